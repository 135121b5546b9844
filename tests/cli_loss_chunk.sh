#!/usr/bin/env bash
# training.loss_chunk: the LM head and the cross-entropy over R rows at a time (src/model/model.c,
# head_loss_backward). The tiny MoE of tests/mpilib.sh (micro-batches of 2 x 32 = 64 positions, R = 24:
# blocks of 24, 24 and 16) trains 8 steps with an evaluation every 4 (loss and next-token accuracy):
# - against R = 0 (all 64 rows at once): every step's loss and grad norm within LAYOUT_TOL, the same
#   validation loss and accuracy, and not bit-identical (the head's weight gradient sums over the blocks);
# - a pipeline changes no sum: pp2 (1F1B and GPipe, 2 micro-batches) with R = 24 is bit-identical to one
#   rank with R = 24 (metrics and final weights): the loss the backward computes reaches the step's loss;
# - tp2 (the vocabulary split, its sums over the ranks block by block) and dp2 ZeRO-3 (the head's
#   gathered weights and reduce-scattered gradient) with R = 24 within LAYOUT_TOL of R = 0, tp2 sending
#   the same bytes (tera bench);
# - memory: the head's logits take R rows instead of 64, exactly (64 - 24) x vocab_size x 4 bytes of
#   scratch fewer (tera plan --dry-run, the count tera train allocates by), on one rank and on pp2's last
#   stage; R >= 64 is R = 0.
# Usage: cli_loss_chunk.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TOL=$LAYOUT_TOL
TINY=("${MODEL[@]}" --training.steps=8 --training.micro_batch=2 --training.eval_every=4 --logging.progress=false)
run() { # run NAME NP ARGS...: trains into $W/NAME
    local name=$1 np=$2
    shift 2
    $MPIRUN -np "$np" "$TERA" train "${TINY[@]}" "$@" --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1 \
        || { fail "$name: run failed"; tail -5 "$W/$name.log"; return 1; }
}
evals() { grep -o '"val_\(loss\|acc\)": [0-9.e+-]*' "$1/metrics.jsonl" | cut -d' ' -f2 | tr '\n' ' '; }
weights() { echo "$W/$1/checkpoints/step_00000008/model.safetensors"; }
# close A B: every step within TOL, the same evaluations (as printed), not bit-identical
close() {
    local out ea eb
    out=$(compare_steps "$W/$1/metrics.jsonl" "$W/$2/metrics.jsonl" "$TOL")
    local ok=$?
    ea=$(evals "$W/$1"); eb=$(evals "$W/$2")
    if [ $ok != 0 ] || [ -z "$ea" ] || ! awk -v a="$ea" -v b="$eb" -v t="$TOL" 'BEGIN {
            n = split(a, x, " "); if (split(b, y, " ") != n) exit 1
            for (i = 1; i <= n; i++) { d = x[i] - y[i]; if (d < 0) d = -d; if (d > t * (x[i] < 0 ? -x[i] : x[i])) exit 1 }
            exit 0 }'; then
        fail "$2 against $1: $out; evaluations $ea / $eb"
    elif cmp -s "$(weights "$1")" "$(weights "$2")"; then
        fail "$2 against $1: bit-identical final weights (the option did nothing)"
    else
        pass "$2 against $1: $out, evaluations $eb"
    fi
}
identical() {
    if cmp -s <(untimed "$W/$1/metrics.jsonl") <(untimed "$W/$2/metrics.jsonl") && cmp -s "$(weights "$1")" "$(weights "$2")"; then
        pass "$2: bit-identical to $1 (metrics with evaluations, final weights)"
    else
        fail "$2 differs from $1"; diff <(untimed "$W/$1/metrics.jsonl") <(untimed "$W/$2/metrics.jsonl") | head -4
    fi
}

run one 1 && run one-r24 1 --training.loss_chunk=24 && close one one-r24
run one-a2 1 --training.grad_accum=2 && run one-a2-r24 1 --training.grad_accum=2 --training.loss_chunk=24 \
    && close one-a2 one-a2-r24
for s in 1f1b gpipe; do
    run "pp2-$s-r24" 2 --training.grad_accum=2 --training.loss_chunk=24 --parallel.pp=2 --parallel.pp_schedule=$s \
        && identical one-a2-r24 "pp2-$s-r24"
done
run tp2 2 --parallel.tp=2 && run tp2-r24 2 --parallel.tp=2 --training.loss_chunk=24 && close tp2 tp2-r24
run z3 2 --parallel.dp=2 --parallel.zero=3 && run z3-r24 2 --parallel.dp=2 --parallel.zero=3 --training.loss_chunk=24 \
    && close z3 z3-r24

# the same bytes under tensor parallelism (its cross-entropy sums move to the backward, block by block)
b=()
for r in 0 24; do
    b+=("$($MPIRUN -np 2 "$TERA" bench "${MODEL[@]}" --parallel.tp=2 --training.loss_chunk=$r --steps 2 --warmup 1 2> /dev/null \
          | tail -1 | python3 -c 'import json, sys; d = json.loads(sys.stdin.read()); print(d["bytes_sent_per_step"], d["min_bytes_per_step"])')")
done
[ -n "${b[0]}" ] && [ "${b[0]}" = "${b[1]}" ] && pass "tp2: the same bytes sent and minimum with loss_chunk 24 ($b)" \
    || fail "tp2 bytes: ${b[0]:-?} (0) against ${b[1]:-?} (24)"

# memory by the count tera train allocates by (tera plan --dry-run): activations + scratch of stage K
V=256 # vocab_size: MODEL's default
mem() { # mem STAGE ARGS...
    local k=$1
    shift
    "$TERA" plan --dry-run "${TINY[@]}" --model.vocab_size=$V "$@" 2>&1 \
        | awk -v k="$k" '$1 == "stage" && $2 == k "," { f = 1; next } f && / bytes: / {
              for (i = 1; i < NF; i++) { if ($i == "activations") a = $(i + 1); if ($i == "scratch") s = $(i + 1) }
              print a + s; exit }'
}
blk=$((V * 4)) # one row of logits
# one rank: [64, V] -> [24, V] of scratch; loss_chunk >= 64 is 0
m0=$(mem 0) m24=$(mem 0 --training.loss_chunk=24) m64=$(mem 0 --training.loss_chunk=64)
[ -n "$m0" ] && [ "$((m0 - m24))" = "$((40 * blk))" ] && [ "$m64" = "$m0" ] \
    && pass "one rank: activations + scratch $m0 -> $m24 bytes, (64 - 24) rows of logits fewer; loss_chunk 64 = 0" \
    || fail "one rank: $m0 -> $m24 (64: $m64), want $((40 * blk)) fewer"
# pp2's last stage: 1F1B holds one slot (its logits in scratch), GPipe two (each slot's logits [64, V]
# kept until its backward): one block of 24 rows instead; the first stage has none either way
for s in 1f1b:64 gpipe:128; do
    PP=(--training.grad_accum=2 --parallel.pp=2 --parallel.pp_schedule=${s%%:*})
    l0=$(mem 1 "${PP[@]}") l24=$(mem 1 "${PP[@]}" --training.loss_chunk=24)
    f0=$(mem 0 "${PP[@]}") f24=$(mem 0 "${PP[@]}" --training.loss_chunk=24)
    [ -n "$l0" ] && [ "$((l0 - l24))" = "$(((${s##*:} - 24) * blk))" ] && [ "$f0" = "$f24" ] \
        && pass "pp2 ${s%%:*}: the last stage $l0 -> $l24 bytes (${s##*:} rows of logits -> 24), the first $f0 either way" \
        || fail "pp2 ${s%%:*}: the last stage $l0 -> $l24, want $(((${s##*:} - 24) * blk)) fewer; the first $f0 -> $f24"
done
finish "$(basename "$0")"
