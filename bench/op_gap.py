#!/usr/bin/env python3
"""Per-operation gap of a training step against each operation's own limit (issue 19,
docs/PERFORMANCE.md "Per-operation gap").

Reads one `tera bench` run (its stderr: the per-operation profile; its stdout: the JSON line with
sgemm_peak_gflops and bf16_peak_gflops), the configuration it ran, and the memory bandwidth of a
triad (bench/bench_fused, the best repetition: triad_nd_best_gbs over activation-sized arrays,
triad_logits_best_gbs over logit-sized ones, triad_dram_best_gbs over 768 MiB for the optimizer). For
every operation of the profile: its share of the step, the work it must do (model FLOPs for the
products, BENCH.md's counting; compulsory bytes for the element-wise passes and the optimizer, each
array read or written once), the rate achieved, and that rate against its limit: the same run's
GEMM peak (fp32 sgemm peak, or the bf16 product peak for bf16 runs on the native units) for the
products, the triad bandwidth for the rest. Prints a markdown table.

Usage: op_gap.py CONFIG.ini BENCH_STDERR BENCH_JSON FUSED_JSON [PARAM_GBS]
  PARAM_GBS: the parameter-sized triad to use for the optimizer instead of FUSED_JSON's (a quieter
  measurement, e.g. bench_optim's triad_gbs), when the DRAM triad of the run caught other jobs.
"""
import configparser
import json
import re
import sys


def cfg_of(path):
    p = configparser.ConfigParser(inline_comment_prefixes=("#", ";"))
    p.read(path)
    m, t = p["model"], p["training"]
    g = lambda s, k, d: int(s.get(k, d))
    c = dict(V=g(m, "vocab_size", 0), D=g(m, "dim", 0), L=g(m, "n_layers", 0), H=g(m, "n_heads", 0),
             E=g(m, "n_experts", 0), k=g(m, "top_k", 0), F=g(m, "ffn_dim", 0), T=g(t, "seq_len", 0),
             B=g(t, "micro_batch", 0))
    c["Hkv"] = g(m, "n_kv_heads", c["H"]) or c["H"]
    if g(m, "first_k_dense", 0) or g(m, "n_shared_experts", 0):
        raise SystemExit("op_gap: counts routed-expert layers only (no dense or shared FFN)")
    return c


def profile_of(path):
    ops = {}
    for line in open(path):
        mt = re.match(r"^\s{2}(\S.*?)\s{2,}([0-9.]+)\s+([0-9.]+)%$", line.rstrip())
        if mt and mt.group(1) != "operation":
            ops[mt.group(1)] = float(mt.group(2))
    return ops


def json_of(path):
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"op_gap: no JSON line in {path}")


def main():
    if len(sys.argv) not in (5, 6):
        raise SystemExit(__doc__)
    c = cfg_of(sys.argv[1])
    ops = profile_of(sys.argv[2])
    run, fused = json_of(sys.argv[3]), json_of(sys.argv[4])
    V, D, L, H, Hkv, E, k, F, T, B = (c[x] for x in ("V", "D", "L", "H", "Hkv", "E", "k", "F", "T", "B"))
    hd, N = D // H, B * T
    R = N * k  # routed rows
    bf16_native = run.get("precision") == "bf16" and run.get("bf16_gemm") == "native"
    gemm_peak = run["bf16_peak_gflops"] if bf16_native and run.get("bf16_peak_gflops") else run["sgemm_peak_gflops"]
    peak_name = "bf16 product peak" if bf16_native else "sgemm peak"
    bw_nd, bw_logits, bw_params = fused["triad_nd_best_gbs"], fused["triad_logits_best_gbs"], fused["triad_dram_best_gbs"]
    params = fused["params"]
    if len(sys.argv) == 6:
        bw_params = float(sys.argv[5])
    qkv = 2 * N * D * (H + 2 * Hkv) * hd
    # (profile name, kind, work per step: FLOP or bytes, bandwidth for bytes)
    rows = [
        ("expert ffn fwd", "gemm", L * 3 * 2 * R * D * F, None),
        ("expert ffn bwd", "gemm", 2 * L * 3 * 2 * R * D * F, None),
        ("qkv proj fwd", "gemm", L * qkv, None),
        ("qkv proj bwd", "gemm", 2 * L * qkv, None),
        ("o proj fwd", "gemm", L * 2 * N * D * D, None),
        ("o proj bwd", "gemm", 2 * L * 2 * N * D * D, None),
        ("lm head fwd", "gemm", 2 * N * D * V, None),
        ("lm head bwd", "gemm", 2 * 2 * N * D * V, None),
        # BENCH.md counts attention as full T x T (12 L D T per token over fwd + bwd); the causal work is half
        ("attention fwd", "gemm", 4 * N * T * D * L, None),
        ("attention bwd", "gemm", 8 * N * T * D * L, None),
        ("router fwd", "gemm", L * 2 * N * D * E, None),
        ("router bwd", "gemm", L * 2 * 2 * N * D * E, None),
        # element-wise: compulsory bytes (fp32)
        ("rmsnorm fwd", "mem", (2 * L + 1) * 8 * N * D + L * 4 * N * D, bw_nd),  # + the residual copy (fused)
        ("rmsnorm bwd", "mem", (2 * L + 1) * 16 * N * D, bw_nd),
        ("rope fwd", "mem", L * 8 * N * (H + Hkv) * hd, bw_nd),
        ("rope bwd", "mem", L * 8 * N * (H + Hkv) * hd, bw_nd),
        # fused (tera_ce_fused, no backward time): reads the logits, writes dlogits; separate: the
        # forward reads them (its second pass finds the row in cache), the backward reads and writes
        ("cross-entropy fwd", "mem", (4 if ops.get("cross-entropy bwd", 0) > 0 else 8) * N * V, bw_logits),
        ("cross-entropy bwd", "mem", 8 * N * V if ops.get("cross-entropy bwd", 0) > 0 else 0, bw_logits),
        ("dispatch/gather", "mem", L * 8 * R * D, bw_nd),  # routed rows copied
        ("combine fwd", "mem", L * (4 * R * D + 8 * N * D), bw_nd),
        ("combine bwd", "mem", L * (12 * R * D + 12 * N * D), bw_nd),
        ("embedding fwd", "mem", 8 * N * D, bw_nd),
        ("embedding bwd", "mem", 8 * N * D, bw_nd),
        ("optimizer", "mem", 36 * params, bw_params),
    ]
    total = sum(ops.values())
    print(f"{run.get('config')} {run.get('precision')} ({run.get('bf16_gemm')}), {run.get('threads')} threads: "
          f"{run['tokens_per_s']:.0f} tokens/s, step {run['step_ms_median']:.0f} ms (ops {total:.0f} ms), "
          f"{peak_name} {gemm_peak:.1f} GFLOP/s, triad {bw_nd:.1f} GB/s (activations) / "
          f"{bw_logits:.1f} (logits) / {bw_params:.1f} (parameters)")
    print()
    print("| operation | ms/step | share | work/step | achieved | limit | of limit |")
    print("|---|---|---|---|---|---|---|")
    seen = set()
    for name, kind, work, bw in rows:
        if name not in ops:
            continue
        seen.add(name)
        ms = ops[name]
        share = 100.0 * ms / total if total else 0.0
        if kind == "gemm":
            rate = work / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
            lim = gemm_peak if name not in ("router fwd", "router bwd") else run["sgemm_peak_gflops"]
            print(f"| {name} | {ms:.1f} | {share:.1f}% | {work / 1e9:.2f} GFLOP | {rate:.1f} GFLOP/s | "
                  f"{lim:.1f} GFLOP/s | {100 * rate / lim:.0f}% |")
        else:
            if work == 0:
                print(f"| {name} | {ms:.1f} | {share:.1f}% | 0 (in the forward's pass) | - | - | - |")
                continue
            rate = work / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
            print(f"| {name} | {ms:.1f} | {share:.1f}% | {work / 2**20:.0f} MiB | {rate:.1f} GB/s | "
                  f"{bw:.1f} GB/s | {100 * rate / bw:.0f}% |")
    for name, ms in sorted(ops.items(), key=lambda x: -x[1]):
        if name not in seen and ms > 0.05:
            print(f"| {name} | {ms:.1f} | {100.0 * ms / total:.1f}% | - | - | - | - |")


if __name__ == "__main__":
    main()
