#!/usr/bin/env bash
# parallel.pp_defer_wgrad: the LM head's weight gradient deferred into a pipeline's gaps (src/model/wgrad.c;
# the last stage computes its queue at the step's end, the head split's first stage in its waits). The
# same products run in the same order, so a deferred run must be bit-identical to the same layout
# without it: every step's metrics and the final weights, in fp32, for
#   - pp2 1F1B (the whole head's gradient on the last stage, 4 entries: all micro-batches);
#   - pp2 with the head split (both ends defer);
#   - pp2 interleaved (2 chunks) with the split and 2 entries for 4 micro-batches (a full queue runs its
#     oldest product at once);
#   - pp4 with the split (stages 0 and 3; the middle stages have no queue);
#   - pp2 x dp2 ZeRO-1 with the split and 1 entry (the head's gradient handed to the data-parallel sums
#     only once the queue is through);
#   - pp2 x tp2 (each rank's vocabulary slice), and pp2 x tp2 interleaved (2 chunks) with the split and 2
#     entries (the helpers serving in phases, queueing their halves of the slices);
# and in bf16 (pp2 with the split). Also:
#   - the runs say where the deferred products ran (stage 0 in its waits, the last stage at the end),
#     and `tera bench` reports it per stage (pp_stage_wgrad_in_waits_ms, pp_stage_wgrad_at_end_ms);
#   - `tera plan` counts the queues' bytes as `tera train` does (the first stage's scratch with the
#     split), predicts a shorter step for bench-dist's pp2 (with and without the split), and its search
#     picks the deferral for bench-dist's best pp2 layout on 2 devices;
#   - refused with one message naming parallel.pp_defer_wgrad: no pipeline, ZeRO-2, a loss chunk.
# Usage: cli_deferwgrad.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
command -v jq > /dev/null || { echo "skip: jq not installed"; exit 0; }
TINY=("${MODEL[@]}" --training.steps=6 --training.micro_batch=1 --checkpoint.async=false)
HS=(--parallel.pp_head_split=true)
C=checkpoints/step_00000006/model.safetensors

# run NAME RANKS [ARGS...]: 6 steps into $W/NAME
run() {
    local name=$1 n=$2
    shift 2
    $MPIRUN -np "$n" "$TERA" train "${TINY[@]}" "$@" --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1 \
        || { fail "$name: the run failed"; tail -5 "$W/$name.log"; return 1; }
}
# same NAME WHAT RANKS DEFER [ARGS...]: the layout with and without deferral, bit for bit
same() {
    local name=$1 what=$2 n=$3 defer=$4
    shift 4
    run "$name" "$n" "$@" && run "$name-d" "$n" "$@" --parallel.pp_defer_wgrad="$defer" || return 1
    if [ "$(grep -c '"loss"' "$W/$name-d/metrics.jsonl")" = 6 ] &&
        cmp -s <(untimed "$W/$name/metrics.jsonl") <(untimed "$W/$name-d/metrics.jsonl") &&
        cmp -s "$W/$name/$C" "$W/$name-d/$C"; then
        pass "$what, $defer deferred: bit-identical metrics and final weights"
    else
        fail "$what, $defer deferred: differs from the run without"
    fi
}

same pp2 "pp2 1f1b" 2 4 --training.grad_accum=4 --parallel.pp=2
same pp2hs "pp2 1f1b, head split" 2 4 --training.grad_accum=4 --parallel.pp=2 "${HS[@]}"
same pp2i "pp2 interleaved (2 chunks), head split" 2 2 --training.grad_accum=4 --parallel.pp=2 \
    --parallel.pp_schedule=interleaved --parallel.pp_chunks=2 "${HS[@]}"
same pp4 "pp4 1f1b, head split" 4 4 --training.grad_accum=4 --parallel.pp=4 "${HS[@]}"
same pp2dp2 "pp2 x dp2 ZeRO-1, head split" 4 1 --training.grad_accum=2 --parallel.pp=2 --parallel.dp=2 \
    --parallel.zero=1 "${HS[@]}"
same pp2tp2 "pp2 x tp2" 4 3 --training.grad_accum=4 --parallel.pp=2 --parallel.tp=2
same pp2tp2hs "pp2 x tp2 interleaved (2 chunks), head split" 4 2 --training.grad_accum=4 --parallel.pp=2 --parallel.tp=2 \
    --parallel.pp_schedule=interleaved --parallel.pp_chunks=2 "${HS[@]}"
same pp2bf "bf16 pp2, head split" 2 4 --training.grad_accum=4 --parallel.pp=2 --training.precision=bf16 "${HS[@]}"

# where they ran: the first stage in its waits, the last at the step's end
l0=$(grep -m1 'pipeline stage 0: deferred' "$W/pp2hs-d.log")
l1=$(grep -m1 'pipeline stage 1: deferred' "$W/pp2hs-d.log")
# (6 steps of 4 micro-batches: stage 0 in its waits where they come in time, the rest at the end; stage 1
# all at the end)
n() { echo "$1" | sed -n "s/.*gradients: \([0-9]*\) in waits, \([0-9]*\) at.*/\\$2/p"; }
[ "$(( $(n "$l0" 1) + $(n "$l0" 2) ))" = 24 ] && [ "$(n "$l1" 1)" = 0 ] && [ "$(n "$l1" 2)" = 24 ] \
    && pass "the run says where: ${l0#tera: } / ${l1#tera: }" || fail "where the deferred products ran: '$l0' '$l1'"
grep -q 'deferred head weight' "$W/pp2hs.log" && fail "a run without deferral reports deferred products" \
    || pass "a run without deferral reports none"

# tera bench: per stage, the deferred products' ms in waits and at the end
B=(bench "${MODEL[@]}" --training.micro_batch=1 --training.grad_accum=4 --parallel.pp=2 "${HS[@]}" --steps 2 --warmup 1)
if $MPIRUN -np 2 "$TERA" "${B[@]}" --parallel.pp_defer_wgrad=4 > "$W/bench.json" 2> "$W/bench.err" &&
    $MPIRUN -np 2 "$TERA" "${B[@]}" > "$W/bench0.json" 2> "$W/bench0.err"; then
    jq -e '.pp_defer_wgrad == 4 and .pp_stage_wgrad_in_waits_ms[1] == 0 and (.pp_stage_wgrad_at_end_ms | length == 2)' \
        "$W/bench.json" > /dev/null \
        && pass "tera bench: in waits $(jq -c .pp_stage_wgrad_in_waits_ms "$W/bench.json") ms, at the end $(jq -c .pp_stage_wgrad_at_end_ms "$W/bench.json") ms a step" \
        || fail "tera bench with deferral: $(jq -c '{pp_defer_wgrad, pp_stage_wgrad_in_waits_ms, pp_stage_wgrad_at_end_ms}' "$W/bench.json")"
    jq -e '.pp_defer_wgrad == 0 and (.pp_stage_wgrad_in_waits_ms + .pp_stage_wgrad_at_end_ms | all(. == 0))' \
        "$W/bench0.json" > /dev/null && pass "tera bench without deferral: none" \
        || fail "tera bench without deferral: $(jq -c '{pp_stage_wgrad_in_waits_ms, pp_stage_wgrad_at_end_ms}' "$W/bench0.json")"
else
    fail "tera bench with deferral"; tail -5 "$W/bench.err"
fi

# the planner: the queues' bytes as tera train counts them (the first stage, with the split), and a
# shorter predicted step for bench-dist's pp2 (the head's weight gradient off the last stage's path)
PL=(plan --dry-run -c "$SRC/configs/bench-dist.ini" --hardware "$SRC/hardware/this-machine.ini" --training.micro_batch=4
    --training.grad_accum=4 --parallel.pp=2 --training.threads=1)
DW=(--parallel.pp_defer_wgrad=4)
sp=$("$TERA" "${PL[@]}" "${HS[@]}" "${DW[@]}" 2>&1 | grep -m1 'bytes: params' | grep -o 'scratch [0-9]*')
s0=$("$TERA" "${PL[@]}" "${HS[@]}" 2>&1 | grep -m1 'bytes: params' | grep -o 'scratch [0-9]*')
$MPIRUN -np 2 "$TERA" train -c "$SRC/configs/bench-dist.ini" --training.steps=1 --training.micro_batch=4 \
    --training.grad_accum=4 --parallel.pp=2 --training.threads=1 "${HS[@]}" "${DW[@]}" --logging.run_dir="$W/mem" \
    > "$W/mem.log" 2>&1
st=$(grep -m1 'memory bytes per rank' "$W/mem.log" | grep -o 'scratch [0-9]*')
# 4 entries of [4 x 256 rows, 2048 logits] and [1024, 256] inputs
[ -n "$sp" ] && [ "$sp" = "$st" ] && [ $((${sp#scratch } - ${s0#scratch })) = $((4 * (1024 * 2048 + 1024 * 256) * 4)) ] \
    && pass "tera plan: the first stage's $sp bytes with the queue, as tera train counts them" \
    || fail "tera plan's first stage '$sp' ('$s0' without the queue), tera train's '$st'"
for hs in "" "${HS[*]}"; do
    # shellcheck disable=SC2086
    a=$("$TERA" "${PL[@]}" $hs 2>&1 | grep -o '  step [0-9.e+-]*' | head -1 | awk '{ print $2 }')
    # shellcheck disable=SC2086
    b=$("$TERA" "${PL[@]}" $hs "${DW[@]}" 2>&1 | grep -o '  step [0-9.e+-]*' | head -1 | awk '{ print $2 }')
    awk -v a="$a" -v b="$b" 'BEGIN { exit !(a > 0 && b > 0 && b < a) }' \
        && pass "tera plan: bench-dist pp2${hs:+ with the split}: step $a s, deferred $b s" \
        || fail "tera plan${hs:+ with the split}: step '$a' s, deferred '$b' s"
done

# the search tries it as a dimension: on 2 devices its best pipeline layout for bench-dist defers (every
# micro-batch's entry), layouts without a pipeline never do
"$TERA" plan -c "$SRC/configs/bench-dist.ini" --hardware "$SRC/hardware/this-machine.ini" --devices 2 --global-batch 16 \
    --training.threads=1 --top 40 --json > "$W/search.json" 2> "$W/search.err"
if jq -e '[.best[] | select(.pp == 2)] as $p | ($p | length > 0) and ($p[0].pp_defer_wgrad == 16 / $p[0].micro_batch)
          and any($p[]; .pp_defer_wgrad == 0) and all(.best[] | select(.pp == 1); .pp_defer_wgrad == 0)' \
    "$W/search.json" > /dev/null; then
    pass "tera plan's search: the best pp2 layout of bench-dist on 2 devices defers ($(jq -c '[.best[] | select(.pp == 2)][0] | {pp_schedule, pp_chunks, pp_head_split, pp_defer_wgrad, micro_batch}' "$W/search.json"))"
else
    fail "tera plan's search and the deferral: $(jq -c '[.best[] | {pp, pp_defer_wgrad}]' "$W/search.json" 2> /dev/null | head -c 300) $(head -c 200 "$W/search.err")"
fi

# refusals: one message naming the key, nothing trained
for bad in "1:" "4:--parallel.pp=2 --parallel.dp=2 --parallel.zero=2" "2:--parallel.pp=2 --training.loss_chunk=8"; do
    n=${bad%%:*} args=${bad#*:}
    # shellcheck disable=SC2086
    if refused parallel.pp_defer_wgrad "$n" "${TINY[@]}" --training.grad_accum=2 $args --parallel.pp_defer_wgrad=2; then
        pass "refused (${args:-no pipeline}): $(grep -m1 'parallel.pp_defer_wgrad' "$W/bad.log" | cut -c1-140)"
    else
        fail "${args:-no pipeline} with deferral: $(head -c 300 "$W/bad.log")"
    fi
done
finish cli_deferwgrad
