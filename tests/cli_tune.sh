#!/usr/bin/env bash
# tera tune end to end (docs/TRACKING.md): bad search files get one error naming the key; a study
# of an objective command under Hyperband (best config, report, events, the study in the registry);
# a study killed with SIGKILL resumes where it was; a study of real tera train trials under ASHA
# (a trial stops exactly at its rung, a promoted one resumes from its checkpoint and its losses equal
# an uninterrupted run's, training.stop_at_step by hand, a train study killed and resumed, best.ini
# loads).
# Usage: cli_tune.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
cd "$W" || exit 1
REG="$W/reg.db"
jqe() { local in; in=$(cat "$2"); [ -n "$in" ] && jq -e "$1" <<< "$in"; } # jq -e FILTER FILE, failing on an empty file

# 1. bad input: one clear error naming the key, nothing created
bad() { # NAME SPACE_LINE WANT...
    local name=$1 line=$2
    shift 2
    printf '[study]\nname = bad\ndir = %s/bad\nregistry = %s\n[space]\n%s\n' "$W" "$REG" "$line" > bad.ini
    local out
    if out=$("$TERA" tune -c bad.ini 2>&1); then fail "$name: accepted"; return; fi
    for want in "$@"; do echo "$out" | grep -qF -- "$want" || { fail "$name: '$out' lacks '$want'"; return; }; done
    [ "$(echo "$out" | wc -l)" = 1 ] && [ ! -e "$W/bad" ] && [ ! -e "$REG" ] && pass "$name: $out" \
        || fail "$name: more than one line or files created: $out"
}
bad "unknown key" "training.lrr = loguniform 1e-4 1e-2" "training.lrr" "unknown key"
bad "empty range" "training.lr = uniform 0.01 0.001" "training.lr" "empty range"
bad "non-numeric bound" "model.aux_coef = uniform 0 lots" "model.aux_coef" "'lots' is not a number"
bad "subnormal bound" "training.lr = loguniform 1e-320 1" "training.lr" "'1e-320' is out of range"
bad "unknown distribution" "model.aux_coef = gaussian 0 1" "model.aux_coef" "unknown distribution"
bad "value the key refuses" "model.drop_policy = choice position random" "model.drop_policy" "random"
printf '[study]\nname = own\nargs = --training.stop_at_step=3\ndir = %s/own\nregistry = %s\n[space]\ntraining.lr = uniform 0.001 0.01\n' \
    "$W" "$REG" > own.ini
out=$("$TERA" tune -c own.ini 2>&1) && fail "training.stop_at_step in args accepted" \
    || { echo "$out" | grep -q "training.stop_at_step is set by tera tune" && pass "a key tera tune sets itself: $out" || fail "$out"; }
# an unknown objective placeholder, an empty study name: refused before any trial runs, nothing created
printf '[study]\nname = ph\nobjective = true {x} {bogus}\ndir = %s/ph\nregistry = %s\n[space]\nx = uniform 0 1\n' "$W" "$REG" > ph.ini
out=$("$TERA" tune -c ph.ini 2>&1) && fail "unknown placeholder accepted" \
    || { echo "$out" | grep -qF "objective: unknown placeholder {bogus}" && [ ! -e "$W/ph" ] && [ ! -e "$REG" ] \
         && pass "unknown objective placeholder: $out" || fail "unknown placeholder: $(tail -1 <<< "$out")"; }
sed -e 's/^name = ph$/name =/' ph.ini > noname.ini
out=$("$TERA" tune -c noname.ini 2>&1) && fail "empty study name accepted" \
    || { echo "$out" | grep -qF "[study] name is empty" && pass "empty study name: $out" || fail "empty name: $(tail -1 <<< "$out")"; }
out=$("$TERA" tune -c own.ini --study '' 2>&1) && fail "empty --study accepted" \
    || { echo "$out" | grep -qF -- "--study ''" && pass "empty --study: $out" || fail "empty --study: $out"; }
out=$("$TERA" tune -c "$W/none.ini" 2>&1) && fail "missing search file accepted" \
    || { echo "$out" | grep -q "none.ini" && pass "missing search file: named" || fail "$out"; }

# 2. an objective command (a quadratic whose value at `steps` carries a 1/steps fidelity error) under
# Hyperband, 3 trials at once, sampled by the GP
cat > f.sh <<'EOF'
#!/bin/sh
awk -v x="$1" -v y="$2" -v s="$3" 'BEGIN { printf "%.8f\n", (x - 0.3)^2 + (log(y) / log(10) - 0.5)^2 + 1.0 / s }'
EOF
chmod +x f.sh
cat > quad.ini <<EOF
[study]
name = quad
objective = $W/f.sh {x} {y} {steps}
sampler = gp
scheduler = hyperband
trials = 24
parallel = 3
min_steps = 1
max_steps = 27
eta = 3
seed = 5
dir = $W/quad
registry = $REG
[space]
x = uniform -1 1
y = loguniform 0.1 100
EOF
"$TERA" tune -c quad.ini > quad.json 2> quad.err || fail "tune quad: $(tail -3 quad.err)"
jqe '.trials == 24 and .failed == 0 and .complete >= 4 and .stopped >= 4 and .best_steps == 27' quad.json > /dev/null \
    && pass "hyperband study: $(jq -c '{complete, stopped, trial_steps, best_value}' quad.json)" || { fail "quad"; cat quad.json; }
best=$(jq .best_value quad.json)
min_final=$(jq -s 'map(select(.final)) | min_by(.value) | .value' quad/events.jsonl)
[ "$best" = "$min_final" ] && pass "best = the lowest full-fidelity value of events.jsonl" || fail "best $best vs $min_final"
bx=$(jq -r '.best_params.x' quad.json)
grep -q "^x = $bx$" quad/best.ini && grep -q "Best: trial $(jq .best_trial quad.json)" quad/report.md \
    && grep -q "Parameter importance" quad/report.md && pass "best.ini and report.md" || fail "best.ini/report.md"
# a stopped trial only spent its rungs' steps; full budget = sum over trials of their last rung's steps
over=$(jq -s 'group_by(.trial) | map(max_by(.steps)) | map(.steps) | add' quad/events.jsonl)
[ "$(jq .trial_steps quad.json)" = "$over" ] && [ "$over" -lt $((24 * 27)) ] \
    && pass "trial-steps $over: each trial ran to its last rung only (< 24 x 27)" || fail "trial_steps $(jq .trial_steps quad.json) vs $over"
sqlite3 "$REG" "SELECT status, budget_used FROM studies WHERE name='quad'" | grep -q "^finished|$over$" \
    && [ "$(sqlite3 "$REG" "SELECT count(*) FROM trials WHERE study='quad'")" = 24 ] \
    && pass "the study and its 24 trials are in the registry" || fail "registry study: $(sqlite3 "$REG" 'SELECT * FROM studies')"
[ "$(jq .best_value quad.json | awk '{ print ($1 < 0.3) }')" = 1 ] && pass "found a value below 0.3 (optimum 1/27 = 0.037)" \
    || fail "best value $(jq .best_value quad.json)"

# 3. killed (SIGKILL) in the middle, then resumed by the same command
sed -e 's/name = quad/name = slow/' -e "s#dir = $W/quad#dir = $W/slow#" -e 's/trials = 24/trials = 12/' \
    -e "s#objective = .*#objective = $W/slow.sh {x} {y} {steps}#" quad.ini > slow.ini
printf '#!/bin/sh\nsleep 0.3\nexec %s/f.sh "$@"\n' "$W" > slow.sh
chmod +x slow.sh
"$TERA" tune -c slow.ini > slow1.json 2> slow1.err &
tpid=$!
for _ in $(seq 1 600); do [ "$(cat slow/events.jsonl 2> /dev/null | wc -l)" -ge 5 ] && break; sleep 0.1; done
kill -KILL $tpid
wait $tpid 2> /dev/null
before=$(sqlite3 "$REG" "SELECT count(*) FROM trials WHERE study='slow'")
"$TERA" tune -c slow.ini > slow2.json 2> slow2.err || fail "resume: $(tail -3 slow2.err)"
grep -q "resuming study 'slow': $before trials so far" slow2.err && pass "the study resumed after SIGKILL with its $before trials" \
    || fail "no resume line: $(head -3 slow2.err)"
[ "$(jq .trials slow2.json)" = 12 ] && [ "$(sqlite3 "$REG" "SELECT count(DISTINCT number) FROM trials WHERE study='slow'")" = 12 ] \
    && [ "$(sqlite3 "$REG" "SELECT count(*) FROM trials WHERE study='slow' AND state IN ('running', 'pending', 'paused')")" = 0 ] \
    && pass "12 trials in all, each once, none left running" || fail "after resume: $(cat slow2.json)"
# the same file with another search space under the same name is refused
sed -e 's/x = uniform -1 1/x = uniform -2 2/' slow.ini > slow_other.ini
out=$("$TERA" tune -c slow_other.ini 2>&1) && fail "another space under a used study name accepted" \
    || { echo "$out" | grep -q "study 'slow' exists" && pass "another search file under a used name: refused" || fail "$out"; }

# 4. tera train trials under ASHA: stop, promote and resume from the checkpoint, best.ini
cat > train.ini <<EOF
[study]
name = tiny
args = --model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32 --training.micro_batch=4 --training.threads=1 --training.min_lr=1e-5 --logging.progress=false --checkpoint.keep=0
sampler = tpe
scheduler = asha
startup = 3
trials = 6
parallel = 1
min_steps = 4
max_steps = 36
eta = 3
seed = 1
dir = $W/tiny
registry = $REG
[space]
training.lr = loguniform 1e-4 3e-2
training.warmup_steps = int 0 4
model.aux_coef = uniform 0 0.05
model.init_std = choice 0.01 0.02 0.04
EOF
"$TERA" tune -c train.ini > tiny.json 2> tiny.err || fail "tune tiny: $(tail -5 tiny.err)"
# A trial trains to its rung and stops there with a checkpoint (training.stop_at_step), so the
# study is the same on every machine: each trial's steps are exactly its last rung's.
jqe '.trials == 6 and .failed == 0 and .complete >= 1 and .stopped >= 1 and .complete + .stopped == 6 and .best_steps == 36' \
    tiny.json > /dev/null && pass "ASHA study of tera train trials: $(jq -c '{complete, stopped, trial_steps, best_value}' tiny.json)" \
    || { fail "tiny"; cat tiny.json; tail -20 tiny.err; }
exact=1
while IFS='|' read -r num state d used; do
    last=$(jq -s "map(select(.trial == $num)) | max_by(.steps) | .steps" tiny/events.jsonl)
    n=$(steps_of "$d/metrics.jsonl" | wc -l)
    top=$(last_fields "$d/metrics.jsonl" step loss | tail -1 | cut -d' ' -f1)
    ck=$(ls "$d/checkpoints" | grep -c '^step_0*'"$last"'$')
    { { [ "$state" = complete ] && [ "$last" = 36 ]; } || { [ "$state" = stopped ] && [ "$last" -lt 36 ]; }; } \
        && [ "$used" = "$last" ] && [ "$n" = "$last" ] && [ "$top" = $((last - 1)) ] && [ "$ck" = 1 ] \
        || { exact=0; echo "trial $num ($state): last rung $last, steps used $used, $n step records up to step $top, checkpoint at the rung: $ck"; }
done < <(sqlite3 "$REG" "SELECT number, state, run_dir, steps_used FROM trials WHERE study='tiny' ORDER BY number")
[ $exact = 1 ] && pass "each trial trained exactly to its last rung (stopped ones at 4 or 12 steps, each step once) and saved it" \
    || fail "a trial did not stop exactly at its rung"
[ "$(jq .trial_steps tiny.json)" = "$(jq -s 'group_by(.trial) | map(max_by(.steps) | .steps) | add' tiny/events.jsonl)" ] \
    && pass "trial-steps $(jq .trial_steps tiny.json): the sum of the trials' last rungs" || fail "trial_steps $(jq .trial_steps tiny.json)"
p=$(grep "promoted to" tiny.err | head -1 | awk '{ print $4 }')
[ -z "$p" ] && p=$(sqlite3 "$REG" "SELECT number FROM trials WHERE study='tiny' AND state='complete' AND bracket=0 LIMIT 1")
pd=$(sqlite3 "$REG" "SELECT run_dir FROM trials WHERE study='tiny' AND number=$p")
# a complete trial of bracket 0 ran in 3 segments (to 4, 12 and 36 steps), each resumed from the last
[ "$(grep -c "tera: resumed .*trial_$(printf %04d "$p") at step [1-9]" "tiny/logs/trial_$(printf %04d "$p").log")" -ge 1 ] \
    && pass "trial $p was resumed from its rung's checkpoint (tera train --resume)" || fail "trial $p not resumed"
[ "$(sqlite3 "$REG" "SELECT count(*) FROM runs WHERE study='tiny' AND trial='$p'")" = 1 ] \
    && [ "$(sqlite3 "$REG" "SELECT segments FROM runs WHERE study='tiny' AND trial='$p'")" -ge 2 ] \
    && pass "the resumed trial is one run in the registry (segments >= 2)" || fail "resumed trial's registry rows"
# its losses equal one uninterrupted run of the same configuration (bit for bit, as printed)
if [ "$(sqlite3 "$REG" "SELECT state FROM trials WHERE study='tiny' AND number=$p")" = complete ]; then
    "$TERA" train -c "$pd/config.ini" --training.stop_at_step=0 --logging.run_dir="$W/ref" --logging.registry= \
        --checkpoint.every=0 2> ref.err || fail "reference run: $(tail -3 ref.err)"
    d=$(compare_steps "$pd/metrics.jsonl" "$W/ref/metrics.jsonl" 0) && pass "promoted trial $p = one uninterrupted run: $d" \
        || fail "promoted trial $p differs from an uninterrupted run: $d"
else
    fail "trial $p was promoted but is not complete"
fi
# training.stop_at_step by hand: the run stops there with a checkpoint; --resume (config.ini keeps the
# stop, the run is at it) trains on to training.steps
"$TERA" train -c "$pd/config.ini" --training.stop_at_step=3 --training.steps=6 --training.warmup_steps=0 --checkpoint.every=0 \
    --logging.run_dir="$W/hand" --logging.registry= 2> hand1.err \
    && "$TERA" train -c "$W/hand/config.ini" --resume 2> hand2.err \
    && [ "$(ls "$W/hand/checkpoints" | tr '\n' ' ')" = "step_00000003 step_00000006 " ] \
    && [ "$(steps_of "$W/hand/metrics.jsonl" | cut -d' ' -f1 | tr '\n' ' ')" = "0 1 2 3 4 5 " ] \
    && pass "stop_at_step = 3 of 6: checkpoints at 3 and 6, each step once" \
    || fail "stop_at_step by hand: $(tail -qn 1 hand1.err hand2.err | tr "\n" " "); $(ls "$W/hand/checkpoints" | tr "\n" " ")"
# a study of tera train trials killed (SIGKILL) while a trial trains, then resumed: every trial still
# ends exactly at its last rung (the killed one continues from its newest checkpoint)
sed -e 's/name = tiny/name = tiny2/' -e "s#dir = $W/tiny#dir = $W/tiny2#" -e 's/trials = 6/trials = 4/' train.ini > train2.ini
"$TERA" tune -c train2.ini > tiny2a.json 2> tiny2a.err &
tpid=$!
for _ in $(seq 1 600); do grep -q '"loss"' tiny2/trials/trial_0001/metrics.jsonl 2> /dev/null && break; sleep 0.05; done
kill -KILL $tpid
wait $tpid 2> /dev/null
sleep 0.5 # the trial ends with the tuner (PR_SET_PDEATHSIG)
"$TERA" tune -c train2.ini > tiny2.json 2> tiny2.err || fail "resume tiny2: $(tail -3 tiny2.err)"
grep -q "resuming study 'tiny2'" tiny2.err && jqe '.trials == 4 and .failed == 0 and .complete + .stopped == 4' tiny2.json > /dev/null \
    && pass "train study resumed after SIGKILL ($(grep -o '[0-9]* interrupted' tiny2.err)): $(jq -c '{complete, stopped, trial_steps}' tiny2.json)" \
    || fail "tiny2: $(cat tiny2.json)"
exact=1
while IFS='|' read -r num d; do
    last=$(jq -s "map(select(.trial == $num)) | max_by(.steps) | .steps" tiny2/events.jsonl)
    top=$(last_fields "$d/metrics.jsonl" step loss | tail -1 | cut -d' ' -f1)
    [ "$(last_fields "$d/metrics.jsonl" step loss | wc -l)" = "$last" ] && [ "$top" = $((last - 1)) ] \
        || { exact=0; echo "trial $num: last rung $last, last step $top"; }
done < <(sqlite3 "$REG" "SELECT number, run_dir FROM trials WHERE study='tiny2' ORDER BY number")
[ $exact = 1 ] && pass "after the resume each trial ended exactly at its last rung" || fail "tiny2: a trial ran past its rung"
"$TERA" config -c tiny/best.ini > best_resolved.ini 2> cfg.err && pass "best.ini is a loadable tera config" \
    || fail "best.ini: $(cat cfg.err)"
blr=$(jq -r '.best_params["training.lr"]' tiny.json)
grep -q "^lr = $blr$" tiny/best.ini && grep -q "^steps = 36$" tiny/best.ini && pass "best.ini has the best lr ($blr) and max_steps" \
    || fail "best.ini lr/steps: $(grep -E '^(lr|steps) =' tiny/best.ini)"
finish cli_tune
