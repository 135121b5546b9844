#!/usr/bin/python3
"""tera_ref.py - an independent, readable PyTorch reference of the model in shared/spec/MODEL.md.

Run with Debian's interpreter (/usr/bin/python3, torch 1.13, numpy). No other dependency: the
safetensors reader/writer at the bottom is hand-written with struct + json.

Everything is plain fp32 eager PyTorch with autograd. The C trainer is compared against this file
tensor by tensor (tests/fixtures/*, written by make_fixtures.py), and bench/torch_peer.py times it.

Definitions (MODEL.md plus the choices this file makes where MODEL.md leaves room)
-------------------------------------------------------------------------------
Forward (pre-norm decoder):
    x = embed_tokens[tokens]
    per layer l:  h = x + Attn(RMSNorm_in(x));  x = h + FFN_l(RMSNorm_post(h))
    logits = lm_head(RMSNorm_final(x))            (lm_head untied)
  RMSNorm      y = w * (x * rsqrt(mean(x^2) + eps)), in fp32 (or fp64 when the model is fp64).
  RoPE         HF-Llama rotate-half. inv_freq[j] = theta^(-2j/hd), angle[t,j] = t*inv_freq[j] for
               positions t = 0..T-1 of each sequence. CHOICE: the angles and their cos/sin are
               computed in float64 and then rounded to the model dtype (HF computes them in fp32; the
               difference is ~1 ulp of the angle and well below the fixture tolerances).
  Attention    causal, scale 1/sqrt(hd), softmax in fp32. GQA like HF repeat_kv: query head h uses
               kv head h // (H/Hkv).
  Expert/FFN   w2(silu(w1 x) * (w3 x)); dense FFN and shared experts use HF names
               gate_proj (=w1), up_proj (=w3), down_proj (=w2).
MoE layer (N = B*T tokens of the layer, x its RMSNorm_post output):
  logits = x @ gate^T in fp32; probs = softmax_E(logits)      (router_score "softmax", the default)
                               probs = sigmoid(logits)        (router_score "sigmoid", DeepSeek-V3;
                                                               "probs" below then means these scores)
  scores = probs + bias[l]   (bias = e_score_correction_bias, aux-loss-free balancing; zeros when off;
                              no gradient)
  top-k by score; ties -> lower expert index. CHOICE: slot j of a token is its j-th pick in
               descending score order (slot 0 = best). Slot order does not change any result: an
               expert can hold only one slot of a token, so the capacity orderings below reduce to
               token order.
  group-limited routing (n_groups G > 1): experts [g E/G, (g+1) E/G) form group g; group score =
               max of the group's scores (softmax, DeepSeek-V2) or the sum of its two largest scores
               (sigmoid, DeepSeek-V3; the one score when a group has one expert), on the biased
               scores; the token keeps its topk_groups best groups (ties -> lower group index) and
               takes its top-k among their experts only. CHOICE: experts of other groups are
               excluded (-inf), not set to 0 as in HF's DeepSeek-V3 (where a negative biased score
               could lose to a masked expert).
  combine weight of slot j = routed_scale * probs[t, e_j] / sum_j' probs[t, e_j']   (the probs, NOT
               the scores; routed_scale = 1 by default, DeepSeek's routed_scaling_factor)
  capacity (cf > 0): per SEQUENCE and per expert, cap = ceil(cf * T * k / E).
               CHOICE: evaluated in double precision as ceil((cf * T * k) / E) (math.ceil in Python).
               Assignment index of (t, j) inside its sequence = t*k + j.
               "position":    keep the assignments with the lowest assignment index first.
               "probability": keep the highest probs[t, e] first, ties by lower assignment index.
               A dropped assignment contributes 0 (the residual carries the token). The kept weights
               are NOT renormalised again; gradients still flow into a dropped expert's probability
               through the normaliser of the kept weights (it is a function of all k chosen probs).
               cf = 0: dropless.
  shared experts (S > 0): one SwiGLU MLP of hidden width S*F on every token, added unweighted.
  dense layers: layers l < first_k_dense use a dense SwiGLU of width dense_ffn_dim, no router.
Losses:
  aux_{l,s} = E * sum_e f_e * P_e, f_e = (#selected assignments of sequence s to e, BEFORE capacity
              drops) / (T*k) (no gradient), P_e = mean over the T tokens of s of probs[:, e]
              (sigmoid: of probs[:, e] / sum_e' probs[:, e'], DeepSeek-V3's sequence-wise balance loss).
  aux  = mean over MoE layers and sequences.
  z    = mean over MoE layers and over all B*T tokens of logsumexp(router logits)^2 (either scoring).
  loss = mean over B*T positions of CE(logits, next token) + aux_coef * aux + z_coef * z.
  (aux and z are computed - and reported - even when their coefficient is 0.)
Training:
  AdamW (torch.optim.AdamW, per-group weight decay: >= 2-D tensors decay - embeddings, lm_head, router
  included - 1-D norm weights do not), lr set per step. An expert that no token reached has gradient
  zero (not None), so AdamW decays it and moves it by its moments like every other tensor:
     s < W: max_lr*(s+1)/W, else min_lr + 0.5*(max_lr-min_lr)*(1+cos(pi*(s-W)/(S-W))).
  Clipping: n = global L2 norm of all gradients; if n > c every gradient is scaled by c/(n+1e-6).
     CHOICE: n is accumulated in float64 and the scale is applied in fp32 (clip_grad_norm_ sums in
     fp32; the difference is rounding).
  Aux-loss-free bias update (aux_free on), after the optimizer step, per MoE layer:
     load_e = # selected assignments to e over the whole step's batch (before drops) - taken from the
     forward pass of that step, i.e. with the bias as it was before this update;
     bias_e += rate * sign(B*T*k/E - load_e), sign(0) = 0.
Init (fixtures only): normal(0, init_std) for every matrix (embeddings and router too); o_proj and
  every w2 / down_proj use init_std / sqrt(2 L); norm weights = 1; the aux-free bias starts at 0 unless
  the caller sets it.
"""
import json
import math
import struct
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------
@dataclass
class Config:
    vocab_size: int
    hidden_size: int            # D
    n_layers: int               # L
    n_heads: int                # H
    n_kv_heads: int             # Hkv (== H: plain multi-head attention)
    n_experts: int              # E
    top_k: int                  # k
    moe_ffn_dim: int            # F, routed expert hidden width
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    aux_coef: float = 0.01
    z_coef: float = 0.0
    n_shared_experts: int = 0   # S; shared MLP width = S*F
    first_k_dense: int = 0
    dense_ffn_dim: int = 0
    capacity_factor: float = 0.0  # 0 = dropless
    drop_policy: str = "position"  # "position" | "probability"
    aux_free: bool = False
    aux_free_rate: float = 0.0
    router_score: str = "softmax"  # "softmax" | "sigmoid"
    n_groups: int = 1             # group-limited routing: G groups of E/G experts (1 = off)
    topk_groups: int = 1          # groups a token may use
    routed_scale: float = 1.0     # routed scaling factor on the combine weights
    init_std: float = 0.02
    max_position_embeddings: int = 4096

    @property
    def head_dim(self):
        return self.hidden_size // self.n_heads

    def is_moe_layer(self, l):
        return l >= self.first_k_dense

    def moe_layers(self):
        return [l for l in range(self.n_layers) if self.is_moe_layer(l)]

    def validate(self):
        assert self.hidden_size % self.n_heads == 0 and self.head_dim % 2 == 0
        assert self.n_heads % self.n_kv_heads == 0
        assert 1 <= self.top_k <= self.n_experts
        assert self.drop_policy in ("position", "probability")
        assert self.capacity_factor >= 0
        assert self.first_k_dense == 0 or self.dense_ffn_dim > 0
        assert self.router_score in ("softmax", "sigmoid")
        assert self.n_experts % self.n_groups == 0 and 1 <= self.topk_groups <= self.n_groups
        assert self.top_k <= self.topk_groups * (self.n_experts // self.n_groups)
        assert self.routed_scale > 0

    def mixtral_routing(self):
        return (self.router_score == "softmax" and self.n_groups == 1 and self.routed_scale == 1.0)

    def to_hf(self):
        """config.json in Hugging Face Mixtral style plus tera's extensions (always written). Routing
        other than Mixtral's (sigmoid scores, expert groups, a routed scale) is written under HF
        DeepSeek-V3's names, and the model type is then tera_moe."""
        d = self._to_hf()
        if not self.mixtral_routing():
            d["architectures"] = ["TeraMoeForCausalLM"]
            d["model_type"] = "tera_moe"
            d.update(scoring_func=self.router_score, n_group=self.n_groups, topk_group=self.topk_groups,
                     routed_scaling_factor=self.routed_scale, norm_topk_prob=True)
        return d

    def _to_hf(self):
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.moe_ffn_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "num_local_experts": self.n_experts,
            "num_experts_per_tok": self.top_k,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "router_aux_loss_coef": self.aux_coef,
            "tie_word_embeddings": False,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "initializer_range": self.init_std,
            "torch_dtype": "float32",
            "moe_intermediate_size": self.moe_ffn_dim,
            "n_shared_experts": self.n_shared_experts,
            "first_k_dense_replace": self.first_k_dense,
            "dense_intermediate_size": self.dense_ffn_dim,
            "router_z_loss_coef": self.z_coef,
            "capacity_factor": self.capacity_factor,
            "drop_policy": self.drop_policy,
            "aux_loss_free": self.aux_free,
            "aux_free_bias_update_rate": self.aux_free_rate,
        }

    @classmethod
    def from_hf(cls, d):
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            n_layers=d["num_hidden_layers"], n_heads=d["num_attention_heads"],
            n_kv_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            n_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
            moe_ffn_dim=d.get("moe_intermediate_size", d["intermediate_size"]),
            rope_theta=d.get("rope_theta", 10000.0), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            aux_coef=d.get("router_aux_loss_coef", 0.01), z_coef=d.get("router_z_loss_coef", 0.0),
            n_shared_experts=d.get("n_shared_experts", 0),
            first_k_dense=d.get("first_k_dense_replace", 0),
            dense_ffn_dim=d.get("dense_intermediate_size", 0),
            capacity_factor=d.get("capacity_factor", 0.0),
            drop_policy=d.get("drop_policy", "position"),
            aux_free=d.get("aux_loss_free", False),
            aux_free_rate=d.get("aux_free_bias_update_rate", 0.0),
            router_score=d.get("scoring_func", "softmax"),
            n_groups=d.get("n_group", 1) or 1, topk_groups=d.get("topk_group", 1) or 1,
            routed_scale=d.get("routed_scaling_factor", 1.0),
            init_std=d.get("initializer_range", 0.02),
            max_position_embeddings=d.get("max_position_embeddings", 4096))


def _compute_dtype(x):
    """fp32 for low-precision activations, otherwise the tensor's own dtype (fp32 or fp64)."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x = x.to(_compute_dtype(x))
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_cos_sin(T, hd, theta, dtype):
    """cos, sin [T, hd], computed in float64 then rounded (see the header)."""
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]   # [T, hd/2]
    ang = torch.cat([ang, ang], dim=-1)                                     # [T, hd]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x, cos, sin):
    # x [B, heads, T, hd]; cos/sin [T, hd]
    return x * cos + rotate_half(x) * sin


# Batched matmul used by attention (bench/torch_peer.py may swap it for a oneDNN-backed one).
MATMUL = torch.matmul


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.H, self.Hkv, self.hd, self.theta = H, Hkv, hd, cfg.rope_theta
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        H, Hkv, hd = self.H, self.Hkv, self.hd
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)      # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, Hkv, hd).transpose(1, 2)    # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, Hkv, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(T, hd, self.theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if Hkv != H:                                   # HF repeat_kv: head h <- kv head h // (H/Hkv)
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        att = MATMUL(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))  # [B, H, T, T]
        att = att.to(_compute_dtype(att))                                    # softmax in fp32
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1).to(v.dtype)
        y = MATMUL(att, v).transpose(1, 2).reshape(B, T, H * hd)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    """Dense FFN / shared experts with HF names gate_proj (w1), up_proj (w3), down_proj (w2)."""

    def __init__(self, D, F_):
        super().__init__()
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """Routed expert with HF Mixtral names: w2(silu(w1 x) * (w3 x))."""

    def __init__(self, D, F_):
        super().__init__()
        self.w1 = nn.Linear(D, F_, bias=False)
        self.w3 = nn.Linear(D, F_, bias=False)
        self.w2 = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """block_sparse_moe.gate: weight [E, D]; aux-loss-free bias as a (non-trainable) buffer."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.hidden_size))
        if cfg.aux_free:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))
        else:
            self.e_score_correction_bias = None


def topk_lowest_index_ties(scores, k):
    """Top-k along the last dim, picks in descending order, ties -> lower index (argmax returns the
    first maximal index, so k rounds of argmax + masking are exactly that rule)."""
    s = scores.clone()
    picks = []
    for _ in range(k):
        i = s.argmax(dim=-1, keepdim=True)
        picks.append(i)
        s.scatter_(-1, i, float("-inf"))
    return torch.cat(picks, dim=-1)


def group_limited_topk(scores, k, n_groups, topk_groups, group_rule):
    """scores [..., E] -> top-k expert ids [..., k] chosen only among the experts of the topk_groups
    best groups; group score = max ("max") or sum of the two largest ("top2") of its scores."""
    E = scores.shape[-1]
    g = scores.reshape(*scores.shape[:-1], n_groups, E // n_groups)        # [..., G, E/G]
    if group_rule == "top2":
        gs = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(dim=-1)          # [..., G]
    else:
        gs = g.max(dim=-1).values
    gsel = topk_lowest_index_ties(gs, topk_groups)                           # [..., Gk]
    gmask = torch.zeros_like(gs, dtype=torch.bool).scatter(-1, gsel, True)  # [..., G]
    emask = gmask.unsqueeze(-1).expand(g.shape).reshape(scores.shape)       # [..., E]
    return topk_lowest_index_ties(scores.masked_fill(~emask, float("-inf")), k), gs, emask


def capacity(cf, T, k, E):
    return int(math.ceil((cf * T * k) / E))


def capacity_keep_mask(sel, probs, cap, policy):
    """sel [B, T, k] expert ids, probs [B, T, E] -> bool keep [B, T, k] under the per-sequence,
    per-expert capacity `cap` (see the header for the orderings)."""
    B, T, k = sel.shape
    E = probs.shape[-1]
    flat = sel.reshape(B, T * k)
    keep = torch.ones(B, T * k, dtype=torch.bool, device=sel.device)
    for b in range(B):
        for e in range(E):
            idx = (flat[b] == e).nonzero().flatten()          # ascending assignment index t*k+j
            if idx.numel() <= cap:
                continue
            if policy == "probability":
                pr = probs[b, idx // k, e]
                idx = idx[torch.sort(-pr, stable=True).indices]  # highest prob first, ties: index
            keep[b, idx[cap:]] = False
    return keep.view(B, T, k)


def load_balance_loss(probs, sel, n_experts):
    """probs [B, T, E], sel [B, T, k] (selected BEFORE capacity drops) -> aux_{l,s} [B]."""
    B, T, k = sel.shape
    f = F.one_hot(sel, n_experts).sum(dim=(1, 2)).to(probs.dtype) / (T * k)  # [B, E], no grad
    P = probs.mean(dim=1)                                                     # [B, E]
    return n_experts * (f * P).sum(-1)


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList([Expert(cfg.hidden_size, cfg.moe_ffn_dim)
                                      for _ in range(cfg.n_experts)])
        self.impl = "gather"   # "gather" (per-expert gathered matmuls) | "dense" (checks only)

    def route(self, x):
        """x [B, T, D] -> dict of routing tensors (see the header)."""
        cfg = self.cfg
        B, T, _ = x.shape
        E, k = cfg.n_experts, cfg.top_k
        with torch.autocast("cpu", enabled=False):
            xr = x.to(_compute_dtype(x))
            logits = F.linear(xr, self.gate.weight.to(xr.dtype))        # [B, T, E], fp32
        sigmoid = cfg.router_score == "sigmoid"
        probs = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
        scores = probs.detach()
        if self.gate.e_score_correction_bias is not None:
            scores = scores + self.gate.e_score_correction_bias.to(scores.dtype)
        group_scores = allowed = None
        if cfg.n_groups > 1:
            sel, group_scores, allowed = group_limited_topk(scores, k, cfg.n_groups, cfg.topk_groups,
                                                            "top2" if sigmoid else "max")
        else:
            sel = topk_lowest_index_ties(scores, k)                   # [B, T, k]
        p_sel = probs.gather(-1, sel)
        weights = p_sel / p_sel.sum(dim=-1, keepdim=True)             # renormalised probs
        if cfg.routed_scale != 1.0:
            weights = weights * cfg.routed_scale
        # what the balancing loss averages: the probs, or (sigmoid) the scores normalised per token
        aux_probs = probs / probs.sum(dim=-1, keepdim=True) if sigmoid else probs
        if cfg.capacity_factor > 0:
            keep = capacity_keep_mask(sel, probs.detach(), capacity(cfg.capacity_factor, T, k, E),
                                      cfg.drop_policy)
            weights = weights * keep.to(weights.dtype)
        else:
            keep = torch.ones_like(sel, dtype=torch.bool)
        return dict(logits=logits, probs=probs, aux_probs=aux_probs, scores=scores, sel=sel, keep=keep,
                    weights=weights, group_scores=group_scores, allowed=allowed,
                    load=torch.bincount(sel.flatten(), minlength=E),   # before drops, whole batch
                    dropped=int((~keep).sum()))

    def forward(self, x):
        B, T, D = x.shape
        r = self.route(x)
        k = self.cfg.top_k
        xf = x.reshape(B * T, D)
        sel = r["sel"].reshape(-1)          # [N*k], assignment a = token*k + slot
        w = r["weights"].reshape(-1)
        keep = r["keep"].reshape(-1)
        if self.impl == "dense":            # every expert on every token, masked combine
            comb = torch.zeros(B * T, self.cfg.n_experts, dtype=w.dtype, device=x.device)
            comb = comb.index_put((torch.arange(B * T).repeat_interleave(k), sel), w * keep,
                                  accumulate=True)
            out = sum(comb[:, e:e + 1] * ex(xf).to(comb.dtype) for e, ex in enumerate(self.experts))
            return out.to(x.dtype).view(B, T, D), r
        # gather: sort kept assignments by expert, one matmul chain per expert, one index_add back
        a = keep.nonzero().flatten()
        ea = sel[a]
        srt = torch.sort(ea, stable=True)
        a = a[srt.indices]
        counts = torch.bincount(srt.values, minlength=self.cfg.n_experts).tolist()
        tok = a // k
        xs = xf.index_select(0, tok).split(counts)     # one gather, one contiguous chunk per expert
        ys = [self.experts[e](xs[e]) for e in range(len(counts)) if counts[e] > 0]
        out = torch.zeros(B * T, D, dtype=w.dtype, device=x.device)
        if ys:
            y = torch.cat(ys, 0).to(w.dtype) * w[a].unsqueeze(1)
            out = out.index_add(0, tok, y)
        return out.to(x.dtype).view(B, T, D), r


class SharedExperts(nn.Module):
    """Container so the shared MLP lands at mlp.shared_experts.* (DeepSeek/Qwen-MoE names)."""

    def __init__(self, cfg):
        super().__init__()
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_ffn_dim)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, l):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(l)
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(cfg)
            if cfg.n_shared_experts > 0:
                self.mlp = SharedExperts(cfg)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.dense_ffn_dim)

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        n = self.post_attention_layernorm(h)
        if not self.is_moe:
            return h + self.mlp(n), None
        y, r = self.block_sparse_moe(n)
        if hasattr(self, "mlp"):
            y = y + self.mlp.shared_experts(n)
        return h + y, r


class Backbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, l) for l in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TeraModel(nn.Module):
    """state_dict() keys are exactly the Hugging Face checkpoint names of MODEL.md."""

    def __init__(self, cfg):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def set_moe_impl(self, impl):
        for layer in self.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.impl = impl

    def init_weights(self, generator):
        """normal(0, std) for every matrix; o_proj / w2 / down_proj with std/sqrt(2L); norms 1."""
        std = self.cfg.init_std
        small = std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    s = small if name.endswith(("o_proj.weight", "w2.weight",
                                                "down_proj.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * s)
                else:
                    p.fill_(1.0)
            for b in self.biases().values():
                b.zero_()

    def biases(self):
        """{layer index: e_score_correction_bias buffer} for MoE layers (empty when aux_free off)."""
        return {l: layer.block_sparse_moe.gate.e_score_correction_bias
                for l, layer in enumerate(self.model.layers)
                if layer.is_moe and layer.block_sparse_moe.gate.e_score_correction_bias is not None}

    def forward(self, inputs, targets=None):
        """inputs, targets [B, T] int64. Returns a dict with logits [B, T, V] and, given targets,
        loss, ce, aux, z and per-MoE-layer routing records."""
        cfg = self.cfg
        x = self.model.embed_tokens(inputs)
        routes = {}
        for l, layer in enumerate(self.model.layers):
            x, r = layer(x)
            if r is not None:
                routes[l] = r
        logits = self.lm_head(self.model.norm(x))
        out = dict(logits=logits, routes=routes)
        if targets is None:
            return out
        V = logits.shape[-1]
        lg = logits.to(_compute_dtype(logits))
        ce = F.cross_entropy(lg.reshape(-1, V), targets.reshape(-1))
        if routes:
            aux = torch.stack([load_balance_loss(r["aux_probs"], r["sel"], cfg.n_experts)
                               for r in routes.values()]).mean()
            z = torch.stack([torch.logsumexp(r["logits"], dim=-1).pow(2).mean()
                             for r in routes.values()]).mean()
        else:
            aux = z = torch.zeros((), dtype=lg.dtype)
        out.update(ce=ce, aux=aux, z=z, loss=ce + cfg.aux_coef * aux + cfg.z_coef * z)
        return out


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------
@dataclass
class TrainHP:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 2
    total_steps: int = 5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def as_strings(self):
        return {k: repr(v) if isinstance(v, float) else str(v) for k, v in asdict(self).items()}


def lr_at(hp, s):
    if s < hp.warmup_steps:
        return hp.lr * (s + 1) / hp.warmup_steps
    if hp.total_steps <= hp.warmup_steps:
        return hp.min_lr
    prog = (s - hp.warmup_steps) / (hp.total_steps - hp.warmup_steps)
    return hp.min_lr + 0.5 * (hp.lr - hp.min_lr) * (1.0 + math.cos(math.pi * prog))


def make_optimizer(model, hp):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps)


def clip_global_norm(params, c):
    """Returns the norm before clipping; scales every gradient by c/(n+1e-6) when n > c."""
    grads = [p.grad for p in params if p.grad is not None]
    n = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    if c > 0 and n > c:
        scale = c / (n + 1e-6)
        for g in grads:
            g.mul_(scale)
    return n


def aux_free_update(model, routes):
    """bias_e += rate * sign(B*T*k/E - load_e), per MoE layer, from this step's routing."""
    cfg = model.cfg
    with torch.no_grad():
        for l, bias in model.biases().items():
            r = routes[l]
            B, T, k = r["sel"].shape
            mean = B * T * k / cfg.n_experts
            load = r["load"].to(torch.float64)
            bias.add_((cfg.aux_free_rate * torch.sign(mean - load)).to(bias.dtype))


def sample_batch(stream, s, B, T):
    """Samples [s*B, (s+1)*B) of the stream; sample i = stream[i*T : i*T+T+1]."""
    rows = [stream[i * T: i * T + T + 1] for i in range(s * B, (s + 1) * B)]
    x = torch.stack(rows).long()
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def train(model, hp, stream, B, T, steps, log=None, on_step=None):
    """Full steps: forward, backward, clip, AdamW (lr per step), aux-free bias update."""
    opt = make_optimizer(model, hp)
    params = list(model.parameters())
    hist = dict(losses=[], grad_norms=[], lrs=[], clipped=[], dropped=[])
    for s in range(steps):
        inputs, targets = sample_batch(stream, s, B, T)
        opt.zero_grad(set_to_none=True)
        out = model(inputs, targets)
        out["loss"].backward()
        for p in params:   # an expert no token reached has gradient 0 (AdamW still decays it and
            if p.grad is None:   # moves it by its moments), not None (torch would skip it)
                p.grad = torch.zeros_like(p)
        if on_step:
            on_step(s, out)
        n = clip_global_norm(params, hp.grad_clip)
        lr = lr_at(hp, s)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        aux_free_update(model, out["routes"])
        hist["losses"].append(float(out["loss"]))
        hist["grad_norms"].append(n)
        hist["lrs"].append(lr)
        hist["clipped"].append(hp.grad_clip > 0 and n > hp.grad_clip)
        hist["dropped"].append(sum(r["dropped"] for r in out["routes"].values()))
        if log:
            log(f"step {s}: loss {hist['losses'][-1]:.6f} norm {n:.6f} lr {lr:.6g} "
                f"clipped {hist['clipped'][-1]} dropped {hist['dropped'][-1]}")
    return hist


# --------------------------------------------------------------------------------------------------
# safetensors (hand-written; no dependency on the safetensors package)
# --------------------------------------------------------------------------------------------------
_DT = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "F16": np.float16,
       "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16}


def _np_dtype_name(a):
    for k, v in _DT.items():
        if a.dtype == np.dtype(v):
            return k
    raise ValueError(f"unsupported dtype {a.dtype}")


def save_safetensors(path, tensors, metadata=None):
    """tensors: ordered {name: torch tensor or numpy array}. Data contiguous in header order, no
    gaps. The JSON header is padded with spaces to a multiple of 8 bytes (as the safetensors
    library does)."""
    header = {"__metadata__": {"format": "pt", **(metadata or {})}}
    blobs, off = [], 0
    for name, t in tensors.items():
        a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        a = np.ascontiguousarray(a)
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _np_dtype_name(a), "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    """-> ({name: torch tensor}, metadata dict)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        b0, b1 = info["data_offsets"]
        a = np.frombuffer(data[base + b0: base + b1], dtype=np.dtype(_DT[info["dtype"]]).newbyteorder("<"))
        out[name] = torch.from_numpy(a.reshape(info["shape"]).copy())
    return out, meta


def model_state(model):
    """Trainable tensors + aux-free biases, HF names, in a stable order."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def load_model(directory):
    """Build a TeraModel from <dir>/config.json + <dir>/model.safetensors."""
    with open(f"{directory}/config.json") as f:
        cfg = Config.from_hf(json.load(f))
    model = TeraModel(cfg)
    tensors, _ = load_safetensors(f"{directory}/model.safetensors")
    model.load_state_dict(tensors, strict=True)
    return model


if __name__ == "__main__":
    # Usage: tera_ref.py <model dir> <fixture.safetensors>: loss of a checkpoint on a fixture batch.
    import sys
    m = load_model(sys.argv[1])
    fx, _ = load_safetensors(sys.argv[2])
    with torch.no_grad():
        o = m(fx["inputs"].long(), fx["targets"].long())
    print(json.dumps({k: float(o[k]) for k in ("loss", "ce", "aux", "z")}))
