#!/usr/bin/env bash
# Loss-spike guard: a batch whose loss and gradients blow up (fault injection), and a batch of random
# tokens, are detected by their z-score, the update is dropped, the run rolls back to the newest
# checkpoint, skips that batch, lowers the LR for a few steps, and ends close to a clean run. Non-finite
# guard: a NaN in one rank's gradient skips the update on every rank, in every layout.
# Usage: cli_stability.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32
      --training.micro_batch=4 --training.warmup_steps=2 --training.steps=60 --training.threads=2 --data.path="$W/c.txt"
      --checkpoint.every=10 --training.spike_window=8 --training.spike_lr_steps=6 --training.spike_grad_zscore=1e6
      --training.spike_zscore=8) # 8: above the clean runs' loss z-scores at this window (7.7), below the poisoned batch's (12.2)
val_loss() { "$TERA" eval --from "$1" --data.path="$W/c.txt" --training.seq_len=32 --training.micro_batch=8 \
    --training.eval_batches=20 2> /dev/null | sed 's/.*"val_loss": \([0-9.]*\).*/\1/'; }

"$TERA" train "${TINY[@]}" --logging.run_dir="$W/clean" > "$W/clean.log" 2>&1 || { fail "clean run"; cat "$W/clean.log"; }
grep -q loss_spike "$W/clean/metrics.jsonl" && fail "clean run reported a spike" || pass "clean run: no spike"
# the batch of step 25 (samples 100..103) blows up: loss x 10, gradients x 100
TERA_FAULT_SPIKE_SAMPLE=100 "$TERA" train "${TINY[@]}" --checkpoint.keep=0 --logging.run_dir="$W/fault" > "$W/fault.log" 2>&1 \
    || { fail "faulted run"; cat "$W/fault.log"; }
ev=$(grep loss_spike "$W/fault/metrics.jsonl")
[ "$(grep -c loss_spike "$W/fault/metrics.jsonl")" = 1 ] && pass "one spike event: ${ev:0:120}" || fail "events: $ev"
echo "$ev" | grep -q '"step": 25,' && echo "$ev" | grep -q '"rolled_back_to": 20' && echo "$ev" | grep -q '"skipped_samples": \[100, 104\]' \
    && pass "spike at step 25 rolled back to step 20, samples [100, 104) skipped" || fail "event content: $ev"
grep -q "loss spike at step 25" "$W/fault.log" && pass "spike reported on stderr" || fail "no stderr report"
# the LR cut (spike_lr_steps = 6): the replayed steps 20-24, then 6 steps from the spike's step on (25-30, step 25
# now on the batch after the skipped one) run at spike_lr_factor x the clean run's LR; step 31 at the full LR
lr_at() { last_fields "$1" step lr | awk -v s="$2" '$1 == s { print $2 }'; } # the last record of step $2
cut_ok=1
for k in 20 24 25 30 31; do
    f=0.5; [ $k = 31 ] && f=1
    awk -v a="$(lr_at "$W/clean/metrics.jsonl" $k)" -v b="$(lr_at "$W/fault/metrics.jsonl" $k)" -v f=$f \
        'BEGIN { d = b - f * a; if (d < 0) d = -d; exit !(a > 0 && d <= 1e-4 * a) }' || { cut_ok=0; echo "step $k: LR $(lr_at "$W/fault/metrics.jsonl" $k) vs clean $(lr_at "$W/clean/metrics.jsonl" $k)"; }
done
[ $cut_ok = 1 ] && pass "LR x 0.5 for the replayed steps 20-24 and the 6 steps 25-30, full LR again at step 31" || fail "LR cut after the spike"
n=$(grep -c '"loss": ' "$W/fault/metrics.jsonl")
last=$(tail -1 "$W/fault/metrics.jsonl" | grep -o '"step": [0-9]*')
[ "$last" = '"step": 59' ] && pass "run completed all 60 steps ($n step records incl. the replay)" || fail "last record: $last"
a=$(val_loss "$W/clean/checkpoints/step_00000060"); b=$(val_loss "$W/fault/checkpoints/step_00000060")
awk -v a="$a" -v b="$b" 'BEGIN { d = b - a; if (d < 0) d = -d; exit !(a > 0 && d <= 0.05 * a) }' \
    && pass "faulted run ends within 5% of the clean run (validation loss $b vs $a)" || fail "recovery: $b vs $a"
# the guard's state is in state.json: resumed at step 30 (LR cut until step 31), the run is bit-identical
losses() { last_fields "$1" step loss; }
st="$W/fault/checkpoints/step_00000030/state.json"
tr -d ' \t\n' < "$st" | grep -q '"lr_cut_until":31,"skip_windows":\[\[100,104\]\],"events":1,"last_spike_step":25' \
    && tr -d ' \t\n' < "$st" | grep -q '"window":8,"n":8' \
    && pass "state.json holds the LR cut, the skipped window, the last spike and the z-score window" || { fail "guard state"; cat "$st"; }
cp -r "$W/fault" "$W/fres"
rm -rf "$W/fres/checkpoints/step_000000"[456]0
TERA_FAULT_SPIKE_SAMPLE=100 "$TERA" train "${TINY[@]}" --checkpoint.keep=0 --logging.run_dir="$W/fres" --resume > "$W/fres.log" 2>&1 \
    && grep -q "resumed .* at step 30" "$W/fres.log" && cmp -s <(losses "$W/fault/metrics.jsonl") <(losses "$W/fres/metrics.jsonl") \
    && cmp -s "$W/fault/checkpoints/step_00000060/model.safetensors" "$W/fres/checkpoints/step_00000060/model.safetensors" \
    && pass "resumed inside the LR cut: losses and final weights bit-identical to the uninterrupted run" \
    || { fail "guard resume"; tail -3 "$W/fres.log"; }
# without checkpoints: the update is dropped and the run goes on (no rollback)
TERA_FAULT_SPIKE_SAMPLE=100 "$TERA" train "${TINY[@]}" --checkpoint.every=0 --logging.run_dir="$W/nockpt" > "$W/n.log" 2>&1 \
    && grep -q '"rolled_back_to": -1' "$W/nockpt/metrics.jsonl" && pass "no checkpoint: update dropped, run continues" \
    || { fail "no-checkpoint spike"; tail -3 "$W/n.log"; }
# a really poisoned batch (TERA_FAULT_POISON_SAMPLE: the 4 samples of step 25 are random tokens, no
# scaling of anything): the guard finds the spike by the loss z-score alone, rolls back, skips those
# samples and ends within 5% of the clean run
TERA_FAULT_POISON_SAMPLE=100 "$TERA" train "${TINY[@]}" --checkpoint.keep=0 --logging.run_dir="$W/poison" > "$W/poison.log" 2>&1 \
    || { fail "poisoned run"; tail -3 "$W/poison.log"; }
ev=$(grep loss_spike "$W/poison/metrics.jsonl")
[ "$(grep -c loss_spike "$W/poison/metrics.jsonl")" = 1 ] && echo "$ev" | grep -q '"step": 25,' && echo "$ev" | grep -q '"rolled_back_to": 20' \
    && echo "$ev" | grep -q '"skipped_samples": \[100, 104\]' && pass "poisoned batch found by its loss: ${ev:0:110}" || fail "poison events: $ev"
p=$(val_loss "$W/poison/checkpoints/step_00000060")
awk -v a="$a" -v b="$p" 'BEGIN { d = b - a; if (d < 0) d = -d; exit !(a > 0 && d <= 0.05 * a) }' \
    && pass "poisoned run ends within 5% of the clean run (validation loss $p vs $a)" || fail "poison recovery: $p vs $a"
# a NaN in the gradient at step 25 (TERA_FAULT_NAN_STEP): that update is skipped and counted, the data
# position still advances (the next steps see the clean run's batches), and the run ends within 5%
TERA_FAULT_NAN_STEP=25 "$TERA" train "${TINY[@]}" --logging.run_dir="$W/nan" > "$W/nan.log" 2>&1 || { fail "NaN run"; tail -3 "$W/nan.log"; }
row() { grep "^{\"step\": $2, \"loss\"" "$1" | tail -1; }
row "$W/nan/metrics.jsonl" 25 | grep -q '"skipped": 1, "skipped_total": 1' && row "$W/nan/metrics.jsonl" 59 | grep -q '"skipped": 0, "skipped_total": 1' \
    && [ "$(grep -c '"skipped": 1' "$W/nan/metrics.jsonl")" = 1 ] \
    && grep -q "^tera: step 25: gradient not finite (loss [0-9.]*, grad norm nan): update skipped on every rank, 1 skipped so far" "$W/nan.log" \
    && pass "NaN at step 25: that update alone skipped, counted and reported" \
    || { fail "NaN skip"; row "$W/nan/metrics.jsonl" 25; }
loss_at() { last_fields "$1" step loss | awk -v s="$2" '$1 == s { print $2 }'; }
[ "$(loss_at "$W/nan/metrics.jsonl" 24)" = "$(loss_at "$W/clean/metrics.jsonl" 24)" ] \
    && [ "$(loss_at "$W/nan/metrics.jsonl" 25)" = "$(loss_at "$W/clean/metrics.jsonl" 25)" ] && [ -n "$(loss_at "$W/nan/metrics.jsonl" 25)" ] \
    && pass "steps up to the NaN as in the clean run, the NaN step's loss too (data position kept)" || fail "NaN run's early steps differ"
c=$(val_loss "$W/nan/checkpoints/step_00000060")
awk -v a="$a" -v b="$c" 'BEGIN { d = b - a; if (d < 0) d = -d; exit !(a > 0 && d <= 0.05 * a) }' \
    && pass "NaN run ends within 5% of the clean run (validation loss $c vs $a)" || fail "NaN recovery: $c vs $a"
# on several ranks a NaN in one rank's gradient skips the update on every rank: with the NaN on one
# rank only, each layout (dp, pp, pp x dp, ZeRO 1-3, tp, ep) trains like one process with the NaN
# (every step's loss, grad norm and skip)
if command -v mpirun > /dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
    # loss, grad norm and skip of every step record
    lgs() { fields "$1" loss grad_norm skipped; }
    D=("${TINY[@]}" --training.threads=1 --training.steps=30 --checkpoint.every=0)
    TERA_FAULT_NAN_STEP=12 "$TERA" train "${D[@]}" --logging.run_dir="$W/n1" > "$W/n1.log" 2>&1 || { fail "NaN one rank"; tail -3 "$W/n1.log"; }
    # name, ranks, world rank with the NaN, layout
    for L in "dp2 2 1 --parallel.dp=2" "pp2 2 1 --parallel.pp=2" "pp2xdp2 4 3 --parallel.pp=2 --parallel.dp=2" \
             "dp2-zero1 2 0 --parallel.dp=2 --parallel.zero=1" "dp2-zero2 2 1 --parallel.dp=2 --parallel.zero=2" \
             "dp2xtp2-zero3 4 3 --parallel.dp=2 --parallel.tp=2 --parallel.zero=3" "ep2 2 1 --parallel.dp=2 --parallel.ep=2"; do
        read -r what np nanrank lay <<< "$L"
        dp=$(echo "$lay" | grep -o 'dp=[0-9]' | cut -d= -f2); dp=${dp:-1}
        TERA_FAULT_NAN_STEP=12@$nanrank mpirun --oversubscribe -np $np "$TERA" train "${D[@]}" $lay --training.micro_batch=$((4 / dp)) \
            --logging.run_dir="$W/n_$what" > "$W/n_$what.log" 2>&1 || { fail "NaN $what"; tail -3 "$W/n_$what.log"; continue; }
        paste -d' ' <(lgs "$W/n1/metrics.jsonl") <(lgs "$W/n_$what/metrics.jsonl") | awk '
            function rel(a, b) { if (a == b) return 0; d = (a - b) / a; return d < 0 ? -d : d }
            { n++; if ($3 != $6) bad = 1; for (i = 1; i <= 2; i++) if ($i !~ /^(nan|null)$/ && $(i + 3) !~ /^(nan|null)$/) { r = rel($i, $(i + 3)); if (r > worst) worst = r }
                   else if ($i != $(i + 3)) bad = 1 }
            END { printf "%d steps, skipped steps alike: %s, worst relative difference %.2g\n", n, bad ? "no" : "yes", worst
                  exit !(n == 30 && !bad && worst <= 2e-5) }' > "$W/nd.txt" \
            && pass "$what, NaN on world rank $nanrank only = one rank with the NaN: $(cat "$W/nd.txt")" || fail "NaN $what: $(cat "$W/nd.txt")"
    done
    # the spike guard's rollback under sharded layouts (the newest checkpoint reloaded into ZeRO-3
    # shards, pipeline stages and tensor-parallel blocks) replays as on one rank: the same event,
    # every step's loss and grad norm within 2e-5
    S=("${TINY[@]}" --training.threads=1 --training.steps=30 --training.micro_batch=2 --training.grad_accum=2)
    TERA_FAULT_SPIKE_SAMPLE=100 "$TERA" train "${S[@]}" --logging.run_dir="$W/s1" > "$W/s1.log" 2>&1 || { fail "spike one rank"; tail -3 "$W/s1.log"; }
    for L in "pp2xdp2-zero3 --parallel.pp=2 --parallel.dp=2 --parallel.zero=3" "dp2xtp2-zero3 --parallel.dp=2 --parallel.tp=2 --parallel.zero=3"; do
        read -r what lay <<< "$L"
        TERA_FAULT_SPIKE_SAMPLE=100 mpirun --oversubscribe -np 4 "$TERA" train "${S[@]}" $lay --training.micro_batch=1 \
            --logging.run_dir="$W/s_$what" > "$W/s_$what.log" 2>&1 || { fail "spike $what"; tail -3 "$W/s_$what.log"; continue; }
        e1=$(grep loss_spike "$W/s1/metrics.jsonl" | sed 's/"loss": [^,]*, "grad_norm": [^,]*, "z": [^,]*, //')
        e2=$(grep loss_spike "$W/s_$what/metrics.jsonl" | sed 's/"loss": [^,]*, "grad_norm": [^,]*, "z": [^,]*, //')
        paste -d' ' <(grep -v '"event"' "$W/s1/metrics.jsonl" | lgs /dev/stdin) <(grep -v '"event"' "$W/s_$what/metrics.jsonl" | lgs /dev/stdin) | awk '
            function rel(a, b) { if (a == b) return 0; d = (a - b) / a; return d < 0 ? -d : d }
            { n++; if ($3 != $6) bad = 1; for (i = 1; i <= 2; i++) { r = rel($i, $(i + 3)); if (r > worst) worst = r } }
            END { printf "%d step records, worst relative difference %.2g\n", n, worst; exit !(n > 30 && !bad && worst <= 2e-5) }' > "$W/sd.txt" \
            && [ -n "$e1" ] && [ "$e1" = "$e2" ] && pass "$what: spike rollback replays as on one rank (${e1:0:60}...): $(cat "$W/sd.txt")" \
            || fail "spike $what: '$e2' vs '$e1': $(cat "$W/sd.txt")"
    done
fi
echo "cli_stability: $fails failed"
[ "$fails" = 0 ]
