#!/usr/bin/env bash
# Gradients stored, not cleared (include/tera/model.h tera_model_grads_stale): between steps nothing
# clears the gradient buffer (ZeRO-0/1), nor a ZeRO-2/3 staging slot when a group binds it (only the
# alignment gaps between its tensors); the first backward of each group stores its weight gradients
# (products with dw_beta 0, which must not read the old values) and zeroes first only what it adds
# into (norm weights, the embedding table, experts no row reaches). Checked on every path that
# writes gradients: for each layout below, a run whose stale gradients are all set to NaN before every
# step (TERA_TEST_STALE_NAN=1: any value read from them would show) ends with checkpoints byte-identical
# to the run that clears them (TERA_GRADS_CLEARED=1, the old way), and with the same per-step losses and
# gradient norms. The model has more experts than a micro-batch has rows (48 experts, top-1, 32 tokens:
# most experts get no row in a micro-batch, some get rows only in the second one), two micro-batches per
# step, shared and dense layers, capacity with drops; layouts: one rank in fp32 and in bf16, tied
# embeddings, dp2 ZeRO-0 (bucketed sums during backward), ZeRO-1, ZeRO-2, ZeRO-3 with tied embeddings (the
# embedding's slot bound at the head), tp2 (the backward's split products), ep2 (expert blocks from each
# rank: an expert's gradient written by several blocks) and ep2 under ZeRO-3, a 2-stage pipeline, and
# ZeRO-2 with int8-compressed sums on a model whose tensors leave alignment gaps in the slots.
# Where one replica holds each expert under ZeRO-0 (one rank, bf16, tied, tp2, ep2, pp2) the experts no
# row reaches are marked, not zeroed (include/tera/model.h tera_model_grads_sparse): their NaN stays in
# the buffer for the whole step, so these cases also check that the optimizer never reads them.
# Usage: cli_grads.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
A=("${MODEL[@]}" --model.n_experts=48 --model.top_k=1 --training.steps=4 --training.micro_batch=1
   --training.grad_accum=2 --checkpoint.every=4 --logging.progress=false)
ck() { echo "$1/checkpoints/step_00000004"; }

# case NAME NP ARGS...: the cleared run and the NaN-stale run, compared
case_() {
    local name=$1 np=$2
    shift 2
    local run=("$TERA")
    [ "$np" -gt 1 ] && run=($MPIRUN -np "$np" "$TERA")
    TERA_GRADS_CLEARED=1 "${run[@]}" train "${A[@]}" "$@" --logging.run_dir="$W/$name-c" > "$W/$name-c.log" 2>&1 \
        || { fail "$name: cleared run"; tail -5 "$W/$name-c.log"; return; }
    TERA_TEST_STALE_NAN=1 "${run[@]}" train "${A[@]}" "$@" --logging.run_dir="$W/$name-n" > "$W/$name-n.log" 2>&1 \
        || { fail "$name: stale-NaN run"; tail -5 "$W/$name-n.log"; return; }
    grep -q "TERA_TEST_STALE_NAN" "$W/$name-n.log" || { fail "$name: the stale gradients were not poisoned (not stored?)"; return; }
    local c n
    c=$(ck "$W/$name-c"); n=$(ck "$W/$name-n")
    if [ -f "$c/model.safetensors" ] && cmp -s "$c/model.safetensors" "$n/model.safetensors" \
        && cmp -s "$c/optimizer.safetensors" "$n/optimizer.safetensors"; then
        pass "$name: weights and moments byte-identical to clearing the gradients"
    else
        fail "$name: checkpoints differ from the cleared run"
    fi
    compare_steps "$W/$name-c/metrics.jsonl" "$W/$name-n/metrics.jsonl" 0 > "$W/$name.cmp" \
        && pass "$name: losses and gradient norms identical ($(cat "$W/$name.cmp"))" \
        || fail "$name: per-step metrics differ: $(cat "$W/$name.cmp")"
}

case_ one 1
case_ bf16 1 --training.precision=bf16
case_ tied 1 --model.tie_embeddings=true
case_ dp2-zero0 2 --parallel.dp=2
case_ dp2-zero1 2 --parallel.dp=2 --parallel.zero=1
case_ dp2-zero2 2 --parallel.dp=2 --parallel.zero=2
case_ dp2-zero3-tied 2 --parallel.dp=2 --parallel.zero=3 --model.tie_embeddings=true
case_ ep2-zero3 2 --parallel.dp=2 --parallel.ep=2 --parallel.zero=3
# width 40: 8 floats of alignment gap after each norm weight, inside the slot's range that is summed;
# int8 compression scales blocks of 256 values, so a NaN left in a gap would spoil its neighbours
GAPS=(--model.dim=40 --model.n_heads=4 --model.n_kv_heads=2)
case_ zero2-int8-gaps 2 "${GAPS[@]}" --parallel.dp=2 --parallel.zero=2 --parallel.grad_compression=int8
case_ tp2 2 --parallel.tp=2
case_ ep2 2 --parallel.dp=2 --parallel.ep=2
case_ pp2 2 --parallel.pp=2

# the lazy path is the default: without either variable the run equals the cleared one too
"$TERA" train "${A[@]}" --logging.run_dir="$W/def" > "$W/def.log" 2>&1 || fail "default run"
cmp -s "$(ck "$W/def")/model.safetensors" "$(ck "$W/one-c")/model.safetensors" \
    && pass "default run (gradients stored) byte-identical to the cleared run" || fail "default run differs"
finish cli_grads
