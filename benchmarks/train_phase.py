"""Benchmark: the training phase alone (Trainer.forward_backward + optim_step) at a real shape, for
several trainer settings in one process, on a fixed batch of rollouts the shape of a GRPO step's
(P prompts x G samples, prompt and completion lengths as given, every completion token scored).

Variants (comma-separated --variants, each "default" or flags joined by "+"): "default"
(TrainerConfig's defaults with 16,384-token micro-batches: no memory plan runs here), "mb8k" /
"mb32k" / "mb64k" (micro_batch_tokens), "budgetNN" (activation_memory_budget NN / 100, CUDA),
"keep" (FSDP2 keeps each layer's gathered weights from forward to backward:
reshard_after_forward=False), "pinned" (micro-batches copied host -> device from pinned memory
without a stream synchronisation). Each variant: its own Trainer, one warm-up step, then --steps
measured steps; the median step split into forward_backward and optim_step, trained tokens/s, MFU
(6 N tokens / seconds / 989.4 TFLOP/s) and the device's peak allocated memory. --profile DIR
profiles the first variant's last step (DIR/train_<variant>.txt: top kernels, device-busy share of
the wall time).

    python benchmarks/train_phase.py --shape qwen3-0.6b --completion 1024 --variants default,mb32k,keep,pinned

Hardware: one CUDA GPU (an H200 for the figures in benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PEAK_FLOPS = 989.4e12


def rollouts(n: int, prompt: int, completion: int, vocab: int, seed: int = 0, advantage: float = 0.5):
    import random

    from minirl.data import Rollout
    rng = random.Random(seed)
    # prompt ids 2..63: the characters. Not 0, the pad token, whose embedding row a random init
    # zeroes: a sequence that starts with it keeps an all-zero hidden state through every layer,
    # and RMSNorm's backward at zero multiplies the gradient by 1/sqrt(eps) per norm (inf, then NaN).
    return [Rollout(prompt_ids=[rng.randrange(2, 64) for _ in range(prompt)],
                    completion_ids=[rng.randrange(vocab) for _ in range(completion)],
                    sampling_logprobs=[-12.0] * completion, reward=float(i % 2),
                    advantage=advantage * (2 * (i % 2) - 1))
            for i in range(n)]


def variant(name: str, model: str, batch, args) -> dict:
    import torch
    import torch.distributed.fsdp as fsdp

    from minirl.core import ppo_loss_fn
    from minirl.data import _Tensors
    from minirl.trainer import Trainer, TrainerConfig

    torch._dynamo.reset()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    flags = set(name.split("+"))
    kw = {"micro_batch_tokens": 65536 if "mb64k" in flags else 32768 if "mb32k" in flags
          else 8192 if "mb8k" in flags else 16384}
    for f in flags:
        if f.startswith("budget"):
            kw["activation_memory_budget"] = int(f[6:]) / 100
    shard, to = fsdp.fully_shard, _Tensors.to
    if "keep" in flags:
        fsdp.fully_shard = lambda m, **k: shard(m, reshard_after_forward=False, **k)
    if "pinned" in flags:
        def pinned_to(self, device):
            from dataclasses import fields, replace
            pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)
            return replace(self, **{f.name: pin(getattr(self, f.name)).to(device, non_blocking=True)
                                    for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})
        _Tensors.to = pinned_to
    try:
        t0 = time.perf_counter()
        trainer = Trainer(model, TrainerConfig(**kw))
        load_s = time.perf_counter() - t0
        loss = ppo_loss_fn()
        steps = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.steps + 1):
            profiling = args.profile and i == args.steps and name == args.variants.split(",")[0]
            prof = None
            if profiling:
                from torch.profiler import ProfilerActivity, profile
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]).__enter__()
            sync()
            t0 = time.perf_counter()
            m = trainer.forward_backward(batch, loss)
            sync()
            t1 = time.perf_counter()
            trainer.optim_step()
            sync()
            t2 = time.perf_counter()
            if prof is not None:
                prof.__exit__(None, None, None)
                ev = prof.key_averages()
                dev = sum(e.self_device_time_total for e in ev) / 1e6
                out = Path(args.profile)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"train_{name}.txt").write_text("\n".join([
                    f"train {name}: wall {t2 - t0:.3f} s, device busy {dev:.3f} s ({100 * dev / (t2 - t0):.0f}%)", "",
                    ev.table(sort_by="self_device_time_total", row_limit=40),
                    ev.table(sort_by="self_cpu_time_total", row_limit=25)]))
                continue
            steps.append({"forward_backward_s": t1 - t0, "optim_s": t2 - t1, "step_s": t2 - t0,
                          "micro_batches": m["micro_batches"], "tokens": m["tokens"]})
            print(f"[{name}] step {i}: {t2 - t0:.3f} s ({m['micro_batches']} micro-batches)", flush=True)
        n_params = sum(p.numel() for p in trainer.model.parameters())
        trained = sum(len(r.prompt_ids) + len(r.completion_ids) for r in batch)
        med = {k: statistics.median(s[k] for s in steps[1:]) for k in ("forward_backward_s", "optim_s", "step_s")}
        res = {"variant": name, "config": kw, "load_s": load_s, "steps": steps, "median": med,
               "trained_tokens_per_s": trained / med["step_s"],
               "mfu": 6 * n_params * trained / med["step_s"] / PEAK_FLOPS,
               "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        del trainer
        return res
    finally:
        fsdp.fully_shard, _Tensors.to = shard, to
        import gc
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--models-dir", default="/tmp/bench_models")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant (after one warm-up)")
    p.add_argument("--variants", default="default,mb32k,keep,pinned")
    p.add_argument("--advantage", type=float, default=0.5, help="rollouts' advantages: +- this, alternating "
                   "(0: no gradient reaches the weights, as in the step benchmark's unrewarded rollouts)")
    p.add_argument("--profile", default=None, metavar="DIR")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from models import SHAPES, build_random_model
    model = Path(args.models_dir) / args.shape
    if not (model / "config.json").exists():
        import torch
        build_random_model(model, args.shape, device="cuda" if torch.cuda.is_available() else None)
    vocab = SHAPES[args.shape]["vocab_size"] if args.shape in SHAPES else 64
    batch = rollouts(args.prompts * args.group_size, args.prompt_len, args.completion, vocab, advantage=args.advantage)
    results = {"workload": vars(args), "variants": []}
    for name in args.variants.split(","):
        try:
            results["variants"].append(variant(name, str(model), batch, args))
        except Exception as e:   # e.g. out of memory: recorded, the next variant runs
            results["variants"].append({"variant": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        Path(args.out).write_text(json.dumps(results, indent=1))
        v = results["variants"][-1]
        print(json.dumps({k: v.get(k) for k in ("variant", "median", "trained_tokens_per_s", "mfu",
                                                 "peak_allocated_gib", "error")}), flush=True)


if __name__ == "__main__":
    main()
