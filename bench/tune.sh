#!/usr/bin/env bash
# tera tune (its GP sampler + Hyperband; SAMPLER=tpe in the environment: its TPE) against Optuna
# (TPESampler + HyperbandPruner) on the test functions of
# bench/tune_objective.sh, steps as the fidelity (1..27, eta 3): the best full-fidelity value reached
# within B trial-steps, median (and quartiles) over 10 seeds each; tera tune's own CPU time per trial.
# Usage: bench/tune.sh [BUILD_DIR] [BUDGET] [SEEDS] [FUNCTIONS]   (the table of docs/TRACKING.md;
#        FUNCTIONS: default "branin hartmann6 sphere4 mixed")
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
TERA="$(cd "${1:-$here/../build}" && pwd)/tera"
B=${2:-1000}
SEEDS=${3:-10}
FUNCS=${4:-branin hartmann6 sphere4 mixed}
PY=$("$here/../scripts/install-peers.sh") || { echo "bench/tune.sh: the Python peers (Optuna) are unavailable" >&2; exit 1; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
space() {
    case $1 in
        branin) printf 'x1 = uniform -5 10\nx2 = uniform 0 15\n' ;;
        hartmann6) for i in 1 2 3 4 5 6; do printf 'x%d = uniform 0 1\n' $i; done ;;
        sphere4) for i in 1 2 3 4; do printf 'x%d = uniform -5 5\n' $i; done ;;
        mixed) printf 'x1 = loguniform 1e-5 1\nx2 = uniform 0 0.3\nx3 = choice relu gelu silu\n' ;;
    esac
}
args() { case $1 in branin) echo "{x1} {x2}" ;; hartmann6) echo "{x1} {x2} {x3} {x4} {x5} {x6}" ;;
                    sphere4) echo "{x1} {x2} {x3} {x4}" ;; mixed) echo "{x1} {x2} {x3}" ;; esac; }
stats() { sort -g | awk '{ v[NR] = $1 } END { printf "%.4f [%.4f, %.4f]", v[int((NR + 1) / 2)], v[int((NR + 3) / 4)], v[int((3 * NR + 3) / 4)] }'; }
echo "| function | tera tune: median [q1, q3] best after $B trial-steps | Optuna: median [q1, q3] | tera trials | Optuna trials | tera tune CPU ms/trial | Optuna ms/trial |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for f in $FUNCS; do
    : > "$W/tera.txt"; : > "$W/optuna.txt"
    for seed in $(seq 1 "$SEEDS"); do
        d="$W/$f-$seed"
        { printf '[study]\nname = %s-%d\nobjective = %s/tune_objective.sh %s {steps} %s\n' "$f" "$seed" "$here" "$f" "$(args $f)"
          printf 'sampler = %s\nscheduler = hyperband\ntrials = 100000\nbudget = %d\nparallel = 1\nseed = %d\n' "${SAMPLER:-gp}" "$B" "$seed"
          printf 'min_steps = 1\nmax_steps = 27\neta = 3\ndir = %s\nregistry = %s/reg.db\n[space]\n' "$d" "$W"
          space $f; } > "$d.ini"
        "$TERA" tune -c "$d.ini" > "$d.json" 2> "$d.err"
        best=$(jq -s "map(select(.final and .cum_steps <= $B)) | min_by(.value) | .value" "$d/events.jsonl")
        echo "$best $(jq .trials "$d.json") $(jq .tune_cpu_s "$d.json")" >> "$W/tera.txt"
        "$PY" "$here/tune_peer.py" "$f" "$seed" "$B" | jq -r '"\(.best) \(.trials) \(.overhead_ms_per_trial)"' >> "$W/optuna.txt"
    done
    tmed=$(cut -d' ' -f1 "$W/tera.txt" | stats); omed=$(cut -d' ' -f1 "$W/optuna.txt" | stats)
    tn=$(awk '{ s += $2 } END { printf "%.0f", s / NR }' "$W/tera.txt"); on=$(awk '{ s += $2 } END { printf "%.0f", s / NR }' "$W/optuna.txt")
    tcpu=$(awk '{ s += 1e3 * $3 / $2 } END { printf "%.2f", s / NR }' "$W/tera.txt")
    ocpu=$(awk '{ s += $3 } END { printf "%.2f", s / NR }' "$W/optuna.txt")
    echo "| $f | $tmed | $omed | $tn | $on | $tcpu | $ocpu |"
    paste -d' ' "$W/tera.txt" "$W/optuna.txt" | sed "s/^/$f per seed (tera best, trials, cpu_s | optuna best, trials, ms): /" >&2
done
