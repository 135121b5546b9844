/* Search space, samplers (random, TPE, Gaussian process) and ASHA / Hyperband rungs (include/tera/tune.h).
 *
 * TPE follows Bergstra, Bardenet, Bengio and Kegl, "Algorithms for Hyper-Parameter Optimization"
 * (NeurIPS 2011): the observations are split at the gamma quantile of their objective into a good
 * group and the rest; each group's density over a parameter is a Parzen estimator (a mixture of
 * truncated Gaussians, one per observation plus one for the prior, each as wide as the larger gap to
 * its neighbours); candidates drawn from the good density l(x) are ranked by l(x) / g(x), which is
 * monotone in the expected improvement. Parameters are modelled independently (the tree of the
 * paper has no conditional nodes here); log-uniform parameters are modelled in log space, integers
 * on [lo - 0.5, hi + 0.5] and rounded; choices by smoothed counts. */
#include "tera/tune.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>


#include "tera/io.h"

/* ---- parsing ------------------------------------------------------------------------------------ */

typedef struct {
    tera_search *s;
    const char *path;
    tera_status st;
} parse_ctx;

static int parse_double(const char *t, double *v) {
    char *end;
    errno = 0;
    *v = strtod(t, &end);
    return end != t && *end == '\0' && errno == 0 && isfinite(*v);
}

static int parse_int(const char *t, long lo, long hi, int *v) {
    char *end;
    errno = 0;
    const long x = strtol(t, &end, 10);
    if (end == t || *end != '\0' || errno || x < lo || x > hi) return 0;
    *v = (int)x;
    return 1;
}

static tera_status study_key(parse_ctx *c, const char *name, const char *value) {
    tera_search *s = c->s;
    struct {
        const char *key;
        char *dst;
        size_t cap;
    } strs[] = {{"name", s->name, sizeof s->name},     {"base", s->base, sizeof s->base},
                {"objective", s->objective, sizeof s->objective}, {"args", s->args, sizeof s->args},
                {"dir", s->dir, sizeof s->dir},        {"registry", s->registry, sizeof s->registry},
                {"metric", s->metric, sizeof s->metric}};
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
        if (!strcmp(name, strs[i].key)) {
            if (strlen(value) >= strs[i].cap)
                return tera_fail(TERA_ERR_CONFIG, "%s: [study] %s: the value is too long (at most %zu characters)",
                                 c->path, name, strs[i].cap - 1);
            snprintf(strs[i].dst, strs[i].cap, "%s", value);
            if (!strcmp(name, "name") && !value[0])
                return tera_fail(TERA_ERR_CONFIG, "%s: [study] name is empty: a study needs a name (its key in the "
                                 "registry)", c->path);
            if (!strcmp(name, "metric") && strcmp(value, "loss") != 0 && strcmp(value, "val_loss") != 0)
                return tera_fail(TERA_ERR_CONFIG, "%s: [study] metric = '%s': expected loss or val_loss", c->path, value);
            return TERA_OK;
        }
    struct {
        const char *key;
        int *dst;
        long lo, hi;
    } ints[] = {{"trials", &s->trials, 1, 100000}, {"parallel", &s->parallel, 1, 256},
                {"min_steps", &s->min_steps, 1, 1L << 30}, {"max_steps", &s->max_steps, 1, 1L << 30},
                {"eta", &s->eta, 2, 100}, {"window", &s->window, 1, 1L << 20},
                {"startup", &s->startup, 0, 100000}, {"candidates", &s->candidates, 1, 10000}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (!strcmp(name, ints[i].key)) {
            if (!parse_int(value, ints[i].lo, ints[i].hi, ints[i].dst))
                return tera_fail(TERA_ERR_CONFIG, "%s: [study] %s = '%s': expected an integer in [%ld, %ld]", c->path,
                                 name, value, ints[i].lo, ints[i].hi);
            return TERA_OK;
        }
    if (!strcmp(name, "budget")) {
        int b;
        if (!parse_int(value, 0, 1L << 30, &b))
            return tera_fail(TERA_ERR_CONFIG, "%s: [study] budget = '%s': expected trial-steps, an integer >= 0", c->path,
                             value);
        s->budget = b;
        return TERA_OK;
    }
    if (!strcmp(name, "seed")) {
        char *end;
        errno = 0;
        s->seed = strtoull(value, &end, 10);
        if (end == value || *end || errno)
            return tera_fail(TERA_ERR_CONFIG, "%s: [study] seed = '%s': expected a non-negative integer", c->path, value);
        return TERA_OK;
    }
    if (!strcmp(name, "gamma")) {
        if (!parse_double(value, &s->gamma) || s->gamma <= 0 || s->gamma >= 1)
            return tera_fail(TERA_ERR_CONFIG, "%s: [study] gamma = '%s': expected a number in (0, 1)", c->path, value);
        return TERA_OK;
    }
    if (!strcmp(name, "sampler")) {
        if (!strcmp(value, "random")) s->sampler = TERA_SAMPLER_RANDOM;
        else if (!strcmp(value, "tpe")) s->sampler = TERA_SAMPLER_TPE;
        else if (!strcmp(value, "gp")) s->sampler = TERA_SAMPLER_GP;
        else return tera_fail(TERA_ERR_CONFIG, "%s: [study] sampler = '%s': expected random, tpe or gp", c->path, value);
        return TERA_OK;
    }
    if (!strcmp(name, "scheduler")) {
        if (!strcmp(value, "none")) s->scheduler = TERA_SCHED_NONE;
        else if (!strcmp(value, "asha")) s->scheduler = TERA_SCHED_ASHA;
        else if (!strcmp(value, "hyperband")) s->scheduler = TERA_SCHED_HYPERBAND;
        else return tera_fail(TERA_ERR_CONFIG, "%s: [study] scheduler = '%s': expected none, asha or hyperband", c->path,
                              value);
        return TERA_OK;
    }
    return tera_fail(TERA_ERR_CONFIG, "%s: [study] unknown key '%s' (name, base, objective, args, dir, registry, "
                     "metric, sampler, scheduler, trials, budget, parallel, seed, min_steps, max_steps, eta, window, startup, "
                     "gamma, candidates)", c->path, name);
}

static tera_status space_key(parse_ctx *c, const char *name, const char *value) {
    tera_search *s = c->s;
    if (s->n_params == TERA_TUNE_MAX_PARAMS)
        return tera_fail(TERA_ERR_CONFIG, "%s: [space] at most %d parameters", c->path, TERA_TUNE_MAX_PARAMS);
    for (int i = 0; i < s->n_params; i++)
        if (!strcmp(s->params[i].key, name))
            return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s is given twice", c->path, name);
    if (strlen(name) >= sizeof s->params[0].key)
        return tera_fail(TERA_ERR_CONFIG, "%s: [space] key '%s' is too long", c->path, name);
    tera_param_spec *p = &s->params[s->n_params];
    memset(p, 0, sizeof *p);
    snprintf(p->key, sizeof p->key, "%s", name);
    char words[TERA_TUNE_MAX_CHOICES + 2][64];
    int n = 0;
    const char *q = value;
    while (*q) {
        while (*q && isspace((unsigned char)*q)) q++;
        if (!*q) break;
        const char *e = q;
        while (*e && !isspace((unsigned char)*e)) e++;
        if (n == TERA_TUNE_MAX_CHOICES + 2 || e - q >= 64)
            return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s = '%s': too many or too long words (at most %d choices "
                             "of 63 characters)", c->path, name, value, TERA_TUNE_MAX_CHOICES);
        snprintf(words[n++], 64, "%.*s", (int)(e - q), q);
        q = e;
    }
    if (n == 0)
        return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s is empty: expected uniform LO HI, loguniform LO HI, int LO HI "
                         "or choice A B ...", c->path, name);
    const char *d = words[0];
    if (!strcmp(d, "choice")) {
        p->dist = TERA_DIST_CHOICE;
        if (n < 2) return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s = '%s': a choice needs at least one value (empty "
                                    "range)", c->path, name, value);
        p->n_choices = n - 1;
        for (int i = 1; i < n; i++) snprintf(p->choices[i - 1], 64, "%s", words[i]);
    } else {
        if (!strcmp(d, "uniform")) p->dist = TERA_DIST_UNIFORM;
        else if (!strcmp(d, "loguniform") || !strcmp(d, "log")) p->dist = TERA_DIST_LOGUNIFORM;
        else if (!strcmp(d, "int")) p->dist = TERA_DIST_INT;
        else return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s = '%s': unknown distribution '%s' (uniform, loguniform, "
                              "int, choice)", c->path, name, value, d);
        if (n != 3) return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s = '%s': expected %s LO HI", c->path, name, value, d);
        for (int i = 1; i < 3; i++) {
            double v;
            if (!parse_double(words[i], &v)) {
                char *end;
                const double x = strtod(words[i], &end); /* a number strtod reads whole but out of range */
                if (end == words[i] || *end || isnan(x))
                    return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s: bound '%s' is not a number", c->path, name,
                                     words[i]);
                return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s: bound '%s' is out of range: %s", c->path, name,
                                 words[i], fabs(x) <= 1.0 ? "below 2.2e-308 in magnitude and not 0 (subnormal or "
                                 "underflowing)" : "beyond the largest double, 1.8e308 in magnitude");
            }
            if (p->dist == TERA_DIST_INT && (v != floor(v) || fabs(v) > 9007199254740992.0)) /* 2^53: exact, castable */
                return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s: bound '%s' of an int range is not an integer of at "
                                 "most 2^53 in magnitude", c->path, name, words[i]);
            *(i == 1 ? &p->lo : &p->hi) = v;
        }
        if (!(p->lo < p->hi))
            return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s = '%s': empty range (LO must be below HI)", c->path, name,
                             value);
        if (!isfinite(p->hi - p->lo)) /* uniform -1e308 1e308 sampled 1e308 every time */
            return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s = '%s': HI - LO overflows a double", c->path, name, value);
        if (p->dist == TERA_DIST_LOGUNIFORM && p->lo <= 0)
            return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s = '%s': loguniform needs 0 < LO", c->path, name, value);
    }
    s->n_params++;
    return TERA_OK;
}

static int ini_cb(void *user, const char *section, const char *name, const char *value) {
    parse_ctx *c = user;
    if (c->st != TERA_OK) return 1;
    if (!strcmp(section, "study")) c->st = study_key(c, name, value);
    else if (!strcmp(section, "space")) c->st = space_key(c, name, value);
    else c->st = tera_fail(TERA_ERR_CONFIG, "%s: unknown section [%s] (expected [study] and [space])", c->path, section);
    return 1;
}

/* INI text without a line-length limit: [section], key = value (blanks and a pair of double quotes
 * around the value removed), comment lines starting with # or ;. */
static tera_status parse_ini(const char *text, const char *path, parse_ctx *c) {
    char section[128] = "";
    int lineno = 0;
    for (const char *p = text; *p && c->st == TERA_OK;) {
        const char *e = strchr(p, '\n');
        const size_t n = e ? (size_t)(e - p) : strlen(p);
        lineno++;
        char *line = tera_malloc(n + 1);
        memcpy(line, p, n);
        line[n] = '\0';
        p += n + (e ? 1 : 0);
        char *s = line;
        while (isspace((unsigned char)*s)) s++;
        size_t len = strlen(s);
        while (len > 0 && isspace((unsigned char)s[len - 1])) s[--len] = '\0';
        if (!*s || *s == '#' || *s == ';') {
            free(line);
            continue;
        }
        if (*s == '[') {
            if (s[len - 1] != ']' || len - 2 >= sizeof section) {
                free(line);
                return tera_fail(TERA_ERR_CONFIG, "%s: line %d: expected [section]", path, lineno);
            }
            snprintf(section, sizeof section, "%.*s", (int)(len - 2), s + 1);
            free(line);
            continue;
        }
        char *eq = strchr(s, '=');
        if (!eq) {
            free(line);
            return tera_fail(TERA_ERR_CONFIG, "%s: line %d: expected key = value", path, lineno);
        }
        char *ke = eq;
        while (ke > s && isspace((unsigned char)ke[-1])) ke--;
        *ke = '\0';
        char *v = eq + 1;
        while (isspace((unsigned char)*v)) v++;
        size_t vl = strlen(v);
        if (vl >= 2 && v[0] == '"' && v[vl - 1] == '"') v[vl - 1] = '\0', v++;
        ini_cb(c, section, s, v);
        free(line);
    }
    return c->st;
}

/* A config key and value the trials will set, on top of the base config and [study] args: a refused
 * value (also by a cross-key check such as min_lr <= lr) names the key. */
static tera_status check_config_key(const char *path, const tera_config *base, const tera_param_spec *p,
                                    const char *text) {
    tera_config cfg = *base;
    char a[256];
    snprintf(a, sizeof a, "%s=%s", p->key, text);
    if (tera_config_set(&cfg, a) != TERA_OK || tera_config_finalize(&cfg) != TERA_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", tera_last_error());
        return tera_fail(TERA_ERR_CONFIG, "%s: [space] %s: %s", path, p->key, why);
    }
    return TERA_OK;
}

/* The objective's {NAME} placeholders (NAME of letters, digits, _ . -; a shell's ${NAME} is left
 * alone) are the parameters and steps, prev_steps, trial, dir: an unknown one is refused here, not
 * passed to every trial's command as it is. */
static tera_status check_placeholders(const tera_search *s, const char *path) {
    static const char *const own[] = {"steps", "prev_steps", "trial", "dir"};
    for (const char *p = strchr(s->objective, '{'); p; p = strchr(p + 1, '{')) {
        size_t n = 0;
        while (p[1 + n] && (isalnum((unsigned char)p[1 + n]) || strchr("_.-", p[1 + n]))) n++;
        if (n == 0 || p[1 + n] != '}' || (p > s->objective && p[-1] == '$')) continue;
        int known = 0;
        for (size_t k = 0; k < sizeof own / sizeof own[0]; k++) known |= strlen(own[k]) == n && !strncmp(own[k], p + 1, n);
        for (int i = 0; i < s->n_params; i++) known |= strlen(s->params[i].key) == n && !strncmp(s->params[i].key, p + 1, n);
        if (!known)
            return tera_fail(TERA_ERR_CONFIG, "%s: [study] objective: unknown placeholder {%.*s} (a [space] parameter, "
                             "{steps}, {prev_steps}, {trial} or {dir})", path, (int)n, p + 1);
    }
    return TERA_OK;
}

tera_status tera_search_parse(tera_search *s, const char *text, const char *path) {
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "study");
    snprintf(s->metric, sizeof s->metric, "loss");
    s->sampler = TERA_SAMPLER_GP;
    s->scheduler = TERA_SCHED_ASHA;
    s->trials = 20;
    s->parallel = 1;
    s->seed = 1;
    s->min_steps = 10;
    s->max_steps = 90;
    s->eta = 3;
    s->window = 5;
    s->startup = 5;
    s->gamma = 0.15;
    s->candidates = 24;
    if (strlen(text) >= sizeof s->text)
        return tera_fail(TERA_ERR_CONFIG, "%s: the search file is longer than %zu bytes", path, sizeof s->text - 1);
    snprintf(s->text, sizeof s->text, "%s", text);
    parse_ctx c = {s, path, TERA_OK};
    TERA_TRY(parse_ini(text, path, &c));
    if (s->n_params == 0) return tera_fail(TERA_ERR_CONFIG, "%s: [space] names no parameter", path);
    if (s->min_steps > s->max_steps)
        return tera_fail(TERA_ERR_CONFIG, "%s: [study] min_steps = %d is above max_steps = %d (empty range)", path,
                         s->min_steps, s->max_steps);
    if (!s->dir[0]) snprintf(s->dir, sizeof s->dir, "runs/tune-%.100s", s->name);
    if (!s->registry[0]) snprintf(s->registry, sizeof s->registry, "runs/registry.db");
    if (!s->objective[0]) { /* tera train trials: every key is a config key the trainer accepts */
        tera_config *base = tera_calloc(1, sizeof *base);
        tera_config_defaults(base);
        tera_status st = s->base[0] ? tera_config_load(base, s->base) : TERA_OK;
        char store[sizeof s->args];
        snprintf(store, sizeof store, "%s", s->args);
        for (char *save = NULL, *w = strtok_r(store, " \t", &save); w && st == TERA_OK; w = strtok_r(NULL, " \t", &save)) {
            if (strncmp(w, "--", 2) != 0 || !strchr(w, '='))
                st = tera_fail(TERA_ERR_CONFIG, "%s: [study] args: '%s' is not a --section.key=value override", path, w);
            else if (tera_config_set(base, w + 2) != TERA_OK)
                st = tera_fail(TERA_ERR_CONFIG, "%s: [study] args: %s", path, tera_last_error());
        }
        for (int i = 0; i < s->n_params && st == TERA_OK; i++) {
            const tera_param_spec *p = &s->params[i];
            if (!strchr(p->key, '.')) {
                free(base);
                return tera_fail(TERA_ERR_CONFIG, "%s: [space] unknown key '%s': trials are tera train runs, so every "
                                 "key is a config key section.key (or set [study] objective to a command)", path,
                                 p->key);
            }
            char t[64];
            if (p->dist == TERA_DIST_CHOICE) {
                for (int k = 0; k < p->n_choices && st == TERA_OK; k++) st = check_config_key(path, base, p, p->choices[k]);
            } else {
                tera_param_text(p, p->lo, t, sizeof t);
                st = check_config_key(path, base, p, t);
                tera_param_text(p, p->hi, t, sizeof t);
                if (st == TERA_OK) st = check_config_key(path, base, p, t);
            }
        }
        free(base);
        return st;
    }
    return check_placeholders(s, path);
}

tera_status tera_search_load(tera_search *s, const char *path) {
    char *text = NULL;
    TERA_TRY(tera_read_text_file(path, &text));
    tera_status st = tera_search_parse(s, text, path);
    free(text);
    return st;
}

void tera_param_text(const tera_param_spec *p, double v, char *buf, size_t n) {
    if (p->dist == TERA_DIST_CHOICE) {
        int i = (int)v;
        if (i < 0) i = 0;
        if (i >= p->n_choices) i = p->n_choices - 1;
        snprintf(buf, n, "%s", p->choices[i]);
    } else if (p->dist == TERA_DIST_INT) {
        snprintf(buf, n, "%ld", (long)llround(v));
    } else {
        snprintf(buf, n, "%.6g", v);
    }
}

/* ---- random numbers: a counter-based stream (splitmix64 of seed, trial, parameter, draw) --------- */

static uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct {
    uint64_t key, ctr;
} rng_t;

static rng_t rng_for(uint64_t seed, int64_t number, int param) {
    rng_t r = {mix64(mix64(seed) ^ mix64((uint64_t)number * 0x100000001b3ull + (uint64_t)param * 7919u + 1)), 0};
    return r;
}

static double rng_u01(rng_t *r) { /* (0, 1) */
    const uint64_t x = mix64(r->key + 0x632be59bd9b4e019ull * ++r->ctr);
    return ((double)(x >> 11) + 0.5) / 9007199254740992.0;
}

static double rng_normal(rng_t *r) {
    const double u = rng_u01(r), v = rng_u01(r);
    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

/* A parameter's internal interval (log space for loguniform, widened by 0.5 for int). */
static void internal_range(const tera_param_spec *p, double *lo, double *hi) {
    if (p->dist == TERA_DIST_LOGUNIFORM) *lo = log(p->lo), *hi = log(p->hi);
    else if (p->dist == TERA_DIST_INT) *lo = p->lo - 0.5, *hi = p->hi + 0.5;
    else *lo = p->lo, *hi = p->hi;
}
static double to_internal(const tera_param_spec *p, double v) { return p->dist == TERA_DIST_LOGUNIFORM ? log(v) : v; }
static double from_internal(const tera_param_spec *p, double u) {
    if (p->dist == TERA_DIST_LOGUNIFORM) return fmin(fmax(exp(u), p->lo), p->hi);
    if (p->dist == TERA_DIST_INT) return fmin(fmax(round(u), p->lo), p->hi);
    return fmin(fmax(u, p->lo), p->hi);
}

static double sample_one_random(const tera_param_spec *p, rng_t *r) {
    if (p->dist == TERA_DIST_CHOICE) {
        int i = (int)(rng_u01(r) * p->n_choices);
        return i >= p->n_choices ? p->n_choices - 1 : i;
    }
    double lo, hi;
    internal_range(p, &lo, &hi);
    return from_internal(p, lo + (hi - lo) * rng_u01(r));
}

void tera_sample_random(const tera_search *s, int64_t number, double *x) {
    for (int i = 0; i < s->n_params; i++) {
        rng_t r = rng_for(s->seed, number, i);
        x[i] = sample_one_random(&s->params[i], &r);
    }
}

/* ---- TPE ------------------------------------------------------------------------------------------ */

typedef struct {
    int n;              /* components: observations + the prior */
    double *mu, *sigma; /* [n] */
    double *logz;       /* [n] log of each truncated component's mass in [lo, hi] */
    double lo, hi;
} parzen;

static double norm_cdf(double z) { return 0.5 * erfc(-z / M_SQRT2); }

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The estimator over pts[m] (internal values) plus the prior N((lo+hi)/2, hi-lo). */
static void parzen_build(parzen *pz, const double *pts, int m, double lo, double hi) {
    pz->n = m + 1;
    pz->lo = lo, pz->hi = hi;
    pz->mu = tera_malloc((size_t)pz->n * sizeof(double));
    pz->sigma = tera_malloc((size_t)pz->n * sizeof(double));
    pz->logz = tera_malloc((size_t)pz->n * sizeof(double));
    for (int i = 0; i < m; i++) pz->mu[i] = pts[i];
    pz->mu[m] = 0.5 * (lo + hi);
    qsort(pz->mu, (size_t)pz->n, sizeof(double), cmp_double);
    const double range = hi - lo;
    const double smin = range / fmin(100.0, 1.0 + pz->n), smax = range;
    for (int i = 0; i < pz->n; i++) { /* the larger gap to a neighbour (the interval's ends at the edges) */
        const double left = pz->mu[i] - (i > 0 ? pz->mu[i - 1] : lo);
        const double right = (i + 1 < pz->n ? pz->mu[i + 1] : hi) - pz->mu[i];
        pz->sigma[i] = fmin(fmax(fmax(left, right), smin), smax);
    }
    /* the prior component is as wide as the range */
    for (int i = 0; i < pz->n; i++)
        if (pz->mu[i] == 0.5 * (lo + hi)) {
            pz->sigma[i] = range;
            break;
        }
    for (int i = 0; i < pz->n; i++) {
        const double z = norm_cdf((hi - pz->mu[i]) / pz->sigma[i]) - norm_cdf((lo - pz->mu[i]) / pz->sigma[i]);
        pz->logz[i] = log(fmax(z, 1e-300));
    }
}

static void parzen_free(parzen *pz) {
    free(pz->mu);
    free(pz->sigma);
    free(pz->logz);
}

static double parzen_logpdf(const parzen *pz, double x) {
    double mx = -INFINITY;
    double *t = tera_malloc((size_t)pz->n * sizeof(double));
    for (int i = 0; i < pz->n; i++) {
        const double z = (x - pz->mu[i]) / pz->sigma[i];
        t[i] = -0.5 * z * z - log(pz->sigma[i]) - 0.5 * log(2 * M_PI) - pz->logz[i];
        if (t[i] > mx) mx = t[i];
    }
    double sum = 0;
    for (int i = 0; i < pz->n; i++) sum += exp(t[i] - mx);
    free(t);
    return mx + log(sum / pz->n);
}

static double parzen_sample(const parzen *pz, rng_t *r) {
    int i = (int)(rng_u01(r) * pz->n);
    if (i >= pz->n) i = pz->n - 1;
    for (int tries = 0; tries < 100; tries++) {
        const double x = pz->mu[i] + pz->sigma[i] * rng_normal(r);
        if (x >= pz->lo && x <= pz->hi) return x;
    }
    return fmin(fmax(pz->mu[i], pz->lo), pz->hi);
}

void tera_sample_tpe(const tera_search *s, const double *xs, const int *order, int n, int64_t number, double *x) {
    if (n < 2) {
        tera_sample_random(s, number, x);
        return;
    }
    int n_good = (int)ceil(s->gamma * n);
    if (n_good < 1) n_good = 1;
    if (n_good > n - 1) n_good = n - 1;
    const int n_bad = n - n_good;
    double *good = tera_malloc((size_t)n * sizeof(double)), *bad = tera_malloc((size_t)n * sizeof(double));
    for (int pi = 0; pi < s->n_params; pi++) {
        const tera_param_spec *p = &s->params[pi];
        rng_t r = rng_for(s->seed, number, pi);
        if (p->dist == TERA_DIST_CHOICE) { /* smoothed counts: one pseudo-observation per choice */
            double wl[TERA_TUNE_MAX_CHOICES], wg[TERA_TUNE_MAX_CHOICES], sl = 0, sg = 0;
            for (int k = 0; k < p->n_choices; k++) wl[k] = wg[k] = 1.0;
            for (int j = 0; j < n; j++) {
                const int k = (int)xs[(size_t)order[j] * s->n_params + pi];
                if (k >= 0 && k < p->n_choices) (j < n_good ? wl : wg)[k] += 1.0;
            }
            for (int k = 0; k < p->n_choices; k++) sl += wl[k], sg += wg[k];
            double best = -INFINITY;
            int best_k = 0;
            for (int c = 0; c < s->candidates; c++) {
                double u = rng_u01(&r) * sl;
                int k = 0;
                while (k + 1 < p->n_choices && u > wl[k]) u -= wl[k++];
                const double score = log(wl[k] / sl) - log(wg[k] / sg);
                if (score > best) best = score, best_k = k;
            }
            x[pi] = best_k;
            continue;
        }
        double lo, hi;
        internal_range(p, &lo, &hi);
        for (int j = 0; j < n; j++) {
            const double v = to_internal(p, xs[(size_t)order[j] * s->n_params + pi]);
            if (j < n_good) good[j] = v;
            else bad[j - n_good] = v;
        }
        parzen l, g;
        parzen_build(&l, good, n_good, lo, hi);
        parzen_build(&g, bad, n_bad, lo, hi);
        double best = -INFINITY, best_x = 0.5 * (lo + hi);
        for (int c = 0; c < s->candidates; c++) {
            const double cand = parzen_sample(&l, &r);
            const double score = parzen_logpdf(&l, cand) - parzen_logpdf(&g, cand);
            if (score > best) best = score, best_x = cand;
        }
        parzen_free(&l);
        parzen_free(&g);
        x[pi] = from_internal(p, best_x);
    }
    free(good);
    free(bad);
}

/* ---- ASHA / Hyperband ------------------------------------------------------------------------------ */

int tera_brackets(const tera_search *s) {
    if (s->scheduler != TERA_SCHED_HYPERBAND) return 1;
    int b = 1;
    for (double r = s->min_steps; r < s->max_steps && b < TERA_TUNE_MAX_RUNGS; r *= s->eta) b++;
    return b;
}

int tera_rungs(const tera_search *s, int bracket, int *steps) {
    int n = 0;
    if (s->scheduler != TERA_SCHED_NONE) {
        double r = s->min_steps;
        for (int b = 0; b < bracket; b++) r *= s->eta;
        for (; r < s->max_steps && n < TERA_TUNE_MAX_RUNGS - 1; r *= s->eta) steps[n++] = (int)r;
    }
    steps[n++] = s->max_steps;
    return n;
}

int tera_asha_promotable(double v, const double *values, int n, int eta) {
    const int top = n / eta > 1 ? n / eta : 1; /* the best of a rung always goes on (as Optuna's ASHA) */
    int better = 0;
    for (int i = 0; i < n; i++) better += values[i] < v;
    return better < top;
}

/* ---- bringing values to one fidelity ----------------------------------------------------------------- */

/* Each level's values are mapped to the next level's by a least-squares line over the trials seen at
 * both (a promoted trial gives one pair), then chained to the top level. With fewer than 4 pairs, or
 * a slope that is not positive, the map is a shift by the mean difference (any pair at all); no pair:
 * the level cannot be mapped (NAN). */
void tera_fidelity_map(const double *vals, int n, int levels, double *out) {
    double a[TERA_TUNE_MAX_RUNGS], b[TERA_TUNE_MAX_RUNGS]; /* level k -> k + 1: a + b v */
    int ok[TERA_TUNE_MAX_RUNGS];
    TERA_ASSERT(levels >= 1 && levels <= TERA_TUNE_MAX_RUNGS);
    for (int k = 0; k + 1 < levels; k++) {
        double sx = 0, sy = 0, sxx = 0, sxy = 0;
        int m = 0;
        for (int i = 0; i < n; i++) {
            const double x = vals[(size_t)i * levels + k], y = vals[(size_t)i * levels + k + 1];
            if (isnan(x) || isnan(y)) continue;
            sx += x, sy += y, sxx += x * x, sxy += x * y, m++;
        }
        ok[k] = m > 0;
        if (!m) continue;
        const double mx = sx / m, my = sy / m, vx = sxx / m - mx * mx, cxy = sxy / m - mx * my;
        b[k] = m >= 4 && vx > 1e-12 * (1 + mx * mx) && cxy > 0 ? cxy / vx : 1.0;
        a[k] = my - b[k] * mx;
    }
    for (int i = 0; i < n; i++) {
        int top = -1;
        for (int k = 0; k < levels; k++)
            if (!isnan(vals[(size_t)i * levels + k])) top = k;
        double v = top >= 0 ? vals[(size_t)i * levels + top] : NAN;
        for (int k = top; k >= 0 && k + 1 < levels && !isnan(v); k++) v = ok[k] ? a[k] + b[k] * v : NAN;
        out[i] = v;
    }
}

/* ---- Gaussian-process sampler ------------------------------------------------------------------------- */

/* Parameters in the unit cube (internal range scaled to [0, 1]); a choice stays its index and its
 * distance is 0 or 1. Matern 5/2 kernel, one length per parameter, signal variance 1 on standardised
 * values, and a noise variance; the lengths and the noise maximise the marginal likelihood (a few
 * coordinate sweeps over a grid, with a weak log-normal prior on each length). */
typedef struct {
    const tera_search *s;
    int n, p;
    double *X, *y;    /* [n][p], [n] */
    double ls[TERA_TUNE_MAX_PARAMS], noise;
    double *L, *alpha; /* [n][n] Cholesky factor of K + noise I, [n] (K + noise I)^-1 y */
} gp_model;

static double gp_kernel(const gp_model *g, const double *a, const double *b) {
    double r2 = 0;
    for (int j = 0; j < g->p; j++) {
        const double d = g->s->params[j].dist == TERA_DIST_CHOICE ? (a[j] != b[j]) : a[j] - b[j];
        r2 += d * d / (g->ls[j] * g->ls[j]);
    }
    const double r = sqrt(5.0 * r2);
    return (1.0 + r + r * r / 3.0) * exp(-r);
}

/* Factorises K + noise I; returns the log marginal likelihood plus the lengths' log prior (-inf when
 * not positive definite). */
static double gp_fit(gp_model *g) {
    const int n = g->n;
    double *L = g->L;
    for (int i = 0; i < n; i++)
        for (int j = 0; j <= i; j++) L[(size_t)i * n + j] = gp_kernel(g, g->X + (size_t)i * g->p, g->X + (size_t)j * g->p) +
                                                             (i == j ? g->noise : 0.0);
    double logdet = 0;
    for (int j = 0; j < n; j++) {
        double d = L[(size_t)j * n + j];
        for (int k = 0; k < j; k++) d -= L[(size_t)j * n + k] * L[(size_t)j * n + k];
        if (!(d > 1e-12)) return -INFINITY;
        d = sqrt(d);
        L[(size_t)j * n + j] = d;
        logdet += 2.0 * log(d);
        for (int i = j + 1; i < n; i++) {
            double v = L[(size_t)i * n + j];
            for (int k = 0; k < j; k++) v -= L[(size_t)i * n + k] * L[(size_t)j * n + k];
            L[(size_t)i * n + j] = v / d;
        }
    }
    for (int i = 0; i < n; i++) { /* L z = y, then L^T alpha = z */
        double v = g->y[i];
        for (int k = 0; k < i; k++) v -= L[(size_t)i * n + k] * g->alpha[k];
        g->alpha[i] = v / L[(size_t)i * n + i];
    }
    double fit = 0;
    for (int i = 0; i < n; i++) fit += g->alpha[i] * g->alpha[i];
    for (int i = n - 1; i >= 0; i--) {
        double v = g->alpha[i];
        for (int k = i + 1; k < n; k++) v -= L[(size_t)k * n + i] * g->alpha[k];
        g->alpha[i] = v / L[(size_t)i * n + i];
    }
    double prior = 0;
    for (int j = 0; j < g->p; j++) prior -= 0.5 * pow(log(g->ls[j] / 0.5) / 1.5, 2);
    return -0.5 * fit - 0.5 * logdet + prior;
}

/* The posterior mean and standard deviation at u; kv, w: scratch [n]. */
static void gp_predict(const gp_model *g, const double *u, double *kv, double *w, double *mu, double *sd) {
    const int n = g->n;
    double m = 0;
    for (int i = 0; i < n; i++) {
        kv[i] = gp_kernel(g, u, g->X + (size_t)i * g->p);
        m += kv[i] * g->alpha[i];
    }
    double q = 0;
    for (int i = 0; i < n; i++) { /* w = L^-1 k */
        double v = kv[i];
        for (int k = 0; k < i; k++) v -= g->L[(size_t)i * n + k] * w[k];
        w[i] = v / g->L[(size_t)i * n + i];
        q += w[i] * w[i];
    }
    *mu = m;
    *sd = sqrt(fmax(1.0 - q, 1e-12));
}

static double norm_pdf(double z) { return exp(-0.5 * z * z) / sqrt(2.0 * M_PI); }

/* Expected improvement below best (standardised values). */
static double gp_ei(const gp_model *g, const double *u, double best, double *kv, double *w) {
    double mu, sd;
    gp_predict(g, u, kv, w, &mu, &sd);
    const double z = (best - mu) / sd;
    return (best - mu) * norm_cdf(z) + sd * norm_pdf(z);
}

static double unit_of(const tera_param_spec *p, double v) {
    if (p->dist == TERA_DIST_CHOICE) return v;
    double lo, hi;
    internal_range(p, &lo, &hi);
    return fmin(fmax((to_internal(p, v) - lo) / (hi - lo), 0.0), 1.0);
}

static double value_of_unit(const tera_param_spec *p, double u) {
    if (p->dist == TERA_DIST_CHOICE) return u;
    double lo, hi;
    internal_range(p, &lo, &hi);
    return from_internal(p, lo + (hi - lo) * u);
}

/* A candidate near c: each numeric coordinate moved by N(0, scale), reflected into [0, 1]; a choice
 * redrawn with probability 0.2. */
static void perturb(const tera_search *s, const double *c, double scale, rng_t *r, double *u) {
    for (int j = 0; j < s->n_params; j++) {
        const tera_param_spec *p = &s->params[j];
        if (p->dist == TERA_DIST_CHOICE) {
            u[j] = rng_u01(r) < 0.2 ? (double)(int)fmin(rng_u01(r) * p->n_choices, p->n_choices - 1) : c[j];
            continue;
        }
        double v = c[j] + scale * rng_normal(r);
        for (int t = 0; t < 4 && (v < 0 || v > 1); t++) v = v < 0 ? -v : 2.0 - v;
        u[j] = fmin(fmax(v, 0.0), 1.0);
    }
}

static const double *g_sort_ys;
static int cmp_by_ys(const void *a, const void *b) {
    const double x = g_sort_ys[*(const int *)a], y = g_sort_ys[*(const int *)b];
    return x < y ? -1 : x > y;
}

void tera_sample_gp(const tera_search *s, const double *xs, const double *ys, int n, const double *pend, int n_pend,
                    int64_t number, double *x) {
    if (n < 2) {
        tera_sample_random(s, number, x);
        return;
    }
    /* at most GP_MAX_OBS observations (the best ones) and GP_MAX_PEND liars: the fit is cubic in them */
    enum { GP_MAX_OBS = 256, GP_MAX_PEND = 64 };
    int *keep = tera_malloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) keep[i] = i;
    if (n > GP_MAX_OBS) {
        g_sort_ys = ys;
        qsort(keep, (size_t)n, sizeof(int), cmp_by_ys);
        n = GP_MAX_OBS;
    }
    if (n_pend > GP_MAX_PEND) n_pend = GP_MAX_PEND;
    const int p = s->n_params, N = n + n_pend;
    gp_model g = {.s = s, .n = N, .p = p};
    g.X = tera_malloc((size_t)N * p * sizeof(double));
    g.y = tera_malloc((size_t)N * sizeof(double));
    g.L = tera_malloc((size_t)N * N * sizeof(double));
    g.alpha = tera_malloc((size_t)N * sizeof(double));
    /* standardised values, the bad tail clipped at median + 5 IQR (a diverged run must not flatten the
     * differences among the rest) */
    double *srt = tera_malloc((size_t)n * sizeof(double));
    for (int i = 0; i < n; i++) srt[i] = ys[keep[i]];
    qsort(srt, (size_t)n, sizeof(double), cmp_double);
    const double iqr = srt[(3 * n) / 4] - srt[n / 4];
    const double cap = iqr > 0 ? srt[n / 2] + 5.0 * iqr : INFINITY;
    free(srt);
    double mean = 0, var = 0, best = INFINITY;
    for (int i = 0; i < n; i++) mean += fmin(ys[keep[i]], cap);
    mean /= n;
    for (int i = 0; i < n; i++) var += pow(fmin(ys[keep[i]], cap) - mean, 2);
    const double sdev = sqrt(var / n) > 0 ? sqrt(var / n) : 1.0;
    for (int i = 0; i < N; i++) {
        const double *src = i < n ? xs + (size_t)keep[i] * p : pend + (size_t)(i - n) * p;
        for (int j = 0; j < p; j++) g.X[(size_t)i * p + j] = unit_of(&s->params[j], src[j]);
        g.y[i] = i < n ? (fmin(ys[keep[i]], cap) - mean) / sdev : 0.0; /* a running trial: the mean (constant liar) */
        if (i < n && g.y[i] < best) best = g.y[i];
    }
    free(keep);
    /* hyperparameters: coordinate sweeps over a grid of lengths, then the noise */
    static const double LS[] = {0.03, 0.06, 0.12, 0.25, 0.5, 1.0, 2.0, 4.0};
    static const double NOISE[] = {1e-6, 1e-4, 1e-3, 1e-2, 0.05, 0.2};
    for (int j = 0; j < p; j++) g.ls[j] = 0.5;
    g.noise = 1e-3;
    double lml = gp_fit(&g);
    for (int sweep = 0; sweep < 2; sweep++) {
        for (int j = 0; j < p; j++) {
            double bl = g.ls[j];
            for (size_t k = 0; k < sizeof LS / sizeof LS[0]; k++) {
                g.ls[j] = LS[k];
                const double v = gp_fit(&g);
                if (v > lml) lml = v, bl = LS[k];
            }
            g.ls[j] = bl;
        }
        double bn = g.noise;
        for (size_t k = 0; k < sizeof NOISE / sizeof NOISE[0]; k++) {
            g.noise = NOISE[k];
            const double v = gp_fit(&g);
            if (v > lml) lml = v, bn = NOISE[k];
        }
        g.noise = bn;
    }
    if (!isfinite(gp_fit(&g))) { /* not positive definite at any grid point */
        g.noise = 0.2;
        if (!isfinite(gp_fit(&g))) {
            free(g.X), free(g.y), free(g.L), free(g.alpha);
            tera_sample_random(s, number, x);
            return;
        }
    }
    /* candidates: uniform ones, then ones near the best observations, then a local refinement */
    double *kv = tera_malloc((size_t)N * sizeof(double)), *w = tera_malloc((size_t)N * sizeof(double));
    double u[TERA_TUNE_MAX_PARAMS], bu[TERA_TUNE_MAX_PARAMS], be = -INFINITY;
    rng_t r = rng_for(s->seed, number, 1000003);
    const int n_rand = 50 * s->candidates;
    for (int c = 0; c < n_rand; c++) {
        for (int j = 0; j < p; j++) {
            const tera_param_spec *q = &s->params[j];
            u[j] = q->dist == TERA_DIST_CHOICE ? (double)(int)fmin(rng_u01(&r) * q->n_choices, q->n_choices - 1)
                                               : rng_u01(&r);
        }
        const double e = gp_ei(&g, u, best, kv, w);
        if (e > be) be = e, memcpy(bu, u, sizeof u);
    }
    int *idx = tera_malloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) idx[i] = i;
    for (int a = 0; a < n && a < 5; a++) /* the 5 best observations (partial selection) */
        for (int b = a + 1; b < n; b++)
            if (g.y[idx[b]] < g.y[idx[a]]) {
                const int t = idx[a];
                idx[a] = idx[b], idx[b] = t;
            }
    static const double SCALE[] = {0.15, 0.05, 0.015};
    for (int a = 0; a < n && a < 5; a++)
        for (int c = 0; c < 4 * s->candidates; c++) {
            perturb(s, g.X + (size_t)idx[a] * p, SCALE[c % 3], &r, u);
            const double e = gp_ei(&g, u, best, kv, w);
            if (e > be) be = e, memcpy(bu, u, sizeof u);
        }
    for (int round = 0; round < 3; round++) {
        double cu[TERA_TUNE_MAX_PARAMS];
        memcpy(cu, bu, sizeof cu);
        for (int c = 0; c < 2 * s->candidates; c++) {
            perturb(s, cu, SCALE[round] / 3.0, &r, u);
            const double e = gp_ei(&g, u, best, kv, w);
            if (e > be) be = e, memcpy(bu, u, sizeof u);
        }
    }
    for (int j = 0; j < p; j++) x[j] = value_of_unit(&s->params[j], bu[j]);
    free(idx);
    free(kv);
    free(w);
    free(g.X), free(g.y), free(g.L), free(g.alpha);
}
