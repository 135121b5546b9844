#!/usr/bin/env bash
# Decoding speed of `tera generate` against Hugging Face transformers' generate on the same CPU, in one
# run (docs/GENERATE.md): greedy, fp32, KV cache on both sides, batch 1 and 8, THREADS threads each.
#
# The model: the quickstart shape (configs/quickstart.ini: D 128, L 4, H 4, E 8, k 2, F 256) with the
# 256-byte vocabulary, trained STEPS steps on the default corpus (speed does not depend on the
# weights), exported with `tera export-hf`. Each side decodes NEW tokens after 8 prompts of the corpus
# (batch 1: one prompt after another; batch 8: all eight together); tokens/s counts the new tokens over
# the decode steps only (tera: its own prefill/decode split; transformers: generate's time less one
# forward over the prompts). REPEAT runs per point, the best kept (the machine may be shared).
# Usage: bench/generate.sh [TERA]   (env: THREADS=1 NEW=64 REPEAT=3 STEPS=20; writes
#        bench/results/generate.jsonl and prints a markdown table)
set -eu
TERA=${1:-build/tera}
THREADS=${THREADS:-1}
NEW=${NEW:-64}
REPEAT=${REPEAT:-3}
STEPS=${STEPS:-20}
cd "$(dirname "$0")/.."
PY=$(scripts/install-peers.sh) || { echo "bench/generate.sh: the Python peers are needed (scripts/install-peers.sh)" >&2; exit 1; }
mkdir -p bench/results
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
export OMP_WAIT_POLICY=PASSIVE

"$TERA" train -c configs/quickstart.ini --model.vocab_size=256 --data.path="" --training.steps="$STEPS" \
    --training.warmup_steps=2 --training.eval_every=0 --training.precision=fp32 --training.threads="$THREADS" \
    --logging.progress=false --logging.run_dir="$W/run" > "$W/train.log" 2>&1 || { cat "$W/train.log"; exit 1; }
"$TERA" export-hf --from "$W/run/checkpoints/step_$(printf %08d "$STEPS")" --out "$W/hf" > /dev/null 2>&1
# 8 prompts of 16 bytes (lines of the corpus)
grep -v '^$' data/default_corpus.txt | awk 'length($0) >= 16 { print substr($0, 1, 16) }' | head -n 8 > "$W/prompts.txt"

out=bench/results/generate.jsonl
: > "$out"
best() { sort -g | tail -n 1; }
for B in 1 8; do
    for r in $(seq "$REPEAT"); do
        "$TERA" generate --from "$W/hf" --prompts "$W/prompts.txt" --max-new-tokens "$NEW" --batch "$B" \
            --training.threads="$THREADS" --json > /dev/null 2> "$W/t.err"
        sed -n 's/.*generated \([0-9]*\) tokens in \([0-9.]*\) s: \([0-9.]*\) tokens\/s.*/\3/p' "$W/t.err"
    done | best > "$W/tera_$B"
    for r in $(seq "$REPEAT"); do
        "$PY" bench/generate_peer.py bench "$W/hf" --batch "$B" --prompt-len 16 --new "$NEW" --threads "$THREADS" \
            | jq -r .decode_tokens_per_s
    done | best > "$W/hf_$B"
    printf '{"batch": %d, "threads": %d, "new_tokens": %d, "tera_tokens_per_s": %s, "transformers_tokens_per_s": %s}\n' \
        "$B" "$THREADS" "$NEW" "$(cat "$W/tera_$B")" "$(cat "$W/hf_$B")" >> "$out"
done
echo "| batch | tera generate (tokens/s) | transformers generate (tokens/s) | ratio |"
echo "|------:|-------------------------:|---------------------------------:|------:|"
jq -r '"| \(.batch) | \(.tera_tokens_per_s | floor) | \(.transformers_tokens_per_s | floor) | \((.tera_tokens_per_s / .transformers_tokens_per_s) * 100 | floor / 100) |"' "$out"
echo "($(grep 'model name' /proc/cpuinfo | head -n 1 | cut -d: -f2 | sed 's/^ //'), $THREADS thread(s), $NEW new tokens, best of $REPEAT; $out)"
