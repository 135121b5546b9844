#!/usr/bin/env bash
# The timeline (logging.trace, src/obs/trace.c): a Chrome trace-event JSON file of the steps in
# logging.trace_steps. One rank: valid JSON with the required fields, only the window's steps, events
# ordered and properly nested on every thread, the compute, checkpoint-writer and data-prefetcher
# threads present, forward/backward, profiled operations, optimizer, data wait and checkpoint events;
# the training figures are those of a run without the trace. Under mpirun (dp=2): both ranks' parts
# merged into one file by rank 0 (pid = rank), collectives on the comm thread. A bad window is refused
# naming the key. Checks run in tests/trace_check.py (python3).
# Usage: cli_trace.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
CHECK="$(dirname "$0")/trace_check.py"
command -v python3 > /dev/null || { echo "skip: python3 not installed"; exit 0; }
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
MODEL=(--model.dim=32 --model.n_layers=3 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --model.first_k_dense=1
       --model.n_shared_experts=1 --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=2 --training.threads=1
       --data.path="$W/c.txt" --data.val_fraction=0.1 --logging.progress=false --training.precision=fp32 --training.steps=8)

# ------------------------------------------------------------------ one rank
"$TERA" train "${MODEL[@]}" --logging.run_dir="$W/plain" > "$W/plain.log" 2>&1 || { fail "run without trace"; cat "$W/plain.log"; }
# checkpoint.every=3: asynchronous saves after steps 2 and 5 (inside the window 2:5) drawn on the writer thread
"$TERA" train "${MODEL[@]}" --checkpoint.every=3 --logging.run_dir="$W/one" --logging.trace="$W/one.json" \
    --logging.trace_steps=2:5 > "$W/one.log" 2>&1 && pass "a run with logging.trace ends normally" \
    || { fail "run with trace"; cat "$W/one.log"; }
python3 "$CHECK" "$W/one.json" 1 2 5 0,2,3 > "$W/one.check" && pass "one rank: $(cat "$W/one.check")" \
    || { fail "one rank's trace"; cat "$W/one.check"; }
for name in step forward backward optimizer "data wait" "attention fwd" "expert ffn bwd" "checkpoint write" \
    "checkpoint save (pause)" "load micro-batch"; do
    jq -e --arg n "$name" '[.traceEvents[] | select(.name == $n)] | length > 0' "$W/one.json" > /dev/null || missing="${missing:-} [$name]"
done
[ -z "${missing:-}" ] && pass "step, forward/backward, profiled ops, optimizer, data wait, checkpoint and prefetch events present" \
    || fail "events missing:$missing"
# each step event spans its forward, backward and optimizer (same thread, inside it)
jq -e '[.traceEvents[] | select(.ph == "X" and .tid == 0)] as $e | [$e[] | select(.name == "step")] | all(. as $s |
       ([$e[] | select(.args.step == $s.args.step and (.name == "forward" or .name == "backward" or .name == "optimizer"))]
        | length >= 3 and all(.ts >= $s.ts and .ts + .dur <= $s.ts + $s.dur + 0.001)))' "$W/one.json" > /dev/null \
    && pass "every step event encloses its forward, backward and optimizer" || fail "step enclosure"
cmp -s <(untimed "$W/plain/metrics.jsonl" | grep -v '"event"') <(untimed "$W/one/metrics.jsonl" | grep -v '"event"') \
    && pass "the trace changes no training figure (every step record identical but its timings)" \
    || fail "metrics differ with the trace on"
ls "$W"/one.json.* > /dev/null 2>&1 && fail "part or temporary files left: $(ls "$W"/one.json.*)" || pass "no part files left"

# a bad window: refused at start, naming the key, nothing trained
"$TERA" train "${MODEL[@]}" --logging.run_dir="$W/bad" --logging.trace="$W/bad.json" --logging.trace_steps=3 > "$W/bad.log" 2>&1
rc=$?
[ $rc != 0 ] && grep -q 'logging.trace_steps = "3"' "$W/bad.log" && [ ! -e "$W/bad.json" ] \
    && pass "logging.trace_steps=3 refused: $(grep -m1 error "$W/bad.log")" || { fail "bad window (exit $rc)"; cat "$W/bad.log"; }
# a path that cannot be written: refused at start, not after the run
"$TERA" train "${MODEL[@]}" --logging.run_dir="$W/nodir" --logging.trace="$W/no/such/dir/t.json" > "$W/nodir.log" 2>&1
rc=$?
[ $rc != 0 ] && grep -q "logging.trace = \"$W/no/such/dir/t.json\"" "$W/nodir.log" && [ ! -e "$W/nodir/metrics.jsonl" ] \
    && pass "an unwritable logging.trace refused at start: exit $rc" || { fail "unwritable trace path (exit $rc)"; cat "$W/nodir.log"; }
# a window past the end: an empty but valid timeline (metadata only)
"$TERA" train "${MODEL[@]}" --logging.run_dir="$W/late" --logging.trace="$W/late.json" --logging.trace_steps=100:2 > "$W/late.log" 2>&1 \
    && [ "$(jq '[.traceEvents[] | select(.ph == "X")] | length' "$W/late.json")" = 0 ] \
    && pass "a window after the last step: valid file without events" || fail "late window"

# tera bench writes the timeline too (its warm-up step 0, timed steps 1-2; the window 1:2)
"$TERA" bench "${MODEL[@]}" --steps 2 --warmup 1 --threads 1 --logging.trace="$W/bench.json" --logging.trace_steps=1:2 \
    > "$W/bench.out" 2> "$W/bench.log" && python3 "$CHECK" "$W/bench.json" 1 1 2 > "$W/bench.check" \
    && jq -e '[.traceEvents[] | select(.name == "step")] | length == 2' "$W/bench.json" > /dev/null \
    && pass "tera bench: $(cat "$W/bench.check")" || { fail "tera bench's trace"; cat "$W/bench.check" "$W/bench.log" 2> /dev/null | tail -5; }

# tera bench --products N (include/tera/profile.h): the timed steps' matrix products by kind and shape.
# One thread: every product runs whole, the LM head's forward among them (rows B*T = 128, vocab, dim 32; 64 rows
# of the table list every kind, whichever ISA oneDNN runs: under AVX2 the head is not among the 8 slowest);
# two threads: the 4 experts run side by side (4 >= 2 x 2 threads), so side-by-side products are timed.
# Without the option the JSON line has no products_* fields and stderr no table.
"$TERA" bench "${MODEL[@]}" --steps 2 --warmup 1 --threads 1 --products 64 > "$W/prod1.json" 2> "$W/prod1.log"
"$TERA" config "${MODEL[@]}" > "$W/cfg.txt" 2>&1
V=$(sed -n 's/^ *vocab_size *= *\([0-9]*\).*/\1/p' "$W/cfg.txt" | head -1)
jq -e '.products_whole_ms > 0 and .products_whole_gflops > 0 and .products_side_thread_ms == 0' "$W/prod1.json" > /dev/null \
    && grep -q "^  by kind" "$W/prod1.log" && grep -q "^  by shape" "$W/prod1.log" \
    && grep -Eq "^  fp32 +0 +1 +128 +$V +32 +whole +1\.00 " "$W/prod1.log" \
    && pass "tera bench --products 64, one thread: whole products only, the LM head's forward (128 x $V x 32) once a step" \
    || { fail "tera bench --products, one thread (vocab '$V')"; cat "$W/prod1.json"; grep -A12 "^matrix" "$W/prod1.log"; }
"$TERA" bench "${MODEL[@]}" --steps 2 --warmup 1 --threads 2 --products 4 > "$W/prod2.json" 2> "$W/prod2.log"
jq -e '.products_side_thread_ms > 0 and .products_side_gflops_per_thread > 0' "$W/prod2.json" > /dev/null \
    && [ "$(grep -c " side " "$W/prod2.log")" -ge 1 ] \
    && pass "tera bench --products 4, two threads: the experts' products side by side" \
    || { fail "tera bench --products, two threads"; cat "$W/prod2.json"; grep -A12 "^matrix" "$W/prod2.log"; }
jq -e 'has("products_whole_ms") | not' "$W/bench.out" > /dev/null && ! grep -q "^matrix products" "$W/bench.log" \
    && pass "tera bench without --products: no products fields, no table" || fail "products reported without --products"

# ------------------------------------------------------------------ two ranks under mpirun
if command -v mpirun > /dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 300 mpirun --oversubscribe -np 2 "$TERA" train \
        "${MODEL[@]}" --parallel.dp=2 --logging.run_dir="$W/mpi" --logging.trace="$W/mpi.json" --logging.trace_steps=1:3 \
        > "$W/mpi.log" 2>&1 && pass "mpirun -np 2 with logging.trace ends normally" || { fail "mpirun trace run"; tail -5 "$W/mpi.log"; }
    python3 "$CHECK" "$W/mpi.json" 2 1 3 0,1,3 > "$W/mpi.check" && pass "two ranks merged: $(cat "$W/mpi.check")" \
        || { fail "two ranks' trace"; cat "$W/mpi.check"; }
    jq -e '[.traceEvents[] | select(.ph == "X" and .tid == 1 and .cat == "comm")] | (map(.pid) | unique) == [0, 1]' \
        "$W/mpi.json" > /dev/null && pass "collectives on the comm thread of both ranks" || fail "comm events"
    ls "$W"/mpi.json.* > /dev/null 2>&1 && fail "part files left: $(ls "$W"/mpi.json.*)" || pass "rank parts removed after the merge"
else
    echo "skip: mpirun not installed"
fi
finish cli_trace
