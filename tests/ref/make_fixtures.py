#!/usr/bin/python3
"""Write the reference fixtures into tests/fixtures/<name>/ (deterministic: fixed torch seed).

    /usr/bin/python3 tests/ref/make_fixtures.py [--out tests/fixtures] [name ...]

Each directory: config.json, model.safetensors (initial weights), fixture.safetensors (batch,
logits, losses, gradients, 5 AdamW steps, final weights). See tests/fixtures/README.md.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tera_ref import Config, TeraModel, TrainHP, save_safetensors, model_state, sample_batch, train  # noqa: E402

STEPS = 5

FIXTURES = {
    # name: (Config, B, T, seed, TrainHP, initial aux-free bias std)
    "mixtral": (Config(vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       n_experts=4, top_k=2, moe_ffn_dim=48, aux_coef=0.01, z_coef=0.0,
                       init_std=0.2, max_position_embeddings=256),
                3, 24, 105, TrainHP(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=STEPS,
                                     grad_clip=3.5), 0.0),
    "deepseek": (Config(vocab_size=80, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=4,
                        n_experts=6, top_k=2, moe_ffn_dim=24, first_k_dense=1, dense_ffn_dim=64,
                        n_shared_experts=1, capacity_factor=1.0, drop_policy="position",
                        aux_coef=0.01, z_coef=0.001, aux_free=True, aux_free_rate=0.01,
                        init_std=0.2, max_position_embeddings=256),
                 2, 72, 113, TrainHP(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=STEPS,
                                      grad_clip=3.0), 0.05),
    "capprob": (Config(vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=1,
                       n_experts=4, top_k=1, moe_ffn_dim=48, capacity_factor=1.0,
                       drop_policy="probability", aux_coef=0.01, z_coef=0.0,
                       init_std=0.2, max_position_embeddings=256),
                2, 40, 101, TrainHP(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=STEPS,
                                     grad_clip=3.3), 0.0),
    # DeepSeek-V3 routing at scale: 256 experts in 8 groups, 4 groups per token, top-8 by sigmoid
    # score (+ aux-free bias), weights renormalised x 2.5; tiny widths and one MoE layer keep the
    # files small (their size is mostly the names of 256 x 3 expert tensors)
    "sigmoid": (Config(vocab_size=64, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1,
                       n_experts=256, top_k=8, moe_ffn_dim=2, first_k_dense=1, dense_ffn_dim=16,
                       router_score="sigmoid", n_groups=8,
                       topk_groups=4, routed_scale=2.5, aux_coef=0.01, z_coef=0.001, aux_free=True,
                       aux_free_rate=0.001, init_std=0.2, max_position_embeddings=64),
                2, 16, 102, TrainHP(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=STEPS,
                                     grad_clip=1.0), 0.05),
    # DeepSeek-V2-style group-limited routing on softmax probabilities (group score = max)
    "softgroups": (Config(vocab_size=64, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=2,
                          n_experts=16, top_k=3, moe_ffn_dim=8, n_groups=4, topk_groups=2,
                          routed_scale=1.5, aux_coef=0.01, z_coef=0.001,
                          init_std=0.2, max_position_embeddings=64),
                   2, 24, 131, TrainHP(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=STEPS,
                                        grad_clip=2.0), 0.0),
}


def routing_margins(cfg, r):
    """Smallest gaps that decide routing: k-th vs (k+1)-th score (top-k), and for the probability
    policy the last kept vs first dropped prob of an over-full expert. Tiny gaps make the fixture
    fragile against another implementation's rounding."""
    k, E = cfg.top_k, cfg.n_experts
    scores = r["scores"]
    m_grp = float("inf")
    if cfg.n_groups > 1:
        # group choice: topk_groups-th vs next group score; expert choice among the allowed experts
        if cfg.topk_groups < cfg.n_groups:
            g = torch.sort(r["group_scores"], dim=-1, descending=True).values
            m_grp = float((g[..., cfg.topk_groups - 1] - g[..., cfg.topk_groups]).min())
        scores = scores.masked_fill(~r["allowed"], float("-inf"))
        E = cfg.topk_groups * (cfg.n_experts // cfg.n_groups)
    s = torch.sort(scores, dim=-1, descending=True).values
    m_sel = float((s[..., k - 1] - s[..., k]).min()) if k < E else float("inf")
    m_sel = min(m_sel, m_grp)
    m_cap = float("inf")
    if cfg.capacity_factor > 0 and cfg.drop_policy == "probability":
        from tera_ref import capacity
        B, T, _ = r["sel"].shape
        cap = capacity(cfg.capacity_factor, T, k, E)
        for b in range(B):
            for e in range(E):
                tok = (r["sel"][b] == e).any(-1).nonzero().flatten()
                if tok.numel() > cap:
                    p = torch.sort(r["probs"][b, tok, e].detach(), descending=True).values
                    m_cap = min(m_cap, float(p[cap - 1] - p[cap]))
    return m_sel, m_cap


def make(name, out_root):
    cfg, B, T, seed, hp, bias_std = FIXTURES[name]
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = TeraModel(cfg)
    model.init_weights(g)
    with torch.no_grad():
        for b in model.biases().values():
            b.copy_(torch.randn(b.shape, generator=g) * bias_std)
    stream = torch.randint(0, cfg.vocab_size, (STEPS * B * T + 1,), generator=g, dtype=torch.int64)

    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
        f.write("\n")
    init_state = model_state(model)
    save_safetensors(os.path.join(d, "model.safetensors"), init_state)

    # forward + backward of the initial model on samples 0..B-1
    inputs, targets = sample_batch(stream, 0, B, T)
    model.zero_grad(set_to_none=True)
    out = model(inputs, targets)
    out["loss"].backward()
    V = cfg.vocab_size
    fx = {
        "inputs": inputs.to(torch.int32), "targets": targets.to(torch.int32),
        "stream": stream.to(torch.int32),
        "logits": out["logits"].detach().reshape(B * T, V),
        "loss": out["loss"].detach().reshape(1), "ce_loss": out["ce"].detach().reshape(1),
        "aux_loss": out["aux"].detach().reshape(1), "z_loss": out["z"].detach().reshape(1),
    }
    for n, p in model.named_parameters():
        fx["grad." + n] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    drops = {}
    for l, r in out["routes"].items():
        k = cfg.top_k
        fx[f"route.{l}.experts"] = r["sel"].reshape(B * T, k).to(torch.int32)
        fx[f"route.{l}.kept"] = r["keep"].reshape(B * T, k).to(torch.int32)
        fx[f"route.{l}.weights"] = r["weights"].detach().reshape(B * T, k)
        drops[l] = r["dropped"]
        print(f"[{name}] layer {l} load {r['load'].tolist()} margins (topk, capacity) "
              f"{routing_margins(cfg, r)}")
    print(f"[{name}] loss {float(out['loss']):.6f} ce {float(out['ce']):.6f} "
          f"aux {float(out['aux']):.6f} z {float(out['z']):.6f} dropped per MoE layer {drops}")

    # 5 training steps from the same initial state (fresh optimizer)
    model.zero_grad(set_to_none=True)
    margins = []
    hist = train(model, hp, stream, B, T, STEPS, log=lambda s: print(f"[{name}] {s}"),
                 on_step=lambda s, o: margins.append(
                     [min(v) for v in zip(*(routing_margins(cfg, r) for r in o["routes"].values()))]))
    print(f"[{name}] smallest routing margins per step (topk, capacity): {margins}")
    assert abs(hist["losses"][0] - float(out["loss"])) <= 1e-6 * max(1.0, abs(hist["losses"][0]))
    fx["train_losses"] = torch.tensor(hist["losses"], dtype=torch.float32)
    fx["train_grad_norms"] = torch.tensor(hist["grad_norms"], dtype=torch.float32)
    fx["train_lrs"] = torch.tensor(hist["lrs"], dtype=torch.float32)
    for n, p in model.named_parameters():
        fx["final." + n] = p.detach().clone()
    for l, b in model.biases().items():
        fx[f"final_bias.{l}"] = b.detach().clone()

    meta = hp.as_strings()
    meta.update(B=str(B), T=str(T), seed=str(seed), steps=str(STEPS))
    save_safetensors(os.path.join(d, "fixture.safetensors"), fx, meta)
    n_clipped = sum(hist["clipped"])
    print(f"[{name}] clipped on {n_clipped}/{STEPS} steps (grad_clip {hp.grad_clip}); "
          f"dropped per step {hist['dropped']}")
    sizes = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    print(f"[{name}] sizes {sizes} total {sum(sizes.values())} bytes")
    return n_clipped, drops


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "fixtures"))
    ap.add_argument("names", nargs="*", default=list(FIXTURES))
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for name in a.names:
        n_clipped, drops = make(name, os.path.normpath(a.out))
        if n_clipped == 0:
            sys.exit(f"{name}: clipping was never active; lower grad_clip")
        if FIXTURES[name][0].capacity_factor > 0 and sum(drops.values()) == 0:
            sys.exit(f"{name}: capacity set but nothing dropped on the fixture batch")


if __name__ == "__main__":
    main()
