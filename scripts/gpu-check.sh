#!/usr/bin/env bash
# The device check of the CUDA backend (issue 21), for a session that has a GPU: ONE script that
# builds with CUDA, compares every op with the CPU backend, trains 50 steps on cpu and cuda and
# compares the losses, and measures throughput. docs/GPU.md explains the figures.
#
# Usage: scripts/gpu-check.sh [--out DIR] [--budget SECONDS] [--only STAGE[,STAGE]] [--jobs N]
#   stages, in order: info build ops train bench (default: all)
#   --budget: the wall-clock seconds the whole script may take (default 540); a stage that would
#             not fit in what is left (its own limit below) is skipped and says so, so a run under an
#             outer timeout still ends with a summary. Each stage runs under `timeout` and its
#             output goes to DIR/<stage>.log; DIR/summary.txt has one line per stage.
#   Rerun a stage alone with --only (the build is kept in build-gpu, or $TERA_GPU_BUILD, and reused).
# Exit status: 0 when every stage that ran passed.
set -u
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/gpu-check-out}
BUDGET=540
ONLY=""
JOBS=$(nproc 2>/dev/null || echo 4)
while [ $# -gt 0 ]; do
    case $1 in
        --out) OUTDIR=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --jobs) JOBS=$2; shift 2 ;;
        *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
BUILD=${TERA_GPU_BUILD:-build-gpu} # the build directory (kept between runs)
TERA=$BUILD/tera
START=$(date +%s)
SUMMARY=$OUTDIR/summary.txt
: > "$SUMMARY"
FAILED=0

left() { echo $((BUDGET - ($(date +%s) - START))); }
note() { echo "$*" | tee -a "$SUMMARY"; }
wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# stage NAME LIMIT_S FUNCTION: runs FUNCTION under timeout LIMIT_S (or what is left of the budget,
# when that is at least half of LIMIT_S), logging to OUTDIR/NAME.log
stage() {
    local name=$1 limit=$2 fn=$3 rest t0 rc
    wanted "$name" || return 0
    rest=$(left)
    if [ "$rest" -lt $((limit / 2)) ]; then
        note "$name: SKIPPED (budget: ${rest}s left, the stage needs up to ${limit}s)"
        return 0
    fi
    [ "$rest" -lt "$limit" ] && limit=$rest
    t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" bash -c "$(declare -f "$fn" tiny_args compare_losses); $fn" > "$OUTDIR/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        note "$name: ok ($(( $(date +%s) - t0 ))s) $(tail -n 1 "$OUTDIR/$name.log")"
    else
        FAILED=1
        [ $rc -eq 124 ] && note "$name: TIMEOUT after ${limit}s" || note "$name: FAILED (exit $rc, $(( $(date +%s) - t0 ))s)"
        tail -n 30 "$OUTDIR/$name.log"
    fi
}

export TERA BUILD JOBS OUTDIR

s_info() {
    nvidia-smi -L || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv || true
    /usr/local/cuda/bin/nvcc --version | tail -n 2 || true
    echo "cores $(nproc)"
}

s_build() {
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTERA_CUDA=ON -DTERA_CUDA_ARCH=90 > /dev/null || exit 1
    cmake --build "$BUILD" -j"$JOBS" --target tera test_cuda 2>&1 | tail -n 5
    test -x "$TERA" && test -x "$BUILD/tests/test_cuda" && echo "built tera and test_cuda with CUDA"
}

s_ops() {
    local out rc
    out=$("$BUILD/tests/test_cuda" 2>&1)
    rc=$?
    echo "$out"
    if grep -q "^skip:" <<< "$out"; then echo "test_cuda skipped: no usable device"; exit 1; fi
    [ $rc -eq 0 ] && echo "every op matches the CPU backend (test_cuda)"
}

# the model of the training comparison: small enough for the CPU side to take well under a minute
tiny_args() {
    echo --model.dim=256 --model.n_layers=4 --model.n_heads=8 --model.n_experts=8 --model.top_k=2 \
         --model.ffn_dim=512 --training.seq_len=128 --training.micro_batch=8 \
         --training.steps=50 --training.warmup_steps=5 --training.seed=7 --logging.progress=false
}

# compare_losses A B TOL: the loss of every step of two metrics files agrees to relative TOL
compare_losses() {
    paste <(grep '"loss"' "$1" | grep -v '"event"' | sed 's/.*"step": \([0-9]*\).*"loss": \([^,}]*\).*/\1 \2/') \
          <(grep '"loss"' "$2" | grep -v '"event"' | sed 's/.*"step": \([0-9]*\).*"loss": \([^,}]*\).*/\1 \2/') |
        awk -v tol="$3" '{ n++; d = ($2 - $4) / $2; if (d < 0) d = -d; if (d > worst) worst = d; if ($1 != $3) bad = 1 }
            END { printf "%d steps, first loss %s, worst relative loss difference %.2e (tolerance %g)\n", n, first, worst, tol
                  exit bad || n < 50 || worst > tol }
            NR == 1 { first = $2 }'
}

s_train() {
    local ok=0 p
    for p in fp32 bf16; do
        for d in cpu cuda; do
            "$TERA" train $(tiny_args) --training.precision=$p --training.device=$d \
                --logging.run_dir="$OUTDIR/train_${p}_$d" > "$OUTDIR/train_${p}_$d.log" 2>&1 \
                || { echo "$p $d run failed:"; tail -n 20 "$OUTDIR/train_${p}_$d.log"; ok=1; continue; }
            grep -h "tokens_per_s" "$OUTDIR/train_${p}_$d/metrics.jsonl" | tail -n 1 | \
                sed 's/.*"tokens_per_s": \([^,}]*\).*/'"$p $d"' tokens\/s (last step): \1/'
        done
        # fp32: the same maths up to the order of fp32 sums; bf16: the same rounded operands, ditto
        echo -n "$p cuda vs cpu: "
        compare_losses "$OUTDIR/train_${p}_cpu/metrics.jsonl" "$OUTDIR/train_${p}_cuda/metrics.jsonl" \
            "$([ $p = fp32 ] && echo 2e-3 || echo 1e-2)" || ok=1
    done
    exit $ok
}

s_bench() {
    # products and attention on device buffers (the backend's own speed)
    "$BUILD/tests/test_cuda" --bench 989 | tee "$OUTDIR/bench_ops.jsonl"
    grep -q '"bench"' "$OUTDIR/bench_ops.jsonl" || { echo "no op benchmark ran"; exit 1; }
    # whole training steps of bench-m through today's model (host tensors staged per op: PCIe bound)
    for d in cpu cuda; do
        "$TERA" train -c configs/bench-m.ini --training.steps=6 --training.device=$d --training.precision=bf16 \
            --logging.run_dir="$OUTDIR/benchm_$d" > "$OUTDIR/benchm_$d.log" 2>&1 || { echo "bench-m $d failed"; tail -n 20 "$OUTDIR/benchm_$d.log"; exit 1; }
        # active parameters per token of bench-m (D=512 L=8 E=16 k=2 F=1024 V=16384 T=512):
        # attention 4 D^2 + router D E + k 3 D F per layer, plus the output layer V D; 6 flops per
        # parameter and token, plus the attention scores 6 T D per layer and token (causal: half of 12)
        grep -h '"tokens_per_s"' "$OUTDIR/benchm_$d/metrics.jsonl" | tail -n 3 | \
            sed 's/.*"tokens_per_s": \([^,}]*\).*/\1/' | awk -v d=$d '
            { s += $1; n++ } END { D = 512; L = 8; E = 16; k = 2; F = 1024; V = 16384; T = 512
              p = L * (4 * D * D + D * E + k * 3 * D * F) + V * D; f = 6 * p + L * 6 * T * D
              tps = s / n; printf "bench-m %s: %.0f tokens/s, %.3g flops/token, MFU %.4f of 989 TFLOP/s bf16\n", d, tps, f, tps * f / 989e12 }'
    done
}

stage info 30 s_info
stage build 300 s_build
stage ops 120 s_ops
stage train 240 s_train
stage bench 180 s_bench
note "total $(( $(date +%s) - START ))s; logs in $OUTDIR"
exit $FAILED
