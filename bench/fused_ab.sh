#!/usr/bin/env bash
# A/B of two tera binaries (before and after a change to the element-wise passes, issue 19) in one
# run: for each round, configuration, ISA (the machine's own, and ONEDNN_MAX_CPU_ISA=AVX512_CORE:
# oneDNN without AMX or the bf16 dot product) and precision, `tera bench` of the old and the new
# binary back to back, the order swapped every round, so that the other jobs of this shared machine
# load both alike. Prints one line per run (tokens/s, median step, CPU ms per step, and the profile's
# element-wise rows) and keeps each run's stdout/stderr in OUT (for bench/op_gap.py).
# Usage: bench/fused_ab.sh OLD NEW OUT [ROUNDS] [STEPS]
#   env CONFIGS="bench-s bench-m", ISAS="native avx512_core", PRECS="fp32 bf16", THREADS=2
set -euo pipefail
OLD=$1 NEW=$2 OUT=$3 ROUNDS=${4:-2} STEPS=${5:-5}
CONFIGS=${CONFIGS:-"bench-s bench-m"} ISAS=${ISAS:-"native avx512_core"} PRECS=${PRECS:-"fp32 bf16"}
THREADS=${THREADS:-2}
export OMP_WAIT_POLICY=PASSIVE # as bench/run.sh: CPU time per step counts no spinning threads
mkdir -p "$OUT"
row() { # the ms/step of a profile row (0 when absent)
    awk -v n="$1" 'index($0, "  " n " ") == 1 { for (i = NF; i > 0; i--) if ($i ~ /^[0-9.]+$/) { v = $i; break } } END { print v + 0 }' "$2"
}
for r in $(seq 1 "$ROUNDS"); do
    for cfg in $CONFIGS; do
        for isa in $ISAS; do
            for prec in $PRECS; do
                if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
                for which in $order; do
                    bin=$OLD; [ "$which" = new ] && bin=$NEW
                    tag="$cfg-$prec-$isa-$which-r$r"
                    env_isa=(); [ "$isa" = native ] || env_isa=(ONEDNN_MAX_CPU_ISA="${isa^^}")
                    env "${env_isa[@]}" "$bin" bench -c "configs/$cfg.ini" --threads "$THREADS" --steps "$STEPS" \
                        --warmup 2 --name "$cfg" --training.precision="$prec" >"$OUT/$tag.json" 2>"$OUT/$tag.txt"
                    j="$OUT/$tag.json" t="$OUT/$tag.txt"
                    printf '%s %s tok/s %s step_ms %s cpu_ms %s | norm f/b %s %s rope f/b %s %s ce f/b %s %s | load %s\n' \
                        "$(date -u +%H:%M:%S)" "$tag" "$(jq -r .tokens_per_s "$j")" "$(jq -r .step_ms_median "$j")" \
                        "$(jq -r .cpu_ms_per_step "$j")" "$(row 'rmsnorm fwd' "$t")" "$(row 'rmsnorm bwd' "$t")" \
                        "$(row 'rope fwd' "$t")" "$(row 'rope bwd' "$t")" "$(row 'cross-entropy fwd' "$t")" \
                        "$(row 'cross-entropy bwd' "$t")" "$(cut -d' ' -f1 /proc/loadavg)"
                done
            done
        done
    done
done
