#!/usr/bin/env bash
# tera generate and tera eval --task through the command line, on a tiny model trained here on the
# default corpus (bytes): the KV-cache path and full recomputation give the same tokens (greedy and
# sampled, batch 1 and 3), a run directory, its checkpoint and its Hugging Face export give the same
# text, a run's tokenizer is found, sampling is reproducible, and bad input gets one clear error.
# Usage: cli_generate.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$SRC/tests/testlib.sh"
ulimit -c 0

head -c 30000 "$SRC/data/default_corpus.txt" > "$W/corpus.txt"
TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_kv_heads=2 --model.n_experts=4
      --model.ffn_dim=32 --model.max_seq_len=128 --training.seq_len=32 --training.micro_batch=4
      --training.warmup_steps=2 --training.lr=1e-2 --logging.progress=false --training.threads=2)
# a few steps from a wide init: diverse tokens (a model that repeats one token would hide a difference)
"$TERA" train "${TINY[@]}" --model.init_std=0.5 --data.path="$W/corpus.txt" --training.steps=3 --logging.run_dir="$W/run" \
    --training.precision=fp32 --logging.sample_every=2 --logging.sample_prompt="All:" --logging.sample_tokens=20 \
    > "$W/train.log" 2>&1 || { fail "train"; cat "$W/train.log"; }
CK=$(ls -d "$W"/run/checkpoints/step_* | tail -n 1)
G=(--training.threads=2)
printf 'First Citizen:\nAll:\nSecond Citizen:\n' > "$W/prompts.txt"

# 1. cached == uncached (greedy), batch 1 and 3, JSON lines
"$TERA" generate "${G[@]}" --from "$W/run" --prompts "$W/prompts.txt" --max-new-tokens 40 --json > "$W/c1.jsonl" 2> "$W/c1.err" \
    || { fail "generate"; cat "$W/c1.err"; }
"$TERA" generate "${G[@]}" --from "$W/run" --prompts "$W/prompts.txt" --max-new-tokens 40 --json --no-cache > "$W/u1.jsonl" 2> /dev/null
"$TERA" generate "${G[@]}" --from "$W/run" --prompts "$W/prompts.txt" --max-new-tokens 40 --json --batch 3 > "$W/c3.jsonl" 2> /dev/null
[ "$(wc -l < "$W/c1.jsonl")" = 3 ] && [ "$(jq '.tokens | length' "$W/c1.jsonl" | sort -u)" = 40 ] \
    && pass "3 prompts, 40 new tokens each" || { fail "generate output"; cat "$W/c1.jsonl" "$W/c1.err"; }
toks() { jq -c '.tokens' "$1"; }
[ -s "$W/c1.jsonl" ] && [ "$(toks "$W/c1.jsonl")" = "$(toks "$W/u1.jsonl")" ] && pass "KV cache == full recomputation (greedy)" \
    || fail "cached and uncached tokens differ"
[ "$(toks "$W/c1.jsonl")" = "$(toks "$W/c3.jsonl")" ] && pass "batch 3 == batch 1" || fail "batched tokens differ"
grep -q 'tokens/s' "$W/c1.err" && pass "tokens/s on stderr" || fail "no tokens/s"
# samples while training (logging.sample_every = 2 of 3 steps): one at step 2 (0-based 1), on stderr and in
# metrics.jsonl; the last weights' sample is what tera generate writes from the final checkpoint
[ "$(grep -c '"sample"' "$W/run/metrics.jsonl")" = 1 ] && [ "$(grep '"sample"' "$W/run/metrics.jsonl" | jq .step)" = 1 ] \
    && grep -q '^step      2 | sample: All:' "$W/train.log" && pass "logging.sample_every: stderr and metrics.jsonl" \
    || { fail "training samples"; grep sample "$W/run/metrics.jsonl" "$W/train.log"; }
"$TERA" train "${TINY[@]}" --model.init_std=0.5 --data.path="$W/corpus.txt" --training.steps=2 --logging.run_dir="$W/run2" \
    --training.precision=fp32 --logging.sample_every=2 --logging.sample_prompt="All:" --logging.sample_tokens=20 \
    > "$W/train2.log" 2>&1 || fail "train 2 steps"
"$TERA" generate "${G[@]}" --from "$W/run2" --prompt "All:" --max-new-tokens 20 --json > "$W/g2.jsonl" 2> /dev/null
[ -n "$(jq -r .completion "$W/g2.jsonl")" ] && [ "$(grep '"sample"' "$W/run2/metrics.jsonl" | jq .sample)" = "$(jq .completion "$W/g2.jsonl")" ] \
    && pass "the step-2 sample is tera generate's continuation from the step-2 checkpoint" || fail "sample != generate"

# 2. sampling: reproducible for a seed, cached == uncached, independent of the batch
S=(--temperature 0.9 --top-k 20 --top-p 0.95 --seed 7 --max-new-tokens 30 --json)
"$TERA" generate "${G[@]}" --from "$W/run" --prompts "$W/prompts.txt" "${S[@]}" > "$W/s1.jsonl" 2> /dev/null
"$TERA" generate "${G[@]}" --from "$W/run" --prompts "$W/prompts.txt" "${S[@]}" --no-cache > "$W/s2.jsonl" 2> /dev/null
"$TERA" generate "${G[@]}" --from "$W/run" --prompts "$W/prompts.txt" "${S[@]}" --batch 2 > "$W/s3.jsonl" 2> /dev/null
"$TERA" generate "${G[@]}" --from "$W/run" --prompts "$W/prompts.txt" "${S[@]/--seed 7/}" --seed 8 > "$W/s4.jsonl" 2> /dev/null
[ -s "$W/s1.jsonl" ] && [ "$(toks "$W/s1.jsonl")" = "$(toks "$W/s2.jsonl")" ] && [ "$(toks "$W/s1.jsonl")" = "$(toks "$W/s3.jsonl")" ] \
    && pass "sampling: cached == uncached == batched for one seed" || fail "sampled tokens differ"
[ "$(toks "$W/s1.jsonl")" != "$(toks "$W/c1.jsonl")" ] && [ "$(toks "$W/s1.jsonl")" != "$(toks "$W/s4.jsonl")" ] \
    && pass "sampling differs from greedy and across seeds" || fail "sampling did not sample"

# 3. the same model as a checkpoint directory and as a Hugging Face export; --prompt and stdin
"$TERA" export-hf --from "$CK" --out "$W/hf" > /dev/null 2>&1 || fail "export-hf"
"$TERA" generate "${G[@]}" --from "$CK" --prompts "$W/prompts.txt" --max-new-tokens 40 --json > "$W/ck.jsonl" 2> /dev/null
"$TERA" generate "${G[@]}" --from "$W/hf" --prompts "$W/prompts.txt" --max-new-tokens 40 --json > "$W/hf.jsonl" 2> /dev/null
[ "$(toks "$W/ck.jsonl")" = "$(toks "$W/c1.jsonl")" ] && [ "$(toks "$W/hf.jsonl")" = "$(toks "$W/c1.jsonl")" ] \
    && pass "run dir == checkpoint == HF export" || fail "sources differ"
# --prompt and stdin: the prompt, then the tokens' bytes as they come (bytes tokenizer), then a newline
{ printf 'All:'; for t in $(jq -r 'select(.prompt == "All:") | .tokens[]' "$W/c1.jsonl"); do printf "\\$(printf %03o "$t")"; done
  printf '\n'; } > "$W/want.txt"
"$TERA" generate "${G[@]}" --from "$W/run" --prompt "All:" --max-new-tokens 40 > "$W/p.txt" 2> /dev/null
cmp -s "$W/p.txt" "$W/want.txt" && pass "--prompt streams the prompt and its continuation" || fail "--prompt text"
printf 'All:\n' | "$TERA" generate "${G[@]}" --from "$W/run" --max-new-tokens 40 > "$W/p.txt" 2> /dev/null
cmp -s "$W/p.txt" "$W/want.txt" && pass "prompts from stdin" || fail "stdin prompt"

# 4. a run whose data has a BPE tokenizer: found next to its data (make run's layout); the end-of-document token stops
mkdir -p "$W/data"
"$TERA" tokenizer train --input "$W/corpus.txt" --vocab-size 300 --output "$W/data/tokenizer" > /dev/null 2>&1
"$TERA" data prepare --input "$W/corpus.txt" --tokenizer "$W/data/tokenizer" --output "$W/data/corpus" > /dev/null 2>&1
"$TERA" train "${TINY[@]}" --model.vocab_size=300 --data.path="$W/data/corpus" --training.steps=4 --logging.run_dir="$W/bpe" \
    > "$W/bpe.log" 2>&1 || { fail "train (BPE)"; cat "$W/bpe.log"; }
"$TERA" generate "${G[@]}" --from "$W/bpe" --prompt "First Citizen:" --max-new-tokens 5 --json > "$W/bpe.jsonl" 2> "$W/bpe.err"
grep -q "tokenizer $W/data/tokenizer" "$W/bpe.err" && [ "$(jq '.tokens | length' "$W/bpe.jsonl")" -ge 1 ] \
    && pass "the run's tokenizer is found next to its data" || { fail "BPE run's tokenizer"; cat "$W/bpe.err"; }

# 5. bad input: one clear message each, exit status 1
expect_error() { # expect_error NAME PATTERN -- COMMAND...
    local name=$1 pat=$2
    shift 3
    if "$@" > "$W/e.out" 2> "$W/e.err" < /dev/null; then fail "$name: accepted"; return; fi
    if [ "$(grep -c 'error' "$W/e.err")" = 1 ] && grep -q -- "$pat" "$W/e.err" && ! grep -qi 'assert\|abort' "$W/e.err"; then
        pass "$name"
    else
        fail "$name: $(cat "$W/e.err")"
    fi
}
expect_error "empty prompt" "prompt is empty" -- "$TERA" generate --from "$W/run" --prompt ""
long=$(head -c 300 "$W/corpus.txt")
expect_error "prompt longer than the context" "the context holds 128 positions" -- "$TERA" generate --from "$W/run" --prompt "$long"
expect_error "unknown tokenizer directory" "no-such-tok" -- "$TERA" generate --from "$W/run" --prompt "A" --tokenizer "$W/no-such-tok"
cp -r "$W/bpe" "$W/bpe2"
sed -i "s|^path = .*|path = \"$W/elsewhere/corpus\"|" "$W/bpe2/config.ini"
expect_error "checkpoint without tokenizer" "give --tokenizer DIR" -- "$TERA" generate --from "$W/bpe2" --prompt "A"
expect_error "not a model directory" "neither a tera checkpoint" -- "$TERA" generate --from "$W" --prompt "A"
expect_error "no prompt on stdin" "no prompt in standard input" -- "$TERA" generate --from "$W/run"
"$TERA" generate --from "$W/bpe2" --prompt "First" --tokenizer "$W/data/tokenizer" --max-new-tokens 2 > /dev/null 2>&1 \
    && pass "--tokenizer DIR for a run without one" || fail "--tokenizer DIR"

# 6. eval --task on the shipped example file
T="$SRC/tests/fixtures/tasks/tiny.jsonl"
"$TERA" eval "${G[@]}" --from "$W/run" --task "$T" --scores "$W/scores.jsonl" > "$W/task.json" 2> "$W/task.err" \
    || { fail "eval --task"; cat "$W/task.err"; }
items=$(jq '.items' "$W/task.json" 2> /dev/null)
[ "$items" = 8 ] && [ "$(wc -l < "$W/scores.jsonl")" = 8 ] && pass "eval --task: 8 items scored" || fail "eval --task output"
# the accuracy is the count of items whose best summed log-likelihood is the label
acc=$(jq -s '[.[] | (.loglik | index(max)) == .label] | map(if . then 1 else 0 end) | add / length' "$W/scores.jsonl")
within "$(jq '.acc + 1' "$W/task.json")" "$(echo "$acc + 1" | bc -l)" 1e-9 && pass "acc = share of argmax == label" || fail "acc"
"$TERA" eval "${G[@]}" --from "$W/hf" --task "$T" > "$W/task_hf.json" 2> /dev/null
[ -s "$W/task_hf.json" ] && [ "$(jq -c '[.acc, .acc_norm]' "$W/task.json")" = "$(jq -c '[.acc, .acc_norm]' "$W/task_hf.json")" ] \
    && pass "eval --task: run == HF export" || fail "eval --task sources differ"
# --scores: an existing file is refused without --force; the task file itself even with --force (it
# used to be truncated before it was read); a failed evaluation leaves an existing file as it was
cp "$T" "$W/self.jsonl"
expect_error "--scores onto an existing file" "scores.jsonl' already exists; pass --force" -- \
    "$TERA" eval "${G[@]}" --from "$W/run" --task "$T" --scores "$W/scores.jsonl"
expect_error "--scores onto the task file" "is the input" -- \
    "$TERA" eval "${G[@]}" --from "$W/run" --task "$W/self.jsonl" --scores "$W/self.jsonl" --force
cmp -s "$T" "$W/self.jsonl" && pass "the task file is intact" || fail "--scores destroyed the task file"
cp "$W/scores.jsonl" "$W/scores.before"
printf '{"context": "A", "choices": ["b"], "label": 0}\n{"context": "A", "choices": ["b"], "label": 3}\n' > "$W/bad2.jsonl"
"$TERA" eval "${G[@]}" --from "$W/run" --task "$W/bad2.jsonl" --scores "$W/scores.jsonl" --force > /dev/null 2>&1 \
    && fail "a bad task item accepted" || { cmp -s "$W/scores.before" "$W/scores.jsonl" && [ ! -e "$W/scores.jsonl.tmp" ] \
    && pass "a failed eval --task --force keeps the existing --scores file" || fail "failed eval changed --scores"; }
printf '{"context": "A", "choices": ["b"], "label": 3}\n' > "$W/bad.jsonl"
expect_error "task label out of range" "bad.jsonl:1: \"label\"" -- "$TERA" eval --from "$W/run" --task "$W/bad.jsonl"

# several ranks: generate refuses with one message; a training run's samples give a one-time note
if command -v mpirun > /dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
    mpirun --oversubscribe -np 2 "$TERA" generate --from "$W/run" --prompt "A" > /dev/null 2> "$W/mpi.err" \
        && fail "generate under mpirun -np 2 accepted" || {
        [ "$(grep -c 'tera: error: generate runs in one process' "$W/mpi.err")" = 1 ] && pass "generate refuses 2 ranks" \
            || { fail "generate under mpirun"; cat "$W/mpi.err"; }; }
    mpirun --oversubscribe -np 2 "$TERA" train "${TINY[@]}" --training.threads=1 --data.path="$W/corpus.txt" --training.steps=2 \
        --parallel.dp=2 --logging.sample_every=1 --logging.run_dir="$W/mrun" > "$W/mrun.log" 2>&1 || fail "train dp 2"
    [ "$(grep -c 'note: logging.sample_every: training samples need the whole model in one process' "$W/mrun.log")" = 1 ] \
        && ! grep -q '"sample"' "$W/mrun/metrics.jsonl" && pass "samples under 2 ranks: one note, no sample" \
        || { fail "samples under 2 ranks"; cat "$W/mrun.log"; }
else
    echo "skip: mpirun not installed (the several-rank checks)"
fi

# 7. the peer: Hugging Face transformers' MixtralForCausalLM on the exported model (fp32, greedy, with and
#    without its cache): the same 64 tokens for each prompt, every step's logits to 1e-4 of the row's
#    largest; the task's log-likelihoods and predictions
if PY=$(peer_python); then
    "$TERA" generate "${G[@]}" --from "$W/hf" --prompts "$W/prompts.txt" --max-new-tokens 64 --json --logits "$W/lg.bin" \
        > "$W/peer.jsonl" 2> /dev/null || fail "generate --logits"
    if "$PY" "$SRC/bench/generate_peer.py" generate "$W/hf" "$W/peer.jsonl" "$W/lg.bin" --max-new-tokens 64 --rtol 1e-4 \
        > "$W/peer.json" 2> "$W/peer.err"; then
        pass "transformers generate == tera generate: $(jq -c '{steps_compared, worst_logit_rel_diff}' "$W/peer.json")"
    else
        fail "transformers generate differs"; cat "$W/peer.json" "$W/peer.err"
    fi
    if "$PY" "$SRC/bench/generate_peer.py" task "$W/hf" "$T" "$W/scores.jsonl" --rtol 1e-4 > "$W/ptask.json" 2> "$W/ptask.err" \
        && [ "$(jq -c '[.acc, .acc_norm]' "$W/ptask.json")" = "$(jq -c '[.acc, .acc_norm]' "$W/task.json")" ]; then
        pass "transformers task scores == tera eval --task: $(jq -c '{acc, acc_norm, worst_loglik_rel_diff}' "$W/ptask.json")"
    else
        fail "task scores differ from transformers"; cat "$W/ptask.json" "$W/ptask.err"
    fi
else
    echo "skip: python peers unavailable (scripts/install-peers.sh): transformers comparison not run"
fi

finish cli_generate
