/* fp16's dynamic loss scaler (include/tera/precision.h). */
#include "tera/precision.h"

void tera_scaler_init(tera_loss_scaler *s, float init_scale, int window) {
    s->scale = init_scale < TERA_LOSS_SCALE_MIN   ? TERA_LOSS_SCALE_MIN
               : init_scale > TERA_LOSS_SCALE_MAX ? TERA_LOSS_SCALE_MAX
                                                  : init_scale;
    s->good_steps = 0;
    s->overflows = 0;
    s->window = window > 0 ? window : 1;
}

int tera_scaler_update(tera_loss_scaler *s, int finite) {
    if (!finite) {
        s->overflows++;
        s->good_steps = 0;
        if (s->scale * 0.5f >= TERA_LOSS_SCALE_MIN) s->scale *= 0.5f;
        return -1;
    }
    if (++s->good_steps < s->window) return 0;
    s->good_steps = 0;
    if (s->scale * 2.0f > TERA_LOSS_SCALE_MAX) return 0;
    s->scale *= 2.0f;
    return 1;
}
