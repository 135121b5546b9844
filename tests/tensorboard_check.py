"""Reads tera's TensorBoard event files with the tensorboard package's EventAccumulator and compares
every scalar with metrics.jsonl (tests/cli_tensorboard.sh). Usage: tensorboard_check.py TB_DIR METRICS_JSONL FIRST_MOE
Prints one summary line; exits 1 naming the first mismatches."""
import json, math, sys

from tensorboard.backend.event_processing import event_accumulator as ea

tb_dir, metrics, first_moe = sys.argv[1], sys.argv[2], int(sys.argv[3])
acc = ea.EventAccumulator(tb_dir, size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
acc.Reload()
tags = acc.Tags()
scal = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}
hist = {t: {e.step: e.histogram_value for e in acc.Histograms(t)} for t in tags["histograms"]}

steps, vals = {}, {}
for line in open(metrics):
    r = json.loads(line)
    if "event" in r:
        continue
    if "loss" in r:
        steps[r["step"]] = r
    elif "val_loss" in r:
        vals[r["step"]] = r["val_loss"]

# (metrics.jsonl key or path, TensorBoard tag, relative tolerance: the file's printed digits)
want = []
# tolerance: (relative, absolute): metrics.jsonl prints %.7g (loss, lr, ...), %.1f (tokens_per_s), %.4f (step_s),
# %.5f (dropped_frac), %.5g (update_ratio, group norms, entropy), %.4f (expert load); TensorBoard holds float32
for k, tol in (("loss", (1e-6, 0)), ("ce_loss", (1e-6, 0)), ("aux_loss", (1e-6, 0)), ("z_loss", (1e-6, 0)),
               ("lr", (1e-6, 0)), ("grad_norm", (1e-6, 0)), ("tokens_per_s", (1e-6, 0.051)), ("step_s", (1e-6, 5.1e-5)),
               ("dropped_frac", (1e-6, 5.1e-6)), ("update_ratio", (1e-4, 0)), ("loss_scale", (1e-7, 0)), ("skipped", (0, 0)),
               ("batch", (0, 0))):
    want.append(((k,), k, tol))
r0 = next(iter(steps.values()))
for k in ("aux_loss_weighted", "z_loss_weighted"):  # newer metrics.jsonl lines carry them
    if k in r0:
        want.append(((k,), k, (1e-6, 0)))
for k in ("model_tflops", "mfu"):  # %.6g / %.5f; mfu only with logging.peak_tflops
    if k in r0:
        want.append(((k,), k, (1e-5, 5.1e-6)))
for g in r0["grad_norm_by_group"]:
    want.append((("grad_norm_by_group", g), "grad_norm_by_group/" + g, (1e-4, 0)))
for j in range(len(r0["router_entropy"])):
    want.append((("router_entropy", j), "router_entropy/layer_%d" % (first_moe + j), (1e-4, 0)))
    want.append((("expert_load_max_over_mean", j), "expert_load_max_over_mean/layer_%d" % (first_moe + j), (1e-6, 5.1e-5)))

bad, n = [], 0


def close(a, b, tol):
    if a is None or b is None:  # JSON null: a non-finite figure
        return a is None and (b is None or not math.isfinite(b))
    rel, ab = tol
    return abs(a - b) <= rel * abs(a) + ab + 1e-30


for path, tag, tol in want:
    if tag not in scal:
        bad.append("no scalar tag " + tag)
        continue
    for s, r in steps.items():
        v = r
        for p in path:
            v = v[p]
        if s not in scal[tag]:
            bad.append("%s: no value at step %d" % (tag, s))
            continue
        n += 1
        if not close(v, scal[tag][s], tol):
            bad.append("%s step %d: %r in TensorBoard, %r in metrics.jsonl" % (tag, s, scal[tag][s], v))
for s, v in vals.items():
    n += 1
    if s not in scal.get("val_loss", {}) or not close(v, scal["val_loss"][s], (1e-6, 0)):
        bad.append("val_loss step %d: %r vs %r" % (s, scal.get("val_loss", {}).get(s), v))
# histograms: every MoE layer, every step; the busiest expert over the mean agrees with metrics.jsonl
nh = 0
for j in range(len(r0["expert_load_max_over_mean"])):
    tag = "expert_load/layer_%d" % (first_moe + j)
    for s, r in steps.items():
        h = hist.get(tag, {}).get(s)
        if h is None:
            bad.append("no histogram %s at step %d" % (tag, s))
            continue
        nh += 1
        counts = list(h.bucket)
        if abs(sum(counts) - h.num) > 0.5 or h.num <= 0:
            bad.append("%s step %d: buckets sum %s, num %s" % (tag, s, sum(counts), h.num))
            continue
        ratio = max(counts) * len(counts) / h.num
        if abs(ratio - r["expert_load_max_over_mean"][j]) > 1e-4:
            bad.append("%s step %d: max/mean %s vs %s" % (tag, s, ratio, r["expert_load_max_over_mean"][j]))
if len(steps) == 0:
    bad.append("no steps in metrics.jsonl")
if bad:
    print("FAIL: %d mismatches, first: %s" % (len(bad), "; ".join(bad[:5])))
    sys.exit(1)
print("tags checked: " + " ".join(tag for _, tag, _ in want))
print("%d scalars of %d tags over %d steps equal metrics.jsonl, %d validation losses, %d histograms" % (
    n, len(want), len(steps), len(vals), nh))
