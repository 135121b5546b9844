#!/usr/bin/env bash
# TensorBoard event files (logging.tensorboard, src/obs/tensorboard.c), read back by the PyPI
# `tensorboard` package's EventAccumulator (the Python peers' venv, scripts/peers-requirements.txt):
# every scalar of every step equals metrics.jsonl's figure (tags = its keys), validation losses too,
# and every MoE layer's expert-load histogram agrees with its max/mean. The event file's TFRecord
# framing is also checked here byte by byte (lengths and masked CRC32C of every record). A directory
# that cannot be created is an error at start naming the key.
# Usage: cli_tensorboard.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
MODEL=(--model.dim=32 --model.n_layers=3 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --model.first_k_dense=1
       --model.n_shared_experts=1 --model.z_coef=0.001 --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=2
       --training.threads=1 --data.path="$W/c.txt" --data.val_fraction=0.1 --training.eval_every=5 --training.eval_batches=2
       --logging.progress=false --training.precision=fp32 --training.steps=12 --logging.peak_tflops=0.5)
"$TERA" train "${MODEL[@]}" --logging.run_dir="$W/run" --logging.tensorboard="$W/tb" > "$W/run.log" 2>&1 \
    && pass "a run with logging.tensorboard ends normally" || { fail "run"; cat "$W/run.log"; }
ls "$W"/tb/events.out.tfevents.* > /dev/null 2>&1 && pass "event file $(basename "$W"/tb/events.out.tfevents.*)" || fail "no event file"

# the framing, independently of TensorBoard: [u64 len][u32 masked crc32c(len)][data][u32 masked crc32c(data)]
python3 - "$W"/tb/events.out.tfevents.* > "$W/frame.txt" << 'PY'
import struct, sys
def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c ^= x
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF
def mask(c):
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF
d = open(sys.argv[1], "rb").read()
i = n = 0
while i < len(d):
    (ln,) = struct.unpack_from("<Q", d, i)
    (hc,) = struct.unpack_from("<I", d, i + 8)
    assert hc == mask(crc32c(d[i:i + 8])), "length crc of record %d" % n
    data = d[i + 12:i + 12 + ln]
    (dc,) = struct.unpack_from("<I", d, i + 12 + ln)
    assert dc == mask(crc32c(data)), "data crc of record %d" % n
    i += 16 + ln
    n += 1
assert i == len(d) and n > 1
print("%d records, %d bytes, every CRC right" % (n, len(d)))
PY
[ $? = 0 ] && pass "TFRecord framing: $(cat "$W/frame.txt")" || { fail "framing"; cat "$W/frame.txt"; }

PY=$(peer_python) || { echo "skip: python peers unavailable (tensorboard)"; finish cli_tensorboard; exit; }
"$PY" "$(dirname "$0")/tensorboard_check.py" "$W/tb" "$W/run/metrics.jsonl" 1 > "$W/check.txt" 2>&1 \
    && pass "EventAccumulator: $(tail -1 "$W/check.txt")" || { fail "TensorBoard read-back"; tail -5 "$W/check.txt"; }
# model_tflops and mfu (logging.peak_tflops = 0.5: mfu = model_tflops / 0.5) among the tags checked above
jq -e -s '[.[] | select(has("loss"))] | length == 12 and all(.[]; .model_tflops > 0 and ((.mfu - .model_tflops / 0.5) | fabs) < 1e-5)' \
    "$W/run/metrics.jsonl" > /dev/null && grep -q "^tags checked: .* model_tflops mfu" "$W/check.txt" \
    && pass "model_tflops and mfu in metrics.jsonl and TensorBoard" || { fail "model_tflops/mfu"; tail -3 "$W/check.txt"; }
"$PY" -c "
from tensorboard.backend.event_processing import event_accumulator as ea
a = ea.EventAccumulator('$W/tb'); a.Reload(); t = a.Tags()['scalars']
print(' '.join(sorted(x for x in t if x.startswith('hw/'))))" > "$W/hw.txt" 2>&1
grep -q 'hw/rss_bytes' "$W/hw.txt" && grep -q 'hw/mem_available_bytes' "$W/hw.txt" \
    && pass "hardware scalars: $(cat "$W/hw.txt")" || { fail "hardware scalars"; cat "$W/hw.txt"; }

# a directory that cannot be created: an error at start naming the key
: > "$W/file"
"$TERA" train "${MODEL[@]}" --logging.run_dir="$W/bad" --logging.tensorboard="$W/file/tb" > "$W/bad.log" 2>&1
rc=$?
[ $rc != 0 ] && grep -q "logging.tensorboard = \"$W/file/tb\"" "$W/bad.log" && [ ! -e "$W/bad" ] && pass "tensorboard dir under a file: exit $rc, $(grep -m1 error "$W/bad.log")" \
    || { fail "bad tensorboard dir (exit $rc)"; cat "$W/bad.log"; }
finish cli_tensorboard
