/* fp16's dynamic loss scaler (include/tera/precision.h). */
#include <cjson/cJSON.h>

#include "tera/precision.h"

void tera_scaler_init(tera_loss_scaler *s, float init_scale, int window) {
    s->scale = init_scale < TERA_LOSS_SCALE_MIN   ? TERA_LOSS_SCALE_MIN
               : init_scale > TERA_LOSS_SCALE_MAX ? TERA_LOSS_SCALE_MAX
                                                  : init_scale;
    s->good_steps = 0;
    s->overflows = 0;
    s->window = window > 0 ? window : 1;
    s->fixed = window <= 0;
}

int tera_scaler_update(tera_loss_scaler *s, int finite) {
    if (!finite) {
        s->overflows++;
        s->good_steps = 0;
        if (s->fixed) return -1;
        if (s->scale * 0.5f >= TERA_LOSS_SCALE_MIN) s->scale *= 0.5f;
        return -1;
    }
    if (s->fixed) {
        s->good_steps++;
        return 0;
    }
    if (++s->good_steps < s->window) return 0;
    s->good_steps = 0;
    if (s->scale * 2.0f > TERA_LOSS_SCALE_MAX) return 0;
    s->scale *= 2.0f;
    return 1;
}

void tera_scaler_save(const tera_loss_scaler *s, cJSON *root) {
    cJSON *o = cJSON_AddObjectToObject(root, "loss_scaler");
    cJSON_AddNumberToObject(o, "scale", (double)s->scale);
    cJSON_AddNumberToObject(o, "good_steps", (double)s->good_steps);
    cJSON_AddNumberToObject(o, "overflows", (double)s->overflows);
}

tera_status tera_scaler_load(tera_loss_scaler *s, const cJSON *root, const char *path) {
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "loss_scaler");
    const cJSON *scale = cJSON_GetObjectItemCaseSensitive(o, "scale");
    if (!cJSON_IsNumber(scale)) return TERA_OK;
    if (!(scale->valuedouble >= TERA_LOSS_SCALE_MIN && scale->valuedouble <= TERA_LOSS_SCALE_MAX))
        return tera_fail(TERA_ERR_FORMAT, "%s: \"loss_scaler.scale\" = %g is outside [%g, %g]", path, scale->valuedouble,
                         (double)TERA_LOSS_SCALE_MIN, (double)TERA_LOSS_SCALE_MAX);
    const cJSON *good = cJSON_GetObjectItemCaseSensitive(o, "good_steps");
    const cJSON *over = cJSON_GetObjectItemCaseSensitive(o, "overflows");
    s->scale = (float)scale->valuedouble;
    s->good_steps = cJSON_IsNumber(good) ? (int64_t)good->valuedouble : 0;
    s->overflows = cJSON_IsNumber(over) ? (int64_t)over->valuedouble : 0;
    return TERA_OK;
}
