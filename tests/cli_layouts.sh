#!/usr/bin/env bash
# Parallel layouts train the same model as one process. For each layout of the table, the tiny MoE
# trains 8 steps in fp32 with the same global batch as a one-rank run whose micro-batch has the same
# shape as each rank's (so every rank's matrix products but tensor parallelism's have the one-rank
# run's shapes), and every step's loss and grad norm and the final weights (the validation loss of
# the final checkpoints) are compared with it:
# - a pipeline alone (ppP, any schedule) changes no sum: bit-identical metrics and final weights;
# - data, expert and tensor parallelism change the order of fp32 sums (over ranks instead of over
#   micro-batches, or a split of K), so they agree to TOL (below), not bit for bit.
# Results must not depend on the CPU: the one-rank reference is also trained under oneDNN's AVX2
# kernels (ONEDNN_MAX_CPU_ISA=AVX2, another summation order) and must agree to TOL, and `make
# test-dist` runs the whole table under the AVX2 cap as well as the machine's own ISA. bf16 (operands
# rounded to 8 bits) amplifies a last-bit difference: a few layouts are checked in bf16 with BF16_TOL.
# Memory per rank by category is compared with the formulas of docs/PARALLELISM.md.
# Also: dropless routing under expert parallelism, model.router_force_balance on ep2 and pp2 x dp2 x
# ep2, overlap on/off bit-identical, checkpoints
# resumed under another layout (ep 2 -> 1, ep 2 -> 4 with ZeRO-1).
#
# Tolerances (docs/PARALLELISM.md, "What is bit-identical"): TOL = LAYOUT_TOL (tests/mpilib.sh) = 2e-6 relative. fp32's unit
# roundoff is 6e-8; a reordered sum of n terms differs by at most ~n ulps of its largest term, and Adam
# (m / sqrt(v)) turns a relative error of a gradient element into the same relative error of its
# update, so differences stay at the level of the last printed digit (7 significant): measured worst
# over the 69 layouts x {AMX, AVX2} 8 steps: see PARALLELISM.md. TOL is 2e-6 (about 30 ulps), still
# 500x below the smallest real fault these checks have caught (a missing or doubled gradient term
# moves step 1's loss by > 1e-3). The test model is in fp32 (training.precision=fp32, set here so that
# no default or CPU changes it) and drops tokens at capacity 1.25 with the position policy: a
# routing decision flips only when two experts' router logits are within a few ulps, which 8 steps
# of this model never came near (the drops counted per step, dropped_frac, are compared exactly).
# BF16_TOL = 5e-4: bf16 rounds operands to 8 significant bits, so a weight whose fp32 value moved by
# one ulp (2^-24) rounds to a neighbouring bf16 value (2^-8 away) with probability 2^-16: the
# difference per element has a mean of about one fp32 ulp but a spread of about 2^-16 = 1.5e-5,
# measured 2.4e-5..5.2e-5 relative in the losses after 8 steps; 5e-4 leaves a factor 10.
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
TOL=${TERA_LAYOUT_TOL:-$LAYOUT_TOL}
BF16_TOL=5e-4
TINY=("${MODEL[@]}" --training.steps=8)

val_loss() { "$TERA" eval --from "$1" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32 \
    --training.micro_batch=4 --training.eval_batches=4 2> /dev/null | sed 's/.*"val_loss": \([0-9.]*\).*/\1/'; }
field() { grep "memory bytes per rank" "$1" | grep -o "$2 [0-9]*" | head -1 | cut -d' ' -f2; } # a figure of that line
dropped() { grep -o '"dropped_frac": [^,]*' "$1/metrics.jsonl"; }
# ref M G [ARGS...]: the one-rank run with micro-batch M and G sequences per step (G / M micro-batches)
ref() {
    local m=$1 g=$2 d="$W/one-$1-$2"
    shift 2
    [ -d "$d" ] || "$TERA" train "${TINY[@]}" "$@" --training.micro_batch="$m" --training.grad_accum=$((g / m)) \
        --logging.run_dir="$d" > "$d.log" 2>&1 || { fail "one rank, micro-batch $m x $((g / m))"; cat "$d.log"; }
    REF=$d
}

ref 1 4
elems() { grep -o "replicated [0-9]*, tensor-parallel [0-9]*, expert [0-9]*" "$1" | tr -dc '0-9 ' | tr -s ' '; }
read -r REP SPL EXP <<< "$(elems "$W/one-1-4.log")"
# the default configuration (no training.precision given) computes in fp32 on every CPU (an AMX
# CPU must not change it): bit-identical to the fp32 run
DEF=()
for a in "${TINY[@]}"; do [ "$a" = --training.precision=fp32 ] || DEF+=("$a"); done
"$TERA" train "${DEF[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/def" > "$W/def.log" 2>&1 \
    && cmp -s <(untimed "$W/one-1-4/metrics.jsonl") <(untimed "$W/def/metrics.jsonl") \
    && pass "the default precision is fp32 on this CPU: $(grep -o '^tera: precision [^|]*' "$W/def.log")" \
    || fail "the default precision is not fp32 here: $(grep -o '^tera: precision [^|]*' "$W/def.log")"
# the same maths on other kernels: oneDNN capped at AVX2 sums in another order than AVX-512 / AMX
ONEDNN_MAX_CPU_ISA=AVX2 "$TERA" train "${TINY[@]}" --training.micro_batch=1 --training.grad_accum=4 \
    --logging.run_dir="$W/avx2" > "$W/avx2.log" 2>&1 || fail "one rank under ONEDNN_MAX_CPU_ISA=AVX2"
a=$(val_loss "$W/one-1-4/checkpoints/step_00000008"); b=$(val_loss "$W/avx2/checkpoints/step_00000008")
out=$(compare_steps "$W/one-1-4/metrics.jsonl" "$W/avx2/metrics.jsonl" "$TOL") && within "$a" "$b" "$TOL" \
    && pass "one rank on oneDNN's ISA $(grep -o 'ISA [a-z0-9_]*' "$W/avx2.log" | head -1 | cut -d' ' -f2) vs $(grep -o 'ISA [a-z0-9_]*' "$W/one-1-4.log" | head -1 | cut -d' ' -f2): $out; validation $a vs $b" \
    || fail "the CPU's kernels change the results: $out; validation $a vs $b"

# name : parallel.dp : parallel.tp : parallel.ep : zero [: parallel.pp : schedule : chunks]
LAYOUTS="dp2:2:1:1:3 tp2:1:2:1:0 ep4:4:1:4:2 dp2xtp2:2:2:1:1 tp2xep2:2:2:2:1 dp2xtp2xep2:4:2:2:3
         pp2:1:1:1:0:2:1f1b:1 pp4/gpipe:1:1:1:0:4:gpipe:1 pp2/interleaved:1:1:1:0:2:interleaved:2
         pp2xdp2xep2:4:1:2:1:2:1f1b:1 tp2+sp:1:2:1:0:1:1f1b:1:1 dp2xtp2xep2+sp:4:2:2:3:1:1f1b:1:1
         pp2xtp2+sp:1:2:1:0:2:1f1b:1:1"
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
    for l in tp2:1:2:1 tp4:1:4:1 dp2xtp2:2:2:1 tp2xep2:2:2:2 dp2xtp2xep2:4:2:2; do # sequence parallelism
        zs="0 1 2 3"
        [ "${l#*:}" = 1:2:1 ] || [ "${l#*:}" = 1:4:1 ] && zs=0 # dp 1: ZeRO shards nothing
        for z in $zs; do LAYOUTS="$LAYOUTS ${l%%:*}+sp:${l#*:}:$z:1:1f1b:1:1"; done
    done
    LAYOUTS="$LAYOUTS pp2xtp2+sp:1:2:1:0:2:1f1b:1:1 pp2xdp2xtp2+sp:2:2:1:1:2:1f1b:1:1"
fi
for l in $LAYOUTS; do
    IFS=: read -r name dp tp ep zero pp sched chunks sp <<< "$l"
    pp=${pp:-1} sched=${sched:-1f1b} chunks=${chunks:-1} sp=${sp:-0}
    SP=()
    [ "$sp" = 1 ] && SP=(--parallel.sequence_parallel=true)
    tag="$name zero$zero"
    R="$W/${name//\//-}-$zero"
    global=4 accum=1
    [ "$dp" = 8 ] && global=8 # dp 8: 8 sequences per step
    micro=$((global / dp))
    [ "$pp" -gt 1 ] && { micro=1; accum=$((global / dp)); } # a pipeline's micro-batches are the accumulation steps
    ref "$micro" "$global"
    $MPIRUN -np $((pp * dp * tp)) "$TERA" train "${TINY[@]}" --training.micro_batch=$micro --training.grad_accum=$accum \
        --parallel.dp="$dp" --parallel.tp="$tp" --parallel.ep="$ep" --parallel.zero="$zero" --parallel.pp="$pp" \
        --parallel.pp_schedule="$sched" --parallel.pp_chunks="$chunks" ${SP[@]+"${SP[@]}"} --logging.run_dir="$R" \
        > "$R.log" 2>&1 || { fail "$tag run"; tail -5 "$R.log"; continue; }
    C=checkpoints/step_00000008/model.safetensors
    if [ "$dp" = 1 ] && [ "$tp" = 1 ]; then # a pipeline alone: the same sums in the same order
        cmp -s <(untimed "$REF/metrics.jsonl") <(untimed "$R/metrics.jsonl") && cmp -s "$REF/$C" "$R/$C" \
            && pass "$tag: bit-identical to one rank (every metric of every step, final weights)" \
            || fail "$tag: differs from one rank: $(compare_steps "$REF/metrics.jsonl" "$R/metrics.jsonl" 0 | tail -1)"
    else
        out=$(compare_steps "$REF/metrics.jsonl" "$R/metrics.jsonl" "$TOL") && [ "$(grep -c '"loss"' "$R/metrics.jsonl")" = 8 ] \
            && [ "$(dropped "$REF")" = "$(dropped "$R")" ] \
            && pass "$tag: every step's loss and grad norm match one rank ($out), tokens dropped alike" \
            || fail "$tag: differs from one rank: $out"
        a=$(val_loss "$REF/checkpoints/step_00000008"); b=$(val_loss "$R/checkpoints/step_00000008")
        within "$a" "$b" "$TOL" && pass "$tag: final weights give the same validation loss ($a vs $b)" \
            || fail "$tag: final weights $a vs $b"
    fi
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

# Sequence parallelism keeps 1/tp of the residual stream's rows on each rank: against tp2 without it,
# rank 0's activations are smaller by exactly those rows of every layer's x_in, h, ln1 and ln2 (D floats
# a row; the norms' outputs gathered again in the backward) and rstd1, rstd2 (one float a row), and of
# the final x_final and rstdf, each buffer rounded up to 64 bytes as the allocator carves it
# (model.n_layers = 4, micro-batch 4 x 32 rows, D = 32).
act() { grep "memory bytes per rank" "$1" | grep -o "activations [0-9]*" | cut -d' ' -f2; }
a0=$(act "$W/tp2-0.log") a1=$(act "$W/tp2+sp-0.log")
awk -v a="$a0" -v b="$a1" 'function sz(n) { return int((4 * n + 63) / 64) * 64 }
    BEGIN { N = 4 * 32; R = N / 2; D = 32; L = 4
            want = L * (4 * (sz(N * D) - sz(R * D)) + 2 * (sz(N) - sz(R))) + (sz(N * D) - sz(R * D)) + (sz(N) - sz(R))
            exit !(a != "" && b != "" && a - b == want) }' \
    && pass "sequence parallelism: activations $a1 bytes a rank against $a0 (the residual stream's rows / tp)" \
    || fail "sequence parallelism: activations ${a1:-?} bytes a rank against ${a0:-?} without it"
# ... and with full recomputation, where each layer keeps its input only (its rows on this rank), or
# selective, it trains the same model as one rank
ref 4 4
for rc in full selective; do
    R="$W/tp2-sp-$rc"
    $MPIRUN -np 2 "$TERA" train "${TINY[@]}" --training.micro_batch=4 --parallel.tp=2 --parallel.sequence_parallel=true \
        --training.recompute=$rc --logging.run_dir="$R" > "$R.log" 2>&1 || { fail "tp2 sequence-parallel $rc recompute run"; tail -5 "$R.log"; }
    out=$(compare_steps "$REF/metrics.jsonl" "$R/metrics.jsonl" "$TOL") && [ "$(grep -c '"loss"' "$R/metrics.jsonl")" = 8 ] \
        && pass "tp2 sequence-parallel with $rc recomputation: every step matches one rank ($out)" \
        || fail "tp2 sequence-parallel with $rc recomputation differs from one rank: $out"
    rm -rf "$R"
done

# bf16: a pipeline is still bit-identical; data, tensor (with and without sequence parallelism) and
# expert parallelism agree to BF16_TOL
BF=(--training.precision=bf16)
for l in pp2:1:1:1:2:1:4 dp2:2:1:1:1:2:1 tp2:1:2:1:1:4:1 dp2xtp2xep2:4:2:2:1:1:1 tp2+sp:1:2:1:1:4:1:1; do
    IFS=: read -r name dp tp ep pp micro accum sp <<< "$l"
    SP=()
    [ "${sp:-0}" = 1 ] && SP=(--parallel.sequence_parallel=true)
    [ -d "$W/bf-$micro" ] || "$TERA" train "${TINY[@]}" "${BF[@]}" --training.micro_batch="$micro" \
        --training.grad_accum=$((4 / micro)) --logging.run_dir="$W/bf-$micro" > "$W/bf-$micro.log" 2>&1 || fail "bf16 one rank"
    $MPIRUN -np $((pp * dp * tp)) "$TERA" train "${TINY[@]}" "${BF[@]}" --training.micro_batch="$micro" \
        --training.grad_accum="$accum" --parallel.dp="$dp" --parallel.tp="$tp" --parallel.ep="$ep" --parallel.pp="$pp" \
        ${SP[@]+"${SP[@]}"} --logging.run_dir="$W/bf-$name" > "$W/bf-$name.log" 2>&1 \
        || { fail "bf16 $name run"; tail -5 "$W/bf-$name.log"; continue; }
    if [ "$pp" -gt 1 ]; then
        cmp -s <(untimed "$W/bf-$micro/metrics.jsonl") <(untimed "$W/bf-$name/metrics.jsonl") \
            && pass "bf16 $name: bit-identical to one rank" || fail "bf16 $name differs from one rank"
    else
        out=$(compare_steps "$W/bf-$micro/metrics.jsonl" "$W/bf-$name/metrics.jsonl" "$BF16_TOL") \
            && pass "bf16 $name: every step matches one rank within $BF16_TOL ($out)" || fail "bf16 $name: $out"
    fi
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
    compare_steps "$W/ev1/metrics.jsonl" "$W/ev$z/metrics.jsonl" "$TOL" > "$W/cmp.txt" &&
        paste -d' ' <(grep -o '"val_loss": [0-9.]*' "$W/ev1/metrics.jsonl" | cut -d' ' -f2) \
                    <(grep -o '"val_loss": [0-9.]*' "$W/ev$z/metrics.jsonl" | cut -d' ' -f2) |
        awk -v tol="$TOL" '{ d = $1 - $2; if (d < 0) d = -d; if (d > tol * $1) bad = 1; n++ } END { exit bad || n != 2 }' \
        && pass "ep2 zero$z with 2 micro-batches per step: every step and both validations match one rank ($(tail -1 "$W/cmp.txt"))" \
        || fail "zero$z with accumulation or evaluation differs"
done

# ZeRO-3 prefetch (parallel.zero_prefetch, on by default above): every layer gather of the ev3 run
# (training and evaluation) was started while the previous layer computed, none was wasted, and
# turning it off gives bit-identical steps, validations and final weights
$MPIRUN -np 2 "$TERA" train "${TINY[@]}" "${EV[@]}" --training.micro_batch=1 --training.grad_accum=2 --parallel.dp=2 \
    --parallel.ep=2 --parallel.zero=3 --parallel.zero_prefetch=0 --logging.run_dir="$W/ev3off" > "$W/ev3off.log" 2>&1 \
    || { fail "zero3 without prefetch"; tail -5 "$W/ev3off.log"; }
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
compare_steps "$W/ev1/metrics.jsonl" "$W/pz1/metrics.jsonl" "$TOL" > "$W/cmp.txt" \
    && paste -d' ' <(grep -o '"val_loss": [0-9.]*' "$W/ev1/metrics.jsonl" | cut -d' ' -f2) \
                   <(grep -o '"val_loss": [0-9.]*' "$W/pz1/metrics.jsonl" | cut -d' ' -f2) |
       awk -v tol="$TOL" '{ d = $1 - $2; if (d < 0) d = -d; if (d > tol * $1) bad = 1; n++ } END { exit bad || n != 2 }' \
    && [ -n "$g1" ] && [ "$p1" -gt $((g1 / 2)) ] && [ "$u1" = 0 ] \
    && cmp -s <(untimed "$W/pz1/metrics.jsonl") <(untimed "$W/pz0/metrics.jsonl") \
    && cmp -s "$W/pz1/checkpoints/step_00000008/model.safetensors" "$W/pz0/checkpoints/step_00000008/model.safetensors" \
    && pass "pp2 x dp2 zero3 with 3 validation batches: matches one rank; prefetch $p1 of $g1 gathers, $u1 unused, bit-identical to none ($(tail -1 "$W/cmp.txt"))" \
    || fail "pp2 x dp2 zero3 with evaluation: gathers $g1 prefetched $p1 unused $u1, or differs from one rank / no prefetch"

# five dimensions at once (pp2 x dp2 x tp2 x ep2, ZeRO-1, dropless): activation recomputation
# (full and selective per layer range) gives bit-identical losses and final weights
FIVE=(--training.micro_batch=1 --training.grad_accum=2 --parallel.pp=2 --parallel.dp=2 --parallel.tp=2 --parallel.ep=2
      --parallel.zero=1 --model.capacity_factor=0)
for rc in none full:0-1,selective:2-3; do
    $MPIRUN -np 8 "$TERA" train "${TINY[@]}" "${FIVE[@]}" --training.recompute=$rc --logging.run_dir="$W/five-${rc%%:*}" \
        > "$W/five.log" 2>&1 || { fail "5-D run with recompute $rc"; tail -5 "$W/five.log"; }
done
cmp -s <(untimed "$W/five-none/metrics.jsonl") <(untimed "$W/five-full/metrics.jsonl") &&
    cmp -s "$W/five-none/checkpoints/step_00000008/model.safetensors" "$W/five-full/checkpoints/step_00000008/model.safetensors" \
    && pass "pp2 x dp2 x tp2 x ep2 zero1: recompute full:0-1,selective:2-3 bit-identical to none" \
    || fail "recomputation changes a 5-D run"

# dropless routing: the token counts are exchanged first, buffers hold the worst case
DL=(--model.capacity_factor=0)
"$TERA" train "${TINY[@]}" "${DL[@]}" --training.micro_batch=1 --training.grad_accum=4 --logging.run_dir="$W/dl1" \
    > "$W/dl1.log" 2>&1 || fail "dropless one rank"
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" "${DL[@]}" --training.micro_batch=1 --parallel.dp=4 --parallel.ep=4 \
    --logging.run_dir="$W/dl4" > "$W/dl4.log" 2>&1 || { fail "dropless ep4"; tail -5 "$W/dl4.log"; }
compare_steps "$W/dl1/metrics.jsonl" "$W/dl4/metrics.jsonl" "$TOL" > "$W/cmp.txt" && pass "dropless ep4: every step matches one rank ($(tail -1 "$W/cmp.txt"))" \
    || fail "dropless ep4 differs: $(tail -2 "$W/cmp.txt")"
# thousands of experts: 4096 routed experts per layer with top-8 (capacity 1.25, so repeats drop)
# train on one rank and under ep = 8 (512 experts per rank) with the same losses
BIG=(--model.dim=16 --model.n_layers=2 --model.n_heads=2 --model.n_kv_heads=2 --model.n_experts=4096 --model.top_k=8
     --model.ffn_dim=8 --model.capacity_factor=1.25 --training.seq_len=16 --training.warmup_steps=1 --training.steps=4
     --training.threads=1 --data.path="$W/c.txt" --training.precision=fp32 --checkpoint.every=0)
"$TERA" train "${BIG[@]}" --training.micro_batch=1 --training.grad_accum=8 --logging.run_dir="$W/e4096" > "$W/e4096.log" 2>&1 \
    || { fail "4096 experts on one rank"; tail -5 "$W/e4096.log"; }
$MPIRUN -np 8 "$TERA" train "${BIG[@]}" --training.micro_batch=1 --parallel.dp=8 --parallel.ep=8 \
    --logging.run_dir="$W/e4096ep8" > "$W/e4096ep8.log" 2>&1 || { fail "4096 experts under ep8"; tail -5 "$W/e4096ep8.log"; }
out=$(compare_steps "$W/e4096/metrics.jsonl" "$W/e4096ep8/metrics.jsonl" "$TOL") && [ "$(dropped "$W/e4096")" = "$(dropped "$W/e4096ep8")" ] \
    && grep -q '"dropped_frac": 0\.[0-9]*[1-9]' "$W/e4096/metrics.jsonl" \
    && pass "4096 experts, top-8: ep8 matches one rank ($out), the same tokens dropped" || fail "4096 experts under ep8: $out"

# model.router_force_balance (benchmarking only): the fixed balanced pattern of each token's position
# (experts (t k + j + l) mod E) is the same on every layout: ep2 (each rank 2 sequences) matches one
# rank running all 4 in one micro-batch, and pp2 x dp2 x ep2 (1F1B) one rank of 4 micro-batches of 1
# (tests/test_balance.c checks the pattern itself, test_decode.c the positions of decoding); nothing is dropped at capacity 1.25
# (each expert gets T k / E = 16 rows of every sequence, the capacity 20), the aux-free bias of MODEL
# is ignored, and the losses are not those of the learned routing (the pattern is in effect)
FB=(--model.router_force_balance=true)
for l in ep2:2:1:2:2:1:4 pp2xdp2xep2:4:2:2:1:2:1; do
    IFS=: read -r name np pp ep micro accum rmicro <<< "$l"
    [ -d "$W/fb-$rmicro" ] || "$TERA" train "${TINY[@]}" "${FB[@]}" --training.micro_batch="$rmicro" \
        --training.grad_accum=$((4 / rmicro)) --logging.run_dir="$W/fb-$rmicro" > "$W/fb-$rmicro.log" 2>&1 \
        || { fail "forced balance, one rank"; tail -5 "$W/fb-$rmicro.log"; }
    $MPIRUN -np "$np" "$TERA" train "${TINY[@]}" "${FB[@]}" --training.micro_batch="$micro" --training.grad_accum="$accum" \
        --parallel.dp=$((np / pp)) --parallel.ep="$ep" --parallel.pp="$pp" --logging.run_dir="$W/fb-$name" \
        > "$W/fb-$name.log" 2>&1 || { fail "forced balance $name run"; tail -5 "$W/fb-$name.log"; continue; }
    out=$(compare_steps "$W/fb-$rmicro/metrics.jsonl" "$W/fb-$name/metrics.jsonl" "$TOL") \
        && [ "$(grep -c '"loss"' "$W/fb-$name/metrics.jsonl")" = 8 ] \
        && ! dropped "$W/fb-$name" | grep -qv ': 0\(\.0*\)\?$' \
        && pass "forced balance $name: every step matches one rank ($out), nothing dropped" \
        || fail "forced balance $name differs from one rank or dropped tokens: $out; $(dropped "$W/fb-$name" | sort | uniq -c | head -3)"
done
ref 4 4
cmp -s <(untimed "$W/one-4-4/metrics.jsonl") <(untimed "$W/fb-4/metrics.jsonl") \
    && fail "forced balance: the same losses as the learned routing" || pass "forced balance changes the routing"

# overlap of the exchange with expert compute changes nothing, bit for bit
$MPIRUN -np 4 "$TERA" train "${TINY[@]}" "${DL[@]}" --training.micro_batch=1 --parallel.dp=4 --parallel.ep=4 \
    --parallel.ep_overlap=0 --logging.run_dir="$W/dl4n" > "$W/dl4n.log" 2>&1 || fail "dropless ep4 without overlap"
cmp -s <(untimed "$W/dl4/metrics.jsonl") <(untimed "$W/dl4n/metrics.jsonl") &&
    cmp -s "$W/dl4/checkpoints/step_00000008/model.safetensors" "$W/dl4n/checkpoints/step_00000008/model.safetensors" \
    && pass "ep overlap on and off: bit-identical losses and final weights" || fail "overlap changes results"

# ... and the shared expert runs while the rows travel (tera_dispatch_side_work): each MoE layer's forward
# (its hidden activations) and backward once per micro-batch (3 MoE layers of MODEL), the full
# recomputation's forward again (all but the last layer, which the work set still holds); none without
# the overlap or without an exchange (rank 0's counts, tera bench's shared_overlapped_per_step)
for l in ov:1:1:ep2:6 accum2:1:2:ep2:12 full:1:1:ep2:8 off:0:1:ep2:0 ep1:1:1:ep1:0; do
    IFS=: read -r name ov accum epl want <<< "$l"
    extra=()
    [ "$name" = full ] && extra=(--training.recompute=full)
    got=$($MPIRUN -np 2 "$TERA" bench "${MODEL[@]}" --steps 2 --warmup 1 --training.micro_batch=2 --training.grad_accum="$accum" \
            --parallel.dp=2 --parallel.ep="${epl#ep}" --parallel.ep_overlap="$ov" "${extra[@]}" 2> "$W/shov-$name.log" | tail -1 \
          | python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["shared_overlapped_per_step"])')
    [ "$got" = "$want.0" ] && pass "shared expert during the exchange ($name): $got passes a step" \
        || fail "shared expert during the exchange ($name): ${got:-?} passes a step, want $want"
done

# tensor parallelism's overlap (parallel.tp_overlap: the weight gradients computed while the input
# gradients are summed; the dense FFN, the shared expert, the routed experts' split exchange, the
# router, q/k/v and the head) changes nothing either: on (the default) and off, bit for bit
for ov in 1 0; do
    $MPIRUN -np 4 "$TERA" train "${MODEL[@]}" --training.steps=3 --training.micro_batch=2 --parallel.dp=2 --parallel.tp=2 \
        --parallel.ep=2 --parallel.tp_overlap=$ov --logging.run_dir="$W/tpov$ov" > "$W/tpov$ov.log" 2>&1 \
        || { fail "dp2 x tp2 x ep2 with parallel.tp_overlap=$ov"; tail -5 "$W/tpov$ov.log"; }
done
K=checkpoints/step_00000003
cmp -s <(untimed "$W/tpov1/metrics.jsonl") <(untimed "$W/tpov0/metrics.jsonl") && [ "$(grep -c '"loss"' "$W/tpov1/metrics.jsonl")" = 3 ] \
    && cmp -s "$W/tpov1/$K/model.safetensors" "$W/tpov0/$K/model.safetensors" \
    && cmp -s "$W/tpov1/$K/optimizer.safetensors" "$W/tpov0/$K/optimizer.safetensors" \
    && pass "tp overlap on and off (dp2 x tp2 x ep2): bit-identical losses, final weights and moments" \
    || fail "tp overlap changes results: $(compare_steps "$W/tpov1/metrics.jsonl" "$W/tpov0/metrics.jsonl" 0 | tail -1)"

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
    grep -q "resumed .* at step 4" "$D.log" && compare_steps "$W/rs/metrics.jsonl" "$D/metrics.jsonl" "$TOL" > "$W/cmp.txt" \
        && pass "ep2 zero1 checkpoint resumed as dp$dp ep$ep zero$zero: steps 4..7 match ($(tail -1 "$W/cmp.txt"))" || fail "resume ep2 -> dp$dp ep$ep: $(tail -2 "$W/cmp.txt")"
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
grep -q "resumed .* at step 4" "$W/rt2.log" && compare_steps "$W/rt/metrics.jsonl" "$W/rt2/metrics.jsonl" "$TOL" > "$W/cmp.txt" \
    && pass "tp4 checkpoint resumed as dp2 x tp2 zero3: steps 4..7 match ($(tail -1 "$W/cmp.txt"))" || fail "resume tp4 -> dp2 tp2: $(tail -2 "$W/cmp.txt")"

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
    grep -q "resumed .* at step 4" "$D.log" && compare_steps "$W/rp/metrics.jsonl" "$D/metrics.jsonl" "$TOL" > "$W/cmp.txt" \
        && pass "pp4 checkpoint resumed on $to rank(s): steps 4..7 match ($(tail -1 "$W/cmp.txt"))" || fail "resume pp4 on $to ranks: $(tail -2 "$W/cmp.txt")"
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
