#!/usr/bin/env bash
# The time model of `tera plan` (docs/PLAN.md) against measured step times on this machine (issue 18).
# Phases (PHASES, default "calibrate measure predict"):
#   calibrate  `tera plan --calibrate` for the shapes of bench-s, bench-m and bench-dist (GEMM and
#              attention rates by shape at the thread counts the benchmarks use, memory bandwidth, and
#              under mpirun on 2, 4 and 8 ranks the collectives through tera's comm layer and the
#              fraction of its rate alone each rank gets when all compute at once, [shared]) into $HW
#              (default hardware/this-machine.ini; each call adds its points to the file);
#   shared     only the [shared] points (mpirun on 2, 4 and 8 ranks, --shared-only) into an existing
#              $HW, its other figures kept (e.g. to re-predict an earlier measurement with them);
#   measure    `tera bench` of bench-s, bench-m and bench-dist layouts on 1-8 ranks (as bench/dist.sh:
#              one thread per rank, global batch 16 x 256 tokens), REPS rounds in alternating order
#              (the machine is shared with other work: rounds and medians show the drift); one JSON
#              line per run into $MEASURED (bench-m once per round only when BENCH_M_REPS allows);
#   predict    `tera plan --dry-run --hardware $HW --json` for each case: predicted step time against
#              the median measured one; prints the table and the median absolute error. Alone
#              (PHASES=predict) it re-predicts an earlier $MEASURED with the current model and $HW.
# FORCE_BALANCE=1 runs the bench-dist layouts with model.router_force_balance=true (benchmarking only:
# every expert, so every expert-parallel rank, gets the same rows), the uniform routing the time model
# prices; without it bench-dist's untrained router collapses onto a few experts and an expert-parallel
# layout measures that imbalance (tera bench's ep_load_max_over_mean), which the model does not know.
# Every file is written under a temporary name and renamed when its phase completes: a failed or
# interrupted calibration leaves $HW as it was, an interrupted measurement the previous $MEASURED.
# PHASES, the counts and every layout are checked before anything runs (exit 2, one message).
# Usage: bench/plan_validate.sh [TERA]   (REPS=3 STEPS=3 WARMUP=1 BENCH_M_REPS=1 PHASES=... FORCE_BALANCE=0)
set -eu
TERA=${1:-build/tera}
REPS=${REPS:-3}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-1}
BENCH_M_REPS=${BENCH_M_REPS:-1}
PHASES=${PHASES:-calibrate measure predict}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.."
mkdir -p bench/results
HW=${HW:-hardware/this-machine.ini}
MEASURED=${MEASURED:-bench/results/plan-measured.jsonl}
PREDICTED=${PREDICTED:-bench/results/plan-predicted.jsonl}
# bench-dist layouts (bench/dist.sh's naming):
#   name:parallel.dp:parallel.tp:parallel.ep:zero:pp[:sequence_parallel[:pp_chunks[:pp_head_split[:defer]]]]
# pp_chunks > 1 runs the interleaved schedule over that many chunks a stage, pp_head_split 1 splits
# the LM head between the first and the last stage, defer 1 sets parallel.pp_defer_wgrad to the 4
# micro-batches (bench/dist.sh's -i4, -hs and -dw), e.g. pp2-i4-hs-dw:1:1:1:0:2:0:4:1:1.
LAYOUTS=${LAYOUTS-"one:1:1:1:0:1 dp2:2:1:1:0:1 tp2:1:2:1:0:1 ep2:2:1:2:0:1 dp4:4:1:1:0:1 dp4-zero1:4:1:1:1:1
    dp4-zero3:4:1:1:3:1 tp4:1:4:1:0:1 ep4:4:1:4:0:1 dp2xep2-zero1:4:1:2:1:1 dp8:8:1:1:0:1 ep8:8:1:8:0:1
    pp2:1:1:1:0:2 pp4:1:1:1:0:4 pp2xdp2xep2-zero1:4:1:2:1:2"}
# the arguments of one bench-dist layout (as bench/dist.sh)
dist_args() { # dp tp ep zero pp [sp [chunks [head_split [defer]]]]
    local dp=$1 tp=$2 ep=$3 zero=$4 pp=$5 sp=${6:-0} chunks=${7:-1} hs=${8:-0} dw=${9:-0} accum=1 sched=""
    [ "$pp" -gt 1 ] && accum=4
    [ "$chunks" -gt 1 ] && sched="$sched --parallel.pp_schedule=interleaved --parallel.pp_chunks=$chunks"
    [ "$hs" = 1 ] && sched="$sched --parallel.pp_head_split=true"
    [ "$dw" = 1 ] && sched="$sched --parallel.pp_defer_wgrad=$accum"
    echo "-c configs/bench-dist.ini --training.micro_batch=$((16 / dp / accum)) --training.grad_accum=$accum" \
         "--parallel.dp=$dp --parallel.tp=$tp --parallel.ep=$ep --parallel.pp=$pp --parallel.zero=$zero" \
         "--parallel.ep_overlap=1 --parallel.sequence_parallel=$([ "$sp" = 1 ] && echo true || echo false)" \
         "--training.threads=1$sched$FB"
}
FB=""
[ "${FORCE_BALANCE:-0}" = 1 ] && FB=" --model.router_force_balance=true"
bad() { echo "bench/plan_validate.sh: $*" >&2; exit 2; }
for ph in $PHASES; do
    case $ph in calibrate|shared|measure|predict) ;; *) bad "PHASES: unknown phase '$ph' (calibrate, shared, measure, predict)" ;; esac
done
for v in REPS STEPS WARMUP BENCH_M_REPS; do
    case ${!v} in ''|*[!0-9]*) bad "$v='${!v}' is not a non-negative integer" ;; esac
done
[ "$REPS" -ge 1 ] && [ "$STEPS" -ge 1 ] || bad "REPS and STEPS must be at least 1 (REPS=$REPS, STEPS=$STEPS)"
# each layout: a name and 5 to 9 integer fields; dp tp ep pp chunks >= 1; sequence_parallel,
# head_split and defer 0 or 1; the global batch of 16 sequences divisible by dp x micro-batches
for l in $LAYOUTS; do
    printf '%s' "$l" | awk -F: '{ ok = NF >= 6 && NF <= 10 && $1 != ""
            for (i = 2; i <= NF; i++) if ($i !~ /^[0-9]+$/) ok = 0
            if (ok) { pp = $6 + 0; accum = pp > 1 ? 4 : 1
                if ($2 < 1 || $3 < 1 || $4 < 1 || pp < 1 || (NF >= 8 && $8 < 1)) ok = 0
                if ((NF >= 7 && $7 > 1) || (NF >= 9 && $9 > 1) || (NF >= 10 && $10 > 1)) ok = 0
                if (ok && 16 % ($2 * accum) != 0) ok = 0 }
            exit !ok }' ||
        bad "LAYOUTS: malformed layout '$l' (name:dp:tp:ep:zero:pp[:sequence_parallel[:pp_chunks[:pp_head_split[:defer]]]], dp tp ep pp pp_chunks >= 1, sequence_parallel pp_head_split defer 0 or 1, 16 divisible by dp x micro-batches)"
done
# the phases' files under temporary names until each phase completes
TMP_HW="$HW.partial.$$" TMP_MEASURED="$MEASURED.partial.$$" TMP_PREDICTED="$PREDICTED.partial.$$"
trap 'rm -f "$TMP_HW" "$TMP_MEASURED" "$TMP_PREDICTED"' EXIT
ranks_of() { echo $(($5 * $1 * $2)); } # dp tp ep zero pp -> pp dp tp
launch() { # ranks args...
    local n=$1; shift
    if [ "$n" = 1 ]; then "$TERA" "$@"; else mpirun --oversubscribe -np "$n" "$TERA" "$@"; fi
}

if [[ " $PHASES " == *" calibrate "* ]]; then
    rm -f "$TMP_HW"
    # bench-dist's shapes on one thread (one process alone: the rates), then the collectives on 2, 4
    # and 8 ranks (all at once, as the benchmarks run them)
    launch 1 plan --calibrate -c configs/bench-dist.ini --training.threads=1 --out "$TMP_HW" > /dev/null
    for n in 2 4 8; do
        launch "$n" plan --calibrate -c configs/bench-dist.ini --training.threads=1 --out "$TMP_HW" > /dev/null
    done
    # bench-s and bench-m on the default thread count (all cores), fp32
    for b in bench-s bench-m; do
        launch 1 plan --calibrate -c "configs/$b.ini" --out "$TMP_HW" > /dev/null
    done
    mv -f "$TMP_HW" "$HW"
    echo "calibrated: $HW"
fi

if [[ " $PHASES " == *" shared "* ]]; then
    [ -f "$HW" ] || { echo "plan_validate.sh: PHASES=shared needs an existing $HW" >&2; exit 1; }
    cp "$HW" "$TMP_HW"
    for n in 2 4 8; do
        echo "shared on $n ranks, load $(cut -d' ' -f1-3 /proc/loadavg)"
        launch "$n" plan --calibrate --shared-only -c configs/bench-dist.ini --training.threads=1 --out "$TMP_HW" | grep '^shared'
    done
    mv -f "$TMP_HW" "$HW"
fi

if [[ " $PHASES " == *" measure "* ]]; then
    : > "$TMP_MEASURED"
    for rep in $(seq "$REPS"); do
        cases="bench-s"
        [ "$rep" -le "$BENCH_M_REPS" ] && cases="$cases bench-m"
        for l in $LAYOUTS; do cases="$cases $l"; done
        # alternate the order between rounds (load drift)
        [ $((rep % 2)) = 0 ] && cases=$(echo $cases | tr ' ' '\n' | tac | tr '\n' ' ')
        for c in $cases; do
            case $c in
            bench-s|bench-m)
                launch 1 bench -c "configs/$c.ini" --name "$c" --steps "$STEPS" --warmup "$WARMUP" 2> /dev/null ;;
            *)
                IFS=: read -r name dp tp ep zero pp sp chunks hs dw <<< "$c"
                # shellcheck disable=SC2046
                launch "$(ranks_of "$dp" "$tp" "$ep" "$zero" "$pp")" bench $(dist_args "$dp" "$tp" "$ep" "$zero" "$pp" "${sp:-0}" "${chunks:-1}" "${hs:-0}" "${dw:-0}") \
                    --name "bench-dist/$name" --steps "$STEPS" --warmup "$WARMUP" 2> /dev/null ;;
            esac | sed "s/^{/{\"rep\": $rep, \"uptime_load\": $(cut -d' ' -f1 /proc/loadavg), /" | tee -a "$TMP_MEASURED"
        done
    done
    [ -s "$TMP_MEASURED" ] || { echo "bench/plan_validate.sh: no case was measured ($TERA bench failed); $MEASURED kept" >&2; exit 1; }
    mv -f "$TMP_MEASURED" "$MEASURED"
fi

if [[ " $PHASES " == *" predict "* ]]; then
    : > "$TMP_PREDICTED"
    for c in bench-s bench-m $LAYOUTS; do
        case $c in
        bench-s|bench-m) name=$c; args="-c configs/$c.ini" ;;
        *) IFS=: read -r n dp tp ep zero pp sp chunks hs dw <<< "$c"; name=bench-dist/$n
           args=$(dist_args "$dp" "$tp" "$ep" "$zero" "$pp" "${sp:-0}" "${chunks:-1}" "${hs:-0}" "${dw:-0}") ;;
        esac
        # shellcheck disable=SC2086
        "$TERA" plan --dry-run $args --hardware "$HW" --json |
            jq -c --arg name "$name" '{name: $name, ranks: .layout.ranks, time: .time}' >> "$TMP_PREDICTED"
    done
    [ -s "$TMP_PREDICTED" ] || { echo "bench/plan_validate.sh: no case was predicted ($TERA plan failed); $PREDICTED kept" >&2; exit 1; }
    mv -f "$TMP_PREDICTED" "$PREDICTED"
    python3 - "$MEASURED" "$PREDICTED" <<'PY'
import json, sys, statistics
meas = {}
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"): continue
    r = json.loads(line)
    meas.setdefault(r["config"], []).append(r["step_ms_median"])
pred = [json.loads(l) for l in open(sys.argv[2])]
print("| case | ranks | measured step ms (runs) | median | predicted ms | compute | elementwise + optimizer | comm | bubble | error |")
print("|---|---|---|---|---|---|---|---|---|---|")
errs = []
for p in pred:
    runs = meas.get(p["name"])
    if not runs: continue
    m = statistics.median(runs)
    t = p["time"]
    ms = 1e3 * t["step_s"]
    e = (ms - m) / m
    errs.append(abs(e))
    comm = 1e3 * (t["tp_s"] + t["ep_s"] + t["pp_s"] + t["dp_exposed_s"])
    print(f"| {p['name']} | {p['ranks']} | {', '.join(f'{x:.0f}' for x in runs)} | {m:.0f} | {ms:.0f} | "
          f"{1e3 * t['matmul_s']:.0f} | {1e3 * (t['memory_s']):.0f} | {comm:.0f} | {1e3 * t['bubble_s']:.0f} | {100 * e:+.1f}% |")
if errs:
    print(f"\nmedian absolute error {100 * statistics.median(errs):.1f}% over {len(errs)} cases "
          f"(max {100 * max(errs):.1f}%)")
PY
fi
