#!/usr/bin/env bash
# fp32 training is bit-identical on 1, 2 and 3 threads under oneDNN's AVX2 kernels
# (ONEDNN_MAX_CPU_ISA=AVX2), its AVX-512 kernels (AVX512_CORE) and the machine's own: the step
# records (loss, grad norm, ...) and the final weights and moments byte for byte. The tiny MoE model
# has every product kind (attention, a dense first layer, a shared expert, 4 experts that run one
# after another on every thread at 1 and 3 threads and side by side at 2, the LM head), and every
# thread count of one ISA is compared with its 1-thread run (src/kernels/cpu/matmul.c, "Deterministic
# tiles"). Usage: cli_threads.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
A=(--model.dim=32 --model.n_layers=3 --model.n_heads=4 --model.n_kv_heads=2 --model.n_experts=4 --model.ffn_dim=32
   --model.n_shared_experts=1 --model.first_k_dense=1 --model.capacity_factor=1.25 --model.z_coef=0.001
   --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=1 --training.steps=3
   --training.precision=fp32 --data.path="$W/c.txt" --data.val_fraction=0.1 --logging.progress=false
   --checkpoint.every=3)
ck() { echo "$W/$1/checkpoints/step_00000003"; }
for isa in AVX2 AVX512_CORE default; do
    ok=1
    for t in 1 2 3; do
        if [ $isa = default ]; then
            env -u ONEDNN_MAX_CPU_ISA "$TERA" train "${A[@]}" --training.threads=$t --logging.run_dir="$W/$isa-$t" > "$W/$isa-$t.log" 2>&1
        else
            ONEDNN_MAX_CPU_ISA=$isa "$TERA" train "${A[@]}" --training.threads=$t --logging.run_dir="$W/$isa-$t" > "$W/$isa-$t.log" 2>&1
        fi || { fail "$isa, $t threads: $(grep error "$W/$isa-$t.log" | head -2)"; ok=0; continue; }
        [ $t = 1 ] && continue
        n=$(steps_of "$W/$isa-$t/metrics.jsonl" | wc -l)
        if [ "$n" = 3 ] && cmp -s <(untimed "$W/$isa-1/metrics.jsonl") <(untimed "$W/$isa-$t/metrics.jsonl") \
            && cmp -s "$(ck $isa-1)/model.safetensors" "$(ck $isa-$t)/model.safetensors" \
            && cmp -s "$(ck $isa-1)/optimizer.safetensors" "$(ck $isa-$t)/optimizer.safetensors"; then :
        else
            fail "$isa: $t threads differ from 1 ($n step records; $(compare_steps "$W/$isa-1/metrics.jsonl" "$W/$isa-$t/metrics.jsonl" 0 2>&1 | head -2))"
            ok=0
        fi
    done
    [ $ok = 1 ] && pass "$isa ($(grep -o "oneDNN ISA [^)]*" "$W/$isa-1.log" | head -1)): 1, 2 and 3 threads give byte-identical step records, weights and moments"
done
# a wide LM head (vocabulary 8192 x dim 64, 512 tokens): its weight gradient runs in primitive pieces
# with AVX-512 kernels (matmul.c, "Weight gradients in primitive pieces"), blocks side by side at 2
# and 3 threads, one after another at 1
B=(--model.dim=64 --model.n_layers=1 --model.n_heads=4 --model.n_kv_heads=2 --model.n_experts=4 --model.ffn_dim=64
   --model.vocab_size=8192 --training.seq_len=64 --training.micro_batch=8 --training.warmup_steps=1
   --training.steps=2 --training.precision=fp32 --data.path="$W/c.txt" --data.val_fraction=0.1
   --logging.progress=false --checkpoint.every=2)
for isa in AVX512_CORE default; do
    ok=1
    for t in 1 2 3; do
        if [ $isa = default ]; then
            env -u ONEDNN_MAX_CPU_ISA "$TERA" train "${B[@]}" --training.threads=$t --logging.run_dir="$W/w$isa-$t" > "$W/w$isa-$t.log" 2>&1
        else
            ONEDNN_MAX_CPU_ISA=$isa "$TERA" train "${B[@]}" --training.threads=$t --logging.run_dir="$W/w$isa-$t" > "$W/w$isa-$t.log" 2>&1
        fi || { fail "wide head, $isa, $t threads: $(grep error "$W/w$isa-$t.log" | head -2)"; ok=0; continue; }
        [ $t = 1 ] && continue
        if cmp -s <(untimed "$W/w$isa-1/metrics.jsonl") <(untimed "$W/w$isa-$t/metrics.jsonl") \
            && cmp -s "$W/w$isa-1/checkpoints/step_00000002/model.safetensors" "$W/w$isa-$t/checkpoints/step_00000002/model.safetensors" \
            && cmp -s "$W/w$isa-1/checkpoints/step_00000002/optimizer.safetensors" "$W/w$isa-$t/checkpoints/step_00000002/optimizer.safetensors"; then :
        else
            fail "wide head, $isa: $t threads differ from 1"
            ok=0
        fi
    done
    [ $ok = 1 ] && pass "wide head, $isa: 1, 2 and 3 threads give byte-identical step records, weights and moments"
done
# The OpenMP wait policy changes when threads sleep, never what they compute: 2 threads under
# OMP_WAIT_POLICY=PASSIVE and ACTIVE give the bytes of the default policy's run above; and tera bench
# names the policy it ran under (omp_wait_policy: the variable's word, "default" unset, "other" for a
# value that is not one word), which bench/run.sh relies on (docs/PERFORMANCE.md, "Wave 16")
ok=1
for pol in PASSIVE ACTIVE; do
    env -u ONEDNN_MAX_CPU_ISA OMP_WAIT_POLICY=$pol "$TERA" train "${A[@]}" --training.threads=2 --logging.run_dir="$W/p$pol" \
        > "$W/p$pol.log" 2>&1 || { fail "OMP_WAIT_POLICY=$pol: $(grep error "$W/p$pol.log" | head -2)"; ok=0; continue; }
    if cmp -s <(untimed "$W/default-2/metrics.jsonl") <(untimed "$W/p$pol/metrics.jsonl") \
        && cmp -s "$(ck default-2)/model.safetensors" "$(ck p$pol)/model.safetensors" \
        && cmp -s "$(ck default-2)/optimizer.safetensors" "$(ck p$pol)/optimizer.safetensors"; then :
    else
        fail "OMP_WAIT_POLICY=$pol: 2 threads differ from the default policy's run"
        ok=0
    fi
done
[ $ok = 1 ] && pass "OMP_WAIT_POLICY PASSIVE and ACTIVE: byte-identical step records, weights and moments at 2 threads"
# tera train says once that PASSIVE costs tokens/s at 2 threads or more (the policy's word in any case,
# as libgomp reads it), and says nothing under ACTIVE or at 1 thread
notes() { grep -c "note: OMP_WAIT_POLICY=$1 puts the $2 threads to sleep" "$3"; }
env -u ONEDNN_MAX_CPU_ISA OMP_WAIT_POLICY=passive "$TERA" train "${A[@]}" --training.threads=1 --training.steps=1 \
    --training.warmup_steps=0 --checkpoint.every=0 --logging.run_dir="$W/pp1" > "$W/pp1.log" 2>&1
rc1=$?
n1=$(grep -c "note: OMP_WAIT_POLICY" "$W/pp1.log")
if [ "$(notes PASSIVE 2 "$W/pPASSIVE.log")" = 1 ] && [ "$(grep -c "note: OMP_WAIT_POLICY" "$W/pACTIVE.log")" = 0 ] \
    && [ "$n1" = 0 ] && [ $rc1 = 0 ]; then
    pass "the PASSIVE note: once at 2 threads, not under ACTIVE, not at 1 thread"
else
    fail "the PASSIVE note: $(notes PASSIVE 2 "$W/pPASSIVE.log") at 2 threads (want 1), $(grep -c "note: OMP_WAIT_POLICY" "$W/pACTIVE.log") under ACTIVE, $n1 at 1 thread (want 0, exit $rc1)"
fi
S=(--model.dim=32 --model.n_layers=1 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32
   --training.micro_batch=2 --data.path="$W/c.txt" --logging.progress=false)
for pol in PASSIVE passive default 'x"y'; do # the note in any case at 2 threads (libgomp's reading)
    want=$pol
    [ "$pol" = 'x"y' ] && want=other
    if [ "$pol" = default ]; then
        env -u OMP_WAIT_POLICY "$TERA" bench "${S[@]}" --steps 1 --warmup 0 --threads 2 > "$W/b.json" 2> "$W/b.log"
    else
        OMP_WAIT_POLICY=$pol "$TERA" bench "${S[@]}" --steps 1 --warmup 0 --threads 2 > "$W/b.json" 2> "$W/b.log"
    fi
    got=$(jq -r .omp_wait_policy "$W/b.json" 2> /dev/null)
    nn=$(grep -c "tera bench: note: OMP_WAIT_POLICY" "$W/b.log")
    wn=0
    case $pol in PASSIVE | passive) wn=1 ;; esac
    if [ "$got" = "$want" ] && [ "$nn" = $wn ]; then
        pass "tera bench under OMP_WAIT_POLICY=$pol: omp_wait_policy \"$got\", $nn note(s)"
    else
        fail "tera bench under OMP_WAIT_POLICY=$pol: omp_wait_policy '$got', expected '$want'; $nn note(s), expected $wn ($(tail -2 "$W/b.log"))"
    fi
done
finish cli_threads
