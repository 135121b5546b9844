#!/usr/bin/env bash
# The data pipeline through the command line: tokenizer training, dataset preparation (text and
# JSON lines), checksums checked at open, bad input. Usage: cli_data.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
GPT2="$SRC/../shared/data/gpt2"
. "$(dirname "$0")/testlib.sh"
expect_error() { # NAME PATTERN command...
    local name=$1 pat=$2
    shift 2
    "$@" > "$W/out" 2> "$W/err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 128 ]; then fail "$name: exit $rc"; cat "$W/err"; return; fi
    grep -q -- "$pat" "$W/err" && pass "$name: $(grep 'error' "$W/err" | head -1)" || { fail "$name: no '$pat' in: $(cat "$W/err")"; }
}

head -c 40000 "$SRC/data/default_corpus.txt" > "$W/corpus.txt"
# 1. train a small BPE vocabulary, prepare the corpus with it, train a model on the dataset
"$TERA" tokenizer train --input "$W/corpus.txt" --vocab-size 400 --output "$W/tok" > "$W/tt.log" 2>&1 \
    && [ -f "$W/tok/encoder.json" ] && [ -f "$W/tok/vocab.bpe" ] && pass "tokenizer train" || { fail "tokenizer train"; cat "$W/tt.log"; }
"$TERA" data prepare --input "$W/corpus.txt" --tokenizer "$W/tok" --output "$W/ds" > "$W/dp.log" 2>&1 \
    && [ -f "$W/ds.bin" ] && [ -f "$W/ds.idx" ] && [ -f "$W/ds.xxh3" ] && pass "data prepare" || { fail "data prepare"; cat "$W/dp.log"; }
printf 'To be, or not to be' | "$TERA" tokenizer encode --tokenizer "$W/tok" > "$W/ids.txt" 2>&1 \
    && [ "$("$TERA" tokenizer decode --tokenizer "$W/tok" < "$W/ids.txt")" = "To be, or not to be" ] \
    && pass "encode/decode round trip" || fail "encode/decode: $(cat "$W/ids.txt")"
# --tokenizer bytes (as data prepare and generate take it): each byte its own id, both ways
[ "$(printf 'h\303\251' | "$TERA" tokenizer encode --tokenizer bytes)" = "104 195 169" ] \
    && [ "$(echo 104 195 169 | "$TERA" tokenizer decode --tokenizer bytes)" = "$(printf 'h\303\251')" ] \
    && pass "encode/decode --tokenizer bytes" || fail "encode/decode --tokenizer bytes"
"$TERA" train --data.path="$W/ds" --model.vocab_size=400 --model.dim=32 --model.n_layers=2 --model.n_heads=4 \
    --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32 --training.micro_batch=4 --training.steps=30 \
    --training.warmup_steps=2 --logging.run_dir="$W/run" > "$W/train.log" 2>&1 && pass "train on the prepared dataset" \
    || { fail "train on dataset"; cat "$W/train.log"; }
first=$(steps_of "$W/run/metrics.jsonl" | head -1 | cut -d" " -f2)
last=$(steps_of "$W/run/metrics.jsonl" | tail -1 | cut -d" " -f2)
awk -v a="$first" -v b="$last" 'BEGIN{exit !(b < a - 0.5)}' && pass "loss falls on BPE tokens ($first -> $last)" || fail "loss $first -> $last"

# 2. JSON lines with GPT-2's tokenizer: document boundaries get <|endoftext|> (50256)
if [ -f "$GPT2/encoder.json" ]; then
    printf '{"text": "Hello world"}\n\n{"text": "caf\\u00e9 2024", "id": 7}\n' > "$W/docs.jsonl"
    "$TERA" data prepare --input "$W/docs.jsonl" --tokenizer "$GPT2" --output "$W/j" > "$W/j.log" 2>&1 || { fail "jsonl prepare"; cat "$W/j.log"; }
    grep -q "2 documents" "$W/j.log" && pass "jsonl: 2 documents (blank line skipped)" || fail "jsonl: $(cat "$W/j.log")"
    want="$(printf 'Hello world' | "$TERA" tokenizer encode --tokenizer "$GPT2") 50256 $(printf 'café 2024' | "$TERA" tokenizer encode --tokenizer "$GPT2") 50256"
    got=$(od -An -v -tu2 -w1000 "$W/j.bin" | tr -s ' ' | sed 's/^ //; s/ $//')
    [ "$got" = "$want" ] && pass "jsonl tokens + end-of-document ($got)" || fail "jsonl tokens: got '$got' want '$want'"
    expect_error "missing field" "docs.jsonl:1: no string field \"body\"" "$TERA" data prepare --input "$W/docs.jsonl" --tokenizer "$GPT2" --output "$W/j2" --field body
    printf '{"text": "fine"}\n{"text": oops}\n' > "$W/bad.jsonl"
    expect_error "invalid JSON" "bad.jsonl:2" "$TERA" data prepare --input "$W/bad.jsonl" --tokenizer "$GPT2" --output "$W/j3"
    printf '{"text": "a"} {"text": "b"}\n' > "$W/two.jsonl" # cJSON alone stopped after the first object
    expect_error "two objects on a line" "two.jsonl:1: not a valid JSON object: more than one JSON value" "$TERA" data prepare --input "$W/two.jsonl" --tokenizer "$GPT2" --output "$W/j5"
    printf '{"text": "a"} \r\n' > "$W/crlf.jsonl"
    "$TERA" data prepare --input "$W/crlf.jsonl" --tokenizer "$GPT2" --output "$W/j6" > /dev/null 2>&1 && pass "jsonl: trailing blanks and CR accepted" || fail "jsonl with CRLF refused"
    printf '{"text": "ok"}\n{"text": "bad \xff byte"}\n' > "$W/utf.jsonl"
    expect_error "invalid UTF-8" "utf.jsonl:2.*offset" "$TERA" data prepare --input "$W/utf.jsonl" --tokenizer "$GPT2" --output "$W/j4"
    [ ! -e "$W/j2.idx" ] && [ ! -e "$W/j3.bin" ] && [ ! -e "$W/j4.bin.tmp" ] && [ ! -e "$W/j5.bin" ] && pass "failed prepares leave nothing" || fail "leftovers: $(ls "$W")"
else
    echo "skip: ../shared/data/gpt2 absent"
fi
: > "$W/empty.txt"
expect_error "empty input" "empty.txt" "$TERA" data prepare --input "$W/empty.txt" --output "$W/e"
expect_error "missing input" "nope.txt" "$TERA" data prepare --input "$W/nope.txt" --output "$W/e"
expect_error "existing dataset" "already exists" "$TERA" data prepare --input "$W/corpus.txt" --tokenizer "$W/tok" --output "$W/ds"
# a lone .bin (another file, or the input itself) and a lone vocab.bpe are refused too, and kept
echo precious > "$W/lone.bin"
expect_error "existing .bin" "lone.bin' already exists" "$TERA" data prepare --input "$W/corpus.txt" --output "$W/lone"
mkdir -p "$W/lonetok" && echo precious > "$W/lonetok/vocab.bpe"
expect_error "existing vocab.bpe" "vocab.bpe' already exists" "$TERA" tokenizer train --input "$W/corpus.txt" --vocab-size 300 --output "$W/lonetok"
[ "$(cat "$W/lone.bin")" = precious ] && [ "$(cat "$W/lonetok/vocab.bpe")" = precious ] && [ ! -e "$W/lone.idx" ] \
    && pass "a refused prepare or tokenizer train leaves the existing files as they were" || fail "existing files changed"
expect_error "missing tokenizer" "notok" "$TERA" data prepare --input "$W/corpus.txt" --tokenizer "$W/notok" --output "$W/x"

# 3. several files after one --input (as the usage line says) = one --input per file; the
#    progress bar ends at 100%; empty documents are skipped with a warning, .txt and JSONL alike
bin_ids() { od -An -v -tu2 -w1000000 "$1.bin" | tr -s ' ' | sed 's/^ //; s/ $//'; }
head -c 3000 "$W/corpus.txt" > "$W/part1.txt"; tail -c 2000 "$W/corpus.txt" > "$W/part2.txt"
printf '{"text": "first document"}\n{"text": "second one"}\n' > "$W/part3.jsonl"
"$TERA" data prepare --input "$W/part1.txt" "$W/part2.txt" "$W/part3.jsonl" --tokenizer "$W/tok" --output "$W/m1" > "$W/m1.log" 2>&1 \
    && grep -q "4 documents" "$W/m1.log" && pass "--input A B C: 4 documents" || { fail "--input A B C"; cat "$W/m1.log"; }
"$TERA" data prepare --input "$W/part1.txt" --input "$W/part2.txt" --input="$W/part3.jsonl" --tokenizer "$W/tok" --output "$W/m2" > /dev/null 2>&1 \
    && cmp -s "$W/m1.bin" "$W/m2.bin" && cmp -s "$W/m1.idx" "$W/m2.idx" && pass "--input A B C = --input A --input B --input=C" \
    || fail "one --input per file gives another dataset"
"$TERA" data prepare --input "$W/part3.jsonl" --tokenizer "$W/tok" --output "$W/m4" > "$W/m4.log" 2>&1 || fail "prepare part3.jsonl"
last=$(tr '\r' '\n' < "$W/m4.log" | grep '^prepare \[' | tail -1)
case "$last" in *"100.0%"*) pass "progress ends at 100% ($last)" ;; *) fail "progress ends: '$last'" ;; esac
"$TERA" tokenizer train --input "$W/part1.txt" "$W/part2.txt" --vocab-size 300 --output "$W/tok2" > "$W/tt2.log" 2>&1 \
    && [ -f "$W/tok2/vocab.bpe" ] && pass "tokenizer train --input A B" || { fail "tokenizer train --input A B"; cat "$W/tt2.log"; }
: > "$W/blank.txt"
printf '{"text": "first document"}\n{"text": ""}\n{"text": "third"}\n' > "$W/gap.jsonl"
"$TERA" data prepare --input "$W/blank.txt" --input "$W/part1.txt" --input "$W/gap.jsonl" --tokenizer "$W/tok" --output "$W/m3" > "$W/m3.log" 2>&1 \
    && grep -q "3 documents" "$W/m3.log" && grep -q "warning: input '.*blank.txt' is empty; skipped" "$W/m3.log" \
    && grep -q "warning: .*gap.jsonl:2: empty document" "$W/m3.log" && pass "empty .txt and empty JSON document: skipped with a warning" \
    || { fail "empty documents"; cat "$W/m3.log"; }
[ "$(od -An -tu8 -j18 -N8 "$W/m3.idx" | tr -d ' ')" = 3 ] && pass "m3.idx holds 3 documents" || fail "m3.idx document count"
"$TERA" tokenizer train --input "$W/blank.txt" --input "$W/part1.txt" --vocab-size 300 --output "$W/tok3" > "$W/tt3.log" 2>&1 \
    && grep -q "warning: input '.*blank.txt' is empty; skipped" "$W/tt3.log" && pass "tokenizer train: an empty file among others is skipped with a warning" \
    || { fail "tokenizer train with an empty file"; cat "$W/tt3.log"; }

# 4. special-token text: `tokenizer encode` and `data prepare` agree, with and without --allow-special
special_agree() { # NAME TOKENIZER_DIR EOT_ID
    local name=$1 tok=$2 eot=$3 txt='Hello<|endoftext|>world'
    printf '%s' "$txt" > "$W/sp.txt"
    local plain allowed
    plain=$(printf '%s' "$txt" | "$TERA" tokenizer encode --tokenizer "$tok")
    allowed=$(printf '%s' "$txt" | "$TERA" tokenizer encode --tokenizer "$tok" --allow-special)
    rm -f "$W"/sp1.* "$W"/sp2.*
    "$TERA" data prepare --input "$W/sp.txt" --tokenizer "$tok" --output "$W/sp1" > /dev/null 2>&1 || fail "$name: prepare"
    "$TERA" data prepare --input "$W/sp.txt" --tokenizer "$tok" --output "$W/sp2" --allow-special > /dev/null 2>&1 || fail "$name: prepare --allow-special"
    [ "$(bin_ids "$W/sp1")" = "$plain $eot" ] && pass "$name: as text by default, both agree ($plain)" \
        || fail "$name: encode '$plain' vs prepare '$(bin_ids "$W/sp1")'"
    case " $plain " in *" $eot "*) fail "$name: default encode maps the text to $eot" ;; esac
    [ "$(bin_ids "$W/sp2")" = "$allowed $eot" ] && pass "$name: --allow-special, both agree ($allowed)" \
        || fail "$name: --allow-special: encode '$allowed' vs prepare '$(bin_ids "$W/sp2")'"
    case " $allowed " in *" $eot "*) ;; *) fail "$name: --allow-special does not map the text to $eot" ;; esac
    [ "$(printf '%s' "$plain" | "$TERA" tokenizer decode --tokenizer "$tok")" = "$txt" ] || fail "$name: decode"
}
special_agree "trained tokenizer" "$W/tok" 399
if [ -f "$GPT2/encoder.json" ]; then special_agree "GPT-2" "$GPT2" 50256; else echo "skip: ../shared/data/gpt2 absent"; fi

# 5. a changed byte in the .bin is caught by the checksum at open
cp "$W/ds.bin" "$W/ds.bin.orig"
printf '\x01' | dd of="$W/ds.bin" bs=1 seek=100 conv=notrunc 2>/dev/null
expect_error "corrupted .bin" "ds.bin: checksum mismatch" "$TERA" train --data.path="$W/ds" --model.vocab_size=400 --logging.run_dir="$W/r9"
cp "$W/ds.bin.orig" "$W/ds.bin"

echo "cli_data: $fails failed"
[ "$fails" = 0 ]
