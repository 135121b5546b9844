#!/usr/bin/env bash
# bench-dist (../shared/spec/BENCH.md) on 1, 2, 4 and 8 MPI ranks in several layouts: tokens/s,
# bytes each rank sent per step against the analytic minimum of the layout (by kind of transfer,
# see src/cli/cmd_bench.c), memory per rank, and what overlapping the expert exchange with expert
# compute saves (ep_overlap 1 vs 0). One thread per rank; global batch 16 sequences of 256 tokens
# (micro_batch = 16 / parallel.dp: tensor-parallel ranks share their samples).
# Then the overlap A/B: each expert-parallel layout of AB_LAYOUTS run AB_REPEATS times with
# ep_overlap 1 and 0 alternating (the machine's load drifts; alternation and medians show it).
# Beside the layouts, the machine's ceiling for 2 ranks (CEILING="2", e.g. "2 4"; "" skips it): as
# many independent one-rank runs side by side, each on its share of the batch; the table gives each
# layout's tokens/s against one rank (the median of the "one" rows) and against that ceiling, its
# exposed communication (blocked in collectives and waits) and the time spent starting and polling
# non-blocking operations (comm_progress_ms: data moved and summed by the library on the rank's core),
# and with expert parallelism the busiest expert-parallel rank's routed rows over the mean
# (ep_load_max_over_mean: a rank with more rows makes the others wait in the exchange).
# FORCE_BALANCE=1 runs every layout, the ceiling and the A/B with model.router_force_balance=true
# (benchmarking only: each token's experts are a fixed balanced pattern of its position, so every
# expert, and every expert-parallel rank, gets the same rows: ep_load_max_over_mean 1; bench-dist's
# untrained router otherwise collapses onto a few experts and expert parallelism measures that
# imbalance, not the exchange). The JSON lines carry "router_force_balance"; the table says which.
# Pipeline layouts add a table of each stage's busy and waiting milliseconds per step (tera bench's
# pp_stage_busy_ms / pp_stage_wait_ms) and what the busiest stage's busy time allows with no bubble.
# CONFIG=FILE runs another model than configs/bench-dist.ini (its global batch still 16 sequences; the
# tests' smoke run). ROUNDS=N (default 1) runs the layouts and the ceiling N times, in alternating order (forward, then
# backward, ...), each JSON line tagged with its "round": every ratio to one rank is then taken against
# the same round's one-rank run, and the table gives each layout's median ratio over the rounds with
# their range and the median round's other figures (this host's memory bandwidth moves by up to 2x
# within minutes, so one pair of runs can mislead; the rounds show how much).
# Usage: bench/dist.sh [TERA] [STEPS] [WARMUP]   (results: $OUT, default bench/results/dist.jsonl,
# and $OUT_AB, default bench/results/dist-overlap.jsonl; LAYOUTS="" or AB_LAYOUTS="" skip a part;
# both are written under temporary names and renamed at the end, so an interrupted run, or one in
# which no run gave a result, keeps the earlier files)
set -eu
TERA=${1:-build/tera}
STEPS=${2:-3}
WARMUP=${3:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.."
mkdir -p bench/results
OUT=${OUT:-bench/results/dist.jsonl}
CONFIG=${CONFIG:-configs/bench-dist.ini}
ROUNDS=${ROUNDS:-1}
case "$ROUNDS" in ''|*[!0-9]*|0) echo "bench/dist.sh: ROUNDS='$ROUNDS' is not a positive integer" >&2; exit 2;; esac
OUT_AB=${OUT_AB:-bench/results/dist-overlap.jsonl}
FB=()
[ "${FORCE_BALANCE:-0}" = 1 ] && FB=(--model.router_force_balance=true)
# Naming as tests/cli_layouts.sh: "dpA x tpT x epE" runs A*T*E ranks with parallel.dp = A*E,
# parallel.tp = T, parallel.ep = E; "ppP" adds P pipeline stages (pp x dp x tp ranks) and runs the
# global batch as 4 micro-batches through them, by 1F1B, or with a field C > 1 after sequence_parallel
# by the interleaved schedule over C model chunks per stage (parallel.pp_chunks; pp2-i4: a layer a
# chunk), a field 1 after it splits the LM head between the first and last stage
# (parallel.pp_head_split: -hs), and a last field 1 defers the head's weight gradients into the
# pipeline's gaps (parallel.pp_defer_wgrad = the 4 micro-batches: -dw); the field after pp set to 1
# turns on parallel.sequence_parallel (tp > 1).
#   name:parallel.dp:parallel.tp:parallel.ep:zero:ep_overlap[:pp[:sequence_parallel[:pp_chunks[:pp_head_split[:defer]]]]]
DEFAULT_LAYOUTS="one:1:1:1:0:1
    dp2:2:1:1:0:1 dp2-zero1:2:1:1:1:1 tp2:1:2:1:0:1 tp2-sp:1:2:1:0:1:1:1 ep2:2:1:2:0:1 ep2-no-overlap:2:1:2:0:0
    dp4:4:1:1:0:1 dp4-zero1:4:1:1:1:1 dp4-zero2:4:1:1:2:1 dp4-zero3:4:1:1:3:1 tp4:1:4:1:0:1 tp4-sp:1:4:1:0:1:1:1
    dp2xtp2:2:2:1:0:1
    ep4:4:1:4:0:1 ep4-no-overlap:4:1:4:0:0 dp2xep2-zero1:4:1:2:1:1 tp2xep2-zero3:2:2:2:3:1
    dp8:8:1:1:0:1 dp2xep4-zero1:8:1:4:1:1 ep8:8:1:8:0:1 ep8-no-overlap:8:1:8:0:0 dp2xtp2xep2-zero2:4:2:2:2:1
    pp2:1:1:1:0:1:2 pp2-i4:1:1:1:0:1:2:0:4 pp2-i4-hs:1:1:1:0:1:2:0:4:1 pp2-i4-hs-dw:1:1:1:0:1:2:0:4:1:1 pp4:1:1:1:0:1:4 pp2xdp2xep2-zero1:4:1:2:1:1:2"
LAYOUTS=${LAYOUTS-$DEFAULT_LAYOUTS}
AB_LAYOUTS=${AB_LAYOUTS-"ep2:2:1:2:0 ep4:4:1:4:0 ep8:8:1:8:0"}
# An entry of LAYOUTS or AB_LAYOUTS may be a bare name of KNOWN (the default list, the other two-rank
# ZeRO stages and pipeline variants, and pp2 x tp2 with and without the head split for a host of four
# cores or more), e.g. LAYOUTS="one dp2 tp2-sp pp2"; any other entry spells out its fields.
# An unknown name or a malformed entry is refused (exit 2) before the results files are touched.
KNOWN="$DEFAULT_LAYOUTS dp2-zero2:2:1:1:2:1 dp2-zero3:2:1:1:3:1 pp2-hs:1:1:1:0:1:2:0:1:1 pp2-dw:1:1:1:0:1:2:0:1:0:1
    pp2-hs-dw:1:1:1:0:1:2:0:1:1:1 pp2-i4-dw:1:1:1:0:1:2:0:4:0:1
    pp2xtp2:1:2:1:0:1:2 pp2xtp2-hs:1:2:1:0:1:2:0:1:1 pp2xtp2-i4-hs-dw:1:2:1:0:1:2:0:4:1:1"
resolve() { # VAR MIN_FIELDS MAX_FIELDS: VAR's entries with bare names replaced by their fields
    local var=$1 lo=$2 hi=$3 e spec known out=""
    for e in ${!var}; do
        spec=$e
        if [ "${e#*:}" = "$e" ]; then
            spec=""
            for known in $KNOWN; do [ "${known%%:*}" = "$e" ] && { spec=$known; break; }; done
            if [ -z "$spec" ]; then
                echo "bench/dist.sh: $var: unknown layout '$e'; known: $(for known in $KNOWN; do printf '%s ' "${known%%:*}"; done)" >&2
                return 2
            fi
            spec=$(printf '%s' "$spec" | cut -d: -f1-"$hi")
        fi
        # fields after the name: integers, dp tp ep (and pp) at least 1, MIN_FIELDS to MAX_FIELDS in all
        if ! printf '%s' "$spec" | awk -F: -v lo="$lo" -v hi="$hi" '{ ok = NF >= lo && NF <= hi
                for (i = 2; i <= NF; i++) if ($i !~ /^[0-9]+$/ || ((i <= 4 || i == 7 || i == 9) && $i + 0 < 1) || ((i == 10 || i == 11) && $i > 1)) ok = 0 }
                END { exit !ok }'; then
            echo "bench/dist.sh: $var: malformed layout '$e' (name:dp:tp:ep:zero:ep_overlap[:pp[:sequence_parallel[:pp_chunks[:pp_head_split[:defer]]]]], dp tp ep pp pp_chunks >= 1, pp_head_split and defer 0 or 1)" >&2
            return 2
        fi
        out="$out $spec"
    done
    printf '%s' "${out# }"
}
LAYOUTS=$(resolve LAYOUTS 6 11) || exit 2
AB_LAYOUTS=$(resolve AB_LAYOUTS 5 5) || exit 2
# the results under temporary names until every run is done: an interrupted run keeps the earlier files
TMP_OUT="$OUT.partial.$$" TMP_AB="$OUT_AB.partial.$$"
trap 'rm -f "$TMP_OUT" "$TMP_AB"' EXIT
: > "$TMP_OUT"
: > "$TMP_AB"
run() { # name dp tp ep zero overlap [pp [sp [chunks [head_split [defer]]]]]
    local name=$1 dp=$2 tp=$3 ep=$4 zero=$5 ov=$6 pp=${7:-1} sp=${8:-0} chunks=${9:-1} hs=${10:-0} dw=${11:-0}
    local n=$((pp * dp * tp)) accum=1 sched=()
    [ "$pp" -gt 1 ] && accum=4
    [ "$chunks" -gt 1 ] && sched=(--parallel.pp_schedule=interleaved --parallel.pp_chunks="$chunks")
    [ "$hs" = 1 ] && sched+=(--parallel.pp_head_split=true)
    [ "$dw" = 1 ] && sched+=(--parallel.pp_defer_wgrad="$accum")
    local args=(bench -c "$CONFIG" --name "bench-dist/$name" --steps "$STEPS" --warmup "$WARMUP"
          --training.micro_batch=$((16 / dp / accum)) --training.grad_accum="$accum" --parallel.dp="$dp"
          --parallel.tp="$tp" --parallel.ep="$ep" --parallel.pp="$pp" --parallel.zero="$zero"
          --parallel.ep_overlap="$ov" --parallel.sequence_parallel="$([ "$sp" = 1 ] && echo true || echo false)"
          --training.threads=1 ${sched[@]+"${sched[@]}"} ${FB[@]+"${FB[@]}"})
    if [ "$n" = 1 ]; then "$TERA" "${args[@]}" 2> /dev/null; else mpirun --oversubscribe -np "$n" "$TERA" "${args[@]}" 2> /dev/null; fi
}
# The machine's own ceiling for N ranks: N independent one-rank runs side by side, each on 16 / N
# sequences (a dp layout's share) and nothing exchanged; their summed tokens/s is what any N-rank
# layout could reach here if communication cost nothing (cores, caches and memory bandwidth shared
# as in the layouts). CEILING="" skips it.
ceiling() { # n
    local n=$1 tmp
    tmp=$(mktemp -d)
    for i in $(seq "$n"); do
        "$TERA" bench -c "$CONFIG" --name "bench-dist/ceiling$n" --steps "$STEPS" --warmup "$WARMUP" \
            --training.micro_batch=$((16 / n)) --training.threads=1 ${FB[@]+"${FB[@]}"} > "$tmp/$i.json" 2> /dev/null &
    done
    wait
    cat "$tmp"/*.json | python3 -c '
import json, sys
rs = [json.loads(l) for l in sys.stdin if l.strip()]
r = dict(rs[0])
r.update(ranks=len(rs), independent=1, tokens_per_s=sum(x["tokens_per_s"] for x in rs),
         step_ms_median=max(x["step_ms_median"] for x in rs))
print(json.dumps(r))'
    rm -rf "$tmp"
}
tag() { # round: each JSON line of stdin with "round" added
    python3 -c 'import json, sys
for l in sys.stdin:
    if l.strip(): print(json.dumps(dict(json.loads(l), round=int(sys.argv[1]))))' "$1"
}
for round in $(seq "$ROUNDS"); do
    order=$LAYOUTS
    if [ $((round % 2)) = 0 ]; then order=$(printf '%s\n' $LAYOUTS | tac); fi # alternating order
    for l in $order; do
        IFS=: read -r name dp tp ep zero ov pp sp chunks hs dw <<< "$l"
        run "$name" "$dp" "$tp" "$ep" "$zero" "$ov" "${pp:-1}" "${sp:-0}" "${chunks:-1}" "${hs:-0}" "${dw:-0}" | tag "$round" | tee -a "$TMP_OUT"
    done
    for n in ${CEILING-2}; do ceiling "$n" | tag "$round" | tee -a "$TMP_OUT"; done
done
for l in $AB_LAYOUTS; do
    IFS=: read -r name dp tp ep zero <<< "$l"
    for i in $(seq "${AB_REPEATS:-3}"); do
        run "$name" "$dp" "$tp" "$ep" "$zero" 1 | tee -a "$TMP_AB"
        run "$name-no-overlap" "$dp" "$tp" "$ep" "$zero" 0 | tee -a "$TMP_AB"
    done
done
if [ ! -s "$TMP_OUT" ] && [ ! -s "$TMP_AB" ]; then
    echo "bench/dist.sh: no run gave a result ($TERA bench failed?); $OUT and $OUT_AB kept" >&2
    exit 1
fi
mv -f "$TMP_OUT" "$OUT"
mv -f "$TMP_AB" "$OUT_AB"
python3 - "$OUT" "$OUT_AB" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
ab = [json.loads(l) for l in open(sys.argv[2])]
MiB, KiB = 2**20, 2**10
rnd = lambda r: r.get("round", 1)
name_of = lambda r: r["config"].split("/")[-1]
nrounds = len({rnd(r) for r in rows})
# one rank and the ceiling per round: each ratio is against its own round (ROUNDS=N)
ones = {}
for r in rows:
    if r.get("ranks", 1) == 1: ones.setdefault(rnd(r), []).append(r["tokens_per_s"])
one_r = {k: statistics.median(v) for k, v in ones.items()}
ceil_r = {(rnd(r), r["ranks"]): r["tokens_per_s"] for r in rows if r.get("independent")}
x_of = lambda r: r["tokens_per_s"] / one_r[rnd(r)] if rnd(r) in one_r else None  # x one rank, its own round
# a layout's rounds: the row of the median ratio stands for it; the ratios (and shares of the ceiling) are kept
groups = {}
for r in rows: groups.setdefault((name_of(r), r.get("ranks", 1), bool(r.get("independent"))), []).append(r)
rows = []
for g in groups.values():
    if any(x_of(r) is None for r in g):
        rows.append(g[0]); continue
    g = sorted(g, key=x_of)
    rep = dict(g[(len(g) - 1) // 2])
    rep["_x"] = [x_of(r) for r in g]
    rep["_of"] = sorted(r["tokens_per_s"] / ceil_r[(rnd(r), r.get("ranks", 1))] for r in g
                        if (rnd(r), r.get("ranks", 1)) in ceil_r)
    rows.append(rep)
def span(v, fmt):
    m = statistics.median(v)
    return fmt(m) + (f" ({fmt(min(v))}-{fmt(max(v))})" if len(v) > 1 else "")
xone = lambda r: span(r["_x"], lambda x: f"{x:.2f}x") if r.get("_x") else "-"
print(f"\n{nrounds} round(s): each ratio against its own round's one-rank run; with several, the median (range) "
      "over the rounds and the median round's other figures" if nrounds > 1 else "")
fb = sorted({r.get("router_force_balance", 0) for r in rows + ab})
print("\nrouting: " + " and ".join("forced balanced (model.router_force_balance, FORCE_BALANCE=1)" if f else
                                  "learned (the router's own top-k)" for f in fb))
print("\n| layout | ranks | dp x tp x ep | ZeRO | tokens/s | x one rank | of the ceiling | step ms | sent MiB/rank/step "
      "| minimum MiB | sent/min | overhead KiB | p2p / ep minimum | params+grads+optimizer MiB/rank "
      "| exposed comm ms (mean / max rank) | progress ms (mean / max rank) | ep load max/mean |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    n = r.get("ranks", 1)
    name = r["config"].split("/")[-1]
    if n == 1:
        print(f"| {name} | 1 | 1 x 1 x 1 | - | {r['tokens_per_s']:.0f} | {xone(r)} | - | {r['step_ms_median']:.0f} "
              "| 0 | 0 | - | - | - | - | 0 | 0 | - |")
        continue
    if r.get("independent"):
        print(f"| {name} | {n} | {n} independent one-rank runs | - | {r['tokens_per_s']:.0f} | {xone(r)} | 100% | "
              f"{r['step_ms_median']:.0f} | 0 | 0 | - | - | - | - | 0 | 0 | - |")
        continue
    of = span(r["_of"], lambda x: f"{100 * x:.0f}%") if r.get("_of") else "-"
    mem = (r["mem_params"] + r["mem_grads"] + r["mem_optimizer"]) / MiB
    lay = f"{r['dp'] // r['ep']} x {r['tp']} x {r['ep']}" + (f" (pp {r['pp']})" if r.get("pp", 1) > 1 else "")
    ratio = r["bytes_sent_per_step"] / r["min_bytes_per_step"] if r["min_bytes_per_step"] else float("nan")
    p2p = f"{r['sent_p2p'] / r['min_p2p']:.3f}" if r["min_p2p"] else "-"
    print(f"| {name} | {n} | {lay} | {r['zero']} | {r['tokens_per_s']:.0f} | {xone(r)} | {of} | {r['step_ms_median']:.0f} | "
          f"{r['bytes_sent_per_step'] / MiB:.2f} | {r['min_bytes_per_step'] / MiB:.2f} | {ratio:.4f} | "
          f"{r['overhead_bytes_per_step'] / KiB:.1f} | {p2p} | {mem:.0f} | "
          f"{r.get('exposed_comm_ms', float('nan')):.1f} / {r.get('exposed_comm_ms_max', float('nan')):.1f} | "
          f"{r.get('comm_progress_ms', float('nan')):.1f} / {r.get('comm_progress_ms_max', float('nan')):.1f} | "
          f"{r.get('ep_load_max_over_mean', float('nan')):.2f} |")
pipes = [r for r in rows if r.get("pp", 1) > 1 and "pp_stage_busy_ms" in r]
if pipes:  # each stage's busy and waiting time: the busiest stage bounds the step whatever the schedule
    print("\nPipeline stages, ms per step busy / waiting (the busiest stage's busy time is the step no schedule "
          "can beat; x one rank at that step):\n")
    print("| layout | schedule | step ms | stages busy / waiting ms | busiest stage | x one rank with no bubble |")
    print("|---|---|---|---|---|---|")
    for r in pipes:
        b, w = r["pp_stage_busy_ms"], r["pp_stage_wait_ms"]
        o = one_r.get(rnd(r))
        bound = f"{r['step_ms_median'] * r['tokens_per_s'] / o / max(b):.2f}x" if o else "-"
        sch = r.get("pp_schedule", "?") + (f", {r['pp_chunks']} chunks" if r.get("pp_chunks", 1) > 1 else "") \
            + (", head split" if r.get("pp_head_split") else "") \
            + (", head wgrad deferred" if r.get("pp_defer_wgrad") else "")
        print(f"| {r['config'].split('/')[-1]} | {sch} | {r['step_ms_median']:.0f} | "
              + ", ".join(f"{x:.0f} / {y:.0f}" for x, y in zip(b, w)) + f" | {b.index(max(b))} | {bound} |")
kinds = ["allreduce", "reduce_scatter", "allgather", "alltoall", "p2p"]
print("\nMiB sent per rank per step by kind, measured / minimum (+ overhead: statistics, expert row counts):\n")
print("| layout | " + " | ".join(kinds) + " | gradients | tensor-parallel | ZeRO-3 gathers | expert exchange |")
print("|---|" + "---|" * (len(kinds) + 4))
for r in rows:
    if r.get("ranks", 1) == 1 or r.get("independent"): continue
    cell = lambda k: "-" if r["sent_" + k] == 0 and r["min_" + k] == 0 else \
        f"{r['sent_' + k] / MiB:.3f} / {r['min_' + k] / MiB:.3f}" + (f" + {r['overhead_' + k] / MiB:.4f}" if r["overhead_" + k] else "")
    print(f"| {r['config'].split('/')[-1]} | " + " | ".join(cell(k) for k in kinds) +
          f" | {r['grad_min_bytes'] / MiB:.2f} | {r['tp_min_bytes'] / MiB:.2f} | {r['zero3_gather_min_bytes'] / MiB:.2f} | "
          f"{r['ep_min_bytes'] / MiB:.2f} |")
by = {r["config"].split("/")[-1]: r for r in rows}
print()
for name in by:  # the sweep's single pairs
    off = by.get(name + "-no-overlap")
    if off is None: continue
    on = by[name]
    print(f"sweep, overlap {name}: step {off['step_ms_median']:.0f} ms without, {on['step_ms_median']:.0f} ms with: "
          f"saves {off['step_ms_median'] - on['step_ms_median']:.0f} ms ({100 * (1 - on['step_ms_median'] / off['step_ms_median']):.1f}%)")
if ab:  # the alternating A/B runs
    print("\n| layout | ranks | step ms, overlap on (runs) | step ms, overlap off (runs) | median on | median off | saved |")
    print("|---|---|---|---|---|---|---|")
    names = []
    for r in ab:
        n = r["config"].split("/")[-1].replace("-no-overlap", "")
        if n not in names: names.append(n)
    for n in names:
        on = [r["step_ms_median"] for r in ab if r["config"].split("/")[-1] == n]
        off = [r["step_ms_median"] for r in ab if r["config"].split("/")[-1] == n + "-no-overlap"]
        mon, moff = statistics.median(on), statistics.median(off)
        ranks = next(r["ranks"] for r in ab if r["config"].split("/")[-1] == n)
        print(f"| {n} | {ranks} | {', '.join(f'{x:.0f}' for x in on)} | {', '.join(f'{x:.0f}' for x in off)} | "
              f"{mon:.0f} | {moff:.0f} | {moff - mon:.0f} ms ({100 * (1 - mon / moff):.1f}%) |")
PY
