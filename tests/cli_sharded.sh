#!/usr/bin/env bash
# Sharded checkpoints (checkpoint.sharded): with several ranks, every rank writes its own blocks
# of the parameters and Adam moments (rank-NNNNN.safetensors), no rank gathers the model, and the
# manifest lists the slice each file holds. Checked on a five-dimensional layout (pp2 x dp2 x tp2
# x ep2, ZeRO-3, 8 ranks):
#   - saving sharded changes nothing in training (metrics bit-identical to an unsharded run);
#   - the whole state is there: converted to one rank, the weights and optimizer files equal, byte
#     for byte, those the unsharded run wrote at the same step;
#   - it resumes on one rank and under another layout (ep4 ZeRO-2), steps 4..7 matching;
#   - differential sharded saves (each rank's changed chunks) resume too;
#   - `tera ckpt verify` names a rank file with a flipped byte, and `--resume` skips that
#     checkpoint for the previous one;
#   - a writer killed in the middle of a sharded save (fault injection at the N-th I/O operation)
#     leaves no committed checkpoint for that step, and the run resumes from the newest one.
# Usage: cli_sharded.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TINY=("${MODEL[@]}" --training.steps=8 --checkpoint.every=4 --checkpoint.keep=0)
FIVE=(--training.micro_batch=1 --training.grad_accum=2 --parallel.pp=2 --parallel.dp=2 --parallel.tp=2 --parallel.ep=2
      --parallel.zero=3)
same_steps() { # loss and grad norm of steps 4..7 by field name, relative LAYOUT_TOL (tests/mpilib.sh)
    compare_steps <(grep '"loss"' "$1" | tail -4) <(grep '"loss"' "$2" | tail -4) "$LAYOUT_TOL" > /dev/null &&
        [ "$(grep -c '"loss"' "$2")" -ge 4 ]
}
resume_from() { # RUN_DIR [layout options]: a copy of the sharded run cut back to step 4, resumed
    local D=$1
    shift
    cp -r "$W/s" "$D"
    rm -rf "$D/checkpoints/step_00000008"
    head -4 "$W/s/metrics.jsonl" > "$D/metrics.jsonl"
}

$MPIRUN -np 8 "$TERA" train "${TINY[@]}" "${FIVE[@]}" --checkpoint.sharded=true --logging.run_dir="$W/s" > "$W/s.log" 2>&1 \
    || { fail "sharded 5-D run"; tail -5 "$W/s.log"; }
$MPIRUN -np 8 "$TERA" train "${TINY[@]}" "${FIVE[@]}" --logging.run_dir="$W/u" > "$W/u.log" 2>&1 \
    || { fail "unsharded 5-D run"; tail -5 "$W/u.log"; }
C8="$W/s/checkpoints/step_00000008"
n=$(ls "$C8" | grep -c '^rank-[0-9]*\.safetensors$')
[ "$n" = 8 ] && [ ! -e "$C8/model.safetensors" ] && grep -q '"sharded":[[:space:]]*true' "$C8/manifest.json" \
    && pass "sharded checkpoint: 8 rank files, no whole-model file" || fail "sharded layout: $(ls "$C8" | tr '\n' ' ')"
cmp -s <(untimed "$W/s/metrics.jsonl") <(untimed "$W/u/metrics.jsonl") \
    && pass "saving sharded leaves training bit-identical" || fail "sharded saving changed the metrics"
"$TERA" ckpt verify "$C8" > /dev/null 2>&1 && pass "sharded checkpoint verifies" || fail "verify of a sharded checkpoint"

# the whole state: converted to one rank (whole files), equal to the unsharded run's, byte for byte
ONE=(--parallel.pp=1 --parallel.dp=1 --parallel.tp=1 --parallel.ep=1 --parallel.zero=0 --training.grad_accum=4)
"$TERA" ckpt convert --from "$C8" --out "$W/c1" "${ONE[@]}" --checkpoint.sharded=false > "$W/c1.log" 2>&1 \
    || { fail "convert a sharded checkpoint"; tail -3 "$W/c1.log"; }
ok=1
for f in model.safetensors optimizer.safetensors config.json; do
    cmp -s "$W/c1/checkpoints/step_00000008/$f" "$W/u/checkpoints/step_00000008/$f" || { ok=0; fail "$f differs"; }
done
[ $ok = 1 ] && pass "sharded -> one rank: weights, moments and config byte-identical to the unsharded run's"
"$TERA" ckpt export-hf "$C8" --out "$W/hf" --tera-moe > /dev/null 2>&1 && cmp -s "$W/hf/model.safetensors" "$W/u/checkpoints/step_00000008/model.safetensors" \
    && pass "export-hf of a sharded checkpoint" || fail "export-hf of a sharded checkpoint"

# evaluated directly (training.init_from / tera eval --from a sharded checkpoint): the same loss
a=$("$TERA" eval --from "$C8" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32 --training.micro_batch=4 \
    --training.eval_batches=4 2> /dev/null | grep -o '"val_loss": [0-9.]*')
b=$("$TERA" eval --from "$W/u/checkpoints/step_00000008" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32 \
    --training.micro_batch=4 --training.eval_batches=4 2> /dev/null | grep -o '"val_loss": [0-9.]*')
[ -n "$a" ] && [ "$a" = "$b" ] && pass "tera eval --from a sharded checkpoint: $a (unsharded: $b)" || fail "eval: '$a' vs '$b'"

# tera export-hf --from takes a checkpoint too; a parallel eval prints one line
"$TERA" export-hf --from "$C8" --out "$W/hf2" --tera-moe > /dev/null 2>&1 && cmp -s "$W/hf2/model.safetensors" "$W/hf/model.safetensors" \
    && pass "export-hf --from a sharded checkpoint" || fail "export-hf --from a sharded checkpoint"
c=$($MPIRUN -np 2 "$TERA" eval --from "$C8" --parallel.tp=2 --data.path="$W/c.txt" --data.val_fraction=0.1 \
    --training.seq_len=32 --training.micro_batch=4 --training.eval_batches=4 2> /dev/null | grep -c '"val_loss"')
[ "$c" = 1 ] && pass "eval under tp2 prints one result" || fail "eval under tp2 printed $c results"

# resumed on one rank and as ep4 with ZeRO-2 (itself saving sharded)
resume_from "$W/r1"
"$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/r1" --resume \
    > "$W/r1.log" 2>&1 || { fail "resume on one rank"; tail -3 "$W/r1.log"; }
grep -q "resumed .* at step 4" "$W/r1.log" && same_steps "$W/s/metrics.jsonl" "$W/r1/metrics.jsonl" \
    && pass "sharded 5-D checkpoint resumed on one rank: steps 4..7 match" || fail "resume on one rank"
resume_from "$W/r4"
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" --training.micro_batch=1 --parallel.dp=4 --parallel.ep=4 --parallel.zero=2 \
    --checkpoint.sharded=true --logging.run_dir="$W/r4" --resume > "$W/r4.log" 2>&1 || { fail "resume as ep4"; tail -3 "$W/r4.log"; }
grep -q "resumed .* at step 4" "$W/r4.log" && same_steps "$W/s/metrics.jsonl" "$W/r4/metrics.jsonl" \
    && ls "$W/r4/checkpoints/step_00000008" | grep -q '^rank-00003.safetensors$' \
    && pass "resumed as ep4 ZeRO-2: steps 4..7 match, saved sharded again" || fail "resume as ep4 ZeRO-2"

# differential sharded saves (checkpoint.full_every = 2, a save every 2 steps): step 4 holds each
# rank's changed chunks against step 2; resumed from it on one rank, steps 4..7 match
$MPIRUN -np 8 "$TERA" train "${TINY[@]}" "${FIVE[@]}" --checkpoint.sharded=true --checkpoint.every=2 \
    --checkpoint.full_every=2 --logging.run_dir="$W/d" > "$W/d.log" 2>&1 || { fail "sharded differential run"; tail -5 "$W/d.log"; }
kinds=$("$TERA" ckpt ls "$W/d" | awk 'NR > 1 { printf "%s ", $3 }')
[ "$kinds" = "full diff full full " ] && ls "$W/d/checkpoints/step_00000004" | grep -q '^rank-00000\.diff$' \
    && "$TERA" ckpt verify "$W/d/checkpoints/step_00000004" > /dev/null 2>&1 \
    && pass "sharded differential checkpoints: kinds $kinds, rank diffs verify" || fail "sharded differential: kinds '$kinds'"
"$TERA" ckpt convert --from "$W/d/checkpoints/step_00000004" --out "$W/dc" "${ONE[@]}" --checkpoint.sharded=false \
    > "$W/dc.log" 2>&1 || { fail "convert a sharded diff"; tail -3 "$W/dc.log"; }
cmp -s "$W/dc/checkpoints/step_00000004/model.safetensors" "$W/u/checkpoints/step_00000004/model.safetensors" &&
    cmp -s "$W/dc/checkpoints/step_00000004/optimizer.safetensors" "$W/u/checkpoints/step_00000004/optimizer.safetensors" \
    && pass "sharded diff (base step 2 + each rank's chunks) -> one rank: byte-identical to the unsharded step 4" \
    || fail "sharded diff restores another state"
D="$W/d1"
cp -r "$W/d" "$D"
rm -rf "$D/checkpoints/step_00000006" "$D/checkpoints/step_00000008"
head -4 "$W/d/metrics.jsonl" > "$D/metrics.jsonl"
"$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$D" --resume \
    > "$D.log" 2>&1 || { fail "resume from a sharded diff"; tail -3 "$D.log"; }
grep -q "resumed .* at step 4" "$D.log" && same_steps "$W/d/metrics.jsonl" "$D/metrics.jsonl" \
    && pass "resumed from a sharded differential checkpoint on one rank: steps 4..7 match" || { fail "resume from a sharded diff"; grep -i "resumed\|error\|warn" "$D.log"; paste "$W/d/metrics.jsonl" "$D/metrics.jsonl" | cut -c1-60 | tail -4; }

# a flipped byte in a rank file: verify names it; --resume falls back to the previous checkpoint
cp -r "$W/s" "$W/bad"
f="$W/bad/checkpoints/step_00000008/rank-00005.safetensors"
printf '\x55' | dd of="$f" bs=1 seek=$(( $(stat -c %s "$f") - 9 )) conv=notrunc 2> /dev/null
"$TERA" ckpt verify "$W/bad/checkpoints/step_00000008" > "$W/v.log" 2>&1 && fail "verify missed a flipped byte" \
    || { grep -q "rank-00005.safetensors" "$W/v.log" && pass "verify names the damaged rank file" || fail "verify: $(head -2 "$W/v.log")"; }
"$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/bad" --resume \
    > "$W/bad.log" 2>&1; grep -q "resumed .* at step 4" "$W/bad.log" && pass "--resume skips it for step 4" \
    || fail "resume past a damaged sharded checkpoint: $(grep -i "error\|resumed" "$W/bad.log" | head -2)"

# a writer killed during a sharded save: never a committed checkpoint of that step, the newest
# committed one is restored
for N in 23 27 31; do
    R="$W/crash$N"
    TERA_CKPT_FAULT=$N $MPIRUN -np 8 "$TERA" train "${TINY[@]}" "${FIVE[@]}" --checkpoint.sharded=true \
        --logging.run_dir="$R" > "$R.log" 2>&1
    bad=0
    for d in "$R"/checkpoints/step_*; do
        [ -e "$d/COMMIT" ] || continue
        "$TERA" ckpt verify "$d" > /dev/null 2>&1 || bad=1
    done
    latest=$(ls -d "$R"/checkpoints/step_???????? 2> /dev/null | while read -r d; do [ -e "$d/COMMIT" ] && echo "$d"; done | tail -1)
    [ -n "$latest" ] || bad=1 # these fault points lie in the second save: step 4's is committed
    if [ -n "$latest" ]; then
        "$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$R" --resume \
            > "$R.resume.log" 2>&1 || bad=1
        [ "$(grep -c '"loss"' "$R/metrics.jsonl")" -ge 8 ] || bad=1
    fi
    [ $bad = 0 ] && pass "fault at I/O operation $N: committed checkpoints verify, the run resumes (newest: ${latest##*/})" \
        || fail "fault at I/O operation $N: $(tail -2 "$R.log")"
done
finish cli_sharded
