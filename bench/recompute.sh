#!/usr/bin/env bash
# Activation recomputation: activation bytes and step time of one configuration under each
# training.recompute policy, measured side by side in one run (the policies alternate, ROUNDS
# times in rotating order, and the median of each policy is kept). Two times per step: wall (step_ms_median) and the
# process CPU time (cpu_ms_per_step, all threads; OpenMP waits passively), which other load on the
# machine disturbs much less: its ratio to none is the compute the recomputation adds.
# Usage: bench/recompute.sh [TERA] [CONFIG]   (STEPS=10 WARMUP=3 THREADS=2 ROUNDS=3
#        POLICIES="none selective full full:0-1,selective:2-3")
set -euo pipefail
TERA=${1:-build/tera}
CONFIG=${2:-bench-s}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
POLICIES=${POLICIES:-none selective full full:0-1,selective:2-3}
cd "$(dirname "$0")/.."
mkdir -p bench/results
OUT=bench/results/recompute-$CONFIG.jsonl
: > "$OUT"
read -r -a POL <<< "$POLICIES"
for r in $(seq 0 $((ROUNDS - 1))); do
    for i in $(seq 0 $((${#POL[@]} - 1))); do # round r starts at policy r: no policy always runs last
        p=${POL[$(((i + r) % ${#POL[@]}))]}
        OMP_WAIT_POLICY=PASSIVE "$TERA" bench -c configs/$CONFIG.ini --name "$CONFIG" --threads "$THREADS" \
            --steps "$STEPS" --warmup "$WARMUP" --training.recompute="$p" 2> /dev/null >> "$OUT"
    done
done
/usr/bin/python3 - "$OUT" "$POLICIES" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
pol = sys.argv[2].split()
by = {p: [r for r in rows if r["recompute"] == p] for p in pol}
base = by[pol[0]]
b_bytes = base[0]["act_bytes"]; b_ms = statistics.median(r["step_ms_median"] for r in base)
b_cpu = statistics.median(r["cpu_ms_per_step"] for r in base)
print("| recompute | activations MiB | vs none | step ms (wall, median) | vs none | CPU ms / step (median) | vs none | final loss |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for p in pol:
    rs = by[p]; ms = statistics.median(r["step_ms_median"] for r in rs); ab = rs[0]["act_bytes"]
    cpu = statistics.median(r["cpu_ms_per_step"] for r in rs)
    losses = sorted({r["final_loss"] for r in rs})
    print("| `%s` | %.1f | %.1f%% | %.1f | %.1f%% | %.1f | %.1f%% | %s |" % (p, ab / 2**20, 100.0 * ab / b_bytes, ms,
          100.0 * ms / b_ms, cpu, 100.0 * cpu / b_cpu, " ".join("%.4f" % x for x in losses)))
PY
