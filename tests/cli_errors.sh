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
expect_error "missing data file" "missing.txt" -- "$TERA" train --data.path="$W/missing.txt" --logging.run_dir="$W/r0"
: > "$W/empty.txt"
expect_error "empty data file" "empty.txt" -- "$TERA" train --data.path="$W/empty.txt" --logging.run_dir="$W/r1"
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

# ---- tokenizer and data preparation (issue 12) ----

# ---- configuration, command line, Hugging Face interchange (issue 12) ----

# ---- multi-rank start-up and hangs (issue 12) ----

echo "cli_errors: $fails failed"
[ "$fails" = 0 ]
