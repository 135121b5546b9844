#!/usr/bin/env bash
# Checkpoints through the command line: COMMIT/manifest, ckpt ls/verify/export-hf, flipped byte and
# truncated file, differential checkpoints + resume, SIGKILL at a random step and resume, and the
# crash-injection loop over every I/O point of the writer, and a SIGKILL at each unlink of retention.
# Usage: cli_ckpt.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
# (testlib.sh: the scratch directory, pass/fail and last_fields, which `losses` needs: without it
# the SIGKILL trials below compared two empty loss lists)
. "$(dirname "$0")/testlib.sh"
ulimit -c 0

head -c 60000 "$SRC/data/default_corpus.txt" > "$W/corpus.txt"
TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32
      --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=2 --logging.progress=false
      --training.threads=2 --data.path="$W/corpus.txt")
same() { # same final weights and moments
    cmp -s "$1/model.safetensors" "$2/model.safetensors" && cmp -s "$1/optimizer.safetensors" "$2/optimizer.safetensors"
}
losses() { # the last logged loss of every step (a resumed run logs some steps twice)
    last_fields "$1" step loss
}

# 1. layout, ls, verify
"$TERA" train "${TINY[@]}" --training.steps=12 --checkpoint.every=4 --logging.run_dir="$W/a" > "$W/a.log" 2>&1 || { fail "train"; cat "$W/a.log"; }
C="$W/a/checkpoints/step_00000008"
for f in COMMIT manifest.json model.safetensors optimizer.safetensors config.json state.json config.ini; do
    [ -f "$C/$f" ] || fail "missing $f"
done
grep -q '^end$' "$C/COMMIT" && grep -q '"global_shape"' "$C/manifest.json" && grep -q '"byte_range"' "$C/manifest.json" \
    && pass "COMMIT and manifest written" || fail "COMMIT/manifest content"
ls "$W/a/checkpoints" | grep -q tmp && fail "a .tmp directory was left behind" || pass "no .tmp left"
"$TERA" ckpt ls "$W/a" > "$W/ls.txt" && [ "$(grep -c ' full .* yes' "$W/ls.txt")" = 3 ] && pass "ckpt ls" || { fail "ckpt ls"; cat "$W/ls.txt"; }
"$TERA" ckpt verify "$W/a" > /dev/null 2>&1 && pass "ckpt verify clean run" || fail "verify clean"
cp -r "$W/a" "$W/b"
printf '\x55' | dd of="$W/b/checkpoints/step_00000008/optimizer.safetensors" bs=1 seek=5000 conv=notrunc 2> /dev/null
if "$TERA" ckpt verify "$W/b/checkpoints/step_00000008" > "$W/v.txt" 2>&1; then fail "flipped byte not found"
else grep -q "optimizer.safetensors" "$W/v.txt" && pass "flipped byte found and named" || fail "flip message: $(cat "$W/v.txt")"; fi
truncate -s 3000 "$W/b/checkpoints/step_00000012/model.safetensors"
if "$TERA" ckpt verify "$W/b" > "$W/v2.txt" 2>&1; then fail "truncation not found"
else grep -q "model.safetensors: truncated" "$W/v2.txt" && pass "truncated file found and named" || fail "trunc message: $(cat "$W/v2.txt")"; fi
# resume skips the corrupt newest checkpoints and takes the newest intact one
"$TERA" train "${TINY[@]}" --training.steps=12 --checkpoint.every=4 --logging.run_dir="$W/b" --resume > "$W/b.log" 2>&1
grep -q "resumed .* at step 4" "$W/b.log" && same "$W/a/checkpoints/step_00000012" "$W/b/checkpoints/step_00000012" \
    && pass "corrupt checkpoints skipped on resume, result identical" || { fail "resume past corrupt"; cat "$W/b.log"; }
grep -q "warning: skipping checkpoint .*step_00000012: .*step_00000012/model.safetensors: truncated" "$W/b.log" \
    && grep -q "warning: skipping checkpoint .*step_00000008: .*step_00000008/optimizer.safetensors: contents differ" "$W/b.log" \
    && pass "each skipped checkpoint's warning names its damaged file" || { fail "skip warnings"; grep warning "$W/b.log"; }
# a file COMMIT names gone (removed by hand, or a retention cut short): skipped with a warning that
# names the file (it used to be skipped silently, as if it were a save in progress)
cp -r "$W/a" "$W/bm"
rm "$W/bm/checkpoints/step_00000012/optimizer.safetensors"
"$TERA" train "${TINY[@]}" --training.steps=12 --checkpoint.every=4 --logging.run_dir="$W/bm" --resume > "$W/bm.log" 2>&1
grep -q "resumed .* at step 8" "$W/bm.log" \
    && grep -q "warning: skipping checkpoint .*step_00000012: .*step_00000012/optimizer.safetensors: missing" "$W/bm.log" \
    && same "$W/a/checkpoints/step_00000012" "$W/bm/checkpoints/step_00000012" \
    && pass "a checkpoint missing a file COMMIT names: skipped, the warning names the file" || { fail "missing file"; grep -v "^step" "$W/bm.log"; }
# ... and a FIFO in a file's place is not opened for reading (which would block until a writer comes)
cp -r "$W/a" "$W/bf"
rm "$W/bf/checkpoints/step_00000012/model.safetensors"; mkfifo "$W/bf/checkpoints/step_00000012/model.safetensors"
timeout 60 "$TERA" eval --from "$W/bf" --data.path="$W/corpus.txt" --training.seq_len=32 --training.micro_batch=4 > /dev/null 2> "$W/bf.err"
rc=$?
[ $rc = 0 ] && grep -q "skipping checkpoint .*step_00000012/model.safetensors" "$W/bf.err" \
    && pass "a FIFO in place of a checkpoint file: skipped with a warning, no hang" || { fail "FIFO in a checkpoint: rc $rc"; cat "$W/bf.err"; }
rm -f "$W/a/checkpoints/step_00000004/COMMIT"
"$TERA" ckpt ls "$W/a" | grep -q "step_00000004 .* no" && pass "directory without COMMIT listed as not committed" || fail "ls uncommitted"
"$TERA" ckpt export-hf "$C" --out "$W/hf" > /dev/null 2>&1 && cmp -s "$W/hf/model.safetensors" "$C/model.safetensors" \
    && pass "ckpt export-hf" || fail "ckpt export-hf"

# 2. differential checkpoints: restore = full + diff, bit-identical resume
"$TERA" train --checkpoint.full_every=3 "${TINY[@]}" --training.steps=12 --checkpoint.every=4 --checkpoint.keep=0 \
    --logging.run_dir="$W/d" > /dev/null 2>&1
"$TERA" ckpt ls "$W/d" > "$W/dls.txt"
grep -q "step_00000008 .* diff .*base step 4" "$W/dls.txt" && pass "differential checkpoint written" || { fail "diff"; cat "$W/dls.txt"; }
[ -f "$W/d/checkpoints/step_00000008/diff.bin" ] && [ ! -f "$W/d/checkpoints/step_00000008/model.safetensors" ] || fail "diff contents"
rm -rf "$W/d/checkpoints/step_00000012"
"$TERA" train --checkpoint.full_every=3 "${TINY[@]}" --training.steps=12 --checkpoint.every=4 --checkpoint.keep=0 \
    --logging.run_dir="$W/d" --resume > "$W/d.log" 2>&1
grep -q "at step 8" "$W/d.log" && same "$W/d/checkpoints/step_00000012" "$W/a/checkpoints/step_00000012" \
    && pass "resume from a differential checkpoint is bit-identical" || { fail "diff resume"; cat "$W/d.log"; }
"$TERA" ckpt export-hf "$W/d/checkpoints/step_00000008" --out "$W/hf8" > /dev/null 2>&1 \
    && cmp -s "$W/hf8/model.safetensors" "$W/a/checkpoints/step_00000008/model.safetensors" \
    && pass "export-hf of a differential checkpoint" || fail "export-hf diff"
# every command that takes --from or training.init_from reads a differential checkpoint as its full
# twin (run a's step 8): the model from manifest.json's model_config (no config.json of its own),
# the weights from the base + diff. Before: "step_00000008/config.json: cannot open".
DF="$W/d/checkpoints/step_00000008"; AF="$W/a/checkpoints/step_00000008"
EV=(--data.path="$W/corpus.txt" --training.seq_len=32 --training.micro_batch=4)
"$TERA" eval --from "$DF" "${EV[@]}" > "$W/ev_d.json" 2> "$W/ev_d.err" && "$TERA" eval --from "$AF" "${EV[@]}" > "$W/ev_a.json" 2> /dev/null \
    && [ "$(jq -r .val_loss "$W/ev_d.json")" = "$(jq -r .val_loss "$W/ev_a.json")" ] \
    && pass "eval --from a differential checkpoint = its full twin ($(jq -r .val_loss "$W/ev_d.json"))" \
    || { fail "eval --from a differential checkpoint"; cat "$W/ev_d.err"; }
"$TERA" generate --from "$DF" --tokenizer bytes --prompt "To be" --max-new-tokens 12 > "$W/gen_d.txt" 2> "$W/gen_d.err" \
    && "$TERA" generate --from "$AF" --tokenizer bytes --prompt "To be" --max-new-tokens 12 > "$W/gen_a.txt" 2> /dev/null \
    && cmp -s "$W/gen_d.txt" "$W/gen_a.txt" && pass "generate --from a differential checkpoint = its full twin" \
    || { fail "generate --from a differential checkpoint"; cat "$W/gen_d.err"; }
"$TERA" export-hf --from "$DF" --out "$W/hfd8" > /dev/null 2> "$W/hfd8.err" \
    && cmp -s "$W/hfd8/model.safetensors" "$AF/model.safetensors" && cmp -s "$W/hfd8/config.json" "$AF/config.json" \
    && pass "export-hf --from a differential checkpoint" || { fail "export-hf --from a differential checkpoint"; cat "$W/hfd8.err"; }
"$TERA" train "${TINY[@]}" --training.steps=2 --training.init_from="$DF" --logging.run_dir="$W/id" > "$W/id.log" 2>&1 \
    && "$TERA" train "${TINY[@]}" --training.steps=2 --training.init_from="$AF" --logging.run_dir="$W/ia" > /dev/null 2>&1 \
    && same "$W/id/checkpoints/step_00000002" "$W/ia/checkpoints/step_00000002" \
    && pass "training.init_from a differential checkpoint = from its full twin" || { fail "init_from a differential checkpoint"; tail -2 "$W/id.log"; }

# 3. SIGKILL at a random moment (steps or saves), resume, compare with an uninterrupted run
S=200
"$TERA" train "${TINY[@]}" --training.steps=$S --checkpoint.every=7 --logging.run_dir="$W/ref" > /dev/null 2>&1
losses "$W/ref/metrics.jsonl" > "$W/ref.loss"
for trial in 1 2 3; do
    R="$W/k$trial"
    "$TERA" train "${TINY[@]}" --training.steps=$S --checkpoint.every=7 --logging.run_dir="$R" > /dev/null 2>&1 &
    pid=$!
    sleep "0.$((RANDOM % 5 + 1))$((RANDOM % 10))"
    kill -9 $pid 2> /dev/null
    wait $pid 2> /dev/null
    at=$(ls "$R/checkpoints" 2> /dev/null | tail -1)
    if "$TERA" train "${TINY[@]}" --training.steps=$S --checkpoint.every=7 --logging.run_dir="$R" --resume > "$R.log" 2>&1 || \
       { grep -q "no committed checkpoint" "$R.log" && "$TERA" train "${TINY[@]}" --training.steps=$S --checkpoint.every=7 \
             --logging.run_dir="$R" --force > "$R.log" 2>&1; }; then
        losses "$R/metrics.jsonl" > "$R.loss"
        f=$(printf 'step_%08d' $S)
        same "$W/ref/checkpoints/$f" "$R/checkpoints/$f" && [ "$(wc -l < "$R.loss")" = $S ] && cmp -s "$W/ref.loss" "$R.loss" \
            && pass "killed ($at, $(grep -o 'resumed.*' "$R.log" || echo restarted)), resumed: weights and losses identical" \
            || fail "trial $trial differs"
    else
        fail "resume after kill: $(cat "$R.log")"
    fi
done

# 4. crash injection: abort at every I/O point of the writer (sync and async, full and diff saves)
"$TERA" train "${TINY[@]}" --training.steps=6 --checkpoint.every=2 --checkpoint.keep=2 --logging.run_dir="$W/fref" > /dev/null 2>&1
n=1 corrupt=0 wrong=0 aborted=0
while :; do
    R="$W/f$n"
    TERA_CKPT_FAULT=$n "$TERA" train --checkpoint.full_every=2 "${TINY[@]}" --training.steps=6 --checkpoint.every=2 \
        --checkpoint.keep=2 --logging.run_dir="$R" > "$R.log" 2>&1
    rc=$?
    [ $rc = 0 ] && break
    aborted=$((aborted + 1))
    grep -q "TERA_CKPT_FAULT" "$R.log" || { fail "fault $n: rc $rc without the fault message"; cat "$R.log"; break; }
    newest=$("$TERA" ckpt ls "$R" 2> /dev/null | awk '$5 == "yes" {s=$2} END {print s}')
    for d in "$R"/checkpoints/step_????????; do
        [ -f "$d/COMMIT" ] || continue
        "$TERA" ckpt verify "$d" > /dev/null 2>&1 || { corrupt=$((corrupt + 1)); echo "corrupt committed: $d"; }
    done
    "$TERA" train --checkpoint.full_every=2 "${TINY[@]}" --training.steps=6 --checkpoint.every=2 --checkpoint.keep=2 \
        --logging.run_dir="$R" --resume > "$R.r.log" 2>&1
    if [ -n "$newest" ]; then
        grep -q "at step $newest\$" "$R.r.log" || { wrong=$((wrong + 1)); echo "fault $n: newest $newest, $(cat "$R.r.log")"; }
        same "$W/fref/checkpoints/step_00000006" "$R/checkpoints/step_00000006" || { wrong=$((wrong + 1)); echo "fault $n: final differs"; }
    else
        grep -q "no committed checkpoint" "$R.r.log" || { wrong=$((wrong + 1)); echo "fault $n: $(cat "$R.r.log")"; }
    fi
    rm -rf "$R"
    n=$((n + 1))
    [ $n -gt 400 ] && { fail "fault loop did not end"; break; }
done
[ $aborted -gt 20 ] && [ $corrupt = 0 ] && [ $wrong = 0 ] \
    && pass "crash at each of $aborted I/O points: 0 corrupt loads, newest committed checkpoint restored, final weights identical" \
    || fail "crash loop: $aborted points, $corrupt corrupt, $wrong wrong"

# 5. retention is atomic: a SIGKILL at each unlink of a run that prunes (keep=1, a save every 2 steps;
#    strace injects the signal, scripts/install-deps.sh installs it) never leaves a checkpoint that
#    `ckpt ls` lists as committed and `ckpt verify` rejects, and --resume continues from the newest
if command -v strace > /dev/null && strace -o /dev/null true 2> /dev/null; then
    bad=0 killed=0
    for when in 1 2 3 4 5 6 7 8 9 10; do
        R="$W/u$when"
        # (the counts are per thread: each background save and the main thread's final save)
        { strace -f -o /dev/null -e trace=unlink -e inject=unlink:signal=SIGKILL:when=$when "$TERA" train "${TINY[@]}" \
            --training.steps=6 --checkpoint.every=2 --checkpoint.keep=1 --logging.run_dir="$R" > "$R.log" 2>&1; } 2> /dev/null
        rc=$?
        listed=$("$TERA" ckpt ls "$R" 2> /dev/null | awk '$5 == "yes" {print $1}')
        [ $rc != 0 ] && [ -n "$listed" ] && killed=$((killed + 1)) # killed after a checkpoint was committed
        for c in $listed; do
            "$TERA" ckpt verify "$R/checkpoints/$c" > /dev/null 2>&1 || { bad=$((bad + 1)); echo "kill at unlink $when: $c listed as committed, does not verify"; }
        done
        "$TERA" train "${TINY[@]}" --training.steps=6 --checkpoint.every=2 --checkpoint.keep=1 --logging.run_dir="$R" --resume \
            > "$R.r.log" 2>&1
        if [ -z "$listed" ]; then
            grep -q "no committed checkpoint" "$R.r.log" || { bad=$((bad + 1)); echo "kill at unlink $when: $(tail -2 "$R.r.log")"; }
        else
            same "$W/fref/checkpoints/step_00000006" "$R/checkpoints/step_00000006" \
                || { bad=$((bad + 1)); echo "kill at unlink $when: resume: $(tail -2 "$R.r.log")"; }
        fi
    done
    [ $killed -ge 5 ] && [ $bad = 0 ] && pass "SIGKILL at $killed unlinks after a commit: every listed checkpoint verifies, resume identical" \
        || fail "retention kills: $killed killed after a commit, $bad bad"
else
    echo "skip: strace not installed or not allowed to trace (scripts/install-deps.sh installs it)"
fi

echo "cli_ckpt: $fails failed"
[ "$fails" = 0 ]
