"""Pixel statistics of a PNG with only the standard library (zlib): tests/cli_report.sh checks that a
headless-Chromium screenshot is not blank. Usage: png_stats.py FILE -> "W H nonwhite_fraction colours"."""
import struct, sys, zlib

d = open(sys.argv[1], "rb").read()
assert d[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
i, idat, w = 8, b"", None
while i < len(d):
    (n,) = struct.unpack(">I", d[i:i + 4])
    t = d[i + 4:i + 8]
    body = d[i + 8:i + 8 + n]
    if t == b"IHDR":
        w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
        assert depth == 8 and ctype in (2, 6) and interlace == 0, "unsupported PNG %d/%d/%d" % (depth, ctype, interlace)
        bpp = 3 if ctype == 2 else 4
    elif t == b"IDAT":
        idat += body
    i += 12 + n
raw = zlib.decompress(idat)
stride = w * bpp
prev = bytearray(stride)
pos = 0
nonwhite = 0
colours = set()
for y in range(h):
    f = raw[pos]
    line = bytearray(raw[pos + 1:pos + 1 + stride])
    pos += 1 + stride
    for x in range(stride):
        a = line[x - bpp] if x >= bpp else 0
        b = prev[x]
        c = prev[x - bpp] if x >= bpp else 0
        if f == 1:
            line[x] = (line[x] + a) & 255
        elif f == 2:
            line[x] = (line[x] + b) & 255
        elif f == 3:
            line[x] = (line[x] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[x] = (line[x] + (a if pa <= pb and pa <= pc else (b if pb <= pc else c))) & 255
    for x in range(0, stride, bpp):
        px = bytes(line[x:x + 3])
        if px != b"\xff\xff\xff":
            nonwhite += 1
        if len(colours) < 10000:
            colours.add(px)
    prev = line
print(w, h, "%.4f" % (nonwhite / float(w * h)), len(colours))
