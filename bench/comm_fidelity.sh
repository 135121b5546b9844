#!/usr/bin/env bash
# The 400-step fidelity run (docs/PERFORMANCE.md: tinyshakespeare, D=96, L=3, H=4, E=4, k=2, F=128,
# T=64, LR 3e-3, warm-up 20, cosine, seed 1234) with each communication option
# (docs/COMMUNICATION.md), on 4 ranks as 2 emulated nodes of 2 (parallel.ranks_per_node = 2),
# micro-batch 2 per rank (the global batch of 8 of the single-process run), fp32, one thread per rank.
# The validation loss (16 batches) at steps 100 / 200 / 300 / 400 of each option against the fp32
# flat run of the same layout (dp 4; dp 4 ZeRO-1; dp 4 x ep 2; dp 4 = ep 4). The issue's margin:
# the final validation loss within 1% of fp32 flat for bf16 / fp16 / fp8, within 2% for int8 and
# 1-bit Adam. The rows s1235-* and s1236-* repeat some options with other seeds (training.seed: another
# initialisation and data order), against the fp32 flat run of that seed and layout: how far apart runs that
# differ only by chance end, which is the scale the margins are to be read against.
# Usage: bench/comm_fidelity.sh [TERA] [STEPS] [MODE]   (default build/tera 400 single; MODE single writes
#        bench/results/comm-fidelity.jsonl; OPTIONS selects, as in bench/comm.sh; the runs' directories
#        are kept under KEEP when it is set)
#
# MODE paired: the protocol that can judge the margins (docs/COMMUNICATION.md, "Fidelity, paired over
# seeds"). The same model and data, on the same 4 ranks as 2 emulated nodes, with a global batch of
# 4 x MICRO sequences (MICRO per rank, default 4: 16), LR (default 1e-3) decaying to MIN_LR (1e-4) after
# a warm-up of PWARM steps (STEPS/10), validation on EVAL_SAMPLES sequences (default 512: 32768 tokens,
# the same ones in every run) every STEPS/10 steps, a run's loss the mean of its last LAST evaluations
# (default 3: after 80%, 90% and 100% of the steps). Every option runs with every seed of SEEDS
# (default "1234 1235 1236 1237 1238") and is compared with its reference run of the same seed
# (paired): the relative difference of the losses, its mean over the seeds, the sample standard
# deviation and the 95% interval of the mean (Student's t). Noise floor: two fp32 pairs that differ
# from "fp32-flat" only in the order of fp32 sums: "ep4-flat" (dp 4 = ep 4: the experts' gradients
# summed over other groups) and "acc2-flat" (half the micro-batch, 2 accumulation steps: the same 16
# sequences, summed in another order; the load-balancing loss over micro-batches of 2). Identity checks
# (first seed only): "ep2-flat" and "zero1-flat" equal "fp32-flat", which is therefore the reference of
# the ep 2 and ZeRO-1 options. A verdict per option: pass when the 95% interval of the mean lies within
# +-margin, fail when the mean is outside it, undecided otherwise. Writes
# bench/results/comm-fidelity-paired.jsonl: one line per run ("kind": "run") and one per option
# ("kind": "summary"); the table after it. Runs go seed by seed; MODE summary (with RUNS=file, e.g.
# KEEP/out.jsonl of an interrupted run) makes the summary and table again from run lines, running nothing.
# The LR-3e-3 run of MODE single is chaotic at this batch: fp32 runs differing in summation order end
# up to 1.9% apart, and it cannot judge a 1% margin.
set -eu
TERA=$(readlink -f "${1:-build/tera}")
STEPS=${2:-400}
MODE=${3:-single}
case "$MODE" in single | paired | summary) ;; *) echo "comm_fidelity: mode '$MODE': single, paired or summary" >&2; exit 1 ;; esac
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.."
DATA=$(readlink -f ../shared/data/tinyshakespeare.txt)
[ -r "$DATA" ] || { echo "comm_fidelity: $DATA missing" >&2; exit 1; }
mkdir -p bench/results
W=${KEEP:-$(mktemp -d)}
mkdir -p "$W"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$W"' EXIT
EVERY=$((STEPS / 4))
WARM=$((STEPS / 20 < 20 ? STEPS / 20 : 20))   # 20 for the 400 steps; shorter runs (trials) scale it

if [ "$MODE" != single ]; then
    MICRO=${MICRO:-4}
    EVAL_SAMPLES=${EVAL_SAMPLES:-512}
    LAST=${LAST:-3}
    SEEDS=${SEEDS:-"1234 1235 1236 1237 1238"}
    LR=${LR:-1e-3}
    MIN_LR=${MIN_LR:-1e-4}
    PWARM=${PWARM:-$((STEPS / 10))}
    PEVERY=$((STEPS / 10))
    EB=$(((EVAL_SAMPLES + MICRO - 1) / MICRO))
    OBW=$((STEPS / 5))   # 1-bit Adam's warm-up: 80 of the 400 steps, as in the single run
    [ $((MICRO % 2)) -eq 0 ] || { echo "comm_fidelity: MICRO=$MICRO: even (the acc2-flat row halves it)" >&2; exit 1; }
    # name : ep : zero : reference : margin in % ("floor": a noise floor pair; "same": an identity check,
    # run with the first seed only) : extra options (an option's key replaces the protocol's)
    POPTIONS=${OPTIONS:-"fp32-flat:1:0::: ep4-flat:4:0:fp32-flat:floor:
        acc2-flat:1:0:fp32-flat:floor:--training.micro_batch=$((MICRO / 2)),--training.grad_accum=2,--training.eval_batches=$((2 * EB))
        bf16:1:0:fp32-flat:1:--parallel.grad_compression=bf16
        fp16:1:0:fp32-flat:1:--parallel.grad_compression=fp16
        int8:1:0:fp32-flat:2:--parallel.grad_compression=int8
        hier+int8:1:0:fp32-flat:2:--parallel.hierarchical=true,--parallel.grad_compression=int8
        onebit-w$OBW:1:0:fp32-flat:2:--optimizer.name=onebit_adam,--optimizer.onebit_warmup_steps=$OBW
        zero1-bf16:1:1:fp32-flat:1:--parallel.grad_compression=bf16
        ep2-flat:2:0:fp32-flat:same: zero1-flat:1:1:fp32-flat:same:
        ep2-a2a-bf16:2:0:fp32-flat:1:--parallel.a2a_compression=bf16
        ep2-a2a-fp8:2:0:fp32-flat:1:--parallel.a2a_compression=fp8
        ep4-a2a-bf16:4:0:ep4-flat:1:--parallel.a2a_compression=bf16
        ep4-a2a-fp8:4:0:ep4-flat:1:--parallel.a2a_compression=fp8"}
    OUT=bench/results/comm-fidelity-paired.jsonl
    : > "$W/out.jsonl"
    # MODE summary: no runs, the table again from the run lines of RUNS (default $OUT; e.g. KEEP's
    # out.jsonl of an interrupted paired run)
    [ "$MODE" = summary ] && { jq -c 'select(.kind == "run")' "${RUNS:-$OUT}" > "$W/out.jsonl"; SEEDS=; }
    for seed in $SEEDS; do
        for o in $POPTIONS; do
            IFS=: read -r name ep zero ref margin extra <<< "$o"
            [ "$margin" = same ] && [ "$seed" != "${SEEDS%% *}" ] && continue
            ex=()
            [ -n "$extra" ] && IFS=, read -r -a ex <<< "$extra"
            d="$W/s$seed-$name"
            base=(--model.dim=96 --model.n_layers=3 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=128
                --training.seq_len=64 --training.micro_batch="$MICRO" --training.steps="$STEPS"
                --training.warmup_steps="$PWARM" --training.lr="$LR" --training.min_lr="$MIN_LR"
                --training.threads=1 --training.precision=fp32 --training.seed="$seed" --data.path="$DATA"
                --data.val_fraction=0.05 --training.eval_every="$PEVERY" --training.eval_batches="$EB"
                --parallel.dp=4 --parallel.ep="$ep" --parallel.zero="$zero" --parallel.ranks_per_node=2
                --logging.progress=false)
            args=()   # a key of the option's own replaces the protocol's
            for a in "${base[@]}"; do [[ " ${ex[*]-} " == *" ${a%%=*}="* ]] || args+=("$a"); done
            t0=$(date +%s)
            mpirun --oversubscribe -np 4 "$TERA" train "${args[@]}" ${ex[@]+"${ex[@]}"} --logging.run_dir="$d" \
                > "$d.log" 2>&1 || { echo "s$seed-$name: failed" >&2; tail -5 "$d.log" >&2; continue; }
            t1=$(date +%s)
            mbv=$MICRO accv=1 ebv=$EB   # what ran (an option may set its own)
            for a in ${ex[@]+"${ex[@]}"}; do
                case "$a" in --training.micro_batch=*) mbv=${a#*=} ;; --training.grad_accum=*) accv=${a#*=} ;;
                    --training.eval_batches=*) ebv=${a#*=} ;; esac
            done
            # the evaluation records of metrics.jsonl (by field name), the last of each step
            jq -c -s --arg n "$name" --argjson ep "$ep" --argjson z "$zero" --arg x "$extra" --arg r "$ref" \
                --arg m "$margin" --argjson seed "$seed" --argjson s "$((t1 - t0))" --argjson last "$LAST" \
                --argjson mb "$mbv" --argjson acc "$accv" --argjson ev "$((ebv * mbv))" --arg lr "$LR" \
                'map(select(has("val_loss"))) | group_by(.step) | map(.[-1]) |
                 {kind: "run", option: $n, ep: $ep, zero: $z, seed: $seed, options: $x, reference: $r,
                  margin: $m, micro_batch: $mb, grad_accum: $acc, global_batch: (4 * $mb * $acc), lr: $lr,
                  eval_samples: $ev,
                  steps: (map(.step) | max), wall_s: $s,
                  val_loss: (map({key: (.step | tostring), value: .val_loss}) | from_entries),
                  final_val_loss: .[-1].val_loss, last: $last,
                  mean_last_val_loss: (.[-$last:] | map(.val_loss) | add / length)}' \
                "$d/metrics.jsonl" | tee -a "$W/out.jsonl"
            [ -n "${KEEP:-}" ] || rm -rf "$d"
        done
    done
    # one summary line per compared option: the paired relative differences (%) of the mean of the last
    # evaluations (and of the last one alone) over the seeds both runs finished
    jq -c -s 'def tq: [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228][. - 1] // 1.96;
        def stats: length as $n | (add / $n) as $m |
            (if $n > 1 then (map((. - $m) * (. - $m)) | add / ($n - 1) | sqrt) else null end) as $sd |
            {n: $n, mean: $m, sd: $sd, min: min, max: max,
             ci95: (if $sd == null then null else [$m - ($n - 1 | tq) * $sd / ($n | sqrt),
                                                   $m + ($n - 1 | tq) * $sd / ($n | sqrt)] end)};
        . as $all | map(select(.reference != "")) | group_by(.option) | map(
            . as $runs | $runs[0] as $o |
            [$runs[] | . as $x | ($all | map(select(.option == $o.reference and .seed == $x.seed))[0]) as $r |
             select($r != null) |
             {seed: .seed, d: ((.mean_last_val_loss - $r.mean_last_val_loss) / $r.mean_last_val_loss * 100),
              d_final: ((.final_val_loss - $r.final_val_loss) / $r.final_val_loss * 100)}] as $p |
            select($p | length > 0) |
            ($p | map(.d) | stats) as $st | ($p | map(.d_final) | stats) as $sf |
            {kind: "summary", option: $o.option, reference: $o.reference, options: $o.options,
             margin: $o.margin, seeds: ($p | map(.seed)), diff_pct: ($p | map(.d)), n: $st.n,
             mean_pct: $st.mean, sd_pct: $st.sd, min_pct: $st.min, max_pct: $st.max, ci95_pct: $st.ci95,
             final_only: {diff_pct: ($p | map(.d_final)), mean_pct: $sf.mean, sd_pct: $sf.sd},
             verdict: (if $o.margin == "floor" then "noise floor"
                       elif $o.margin == "same" then (if ($st.min == 0 and $st.max == 0) then "identical"
                                                      else "differs" end)
                       else ($o.margin | tonumber) as $mg |
                            if ($st.mean | fabs) > $mg then "fail"
                            elif $st.ci95 != null and $st.ci95[0] >= -$mg and $st.ci95[1] <= $mg then "pass"
                            else "undecided" end end)})[]' "$W/out.jsonl" > "$W/summary.jsonl"
    cat "$W/out.jsonl" "$W/summary.jsonl" > "$OUT.tmp" && mv "$OUT.tmp" "$OUT"
    echo "wrote $OUT"
    f() { jq -r "$1" "$W/summary.jsonl"; }
    f 'select(.verdict == "noise floor") | "noise floor, \(.option) vs \(.reference) (paired): mean \(.mean_pct * 1000 | round / 1000 | if . == 0 then 0 else . end)%, sd \(.sd_pct // 0 | . * 1000 | round / 1000), largest |difference| \([.min_pct, .max_pct] | map(fabs) | max * 1000 | round / 1000)%"'
    echo "| option | vs | n | paired difference, mean | sd | 95% interval of the mean | per seed | last evaluation only: mean (sd) | margin | verdict |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    jq -r 'def r3: if . == null then "-" else (. * 1000 | round / 1000 | if . == 0 then 0 else . end | tostring) end;
        "| \(.option) | \(.reference) | \(.n) | \(.mean_pct | r3)% | \(.sd_pct | r3) | " +
        (if .ci95_pct == null then "-" else "[\(.ci95_pct[0] | r3), \(.ci95_pct[1] | r3)]" end) + " | " +
        (.diff_pct | map(r3) | join(", ")) + " | \(.final_only.mean_pct | r3)% (\(.final_only.sd_pct | r3)) | " +
        (if (.margin | test("^[0-9.]+$")) then "\(.margin)%" else "-" end) + " | \(.verdict) |"' "$W/summary.jsonl"
    exit 0
fi

# name : ep : zero : extra options (comma-separated); the reference of a row is the row named
# "*flat" with the same ep, zero and seed
OPTIONS=${OPTIONS:-"fp32-flat:1:0: hierarchical:1:0:--parallel.hierarchical=true
    bf16:1:0:--parallel.grad_compression=bf16 fp16:1:0:--parallel.grad_compression=fp16
    int8:1:0:--parallel.grad_compression=int8
    hier+int8:1:0:--parallel.hierarchical=true,--parallel.grad_compression=int8
    onebit-w80:1:0:--optimizer.name=onebit_adam,--optimizer.onebit_warmup_steps=80
    zero1-flat:1:1: zero1-bf16:1:1:--parallel.grad_compression=bf16
    ep2-flat:2:0: ep2-a2a-bf16:2:0:--parallel.a2a_compression=bf16 ep2-a2a-fp8:2:0:--parallel.a2a_compression=fp8
    ep4-flat:4:0: ep4-two-stage:4:0:--parallel.ep_hierarchical=true
    ep4-a2a-bf16:4:0:--parallel.a2a_compression=bf16 ep4-a2a-fp8:4:0:--parallel.a2a_compression=fp8
    ep4-two-stage+fp8:4:0:--parallel.ep_hierarchical=true,--parallel.a2a_compression=fp8
    s1235-fp32-flat:1:0:--training.seed=1235 s1235-bf16:1:0:--training.seed=1235,--parallel.grad_compression=bf16
    s1235-int8:1:0:--training.seed=1235,--parallel.grad_compression=int8
    s1235-ep4-flat:4:0:--training.seed=1235
    s1235-ep4-a2a-bf16:4:0:--training.seed=1235,--parallel.a2a_compression=bf16
    s1235-ep4-a2a-fp8:4:0:--training.seed=1235,--parallel.a2a_compression=fp8
    s1236-fp32-flat:1:0:--training.seed=1236 s1236-bf16:1:0:--training.seed=1236,--parallel.grad_compression=bf16
    s1236-int8:1:0:--training.seed=1236,--parallel.grad_compression=int8
    s1236-ep2-flat:2:0:--training.seed=1236 s1236-ep2-a2a-bf16:2:0:--training.seed=1236,--parallel.a2a_compression=bf16
    s1236-ep4-flat:4:0:--training.seed=1236
    s1236-ep4-a2a-bf16:4:0:--training.seed=1236,--parallel.a2a_compression=bf16
    s1236-ep4-a2a-fp8:4:0:--training.seed=1236,--parallel.a2a_compression=fp8"}

OUT=bench/results/comm-fidelity.jsonl
: > "$W/out.jsonl"
for o in $OPTIONS; do
    IFS=: read -r name ep zero extra <<< "$o"
    ex=()
    [ -n "$extra" ] && IFS=, read -r -a ex <<< "$extra"
    t0=$(date +%s)
    mpirun --oversubscribe -np 4 "$TERA" train --model.dim=96 --model.n_layers=3 --model.n_heads=4 \
        --model.n_experts=4 --model.ffn_dim=128 --training.seq_len=64 --training.micro_batch=2 \
        --training.steps="$STEPS" --training.warmup_steps="$WARM" --training.threads=1 --training.precision=fp32 \
        --data.path="$DATA" --data.val_fraction=0.05 --training.eval_every="$EVERY" --training.eval_batches=16 \
        --parallel.dp=4 --parallel.ep="$ep" --parallel.zero="$zero" --parallel.ranks_per_node=2 \
        ${ex[@]+"${ex[@]}"} --logging.progress=false --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1 \
        || { echo "$name: failed" >&2; tail -5 "$W/$name.log" >&2; continue; }
    t1=$(date +%s)
    # the evaluation records of metrics.jsonl (by field name), the last of each step
    seed=1234
    [[ ",$extra" == *",--training.seed="* ]] && seed=$(sed 's/.*--training\.seed=\([0-9]*\).*/\1/' <<< "$extra")
    jq -c -s --arg n "$name" --argjson ep "$ep" --argjson z "$zero" --arg x "$extra" --argjson s "$((t1 - t0))" \
        --argjson seed "$seed" 'map(select(has("val_loss"))) | group_by(.step) | map(.[-1]) |
         {option: $n, ep: $ep, zero: $z, seed: $seed, options: $x, steps: (map(.step) | max), wall_s: $s,
          val_loss: (map({key: (.step | tostring), value: .val_loss}) | from_entries),
          final_val_loss: .[-1].val_loss,
          final_train_loss: null}' "$W/$name/metrics.jsonl" > "$W/r.json"
    last=$(jq -c -s 'map(select(has("loss") and (has("event") | not))) | .[-1].loss' "$W/$name/metrics.jsonl")
    jq -c --argjson l "$last" '.final_train_loss = $l' "$W/r.json" | tee -a "$W/out.jsonl"
done
cp "$W/out.jsonl" "$OUT"
echo "wrote $OUT"

# the table: validation loss at the four evaluations (metrics.jsonl's step k is the (k+1)-th step),
# the final one against the reference
S=$(jq -r -s 'map(.val_loss | keys[]) | unique | map(tonumber) | sort | map(tostring) | join(" ")' "$OUT")
echo "| option |$(for k in $S; do printf ' after %d steps |' $((k + 1)); done) final vs fp32 flat (same layout) |"
echo "|---|$(for _ in $S; do printf -- '---|'; done)---|"
jq -r -s --arg s "$S" '. as $all | .[] | . as $o |
    ($all | map(select(.ep == $o.ep and .zero == $o.zero and .seed == $o.seed and (.option | test("flat$"))))[0]) as $r |
    "| \(.option) | " + ([($s | split(" "))[] as $k | ($o.val_loss[$k] // null) |
        if . == null then "-" else (. * 10000 | round / 10000 | tostring) end] | join(" | ")) + " | " +
    (if $r == null then "no reference" elif $r.option == .option then ""
     else "\(((.final_val_loss - $r.final_val_loss) / $r.final_val_loss * 10000 | round) / 100)%" end) + " |"' "$OUT"
