#!/usr/bin/env bash
# End-to-end through the command line: train on a text file, metrics, checkpoint, export-hf,
# train from the exported directory, eval, resume. Usage: cli_e2e.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"

head -c 60000 "$SRC/data/default_corpus.txt" > "$W/corpus.txt"
TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32
      --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=2 --logging.log_every=5
      --training.threads=2)

# 1. train on a text file
"$TERA" train "${TINY[@]}" --training.steps=20 --data.path="$W/corpus.txt" --logging.run_dir="$W/run" \
    --checkpoint.every=10 > "$W/train.log" 2>&1 && pass "train exits 0" || { fail "train"; cat "$W/train.log"; }
grep -q "step     20/20 | loss" "$W/train.log" && pass "progress line" || fail "progress line"
n=$(steps_of "$W/run/metrics.jsonl" | wc -l)
[ "$n" = 20 ] && pass "metrics.jsonl has 20 step records" || fail "metrics.jsonl has $n step records"
[ "$(jq -r 'select(.event == "memory") | .peak_rss_mib > 0' "$W/run/metrics.jsonl")" = true ] \
    && pass "metrics.jsonl ends with the peak-RSS event" || fail "no memory event in metrics.jsonl"
for k in step loss aux_loss lr grad_norm tokens_per_s elapsed_s; do
    grep -q "\"$k\": " "$W/run/metrics.jsonl" || fail "metrics key $k"
done
first=$(steps_of "$W/run/metrics.jsonl" | head -1 | cut -d" " -f2)
last=$(steps_of "$W/run/metrics.jsonl" | tail -1 | cut -d" " -f2)
awk -v a="$first" -v b="$last" 'BEGIN{exit !(b < a - 0.5)}' && pass "loss falls ($first -> $last)" || fail "loss did not fall ($first -> $last)"
[ -f "$W/run/config.ini" ] && pass "resolved config written" || fail "config.ini missing"
[ -f "$W/run/checkpoints/step_00000010/model.safetensors" ] && [ -f "$W/run/checkpoints/step_00000020/config.json" ] \
    && pass "checkpoints at 10 and 20" || fail "checkpoints missing"

# --force starts over in an existing run directory: the old run's metrics and checkpoints go
# (a later --resume must not pick up the old run's checkpoints)
cp -r "$W/run" "$W/forced"
"$TERA" train "${TINY[@]}" --training.steps=5 --data.path="$W/corpus.txt" --logging.run_dir="$W/forced" --force \
    > /dev/null 2>&1 || fail "train --force"
[ "$(steps_of "$W/forced/metrics.jsonl" | wc -l)" = 5 ] && [ "$(ls "$W/forced/checkpoints" | tr '\n' ' ')" = "step_00000005 " ] \
    && pass "--force replaces the old run's metrics and checkpoints" \
    || fail "--force left old files: $(wc -l < "$W/forced/metrics.jsonl") metrics lines, $(ls "$W/forced/checkpoints" | tr '\n' ' ')"
# ... and only tera's: what else checkpoints/ holds stays (a step_N.tmp leftover goes); with
# nothing else left, checkpoints/ itself goes before the new run makes it again
cp -r "$W/run" "$W/forced2"
mkdir -p "$W/forced2/checkpoints/step_00000030.tmp" "$W/forced2/checkpoints/mine"
echo keep > "$W/forced2/checkpoints/notes.txt"; echo keep > "$W/forced2/checkpoints/mine/a.pt"
"$TERA" train "${TINY[@]}" --training.steps=5 --data.path="$W/corpus.txt" --logging.run_dir="$W/forced2" --force \
    > /dev/null 2>&1 || fail "train --force (other files in checkpoints/)"
[ "$(ls "$W/forced2/checkpoints" | tr '\n' ' ')" = "mine notes.txt step_00000005 " ] \
    && [ "$(cat "$W/forced2/checkpoints/mine/a.pt" "$W/forced2/checkpoints/notes.txt")" = "keep
keep" ] && pass "--force removes only tera's checkpoints, other files in checkpoints/ stay" \
    || fail "--force with other files: $(ls "$W/forced2/checkpoints" | tr '\n' ' ')"

# retention: checkpoint.keep=2 with a save every 5 steps keeps the newest two
"$TERA" train "${TINY[@]}" --training.steps=20 --data.path="$W/corpus.txt" --logging.run_dir="$W/keep" \
    --checkpoint.every=5 --checkpoint.keep=2 > /dev/null 2>&1
[ "$(ls "$W/keep/checkpoints" | tr '\n' ' ')" = "step_00000015 step_00000020 " ] && pass "retention keeps the newest 2" \
    || fail "retention: $(ls "$W/keep/checkpoints" | tr '\n' ' ')"

# retention with milestones: keep the newest 2 and every step divisible by 10
"$TERA" train "${TINY[@]}" --training.steps=20 --data.path="$W/corpus.txt" --logging.run_dir="$W/keep10" \
    --checkpoint.every=5 --checkpoint.keep=2 --checkpoint.keep_every=10 > /dev/null 2>&1
[ "$(ls "$W/keep10/checkpoints" | tr '\n' ' ')" = "step_00000010 step_00000015 step_00000020 " ] \
    && pass "retention keeps the newest 2 and the milestone" || fail "milestones: $(ls "$W/keep10/checkpoints" | tr '\n' ' ')"

# 2. the run directory is never overwritten without --force
cp "$W/run/metrics.jsonl" "$W/metrics.before"
if "$TERA" train "${TINY[@]}" --training.steps=5 --data.path="$W/corpus.txt" --logging.run_dir="$W/run" > "$W/again.log" 2>&1; then
    fail "second run into the same directory succeeded"
else
    grep -q "already exists" "$W/again.log" && pass "existing run dir refused" || fail "message: $(cat "$W/again.log")"
fi
cmp -s "$W/metrics.before" "$W/run/metrics.jsonl" && pass "existing metrics untouched" || fail "metrics changed"

# 3. resume: drop the step-20 checkpoint, resume from step 10: the new step-20 weights are the same
cp -r "$W/run" "$W/run_orig"
rm -rf "$W/run/checkpoints/step_00000020"
"$TERA" train "${TINY[@]}" --training.steps=20 --data.path="$W/corpus.txt" --logging.run_dir="$W/run" --resume \
    > "$W/resume.log" 2>&1 && grep -q "resumed .* at step 10" "$W/resume.log" && pass "resume from step 10" || { fail "resume"; cat "$W/resume.log"; }
cmp -s "$W/run/checkpoints/step_00000020/model.safetensors" "$W/run_orig/checkpoints/step_00000020/model.safetensors" \
    && cmp -s "$W/run/checkpoints/step_00000020/optimizer.safetensors" "$W/run_orig/checkpoints/step_00000020/optimizer.safetensors" \
    && pass "resumed run bit-identical to the uninterrupted one" || fail "resumed weights differ"
"$TERA" train "${TINY[@]}" --training.steps=20 --data.path="$W/corpus.txt" --logging.run_dir="$W/run" --resume \
    > "$W/resume2.log" 2>&1 && pass "resume of a finished run is a no-op" || { fail "resume finished"; cat "$W/resume2.log"; }
grep -Eq '"samples_consumed":[[:space:]]*80,' "$W/run/checkpoints/step_00000020/state.json" && pass "state.json data position" \
    || fail "state.json: $(cat "$W/run/checkpoints/step_00000020/state.json")"
head -c 30000 "$W/corpus.txt" > "$W/other.txt"
if "$TERA" train "${TINY[@]}" --training.steps=30 --data.path="$W/other.txt" --logging.run_dir="$W/run" --resume > "$W/resume3.log" 2>&1; then
    fail "resume on other data accepted"
else
    grep -q "other data" "$W/resume3.log" && pass "resume on other data refused" || fail "message: $(cat "$W/resume3.log")"
fi

# 4. export-hf (sharded), then train and eval from the exported directory
"$TERA" export-hf --from "$W/run/checkpoints/step_00000020" --out "$W/hf" --max-shard-bytes 50000 > "$W/exp.log" 2>&1 \
    && [ -f "$W/hf/model.safetensors.index.json" ] && [ -f "$W/hf/config.json" ] && pass "export-hf sharded" || { fail "export-hf"; cat "$W/exp.log"; }
grep -Eq '"model_type":[[:space:]]*"mixtral"' "$W/hf/config.json" && pass "config.json is Mixtral" || fail "config.json model_type"
if "$TERA" export-hf --from "$W/run/checkpoints/step_00000020" --out "$W/hf" > "$W/exp2.log" 2>&1; then
    fail "export into an existing directory succeeded"
else
    pass "export into existing directory refused"
fi
"$TERA" eval --from "$W/hf" --data.path="$W/corpus.txt" --training.seq_len=32 --training.micro_batch=4 > "$W/eval.json" 2> "$W/eval.log" \
    && grep -q '"val_loss"' "$W/eval.json" && pass "eval" || { fail "eval"; cat "$W/eval.log"; }
# eval --from a run directory: its newest checkpoint (step 20 here), the figures of --from that checkpoint
"$TERA" eval --from "$W/run" --data.path="$W/corpus.txt" --training.seq_len=32 --training.micro_batch=4 > "$W/eval_run.json" 2> "$W/eval_run.log" \
    && "$TERA" eval --from "$W/run/checkpoints/step_00000020" --data.path="$W/corpus.txt" --training.seq_len=32 --training.micro_batch=4 \
        > "$W/eval_ck.json" 2> /dev/null \
    && [ "$(jq -c '{val_loss, val_acc, tokens}' "$W/eval_run.json")" = "$(jq -c '{val_loss, val_acc, tokens}' "$W/eval_ck.json")" ] \
    && grep -q '"val_loss": [0-9]' "$W/eval_run.json" && pass "eval --from a run directory = its newest checkpoint: $(jq -c '{val_loss}' "$W/eval_run.json")" \
    || { fail "eval --from a run directory"; cat "$W/eval_run.log" "$W/eval_run.json"; }
"$TERA" train --training.init_from="$W/hf" --training.seq_len=32 --training.micro_batch=4 --training.steps=3 \
    --training.warmup_steps=1 --data.path="$W/corpus.txt" --logging.run_dir="$W/run2" > "$W/ft.log" 2>&1 \
    && pass "train from exported HF directory" || { fail "train from HF"; cat "$W/ft.log"; }
# training resumed from the exported weights starts near the loss where the first run ended
fl=$(steps_of "$W/run2/metrics.jsonl" | head -1 | cut -d" " -f2)
awk -v a="$fl" -v b="$last" 'BEGIN{exit !(a < b + 0.5)}' && pass "init_from starts trained ($fl)" || fail "init_from loss $fl vs $last"

# 5. bit-identical runs from the same seed
for r in a b; do
    "$TERA" train "${TINY[@]}" --training.steps=5 --data.path="$W/corpus.txt" --logging.run_dir="$W/det$r" > /dev/null 2>&1
    untimed "$W/det$r/metrics.jsonl" > "$W/det$r.txt" # every field but the timings
done
cmp -s "$W/deta.txt" "$W/detb.txt" && cmp -s "$W/deta/checkpoints/step_00000005/model.safetensors" \
    "$W/detb/checkpoints/step_00000005/model.safetensors" && pass "same seed, identical losses and weights" || fail "determinism"

echo "cli_e2e: $fails failed"
[ "$fails" = 0 ]
