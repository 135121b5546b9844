/* Mixed precision: the precision a run's linear layers use (training.precision), the conversion
 * scratch it needs, and fp16's dynamic loss scaler. The precision is a property of the compute backend's
 * context (tera_backend_set_precision, include/tera/backend.h); model code holds no precision logic. */
#ifndef TERA_PRECISION_H
#define TERA_PRECISION_H

#include <stdint.h>

#include "tera/backend.h"
#include "tera/config.h"

/* training.precision ("auto", "fp32", "bf16", "fp16") -> the precision in effect on backend be.
 * auto = bf16 where be's bf16 products are faster than its fp32 ones: fast bf16 products
 * (caps.bf16_fast: the CPU backend, oneDNN's AMX), or a bf16 dot product that the probe
 * (caps.bf16_probe) measures at TERA_BF16_DOT_MARGIN times the FMA's multiply-adds or more (the rule
 * of bf16_gemm = auto below: the products then run on the native units); else fp32 (no AVX512-BF16,
 * or a CPU whose dot product is slow: oneDNN's bf16 products measured ~0.6x its fp32 ones on one,
 * docs/PERFORMANCE.md). A multi-rank run takes fp32 if any rank resolved fp32 (tera_trainer_init).
 * *note receives one line saying why (static storage). */
tera_precision tera_precision_resolve(const tera_backend *be, const char *name, const char **note);

/* training.bf16_gemm ("auto", "native", "fma") -> the units bf16 products run on. auto = native
 * where be reports fast bf16 products (AMX); else the probe (caps.bf16_probe): native only when
 * the bf16 dot product issues at least TERA_BF16_DOT_MARGIN times the FMA's multiply-adds (a
 * margin, so that a noisy probe does not flip the choice between runs), fma otherwise and where
 * there is no dot-product instruction. A multi-rank run takes fma if any rank resolved fma
 * (tera_trainer_init). *note: one line saying why. */
#define TERA_BF16_DOT_MARGIN 1.25
tera_bf16_gemm tera_bf16_gemm_resolve(const tera_backend *be, const char *name, const char **note);

/* The bf16 weight shadow (include/tera/backend.h, weights_register): whether a rank of the run cfg
 * describes keeps one, 2 bytes per resident parameter. The one rule, for the trainer (which registers
 * the model's weights when it holds) and tera plan's memory model (src/parallel/plan_mem.c, which
 * counts the bytes): the CPU device with products in bf16 on the native units (p, g as resolved:
 * the CPU backend keeps a shadow only then), no pipeline (parallel.pp = 1), the rank's whole weights
 * resident (not ZeRO-3), and either the AdamW update writes it (ZeRO-0, optimizer.name = adamw) or at
 * least 4 micro-batches share each rounding (training.grad_accum >= 4). zero: the ZeRO stage in
 * effect (tera_zero_stage_in_effect: 0 on one data-parallel rank). Environment, for A/B timing:
 * TERA_BF16_SHADOW=0: never; =lazy: the update never writes it, so only the grad_accum rule. */
int tera_bf16_shadow_on(const tera_config *cfg, int zero, tera_precision p, tera_bf16_gemm g);

/* The expert exchange's rows out in bf16 (tera_model_par.a2a_rows_bf16): whether the run cfg describes
 * gives its dispatcher the bf16 buffers for them (training.precision bf16, or auto, which may resolve
 * to it; parallel.a2a_compression none; ep > 1). The one rule for the trainer and tera plan's memory
 * and time models. The dispatcher sends them so while the backend's products are bf16 (the same on
 * every rank), since every reader of them is a product that rounds them so anyway: the same bits.
 * Environment, for A/B: TERA_A2A_ROWS_BF16=0: never (no buffers). */
int tera_a2a_rows_bf16(const tera_config *cfg);

/* Operand elements (both operands of one product) the largest linear product of this model converts
 * at once: outside parallel regions (main) and on each thread running experts side by side (ep:
 * expert-parallel degree; a rank's expert can receive rows from every rank of its group). */
void tera_precision_scratch_elems(const tera_model_config *c, int B, int T, int ep, int64_t *main_elems,
                                  int64_t *thread_elems);

/* Dynamic loss scaling (fp16). The loss scales passed to backward are multiplied by scale; the
 * gradients are unscaled before the norm and the clip; a step whose gradient is not finite halves
 * the scale and is skipped; after `window` consecutive finite steps the scale doubles. */
#define TERA_LOSS_SCALE_MIN (1.0f / 65536.0f)
#define TERA_LOSS_SCALE_MAX 1099511627776.0f /* 2^40 */
typedef struct {
    float scale;
    int64_t good_steps; /* consecutive finite steps since the scale last changed */
    int64_t overflows;  /* steps skipped for a non-finite gradient */
    int window;
    int fixed;          /* 1: the scale never changes (training.loss_scaling = fixed) */
} tera_loss_scaler;

/* window <= 0: a fixed loss scale (TensorFlow's FixedLossScaleManager): init_scale throughout. */
void tera_scaler_init(tera_loss_scaler *s, float init_scale, int window);
/* After a step: finite = its gradient was finite. Returns -1 (halved, update to be skipped),
 * +1 (doubled) or 0. The scale stays within [TERA_LOSS_SCALE_MIN, TERA_LOSS_SCALE_MAX]. A fixed
 * scale only counts the overflow (-1: the update is still skipped) and never changes. */
int tera_scaler_update(tera_loss_scaler *s, int finite);
struct cJSON;
/* state.json: adds "loss_scaler" (scale, good_steps, overflows) to root. */
void tera_scaler_save(const tera_loss_scaler *s, struct cJSON *root);
/* Restores "loss_scaler" of root into *s when present (absent: *s unchanged); a scale outside
 * [TERA_LOSS_SCALE_MIN, TERA_LOSS_SCALE_MAX] is refused, naming path. */
tera_status tera_scaler_load(tera_loss_scaler *s, const struct cJSON *root, const char *path);

#endif
