#!/usr/bin/env bash
# Training options of issue 20 through the command line:
# - model.balance_loss = switch_global | importance_load: every layout below trains the same model as
#   one rank (dp2 x ep2 and tp2 to LAYOUT_TOL, pp2 bit for bit), and the balancing loss differs from
#   the default per-sequence one; switch_dp under dp2 and dp2 x ep2 trains the model one rank trains
#   with switch_global on the whole batch (and switch_global under dp2 does not);
# - training.lr_schedule = wsd / linear: the LR of every step in metrics.jsonl against the formula of
#   docs/SCHEDULES.md (computed here in awk);
# - training.loss_scaling = fixed: fp16 keeps training.loss_scale on every step, also across a
#   non-finite step (skipped) where the dynamic scaler halves it;
# - evaluation: metrics.jsonl's eval lines carry val_loss, val_ppl = exp(val_loss) and val_acc in
#   [0, 1], the same lines under pp2; tera eval prints val_acc, the same under tp2 (the argmax over the
#   vocabulary slices);
#   step lines carry aux_loss_weighted = aux_coef x aux_loss and z_loss_weighted = z_coef x z_loss.
# Usage: cli_train_options.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TINY=("${MODEL[@]}" --training.steps=6 --model.aux_coef=0.1)

# 1. balancing losses under parallel layouts
for kind in switch_global importance_load; do
    B=(--model.balance_loss=$kind)
    "$TERA" train "${TINY[@]}" "${B[@]}" --training.micro_batch=2 --training.grad_accum=2 \
        --logging.run_dir="$W/one-$kind" > "$W/one-$kind.log" 2>&1 || { fail "$kind one rank"; tail -3 "$W/one-$kind.log"; }
    run() { # run NAME NP ARGS...: a layout against the one-rank run
        local name=$1 np=$2 tol=$3
        shift 3
        $MPIRUN -np "$np" "$TERA" train "${TINY[@]}" "${B[@]}" --training.micro_batch=2 "$@" \
            --logging.run_dir="$W/$name-$kind" > "$W/$name-$kind.log" 2>&1 || { fail "$kind $name"; tail -3 "$W/$name-$kind.log"; }
        compare_steps "$W/one-$kind/metrics.jsonl" "$W/$name-$kind/metrics.jsonl" "$tol" \
            && pass "$kind: $name trains as one rank" || fail "$kind: $name differs from one rank"
    }
    run dp2ep2 2 "$LAYOUT_TOL" --parallel.dp=2 --parallel.ep=2
    run tp2 2 "$LAYOUT_TOL" --training.grad_accum=2 --parallel.tp=2
    run pp2 2 0 --training.grad_accum=2 --parallel.pp=2
    a=$(fields "$W/one-$kind/metrics.jsonl" step aux_loss | head -1 | cut -d' ' -f2)
    echo "$kind: aux_loss of step 0 = $a"
done
"$TERA" train "${TINY[@]}" --training.micro_batch=2 --training.grad_accum=2 --logging.run_dir="$W/switch" \
    > "$W/switch.log" 2>&1 || fail "switch one rank"
s=$(fields "$W/switch/metrics.jsonl" step aux_loss | head -1 | cut -d' ' -f2)
g=$(fields "$W/one-switch_global/metrics.jsonl" step aux_loss | head -1 | cut -d' ' -f2)
i=$(fields "$W/one-importance_load/metrics.jsonl" step aux_loss | head -1 | cut -d' ' -f2)
awk -v s="$s" -v g="$g" -v i="$i" 'BEGIN { exit !(s != g && s != i && g > 0 && i > 0) }' \
    && pass "the three balancing losses differ at step 0 ($s, $g, $i)" || fail "balancing losses: $s $g $i"

# switch_dp: expert fractions over the data-parallel ranks' micro-batches. dp2 (and dp2 x ep2) with
# micro-batches of 2 train the model one rank trains on micro-batches of 4 with switch_global (aux_loss
# included); switch_global under dp2 does not (each rank counts its own tokens)
"$TERA" train "${TINY[@]}" --model.balance_loss=switch_global --training.micro_batch=4 \
    --logging.run_dir="$W/one-mb4" > "$W/one-mb4.log" 2>&1 || { fail "switch_global micro-batch 4"; tail -3 "$W/one-mb4.log"; }
aux_of() { fields "$1/metrics.jsonl" step aux_loss | awk '{ print $2 }' | paste -sd' '; }
for lay in "dp2:--parallel.dp=2" "dp2ep2:--parallel.dp=2 --parallel.ep=2"; do
    name=${lay%%:*}
    $MPIRUN -np 2 "$TERA" train "${TINY[@]}" --model.balance_loss=switch_dp --training.micro_batch=2 ${lay#*:} \
        --logging.run_dir="$W/dp-$name" > "$W/dp-$name.log" 2>&1 || { fail "switch_dp $name"; tail -3 "$W/dp-$name.log"; }
    out=$(compare_steps "$W/one-mb4/metrics.jsonl" "$W/dp-$name/metrics.jsonl" "$LAYOUT_TOL") \
        && paste <(fields "$W/one-mb4/metrics.jsonl" aux_loss) <(fields "$W/dp-$name/metrics.jsonl" aux_loss) \
            | awk -v t="$LAYOUT_TOL" '{ d = $1 - $2; if (d < 0) d = -d; if (d > t * $1) bad = 1; n++ } END { exit bad || !n }' \
        && pass "switch_dp $name trains as one rank with the whole batch ($out; aux_loss too)" \
        || fail "switch_dp $name: $out; aux one rank $(aux_of "$W/one-mb4"), $name $(aux_of "$W/dp-$name")"
done
$MPIRUN -np 2 "$TERA" train "${TINY[@]}" --model.balance_loss=switch_global --training.micro_batch=2 --parallel.dp=2 \
    --logging.run_dir="$W/dp-global" > "$W/dp-global.log" 2>&1 || fail "switch_global dp2"
[ "$(aux_of "$W/dp-global")" != "$(aux_of "$W/one-mb4")" ] \
    && pass "switch_global under dp2 differs from the whole batch's ($(aux_of "$W/dp-global") vs $(aux_of "$W/one-mb4"))" \
    || fail "switch_global under dp2 equals the whole batch's: switch_dp tests nothing"

# weighted router losses: aux_coef x aux_loss and z_coef x z_loss (coefficients 0.1 and 0.001)
fields "$W/switch/metrics.jsonl" aux_loss aux_loss_weighted z_loss z_loss_weighted |
    awk '{ n++; if ($1 == "-" || $2 == "-" || $3 == "-" || $4 == "-") bad = 1
           d1 = $2 - 0.1 * $1; d2 = $4 - 0.001 * $3; if (d1 < 0) d1 = -d1; if (d2 < 0) d2 = -d2
           if (d1 > 1e-6 * $2 || d2 > 1e-6 * $4) bad = 1 } END { exit bad || n == 0 }' \
    && pass "aux_loss_weighted = 0.1 aux_loss, z_loss_weighted = 0.001 z_loss" || fail "weighted router losses"

# 2. LR schedules against the formulas (S 10, W 2, lr 1e-3, min_lr 1e-4)
lr_check() { # lr_check NAME AWK-EXPRESSION-OF-s
    "$TERA" train "${TINY[@]}" --training.steps=10 --training.micro_batch=2 --training.lr=1e-3 --training.min_lr=1e-4 \
        "${@:3}" --logging.run_dir="$W/lr-$1" > "$W/lr-$1.log" 2>&1 || { fail "lr $1"; tail -3 "$W/lr-$1.log"; }
    fields "$W/lr-$1/metrics.jsonl" step lr | awk -v name="$1" '
        { s = $1; '"$2"'; n++; d = $2 - want; if (d < 0) d = -d
          if (d > 1e-6 * want) { bad = 1; print name " step " s ": lr " $2 ", want " want } }
        END { exit bad || n != 10 }' && pass "lr_schedule $1 follows its formula" || fail "lr_schedule $1"
}
# wsd, decay_fraction 0.3: stable until D0 = 7, then linear / 1 - sqrt over q = (s - 7) / 3
lr_check wsd 'want = s < 2 ? 1e-3 * (s + 1) / 2 : (s < 7 ? 1e-3 : 1e-4 + 9e-4 * (1 - (s - 7) / 3))' \
    --training.warmup_steps=2 --training.lr_schedule=wsd --training.decay_fraction=0.3
lr_check wsd-sqrt 'want = s < 2 ? 1e-3 * (s + 1) / 2 : (s < 7 ? 1e-3 : 1e-4 + 9e-4 * (1 - sqrt((s - 7) / 3)))' \
    --training.warmup_steps=2 --training.lr_schedule=wsd --training.decay_fraction=0.3 --training.decay_shape=sqrt
lr_check linear 'want = s < 2 ? 1e-3 * (s + 1) / 2 : 1e-4 + 9e-4 * (1 - (s - 2) / 8)' \
    --training.warmup_steps=2 --training.lr_schedule=linear
lr_check warmup-all 'want = 1e-3 * (s + 1) / 10' --training.warmup_steps=10 --training.lr_schedule=wsd

# 3. fp16 with a fixed loss scale: 1024 on every step, through a NaN step that is skipped
F16=(--training.precision=fp16 --training.loss_scale=1024 --training.micro_batch=2 --training.steps=6)
TERA_FAULT_NAN_STEP=2 "$TERA" train "${TINY[@]}" "${F16[@]}" --training.loss_scaling=fixed \
    --logging.run_dir="$W/fixed" > "$W/fixed.log" 2>&1 || { fail "fp16 fixed"; tail -3 "$W/fixed.log"; }
TERA_FAULT_NAN_STEP=2 "$TERA" train "${TINY[@]}" "${F16[@]}" --logging.run_dir="$W/dyn" > "$W/dyn.log" 2>&1 \
    || { fail "fp16 dynamic"; tail -3 "$W/dyn.log"; }
[ "$(fields "$W/fixed/metrics.jsonl" loss_scale | sort -u)" = 1024 ] && [ "$(fields "$W/fixed/metrics.jsonl" step skipped | awk '$2 == 1 { print $1 }')" = 2 ] \
    && pass "fixed loss scale: 1024 on all 6 steps, step 2 skipped" \
    || fail "fixed loss scale: $(fields "$W/fixed/metrics.jsonl" step loss_scale skipped | tr '\n' ';')"
[ "$(fields "$W/dyn/metrics.jsonl" loss_scale | tail -1)" = 512 ] && pass "the dynamic scaler halves it on the same run" \
    || fail "dynamic scale: $(fields "$W/dyn/metrics.jsonl" loss_scale | tr '\n' ' ')"

# 4. evaluation: val_loss, val_ppl, val_acc in the eval lines and from tera eval (tp2 = one rank)
"$TERA" train "${TINY[@]}" --training.micro_batch=2 --training.steps=4 --training.eval_every=2 \
    --logging.run_dir="$W/ev" > "$W/ev.log" 2>&1 || fail "train with eval"
jq -e -s '[.[] | select(.val_loss != null)] | length == 2 and
          all(.val_acc >= 0 and .val_acc <= 1 and ((.val_ppl - (.val_loss | exp)) | fabs) < 1e-5 * .val_ppl)' \
    "$W/ev/metrics.jsonl" > /dev/null && pass "eval lines: val_loss, val_ppl = exp(val_loss), val_acc in [0, 1]" \
    || fail "eval lines: $(grep val_ "$W/ev/metrics.jsonl")"
$MPIRUN -np 2 "$TERA" train "${TINY[@]}" --training.micro_batch=2 --training.steps=4 --training.eval_every=2 \
    --parallel.pp=2 --logging.run_dir="$W/ev-pp2" > "$W/ev-pp2.log" 2>&1 || fail "pp2 train with eval"
[ "$(grep val_acc "$W/ev/metrics.jsonl")" = "$(grep val_acc "$W/ev-pp2/metrics.jsonl")" ] \
    && pass "pp2: the same eval lines (the last stage counts the accuracy)" || fail "pp2 eval lines differ"
EV=(eval --from "$W/ev/checkpoints/step_00000004" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32
    --training.micro_batch=4 --training.eval_batches=4)
a=$("$TERA" "${EV[@]}" 2> /dev/null | jq -r '"\(.val_loss) \(.val_acc)"')
b=$($MPIRUN -np 2 "$TERA" "${EV[@]}" --parallel.tp=2 2> /dev/null | jq -r '"\(.val_loss) \(.val_acc)"')
echo "tera eval: one rank '$a', tp2 '$b'"
awk -v a="$a" -v b="$b" 'BEGIN { split(a, x, " "); split(b, y, " ")
    exit !(x[2] > 0 && x[2] <= 1 && x[2] == y[2] && (x[1] - y[1] < 1e-5 && y[1] - x[1] < 1e-5)) }' \
    && pass "tera eval prints val_acc, equal under tp2" || fail "tera eval accuracy: '$a' vs '$b'"

finish cli_train_options
