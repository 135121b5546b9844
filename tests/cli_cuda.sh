#!/usr/bin/env bash
# training.device through the command line. Where the CUDA backend cannot run (a build without
# CUDA, or no device): `--training.device=cuda` is one clear error at start naming the key, exit 1,
# nothing written to the run directory's metrics. Where it runs: 4 steps on cuda follow the cpu
# run's losses (fp32: the same maths up to the order of the sums). An unknown device is a config
# error naming the key either way. Usage: cli_cuda.sh TERA SOURCE_DIR
set -u
TERA=$1
. "$(dirname "$0")/testlib.sh"
TINY=(--model.dim=64 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=64
      --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=1 --training.steps=4
      --training.threads=2 --logging.progress=false)

"$TERA" train "${TINY[@]}" --training.device=tpu --logging.run_dir="$W/tpu" > "$W/tpu.out" 2> "$W/tpu.err"
rc=$?
[ $rc -eq 1 ] && grep -q "training.device" "$W/tpu.err" && pass "unknown device: $(head -1 "$W/tpu.err")" \
    || { fail "unknown device: exit $rc"; cat "$W/tpu.err"; }

"$TERA" train "${TINY[@]}" --training.device=cuda --logging.run_dir="$W/cuda" > "$W/cuda.out" 2> "$W/cuda.err"
rc=$?
if [ $rc -ne 0 ]; then
    # no CUDA here: one error line naming the key, a plain exit (not a signal), no step trained
    if [ $rc -eq 1 ] && grep -q "training.device = cuda" "$W/cuda.err" && [ "$(grep -c 'tera: error' "$W/cuda.err")" -eq 1 ] \
        && ! grep -qs '"loss"' "$W/cuda/metrics.jsonl"; then
        pass "cuda unavailable: $(grep 'tera: error' "$W/cuda.err")"
    else
        fail "cuda unavailable: exit $rc"
        cat "$W/cuda.err"
    fi
else
    "$TERA" train "${TINY[@]}" --training.device=cpu --logging.run_dir="$W/cpu" > "$W/cpu.out" 2>&1 || fail "cpu run"
    msg=$(compare_steps "$W/cpu/metrics.jsonl" "$W/cuda/metrics.jsonl" 1e-3) && pass "cuda follows cpu: $msg" \
        || fail "cuda vs cpu: $msg"
fi
finish cli_cuda
