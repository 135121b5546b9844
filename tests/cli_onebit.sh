#!/usr/bin/env bash
# 1-bit Adam end to end (optimizer.name = onebit_adam; docs/COMMUNICATION.md): the tiny MoE of
# mpilib.sh in fp32, optimizer.onebit_warmup_steps = 4, 12 steps.
# - dp 2, dp 4 x ep 2 with ZeRO-1 (edp 2), pp 2 x dp 2: the warm-up steps are AdamW's bit for bit (the same
#   run with optimizer.name = adamw), the later ones differ (the option acts), the loss decreases;
# - exact resume: a run resumed from its step-6 checkpoint (after the freeze) logs the same bits for
#   steps 6..11 and ends with the same weights as the uninterrupted run (dp 2; dp 4 x ep 2 ZeRO-1);
#   without the per-rank communication state (checkpoints/comm_state) the resume warns and differs;
# - ZeRO-2 and ZeRO-3 (after the freeze each rank's own gradient accumulates whole, no reduce-scatter):
#   with one micro-batch per step the same arithmetic as ZeRO-0/1, so every step's figures, the final
#   weights and moments are bit-identical to the ZeRO-0 run (dp 2) and the ZeRO-1 run (dp 4 x ep 2),
#   through the warm-up and after the freeze; pp 2 x dp 2 with two micro-batches under ZeRO-3 sums the
#   warm-up's gradients micro-batch by micro-batch (another order than ZeRO-0's one sum), so there the
#   losses and gradient norms agree within LAYOUT_TOL (mpilib.sh) instead; resume after the freeze is
#   bit-identical under ZeRO-2 (dp 2) and ZeRO-3 (dp 4 x ep 2);
# - parallel.grad_compression = int8: resume is bit-identical too (its residuals are in comm_state), also
#   when a save in the background is slow (TERA_CKPT_DELAY_MS); with checkpoint.keep the state of
#   exactly the kept checkpoints remains;
# - bytes (tera bench, the mean over the ranks per step, 1-bit from the second step on): at most
#   1/16 of the AdamW run's (dp 2), the gradient/momentum all-reduce at most 1/16 with dp 4 x ep 2
#   (ZeRO-1's fp32 parameter all-gather stays: docs/COMMUNICATION.md has its figures); ZeRO-2/3 (dp 2): no
#   reduce-scatter, the momentum's all-reduce at most 1/16 of AdamW's fp32 gradient all-reduce (0.07 of
#   ZeRO-2/3's reduce-scatter, half of it), the parameters' all-gathers as many bytes as AdamW's.
# Usage: cli_onebit.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TINY=("${MODEL[@]}" --training.steps=12 --training.micro_batch=2 --training.grad_accum=1 --logging.progress=false)
OB=(--optimizer.name=onebit_adam --optimizer.onebit_warmup_steps=4)

# run NAME NP ARGS...: trains into $W/NAME
run() {
    local name=$1 np=$2
    shift 2
    $MPIRUN -np "$np" "$TERA" train "${TINY[@]}" "$@" --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1 \
        || { fail "$name: run failed"; tail -5 "$W/$name.log"; return 1; }
}
# warmup_then NAME REF: steps 0-3 identical to REF's, the later ones not; the loss decreases
warmup_then() {
    local a=$W/$1/metrics.jsonl b=$W/$2/metrics.jsonl first last
    first=$(steps_of "$a" | head -1 | cut -d' ' -f2); last=$(steps_of "$a" | tail -1 | cut -d' ' -f2)
    if ! cmp -s <(steps_of "$a" | head -4) <(steps_of "$b" | head -4); then
        fail "$1: the warm-up steps differ from $2's (AdamW)"
    elif cmp -s <(steps_of "$a" | tail -8) <(steps_of "$b" | tail -8); then
        fail "$1: the steps after the warm-up equal $2's (1-bit Adam did nothing)"
    elif awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 0.5) }'; then
        pass "$1: warm-up = AdamW bit for bit, then 1-bit Adam; loss $first -> $last (AdamW $(steps_of "$b" | tail -1 | cut -d' ' -f2))"
    else
        fail "$1: the loss does not decrease: $first -> $last"
    fi
}
# resumed NAME NP ARGS...: NAME (checkpoints every 6 steps) resumed from step 6 in NAME-r matches NAME
resumed() {
    local name=$1 np=$2 D=$W/$1-r C=checkpoints/step_00000012/model.safetensors
    shift 2
    cp -r "$W/$name" "$D"
    rm -rf "$D/checkpoints/step_00000012" "$D/checkpoints/comm_state/step_00000012"
    head -6 "$W/$name/metrics.jsonl" > "$D/metrics.jsonl"
    $MPIRUN -np "$np" "$TERA" train "${TINY[@]}" "$@" --logging.run_dir="$D" --resume > "$D.log" 2>&1 \
        || { fail "$name: resume failed"; tail -5 "$D.log"; return 1; }
    if grep -q "resumed .* at step 6" "$D.log" && cmp -s <(untimed "$W/$name/metrics.jsonl") <(untimed "$D/metrics.jsonl") \
        && cmp -s "$W/$name/$C" "$D/$C"; then
        pass "$name: resumed at step 6, steps 6..11 and the final weights bit-identical"
    else
        fail "$name: the resumed run differs"; diff <(steps_of "$W/$name/metrics.jsonl") <(steps_of "$D/metrics.jsonl") | head -4
    fi
}

DP=(--parallel.dp=2)
EPL=(--parallel.dp=4 --parallel.ep=2)
EP=("${EPL[@]}" --parallel.zero=1)
PP=(--parallel.pp=2 --parallel.dp=2 --training.micro_batch=1 --training.grad_accum=2)
run adam-dp 2 "${DP[@]}" && run ob-dp 2 "${DP[@]}" "${OB[@]}" --checkpoint.every=6 && warmup_then ob-dp adam-dp
run adam-ep 4 "${EP[@]}" && run ob-ep 4 "${EP[@]}" "${OB[@]}" --checkpoint.every=6 && warmup_then ob-ep adam-ep
run adam-pp 4 "${PP[@]}" && run ob-pp 4 "${PP[@]}" "${OB[@]}" && warmup_then ob-pp adam-pp

resumed ob-dp 2 "${DP[@]}" "${OB[@]}" --checkpoint.every=6
resumed ob-ep 4 "${EP[@]}" "${OB[@]}" --checkpoint.every=6

# ZeRO-2 and ZeRO-3: the same bits as ZeRO-0/1 (one micro-batch per step), within LAYOUT_TOL with accumulation
C=checkpoints/step_00000012/model.safetensors
O=checkpoints/step_00000012/optimizer.safetensors
same_as() { # NAME REF
    if cmp -s <(untimed "$W/$1/metrics.jsonl") <(untimed "$W/$2/metrics.jsonl") && cmp -s "$W/$1/$C" "$W/$2/$C" \
        && cmp -s "$W/$1/$O" "$W/$2/$O"; then
        pass "$1: every step (warm-up and 1-bit), the final weights and moments bit-identical to $2"
    else
        fail "$1 differs from $2"; diff <(steps_of "$W/$1/metrics.jsonl") <(steps_of "$W/$2/metrics.jsonl") | head -4
    fi
}
for z in 2 3; do
    run ob-dp-z$z 2 "${DP[@]}" "${OB[@]}" --parallel.zero=$z --checkpoint.every=6 && same_as ob-dp-z$z ob-dp
    run ob-ep-z$z 4 "${EPL[@]}" "${OB[@]}" --parallel.zero=$z --checkpoint.every=6 && same_as ob-ep-z$z ob-ep
done
run ob-pp-z3 4 "${PP[@]}" "${OB[@]}" --parallel.zero=3 \
    && compare_steps "$W/ob-pp-z3/metrics.jsonl" "$W/ob-pp/metrics.jsonl" "$LAYOUT_TOL" > "$W/cmp.txt" \
    && pass "ob-pp-z3: pp 2 x dp 2 ZeRO-3 with 2 micro-batches matches ZeRO-0 ($(tail -1 "$W/cmp.txt"))" \
    || fail "ob-pp-z3 differs from ZeRO-0 beyond $LAYOUT_TOL: $(tail -2 "$W/cmp.txt")"
resumed ob-dp-z2 2 "${DP[@]}" "${OB[@]}" --parallel.zero=2 --checkpoint.every=6
resumed ob-ep-z3 4 "${EPL[@]}" "${OB[@]}" --parallel.zero=3 --checkpoint.every=6
# the residuals matter: without them the resume is not exact, and says so
D=$W/ob-dp-nostate
cp -r "$W/ob-dp" "$D" && rm -rf "$D/checkpoints/step_00000012" "$D/checkpoints/comm_state" \
    && head -6 "$W/ob-dp/metrics.jsonl" > "$D/metrics.jsonl"
$MPIRUN -np 2 "$TERA" train "${TINY[@]}" "${DP[@]}" "${OB[@]}" --checkpoint.every=6 --logging.run_dir="$D" --resume \
    > "$D.log" 2>&1 || fail "resume without comm_state failed"
grep -q "warning: --resume at step 6: 2 rank(s) have no communication state" "$D.log" \
    && ! cmp -s <(steps_of "$W/ob-dp/metrics.jsonl") <(steps_of "$D/metrics.jsonl") \
    && pass "resume without the communication state: warned, and not bit-identical (the state is what makes it exact)" \
    || fail "resume without the communication state: $(grep warning "$D.log")"
# parallel.grad_compression's residuals are saved too. On a slow disk (TERA_CKPT_DELAY_MS: every
# checkpoint I/O 50 ms late) the step-6 save is still in the background, its directory not yet made,
# when step 12's save removes the state of checkpoints retention removed: step 6's must stay.
MPIRUN="$MPIRUN -x TERA_CKPT_DELAY_MS=50" run int8 2 "${DP[@]}" --parallel.grad_compression=int8 --checkpoint.every=6
[ -f "$W/int8/checkpoints/comm_state/step_00000006/rank-00001.bin" ] \
    && pass "int8: a slow background save's communication state kept" \
    || fail "int8: step 6's communication state removed while its checkpoint was being written"
resumed int8 2 "${DP[@]}" --parallel.grad_compression=int8 --checkpoint.every=6
# retention (checkpoint.keep = 2, a save every 2 steps): the state of exactly the kept checkpoints remains
run keep 2 "${DP[@]}" --parallel.grad_compression=int8 --checkpoint.every=2 --checkpoint.keep=2
kept=$(cd "$W/keep/checkpoints" && echo step_*)
states=$(cd "$W/keep/checkpoints/comm_state" && echo step_*)
[ "$kept" = "step_00000010 step_00000012" ] && [ "$states" = "$kept" ] \
    && pass "retention: communication state of the kept checkpoints only ($states)" \
    || fail "retention: checkpoints $kept, communication state $states"

# bytes per rank per step (tera bench's comm line: the mean over the ranks; the first step is the warm-up)
bench() { # NAME NP ARGS...
    local name=$1 np=$2
    shift 2
    $MPIRUN -np "$np" "$TERA" bench "${MODEL[@]}" --training.micro_batch=1 --steps 2 --warmup 1 "$@" \
        > "$W/b-$name.json" 2> "$W/b-$name.err" || { fail "bench $name"; tail -3 "$W/b-$name.err"; }
    sed -n 's/^tera bench: comm //p' "$W/b-$name.err" > "$W/b-$name.comm"
}
total() { jq -r '.intra_bytes_per_rank_step + .inter_bytes_per_rank_step' "$W/b-$1.comm"; }
bench adam 2 "${DP[@]}" && bench ob 2 "${DP[@]}" "${OB[@]}" --optimizer.onebit_warmup_steps=1 \
    && awk -v a="$(total adam)" -v o="$(total ob)" 'BEGIN { exit !(o > 0 && o <= a / 16) }' \
    && pass "bytes per rank per step, dp 2: AdamW $(total adam), 1-bit Adam $(total ob) ($(awk -v a="$(total adam)" \
       -v o="$(total ob)" 'BEGIN { printf "%.4f", o / a }') of it, at most 1/16)" \
    || fail "1-bit Adam bytes: $(total ob) vs AdamW $(total adam)"
ar() { jq -r '.sent_allreduce' "$W/b-$1.json"; }
EP0=(--parallel.dp=4 --parallel.ep=2)
bench adam-ep 4 "${EP0[@]}" && bench ob-ep 4 "${EP0[@]}" "${OB[@]}" --optimizer.onebit_warmup_steps=1 \
    && awk -v a="$(ar adam-ep)" -v o="$(ar ob-ep)" 'BEGIN { exit !(o > 0 && o <= a / 16) }' \
    && pass "all-reduce bytes per step, dp 4 x ep 2 (rank 0; the expert exchange aside): AdamW $(ar adam-ep), 1-bit Adam $(ar ob-ep)" \
    || fail "1-bit Adam all-reduce bytes with dp 4 x ep 2: $(ar ob-ep) vs AdamW $(ar adam-ep)"

# ZeRO-2/3, dp 2: no gradient reduce-scatter after the warm-up; the momentum's all-reduce (the step's
# statistics sums included) at most 1/16 of AdamW's fp32 gradient all-reduce (the ZeRO-0 run above); the
# parameters' all-gathers (ZeRO-2: after the update, ZeRO-3: layer by layer) as AdamW's
rs() { jq -r '.sent_reduce_scatter' "$W/b-$1.json"; }
ag() { jq -r '.sent_allgather' "$W/b-$1.json"; }
for z in 2 3; do
    bench adam-z$z 2 "${DP[@]}" --parallel.zero=$z && bench ob-z$z 2 "${DP[@]}" --parallel.zero=$z "${OB[@]}" \
        --optimizer.onebit_warmup_steps=1 \
        && [ "$(rs ob-z$z)" = 0 ] && [ "$(ag ob-z$z)" = "$(ag adam-z$z)" ] \
        && awk -v a="$(ar adam)" -v o="$(ar ob-z$z)" 'BEGIN { exit !(o > 0 && o <= a / 16) }' \
        && pass "bytes per step, dp 2 ZeRO-$z: momentum all-reduce $(ar ob-z$z) ($(awk -v a="$(ar adam)" -v o="$(ar ob-z$z)" \
           'BEGIN { printf "%.4f", o / a }') of AdamW's all-reduce $(ar adam), $(awk -v r="$(rs adam-z$z)" -v o="$(ar ob-z$z)" \
           'BEGIN { printf "%.4f", o / r }') of its ZeRO-$z reduce-scatter $(rs adam-z$z)), no reduce-scatter, all-gathers $(ag ob-z$z) as AdamW's" \
        || fail "1-bit Adam ZeRO-$z bytes: all-reduce $(ar ob-z$z) (AdamW $(ar adam)), reduce-scatter $(rs ob-z$z), all-gather $(ag ob-z$z) (AdamW $(ag adam-z$z))"
done
finish cli_onebit
