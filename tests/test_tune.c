/* tera tune's pieces (src/obs/tune.c): the search file and its errors, the rungs of ASHA and
 * Hyperband, the promotion rule, random sampling, and TPE against random search on test functions. */
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
}

static void test_errors(void **state) {
    (void)state;
    expect_error("[space]\ntraining.lrr = uniform 0.001 0.01\n", "training.lrr", "unknown key");
    expect_error("[space]\nlr = uniform 0.001 0.01\n", "'lr'", "config key");
    expect_error("[space]\ntraining.lr = uniform 0.01 0.001\n", "training.lr", "empty range");
    expect_error("[space]\ntraining.lr = uniform 0.01 0.01\n", "training.lr", "empty range");
    expect_error("[space]\ntraining.lr = uniform 1e-4 high\n", "training.lr", "bound 'high' is not a number");
    expect_error("[space]\ntraining.lr = normal 0 1\n", "training.lr", "unknown distribution 'normal'");
    expect_error("[space]\ntraining.lr = loguniform 0 0.1\n", "training.lr", "0 < LO");
    expect_error("[space]\nmodel.init_std = choice\n", "model.init_std", "empty range");
    expect_error("[space]\ntraining.warmup_steps = int 0 2.5\n", "training.warmup_steps", "not an integer");
    expect_error("[space]\ntraining.warmup_steps = int -5 2\n", "training.warmup_steps", "-5");
    expect_error("[space]\nmodel.drop_policy = choice position nearest\n", "model.drop_policy", "nearest");
    expect_error("[study]\nsampler = grid\n[space]\ntraining.lr = uniform 0.001 0.01\n", "sampler", "grid");
    expect_error("[study]\ntrails = 3\n[space]\ntraining.lr = uniform 0.001 0.01\n", "unknown key 'trails'", "[study]");
    expect_error("[study]\nmin_steps = 50\nmax_steps = 10\n[space]\ntraining.lr = uniform 0.001 0.01\n", "min_steps",
                 "empty range");
    expect_error("[study]\nname = x\n", "[space]", "no parameter");
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

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_parse), cmocka_unit_test(test_errors),
                                       cmocka_unit_test(test_rungs), cmocka_unit_test(test_random),
                                       cmocka_unit_test(test_tpe_beats_random)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
