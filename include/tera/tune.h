/* Hyperparameter search (`tera tune -c search.ini`, docs/TRACKING.md): the search space and study
 * file, the samplers (random; TPE after Bergstra et al. 2011; Gaussian-process expected improvement,
 * the default) and the ASHA / Hyperband rungs with
 * training steps as the fidelity. The processes (trials run as `tera train` or an objective command)
 * are driven by src/cli/cmd_tune.c. */
#ifndef TERA_TUNE_H
#define TERA_TUNE_H

#include <stdint.h>
#include <stdio.h>

#include "tera/config.h"
#include "tera/status.h"

#define TERA_TUNE_MAX_PARAMS 32
#define TERA_TUNE_MAX_CHOICES 16
#define TERA_TUNE_MAX_RUNGS 16

typedef enum {
    TERA_DIST_UNIFORM = 0, /* uniform LO HI */
    TERA_DIST_LOGUNIFORM,  /* loguniform LO HI (0 < LO < HI): uniform in log */
    TERA_DIST_INT,         /* int LO HI: an integer in [LO, HI] */
    TERA_DIST_CHOICE,      /* choice A B C ...: one of the words */
} tera_dist;

typedef struct {
    char key[128];   /* a config key section.key (or any name with an objective command) */
    tera_dist dist;
    double lo, hi;   /* uniform, loguniform, int */
    int n_choices;
    char choices[TERA_TUNE_MAX_CHOICES][64];
} tera_param_spec;

typedef enum { TERA_SAMPLER_RANDOM = 0, TERA_SAMPLER_TPE, TERA_SAMPLER_GP } tera_sampler_kind;
typedef enum { TERA_SCHED_NONE = 0, TERA_SCHED_ASHA, TERA_SCHED_HYPERBAND } tera_sched_kind;

typedef struct {
    char name[128];            /* the study's name in the registry */
    char base[TERA_PATH_MAX];  /* the trials' base config file ("" = defaults) */
    char objective[2048];      /* a command that prints the objective ("" = tera train trials) */
    char args[2048];           /* extra --section.key=value arguments for every trial */
    char dir[TERA_PATH_MAX];   /* the study directory (trials, best config, report) */
    char registry[TERA_PATH_MAX];
    char metric[32];           /* loss | val_loss (tera train trials) */
    tera_sampler_kind sampler;
    tera_sched_kind scheduler;
    int trials, parallel;
    int64_t budget;            /* trial-steps after which no new trial starts (0 = no limit) */
    uint64_t seed;
    int min_steps, max_steps, eta;
    int window;                /* metric loss: mean of the last `window` steps up to the rung */
    int startup;               /* random trials before TPE / the GP models the rest */
    double gamma;              /* TPE: fraction of observations in the good group */
    int candidates;            /* TPE: candidates drawn from l(x) per parameter; GP: 50 x this uniform ones */
    int n_params;
    tera_param_spec params[TERA_TUNE_MAX_PARAMS];
    char text[16384];          /* the file as read (the study's identity in the registry) */
} tera_search;

/* Reads and checks a search file. Every error names the file, the key and the value at fault: an
 * unknown [study] key, an unknown config key in [space] (tera train trials), an unknown
 * distribution, a non-numeric bound, an empty range (LO >= HI, choice without words), a bound the
 * config key refuses. */
tera_status tera_search_load(tera_search *s, const char *path);
/* The same from text (path only names it in messages). */
tera_status tera_search_parse(tera_search *s, const char *text, const char *path);

/* Parameter values are doubles: the number itself, or a choice's index. Text for a config
 * override or a command line ("%.6g"; ints as integers; a choice's word). */
void tera_param_text(const tera_param_spec *p, double v, char *buf, size_t n);

/* Random sampling of every parameter for trial `number` (a counter-based stream of (seed, number)). */
void tera_sample_random(const tera_search *s, int64_t number, double *x);
/* TPE: xs[n][n_params] past parameters, order[n] their indices from best to worst (the first
 * max(1, ceil(gamma n)) are the good group l, the rest g); draws `candidates` from l per parameter
 * and keeps the one with the largest l(x)/g(x). Falls back to random when n < 2. */
void tera_sample_tpe(const tera_search *s, const double *xs, const int *order, int n, int64_t number, double *x);

/* Gaussian-process Bayesian optimisation: xs[n][n_params] past parameters, ys[n] their values (lower
 * is better, at one fidelity: tera_fidelity_map), pend[n_pend][n_params] the parameters of trials
 * still running (given the mean value, a constant liar, so parallel trials spread out). A Matern 5/2
 * GP with a length per parameter fitted by marginal likelihood; the candidate with the largest
 * expected improvement among 50 x candidates uniform ones and ones near the 5 best is taken. Random
 * when n < 2. Deterministic for a (seed, number). */
void tera_sample_gp(const tera_search *s, const double *xs, const double *ys, int n, const double *pend, int n_pend,
                    int64_t number, double *x);
/* vals[n][levels]: each trial's value at each fidelity level (NAN where it has none; a trial's values
 * are at consecutive levels). out[n]: its newest value brought to the top level by chaining a
 * least-squares line from each level to the next (fitted on the trials seen at both: promoted ones;
 * a shift when fewer than 4 or the slope is not positive); NAN when a level on the way has no pair. */
void tera_fidelity_map(const double *vals, int n, int levels, double *out);

/* The rungs (steps) of a bracket: min_steps * eta^(bracket + k) below max_steps, then max_steps.
 * NONE: max_steps only. Returns their count. */
int tera_rungs(const tera_search *s, int bracket, int *steps);
/* Brackets: ASHA 1, Hyperband ceil(log_eta(max/min)) + 1 (the last runs max_steps only), NONE 1. */
int tera_brackets(const tera_search *s);
/* ASHA: may a trial with value v at rung k be promoted, given the n values recorded at rung k in
 * its bracket (v among them)? It is when v ranks in the best max(1, floor(n / eta)): the best value of
 * a rung always goes on, so a study of few trials still reaches max_steps (Optuna's rule). */
int tera_asha_promotable(double v, const double *values, int n, int eta);

#endif
