#!/usr/bin/env bash
# tera report RUN_DIR (src/cli/cmd_report.c): one self-contained HTML page of a run. A tiny MoE run with
# validation, a skipped step (a NaN gradient) and a loss spike; the page has no script and no external
# resource, its SVG plots hold every step, the heatmap one row per MoE layer, the events and config.
# Then headless Chromium (Debian's chromium) renders it: --dump-dom shows every plot in the DOM, and the
# screenshot is not blank (pixel statistics in tests/png_stats.py). Bad input: a missing run directory or
# one without steps is an error naming the file, and an existing report is left as it was.
# Usage: cli_report.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
RUN=(--model.dim=32 --model.n_layers=3 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --model.first_k_dense=1
     --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=2 --training.steps=40 --training.threads=2
     --data.path="$W/c.txt" --data.val_fraction=0.1 --training.eval_every=10 --training.eval_batches=2 --checkpoint.every=10
     --checkpoint.keep=0 --training.spike_window=8 --training.spike_lr_steps=6 --training.spike_grad_zscore=1e6
     --training.spike_zscore=8 --logging.progress=false --training.precision=fp32 --logging.hardware=true)
# step 5: a NaN gradient (skipped); samples 100..103 (step 25): a loss spike (rolled back to step 20)
TERA_FAULT_NAN_STEP=5 TERA_FAULT_SPIKE_SAMPLE=100 "$TERA" train "${RUN[@]}" --logging.run_dir="$W/run" > "$W/train.log" 2>&1 \
    || { fail "training run"; cat "$W/train.log"; }
grep -q '"event": "loss_spike"' "$W/run/metrics.jsonl" && pass "the run has a loss spike event" || fail "no spike in the run"
"$TERA" report "$W/run" > "$W/report.log" 2>&1 && [ -s "$W/run/report.html" ] && pass "tera report RUN_DIR: $(tail -1 "$W/report.log")" \
    || { fail "tera report"; cat "$W/report.log"; }
"$TERA" report "$W/run" --out "$W/r.html" > /dev/null 2>&1 && cmp -s "$W/r.html" "$W/run/report.html" \
    && pass "--out FILE writes the same page" || fail "--out"
"$TERA" report "$W/run" > /dev/null 2>&1 && pass "the default page is replaced on a second report" || fail "second report"
# --out onto an existing file: refused without --force; never the run's metrics.jsonl (it used to
# become the HTML page)
cp "$W/run/metrics.jsonl" "$W/metrics.before"
if "$TERA" report "$W/run" --out "$W/r.html" > /dev/null 2> "$W/rep.err"; then fail "--out onto an existing file without --force"
else grep -q "already exists; pass --force" "$W/rep.err" && pass "--out onto an existing file: refused without --force" || fail "$(cat "$W/rep.err")"; fi
if "$TERA" report "$W/run" --out "$W/run/metrics.jsonl" --force > /dev/null 2> "$W/rep.err"; then fail "--out onto metrics.jsonl"
else cmp -s "$W/metrics.before" "$W/run/metrics.jsonl" && grep -q "is the input" "$W/rep.err" \
    && pass "--out onto the run's metrics.jsonl: refused even with --force" || fail "--out metrics.jsonl: $(cat "$W/rep.err")"; fi
H="$W/r.html"
grep -qi '<script' "$H" && fail "the page has a script" || pass "no script"
grep -Eo '(src|href)="[^"]*"' "$H" | grep -v '^href="#' > "$W/ext.txt"; grep -Eo 'url\(' "$H" >> "$W/ext.txt"
[ ! -s "$W/ext.txt" ] && pass "self-contained: no external resource" || fail "external resources: $(head -3 "$W/ext.txt")"
n_steps=$(last_fields "$W/run/metrics.jsonl" step | wc -l)
pts=$(awk '/<svg id="plot-loss"/,/<\/svg>/' "$H" | grep 'data-name="loss"' | grep -o '[0-9.]*,[0-9.]*' | wc -l)
[ "$pts" = "$n_steps" ] && pass "the loss line has a point per step ($pts)" || fail "loss points $pts, steps $n_steps"
vals=$(jq -r 'select(.val_loss != null) | .step' "$W/run/metrics.jsonl" | sort -u | wc -l) # a rollback logs some again
vpts=$(awk '/<svg id="plot-loss"/,/<\/svg>/' "$H" | grep 'data-name="validation loss"' | grep -o '[0-9.]*,[0-9.]*' | wc -l)
[ "$vpts" -ge 3 ] && [ "$vpts" = "$vals" ] && pass "validation loss: a point per evaluated step ($vpts)" || fail "validation points $vpts of $vals"
grep -q 'class="event-spike"' "$H" && grep -q 'class="event-skip"' "$H" && pass "the spike and the skipped step are marked on the loss plot" \
    || fail "event marks"
grep -q '<td>loss_spike</td>' "$H" && grep -q '<td>skipped</td>' "$H" && pass "events table lists them" || fail "events table"
grep -q '^\[model\]' "$H" && grep -q 'n_experts = 4' "$H" && pass "config.ini embedded" || fail "config"

# headless Chromium: the DOM and a screenshot
CHROME=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$CHROME" ]; then
    echo "skip: chromium not installed (scripts/install-deps.sh installs it)"
else
    CH=(--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run --user-data-dir="$W/chrome" --hide-scrollbars)
    timeout 120 "$CHROME" "${CH[@]}" --dump-dom "file://$H" > "$W/dom.html" 2> "$W/chrome1.log"
    missing=""
    for id in plot-loss plot-lr plot-grad-norm plot-throughput plot-memory plot-expert-load; do
        grep -q "<svg id=\"$id\"" "$W/dom.html" || missing="$missing $id"
    done
    [ -z "$missing" ] && pass "Chromium DOM: the six plots (loss, LR, grad norm, throughput, memory, expert-load heatmap)" \
        || { fail "plots missing from the DOM:$missing"; tail -3 "$W/chrome1.log"; }
    cells=$(awk '/<svg id="plot-expert-load"/,/<\/svg>/' "$W/dom.html" | grep -c '<rect class="cell"')
    [ "$cells" = $((2 * n_steps)) ] && pass "heatmap: $cells cells (2 MoE layers x $n_steps steps)" || fail "heatmap cells $cells, want $((2 * n_steps))"
    timeout 120 "$CHROME" "${CH[@]}" --window-size=900,2400 --screenshot="$W/shot.png" "file://$H" > /dev/null 2> "$W/chrome2.log"
    if [ -s "$W/shot.png" ]; then
        read -r pw ph frac ncol < <(python3 "$(dirname "$0")/png_stats.py" "$W/shot.png")
        awk -v f="$frac" -v c="$ncol" 'BEGIN { exit !(f > 0.03 && f < 0.9 && c >= 20) }' \
            && pass "screenshot ${pw}x${ph}: $frac of the pixels not white, $ncol colours (not blank)" \
            || fail "screenshot looks blank: $frac non-white, $ncol colours"
    else
        fail "no screenshot"; tail -5 "$W/chrome2.log"
    fi
fi

# bad input
"$TERA" report "$W/nope" > "$W/e1.log" 2>&1
rc=$?
[ $rc != 0 ] && grep -q "$W/nope/metrics.jsonl" "$W/e1.log" && pass "missing run dir: exit $rc, $(head -1 "$W/e1.log")" || fail "missing run dir"
mkdir -p "$W/empty" && : > "$W/empty/metrics.jsonl" && echo keep > "$W/empty/report.html"
"$TERA" report "$W/empty" > "$W/e2.log" 2>&1
rc=$?
[ $rc != 0 ] && grep -q "empty/metrics.jsonl has no step records" "$W/e2.log" && [ "$(cat "$W/empty/report.html")" = keep ] \
    && pass "no steps: exit $rc, the existing report untouched" || fail "empty run (exit $rc)"
"$TERA" report > /dev/null 2>&1 && fail "no argument accepted" || pass "no argument: usage error"
finish cli_report
