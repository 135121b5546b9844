#!/usr/bin/env bash
# Mixed precision through the command line: the precision in effect is printed (auto: bf16 with AMX or
# a bf16 dot product the probe measures at 1.25x the FMA, else fp32; ranks that disagree all take fp32); bf16 and fp16 runs follow the fp32 loss curve within a stated margin (fidelity, short
# version: docs/PERFORMANCE.md has the long one); fp16 with a deliberately huge initial loss scale
# recovers (overflowing steps skipped, scale halved each time, then training; the scale doubles
# after loss_scale_window clean steps); --resume restores the scaler exactly; bf16 and fp16 runs
# are deterministic, on both kinds of bf16 units (training.bf16_gemm native and fma); the units in
# effect are printed, and two MPI ranks agree on them and train like one process; fp16 on dp2 x tp2
# ZeRO-2 skips and rescales exactly like one process.
# Usage: cli_precision.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
TINY=(--model.dim=64 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=64
      --training.seq_len=64 --training.micro_batch=8 --training.warmup_steps=10 --training.threads=2
      --logging.progress=false)
# step loss loss_scale skipped, one line per step (the last record of a step wins: resumed runs log
# some steps twice)
rows() {
    last_fields "$1" step loss loss_scale skipped
}

# 1. the precision in effect is printed at start: the default is fp32 on every CPU (naming oneDNN's
# ISA); `auto` is opt-in
"$TERA" train "${TINY[@]}" --training.steps=2 --training.warmup_steps=1 --logging.run_dir="$W/def" > "$W/def.log" 2>&1 || { fail "default run"; cat "$W/def.log"; }
grep -q "^tera: precision fp32 (set; oneDNN ISA " "$W/def.log" && pass "default: $(grep '^tera: precision' "$W/def.log")" \
    || { fail "default precision line"; cat "$W/def.log"; }
"$TERA" train "${TINY[@]}" --training.steps=2 --training.warmup_steps=1 --training.precision=auto --logging.run_dir="$W/auto" > "$W/auto.log" 2>&1 || { fail "auto run"; cat "$W/auto.log"; }
grep -q "^tera: precision \(fp32\|bf16\) (auto: oneDNN ISA " "$W/auto.log" && pass "$(grep '^tera: precision' "$W/auto.log")" \
    || { fail "no precision line"; cat "$W/auto.log"; }
# auto = bf16 with AMX, or where the probe printed on the line measures the bf16 dot product at
# 1.25x the FMA's multiply-adds or more; fp32 otherwise (read from the line's own figures)
auto_line=$(grep '^tera: precision' "$W/auto.log")
want=fp32
if grep -q "ISA avx512_core_amx" <<< "$auto_line"; then want=bf16
elif probe=$(grep -o 'probe [0-9.]* G bf16 dot product multiply-adds/s, [0-9.]* G FMA' <<< "$auto_line"); then
    want=$(awk '{ print ($2 >= 1.25 * $8) ? "bf16" : "fp32" }' <<< "$probe")
fi
grep -q "^tera: precision $want (auto" "$W/auto.log" && pass "auto = $want by its rule (AMX, or the dot-product probe)" \
    || fail "auto rule: want $want: $auto_line"
AUTO=$want

# 2. fidelity: 20-step window means of the loss within 5% of fp32's over 120 steps (embedded corpus);
#    bf16n = bf16 on oneDNN's bf16 kernels, bf16f = bf16 on the fp32 FMA kernels
prec() { case $1 in bf16n) echo "--training.precision=bf16 --training.bf16_gemm=native" ;;
                    bf16f) echo "--training.precision=bf16 --training.bf16_gemm=fma" ;; *) echo "--training.precision=$1" ;; esac; }
for p in fp32 bf16n bf16f fp16; do
    "$TERA" train "${TINY[@]}" --training.steps=120 $(prec $p) --logging.run_dir="$W/f_$p" > "$W/f_$p.log" 2>&1 \
        || { fail "$p run"; cat "$W/f_$p.log"; }
done
if grep -q "bf16 products: fma (native was set, but this CPU has no bf16 GEMM kernels" "$W/f_bf16n.log"; then
    # a CPU below AVX-512 (or ONEDNN_MAX_CPU_ISA=AVX2): native falls back to fma, said once, and both
    # runs are then the same run
    cmp -s <(rows "$W/f_bf16n/metrics.jsonl") <(rows "$W/f_bf16f/metrics.jsonl") \
        && pass "no bf16 GEMM kernels here: native fell back to fma (said at start), the same run as fma" \
        || fail "native fell back to fma but the runs differ"
else
    grep -q "^tera: precision bf16 (set.* | bf16 products: native (set)$" "$W/f_bf16n.log" \
        && grep -q "^tera: precision bf16 (set.* | bf16 products: fma (set)$" "$W/f_bf16f.log" \
        && pass "bf16 units printed: $(grep -h -o 'bf16 products: .*' "$W/f_bf16n.log" "$W/f_bf16f.log" | tr '\n' ' ')" \
        || { fail "bf16 units line"; grep -h '^tera: precision' "$W"/f_bf16*.log; }
    cmp -s <(rows "$W/f_bf16n/metrics.jsonl") <(rows "$W/f_bf16f/metrics.jsonl") && fail "bf16 native and fma runs identical: one of them is not in effect"
fi
for p in bf16n bf16f fp16; do
    grep -q "^tera: precision ${p:0:4} (set" "$W/f_$p.log" || fail "$p not in effect"
    paste <(rows "$W/f_fp32/metrics.jsonl") <(rows "$W/f_$p/metrics.jsonl") | awk -v p=$p '
        { w = int($1 / 20); a[w] += $2; b[w] += $6; n[w]++; if ($2 != $6) differ = 1 }
        END { worst = 0; for (i in n) { r = (b[i] - a[i]) / a[i]; if (r < 0) r = -r; if (r > worst) worst = r }
              printf "%s: %d windows, worst window-mean difference %.2f%%, first %.3f last %.3f (fp32 %.3f %.3f)\n",
                     p, length(n), 100 * worst, b[0] / n[0], b[5] / n[5], a[0] / n[0], a[5] / n[5]
              exit !(length(n) == 6 && worst <= 0.05 && differ && b[5] / n[5] < b[0] / n[0] - 1.0) }' > "$W/fid.txt" \
        && pass "$(cat "$W/fid.txt")" || fail "fidelity $(cat "$W/fid.txt")"
done

# 3. fp16 with a loss scale of 2^36: the first steps overflow (skipped, scale halved each time),
#    then it trains; after 10 clean steps the scale doubles
F16=("${TINY[@]}" --training.precision=fp16 --training.loss_scale=68719476736 --training.loss_scale_window=10
     --training.steps=60 --checkpoint.every=30)
"$TERA" train "${F16[@]}" --logging.run_dir="$W/a" > "$W/a.log" 2>&1 || { fail "fp16 run"; cat "$W/a.log"; }
rows "$W/a/metrics.jsonl" > "$W/a.rows"
awk 'NR == 1 { ok = $3 == 68719476736 && $4 == 1 }
     prev_skip == 1 { if ($3 != prev_scale / 2) bad = 1 }            # each overflow halved the scale
     $4 == 1 { skips++ } $4 == 0 { clean++; if (!first_clean) first_clean = NR }
     prev_skip == 0 && NR > 1 && $3 == 2 * prev_scale { grew = 1 }    # a doubling after clean steps
     NR <= 10 { l0 += $2; n0++ } NR > 50 { l1 += $2; n1++ }
     { prev_scale = $3; prev_skip = $4 }
     END { printf "%d overflowing steps skipped, first clean step %d, doubled later: %d, loss %.3f -> %.3f\n",
                  skips, first_clean - 1, grew, l0 / n0, l1 / n1
           exit !(ok && !bad && skips >= 3 && clean >= 40 && grew && l1 / n1 < l0 / n0 - 0.5) }' "$W/a.rows" > "$W/a.txt" \
    && pass "fp16 huge scale recovers: $(cat "$W/a.txt")" || { fail "fp16 recovery: $(cat "$W/a.txt")"; head -20 "$W/a.rows"; }
grep -q '"loss_scaler"' "$W/a/checkpoints/step_00000030/state.json" && pass "state.json holds the scaler" || fail "no scaler in state.json"

# 4. resume from step 30 restores the scaler: steps 30..59 (loss, scale, skips) as in the straight run
cp -r "$W/a" "$W/b"
rm -rf "$W/b/checkpoints/step_00000060"
"$TERA" train "${F16[@]}" --logging.run_dir="$W/b" --resume > "$W/b.log" 2>&1 || { fail "resume"; cat "$W/b.log"; }
grep -q "resumed .* at step 30" "$W/b.log" && rows "$W/b/metrics.jsonl" | cmp -s - "$W/a.rows" \
    && pass "resumed fp16 run identical to the straight run (loss, loss scale, skips)" \
    || { fail "resume differs"; diff <(rows "$W/b/metrics.jsonl") "$W/a.rows" | head; }

# 5. bf16 and fp16 runs are bit-identical for a fixed seed, like fp32 ones
for p in bf16n bf16f fp16; do
    for i in 1 2; do
        "$TERA" train "${TINY[@]}" --training.steps=12 $(prec $p) --logging.run_dir="$W/d_${p}_$i" > /dev/null 2>&1
    done
    cmp -s "$W/d_${p}_1/checkpoints/step_00000012/model.safetensors" "$W/d_${p}_2/checkpoints/step_00000012/model.safetensors" \
        && pass "$p: two runs bit-identical" || fail "$p runs differ"
done
# 5b. the FFNs' g kept as bf16 between the forward and the backward (bf16 on the native units, the
#     default) trains bit for bit as the fp32 g (TERA_ACT_BF16=0): routed and shared experts and a
#     dense first layer, with and without full recomputation and with two micro-batches
#     (where native fell back to fma, both runs keep the fp32 g: nothing to compare, said so)
G=("${TINY[@]}" --model.n_layers=3 --model.first_k_dense=1 --model.dense_ffn_dim=96 --model.n_shared_experts=1
   --training.steps=6 --training.warmup_steps=2 $(prec bf16n))
G_CASES=("plain" "recompute:--training.recompute=full" "accum:--training.grad_accum=2")
if grep -q "bf16 products: fma (native was set" "$W/f_bf16n.log"; then
    echo "skip: the g kept in bf16 (no bf16 GEMM kernels here: native fell back to fma, g stays fp32)"
    G_CASES=()
fi
for v in ${G_CASES[@]+"${G_CASES[@]}"}; do
    name=${v%%:*}; extra=(); [ "$v" != "$name" ] && extra=(${v#*:})
    "$TERA" train "${G[@]}" "${extra[@]}" --logging.run_dir="$W/g_${name}_1" > "$W/g_${name}_1.log" 2>&1
    TERA_ACT_BF16=0 "$TERA" train "${G[@]}" "${extra[@]}" --logging.run_dir="$W/g_${name}_0" > "$W/g_${name}_0.log" 2>&1
    if cmp -s "$W/g_${name}_1/checkpoints/step_00000006/model.safetensors" "$W/g_${name}_0/checkpoints/step_00000006/model.safetensors"         && cmp -s "$W/g_${name}_1/checkpoints/step_00000006/optimizer.safetensors" "$W/g_${name}_0/checkpoints/step_00000006/optimizer.safetensors"; then
        pass "bf16 native, $name: the g kept in bf16 = the fp32 g, weights and moments bit for bit"
    else
        fail "bf16 native, $name: the g kept in bf16 differs from the fp32 g"; tail -3 "$W/g_${name}_1.log" "$W/g_${name}_0.log"
    fi
done
# 6. two ranks (dp2) in bf16 with the units left to auto: both ranks print the same units, and the
#    run matches one process on those units (loss and grad norm of every step within 1e-4 relative).
#    The one-rank run is given the units the ranks settled on: where the probe decides (no AMX), two
#    separate processes could decide differently on a busy machine, and the units change the sums.
if command -v mpirun > /dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
    B16=("${TINY[@]}" --training.threads=1 --training.steps=8 --training.warmup_steps=2 --training.precision=bf16)
    mpirun --oversubscribe -np 2 "$TERA" train "${B16[@]}" --training.micro_batch=4 --parallel.dp=2 \
        --logging.run_dir="$W/m2" > "$W/m2.log" 2>&1 || { fail "bf16 dp2"; cat "$W/m2.log"; }
    u2=$(grep -o 'bf16 products: [a-z]*' "$W/m2.log" | sort -u)
    [ -n "$u2" ] && [ "$(echo "$u2" | wc -l)" = 1 ] && pass "dp2 ranks agree on the units: $u2" \
        || fail "units: dp2 ranks printed '$u2'"
    "$TERA" train "${B16[@]}" --training.micro_batch=8 --training.bf16_gemm="${u2##* }" --logging.run_dir="$W/m1" \
        > "$W/m1.log" 2>&1 || { fail "bf16 one rank"; cat "$W/m1.log"; }
    paste <(grep '"loss": ' "$W/m1/metrics.jsonl" | sed 's/.*"loss": \([^,]*\),.*"grad_norm": \([^,]*\),.*/\1 \2/') \
          <(grep '"loss": ' "$W/m2/metrics.jsonl" | sed 's/.*"loss": \([^,]*\),.*"grad_norm": \([^,]*\),.*/\1 \2/') | awk '
        function rel(a, b) { d = (a - b) / a; return d < 0 ? -d : d }
        { n++; for (i = 1; i <= 2; i++) { r = rel($i, $(i + 2)); if (r > worst) worst = r } }
        END { printf "%d steps, worst relative difference %.2g\n", n, worst; exit !(n == 8 && worst <= 1e-4) }' > "$W/m.txt" \
        && pass "bf16 dp2 = one rank: $(cat "$W/m.txt")" || fail "bf16 dp2 differs: $(cat "$W/m.txt")"
    # precision = auto on ranks whose CPUs differ (rank 1's oneDNN capped at AVX2: no bf16 products
    # faster than fp32): every rank trains in fp32, rank 0 says why, and the run is the same run as
    # precision = fp32 on the same two ranks
    A2=("${TINY[@]}" --training.threads=1 --training.steps=4 --training.warmup_steps=2 --training.micro_batch=4
        --parallel.dp=2)
    for p in auto fp32; do
        mpirun --oversubscribe -np 1 "$TERA" train "${A2[@]}" --training.precision=$p --logging.run_dir="$W/x_$p" : \
            -np 1 env ONEDNN_MAX_CPU_ISA=AVX2 "$TERA" train "${A2[@]}" --training.precision=$p --logging.run_dir="$W/x_$p" \
            > "$W/x_$p.log" 2>&1 || { fail "mixed-CPU dp2 $p"; tail -5 "$W/x_$p.log"; }
    done
    if [ "$AUTO" = bf16 ]; then
        grep -q "^tera: precision fp32 (auto: another rank's CPU has no faster bf16 products)" "$W/x_auto.log" \
            && pass "auto on mixed CPUs: $(grep '^tera: precision' "$W/x_auto.log")" \
            || fail "auto on mixed CPUs: $(grep '^tera: precision' "$W/x_auto.log")"
    else
        grep -q "^tera: precision fp32 (auto" "$W/x_auto.log" && pass "auto on mixed CPUs: fp32 (fp32 here already)" \
            || fail "auto on mixed CPUs: $(grep '^tera: precision' "$W/x_auto.log")"
    fi
    cmp -s <(rows "$W/x_auto/metrics.jsonl") <(rows "$W/x_fp32/metrics.jsonl") \
        && pass "auto on mixed CPUs trains as fp32 does, bit for bit ($(rows "$W/x_auto/metrics.jsonl" | wc -l) steps)" \
        || fail "auto on mixed CPUs differs from fp32"
    # fp16 from a loss scale of 2^36 on dp2 x tp2 with ZeRO-2: every rank skips the same overflowing
    # steps and moves its scale alike, as one process does (loss, scale and skip of every step)
    F=("${TINY[@]}" --training.threads=1 --training.steps=24 --training.warmup_steps=2 --training.precision=fp16
       --training.loss_scale=68719476736 --training.loss_scale_window=5)
    "$TERA" train "${F[@]}" --training.micro_batch=8 --logging.run_dir="$W/h1" > "$W/h1.log" 2>&1 || { fail "fp16 one rank"; cat "$W/h1.log"; }
    mpirun --oversubscribe -np 4 "$TERA" train "${F[@]}" --training.micro_batch=4 --parallel.dp=2 --parallel.tp=2 \
        --parallel.zero=2 --logging.run_dir="$W/h4" > "$W/h4.log" 2>&1 || { fail "fp16 dp2 x tp2"; tail -5 "$W/h4.log"; }
    paste -d' ' <(rows "$W/h1/metrics.jsonl") <(rows "$W/h4/metrics.jsonl") | awk '
        { n++; if ($3 != $7 || $4 != $8) bad = 1; skips += $4; d = ($2 - $6) / $2; if (d < 0) d = -d; if (d > worst) worst = d }
        END { printf "%d steps, %d skipped alike, scales alike, worst loss difference %.2g\n", n, skips, worst
              exit !(n == 24 && !bad && skips >= 3 && worst <= 1e-4) }' > "$W/h.txt" \
        && pass "fp16 dp2 x tp2 ZeRO-2 = one rank: $(cat "$W/h.txt")" || fail "fp16 multi-rank: $(cat "$W/h.txt")"
fi

finish cli_precision
