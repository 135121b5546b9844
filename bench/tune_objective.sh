#!/bin/sh
# Test functions with a fidelity, for `tera tune` (objective command) and bench/tune_peer.py (the same
# formulas in Python for Optuna). Usage: tune_objective.sh FUNC STEPS X1 X2 ...
# Value at STEPS steps: f(x) + (1 + f(x)) * 2 / STEPS, f shifted so that its minimum is 0: the error
# of a short run shrinks as 1/steps and is larger for worse points (a learning curve's shape).
#   branin     x1 in [-5, 10], x2 in [0, 15]
#   hartmann6  x1..x6 in [0, 1]
#   sphere4    x1..x4 in [-5, 5], optimum at 1.5
#   mixed      x1 = lr (log-uniform 1e-5..1), x2 = weight decay in [0, 0.3], x3 = relu | gelu | silu
f=$1; s=$2; shift 2
exec awk -v f="$f" -v s="$s" -v args="$*" 'BEGIN {
    n = split(args, x, " "); pi = atan2(0, -1)
    if (f == "branin") {
        b = 5.1 / (4 * pi * pi); c = 5 / pi; t = 1 / (8 * pi)
        v = (x[2] - b * x[1] ^ 2 + c * x[1] - 6) ^ 2 + 10 * (1 - t) * cos(x[1]) + 10 - 0.397887
    } else if (f == "hartmann6") {
        split("1.0 1.2 3.0 3.2", al, " ")
        split("10 3 17 3.5 1.7 8 0.05 10 17 0.1 8 14 3 3.5 1.7 10 17 8 17 8 0.05 10 0.1 14", A, " ")
        split("1312 1696 5569 124 8283 5886 2329 4135 8307 3736 1004 9991 2348 1451 3522 2883 3047 6650 4047 8828 8732 5743 1091 381", P, " ")
        v = 0
        for (i = 1; i <= 4; i++) {
            e = 0
            for (j = 1; j <= 6; j++) e += A[(i - 1) * 6 + j] * (x[j] - P[(i - 1) * 6 + j] / 10000) ^ 2
            v -= al[i] * exp(-e)
        }
        v += 3.32237
    } else if (f == "sphere4") {
        v = 0; for (j = 1; j <= 4; j++) v += (x[j] - 1.5) ^ 2
    } else if (f == "mixed") {
        v = (log(x[1]) / log(10) + 2.5) ^ 2 + 20 * (x[2] - 0.1) ^ 2 + (x[3] == "gelu" ? 0 : 0.3)
    } else { print "unknown function " f > "/dev/stderr"; exit 1 }
    if (v < 0) v = 0
    printf "%.10g\n", v + (1 + v) * 2 / s
}'
