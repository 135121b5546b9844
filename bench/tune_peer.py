"""Optuna (TPE sampler + Hyperband pruner), the peer of `tera tune`, on the test functions of
bench/tune_objective.sh (the same formulas), with steps as the fidelity.

Usage: tune_peer.py FUNC SEED BUDGET [MAX_STEPS] [ETA]
Prints one JSON line: the best final value among trials completed within BUDGET trial-steps (every
reported step of every trial counts, pruned trials included), the trials run, and Optuna's own time
per trial (sampling and pruning; the objective is a formula and costs nothing).
"""
import json
import math
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


def main():
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
