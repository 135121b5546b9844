#!/usr/bin/env bash
# Bad input through the command line: one clear message naming the culprit, a non-zero exit, no
# crash, nothing existing overwritten. Usage: cli_errors.sh TERA SOURCE_DIR
set -u
TERA=$1
. "$(dirname "$0")/testlib.sh"
# expect_error NAME PATTERN -- command...: exit status 1 (not a signal) and PATTERN in stderr
expect_error() {
    local name=$1 pat=$2
    shift 3
    "$@" > "$W/out" 2> "$W/err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 128 ]; then
        echo "FAIL: $name: exit $rc"; fails=$((fails + 1)); cat "$W/err"; return
    fi
    if ! grep -q -- "$pat" "$W/err"; then
        echo "FAIL: $name: message lacks '$pat':"; cat "$W/err"; fails=$((fails + 1)); return
    fi
    [ "$(grep -c 'tera: error' "$W/err")" -le 1 ] || { echo "FAIL: $name: more than one error line"; fails=$((fails + 1)); return; }
    echo "ok: $name: $(head -1 "$W/err")"
}

expect_error "missing config" "nope.ini" -- "$TERA" train -c "$W/nope.ini"
printf '[model]\ndimm = 3\n' > "$W/bad1.ini"
expect_error "unknown key" "dimm" -- "$TERA" train -c "$W/bad1.ini"
printf '[modle]\ndim = 3\n' > "$W/bad2.ini"
expect_error "unknown section" "modle" -- "$TERA" train -c "$W/bad2.ini"
printf '[model]\ndrop_policy = random\n' > "$W/bad3.ini"
expect_error "bad enum" "position" -- "$TERA" train -c "$W/bad3.ini"
printf '[training]\nsteps = 12abc\n' > "$W/bad4.ini"
expect_error "bad int" "steps" -- "$TERA" train -c "$W/bad4.ini"
printf 'this is not ini\n' > "$W/bad5.ini"
expect_error "syntax error" "bad5.ini" -- "$TERA" train -c "$W/bad5.ini"
expect_error "bad override" "lr" -- "$TERA" train --training.lr=fast
expect_error "unknown override" "training.nope" -- "$TERA" train --training.nope=1
expect_error "cross-field" "n_heads" -- "$TERA" train --model.dim=30 --model.n_heads=4
expect_error "fp16 sums under fp16" "grad_compression" -- "$TERA" train --training.precision=fp16 --parallel.grad_compression=fp16
expect_error "missing data file" "missing.txt" -- "$TERA" train --data.path="$W/missing.txt" --logging.run_dir="$W/r0"
: > "$W/empty.txt"
expect_error "empty data file" "empty.txt" -- "$TERA" train --data.path="$W/empty.txt" --logging.run_dir="$W/r1"
# a FIFO (or device) as data is refused at once, not waited on for a writer
mkfifo "$W/fifo.txt"
expect_error "a FIFO as data.path" "is not a regular file" -- timeout 30 "$TERA" train --data.path="$W/fifo.txt" --logging.run_dir="$W/r1f"
expect_error "a FIFO as data prepare's input" "is not a regular file" -- timeout 30 "$TERA" data prepare --input "$W/fifo.txt" --output "$W/fifo_ds" --tokenizer bytes
# a model that cannot fit the host is refused before anything is allocated or created, with the
# planner's own figure (tera plan --dry-run's total for the rank, read by field name)
HUGE=(--model.dim=32 --model.n_heads=2 --model.ffn_dim=32 --model.n_experts=100000000 --training.warmup_steps=1)
expect_error "model larger than the host" "training.memory_check = false" -- "$TERA" train "${HUGE[@]}" --logging.run_dir="$W/huge"
want=$("$TERA" plan --dry-run "${HUGE[@]}" --json 2> /dev/null | jq '.roles[0].total / 1073741824 * 100 | round / 100')
if [ -e "$W/huge" ]; then
    echo "FAIL: the refused run created its run directory"; fails=$((fails + 1))
elif [ -n "$want" ] && grep -q "needs $(printf '%.2f' "$want") GiB on the host of world rank 0 (1 rank;" "$W/err"; then
    echo "ok: the refusal names the planner's $want GiB and creates nothing"
else
    echo "FAIL: memory refusal figure (plan says $want GiB): $(cat "$W/err")"; fails=$((fails + 1))
fi
# sizes whose byte counts would overflow 64 bits (model.dim = 1e9: 1.6e19 parameters) are refused by the
# configuration check, before the parameter table or the memory check multiply them (the sanitizer build
# reported the signed overflow there, tera/src/parallel/plan_mem.c, before this check)
expect_error "a model beyond 64-bit byte counts" "model.dim = 1000000000" -- "$TERA" train --model.dim=1000000000 --logging.run_dir="$W/big"
grep -q "runtime error" "$W/err" && { echo "FAIL: overflow reported by the sanitizer"; fails=$((fails + 1)); }
expect_error "its plan too" "beyond the 7.21e+16" -- "$TERA" plan --dry-run --model.dim=1000000000
expect_error "a micro-batch beyond 64-bit byte counts" "training.micro_batch x training.seq_len = 1000000000 x 1000000000" -- \
    "$TERA" train --model.max_seq_len=1000000000 --training.seq_len=1000000000 --training.micro_batch=1000000000 --logging.run_dir="$W/big2"
grep -q "runtime error" "$W/err" && { echo "FAIL: overflow reported by the sanitizer"; fails=$((fails + 1)); }
[ -e "$W/big" ] || [ -e "$W/big2" ] && { echo "FAIL: a refused run created its run directory"; fails=$((fails + 1)); }
# more compute threads than any host runs: the key's range, not the OpenMP runtime's failure to create them
expect_error "training.threads beyond its range" "training.threads" -- "$TERA" train --training.threads=40000 --logging.run_dir="$W/thr"
[ -e "$W/thr" ] && { echo "FAIL: the refused run created its run directory"; fails=$((fails + 1)); }
printf 'abc' > "$W/odd.u16"
expect_error "odd u16 file" "odd.u16" -- "$TERA" train --data.path="$W/odd.u16" --logging.run_dir="$W/r2"
printf 'MMIDIDX\0\0garbage' > "$W/bad.idx"; : > "$W/bad.bin"
expect_error "corrupt .idx" "bad.idx" -- "$TERA" train --data.path="$W/bad" --data.format=bin --logging.run_dir="$W/r3"
expect_error "missing init_from" "config.json" -- "$TERA" train --training.init_from="$W/nohf" --logging.run_dir="$W/r4"
mkdir -p "$W/hf"
printf '{"model_type": "mixtral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128}' > "$W/hf/config.json"
printf '\x10\x00\x00\x00\x00\x00\x00\x00{"a": 1}' > "$W/hf/model.safetensors"
expect_error "corrupt safetensors" "model.safetensors" -- "$TERA" train --training.init_from="$W/hf" --logging.run_dir="$W/r5"
printf '{"model_type": "mixtral", "hidden_size": "big"}' > "$W/hf/config.json"
expect_error "bad config.json" "hidden_size" -- "$TERA" eval --from "$W/hf"
expect_error "eval without --from" "from" -- "$TERA" eval
expect_error "unknown command" "frobnicate" -- "$TERA" frobnicate
# nothing is created for failed runs and an existing directory keeps its files
mkdir -p "$W/keep"; echo precious > "$W/keep/notes.txt"
expect_error "existing run dir" "already exists" -- "$TERA" train --training.steps=1 --training.warmup_steps=0 --logging.run_dir="$W/keep"
[ "$(cat "$W/keep/notes.txt")" = precious ] && echo "ok: existing file untouched" || { echo "FAIL: file changed"; fails=$((fails + 1)); }
for d in r0 r1 r2 r3 r4 r5; do [ -e "$W/$d" ] && { echo "FAIL: failed run created $d"; fails=$((fails + 1)); }; done

# ---- run directories, checkpoints, resume, metrics (issue 12) ----
# (scratch files r12_*: a tiny model on a 60 kB slice of the corpus, 4 steps, a checkpoint every 2;
# JSON is checked with jq, which scripts/install-deps.sh installs)
head -c 60000 "$2/data/default_corpus.txt" > "$W/r12_corpus.txt"
R12=(--model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --training.seq_len=32
     --training.warmup_steps=1 --logging.progress=false --training.threads=1 --data.path="$W/r12_corpus.txt")
D32=(--model.dim=32 --training.micro_batch=4)   # (a key may be given once: these vary per command)
r12_ok() { echo "ok: $1"; }
r12_fail() { echo "FAIL: $1"; fails=$((fails + 1)); }
# every line of a JSON-lines file is JSON: no torn line, no bare nan (and the file is not empty)
jsonl_ok() { [ -s "$1" ] && jq -e . "$1" > /dev/null 2>&1; }
"$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=4 --checkpoint.every=2 --logging.run_dir="$W/r12_run" > "$W/r12_run.log" 2>&1 || { r12_fail "r12 set-up run"; cat "$W/r12_run.log"; }
# a refused --resume (another model shape) writes nothing: config.ini still records the run's model
cp "$W/r12_run/config.ini" "$W/r12_config.before"
cp "$W/r12_run/metrics.jsonl" "$W/r12_metrics.before"
expect_error "--resume with another model shape" "shape \[256,32\], expected \[256,64\]" -- \
    "$TERA" train "${R12[@]}" --model.dim=64 --training.micro_batch=4 --training.steps=4 --logging.run_dir="$W/r12_run" --resume
cmp -s "$W/r12_config.before" "$W/r12_run/config.ini" && cmp -s "$W/r12_metrics.before" "$W/r12_run/metrics.jsonl" \
    && r12_ok "refused --resume left config.ini and metrics.jsonl as they were" \
    || r12_fail "refused --resume changed the run: $(diff "$W/r12_config.before" "$W/r12_run/config.ini" | head -3)"
# a refused ckpt convert leaves no --out behind (the retry needs no --force), nor changes an existing one
expect_error "ckpt convert to another model shape" "shape \[256,32\], expected \[256,64\]" -- \
    "$TERA" ckpt convert --from "$W/r12_run" --out "$W/r12_cv" --model.dim=64
[ ! -e "$W/r12_cv" ] && r12_ok "refused convert created no --out" || r12_fail "refused convert left: $(ls -A "$W/r12_cv")"
"$TERA" ckpt convert --from "$W/r12_run" --out "$W/r12_cv" > "$W/r12_cv.log" 2>&1 && [ -f "$W/r12_cv/config.ini" ] \
    && "$TERA" ckpt verify "$W/r12_cv/checkpoints/step_00000004" > /dev/null 2>&1 \
    && r12_ok "the retried convert works without --force" || { r12_fail "retried convert"; cat "$W/r12_cv.log"; }
mkdir -p "$W/r12_cv2"; echo '{"step": 0}' > "$W/r12_cv2/metrics.jsonl"
expect_error "ckpt convert --force to another model shape" "shape \[256,32\], expected \[256,64\]" -- \
    "$TERA" ckpt convert --from "$W/r12_run" --out "$W/r12_cv2" --force --model.dim=64
[ "$(ls -A "$W/r12_cv2")" = metrics.jsonl ] && [ "$(cat "$W/r12_cv2/metrics.jsonl")" = '{"step": 0}' ] \
    && r12_ok "refused convert --force kept the old --out" || r12_fail "refused convert --force changed --out: $(ls -A "$W/r12_cv2")"
# ckpt ls / verify of a run whose checkpoints is a file or a dangling link: an error naming it (ls
# printed an empty table); a run without checkpoints at all: ls prints the empty table, as before
mkdir -p "$W/r12_cf" "$W/r12_cl" "$W/r12_cn"
: > "$W/r12_cf/checkpoints"
ln -s "$W/r12_nowhere" "$W/r12_cl/checkpoints"
expect_error "ckpt ls: checkpoints is a file" "r12_cf/checkpoints: not a directory" -- "$TERA" ckpt ls "$W/r12_cf"
expect_error "ckpt ls: checkpoints is a dangling link" "r12_cl/checkpoints: cannot follow the link" -- \
    "$TERA" ckpt ls "$W/r12_cl"
expect_error "ckpt verify: checkpoints is a file" "r12_cf/checkpoints: not a directory" -- "$TERA" ckpt verify "$W/r12_cf"
"$TERA" ckpt ls "$W/r12_cn" > "$W/out" 2> "$W/err" && [ "$(wc -l < "$W/out")" = 1 ] && [ ! -s "$W/err" ] \
    && r12_ok "ckpt ls of a run without checkpoints: the empty table" || r12_fail "ckpt ls without checkpoints: $(cat "$W/err")"
# a directory that is not there: an error naming it (ls printed an empty table, verify "no committed
# checkpoint")
expect_error "ckpt ls: no such directory" "r12_absent: No such file or directory" -- "$TERA" ckpt ls "$W/r12_absent"
expect_error "ckpt verify: no such directory" "r12_absent: No such file or directory" -- "$TERA" ckpt verify "$W/r12_absent"
# a resumed run that had already finished says so (no "final loss 0.0000")
"$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=4 --checkpoint.every=2 --logging.run_dir="$W/r12_run" --resume > "$W/r12_done.log" 2>&1 \
    && grep -q "nothing to train: .* already at step 4 and training.steps = 4" "$W/r12_done.log" \
    && ! grep -q "final loss" "$W/r12_done.log" && r12_ok "--resume of a finished run: $(grep 'nothing to train' "$W/r12_done.log")" \
    || { r12_fail "--resume of a finished run"; cat "$W/r12_done.log"; }
# no run directory: no word of a checkpoint
"$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=1 --logging.run_dir= > "$W/r12_nodir.log" 2>&1 \
    && grep -q "done: 1 steps" "$W/r12_nodir.log" && ! grep -qi "checkpoint" "$W/r12_nodir.log" \
    && r12_ok "logging.run_dir= : $(grep 'done:' "$W/r12_nodir.log")" || { r12_fail "logging.run_dir= message"; cat "$W/r12_nodir.log"; }
# non-finite values are written as null: metrics.jsonl stays JSON; a run that skips every step fails
TERA_FAULT_NAN_STEP=1 "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=4 --checkpoint.every=2 --logging.run_dir="$W/r12_nan" > "$W/r12_nan.log" 2>&1 \
    && jsonl_ok "$W/r12_nan/metrics.jsonl" \
    && [ "$(jq -r 'select(.step == 1 and .loss != null) | .grad_norm' "$W/r12_nan/metrics.jsonl")" = null ] \
    && r12_ok "a NaN gradient is logged as \"grad_norm\": null, every line JSON" \
    || { r12_fail "NaN in metrics.jsonl: $(sed -n 2p "$W/r12_nan/metrics.jsonl" | cut -c1-200)"; tail -3 "$W/r12_nan.log"; }
for f in "$W"/r12_nan/checkpoints/*/state.json "$W"/r12_nan/checkpoints/*/manifest.json; do
    jq -e . "$f" > /dev/null 2>&1 || r12_fail "not JSON: $f"
done
# tera eval of weights whose logits overflow (the final norm at FLT_MAX: finite, so they load): null, not nan
mkdir -p "$W/r12_hf"
cp "$W/r12_run/checkpoints/step_00000004/config.json" "$W/r12_run/checkpoints/step_00000004/model.safetensors" "$W/r12_hf/"
at=$(jq -r '.tensors[] | select(.name == "model.norm.weight") | .byte_range[0]' "$W/r12_run/checkpoints/step_00000004/manifest.json")
for i in $(seq 32); do printf '\xff\xff\x7f\x7f'; done | dd of="$W/r12_hf/model.safetensors" bs=1 seek="$at" conv=notrunc 2> /dev/null
"$TERA" eval --from "$W/r12_hf" --data.path="$W/r12_corpus.txt" --training.seq_len=32 --data.val_fraction=0.1 \
    > "$W/r12_eval.json" 2> "$W/r12_eval.err"
jq -e '.val_loss == null and .val_ppl == null' "$W/r12_eval.json" > /dev/null 2>&1 \
    && r12_ok "eval with an overflowing model prints \"val_loss\": null" \
    || { r12_fail "eval output: $(cat "$W/r12_eval.json")"; cat "$W/r12_eval.err"; }
expect_error "every step skipped (non-finite)" "all 1 steps were skipped" -- \
    env TERA_FAULT_NAN_STEP=0 "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=1 --logging.run_dir="$W/r12_allnan"
# a full disk (/dev/full as metrics.jsonl): the failed write is reported once, by file and error; the
# run ends with an error, its checkpoints complete
cp -r "$W/r12_run" "$W/r12_full"
rm "$W/r12_full/metrics.jsonl"; ln -s /dev/full "$W/r12_full/metrics.jsonl"
expect_error "metrics.jsonl on a full disk" "r12_full/metrics.jsonl: write failed: No space left on device" -- \
    "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=6 --logging.run_dir="$W/r12_full" --resume
[ "$(grep -c "write failed" "$W/err")" = 1 ] && "$TERA" ckpt verify "$W/r12_full/checkpoints/step_00000006" > /dev/null 2>&1 \
    && r12_ok "reported once; the step-6 checkpoint is complete" || { r12_fail "full disk"; cat "$W/err"; }
# a file-size limit (ulimit -f, SIGXFSZ ignored: writes fail with EFBIG) cuts metrics.jsonl mid-line:
# the torn line is removed again, the file stays JSON lines
r12_limit() { (trap '' XFSZ; ulimit -f 24; exec "$@"); }
expect_error "metrics.jsonl past a file-size limit" "metrics.jsonl: write failed: File too large" -- \
    r12_limit "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=60 --logging.run_dir="$W/r12_efbig"
jsonl_ok "$W/r12_efbig/metrics.jsonl" && r12_ok "metrics.jsonl cut back to complete lines ($(wc -l < "$W/r12_efbig/metrics.jsonl") lines)" \
    || r12_fail "torn metrics.jsonl: $(tail -c 100 "$W/r12_efbig/metrics.jsonl")"
# state.json read back on --resume: every count must be one a run could have written. Each case edits
# the step-4 checkpoint's state.json with jq and commits it again (state.json's size and XXH3 in
# manifest.json, then both in COMMIT), so that only the range check can refuse it. Before the
# check: step 1e300 ran an endless run, samples_consumed -5 aborted in the loader (loader.c),
# adam_t -1 trained on NaN and exited 0, step 2.5 was taken as 2.
XXH="$(dirname "$TERA")/tests/tera_xxh3sum"
recommit_state() { # DIR JQ-FILTER
    local d=$1 sz hx msz mhx
    jq "$2" "$d/state.json" > "$d/state.json.new" && mv "$d/state.json.new" "$d/state.json"
    read -r sz hx < <("$XXH" "$d/state.json")
    jq --argjson b "$sz" --arg h "$hx" '.files["state.json"] = {bytes: $b, xxh3: $h}' "$d/manifest.json" > "$d/m.new" \
        && mv "$d/m.new" "$d/manifest.json"
    read -r msz mhx < <("$XXH" "$d/manifest.json")
    sed -i -e "s/^file state.json .*/file state.json $sz $hx/" -e "s/^file manifest.json .*/file manifest.json $msz $mhx/" "$d/COMMIT"
}
if [ -x "$XXH" ]; then
    st_case() { # NAME JQ-FILTER PATTERN
        rm -rf "$W/r12_st"; cp -r "$W/r12_run" "$W/r12_st"; rm -rf "$W/r12_st/checkpoints/step_00000002"
        recommit_state "$W/r12_st/checkpoints/step_00000004" "$2"
        "$TERA" ckpt verify "$W/r12_st/checkpoints/step_00000004" > /dev/null 2>&1 || r12_fail "$1: the edited checkpoint does not verify"
        cp "$W/r12_st/metrics.jsonl" "$W/r12_st.metrics"
        expect_error "--resume with state.json $1" "$3" -- \
            timeout 60 "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=8 --logging.run_dir="$W/r12_st" --resume
        cmp -s "$W/r12_st.metrics" "$W/r12_st/metrics.jsonl" && [ "$(ls "$W/r12_st/checkpoints")" = step_00000004 ] \
            || r12_fail "$1: the refused --resume changed the run"
    }
    st_case "step 1e300" '.step = 1e300' 'state.json: "step" = 1.0000000000000001e+300 is not a whole number in \[0, 9007199254740992\]'
    st_case "step -1" '.step = -1' '"step" = -1 is not a whole number'
    st_case "step 2.5" '.step = 2.5' '"step" = 2.5 is not a whole number'
    st_case "step 2 (the directory is step 4)" '.step = 2' '"step" = 2, but the checkpoint is step 4'
    st_case "adam_t -1" '.adam_t = -1' '"adam_t" = -1 is not a whole number in \[0, 4\]'
    st_case "adam_t 5 > step" '.adam_t = 5' '"adam_t" = 5 is not a whole number in \[0, 4\]'
    st_case "skipped_steps 9" '.skipped_steps = 9' '"skipped_steps" = 9 is not a whole number in \[0, 4\]'
    st_case "samples_consumed -5" '.data.samples_consumed = -5' '"data.samples_consumed" = -5 is not a whole number'
    st_case "samples_consumed 1.5" '.data.samples_consumed = 1.5' '"data.samples_consumed" = 1.5 is not a whole number'
    st_case "seq_len 1e12" '.data.seq_len = 1e12' '"data.seq_len" = 1000000000000 is not a whole number in \[0, 2147483647\]'
    st_case "format_version 9" '.format_version = 9' '"format_version" = 9 is not a whole number in \[1, 2\]'
    st_case "seed -3" '.seed = -3' '"seed" is missing or not a whole number'
    # the edit itself is sound: an unchanged value committed again resumes
    rm -rf "$W/r12_st"; cp -r "$W/r12_run" "$W/r12_st"
    recommit_state "$W/r12_st/checkpoints/step_00000004" '.'
    "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=5 --logging.run_dir="$W/r12_st" --resume > "$W/r12_st.log" 2>&1 \
        && r12_ok "state.json rewritten unchanged and committed again resumes" || { r12_fail "recommitted state.json"; cat "$W/r12_st.log"; }
else
    echo "skip: state.json range checks ($XXH not built)"
fi
# a seed above 2^53 (state.json holds it as a double, rounded): the resume compares it as a double
# (it used to compare the rounded value with the exact seed and refuse the run's own checkpoint)
"$TERA" train "${R12[@]}" "${D32[@]}" --training.seed=1152921504606846977 --training.steps=2 --checkpoint.every=1 \
    --logging.run_dir="$W/r12_seed" > /dev/null 2>&1 \
    && "$TERA" train "${R12[@]}" "${D32[@]}" --training.seed=1152921504606846977 --training.steps=3 \
        --logging.run_dir="$W/r12_seed" --resume > "$W/r12_seed.log" 2>&1 && grep -q "resumed .* at step 2" "$W/r12_seed.log" \
    && r12_ok "--resume with training.seed = 2^60 + 1" || { r12_fail "resume with a seed above 2^53"; grep error "$W/r12_seed.log"; }
# --resume cuts a torn last line (a crash or a full disk in an older run) before appending
cp -r "$W/r12_run" "$W/r12_torn"
printf '{"step": 3, "loss": 5.4' >> "$W/r12_torn/metrics.jsonl"
"$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=6 --logging.run_dir="$W/r12_torn" --resume > "$W/r12_torn.log" 2>&1 \
    && jsonl_ok "$W/r12_torn/metrics.jsonl" && grep -q "metrics.jsonl: removed an incomplete last line" "$W/r12_torn.log" \
    && [ "$(jq -r 'select(.loss) | .step' "$W/r12_torn/metrics.jsonl" | tail -1)" = 5 ] \
    && r12_ok "--resume removed a torn last line of metrics.jsonl and appended whole lines" \
    || { r12_fail "torn line on resume: $(tail -c 300 "$W/r12_torn/metrics.jsonl")"; cat "$W/r12_torn.log"; }
# one process per run directory: a second train (--resume, --force, or a plain start) is refused while a
# run is live, naming its pid, and changes nothing; the same under mpirun on every rank, without a hang
"$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=100000 --checkpoint.every=0 --logging.run_dir="$W/r12_live" \
    > "$W/r12_live.log" 2>&1 &
r12_pid=$!
for i in $(seq 1 300); do [ -s "$W/r12_live/metrics.jsonl" ] && break; sleep 0.1; done
expect_error "--resume while the run is live" "in use by another tera process (pid $r12_pid)" -- \
    "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=4 --checkpoint.every=2 --logging.run_dir="$W/r12_live" --resume
expect_error "--force while the run is live" "in use by another tera process (pid $r12_pid)" -- \
    "$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=4 --checkpoint.every=2 --logging.run_dir="$W/r12_live" --force
expect_error "ckpt convert --force into a live run" "in use by another tera process (pid $r12_pid)" -- \
    "$TERA" ckpt convert --from "$W/r12_run" --out "$W/r12_live" --force
[ -f "$W/r12_live/config.ini" ] && kill -0 $r12_pid 2> /dev/null && n1=$(wc -l < "$W/r12_live/metrics.jsonl") \
    && sleep 0.3 && [ "$(wc -l < "$W/r12_live/metrics.jsonl")" -gt "$n1" ] \
    && r12_ok "the live run goes on, its files in place" || r12_fail "the live run was disturbed"
if command -v mpirun > /dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    timeout 120 mpirun --oversubscribe -np 2 "$TERA" train "${R12[@]}" --model.dim=32 --parallel.dp=2 --training.micro_batch=2 --training.steps=4 \
        --logging.run_dir="$W/r12_live" --force > /dev/null 2> "$W/r12_mpi.err"
    rc=$?
    [ $rc != 0 ] && [ $rc != 124 ] && grep -q "in use by another tera process (pid $r12_pid)" "$W/r12_mpi.err" \
        && [ "$(grep -c 'tera: error' "$W/r12_mpi.err")" = 1 ] \
        && r12_ok "mpirun -np 2 --force into a live run: refused on every rank (rc $rc), one message" \
        || { r12_fail "mpirun into a live run: rc $rc"; cat "$W/r12_mpi.err"; }
fi
kill -9 $r12_pid; wait $r12_pid 2> /dev/null
# a killed holder's lock is stale: the next run takes it over
"$TERA" train "${R12[@]}" "${D32[@]}" --training.steps=2 --logging.run_dir="$W/r12_live" --force > "$W/r12_after.log" 2>&1 \
    && r12_ok "after the holder was killed, --force takes the run directory" || { r12_fail "stale lock"; cat "$W/r12_after.log"; }

# ---- tokenizer and data preparation (issue 12) ----
# (scratch files d12_*; a full disk is simulated by `ulimit -f 4` with SIGXFSZ ignored: a write
# past 4 KiB fails with EFBIG, as root too)
head -c 40000 "$2/data/default_corpus.txt" > "$W/d12_corpus.txt"
: > "$W/d12_empty.txt"
expect_error "tokenizer train: empty input" "d12_empty.txt.*empty" -- \
    "$TERA" tokenizer train --input "$W/d12_empty.txt" --vocab-size 300 --output "$W/d12_tok0"
[ ! -e "$W/d12_tok0" ] && echo "ok: refused training wrote nothing" || { echo "FAIL: d12_tok0 created"; fails=$((fails + 1)); }
printf 'fine text\nbad \xff byte\n' > "$W/d12_latin1.txt"
expect_error "tokenizer train: invalid UTF-8" "d12_latin1.txt.*byte offset 14" -- \
    "$TERA" tokenizer train --input "$W/d12_latin1.txt" --vocab-size 300 --output "$W/d12_tok1"
fulldisk() { (trap '' XFSZ; ulimit -f 4; exec "$@"); }
"$TERA" tokenizer train --input "$W/d12_corpus.txt" --vocab-size 1000 --output "$W/d12_tok" > /dev/null 2>&1 \
    && [ "$(stat -c %s "$W/d12_tok/encoder.json")" -gt 4096 ] || { echo "FAIL: d12 tokenizer setup"; fails=$((fails + 1)); }
cp -r "$W/d12_tok" "$W/d12_tok.orig"
expect_error "tokenizer train --force on a full disk" "encoder.json.*File too large" -- \
    fulldisk "$TERA" tokenizer train --force --input "$W/d12_corpus.txt" --vocab-size 900 --output "$W/d12_tok"
diff -r "$W/d12_tok" "$W/d12_tok.orig" > /dev/null && echo "ok: the old tokenizer survives a full disk" \
    || { echo "FAIL: the old tokenizer changed: $(ls -l "$W/d12_tok")"; fails=$((fails + 1)); }
expect_error "tokenizer train (new directory) on a full disk" "encoder.json.*File too large" -- \
    fulldisk "$TERA" tokenizer train --input "$W/d12_corpus.txt" --vocab-size 900 --output "$W/d12_new/tok"
left=$(ls -d "$W"/d12_tok.tmp* "$W"/d12_new* 2>/dev/null)
[ -z "$left" ] && echo "ok: failed tokenizer writes leave nothing behind" || { echo "FAIL: left behind: $left"; fails=$((fails + 1)); }
printf '{"text": ""}\n\n' > "$W/d12_empty.jsonl"
expect_error "data prepare: only an empty text file" "d12_empty.txt' holds no documents" -- \
    "$TERA" data prepare --input "$W/d12_empty.txt" --output "$W/d12_ds0"
expect_error "data prepare: only an empty JSON document" "d12_empty.jsonl' holds no documents" -- \
    "$TERA" data prepare --input "$W/d12_empty.jsonl" --output "$W/d12_ds0"
expect_error "data prepare: several inputs, all empty" "none of the 2 inputs" -- \
    "$TERA" data prepare --input "$W/d12_empty.txt" "$W/d12_empty.jsonl" --output "$W/d12_ds0"
[ -z "$(ls "$W"/d12_ds0* 2>/dev/null)" ] && echo "ok: refused prepares wrote nothing" || { echo "FAIL: d12_ds0 files left"; fails=$((fails + 1)); }
expect_error "data prepare: a missing file among several" "cannot open input.*d12_nope.txt" -- \
    "$TERA" data prepare --input "$W/d12_corpus.txt" "$W/d12_nope.txt" --output "$W/d12_ds0"
expect_error "data prepare: --input without a file" "needs a value" -- "$TERA" data prepare --output "$W/d12_ds0" --input
expect_error "data prepare: --input followed by an option" "needs a file before '--output'" -- \
    "$TERA" data prepare --input --output "$W/d12_ds0"

expect_error "decode --allow-special" "applies to encode" -- "$TERA" tokenizer decode --tokenizer "$W/nope" --allow-special
printf '7 300\n' > "$W/ids300.txt"
expect_error "decode: a byte id past 255" "token id 300 is not in 0..255" -- \
    bash -c '"$1" tokenizer decode --tokenizer bytes < "$2"' _ "$TERA" "$W/ids300.txt"
# the first bad id in order is named: one past the vocabulary before a huge or a negative one (the
# later one was named: the vocabulary was checked only after every id was read)
printf '5 1000 99999999999\n' > "$W/ids_bad.txt"
expect_error "decode: an id past the vocabulary, then a huge one" "byte 2: token id 1000 is not in 0..999" -- \
    bash -c '"$1" tokenizer decode --tokenizer "$3" < "$2"' _ "$TERA" "$W/ids_bad.txt" "$W/d12_tok"
printf '5 1000 -3\n' > "$W/ids_bad.txt"
expect_error "decode: an id past the vocabulary, then a negative one" "byte 2: token id 1000 is not in 0..999" -- \
    bash -c '"$1" tokenizer decode --tokenizer "$3" < "$2"' _ "$TERA" "$W/ids_bad.txt" "$W/d12_tok"

# ---- configuration, command line, Hugging Face interchange (issue 12) ----
# (scratch files c12_*: a tiny model with one dense layer, trained 2 steps on the embedded corpus)
# every subcommand answers --help with its usage on stdout and exit 0
for c in train eval export-hf config bench "data prepare" "tokenizer train" "tokenizer encode" "tokenizer decode" \
         "ckpt ls" "ckpt verify" "ckpt export-hf" "ckpt convert" schedule data tokenizer ckpt; do
    # shellcheck disable=SC2086
    if "$TERA" $c --help > "$W/c12_help" 2>&1 && grep -q "tera $c" "$W/c12_help"; then pass "tera $c --help"
    else fail "tera $c --help: $(head -2 "$W/c12_help")"; fi
done
"$TERA" train -h > "$W/c12_help" 2>&1 && grep -q "tera train" "$W/c12_help" && pass "tera train -h" || fail "tera train -h"
# contradictions and repeats on the command line
expect_error "--resume with --force" "contradict" -- "$TERA" train --resume --force --logging.run_dir="$W/c12_rf"
# a key set twice on the command line: the last value applies (wrapper scripts append "$@" to their
# defaults), with a note naming both; the same value twice says nothing
"$TERA" config --model.dim=64 "--model .dim=32" > "$W/c12_twice" 2> "$W/c12_twice.err" \
    && grep -q '^dim = 32' "$W/c12_twice" \
    && grep -q "note: the command line sets model.dim twice ('--model.dim=64', then '--model .dim=32'): the last one applies" "$W/c12_twice.err" \
    && pass "a key twice on the command line: the last applies, with a note" || fail "a key twice: $(cat "$W/c12_twice.err")"
"$TERA" config --model.dim=64 --model.dim=64 > /dev/null 2> "$W/c12_twice.err" && [ ! -s "$W/c12_twice.err" ] \
    && pass "the same value twice: no note" || fail "same value twice: $(cat "$W/c12_twice.err")"
expect_error "an option twice" "--from is given twice ('.*/a' and '.*/b')" -- "$TERA" eval --from "$W/a" --from "$W/b"
[ -e "$W/c12_rf" ] && fail "a refused command line created its run directory" \
    || pass "refused command lines created nothing"
# a model that no transformers class computes (dense first layer): export-hf refuses it unless --tera-moe
C12=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --model.first_k_dense=1
     --training.seq_len=32 --training.micro_batch=2 --training.warmup_steps=0 --logging.progress=false --training.threads=1)
"$TERA" train "${C12[@]}" --training.steps=2 --logging.run_dir="$W/c12_run" > "$W/c12_run.log" 2>&1 \
    || { fail "c12 set-up run"; cat "$W/c12_run.log"; }
C12CK="$W/c12_run/checkpoints/step_00000002"
expect_error "export-hf of a model transformers cannot compute" "dense first layers" -- \
    "$TERA" export-hf --from "$C12CK" --out "$W/c12_hf_refused"
grep -q -- "--tera-moe" "$W/err" && pass "the refusal names --tera-moe" || fail "the refusal does not name --tera-moe"
expect_error "ckpt export-hf of a model transformers cannot compute" "dense first layers" -- \
    "$TERA" ckpt export-hf "$C12CK" --out "$W/c12_hf_refused"
[ -e "$W/c12_hf_refused" ] && fail "a refused export wrote $W/c12_hf_refused" || pass "a refused export wrote nothing"
grep -Eq '"model_type":[[:space:]]*"tera_moe"' "$C12CK/config.json" && pass "the checkpoint's config.json says tera_moe" \
    || fail "checkpoint config.json: $(grep model_type "$C12CK/config.json")"
"$TERA" export-hf --from "$C12CK" --out "$W/c12_hf" --tera-moe > "$W/c12_exp.log" 2>&1 \
    && grep -Eq '"model_type":[[:space:]]*"tera_moe"' "$W/c12_hf/config.json" \
    && pass "export-hf --tera-moe writes model_type tera_moe" || { fail "export-hf --tera-moe"; cat "$W/c12_exp.log"; }
# never into tera's own directories, --force or not: the checkpoint, the run directory and the run's
# checkpoints/ keep their files as they were (an export there would read as the checkpoint's own)
ls -l "$C12CK" > "$W/c12_ck_before"
expect_error "export-hf --force into a checkpoint" "inside the tera checkpoint" -- \
    "$TERA" export-hf --from "$C12CK" --out "$C12CK" --force --tera-moe --max-shard-bytes 4096
expect_error "export-hf into a directory under a checkpoint" "inside the tera checkpoint" -- \
    "$TERA" export-hf --from "$C12CK" --out "$C12CK/sub/hf" --tera-moe
expect_error "ckpt export-hf --force into a run directory" "is a tera run directory" -- \
    "$TERA" ckpt export-hf "$C12CK" --out "$W/c12_run" --force --tera-moe
expect_error "export-hf into a run's checkpoints/" "inside the run's checkpoint directory" -- \
    "$TERA" export-hf --from "$C12CK" --out "$W/c12_run/checkpoints/hf" --tera-moe
expect_error "ckpt convert into a run's checkpoints/" "inside the run's checkpoint directory" -- \
    "$TERA" ckpt convert --from "$C12CK" --out "$W/c12_run/checkpoints/conv"
ls -l "$C12CK" > "$W/c12_ck_after"
if cmp -s "$W/c12_ck_before" "$W/c12_ck_after" && [ ! -e "$C12CK/sub" ] && [ ! -e "$W/c12_run/model.safetensors" ] \
    && [ "$(ls "$W/c12_run/checkpoints")" = step_00000002 ] && "$TERA" ckpt verify "$C12CK" > /dev/null 2>&1; then
    pass "refused exports and conversions left the checkpoint and the run as they were"
else fail "a refused export or conversion changed $W/c12_run: $(ls "$C12CK" "$W/c12_run" "$W/c12_run/checkpoints")"; fi
# --force over a previous export replaces it whole: no shards of the earlier export stay beside the new files
"$TERA" export-hf --from "$C12CK" --out "$W/c12_hfs" --tera-moe --max-shard-bytes 4096 > /dev/null 2>&1
n_before=$(ls "$W/c12_hfs" | grep -c '^model-.*-of-.*\.safetensors$')
: > "$W/c12_hfs/README.md"
"$TERA" export-hf --from "$C12CK" --out "$W/c12_hfs" --tera-moe --force > /dev/null 2>&1
left=$(ls "$W/c12_hfs" | tr '\n' ' ')
[ "$n_before" -gt 1 ] && [ "$left" = "README.md config.json model.safetensors " ] \
    && pass "--force over a sharded export: $n_before old shards and their index gone, other files kept" \
    || fail "--force over a sharded export left: $left (shards before: $n_before)"
"$TERA" export-hf --from "$C12CK" --out "$W/c12_hfs" --tera-moe --force --max-shard-bytes 4096 > /dev/null 2>&1
[ ! -e "$W/c12_hfs/model.safetensors" ] && [ -e "$W/c12_hfs/model.safetensors.index.json" ] \
    && pass "--force with shards over a single-file export: the old model.safetensors gone" \
    || fail "sharded --force over a single file: $(ls "$W/c12_hfs" | tr '\n' ' ')"
# --from a run directory: its newest committed checkpoint; a checkpoint that does not verify (one
# weight byte changed, the header intact) is refused by export-hf, generate and eval, naming the file
"$TERA" export-hf --from "$W/c12_run" --out "$W/c12_hfr" --tera-moe > "$W/c12_expr.log" 2>&1 \
    && grep -q "exported .*c12_run/checkpoints/step_00000002 ->" "$W/c12_expr.log" \
    && pass "export-hf --from a run directory takes its newest checkpoint" || { fail "export-hf --from RUN"; cat "$W/c12_expr.log"; }
cp -r "$W/c12_run" "$W/c12_bad"
C12BAD="$W/c12_bad/checkpoints/step_00000002"
printf '\x7f' | dd of="$C12BAD/model.safetensors" bs=1 seek=$(( $(stat -c %s "$C12BAD/model.safetensors") - 3 )) conv=notrunc 2> /dev/null
expect_error "export-hf of a checkpoint that does not verify" "model.safetensors: contents differ" -- \
    "$TERA" export-hf --from "$C12BAD" --out "$W/c12_hfbad" --tera-moe
[ -e "$W/c12_hfbad" ] && fail "a refused export of a damaged checkpoint wrote $W/c12_hfbad" || pass "nothing written from the damaged checkpoint"
expect_error "generate from a checkpoint that does not verify" "model.safetensors: contents differ" -- \
    "$TERA" generate --from "$C12BAD" --prompt hi --tokenizer bytes --max-new-tokens 1
expect_error "eval of a checkpoint that does not verify" "differ from the saved state" -- \
    "$TERA" eval --from "$C12BAD" --training.seq_len=32 --training.micro_batch=2 --training.eval_batches=1
# derived defaults follow config.json: without dense_intermediate_size the dense width is top_k x 32 = 64
grep -v '"dense_intermediate_size"' "$W/c12_hf/config.json" > "$W/c12_cfg" && cp "$W/c12_cfg" "$W/c12_hf/config.json"
C12E=(--training.seq_len=32 --training.micro_batch=2 --training.eval_batches=1 --training.threads=1)
"$TERA" eval --from "$W/c12_hf" "${C12E[@]}" > "$W/c12_eval.json" 2> "$W/c12_eval.log" \
    && pass "eval of an HF model without dense_intermediate_size" || { fail "eval without dense_intermediate_size"; cat "$W/c12_eval.log"; }
"$TERA" export-hf --from "$W/c12_hf" --out "$W/c12_hf2" --tera-moe > /dev/null 2>&1 \
    && grep -Eq '"dense_intermediate_size":[[:space:]]*64,' "$W/c12_hf2/config.json" \
    && pass "dense width = top_k x intermediate_size (64)" \
    || fail "dense width: $(grep dense_intermediate_size "$W/c12_hf2/config.json" 2>&1)"
# tera eval runs fp32 unless its own command line says otherwise, and says so
grep -q "^tera eval: precision fp32" "$W/c12_eval.log" && pass "eval says precision fp32" || fail "eval precision line: $(cat "$W/c12_eval.log")"
printf '[training]\nprecision = bf16\n' > "$W/c12_bf16.ini"
"$TERA" eval --from "$W/c12_hf" -c "$W/c12_bf16.ini" "${C12E[@]}" > /dev/null 2> "$W/c12_eval2.log"
grep -q "^tera eval: precision fp32" "$W/c12_eval2.log" && pass "eval ignores a config file's precision" \
    || fail "eval with a bf16 config file: $(grep precision "$W/c12_eval2.log")"
"$TERA" eval --from "$W/c12_hf" --training.precision=bf16 "${C12E[@]}" > /dev/null 2> "$W/c12_eval3.log"
grep -q "^tera eval: precision bf16" "$W/c12_eval3.log" && pass "eval --training.precision=bf16 runs bf16" \
    || fail "eval --training.precision=bf16: $(grep precision "$W/c12_eval3.log")"
# under init_from / --from the model comes from config.json: a contradicting value is refused, naming both
expect_error "--model.dim against config.json" "model.dim = 64 .*hidden_size = 32" -- \
    "$TERA" eval --from "$W/c12_hf" --model.dim=64 "${C12E[@]}"
expect_error "--model.aux_coef against config.json under init_from" "model.aux_coef = 0.5 .*router_aux_loss_coef = 0.01" -- \
    "$TERA" train --training.init_from="$W/c12_hf" --model.aux_coef=0.5 --training.steps=1 --training.warmup_steps=0 \
    --logging.run_dir="$W/c12_r1"
printf '[model]\nn_layers = 3\n' > "$W/c12_model.ini"
expect_error "a config file's model.n_layers against config.json" "model.n_layers = 3 .*num_hidden_layers = 2" -- \
    "$TERA" eval --from "$W/c12_hf" -c "$W/c12_model.ini" "${C12E[@]}"
"$TERA" eval --from "$W/c12_hf" --model.dim=32 "${C12E[@]}" > /dev/null 2>&1 && pass "an agreeing --model.dim passes" \
    || fail "an agreeing --model.dim was refused"
# an HF attention window shorter than the sequences is refused (tera has no sliding-window attention)
mkdir -p "$W/c12_sw" && cp "$W/c12_hf/model.safetensors" "$W/c12_sw/"
sed 's/"sliding_window":[[:space:]]*null/"sliding_window": 16/' "$W/c12_hf/config.json" > "$W/c12_sw/config.json"
expect_error "sliding_window below seq_len" "sliding_window = 16" -- "$TERA" eval --from "$W/c12_sw" "${C12E[@]}"
"$TERA" eval --from "$W/c12_sw" --training.seq_len=16 --training.micro_batch=2 --training.eval_batches=1 > /dev/null 2>&1 \
    && pass "sliding_window >= seq_len is accepted" || fail "sliding_window = seq_len refused"
# a NaN weight is refused at load (naming file and tensor) instead of skipping every step; the
# writer stores tensors sorted by name, so the file's last 4 bytes are model.norm.weight's last element
mkdir -p "$W/c12_nan" && cp "$W/c12_hf/config.json" "$W/c12_hf/model.safetensors" "$W/c12_nan/"
n=$(stat -c %s "$W/c12_nan/model.safetensors")
printf '\000\000\300\177' | dd of="$W/c12_nan/model.safetensors" bs=1 seek=$((n - 4)) conv=notrunc 2> /dev/null
expect_error "init_from with a NaN weight" "model.safetensors: tensor 'model.norm.weight' holds a non-finite value (NaN" -- \
    "$TERA" train --training.init_from="$W/c12_nan" --training.steps=2 --training.warmup_steps=0 \
    --logging.run_dir="$W/c12_r2" "${C12E[@]}"
expect_error "eval --from with a NaN weight" "model.norm.weight" -- "$TERA" eval --from "$W/c12_nan" "${C12E[@]}"
for d in c12_r1 c12_r2; do [ -e "$W/$d" ] && fail "a refused init_from created $d"; done

# ---- the newer features: trace, runs --where, plan --hardware, eval --task (probe s11) ----
S11=("${R12[@]}" "${D32[@]}" --training.steps=2 --logging.registry="$W/s11_reg.db")
# a trace path that is a directory: refused at start (it failed at the end of the run), nothing created
expect_error "logging.trace is a directory" "logging.trace = \"$W\" is a directory" -- \
    "$TERA" train "${S11[@]}" --logging.trace="$W" --logging.run_dir="$W/s11_tr"
[ -e "$W/s11_tr" ] && fail "the refused trace run created its run directory" || pass "refused trace run created nothing"
# a window past the last step: the run succeeds and says the trace holds no step (it said nothing)
"$TERA" train "${S11[@]}" --logging.trace="$W/s11.json" --logging.trace_steps=5:2 --logging.run_dir="$W/s11_tw" \
    > "$W/s11_tw.log" 2>&1 && grep -q "warning: logging.trace_steps: no step of the window \[5, 7) ran" "$W/s11_tw.log" \
    && pass "trace window past the end: $(grep 'trace_steps' "$W/s11_tw.log")" || { fail "trace window past the end"; cat "$W/s11_tw.log"; }
# < and > need a number (a word compared as 0 and matched every run)
expect_error "runs --where with < and a word" "compares numbers; 'abc' is not one" -- \
    "$TERA" runs ls --registry "$W/s11_reg.db" --where "final_loss<abc"
expect_error "runs --where with >>" "compares numbers; '>1' is not one" -- \
    "$TERA" runs ls --registry "$W/s11_reg.db" --where "training.lr>>1"
# directories as files: named as such (a directory opened and read as an empty file before)
expect_error "plan --hardware a directory" "hardware description '$W': Is a directory" -- \
    "$TERA" plan -c "$2/configs/quickstart.ini" --hardware "$W" --devices 2 --global-batch 4
expect_error "eval --task a directory" "--task $W: Is a directory" -- \
    "$TERA" eval --from "$W/r12_run/checkpoints/step_00000004" --task "$W" --tokenizer bytes
# tera bench: its own options as numbers (atoi ran "--warmup abc" as 0 warm-up steps) and a --name that
# would break its JSON line
expect_error "bench --warmup abc" "--warmup 'abc' is not an integer in 0..100000" -- "$TERA" bench "${S11[@]}" --warmup abc
expect_error "bench --threads x" "--threads 'x' is not an integer in 0..4096" -- "$TERA" bench "${S11[@]}" --threads x
expect_error "bench --name with a quote" "--name 'a\"b': no quotes" -- "$TERA" bench "${S11[@]}" --name 'a"b'
expect_error "bench --products -1" "--products '-1' is not an integer in 0..1024" -- "$TERA" bench "${S11[@]}" --products -1
# tera tune: a bad --trials / --parallel (ignored for the file's value before) and a --dir that is a file
# (taken as created, every trial then failed naming logs under it)
printf '[study]\nname = s11\n[space]\ntraining.lr = loguniform 1e-3 1e-2\n' > "$W/s11_search.ini"
expect_error "tune --trials 0" "--trials '0': expected an integer in \[1, 100000\]" -- \
    "$TERA" tune -c "$W/s11_search.ini" --trials 0 --registry "$W/s11_tune.db" --dir "$W/s11_tune"
expect_error "tune --parallel abc" "--parallel 'abc': expected an integer in \[1, 256\]" -- \
    "$TERA" tune -c "$W/s11_search.ini" --parallel abc --registry "$W/s11_tune.db" --dir "$W/s11_tune"
expect_error "tune --dir a file" "s11_search.ini: exists and is not a directory" -- \
    "$TERA" tune -c "$W/s11_search.ini" --trials 1 --registry "$W/s11_tune.db" --dir "$W/s11_search.ini"
[ -e "$W/s11_tune.db" ] || [ -e "$W/s11_tune" ] && fail "a refused tune created its registry or directory" \
    || pass "refused tune runs created nothing"

# ---- multi-rank start-up and hangs (issue 12) ----
# an error every rank finds before the run starts is printed once (by rank 0), not once per rank; a
# stalled rank is named by the others' watchdog (tests/cli_hang.sh)
if command -v mpirun > /dev/null; then
    expect_error "same error on 2 ranks, printed once" "must be divisible by model.n_heads" -- \
        env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 2 \
        "$TERA" train --model.dim=30 --model.n_heads=4
    [ "$(grep -c 'must be divisible by model.n_heads' "$W/err")" = 1 ] && pass "the message appears once" \
        || fail "the message appears $(grep -c 'must be divisible by model.n_heads' "$W/err") times"
    # a set-up error on rank 1 only (its metrics port above 65535): one error line, and rank 0 neither
    # creates the run directory nor, under --force, clears the old run (it removed its checkpoints)
    MPI2=(env ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" OMPI_ALLOW_RUN_AS_ROOT=1
          OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpirun --oversubscribe -np 2 "$TERA" train
          "${S11[@]}" --parallel.dp=2 --checkpoint.every=2)
    expect_error "port above 65535 on rank 1 only" "error (rank 1): logging.metrics_port = 65535" -- \
        "${MPI2[@]}" --logging.metrics_port=65535 --logging.run_dir="$W/s11_mp"
    [ -e "$W/s11_mp" ] && fail "the refused 2-rank run created its run directory" || pass "refused 2-rank run created nothing"
    "${MPI2[@]}" --logging.run_dir="$W/s11_mp" > "$W/s11_mp.log" 2>&1 || { fail "2-rank set-up run"; cat "$W/s11_mp.log"; }
    expect_error "port above 65535 on rank 1 only, --force" "logging.metrics_port = 65535" -- \
        "${MPI2[@]}" --logging.metrics_port=65535 --logging.run_dir="$W/s11_mp" --force
    [ -d "$W/s11_mp/checkpoints/step_00000002" ] && [ -s "$W/s11_mp/metrics.jsonl" ] \
        && pass "a refused --force run left the old run's checkpoints and metrics" \
        || fail "a refused --force run removed the old run: $(ls -A "$W/s11_mp")"
    # an error on one rank only (mpirun's A : B gives the ranks different arguments) is printed by that
    # rank, naming it, and stops the job at once instead of leaving the others waiting for it; two
    # different errors are printed once each
    ok=(--parallel.dp=2 --training.steps=2 --training.warmup_steps=0 --logging.run_dir=)
    bad=(--model.dim=30 --model.n_heads=4)
    for c in "rank 1 only|error (rank 1): config: model.dim (30)|1|${ok[*]}|${ok[*]} ${bad[*]}" \
             "rank 0 only|error: config: model.dim (30)|1|${ok[*]} ${bad[*]}|${ok[*]}" \
             "different errors|error (rank 1): config: model.dim (31)|2|${bad[*]}|--model.dim=31 --model.n_heads=4"; do
        IFS='|' read -r what pat lines a0 a1 <<< "$c"
        # shellcheck disable=SC2086 # the arguments hold no blanks
        timeout 60 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe \
            -np 1 "$TERA" train $a0 : -np 1 "$TERA" train $a1 > "$W/out" 2> "$W/err"
        rc=$?
        if [ $rc = 0 ] || [ $rc = 124 ] || [ $rc -ge 128 ]; then fail "error on $what: exit $rc"; cat "$W/err"
        elif ! grep -qF -- "$pat" "$W/err"; then fail "error on $what: no '$pat'"; cat "$W/err"
        elif [ "$(grep -c 'tera: error' "$W/err")" != "$lines" ]; then fail "error on $what: not $lines error line(s)"; cat "$W/err"
        else pass "error on $what: $(grep -F -- "$pat" "$W/err")"; fi
    done
fi

# ---- bounds on tools whose options were each in range (probe, session 19) ----
# tera schedule: 4096 x 4096 x 4096 asked for 1.6 TB and aborted (schedule.c:97)
expect_error "schedule too large" "is more than 1048576" -- timeout 60 "$TERA" schedule --kind interleaved --pp 4096 --micro 4096 --chunks 4096
# tera sim-failures: a recovery long against the MTBF, or a huge cluster or horizon, ran for days
expect_error "sim-failures: recovery restarts" "would start over about" -- timeout 60 "$TERA" sim-failures --recovery 200000
expect_error "sim-failures: too many failures" "more than 2e8 draws" -- timeout 60 "$TERA" sim-failures --devices 1e9
expect_error "sim-failures: trials" "at most 100000" -- timeout 60 "$TERA" sim-failures --trials 1e9
# no failures: finite figures, valid JSON (mtbf_s and young_s null, not inf; no NaN)
timeout 60 "$TERA" sim-failures --failures 0 --json > "$W/sf0.json" 2>&1 \
    && jq -e '.mtbf_s == null and .young_s == null and .effective_at_daly == 1 and .model_at_daly >= 0.9999' "$W/sf0.json" > /dev/null \
    && echo "ok: sim-failures --failures 0: valid JSON, finite figures" || { echo "FAIL: sim-failures --failures 0: $(cat "$W/sf0.json")"; fails=$((fails + 1)); }

# tera launch: a slot count past int (99999999999 became 1215752191 slots)
expect_error "launch --hosts slots" "SLOTS in 1..65536" -- "$TERA" launch --hosts a:99999999999 -- "$TERA" train
printf 'a slots=99999999999\n' > "$W/hosts.txt"
expect_error "launch --hostfile slots" "hosts.txt:1: host 'a': slots= must be an integer in 1..65536" -- \
    "$TERA" launch --hostfile "$W/hosts.txt" -- "$TERA" train

echo "cli_errors: $fails failed"
[ "$fails" = 0 ]
