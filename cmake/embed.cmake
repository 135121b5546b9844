# Turn a file into a C array: tera_default_corpus / tera_default_corpus_len.
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
file(WRITE ${OUT} "/* generated from ${IN} */\n#include <stddef.h>\nconst unsigned char tera_default_corpus[] = {${body}0};\nconst size_t tera_default_corpus_len = ${len};\n")
