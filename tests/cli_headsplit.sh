#!/usr/bin/env bash
# parallel.pp_head_split: the LM head's vocabulary split between a pipeline's first and last stage
# (src/model/head_split.c) trains the same model as one process. The tiny MoE of mpilib.sh trains 8
# steps in fp32; every step's loss and grad norm and the final weights (their validation loss) must
# agree with one rank to LAYOUT_TOL (the cross-entropy's sums over the vocabulary run in two halves, as
# with tp = 2, so not bit for bit), in:
#   - pp2 under 1F1B and under the interleaved schedule (2 chunks), pp4 (the pair is stages 0 and 3,
#     the middle stages take no part), and pp2 x dp2 with ZeRO-1 (two pairs; the head's gradient, half
#     of it from the first stage, summed over the data-parallel ranks);
#   - with tensor parallelism: pp2 x tp2 (two pairs, one per vocabulary slice; each helper serves its
#     micro-batches in phases without waiting for its owner, its stage's other tp rank possibly in a
#     collective meanwhile), and pp2 x tp2 with sequence parallelism under the interleaved schedule;
#   - bf16 products: pp2 and pp2 x tp2 with the split against the same layouts without, to the bf16
#     tolerance of cli_layouts.sh;
# and:
#   - a fixed seed gives bit-identical runs (metrics and checkpoint) with the split, with tp 1 and 2;
#   - a checkpoint of a split run resumes, with the split, to the same steps as the run that went on;
#     and the same checkpoint resumes without it (the last stage owns the whole head);
#   - evaluation (training.eval_every) runs the whole head on the last stage: the same validation loss
#     as without the split;
#   - `tera bench` shows the head's work on both ends (ops_ms_by_rank: lm head fwd on ranks 0 and 1; with
#     pp2 x tp2 on all four ranks);
#   - `tera plan` predicts a shorter step for bench-dist's pp2 with the split, and the first stage's
#     scratch bytes exactly as `tera train` counts them (also with pp2 x tp2 x sp: a quarter of the head); its
#     search tries the split (the best pp2 layout of bench-dist on 2 devices has it);
#   - refused with one message naming parallel.pp_head_split: no pipeline, GPipe, ZeRO-2, a vocabulary
#     that 2 x tp does not divide.
# Usage: cli_headsplit.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
command -v jq > /dev/null || { echo "skip: jq not installed"; exit 0; }
TOL=${TERA_LAYOUT_TOL:-$LAYOUT_TOL}
BF16_TOL=5e-4
TINY=("${MODEL[@]}" --training.steps=8)
HS=(--parallel.pp_head_split=true)
C=checkpoints/step_00000008/model.safetensors

val_loss() { "$TERA" eval --from "$1" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32 \
    --training.micro_batch=4 --training.eval_batches=4 2> /dev/null | sed 's/.*"val_loss": \([0-9.]*\).*/\1/'; }
# run NAME RANKS [ARGS...]: 8 steps of 4 sequences (micro-batches of 1) into $W/NAME
run() {
    local name=$1 n=$2
    shift 2
    if [ "$n" = 1 ]; then
        "$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 "$@" --logging.run_dir="$W/$name" \
            > "$W/$name.log" 2>&1
    else
        $MPIRUN -np "$n" "$TERA" train "${TINY[@]}" --training.micro_batch=1 "$@" --logging.run_dir="$W/$name" \
            > "$W/$name.log" 2>&1
    fi || { fail "$name: the run failed"; tail -5 "$W/$name.log"; return 1; }
}
# against NAME REF TOL WHAT: every step and the final weights of NAME against REF
against() {
    local out a b
    out=$(compare_steps "$W/$2/metrics.jsonl" "$W/$1/metrics.jsonl" "$3") && [ "$(grep -c '"loss"' "$W/$1/metrics.jsonl")" = 8 ] \
        && pass "$4: every step's loss and grad norm match ($out)" || fail "$4: differs: $out"
    a=$(val_loss "$W/$2/$(dirname $C)"); b=$(val_loss "$W/$1/$(dirname $C)")
    within "$a" "$b" "$3" && pass "$4: final weights give the same validation loss ($a vs $b)" \
        || fail "$4: final weights $a vs $b"
}

run one 1
run pp2 2 --training.grad_accum=4 --parallel.pp=2 "${HS[@]}" && against pp2 one "$TOL" "pp2 1f1b, head split"
grep -q "head split" "$W/pp2.log" && pass "the run says the head is split: $(grep -o 'head split[^|]*' "$W/pp2.log" | head -1)" \
    || fail "no word of the head split in the log"
run pp2i 2 --training.grad_accum=4 --parallel.pp=2 --parallel.pp_schedule=interleaved --parallel.pp_chunks=2 "${HS[@]}" &&
    against pp2i one "$TOL" "pp2 interleaved (2 chunks), head split"
run pp4 4 --training.grad_accum=4 --parallel.pp=4 "${HS[@]}" && against pp4 one "$TOL" "pp4 1f1b, head split (stages 0 and 3)"
run pp2dp2 4 --training.grad_accum=2 --parallel.pp=2 --parallel.dp=2 --parallel.zero=1 "${HS[@]}" &&
    against pp2dp2 one "$TOL" "pp2 x dp2 ZeRO-1, head split"

# with tensor parallelism: a pair per vocabulary slice
TP2=(--training.grad_accum=4 --parallel.pp=2 --parallel.tp=2)
TP2SP=("${TP2[@]}" --parallel.sequence_parallel=true --parallel.pp_schedule=interleaved --parallel.pp_chunks=2)
run pp2tp2 4 "${TP2[@]}" "${HS[@]}" && against pp2tp2 one "$TOL" "pp2 x tp2 1f1b, head split"
run pp2tp2sp 4 "${TP2SP[@]}" "${HS[@]}" && against pp2tp2sp one "$TOL" "pp2 x tp2, sequence-parallel, interleaved, head split"

# bf16: against the same pipeline without the split
if run pp2bf 2 --training.grad_accum=4 --parallel.pp=2 --training.precision=bf16 &&
    run pp2bfhs 2 --training.grad_accum=4 --parallel.pp=2 --training.precision=bf16 "${HS[@]}"; then
    against pp2bfhs pp2bf "$BF16_TOL" "bf16 pp2, head split against no split"
fi
if run pp2tp2bf 4 "${TP2[@]}" --training.precision=bf16 && run pp2tp2bfhs 4 "${TP2[@]}" --training.precision=bf16 "${HS[@]}"; then
    against pp2tp2bfhs pp2tp2bf "$BF16_TOL" "bf16 pp2 x tp2, head split against no split"
fi

# determinism: the same seed, the same bits
if run pp2i-again 2 --training.grad_accum=4 --parallel.pp=2 --parallel.pp_schedule=interleaved --parallel.pp_chunks=2 "${HS[@]}"; then
    cmp -s <(untimed "$W/pp2i/metrics.jsonl") <(untimed "$W/pp2i-again/metrics.jsonl") && cmp -s "$W/pp2i/$C" "$W/pp2i-again/$C" \
        && pass "two runs with the split: bit-identical metrics and final weights" \
        || fail "two runs with the split differ"
fi
if run pp2tp2sp-again 4 "${TP2SP[@]}" "${HS[@]}"; then
    cmp -s <(untimed "$W/pp2tp2sp/metrics.jsonl") <(untimed "$W/pp2tp2sp-again/metrics.jsonl") &&
        cmp -s "$W/pp2tp2sp/$C" "$W/pp2tp2sp-again/$C" \
        && pass "two pp2 x tp2 runs with the split: bit-identical metrics and final weights" \
        || fail "two pp2 x tp2 runs with the split differ"
fi

# resume: the split run's step-4 checkpoint (its step-8 one removed), resumed to step 8 with the split
# and without it; the resumed steps against the run that went on
R=(--training.grad_accum=4 --parallel.pp=2 --checkpoint.every=4 --checkpoint.async=false)
last4() { grep '"loss"' "$1" | grep -v '"event"' | tail -n 4 > "$2"; }
if run rs 2 "${R[@]}" "${HS[@]}"; then
    rm -rf "$W/rs/checkpoints/step_00000008"
    cp -r "$W/rs" "$W/rs-plain"
    $MPIRUN -np 2 "$TERA" train "${TINY[@]}" --training.micro_batch=1 "${R[@]}" "${HS[@]}" --logging.run_dir="$W/rs" --resume \
        > "$W/rs2.log" 2>&1 || { fail "resume with the split"; tail -5 "$W/rs2.log"; }
    $MPIRUN -np 2 "$TERA" train "${TINY[@]}" --training.micro_batch=1 "${R[@]}" --logging.run_dir="$W/rs-plain" --resume \
        > "$W/rs3.log" 2>&1 || { fail "resume without the split"; tail -5 "$W/rs3.log"; }
    last4 "$W/rs/metrics.jsonl" "$W/rs.last"
    last4 "$W/rs-plain/metrics.jsonl" "$W/rs-plain.last"
    out=$(compare_steps "$W/pp2/metrics.jsonl" "$W/rs.last" 0 4) \
        && pass "a split run resumed with the split: steps 5-8 bit-identical to the run that went on ($out)" \
        || fail "resumed with the split: $out"
    out=$(compare_steps "$W/pp2/metrics.jsonl" "$W/rs-plain.last" "$TOL" 4) \
        && pass "the same checkpoint resumed without the split: steps 5-8 agree ($out)" \
        || fail "resumed without the split: $out"
fi

# evaluation: the whole head on the last stage
E=(--training.grad_accum=4 --parallel.pp=2 --training.eval_every=4 --training.eval_batches=2)
if run ev 2 "${E[@]}" && run evhs 2 "${E[@]}" "${HS[@]}"; then
    a=$(grep '"val_loss"' "$W/ev/metrics.jsonl" | tail -1 | jq .val_loss)
    b=$(grep '"val_loss"' "$W/evhs/metrics.jsonl" | tail -1 | jq .val_loss)
    [ -n "$a" ] && within "$a" "$b" "$TOL" && pass "evaluation with the split: validation loss $b ($a without)" \
        || fail "evaluation with the split: '$b', without '$a'"
fi

# tera bench: the head's work on both ends of the pipeline
if $MPIRUN -np 2 "$TERA" bench "${MODEL[@]}" --training.micro_batch=1 --training.grad_accum=4 --parallel.pp=2 "${HS[@]}" \
    --steps 2 --warmup 1 > "$W/bench.json" 2> "$W/bench.err"; then
    jq -e '.ops_ms_by_rank["lm head fwd"] | length == 2 and all(.[]; . > 0)' "$W/bench.json" > /dev/null \
        && pass "tera bench: the head runs on both stages ($(jq -c '.ops_ms_by_rank["lm head fwd"]' "$W/bench.json") ms)" \
        || fail "tera bench: lm head fwd by rank $(jq -c '.ops_ms_by_rank["lm head fwd"]' "$W/bench.json")"
else
    fail "tera bench with the split"; tail -5 "$W/bench.err"
fi
if $MPIRUN -np 4 "$TERA" bench "${MODEL[@]}" --training.micro_batch=1 "${TP2[@]}" "${HS[@]}" --steps 2 --warmup 1 \
    > "$W/bench4.json" 2> "$W/bench4.err"; then
    jq -e '.ops_ms_by_rank["lm head fwd"] | length == 4 and all(.[]; . > 0)' "$W/bench4.json" > /dev/null \
        && pass "tera bench pp2 x tp2: the head runs on every rank ($(jq -c '.ops_ms_by_rank["lm head fwd"]' "$W/bench4.json") ms)" \
        || fail "tera bench pp2 x tp2: lm head fwd by rank $(jq -c '.ops_ms_by_rank["lm head fwd"]' "$W/bench4.json")"
else
    fail "tera bench pp2 x tp2 with the split"; tail -5 "$W/bench4.err"
fi

# the planner: half the head on each end (a shorter predicted step on bench-dist's pp2, whose last stage
# carries the head), and the first stage's memory as tera train counts it
PL=(plan --dry-run -c "$SRC/configs/bench-dist.ini" --hardware "$SRC/hardware/this-machine.ini" --training.micro_batch=4
    --training.grad_accum=4 --parallel.pp=2 --training.threads=1)
a=$("$TERA" "${PL[@]}" 2>&1 | grep -o '  step [0-9.e+-]*' | head -1 | awk '{ print $2 }')
b=$("$TERA" "${PL[@]}" "${HS[@]}" 2>&1 | grep -o '  step [0-9.e+-]*' | head -1 | awk '{ print $2 }')
awk -v a="$a" -v b="$b" 'BEGIN { exit !(a > 0 && b > 0 && b < a) }' \
    && pass "tera plan: bench-dist pp2 step $a s, with the split $b s" || fail "tera plan: step '$a' s, with the split '$b' s"
# the search tries the split as a dimension: on 2 devices its best pipeline layout for bench-dist
# splits the head (the last stage's head is most of a layer there), and says so
"$TERA" plan -c "$SRC/configs/bench-dist.ini" --hardware "$SRC/hardware/this-machine.ini" --devices 2 --global-batch 16 \
    --training.threads=1 --top 40 --json > "$W/search.json" 2> "$W/search.err"
if jq -e '[.best[] | select(.pp == 2)] | length > 0 and (.[0].pp_head_split == true)
          and any(.[]; .pp_head_split == false)' "$W/search.json" > /dev/null; then
    pass "tera plan's search: the best pp2 layout of bench-dist on 2 devices splits the head ($(jq -c '[.best[] | select(.pp == 2)][0] | {pp_schedule, pp_chunks, pp_head_split, micro_batch}' "$W/search.json"))"
else
    fail "tera plan's search and the head split: $(jq -c '[.best[] | select(.pp == 2) | {pp_schedule, pp_head_split}]' "$W/search.json" 2> /dev/null | head -c 300) $(head -c 200 "$W/search.err")"
fi
# mem_bytes LABEL RANKS ARGS...: the first stage's scratch bytes by tera plan and by tera train, the same
mem_bytes() {
    local label=$1 n=$2 sp st
    shift 2
    sp=$("$TERA" "${PL[@]}" "$@" 2>&1 | grep -m1 'bytes: params' | grep -o 'scratch [0-9]*')
    rm -rf "$W/mem"
    $MPIRUN -np "$n" "$TERA" train -c "$SRC/configs/bench-dist.ini" --training.steps=1 --training.micro_batch=4 \
        --training.grad_accum=4 --parallel.pp=2 --training.threads=1 "$@" --logging.run_dir="$W/mem" > "$W/mem.log" 2>&1
    st=$(grep -m1 'memory bytes per rank' "$W/mem.log" | grep -o 'scratch [0-9]*')
    [ -n "$sp" ] && [ "$sp" = "$st" ] && pass "tera plan: the first stage's $sp bytes$label, as tera train counts them" \
        || fail "tera plan's first stage '$sp', tera train's '$st'$label"
}
mem_bytes "" 2 "${HS[@]}"
mem_bytes " with pp2 x tp2 x sp" 4 --parallel.tp=2 --parallel.sequence_parallel=true "${HS[@]}"

# refusals: one message naming the key, nothing trained
for bad in "1:" "2:--parallel.pp=2 --parallel.pp_schedule=gpipe" "4:--parallel.pp=2 --parallel.tp=2 --model.vocab_size=510" \
           "4:--parallel.pp=2 --parallel.dp=2 --parallel.zero=2"; do
    n=${bad%%:*} args=${bad#*:} accum=()
    [ "$n" != 1 ] && accum=(--training.grad_accum=2)
    # shellcheck disable=SC2086
    if refused parallel.pp_head_split "$n" "${TINY[@]}" --training.micro_batch=1 ${accum[@]+"${accum[@]}"} $args "${HS[@]}"; then
        pass "refused (${args:-no pipeline}): $(grep -m1 'parallel.pp_head_split' "$W/bad.log" | cut -c1-140)"
    else
        fail "${args:-no pipeline} with the split: $(head -c 300 "$W/bad.log")"
    fi
done
finish cli_headsplit
