#!/usr/bin/env bash
# MLflow logging (logging.mlflow_uri, src/obs/mlflow.c) against a real `mlflow server` on loopback:
# the run is read back through MLflow's own client (params, every step's loss and val_loss, tags,
# config.ini as an artefact, status FINISHED); a server that cannot be reached gives one warning and
# the run trains on. Usage: cli_mlflow.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/testlib.sh"
PY=$(peer_python) || { echo "skip: python peers unavailable (scripts/install-peers.sh)"; exit 0; }
"$PY" -c "import mlflow" 2> /dev/null || { echo "skip: mlflow is not installed in the peers' environment"; exit 0; }

TINY=(--model.dim=32 --model.n_layers=2 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32
      --training.seq_len=32 --training.micro_batch=4 --training.warmup_steps=2 --training.threads=1
      --logging.progress=false)
cd "$W" || exit 1
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# 1. an unreachable server: one warning, training goes on and finishes
dead=$(free_port)
"$TERA" train "${TINY[@]}" --training.steps=6 --logging.run_dir="$W/dead" --logging.registry="$W/reg.db" \
    --logging.mlflow_uri="http://127.0.0.1:$dead" 2> dead.log && pass "an unreachable MLflow server does not stop training" \
    || fail "train with a dead server: $(tail -3 dead.log)"
[ "$(grep -c 'warning: MLflow' dead.log)" = 1 ] && grep -q "127.0.0.1:$dead" dead.log \
    && pass "one warning naming the server" || { fail "warnings: $(grep -c 'warning: MLflow' dead.log)"; cat dead.log; }
[ "$("$TERA" runs ls --registry "$W/reg.db" --json | jq -r .status)" = finished ] && pass "the run is finished in the registry" \
    || fail "registry status"

# 2. a real server
port=$(free_port)
set -m # the server gets a process group of its own (pgid = its pid), with its gunicorn processes
"$PY" -m mlflow server --host 127.0.0.1 --port "$port" --workers 1 --backend-store-uri "sqlite:///$W/mlflow.db" \
    --artifacts-destination "$W/artifacts" > server.log 2>&1 &
spid=$!
set +m
# the server and its gunicorn processes: the whole group stopped on exit
# (gunicorn: INT is its quick shutdown, TERM a graceful one of up to 30 s)
stop_server() {
    kill -INT -- -$spid 2> /dev/null
    for _ in $(seq 1 50); do kill -0 -- -$spid 2> /dev/null || break; sleep 0.1; done
    kill -KILL -- -$spid 2> /dev/null
    wait $spid 2> /dev/null
}
trap 'stop_server; rm -rf "$W"' EXIT
up=0
for _ in $(seq 1 360); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && { up=1; break; }
    kill -0 $spid 2> /dev/null || break
    sleep 0.5
done
[ $up = 1 ] || { fail "mlflow server did not start: $(tail -5 server.log)"; finish cli_mlflow; exit 1; }
pass "mlflow server up on 127.0.0.1:$port"

"$TERA" train "${TINY[@]}" --training.steps=30 --training.eval_every=10 --data.val_fraction=0.1 --training.lr=0.002 \
    --logging.run_dir="$W/run" --logging.registry="$W/reg.db" --logging.mlflow_uri="http://127.0.0.1:$port" \
    --logging.mlflow_experiment=tera-test 2> run.log || fail "train: $(tail -3 run.log)"
grep -q "warning" run.log && fail "warnings: $(grep warning run.log)"
id=$("$TERA" runs ls --registry "$W/reg.db" --json --where "run_dir=$W/run" | jq -r .id)
mrun=$("$TERA" runs show "$id" --registry "$W/reg.db" --json | jq -r .mlflow_run)
[ -n "$mrun" ] && [ "$mrun" != null ] && pass "the registry holds the MLflow run id" || fail "no MLflow run id"
last_fields "$W/run/metrics.jsonl" step loss > want.txt
cat > read.py <<'EOF'
import json, sys
import mlflow
from mlflow.tracking import MlflowClient
uri, run_id, out = sys.argv[1], sys.argv[2], sys.argv[3]
mlflow.set_tracking_uri(uri)
c = MlflowClient(tracking_uri=uri)
r = c.get_run(run_id)
exp = c.get_experiment(r.info.experiment_id)
loss = sorted((m.step, m.value) for m in c.get_metric_history(run_id, "loss"))
val = sorted((m.step, m.value) for m in c.get_metric_history(run_id, "val_loss"))
arts = [a.path for a in c.list_artifacts(run_id)]
cfg = open(c.download_artifacts(run_id, "config.ini", out)).read()
json.dump({"status": r.info.status, "experiment": exp.name, "params": r.data.params, "tags": r.data.tags,
           "loss": loss, "val_loss": val, "artifacts": arts, "config_has_lr": "lr = 0.002" in cfg}, sys.stdout)
EOF
"$PY" read.py "http://127.0.0.1:$port" "$mrun" "$W" > got.json 2> read.err || fail "MLflow client: $(tail -3 read.err)"
jq -e '.status == "FINISHED" and .experiment == "tera-test" and .params["training.lr"] == "0.002" and
       .params["model.dim"] == "32" and (.params | length) > 50 and .tags.tera_run_id == "'"$id"'" and
       (.tags.dataset_fingerprint | length) > 0 and .tags.tokenizer_fingerprint == "bytes" and
       .artifacts == ["config.ini"] and .config_has_lr' got.json > /dev/null \
    && pass "read back: status FINISHED, experiment, params, tags, config.ini artefact" || { fail "read back"; cat got.json; }
# every step's loss, as metrics.jsonl has it
jq -r '.loss[] | "\(.[0]) \(.[1])"' got.json > gotloss.txt
paste -d' ' want.txt gotloss.txt | awk '{ n++; d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-5 * $2) bad++ }
    END { exit !(n == 30 && !bad) }' && pass "all 30 steps' loss logged, equal to metrics.jsonl" \
    || { fail "loss series"; paste want.txt gotloss.txt | head; }
[ "$(jq '.val_loss | length' got.json)" = 3 ] && pass "val_loss at its 3 evaluations" || fail "val_loss: $(jq -c .val_loss got.json)"
finish cli_mlflow
