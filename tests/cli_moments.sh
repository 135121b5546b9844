#!/usr/bin/env bash
# optimizer.moments = bf16 (AdamW's moments stored as bf16, rounded stochastically; docs/TRAINING.md):
# 1. it trains (the loss falls like fp32 moments' over a few steps) with half the optimizer bytes,
#    printed by tera train and predicted to the byte by tera plan --dry-run;
# 2. checkpoints store the moments as fp32 that are bf16 values (saved exactly), and a resume from
#    one is bit-identical to the uninterrupted run (weights, moments and metrics);
# 3. the rounding depends on no thread count or layout: 1 and 2 threads, and dp2 under ZeRO-0, -1,
#    -2 and -3, dp2 x ep2 against dp2, and a 2-stage pipeline against one process end with
#    byte-identical checkpoints (fp32 moments are bit-identical across these pairs too; one process
#    against dp2, or tp2, is not, even in fp32: the gradients are summed in another order);
# 4. an fp32-moment checkpoint resumes into bf16 moments (rounded to nearest), and 1-bit Adam
#    refuses bf16 moments with an error naming the key.
# Usage: cli_moments.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
A=("${MODEL[@]}" --training.steps=8 --training.micro_batch=4 --logging.progress=false)
B16=(--optimizer.moments=bf16)
mem() { grep "memory bytes per rank" "$1" | grep -o "optimizer [0-9]*" | head -1 | cut -d' ' -f2; }
ck() { echo "$W/$1/checkpoints/step_0000000$2"; }
# same_ckpt DIR1 DIR2: weights and moments byte for byte
same_ckpt() { cmp -s "$1/model.safetensors" "$2/model.safetensors" && cmp -s "$1/optimizer.safetensors" "$2/optimizer.safetensors"; }

# 1. trains, half the optimizer memory
"$TERA" train "${A[@]}" --checkpoint.every=4 --logging.run_dir="$W/f32" > "$W/f32.log" 2>&1 || { fail "fp32 run"; cat "$W/f32.log"; }
"$TERA" train "${A[@]}" "${B16[@]}" --checkpoint.every=4 --logging.run_dir="$W/b16" > "$W/b16.log" 2>&1 \
    || { fail "bf16 moments run"; cat "$W/b16.log"; }
m32=$(mem "$W/f32.log"); m16=$(mem "$W/b16.log")
[ -n "$m32" ] && [ -n "$m16" ] && [ $((2 * m16)) = "$m32" ] && pass "optimizer bytes per rank: fp32 $m32, bf16 $m16" \
    || fail "optimizer bytes: fp32 ${m32:-?}, bf16 ${m16:-?}"
l32=$(last_fields "$W/f32/metrics.jsonl" step loss | awk '{ print $2 }' | tr '\n' ' ')
l16=$(last_fields "$W/b16/metrics.jsonl" step loss | awk '{ print $2 }' | tr '\n' ' ')
# the loss falls over the 8 steps, and each step's stays within 1% of the fp32 moments' run
awk -v a="$l32" -v b="$l16" 'BEGIN { n = split(a, x, " "); m = split(b, y, " "); if (n != 8 || m != 8) exit 1
    if (!(y[8] < y[1] - 0.1)) exit 1
    for (i = 1; i <= 8; i++) { d = (y[i] - x[i]) / x[i]; if (d < 0) d = -d; if (d > 0.01) exit 1 } }' \
    && pass "bf16 moments train: loss $(echo "$l16" | awk '{ print $1 " -> " $8 }') (fp32 moments $(echo "$l32" | awk '{ print $1 " -> " $8 }'))" \
    || fail "bf16 moments losses: $l16 against fp32 $l32"
if "$TERA" plan --dry-run "${A[@]}" "${B16[@]}" --parallel.dp=2 --parallel.zero=1 --training.micro_batch=2 --json > "$W/plan.json" 2> "$W/plan.err" \
    && $MPIRUN -np 2 "$TERA" train "${A[@]}" "${B16[@]}" --parallel.dp=2 --parallel.zero=1 --training.micro_batch=2 \
        --training.steps=2 --training.warmup_steps=1 --logging.run_dir= > "$W/plan.log" 2>&1; then
    p=$(mem "$W/plan.log"); q=$(jq -r '.roles[0].optimizer' "$W/plan.json")
    [ -n "$p" ] && [ "$p" = "$q" ] && pass "dp2 ZeRO-1 with bf16 moments: $p optimizer bytes per rank, predicted to the byte" \
        || fail "planner's optimizer bytes $q, tera train ${p:-?}"
else
    fail "plan / dp2 run: $(cat "$W/plan.err"; grep error "$W/plan.log" | head -2)"
fi

# 2. stored moments are bf16 values; resume is bit-identical
/usr/bin/python3 - "$(ck b16 8)/optimizer.safetensors" > "$W/st.txt" 2>&1 <<'PY'
import json, struct, sys
d = open(sys.argv[1], "rb").read()
h = struct.unpack("<Q", d[:8])[0]
head = json.loads(d[8:8 + h])
n = low = 0
for k, t in head.items():
    if k == "__metadata__": continue
    assert t["dtype"] == "F32", t["dtype"]
    a, b = t["data_offsets"]
    for (u,) in struct.iter_unpack("<I", d[8 + h + a:8 + h + b]):
        n += 1
        low += (u & 0xFFFF) != 0
print(n, low)
PY
read -r n low < "$W/st.txt"
[ "${low:-1}" = 0 ] && [ "${n:-0}" -gt 0 ] && pass "optimizer.safetensors: $n fp32 moments, every one a bf16 value" \
    || fail "stored moments: $(cat "$W/st.txt")"
mkdir -p "$W/r/checkpoints" && cp -r "$(ck b16 4)" "$W/r/checkpoints/" && cp "$W/b16/config.ini" "$W/r/"
"$TERA" train "${A[@]}" "${B16[@]}" --checkpoint.every=4 --logging.run_dir="$W/r" --resume > "$W/r.log" 2>&1 || { fail "resume"; cat "$W/r.log"; }
grep -q "resumed .* at step 4" "$W/r.log" && same_ckpt "$(ck b16 8)" "$(ck r 8)" \
    && cmp -s <(untimed "$W/b16/metrics.jsonl" | grep -v event | tail -4) <(untimed "$W/r/metrics.jsonl" | grep -v event | tail -4) \
    && pass "resume at step 4: steps 4-7 and the step-8 checkpoint byte-identical to the uninterrupted run" \
    || fail "resume with bf16 moments differs: $(grep -c . "$W/r/metrics.jsonl") records"

# 3. threads and ZeRO stages
"$TERA" train "${A[@]}" "${B16[@]}" --training.threads=2 --logging.run_dir="$W/t2" > "$W/t2.log" 2>&1 || fail "2 threads"
# (fp32 products do not depend on the thread count on any ISA, ONEDNN_MAX_CPU_ISA=AVX2 included:
# tests/cli_threads.sh)
same_ckpt "$(ck b16 8)" "$(ck t2 8)" && pass "1 and 2 threads: byte-identical checkpoints" \
    || fail "1 and 2 threads: the checkpoints differ"
for z in 0 1 2 3; do
    $MPIRUN -np 2 "$TERA" train "${A[@]}" "${B16[@]}" --training.micro_batch=2 --parallel.dp=2 --parallel.zero=$z \
        --logging.run_dir="$W/z$z" > "$W/z$z.log" 2>&1 || { fail "dp2 ZeRO-$z run: $(grep error "$W/z$z.log" | head -2)"; continue; }
    [ $z = 0 ] && continue
    same_ckpt "$(ck z0 8)" "$(ck z$z 8)" && pass "dp2 ZeRO-$z (moments sharded): byte-identical to dp2 ZeRO-0" \
        || fail "dp2 ZeRO-$z differs from ZeRO-0"
done
# expert parallelism (dp2 x ep2 ZeRO-1: each rank holds half the experts) against dp2 ZeRO-1, and a
# two-stage pipeline against one process with the same micro-batches (both pairs bit-identical in fp32)
$MPIRUN -np 2 "$TERA" train "${A[@]}" "${B16[@]}" --training.micro_batch=2 --parallel.dp=2 --parallel.ep=2 --parallel.zero=1 \
    --logging.run_dir="$W/ep2" > "$W/ep2.log" 2>&1 && same_ckpt "$(ck z1 8)" "$(ck ep2 8)" \
    && pass "dp2 x ep2 ZeRO-1: byte-identical to dp2 ZeRO-1" || fail "dp2 x ep2: $(grep error "$W/ep2.log" | head -2) differs"
"$TERA" train "${A[@]}" "${B16[@]}" --training.micro_batch=2 --training.grad_accum=2 --logging.run_dir="$W/acc" > "$W/acc.log" 2>&1 \
    && $MPIRUN -np 2 "$TERA" train "${A[@]}" "${B16[@]}" --training.micro_batch=2 --training.grad_accum=2 --parallel.pp=2 \
        --logging.run_dir="$W/pp2" > "$W/pp2.log" 2>&1 && same_ckpt "$(ck acc 8)" "$(ck pp2 8)" \
    && pass "pp2 (2 stages, 2 micro-batches): byte-identical to one process" || fail "pp2: $(grep error "$W/pp2.log" | head -2) differs"

# 4. fp32 moments into bf16 ones; 1-bit Adam refuses
mkdir -p "$W/x/checkpoints" && cp -r "$(ck f32 4)" "$W/x/checkpoints/" && cp "$W/f32/config.ini" "$W/x/"
"$TERA" train "${A[@]}" "${B16[@]}" --logging.run_dir="$W/x" --resume > "$W/x.log" 2>&1 && grep -q "resumed .* at step 4" "$W/x.log" \
    && a=$(last_fields "$W/x/metrics.jsonl" step loss | awk '$1 == 5 { print $2 }') \
    && b=$(last_fields "$W/f32/metrics.jsonl" step loss | awk '$1 == 5 { print $2 }') && within "$b" "$a" 0.001 \
    && pass "fp32 checkpoint resumed with bf16 moments: step 5 loss $a (fp32 moments $b)" \
    || fail "fp32 -> bf16 moments resume: $(grep error "$W/x.log" | head -2) ${a:-?} vs ${b:-?}"
if "$TERA" train "${A[@]}" "${B16[@]}" --optimizer.name=onebit_adam --logging.run_dir= > "$W/ob.log" 2>&1; then
    fail "1-bit Adam accepted bf16 moments"
else
    grep -q "optimizer.moments" "$W/ob.log" && pass "1-bit Adam refuses: $(grep -o 'optimizer.moments.*' "$W/ob.log" | head -1 | cut -c1-100)" \
        || fail "1-bit Adam error: $(tail -2 "$W/ob.log")"
fi
finish cli_moments
