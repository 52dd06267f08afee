"""Benchmark: one decode step's random sampling when every request carries its own seed.

minirl seeds every turn (reproducible runs), and vLLM 0.22's V1 sampler then draws each seeded
row's noise with its own torch.Generator, one kernel launch per request per step
(`random_sample` in vllm/v1/sample/ops/topk_topp_sampler.py). This times, on (rows, vocabulary)
fp32 probabilities: that loop; one unseeded draw for the whole batch (what unseeded requests get);
and vLLM's batched Gumbel-max kernel with per-request seeds and positions (the V2 model runner's
`gumbel_sample`, when vLLM with Triton is importable). Medians of --repeats, after a warm-up.

    python benchmarks/sampler.py --out $OUT/sampler_h200.json      # one CUDA GPU (vLLM optional)
    python benchmarks/sampler.py --rows 8 --vocab 1000 --repeats 2 # CPU smoke test

Hardware: a CUDA GPU for the figures (an H200 in benchmarks/results); CPU runs the two torch paths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    import torch
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    try:
        from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
    except Exception:                       # no vLLM, or no Triton (CPU)
        gumbel_sample = None
    doc = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "vocab": args.vocab, "rows": {}}
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device=dev)
        gens = {i: torch.Generator(device=dev).manual_seed(1000 + i) for i in range(rows)}

        def per_request():                  # vLLM 0.22 random_sample with a generator per row
            probs = logits.softmax(-1)
            q = torch.empty_like(probs)
            for i, g in gens.items():
                q[i].exponential_(generator=g)
            return probs.div_(q).argmax(-1)

        def batched():                      # the same without seeds: one draw for all rows
            probs = logits.softmax(-1)
            return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)

        r = {"per_request_generators_ms": 1e3 * timed(per_request, args.repeats, sync),
             "one_unseeded_draw_ms": 1e3 * timed(batched, args.repeats, sync)}
        if gumbel_sample is not None and dev == "cuda":
            idx = torch.arange(rows, device=dev, dtype=torch.int32)
            temp = torch.ones(rows, device=dev)
            seeds = torch.arange(1000, 1000 + rows, device=dev, dtype=torch.int64)
            pos = torch.full((rows,), 100, device=dev, dtype=torch.int64)
            r["vllm_gumbel_seeded_ms"] = 1e3 * timed(
                lambda: gumbel_sample(logits, idx, temp, seeds, pos, apply_temperature=False), args.repeats, sync)
        doc["rows"][rows] = r
        print(rows, {k: round(v, 3) for k, v in r.items()}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
