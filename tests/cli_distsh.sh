#!/usr/bin/env bash
# bench/dist.sh, the two-rank scaling benchmark, end to end on a tiny model (CONFIG): two rounds
# (ROUNDS=2) of one rank, dp2, pp2 (1F1B), pp2-i2 (interleaved over 2 chunks, the head's weight gradients
# deferred) and the ceiling of two
# independent one-rank runs, one step each.
#   - every run's JSON line is kept, tagged with its round; the second round runs the layouts in the
#     reverse order (the machine's drift hits both ends alike);
#   - the table's "x one rank" of dp2 and pp2 is the median over the rounds of each round's tokens/s
#     over that round's one-rank tokens/s, with the range (recomputed here from the JSON lines by
#     field name), the ceiling row likewise; the pipeline table has the pp2 and pp2-i2 rows, each
#     with the schedule its JSON line says it ran (pp_schedule, pp_chunks);
#   - LAYOUTS may name a layout of the script's list bare ("one", "pp2") or spell out its fields; a
#     four-rank known layout, pp2xtp2-hs (pp2 x tp2 with the head split), runs and is in the pipeline table;
#   - ROUNDS that is not a positive integer, an unknown layout name and a malformed layout are
#     refused before the results file is touched, and a run whose tera fails keeps it;
#   - bench/plan_validate.sh's predict phase passes the pipeline fields to `tera plan` and compares by name;
#     its bad input is refused before anything runs, and a failing phase keeps the earlier files.
# A renamed field of `tera bench` or a broken summary fails here, not in a benchmark session.
# Usage: cli_distsh.sh TERA SOURCE_DIR
set -u
TERA=$(realpath "$1")
SRC=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" # Open MPI's own allocations (see cli_dist.sh)
command -v mpirun > /dev/null || { echo "skip: mpirun not installed"; exit 0; }
command -v jq > /dev/null || { echo "skip: jq not installed"; exit 0; }
. "$(dirname "$0")/testlib.sh"

cat > "$W/tiny.ini" <<'EOF'
[model]
vocab_size = 256
dim = 32
n_layers = 4
n_heads = 4
n_experts = 4
top_k = 2
ffn_dim = 32
max_seq_len = 32

[training]
seq_len = 32
micro_batch = 16
threads = 1
warmup_steps = 0

[logging]
run_dir = ""
progress = false
EOF
(cd "$SRC" && CONFIG="$W/tiny.ini" ROUNDS=2 FORCE_BALANCE=1 AB_LAYOUTS="" CEILING=2 OUT="$W/dist.jsonl" \
    OUT_AB="$W/ab.jsonl" LAYOUTS="one dp2:2:1:1:0:1 pp2 pp2-i2:1:1:1:0:1:2:0:2:0:1" \
    bash bench/dist.sh "$TERA" 1 0) > "$W/out.txt" 2>&1
rc=$?
[ "$rc" = 0 ] && pass "bench/dist.sh ran (exit 0)" || { fail "bench/dist.sh exit $rc"; tail -20 "$W/out.txt"; }

# the JSON lines: name round, in the order run
jq -r '(.config | split("/") | last) + " " + (.round | tostring)' "$W/dist.jsonl" > "$W/order.txt" 2> /dev/null
if [ "$(tr '\n' ' ' < "$W/order.txt")" = "one 1 dp2 1 pp2 1 pp2-i2 1 ceiling2 1 pp2-i2 2 pp2 2 dp2 2 one 2 ceiling2 2 " ]; then
    pass "10 runs, tagged by round, the second round in reverse order"
else
    fail "runs and rounds: $(tr '\n' ' ' < "$W/order.txt")"
fi

# the pipelines' schedules as run: pp2 by 1F1B, pp2-i2 (a chunks field of 2) interleaved over 2 chunks, with
# the head's weight gradients deferred (a last field of 1: the step's 4 micro-batches)
sch=$(jq -r 'select(.pp == 2) | (.config | split("/") | last) + " " + .pp_schedule + " " + (.pp_chunks | tostring)
             + " " + (.pp_defer_wgrad | tostring)' "$W/dist.jsonl" 2> /dev/null | sort -u | tr '\n' ' ')
[ "$sch" = "pp2 1f1b 1 0 pp2-i2 interleaved 2 4 " ] && pass "pipeline schedules run: $sch" || fail "pipeline schedules: '$sch'"
# x one rank: the median of the per-round ratios, and their range, as the table prints them
expect() { # name: "M.MMx (L.LLx-H.HHx)" from the JSON lines
    jq -s -r --arg n "$1" '
        (map(select((.config | split("/") | last) == "one")) | map({key: (.round | tostring), value: .tokens_per_s}) | from_entries) as $one
        | [.[] | select((.config | split("/") | last) == $n) | .tokens_per_s / $one[.round | tostring]] | sort
        | "\((.[0] + .[1]) / 2) \(.[0]) \(.[1])"' "$W/dist.jsonl" |
        awk '{ printf "%.2fx (%.2fx-%.2fx)", $1, $2, $3 }'
}
for n in dp2 pp2 pp2-i2 ceiling2; do
    want=$(expect "$n")
    got=$(grep "^| $n |" "$W/out.txt" | head -1 | awk -F' [|] ' '{ print $6 }')
    if [ -n "$want" ] && [ "$got" = "$want" ]; then
        pass "$n: x one rank $got (the median of the rounds' ratios, with their range)"
    else
        fail "$n: x one rank '$got', expected '$want'"
    fi
done
grep -q "^2 round(s): each ratio against its own round's one-rank run" "$W/out.txt" &&
    pass "the table says how its ratios were taken" || fail "no rounds line"
if grep -A5 "^Pipeline stages" "$W/out.txt" | grep -q "^| pp2 | 1f1b | " &&
    grep -A5 "^Pipeline stages" "$W/out.txt" | grep -q "^| pp2-i2 | interleaved, 2 chunks, head wgrad deferred | "; then
    pass "the pipeline table has pp2 and pp2-i2, with their schedules"
else
    fail "the pipeline table: $(grep -A5 "^Pipeline stages" "$W/out.txt" | tr '\n' ' ')"
fi
# a four-rank layout of the known names: pp2 x tp2 with the head split (each tp rank's slice halved)
(cd "$SRC" && CONFIG="$W/tiny.ini" AB_LAYOUTS="" CEILING="" OUT="$W/tp.jsonl" OUT_AB="$W/ab.jsonl" LAYOUTS="pp2xtp2-hs" \
    bash bench/dist.sh "$TERA" 1 0) > "$W/tp.txt" 2>&1
if jq -e 'select(.tp == 2 and .pp == 2 and .pp_head_split == 1)' "$W/tp.jsonl" > /dev/null 2>&1 &&
    grep -A5 "^Pipeline stages" "$W/tp.txt" | grep -q "^| pp2xtp2-hs | 1f1b, head split | "; then
    pass "pp2xtp2-hs ran: tp 2, pp 2, the head split, in the pipeline table"
else
    fail "pp2xtp2-hs: $(tail -3 "$W/tp.txt" | tr '\n' ' ' | head -c 300)"
fi
# a bad ROUNDS: refused before anything runs, the results file of an earlier run kept
cp "$W/dist.jsonl" "$W/kept.jsonl"
(cd "$SRC" && ROUNDS=two OUT="$W/kept.jsonl" OUT_AB="$W/ab.jsonl" bash bench/dist.sh "$TERA" 1 0) > "$W/bad.txt" 2>&1
rc=$?
if [ "$rc" = 2 ] && grep -q "ROUNDS='two' is not a positive integer" "$W/bad.txt" && cmp -s "$W/dist.jsonl" "$W/kept.jsonl"; then
    pass "ROUNDS=two refused (exit 2, one message), the earlier results kept"
else
    fail "ROUNDS=two: exit $rc, $(head -c 200 "$W/bad.txt")"
fi
# an unknown name and a malformed entry: refused the same way, naming the entry
for bad in "one dp3" "one dp2:2:0:1:0:1" "one pp0:1:1:1:0:1:0" "one pp2-i0:1:1:1:0:1:2:0:0" "one pp2-dw2:1:1:1:0:1:2:0:1:0:2"; do
    (cd "$SRC" && LAYOUTS="$bad" OUT="$W/kept.jsonl" OUT_AB="$W/ab.jsonl" bash bench/dist.sh "$TERA" 1 0) > "$W/bad.txt" 2>&1
    rc=$?
    entry=${bad#one }
    if [ "$rc" = 2 ] && [ "$(wc -l < "$W/bad.txt")" = 1 ] && grep -q "layout '$entry'" "$W/bad.txt" &&
        cmp -s "$W/dist.jsonl" "$W/kept.jsonl"; then
        pass "LAYOUTS='$bad' refused (exit 2, one message naming '$entry'), the earlier results kept"
    else
        fail "LAYOUTS='$bad': exit $rc, $(head -c 300 "$W/bad.txt")"
    fi
done
# bench/plan_validate.sh's predict phase: the pipeline fields of a layout (chunks, head split,
# deferral) reach `tera plan`, and its table compares by case name with a measured file's lines
printf '%s\n' '{"config": "bench-dist/pp2", "step_ms_median": 800.0}' \
    '{"config": "bench-dist/pp2-i4-hs-dw", "step_ms_median": 700.0}' > "$W/pv-measured.jsonl"
(cd "$SRC" && HW=hardware/this-machine.ini MEASURED="$W/pv-measured.jsonl" PREDICTED="$W/pv-predicted.jsonl" \
    PHASES=predict LAYOUTS="pp2:1:1:1:0:2 pp2-i4-hs-dw:1:1:1:0:2:0:4:1:1" bash bench/plan_validate.sh "$TERA") \
    > "$W/pv.txt" 2>&1
rc=$?
pv() { jq -r --arg n "$1" "select(.name == \$n) | $2" "$W/pv-predicted.jsonl" 2> /dev/null; }
p1=$(pv bench-dist/pp2 .time.step_s)
p2=$(pv bench-dist/pp2-i4-hs-dw .time.step_s)
if [ "$rc" = 0 ] && [ -n "$p1" ] && [ -n "$p2" ] && [ "$(pv bench-dist/pp2-i4-hs-dw .ranks)" = 2 ] &&
    awk -v a="$p1" -v b="$p2" 'BEGIN { exit !(b < 0.95 * a) }' &&
    grep -q '^| bench-dist/pp2 | 2 | 800 | 800 | ' "$W/pv.txt" && grep -q '^| bench-dist/pp2-i4-hs-dw | 2 | 700 | 700 | ' "$W/pv.txt" &&
    grep -q '^median absolute error .* over 2 cases' "$W/pv.txt"; then
    pass "plan_validate.sh predict: pp2-i4-hs-dw priced as interleaved with the split and the deferral ($p2 s against pp2's $p1 s), both rows against the measured file"
else
    fail "plan_validate.sh predict: exit $rc, pp2 '$p1' s, pp2-i4-hs-dw '$p2' s: $(tail -4 "$W/pv.txt" | tr '\n' ' ' | head -c 300)"
fi
# a tera that fails every run: exit 1, the message, the earlier results kept, no partial file left
(cd "$SRC" && LAYOUTS="one dp2" CEILING="" AB_LAYOUTS="" OUT="$W/kept.jsonl" OUT_AB="$W/ab.jsonl" bash bench/dist.sh /bin/false 1 0) > "$W/bad.txt" 2>&1
rc=$?
if [ "$rc" = 1 ] && grep -q "no run gave a result" "$W/bad.txt" && cmp -s "$W/dist.jsonl" "$W/kept.jsonl" &&
    [ -z "$(ls "$W" | grep partial)" ]; then
    pass "dist.sh with a failing tera: exit 1, the earlier results kept"
else
    fail "dist.sh with a failing tera: exit $rc, $(head -c 300 "$W/bad.txt")"
fi
# plan_validate.sh's bad input and failures: a malformed layout, an unknown phase or a bad count is
# refused before anything runs (exit 2, one message); a calibration, measurement or prediction that
# fails leaves the earlier hardware file, measured and predicted lines as they were
cp "$SRC/hardware/this-machine.ini" "$W/pv-hw.ini"
cp "$W/pv-hw.ini" "$W/pv-hw0.ini"
cp "$W/pv-measured.jsonl" "$W/pv-measured0.jsonl"
cp "$W/pv-predicted.jsonl" "$W/pv-predicted0.jsonl"
pv_kept() { cmp -s "$W/pv-hw.ini" "$W/pv-hw0.ini" && cmp -s "$W/pv-measured.jsonl" "$W/pv-measured0.jsonl" &&
    cmp -s "$W/pv-predicted.jsonl" "$W/pv-predicted0.jsonl"; }
for bad in "LAYOUTS=one|malformed layout 'one'" "LAYOUTS=dp3:3:1:1:0:1|malformed layout 'dp3:3:1:1:0:1'" \
           "LAYOUTS=pp2-hs2:1:1:1:0:2:0:1:2|malformed layout 'pp2-hs2" "PHASES=calibrte|unknown phase 'calibrte'" \
           "REPS=two|REPS='two' is not"; do
    (cd "$SRC" && env "${bad%%|*}" HW="$W/pv-hw.ini" MEASURED="$W/pv-measured.jsonl" PREDICTED="$W/pv-predicted.jsonl" \
        bash bench/plan_validate.sh "$TERA") > "$W/bad.txt" 2>&1
    rc=$?
    if [ "$rc" = 2 ] && [ "$(wc -l < "$W/bad.txt")" = 1 ] && grep -qF "${bad#*|}" "$W/bad.txt" && pv_kept; then
        pass "plan_validate.sh ${bad%%|*} refused (exit 2, one message), the files kept"
    else
        fail "plan_validate.sh ${bad%%|*}: exit $rc, $(head -c 300 "$W/bad.txt")"
    fi
done
for ph in calibrate shared measure predict; do
    (cd "$SRC" && LAYOUTS="one:1:1:1:0:1" REPS=1 BENCH_M_REPS=0 PHASES=$ph HW="$W/pv-hw.ini" MEASURED="$W/pv-measured.jsonl" \
        PREDICTED="$W/pv-predicted.jsonl" bash bench/plan_validate.sh /bin/false) > "$W/bad.txt" 2>&1
    rc=$?
    if [ "$rc" != 0 ] && pv_kept && [ -z "$(ls "$W" | grep partial)" ]; then
        pass "plan_validate.sh PHASES=$ph with a failing tera: exit $rc, the earlier files kept, no partial file left"
    else
        fail "plan_validate.sh PHASES=$ph with a failing tera: exit $rc, files kept: $(pv_kept && echo yes || echo no), $(ls "$W" | grep partial)"
    fi
done
finish cli_distsh
