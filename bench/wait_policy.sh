#!/usr/bin/env bash
# The OpenMP wait policy's effect on tera and on the PyTorch peer (docs/PERFORMANCE.md, "Wave 16"):
# each configuration and thread count run ROUNDS times under OMP_WAIT_POLICY=PASSIVE, the runtime's
# default (the variable unset: libgomp spins a while before it sleeps) and ACTIVE, the policies
# alternating within a round (the machine's load drifts; alternation and medians show it). Prints
# tokens/s per round and the median per side and policy, and tera's MFU against the sgemm peak of
# the same run; bench/run.sh then runs each side under its best one.
# Usage: bench/wait_policy.sh [TERA] [configs...]
#   (ROUNDS=3 STEPS=10 WARMUP=3 THREADS="2" PRECISION=fp32 PEER=1; PEER=0 skips PyTorch;
#    raw JSON lines to $OUT, default bench/results/wait-policy.jsonl)
set -euo pipefail
TERA=${1:-build/tera}
shift || true
CONFIGS=${*:-bench-s}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
THREADS=${THREADS:-2}
PRECISION=${PRECISION:-fp32}
PEER=${PEER:-1}
cd "$(dirname "$0")/.."
mkdir -p bench/results
OUT=${OUT:-bench/results/wait-policy.jsonl}
: > "$OUT"
if grep -q avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}; fi
if [ "$PEER" = 1 ] && ! /usr/bin/python3 -c "import torch" 2> /dev/null; then
    echo "wait_policy: python3-torch missing, PyTorch peer skipped" >&2
    PEER=0
fi
for cfg in $CONFIGS; do
    for t in $THREADS; do
        for r in $(seq "$ROUNDS"); do
            for w in PASSIVE default ACTIVE; do
                envs=(OMP_WAIT_POLICY=$w)
                [ $w = default ] && envs=(-u OMP_WAIT_POLICY)
                j=$(env "${envs[@]}" "$TERA" bench -c "configs/$cfg.ini" --name "$cfg" --threads "$t" --steps "$STEPS" \
                    --warmup "$WARMUP" --training.precision="$PRECISION" 2> /dev/null)
                echo "{\"side\": \"tera\", \"policy\": \"$w\", \"round\": $r, \"result\": $j}" >> "$OUT"
                if [ "$PEER" = 1 ]; then
                    j=$(env "${envs[@]}" OMP_NUM_THREADS="$t" /usr/bin/python3 bench/torch_peer.py --config "$cfg" \
                        --threads "$t" --precision "$PRECISION" --steps "$STEPS" --warmup "$WARMUP" --fp32-gemm blas)
                    echo "{\"side\": \"pytorch\", \"policy\": \"$w\", \"round\": $r, \"result\": $j}" >> "$OUT"
                fi
            done
        done
    done
done
/usr/bin/python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
groups = {}
for x in rows:
    a = x["result"]
    key = (a["config"], a["threads"], x["side"], x["policy"])
    groups.setdefault(key, []).append(a)
print("%-8s %3s %-8s %-8s | %-26s %8s | %s" % ("config", "thr", "side", "policy", "tokens/s by round", "median", "tera MFU by round"))
for (cfg, thr, side, pol), v in sorted(groups.items()):
    tps = [a["tokens_per_s"] for a in v]
    mfu = " ".join("%.1f%%" % (100 * a["mfu"]) for a in v if "mfu" in a)
    print("%-8s %3d %-8s %-8s | %-26s %8.0f | %s" % (cfg, thr, side, pol, " ".join("%.0f" % t for t in tps),
          statistics.median(tps), mfu or "-"))
PY
