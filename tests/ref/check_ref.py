#!/usr/bin/python3
"""Self-checks of tera_ref.py (run: /usr/bin/python3 tests/ref/check_ref.py). Exit status 1 on any
failure. Covers: float64 gradcheck of the whole loss on tiny configs with every option (sigmoid
scores, expert groups and the routed scale included), group-limited top-k against a brute force, the MoE
gather path against a dense masked path, the aux loss of balanced routing, GQA against tiled MHA,
attention + RoPE against a naive loop with complex rotations, top-k ties, capacity policies,
the aux-free bias update, AdamW / LR / clipping against the formulas of MODEL.md, safetensors
round trip, and the committed fixtures against a fresh recomputation."""
import cmath
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tera_ref as R  # noqa: E402

FAILS = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        FAILS.append(name)


def maxdiff(a, b):
    return float((a.double() - b.double()).abs().max())


def tiny(**kw):
    base = dict(vocab_size=13, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4,
                top_k=2, moe_ffn_dim=6, init_std=0.5, aux_coef=0.3, z_coef=0.05)
    base.update(kw)
    return R.Config(**base)


def build(cfg, seed, bias_std=0.0):
    g = torch.Generator().manual_seed(seed)
    m = R.TeraModel(cfg)
    m.init_weights(g)
    with torch.no_grad():
        for b in m.biases().values():
            b.copy_(torch.randn(b.shape, generator=g) * bias_std)
    return m, g


def test_gradcheck():
    cases = {
        "dropless GQA": (tiny(), 0.0),
        "dense+shared+capacity(position)+aux_free+z": (
            tiny(n_layers=3, n_kv_heads=2, first_k_dense=1, dense_ffn_dim=10, n_shared_experts=2,
                 capacity_factor=1.0, drop_policy="position", aux_free=True, aux_free_rate=0.01),
            0.05),
        "k=1 capacity(probability) MQA": (
            tiny(top_k=1, capacity_factor=1.0, drop_policy="probability"), 0.0),
        "sigmoid, 4 groups / 2, routed_scale, aux_free, capacity(probability)": (
            tiny(n_experts=8, top_k=3, router_score="sigmoid", n_groups=4, topk_groups=2,
                 routed_scale=2.5, aux_free=True, aux_free_rate=0.01, capacity_factor=1.5,
                 drop_policy="probability"), 0.05),
        "softmax, 4 groups / 3, routed_scale": (
            tiny(n_experts=8, top_k=2, n_groups=4, topk_groups=3, routed_scale=1.5), 0.0),
    }
    for name, (cfg, bias_std) in cases.items():
        m, g = build(cfg, 7, bias_std)
        m = m.double()
        B, T = 2, 7
        x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
        inp, tgt = x[:, :-1], x[:, 1:]
        names = [n for n, _ in m.named_parameters()]
        params = tuple(p.detach().clone().requires_grad_(True) for p in m.parameters())
        with torch.no_grad():
            drops = sum(r["dropped"] for r in m(inp, tgt)["routes"].values())

        def f(*ps):
            return torch.nn.utils.stateless.functional_call(
                m, dict(zip(names, ps)), (inp, tgt))["loss"]

        ok = torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-6, rtol=1e-4,
                                      raise_exception=False)
        check(f"gradcheck float64: {name}", ok, f"(dropped assignments: {drops})")


def test_gather_vs_dense():
    for name, cfg, bias_std in [
            ("mixtral-like", tiny(n_experts=5, top_k=2), 0.0),
            ("deepseek-like", tiny(n_layers=3, first_k_dense=1, dense_ffn_dim=10, n_shared_experts=1,
                                   capacity_factor=0.75, aux_free=True, aux_free_rate=0.01), 0.1),
            ("capprob-like", tiny(top_k=1, capacity_factor=1.0, drop_policy="probability"), 0.0),
            ("sigmoid-groups-like", tiny(n_experts=8, top_k=3, router_score="sigmoid", n_groups=4,
                                         topk_groups=2, routed_scale=2.5, aux_free=True), 0.05)]:
        m, g = build(cfg, 3, bias_std)
        x = torch.randint(0, cfg.vocab_size, (3, 17), generator=g)
        res = {}
        for impl in ("gather", "dense"):
            m.set_moe_impl(impl)
            m.zero_grad(set_to_none=True)
            o = m(x[:, :-1], x[:, 1:])
            o["loss"].backward()
            res[impl] = (o["loss"].detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
        gd = max(maxdiff(res["gather"][1][n], res["dense"][1][n]) for n in res["gather"][1])
        ld = maxdiff(res["gather"][0], res["dense"][0])
        check(f"MoE gather == dense masked combine: {name}", ld < 1e-6 and gd < 1e-6,
              f"(loss diff {ld:.2e}, max grad diff {gd:.2e})")
        m.set_moe_impl("gather")


def test_aux_balanced():
    E, k, T = 4, 2, 8
    # token t prefers experts t%E and (t+1)%E with a cyclic pattern: every column of probs holds
    # the same multiset of values (P_e = 1/E) and each expert gets T*k/E assignments (f_e = 1/E)
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = torch.stack([base.roll(t % E) for t in range(T)])[None]  # [1, T, E]
    sel = R.topk_lowest_index_ties(probs, k)
    aux = R.load_balance_loss(probs, sel, E)
    check("aux == 1.0 for perfectly balanced routing", abs(float(aux) - 1.0) < 1e-6, f"({float(aux)})")
    # collapsed routing: every token sends both slots' worth to experts 0, 1 with prob 0.45 each
    probs2 = torch.tensor([0.45, 0.45, 0.05, 0.05]).expand(1, T, E)
    aux2 = R.load_balance_loss(probs2, R.topk_lowest_index_ties(probs2, k), E)
    check("aux of collapsed routing = E * sum f P", abs(float(aux2) - 4 * (0.5 * 0.45 * 2)) < 1e-6,
          f"({float(aux2)})")
    # a whole model with a zero router: uniform probs -> aux = 1 exactly, ties -> experts 0..k-1
    cfg = tiny(n_experts=4, top_k=2)
    m, g = build(cfg, 5)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.block_sparse_moe.gate.weight.zero_()
    x = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    o = m(x[:, :-1], x[:, 1:])
    sel_ok = all(bool((r["sel"] == torch.tensor([0, 1])).all()) for r in o["routes"].values())
    check("uniform router: aux == 1, ties pick lower expert index",
          abs(float(o["aux"]) - 1.0) < 1e-6 and sel_ok, f"({float(o['aux'])})")
    z_expected = math.log(4) ** 2
    check("uniform router: z == log(E)^2", abs(float(o["z"]) - z_expected) < 1e-5)


def test_group_limited():
    # brute force: score groups, keep the best topk_groups (ties: lower index), then k rounds of
    # arg-max over their experts; values on a coarse grid so that ties are everywhere
    g = torch.Generator().manual_seed(11)
    for rule, G, Gk, E, k in [("top2", 8, 4, 64, 8), ("max", 8, 4, 64, 8), ("top2", 16, 1, 64, 2),
                              ("max", 64, 8, 64, 8), ("top2", 64, 8, 64, 8)]:
        s = torch.randint(0, 16, (40, E), generator=g).double() / 16
        sel = R.group_limited_topk(s, k, G, Gk, rule)[0]
        ok = True
        for t in range(s.shape[0]):
            grp = s[t].view(G, E // G)
            if rule == "top2":
                gs = [sum(sorted(grp[i].tolist(), reverse=True)[:2]) for i in range(G)]
            else:
                gs = [max(grp[i].tolist()) for i in range(G)]
            keep = sorted(range(G), key=lambda i: (-gs[i], i))[:Gk]
            allowed = [e for e in range(E) if e // (E // G) in keep]
            want = sorted(allowed, key=lambda e: (-float(s[t, e]), e))[:k]
            ok = ok and sel[t].tolist() == want
        check(f"group-limited top-k ({rule}, {G} groups / {Gk}, E {E}, k {k}) == brute force", ok)
    # sigmoid balancing loss: scores equal across experts (any logits row constant) and balanced
    # selections give aux = 1; the normaliser makes P independent of the scores' scale
    E, k, T = 4, 2, 8
    sel = torch.stack([torch.tensor([t % E, (t + 1) % E]) for t in range(T)])[None]
    for v in (0.2, 0.9):
        p = torch.full((1, T, E), v)
        aux = R.load_balance_loss(p / p.sum(-1, keepdim=True), sel, E)
        check(f"sigmoid aux == 1 for balanced routing, equal scores {v}", abs(float(aux) - 1) < 1e-6)


def test_topk_ties():
    s = torch.tensor([[0.2, 0.3, 0.3, 0.1, 0.3]])
    check("top-k ties -> lower index, picks in descending order",
          R.topk_lowest_index_ties(s, 3).tolist() == [[1, 2, 4]])


def naive_attention(x, att, cfg):
    """Per head / per position loops, RoPE as a complex rotation of pairs (j, j + hd/2)."""
    B, T, D = x.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = (x @ att.q_proj.weight.T).view(B, T, H, hd).double()
    k = (x @ att.k_proj.weight.T).view(B, T, Hkv, hd).double()
    v = (x @ att.v_proj.weight.T).view(B, T, Hkv, hd).double()

    def rope(vec, t):
        out = vec.clone()
        for j in range(hd // 2):
            z = complex(vec[j], vec[j + hd // 2]) * cmath.exp(1j * t * cfg.rope_theta ** (-2 * j / hd))
            out[j], out[j + hd // 2] = z.real, z.imag
        return out

    y = torch.zeros(B, T, H, hd, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            ks = [rope(k[b, s, kv], s) for s in range(T)]
            for t in range(T):
                qt = rope(q[b, t, h], t)
                sc = torch.tensor([float(qt @ ks[s]) / math.sqrt(hd) for s in range(t + 1)])
                p = sc.softmax(0)
                y[b, t, h] = sum(p[s] * v[b, s, kv] for s in range(t + 1))
    return y.reshape(B, T, H * hd) @ att.o_proj.weight.double().T


def test_attention():
    for Hkv in (4, 2, 1):
        cfg = tiny(hidden_size=16, n_heads=4, n_kv_heads=Hkv, rope_theta=500.0)
        torch.manual_seed(11)
        att = R.Attention(cfg)
        x = torch.randn(2, 6, 16)
        d = maxdiff(att(x), naive_attention(x, att, cfg))
        check(f"attention+RoPE == naive complex-rotation loop (H=4, Hkv={Hkv})", d < 1e-5, f"({d:.2e})")
    # GQA with tiled k/v weights equals MHA with Hkv = H
    cfg_g, cfg_m = tiny(hidden_size=16, n_heads=4, n_kv_heads=2), tiny(hidden_size=16, n_heads=4, n_kv_heads=4)
    torch.manual_seed(12)
    ag, am = R.Attention(cfg_g), R.Attention(cfg_m)
    hd = 4
    with torch.no_grad():
        am.q_proj.weight.copy_(ag.q_proj.weight)
        am.o_proj.weight.copy_(ag.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            w = getattr(ag, name).weight.view(2, hd, 16)
            getattr(am, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(16, 16))
    x = torch.randn(3, 5, 16)
    d = maxdiff(ag(x), am(x))
    check("GQA (Hkv=2) == MHA with each kv head tiled over its query heads", d < 1e-6, f"({d:.2e})")


def test_rmsnorm():
    n = R.RMSNorm(5, eps=0.25)
    with torch.no_grad():
        n.weight.copy_(torch.arange(1.0, 6.0))
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5, 0.0]])
    ref = torch.arange(1.0, 6.0) * x / math.sqrt(float((x ** 2).mean()) + 0.25)
    check("RMSNorm uses the configured eps", maxdiff(n(x), ref) < 1e-6)


def test_capacity():
    check("cap = ceil(cf*T*k/E)", R.capacity(1.0, 72, 2, 6) == 24 and R.capacity(1.25, 10, 1, 4) == 4
          and R.capacity(1.0, 40, 1, 4) == 10)
    # one sequence, T=5, k=2, E=3, cap=2. assignments (t*k+j): expert of each
    sel = torch.tensor([[[0, 1], [0, 2], [1, 0], [0, 1], [2, 0]]])
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.3, 0.5, 0.2],
                           [0.7, 0.2, 0.1], [0.2, 0.1, 0.7]]])
    pos = R.capacity_keep_mask(sel, probs, 2, "position")
    # expert 0 at tokens 0,1,2,3,4 -> keep tokens 0,1; expert 1 at tokens 0,2,3 -> keep 0,2
    exp_pos = torch.tensor([[[1, 1], [1, 1], [1, 0], [0, 0], [1, 0]]], dtype=torch.bool)
    check("capacity 'position' keeps the lowest assignment indices", bool((pos == exp_pos).all()),
          str(pos.int().tolist()))
    pr = R.capacity_keep_mask(sel, probs, 2, "probability")
    # expert 0 probs by token: .5 .6 .3 .7 .2 -> keep tokens 3, 1; expert 1: .3 .5 .2 -> keep 2, 0
    exp_pr = torch.tensor([[[0, 1], [1, 1], [1, 0], [1, 0], [1, 0]]], dtype=torch.bool)
    check("capacity 'probability' keeps the highest probs", bool((pr == exp_pr).all()),
          str(pr.int().tolist()))
    probs_tie = torch.full((1, 5, 3), 1 / 3)
    check("capacity 'probability' ties -> lower assignment index",
          bool((R.capacity_keep_mask(sel, probs_tie, 2, "probability") == exp_pos).all()))
    # weights of kept slots are not renormalised again
    cfg = tiny(capacity_factor=0.5, n_experts=4, top_k=2)
    m, g = build(cfg, 9)
    r = m.model.layers[0].block_sparse_moe.route(torch.randn(2, 8, cfg.hidden_size, generator=g))
    p_sel = r["probs"].gather(-1, r["sel"])
    w_expected = p_sel / p_sel.sum(-1, keepdim=True) * r["keep"]
    check("dropped slots get weight 0, kept weights not renormalised",
          r["dropped"] > 0 and maxdiff(r["weights"], w_expected) == 0.0, f"(dropped {r['dropped']})")


def test_aux_free_update():
    cfg = tiny(aux_free=True, aux_free_rate=0.5, n_experts=4, top_k=1)
    m, _ = build(cfg, 1)
    B, T = 1, 8  # mean load = 2
    sel = torch.tensor([0, 0, 0, 1, 1, 2, 0, 0]).view(B, T, 1)  # loads 5, 2, 1, 0
    routes = {l: {"sel": sel, "load": torch.bincount(sel.flatten(), minlength=4)} for l in (0, 1)}
    R.aux_free_update(m, routes)
    check("aux-free bias += rate*sign(mean-load), sign(0)=0",
          m.biases()[0].tolist() == [-0.5, 0.0, 0.5, 0.5])


def test_optimizer():
    hp = R.TrainHP(lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=6)
    lrs = [R.lr_at(hp, s) for s in range(6)]
    exp = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * (s - 2) / 4)) for s in range(2, 6)]
    check("LR schedule", max(abs(a - b) for a, b in zip(lrs, exp)) < 1e-12, str([round(v, 4) for v in lrs]))
    hp_c = R.TrainHP(lr=0.3, min_lr=0.3, warmup_steps=0, total_steps=4)
    check("W=0, min_lr=max_lr gives a constant LR", all(R.lr_at(hp_c, s) == 0.3 for s in range(4)))
    # AdamW vs MODEL.md formulas over 3 steps, with decay on a matrix and none on a vector
    torch.manual_seed(4)
    hp = R.TrainHP(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.2)
    lin = torch.nn.Module()
    lin.w = torch.nn.Parameter(torch.randn(3, 4))
    lin.n = torch.nn.Parameter(torch.randn(4))
    opt = R.make_optimizer(lin, hp)
    ref = {"w": lin.w.detach().clone(), "n": lin.n.detach().clone()}
    mom = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in ref.items()}
    for t in range(1, 4):
        grads = {"w": torch.randn(3, 4), "n": torch.randn(4)}
        lin.w.grad, lin.n.grad = grads["w"].clone(), grads["n"].clone()
        opt.step()
        for k in ref:
            m_, v_ = mom[k]
            m_ = hp.beta1 * m_ + (1 - hp.beta1) * grads[k]
            v_ = hp.beta2 * v_ + (1 - hp.beta2) * grads[k] ** 2
            mom[k] = (m_, v_)
            if k == "w":
                ref[k] = ref[k] - hp.lr * hp.weight_decay * ref[k]
            ref[k] = ref[k] - hp.lr * (m_ / (1 - hp.beta1 ** t)) / ((v_ / (1 - hp.beta2 ** t)).sqrt() + hp.eps)
    d = max(maxdiff(lin.w, ref["w"]), maxdiff(lin.n, ref["n"]))
    check("AdamW == MODEL.md formulas (decay on 2-D only)", d < 1e-6, f"({d:.2e})")
    # clipping
    p = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    p[0].grad, p[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    n = R.clip_global_norm(p, 1.0)
    ok = abs(n - 5.0) < 1e-12 and maxdiff(p[0].grad, torch.tensor([3.0, 0.0]) / (5 + 1e-6)) < 1e-7
    p[0].grad, p[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    R.clip_global_norm(p, 5.0)
    ok = ok and p[0].grad.tolist() == [3.0, 0.0]
    check("global-norm clipping c/(n+1e-6) only when n > c", ok)


def test_safetensors():
    t = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int32), "c": torch.randn(1)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.safetensors")
        R.save_safetensors(path, t, {"k": "v"})
        raw = open(path, "rb").read()
        u, meta = R.load_safetensors(path)
    n = int.from_bytes(raw[:8], "little")
    ok = all(torch.equal(t[k], u[k]) for k in t) and meta == {"format": "pt", "k": "v"}
    ok = ok and n % 8 == 0 and len(raw) == 8 + n + 15 * 4 + 7 * 4 + 4
    check("safetensors round trip, header padded to 8, no gaps", ok)


def test_fixtures():
    root = os.path.join(HERE, "..", "fixtures")
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        d = os.path.join(root, name)
        if not os.path.isfile(os.path.join(d, "fixture.safetensors")):
            continue
        m = R.load_model(d)
        fx, meta = R.load_safetensors(os.path.join(d, "fixture.safetensors"))
        B, T = int(meta["B"]), int(meta["T"])
        s = fx["stream"].long()
        inp, tgt = R.sample_batch(s, 0, B, T)
        ok = torch.equal(inp, fx["inputs"].long()) and torch.equal(tgt, fx["targets"].long())
        o = m(inp, tgt)
        o["loss"].backward()
        d_l = maxdiff(o["logits"].reshape(B * T, -1), fx["logits"])
        d_loss = max(maxdiff(o[a].reshape(1), fx[b]) for a, b in
                     (("loss", "loss"), ("ce", "ce_loss"), ("aux", "aux_loss"), ("z", "z_loss")))
        d_g = max(maxdiff(p.grad if p.grad is not None else torch.zeros_like(p), fx["grad." + n])
                  for n, p in m.named_parameters())
        names_ok = {k[5:] for k in fx if k.startswith("grad.")} == {n for n, _ in m.named_parameters()}
        check(f"fixture {name}: batch, logits, losses, grads recomputed", ok and names_ok and
              d_l < 1e-5 and d_loss < 1e-6 and d_g < 1e-6,
              f"(logits {d_l:.1e}, losses {d_loss:.1e}, grads {d_g:.1e})")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for fn in (test_topk_ties, test_group_limited, test_rmsnorm, test_attention, test_aux_balanced, test_capacity,
               test_aux_free_update, test_optimizer, test_safetensors, test_gather_vs_dense,
               test_gradcheck, test_fixtures):
        fn()
    print(f"{len(FAILS)} failure(s)" if FAILS else "all checks passed")
    sys.exit(1 if FAILS else 0)
