"""Packed attention with grouped K/V heads: passed to the kernel as they are, or repeated per query head.

    python benchmarks/varlen_gqa.py --out benchmarks/results/varlen_gqa.json      # one GPU, ~20 s

torch's flash varlen kernel (torch.nn.attention.varlen.varlen_attn, what the Trainer's packed rows
run on CUDA) reads a K/V head once for every query head of its group. Repeating K/V per query head
first (what a kernel without grouped heads needs) writes and reads the copies and sums their
gradients back. For Qwen3-0.6B (16 query heads, 8 K/V) and 4B (32 and 8), head_dim 128, one
micro-batch of the launch's default plan (32,768 and 16,384 tokens) packed from rollouts of
--length tokens: the median forward + backward of one layer's attention each way (CUDA events, after
two warm-ups), that times the model's layers, and how far the two ways' outputs and gradients differ.
Hardware: one CUDA GPU with torch >= 2.10.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics

import torch
from torch.nn.attention.varlen import varlen_attn

SHAPES = {"qwen3-0.6b": (16, 8, 28, 32768), "qwen3-4b": (32, 8, 36, 16384)}   # heads, K/V heads, layers, tokens
GQA = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}


def attention(q, k, v, cu, max_len, repeat: bool):
    if repeat:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), **({} if repeat else GQA))


def run(shape: str, length: int, repeat: int) -> dict:
    heads, kv_heads, layers, tokens = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device="cuda")
    if cu[-1] != tokens:
        cu = torch.cat([cu, cu.new_tensor([tokens])])
    grad = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    out, times = {}, {}
    for way in ("shared", "repeated"):
        def step():
            q.grad = k.grad = v.grad = None
            o = attention(q, k, v, cu, length, way == "repeated")
            o.backward(grad)
            return o
        for _ in range(2):
            step()
        ms = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            o = step()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        times[way] = statistics.median(ms)
        out[way] = [o.detach().float(), *(x.grad.float() for x in (q, k, v))]
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(out["shared"], out["repeated"]))
    return {"shape": shape, "tokens": tokens, "rollout_tokens": length, "layers": layers,
            "ms_per_layer": times, "s_per_micro_batch": {w: t * layers / 1e3 for w, t in times.items()},
            "speedup": times["repeated"] / times["shared"], "max_rel_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b")
    p.add_argument("--length", type=int, default=320, help="tokens a rollout (prompt + completion)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()
    rows = [run(s, a.length, a.repeat) for s in a.shapes.split(",")]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "enable_gqa_param": bool(GQA),
           "rows": rows}
    for r in rows:
        print(f"{r['shape']}: {r['tokens']} tokens in rollouts of {r['rollout_tokens']}: one layer fwd+bwd "
              f"{r['ms_per_layer']['shared']:.3f} ms shared K/V vs {r['ms_per_layer']['repeated']:.3f} ms "
              f"repeated ({r['speedup']:.2f}x); x{r['layers']} layers: {r['s_per_micro_batch']['shared']:.3f} vs "
              f"{r['s_per_micro_batch']['repeated']:.3f} s; max rel diff {r['max_rel_diff']:.2e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
