/* training.recompute: the activation-recomputation policy of each layer, from a spec such as
 * "none", "full", "selective" or "full:0-3,selective:4-7".
 *
 * Grammar: items separated by commas; item = policy [":" first ["-" last]]; policy = none |
 * selective | full; layers are 0-based and inclusive. An item with a range applies to those
 * layers; an item without one applies to every layer no ranged item names. A layer may be named
 * by at most one ranged item, and at most one item may be unranged. Layers not covered: none. */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tera/model.h"

static const char *const policy_names[] = {"none", "selective", "full"};

const char *tera_recompute_name(int policy) {
    return policy >= 0 && policy < 3 ? policy_names[policy] : "?";
}

/* Parses a non-negative decimal layer index at *p; advances *p. -1 if there is none. */
static long parse_index(const char **p) {
    if (!isdigit((unsigned char)**p)) return -1;
    char *end;
    errno = 0;
    long v = strtol(*p, &end, 10);
    if (errno == ERANGE || v > 1000000000L) v = 1000000000L;
    *p = end;
    return v;
}

#define BAD(...)                                                                                   \
    do {                                                                                           \
        free(named);                                                                               \
        return tera_fail(TERA_ERR_CONFIG, "config: training.recompute = \"%s\": " __VA_ARGS__);   \
    } while (0)

tera_status tera_recompute_parse(const char *spec, int n_layers, uint8_t *policy) {
    if (!spec) spec = "";
    uint8_t *named = tera_calloc((size_t)(n_layers > 0 ? n_layers : 1), 1); /* 1 + policy, 0 = not named */
    int bare = -1; /* policy of the unranged item */
    const char *p = spec;
    while (*p == ' ') p++;
    if (*p == '\0') {
        free(named);
        if (policy) memset(policy, TERA_RECOMPUTE_NONE, (size_t)n_layers);
        return TERA_OK;
    }
    for (;;) {
        while (*p == ' ') p++;
        const char *w = p;
        while (isalpha((unsigned char)*p)) p++;
        int pol = -1;
        for (int i = 0; i < 3; i++)
            if ((size_t)(p - w) == strlen(policy_names[i]) && strncmp(w, policy_names[i], (size_t)(p - w)) == 0)
                pol = i;
        if (pol < 0)
            BAD("\"%.*s\" is not a policy; items are POLICY or POLICY:FIRST-LAST with POLICY one of none, "
                "selective, full (e.g. full:0-3,selective:4-7)",
                spec, (int)strcspn(w, ",:"), w);
        while (*p == ' ') p++;
        if (*p == ':') {
            p++;
            while (*p == ' ') p++;
            long lo = parse_index(&p), hi = lo;
            if (lo >= 0 && *p == '-') {
                p++;
                hi = parse_index(&p);
            }
            if (lo < 0 || hi < 0)
                BAD("a layer range after \"%s:\" must be FIRST or FIRST-LAST (0-based layer indices)", spec,
                    policy_names[pol]);
            if (lo > hi) BAD("layer range %ld-%ld is empty (FIRST must be at most LAST)", spec, lo, hi);
            if (hi >= n_layers)
                BAD("layer range %ld-%ld is outside the model's layers 0-%d (model.n_layers = %d)", spec, lo, hi,
                    n_layers - 1, n_layers);
            for (long l = lo; l <= hi; l++) {
                if (named[l]) BAD("layer %ld is named by more than one item", spec, l);
                named[l] = (uint8_t)(1 + pol);
            }
        } else {
            if (bare >= 0) BAD("more than one item without a layer range", spec);
            bare = pol;
        }
        while (*p == ' ') p++;
        if (*p == '\0') break;
        if (*p != ',') BAD("unexpected \"%s\" (items are separated by commas)", spec, p);
        p++;
    }
    if (policy)
        for (int l = 0; l < n_layers; l++)
            policy[l] = named[l] ? (uint8_t)(named[l] - 1) : (uint8_t)(bare >= 0 ? bare : TERA_RECOMPUTE_NONE);
    free(named);
    return TERA_OK;
}
