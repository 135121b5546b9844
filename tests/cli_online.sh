#!/usr/bin/env bash
# Online tokenization (data.tokenizer = DIR, data.format = text | jsonl | auto) with data.stream = false:
# raw shards (a glob, a directory, gzip *.gz and zstd *.zst) are encoded at start-up by worker threads into the token stream
# `tera data prepare` writes for the same files, so training on them is bit-identical to preparing
# then training; 1 and 2 workers give the same stream; dp 2 trains as one rank; pp 2 (two ranks
# sharing the encoding) bit for bit; a resumed run is
# bit-identical to the uninterrupted one; bad input is refused naming the file and line.
# Throughput figures: bench/online_tokenize.sh (not timed here).
# Usage: cli_online.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"

"$TERA" tokenizer train --input "$W/c.txt" --vocab-size 512 --output "$W/tok" > /dev/null 2>&1 || fail "tokenizer train"
mkdir -p "$W/shards" "$W/texts"
# three JSON-lines shards of paragraphs (the last zstd-compressed when zstd is installed), and the
# same paragraphs as text files of 40 paragraphs each
awk -v d="$W" 'BEGIN { RS = ""; n = 0 }
     { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, "\\t"); gsub(/\n/, "\\n")
       printf "{\"text\": \"%s\", \"id\": %d}\n", $0, n > (d "/shards/s" int(n / 150) ".jsonl"); n++ }' "$W/c.txt"
for i in 0 1 2; do [ -f "$W/shards/s$i.jsonl" ] || fail "shard $i missing"; done
cp "$W/shards/s2.jsonl" "$W/s2.jsonl"
cp "$W/shards/s1.jsonl" "$W/s1.jsonl"
if command -v zstd > /dev/null; then zstd -q --rm "$W/shards/s2.jsonl" -o "$W/shards/s2.jsonl.zst"; fi
gzip "$W/shards/s1.jsonl" # -> s1.jsonl.gz
split -l 300 -d "$W/c.txt" "$W/texts/part"
"$TERA" data prepare --input "$W/shards/s0.jsonl" "$W/s1.jsonl" "$W/s2.jsonl" --tokenizer "$W/tok" \
    --output "$W/prep" > /dev/null 2>&1 || fail "prepare jsonl"
"$TERA" data prepare --input "$W/texts/"* --tokenizer "$W/tok" --output "$W/prept" > /dev/null 2>&1 || fail "prepare text"

NOD=() # the tiny model without its data.path
for a in "${MODEL[@]}"; do case $a in --data.path=*) ;; *) NOD+=("$a") ;; esac; done
NOD+=(--data.stream=false) # the start-up pass (streaming, the default: tests/cli_stream.sh)
M=("${NOD[@]}" --model.vocab_size=512 --training.steps=6 --training.micro_batch=2 --training.grad_accum=2
   --training.eval_every=3 --checkpoint.every=3)
ON=(--data.path="$W/shards/s*" --data.tokenizer="$W/tok")
same() { # same A B: identical losses, grad norms, validation losses and final weights
    [ "$(grep -o '"\(loss\|grad_norm\|val_loss\)": [^,}]*' "$W/$1/metrics.jsonl")" = \
      "$(grep -o '"\(loss\|grad_norm\|val_loss\)": [^,}]*' "$W/$2/metrics.jsonl")" ] &&
        cmp -s "$W/$1/checkpoints/step_00000006/model.safetensors" "$W/$2/checkpoints/step_00000006/model.safetensors"
}
"$TERA" train "${M[@]}" --data.path="$W/prep" --logging.run_dir="$W/prep-run" > "$W/p.log" 2>&1 || { fail "prepared"; tail -3 "$W/p.log"; }
"$TERA" train "${M[@]}" "${ON[@]}" --logging.run_dir="$W/on" > "$W/on.log" 2>&1 || { fail "online"; tail -3 "$W/on.log"; }
grep "tera: online tokenization" "$W/on.log"
grep -q "from 3 shard(s)" "$W/on.log" && pass "three shards read" || fail "shards: $(grep online "$W/on.log")"
same prep-run on && pass "online (glob of jsonl shards: plain, gzip, zstd) = prepare + train, bit for bit" || fail "online differs from prepared"
"$TERA" train "${M[@]}" "${ON[@]}" --data.tokenize_workers=1 --logging.run_dir="$W/on1" > /dev/null 2>&1 || fail "1 worker"
same on on1 && pass "1 and 2 workers: the same run" || fail "workers change the run"
"$TERA" train "${M[@]}" --data.path="$W/prept" --logging.run_dir="$W/prept-run" > /dev/null 2>&1 || fail "prepared text"
"$TERA" train "${M[@]}" --data.path="$W/texts" --data.tokenizer="$W/tok" --data.format=text --logging.run_dir="$W/ont" \
    > /dev/null 2>&1 || fail "online text directory"
same prept-run ont && pass "online (a directory of text files) = prepare + train, bit for bit" || fail "online text differs"

# dp 2 = one rank
$MPIRUN -np 2 "$TERA" train "${M[@]}" "${ON[@]}" --training.grad_accum=1 --parallel.dp=2 --logging.run_dir="$W/dp2" \
    > "$W/dp2.log" 2>&1 || { fail "online dp2"; tail -3 "$W/dp2.log"; }
compare_steps "$W/on/metrics.jsonl" "$W/dp2/metrics.jsonl" "$LAYOUT_TOL" && pass "online dp2 trains as one rank" || fail "dp2"

# pp 2: the two ranks encode half the documents each and exchange them: bit-identical to one rank
$MPIRUN -np 2 "$TERA" train "${M[@]}" "${ON[@]}" --parallel.pp=2 --logging.run_dir="$W/pp2" > "$W/pp2.log" 2>&1 \
    || { fail "online pp2"; tail -3 "$W/pp2.log"; }
grep -q "x 2 rank(s)" "$W/pp2.log" && same on pp2 && pass "online pp2 (encoding shared by 2 ranks) = one rank, bit for bit" \
    || fail "online pp2: $(grep online "$W/pp2.log")"
# a document only the second rank encodes fails: both ranks stop with its message
mkdir -p "$W/badu"
printf 'hello world\n' > "$W/badu/a.txt"
printf 'ok \xff\xfe bad\n' > "$W/badu/b.txt"
if $MPIRUN -np 2 "$TERA" train "${NOD[@]}" --model.vocab_size=512 --training.steps=2 --training.seq_len=2 \
    --training.micro_batch=1 --parallel.pp=2 --data.path="$W/badu" --data.tokenizer="$W/tok" --data.format=text \
    --logging.run_dir="$W/badu-run" > "$W/badu.log" 2>&1; then fail "invalid UTF-8 accepted under 2 ranks"
else grep -q "badu/b.txt': tokenizer: invalid UTF-8 at byte offset 3" "$W/badu.log" \
    && pass "invalid UTF-8 in the second rank's share: refused naming the file and offset" || fail "$(cat "$W/badu.log")"; fi

# resume from step 3
cp -r "$W/on" "$W/res"
rm -rf "$W/res/checkpoints/step_00000006"
"$TERA" train "${M[@]}" "${ON[@]}" --logging.run_dir="$W/res" --resume > "$W/res.log" 2>&1 \
    && grep -q "resumed .* at step 3" "$W/res.log" || { fail "resume"; tail -3 "$W/res.log"; }
cmp -s "$W/on/checkpoints/step_00000006/model.safetensors" "$W/res/checkpoints/step_00000006/model.safetensors" \
    && [ "$(last_fields "$W/on/metrics.jsonl" step loss grad_norm)" = "$(last_fields "$W/res/metrics.jsonl" step loss grad_norm)" ] \
    && pass "resumed online run bit-identical to the uninterrupted one" || fail "resumed online run differs"

# a blend of a prepared prefix and a raw shard tokenized online (data.tokenizer applies to raw paths)
"$TERA" train "${M[@]}" --data.paths="0.5 $W/prep, 0.5 $W/shards/s0.jsonl" --data.tokenizer="$W/tok" \
    --logging.run_dir="$W/mixed" > "$W/mixed.log" 2>&1 || { fail "mixed blend"; tail -3 "$W/mixed.log"; }
jq -e -s '[.[] | select(.val_loss_prep != null and .val_loss_s0_jsonl != null)] | length == 2' "$W/mixed/metrics.jsonl" \
    > /dev/null && pass "blend of a prepared prefix and a raw shard: both validation losses" || fail "mixed blend metrics"

# refusals name the file (and line)
bad() { # bad MESSAGE-PART ARGS...
    if "$TERA" train "${NOD[@]}" --model.vocab_size=512 --training.steps=2 --training.warmup_steps=0 "${@:2}" \
        --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1; then fail "accepted: ${*:2}"
    else grep -q "$1" "$W/bad.log" && pass "refused: $1" || fail "message for ${*:2}: $(cat "$W/bad.log")"; fi
}
mkdir -p "$W/broken"
printf '{"text": "fine"}\n{"text": broken\n' > "$W/broken/b.jsonl"
bad "b.jsonl:2: invalid JSON" --data.path="$W/broken/b.jsonl" --data.tokenizer="$W/tok"
printf '{"text": "one"}\n{"text": "two"} {"text": "dropped"}\n' > "$W/broken/t.jsonl"
bad "t.jsonl:2: more than one JSON value on the line" --data.path="$W/broken/t.jsonl" --data.tokenizer="$W/tok"
printf '{"body": "no text"}\n' > "$W/broken/c.jsonl"
bad "c.jsonl:1: no string field" --data.path="$W/broken/c.jsonl" --data.tokenizer="$W/tok"
bad "matches no file" --data.path="$W/nothing/*.jsonl" --data.tokenizer="$W/tok"
bad "has 512 tokens but model.vocab_size = 300" --data.path="$W/shards/s*" --data.tokenizer="$W/tok" --model.vocab_size=300
bad "data.format must be text, jsonl or auto" --data.path="$W/shards/s*" --data.tokenizer="$W/tok" --data.format=bin
printf 'not gzip' > "$W/broken/e.jsonl.gz"
bad "e.jsonl.gz' is not a complete gzip stream" --data.path="$W/broken/e.jsonl.gz" --data.tokenizer="$W/tok"
head -c 2000 "$W/shards/s0.jsonl" | gzip | head -c 600 > "$W/broken/f.jsonl.gz"
bad "f.jsonl.gz' is not a complete gzip stream" --data.path="$W/broken/f.jsonl.gz" --data.tokenizer="$W/tok"
printf 'not zstd' > "$W/broken/d.jsonl.zst"
bad "d.jsonl.zst' is not a complete zstd stream" --data.path="$W/broken/d.jsonl.zst" --data.tokenizer="$W/tok"
finish cli_online
