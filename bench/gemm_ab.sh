#!/usr/bin/env bash
# Whole fp32 steps of one configuration, four variants alternating round by round (the order rotated
# every round), for the fp32 product paths of src/kernels/cpu/matmul.c (docs/PERFORMANCE.md, issue 19):
#   old     OLD_TERA (the tree before, e.g. build/tera)
#   new     NEW_TERA as it runs (weight gradients in primitive pieces, TN tiles by rows)
#   nopiece NEW_TERA with TERA_GEMM_PIECES=0 (the previous tree's products in the new binary)
#   onednn  NEW_TERA with TERA_GEMM_TILES=0 (oneDNN's own threading: numbers depend on the threads)
# One JSON line per run: variant, round, step_ms_median, cpu_ms_per_step and the product rows of the
# profile (ms per step); then the medians over the rounds per variant.
# Usage: bench/gemm_ab.sh NEW_TERA OLD_TERA CONFIG THREADS [ROUNDS] [STEPS]
#   e.g. bench/gemm_ab.sh build-tiles/tera build/tera configs/bench-m.ini 2 3 4
set -u
NEW=$1 OLD=$2 CFG=$3 THREADS=$4 ROUNDS=${5:-3} STEPS=${6:-4}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
variants=(old new nopiece onednn)
run() { # variant round
    local v=$1 r=$2 bin=$NEW envs=()
    case $v in
        old) bin=$OLD ;;
        nopiece) envs=(TERA_GEMM_PIECES=0) ;;
        onednn) envs=(TERA_GEMM_TILES=0) ;;
    esac
    env "${envs[@]}" OMP_WAIT_POLICY=PASSIVE "$bin" bench -c "$CFG" --steps "$STEPS" --warmup 1 --threads "$THREADS" \
        --training.precision=fp32 > "$OUT/$v.$r.txt" 2>&1 || { echo "{\"variant\": \"$v\", \"error\": true}"; return; }
    awk -v v="$v" -v r="$r" '
        /^  (expert ffn|lm head|qkv proj|o proj|router) (fwd|bwd) / {
            n = $1; for (i = 2; i <= NF - 2; i++) n = n " " $i
            rows = rows sprintf(", \"%s\": %s", n, $(NF - 1)) }
        /^\{/ { line = $0 }
        END {
            match(line, /"step_ms_median": [0-9.]+/); s = substr(line, RSTART + 18, RLENGTH - 18)
            match(line, /"cpu_ms_per_step": [0-9.]+/); c = substr(line, RSTART + 19, RLENGTH - 19)
            printf("{\"variant\": \"%s\", \"round\": %d, \"step_ms_median\": %s, \"cpu_ms_per_step\": %s%s}\n", v, r, s, c, rows)
        }' "$OUT/$v.$r.txt"
}
echo "# $(date -u +%H:%M:%S) $CFG, $THREADS threads, $ROUNDS rounds x $STEPS steps; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 0; r < ROUNDS; r++)); do
    for ((i = 0; i < ${#variants[@]}; i++)); do
        run "${variants[(i + r) % ${#variants[@]}]}" "$r"
    done
done | tee "$OUT/all.jsonl"
echo "# $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg); medians over the rounds:"
for v in "${variants[@]}"; do
    jq -s -c --arg v "$v" '[.[] | select(.variant == $v and (.error | not))] as $r
        | def med(f): ([$r[] | f | select(. != null)] | sort | if length == 0 then null
            elif length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end);
        {variant: $v, step_ms_median: med(.step_ms_median), cpu_ms_per_step: med(.cpu_ms_per_step),
         "lm head bwd": med(.["lm head bwd"]), "expert ffn bwd": med(.["expert ffn bwd"]),
         "expert ffn fwd": med(.["expert ffn fwd"]), "qkv proj bwd": med(.["qkv proj bwd"]),
         "o proj bwd": med(.["o proj bwd"])}' "$OUT/all.jsonl"
done
