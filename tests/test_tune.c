/* tera tune's pieces (src/obs/tune.c): the search file and its errors, the rungs of ASHA and
 * Hyperband, the promotion rule, random sampling, TPE and the Gaussian-process sampler against random
 * search on test functions, the GP's liars and determinism, and the map of values to one fidelity. */
#include "testutil.h"
#include "tera/tune.h"

static tera_search g_s;

/* The error of parsing text: "" when it parses. */
static const char *parse_error(const char *text) {
    static char msg[2048];
    msg[0] = '\0';
    if (tera_search_parse(&g_s, text, "search.ini") != TERA_OK) snprintf(msg, sizeof msg, "%s", tera_last_error());
    return msg;
}

static void expect_error(const char *text, const char *part1, const char *part2) {
    const char *e = parse_error(text);
    if (!strstr(e, part1) || !strstr(e, part2)) {
        fprintf(stderr, "for:\n%s\ngot: '%s'\nwant '%s' and '%s'\n", text, e, part1, part2);
        fail();
    }
}

static void test_parse(void **state) {
    (void)state;
    assert_string_equal(parse_error("[study]\nname = s1\nscheduler = hyperband\nmin_steps = 5\nmax_steps = 45\n"
                                    "args = --model.dim=32 --model.n_heads=4 --model.ffn_dim=32 --model.n_layers=2 "
                                    "--training.min_lr=1e-5\n[space]\n"
                                    "training.lr = loguniform 1e-4 1e-2\ntraining.warmup_steps = int 0 20\n"
                                    "model.aux_coef = uniform 0 0.05\nmodel.init_std = choice 0.01 0.02\n"), "");
    assert_int_equal(g_s.n_params, 4);
    assert_int_equal(g_s.params[0].dist, TERA_DIST_LOGUNIFORM);
    assert_int_equal(g_s.params[3].n_choices, 2);
    assert_string_equal(g_s.params[3].choices[1], "0.02");
    assert_int_equal(g_s.scheduler, TERA_SCHED_HYPERBAND);
    assert_string_equal(g_s.dir, "runs/tune-s1");
    /* objective commands take any parameter names */
    assert_string_equal(parse_error("[study]\nobjective = ./f.sh {x}\n[space]\nx = uniform -5 5\n"), "");
    /* every placeholder tera tune fills in; a shell's ${NAME} and awk's braces are not placeholders */
    assert_string_equal(parse_error("[study]\nobjective = sh -c 'f ${HOME} {x} {steps} {prev_steps} {trial} {dir}' | "
                                    "awk '{ print $1 }'\n[space]\nx = uniform -5 5\n"), "");
}

static void test_errors(void **state) {
    (void)state;
    expect_error("[space]\ntraining.lrr = uniform 0.001 0.01\n", "training.lrr", "unknown key");
    expect_error("[space]\nlr = uniform 0.001 0.01\n", "'lr'", "config key");
    expect_error("[space]\ntraining.lr = uniform 0.01 0.001\n", "training.lr", "empty range");
    expect_error("[space]\ntraining.lr = uniform 0.01 0.01\n", "training.lr", "empty range");
    /* a range whose width overflows (it sampled 1e308 every time) */
    expect_error("[space]\ntraining.lr = uniform -1e308 1e308\n", "training.lr", "HI - LO overflows");
    expect_error("[space]\ntraining.lr = uniform 1e-4 high\n", "training.lr", "bound 'high' is not a number");
    /* a number out of a double's range is not "not a number" */
    expect_error("[space]\ntraining.lr = loguniform 1e-320 1\n", "training.lr", "bound '1e-320' is out of range: below");
    expect_error("[space]\ntraining.lr = uniform 0 1e400\n", "training.lr", "bound '1e400' is out of range: beyond");
    expect_error("[space]\ntraining.lr = normal 0 1\n", "training.lr", "unknown distribution 'normal'");
    expect_error("[space]\ntraining.lr = loguniform 0 0.1\n", "training.lr", "0 < LO");
    expect_error("[space]\nmodel.init_std = choice\n", "model.init_std", "empty range");
    expect_error("[space]\ntraining.warmup_steps = int 0 2.5\n", "training.warmup_steps", "not an integer");
    /* a bound beyond 2^53 (was cast to int64 out of range: a nonsense value named in the error) */
    expect_error("[space]\nmodel.n_layers = int 1 1e30\n", "1e30", "at most 2^53");
    expect_error("[space]\ntraining.warmup_steps = int -5 2\n", "training.warmup_steps", "-5");
    expect_error("[space]\nmodel.drop_policy = choice position nearest\n", "model.drop_policy", "nearest");
    expect_error("[study]\nsampler = grid\n[space]\ntraining.lr = uniform 0.001 0.01\n", "sampler", "grid");
    expect_error("[study]\ntrails = 3\n[space]\ntraining.lr = uniform 0.001 0.01\n", "unknown key 'trails'", "[study]");
    expect_error("[study]\nmin_steps = 50\nmax_steps = 10\n[space]\ntraining.lr = uniform 0.001 0.01\n", "min_steps",
                 "empty range");
    expect_error("[study]\nname = x\n", "[space]", "no parameter");
    expect_error("[study]\nname =\n[space]\ntraining.lr = uniform 0.001 0.01\n", "[study] name", "empty");
    /* an unknown objective placeholder: refused before any trial runs (each trial's command had it as it was) */
    expect_error("[study]\nobjective = ./f.sh {x} {y}\n[space]\nx = uniform 0 1\n", "objective",
                 "unknown placeholder {y}");
    expect_error("[grid]\na = 1\n", "unknown section [grid]", "search.ini");
}

static void test_rungs(void **state) {
    (void)state;
    assert_string_equal(parse_error("[study]\nobjective = f\nscheduler = hyperband\nmin_steps = 1\nmax_steps = 27\n"
                                    "eta = 3\n[space]\nx = uniform 0 1\n"), "");
    int r[TERA_TUNE_MAX_RUNGS];
    assert_int_equal(tera_brackets(&g_s), 4);
    assert_int_equal(tera_rungs(&g_s, 0, r), 4);
    assert_int_equal(r[0], 1), assert_int_equal(r[1], 3), assert_int_equal(r[2], 9), assert_int_equal(r[3], 27);
    assert_int_equal(tera_rungs(&g_s, 2, r), 2);
    assert_int_equal(r[0], 9), assert_int_equal(r[1], 27);
    assert_int_equal(tera_rungs(&g_s, 3, r), 1);
    assert_int_equal(r[0], 27);
    g_s.scheduler = TERA_SCHED_ASHA;
    assert_int_equal(tera_brackets(&g_s), 1);
    g_s.scheduler = TERA_SCHED_NONE;
    assert_int_equal(tera_rungs(&g_s, 0, r), 1);
    assert_int_equal(r[0], 27);
    /* ASHA: the best floor(n / eta) of a rung are promoted */
    const double v[] = {5, 3, 4, 1, 2, 6};
    assert_true(tera_asha_promotable(5, v, 1, 3));  /* the first of a rung goes on */
    assert_false(tera_asha_promotable(5, v, 2, 3)); /* {5, 3}: only the best of max(1, 2/3) */
    assert_true(tera_asha_promotable(3, v, 2, 3));
    assert_true(tera_asha_promotable(1, v, 6, 3));
    assert_true(tera_asha_promotable(2, v, 6, 3));
    assert_false(tera_asha_promotable(3, v, 6, 3));
}

static void test_random(void **state) {
    (void)state;
    assert_string_equal(parse_error("[study]\nobjective = f\nseed = 7\n[space]\na = uniform -2 3\nb = loguniform 1e-4 "
                                    "1e-1\nc = int 0 4\nd = choice x y z\n"), "");
    double x[4], y[4];
    int seen_c[5] = {0}, seen_d[3] = {0}, low_b = 0;
    for (int t = 0; t < 400; t++) {
        tera_sample_random(&g_s, t, x);
        tera_sample_random(&g_s, t, y);
        assert_memory_equal(x, y, sizeof x); /* the stream is (seed, trial): reproducible */
        assert_true(x[0] >= -2 && x[0] <= 3);
        assert_true(x[1] >= 1e-4 && x[1] <= 1e-1);
        assert_true(x[2] == floor(x[2]) && x[2] >= 0 && x[2] <= 4);
        seen_c[(int)x[2]]++;
        seen_d[(int)x[3]]++;
        low_b += x[1] < 1e-2; /* log-uniform: 2 of 3 decades below 1e-2 */
    }
    for (int i = 0; i < 5; i++) assert_true(seen_c[i] > 40); /* the end points too */
    for (int i = 0; i < 3; i++) assert_true(seen_d[i] > 80);
    assert_true(low_b > 230 && low_b < 300);
    char t[64];
    tera_param_text(&g_s.params[3], 2, t, sizeof t);
    assert_string_equal(t, "z");
    tera_param_text(&g_s.params[2], 3.0, t, sizeof t);
    assert_string_equal(t, "3");
}

/* Sequential search (one trial at a time): the best value of f after n trials. */
typedef double (*objective_fn)(const double *x);
static double run_search(tera_search *s, objective_fn f, int n) {
    double xs[64 * TERA_TUNE_MAX_PARAMS], ys[64];
    int order[64];
    double best = INFINITY;
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < t; i++) order[i] = i;
        for (int i = 1; i < t; i++) /* insertion sort by value */
            for (int j = i; j > 0 && ys[order[j]] < ys[order[j - 1]]; j--) {
                const int k = order[j];
                order[j] = order[j - 1], order[j - 1] = k;
            }
        double *x = xs + (size_t)t * s->n_params;
        if (s->sampler == TERA_SAMPLER_TPE && t >= s->startup) tera_sample_tpe(s, xs, order, t, t, x);
        else if (s->sampler == TERA_SAMPLER_GP && t >= s->startup) tera_sample_gp(s, xs, ys, t, NULL, 0, t, x);
        else tera_sample_random(s, t, x);
        ys[t] = f(x);
        if (ys[t] < best) best = ys[t];
    }
    return best;
}

static double sphere(const double *x) { return (x[0] - 1.3) * (x[0] - 1.3) + (x[1] + 0.7) * (x[1] + 0.7); }
static double branin(const double *x) {
    const double a = 1, b = 5.1 / (4 * M_PI * M_PI), c = 5 / M_PI, r = 6, s = 10, t = 1 / (8 * M_PI);
    return a * pow(x[1] - b * x[0] * x[0] + c * x[0] - r, 2) + s * (1 - t) * cos(x[0]) + s - 0.397887;
}
static double log_bowl(const double *x) { /* a learning-rate-like optimum at 3e-3, choice 2 best */
    const double d = log10(x[0] / 3e-3);
    return d * d + (x[1] == 2 ? 0 : 0.5);
}

static double hartmann6(const double *x) { /* minimum 0 at (0.2017, 0.1500, 0.4769, 0.2753, 0.3117, 0.6573) */
    static const double al[4] = {1.0, 1.2, 3.0, 3.2};
    static const double A[4][6] = {{10, 3, 17, 3.5, 1.7, 8}, {0.05, 10, 17, 0.1, 8, 14}, {3, 3.5, 1.7, 10, 17, 8},
                                   {17, 8, 0.05, 10, 0.1, 14}};
    static const double P[4][6] = {{1312, 1696, 5569, 124, 8283, 5886}, {2329, 4135, 8307, 3736, 1004, 9991},
                                   {2348, 1451, 3522, 2883, 3047, 6650}, {4047, 8828, 8732, 5743, 1091, 381}};
    double v = 3.32237;
    for (int i = 0; i < 4; i++) {
        double e = 0;
        for (int j = 0; j < 6; j++) e += A[i][j] * pow(x[j] - P[i][j] / 1e4, 2);
        v -= al[i] * exp(-e);
    }
    return fmax(v, 0.0);
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median over 11 seeds of the best after 40 trials: TPE at least 2x closer to the optimum than random. */
static void compare(const char *text, objective_fn f) {
    assert_string_equal(parse_error(text), "");
    double tpe[11], rnd[11];
    for (int seed = 0; seed < 11; seed++) {
        g_s.seed = (uint64_t)seed + 1;
        g_s.sampler = TERA_SAMPLER_TPE;
        tpe[seed] = run_search(&g_s, f, 40);
        g_s.sampler = TERA_SAMPLER_RANDOM;
        rnd[seed] = run_search(&g_s, f, 40);
    }
    qsort(tpe, 11, sizeof(double), cmp_d);
    qsort(rnd, 11, sizeof(double), cmp_d);
    fprintf(stderr, "median best after 40 trials: tpe %.4g, random %.4g\n", tpe[5], rnd[5]);
    assert_true(tpe[5] <= 0.5 * rnd[5]);
}

static void test_tpe_beats_random(void **state) {
    (void)state;
    compare("[study]\nobjective = f\nstartup = 8\n[space]\nx = uniform -5 5\ny = uniform -5 5\n", sphere);
    compare("[study]\nobjective = f\nstartup = 8\n[space]\nx = uniform -5 10\ny = uniform 0 15\n", branin);
    compare("[study]\nobjective = f\nstartup = 8\n[space]\nlr = loguniform 1e-5 1\nc = choice a b c d\n", log_bowl);
}

/* Median over 11 seeds of the best of 40 trials on Hartmann-6 (6 dimensions, several local minima):
 * the GP sampler well below random search and TPE. */
static void test_gp_beats_tpe(void **state) {
    (void)state;
    assert_string_equal(parse_error("[study]\nobjective = f\nstartup = 8\n[space]\na = uniform 0 1\nb = uniform 0 1\n"
                                    "c = uniform 0 1\nd = uniform 0 1\ne = uniform 0 1\nf = uniform 0 1\n"), "");
    double gp[11], tpe[11], rnd[11];
    for (int seed = 0; seed < 11; seed++) {
        g_s.seed = (uint64_t)seed + 1;
        g_s.sampler = TERA_SAMPLER_GP;
        gp[seed] = run_search(&g_s, hartmann6, 40);
        g_s.sampler = TERA_SAMPLER_TPE;
        tpe[seed] = run_search(&g_s, hartmann6, 40);
        g_s.sampler = TERA_SAMPLER_RANDOM;
        rnd[seed] = run_search(&g_s, hartmann6, 40);
    }
    qsort(gp, 11, sizeof(double), cmp_d);
    qsort(tpe, 11, sizeof(double), cmp_d);
    qsort(rnd, 11, sizeof(double), cmp_d);
    fprintf(stderr, "hartmann6, median best after 40 trials: gp %.4g, tpe %.4g, random %.4g\n", gp[5], tpe[5], rnd[5]);
    assert_true(gp[5] <= 0.5 * rnd[5]);
    assert_true(gp[5] <= 0.5 * tpe[5]);
    /* and on the mixed space of the log bowl (log-uniform and a choice) */
    assert_string_equal(parse_error("[study]\nobjective = f\nstartup = 8\n[space]\nlr = loguniform 1e-5 1\n"
                                    "c = choice a b c d\n"), "");
    for (int seed = 0; seed < 11; seed++) {
        g_s.seed = (uint64_t)seed + 1;
        g_s.sampler = TERA_SAMPLER_GP;
        gp[seed] = run_search(&g_s, log_bowl, 40);
        g_s.sampler = TERA_SAMPLER_RANDOM;
        rnd[seed] = run_search(&g_s, log_bowl, 40);
    }
    qsort(gp, 11, sizeof(double), cmp_d);
    qsort(rnd, 11, sizeof(double), cmp_d);
    fprintf(stderr, "log bowl with a choice: gp %.4g, random %.4g\n", gp[5], rnd[5]);
    assert_true(gp[5] <= 0.5 * rnd[5]);
}

/* The GP's proposals: reproducible for (seed, trial), inside the space (ints whole, choices valid),
 * and a running trial (a liar) moves the next proposal away from it. */
static void test_gp_details(void **state) {
    (void)state;
    assert_string_equal(parse_error("[study]\nobjective = f\nseed = 3\n[space]\na = uniform -2 3\nb = loguniform 1e-4 "
                                    "1e-1\nc = int 0 4\nd = choice x y z\n"), "");
    double xs[12 * 4], ys[12];
    for (int t = 0; t < 12; t++) {
        tera_sample_random(&g_s, t, xs + 4 * t);
        ys[t] = pow(xs[4 * t] - 1, 2) + pow(log10(xs[4 * t + 1]) + 2, 2) + 0.1 * xs[4 * t + 2] + (xs[4 * t + 3] != 1);
    }
    double x[4], y[4], z[4];
    tera_sample_gp(&g_s, xs, ys, 12, NULL, 0, 12, x);
    tera_sample_gp(&g_s, xs, ys, 12, NULL, 0, 12, y);
    assert_memory_equal(x, y, sizeof x);
    assert_true(x[0] >= -2 && x[0] <= 3 && x[1] >= 1e-4 && x[1] <= 1e-1);
    assert_true(x[2] == floor(x[2]) && x[2] >= 0 && x[2] <= 4);
    assert_true(x[3] == 0 || x[3] == 1 || x[3] == 2);
    tera_sample_gp(&g_s, xs, ys, 12, x, 1, 12, z); /* x is running now */
    double d = 0;
    for (int j = 0; j < 2; j++) d += fabs(z[j] - x[j]);
    assert_true(d > 1e-3 || z[2] != x[2] || z[3] != x[3]);
    tera_sample_gp(&g_s, xs, ys, 1, NULL, 0, 12, z); /* too few observations: the random draw */
    tera_sample_random(&g_s, 12, y);
    assert_memory_equal(z, y, sizeof z);
}

#define assert_near(a, b, tol) assert_true(fabs((a) - (b)) <= (tol))

/* Values at three fidelity levels, v_l = a_l + b_l f: mapped to the top level exactly where every map
 * has 4 pairs or more; a shift with fewer; NAN where a level has no pair. */
static void test_fidelity_map(void **state) {
    (void)state;
    const double a[3] = {2.0, 0.7, 0.1}, b[3] = {3.0, 1.5, 1.05};
    enum { N = 10, L = 3 };
    double vals[N * L], out[N];
    for (int i = 0; i < N * L; i++) vals[i] = NAN;
    for (int i = 0; i < N; i++) {
        const double f = 0.3 * i + 0.05 * (i % 3);
        const int first = i < 6 ? 0 : i < 9 ? 1 : 2, last = i < 3 ? 0 : i < 8 ? 1 : 2; /* as ASHA's brackets */
        for (int l = first; l <= last; l++) vals[i * L + l] = a[l] + b[l] * f;
    }
    /* pairs 0->1: trials 3, 4, 5 (3: a shift); 1->2: trial 8 only (a shift) */
    tera_fidelity_map(vals, N, L, out);
    for (int i = 0; i < N; i++) assert_true(isfinite(out[i]));
    assert_near(out[9], vals[9 * L + 2], 1e-12); /* already at the top */
    assert_near(out[8], vals[8 * L + 2], 1e-12);
    /* with 4 or more pairs at each level, lines: exact */
    for (int i = 0; i < N; i++) {
        const double f = 0.3 * i + 0.05 * (i % 3);
        for (int l = 0; l < L; l++) vals[i * L + l] = (i < 3 && l > 0) ? NAN : a[l] + b[l] * f;
    }
    tera_fidelity_map(vals, N, L, out);
    for (int i = 0; i < N; i++) assert_near(out[i], a[2] + b[2] * (0.3 * i + 0.05 * (i % 3)), 1e-9);
    /* no pair from level 0 to 1: level 0's values cannot be mapped */
    for (int i = 0; i < N * L; i++) vals[i] = NAN;
    vals[0 * L + 0] = 5.0, vals[1 * L + 1] = 3.0, vals[1 * L + 2] = 2.0, vals[2 * L + 2] = 1.0;
    tera_fidelity_map(vals, 3, L, out);
    assert_true(isnan(out[0]));
    assert_near(out[1], 2.0, 1e-12);
    assert_near(out[2], 1.0, 1e-12);
    vals[1 * L + 0] = 4.0; /* one pair 0 -> 1: a shift by -1, then 1 -> 2 by -1 */
    tera_fidelity_map(vals, 3, L, out);
    assert_near(out[0], 3.0, 1e-12);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_parse), cmocka_unit_test(test_errors),
                                       cmocka_unit_test(test_rungs), cmocka_unit_test(test_random),
                                       cmocka_unit_test(test_tpe_beats_random), cmocka_unit_test(test_gp_beats_tpe),
                                       cmocka_unit_test(test_gp_details), cmocka_unit_test(test_fidelity_map)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
