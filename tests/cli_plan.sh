#!/usr/bin/env bash
# tera plan (issue 18, docs/PLAN.md).
# 1. The memory model against tera's own allocator: for a table of layouts of the tiny MoE of
#    tests/mpilib.sh on 1-8 MPI ranks (and bench-s / bench-m on one rank), `tera train` prints world
#    rank 0's "memory bytes per rank" by category; `tera plan --dry-run --json` (nothing allocated)
#    must give the same six figures to the byte (roles[0] is world rank 0), and the same element
#    counts (non-expert / expert floats). `tera train --dry-run` is the same command. The bf16 weight
#    shadow (printed on a line of its own, 2 bytes per resident parameter) is the plan's bf16_shadow,
#    in bf16 layouts where the rule (tera_bf16_shadow_on) keeps one and where it does not.
# 2. The search: on a hardware file, the best layout is written with --write-config and `tera config`
#    resolves it; a DeepSeek-V3-like model (approximate widths, docs/PLAN.md) on 2048 H800 with
#    PP16 x EP64 x ZeRO-1 fits; a 1T-parameter MoE on 1024 x 64 GiB devices gets a fitting plan.
# 3. Errors name the file, key or option.
# Usage: cli_plan.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TINY=()
for a in "${MODEL[@]}"; do [ "$a" = --training.warmup_steps=2 ] || TINY+=("$a"); done
TINY+=(--training.steps=1 --training.warmup_steps=0 --logging.run_dir=)
field() { grep "memory bytes per rank" "$1" | grep -o "$2 [0-9]*" | head -1 | cut -d' ' -f2; }
# floats LOG non-expert|expert: the element counts of that line ("(non-expert N floats + expert M floats)")
floats() { grep "memory bytes per rank" "$1" | grep -o "[(+] \?$2 [0-9]* floats" | head -1 | grep -o "[0-9][0-9]*"; }
# shadow LOG: the bf16 weight shadow's bytes tera train printed (0 without the line: none)
shadow() { local b; b=$(grep -o "weight shadow [0-9]* bytes" "$1" | head -1 | cut -d' ' -f3); echo "${b:-0}"; }
# check TAG LOG JSON: the six printed figures, the two element counts and the bf16 shadow of world rank 0
check() {
    local tag=$1 log=$2 js=$3 bad="" k p m
    for k in params grads optimizer activations scratch comm; do
        p=$(field "$log" "$k")
        m=$(jq -r ".roles[0].$k" "$js")
        [ -n "$p" ] && [ "$p" = "$m" ] || bad="$bad $k: measured ${p:-?} predicted $m;"
    done
    p=$(floats "$log" non-expert); m=$(jq -r '.roles[0].non_expert_floats' "$js")
    [ "$p" = "$m" ] || bad="$bad non-expert floats $p vs $m;"
    p=$(floats "$log" expert); m=$(jq -r '.roles[0].expert_floats' "$js")
    [ "$p" = "$m" ] || bad="$bad expert floats $p vs $m;"
    p=$(shadow "$log"); m=$(jq -r '.roles[0].bf16_shadow' "$js")
    [ "$p" = "$m" ] || bad="$bad bf16 shadow: measured $p predicted $m;"
    [ -z "$bad" ] && pass "$tag: memory of world rank 0 predicted to the byte ($(field "$log" params) params, $(field "$log" activations) activations, $(field "$log" scratch) scratch, $(field "$log" comm) comm bytes)" \
        || fail "$tag:$bad"
}

# name : dp : tp : ep : zero : pp : schedule : chunks : micro : accum : recompute
LAYOUTS="one:1:1:1:0:1:1f1b:1:4:1:none dp2z3:2:1:1:3:1:1f1b:1:2:1:none tp2:1:2:1:0:1:1f1b:1:4:1:selective
         ep4z2:4:1:4:2:1:1f1b:1:1:2:full pp2-1f1b:1:1:1:0:2:1f1b:1:1:4:none
         pp2xdp2xep2z1:4:1:2:1:2:1f1b:1:1:2:selective dp2xtp2xep2z3:4:2:2:3:1:1f1b:1:1:1:none
         pp2-interleaved:1:1:1:0:2:interleaved:2:1:4:full:0-1 pp2xdp2z3-gpipe:2:1:1:3:2:gpipe:1:1:2:none"
for l in $LAYOUTS; do
    IFS=: read -r name dp tp ep zero pp sched chunks micro accum rec <<< "$l"
    [ "$name" = pp2-interleaved ] && rec="full:0-1"
    np=$((pp * dp * tp))
    ARGS=("${TINY[@]}" --parallel.dp="$dp" --parallel.tp="$tp" --parallel.ep="$ep" --parallel.zero="$zero"
          --parallel.pp="$pp" --parallel.pp_schedule="$sched" --parallel.pp_chunks="$chunks"
          --training.micro_batch="$micro" --training.grad_accum="$accum" --training.recompute="$rec")
    if [ "$np" = 1 ]; then "$TERA" train "${ARGS[@]}" > "$W/$name.log" 2>&1
    else $MPIRUN -np "$np" "$TERA" train "${ARGS[@]}" > "$W/$name.log" 2>&1; fi \
        || { fail "$name: tera train failed: $(grep error "$W/$name.log" | head -2)"; continue; }
    "$TERA" plan --dry-run "${ARGS[@]}" --json > "$W/$name.json" 2> "$W/$name.err" \
        || { fail "$name: tera plan --dry-run failed: $(cat "$W/$name.err")"; continue; }
    check "$name ($np ranks, recompute $rec)" "$W/$name.log" "$W/$name.json"
done
# the bf16 weight shadow (tera_bf16_shadow_on): bf16 on the native units with the whole weights
# resident and no pipeline, where the AdamW update writes it (ZeRO-0) or grad_accum >= 4 shares it.
# name : dp : tp : zero : pp : accum : shadow expected (on a CPU with bf16 GEMM kernels)
on=0
for l in one-bf16:1:1:0:1:1:1 tp2-bf16:1:2:0:1:1:1 dp2z1-bf16-accum4:2:1:1:1:4:1 dp2z1-bf16:2:1:1:1:1:0 \
         dp2z3-bf16-accum4:2:1:3:1:4:0 pp2-bf16-accum4:1:1:0:2:4:0; do
    IFS=: read -r name dp tp zero pp accum want <<< "$l"
    np=$((pp * dp * tp))
    ARGS=("${TINY[@]}" --training.precision=bf16 --training.bf16_gemm=native --parallel.dp="$dp" --parallel.tp="$tp"
          --parallel.zero="$zero" --parallel.pp="$pp" --training.micro_batch=1 --training.grad_accum="$accum")
    if [ "$np" = 1 ]; then "$TERA" train "${ARGS[@]}" > "$W/$name.log" 2>&1
    else $MPIRUN -np "$np" "$TERA" train "${ARGS[@]}" > "$W/$name.log" 2>&1; fi \
        || { fail "$name: tera train failed: $(grep error "$W/$name.log" | head -2)"; continue; }
    "$TERA" plan --dry-run "${ARGS[@]}" --json > "$W/$name.json" 2> "$W/$name.err" \
        || { fail "$name: tera plan --dry-run failed: $(cat "$W/$name.err")"; continue; }
    check "$name ($np ranks, bf16 shadow $(shadow "$W/$name.log") bytes)" "$W/$name.log" "$W/$name.json"
    b=$(shadow "$W/$name.log")
    if grep -q "bf16 products: native" "$W/$name.log"; then
        [ $((b > 0)) = "$want" ] && on=$((on + want)) || fail "$name: bf16 shadow $b bytes, expected $([ "$want" = 1 ] && echo some || echo none)"
    fi
done
[ "$on" -gt 0 ] && pass "bf16 shadow kept and predicted in $on layouts" \
    || echo "note: no bf16 GEMM kernels on this CPU (bf16 products on the FMA units): no layout keeps a bf16 shadow"

# 1-bit Adam (optimizer.name = onebit_adam): the bytes tera train says it adds to AdamW's (ZeRO-1/2/3's
# whole momentum, ZeRO-2/3's whole own gradient, error feedback, message buffers) are the plan's "onebit"
# category, and (dp4 x ep2 ZeRO-1) the six figures of the line stay exact
onebit() { # onebit NAME RANKS LABEL FULL-CHECK ARGS...
    local n=$1 np=$2 label=$3 full=$4
    shift 4
    local a=("${TINY[@]}" --optimizer.name=onebit_adam --training.micro_batch=1 --training.grad_accum=1 "$@")
    if $MPIRUN -np "$np" "$TERA" train "${a[@]}" > "$W/$n.log" 2>&1 \
        && "$TERA" plan --dry-run "${a[@]}" --json > "$W/$n.json" 2> "$W/$n.err"; then
        [ "$full" = 1 ] && check "$label ($np ranks)" "$W/$n.log" "$W/$n.json"
        local p m
        p=$(grep -o "memory per rank [0-9]* bytes more" "$W/$n.log" | grep -o "[0-9][0-9]*" | head -1)
        m=$(jq -r '.roles[0].onebit' "$W/$n.json")
        [ -n "$p" ] && [ "$p" = "$m" ] && pass "$label: the $p bytes per rank tera train adds predicted to the byte" \
            || fail "$label's memory: tera train ${p:-?} bytes, plan $m"
    else
        fail "$label: $(grep error "$W/$n.log" | head -2) $(cat "$W/$n.err" 2> /dev/null)"
    fi
}
onebit onebit 4 "1-bit Adam dp4 x ep2 ZeRO-1" 1 --parallel.dp=4 --parallel.ep=2 --parallel.zero=1
onebit onebit2 2 "1-bit Adam dp2 ZeRO-2" 0 --parallel.dp=2 --parallel.zero=2 --training.steps=2 \
    --optimizer.onebit_warmup_steps=1

# the benchmark models on one rank (their own micro-batch and sequence; threads fixed: the attention
# scratch is sized per thread)
for b in bench-s bench-m; do
    ARGS=(-c "$SRC/configs/$b.ini" --training.steps=1 --training.threads=1 --training.precision=fp32)
    # the line is printed before the first step: the run is stopped once it is there (a bench-m step
    # takes half a minute on two shared cores; on a loaded machine the line itself came after 90 s,
    # so up to 300 s are allowed)
    "$TERA" train "${ARGS[@]}" > "$W/$b.log" 2>&1 &
    pid=$!
    for _ in $(seq 3000); do grep -q "memory bytes per rank" "$W/$b.log" && break; kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
    kill "$pid" 2> /dev/null; wait "$pid" 2> /dev/null
    grep -q "memory bytes per rank" "$W/$b.log" || { fail "$b: tera train printed no memory line: $(tail -2 "$W/$b.log")"; continue; }
    "$TERA" train --dry-run "${ARGS[@]}" --json > "$W/$b.json" 2> "$W/$b.err" \
        || { fail "$b: tera train --dry-run failed: $(cat "$W/$b.err")"; continue; }
    check "$b (1 rank, tera train --dry-run)" "$W/$b.log" "$W/$b.json"
done

# every rank role of a pipeline: the roles cover every rank once
"$TERA" plan --dry-run "${TINY[@]}" --parallel.pp=2 --parallel.dp=4 --parallel.ep=2 --parallel.zero=1 \
    --training.micro_batch=1 --training.grad_accum=4 --json > "$W/roles.json" 2>&1 \
    && [ "$(jq '[.roles[].ranks] | add' "$W/roles.json")" = 8 ] && [ "$(jq '[.roles[].pp_rank] | max' "$W/roles.json")" = 1 ] \
    && pass "pp2 x dp4 x ep2: $(jq '.roles | length' "$W/roles.json") rank roles covering 8 ranks" \
    || fail "rank roles: $(head -c 300 "$W/roles.json")"

# the search writes a configuration tera accepts
H=$SRC/hardware
"$TERA" plan "${MODEL[@]}" --hardware "$H/h100.ini" --devices 8 --global-batch 16 --training.precision=bf16 \
    --write-config "$W/best.ini" --json > "$W/search.json" 2> "$W/search.err" \
    && [ "$(jq '.best | length' "$W/search.json")" -ge 1 ] \
    && [ "$(jq '.best[0].pp * .best[0].dp * .best[0].tp' "$W/search.json")" = 8 ] \
    && "$TERA" config -c "$W/best.ini" > "$W/best.resolved" 2> "$W/best.err" \
    && grep -q "^dp = $(jq '.best[0].dp' "$W/search.json")" "$W/best.resolved" \
    && pass "search on 8 x H100: $(jq '.valid_layouts' "$W/search.json") valid layouts, best pp $(jq '.best[0].pp' "$W/search.json") x dp $(jq '.best[0].dp' "$W/search.json") x tp $(jq '.best[0].tp' "$W/search.json"), written and resolved by tera config" \
    || fail "search / --write-config: $(cat "$W/search.err" "$W/best.err" 2> /dev/null | head -3)"

# --write-config onto an existing file: refused without --force (the file kept), and never onto the
# hardware file the plan reads, even with --force (it used to replace it with a training config)
cp "$H/h100.ini" "$W/hw.ini"
printf '# mine\n' > "$W/mine.ini"
if "$TERA" plan "${MODEL[@]}" --hardware "$W/hw.ini" --devices 8 --global-batch 16 --training.precision=bf16 \
        --write-config "$W/mine.ini" > /dev/null 2> "$W/mine.err"; then fail "--write-config onto an existing file without --force"
else [ "$(cat "$W/mine.ini")" = "# mine" ] && grep -q "mine.ini' already exists; pass --force" "$W/mine.err" \
    && pass "--write-config onto an existing file: refused without --force, kept" || fail "existing --write-config: $(cat "$W/mine.err")"; fi
if "$TERA" plan "${MODEL[@]}" --hardware "$W/hw.ini" --devices 8 --global-batch 16 --training.precision=bf16 \
        --write-config "$W/hw.ini" --force > /dev/null 2> "$W/hwself.err"; then fail "--write-config onto the --hardware file"
else cmp -s "$H/h100.ini" "$W/hw.ini" && grep -q "is the input" "$W/hwself.err" \
    && pass "--write-config onto the --hardware file: refused even with --force" || fail "--write-config onto its input: $(cat "$W/hwself.err")"; fi

# --write-config onto an existing file that cannot be written whole (a file-size limit, SIGXFSZ
# ignored: the write fails with EFBIG) fails and leaves the old file as it was (written under a
# temporary name and renamed), and leaves no temporary file behind
printf '# precious\n' > "$W/keep.ini"
if (trap '' XFSZ; ulimit -f 4; exec "$TERA" plan "${MODEL[@]}" --hardware "$H/h100.ini" --devices 8 --global-batch 16 \
        --training.precision=bf16 --write-config "$W/keep.ini" --force) > /dev/null 2> "$W/keep.err"; then
    fail "--write-config under a 4 KiB file-size limit succeeded"
elif [ "$(cat "$W/keep.ini")" = "# precious" ] && [ -z "$(ls "$W" | grep 'keep.ini.tmp')" ] && grep -q "keep.ini" "$W/keep.err"; then
    pass "a failed --write-config keeps the existing file: $(grep -o 'cannot write.*' "$W/keep.err" | head -1)"
else
    fail "failed --write-config: file now '$(head -c 80 "$W/keep.ini")', $(ls "$W" | grep -c keep.ini.tmp) temporary files, $(cat "$W/keep.err")"
fi

# DeepSeek-V3-like (docs/PLAN.md): PP16 x EP64 x ZeRO-1 on 2048 H800 fits
DSV3=(-c "$SRC/configs/plan-dsv3.ini")
"$TERA" plan --dry-run "${DSV3[@]}" --hardware "$H/h800.ini" --json > "$W/dsv3.json" 2> "$W/dsv3.err" \
    && [ "$(jq '.layout.ranks' "$W/dsv3.json")" = 2048 ] && [ "$(jq '.fits' "$W/dsv3.json")" = true ] \
    && pass "DeepSeek-V3-like, $(jq '.total_params / 1e9 | floor' "$W/dsv3.json")B params ($(jq '.active_params / 1e9 | floor' "$W/dsv3.json")B active), PP16 x EP64 x ZeRO-1 on 2048 H800: largest rank $(jq '.worst_total / 1073741824 * 10 | floor / 10' "$W/dsv3.json") GiB, fits" \
    || fail "DeepSeek-V3-like on H800: $(cat "$W/dsv3.err"; jq -c '{fits, worst_total}' "$W/dsv3.json" 2> /dev/null)"
# a 1T-parameter MoE on 1024 x 64 GiB devices gets a fitting plan
"$TERA" plan -c "$SRC/configs/plan-1t.ini" --hardware "$H/ascend910b.ini" --devices 1024 --global-batch 4096 \
    --top 1 --json > "$W/1t.json" 2> "$W/1t.err" \
    && [ "$(jq '.best | length' "$W/1t.json")" = 1 ] && [ "$(jq '.total_params >= 1e12' "$W/1t.json")" = true ] \
    && [ "$(jq '.best[0].memory_worst_rank.total <= .device_bytes * (1 - .reserve)' "$W/1t.json")" = true ] \
    && pass "1T MoE on 1024 x 64 GiB: $(jq -r '.best[0] | "pp \(.pp) x dp \(.dp) x tp \(.tp), ep \(.ep), ZeRO \(.zero), \(.pp_schedule), micro \(.micro_batch) x \(.grad_accum), recompute \(.recompute): step \(.time.step_s * 100 | floor / 100) s"' "$W/1t.json")" \
    || fail "1T plan: $(cat "$W/1t.err"; head -c 300 "$W/1t.json")"

# a layout too large with its whole logits fits with the head and the loss over blocks of rows: a
# 32768-token vocabulary at T 2048 on one device of 0.25 GiB (the logits alone 256 MiB); the search
# tries training.loss_chunk = 1024 (TERA_PLAN_LOSS_CHUNK) and writes it into the configuration
BIGV=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --model.vocab_size=32768
      --training.seq_len=2048 --model.max_seq_len=2048 --training.precision=bf16)
sed 's/^memory_gib = 80 /memory_gib = 0.25 /' "$H/h100.ini" > "$W/small.ini"
whole=$("$TERA" plan --dry-run "${BIGV[@]}" --training.micro_batch=1 --hardware "$W/small.ini" --json 2> /dev/null | jq '.worst_total')
"$TERA" plan "${BIGV[@]}" --hardware "$W/small.ini" --devices 1 --global-batch 1 --write-config "$W/bigv.ini" --json \
        > "$W/bigv.json" 2> "$W/bigv.err" \
    && [ "$(jq '.best[0].loss_chunk' "$W/bigv.json")" = 1024 ] \
    && [ "$(jq --argjson w "${whole:-0}" '$w > .device_bytes * (1 - .reserve) and .best[0].memory_worst_rank.total <= .device_bytes * (1 - .reserve)' "$W/bigv.json")" = true ] \
    && "$TERA" config -c "$W/bigv.ini" 2> /dev/null | grep -q "^loss_chunk = 1024" \
    && pass "large vocabulary on 0.25 GiB: $whole bytes with the whole logits, $(jq '.best[0].memory_worst_rank.total' "$W/bigv.json") with loss_chunk 1024, written" \
    || fail "loss_chunk in the search: $(cat "$W/bigv.err"; jq -c '.best[0] | {loss_chunk, m: .memory_worst_rank.total}' "$W/bigv.json" 2> /dev/null), whole $whole"

# sequence parallelism is a dimension of the search (every tp > 1 layout with and without it): on
# GPT-3 175B's 512 H100s it decides the plan (docs/PLAN.md): the best layout is sequence-parallel at
# tp > 1 and fits without recomputation, and --write-config writes the option
"$TERA" plan -c "$SRC/configs/plan-gpt175b.ini" --hardware "$H/h100.ini" --devices 512 --global-batch 1536 --top 3 \
    --write-config "$W/gpt-sp.ini" --json > "$W/gpt-sp.json" 2> "$W/gpt-sp.err" \
    && [ "$(jq '.best[0].sequence_parallel and .best[0].tp > 1 and .best[0].recompute == "none"' "$W/gpt-sp.json")" = true ] \
    && [ "$(jq '.best[0].memory_worst_rank.total <= .device_bytes * (1 - .reserve)' "$W/gpt-sp.json")" = true ] \
    && "$TERA" config -c "$W/gpt-sp.ini" 2> /dev/null | grep -q "^sequence_parallel = true" \
    && pass "GPT-3 175B on 512 x H100: $(jq -r '.best[0] | "pp \(.pp) x dp \(.dp) x tp \(.tp) sequence-parallel, ZeRO \(.zero), recompute \(.recompute): step \(.time.step_s * 100 | floor / 100) s"' "$W/gpt-sp.json"), written with sequence_parallel = true" \
    || fail "sequence parallelism in the search: $(cat "$W/gpt-sp.err"; jq -c '.best[0] | {tp, sequence_parallel, recompute}' "$W/gpt-sp.json" 2> /dev/null)"
# Published runs (docs/PLAN.md, "Sanity checks"), each with the implementation choices its report
# states, checked by field name:
# - DeepSeek-V3's own run of that layout (FP8 products, FP8/BF16 expert exchange hidden by DualPipe,
#   no full recomputation): H800-hours per 10^12 tokens within 25% of the published ~180K
#   (2.664M H800-hours of pre-training for 14.8T tokens);
"$TERA" plan --dry-run "${DSV3[@]}" --hardware "$H/h800.ini" --training.recompute=none --products fp8 \
    --exchange-bytes 1.75 --exchange-overlap 1 --json > "$W/dsv3t.json" 2> "$W/dsv3t.err" \
    && hours=$(jq '.layout.ranks * 1e12 / .time.tokens_per_s / 3600 | floor' "$W/dsv3t.json") \
    && [ "$(jq '(.layout.ranks * 1e12 / .time.tokens_per_s / 3600) / 180000 | . >= 0.75 and . <= 1.25' "$W/dsv3t.json")" = true ] \
    && pass "DeepSeek-V3 on 2048 H800: $hours H800-hours per 1e12 tokens predicted, published ~180000 (within 25%)" \
    || fail "DeepSeek-V3 H800-hours: ${hours:-?} vs ~180000: $(cat "$W/dsv3t.err"; jq -c .time "$W/dsv3t.json" 2> /dev/null)"
# - a GPT-3 175B-like model: Megatron-Core (TP4 x PP8 x DP16 on H100, reported up to 47% MFU) and
#   MegaScale (TP8 x PP8 x DP192 on 12,288 A100, reported 55.2% MFU), both overlapping their tensor-
#   and data-parallel communication: predicted MFU within 25% of the reported one.
GPT=(-c "$SRC/configs/plan-gpt175b.ini" --comm-overlap 1)
for run in "Megatron-Core:h100:0.47:" "MegaScale:a100:0.552:--parallel.tp=8 --parallel.dp=192 --training.grad_accum=32"; do
    IFS=: read -r who hwf mfu extra <<< "$run"
    # shellcheck disable=SC2086
    "$TERA" plan --dry-run "${GPT[@]}" --hardware "$H/$hwf.ini" $extra --json > "$W/gpt.json" 2> "$W/gpt.err" \
        && [ "$(jq --argjson r "$mfu" '.time.mfu / $r | . >= 0.75 and . <= 1.25' "$W/gpt.json")" = true ] \
        && pass "$who, GPT-3 175B on $(jq '.layout.ranks' "$W/gpt.json") x $hwf: MFU $(jq '.time.mfu * 1000 | floor / 10' "$W/gpt.json")% predicted, $mfu reported" \
        || fail "$who MFU: $(cat "$W/gpt.err"; jq -c '.time.mfu' "$W/gpt.json" 2> /dev/null) vs $mfu"
done

# tera plan --calibrate: one process measures the products, attention and memory bandwidth of the
# model's shapes, two ranks the collectives through the comm layer; the file it writes is a hardware
# description the time model reads (checked by its sections and fields, not by the rates)
"$TERA" plan --calibrate "${TINY[@]}" --training.threads=1 --out "$W/cal.ini" > "$W/cal.log" 2>&1 \
    && $MPIRUN -np 2 "$TERA" plan --calibrate "${TINY[@]}" --out "$W/cal.ini" >> "$W/cal.log" 2>&1 \
    && grep -q '^\[gemm\]' "$W/cal.ini" && grep -q '^point = 1 fp32 ' "$W/cal.ini" && grep -q '^\[attention\]' "$W/cal.ini" \
    && grep -q '^\[memory\]' "$W/cal.ini" && grep -q '^allreduce = 2 ' "$W/cal.ini" && grep -q '^alltoall = 2 ' "$W/cal.ini" \
    && grep -q '^shared_sum = 2 ' "$W/cal.ini" \
    && awk '/^\[/ {s = $0} s == "[shared]" && $1 == "point" && $3 == 2 && $5 > 0 && $5 <= 1.5 && $6 > 0 && $6 <= 1.5 {n++} END {exit n != 1}' "$W/cal.ini" \
    && "$TERA" plan --dry-run "${TINY[@]}" --training.threads=1 --hardware "$W/cal.ini" --json > "$W/calp.json" 2> "$W/calp.err" \
    && [ "$(jq '.time.matmul_s > 0 and .time.memory_s > 0 and .time.step_s >= .time.compute_s' "$W/calp.json")" = true ] \
    && pass "tera plan --calibrate: $(grep -c '^point' "$W/cal.ini") measured points, $(grep -c '= 2 ' "$W/cal.ini") collective fits; the time model reads them" \
    || fail "calibrate: $(tail -3 "$W/cal.log"; cat "$W/calp.err" 2> /dev/null)"
# the steadiness check: the calibration's first products are measured again at its end; when the
# host's speed moved (TERA_CALIBRATE_SLOW_START_US slows their first measurement), one note on stderr
# names a product and says to calibrate again, and the file is still written
if TERA_CALIBRATE_SLOW_START_US=20000 "$TERA" plan --calibrate "${TINY[@]}" --training.threads=1 --out "$W/cal-slow.ini" \
        > "$W/cal-slow.log" 2> "$W/cal-slow.err" \
    && [ "$(grep -c 'moved during the calibration' "$W/cal-slow.err")" = 1 ] && grep -q 'x \[[0-9]*\]^T.*calibrate again' "$W/cal-slow.err" \
    && [ "$(grep -c 'steadiness:' "$W/cal-slow.log")" = 3 ] && [ "$(grep -c 'steadiness:' "$W/cal.log")" = 3 ] \
    && grep -q '^\[gemm\]' "$W/cal-slow.ini"; then
    pass "calibrate: its first 3 products measured again at the end; a moved host gets one note: $(cut -c1-120 "$W/cal-slow.err")..."
else
    fail "steadiness check: $(cat "$W/cal-slow.err"; grep steadiness "$W/cal-slow.log" "$W/cal.log")"
fi
# the shared_sum fit (ZeRO's sums in host-shared memory) prices dp 2's sums: the same plan without it
# prices the segment's collectives instead, another figure; without host-shared blocks
# (TERA_COMM_SHM=0) the calibration writes no such fit
grep -v '^shared_sum' "$W/cal.ini" > "$W/cal-nosh.ini"
if "$TERA" plan --dry-run "${TINY[@]}" --training.threads=1 --parallel.dp=2 --hardware "$W/cal.ini" --json > "$W/calsh.json" 2> "$W/calsh.err" \
    && "$TERA" plan --dry-run "${TINY[@]}" --training.threads=1 --parallel.dp=2 --hardware "$W/cal-nosh.ini" --json > "$W/calnosh.json" 2>> "$W/calsh.err" \
    && [ "$(jq '.time.dp_total_s > 0' "$W/calsh.json")" = true ] \
    && [ "$(jq -r '.time.dp_total_s' "$W/calsh.json")" != "$(jq -r '.time.dp_total_s' "$W/calnosh.json")" ] \
    && $MPIRUN -np 2 env TERA_COMM_SHM=0 "$TERA" plan --calibrate "${TINY[@]}" --out "$W/cal-noshm.ini" > "$W/cal-noshm.log" 2>&1 \
    && grep -q '^allreduce = 2 ' "$W/cal-noshm.ini" && ! grep -q '^shared_sum' "$W/cal-noshm.ini"; then
    pass "shared_sum: dp 2's sums $(jq '.time.dp_total_s * 1e6 | round' "$W/calsh.json") us with the fit, $(jq '.time.dp_total_s * 1e6 | round' "$W/calnosh.json") us as collectives; none measured with TERA_COMM_SHM=0"
else
    fail "shared_sum: $(cat "$W/calsh.err"; tail -3 "$W/cal-noshm.log" 2> /dev/null)"
fi
# --shared-only: only the [shared] points are measured again, the collective fits stay as they were;
# on one process it is refused (it measures ranks sharing the machine)
grep '^allreduce = 2 ' "$W/cal.ini" > "$W/cal-ar.txt" 2> /dev/null
if $MPIRUN -np 2 "$TERA" plan --calibrate --shared-only "${TINY[@]}" --out "$W/cal.ini" > "$W/calsh.log" 2>&1 \
    && grep -q '^shared: 2 ranks' "$W/calsh.log" && [ -s "$W/cal-ar.txt" ] \
    && [ "$(grep '^allreduce = 2 ' "$W/cal.ini")" = "$(cat "$W/cal-ar.txt")" ]; then
    if "$TERA" plan --calibrate --shared-only "${TINY[@]}" --out "$W/cal.ini" > /dev/null 2> "$W/calsh1.err"; then
        fail "--shared-only on one process accepted"
    else
        pass "--calibrate --shared-only: $(grep '^shared: 2 ranks' "$W/calsh.log" | head -1 | cut -c1-90); the collective fits kept; one process refused"
    fi
else
    fail "--calibrate --shared-only: $(tail -3 "$W/calsh.log")"
fi
# calibrating into a file that is not a hardware description refuses it by name and leaves it as it was
printf '# precious\n[device]\nname = x\n' > "$W/keep-hw.ini"
if "$TERA" plan --calibrate "${TINY[@]}" --training.threads=1 --out "$W/keep-hw.ini" > /dev/null 2> "$W/kh.err"; then
    fail "--calibrate into a malformed hardware file succeeded"
else
    grep -q "keep-hw.ini" "$W/kh.err" && [ "$(head -1 "$W/keep-hw.ini")" = "# precious" ] \
        && pass "a malformed --out file is named and kept: $(head -1 "$W/kh.err")" || fail "malformed --out: $(cat "$W/kh.err")"
fi

# errors name what is wrong
printf '[device]\nname = x\nmemory_gib = lots\n' > "$W/bad.ini"
"$TERA" plan "${MODEL[@]}" --hardware "$W/bad.ini" --devices 8 --global-batch 8 > /dev/null 2> "$W/e1" ; rc=$?
[ "$rc" != 0 ] && grep -q "bad.ini:3: \[device\] memory_gib = 'lots'" "$W/e1" && pass "a bad hardware value is named: $(cat "$W/e1")" \
    || fail "bad hardware file: rc $rc, $(cat "$W/e1")"
"$TERA" plan "${MODEL[@]}" --hardware "$W/nope.ini" --devices 8 --global-batch 8 > /dev/null 2> "$W/e4"; rc=$?
[ "$rc" != 0 ] && grep -q "nope.ini': No such file or directory" "$W/e4" && pass "a missing hardware file is named with the reason" \
    || fail "missing hardware file: rc $rc, $(cat "$W/e4")"
"$TERA" plan "${MODEL[@]}" --hardware "$H/h100.ini" --devices 8 > /dev/null 2> "$W/e2"; rc=$?
[ "$rc" != 0 ] && grep -q "global-batch" "$W/e2" && pass "a missing option is named" || fail "missing option: $(cat "$W/e2")"
"$TERA" plan --dry-run "${MODEL[@]}" --parallel.dp=2 --parallel.ep=4 > /dev/null 2> "$W/e3"; rc=$?
[ "$rc" != 0 ] && grep -q "parallel.ep" "$W/e3" && pass "an invalid layout is refused: $(cat "$W/e3")" || fail "invalid layout: $(cat "$W/e3")"
"$TERA" plan --help | grep -q -- "--global-batch" && pass "tera plan --help" || fail "tera plan --help"
finish cli_plan
