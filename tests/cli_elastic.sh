#!/usr/bin/env bash
# Elastic training: `tera launch` on three hosts of two ranks each, made of network namespaces (tests/netns.sh:
# Open MPI over TCP between them, an rsh agent that enters a namespace). Faults: every rank of one host killed,
# one rank stopped (SIGSTOP), one host's link taken down and brought back, after which it is re-admitted. Each
# time the supervisor detects it, replans to the hosts left (dp 6 -> 4, accumulation 2 -> 3: the same global
# batch), resumes from the newest checkpoint and the run finishes; no committed step is lost or repeated and the
# final validation loss is within 1% of a fault-free run. Recovery times (detection to the first resumed step)
# are printed. Skips (with a message) where namespaces cannot be made.
# Usage: cli_elastic.sh TERA SOURCE_DIR
set -u
TERA=$(readlink -f "$1")
SRC=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
command -v mpirun > /dev/null || { echo "skip: mpirun not installed"; exit 0; }
command -v jq > /dev/null || { echo "skip: jq not installed"; exit 0; }
. "$(dirname "$0")/testlib.sh"
. "$(dirname "$0")/netns.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
ONE=(train --model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32
     --training.micro_batch=4 --training.warmup_steps=2 --training.threads=1 --data.path="$W/c.txt" --logging.progress=false)

# --- checkpoint.every_s / full_every_s: saves by rank 0's wall clock, differential unless the full clock ran out
# (1000 steps: the check needs two full saves, 0.15 s apart; 400 steps of this model ran in 0.3 s on a
# fast CPU, which left room for one). The gaps are read from the step records' elapsed_s, stamped a
# little before rank 0 looks at its clock, and that little varies by a few ms (logging, the data):
# 10 ms of tolerance, against saves that would come every step (< 1 ms apart) if the clock were ignored.
"$TERA" "${ONE[@]}" --training.steps=1000 --checkpoint.every_s=0.04 --checkpoint.full_every_s=0.15 --checkpoint.full_every=1000000 \
    --checkpoint.keep=0 --logging.run_dir="$W/cad" > "$W/cad.log" 2>&1 || { fail "wall-clock cadence run"; tail -5 "$W/cad.log"; }
# step, kind, elapsed_s of the step record before each intermediate save; a differential save comes >= every_s
# after the one before, a full one >= full_every_s after the full one before (its clock runs on its own)
for d in "$W/cad/checkpoints/step_"*; do
    k=$(jq -r .kind "$d/manifest.json"); st=$(jq -r .step "$d/manifest.json")
    [ "$st" -lt 1000 ] && echo "$st $k $(fields "$W/cad/metrics.jsonl" step elapsed_s | awk -v s=$((st - 1)) '$1 == s { print $2 }')"
done > "$W/cad.saves"
awk '{ n++; if ($2 == "diff") d++; else f++
       if (n > 1 && $2 == "diff" && $3 - pe < 0.04 - 0.01) { print "saves " ps " and " $1 " only " $3 - pe " s apart"; bad = 1 }
       if ($2 == "full" && n > 1 && $3 - pf < 0.15 - 0.01) { print "full saves " psf " and " $1 " only " $3 - pf " s apart"; bad = 1 }
       if ($2 == "full") { pf = $3; psf = $1 }
       pe = $3; ps = $1 }
     END { printf "%d wall-clock saves (%d full, %d differential)\n", n, f, d; exit bad || n < 3 || d < 1 || f < 2 }' "$W/cad.saves" \
    && pass "every_s: saves >= 0.04 s apart, differential, and full ones >= 0.15 s apart (10 ms tolerance) ($(awk '{ printf "%s%s:%s", (NR > 1 ? " " : ""), $1, $2 }' "$W/cad.saves"))" \
    || { fail "wall-clock cadence"; cat "$W/cad.saves"; }
# (600 steps: 200 ran in under 0.1 s on a fast CPU with the shared-memory sums, leaving only the final save)
mpirun --oversubscribe -np 2 "$TERA" "${ONE[@]}" --parallel.dp=2 --training.steps=600 --checkpoint.every_s=0.1 --checkpoint.keep=0 \
    --logging.run_dir="$W/cad2" > "$W/cad2.log" 2>&1 && [ "$(ls -d "$W/cad2/checkpoints/step_"* | wc -l)" -ge 2 ] \
    && pass "every_s on 2 ranks: rank 0's clock decides for both ($(ls "$W/cad2/checkpoints" | grep -c step_) checkpoints)" \
    || { fail "every_s on 2 ranks"; tail -5 "$W/cad2.log"; }

# --- training.nan_rollback_after: 3 non-finite steps in a row (the fault hook, transient) roll back and lower the LR
NAN=(--training.steps=40 --checkpoint.every=10 --checkpoint.keep=0 --training.nan_rollback_after=3 --training.spike_lr_steps=5)
TERA_FAULT_NAN_STEP=25:3 "$TERA" "${ONE[@]}" "${NAN[@]}" --logging.run_dir="$W/nan" > "$W/nan.log" 2>&1 || { fail "nan run"; tail -5 "$W/nan.log"; }
e=$(grep '"nan_rollback"' "$W/nan/metrics.jsonl")
[ "$(echo "$e" | grep -c .)" = 1 ] && echo "$e" | jq -e '.step == 25 and .rolled_back_to == 20 and .skipped_samples == [100, 112]
    and .lr_cut_until == 30' > /dev/null && pass "3 non-finite steps 25-27: rolled back to step 20, samples [100, 112) skipped: $e" \
    || fail "nan rollback event: $e"
lr_of() { last_fields "$1" step lr | awk -v s="$2" '$1 == s { print $2 }'; }
"$TERA" "${ONE[@]}" "${NAN[@]}" --logging.run_dir="$W/nanref" > /dev/null 2>&1
awk -v a="$(lr_of "$W/nanref/metrics.jsonl" 29)" -v b="$(lr_of "$W/nan/metrics.jsonl" 29)" -v c="$(lr_of "$W/nanref/metrics.jsonl" 30)" \
    -v d="$(lr_of "$W/nan/metrics.jsonl" 30)" 'BEGIN { exit !(a > 0 && (b - 0.5 * a) ^ 2 < (1e-4 * a) ^ 2 && c == d) }' \
    && [ "$(last_fields "$W/nan/metrics.jsonl" step | wc -l)" = 40 ] && grep -q "3 consecutive non-finite steps" "$W/nan.log" \
    && pass "LR x 0.5 until step 30 (spike_lr_factor), full LR after, all 40 steps done" || fail "nan rollback LR cut / completion"
TERA_FAULT_NAN_STEP=25 "$TERA" "${ONE[@]}" "${NAN[@]}" --logging.run_dir="$W/nan1" > /dev/null 2>&1 \
    && ! grep -q nan_rollback "$W/nan1/metrics.jsonl" && [ "$(fields "$W/nan1/metrics.jsonl" skipped | grep -c '^1$')" = 1 ] \
    && pass "a single non-finite step is only skipped" || fail "single non-finite step"
TERA_FAULT_NAN_STEP=25:2 "$TERA" "${ONE[@]}" "${NAN[@]}" --logging.run_dir="$W/nan2" > /dev/null 2>&1 \
    && ! grep -q nan_rollback "$W/nan2/metrics.jsonl" && pass "2 non-finite steps (< 3): skipped, no rollback" || fail "2 non-finite steps"
TERA_FAULT_NAN_STEP=25:3@1 mpirun --oversubscribe -np 2 "$TERA" "${ONE[@]}" "${NAN[@]}" --parallel.dp=2 --logging.run_dir="$W/nanmp" \
    > "$W/nanmp.log" 2>&1 && grep '"nan_rollback"' "$W/nanmp/metrics.jsonl" | jq -e '.rolled_back_to == 20' > /dev/null \
    && pass "2 ranks, NaN on rank 1 only: both roll back together" || { fail "nan rollback on 2 ranks"; tail -5 "$W/nanmp.log"; }

# --- tera sim-failures: no failures = the save overhead exactly; Llama 3's rate at 16k devices with tera's costs
"$TERA" sim-failures --failures 0 --every-s 99 --save-pause 1 --json | jq -e '.effective_at_every > 0.98999 and .effective_at_every < 0.99001' \
    > /dev/null && pass "sim-failures without failures: 99 s of training per 1 s pause = 99%" || fail "sim-failures without failures"
j=$("$TERA" sim-failures --json)
echo "$j" | jq -e '.meets_goal and .effective_recommended >= 0.9 and .devices == 16384 and (.mtbf_s - 11135 | fabs) < 1' > /dev/null \
    && pass "sim-failures at 16,384 devices: $(echo "$j" | jq -c '{mtbf_s, daly_s, recommended_every_s, effective_recommended}')" \
    || fail "sim-failures default: $j"
j=$("$TERA" sim-failures --save-pause 30 --detect 60 --recovery 600 --json)
echo "$j" | jq -e '(.effective_at_daly - .model_at_daly | fabs) < 0.01 and (.young_s - (2 * 30 * .mtbf_s | sqrt) | fabs) < 1' > /dev/null \
    && pass "simulation within 1% of the first-order model at Daly's cadence: $(echo "$j" | jq -c '{daly_s, effective_at_daly, model_at_daly}')" \
    || fail "sim-failures vs model: $j"

# --- the multi-host rig
if ! netns_up 3; then
    echo "skip: cannot create network namespaces here ($NETNS_WHY): the multi-host tests did not run"
    finish cli_elastic
    exit
fi
trap 'netns_down; rm -rf "$W"' EXIT
S=40
TRAIN=(train --model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32
       --training.seq_len=32 --training.micro_batch=2 --training.grad_accum=2 --parallel.dp=6 --parallel.ep=2
       --training.steps=$S --training.warmup_steps=2 --training.threads=1 --data.path="$W/c.txt" --data.val_fraction=0.1
       --checkpoint.every=10 --logging.log_every=20)
LAUNCH=(--hosts "$NETNS_HOSTS" --rsh-agent "$NETNS_AGENT" --mpi-args "$NETNS_MPI_ARGS" --hang-timeout 3
        --hang-factor 4 --teardown-timeout 5 --probe-timeout 5 --max-restarts 3)
# launch NAME [launch options]: tera launch in the hub namespace (the login node), in the background
launch() {
    local name=$1
    shift
    netns_hub "$TERA" launch "${LAUNCH[@]}" "$@" -- "$TERA" "${TRAIN[@]}" --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1 &
    LPID=$!
}
# finish_launch NAME: waits for it (at most 240 s); fails the run when it did not finish
finish_launch() {
    local t=0
    while kill -0 "$LPID" 2> /dev/null && [ $t -lt 2400 ]; do sleep 0.1; t=$((t + 1)); done
    kill -0 "$LPID" 2> /dev/null && { kill "$LPID"; fail "$1: tera launch still running after 240 s"; }
    wait "$LPID"
}
# wait_step RUN ATTEMPT STEP: until world rank 0 of that attempt has completed STEP steps (at most 120 s)
wait_step() {
    local f="$W/$1/elastic/heartbeat-$2/rank-0" t=0 s
    while [ $t -lt 1200 ]; do
        s=$(head -c 127 "$f" 2> /dev/null | awk '{ print $6 }')
        [ -n "$s" ] && [ "$s" -ge "$3" ] && return 0
        sleep 0.1
        t=$((t + 1))
    done
    return 1
}
ev() { jq -c "select(.event == \"$2\")" "$W/$1/elastic/events.jsonl"; }
now() { date +%s.%N; }
val_loss() { "$TERA" eval --from "$W/$1/checkpoints/step_000000$S" --data.path="$W/c.txt" --data.val_fraction=0.1 \
    --training.seq_len=32 --training.micro_batch=8 --training.eval_batches=8 2> /dev/null | jq -r .val_loss; }
# metrics_ok RUN: every step 0 .. S-1 has a record; each resume (a step lower than the one before) goes back to a
# committed checkpoint's step; the steps before the earliest resume point appear once
metrics_ok() {
    local m="$W/$1/metrics.jsonl"
    fields "$m" step | awk -v S=$S -v ck="$(ev "$1" launch | jq -r 'select(.resume) | .from_step' | tr '\n' ' ')" '
        BEGIN { n = split(ck, c, " "); for (i = 1; i <= n; i++) okc[c[i]] = 1 }
        { if (NR > 1 && $1 <= prev) { if (!($1 in okc)) { print "resumed at step " $1 ", not a checkpoint step"; bad = 1 }
                                      if (low == "" || $1 < low) low = $1 }
          cnt[$1]++; prev = $1 }
        END { for (s = 0; s < S; s++) if (!(s in cnt)) { print "step " s " missing"; bad = 1 }
              for (s = 0; s < (low == "" ? S : low); s++) if (cnt[s] != 1) { print "committed step " s " logged " cnt[s] " times"; bad = 1 }
              exit bad }'
}

# fault-free reference: the same layout (dp 6 x accumulation 2) on this machine, without the supervisor
mpirun --oversubscribe -np 6 "$TERA" "${TRAIN[@]}" --logging.run_dir="$W/ref" > "$W/ref.log" 2>&1 \
    && pass "fault-free run: dp 6 x accumulation 2" || { fail "fault-free run"; tail -20 "$W/ref.log"; }
ref_loss=$(val_loss ref)

# 1. every rank of h3 killed mid-run (fallback layouts given: the first that fits 4 ranks re-splits the experts)
launch kill --layouts "dp=4,ep=4;dp=2"
if wait_step kill 0 15; then
    t_kill=$(now)
    netns_kill_host h3 KILL
else
    fail "kill run: step 15 not reached"
fi
finish_launch kill || { fail "kill run exit status"; tail -30 "$W/kill.log"; }
f=$(ev kill failure | head -1)
r=$(ev kill replan | head -1)
echo "$f" | jq -e '.kind == "exit" and .hosts == ["h3"]' > /dev/null && pass "killed host detected: ${f:0:200}" || fail "failure event: $f"
echo "$r" | jq -e '.np == 4 and .dp == 4 and .ep == 4 and .grad_accum == 3 and .excluded == ["h3"] and .why == "--layouts entry"' \
    > /dev/null && pass "replanned to 2 hosts by --layouts: dp 4 x ep 4 x accumulation 3 (the same global batch)" || fail "replan: $r"
ev kill launch | tail -1 | jq -e '.resume and .hosts == ["h1", "h2"]' > /dev/null && pass "relaunched on h1, h2 with --resume" \
    || fail "relaunch: $(ev kill launch | tail -1 | cut -c1-300)"
ev kill finished | jq -e '.restarts == 1' > /dev/null && pass "run finished after one restart" || fail "finish: $(tail -3 "$W/kill.log")"
metrics_ok kill && pass "metrics: every step present, resumed at the checkpoint's step, no committed step repeated" || fail "metrics of the kill run"
kill_loss=$(val_loss kill)
within "$ref_loss" "$kill_loss" 0.01 && pass "final validation loss $kill_loss within 1% of the fault-free run's $ref_loss" \
    || fail "validation loss $kill_loss vs $ref_loss"
det1=$(awk -v a="$(echo "$f" | jq .wall)" -v b="${t_kill:-0}" 'BEGIN { printf "%.2f", a - b }')
rec1=$(ev kill recovered | jq .recovery_s)
echo "kill: detection $det1 s after the kill; recovery (detection to first resumed step) $rec1 s; restore $(ev kill recovered | jq .restore_s) s"
awk -v r="$rec1" 'BEGIN { exit !(r > 0 && r <= 60) }' && pass "recovery within 60 s ($rec1 s)" || fail "recovery time $rec1"

# 2. one rank of h2 stopped (SIGSTOP): hung, detected within the timeout
launch stop
if wait_step stop 0 15; then
    victim=$(for p in $(netns_pids h2); do [ "$(cat /proc/$p/comm 2> /dev/null)" = tera ] && echo "$p"; done | head -1)
    t_stop=$(now)
    kill -STOP "$victim"
else
    fail "stop run: step 15 not reached"
fi
finish_launch stop || { fail "stop run exit status"; tail -30 "$W/stop.log"; }
f=$(ev stop failure | head -1)
echo "$f" | jq -e '.kind == "hang" and .hosts == ["h2"] and (.ranks | length) == 1' > /dev/null \
    && pass "stopped rank detected as hung on h2: ${f:0:220}" || fail "hang event: $f"
det2=$(awk -v a="$(echo "$f" | jq .wall)" -v b="${t_stop:-0}" 'BEGIN { printf "%.2f", a - b }')
lim=$(echo "$f" | jq -r .detail | sed 's/.*limit \([0-9.]*\) s.*/\1/')
awk -v d="$det2" -v l="$lim" 'BEGIN { exit !(d > 0 && d <= l + 3) }' && pass "hang detected $det2 s after SIGSTOP (timeout $lim s)" \
    || fail "hang detection took $det2 s (timeout $lim s)"
ev stop replan | head -1 | jq -e '.np == 4 and .dp == 4 and .ep == 2 and .grad_accum == 3 and .excluded == ["h2"]' > /dev/null && ev stop finished | jq -e '.restarts == 1' > /dev/null \
    && metrics_ok stop && pass "recovered on h1, h3 and finished ($(ev stop recovered | jq .recovery_s) s recovery)" \
    || fail "stop run recovery: $(ev stop replan | cut -c1-200)"
kill -CONT "$victim" 2> /dev/null

# 3. h3's link down (hung, unreachable: excluded), back up, then h2's ranks killed: h3 is re-admitted
launch link
if wait_step link 0 12; then
    t_down=$(now)
    netns_link h3 down
else
    fail "link run: step 12 not reached"
fi
if wait_step link 1 25; then
    netns_link h3 up
    netns_kill_host h2 KILL
else
    fail "link run: attempt 1 did not reach step 25"
fi
finish_launch link || { fail "link run exit status"; tail -30 "$W/link.log"; }
f=$(ev link failure | head -1)
echo "$f" | jq -e '.kind == "hang"' > /dev/null && ev link probe | head -3 | jq -e 'select(.host == "h3") | .reachable == false' > /dev/null \
    && ev link replan | head -1 | jq -e '.excluded == ["h3"] and .np == 4' > /dev/null \
    && pass "link down: hang detected $(awk -v a="$(echo "$f" | jq .wall)" -v b="${t_down:-0}" 'BEGIN { printf "%.2f", a - b }') s after, h3 unreachable and excluded" \
    || fail "link down: $f / $(ev link replan | head -1)"
ev link replan | sed -n 2p | jq -e '.readmitted == ["h3"] and .excluded == ["h2"] and .np == 4' > /dev/null \
    && ev link launch | tail -1 | jq -e '.hosts == ["h1", "h3"]' > /dev/null \
    && pass "h3 back: re-admitted at the next restart (after h2 failed), run on h1, h3" || fail "re-admission: $(ev link replan | sed -n 2p)"
ev link finished | jq -e '.restarts == 2' > /dev/null && metrics_ok link && pass "link run finished after two restarts" \
    || fail "link run: $(tail -3 "$W/link.log")"
link_loss=$(val_loss link)
within "$ref_loss" "$link_loss" 0.01 && pass "link run's validation loss $link_loss within 1% of $ref_loss" || fail "link run loss $link_loss vs $ref_loss"
echo "recovery times (s): kill $rec1, stop $(ev stop recovered | jq .recovery_s), link $(ev link recovered | jq -s -c 'map(.recovery_s)')"
finish cli_elastic
