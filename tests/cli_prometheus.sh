#!/usr/bin/env bash
# The Prometheus endpoint (logging.metrics_port, docs/MONITORING.md) against a real Prometheus, and the
# alert rules (deploy/prometheus) under promtool. `tera train` serves on a free loopback port chosen
# here; Prometheus (data in the scratch directory) scrapes it every second; its HTTP API shows the
# series with their labels, and every scraped step's values equal that step's line of metrics.jsonl.
# The endpoint answers 404 to another path and 405 to another method, survives raw garbage and a
# client that never finishes its request, and training goes on through all of it; a port in use is
# an error at start naming the port and the key. Under mpirun, both ranks' endpoints (base + rank)
# are scraped. All traffic goes to 127.0.0.1; everything started here is stopped on exit.
# Skips what needs a missing tool (curl, jq: all; prometheus, promtool, mpirun: their parts).
# Usage: cli_prometheus.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
for tool in curl jq; do command -v $tool > /dev/null || { echo "skip: $tool not installed"; exit 0; }; done
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2> /dev/null; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2> /dev/null || break; sleep 0.1; done
        kill -9 "$p" 2> /dev/null
        wait "$p" 2> /dev/null
    done
    rm -rf "$W"
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

# ------------------------------------------------------------------ the alert rules (promtool)
RULES="$(cd "$SRC" && pwd)/deploy/prometheus/tera-alerts.yml" # absolute: Prometheus reads it from its config
if command -v promtool > /dev/null; then
    promtool check rules "$RULES" > "$W/check.log" 2>&1 && pass "promtool check rules: $(grep -o '[0-9]* rules found' "$W/check.log")" \
        || { fail "promtool check rules"; cat "$W/check.log"; }
    promtool test rules "$SRC/deploy/prometheus/tera-alerts.test.yml" > "$W/unit.log" 2>&1 \
        && pass "promtool test rules: every alert fires and stays silent on its synthetic series" \
        || { fail "promtool test rules"; cat "$W/unit.log"; }
else
    echo "skip: promtool not installed (scripts/install-deps.sh installs prometheus)"
fi

# ------------------------------------------------------------------ helpers
# free_port N [TAKEN...]: a base port P with P .. P+N-1 all free on 127.0.0.1 (nothing accepts a connection
# there) and none of them one of TAKEN: ports handed out earlier whose server may not listen yet (drawn
# independently, Prometheus's port and the mpirun job's once coincided, and the job's rank 0 found it in use)
free_port() {
    local n=$1 p i t busy
    shift
    for _ in $(seq 200); do
        p=$((20000 + RANDOM % 12000)); busy=0 # below the ephemeral range (32768-60999)
        for ((i = 0; i < n; i++)); do
            for t in "$@"; do [ $((p + i)) = "$t" ] && busy=1; done
            [ $busy = 1 ] && break
            (exec 3<> "/dev/tcp/127.0.0.1/$((p + i))") 2> /dev/null && { busy=1; break; }
        done
        [ $busy = 0 ] && { echo $p; return 0; }
    done
    return 1
}
http_code() { curl -s -o /dev/null --max-time 5 -w '%{http_code}' "$@"; }
# wait_for SECONDS COMMAND...: polls every 0.2 s until COMMAND succeeds
wait_for() {
    local t=$1; shift
    for _ in $(seq $((t * 5))); do "$@" && return 0; sleep 0.2; done
    return 1
}
scrape() { curl -sf --max-time 5 "http://127.0.0.1:$1/metrics"; }
# the value of an unlabelled-but-rank sample of the endpoint on port $1 (e.g. tera_step)
value_of() { scrape "$1" | awk -v n="$2" '$1 ~ "^" n "\\{" { print $2; exit }'; }
step_of() { value_of "$1" tera_step; }
advanced() { local s; s=$(step_of "$1"); [ -n "$s" ] && [ "$s" -gt "$2" ]; }
prom() { curl -sf --max-time 10 "http://127.0.0.1:$PP/api/v1/$1" "${@:2}"; }
# instant query: one "labels value" line per series
pq() { prom query --data-urlencode "query=$1" | jq -r '.data.result[] | "\(.metric | del(.__name__) | to_entries | map("\(.key)=\(.value)") | join(",")) \(.value[1])"'; }
scrapes_of() { pq "count_over_time(tera_step{job=\"$1\"}[2m])" | awk '{ if ($2 > m) m = $2 } END { print m + 0 }'; }
# scraped JOB N K: at least K targets of JOB scraped at least N times with a step published
scraped() { [ "$(pq "count_over_time(tera_step{job=\"$1\"}[2m]) >= $2" | wc -l)" -ge "$3" ]; }

head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
T=64
# a tiny MoE with a dense first layer and a shared expert (every gradient group), long enough to outlast the checks
MODEL=(--model.dim=32 --model.n_layers=4 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --model.n_shared_experts=1
       --model.first_k_dense=1 --model.z_coef=0.001 --training.seq_len=$T --training.micro_batch=8 --training.warmup_steps=2
       --training.threads=1 --data.path="$W/c.txt" --data.val_fraction=0.1 --training.eval_every=20 --training.eval_batches=2
       --checkpoint.every=200 --checkpoint.keep=1 --logging.progress=false --training.precision=fp32 --logging.peak_tflops=1)
# its model FLOPs per token from the resolved config, by ../shared/spec/BENCH.md's count: 6 x the matrix
# parameters a token passes through (attention, router, top_k routed + shared experts or the dense FFN,
# LM head) + 12 x layers x dim x seq_len (attention scores)
FPT=$("$TERA" config "${MODEL[@]}" 2> /dev/null | awk -F' = ' -v T=$T '
    /^\[/ { sec = $0 } sec == "[model]" && NF == 2 { c[$1] = $2 }
    END { D = c["dim"]; H = c["n_heads"]; K = c["n_kv_heads"] ? c["n_kv_heads"] : H; hd = D / H; L = c["n_layers"]
          for (l = 0; l < L; l++) { a += 2 * D * H * hd + 2 * D * K * hd
              if (l < c["first_k_dense"]) a += 3 * D * c["dense_ffn_dim"]
              else a += c["n_experts"] * D + c["top_k"] * 3 * D * c["ffn_dim"] + 3 * D * c["ffn_dim"] * c["n_shared_experts"] }
          a += c["vocab_size"] * D; printf "%d", 6 * a + 12 * L * D * T }')

# ------------------------------------------------------------------ one rank
P=$(free_port 1) || { fail "no free port"; finish cli_prometheus; exit; }
# a NaN in the gradient of step 3: one skipped step to count
TERA_FAULT_NAN_STEP=3 "$TERA" train "${MODEL[@]}" --training.steps=1000000 --logging.metrics_port=$P --logging.run_dir="$W/run" \
    > "$W/train.log" 2>&1 &
TPID=$!
PIDS+=($TPID)
wait_for 60 scrape $P > /dev/null && pass "endpoint on port $P answers" || { fail "endpoint never answered"; cat "$W/train.log"; }
wait_for 60 advanced $P 0 && pass "training runs (step $(step_of $P))" || fail "no step published"

# the exposition itself: HELP and TYPE for every family, the rank label on every sample
scrape $P > "$W/expo.txt"
awk '/^# TYPE / { t[$3] = $4 } /^# HELP / { h[$3] = 1 } !/^#/ { n = $1; sub(/\{.*/, "", n); b = n
     sub(/_(bucket|sum|count)$/, "", b); if (!(n in t) && !(b in t)) { print "no TYPE: " n; bad = 1 }
     if (!(n in h) && !(b in h)) { print "no HELP: " n; bad = 1 } if ($1 !~ /rank="0"/) { print "no rank: " $1; bad = 1 } }
     END { exit bad }' "$W/expo.txt" && pass "every sample has HELP, TYPE and rank=\"0\" ($(grep -vc '^#' "$W/expo.txt") samples)" \
    || fail "exposition format"
grep -q '^# TYPE tera_step_seconds histogram' "$W/expo.txt" && grep -q '^tera_step_seconds_bucket{rank="0",le="+Inf"}' "$W/expo.txt" \
    && grep -q '^# TYPE tera_tokens_total counter' "$W/expo.txt" && pass "step time is a histogram, tokens a counter" \
    || fail "histogram/counter types"

# errors and abuse: another path, another method, raw garbage, a client that never finishes
[ "$(http_code "http://127.0.0.1:$P/")" = 404 ] && [ "$(http_code "http://127.0.0.1:$P/metricsx")" = 404 ] \
    && pass "404 for another path" || fail "another path: $(http_code "http://127.0.0.1:$P/")"
[ "$(http_code -X BREW "http://127.0.0.1:$P/metrics")" = 405 ] && [ "$(http_code -d x "http://127.0.0.1:$P/metrics")" = 405 ] \
    && pass "405 for another method (BREW, POST)" || fail "bad method: $(http_code -X BREW "http://127.0.0.1:$P/metrics")"
s0=$(step_of $P)
(exec 3<> "/dev/tcp/127.0.0.1/$P" && printf 'GARBAGE\x01\x02\xff nonsense\r\n\r\n' >&3 && timeout 5 cat <&3) > "$W/garbage.out" 2> /dev/null
head -c 12 "$W/garbage.out" | grep -q '^HTTP/1.1 400' && pass "raw garbage: answered 400" \
    || pass "raw garbage: connection closed ($(head -c 12 "$W/garbage.out" | tr -d '\r\n' | od -c | head -1))"
for i in $(seq 20); do # clients that hang up before the answer (the server's write fails: no SIGPIPE)
    (exec 3<> "/dev/tcp/127.0.0.1/$P" && printf 'GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n' >&3) 2> /dev/null
done
SLOW=() # a scrape blocked by them would wait for their 10 s timeout
for i in 1 2 3 4 5 6 7 8; do # slow clients: half a request line each, held open
    exec {fd}<> "/dev/tcp/127.0.0.1/$P" && printf 'GET /metr' >&$fd && SLOW+=($fd)
done
t0=$(date +%s.%N)
scrape $P > /dev/null && ok_slow=1 || ok_slow=0
t1=$(date +%s.%N)
[ $ok_slow = 1 ] && awk -v a=$t0 -v b=$t1 'BEGIN { exit !(b - a < 5) }' \
    && pass "a scrape with ${#SLOW[@]} slow clients connected answers in $(awk -v a=$t0 -v b=$t1 'BEGIN { printf "%.3f", b - a }') s" \
    || fail "scrape blocked by slow clients"
sleep 1
wait_for 30 advanced $P "$s0" && pass "training went on through the garbage, the hang-ups and the slow clients (step $s0 -> $(step_of $P))" \
    || fail "training stopped"
for fd in "${SLOW[@]}"; do exec {fd}>&-; done
kill -0 $TPID 2> /dev/null && pass "trainer alive" || fail "trainer died"
# no pipeline: no pipeline counters
scrape $P | grep -q "^tera_pipeline_" && fail "one rank without a pipeline exports tera_pipeline_*" \
    || pass "no tera_pipeline_* without a pipeline"

# a pipeline (pp2 under mpirun): each rank counts its own stage's busy and waiting seconds; both grow
if command -v mpirun > /dev/null && R=$(free_port 2 "$P"); then
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" mpirun --oversubscribe -np 2 "$TERA" train "${MODEL[@]}" \
        --parallel.pp=2 --training.micro_batch=1 --training.grad_accum=4 --training.steps=1000000 \
        --logging.metrics_port=$R --logging.run_dir="$W/pipe" > "$W/pipe.log" 2>&1 &
    PIPEJOB=$!
    piped() { # both ranks past step 2, their counters read twice
        local q v
        for q in $R $((R + 1)); do
            advanced $q 2 || return 1
        done
    }
    if wait_for 90 piped; then
        for q in $R $((R + 1)); do scrape $q > "$W/pipe.$q.a"; done
        sleep 1.5
        ok=1 msg=""
        for q in $R $((R + 1)); do
            scrape $q > "$W/pipe.$q.b"
            for k in busy wait; do
                a=$(awk -v n="tera_pipeline_${k}_seconds_total" '$1 ~ "^" n "\\{" { print $2 }' "$W/pipe.$q.a")
                b=$(awk -v n="tera_pipeline_${k}_seconds_total" '$1 ~ "^" n "\\{" { print $2 }' "$W/pipe.$q.b")
                s=$(awk '$1 ~ /^tera_step_seconds_sum\{/ { print $2 }' "$W/pipe.$q.b")
                grep -q "^# TYPE tera_pipeline_${k}_seconds_total counter" "$W/pipe.$q.b" \
                    && awk -v a="$a" -v b="$b" -v s="$s" -v k=$k 'BEGIN { exit !(a != "" && b != "" && b >= a && (k == "wait" || b > a) && b <= s) }' \
                    || ok=0
                msg="$msg port $q $k ${a:-?} -> ${b:-?} s (steps ${s:-?} s);"
            done
        done
        [ $ok = 1 ] && pass "pp2: tera_pipeline_busy/wait_seconds_total on both ranks, busy growing, within the steps' time:$msg" \
            || fail "pp2 pipeline counters:$msg"
    else
        fail "pp2 job never published 2 steps on ports $R and $((R + 1))"; tail -5 "$W/pipe.log"
    fi
    kill $PIPEJOB 2> /dev/null; wait $PIPEJOB 2> /dev/null
fi

# a port in use: an error at start naming the port and the key, nothing written
"$TERA" train "${MODEL[@]}" --training.steps=5 --logging.metrics_port=$P --logging.run_dir="$W/busy" > "$W/busy.log" 2>&1
rc=$?
[ $rc != 0 ] && grep -q "logging.metrics_port = $P" "$W/busy.log" && grep -q "port $P .*in use" "$W/busy.log" \
    && pass "port in use: exit $rc, $(grep -m1 'error' "$W/busy.log")" || { fail "port in use (exit $rc)"; cat "$W/busy.log"; }
[ ! -e "$W/busy" ] && pass "port in use: no run directory created" || fail "port in use left $W/busy"
[ "$(grep -c 'error' "$W/busy.log")" = 1 ] && pass "port in use: one error line" || fail "port in use: $(grep -c error "$W/busy.log") error lines"
# under mpirun: rank 1's port (base + 1) is the busy one; the job stops at start, rank 1 named
if command -v mpirun > /dev/null && ! (exec 3<> "/dev/tcp/127.0.0.1/$((P - 1))") 2> /dev/null; then
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 300 mpirun --oversubscribe -np 2 "$TERA" train \
        "${MODEL[@]}" --parallel.dp=2 --training.steps=5 --logging.metrics_port=$((P - 1)) --logging.run_dir="$W/busy2" \
        > "$W/busy2.log" 2>&1
    rc=$?
    [ $rc != 0 ] && [ $rc != 124 ] && grep -q "port $P (metrics_port + world rank 1): the port is in use" "$W/busy2.log" \
        && [ ! -e "$W/busy2/metrics.jsonl" ] && pass "mpirun, rank 1's port in use: exit $rc, no step run, $(grep -m1 'metrics_port' "$W/busy2.log")" \
        || { fail "mpirun port in use (exit $rc)"; tail -5 "$W/busy2.log"; }
fi

# ------------------------------------------------------------------ a real Prometheus
if ! command -v prometheus > /dev/null; then
    echo "skip: prometheus not installed (scripts/install-deps.sh installs it)"
else
    PP=$(free_port 1 "$P")
    Q=$(free_port 2 "$P" "$PP") # the mpirun job's ranks: Q and Q + 1
    cat > "$W/prom.yml" << EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - $RULES
scrape_configs:
  - job_name: tera
    static_configs:
      - targets: ['127.0.0.1:$P']
  - job_name: tera-mpi
    static_configs:
      - targets: ['127.0.0.1:$Q', '127.0.0.1:$((Q + 1))']
EOF
    prometheus --config.file="$W/prom.yml" --storage.tsdb.path="$W/prom-data" --web.listen-address="127.0.0.1:$PP" \
        --log.level=warn > "$W/prom.log" 2>&1 &
    PROM=$!
    PIDS+=($PROM)
    wait_for 60 prom query --data-urlencode 'query=up' -o /dev/null && pass "Prometheus up on port $PP" \
        || { fail "Prometheus did not start"; cat "$W/prom.log"; }
    wait_for 60 scraped tera 2 1 && pass "two scrapes of tera ($(scrapes_of tera))" || fail "no two scrapes"
    [ "$(pq 'up{job="tera"}' | awk '{ print $2 }')" = 1 ] && pass "up{job=\"tera\"} = 1" || fail "up: $(pq 'up')"
    n_rules=$(prom rules | jq '[.data.groups[].rules[]] | length')
    n_bad=$(prom rules | jq '[.data.groups[].rules[] | select(.health == "err")] | length')
    [ "$n_rules" = 10 ] && [ "$n_bad" = 0 ] && pass "the 10 alert rules load and evaluate in Prometheus" \
        || fail "rules: $n_rules loaded, $n_bad in error"

    # every series with its labels (names with their distinguishing label)
    prom series --data-urlencode 'match[]={job="tera"}' \
        | jq -r '.data[] | "\(.__name__) \(.part // .group // .layer // .category // .kind // .le // .op // "-") \(.rank)"' \
        | sort -u > "$W/series.txt"
    missing=""
    for want in "tera_step - 0" "tera_loss - 0" "tera_loss_part ce 0" "tera_loss_part aux 0" "tera_loss_part z 0" \
        "tera_learning_rate - 0" "tera_grad_norm - 0" "tera_update_ratio - 0" "tera_tokens_total - 0" \
        "tera_tokens_per_second - 0" "tera_last_step_timestamp_seconds - 0" "tera_steps_target - 0" \
        "tera_grad_norm_group embed 0" "tera_grad_norm_group attn 0" "tera_grad_norm_group router 0" \
        "tera_grad_norm_group experts 0" "tera_grad_norm_group dense_shared_ffn 0" "tera_grad_norm_group norms 0" \
        "tera_grad_norm_group lm_head 0" "tera_router_entropy 1 0" "tera_router_entropy 2 0" "tera_router_entropy 3 0" \
        "tera_expert_load_max_over_mean 1 0" "tera_expert_load_max_over_mean 3 0" "tera_step_seconds_bucket 0.01 0" \
        "tera_step_seconds_bucket +Inf 0" "tera_step_seconds_sum - 0" "tera_step_seconds_count - 0" \
        "tera_data_wait_seconds_total - 0" "tera_comm_wait_seconds_total - 0" "tera_skipped_steps_total - 0" "tera_loss_spike_events_total - 0" \
        "tera_validation_loss - 0" "tera_validation_perplexity - 0" "tera_validation_step - 0" \
        "tera_memory_bytes params 0" "tera_memory_bytes grads 0" "tera_memory_bytes optimizer 0" \
        "tera_memory_bytes activations 0" "tera_memory_bytes scratch 0" "tera_process_resident_memory_bytes - 0" \
        "tera_process_cpu_seconds_total - 0" "tera_comm_sent_bytes_total allreduce 0" "tera_comm_sent_bytes_total p2p 0" \
        "tera_checkpoint_saves_total - 0" "tera_checkpoint_last_pause_seconds - 0" "tera_checkpoint_last_write_seconds - 0" \
        "tera_checkpoint_last_step - 0" "tera_checkpoint_every_steps - 0" "tera_info - 0" \
        "tera_cpu_utilization_ratio - 0" "tera_cpu_cores_used - 0" "tera_model_flops_per_second - 0" "tera_mfu_ratio - 0" \
        "tera_peak_flops_per_second - 0" "tera_operation_seconds_total expert ffn fwd 0" \
        "tera_operation_seconds_total expert ffn bwd 0" "tera_operation_seconds_total attention fwd 0" \
        "tera_operation_seconds_total optimizer 0" "tera_operation_seconds_total lm head bwd 0" \
        "tera_comm_blocked_seconds_total allreduce 0" "tera_comm_blocked_seconds_total p2p 0" \
        "tera_comm_blocked_seconds_total barrier 0"; do
        grep -qxF "$want" "$W/series.txt" || missing="$missing [$want]"
    done
    [ -z "$missing" ] && pass "$(wc -l < "$W/series.txt") series with their labels in Prometheus" || fail "missing series:$missing"
    grep -q '^tera_router_entropy 0 ' "$W/series.txt" && fail "a dense layer has router series" || pass "no router series for the dense layer 0"
    types=$(prom metadata | jq -r '[.data.tera_step[0].type, .data.tera_tokens_total[0].type, .data.tera_step_seconds[0].type] | join(" ")')
    [ "$types" = "gauge counter histogram" ] && pass "metadata: tera_step gauge, tera_tokens_total counter, tera_step_seconds histogram" \
        || fail "metadata types: $types"

    # every scraped sample of the last minute against metrics.jsonl: the same step has the same figures
    prom query --data-urlencode 'query={job="tera",__name__=~"tera_step|tera_loss|tera_loss_part|tera_learning_rate|tera_grad_norm|tera_tokens_total|tera_step_seconds_count"}[1m]' \
        | jq -r '.data.result[] | .metric as $m | .values[] | "\(.[0]) \($m.__name__)\(if $m.part then "_" + $m.part else "" end) \(.[1])"' \
        > "$W/samples.txt"
    jq -c 'select(has("loss") and (has("event") | not)) | [.step, .loss, .ce_loss, .aux_loss, .z_loss, .lr, .grad_norm, .batch]' \
        "$W/run/metrics.jsonl" > "$W/steps.txt"
    awk 'NR == FNR { gsub(/[\[\]]/, ""); split($0, f, ","); for (i = 2; i <= 8; i++) line[f[1], i] = f[i]; next }
         { v[$1, $2] = $3; ts[$1] = 1 }
         function rel(a, b,  d) { d = a - b; if (d < 0) d = -d; return a == b ? 0 : d / (a < 0 ? -a : a) }
         END { for (t in ts) { s = v[t, "tera_step"]; if (s == "") continue; n++
                 if (line[s, 2] == "") { print "step " s " has no metrics.jsonl line"; bad = 1; continue }
                 split("tera_loss tera_loss_part_ce tera_loss_part_aux tera_loss_part_z tera_learning_rate tera_grad_norm", k, " ")
                 for (i = 1; i <= 6; i++) if (rel(line[s, i + 1], v[t, k[i]]) > 1e-6) { print "step " s ": " k[i] " " v[t, k[i]] " vs " line[s, i + 1]; bad = 1 }
                 if (v[t, "tera_tokens_total"] != (s + 1) * line[s, 8] * T) { print "step " s ": tokens " v[t, "tera_tokens_total"]; bad = 1 }
                 if (v[t, "tera_step_seconds_count"] != s + 1) { print "step " s ": step count " v[t, "tera_step_seconds_count"]; bad = 1 } }
               print n " scrapes checked"; exit bad || n < 2 }' T=$T "$W/steps.txt" "$W/samples.txt" > "$W/consistent.txt"
    [ $? = 0 ] && pass "every scrape equals its step's metrics.jsonl line (loss, ce, aux, z, lr, grad_norm; tokens and step count): $(tail -1 "$W/consistent.txt")" \
        || { fail "scrapes against metrics.jsonl"; head -20 "$W/consistent.txt"; }
    # both from one query: the latest scrape's pair (a separate query could see the next evaluation)
    prom query --data-urlencode 'query={job="tera",__name__=~"tera_validation_step|tera_validation_loss"}' \
        | jq -r '.data.result[] | "\(.metric.__name__) \(.value[1])"' > "$W/val.txt"
    vs=$(awk '$1 == "tera_validation_step" { print $2 }' "$W/val.txt"); vl=$(awk '$1 == "tera_validation_loss" { print $2 }' "$W/val.txt")
    jl=$(jq -r "select(.val_loss != null and .step == ${vs:--1}) | .val_loss" "$W/run/metrics.jsonl" | tail -1)
    [ -n "$jl" ] && within "$jl" "$vl" 1e-6 && pass "validation loss after step $vs: $vl (metrics.jsonl $jl)" || fail "validation loss $vl vs $jl at $vs"
    # efficiency: model FLOP/s = the spec's FLOPs per token x tokens/s of the same step; MFU = that over peak x 1 rank
    prom query --data-urlencode 'query={job="tera",__name__=~"tera_model_flops_per_second|tera_tokens_per_second|tera_mfu_ratio|tera_peak_flops_per_second|tera_step"}' \
        | jq -r '.data.result[] | "\(.metric.__name__) \(.value[1])"' > "$W/eff.txt"
    awk -v fpt="$FPT" '{ v[$1] = $2 } END { f = v["tera_model_flops_per_second"]; t = v["tera_tokens_per_second"]
         e = f / (t * fpt) - 1; m = v["tera_mfu_ratio"] / (f / 1e12) - 1
         printf "step %d: %.4g FLOP/s = %d FLOPs/token x %.1f tokens/s; MFU %.3g%% of 1 TFLOP/s\n", v["tera_step"], f, fpt, t, 100 * v["tera_mfu_ratio"]
         exit !(fpt > 0 && t > 0 && e < 1e-9 && e > -1e-9 && m < 1e-9 && m > -1e-9 && v["tera_peak_flops_per_second"] == 1e12) }' \
        "$W/eff.txt" > "$W/eff.out" && pass "model FLOP/s and MFU: $(cat "$W/eff.out")" || { fail "model FLOP/s / MFU"; cat "$W/eff.txt"; }
    jq -e -s --argjson fpt "$FPT" '[.[] | select(has("loss") and (has("event") | not))] | length > 3 and
         all(.[]; (.model_tflops * 1e12 / (.tokens_per_s * $fpt) - 1 | fabs) < 1e-4 and ((.mfu - .model_tflops) | fabs) < 1e-5)' \
        "$W/run/metrics.jsonl" > /dev/null && pass "metrics.jsonl: model_tflops and mfu on every step line" \
        || fail "metrics.jsonl model_tflops/mfu: $(jq -c 'select(.loss) | {model_tflops, mfu, tokens_per_s}' "$W/run/metrics.jsonl" | tail -2)"
    # time per operation: counters that grow, most of the step inside them, no operation longer than all steps
    o1=$(pq 'sum(tera_operation_seconds_total{job="tera"})' | awk '{ print $NF }'); sleep 3
    prom query --data-urlencode 'query={job="tera",__name__=~"tera_operation_seconds_total|tera_step_seconds_sum"}' \
        | jq -r '.data.result[] | "\(.metric.__name__) \(.metric.op // "-" | gsub(" "; "_")) \(.value[1])"' > "$W/ops.txt"
    awk -v o1="$o1" '$1 == "tera_step_seconds_sum" { st = $3; next } { sum += $3; n++; if ($3 > mx) { mx = $3; top = $2 } }
         END { printf "%d operations, %.3f s inside them over %.3f s of steps (%.0f%%), the largest %s; %.3f s more in 3 s\n", n, sum, st, 100 * sum / st, top, sum - o1
               exit !(n >= 15 && o1 > 0 && sum > o1 && sum > 0.3 * st && sum < 1.5 * st && mx < st) }' "$W/ops.txt" > "$W/ops.out" \
        && pass "time per operation: $(cat "$W/ops.out")" || { fail "time per operation"; cat "$W/ops.txt"; }
    sk=$(pq 'tera_skipped_steps_total{job="tera"}' | awk '{ print $2 }')
    [ "$sk" = 1 ] && [ "$(jq -r 'select(.step == 3 and .loss != null) | .skipped' "$W/run/metrics.jsonl")" = 1 ] \
        && pass "the skipped step 3 (NaN gradient) is counted: tera_skipped_steps_total = 1" || fail "skipped steps: $sk"
    sv=$(pq 'tera_checkpoint_saves_total{job="tera"}' | awk '{ print $2 }')
    [ "${sv:-0}" -ge 1 ] 2> /dev/null && pass "checkpoint saves counted ($sv; last at step $(pq 'tera_checkpoint_last_step{job="tera"}' | awk '{ print $2 }'))" \
        || echo "note: no checkpoint saved yet (saves $sv)"
    # hardware readings (src/obs/hw.c): CPU figures from this process, the rest where /sys and /proc expose them
    scrape $P > "$W/expo2.txt"
    awk '$1 ~ /^tera_cpu_utilization_ratio\{/ { u = $2 } $1 ~ /^tera_cpu_cores_used\{/ { c = $2 }
         END { exit !(u > 0 && u <= 1.5 && c > 0) }' "$W/expo2.txt" \
        && pass "CPU utilisation served: $(grep -m1 '^tera_cpu_utilization_ratio' "$W/expo2.txt")" || fail "CPU utilisation"
    if ls /sys/class/hwmon/hwmon*/temp*_input > /dev/null 2>&1; then
        grep -q '^tera_hw_temperature_celsius{rank="0",sensor="' "$W/expo2.txt" && pass "hwmon temperatures served" || fail "hwmon temperatures missing"
    else
        grep -q '^tera_hw_temperature_celsius' "$W/expo2.txt" && fail "temperature served without hwmon" \
            || pass "no hwmon temperature on this machine: the family is absent (not zero)"
    fi
    if ! ls /sys/class/powercap/intel-rapl:*/energy_uj > /dev/null 2>&1; then
        grep -q '^tera_hw_power_watts' "$W/expo2.txt" && fail "power served without RAPL" \
            || pass "no RAPL on this machine: tera_hw_power_watts is absent (not zero)"
    fi

    # the Grafana dashboard: every panel's PromQL, with the dashboard's variables filled in, returns data
    DASH="$SRC/deploy/grafana/tera.json"
    if jq -e '.panels | length > 0' "$DASH" > /dev/null; then
        sleep 5 # rates need two samples in the window
        jq -r '.panels[] | select(.type != "row") | . as $p | .targets[] | [($p.tera_optional // false | tostring), $p.title, .expr] | @tsv' \
            "$DASH" > "$W/dash.tsv"
        nq=0; nbad=0; nopt=0
        while IFS=$'\t' read -r optional title expr; do
            q=${expr//\$__rate_interval/15s}; q=${q//\$job/tera}; q=${q//\$rank/.+}
            n=$(prom query --data-urlencode "query=$q" | jq '.data.result | length')
            nq=$((nq + 1))
            if [ "${n:-0}" -gt 0 ] 2> /dev/null; then continue; fi
            if [ "$optional" = true ]; then nopt=$((nopt + 1)); echo "note: optional panel \"$title\": no data here ($q)"; continue; fi
            nbad=$((nbad + 1)); echo "no data: [$title] $q"
        done < "$W/dash.tsv"
        [ $nbad = 0 ] && [ $nq -ge 20 ] && pass "Grafana dashboard: $((nq - nopt)) of the $nq queries of $(jq '[.panels[] | select(.type != "row")] | length' "$DASH") panels return data; the $nopt without are optional hardware figures this machine does not expose" \
            || fail "Grafana dashboard: $nbad of $nq queries return nothing"
        jq -e '[.panels[] | select(.type == "heatmap") | .targets[].expr | test("tera_expert_load_max_over_mean")] | any' "$DASH" > /dev/null \
            && pass "the expert load heatmap panel is there" || fail "no expert load heatmap panel"
    else
        fail "deploy/grafana/tera.json has no panels"
    fi
    kill $TPID 2> /dev/null; wait $TPID 2> /dev/null

    # ---------------------------------------------------------------- two ranks under mpirun: base + world rank
    if ! command -v mpirun > /dev/null; then
        echo "skip: mpirun not installed"
    else
        ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" mpirun --oversubscribe -np 2 "$TERA" train "${MODEL[@]}" \
            --parallel.dp=2 --training.steps=1000000 --logging.metrics_port=$Q --logging.run_dir="$W/mpi" > "$W/mpi.log" 2>&1 &
        MPID=$!
        PIDS+=($MPID)
        wait_for 90 scraped tera-mpi 2 2 && pass "both ranks scraped" \
            || { fail "mpirun ranks not scraped"; tail -5 "$W/mpi.log"; }
        [ "$(pq 'up{job="tera-mpi"}' | awk '$2 == 1' | wc -l)" = 2 ] && pass "up = 1 for ports $Q and $((Q + 1))" || fail "up: $(pq 'up{job="tera-mpi"}')"
        pq 'tera_info{job="tera-mpi"}' | grep -q "instance=127.0.0.1:$Q,.*rank=0,.*world_size=2" && \
            pq 'tera_info{job="tera-mpi"}' | grep -q "instance=127.0.0.1:$((Q + 1)),.*rank=1,.*world_size=2" \
            && pass "rank 0 on port $Q, rank 1 on port $((Q + 1)) (tera_info)" || fail "tera_info: $(pq 'tera_info{job="tera-mpi"}')"
        [ "$(pq 'tera_comm_sent_bytes_total{job="tera-mpi",kind="allreduce"} > 0' | wc -l)" = 2 ] \
            && pass "both ranks count all-reduce bytes" || fail "comm bytes: $(pq 'tera_comm_sent_bytes_total{job="tera-mpi",kind="allreduce"}')"
        # MFU over the peak of both ranks: half of what one rank's peak gives
        [ "$(pq 'abs(tera_mfu_ratio{job="tera-mpi"} / (tera_model_flops_per_second{job="tera-mpi"} / 2e12) - 1) < 1e-9' | wc -l)" = 2 ] \
            && pass "dp2: tera_mfu_ratio = model FLOP/s over 2 ranks x 1 TFLOP/s on both ranks" \
            || fail "dp2 MFU: $(pq 'tera_mfu_ratio{job="tera-mpi"}') $(pq 'tera_model_flops_per_second{job="tera-mpi"}')"
        [ "$(pq 'tera_comm_wait_seconds_total{job="tera-mpi"} > 0' | wc -l)" = 2 ] \
            && pass "both ranks count time blocked in communication" || fail "comm wait: $(pq 'tera_comm_wait_seconds_total{job="tera-mpi"}')"
        # blocked time by kind: dp2 ZeRO-0 blocks in all-reduces (and their waits), never in point-to-point
        # or all-to-all; the kinds add up to at least the steps' blocked time (they also count evaluations)
        prom query --data-urlencode 'query={job="tera-mpi",__name__=~"tera_comm_blocked_seconds_total|tera_comm_wait_seconds_total"}' \
            | jq -r '.data.result[] | "\(.metric.rank) \(.metric.__name__) \(.metric.kind // "-") \(.value[1])"' > "$W/blk.txt"
        awk '$2 == "tera_comm_wait_seconds_total" { w[$1] = $4; next } { b[$1, $3] = $4; s[$1] += $4 }
             END { for (r = 0; r < 2; r++) { printf "rank %d: all-reduce %.3f s, barrier %.3f s, p2p %s, all-to-all %s; steps %.3f s. ", r, b[r, "allreduce"], b[r, "barrier"], b[r, "p2p"], b[r, "alltoall"], w[r]
                   if (!(b[r, "allreduce"] > 0 && b[r, "p2p"] == 0 && b[r, "alltoall"] == 0 && s[r] >= 0.999 * w[r] && w[r] > 0)) bad = 1 }
                   exit bad }' "$W/blk.txt" > "$W/blk.out" \
            && pass "blocked time by kind: $(cat "$W/blk.out")" || { fail "blocked time by kind: $(cat "$W/blk.out")"; cat "$W/blk.txt"; }
        # the same global loss on both ranks for every step both scraped, equal to rank 0's metrics.jsonl
        prom query --data-urlencode 'query={job="tera-mpi",__name__=~"tera_step|tera_loss"}[1m]' \
            | jq -r '.data.result[] | .metric as $m | .values[] | "\($m.rank) \(.[0]) \($m.__name__) \(.[1])"' > "$W/mpi_samples.txt"
        jq -c 'select(has("loss") and (has("event") | not)) | [.step, .loss]' "$W/mpi/metrics.jsonl" > "$W/mpi_steps.txt"
        awk 'NR == FNR { gsub(/[\[\]]/, ""); split($0, f, ","); jl[f[1]] = f[2]; next }
             { v[$1, $2, $3] = $4; key[$1, $2] = 1 }
             END { for (k in key) { split(k, p, SUBSEP); s = v[p[1], p[2], "tera_step"]; l = v[p[1], p[2], "tera_loss"]
                     if (s == "") continue; n[p[1]]++; d = l - jl[s]; if (d < 0) d = -d
                     if (jl[s] == "" || d > 1e-6 * jl[s]) { print "rank " p[1] " step " s ": " l " vs " jl[s]; bad = 1 } }
                   print n[0] + 0 " and " n[1] + 0 " scrapes of ranks 0 and 1"; exit bad || n[0] < 2 || n[1] < 2 }' \
            "$W/mpi_steps.txt" "$W/mpi_samples.txt" > "$W/mpi_consistent.txt" \
            && pass "both ranks' scraped losses equal metrics.jsonl: $(tail -1 "$W/mpi_consistent.txt")" \
            || { fail "mpirun scrapes against metrics.jsonl"; head "$W/mpi_consistent.txt"; }
        kill $MPID 2> /dev/null; wait $MPID 2> /dev/null
    fi
fi
kill $TPID 2> /dev/null; wait $TPID 2> /dev/null

# ------------------------------------------------------------------ a run that ends: the endpoint stops with it
P2=$(free_port 1 "$P" "${PP:-}") # Prometheus still listens on PP
"$TERA" train "${MODEL[@]}" --training.steps=30 --logging.metrics_port=$P2 --logging.run_dir="$W/short" > "$W/short.log" 2>&1 \
    && pass "a run with metrics_port ends normally (exit 0)" || { fail "short run"; tail -5 "$W/short.log"; }
(exec 3<> "/dev/tcp/127.0.0.1/$P2") 2> /dev/null && fail "port $P2 still open after the run" || pass "port $P2 closed after the run"
"$TERA" train "${MODEL[@]}" --training.steps=3 --logging.metrics_port=65535 --parallel.dp=1 --logging.run_dir="$W/hi" > "$W/hi.log" 2>&1 \
    && pass "port 65535 works for one rank" || { fail "port 65535"; tail -3 "$W/hi.log"; }
"$TERA" config --logging.metrics_port=65536 > "$W/cfg.log" 2>&1 && fail "metrics_port 65536 accepted" \
    || { grep -q "metrics_port" "$W/cfg.log" && pass "metrics_port 65536 refused: $(head -1 "$W/cfg.log")" || fail "refusal message: $(cat "$W/cfg.log")"; }
for v in -1 abc 1e-9; do
    "$TERA" config --logging.peak_tflops=$v > "$W/peak.log" 2>&1 && fail "logging.peak_tflops = $v accepted" \
        || { grep -q "logging.peak_tflops" "$W/peak.log" && [ "$(grep -c error "$W/peak.log")" = 1 ] \
             && pass "logging.peak_tflops = $v refused: $(head -1 "$W/peak.log" | cut -c1-120)" || fail "peak_tflops $v: $(cat "$W/peak.log")"; }
done
finish cli_prometheus
