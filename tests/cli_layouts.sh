#!/usr/bin/env bash
# Parallel layouts train the same model as one process. For each layout of the table, the tiny
# MoE trains 8 steps with the same global batch as a one-rank run (which accumulates 4
# micro-batches); every step's loss and grad norm and the final weights (the validation loss of the
# final checkpoints) agree with one rank to float32 rounding: relative 2e-5 (sums over ranks
# and over expert blocks add in a different order than one process does, so bit-identity is not
# expected). Memory per rank by category is compared with the formulas of docs/PARALLELISM.md.
# Also: dropless routing under expert parallelism, overlap on/off bit-identical, checkpoints
# resumed under another layout (ep 2 -> 1, ep 2 -> 4 with ZeRO-1).
#
# Pipelines ("ppP", "ppP/gpipe", "ppP/interleaved") split the layers into P stages, the micro-batches
# of a step (training.grad_accum) flowing through the schedule.
# Naming: the degrees multiply to the rank count. "tpT" splits each tensor over T ranks (parallel.tp);
# "epE" splits the experts over E data-parallel ranks, which also read different samples, so
# parallel.dp counts them: "dpA x tpT x epE" runs A*T*E ranks with parallel.dp = A*E,
# parallel.tp = T, parallel.ep = E.
# CI runs a representative subset; TERA_TEST_FULL=1 (make test-dist) runs the whole table.
# Usage: cli_layouts.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TINY=("${MODEL[@]}" --training.steps=8)

same_steps() { # loss (field 2) and grad_norm (field 7) of every step of two metrics files
    [ "$(grep -c '"loss"' "$1")" = 8 ] && [ "$(grep -c '"loss"' "$2")" = 8 ] || { echo "expected 8 steps"; return 1; }
    paste -d' ' <(grep '"loss"' "$1" | cut -d, -f2,7 | tr -dc '0-9.e+\-, \n' | tr ',' ' ') \
                <(grep '"loss"' "$2" | cut -d, -f2,7 | tr -dc '0-9.e+\-, \n' | tr ',' ' ') |
        awk -v tol="${3:-2e-5}" '{ for (i = 1; i <= 2; i++) { a = $i; b = $(i + 2); d = a - b; if (d < 0) d = -d;
               if (d > tol * (a < 0 ? -a : a) + 1e-7) { print "step " NR - 1 ": " a " vs " b; bad = 1 } } }
             END { exit bad }'
}
val_loss() { "$TERA" eval --from "$1" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32 \
    --training.micro_batch=4 --training.eval_batches=4 2> /dev/null | sed 's/.*"val_loss": \([0-9.]*\).*/\1/'; }
field() { grep "memory bytes per rank" "$1" | grep -o "$2 [0-9]*" | head -1 | cut -d' ' -f2; } # a figure of that line

"$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/one" > "$W/one.log" 2>&1 \
    || { fail "one rank"; cat "$W/one.log"; }
elems() { grep -o "replicated [0-9]*, tensor-parallel [0-9]*, expert [0-9]*" "$1" | tr -dc '0-9 ' | tr -s ' '; }
read -r REP SPL EXP <<< "$(elems "$W/one.log")"

# name : parallel.dp : parallel.tp : parallel.ep : zero [: parallel.pp : schedule : chunks]
LAYOUTS="dp2:2:1:1:3 tp2:1:2:1:0 ep4:4:1:4:2 dp2xtp2:2:2:1:1 tp2xep2:2:2:2:1 dp2xtp2xep2:4:2:2:3
         pp2:1:1:1:0:2:1f1b:1 pp4/gpipe:1:1:1:0:4:gpipe:1 pp2/interleaved:1:1:1:0:2:interleaved:2
         pp2xdp2xep2:4:1:2:1:2:1f1b:1"
if [ "${TERA_TEST_FULL:-0}" = 1 ]; then # every layout with every ZeRO stage it can shard over
    LAYOUTS="tp2:1:2:1:0 tp4:1:4:1:0 pp2:1:1:1:0:2:1f1b:1 pp4:1:1:1:0:4:1f1b:1 pp2/gpipe:1:1:1:0:2:gpipe:1
             pp4/gpipe:1:1:1:0:4:gpipe:1 pp2/interleaved:1:1:1:0:2:interleaved:2 pp2xtp2:1:2:1:0:2:1f1b:1"
    for l in dp2:2:1:1 dp4:4:1:1 ep2:2:1:2 ep4:4:1:4 dp2xtp2:2:2:1 dp2xep2:4:1:2 tp2xep2:2:2:2 dp4xep2:8:1:2 \
             dp2xep4:8:1:4 tp4xep2:2:4:2 dp2xtp2xep2:4:2:2; do
        for z in 0 1 2 3; do LAYOUTS="$LAYOUTS $l:$z"; done
    done
    for l in pp2xdp2:2:1:1 pp2xep2:2:1:2 pp2xdp2xep2:4:1:2 pp2xdp2xtp2:2:2:1; do
        for z in 0 1 2 3; do LAYOUTS="$LAYOUTS $l:$z:2:1f1b:1"; done
    done
    LAYOUTS="$LAYOUTS pp2xdp2/interleaved:2:1:1:2:2:interleaved:2"
fi
for l in $LAYOUTS; do
    IFS=: read -r name dp tp ep zero pp sched chunks <<< "$l"
    pp=${pp:-1} sched=${sched:-1f1b} chunks=${chunks:-1}
    tag="$name zero$zero"
    R="$W/${name//\//-}-$zero"
    accum=1
    micro=$((4 / dp))
    [ "$micro" = 0 ] && { micro=1; accum=1; } # dp 8: 8 sequences per step
    [ "$pp" -gt 1 ] && { micro=1; accum=$((4 / dp)); } # a pipeline's micro-batches are the accumulation steps
    if [ "$dp" = 8 ]; then # compare with one rank accumulating 8 micro-batches
        [ -d "$W/one8" ] || "$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=8 \
            --logging.run_dir="$W/one8" > "$W/one8.log" 2>&1
        ref="$W/one8"
    else
        ref="$W/one"
    fi
    $MPIRUN -np $((pp * dp * tp)) "$TERA" train "${TINY[@]}" --training.micro_batch=$micro --training.grad_accum=$accum \
        --parallel.dp="$dp" --parallel.tp="$tp" --parallel.ep="$ep" --parallel.zero="$zero" --parallel.pp="$pp" \
        --parallel.pp_schedule="$sched" --parallel.pp_chunks="$chunks" --logging.run_dir="$R" \
        > "$R.log" 2>&1 || { fail "$tag run"; tail -5 "$R.log"; continue; }
    same_steps "$ref/metrics.jsonl" "$R/metrics.jsonl" && pass "$tag: every step's loss and grad norm match one rank" \
        || fail "$tag: losses differ from one rank"
    a=$(val_loss "$ref/checkpoints/step_00000008"); b=$(val_loss "$R/checkpoints/step_00000008")
    awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a > 0 && d <= 2e-5 * a) }' \
        && pass "$tag: final weights give the same validation loss ($a vs $b)" || fail "$tag: final weights $a vs $b"
    # memory per rank (rank 0's figures): each rank holds every replicated element (norms, router),
    # 1/tp of the tensor-parallel ones and 1/(ep tp) of the experts' (exact element counts); the
    # flat buffers of parameters and gradients hold those plus 64-byte alignment; Adam's two
    # moments the same, or with ZeRO a 1/dp shard of the non-expert region and a 1/(dp/ep) shard
    # of the expert region (each rounded up to 16 floats); ZeRO-2 keeps gradients only for that
    # shard, ZeRO-3 parameters too (the staging of one group at a time counts as communication);
    # a pipeline stage holds a part of the layers (rank 0: the first stage's)
    read -r rep spl exp <<< "$(elems "$R.log")"
    p=$(field "$R.log" "params"); g=$(field "$R.log" "grads"); o=$(field "$R.log" "optimizer")
    nd=$(grep -o 'non-expert [0-9]*' "$R.log" | cut -d' ' -f2); nx=$(grep -o 'expert [0-9]* floats)' "$R.log" | cut -d' ' -f2)
    awk -v rep="$rep" -v spl="$spl" -v exp_="$exp" -v R="$REP" -v S="$SPL" -v X="$EXP" -v p="$p" -v g="$g" -v o="$o" \
        -v nd="$nd" -v nx="$nx" -v dp="$dp" -v tp="$tp" -v ep="$ep" -v z="$zero" -v pp="$pp" 'BEGIN {
        if (pp == 1) ok = rep == R && spl * tp == S && exp_ * ep * tp == X
        else ok = rep <= R && spl * tp <= S && exp_ * ep * tp <= X && rep + spl * tp + exp_ * ep * tp < R + S + X
        held = rep + spl + exp_
        whole = 4 * (nd + nx)
        ok = ok && 4 * held <= whole && whole <= 4 * (held + 16 * 64)
        if (z == 0) ok = ok && o == 2 * whole
        else { lo = 8 * (nd / dp + nx / (dp / ep)); ok = ok && o >= lo - 8 && o <= lo + 8 * 32 }
        ok = ok && p == (z >= 3 ? o / 2 : whole) && g == (z >= 2 ? o / 2 : whole)
        exit !ok }' \
        && pass "$tag: memory per rank matches the formula (elements $rep + $spl + $exp; params $p, optimizer $o bytes)" \
        || fail "$tag: memory: elements $rep $spl $exp (one rank $REP $SPL $EXP), params $p grads $g optimizer $o"
    rm -rf "$R"
done

# ZeRO-2/3 reduce-scatter every micro-batch's gradients (accumulating in the shards) and ZeRO-3
# gathers parameters for evaluation too: dp2 x ep2 with 2 micro-batches per step and a validation
# every 4 steps against one rank
EV=(--training.eval_every=4 --training.eval_batches=3)
"$TERA" train "${TINY[@]}" "${EV[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/ev1" \
    > "$W/ev1.log" 2>&1 || fail "one rank with evaluation"
for z in 2 3; do
    $MPIRUN -np 2 "$TERA" train "${TINY[@]}" "${EV[@]}" --training.micro_batch=1 --training.grad_accum=2 --parallel.dp=2 \
        --parallel.ep=2 --parallel.zero=$z --logging.run_dir="$W/ev$z" > "$W/ev$z.log" 2>&1 || { fail "zero$z accum"; tail -5 "$W/ev$z.log"; }
    same_steps "$W/ev1/metrics.jsonl" "$W/ev$z/metrics.jsonl" &&
        paste -d' ' <(grep -o '"val_loss": [0-9.]*' "$W/ev1/metrics.jsonl" | cut -d' ' -f2) \
                    <(grep -o '"val_loss": [0-9.]*' "$W/ev$z/metrics.jsonl" | cut -d' ' -f2) |
        awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-5 * $1) bad = 1; n++ } END { exit bad || n != 2 }' \
        && pass "ep2 zero$z with 2 micro-batches per step: every step and both validations match one rank" \
        || fail "zero$z with accumulation or evaluation differs"
done

# ZeRO-3 prefetch (parallel.zero_prefetch, on by default above): every layer gather of the ev3 run
# (training and evaluation) was started while the previous layer computed, none was wasted, and
# turning it off gives bit-identical steps, validations and final weights
$MPIRUN -np 2 "$TERA" train "${TINY[@]}" "${EV[@]}" --training.micro_batch=1 --training.grad_accum=2 --parallel.dp=2 \
    --parallel.ep=2 --parallel.zero=3 --parallel.zero_prefetch=0 --logging.run_dir="$W/ev3off" > "$W/ev3off.log" 2>&1 \
    || { fail "zero3 without prefetch"; tail -5 "$W/ev3off.log"; }
untimed() { sed 's/"tokens_per_s[^,]*,//; s/"elapsed_s[^,]*,//; s/"step_s[^,]*,//; s/"data_wait_s[^,]*,//' "$1"; }
counts() { sed -n 's/.*ZeRO-3 layer gathers: \([0-9]*\), \([0-9]*\) of them prefetched.*, \([0-9]*\) prefetches unused.*/\1 \2 \3/p' "$1"; }
read -r g1 p1 u1 <<< "$(counts "$W/ev3.log")"; read -r g0 p0 u0 <<< "$(counts "$W/ev3off.log")"
[ -n "$g1" ] && [ "$g1" -gt 0 ] && [ "$p1" = "$g1" ] && [ "$u1" = 0 ] && [ "$g0" = "$g1" ] && [ "$p0" = 0 ] \
    && cmp -s <(untimed "$W/ev3/metrics.jsonl") <(untimed "$W/ev3off/metrics.jsonl") \
    && cmp -s "$W/ev3/checkpoints/step_00000008/model.safetensors" "$W/ev3off/checkpoints/step_00000008/model.safetensors" \
    && pass "zero3 prefetch: $p1 of $g1 layer gathers prefetched, $u1 unused; bit-identical to no prefetch" \
    || fail "zero3 prefetch: gathers $g1 prefetched $p1 unused $u1 (off: $g0 $p0); or the runs differ"

# the same through a pipeline (pp2 x dp2, ZeRO-3, 1F1B: the executor names the order of use), with
# 3 validation batches over 2 data-parallel ranks (every rank must run as many forwards: its
# parameter gathers are collective; this hung before evaluation kept ZeRO-3 ranks in step)
for pf in 1 0; do
    $MPIRUN -np 4 "$TERA" train "${TINY[@]}" "${EV[@]}" --training.micro_batch=1 --training.grad_accum=2 --parallel.pp=2 \
        --parallel.dp=2 --parallel.zero=3 --parallel.zero_prefetch=$pf --parallel.timeout_s=60 --logging.run_dir="$W/pz$pf" \
        > "$W/pz$pf.log" 2>&1 || { fail "pp2 x dp2 zero3 with evaluation (prefetch $pf)"; tail -5 "$W/pz$pf.log"; }
done
read -r g1 p1 u1 <<< "$(counts "$W/pz1.log")"
same_steps "$W/ev1/metrics.jsonl" "$W/pz1/metrics.jsonl" \
    && paste -d' ' <(grep -o '"val_loss": [0-9.]*' "$W/ev1/metrics.jsonl" | cut -d' ' -f2) \
                   <(grep -o '"val_loss": [0-9.]*' "$W/pz1/metrics.jsonl" | cut -d' ' -f2) |
       awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-5 * $1) bad = 1; n++ } END { exit bad || n != 2 }' \
    && [ -n "$g1" ] && [ "$p1" -gt $((g1 / 2)) ] && [ "$u1" = 0 ] \
    && cmp -s <(untimed "$W/pz1/metrics.jsonl") <(untimed "$W/pz0/metrics.jsonl") \
    && cmp -s "$W/pz1/checkpoints/step_00000008/model.safetensors" "$W/pz0/checkpoints/step_00000008/model.safetensors" \
    && pass "pp2 x dp2 zero3 with 3 validation batches: matches one rank; prefetch $p1 of $g1 gathers, $u1 unused, bit-identical to none" \
    || fail "pp2 x dp2 zero3 with evaluation: gathers $g1 prefetched $p1 unused $u1, or differs from one rank / no prefetch"

# five dimensions at once (pp2 x dp2 x tp2 x ep2, ZeRO-1, dropless): activation recomputation
# (full and selective per layer range) gives bit-identical losses and final weights
FIVE=(--training.micro_batch=1 --training.grad_accum=2 --parallel.pp=2 --parallel.dp=2 --parallel.tp=2 --parallel.ep=2
      --parallel.zero=1 --model.capacity_factor=0)
for rc in none full:0-1,selective:2-3; do
    $MPIRUN -np 8 "$TERA" train "${TINY[@]}" "${FIVE[@]}" --training.recompute=$rc --logging.run_dir="$W/five-${rc%%:*}" \
        > "$W/five.log" 2>&1 || { fail "5-D run with recompute $rc"; tail -5 "$W/five.log"; }
done
cmp -s <(cut -d, -f1-7 "$W/five-none/metrics.jsonl") <(cut -d, -f1-7 "$W/five-full/metrics.jsonl") &&
    cmp -s "$W/five-none/checkpoints/step_00000008/model.safetensors" "$W/five-full/checkpoints/step_00000008/model.safetensors" \
    && pass "pp2 x dp2 x tp2 x ep2 zero1: recompute full:0-1,selective:2-3 bit-identical to none" \
    || fail "recomputation changes a 5-D run"

# dropless routing: the token counts are exchanged first, buffers hold the worst case
DL=(--model.capacity_factor=0)
"$TERA" train "${TINY[@]}" "${DL[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/dl1" \
    > "$W/dl1.log" 2>&1 || fail "dropless one rank"
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" "${DL[@]}" --training.micro_batch=1 --parallel.dp=4 --parallel.ep=4 \
    --logging.run_dir="$W/dl4" > "$W/dl4.log" 2>&1 || { fail "dropless ep4"; tail -5 "$W/dl4.log"; }
same_steps "$W/dl1/metrics.jsonl" "$W/dl4/metrics.jsonl" && pass "dropless ep4: every step matches one rank" \
    || fail "dropless ep4 differs"
# overlap of the exchange with expert compute changes nothing, bit for bit
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" "${DL[@]}" --training.micro_batch=1 --parallel.dp=4 --parallel.ep=4 \
    --parallel.ep_overlap=0 --logging.run_dir="$W/dl4n" > "$W/dl4n.log" 2>&1 || fail "dropless ep4 without overlap"
cmp -s <(cut -d, -f1-7 "$W/dl4/metrics.jsonl") <(cut -d, -f1-7 "$W/dl4n/metrics.jsonl") &&
    cmp -s "$W/dl4/checkpoints/step_00000008/model.safetensors" "$W/dl4n/checkpoints/step_00000008/model.safetensors" \
    && pass "ep overlap on and off: bit-identical losses and final weights" || fail "overlap changes results"

# checkpoints hold the whole model: an ep2 ZeRO-1 checkpoint of step 4 resumes on one rank and on
# ep4 with ZeRO-2 (each rank takes its experts and its moment shards); steps 4..7 match
$MPIRUN -np 2 "$TERA" train "${TINY[@]}" --training.micro_batch=2 --parallel.dp=2 --parallel.ep=2 --parallel.zero=1 \
    --checkpoint.every=4 --logging.run_dir="$W/rs" > "$W/rs.log" 2>&1 || { fail "ep2 run with checkpoints"; tail -5 "$W/rs.log"; }
for to in "1 1 0" "4 4 2"; do
    read -r dp ep zero <<< "$to"
    D="$W/rs-$dp"
    cp -r "$W/rs" "$D"
    rm -rf "$D/checkpoints/step_00000008"
    head -4 "$W/rs/metrics.jsonl" > "$D/metrics.jsonl"
    if [ "$dp" = 1 ]; then
        "$TERA" train "${TINY[@]}" --training.micro_batch=2 --training.grad_accum=2 --logging.run_dir="$D" --resume \
            > "$D.log" 2>&1 || { fail "resume on one rank"; tail -5 "$D.log"; }
    else
        $MPIRUN -np "$dp" "$TERA" train "${TINY[@]}" --training.micro_batch=1 --parallel.dp="$dp" --parallel.ep="$ep" \
            --parallel.zero="$zero" --logging.run_dir="$D" --resume > "$D.log" 2>&1 || { fail "resume on ep$ep"; tail -5 "$D.log"; }
    fi
    grep -q "resumed .* at step 4" "$D.log" && same_steps "$W/rs/metrics.jsonl" "$D/metrics.jsonl" \
        && pass "ep2 zero1 checkpoint resumed as dp$dp ep$ep zero$zero: steps 4..7 match" || fail "resume ep2 -> dp$dp ep$ep"
done

# a tp4 ZeRO-0 checkpoint resumes as dp2 x tp2 with ZeRO-3 (blocks re-cut from the whole tensors,
# parameters and moments sharded)
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" --training.micro_batch=4 --parallel.tp=4 --checkpoint.every=4 \
    --logging.run_dir="$W/rt" > "$W/rt.log" 2>&1 || { fail "tp4 run with checkpoints"; tail -5 "$W/rt.log"; }
cp -r "$W/rt" "$W/rt2"
rm -rf "$W/rt2/checkpoints/step_00000008"
head -4 "$W/rt/metrics.jsonl" > "$W/rt2/metrics.jsonl"
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" --training.micro_batch=2 --parallel.dp=2 --parallel.tp=2 --parallel.zero=3 \
    --logging.run_dir="$W/rt2" --resume > "$W/rt2.log" 2>&1 || { fail "resume tp4 -> dp2 tp2"; tail -5 "$W/rt2.log"; }
grep -q "resumed .* at step 4" "$W/rt2.log" && same_steps "$W/rt/metrics.jsonl" "$W/rt2/metrics.jsonl" \
    && pass "tp4 checkpoint resumed as dp2 x tp2 zero3: steps 4..7 match" || fail "resume tp4 -> dp2 tp2"

# a pp4 (1f1b) checkpoint resumes as one rank, and as pp2 interleaved with dp2 and ZeRO-1
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --parallel.pp=4 \
    --checkpoint.every=4 --logging.run_dir="$W/rp" > "$W/rp.log" 2>&1 || { fail "pp4 run with checkpoints"; tail -5 "$W/rp.log"; }
for to in 1 4; do
    D="$W/rp-$to"
    cp -r "$W/rp" "$D"
    rm -rf "$D/checkpoints/step_00000008"
    head -4 "$W/rp/metrics.jsonl" > "$D/metrics.jsonl"
    if [ $to = 1 ]; then
        "$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$D" --resume \
            > "$D.log" 2>&1 || { fail "resume pp4 on one rank"; tail -5 "$D.log"; }
    else
        $MPIRUN -np 4 "$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=2 --parallel.dp=2 \
            --parallel.zero=1 --parallel.pp=2 --parallel.pp_schedule=interleaved --parallel.pp_chunks=2 \
            --logging.run_dir="$D" --resume > "$D.log" 2>&1 || { fail "resume pp4 as pp2 interleaved"; tail -5 "$D.log"; }
    fi
    grep -q "resumed .* at step 4" "$D.log" && same_steps "$W/rp/metrics.jsonl" "$D/metrics.jsonl" \
        && pass "pp4 checkpoint resumed on $to rank(s): steps 4..7 match" || fail "resume pp4 on $to ranks"
done

# invalid layouts are refused before any work, naming the constraint
bad() { # expected message, then the options
    local want=$1 np=$2
    shift 2
    if $MPIRUN -np "$np" "$TERA" train "${TINY[@]}" "$@" --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1; then
        fail "accepted: $*"
    else
        grep -q "$want" "$W/bad.log" && pass "refused: $want" || fail "message for $*: $(head -3 "$W/bad.log")"
    fi
    rm -rf "$W/bad"
}
bad "parallel.ep (4) must divide parallel.dp (2)" 2 --parallel.dp=2 --parallel.ep=4
bad "parallel.tp (3) must divide model.vocab_size (256)" 3 --parallel.tp=3
bad "parallel.dp x parallel.tp = 2 x 2 = 4 ranks, but 2 are running" 2 --parallel.dp=2 --parallel.tp=2
bad "parallel.pp x parallel.pp_chunks = 8 virtual stages need at least as many layers" 4 --parallel.pp=4 \
    --parallel.pp_schedule=interleaved --parallel.pp_chunks=2 --training.grad_accum=4
bad "parallel.pp_layers = \"3,2\": needs 2 counts (pp x pp_chunks) adding up to model.n_layers = 4" 2 --parallel.pp=2 \
    --parallel.pp_layers=3,2
echo "cli_layouts: $fails failed"
[ "$fails" = 0 ]
