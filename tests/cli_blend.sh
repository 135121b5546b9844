#!/usr/bin/env bash
# Dataset blends (data.paths = "W1 PREFIX1, W2 PREFIX2"): a run on a blend of two prepared datasets
# logs per-dataset validation losses (val_loss_NAME) besides val_loss; the datasets of the samples a
# run read match the weights (counted from the blend's interleaving by the unit test
# test_loader/test_blend; here through the start-up report of one period); a layout with dp 2
# trains as one rank with the same global batch; a resumed run is bit-identical to the
# uninterrupted one; bad blends are refused naming the item.
# Usage: cli_blend.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"

head -c 40000 "$SRC/data/default_corpus.txt" > "$W/a.txt"
tail -c 30000 "$SRC/data/default_corpus.txt" > "$W/b.txt"
"$TERA" data prepare --input "$W/a.txt" --output "$W/web" > /dev/null 2>&1 || fail "prepare web"
"$TERA" data prepare --input "$W/b.txt" --output "$W/code" > /dev/null 2>&1 || fail "prepare code"
NOD=() # the tiny model without its data.path
for a in "${MODEL[@]}"; do case $a in --data.path=*) ;; *) NOD+=("$a") ;; esac; done
BL=(--data.paths="0.7 $W/web, 0.3 $W/code" --data.val_fraction=0.1)
M=("${NOD[@]}" "${BL[@]}" --training.steps=8 --training.eval_every=4 --checkpoint.every=4)

"$TERA" train "${M[@]}" --training.micro_batch=2 --training.grad_accum=2 --logging.run_dir="$W/one" > "$W/one.log" 2>&1 \
    || { fail "blend run"; tail -3 "$W/one.log"; }
grep -q "tera: blend 1/2: .*web (val_loss_web) weight 0.7000 (7000 of every 10000 samples)" "$W/one.log" \
    && grep -q "tera: blend 2/2: .*code (val_loss_code) weight 0.3000 (3000 of every 10000 samples)" "$W/one.log" \
    && pass "start-up report: 7000 + 3000 samples per period of 10000" || fail "blend report: $(grep blend "$W/one.log")"
jq -e -s '[.[] | select(.val_loss != null)] | length == 2 and all(.val_loss_web > 0 and .val_loss_code > 0 and
          .val_acc_web >= 0 and .val_acc_code >= 0 and .val_loss_web != .val_loss_code)' "$W/one/metrics.jsonl" > /dev/null \
    && pass "per-dataset validation losses in metrics.jsonl" || fail "eval lines: $(grep val_ "$W/one/metrics.jsonl")"

# dp 2 = one rank (same global batch of 4 sequences)
$MPIRUN -np 2 "$TERA" train "${M[@]}" --training.micro_batch=2 --parallel.dp=2 --logging.run_dir="$W/dp2" > "$W/dp2.log" 2>&1 \
    || { fail "blend dp2"; tail -3 "$W/dp2.log"; }
compare_steps "$W/one/metrics.jsonl" "$W/dp2/metrics.jsonl" "$LAYOUT_TOL" && pass "dp2 on the blend trains as one rank" \
    || fail "dp2 differs"

# resume from step 4: bit-identical weights and losses at step 8
cp -r "$W/one" "$W/res"
rm -rf "$W/res/checkpoints/step_00000008"
"$TERA" train "${M[@]}" --training.micro_batch=2 --training.grad_accum=2 --logging.run_dir="$W/res" --resume \
    > "$W/res.log" 2>&1 && grep -q "resumed .* at step 4" "$W/res.log" || { fail "resume"; tail -3 "$W/res.log"; }
cmp -s "$W/one/checkpoints/step_00000008/model.safetensors" "$W/res/checkpoints/step_00000008/model.safetensors" \
    && [ "$(last_fields "$W/one/metrics.jsonl" step loss grad_norm)" = "$(last_fields "$W/res/metrics.jsonl" step loss grad_norm)" ] \
    && pass "resumed blend run bit-identical to the uninterrupted one" || fail "resumed blend run differs"

# the blend differs from either dataset alone (the datasets are really mixed)
"$TERA" train "${NOD[@]}" --data.path="$W/web" --data.val_fraction=0.1 --training.steps=8 \
    --training.micro_batch=2 --training.grad_accum=2 --logging.run_dir="$W/web-only" > /dev/null 2>&1 || fail "web alone"
[ "$(fields "$W/web-only/metrics.jsonl" loss | tr '\n' ' ')" != "$(fields "$W/one/metrics.jsonl" loss | tr '\n' ' ')" ] \
    && pass "the blend's losses differ from its first dataset's alone" || fail "blend reads only its first dataset"

# refusals name the item
bad() { # bad MESSAGE-PART PATHS [ARGS]
    if "$TERA" train "${NOD[@]}" --training.steps=2 --data.paths="$2" "${@:3}" --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1; then
        fail "accepted data.paths='$2'"
    else
        grep -q "$1" "$W/bad.log" && pass "refused '$2'" || fail "message for '$2': $(cat "$W/bad.log")"
    fi
}
bad "not 'WEIGHT PATH'" "web $W/web"
bad "not 'WEIGHT PATH'" "0 $W/web"
bad "not 'WEIGHT PATH'" "0.5"
bad "names no dataset" " , "
bad "nonexistent" "0.5 $W/web, 0.5 $W/nonexistent"
bad "both set" "1 $W/web" --data.path="$W/code"
finish cli_blend
