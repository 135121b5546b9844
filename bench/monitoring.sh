#!/usr/bin/env bash
# The monitoring's cost on the training step (docs/MONITORING.md): `tera bench` on configs/bench-s.ini
# with everything off against everything on, run side by side (off, on, off, on, ...) so that a change
# of the machine's load hits both alike. "On": the Prometheus endpoint (logging.metrics_port) scraped
# by curl every SCRAPE seconds during the whole run, TensorBoard event files (logging.tensorboard) and
# the timeline recording every timed step (logging.trace, trace_steps 0:100000; the file itself is only
# written by tera train), plus the hardware sampling they imply. Per run: the median step time and the
# CPU time per step (process CPU: all threads, the endpoint's included), reported as the median over
# the runs of each side; the endpoint's answer time under the scrapes (median and max of curl's
# time_total). tera bench never writes metrics.jsonl (no run directory), so its cost is in neither side.
# Usage: bench/monitoring.sh [TERA] [PAIRS] [STEPS]   (appends to bench/results/monitoring.jsonl;
#        ORDER=on-first runs each pair's "on" side first, SCRAPE=S the scrape interval, THREADS=N)
set -eu
TERA=${1:-build/tera}
PAIRS=${2:-5}
STEPS=${3:-20}
SCRAPE=${SCRAPE:-1}
THREADS=${THREADS:-$(nproc)}
export OMP_WAIT_POLICY=PASSIVE # CPU time per step: no spinning threads counted
cd "$(dirname "$0")/.."
mkdir -p bench/results
W=$(mktemp -d)
SCRAPER=""
trap '[ -n "$SCRAPER" ] && kill $SCRAPER 2> /dev/null; rm -rf "$W"' EXIT
port() { echo $((20000 + RANDOM % 12000)); }
run() { # run SIDE I -> one JSON line of tera bench in $W/SIDE-I.json
    local side=$1 i=$2 extra=()
    if [ "$side" = on ]; then
        local p; p=$(port)
        extra=(--logging.metrics_port=$p --logging.tensorboard="$W/tb-$i" --logging.trace="$W/trace-$i.json"
               --logging.trace_steps=0:100000)
        ( while :; do curl -s -o /dev/null --max-time 5 -w '%{time_total}\n' "http://127.0.0.1:$p/metrics" >> "$W/scrape.txt" || true
                      sleep "$SCRAPE"; done ) &
        SCRAPER=$!
    fi
    "$TERA" bench -c configs/bench-s.ini --steps "$STEPS" --warmup 1 --threads "$THREADS" "${extra[@]}" \
        > "$W/$side-$i.json" 2> "$W/$side-$i.log" || { echo "bench ($side $i) failed:"; tail -5 "$W/$side-$i.log"; exit 1; }
    if [ -n "$SCRAPER" ]; then kill $SCRAPER 2> /dev/null; wait $SCRAPER 2> /dev/null || true; SCRAPER=""; fi
}
for i in $(seq "$PAIRS"); do
    if [ "${ORDER:-off-first}" = on-first ]; then run on "$i"; run off "$i"; else run off "$i"; run on "$i"; fi
    echo "pair $i: off $(jq -r '"\(.step_ms_median) ms, cpu \(.cpu_ms_per_step) ms"' "$W/off-$i.json"); on $(jq -r '"\(.step_ms_median) ms, cpu \(.cpu_ms_per_step) ms"' "$W/on-$i.json")"
done
med() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
off_ms=$(cat "$W"/off-*.json | jq -r .step_ms_median | med); on_ms=$(cat "$W"/on-*.json | jq -r .step_ms_median | med)
off_cpu=$(cat "$W"/off-*.json | jq -r .cpu_ms_per_step | med); on_cpu=$(cat "$W"/on-*.json | jq -r .cpu_ms_per_step | med)
# per pair: on / off (a pair ran a minute apart, under the same load as far as possible)
pair_ratio=$(for i in $(seq "$PAIRS"); do jq -rn --slurpfile a "$W/off-$i.json" --slurpfile b "$W/on-$i.json" '$b[0].step_ms_median / $a[0].step_ms_median'; done | med)
pair_cpu=$(for i in $(seq "$PAIRS"); do jq -rn --slurpfile a "$W/off-$i.json" --slurpfile b "$W/on-$i.json" '$b[0].cpu_ms_per_step / $a[0].cpu_ms_per_step'; done | med)
n_scr=$(grep -c . "$W/scrape.txt" || true)
scr_med=$(grep . "$W/scrape.txt" | med); scr_max=$(grep . "$W/scrape.txt" | sort -g | tail -1)
line=$(printf '{"bench": "monitoring", "config": "bench-s", "order": "%s", "pairs": %d, "steps": %d, "threads": %d, "load_avg": "%s", "off_step_ms": %s, "on_step_ms": %s, "median_pair_step_ratio": %s, "off_cpu_ms_per_step": %s, "on_cpu_ms_per_step": %s, "median_pair_cpu_ratio": %s, "scrapes": %d, "scrape_interval_s": %s, "scrape_s_median": %s, "scrape_s_max": %s}' \
    "${ORDER:-off-first}" "$PAIRS" "$STEPS" "$THREADS" "$(cut -d' ' -f1-3 /proc/loadavg)" "$off_ms" "$on_ms" "$pair_ratio" "$off_cpu" "$on_cpu" "$pair_cpu" "$n_scr" "$SCRAPE" "${scr_med:-null}" "${scr_max:-null}")
echo "$line" | tee -a bench/results/monitoring.jsonl
# the monitoring's own work per step, timed directly (resolves what the whole steps above cannot)
BM=$(dirname "$TERA")/bench/bench_monitoring
[ -x "$BM" ] && "$BM" -c configs/bench-s.ini --steps 5 --reps 2000 --threads "$THREADS" | tee -a bench/results/monitoring.jsonl
