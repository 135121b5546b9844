#!/usr/bin/env bash
# make bench: bench-s and bench-m (../shared/spec/BENCH.md) on 1 and 2 threads, in fp32 and bf16,
# tera beside the PyTorch eager peer (fp32; bf16 = torch.autocast("cpu", dtype=torch.bfloat16)) in
# the same run. Prints a table (tokens/s, MFU vs the fp32 sgemm peak measured in the same run, ratio
# to PyTorch at the same precision and thread count) and tera's per-operation profile; raw JSON
# lines go to bench/results/latest.jsonl.
# Usage: bench/run.sh [TERA] [configs...]   (STEPS=10 WARMUP=3 THREADS="1 2" PRECISIONS="fp32 bf16")
# A precision may name the bf16 units (training.bf16_gemm): PRECISIONS="fp32 bf16:native bf16:fma";
# plain bf16 leaves them to auto. The prec column shows the units in effect (bf16/fma, bf16/native).
set -euo pipefail
TERA=${1:-build/tera}
shift || true
CONFIGS=${*:-bench-s bench-m}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
THREADS=${THREADS:-1 2}
PRECISIONS=${PRECISIONS:-fp32 bf16}
cd "$(dirname "$0")/.."
mkdir -p bench/results
OUT=bench/results/latest.jsonl
: > "$OUT"
# PyTorch's fp32 products go to the system BLAS; Debian's OpenBLAS 0.3.21 needs to be told this
# CPU's kernel family (it does not recognise it and falls back to SSE3 otherwise).
if grep -q avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}; fi
PEER_GEMM=${PEER_GEMM:-blas}
have_torch=1
/usr/bin/python3 -c "import torch" 2>/dev/null || { have_torch=0; echo "bench: python3-torch missing, PyTorch peer skipped" >&2; }

printf "%-8s %3s %11s | %12s %7s %7s | %12s %7s | %6s\n" config thr prec "tera tok/s" "GF/s" MFU "torch tok/s" "GF/s" ratio
for cfg in $CONFIGS; do
    for t in $THREADS; do
        for p in $PRECISIONS; do
            prec=${p%%:*}
            units=(); [ "$prec" != "$p" ] && units=(--training.bf16_gemm=${p#*:})
            tj=$(OMP_WAIT_POLICY=PASSIVE "$TERA" bench -c configs/$cfg.ini --name $cfg --threads $t --steps $STEPS \
                 --warmup $WARMUP --training.precision=$prec "${units[@]}" 2> bench/results/profile-$cfg-t$t-${p/:/-}.txt)
            echo "$tj" >> "$OUT"
            pj='{}'
            if [ $have_torch = 1 ]; then
                pj=$(OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$t /usr/bin/python3 bench/torch_peer.py --config $cfg \
                     --threads $t --precision $prec --steps $STEPS --warmup $WARMUP --fp32-gemm $PEER_GEMM)
                echo "$pj" >> "$OUT"
            fi
            /usr/bin/python3 - "$tj" "$pj" <<'PY' 2>/dev/null || echo "$tj"
import json, sys
a = json.loads(sys.argv[1]); b = json.loads(sys.argv[2])
pt = b.get("tokens_per_s"); pg = b.get("tflops", 0) * 1e3 if b else None
prec = a["precision"] + ("/" + a["bf16_gemm"] if a.get("bf16_gemm", "-") != "-" else "")
print("%-8s %3d %11s | %12.0f %7.1f %6.1f%% | %12s %7s | %6s" % (
    a["config"], a["threads"], prec, a["tokens_per_s"], a["gflops"], 100 * a["mfu"],
    "%.0f" % pt if pt else "-", "%.1f" % pg if pt else "-",
    "%.2fx" % (a["tokens_per_s"] / pt) if pt else "-"))
PY
        done
    done
done
echo
echo "fp32 GEMM peak (best of 2048^3 products before and after the steps, same run):"
grep -o '"threads": [0-9]*, .*"sgemm_peak_gflops": [0-9.]*' "$OUT" | sed 's/"precision.*"sgemm/ sgemm/' | sort -u
echo
echo "bf16: model FLOP/s against the best oneDNN bf16 product rate over the model's own training shapes"
echo "(tera bench's bf16_peak_gflops, same run; null where the CPU has no native bf16 products):"
grep '"precision": "bf16"' "$OUT" | /usr/bin/python3 -c '
import json, sys
for l in sys.stdin:
    a = json.loads(l)
    if a.get("impl", "tera") != "tera" or "gflops" not in a: continue  # the PyTorch peer'"'"'s lines
    pk = a.get("bf16_peak_gflops")
    print("%-8s %2d threads: %7.1f GF/s of %s (%s)" % (a["config"], a["threads"], a["gflops"],
          "%.1f GF/s bf16 peak, %.1f%%" % (pk, 100 * a["gflops"] / pk) if pk else "no bf16 peak",
          a.get("bf16_peak_isa", a.get("bf16_peak_skipped", "-"))))' || true
echo
echo "tera per-operation profile, bench-m, 2 threads:"
cat bench/results/profile-bench-m-t2-fp32.txt 2>/dev/null || cat bench/results/profile-*-t2-fp32.txt
