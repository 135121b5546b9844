#!/usr/bin/env bash
# Online tokenization throughput (data.tokenizer, docs/DATA.md): tokens/s of tera's start-up encoding
# on 1 and 2 worker threads against Hugging Face `tokenizers` (PyPI, the peers' venv:
# scripts/install-peers.sh) encoding the same documents with the same GPT-2 files (encode_batch, 1 and
# 2 Rayon threads). Documents: the paragraphs of the corpus, repeated REPEAT times, as JSON lines. The
# encoding time alone is compared (tera's "encoding S s" of its start-up line; tokenizers' encode_batch
# call), median of RUNS runs. Both must produce the same number of ids (checked).
# Usage: bench/online_tokenize.sh [TERA] [CORPUS]   (REPEAT=8 RUNS=3 TOKENIZER=../shared/data/gpt2)
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
            --data.tokenize_workers=$w --logging.run_dir= 2>&1 | grep "online tokenization" |
            sed 's/.*documents, \([0-9]*\) tokens.*encoding \([0-9.]*\) s.*/\1 \2/'
    done > "$W/tera$w"
    ntok=$(head -1 "$W/tera$w" | cut -d' ' -f1)
    s=$(cut -d' ' -f2 "$W/tera$w" | median)
    awk -v n="$ntok" -v s="$s" -v w=$w 'BEGIN { printf "tera       %d worker(s): %9.0f tokens/s (%d tokens in %.3f s)\n", w, n / s, n, s }'
done
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
