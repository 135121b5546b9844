#!/usr/bin/env bash
# Loss-spike guard: a batch whose loss and gradients blow up (fault injection) is detected by its
# z-score, its update is dropped, the run rolls back to the newest checkpoint, skips that batch,
# lowers the LR for a few steps, and ends close to a clean run. Usage: cli_stability.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32
      --training.micro_batch=4 --training.warmup_steps=2 --training.steps=60 --training.threads=2 --data.path="$W/c.txt"
      --checkpoint.every=10 --training.spike_window=8 --training.spike_lr_steps=5 --training.spike_grad_zscore=1e6)
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
n=$(grep -c '"loss": ' "$W/fault/metrics.jsonl")
last=$(tail -1 "$W/fault/metrics.jsonl" | grep -o '"step": [0-9]*')
[ "$last" = '"step": 59' ] && pass "run completed all 60 steps ($n step records incl. the replay)" || fail "last record: $last"
a=$(val_loss "$W/clean/checkpoints/step_00000060"); b=$(val_loss "$W/fault/checkpoints/step_00000060")
awk -v a="$a" -v b="$b" 'BEGIN { d = b - a; if (d < 0) d = -d; exit !(a > 0 && d <= 0.05 * a) }' \
    && pass "faulted run ends within 5% of the clean run (validation loss $b vs $a)" || fail "recovery: $b vs $a"
# the guard's state is in state.json: resumed at step 30 (LR cut until step 31), the run is bit-identical
losses() { grep '"loss": ' "$1" | grep -v '"event"' | sed 's/^{"step": \([0-9]*\), "loss": \([^,]*\),.*/\1 \2/' \
    | awk '{l[$1]=$2} END {for (s in l) print s, l[s]}' | sort -n; }
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
echo "cli_stability: $fails failed"
[ "$fails" = 0 ]
