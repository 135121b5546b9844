#!/usr/bin/env bash
# The 400-step fidelity run (docs/PERFORMANCE.md: tinyshakespeare, D=96, L=3, H=4, E=4, k=2, F=128,
# T=64, LR 3e-3, warm-up 20, cosine, seed 1234) with each communication option
# (docs/COMMUNICATION.md), on 4 ranks as 2 emulated nodes of 2 (parallel.ranks_per_node = 2),
# micro-batch 2 per rank (the global batch of 8 of the single-process run), fp32, one thread per rank.
# The validation loss (16 batches) at steps 100 / 200 / 300 / 400 of each option against the fp32
# flat run of the same layout (dp 4; dp 4 ZeRO-1; dp 4 x ep 2; dp 4 = ep 4). The issue's margin:
# the final validation loss within 1% of fp32 flat for bf16 / fp16 / fp8, within 2% for int8 and
# 1-bit Adam. The rows s1235-* and s1236-* repeat some options with other seeds (training.seed: another
# initialisation and data order), against the fp32 flat run of that seed and layout: how far apart runs that
# differ only by chance end, which is the scale the margins are to be read against.
# Usage: bench/comm_fidelity.sh [TERA] [STEPS]   (default build/tera 400; writes
#        bench/results/comm-fidelity.jsonl; OPTIONS selects, as in bench/comm.sh; the runs' directories
#        are kept under KEEP when it is set)
set -eu
TERA=$(readlink -f "${1:-build/tera}")
STEPS=${2:-400}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.."
DATA=$(readlink -f ../shared/data/tinyshakespeare.txt)
[ -r "$DATA" ] || { echo "comm_fidelity: $DATA missing" >&2; exit 1; }
mkdir -p bench/results
W=${KEEP:-$(mktemp -d)}
mkdir -p "$W"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$W"' EXIT
EVERY=$((STEPS / 4))
WARM=$((STEPS / 20 < 20 ? STEPS / 20 : 20))   # 20 for the 400 steps; shorter runs (trials) scale it

# name : ep : zero : extra options (comma-separated); the reference of a row is the row named
# "*flat" with the same ep, zero and seed
OPTIONS=${OPTIONS:-"fp32-flat:1:0: hierarchical:1:0:--parallel.hierarchical=true
    bf16:1:0:--parallel.grad_compression=bf16 fp16:1:0:--parallel.grad_compression=fp16
    int8:1:0:--parallel.grad_compression=int8
    hier+int8:1:0:--parallel.hierarchical=true,--parallel.grad_compression=int8
    onebit-w80:1:0:--optimizer.name=onebit_adam,--optimizer.onebit_warmup_steps=80
    zero1-flat:1:1: zero1-bf16:1:1:--parallel.grad_compression=bf16
    ep2-flat:2:0: ep2-a2a-bf16:2:0:--parallel.a2a_compression=bf16 ep2-a2a-fp8:2:0:--parallel.a2a_compression=fp8
    ep4-flat:4:0: ep4-two-stage:4:0:--parallel.ep_hierarchical=true
    ep4-a2a-bf16:4:0:--parallel.a2a_compression=bf16 ep4-a2a-fp8:4:0:--parallel.a2a_compression=fp8
    ep4-two-stage+fp8:4:0:--parallel.ep_hierarchical=true,--parallel.a2a_compression=fp8
    s1235-fp32-flat:1:0:--training.seed=1235 s1235-bf16:1:0:--training.seed=1235,--parallel.grad_compression=bf16
    s1235-int8:1:0:--training.seed=1235,--parallel.grad_compression=int8
    s1235-ep4-flat:4:0:--training.seed=1235
    s1235-ep4-a2a-bf16:4:0:--training.seed=1235,--parallel.a2a_compression=bf16
    s1235-ep4-a2a-fp8:4:0:--training.seed=1235,--parallel.a2a_compression=fp8
    s1236-fp32-flat:1:0:--training.seed=1236 s1236-bf16:1:0:--training.seed=1236,--parallel.grad_compression=bf16
    s1236-int8:1:0:--training.seed=1236,--parallel.grad_compression=int8
    s1236-ep2-flat:2:0:--training.seed=1236 s1236-ep2-a2a-bf16:2:0:--training.seed=1236,--parallel.a2a_compression=bf16
    s1236-ep4-flat:4:0:--training.seed=1236
    s1236-ep4-a2a-bf16:4:0:--training.seed=1236,--parallel.a2a_compression=bf16
    s1236-ep4-a2a-fp8:4:0:--training.seed=1236,--parallel.a2a_compression=fp8"}

OUT=bench/results/comm-fidelity.jsonl
: > "$W/out.jsonl"
for o in $OPTIONS; do
    IFS=: read -r name ep zero extra <<< "$o"
    ex=()
    [ -n "$extra" ] && IFS=, read -r -a ex <<< "$extra"
    t0=$(date +%s)
    mpirun --oversubscribe -np 4 "$TERA" train --model.dim=96 --model.n_layers=3 --model.n_heads=4 \
        --model.n_experts=4 --model.ffn_dim=128 --training.seq_len=64 --training.micro_batch=2 \
        --training.steps="$STEPS" --training.warmup_steps="$WARM" --training.threads=1 --training.precision=fp32 \
        --data.path="$DATA" --data.val_fraction=0.05 --training.eval_every="$EVERY" --training.eval_batches=16 \
        --parallel.dp=4 --parallel.ep="$ep" --parallel.zero="$zero" --parallel.ranks_per_node=2 \
        ${ex[@]+"${ex[@]}"} --logging.progress=false --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1 \
        || { echo "$name: failed" >&2; tail -5 "$W/$name.log" >&2; continue; }
    t1=$(date +%s)
    # the evaluation records of metrics.jsonl (by field name), the last of each step
    seed=1234
    [[ ",$extra" == *",--training.seed="* ]] && seed=$(sed 's/.*--training\.seed=\([0-9]*\).*/\1/' <<< "$extra")
    jq -c -s --arg n "$name" --argjson ep "$ep" --argjson z "$zero" --arg x "$extra" --argjson s "$((t1 - t0))" \
        --argjson seed "$seed" 'map(select(has("val_loss"))) | group_by(.step) | map(.[-1]) |
         {option: $n, ep: $ep, zero: $z, seed: $seed, options: $x, steps: (map(.step) | max), wall_s: $s,
          val_loss: (map({key: (.step | tostring), value: .val_loss}) | from_entries),
          final_val_loss: .[-1].val_loss,
          final_train_loss: null}' "$W/$name/metrics.jsonl" > "$W/r.json"
    last=$(jq -c -s 'map(select(has("loss") and (has("event") | not))) | .[-1].loss' "$W/$name/metrics.jsonl")
    jq -c --argjson l "$last" '.final_train_loss = $l' "$W/r.json" | tee -a "$W/out.jsonl"
done
cp "$W/out.jsonl" "$OUT"
echo "wrote $OUT"

# the table: validation loss at the four evaluations (metrics.jsonl's step k is the (k+1)-th step),
# the final one against the reference
S=$(jq -r -s 'map(.val_loss | keys[]) | unique | map(tonumber) | sort | map(tostring) | join(" ")' "$OUT")
echo "| option |$(for k in $S; do printf ' after %d steps |' $((k + 1)); done) final vs fp32 flat (same layout) |"
echo "|---|$(for _ in $S; do printf -- '---|'; done)---|"
jq -r -s --arg s "$S" '. as $all | .[] | . as $o |
    ($all | map(select(.ep == $o.ep and .zero == $o.zero and .seed == $o.seed and (.option | test("flat$"))))[0]) as $r |
    "| \(.option) | " + ([($s | split(" "))[] as $k | ($o.val_loss[$k] // null) |
        if . == null then "-" else (. * 10000 | round / 10000 | tostring) end] | join(" | ")) + " | " +
    (if $r == null then "no reference" elif $r.option == .option then ""
     else "\(((.final_val_loss - $r.final_val_loss) / $r.final_val_loss * 10000 | round) / 100)%" end) + " |"' "$OUT"
