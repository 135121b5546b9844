/* tera sim-failures: the effective training time of a long run under failures, from a failure rate,
 * a cluster size, the checkpoint cadence and tera's save pause, detection, recovery and restore times;
 * recommends the cadence (Young/Daly's formula and a simulation over a grid). docs/ELASTIC.md. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tera/io.h"
#include "tera/status.h"

/* tera's figures measured here (docs/ELASTIC.md, "Measured figures"): the largest mean step-loop pause
 * per streamed save measured on the three-host rig (4 ranks over TCP, the test model, a loaded
 * machine), detection at tera launch's default hang timeout (the slow case: a dead rank was detected
 * in 1.2-2.2 s), and the slowest detection -> first resumed step measured on the rig (teardown,
 * replan, relaunch, restore) */
#define TERA_SIM_SAVE_PAUSE_S 1.07
#define TERA_SIM_DETECT_S 30.0
#define TERA_SIM_RECOVERY_S 7.6

typedef struct {
    double devices;       /* cluster size */
    double failures;      /* failures observed ... */
    double days;          /* ... in this many days ... */
    double ref_devices;   /* ... on this many devices (the rate scales per device) */
    double save_pause_s;  /* the step loop's pause per checkpoint */
    double detect_s;      /* failure -> detected */
    double recovery_s;    /* detected -> first resumed step, restore included */
    double horizon_days;  /* simulated run length */
    int trials;
    uint64_t seed;
} sim_cfg;

/* splitmix64: a deterministic uniform in (0, 1) */
static double urand(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) / 9007199254740992.0;
}

/* One run of `horizon` seconds: segments of `every` seconds of training, each followed by a save
 * pause (the checkpoint is committed when the pause ends; its background write is taken to finish
 * before the next one, as tera's next save waits for it); failures arrive as a Poisson process of
 * mean interval mtbf (also during saves and recovery); a failure loses the training since the last
 * committed checkpoint and costs detect + recovery. Returns the fraction of the horizon spent on
 * training that is kept. */
static double simulate(double horizon, double every, double pause, double down, double mtbf, uint64_t *rng) {
    const double seg = every + pause;
    double t = 0.0, kept = 0.0, next_fail = -mtbf * log(urand(rng));
    while (t < horizon) {
        /* the whole segments that end before the next failure (or the horizon) are committed */
        const double until = next_fail < horizon ? next_fail : horizon;
        const double n = floor((until - t) / seg);
        kept += n * every;
        t += n * seg;
        if (next_fail >= horizon) { /* the run ends inside a segment: its final save keeps it */
            kept += fmin(every, horizon - t);
            break;
        }
        /* a failure inside the segment: its training is lost; then down time, itself interruptible */
        t = next_fail;
        next_fail = t - mtbf * log(urand(rng));
        double up = t + down;
        while (next_fail < up) { /* failed again while recovering: recovery starts over */
            up = next_fail + down;
            next_fail = next_fail - mtbf * log(urand(rng));
        }
        t = up;
    }
    return kept / horizon;
}

static double mean_effective(const sim_cfg *c, double every, double mtbf) {
    uint64_t rng = c->seed;
    double sum = 0.0;
    for (int i = 0; i < c->trials; i++)
        sum += simulate(c->horizon_days * 86400.0, every, c->save_pause_s, c->detect_s + c->recovery_s, mtbf, &rng);
    return sum / c->trials;
}

/* The first-order model: a fraction pause/(every+pause) to saves, and per failure half a segment
 * plus the down time lost. */
static double model_effective(const sim_cfg *c, double every, double mtbf) {
    const double seg = every + c->save_pause_s;
    const double lost = 0.5 * seg + c->detect_s + c->recovery_s;
    return (every / seg) * fmax(0.0, 1.0 - lost / mtbf);
}

static int num(const char *name, const char *v, double lo, double *out) {
    char *end;
    double x = v ? strtod(v, &end) : NAN;
    if (!v || end == v || *end || !(x >= lo) || !isfinite(x)) {
        tera_fail(TERA_ERR_ARG, "sim-failures: --%s '%s': expected a number >= %g", name, v ? v : "", lo);
        return 0;
    }
    *out = x;
    return 1;
}

int tera_cmd_simfail(int argc, char **argv) {
    /* defaults: Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs; tera's times as
     * measured on the test rig (docs/ELASTIC.md, "Measured figures") */
    sim_cfg c = {.devices = 16384, .failures = 419, .days = 54, .ref_devices = 16384, .save_pause_s = TERA_SIM_SAVE_PAUSE_S,
                 .detect_s = TERA_SIM_DETECT_S, .recovery_s = TERA_SIM_RECOVERY_S, .horizon_days = 54, .trials = 200,
                 .seed = 1};
    double every = -1, trials = 200, seed = 1, goal = 0.9;
    int json = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = 1;
        if (!strcmp(a, "--json")) { json = 1; continue; }
        if (!strcmp(a, "--devices")) ok = num("devices", v, 1, &c.devices);
        else if (!strcmp(a, "--failures")) ok = num("failures", v, 0, &c.failures);
        else if (!strcmp(a, "--days")) ok = num("days", v, 1e-6, &c.days);
        else if (!strcmp(a, "--ref-devices")) ok = num("ref-devices", v, 1, &c.ref_devices);
        else if (!strcmp(a, "--save-pause")) ok = num("save-pause", v, 0, &c.save_pause_s);
        else if (!strcmp(a, "--detect")) ok = num("detect", v, 0, &c.detect_s);
        else if (!strcmp(a, "--recovery")) ok = num("recovery", v, 0, &c.recovery_s);
        else if (!strcmp(a, "--every-s")) ok = num("every-s", v, 1e-3, &every);
        else if (!strcmp(a, "--horizon-days")) ok = num("horizon-days", v, 1e-3, &c.horizon_days);
        else if (!strcmp(a, "--trials")) ok = num("trials", v, 1, &trials);
        else if (!strcmp(a, "--seed")) ok = num("seed", v, 0, &seed);
        else if (!strcmp(a, "--goal")) ok = num("goal", v, 0, &goal);
        else {
            tera_fail(TERA_ERR_ARG, "sim-failures: unknown option '%s' (tera sim-failures --help)", a);
            return tera_cli_error();
        }
        if (!ok) return tera_cli_error();
        i++;
    }
    c.trials = (int)trials;
    c.seed = (uint64_t)seed;
    /* failures per device-second, scaled to this cluster */
    const double rate = c.failures / (c.days * 86400.0 * c.ref_devices) * c.devices;
    const double mtbf = rate > 0 ? 1.0 / rate : INFINITY;
    /* Young: sqrt(2 delta M); Daly's refinement sqrt(2 delta (M + R)) - delta (delta: save pause, R: down time) */
    const double down = c.detect_s + c.recovery_s;
    /* the work the simulation would do, bounded before it starts (at most 2e8 draws): each of the
     * ~122 cadences runs `trials` runs of horizon / MTBF failures, and a recovery starts over
     * e^(down / MTBF) times on average (values the options allow ran for days) */
    const double events = 122.0 * c.trials * (c.horizon_days * 86400.0 / mtbf);
    const char *why = NULL;
    char buf[512];
    if (c.trials > 100000) why = "--trials: at most 100000";
    else if (events * exp(fmin(down / mtbf, 50.0)) > 2e8)
        snprintf(buf, sizeof buf, "the simulation would draw about %.3g failures (%.3g a run, %d runs, 122 cadences) "
                 "and a recovery (%.3g s against a mean time between failures of %.3g s) would start over about %.3g "
                 "times each: more than 2e8 draws; fewer --devices, --horizon-days, --trials or a shorter recovery",
                 events, events / 122.0 / c.trials, c.trials, down, mtbf, exp(fmin(down / mtbf, 700.0))), why = buf;
    if (why) {
        tera_fail(TERA_ERR_ARG, "sim-failures: %s", why);
        return tera_cli_error();
    }
    const double young = sqrt(2.0 * c.save_pause_s * mtbf);
    double daly = c.save_pause_s < 2.0 * mtbf ? sqrt(2.0 * c.save_pause_s * (mtbf + down)) - c.save_pause_s : mtbf;
    /* no failures (MTBF infinite): the cadence is the whole run (one save, at the end); a cadence
     * of inf s would make the simulated and the modelled fractions NaN */
    if (!(daly <= c.horizon_days * 86400.0)) daly = c.horizon_days * 86400.0;
    /* the simulation over a grid of cadences (1 s .. 1 day, 24 a decade), around the formulas' */
    double best = 0.0, best_every = 0.0;
    for (int k = 0; k <= 24 * 5; k++) {
        const double e = pow(10.0, k / 24.0);
        if (e > c.horizon_days * 86400.0) break;
        const double f = mean_effective(&c, e, mtbf);
        if (f > best) best = f, best_every = e;
    }
    const double at_daly = mean_effective(&c, daly, mtbf); /* no failures (mtbf infinite): one segment */
    const double given = every > 0 ? mean_effective(&c, every, mtbf) : -1.0;
    const double rec = at_daly >= best - 0.002 ? daly : best_every; /* Daly's unless the grid finds clearly better */
    const double rec_eff = rec == daly ? at_daly : best;
    if (json) {
        char mj[64], yj[64]; /* null when infinite (no failures): JSON has no inf */
        printf("{\"devices\": %.0f, \"failures_per_day\": %.4f, \"mtbf_s\": %s, \"save_pause_s\": %.4g, \"detect_s\": %.4g, "
               "\"recovery_s\": %.4g, \"young_s\": %s, \"daly_s\": %.1f, \"effective_at_daly\": %.4f, "
               "\"model_at_daly\": %.4f, \"best_grid_s\": %.1f, \"effective_best_grid\": %.4f, \"recommended_every_s\": %.0f, "
               "\"effective_recommended\": %.4f",
               c.devices, rate * 86400.0, tera_json_num(mj, sizeof mj, "%.1f", mtbf), c.save_pause_s, c.detect_s,
               c.recovery_s, tera_json_num(yj, sizeof yj, "%.1f", young), daly, at_daly,
               model_effective(&c, daly, mtbf), best_every, best, rec, rec_eff);
        if (every > 0) printf(", \"every_s\": %.4g, \"effective_at_every\": %.4f", every, given);
        printf(", \"goal\": %.3f, \"meets_goal\": %s, \"trials\": %d}\n", goal, rec_eff >= goal ? "true" : "false", c.trials);
        return 0;
    }
    printf("cluster %.0f devices: %.2f failures/day (%.0f in %.0f days on %.0f devices, scaled), MTBF %.2f h\n", c.devices,
           rate * 86400.0, c.failures, c.days, c.ref_devices, mtbf / 3600.0);
    printf("costs: save pause %.3g s per checkpoint, detection %.3g s, recovery %.3g s (restore included)\n",
           c.save_pause_s, c.detect_s, c.recovery_s);
    printf("Young's cadence sqrt(2 x pause x MTBF) = %.0f s; Daly's = %.0f s: effective training time %.2f%% "
           "(simulated, %d runs of %.0f days; first-order model %.2f%%)\n", young, daly, 100.0 * at_daly, c.trials,
           c.horizon_days, 100.0 * model_effective(&c, daly, mtbf));
    printf("best cadence on the grid: %.0f s: %.2f%%\n", best_every, 100.0 * best);
    if (every > 0) printf("given cadence %.0f s: %.2f%%\n", every, 100.0 * given);
    printf("recommended: checkpoint.every_s = %.0f (%.2f%% effective; goal %.0f%%: %s)\n", rec, 100.0 * rec_eff, 100.0 * goal,
           rec_eff >= goal ? "met" : "NOT met");
    return 0;
}
