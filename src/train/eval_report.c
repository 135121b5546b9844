/* Evaluation extras: next-token accuracy of the logits a forward left behind (val_acc), and the
 * evaluation line of metrics.jsonl (val_loss, val_ppl, val_acc; with a blend, val_loss_NAME per
 * dataset). */
#include <math.h>
#include <stdio.h>

#include "tera/io.h"
#include "tera/train.h"

/* The prediction of a position is its first largest logit (ties: the lower token id); with the
 * vocabulary split over tensor-parallel ranks, the largest value and then the lowest id holding it
 * are agreed with two max-reductions over the group, so every rank counts the same. */
int64_t tera_count_correct(const float *logits, const int32_t *targets, int64_t N, int64_t Vl, int64_t v0,
                           struct tera_comm *tp_group, float *scratch) {
    int64_t correct = 0;
    if (!tp_group || tera_comm_size(tp_group) == 1) {
        for (int64_t n = 0; n < N; n++) {
            const float *r = logits + n * Vl;
            int64_t best = 0;
            for (int64_t v = 1; v < Vl; v++)
                if (r[v] > r[best]) best = v;
            correct += best + v0 == targets[n];
        }
        return correct;
    }
    float *mx = scratch, *id = scratch + N; /* [N] each */
    for (int64_t n = 0; n < N; n++) {
        const float *r = logits + n * Vl;
        float m = -INFINITY;
        for (int64_t v = 0; v < Vl; v++) m = r[v] > m ? r[v] : m;
        mx[n] = m;
    }
    tera_comm_allreduce_max_f32(tp_group, mx, N);
    for (int64_t n = 0; n < N; n++) { /* minus the lowest global id holding the maximum (exact below 2^24) */
        const float *r = logits + n * Vl;
        id[n] = -INFINITY;
        for (int64_t v = 0; v < Vl; v++)
            if (r[v] == mx[n]) {
                id[n] = -(float)(v + v0);
                break;
            }
    }
    tera_comm_allreduce_max_f32(tp_group, id, N);
    for (int64_t n = 0; n < N; n++) correct += -id[n] == (float)targets[n];
    return correct;
}

tera_status tera_trainer_eval_line(tera_trainer *tr, int64_t step, double vl, double va, char *line, size_t n,
                                   size_t *len) {
    char num[64], ppl[64], acc[64];
    int k = snprintf(line, n, "{\"step\": %ld, \"val_loss\": %s, \"val_ppl\": %s, \"val_acc\": %s", (long)step,
                     tera_json_num(num, sizeof num, "%.7g", vl), tera_json_num(ppl, sizeof ppl, "%.7g", exp(vl)),
                     tera_json_num(acc, sizeof acc, "%.7g", va));
    const int K = tera_loader_n_datasets(&tr->loader);
    for (int d = 0; K > 1 && d < K; d++) { /* a blend: each dataset's own validation split */
        double dl, da;
        TERA_TRY(tera_trainer_eval_dataset(tr, d, tr->cfg.training.eval_batches, &dl, &da));
        const char *name = tera_loader_dataset_name(&tr->loader, d);
        if (k < (int)n)
            k += snprintf(line + k, n - (size_t)k, ", \"val_loss_%s\": %s, \"val_acc_%s\": %s", name,
                          tera_json_num(num, sizeof num, "%.7g", dl), name, tera_json_num(acc, sizeof acc, "%.7g", da));
    }
    if (k < (int)n) k += snprintf(line + k, n - (size_t)k, "}\n");
    if (k >= (int)n)
        return tera_fail(TERA_ERR_CONFIG, "data.paths: the evaluation line of step %ld (%d datasets) is longer than "
                         "%zu bytes", (long)step, K, n);
    *len = (size_t)k;
    return TERA_OK;
}
