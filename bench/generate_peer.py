#!/usr/bin/env python3
"""The Hugging Face transformers peer of `tera generate` and `tera eval --task` (docs/GENERATE.md).

  generate_peer.py generate HF_DIR TERA_JSONL TERA_LOGITS [--max-new-tokens N] [--rtol R]
      For every prompt of `tera generate --json --logits FILE` output (its prompt_ids), runs
      MixtralForCausalLM.generate greedily in fp32, with and without its KV cache, and checks that
      the new tokens equal tera's token for token and that every step's logits agree with tera's
      to rtol relative to the row's largest magnitude. Prints one JSON line; exit 1 on a mismatch.
  generate_peer.py task HF_DIR TASK_JSONL TERA_SCORES [--tokenizer DIR|bytes] [--rtol R]
      Scores every choice of a task file as `tera eval --task` does (context and choice encoded
      separately, summed log-likelihood of the choice's tokens; per byte of its text) and compares
      with tera's --scores file. Prints one JSON line with both accuracies; exit 1 on a mismatch.
  generate_peer.py bench HF_DIR --batch B --prompt-len P --new N [--threads T]
      Greedy KV-cache decoding speed: new tokens per second over the decode steps (prefill timed
      apart), one JSON line.
"""
import argparse
import json
import sys
import time

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

transformers.logging.set_verbosity_error()  # 4.44 warns about its own legacy cache format


def load(hf_dir):
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # tera stops at <|endoftext|> only when the tokenizer has one
    model.generation_config.pad_token_id = 0
    return model


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def cmd_generate(a):
    model = load(a.hf_dir)
    V = model.config.vocab_size
    rows = [json.loads(l) for l in open(a.tera_jsonl) if l.strip()]
    lg = np.fromfile(a.tera_logits, dtype=np.float32).reshape(-1, V)
    off, worst, bad, steps = 0, 0.0, [], 0
    for r in rows:
        n = len(r["tokens"])
        tera_logits = lg[off:off + n]
        off += n
        ids = torch.tensor([r["prompt_ids"]], dtype=torch.long)
        for cache in (True, False):
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False, use_cache=cache,
                                     output_logits=True, return_dict_in_generate=True)
            new = out.sequences[0, ids.shape[1]:].tolist()
            if new != r["tokens"]:
                k = next((i for i, (x, y) in enumerate(zip(new, r["tokens"])) if x != y), min(len(new), n))
                bad.append(f"prompt {r['prompt_index']} (cache={cache}): tokens differ from step {k}")
            for s, hl in enumerate(out.logits[:n]):
                e = rel_err(tera_logits[s], hl[0].numpy())
                worst = max(worst, e)
                steps += 1
                if e > a.rtol:
                    bad.append(f"prompt {r['prompt_index']} (cache={cache}) step {s}: logits differ by {e:.3g}")
    print(json.dumps({"prompts": len(rows), "steps_compared": steps, "worst_logit_rel_diff": worst,
                      "tokens_equal": not any("tokens" in b for b in bad), "ok": not bad}))
    for b in bad[:10]:
        print(b, file=sys.stderr)
    return 0 if not bad else 1


def encoder(tok):
    if tok == "bytes":
        return lambda s: list(s.encode("utf-8"))
    from transformers import GPT2Tokenizer
    t = GPT2Tokenizer(vocab_file=f"{tok}/encoder.json", merges_file=f"{tok}/vocab.bpe")
    return lambda s: t.encode(s)


def cmd_task(a):
    model = load(a.hf_dir)
    enc = encoder(a.tokenizer)
    tera = [json.loads(l) for l in open(a.tera_scores) if l.strip()]
    items = [json.loads(l) for l in open(a.task) if l.strip()]
    worst, bad, acc, acc_norm = 0.0, [], 0, 0
    for it, tr in zip(items, tera):
        ctx = enc(it["context"])
        ll = []
        for ch in it["choices"]:
            c = enc(ch)
            ids = torch.tensor([ctx + c], dtype=torch.long)
            with torch.no_grad():
                logits = model(ids).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            ll.append(float(sum(lp[len(ctx) - 1 + j, t] for j, t in enumerate(c))))
        lln = [s / len(ch.encode("utf-8")) for s, ch in zip(ll, it["choices"])]
        for x, y in zip(tr["loglik"], ll):
            e = abs(x - y) / max(abs(y), 1e-30)
            worst = max(worst, e)
            if e > a.rtol:
                bad.append(f"line {tr['line']}: log-likelihood {x} vs transformers {y}")
        pred, pred_norm = int(np.argmax(ll)), int(np.argmax(lln))
        acc += pred == it["label"]
        acc_norm += pred_norm == it["label"]
        if pred != tr["pred"] or pred_norm != tr["pred_norm"]:
            bad.append(f"line {tr['line']}: prediction ({tr['pred']}, {tr['pred_norm']}) vs ({pred}, {pred_norm})")
    if len(items) != len(tera):
        bad.append(f"{len(items)} items in the task, {len(tera)} scored by tera")
    n = max(len(items), 1)
    print(json.dumps({"items": len(items), "acc": acc / n, "acc_norm": acc_norm / n, "worst_loglik_rel_diff": worst,
                      "ok": not bad}))
    for b in bad[:10]:
        print(b, file=sys.stderr)
    return 0 if not bad else 1


def cmd_bench(a):
    torch.set_num_threads(a.threads)
    model = load(a.hf_dir)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (a.batch, a.prompt_len), generator=g)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model(ids)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
        t = time.perf_counter() - t0
    new = (out.shape[1] - a.prompt_len) * a.batch
    dec = max(t - t_prefill, 1e-9)  # generate's time less one prefill forward
    print(json.dumps({"peer": "transformers", "batch": a.batch, "threads": a.threads, "new_tokens": new,
                      "seconds": t, "decode_tokens_per_s": new / dec, "tokens_per_s_incl_prefill": new / t}))
    return 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("hf_dir"), g.add_argument("tera_jsonl"), g.add_argument("tera_logits")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--rtol", type=float, default=1e-4)
    t = sub.add_parser("task")
    t.add_argument("hf_dir"), t.add_argument("task"), t.add_argument("tera_scores")
    t.add_argument("--tokenizer", default="bytes")
    t.add_argument("--rtol", type=float, default=1e-4)
    b = sub.add_parser("bench")
    b.add_argument("hf_dir")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--prompt-len", type=int, default=16)
    b.add_argument("--new", type=int, default=64)
    b.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.manual_seed(0)
    return {"generate": cmd_generate, "task": cmd_task, "bench": cmd_bench}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
