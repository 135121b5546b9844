#!/usr/bin/env bash
# Streamed online tokenization (data.tokenizer with data.stream = true, the default; docs/DATA.md):
# one rank streaming two shards (gzip and zstd) reads exactly the stream `tera data prepare` writes
# (bit-identical training); 1 and 2 workers give the same run; dp 2 gives each rank its own shard;
# a resumed run (dp 2; and dp 1 resumed under pp 2, a layout change that keeps dp) is bit-identical to
# the uninterrupted one; a dp change on resume, too few shards, evaluation, a missing tokenizer, an
# empty shard list and a bad line met while training are refused with one clear message. A separate
# validation set (data.val_path) evaluates a streamed run exactly as it evaluates the prepared stream.
# Throughput and memory figures: bench/online_tokenize.sh (not timed here).
# Usage: cli_stream.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"

"$TERA" tokenizer train --input "$W/c.txt" --vocab-size 512 --output "$W/tok" > /dev/null 2>&1 || fail "tokenizer train"
mkdir -p "$W/sh" "$W/texts"
# two JSON-lines shards of paragraphs: s0 (6 short paragraphs, so that one rank crosses into s1 and a dp 2
# run wraps around s0) gzip-compressed, s1 zstd-compressed (plain without zstd)
awk -v d="$W" 'BEGIN { RS = ""; n = 0 }
     { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, "\\t"); gsub(/\n/, "\\n")
       printf "{\"text\": \"%s\", \"id\": %d}\n", $0, n > (d "/sh/s" (n < 6 ? 0 : 1) ".jsonl"); n++ }' "$W/c.txt"
cp "$W/sh/s0.jsonl" "$W/s0.jsonl"
cp "$W/sh/s1.jsonl" "$W/s1.jsonl"
gzip "$W/sh/s0.jsonl"
if command -v zstd > /dev/null; then zstd -q --rm "$W/sh/s1.jsonl" -o "$W/sh/s1.jsonl.zst"; fi
ls "$W/sh" | tr '\n' ' '
echo
"$TERA" data prepare --input "$W/s0.jsonl" "$W/s1.jsonl" --tokenizer "$W/tok" --output "$W/prep" > /dev/null 2>&1 \
    || fail "prepare"

NOD=() # the tiny model without its data.path and validation split
for a in "${MODEL[@]}"; do case $a in --data.path=* | --data.val_fraction=*) ;; *) NOD+=("$a") ;; esac; done
M=("${NOD[@]}" --model.vocab_size=512 --training.steps=6 --training.micro_batch=2 --training.grad_accum=2
   --checkpoint.every=3)
ON=(--data.path="$W/sh" --data.tokenizer="$W/tok")
final() { echo "$W/$1/checkpoints/step_00000006/model.safetensors"; }
same() { # same A B: identical step records and final weights
    [ "$(last_fields "$W/$1/metrics.jsonl" step loss grad_norm)" = "$(last_fields "$W/$2/metrics.jsonl" step loss grad_norm)" ] &&
        cmp -s "$(final "$1")" "$(final "$2")"
}
run() { # run NAME ARGS...: tera train into $W/NAME
    local n=$1
    shift
    "$TERA" train "${M[@]}" "$@" --logging.run_dir="$W/$n" > "$W/$n.log" 2>&1 || { fail "$n"; tail -5 "$W/$n.log"; }
}

# one rank streams both shards in order: the prepared stream, bit for bit
run prep-run --data.path="$W/prep"
run on "${ON[@]}"
grep "tera: streaming" "$W/on.log"
jq -e '.data.stream.ranks[0].shard == 1 and .data.stream.ranks[0].epoch == 0' \
    "$W/on/checkpoints/step_00000006/state.json" > /dev/null || fail "dp 1 did not reach the second shard"
grep -q "2 shard(s) over 1 data-parallel rank" "$W/on.log" && same prep-run on \
    && pass "dp 1 streaming (gzip + zstd shards) = prepare + train, bit for bit" || fail "streaming differs from prepared"
run on1 "${ON[@]}" --data.tokenize_workers=1
run on3 "${ON[@]}" --data.tokenize_workers=3 --data.prefetch=0
same on on1 && same on on3 && pass "1, 2 and 3 workers (and no prefetch): the same run" || fail "workers change the run"
# a directory of text files (one document each, ~200 tokens: a run crosses several)
split -l 20 -a 3 -d "$W/c.txt" "$W/texts/part"
"$TERA" data prepare --input "$W/texts/"* --tokenizer "$W/tok" --output "$W/prept" > /dev/null 2>&1 || fail "prepare text"
run prept-run --data.path="$W/prept"
run ont --data.path="$W/texts" --data.tokenizer="$W/tok" --data.format=text
same prept-run ont && pass "streaming a directory of text files = prepare + train, bit for bit" || fail "text differs"

# a separate validation set (data.val_path) evaluates a streamed run: the streamed run with the raw s0 shard
# as its validation set equals prepare + train with the prepared s0 as validation set, step and val_loss alike
"$TERA" data prepare --input "$W/s0.jsonl" --tokenizer "$W/tok" --output "$W/prep0" > /dev/null 2>&1 || fail "prepare s0"
run onv "${ON[@]}" --data.val_path="$W/s0.jsonl" --training.eval_every=3 --training.eval_batches=2
run prepv --data.path="$W/prep" --data.val_path="$W/prep0" --training.eval_every=3 --training.eval_batches=2
vals() { jq -r 'select(.val_loss != null) | "\(.step) \(.val_loss)"' "$W/$1/metrics.jsonl"; }
[ "$(vals onv | wc -l)" = 2 ] && [ "$(vals onv)" = "$(vals prepv)" ] && same on onv && same prepv on \
    && pass "streamed run evaluated on data.val_path: both evaluations (step val_loss) = the prepared set's ($(vals onv | tr '\n' ' '))" \
    || fail "val_path: $(vals onv | tr '\n' ' ') vs $(vals prepv | tr '\n' ' ')"

# dp 2: rank r streams shard r; its state names both ranks' positions
$MPIRUN -np 2 "$TERA" train "${M[@]}" "${ON[@]}" --parallel.dp=2 --training.grad_accum=1 --logging.run_dir="$W/dp2" \
    > "$W/dp2.log" 2>&1 || { fail "dp2"; tail -5 "$W/dp2.log"; }
S3="$W/dp2/checkpoints/step_00000003/state.json"
jq -e '.data.stream.dp == 2 and (.data.stream.ranks | length) == 2 and (.data.stream.ranks[0].shard_file | test("s0"))
       and (.data.stream.ranks[1].shard_file | test("s1")) and .data.stream.ranks[0].sample == 6
       and .data.stream.ranks[1].sample == 6' "$S3" > /dev/null \
    && pass "dp 2: each rank streams its own shard, both positions in state.json" || fail "dp2 state: $(jq -c .data "$S3")"
jq -e '.data.stream.ranks[0].epoch >= 1 and .data.stream.ranks[1].epoch == 0' \
    "$W/dp2/checkpoints/step_00000006/state.json" > /dev/null || fail "dp 2: rank 0 did not wrap around its shard"
! cmp -s "$(final on)" "$(final dp2)" && pass "dp 2 reads other samples than dp 1 (its own shards)" || fail "dp2 = dp1"

# resume bit-identical: dp 2 from step 3
cp -r "$W/dp2" "$W/dp2r"
rm -rf "$W/dp2r/checkpoints/step_00000006"
# (no read-ahead: the first sample asked for is the checkpoint's, so the producer starts at its byte offset)
$MPIRUN -np 2 "$TERA" train "${M[@]}" "${ON[@]}" --parallel.dp=2 --training.grad_accum=1 --logging.run_dir="$W/dp2r" \
    --data.prefetch=0 --resume > "$W/dp2r.log" 2>&1 && grep -q "resumed .* at step 3" "$W/dp2r.log" \
    || { fail "dp2 resume"; tail -5 "$W/dp2r.log"; }
grep -q "1 start(s) at a checkpoint's position" "$W/dp2r.log" || fail "dp2 resume: $(grep "streaming tok" "$W/dp2r.log")"
same dp2 dp2r && pass "dp 2 streaming resumed at step 3: bit-identical to the uninterrupted run" || fail "dp2 resume differs"

# a layout change that keeps dp: the dp 1 run resumed under pp 2 (pp is bit-identical to one rank)
cp -r "$W/on" "$W/pp2r"
rm -rf "$W/pp2r/checkpoints/step_00000006"
$MPIRUN -np 2 "$TERA" train "${M[@]}" "${ON[@]}" --parallel.pp=2 --logging.run_dir="$W/pp2r" --resume \
    > "$W/pp2r.log" 2>&1 && grep -q "resumed .* at step 3" "$W/pp2r.log" || { fail "pp2 resume"; tail -5 "$W/pp2r.log"; }
grep -q "1 start(s) at a checkpoint's position" "$W/pp2r.log" || fail "pp2 resume: $(grep "streaming tok" "$W/pp2r.log")"
same on pp2r && pass "dp 1 streaming resumed under pp 2: bit-identical" || fail "pp2 resume differs"

# a dp change on resume is refused
cp -r "$W/on" "$W/dpch"
if $MPIRUN -np 2 "$TERA" train "${M[@]}" "${ON[@]}" --parallel.dp=2 --training.grad_accum=1 --logging.run_dir="$W/dpch" \
    --resume > "$W/dpch.log" 2>&1; then fail "dp change accepted"
else grep -q "streamed its shards over parallel.dp = 1 data-parallel ranks" "$W/dpch.log" \
    && pass "resume under another dp: refused naming both degrees" || fail "dp change: $(grep error "$W/dpch.log")"; fi

# refusals: one clear message each
bad() { # bad MESSAGE-PART ARGS...
    if "$TERA" train "${NOD[@]}" --model.vocab_size=512 --training.steps=2 --training.warmup_steps=0 "${@:2}" \
        --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1; then fail "accepted: ${*:2}"
    else grep -q "$1" "$W/bad.log" && [ "$(grep -c "tera: error" "$W/bad.log")" = 1 ] && pass "refused: $1" \
        || fail "message for ${*:2}: $(cat "$W/bad.log")"; fi
}
bad "no-such-tok" --data.path="$W/sh" --data.tokenizer="$W/no-such-tok"
bad "matches no file" --data.path="$W/nothing/*.jsonl" --data.tokenizer="$W/tok"
bad "keeps no validation split" "${ON[@]}" --training.eval_every=2 --data.val_fraction=0.1
bad "training.eval_every = 2: streamed" "${ON[@]}" --training.eval_every=2
bad "data.val_path = '$W/s0.jsonl' and data.val_fraction = 0.1 are both set" "${ON[@]}" --data.val_path="$W/s0.jsonl" \
    --data.val_fraction=0.1
bad "data.val_path '$W/nothing/\*.jsonl' matches no file" "${ON[@]}" --data.val_path="$W/nothing/*.jsonl"
bad "data.val_path = '$W/prep0' with a blend" --data.paths="1 $W/prep" --data.val_path="$W/prep0"
mkdir -p "$W/one"
cp "$W/s0.jsonl" "$W/one/"
if $MPIRUN -np 2 "$TERA" train "${NOD[@]}" --model.vocab_size=512 --training.steps=2 --parallel.dp=2 \
    --data.path="$W/one" --data.tokenizer="$W/tok" --logging.run_dir="$W/bad2" > "$W/bad2.log" 2>&1; then fail "dp 2 on 1 shard"
else grep -q "1 shard(s) for parallel.dp = 2" "$W/bad2.log" && pass "dp 2 on one shard: refused" \
    || fail "dp > shards: $(grep error "$W/bad2.log")"; fi
mkdir -p "$W/broken"
{ head -n 40 "$W/s1.jsonl"; printf '{"text": broken\n'; } > "$W/broken/b.jsonl"
bad "b.jsonl:41: invalid JSON" --data.path="$W/broken" --data.tokenizer="$W/tok" --training.steps=40
rm -rf "$W/bad" # (the refusal above came after the run directory was set up)
{ head -n 40 "$W/s1.jsonl"; printf '{"text": "a"}{"text": "b"}\n'; } > "$W/broken/b.jsonl"
bad "b.jsonl:41: more than one JSON value on the line" --data.path="$W/broken" --data.tokenizer="$W/tok" --training.steps=40
finish cli_stream
