#!/usr/bin/env bash
# bench-dist (../shared/spec/BENCH.md) on 1, 2, 4 and 8 MPI ranks in several layouts: tokens/s,
# bytes each rank sent per step against the analytic minimum of the layout, memory per rank, and
# what overlapping the expert exchange with expert compute saves (ep_overlap 1 vs 0).
# One thread per rank; global batch 16 sequences of 256 tokens. Usage: bench/dist.sh [TERA] [STEPS]
set -eu
TERA=${1:-build/tera}
STEPS=${2:-5}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/dist-results.jsonl}
: > "$OUT"
# name dp ep zero overlap
for l in one:1:1:0:1 dp2:2:1:0:1 ep2:2:2:0:1 dp4:4:1:0:1 dp4-zero1:4:1:1:1 ep4:4:4:0:1 ep4-no-overlap:4:4:0:0 \
         dp2xep2-zero1:4:2:1:1 dp8:8:1:0:1 dp2xep4-zero1:8:4:1:1 ep8:8:8:0:1 ep8-no-overlap:8:8:0:0; do
    IFS=: read -r name dp ep zero ov <<< "$l"
    args=(bench -c configs/bench-dist.ini --name "bench-dist/$name" --steps "$STEPS" --warmup 2
          --training.micro_batch=$((16 / dp)) --parallel.dp="$dp" --parallel.ep="$ep" --parallel.zero="$zero"
          --parallel.ep_overlap="$ov" --training.threads=1)
    if [ "$dp" = 1 ]; then "$TERA" "${args[@]}" 2> /dev/null; else mpirun --oversubscribe -np "$dp" "$TERA" "${args[@]}" 2> /dev/null; fi \
        | tee -a "$OUT"
done
python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\n| layout | ranks | tokens/s | bytes sent/rank/step | analytic minimum | ratio | params+grads+optimizer MiB/rank | comm buffers MiB |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    n = r.get("ranks", 1)
    if n == 1:
        print(f"| {r['config']} | 1 | {r['tokens_per_s']:.0f} | 0 | 0 | - | - | - |"); continue
    mem = (r["mem_params"] + r["mem_grads"] + r["mem_optimizer"]) / 2**20
    ratio = r["bytes_sent_per_step"] / r["min_bytes_per_step"] if r["min_bytes_per_step"] else float("nan")
    print(f"| {r['config']} | {n} | {r['tokens_per_s']:.0f} | {r['bytes_sent_per_step']/2**20:.1f} MiB | "
          f"{r['min_bytes_per_step']/2**20:.1f} MiB | {ratio:.3f} | {mem:.0f} | {r['mem_comm']/2**20:.0f} |")
PY
