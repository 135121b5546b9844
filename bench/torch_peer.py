#!/usr/bin/python3
"""PyTorch benchmark peer (shared/spec/BENCH.md): full training steps of tests/ref/tera_ref.py's
model in eager mode on random tokens, printing ONE JSON line.

    OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 bench/torch_peer.py --config bench-s --threads 2 \
        --precision bf16 --steps 10 --warmup 3

The model is the reference (H = Hkv = 8, dropless, aux_coef 0.01, z off, untied head) with its MoE in
the gathered form: kept assignments sorted by expert, one SwiGLU matmul chain per expert on its
gathered tokens, one index_add back. bf16 = torch.autocast("cpu", dtype=torch.bfloat16) around the
forward and loss (router, norms, softmax and loss stay fp32; master weights and AdamW are fp32).

--fp32-gemm: Debian's torch 1.13 is built with BLAS_INFO=generic and on this machine libblas.so.3
is netlib's reference BLAS, so an fp32 torch.mm runs at ~4 GFLOP/s while the oneDNN that torch also
links runs fp32 convolutions at ~75 GFLOP/s. The peer's best honest fp32 configuration ("onednn",
the default) therefore computes every nn.Linear as a 1x1 conv2d and the attention batched
matmuls as grouped 1x1 conv2d - the same maths, in stock PyTorch ops with autograd, reaching
oneDNN. "blas" keeps torch's plain F.linear / torch.matmul. bf16 autocast already uses oneDNN
matmuls and is left untouched.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ref"))
import tera_ref as R  # noqa: E402

CONFIGS = {  # name: (V, D, L, H, E, k, F, T, B)
    "bench-s": (4096, 256, 4, 8, 8, 2, 512, 256, 8),
    "bench-m": (16384, 512, 8, 8, 16, 2, 1024, 512, 4),
    "bench-dist": (4096, 256, 8, 8, 16, 2, 512, 256, 16),
}


# PyTorch 1.13 sends a 1x1 convolution with batch < 16 on ONE thread to its native (BLAS) path
# instead of oneDNN (ConvParams::use_mkldnn), so the rows are folded into a batch of 16 there.
FOLD = 16


def _fold():
    return FOLD if torch.get_num_threads() == 1 else 1


def _linear_conv(self, x):
    """nn.Linear.forward as a 1x1 conv2d over [g, in, N/g, 1] (oneDNN's fp32 path)."""
    shp = x.shape
    x2 = x.reshape(-1, shp[-1])
    n, out = x2.shape[0], self.weight.shape[0]
    g = _fold() if x2.shape[0] % FOLD == 0 else 1
    if g == 1:
        y = F.conv2d(x2.t()[None, :, :, None], self.weight[:, :, None, None])
        y = y.view(out, n).t()   # views only: no zero-filled backward
    else:
        xi = x2.reshape(g, n // g, shp[-1]).permute(0, 2, 1)[..., None]      # [g, in, n/g, 1]
        y = F.conv2d(xi, self.weight[:, :, None, None])                      # [g, out, n/g, 1]
        y = y[..., 0].permute(0, 2, 1).reshape(n, out)
    return y.reshape(*shp[:-1], out)


def _matmul_gconv(a, b):
    """a [..., M, K] @ b [..., K, N] as a grouped 1x1 conv2d, one group per leading index."""
    lead, (M, K), N = a.shape[:-2], a.shape[-2:], b.shape[-1]
    a3, b3 = a.reshape(-1, M, K), b.reshape(-1, K, N)
    G = a3.shape[0]
    w = b3.transpose(1, 2).reshape(G * N, K, 1, 1)
    g = _fold() if M % FOLD == 0 else 1
    if g == 1:
        x = a3.transpose(1, 2).reshape(1, G * K, M, 1)
        y = F.conv2d(x, w, groups=G)                      # [1, G*N, M, 1]
        return y.reshape(G, N, M).transpose(1, 2).reshape(*lead, M, N)
    x = a3.reshape(G, g, M // g, K).permute(1, 0, 3, 2).reshape(g, G * K, M // g, 1)
    y = F.conv2d(x, w, groups=G)                          # [g, G*N, M/g, 1]
    y = y.reshape(g, G, N, M // g).permute(1, 0, 3, 2).reshape(G, M, N)
    return y.reshape(*lead, M, N)


def flops_per_token(cfg, T):
    """6 * active matrix params (attention, router, k experts, shared experts, LM head; no
    embedding) + 12 * L * D * T."""
    D, hd = cfg.hidden_size, cfg.head_dim
    attn = D * cfg.n_heads * hd * 2 + D * cfg.n_kv_heads * hd * 2
    per_layer = []
    for l in range(cfg.n_layers):
        if cfg.is_moe_layer(l):
            ffn = D * cfg.n_experts + 3 * D * cfg.moe_ffn_dim * (cfg.top_k + cfg.n_shared_experts)
        else:
            ffn = 3 * D * cfg.dense_ffn_dim
        per_layer.append(attn + ffn)
    active = sum(per_layer) + cfg.vocab_size * D
    return 6 * active + 12 * cfg.n_layers * D * T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32-gemm", choices=("onednn", "blas"), default="onednn")
    a = ap.parse_args()
    gemm = a.fp32_gemm if a.precision == "fp32" else "autocast-bf16"
    if gemm == "onednn":
        torch.nn.Linear.forward = _linear_conv
        R.MATMUL = _matmul_gconv

    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(a.seed)
    V, D, L, H, E, k, F_, T, B = CONFIGS[a.config]
    cfg = R.Config(vocab_size=V, hidden_size=D, n_layers=L, n_heads=H, n_kv_heads=H, n_experts=E,
                   top_k=k, moe_ffn_dim=F_, aux_coef=0.01, z_coef=0.0, init_std=0.02,
                   max_position_embeddings=T)
    model = R.TeraModel(cfg)
    model.init_weights(torch.Generator().manual_seed(a.seed))
    hp = R.TrainHP(lr=3e-4, min_lr=3e-4, warmup_steps=0, total_steps=a.steps + a.warmup,
                   grad_clip=1.0)
    opt = R.make_optimizer(model, hp)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(a.seed + 1)

    times = []
    for s in range(a.warmup + a.steps):
        x = torch.randint(0, V, (B, T + 1), generator=g)
        inputs, targets = x[:, :-1], x[:, 1:]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(a.precision == "bf16")):
            out = model(inputs, targets)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, hp.grad_clip)
        opt.step()
        t1 = time.perf_counter()
        if s >= a.warmup:
            times.append(t1 - t0)
        if not torch.isfinite(out["loss"]):
            sys.exit(f"non-finite loss at step {s}")

    step = statistics.median(times)
    tps = B * T / step
    fpt = flops_per_token(cfg, T)
    print(json.dumps({"impl": "pytorch", "config": a.config, "threads": a.threads,
                      "precision": a.precision, "gemm": gemm, "tokens_per_s": round(tps, 2),
                      "step_ms_median": round(step * 1e3, 3), "flops_per_token": fpt,
                      "tflops": round(fpt * tps / 1e12, 6), "torch": torch.__version__,
                      "steps": a.steps, "warmup": a.warmup, "final_loss": round(float(out["loss"]), 5)}))


if __name__ == "__main__":
    main()
