#!/usr/bin/env bash
# The run registry end to end (logging.registry, tera runs; docs/TRACKING.md): runs register
# themselves (also several at once), ls filters, show, compare with a plot, rm, statuses failed /
# killed (SIGTERM, and SIGKILL found by its stopped heartbeat), --resume continues the run's row,
# dataset fingerprints, the git commit, and logging.registry = "" writes nothing.
# Usage: cli_runs.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"

TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32
      --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=2 --training.threads=1
      --logging.progress=false)
REG="$W/reg/registry.db"
cd "$W" || exit 1
head -c 40000 "$SRC/data/default_corpus.txt" > corpus.txt
head -c 30000 "$SRC/data/default_corpus.txt" > corpus2.txt
runs() { "$TERA" runs "$@" --registry "$REG"; }
id_of() { runs ls --json --where "run_dir=$W/$1" | jq -r .id; }
# jq -e that fails on empty input too
jqe() { local in; in=$(cat); [ -n "$in" ] && jq -e "$@" <<< "$in"; }

# 1. two runs one after the other, three at once
"$TERA" train "${TINY[@]}" --training.steps=12 --data.path=corpus.txt --logging.run_dir="$W/a" \
    --logging.registry="$REG" --checkpoint.every=6 2> a.log || fail "train a: $(tail -3 a.log)"
"$TERA" train "${TINY[@]}" --training.steps=12 --data.path=corpus.txt --training.lr=2e-3 --logging.run_dir="$W/b" \
    --logging.registry="$REG" 2> b.log || fail "train b: $(tail -3 b.log)"
for i in 1 2 3; do
    "$TERA" train "${TINY[@]}" --training.steps=8 --data.path=corpus2.txt --training.seed=$i \
        --logging.run_dir="$W/c$i" --logging.registry="$REG" 2> c$i.log &
done
wait
n=$(runs ls --json | wc -l)
fin=$(runs ls --json --status finished | wc -l)
[ "$n" = 5 ] && [ "$fin" = 5 ] && pass "5 runs registered, 3 of them written at once, all finished" \
    || { fail "registered $n runs, $fin finished"; runs ls; }
grep -q "tera: registry $REG: run " a.log && pass "the run prints its registry id" || fail "no registry line in a.log"

# 2. filters
[ "$(runs ls --json --where training.lr=0.002 | jq -r .run_dir)" = "$W/b" ] \
    && pass "--where training.lr=0.002 finds run b" || fail "--where training.lr=0.002"
[ "$(runs ls --json --where training.lr=2e-3 | wc -l)" = 1 ] && pass "--where compares numbers as numbers (2e-3)" \
    || fail "--where training.lr=2e-3"
runs ls --where 'final_loss<nan' > /dev/null 2> nan.err && fail "--where final_loss<nan accepted" \
    || { grep -q "'nan' is not a number to compare with" nan.err && pass "--where final_loss<nan refused" || fail "nan: $(cat nan.err)"; }
[ "$(runs ls --json --where 'last_step<10' | wc -l)" = 3 ] && pass "--where on a summary field (last_step<10)" \
    || fail "--where last_step<10: $(runs ls --json --where 'last_step<10' | wc -l)"
[ "$(runs ls --json --where data.path=corpus2.txt --where training.seed=2 | jq -r .run_dir)" = "$W/c2" ] \
    && pass "two --where filters" || fail "two --where filters"
out=$(runs ls --where training.bogus=1 2>&1) && fail "unknown filter key accepted" \
    || { echo "$out" | grep -q "training.bogus" && pass "a --where on an unknown config key: error names it" || fail "$out"; }
out=$(runs ls --where nonsense 2>&1) && fail "--where without = accepted" \
    || { echo "$out" | grep -q "nonsense" && pass "--where without an operator: error names it" || fail "$out"; }

# 3. show: everything recorded
A=$(id_of a)
runs show "$A" --json > a.json
jqe '.status == "finished" and .summary.last_step == 12 and (.checkpoints | length) == 2 and
       (.checkpoints[1] | endswith("step_00000012")) and .config["training.steps"] == "12" and
       (.command | contains("--logging.run_dir=")) and .tokenizer_fp == "bytes" and .version != null and
       (.layout | contains("pp 1 x dp 1 x tp 1")) and .metrics_path == "'"$W/a/metrics.jsonl"'" and
       .dataset_bytes == 40000 and (.dataset_fp | length) == 16' < a.json > /dev/null \
    && pass "show: status, summary, checkpoints, config, command, layout, dataset and tokenizer fingerprints" \
    || { fail "show a"; cat a.json; }
want_loss=$(last_fields "$W/a/metrics.jsonl" step loss | tail -1 | cut -d' ' -f2)
within "$want_loss" "$(jq .summary.final_loss a.json)" 1e-5 && pass "final_loss = the last step's loss of metrics.jsonl" \
    || fail "final_loss $(jq .summary.final_loss a.json) vs $want_loss"
[ "$(jq -r .dataset_fp a.json)" = "$(runs show "$(id_of b)" --json | jq -r .dataset_fp)" ] \
    && [ "$(jq -r .dataset_fp a.json)" != "$(runs show "$(id_of c1)" --json | jq -r .dataset_fp)" ] \
    && pass "same data, same fingerprint; other data, another" || fail "dataset fingerprints"
# ids are DATE-TIME-6hex and runs started in the same second share DATE-TIME: a 20-character prefix
# (4 of the hex digits) is unique here, a 17-character one was not always
runs show "${A:0:20}" | grep -q "^status *finished" && pass "show by an id prefix" || fail "show by prefix"
out=$(runs show nosuchrun 2>&1) && fail "show of a missing run" \
    || { echo "$out" | grep -q "no run 'nosuchrun'" && pass "show of a missing run names it" || fail "$out"; }

# 4. compare: the differing keys, the final metrics, a plot
runs compare "$A" "$(id_of b)" --plot loss,lr --out cmp.html > cmp.txt 2> cmp.err || fail "compare: $(cat cmp.err)"
printf 'keep\n' > keep.txt
runs compare "$A" "$(id_of b)" --plot loss --out keep.txt > /dev/null 2> keep.err && fail "compare --out onto an existing file" \
    || { [ "$(cat keep.txt)" = keep ] && grep -q "already exists; pass --force" keep.err \
        && pass "compare --out onto an existing file: refused without --force, kept" || fail "compare --out: $(cat keep.err)"; }
runs compare "$A" "$(id_of b)" --plot loss --out keep.txt --force > /dev/null 2>&1 && grep -q "<svg" keep.txt \
    && pass "compare --out --force replaces it" || fail "compare --out --force"
grep -q "^training.lr *| 0.003 *| 0.002" cmp.txt && pass "compare shows training.lr side by side" || { fail "compare"; cat cmp.txt; }
grep -q "^training.steps" cmp.txt && fail "compare shows an equal key" || pass "compare hides equal keys"
grep -q "^final_loss" cmp.txt && pass "compare shows final metrics" || fail "no final metrics"
[ "$(grep -c '<polyline class="run"' cmp.html)" = 4 ] && grep -q "data-run=\"$A\"" cmp.html && grep -q 'data-metric="lr"' cmp.html \
    && pass "plot: one line per run and metric" || fail "plot: $(grep -c polyline cmp.html) lines"
runs compare "$A" "$(id_of b)" --all | grep -q "^training.steps" && pass "compare --all shows every key" || fail "--all"

# 5. a failed run (every step skipped as not finite)
TERA_FAULT_NAN_STEP=0 "$TERA" train "${TINY[@]}" --training.steps=1 --training.warmup_steps=0 --logging.run_dir="$W/f" --logging.registry="$REG" \
    2> f.log && fail "a run with only non-finite steps exited 0"
runs show "$(id_of f)" --json | jqe '.status == "failed" and (.error | contains("not finite"))' > /dev/null \
    && pass "a failing run is recorded as failed with its error" || fail "failed run: $(runs show "$(id_of f)" --json)"

# 6. killed: SIGTERM is recorded at once; SIGKILL by the stopped heartbeat
"$TERA" train "${TINY[@]}" --training.steps=100000 --checkpoint.every=5 --logging.run_dir="$W/k" \
    --logging.registry="$REG" 2> k.log &
pid=$!
# wait for a committed checkpoint at step 10 or later (retention may already have removed step 10's)
for _ in $(seq 1 1200); do
    c=$(ls "$W/k/checkpoints" 2> /dev/null | grep -v tmp | tail -1)
    [ -n "$c" ] && [ "$((10#${c#step_}))" -ge 10 ] && break
    sleep 0.1
done
kill -TERM $pid
wait $pid
K=$(id_of k)
runs show "$K" --json | jqe '.status == "killed" and (.error | contains("signal 15"))' > /dev/null \
    && pass "SIGTERM: status killed, naming the signal" || fail "SIGTERM: $(runs show "$K" --json | jq -c '{status, error}')"
TERA_REGISTRY_HEARTBEAT_S=0.2 "$TERA" train "${TINY[@]}" --training.steps=100000 --logging.run_dir="$W/k9" \
    --logging.registry="$REG" 2> k9.log &
pid=$!
for _ in $(seq 1 1200); do [ -s "$W/k9/metrics.jsonl" ] && break; sleep 0.1; done
sleep 0.5
kill -KILL $pid
wait $pid 2> /dev/null
[ "$(runs ls --json --where "run_dir=$W/k9" | jq -r .status)" = running ] && pass "SIGKILL: still running within the stale limit" \
    || fail "SIGKILL: $(runs ls --json --where "run_dir=$W/k9" | jq -r .status) before the limit"
sleep 1.2
[ "$(TERA_REGISTRY_STALE_S=1 "$TERA" runs ls --registry "$REG" --json --where "run_dir=$W/k9" | jq -r .status)" = killed ] \
    && pass "SIGKILL: marked killed once its heartbeat is older than the limit" || fail "SIGKILL not reaped"

# 6b. SIGINT/SIGTERM land on a thread of their own: every other thread of the run blocks them. A
# handled signal delivered on a thread inside oneDNN's JIT sgemm (whose rsp then points into a heap
# workspace, oneDNN#4845) pushed its frame onto the heap: "corrupted size vs. prev_size" or a
# segfault, the row left running (about half of these bursts on the tiny model did). The threads'
# masks (2 threads: OpenMP's too), then SIGTERM bursts right after checkpoints.
"$TERA" train "${TINY[@]}" --training.threads=2 --training.steps=100000 --checkpoint.every=2 \
    --logging.run_dir="$W/s0" --logging.registry="$REG" 2> s0.log &
pid=$!
for _ in $(seq 1 1200); do [ -n "$(ls "$W/s0/checkpoints" 2> /dev/null | grep -v tmp)" ] && break; sleep 0.05; done
total=0 open=0
for f in /proc/$pid/task/*/status; do
    blk=$(awk '/^SigBlk:/ { print $2 }' "$f" 2> /dev/null)
    [ -n "$blk" ] || continue
    total=$((total + 1))
    [ $((16#$blk & 16#4002)) = $((16#4002)) ] || open=$((open + 1)) # SIGINT (bit 1), SIGTERM (bit 14)
done
main_blk=$(awk '/^SigBlk:/ { print $2 }' /proc/$pid/status)
kill -TERM $pid
wait $pid
rc=$?
[ "$((16#${main_blk:-0} & 16#4002))" = $((16#4002)) ] && [ "$open" -le 2 ] && [ "$total" -gt "$open" ] \
    && pass "SIGINT/SIGTERM blocked in $((total - open)) of the run's $total threads (the main thread too)" \
    || fail "signal masks: main thread SigBlk ${main_blk:-?}, $open of $total threads take SIGINT/SIGTERM"
[ "$rc" = 143 ] && [ "$(runs ls --json --where "run_dir=$W/s0" | jq -r .status)" = killed ] \
    && pass "SIGTERM with 2 threads: exit 143, killed" || fail "SIGTERM with 2 threads: exit $rc, $(tail -1 s0.log)"
bad=0
for i in 1 2 3 4; do
    "$TERA" train "${TINY[@]}" --training.steps=100000 --checkpoint.every=2 --logging.run_dir="$W/s$i" \
        --logging.registry="$REG" 2> s$i.log &
    pid=$!
    for _ in $(seq 1 1200); do [ -n "$(ls "$W/s$i/checkpoints" 2> /dev/null | grep -v tmp)" ] && break; sleep 0.05; done
    for _ in $(seq 1 100000); do kill -TERM $pid 2> /dev/null || break; done # until it is gone
    wait $pid 2> /dev/null
    rc=$?
    st=$(runs ls --json --where "run_dir=$W/s$i" | jq -r .status)
    [ "$rc" = 143 ] && [ "$st" = killed ] || { bad=$((bad + 1)); echo "burst $i: exit $rc, status $st: $(tail -1 s$i.log)"; }
done
[ "$bad" = 0 ] && pass "SIGTERM bursts during training and checkpoint writes: 4 runs, each exit 143 and killed" \
    || fail "SIGTERM bursts: $bad of 4 runs did not end by the signal recorded killed"
# a SIGINT ignored when the run starts (this script's background jobs, nohup) stays ignored: the
# run goes on and finishes (the tracker used to catch it, mark the row killed, and train on)
"$TERA" train "${TINY[@]}" --training.steps=60 --checkpoint.every=5 --logging.run_dir="$W/si" \
    --logging.registry="$REG" 2> si.log &
pid=$!
for _ in $(seq 1 1200); do [ -n "$(ls "$W/si/checkpoints" 2> /dev/null | grep -v tmp)" ] && break; sleep 0.05; done
kill -INT $pid 2> /dev/null
wait $pid
rc=$?
[ "$rc" = 0 ] && [ "$(runs ls --json --where "run_dir=$W/si" | jq -r .status)" = finished ] \
    && pass "an ignored SIGINT stays ignored: the run finishes" \
    || fail "ignored SIGINT: exit $rc, $(runs ls --json --where "run_dir=$W/si" | jq -r .status)"

# 7. --resume continues the run's row
last=$(ls "$W/k/checkpoints" | grep -v tmp | tail -1)
step=$((10#${last#step_}))
"$TERA" train -c "$W/k/config.ini" --resume --training.steps=$((step + 3)) 2> kr.log || fail "resume: $(tail -3 kr.log)"
runs show "$K" --json | jqe ".status == \"finished\" and .segments == 2 and .summary.last_step == $((step + 3))" > /dev/null \
    && pass "--resume continues the same registry row (segments 2, finished at step $((step + 3)))" \
    || fail "resume row: $(runs show "$K" --json | jq -c '{status, segments, summary}')"
[ "$(runs ls --json --where "run_dir=$W/k" | wc -l)" = 1 ] && pass "no second row for the resumed run" || fail "second row"

# 8. rm
runs rm "$(id_of c3)" > rm.txt && [ "$(runs ls --json | grep -c "\"$W/c3\"")" = 0 ] && [ -d "$W/c3/checkpoints" ] \
    && pass "rm removes the record and keeps the run directory" || fail "rm"

# 9. the git commit of the working tree the run starts in; logging.registry = "" writes nothing.
# A scratch repository of the test's own: the source tree's HEAD moves whenever someone commits while
# the test runs (a commit between the run's start and our rev-parse failed this check under load),
# and its dirty flag is whatever the tree is; here both are known, so the flag is checked both ways.
gitq() { git -C "$W/repo" -c user.name=tera -c user.email=tera@localhost -c commit.gpgsign=false "$@"; }
if mkdir repo && gitq init -q && echo one > repo/tracked && gitq add tracked && gitq commit -q -m one \
    && head=$(gitq rev-parse HEAD) && [ -n "$head" ]; then
    (cd repo && "$TERA" train "${TINY[@]}" --training.steps=2 --logging.run_dir="$W/g" --logging.registry="$REG" 2> "$W/g.log")
    echo changed >> repo/tracked
    (cd repo && "$TERA" train "${TINY[@]}" --training.steps=2 --logging.run_dir="$W/gd" --logging.registry="$REG" 2> "$W/gd.log")
    runs show "$(id_of g)" --json | jqe ".git_commit == \"$head\" and .git_dirty == 0" > /dev/null \
        && runs show "$(id_of gd)" --json | jqe ".git_commit == \"$head\" and .git_dirty == 1" > /dev/null \
        && pass "git commit and dirty flag of the work tree (clean, then a tracked file changed)" \
        || fail "git: want $head: clean $(runs show "$(id_of g)" --json | jq -c '{git_commit, git_dirty}'), changed $(runs show "$(id_of gd)" --json | jq -c '{git_commit, git_dirty}')"
else
    echo "skip: no git to make a scratch repository (git commit and dirty flag not checked)"
fi
[ "$(runs show "$A" --json | jq -r .git_commit)" = null ] && pass "no git commit outside a work tree" || fail "git outside a tree"
mkdir off && (cd off && "$TERA" train "${TINY[@]}" --training.steps=2 --logging.run_dir="$W/off/r" --logging.registry= \
    2> ../off.log) && [ ! -e off/runs ] && ! grep -q "registry" off.log && pass "logging.registry = \"\" writes nothing" \
    || fail "registry off"
out=$("$TERA" runs ls --registry "$W/none/reg.db" 2>&1) && fail "ls of a missing registry" \
    || { echo "$out" | grep -q "no run registry at $W/none/reg.db" && [ ! -e "$W/none" ] \
         && pass "ls of a missing registry: error, nothing created" || fail "$out"; }
# the default registry is runs/registry.db under the working directory
mkdir def && (cd def && "$TERA" train "${TINY[@]}" --training.steps=2 --logging.run_dir="$W/def/r" 2> ../def.log) \
    && [ "$("$TERA" runs ls --registry def/runs/registry.db --json | wc -l)" = 1 ] && pass "default registry runs/registry.db" \
    || fail "default registry"
# a registry whose tables lack a column tera writes (an older or edited file): refused at open with
# one message, exit 1 (tera tune used to read its study as empty, warn at every write and exit 0)
python3 -c "
import sqlite3, sys
c = sqlite3.connect(sys.argv[1])
c.execute('CREATE TABLE trials(study TEXT NOT NULL, number INTEGER NOT NULL, state TEXT NOT NULL, PRIMARY KEY(study, number))')
c.commit()" "$W/old.db"
"$TERA" runs ls --registry "$W/old.db" > /dev/null 2> old.err && fail "a registry with an old schema accepted" \
    || { grep -q "old.db: no such column: .*not the schema this tera writes" old.err && [ "$(grep -c 'tera: error' old.err)" = 1 ] \
        && pass "a registry lacking a column: refused at open ($(head -c 120 old.err))" || fail "old schema: $(cat old.err)"; }
finish cli_runs
