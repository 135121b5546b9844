#!/usr/bin/env bash
# Dynamic batch size through the command line: the ramp-up's per-step batches and LR, growth on a
# high grad norm, exact data accounting (samples_consumed = the sum of the per-step batches), tokens/s
# of the actual batch, and a resume from mid-ramp-window and after growth that is bit-identical to the
# uninterrupted run. Usage: cli_batch.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
BASE=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32
      --training.micro_batch=2 --training.grad_accum=4 --training.warmup_steps=2 --training.steps=30 --training.threads=2
      --data.path="$W/c.txt" --logging.progress=false --checkpoint.every=10 --checkpoint.keep=0)
# ramp 1 -> 4 micro-batches over 6 steps; then x2 when the mean grad norm of 5 steps exceeds 0.1, up to 16
DYN=(--training.batch_rampup_start=1 --training.batch_rampup_steps=6 --training.batch_grow_gnorm=0.1
     --training.batch_grow_window=5 --training.batch_grow_max=16)
# per step record: "step field" (the last record of a step: a resumed run logs some steps twice)
col() { grep '"loss"' "$1" | grep -v '"event"' | sed "s/^{\"step\": \([0-9]*\),.*\"$2\": \([^,}]*\).*/\1 \2/" \
    | awk '{v[$1]=$2} END {for (s in v) print s, v[s]}' | sort -n; }
consumed() { grep -o '"samples_consumed":[[:space:]]*[0-9]*' "$1/state.json" | grep -o '[0-9]*$'; }

"$TERA" train "${BASE[@]}" "${DYN[@]}" --logging.run_dir="$W/ref" > "$W/ref.log" 2>&1 || { fail "train"; cat "$W/ref.log"; }
M="$W/ref/metrics.jsonl"
b=$(col "$M" batch | head -7 | awk '{printf "%s ", $2}')
[ "$b" = "2 2 4 4 6 6 8 " ] && pass "ramp-up: batches of steps 0-6: $b" || fail "ramp-up batches: $b"
col "$M" accum | head -7 | awk '{printf "%s ", $2}' | grep -q '^1 1 2 2 3 3 4 $' && pass "accum per step logged" || fail "accum"
# LR: sqrt(accum / grad_accum) x the schedule's LR (step 0: accum 1 of 4 -> x 0.5)
"$TERA" train "${BASE[@]}" --training.steps=30 --logging.run_dir="$W/plain" > /dev/null 2>&1 || fail "plain run"
l0=$(col "$M" lr | awk '$1 == 0 {print $2}'); p0=$(col "$W/plain/metrics.jsonl" lr | awk '$1 == 0 {print $2}')
l2=$(col "$M" lr | awk '$1 == 2 {print $2}'); p2=$(col "$W/plain/metrics.jsonl" lr | awk '$1 == 2 {print $2}')
awk -v a="$l0" -v b="$p0" -v c="$l2" -v d="$p2" 'BEGIN { exit !(a / b > 0.4999 && a / b < 0.5001 && c / d > 0.7070 && c / d < 0.7072) }' \
    && pass "LR x sqrt(accum/grad_accum): step 0 $l0 vs $p0, step 2 $l2 vs $p2" || fail "LR rule: $l0/$p0, $l2/$p2"
"$TERA" train "${BASE[@]}" "${DYN[@]}" --training.batch_lr_scaling=none --training.steps=3 --logging.run_dir="$W/none" > /dev/null 2>&1
[ "$(col "$W/none/metrics.jsonl" lr | awk '$1 == 0 {print $2}')" = "$p0" ] && pass "batch_lr_scaling = none keeps the LR" || fail "none"
# growth: an event, and the batch of the following steps is the event's
ev=$(grep '"batch_grow"' "$M" | head -1)
gs=$(echo "$ev" | sed 's/{"step": \([0-9]*\),.*/\1/'); gb=$(echo "$ev" | sed 's/.*"batch": \([0-9]*\).*/\1/')
nb=$(col "$M" batch | awk -v s="$gs" '$1 == s + 1 {print $2}')
[ -n "$ev" ] && [ "$nb" = "$gb" ] && [ "$gb" = 16 ] && grep -q "batch grows to 8 micro-batches" "$W/ref.log" \
    && pass "grad-norm growth at step $gs: batch 8 -> $nb" || fail "growth: '$ev', next batch $nb"
[ "$(col "$M" batch | tail -1 | cut -d' ' -f2)" = 32 ] && pass "growth stops at batch_grow_max (16 x 2 = 32 sequences)" || fail "cap"
# data accounting: the data position of each checkpoint is the sum of the batches before it
for s in 10 20 30; do
    sum=$(col "$M" batch | awk -v s=$s '$1 < s {t += $2} END {print t}')
    c=$(consumed "$W/ref/checkpoints/step_000000$s")
    [ "$sum" = "$c" ] && pass "step $s: samples_consumed $c = sum of the per-step batches" || fail "step $s: consumed $c, batches $sum"
done
grep -q '"grow":	4' "$W/ref/checkpoints/step_00000030/state.json" && pass "growth state in state.json" || fail "state.json batch"
# tokens/s of the actual batch: tokens_per_s x step_s summed = batch x seq_len summed (rounding aside)
paste <(col "$M" tokens_per_s) <(col "$M" step_s) <(col "$M" batch) | awk '{a += $2 * $4; b += $6 * 32} END {r = a / b; exit !(r > 0.9 && r < 1.1)}' \
    && pass "tokens_per_s counts the step's actual batch" || fail "tokens_per_s"

# resume from step 10 (mid grad-norm window, before growth) and from step 20 (after two doublings)
for at in 10 20; do
    R="$W/r$at"
    cp -r "$W/ref" "$R"
    for s in 10 20 30; do [ $s -gt $at ] && rm -rf "$R/checkpoints/step_000000$s"; done
    "$TERA" train "${BASE[@]}" "${DYN[@]}" --logging.run_dir="$R" --resume > "$R.log" 2>&1 || { fail "resume $at"; cat "$R.log"; }
    grep -q "resumed .* at step $at" "$R.log" && cmp -s <(col "$M" loss) <(col "$R/metrics.jsonl" loss) \
        && cmp -s <(col "$M" batch) <(col "$R/metrics.jsonl" batch) \
        && cmp -s "$W/ref/checkpoints/step_00000030/model.safetensors" "$R/checkpoints/step_00000030/model.safetensors" \
        && [ "$(consumed "$R/checkpoints/step_00000030")" = "$(consumed "$W/ref/checkpoints/step_00000030")" ] \
        && pass "resumed at step $at: losses, batches, data position and final weights bit-identical" \
        || fail "resume at $at differs"
done
# two data-parallel ranks of micro_batch 1 take the same batches and samples as one rank of micro_batch 2
if command -v mpirun > /dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" # Open MPI's own allocations (see cli_dist.sh)
    D=(--training.steps=12 --training.batch_rampup_steps=4 --training.batch_grow_window=3 --training.batch_grow_max=8)
    "$TERA" train "${BASE[@]}" "${DYN[@]}" "${D[@]}" --logging.run_dir="$W/dp1" > /dev/null 2>&1
    mpirun --oversubscribe -np 2 "$TERA" train "${BASE[@]}" "${DYN[@]}" "${D[@]}" --training.micro_batch=1 --parallel.dp=2 \
        --training.threads=1 --logging.run_dir="$W/dp2" > "$W/dp2.log" 2>&1 || { fail "dp=2 run"; tail -5 "$W/dp2.log"; }
    cmp -s <(col "$W/dp1/metrics.jsonl" batch) <(col "$W/dp2/metrics.jsonl" batch) && grep -q batch_grow "$W/dp2/metrics.jsonl" \
        && paste <(col "$W/dp1/metrics.jsonl" loss) <(col "$W/dp2/metrics.jsonl" loss) \
           | awk '{d = $2 - $4; if (d < 0) d = -d; if (NF != 4 || d > 2e-5 * $2) bad = 1} END {exit bad || NR != 12}' \
        && pass "dp=2: same per-step batches (ramp and growth) and losses (rel. 2e-5) as one rank" || fail "dp=2 dynamic batch"
fi
finish cli_batch
