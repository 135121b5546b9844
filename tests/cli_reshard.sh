#!/usr/bin/env bash
# `tera ckpt convert`: a checkpoint saved under layout A, converted under layout B, is the same
# checkpoint. Checkpoints hold the whole model as one process does (every rank contributes its
# blocks and ZeRO shards, rank 0 writes), so the converted model.safetensors, optimizer.safetensors
# and config.json are byte-identical to A's (the same tensors, names, shapes and order: the
# safetensors headers cannot differ), the manifest's XXH3 of the weights, moments and router bias
# are equal (also for a differential source, which has no model.safetensors), and state.json
# agrees on everything but batch.accum/batch.sequences (the next step's accumulation count and
# global sequences, which follow from B's own batch settings). Then `tera train -c RUN_DIR/config.ini
# --resume` (the converted run directory's configuration: layout B) continues: its steps 4 and 5 match A's own steps 4 and 5 to the
# layouts' tolerance (LAYOUT_TOL, derived in cli_layouts.sh). Errors: a flipped byte
# (in the checkpoint or in the base of a differential one), a missing or uncommitted checkpoint,
# an existing run directory without --force.
#
# Layout names as in cli_layouts.sh ("dpA x tpT x epE" runs A*T*E ranks with parallel.dp = A*E);
# every run has a global batch of 4 sequences.
# Usage: cli_reshard.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TINY=("${MODEL[@]}" --training.steps=6)

# layout NAME:DP:TP:EP:ZERO[:PP:SCHEDULE:CHUNKS] -> NP (ranks) and L (options), global batch 4
layout() {
    local name dp tp ep zero pp sched chunks micro accum
    IFS=: read -r name dp tp ep zero pp sched chunks <<< "$1"
    pp=${pp:-1} sched=${sched:-1f1b} chunks=${chunks:-1}
    micro=$((4 / dp)) accum=1
    [ "$pp" -gt 1 ] && { micro=1; accum=$((4 / dp)); }
    NP=$((pp * dp * tp)) LDP=$dp LTP=$tp LEP=$ep
    L=(--parallel.dp="$dp" --parallel.tp="$tp" --parallel.ep="$ep" --parallel.zero="$zero" --parallel.pp="$pp"
       --parallel.pp_schedule="$sched" --parallel.pp_chunks="$chunks" --training.micro_batch=$micro
       --training.grad_accum=$accum)
}
run() { # NP, then the command: one rank without mpirun
    local np=$1
    shift
    if [ "$np" = 1 ]; then "$@"; else $MPIRUN -np "$np" "$@"; fi
}
# the last N step records of A against all of B, by field name: same steps, loss and grad norm to
# LAYOUT_TOL (tests/mpilib.sh)
same_last() { compare_steps "$2" "$3" "$LAYOUT_TOL" "$1"; }
regions() { sed -n '/"regions"/,/"files"/p' "$1/manifest.json" | grep '"xxh3"'; }
state() { grep -v '"accum"\|"sequences"' "$1/state.json"; }
# the converted checkpoint DST is the source SRC: bytes (full sources), state hashes, state.json
same_ckpt() {
    local f
    if [ -f "$1/model.safetensors" ]; then
        for f in model.safetensors optimizer.safetensors config.json; do
            cmp -s "$1/$f" "$2/$f" || { echo "$f differs"; return 1; }
        done
    fi
    [ "$(regions "$1" | wc -l)" = 4 ] && [ "$(regions "$1")" = "$(regions "$2")" ] || { echo "region hashes differ"; return 1; }
    [ "$(state "$1")" = "$(state "$2")" ] || { diff <(state "$1") <(state "$2"); return 1; }
    grep -q '"kind":	"full"' "$2/manifest.json" || { echo "not a full checkpoint"; return 1; }
}

# sources: each trains 6 steps under A with a checkpoint at step 4 (the one-rank run: a full one
# at step 2 and a differential one at step 4); steps 4 and 5 of its metrics are the continuation
# under A
declare -A SPEC=([ep4]=ep4:4:1:4:2 [tp2]=tp2:1:2:1:0 [d5]=dp2xtp2xep2:4:2:2:3 [pp2g]=pp2/gpipe:1:1:1:0:2:gpipe:1
                 [one]=one:1:1:1:0)
t0=$(date +%s.%N)
for s in ep4 tp2 d5 pp2g one; do
    layout "${SPEC[$s]}"
    every=4
    [ $s = one ] && every=2
    TERA_CKPT_FULL_EVERY=2 run "$NP" "$TERA" train "${TINY[@]}" "${L[@]}" --checkpoint.every=$every \
        --logging.run_dir="$W/$s" > "$W/$s.log" 2>&1 || { fail "source $s"; tail -5 "$W/$s.log"; }
done
grep -q '"kind":	"diff"' "$W/one/checkpoints/step_00000004/manifest.json" && [ -d "$W/one/checkpoints/step_00000002" ] &&
    [ ! -f "$W/one/checkpoints/step_00000004/model.safetensors" ] \
    && pass "the one-rank source's step 4 is differential (base step 2)" || fail "expected a differential step 4"
t1=$(date +%s.%N)

# source : target layout : resume and compare the continuation (1) or not (0)
PAIRS="ep4:ep2:2:1:2:0:1 ep4:one:1:1:1:0:0 ep4:tp2xep2:2:2:2:1:0
       tp2:tp4:1:4:1:0:1 tp2:dp2:2:1:1:3:0
       d5:pp4:1:1:1:0:4:1f1b:1:1 d5:one:1:1:1:0:0 d5:ep4:4:1:4:1:0
       pp2g:tp2xpp2/interleaved:1:2:1:0:2:interleaved:2:1 pp2g:one:1:1:1:0:0
       one:dp2xep2:4:1:2:2:1 one:pp2xdp2xep2:4:1:2:1:2:1f1b:1:1"
npairs=0 nresumed=0
for p in $PAIRS; do
    from=${p%%:*} rest=${p#*:}
    cmpare=${rest##*:} spec=${rest%:*}
    layout "$spec"
    to=${spec%%:*}
    tag="${SPEC[$from]%%:*} -> $to zero$(echo "$spec" | cut -d: -f5)"
    D="$W/cv-$from-${to//\//-}"
    C="$W/$from/checkpoints/step_00000004"
    run "$NP" "$TERA" ckpt convert --from "$C" --out "$D" "${L[@]}" > "$D.log" 2>&1 \
        || { fail "$tag: convert"; tail -5 "$D.log"; continue; }
    npairs=$((npairs + 1))
    out=$(same_ckpt "$C" "$D/checkpoints/step_00000004") && cmp -s "$D/config.ini" "$D/checkpoints/step_00000004/config.ini" &&
        grep -qx "dp = $LDP" "$D/config.ini" && grep -qx "tp = $LTP" "$D/config.ini" && grep -qx "ep = $LEP" "$D/config.ini" \
        && pass "$tag: converted checkpoint is the source's (weights, moments, router bias, state)" \
        || fail "$tag: converted checkpoint differs: $out"
    [ "$cmpare" = 1 ] || continue
    run "$NP" "$TERA" train -c "$D/config.ini" --resume > "$D.rlog" 2>&1 \
        || { fail "$tag: resume"; tail -5 "$D.rlog"; continue; }
    nresumed=$((nresumed + 1))
    grep -q "resumed .* at step 4" "$D.rlog" && out=$(same_last 2 "$W/$from/metrics.jsonl" "$D/metrics.jsonl") \
        && pass "$tag: resumed under the new layout, steps 4 and 5 match the source layout's" \
        || fail "$tag: continuation differs: $out"
done
[ "$npairs" -ge 12 ] || fail "only $npairs of 12 pairs converted"
t2=$(date +%s.%N)

# a converted checkpoint converts on: dp2 x tp2 x ep2 ZeRO-3 -> ep4 ZeRO-1 -> back, from the run
# directory (its newest checkpoint), into an existing run directory with --force: byte-identical
layout "${SPEC[d5]}"
run "$NP" "$TERA" ckpt convert --from "$W/cv-d5-ep4" --out "$W/cv-d5-ep4" "${L[@]}" > "$W/self.log" 2>&1 &&
    fail "converted a run directory into itself" ||
    { grep -q "lies inside the checkpoint" "$W/self.log" && pass "refused: --out holding the checkpoint" \
      || fail "message: $(cat "$W/self.log")"; }
run "$NP" "$TERA" ckpt convert --from "$W/cv-d5-ep4" --out "$W/cv-one-dp2xep2" "${L[@]}" > "$W/back.log" 2>&1 &&
    fail "overwrote a non-empty run directory without --force" ||
    { grep -q "already exists and is not empty.*--force" "$W/back.log" && pass "refused: existing run directory without --force" \
      || fail "message: $(cat "$W/back.log")"; }
run "$NP" "$TERA" ckpt convert --from "$W/cv-d5-ep4" --out "$W/cv-one-dp2xep2" "${L[@]}" --force > "$W/back.log" 2>&1 &&
    [ ! -f "$W/cv-one-dp2xep2/metrics.jsonl" ] && [ "$(ls "$W/cv-one-dp2xep2/checkpoints")" = step_00000004 ] &&
    same_ckpt "$W/d5/checkpoints/step_00000004" "$W/cv-one-dp2xep2/checkpoints/step_00000004" > /dev/null &&
    cmp -s "$W/d5/checkpoints/step_00000004/config.ini" <(sed "s|$W/cv-one-dp2xep2|$W/d5|" "$W/cv-one-dp2xep2/config.ini") \
    && pass "dp2 x tp2 x ep2 zero3 -> ep4 zero1 -> back (run directory form, --force): byte-identical, same config.ini" \
    || { fail "round trip"; tail -3 "$W/back.log"; }

# damaged or missing input: named, nothing written
flip() { # inverts the bits of the byte in the middle of a file
    local at=$(($(stat -c %s "$1") / 2)) b
    b=$(od -An -tu1 -j "$at" -N1 "$1" | tr -d ' ')
    printf "\\$(printf %03o $((255 - b)))" | dd of="$1" bs=1 seek="$at" conv=notrunc 2> /dev/null
}
cp -r "$W/ep4" "$W/bad"
f="$W/bad/checkpoints/step_00000004/optimizer.safetensors"
flip "$f"
expect_fail() { # NP, expected message (grep), then the arguments of ckpt convert
    local np=$1 want=$2
    shift 2
    rm -rf "$W/o"
    if run "$np" "$TERA" ckpt convert "$@" --out "$W/o" > "$W/e.log" 2>&1; then
        fail "accepted: $*"
    else
        grep -q -- "$want" "$W/e.log" && [ ! -e "$W/o" ] && pass "refused: $(grep -m1 'error' "$W/e.log" | cut -c1-150)" \
            || fail "message for $*: $(head -3 "$W/e.log")"
    fi
}
expect_fail 2 "$f: contents differ" --from "$W/bad/checkpoints/step_00000004" --parallel.dp=2 --parallel.ep=2 \
    --training.micro_batch=2
cp -r "$W/one" "$W/bad1"
f="$W/bad1/checkpoints/step_00000002/model.safetensors"
flip "$f"
expect_fail 1 "$f: contents differ" --from "$W/bad1/checkpoints/step_00000004"
rm "$W/bad1/checkpoints/step_00000004/COMMIT"
expect_fail 1 "$W/bad1/checkpoints/step_00000004/COMMIT: missing or malformed" --from "$W/bad1/checkpoints/step_00000004"
expect_fail 1 "'$W/nothere': no such checkpoint directory" --from "$W/nothere"
t3=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" -v n="$npairs" -v r="$nresumed" 'BEGIN {
    printf "timing: sources %.1f s, %d conversions + %d resumes %.1f s, round trip and errors %.1f s\n", b - a, n, r, c - b, d - c }'
finish cli_reshard
