#!/usr/bin/env bash
# Pipeline schedules measured: for GPipe, 1F1B and interleaved 1F1B on pp = 2 and 4 stages with m
# micro-batches per step, each stage's measured idle fraction (1 - time running its operations /
# step time, the bubble) beside the formula (p-1)/(m+p-1) (interleaved: (p-1)/(v*m+p-1)), and the
# activation memory each stage holds (slots = micro-batches in flight x per-slot bytes).
# The model is bench-s's (V=4096 D=256 L=4... with L=8 here so that 4 stages x 2 chunks fit),
# one thread per rank. pp=2 gives each stage its own core on a 2-core machine; pp=4 oversubscribes
# (waiting ranks share cores with working ones), so its idle fractions overstate the bubble.
# Usage: bench/pipeline.sh [TERA] [STEPS]
set -u
TERA=${1:-build/tera}
STEPS=${2:-6}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1 OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.."
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
M=${M:-8}
printf '| schedule | pp | m | stage | step ms | busy ms | idle fraction | formula | activation slots | activations MiB |\n'
printf '|---|---|---|---|---|---|---|---|---|---|\n'
for run in gpipe:2:1 1f1b:2:1 interleaved:2:2 gpipe:4:1 1f1b:4:1 interleaved:4:2; do
    IFS=: read -r sched pp v <<< "$run"
    mpirun --oversubscribe -np "$pp" "$TERA" train -c configs/bench-s.ini --model.n_layers=8 --training.steps="$STEPS" \
        --training.micro_batch=2 --training.grad_accum="$M" --training.threads=1 --parallel.pp="$pp" \
        --parallel.pp_schedule="$sched" --parallel.pp_chunks="$v" --logging.run_dir="$W/r" --logging.progress=true \
        --force > "$W/log" 2>&1 || { echo "failed: $run"; tail -5 "$W/log"; continue; }
    for st in $(seq 0 $((pp - 1))); do
        mem=$(grep "pipeline stage $st of" "$W/log" | sed 's/.*, \([0-9]*\) activation slots*, activations \([0-9.]*\) MiB/\1 \2/')
        tim=$(grep "pipeline stage $st: step" "$W/log" | sed 's/.*step \([0-9.]*\) ms, busy \([0-9.]*\) ms, waiting [0-9.]* ms: idle fraction \([0-9.]*\) (bubble formula \([0-9.]*\))/\1 \2 \3 \4/')
        read -r slots mib <<< "$mem"
        read -r step busy idle formula <<< "$tim"
        name=$sched; [ "$v" -gt 1 ] && name="$sched v=$v"
        printf '| %s | %d | %d | %d | %s | %s | %s | %s | %s | %s |\n' "$name" "$pp" "$M" "$st" "$step" "$busy" \
            "$idle" "$formula" "$slots" "$mib"
    done
done
