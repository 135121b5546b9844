#!/usr/bin/env bash
# Memory per rank at every moment (issue 13, part 1): no rank ever holds the whole model, also
# not while saving, resuming or converting a checkpoint. On a model whose weights (57 MB) are
# much larger than a rank's ZeRO-3 shard, for dp = 1, 2, 4 and 8 (ZeRO-3), each rank's peak
# resident memory (ru_maxrss, from /usr/bin/time) of
#   - a run of 2 steps that saves nothing (logging.run_dir = ""): the step-loop peak P;
#   - the same run saving a whole checkpoint (streamed to world rank 0), and a sharded one;
#   - --resume from that checkpoint (one more step, then its final save);
#   - tera ckpt convert of that checkpoint to another layout (ZeRO-1, expert parallel where dp > 1)
#   - a run starting from a Hugging Face directory (training.init_from, exported from dp1's checkpoint)
# stays within P + MARGIN (+ SEG with several ranks), with MARGIN (16 MiB) + SEG (16 MiB) well below one
# copy of the weights (54.6 MiB; the code this replaced held 3 whole copies on every rank while saving:
# +170 MiB at dp4 on half this model). SEG is the shared segment a group of ranks maps for its fp32
# collectives (src/comm/comm_shm.c: two sets of 8 MiB): the saves' collectives use it, while since
# wave 28 of issue 19 the step loop's gradient sums and ZeRO-3 gathers go through host-shared blocks
# instead and may leave its pages untouched (P then lacks them). One rank
# (dp = 1) snapshots its own storage only for a save in the background (3 x its floats, the rank's
# double buffer, which is the whole model there; checkpoint.async with checkpoint.every): its bound
# is P + the snapshot `tera train` announces + MARGIN. Its synchronous saves (the final one, and every
# save under checkpoint.async=false) write the state itself: a run saving every step synchronously
# stays within P + MARGIN, and announces no snapshot. Also checked: `tera train` prints the peak
# (field names peak_rss_mib, peak_rss_rank, peak_rss_mib_by_rank).
# Usage: cli_memory.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
[ -x /usr/bin/time ] || { echo "skip: /usr/bin/time not installed"; exit 0; }
MARGIN_MIB=16
SEG_MIB=16
BIG=(--model.dim=256 --model.n_layers=8 --model.n_heads=8 --model.n_kv_heads=4 --model.n_experts=8 --model.ffn_dim=256
     --model.vocab_size=256 --training.seq_len=32 --training.micro_batch=1 --training.grad_accum=1 --training.threads=1
     --training.warmup_steps=1 --data.path="$W/c.txt" --data.val_fraction=0 --training.precision=fp32
     --logging.log_every=100 --checkpoint.writer_buffer_mb=1 --checkpoint.keep=0)
T0=$(date +%s)

# run TAG NP ARGS...: runs tera on NP ranks (NP = 1: no launcher), each rank's peak RSS in
# $W/rss.TAG.RANK (KiB); prints the largest in MiB
run() {
    local tag=$1 np=$2
    shift 2
    rm -f "$W"/rss."$tag".*
    if [ "$np" = 1 ]; then
        /usr/bin/time -f %M -o "$W/rss.$tag.0" "$TERA" "$@" > "$W/$tag.log" 2>&1
    else
        $MPIRUN -np "$np" sh -c '/usr/bin/time -f %M -o "$0.$OMPI_COMM_WORLD_RANK" "$@"' "$W/rss.$tag" "$TERA" "$@" \
            > "$W/$tag.log" 2>&1
    fi || { fail "$tag: tera failed: $(grep -i error "$W/$tag.log" | head -2)"; echo 0; return; }
    [ "$(ls "$W"/rss."$tag".* | wc -l)" = "$np" ] || { fail "$tag: $(ls "$W"/rss."$tag".* | wc -l) of $np ranks measured"; echo 0; return; }
    tail -q -n 1 "$W"/rss."$tag".* | awk '{ if ($1 > m) m = $1 } END { printf "%.1f", m / 1024 }'
}
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a > 0 && a <= b) }'; }

table="dp | step loop (no save) | whole save | sharded save | resume | convert | init from HF | bound"
HF="$W/hf"
for dp in 1 2 4 8; do
    Z=(--parallel.dp=$dp --parallel.zero=3)
    [ "$dp" = 1 ] && Z=()
    R="$W/run$dp"
    p=$(run nosave$dp $dp train "${BIG[@]}" "${Z[@]}" --training.steps=2 --logging.run_dir=)
    w=$(run save$dp $dp train "${BIG[@]}" "${Z[@]}" --training.steps=2 --logging.run_dir="$R")
    s=-
    [ "$dp" -gt 1 ] && s=$(run sharded$dp $dp train "${BIG[@]}" "${Z[@]}" --training.steps=2 --checkpoint.sharded=true \
        --logging.run_dir="$W/sh$dp")
    r=$(run resume$dp $dp train "${BIG[@]}" "${Z[@]}" --training.steps=3 --logging.run_dir="$R" --resume)
    grep -q "resumed .* at step 2" "$W/resume$dp.log" || fail "dp$dp: not resumed at step 2: $(grep -i "error\|resumed" "$W/resume$dp.log" | head -2)"
    C=(--parallel.dp=$dp --parallel.ep=2 --parallel.zero=1)
    [ "$dp" = 1 ] && C=()
    c=$(run convert$dp $dp ckpt convert --from "$R/checkpoints/step_00000002" --out "$W/conv$dp" "${C[@]}")
    # a Hugging Face directory as training.init_from: each rank reads its own ranges (no whole-model import)
    [ -d "$HF" ] || "$TERA" export-hf --from "$W/run1/checkpoints/step_00000002" --out "$HF" --tera-moe > "$W/hf.log" 2>&1 \
        || fail "export-hf: $(tail -2 "$W/hf.log")"
    h=$(run hfinit$dp $dp train "${BIG[@]}" "${Z[@]}" --training.steps=2 --logging.run_dir= --training.init_from="$HF")
    bound=$(awk -v p="$p" -v m="$MARGIN_MIB" -v g="$([ "$dp" -gt 1 ] && echo "$SEG_MIB" || echo 0)" 'BEGIN { printf "%.1f", p + m + g }')
    if [ "$dp" = 1 ]; then # the single rank's snapshot: weights, moments, router bias of its own storage
        snap=$(grep -o "checkpoint memory per rank: snapshot [0-9]*" "$W/save1.log" | grep -o "[0-9]*$")
        bound=$(awk -v p="$p" -v m="$MARGIN_MIB" -v s="${snap:-0}" 'BEGIN { printf "%.1f", p + s / 1048576 + m }')
    fi
    ok=1
    for x in "whole save:$w" "sharded save:$s" "resume:$r" "convert:$c" "init from HF:$h"; do
        v=${x##*:}
        [ "$v" = - ] && continue
        le "$v" "$bound" || { ok=0; fail "dp$dp ZeRO-3 ${x%%:*}: peak RSS $v MiB above the bound $bound MiB (step loop $p MiB)"; }
    done
    [ $ok = 1 ] && pass "dp$dp: peak RSS (MiB, largest rank) step loop $p, whole save $w, sharded save $s, resume $r, convert $c, init from HF $h: all <= $bound"
    table="$table
$dp | $p | $w | $s | $r | $c | $h | $bound"
    [ "$dp" = 1 ] && p1=$p
done

# one rank, a synchronous save at every step: no snapshot (announced as 0 bytes), within P + MARGIN;
# the same run with the saves in the background announces the snapshot (3 x the floats + router bias)
y=$(run sync1 1 train "${BIG[@]}" --training.steps=3 --checkpoint.every=1 --checkpoint.async=false --logging.run_dir="$W/sync1")
a=$(run async1 1 train "${BIG[@]}" --training.steps=3 --checkpoint.every=1 --checkpoint.async=true --logging.run_dir="$W/async1")
ys=$(grep -o "checkpoint memory per rank: snapshot [0-9]*" "$W/sync1.log" | grep -o "[0-9]*$")
as=$(grep -o "checkpoint memory per rank: snapshot [0-9]*" "$W/async1.log" | grep -o "[0-9]*$")
nf=$(grep -o "params [0-9]* (non-expert" "$W/async1.log" | grep -o "[0-9]*") # bytes of the rank's floats
bound=$(awk -v p="${p1:-0}" -v m="$MARGIN_MIB" 'BEGIN { printf "%.1f", p + m }')
if le "$y" "$bound" && [ "$ys" = 0 ] && [ -n "$nf" ] && [ "${as:-0}" -ge $((3 * nf)) ] \
    && [ "$(ls -d "$W"/sync1/checkpoints/step_0000000[123] | wc -l)" = 3 ]; then
    pass "dp1, a synchronous save every step: peak RSS $y MiB <= $bound (step loop ${p1:-?}), no snapshot; in the background it announces $as bytes"
else
    fail "dp1 synchronous saves: peak RSS $y MiB (bound $bound), snapshot announced '$ys' (want 0), background '$as' (want >= 3 x $nf), async peak $a MiB"
fi

# the end-of-run line: the largest rank's peak, which rank, every rank's (dp4's whole-save run)
line=$(grep "tera: memory: peak_rss_mib" "$W/save4.log")
mx=$(echo "$line" | sed 's/.*peak_rss_mib \([0-9.]*\).*/\1/')
byr=$(echo "$line" | sed 's/.*peak_rss_mib_by_rank \([0-9.,]*\).*/\1/')
at=$(echo "$line" | sed 's/.*peak_rss_rank \([0-9]*\).*/\1/')
echo "$byr" | awk -F, -v m="$mx" -v at="$at" '{ if (NF != 4) exit 1; for (i = 1; i <= NF; i++) if ($i > $(at + 1)) exit 1
                                                 exit !($(at + 1) == m && m > 0) }' \
    && pass "tera train prints each rank's peak RSS: $line" || fail "peak RSS line: '$line'"
echo "$table"
echo "time: $(( $(date +%s) - T0 )) s"
finish cli_memory
