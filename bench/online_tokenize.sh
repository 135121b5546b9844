#!/usr/bin/env bash
# Online tokenization throughput (data.tokenizer, docs/DATA.md): tokens/s of tera's encoding on 1 and 2
# worker threads, in the start-up pass (data.stream = false) and streamed during training (the
# default), against Hugging Face `tokenizers` (PyPI, the peers' venv: scripts/install-peers.sh)
# encoding the same documents with the same GPT-2 files (encode_batch, 1 and 2 Rayon threads).
# Documents: the paragraphs of the corpus, repeated REPEAT times, as JSON lines. The encoding time
# alone is compared (tera's "encoding S s" of its start-up or end line; tokenizers' encode_batch call),
# median of RUNS runs. Both must produce the same number of ids (checked for the start-up pass).
# Then the step's consumption: configs/bench-s.ini and bench-m.ini trained STEPS_S / STEPS_M steps on
# the streamed documents (a 4096 / 16384-token BPE trained here on the corpus), 1 and 2 workers:
# tokens/s of the step and the data wait per step from metrics.jsonl (step 0 left out). Last, memory:
# peak RSS (metrics.jsonl) of a tiny model on MEM_CORPUS repeated MEM_REPEAT times, streamed and
# start-up pass.
# Usage: bench/online_tokenize.sh [TERA] [CORPUS]   (REPEAT=8 RUNS=3 TOKENIZER=../shared/data/gpt2
#        STEPS_S=12 STEPS_M=4 MEM_CORPUS=../shared/data/tinyshakespeare.txt MEM_REPEAT=20; SKIP_MEM=1, SKIP_STEP=1)
set -euo pipefail
TERA=${1:-build/tera}
CORPUS=${2:-data/default_corpus.txt}
REPEAT=${REPEAT:-8}
RUNS=${RUNS:-3}
TOK=${TOKENIZER:-../shared/data/gpt2}
. "$(dirname "$0")/../tests/testlib.sh" # $W: a scratch directory removed on exit; peer_python
for i in $(seq "$REPEAT"); do cat "$CORPUS"; echo; done > "$W/corpus.txt"
awk 'BEGIN { RS = "" } { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, "\\t"); gsub(/\n/, "\\n")
     printf "{\"text\": \"%s\"}\n", $0 }' "$W/corpus.txt" > "$W/docs.jsonl"
docs=$(wc -l < "$W/docs.jsonl")
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
echo "corpus: $(du -h "$W/docs.jsonl" | cut -f1) as $docs JSON lines; tokenizer $TOK; median of $RUNS runs"
for w in 1 2; do
    for r in $(seq "$RUNS"); do
        "$TERA" train --model.vocab_size=50304 --model.dim=16 --model.n_layers=1 --model.n_heads=2 --model.n_experts=2 \
            --model.top_k=1 --model.ffn_dim=16 --training.seq_len=64 --training.micro_batch=1 --training.steps=1 \
            --training.warmup_steps=0 --training.threads=1 --data.path="$W/docs.jsonl" --data.tokenizer="$TOK" \
            --data.tokenize_workers=$w --data.stream=false --logging.run_dir= 2>&1 | grep "online tokenization" |
            sed 's/.*documents, \([0-9]*\) tokens.*encoding \([0-9.]*\) s.*/\1 \2/'
    done > "$W/tera$w"
    ntok=$(head -1 "$W/tera$w" | cut -d' ' -f1)
    s=$(cut -d' ' -f2 "$W/tera$w" | median)
    awk -v n="$ntok" -v s="$s" -v w=$w 'BEGIN { printf "tera start-up %d worker(s): %9.0f tokens/s (%d tokens in %.3f s)\n", w, n / s, n, s }'
done
for w in 1 2; do # streamed: a tiny model consuming fast; the encoder's own rate (its end line)
    for r in $(seq "$RUNS"); do
        "$TERA" train --model.vocab_size=50304 --model.dim=16 --model.n_layers=1 --model.n_heads=2 --model.n_experts=2 \
            --model.top_k=1 --model.ffn_dim=16 --training.seq_len=256 --training.micro_batch=16 --training.steps=40 \
            --training.warmup_steps=0 --training.threads=1 --data.path="$W/docs.jsonl" --data.tokenizer="$TOK" \
            --data.tokenize_workers=$w --logging.run_dir= 2>&1 | grep "streaming tokenization (this rank" |
            sed 's/.*documents, \([0-9]*\) tokens.*encoding \([0-9.]*\) s.*/\1 \2/'
    done > "$W/stream$w"
    awk -v w=$w '{ r[NR] = $1 / $2; n[NR] = $1; s[NR] = $2 } END { for (i = 1; i <= NR; i++) for (j = i + 1; j <= NR; j++)
        if (r[j] < r[i]) { t = r[i]; r[i] = r[j]; r[j] = t; t = n[i]; n[i] = n[j]; n[j] = t; t = s[i]; s[i] = s[j]; s[j] = t }
        m = int((NR + 1) / 2); printf "tera streamed %d worker(s): %9.0f tokens/s (%d tokens in %.3f s)\n", w, r[m], n[m], s[m] }' "$W/stream$w"
done
if [ -z "${SKIP_STEP:-}" ]; then # the step's consumption against the streamed encoding
    for cfg in s m; do
        V=$(awk -F= '/^vocab_size/ { gsub(/ /, "", $2); print $2 }' "$(dirname "$0")/../configs/bench-$cfg.ini")
        [ -d "$W/tok$V" ] || "$TERA" tokenizer train --input "$W/corpus.txt" --vocab-size "$V" --output "$W/tok$V" > /dev/null 2>&1
        steps=$([ $cfg = s ] && echo "${STEPS_S:-12}" || echo "${STEPS_M:-4}")
        for w in 1 2; do
            rm -rf "$W/run"
            "$TERA" train --config "$(dirname "$0")/../configs/bench-$cfg.ini" --training.steps="$steps" \
                --data.path="$W/docs.jsonl" --data.tokenizer="$W/tok$V" --data.tokenize_workers=$w \
                --logging.run_dir="$W/run" > "$W/run.log" 2>&1 || { echo "bench-$cfg failed"; tail -3 "$W/run.log"; continue; }
            jq -s -r --arg c "bench-$cfg" --arg w "$w" '[.[] | select(.loss != null and .event == null and .step > 0)] |
                ((map(.tokens_per_s) | add / length) as $tps | (map(.data_wait_s) | add / length) as $dw |
                 (map(.step_s) | add / length) as $st |
                 "\($c) streamed, \($w) worker(s): step \($tps | floor) tokens/s, data wait \($dw * 1000 | . * 1000 | floor / 1000) ms of \($st * 1000 | floor) ms per step (\(length) steps)")' \
                "$W/run/metrics.jsonl"
        done
    done
fi
if [ -z "${SKIP_MEM:-}" ]; then # peak RSS: streamed against the start-up pass on a bigger input
    MEMC=${MEM_CORPUS:-$(dirname "$0")/../../shared/data/tinyshakespeare.txt}
    for i in $(seq "${MEM_REPEAT:-20}"); do cat "$MEMC"; echo; done |
        awk 'BEGIN { RS = "" } { gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, "\\t"); gsub(/\n/, "\\n")
             printf "{\"text\": \"%s\"}\n", $0 }' > "$W/big.jsonl"
    [ -d "$W/tok4096" ] || "$TERA" tokenizer train --input "$W/corpus.txt" --vocab-size 4096 --output "$W/tok4096" > /dev/null 2>&1
    for mode in true false; do
        rm -rf "$W/mem"
        "$TERA" train --model.vocab_size=4096 --model.dim=16 --model.n_layers=1 --model.n_heads=2 --model.n_experts=2 \
            --model.top_k=1 --model.ffn_dim=16 --training.seq_len=256 --training.micro_batch=8 --training.steps=20 \
            --training.warmup_steps=0 --training.threads=1 --data.path="$W/big.jsonl" --data.tokenizer="$W/tok4096" \
            --data.stream=$mode --logging.run_dir="$W/mem" > "$W/mem.log" 2>&1 || { echo "memory run failed"; tail -3 "$W/mem.log"; }
        echo "peak RSS, $(du -h "$W/big.jsonl" | cut -f1) of JSON lines, data.stream=$mode: $(jq -r 'select(.event == "memory") | .peak_rss_mib' "$W/mem/metrics.jsonl") MiB"
    done
fi
PY=$(peer_python) || { echo "skip: python peers unavailable (scripts/install-peers.sh)"; exit 0; }
for w in 1 2; do
    RAYON_NUM_THREADS=$w RAYON_RS_NUM_CPUS=$w TOKENIZERS_PARALLELISM=true "$PY" - "$W/docs.jsonl" "$TOK" "$RUNS" "$ntok" "$w" <<'PY'
import json, sys, time
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
docs_path, tok_dir, runs, want, w = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
docs = [json.loads(l)["text"] for l in open(docs_path, encoding="utf-8")]
tok = Tokenizer(models.BPE.from_file(tok_dir + "/encoder.json", tok_dir + "/vocab.bpe"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    enc = tok.encode_batch(docs)
    times.append(time.perf_counter() - t0)
n = sum(len(e.ids) for e in enc) + len(docs)  # + one end-of-document id per document, as tera packs
s = sorted(times)[(runs - 1) // 2]
print("tokenizers %d thread(s): %9.0f tokens/s (%d tokens in %.3f s)%s" % (w, n / s, n, s,
      "" if n == want else "  MISMATCH: tera has %d tokens" % want))
PY
done
