#!/usr/bin/env bash
# A real tera training search: tera tune against Optuna (TPESampler + HyperbandPruner driving
# `tera train` through subprocesses, bench/tune_peer.py train), both with Hyperband and steps as the
# fidelity (rungs 5, 15, 45; eta 3), over training.lr, training.warmup_steps, model.aux_coef and
# model.init_std of a tiny MoE model on the embedded corpus; the objective is the validation loss at
# the rung. Both sides train a trial to its rung, stop there with a checkpoint
# (training.stop_at_step) and resume it when it goes on. Compared: the best validation loss at 45
# steps reached within B trial-steps, per seed and median; the trials run; each tuner's own CPU time
# per trial (tera tune: getrusage of the tuner; Optuna: process_time of the Python process; neither
# counts the tera train processes).
# Usage: bench/tune_train.sh [BUILD_DIR] [BUDGET] [SEEDS] [SIDES]   (SIDES: "tera optuna", the default;
#        SAMPLER=tpe in the environment: tera tune's TPE instead of its default, the GP)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
TERA="$(cd "${1:-$here/../build}" && pwd)/tera"
B=${2:-600}
SEEDS=${3:-3}
SIDES=${4:-tera optuna}
LO=5 HI=45 ETA=3
ARGS="--model.dim=64 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=64 --training.seq_len=64 \
--training.micro_batch=8 --training.threads=1 --training.min_lr=1e-5 --training.eval_every=$LO --training.eval_batches=4 \
--data.val_fraction=0.05 --logging.progress=false"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
med() { sort -g | awk '{ v[NR] = $1 } END { printf "%.4f", v[int((NR + 1) / 2)] }'; }
: > "$W/tera.txt"; : > "$W/optuna.txt"
for seed in $(seq 1 "$SEEDS"); do
    if [[ " $SIDES " == *" tera "* ]]; then
        d="$W/tera-$seed"
        cat > "$d.ini" <<INI
[study]
name = train-$seed
args = $ARGS
metric = val_loss
sampler = ${SAMPLER:-gp}
scheduler = hyperband
trials = 100000
budget = $B
parallel = 1
seed = $seed
min_steps = $LO
max_steps = $HI
eta = $ETA
dir = $d
registry = $W/reg.db
[space]
training.lr = loguniform 1e-4 3e-2
training.warmup_steps = int 0 $LO
model.aux_coef = uniform 0 0.05
model.init_std = loguniform 0.005 0.05
INI
        t0=$(date +%s.%N)
        "$TERA" tune -c "$d.ini" > "$d.json" 2> "$d.err"
        wall=$(echo "$(date +%s.%N) - $t0" | bc)
        best=$(jq -s "map(select(.final and .cum_steps <= $B)) | min_by(.value) | .value" "$d/events.jsonl")
        line="$best $(jq .trials "$d.json") $(jq '1e3 * .tune_cpu_s / .trials' "$d.json") $wall"
        echo "$line" >> "$W/tera.txt"
        echo "tera tune seed $seed: best val_loss, trials, tune CPU ms/trial, wall s: $line" >&2
    fi
    if [[ " $SIDES " == *" optuna "* ]]; then
        PY=${PY:-$("$here/../scripts/install-peers.sh")} || { echo "bench/tune_train.sh: Optuna is unavailable" >&2; exit 1; }
        mkdir -p "$W/optuna-$seed"
        out=$("$PY" "$here/tune_peer.py" train "$seed" "$B" $LO $HI $ETA "$TERA" "$W/optuna-$seed" "$ARGS")
        line=$(jq -r '"\(.best) \(.trials) \(.cpu_ms_per_trial) \(.wall_s)"' <<< "$out")
        echo "$line" >> "$W/optuna.txt"
        echo "optuna seed $seed: best val_loss, trials, CPU ms/trial, wall s: $line" >&2
    fi
done
echo "| tuner | best val_loss after $B trial-steps: median | per seed (1..$SEEDS) | trials (mean) | tuner CPU ms/trial |"
echo "| --- | --- | --- | --- | --- |"
for side in tera optuna; do
    [ -s "$W/$side.txt" ] || continue
    echo "| $side | $(cut -d' ' -f1 "$W/$side.txt" | med) | $(cut -d' ' -f1 "$W/$side.txt" | xargs printf '%.4f ' | sed 's/ $//') |" \
         "$(awk '{ s += $2 } END { printf "%.0f", s / NR }' "$W/$side.txt") | $(awk '{ s += $3 } END { printf "%.2f", s / NR }' "$W/$side.txt") |"
done
