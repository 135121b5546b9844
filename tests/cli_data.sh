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
"$TERA" train --data.path="$W/ds" --model.vocab_size=400 --model.dim=32 --model.n_layers=2 --model.n_heads=4 \
    --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32 --training.micro_batch=4 --training.steps=30 \
    --training.warmup_steps=2 --logging.run_dir="$W/run" > "$W/train.log" 2>&1 && pass "train on the prepared dataset" \
    || { fail "train on dataset"; cat "$W/train.log"; }
first=$(head -1 "$W/run/metrics.jsonl" | sed 's/.*"loss": \([0-9.e+-]*\),.*/\1/')
last=$(tail -1 "$W/run/metrics.jsonl" | sed 's/.*"loss": \([0-9.e+-]*\),.*/\1/')
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
    printf '{"text": "ok"}\n{"text": "bad \xff byte"}\n' > "$W/utf.jsonl"
    expect_error "invalid UTF-8" "utf.jsonl:2.*offset" "$TERA" data prepare --input "$W/utf.jsonl" --tokenizer "$GPT2" --output "$W/j4"
    [ ! -e "$W/j2.idx" ] && [ ! -e "$W/j3.bin" ] && [ ! -e "$W/j4.bin.tmp" ] && pass "failed prepares leave nothing" || fail "leftovers: $(ls "$W")"
else
    echo "skip: ../shared/data/gpt2 absent"
fi
: > "$W/empty.txt"
expect_error "empty input" "empty.txt" "$TERA" data prepare --input "$W/empty.txt" --output "$W/e"
expect_error "missing input" "nope.txt" "$TERA" data prepare --input "$W/nope.txt" --output "$W/e"
expect_error "existing dataset" "already exists" "$TERA" data prepare --input "$W/corpus.txt" --tokenizer "$W/tok" --output "$W/ds"
expect_error "missing tokenizer" "notok" "$TERA" data prepare --input "$W/corpus.txt" --tokenizer "$W/notok" --output "$W/x"

# 3. a changed byte in the .bin is caught by the checksum at open
cp "$W/ds.bin" "$W/ds.bin.orig"
printf '\x01' | dd of="$W/ds.bin" bs=1 seek=100 conv=notrunc 2>/dev/null
expect_error "corrupted .bin" "ds.bin: checksum mismatch" "$TERA" train --data.path="$W/ds" --model.vocab_size=400 --logging.run_dir="$W/r9"
cp "$W/ds.bin.orig" "$W/ds.bin"

echo "cli_data: $fails failed"
[ "$fails" = 0 ]
