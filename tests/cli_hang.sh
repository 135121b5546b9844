#!/usr/bin/env bash
# Waiting for other ranks (issue 12): a rank that stalls inside a step (TERA_FAULT_STALL_STEP=S@RANK
# sleeps at the start of step S) makes the others abort the job within parallel.timeout_s plus the
# grace period, with one message naming the stalled rank, and every process exits; meanwhile the
# waiting ranks sleep instead of spinning (their CPU time is a small share of the wall time). The
# pipeline report's busy and waiting times (receives and sends) add up to its step time, and
# metrics.jsonl's per-step figures of each stage (pp_busy_s, pp_wait_s) average to the report's.
# Usage: cli_hang.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TICK=$(getconf CLK_TCK)

# pid of world rank $2 of the job whose command line holds $1
rank_pid() {
    local p
    for p in $(pgrep -f -- "$1"); do
        tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && { echo "$p"; return; }
    done
}
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2> /dev/null; } # utime + stime (comm "tera" has no space)

# stall NAME NP STALLED_RANK WAITING_RANK TIMEOUT LAYOUT...: world rank STALLED_RANK sleeps at step 3
stall() {
    local name=$1 np=$2 bad=$3 waiter=$4 to=$5
    shift 5
    local R="$W/$name"
    ( TERA_FAULT_STALL_STEP=3@$bad $MPIRUN -np "$np" "$TERA" train "${MODEL[@]}" --training.steps=100000 "$@" \
        --parallel.timeout_s="$to" --logging.run_dir="$R" > "$R.log" 2>&1; echo "rc=$?" >> "$R.log" ) &
    local job=$! i
    for i in $(seq 1 600); do grep -q "stalls at step 3" "$R.log" 2> /dev/null && break; sleep 0.1; done
    local t0 pid c0 c1 w0 w1 share=""
    t0=$(date +%s.%N)
    pid=$(rank_pid "--logging.run_dir=$R" "$waiter")
    if [ -n "$pid" ]; then # CPU time of a waiting rank over 3 s of its wait
        sleep 0.5
        c0=$(cpu_ticks "$pid"); w0=$(date +%s.%N)
        sleep 3
        c1=$(cpu_ticks "$pid"); w1=$(date +%s.%N)
        [ -n "$c0" ] && [ -n "$c1" ] && share=$(awk -v a="$c0" -v b="$c1" -v s="$w0" -v e="$w1" -v t="$TICK" \
            'BEGIN { printf "%.3f", (b - a) / t / (e - s) }')
    fi
    for i in $(seq 1 600); do kill -0 $job 2> /dev/null || break; sleep 0.1; done
    local took
    took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if kill -0 $job 2> /dev/null; then
        fail "$name: job still running 60 s after rank $bad stalled"
        pkill -9 -f -- "--logging.run_dir=$R"
        return
    fi
    sleep 0.5
    local left
    left=$(pgrep -f -- "--logging.run_dir=$R" | wc -l)
    [ "$left" = 0 ] && pass "$name: every process exited" || { fail "$name: $left processes left"; pkill -9 -f -- "--logging.run_dir=$R"; }
    if grep -q "rank $bad did not answer" "$R.log" && [ "$(grep -c 'tera: fatal' "$R.log")" = 1 ] && ! grep -q "rc=0" "$R.log"; then
        pass "$name: aborted ${took} s after the stall (timeout $to s): $(grep -o 'rank [0-9]* did not answer[^;]*' "$R.log")"
    else
        fail "$name: message: $(grep -v '^tera: [mdpl]' "$R.log" | head -8)"
    fi
    # spinning takes a whole core (share 1, or what a loaded machine leaves it); sleeping a few percent
    if [ -n "$share" ] && awk -v s="$share" 'BEGIN { exit !(s < 0.25) }'; then
        pass "$name: waiting rank $waiter used ${share} s of CPU per second of its wait"
    else
        fail "$name: waiting rank $waiter's CPU share while waiting: '${share}' (pid '$pid')"
    fi
}
# data parallel: rank 0 waits in the gradient all-reduce for rank 1
stall dp2 2 1 0 4 --parallel.dp=2 --training.micro_batch=2
# pipeline x data parallel: stage 0's dp rank 1 (world 1) stalls; world 3 (its next stage) waits in a receive,
# world 0 and 2 in collectives; only world 1 is named
stall pp2xdp2 4 1 3 4 --parallel.pp=2 --parallel.dp=2 --training.micro_batch=1 --training.grad_accum=2

# the pipeline report: busy + waiting (receives and sends) = the step time, for every schedule (within
# [0.9, 1.05]: the parts are timed by separate clock reads and printed rounded; before send waits were
# counted, the last stage showed 0.64-0.87)
# metrics.jsonl has each stage's busy and waiting seconds of every step (pp_busy_s, pp_wait_s): their
# means over the 12 steps are the report's figures (to its 0.1 ms rounding), and stage 0's busy +
# waiting is within the step of world rank 0, which writes the line (another stage's pipeline window
# can start before rank 0's step does)
for s in gpipe 1f1b "interleaved --parallel.pp_chunks=2"; do
    rm -rf "$W/piperun"
    $MPIRUN -np 2 "$TERA" train "${MODEL[@]}" --training.steps=12 --parallel.pp=2 --training.micro_batch=2 \
        --training.grad_accum=4 --parallel.pp_schedule=$s --logging.run_dir="$W/piperun" > "$W/pipe.log" 2>&1 || { fail "pipeline $s"; tail -3 "$W/pipe.log"; continue; }
    rep=$(grep "pipeline stage [0-9]: step" "$W/pipe.log" | sed 's/.*stage \([0-9]\): step [0-9.]* ms, busy \([0-9.]*\) ms, waiting \([0-9.]*\) ms.*/\1 \2 \3/' | sort | tr '\n' ' ')
    jq -s -e --arg rep "$rep" '($rep | split(" ") | map(select(. != "")) | map(tonumber)) as $r
            | def ab: if . < 0 then -. else . end;
            [.[] | select(has("step_s"))] as $m
            | ($m | length) == 12
              and all($m[]; (.pp_busy_s | length) == 2 and (.pp_wait_s | length) == 2 and all(.pp_busy_s[]; . > 0)
                           and .pp_busy_s[0] + .pp_wait_s[0] <= .step_s + 1e-3)
              and ([0, 1] | all(. as $q | ((([$m[].pp_busy_s[$q]] | add) / 12 * 1e3 - $r[3 * $q + 1]) | ab) <= 0.06
                                         and ((([$m[].pp_wait_s[$q]] | add) / 12 * 1e3 - $r[3 * $q + 2]) | ab) <= 0.06))' \
        "$W/piperun/metrics.jsonl" > /dev/null \
        && pass "${s%% *}: metrics.jsonl's pp_busy_s / pp_wait_s of 12 steps, their means the report's ($rep)" \
        || fail "${s%% *}: metrics.jsonl pipeline fields against the report ($rep): $(jq -c '[.pp_busy_s, .pp_wait_s, .step_s]' "$W/piperun/metrics.jsonl" | head -3)"
    grep "pipeline stage [0-9]: step" "$W/pipe.log" | sed 's/.*stage \([0-9]\): step \([0-9.]*\) ms, busy \([0-9.]*\) ms, waiting \([0-9.]*\) ms.*/\1 \2 \3 \4/' \
        | awk -v s="${s%% *}" '{ n++; r = ($3 + $4) / $2; printf "%s stage %d: (busy + waiting) / step = %.3f\n", s, $1, r; if (r < 0.9 || r > 1.05) bad = 1 }
                              END { exit bad || n != 2 }' > "$W/pipe.txt" \
        && pass "$(paste -sd';' "$W/pipe.txt")" || fail "pipeline report parts: $(cat "$W/pipe.txt")"
done
finish cli_hang
