#!/usr/bin/env bash
# Data parallelism over MPI: dp=2 and dp=4 train the same model as one rank with the same global
# batch (through gradient accumulation): every step's loss and grad norm, and the final weights
# (through the validation loss of the checkpoints), agree to float32 rounding (relative 2e-6, derived in cli_layouts.sh).
# Usage: cli_dist.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe"
# Under the sanitizer build, Open MPI's own allocations (its plugins are unloaded at finalize, so
# their frames cannot be suppressed by name) show up as leaks: leak checking is off for this test
# only; ASan's memory-error checks stay on, and tera's own leaks are checked by the other tests.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
command -v mpirun > /dev/null || { echo "skip: mpirun not installed"; exit 0; }
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_kv_heads=2 --model.n_experts=4 --model.ffn_dim=32
      --model.capacity_factor=1.25 --model.z_coef=0.001 --model.aux_free=true --training.seq_len=32
      --training.warmup_steps=2 --training.steps=8 --training.threads=1 --data.path="$W/c.txt" --data.val_fraction=0.1 --training.precision=fp32)

# compare two metrics files: loss (field 2) and grad_norm (field 7) of every step
same_steps() { # every step's loss and grad norm, by field name (testlib.sh)
    [ "$(grep -c '"loss"' "$1")" = 8 ] && [ "$(grep -c '"loss"' "$2")" = 8 ] || { echo "expected 8 steps"; return 1; }
    compare_steps "$1" "$2" 2e-6
}
val_loss() { "$TERA" eval --from "$1" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32 \
    --training.micro_batch=4 --training.eval_batches=4 2> /dev/null | sed 's/.*"val_loss": \([0-9.]*\).*/\1/'; }

"$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/one" > "$W/one.log" 2>&1 \
    || { fail "one rank"; cat "$W/one.log"; }
for layout in "2 0" "4 0" "2 1" "4 1"; do
    set -- $layout
    dp=$1 zero=$2
    micro=$((4 / dp))
    $MPIRUN -np $dp "$TERA" train "${TINY[@]}" --training.micro_batch=$micro --parallel.dp=$dp --parallel.zero=$zero \
        --logging.run_dir="$W/dp$dp" > "$W/dp$dp.log" 2>&1 || { fail "dp$dp zero$zero run"; cat "$W/dp$dp.log"; continue; }
    if [ $zero = 1 ]; then
        o1=$(grep -o 'optimizer [0-9.]*' "$W/one.log" | head -1); od=$(grep -o 'optimizer [0-9.]*' "$W/dp$dp.log" | head -1)
        awk -v a="${o1#optimizer }" -v b="${od#optimizer }" -v d=$dp 'BEGIN { exit !(b <= a / d + 0.05) }' \
            && pass "zero1 dp$dp: optimizer state per rank $od MiB (one rank: $o1 MiB)" || fail "zero1 memory: $o1 vs $od"
    fi
    grep -q "$dp data-parallel ranks (mpi)" "$W/dp$dp.log" && pass "dp$dp runs on $dp MPI ranks" || fail "dp$dp banner"
    same_steps "$W/one/metrics.jsonl" "$W/dp$dp/metrics.jsonl" && pass "dp$dp zero$zero: every step's loss and grad norm match one rank" \
        || fail "dp$dp zero$zero losses differ"
    a=$(val_loss "$W/one/checkpoints/step_00000008"); b=$(val_loss "$W/dp$dp/checkpoints/step_00000008")
    awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a > 0 && d <= 2e-6 * a) }' \
        && pass "dp$dp: final weights give the same validation loss ($a vs $b)" || fail "dp$dp final weights: $a vs $b"
    [ "$(ls "$W/dp$dp/checkpoints")" = "step_00000008" ] && pass "dp$dp: one checkpoint, written by rank 0" || fail "dp$dp checkpoints"
    # replicas without ZeRO: rank 0's own storage is the whole model, so it snapshots it like one process
    # (no window-by-window gather over the ranks); with ZeRO the save is streamed to rank 0
    want="[0-9]* streamed saves"
    [ $zero = 0 ] && want="[0-9]* saves ("
    grep -q "tera: checkpoints: $want" "$W/dp$dp.log" && pass "dp$dp zero$zero: save path '$want'" \
        || fail "dp$dp zero$zero save path: $(grep "tera: checkpoints" "$W/dp$dp.log")"
    rm -rf "$W/dp$dp"
done

# exact resume across a change of data-parallel degree: dp=2 saves at step 4; one rank (accumulating
# the same global batch) resumes from it; steps 4..7 and the final weights match the dp=2 run
$MPIRUN -np 2 "$TERA" train "${TINY[@]}" --training.micro_batch=2 --parallel.dp=2 --parallel.zero=1 --checkpoint.every=4 \
    --logging.run_dir="$W/rs" > "$W/rs.log" 2>&1 || { fail "dp2 zero1 run with checkpoints"; cat "$W/rs.log"; }
cp -r "$W/rs" "$W/rs1"
rm -rf "$W/rs1/checkpoints/step_00000008"
head -4 "$W/rs/metrics.jsonl" > "$W/rs1/metrics.jsonl"
"$TERA" train "${TINY[@]}" --training.micro_batch=2 --training.grad_accum=2 --logging.run_dir="$W/rs1" --resume \
    > "$W/rs1.log" 2>&1 && grep -q "resumed .* at step 4" "$W/rs1.log" && pass "dp2 checkpoint resumed on one rank" \
    || { fail "resume on one rank"; cat "$W/rs1.log"; }
same_steps "$W/rs/metrics.jsonl" "$W/rs1/metrics.jsonl" && pass "resume across dp 2 (zero1) -> 1: steps 4..7 match" || fail "resume across dp"
# and the same checkpoint resumed by 4 ranks with ZeRO-1 (each loads its shard of the moments)
cp -r "$W/rs" "$W/rs4"
rm -rf "$W/rs4/checkpoints/step_00000008"
head -4 "$W/rs/metrics.jsonl" > "$W/rs4/metrics.jsonl"
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" --training.micro_batch=1 --parallel.dp=4 --parallel.zero=1 \
    --logging.run_dir="$W/rs4" --resume > "$W/rs4.log" 2>&1 || { fail "resume on dp4 zero1"; cat "$W/rs4.log"; }
same_steps "$W/rs/metrics.jsonl" "$W/rs4/metrics.jsonl" && pass "resume across dp 2 -> 4 with ZeRO-1 shards: steps 4..7 match" \
    || fail "resume dp2 -> dp4 zero1"

# failure: a killed rank stops the job (mpirun names it); a hung rank trips the watchdog of the
# others (parallel.timeout_s) - no hang either way, within a bounded time
for how in KILL STOP; do
    R="$W/fail$how"
    ( $MPIRUN -np 2 "$TERA" train "${TINY[@]}" --training.steps=100000 --training.micro_batch=2 --parallel.dp=2 \
        --parallel.timeout_s=3 --logging.run_dir="$R" > "$R.log" 2>&1; echo "rc=$?" >> "$R.log" ) &
    job=$!
    for i in $(seq 1 100); do [ -s "$R/metrics.jsonl" ] && break; sleep 0.1; done
    victim=$(pgrep -f -- "--logging.run_dir=$R" | tail -1)
    kill -$how "$victim"
    t0=$(date +%s)
    for i in $(seq 1 200); do kill -0 $job 2> /dev/null || break; sleep 0.1; done
    took=$(( $(date +%s) - t0 ))
    if kill -0 $job 2> /dev/null; then
        fail "SIG$how of a rank: job still running after 20 s"
        pkill -9 -f -- "--logging.run_dir=$R"
    else
        if [ $how = KILL ]; then pat="exited on signal 9"; else pat="made no progress for 3 s: a peer rank stopped answering"; fi
        grep -q "$pat" "$R.log" && ! grep -q "rc=0" "$R.log" && pass "SIG$how of a rank: job stopped in ${took}s ($pat)" \
            || { fail "SIG$how: $(tail -5 "$R.log")"; }
    fi
    pkill -9 -f -- "--logging.run_dir=$R" 2> /dev/null
done

# a layout that does not match the ranks is refused on every rank before any work
if $MPIRUN -np 2 "$TERA" train "${TINY[@]}" --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1; then
    fail "dp=1 on 2 ranks accepted"
else
    grep -q "parallel.dp = 1 but 2 ranks are running" "$W/bad.log" && pass "mismatched dp refused" || fail "message: $(cat "$W/bad.log")"
fi
echo "cli_dist: $fails failed"
[ "$fails" = 0 ]
