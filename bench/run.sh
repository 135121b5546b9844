#!/usr/bin/env bash
# make bench: bench-s and bench-m (../shared/spec/BENCH.md) on 1 and 2 threads, in fp32 and bf16,
# tera beside the PyTorch eager peer (fp32; bf16 = torch.autocast("cpu", dtype=torch.bfloat16)) in
# the same run. Prints a table (tokens/s, MFU vs the fp32 sgemm peak measured in the same run, ratio
# to PyTorch at the same precision and thread count) and tera's per-operation profile; raw JSON
# lines go to bench/results/latest.jsonl.
# Usage: bench/run.sh [TERA] [configs...]   (STEPS=10 WARMUP=3 THREADS="1 2" PRECISIONS="fp32 bf16")
# A precision may name the bf16 units (training.bf16_gemm): PRECISIONS="fp32 bf16:native bf16:fma";
# plain bf16 leaves them to auto. The prec column shows the units in effect (bf16/fma, bf16/native).
# OpenMP wait policy (docs/PERFORMANCE.md, "Wave 16"; bench/wait_policy.sh compares them): tera runs
# under the runtime's default (TERA_OMP_WAIT="", what a `tera train` gets unless its caller sets
# OMP_WAIT_POLICY; PASSIVE cost it 4-11% at 2 threads). The PyTorch peer's best policy depends on the
# precision and the run (fp32: its OpenBLAS threads and OpenMP's spinning share 2 cores badly, bench-s
# 1273 tokens/s against PASSIVE's 2596; bf16: autocast's oneDNN products 2109 against PASSIVE's
# 1833), so by default (PEER_OMP_WAIT=best) each peer row is run under PASSIVE and under the default
# and the faster one is kept; its JSON line names it (omp_wait_policy) and the other's tokens/s
# (other_policy_tokens_per_s). TERA_OMP_WAIT and PEER_OMP_WAIT also take PASSIVE, ACTIVE or "" (unset).
# ROUNDS=N (default 1) runs the whole grid N times, round after round (every row sees the same drift of
# a shared machine), and ends with a table of medians: per row the median tokens/s with its range, the
# median of each round's MFU (each against its own round's sgemm peak) and the ratio of the medians.
# Single runs here move by up to 19% (docs/PERFORMANCE.md, "Wave 15"): judge targets by ROUNDS=3.
# PEER=0 leaves the PyTorch peer out.
set -euo pipefail
TERA=${1:-build/tera}
shift || true
CONFIGS=${*:-bench-s bench-m}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
THREADS=${THREADS:-1 2}
PRECISIONS=${PRECISIONS:-fp32 bf16}
TERA_OMP_WAIT=${TERA_OMP_WAIT-}
PEER_OMP_WAIT=${PEER_OMP_WAIT-best}
ROUNDS=${ROUNDS:-1}
PEER=${PEER:-1}
case "$ROUNDS" in ''|*[!0-9]*|0) echo "bench/run.sh: ROUNDS='$ROUNDS' is not a positive integer" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
# env(1) arguments giving a side its wait policy ("" unsets the variable: the runtime's default)
wait_env() { if [ -n "$1" ]; then echo "OMP_WAIT_POLICY=$1"; else echo "-u OMP_WAIT_POLICY"; fi; }
# the peer's JSON line for config $1, threads $2, precision $3 under wait policy $4, naming the policy
peer_run() {
    env $(wait_env "$4") OMP_NUM_THREADS=$2 /usr/bin/python3 bench/torch_peer.py --config $1 --threads $2 \
        --precision $3 --steps $STEPS --warmup $WARMUP --fp32-gemm $PEER_GEMM \
        | /usr/bin/python3 -c 'import json, sys; a = json.loads(sys.stdin.read()); a["omp_wait_policy"] = sys.argv[1]; print(json.dumps(a))' "${4:-default}"
}
# the faster of two peer lines, with the other's tokens/s
faster() {
    /usr/bin/python3 -c 'import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if b["tokens_per_s"] > a["tokens_per_s"]: a, b = b, a
a["other_policy_tokens_per_s"] = b["tokens_per_s"]
print(json.dumps(a))' "$1" "$2"
}
mkdir -p bench/results
OUT=bench/results/latest.jsonl
: > "$OUT"
# PyTorch's fp32 products go to the system BLAS; Debian's OpenBLAS 0.3.21 needs to be told this
# CPU's kernel family (it does not recognise it and falls back to SSE3 otherwise).
if grep -q avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}; fi
PEER_GEMM=${PEER_GEMM:-blas}
have_torch=1
if [ "$PEER" = 0 ]; then have_torch=0
else /usr/bin/python3 -c "import torch" 2>/dev/null || { have_torch=0; echo "bench: python3-torch missing, PyTorch peer skipped" >&2; }
fi
# "blas" is the peer's best fp32 only where the system BLAS is OpenBLAS (`make bench` installs it
# before this script). With netlib's reference BLAS a torch.mm runs at ~6 GFLOP/s (bench-s 183
# tokens/s on the AMD machine of docs/PERFORMANCE.md wave 27, against 2409 with OpenBLAS), so the
# script installs it (scripts/install-deps.sh --with-torch); where that leaves another BLAS in place
# (no root, or the alternative set by hand) the peer's fp32 products go through oneDNN's convolutions
# (PEER_GEMM=onednn: 342 tokens/s there, still far from OpenBLAS) and the script says so.
is_openblas() { readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null | grep -q openblas; }
if [ "$have_torch" = 1 ] && [ "$PEER_GEMM" = blas ] && ! is_openblas; then
    echo "bench: the system BLAS is not OpenBLAS: scripts/install-deps.sh --with-torch" >&2
    scripts/install-deps.sh --with-torch >&2 || true
    if ! is_openblas; then
        echo "bench: the system BLAS is still not OpenBLAS; the PyTorch peer's fp32 products go through" \
            "oneDNN (PEER_GEMM=onednn), a slower peer than OpenBLAS's" >&2
        PEER_GEMM=onednn
    fi
fi
# a JSON line with "round": $2 added
with_round() { /usr/bin/python3 -c 'import json, sys; a = json.loads(sys.argv[1]); a["round"] = int(sys.argv[2]); print(json.dumps(a))' "$1" "$2"; }

echo "OpenMP wait policy: tera ${TERA_OMP_WAIT:-default (unset)}; PyTorch peer ${PEER_OMP_WAIT:-default (unset)}"
for round in $(seq 1 "$ROUNDS"); do
[ "$ROUNDS" -gt 1 ] && echo "round $round of $ROUNDS ($(date -u +%H:%M:%S) UTC)"
printf "%-8s %3s %11s | %12s %7s %7s | %12s %7s %8s | %6s\n" config thr prec "tera tok/s" "GF/s" MFU "torch tok/s" "GF/s" "policy" ratio
for cfg in $CONFIGS; do
    for t in $THREADS; do
        for p in $PRECISIONS; do
            prec=${p%%:*}
            units=(); [ "$prec" != "$p" ] && units=(--training.bf16_gemm=${p#*:})
            tj=$(env $(wait_env "$TERA_OMP_WAIT") "$TERA" bench -c configs/$cfg.ini --name $cfg --threads $t --steps $STEPS \
                 --warmup $WARMUP --training.precision=$prec "${units[@]}" 2> bench/results/profile-$cfg-t$t-${p/:/-}.txt)
            tj=$(with_round "$tj" "$round")
            echo "$tj" >> "$OUT"
            pj='{}'
            if [ $have_torch = 1 ]; then
                if [ "$PEER_OMP_WAIT" = best ] && [ "$t" -gt 1 ]; then # one thread: no team waits
                    pj=$(faster "$(peer_run $cfg $t $prec PASSIVE)" "$(peer_run $cfg $t $prec "")")
                else
                    pw=$PEER_OMP_WAIT
                    [ "$pw" = best ] && pw=PASSIVE
                    pj=$(peer_run $cfg $t $prec "$pw")
                fi
                pj=$(with_round "$pj" "$round")
                echo "$pj" >> "$OUT"
            fi
            /usr/bin/python3 - "$tj" "$pj" <<'PY' 2>/dev/null || echo "$tj"
import json, sys
a = json.loads(sys.argv[1]); b = json.loads(sys.argv[2])
pt = b.get("tokens_per_s"); pg = b.get("tflops", 0) * 1e3 if b else None
prec = a["precision"] + ("/" + a["bf16_gemm"] if a.get("bf16_gemm", "-") != "-" else "")
print("%-8s %3d %11s | %12.0f %7.1f %6.1f%% | %12s %7s %8s | %6s" % (
    a["config"], a["threads"], prec, a["tokens_per_s"], a["gflops"], 100 * a["mfu"],
    "%.0f" % pt if pt else "-", "%.1f" % pg if pt else "-", b.get("omp_wait_policy", "-"),
    "%.2fx" % (a["tokens_per_s"] / pt) if pt else "-"))
PY
        done
    done
done
done
if [ "$ROUNDS" -gt 1 ]; then
    echo
    echo "medians over $ROUNDS rounds (tokens/s: median [min-max]; MFU: median of the rounds' own; ratio of the medians):"
    /usr/bin/python3 - "$OUT" <<'PY'
import json, statistics, sys
rows, last = {}, None  # rows in first-seen order (dicts keep insertion order)
for l in open(sys.argv[1]):
    a = json.loads(l)
    if a.get("impl", "tera") != "tera":  # the peer's line follows the tera line of its row
        if last: rows[last]["peer"].append(a["tokens_per_s"])
        continue
    prec = a["precision"] + ("/" + a["bf16_gemm"] if a.get("bf16_gemm", "-") != "-" else "")
    last = (a["config"], a["threads"], prec)
    r = rows.setdefault(last, {"tera": [], "mfu": [], "peer": []})
    r["tera"].append(a["tokens_per_s"])
    r["mfu"].append(a["mfu"])
print("%-8s %3s %11s | %22s %7s | %22s | %6s" % ("config", "thr", "prec", "tera tok/s", "MFU", "torch tok/s", "ratio"))
rng = lambda v, m: "%.0f [%.0f-%.0f]" % (m, min(v), max(v))
for key, r in rows.items():
    t, p = r["tera"], r["peer"]
    mt = statistics.median(t)
    mp = statistics.median(p) if p else None
    print("%-8s %3d %11s | %22s %6.1f%% | %22s | %6s" % (key[0], key[1], key[2], rng(t, mt), 100 * statistics.median(r["mfu"]),
          rng(p, mp) if p else "-", "%.2fx" % (mt / mp) if p else "-"))
PY
fi
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
