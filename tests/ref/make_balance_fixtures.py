#!/usr/bin/python3
"""PyTorch reference of tera's load-balancing losses (model.balance_loss), at the router.

For each scoring (softmax, sigmoid) and each loss (switch, switch_global, importance_load) it draws
router logits for one micro-batch of B sequences of T tokens, routes them (top-k of the scores, ties
to the lower index; combine weights = chosen scores renormalised to sum 1, times routed_scale) and
writes, as text, the logits, the selection, the loss in tera's aux_sum units (per-sequence losses
summed over the sequences; a per-micro-batch loss counted B times) and its gradient with respect to
the logits (autograd in float64, the selection held fixed):

  switch          sum_b E sum_e f_{b,e} P_{b,e}       f_{b,e} = n_{b,e} / (T k),  P_{b,e} = mean_t p[t,e]
  switch_global   B E sum_e f_e P_e                   f_e = n_e / (B T k),        P_e = mean over B T tokens
  importance_load B (cv2(I) + cv2(L))                 I_e = sum of combine weights to e, L_e = n_e
  cv2(x) = x.var() / (x.mean()^2 + 1e-10)             (torch's unbiased variance, Shazeer et al. 2017)

p = softmax(logits) (softmax) or s / s.sum() with s = sigmoid(logits) (sigmoid), n_{b,e} the
assignments of sequence b to expert e (no gradient), L carries no gradient.
Written from the definitions above (docs/ARCHITECTURE.md, "Balancing losses"), not from tera's code.

    /usr/bin/python3 tests/ref/make_balance_fixtures.py     # writes tests/fixtures/balance/*.txt
"""
import os
import sys

import torch

B, T, E, K, SCALE = 3, 7, 6, 2, 1.5
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "balance")


def cv2(x):
    return x.var() / (x.mean() ** 2 + 1e-10)


def case(score, kind, seed):
    g = torch.Generator().manual_seed(seed)
    logits32 = (torch.randn(B * T, E, generator=g) * 1.5).float()
    x = logits32.double().requires_grad_(True)
    s = torch.softmax(x, -1) if score == "softmax" else torch.sigmoid(x)
    # selection on the fp32 scores (as tera), held fixed; ties: lower index (stable sort)
    s32 = torch.softmax(logits32, -1) if score == "softmax" else torch.sigmoid(logits32)
    topi = torch.sort(s32, dim=-1, descending=True, stable=True).indices[:, :K]
    chosen = s.gather(1, topi)
    w = SCALE * chosen / chosen.sum(-1, keepdim=True)
    p = s if score == "softmax" else s / s.sum(-1, keepdim=True)
    n = torch.zeros(B, E, dtype=torch.float64)
    for b in range(B):
        for e in topi[b * T:(b + 1) * T].reshape(-1).tolist():
            n[b, e] += 1
    if kind == "switch":
        P = p.view(B, T, E).mean(1)
        loss = (E * (n / (T * K) * P).sum(-1)).sum()
    elif kind == "switch_global":
        loss = B * E * (n.sum(0) / (B * T * K) * p.mean(0)).sum()
    else:
        imp = torch.zeros(E, dtype=torch.float64).index_add(0, topi.reshape(-1), w.reshape(-1))
        loss = B * (cv2(imp) + cv2(n.sum(0)))
    loss.backward()
    lines = ["%s %s %d %d %d %d %.9g" % (kind, score, B, T, E, K, SCALE),
             " ".join("%.9g" % v for v in logits32.reshape(-1).tolist()),
             " ".join(str(v) for v in topi.reshape(-1).tolist()),
             "%.17g" % loss.item(),
             " ".join("%.17g" % v for v in x.grad.reshape(-1).tolist())]
    # the smallest margin between the k-th and (k+1)-th fp32 score: far above rounding
    srt = torch.sort(s32, dim=-1, descending=True).values
    margin = (srt[:, K - 1] - srt[:, K]).min().item()
    assert margin > 1e-4, "seed %d: routing margin %g too small" % (seed, margin)
    return "\n".join(lines) + "\n", margin


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    seed = 11
    for score in ("softmax", "sigmoid"):
        for kind in ("switch", "switch_global", "importance_load"):
            text, margin = case(score, kind, seed)
            path = os.path.join(OUT, "%s_%s.txt" % (kind, score))
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            print("%s: routing margin %.3g" % (os.path.relpath(path), margin), file=sys.stderr)
            seed += 1


if __name__ == "__main__":
    main()
