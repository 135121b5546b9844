#!/usr/bin/env bash
# A/B of the attention kernels in whole `tera bench` steps (issue 19): for each round, configuration,
# precision and thread count, the old and the new variant back to back, the order swapped every
# round, so that the other jobs of a shared machine load both alike. A variant is a binary plus an
# optional environment (TERA_ATTN_FP32=sgemm selects the sgemm attention kernels that the AVX-512
# ones replaced; TERA_ATTN_BF16=0 keeps bf16 runs on the fp32 attention). Prints one line per run
# (tokens/s, median step, the profile's attention rows) and keeps each run's stdout/stderr in OUT.
# Usage: bench/attn_ab.sh OLD NEW OUT [ROUNDS] [STEPS]
#   env OLD_ENV="TERA_ATTN_FP32=sgemm" NEW_ENV="", CONFIGS="bench-s bench-m", PRECS="fp32 bf16",
#   THREADS="1 2"
# e.g. (one binary, the kernels before and after):
#   OLD_ENV=TERA_ATTN_FP32=sgemm bench/attn_ab.sh build/tera build/tera /tmp/attn_ab 5 6
set -euo pipefail
OLD=$1 NEW=$2 OUT=$3 ROUNDS=${4:-5} STEPS=${5:-6}
OLD_ENV=${OLD_ENV-TERA_ATTN_FP32=sgemm} NEW_ENV=${NEW_ENV-}
CONFIGS=${CONFIGS:-"bench-s bench-m"} PRECS=${PRECS:-"fp32 bf16"} THREADS=${THREADS:-"1 2"}
export OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
row() { # the ms/step of a profile row (0 when absent)
    awk -v n="$1" 'index($0, "  " n " ") == 1 { for (i = NF; i > 0; i--) if ($i ~ /^[0-9.]+$/) { v = $i; break } } END { print v + 0 }' "$2"
}
for r in $(seq 1 "$ROUNDS"); do
    for cfg in $CONFIGS; do
        for prec in $PRECS; do
            for thr in $THREADS; do
                if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
                for which in $order; do
                    bin=$OLD envs=$OLD_ENV
                    [ "$which" = new ] && bin=$NEW envs=$NEW_ENV
                    tag="$cfg-$prec-t$thr-$which-r$r"
                    # shellcheck disable=SC2086
                    env $envs "$bin" bench -c "configs/$cfg.ini" --threads "$thr" --steps "$STEPS" --warmup 2 \
                        --name "$cfg" --training.precision="$prec" >"$OUT/$tag.json" 2>"$OUT/$tag.txt"
                    j="$OUT/$tag.json" t="$OUT/$tag.txt"
                    printf '%s %s tok/s %s step_ms %s | attention f/b %s %s | loss %s | load %s\n' \
                        "$(date -u +%H:%M:%S)" "$tag" "$(jq -r .tokens_per_s "$j")" "$(jq -r .step_ms_median "$j")" \
                        "$(row 'attention fwd' "$t")" "$(row 'attention bwd' "$t")" "$(jq -r .final_loss "$j")" \
                        "$(cut -d' ' -f1 /proc/loadavg)"
                done
            done
        done
    done
done
