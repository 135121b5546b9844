#!/usr/bin/env bash
# Activation recomputation end to end: training with training.recompute = full, selective or a
# per-layer-range mix writes the same metrics (every field but the timings) and the same weights,
# bit for bit, as training without it, with fewer activation bytes; a bad spec is refused naming
# the key. Usage: cli_recompute.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
TINY=(--model.dim=32 --model.n_layers=4 --model.n_heads=4 --model.n_kv_heads=2 --model.n_experts=4
      --model.ffn_dim=32 --model.first_k_dense=1 --model.n_shared_experts=1 --model.capacity_factor=1.25
      --model.aux_free=true --model.z_coef=0.001 --training.seq_len=32 --training.micro_batch=4
      --training.grad_accum=2 --training.warmup_steps=2 --training.steps=12 --training.threads=2
      --training.eval_every=6 --data.val_fraction=0.1 --data.path="$W/c.txt" --logging.progress=false)
# metrics without the wall-clock fields
strip() { grep -v '"event": "memory"' "$1" | sed -E 's/"(tokens_per_s|elapsed_s|step_s|data_wait_s|comm_wait_s|model_tflops|mfu|seconds|eval_s)": [0-9.e+-]*,? ?//g; s/"pp_(busy|wait)_s": \[[^]]*\],? ?//g'; }
acts() { sed -n 's/.*activations \([0-9.]*\).*/\1/p' "$1"; }

"$TERA" train "${TINY[@]}" --logging.run_dir="$W/none" > "$W/none.log" 2>&1 || { fail "run without recomputation"; cat "$W/none.log"; }
for spec in full selective full:0-1,selective:2-3; do
    d="$W/$(echo "$spec" | tr ':,' '__')"
    if ! "$TERA" train "${TINY[@]}" --training.recompute="$spec" --logging.run_dir="$d" > "$d.log" 2>&1; then
        fail "run with recompute=$spec"; cat "$d.log"; continue
    fi
    if [ "$(strip "$W/none/metrics.jsonl")" = "$(strip "$d/metrics.jsonl")" ] && [ -s "$d/metrics.jsonl" ]; then
        pass "recompute=$spec: metrics.jsonl identical ($(grep -c '"loss"' "$d/metrics.jsonl") records)"
    else
        fail "recompute=$spec: metrics differ"; diff <(strip "$W/none/metrics.jsonl") <(strip "$d/metrics.jsonl") | head -4
    fi
    cmp -s "$W/none/checkpoints/step_00000012/model.safetensors" "$d/checkpoints/step_00000012/model.safetensors" \
        && pass "recompute=$spec: final weights identical" || fail "recompute=$spec: final weights differ"
    a0=$(acts "$W/none.log"); a1=$(acts "$d.log")
    awk -v a="$a0" -v b="$a1" 'BEGIN { exit !(b > 0 && b < a) }' \
        && pass "recompute=$spec: activations $a1 MiB < $a0 MiB" || fail "recompute=$spec: activations $a1 vs $a0 MiB"
done
"$TERA" train "${TINY[@]}" --training.recompute=full:2-7 --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1 \
    && fail "bad spec accepted" \
    || { grep -q 'training.recompute = "full:2-7"' "$W/bad.log" && pass "bad spec refused: $(head -1 "$W/bad.log")" \
         || { fail "bad spec message"; cat "$W/bad.log"; }; }
finish cli_recompute
