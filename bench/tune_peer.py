"""Optuna (TPE sampler + Hyperband pruner), the peer of `tera tune`, on the test functions of
bench/tune_objective.sh (the same formulas), with steps as the fidelity; or driving real `tera train`
trials (bench/tune_train.sh).

Usage: tune_peer.py FUNC SEED BUDGET [MAX_STEPS] [ETA]
Prints one JSON line: the best final value among trials completed within BUDGET trial-steps (every
reported step of every trial counts, pruned trials included), the trials run, and Optuna's own time
per trial (sampling and pruning; the objective is a formula and costs nothing).

Usage: tune_peer.py train SEED BUDGET MIN_STEPS MAX_STEPS ETA TERA DIR ARGS
Trials are `tera train` processes (ARGS: one string of --section.key=value overrides) over
training.lr (log 1e-4..3e-2), training.warmup_steps (int 0..MIN_STEPS), model.aux_coef (0..0.05) and
model.init_std (log 0.005..0.05); the objective is the validation loss at each rung (MIN_STEPS * ETA^k
steps, then MAX_STEPS). A trial trains to the rung, stops there with a checkpoint
(training.stop_at_step), reports, and continues with `tera train --resume` unless Hyperband prunes it:
the same mechanism as `tera tune`. Prints the best validation loss at MAX_STEPS among trials finished
within BUDGET trial-steps, the trials, and Optuna's own time per trial: CPU time of the Python process
(its children excluded) and wall time outside the tera processes.
"""
import json
import math
import os
import subprocess
import sys
import time

import optuna


def fvalue(func, x):
    if func == "branin":
        b, c, t = 5.1 / (4 * math.pi ** 2), 5 / math.pi, 1 / (8 * math.pi)
        v = (x[1] - b * x[0] ** 2 + c * x[0] - 6) ** 2 + 10 * (1 - t) * math.cos(x[0]) + 10 - 0.397887
    elif func == "hartmann6":
        al = [1.0, 1.2, 3.0, 3.2]
        A = [[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14], [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]]
        P = [[1312, 1696, 5569, 124, 8283, 5886], [2329, 4135, 8307, 3736, 1004, 9991],
             [2348, 1451, 3522, 2883, 3047, 6650], [4047, 8828, 8732, 5743, 1091, 381]]
        v = -sum(al[i] * math.exp(-sum(A[i][j] * (x[j] - P[i][j] / 1e4) ** 2 for j in range(6))) for i in range(4))
        v += 3.32237
    elif func == "sphere4":
        v = sum((xi - 1.5) ** 2 for xi in x)
    elif func == "mixed":
        v = (math.log10(x[0]) + 2.5) ** 2 + 20 * (x[1] - 0.1) ** 2 + (0 if x[2] == "gelu" else 0.3)
    else:
        raise SystemExit("unknown function " + func)
    return max(v, 0.0)


def suggest(func, trial):
    if func == "branin":
        return [trial.suggest_float("x1", -5, 10), trial.suggest_float("x2", 0, 15)]
    if func == "hartmann6":
        return [trial.suggest_float("x%d" % (i + 1), 0, 1) for i in range(6)]
    if func == "sphere4":
        return [trial.suggest_float("x%d" % (i + 1), -5, 5) for i in range(4)]
    return [trial.suggest_float("x1", 1e-5, 1, log=True), trial.suggest_float("x2", 0, 0.3),
            trial.suggest_categorical("x3", ["relu", "gelu", "silu"])]


def val_loss_at(run_dir, step):
    """The validation loss recorded after `step` steps (metrics.jsonl counts steps from 0)."""
    v = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("step") == step - 1 and "val_loss" in r:
                v = r["val_loss"]
    if v is None:
        raise RuntimeError("%s: no val_loss at step %d" % (run_dir, step))
    return v


def main_train():
    seed, budget, lo, hi, eta = (int(a) for a in sys.argv[2:7])
    tera, top, args = sys.argv[7], sys.argv[8], sys.argv[9].split()
    rungs = []
    r = lo
    while r < hi:
        rungs.append(r)
        r *= eta
    rungs.append(hi)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    state = {"steps": 0, "best": math.inf, "child_s": 0.0}

    def run(cmd):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        state["child_s"] += time.perf_counter() - t0

    def objective(trial):
        p = {"training.lr": trial.suggest_float("training.lr", 1e-4, 3e-2, log=True),
             "training.warmup_steps": trial.suggest_int("training.warmup_steps", 0, lo),
             "model.aux_coef": trial.suggest_float("model.aux_coef", 0, 0.05),
             "model.init_std": trial.suggest_float("model.init_std", 0.005, 0.05, log=True)}
        d = os.path.join(top, "trial_%04d" % trial.number)
        v, prev = math.inf, 0
        for s in rungs:
            stop = "--training.stop_at_step=%d" % (s if s < hi else 0)
            if prev == 0:
                run([tera, "train"] + args + ["--%s=%s" % (k, p[k]) for k in p] +
                    ["--training.steps=%d" % hi, "--logging.run_dir=" + d, "--logging.registry=", stop])
            else:
                run([tera, "train", "-c", os.path.join(d, "config.ini"), "--resume", stop])
            state["steps"] += s - prev
            prev = s
            v = val_loss_at(d, s)
            trial.report(v, s)
            if trial.should_prune():
                raise optuna.TrialPruned()
        if state["steps"] <= budget:
            state["best"] = min(state["best"], v)
        return v

    def stop(study, trial):
        if state["steps"] >= budget:
            study.stop()

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed),
                                pruner=optuna.pruners.HyperbandPruner(min_resource=lo, max_resource=hi,
                                                                      reduction_factor=eta))
    t0, c0 = time.perf_counter(), time.process_time()
    study.optimize(objective, n_trials=100000, callbacks=[stop])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(study.trials)
    print(json.dumps({"tool": "optuna", "func": "train", "cpu_ms_per_trial": 1e3 * cpu / max(n, 1), "seed": seed, "budget": budget, "best": state["best"],
                      "trials": n, "steps": state["steps"], "wall_s": wall,
                      "overhead_ms_per_trial": 1e3 * (wall - state["child_s"]) / max(n, 1)}))


def main():
    if sys.argv[1] == "train":
        main_train()
        return
    func, seed, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 27
    eta = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    state = {"steps": 0, "best": math.inf, "objective_s": 0.0}

    def objective(trial):
        t0 = time.perf_counter()
        x = suggest(func, trial)
        f = fvalue(func, x)
        state["objective_s"] += time.perf_counter() - t0
        v = math.inf
        for s in range(1, max_steps + 1):
            t0 = time.perf_counter()
            v = f + (1 + f) * 2 / s
            state["objective_s"] += time.perf_counter() - t0
            state["steps"] += 1
            trial.report(v, s)
            if trial.should_prune():
                raise optuna.TrialPruned()
        if state["steps"] <= budget:
            state["best"] = min(state["best"], v)
        return v

    def stop(study, trial):
        if state["steps"] >= budget:
            study.stop()

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed),
                                pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_steps,
                                                                      reduction_factor=eta))
    t0 = time.perf_counter()
    study.optimize(objective, n_trials=100000, callbacks=[stop])
    wall = time.perf_counter() - t0
    n = len(study.trials)
    print(json.dumps({"tool": "optuna", "func": func, "seed": seed, "budget": budget, "best": state["best"],
                      "trials": n, "steps": state["steps"],
                      "overhead_ms_per_trial": 1e3 * (wall - state["objective_s"]) / max(n, 1)}))


if __name__ == "__main__":
    main()
