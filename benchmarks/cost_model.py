"""Cost model: the async / co-located throughput ratio at N GPUs, from per-GPU rates measured on two.

    python benchmarks/cost_model.py benchmarks/results/longtail_qwen3-0.6b_2gpu.json --gpus 8 64
    python benchmarks/cost_model.py benchmarks/results/longtail_qwen3-0.6b_1gpu.json --gpus 8 64 --efficiency 0.9
    python benchmarks/cost_model.py --gen 9000 --train 4000 --colocated 2600 --efficiency 0.9

Inputs (trained tokens/s per GPU): gen = one GPU generating alone, train = one GPU training alone,
colocated = the co-located run's rate divided by its GPUs; efficiency = the measured async rate over
its ideal min(k * gen, (N - k) * train) on the measured split. Model: co-located scales linearly
(N * colocated: every GPU alternates generation and training, so its rate already pays both and the
switch); async with k generating GPUs runs at efficiency * min(k * gen, (N - k) * train), best k.
From a run on one shared device (--gpus 1, or the CPU) the async rate measures two pools competing for
the same SMs, not separate pools: efficiency is then 1 (the bound) unless --efficiency gives one.
Departures, stated: data-parallel training is taken as linear in GPUs (its all-reduce is not
modelled), and one async trainer group / k independent engines. Hardware: none (arithmetic).
"""

from __future__ import annotations

import argparse
import json


def best_split(n: int, gen: float, train: float, efficiency: float = 1.0) -> tuple[int, float]:
    """(k generating GPUs, async tokens/s) maximising efficiency * min(k * gen, (n - k) * train), 1 <= k < n."""
    return max(((k, efficiency * min(k * gen, (n - k) * train)) for k in range(1, n)), key=lambda kv: kv[1])


def predict(n: int, gen: float, train: float, colocated: float, efficiency: float) -> dict:
    k, rate = best_split(n, gen, train, efficiency)
    return {"gpus": n, "gen_gpus": k, "train_gpus": n - k, "async_tokens_per_s": rate,
            "colocated_tokens_per_s": n * colocated, "ratio": rate / (n * colocated)}


def shared_device(doc: dict) -> bool:
    """Generator and trainer of the measured async run shared one device (--gpus 1, or the CPU)."""
    return doc["settings"]["gpus"] < 2


def from_measurement(doc: dict) -> dict:
    """gen, train, colocated (per GPU) and efficiency out of benchmarks/async_longtail.py's JSON."""
    P, s = doc["parts"], doc["settings"]
    need = ["gen_alone", "train_alone", "colocated"] + ([] if shared_device(doc) else ["async"])
    if missing := [k for k in need if "error" in P.get(k, {"error": 1})]:
        raise SystemExit(f"the measurement lacks {', '.join(missing)} (not run, or failed): run "
                         "benchmarks/async_longtail.py with those --parts (--merge keeps the others)")
    gen, train = P["gen_alone"]["tokens_per_s"], P["train_alone"]["tokens_per_s"]
    ranks = P["colocated"].get("ranks", max(s["gpus"], 1))
    rates = {"gen": gen, "train": train, "colocated": P["colocated"]["trained_tokens_per_s"] / ranks}
    if shared_device(doc):
        return {**rates, "efficiency": 1.0}
    k, n = s["gen_gpus"], s["gpus"]
    return {**rates, "efficiency": P["async"]["trained_tokens_per_s"] / min(k * gen, (n - k) * train)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measured", nargs="?", help="benchmarks/async_longtail.py JSON (else give the rates)")
    p.add_argument("--gen", type=float)
    p.add_argument("--train", type=float)
    p.add_argument("--colocated", type=float, help="co-located trained tokens/s per GPU")
    p.add_argument("--efficiency", type=float, default=None, help="async / its ideal (default: measured, else 1)")
    p.add_argument("--gpus", type=int, nargs="+", default=[2, 8, 64])
    args = p.parse_args(argv)
    doc = json.load(open(args.measured)) if args.measured else None
    rates = from_measurement(doc) if doc else {"gen": args.gen, "train": args.train, "colocated": args.colocated,
                                               "efficiency": 1.0}
    if args.efficiency is not None:
        rates["efficiency"] = args.efficiency
    rows = [predict(n, **rates) for n in args.gpus]
    print(json.dumps({"rates": rates, "predictions": rows}, indent=1))
    if doc and shared_device(doc):
        print(f"\nMeasured on one shared device: efficiency {rates['efficiency']:g} "
              f"({'given' if args.efficiency is not None else 'the bound; a run on two GPUs measures it'}).")
    print("\n| GPUs | gen:train | async tok/s | co-located tok/s | async / co-located |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['gen_gpus']}:{r['train_gpus']} | {r['async_tokens_per_s']:.0f} | "
              f"{r['colocated_tokens_per_s']:.0f} | {r['ratio']:.2f}x |")
    return rows


if __name__ == "__main__":
    main()
