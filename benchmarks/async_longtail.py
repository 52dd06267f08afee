"""Benchmark: a reasoning-RL-like long-tail workload, co-located against async on the same devices.

    python benchmarks/async_longtail.py --shape qwen3-0.6b --gpus 2      # async: 1 generates, 1 trains
    python benchmarks/async_longtail.py --shape qwen3-4b --gpus 2
    python benchmarks/async_longtail.py --shape qwen3-0.6b --gpus 1      # one GPU shared by both actors
    python benchmarks/async_longtail.py --shape qwen3-4b --gpus 1 --micro-batch-tokens 4096
    python benchmarks/async_longtail.py --shape tiny --gpus 0 --prompts 8 --group-size 4 --steps 4 \\
        --median 12 --cap 48 --max-model-len 128                        # CPU smoke test

Workload: --prompts x --group-size samples a step; each sample's length is drawn (seeded by prompt
and sample) from a log-normal of median --median and sigma --sigma, capped at --cap, and forced
with per-request max_tokens and ignore_eos (the weights are random). Parts, each in a fresh process:
  colocated  every rank (FSDP2 over --gpus, an engine on each) generates its share, then trains
  async      RolloutServer (one generator per --gen-gpus) + a trainer on the other GPUs,
             max_staleness --staleness, the decoupled TIS loss (launch/async.py's)
  gen_alone / train_alone   one GPU generating only / training only (the ideal: their minimum)
With --gpus 1 the async part shares the GPU: the generator's bundle holds {"GPU": --gen-fraction},
the trainer's the rest (Ray's share is bookkeeping: both actors get the same CUDA_VISIBLE_DEVICES and
run at once, competing for the same SMs); the engine is fixed at --gen-memory GiB (weights, a
kv_cache_memory_bytes KV cache, ENGINE_RESERVE_GIB), whatever started first, and the trainer keeps
the rest; weights go through the object store (NCCL puts no two ranks on one GPU). --merge keeps the
parts of an earlier run of the same workload, so the parts can run over several calls.
Measured after --warmup steps: trained tokens/s (async: the steps after warm-up also train rollouts
queued during it, up to --staleness steps' worth, so few steps read high; the generator's tokens/s
over its whole session, fill included, is the lower bound beside it), engine busy fraction, pause per weight update
(the generator's load alone), staleness histogram, recycled rollouts. Writes --out (JSON) and a
markdown table beside it; benchmarks/cost_model.py predicts 8 and 64 GPUs from it. Hardware: 0-2 GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


ENGINE_RESERVE_GIB = 4.0       # an engine's memory beside weights and KV cache: activations, CUDA graphs, sampler
GEN_MEMORY_GIB = {"qwen3-0.6b": 56.0, "qwen3-4b": 48.0}
"""--gpus 1: the engine's share of a ~140 GiB H200 by shape. The trainer keeps the rest: full fine-tuning
peaks ~22 GiB at 0.6B, ~77 GiB at 4B with small micro-batches (--micro-batch-tokens 4096)."""
WORKLOAD = ("shape", "gpus", "gen_gpus", "prompts", "group_size", "prompt_len", "median", "sigma", "cap",
            "max_model_len", "max_num_seqs", "seed", "steps", "warmup", "staleness", "transport", "gen_fraction",
            "gen_memory", "micro_batch_tokens")        # what --merge requires to be equal


def log(msg):
    print(f"[longtail {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shared_gpu_bundles(fraction: float) -> tuple[dict, dict]:
    """(generator, trainer) bundles that split one GPU: Ray places both on it, fraction and 1 - fraction."""
    if not 0 < fraction < 1:
        raise ValueError(f"--gen-fraction must be between 0 and 1 (exclusive), got {fraction}")
    f = round(fraction, 4)                                     # Ray counts resources in units of 1e-4
    return {"CPU": 1, "GPU": f}, {"CPU": 1, "GPU": round(1 - f, 4)}


def engine_memory(gen_gib: float, weight_bytes: int, total_bytes: int) -> dict:
    """vLLM kwargs that hold an engine at gen_gib GiB of a shared GPU: a KV cache of what its weights and
    ENGINE_RESERVE_GIB leave (kv_cache_memory_bytes: vLLM sizes nothing from free memory), and
    gpu_memory_utilization = its share of the device (vLLM then only checks at start that it is free)."""
    gib = 2**30
    kv = int(gen_gib * gib) - weight_bytes - int(ENGINE_RESERVE_GIB * gib)
    if gen_gib * gib >= total_bytes:
        raise ValueError(f"--gen-memory {gen_gib:g} GiB is not below the GPU's {total_bytes / gib:.1f} GiB: "
                         "the trainer shares it; lower --gen-memory")
    if kv < gib:
        raise ValueError(f"--gen-memory {gen_gib:g} GiB leaves {kv / gib:.1f} GiB of KV cache after the weights "
                         f"({weight_bytes / gib:.1f} GiB) and {ENGINE_RESERVE_GIB:g} GiB for activations and CUDA "
                         "graphs; raise --gen-memory to at least 1 GiB more")
    return {"kv_cache_memory_bytes": kv, "gpu_memory_utilization": round(gen_gib * gib / total_bytes, 4)}


def trainer_config(args):
    from minirl.trainer import TrainerConfig
    mb = {"micro_batch_tokens": args.micro_batch_tokens} if args.micro_batch_tokens else {}
    return TrainerConfig(lr=1e-6, **mb)


def length(seed: int, uid, index: int, median: float, sigma: float, cap: int) -> int:
    """The seeded long-tail length of sample `index` of prompt `uid`."""
    rng = random.Random(f"{seed}/{uid}/{index}")
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def make_episode(seed: int, median: float, sigma: float, cap: int):
    async def episode(ep):
        await ep.generate(max_tokens=length(seed, ep.uid, ep.index, median, sigma, cap), ignore_eos=True)
        return float(random.Random(f"r{ep.uid}/{ep.index}").random() < 0.5)   # rewards with variance
    return episode


def prompts(args, step: int | None = None) -> list:
    n = args.prompts * (args.steps if step is None else 1)
    rng = random.Random(args.seed if step is None else args.seed * 1000 + step)
    top = 60 if args.shape == "tiny" else 1000                # ids the tokenizer decodes
    return [[rng.randrange(3, top) for _ in range(args.prompt_len)] for _ in range(n)]


def tokens_of(batches) -> int:
    return sum(len(r.completion_ids) for b in batches for r in b)


def loss_fn():
    from minirl.offpolicy import decoupled_loss_fn
    return decoupled_loss_fn("tis", clip_high=0.28)


# ---- parts ---------------------------------------------------------------------------------------

def _colocated_rank(model, args):
    from minirl import WeightManager
    from minirl.colocated import WeightManagerConfig
    from minirl.episodes import run_episodes
    wm = WeightManager(model, config=WeightManagerConfig(trainer=trainer_config(args)),
                       max_model_len=args.max_model_len, max_num_seqs=1024)
    episode, rows = make_episode(args.seed, args.median, args.sigma, args.cap), []
    world, rank = wm.rank.world_size, wm.rank.rank
    for step in range(args.steps):
        mine = prompts(args, step)[rank::world]
        t0 = time.perf_counter()
        llm = wm.as_vllm()
        batches = run_episodes(llm, episode, mine, group_size=args.group_size, policy_version=wm.policy_version,
                               device=wm.device, uids=[(step, rank, i) for i in range(len(mine))])
        t1 = time.perf_counter()
        wm.as_trainable()
        rollouts = [r for b in batches for r in b.compute_advantages()]
        wm.trainer.forward_backward(rollouts, loss_fn())
        wm.trainer.optim_step()
        t2 = time.perf_counter()
        rows.append({"gen_s": t1 - t0, "train_s": t2 - t1, "tokens": tokens_of(batches)})
    wm.close()
    return rows


def part_colocated(args, model):
    import ray
    from actors.colocated import run_spmd
    ranks = max(args.gpus, 1)
    ray.init(address="local", num_cpus=8, num_gpus=args.gpus, include_dashboard=False, log_to_driver=False)
    per_rank = run_spmd(_colocated_rank, model, args, num_workers=ranks,
                        bundle={"CPU": 1, **({"GPU": 1} if args.gpus else {})}, timeout_s=args.timeout)
    ray.shutdown()
    steady = list(zip(*per_rank))[args.warmup:]           # per step: every rank's row
    wall = sum(max(r["gen_s"] + r["train_s"] for r in step) for step in steady)
    gen = sum(max(r["gen_s"] for r in step) for step in steady)
    return {"ranks": ranks, "trained_tokens_per_s": sum(r["tokens"] for s in steady for r in s) / wall,
            "engine_busy": gen / wall, "step_s": wall / len(steady), "staleness": {"0": 1.0}, "recycled": 0}


def _async_loop(worker, warmup):
    import os
    import torch
    cuda, dev = worker.device.type == "cuda", {}
    if cuda:        # what else holds this GPU (the engine, when they share it; plus this process's context)
        free, total = torch.cuda.mem_get_info(worker.device)
        dev = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "total_gib": total / 2**30,
               "others_gib": (total - free - torch.cuda.memory_reserved(worker.device)) / 2**30}
    lags, rows, t_prev = [], [], time.perf_counter()
    for step, batches in enumerate(worker.pull_rollouts()):
        rollouts = [r for b in batches for r in b.compute_advantages()]
        lags += [worker.policy_version - r.policy_version for r in rollouts]
        spans = sum(r.info["versions"][0] != r.info["versions"][1] for r in rollouts)
        worker.trainer.forward_backward(rollouts, loss_fn())
        worker.trainer.optim_step()
        sync = worker.sync_weights()
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        rows.append({"s": now - t_prev, "tokens": tokens_of(batches), "spans": spans, "sync_s": sync["sync_s"]})
        t_prev = now
    hist = {str(k): lags.count(k) / len(lags) for k in sorted(set(lags))}
    if cuda:
        dev["trainer_peak_gib"] = torch.cuda.max_memory_reserved(worker.device) / 2**30
    return {"rows": rows, "staleness": hist, "queue": worker.queue_stats(), "device": dev}


def part_async(args, model):
    import ray
    from ray.util.placement_group import placement_group_table
    from actors.server import RolloutServer
    from actors.training import start_trainers
    ray.init(address="local", num_cpus=8, num_gpus=args.gpus, include_dashboard=False, namespace="minirl",
             log_to_driver=False)
    gen_res = train_res = {"CPU": 1, **({"GPU": 1} if args.gpus else {})}
    llm = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs}
    if args.gpus == 1:                                 # one GPU shared: the engine's memory fixed up front
        import torch
        gen_res, train_res = shared_gpu_bundles(args.gen_fraction)
        weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        llm.update(engine_memory(args.gen_memory, weights, torch.cuda.get_device_properties(0).total_memory))
    gens = max(1, args.gen_gpus) if args.gpus > 1 else 1
    srv = RolloutServer(model, "longtail", episode=make_episode(args.seed, args.median, args.sigma, args.cap),
                        num_generators=gens, group_size=args.group_size, resources=gen_res,
                        queue_size=args.prompts * (args.staleness + 1),
                        prompts_per_call=max(1, args.max_num_seqs // args.group_size), llm_kwargs=llm)
    srv.submit(prompts(args), uids=list(range(args.prompts * args.steps)))
    pg, (trainer,) = start_trainers(1, model, "longtail", bundle=train_res, config=trainer_config(args),
                                    batch_size=args.prompts, max_staleness=args.staleness, transport=args.transport)
    placed = {"generator": placement_group_table(next(iter(srv.generators.values()))["pg"])["bundles"][0],
              "trainer": placement_group_table(pg)["bundles"][0]}      # as Ray holds them
    srv.run(block=False)
    out = ray.get(trainer.run.remote(_async_loop, args.warmup), timeout=args.timeout)
    stats = srv.wait(timeout_s=300)
    srv.shutdown(remove_queue=True)
    ray.shutdown()
    steady = out["rows"][args.warmup:]
    wall = sum(r["s"] for r in steady)
    return {"generators": gens, "trained_tokens_per_s": sum(r["tokens"] for r in steady) / wall,
            "session_tokens_per_s": stats["tokens"] / max(stats.get("serve_s", 0), 1e-9),
            "engine_busy": stats.get("busy_s", 0) / max(stats.get("serve_s", 0), 1e-9),
            "pause_per_update_s": stats["load_s"] / max(stats["loads"], 1),
            "sync_s": statistics.median(r["sync_s"] for r in steady), "step_s": wall / len(steady),
            "rollouts_spanning_versions": sum(r["spans"] for r in out["rows"]),
            "staleness": out["staleness"], "recycled": out["queue"]["recycled_stale"],
            "waited_for_old": out["queue"]["waited_for_old"], "server": stats, "bundles": placed,
            "device": out["device"], "engine_memory": {k: llm[k] for k in llm if "memory" in k},
            "transport": args.transport}


def part_gen_alone(args, model):
    from minirl.generator import Generator
    from minirl.hub import PromptItem
    gen = Generator(model, episode=make_episode(args.seed, args.median, args.sigma, args.cap),
                    group_size=args.group_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    items = [PromptItem(uid=i, prompt=p) for i, p in enumerate(prompts(args))]
    warm = items[:args.prompts * args.warmup]
    gen.generate(warm)
    t0 = time.perf_counter()
    batches = gen.generate(items[len(warm):])
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens_of(batches) / wall}


def part_train_alone(args, model):
    """The trainer alone on one step's rollouts, made without an engine: same prompts and lengths
    (training cost depends on the tokens only), random completion ids."""
    from minirl.data import Rollout, RolloutBatch
    from minirl.trainer import Trainer
    rng, top = random.Random(1), 60 if args.shape == "tiny" else 1000
    batches = [RolloutBatch([Rollout(prompt_ids=p, completion_ids=[rng.randrange(3, top) for _ in range(n)],
                                     sampling_logprobs=[-1.0] * n, reward=float(rng.random() < 0.5))
                             for g in range(args.group_size)
                             for n in [length(args.seed, i, i * args.group_size + g, args.median, args.sigma,
                                              args.cap)]], uid=i)
               for i, p in enumerate(prompts(args, 0))]
    trainer = Trainer(model, trainer_config(args))
    rollouts = [r for b in batches for r in b.compute_advantages()]
    times = []
    for _ in range(args.warmup + 2):
        t0 = time.perf_counter()
        trainer.forward_backward(rollouts, loss_fn())
        trainer.optim_step()
        times.append(time.perf_counter() - t0)
    return {"tokens_per_s": tokens_of(batches) / statistics.median(times[args.warmup:])}


# ---- driver ----------------------------------------------------------------------------------------

def child(part, args):
    model = str(Path(args.work) / f"model-{args.shape}")
    if not Path(model, "config.json").exists():
        if args.shape == "tiny":
            from minirl.recipes.tiny import build_tiny_model
            build_tiny_model(model)
        else:
            import torch
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from models import build_random_model
            build_random_model(model, args.shape, device="cuda" if torch.cuda.is_available() else None)
    return {"colocated": part_colocated, "async": part_async, "gen_alone": part_gen_alone,
            "train_alone": part_train_alone}[part](args, model)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--shape", default="qwen3-0.6b")
    add("--gpus", type=int, default=2)
    add("--gen-gpus", type=int, default=1, help="(async) GPUs that generate; the rest train (one trainer)")
    add("--parts", default="gen_alone,train_alone,colocated,async")
    add("--steps", type=int, default=8)
    add("--warmup", type=int, default=2)
    add("--prompts", type=int, default=128)
    add("--group-size", type=int, default=8)
    add("--prompt-len", type=int, default=64)
    add("--median", type=float, default=500)
    add("--sigma", type=float, default=0.8)
    add("--cap", type=int, default=4096)
    add("--max-model-len", type=int, default=4224)
    add("--max-num-seqs", type=int, default=512)
    add("--staleness", type=int, default=1)
    add("--transport", default=None, choices=["collective", "object_store"],
        help="weights to the generators; default collective, object_store with --gpus 1")
    add("--gen-fraction", type=float, default=0.5, help="(--gpus 1) the generator's Ray GPU share (trainer: the rest)")
    add("--gen-memory", type=float, default=None,
        help=f"(--gpus 1) GiB of the GPU for the engine (weights + KV cache + {ENGINE_RESERVE_GIB:g}); "
             f"default by shape {GEN_MEMORY_GIB}")
    add("--micro-batch-tokens", type=int, default=None, help="every trainer's micro-batch (default TrainerConfig's)")
    add("--merge", default=None, help="an earlier run's JSON (same workload): its parts kept, --parts run")
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=1800)
    add("--work", default="/tmp/bench_longtail")
    add("--out", default=None)
    add("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gpus == 1 and args.transport == "collective":
        p.error("--gpus 1 --transport collective: NCCL cannot put the trainer and the generator, two ranks, on one "
                "GPU; use --transport object_store (the default there)")
    args.transport = args.transport or ("object_store" if args.gpus == 1 else "collective")
    if args.gpus == 1 and args.gen_memory is None:
        if args.shape not in GEN_MEMORY_GIB:
            p.error(f"--gpus 1 --shape {args.shape}: give --gen-memory GIB, the engine's share of the GPU")
        args.gen_memory = GEN_MEMORY_GIB[args.shape]
    earlier = json.loads(Path(args.merge).read_text()) if args.merge else None
    if earlier and (diff := [k for k in WORKLOAD if earlier["settings"].get(k) != getattr(args, k)]):
        theirs = ", ".join(f"{k} {earlier['settings'].get(k)} there, {getattr(args, k)} here" for k in diff)
        p.error(f"--merge {args.merge} measured another workload: {theirs}")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.child:
        Path(args.work, "child.json").write_text(json.dumps(child(args.child, args)))
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from async_rl import run_parts                     # each part in a fresh process, results as they finish
    out = Path(args.out or ROOT / "benchmarks/results" / f"longtail_{args.shape}_{args.gpus}gpu.json")
    doc = run_parts(args, out, markdown, grace_s=120)
    if earlier:
        doc["parts"] = {**earlier["parts"], **doc["parts"]}
        doc["settings"]["parts"] = ",".join(doc["parts"])
        out.write_text(json.dumps(doc, indent=1))
        out.with_suffix(".md").write_text(markdown(doc))
        print(f"merged with {args.merge}:\n{markdown(doc)}")


def markdown(doc) -> str:
    s, P = doc["settings"], doc["parts"]
    c, a = P.get("colocated", {}), P.get("async", {})
    g, t = P.get("gen_alone", {}).get("tokens_per_s"), P.get("train_alone", {}).get("tokens_per_s")
    shared = s["gpus"] == 1
    lines = [f"# long-tail workload: {s['shape']}, {'one GPU shared' if shared else str(s['gpus']) + ' GPU(s)'}", "",
             f"{s['prompts']} prompts x {s['group_size']} samples a step, lengths log-normal (median "
             f"{s['median']:g}, sigma {s['sigma']:g}, cap {s['cap']}), {s['steps']} steps, {s['warmup']} warm-up.", ""]
    if shared:
        lines += [f"One GPU shared: async runs the generator (Ray GPU share {s['gen_fraction']:g}, engine held at "
                  f"{s['gen_memory']:g} GiB) and the trainer (the rest) at once on the same device, where they compete "
                  "for the same SMs; co-located alternates the two on the whole GPU (WeightManager's switch). "
                  "Weights go through the object store.", ""]
        d = a.get("device", {})
        if "others_gib" in d:
            lines += [f"Trainer's GPU (CUDA_VISIBLE_DEVICES={d['cuda_visible_devices']}, {d['total_gib']:.0f} GiB): "
                      f"{d['others_gib']:.1f} GiB held by other processes (the engine) at its start; trainer peak "
                      f"{d.get('trainer_peak_gib', 0):.1f} GiB reserved. Bundles as Ray holds them: "
                      f"{a['bundles']}.", ""]
    lines += ["| | trained tokens/s | engine busy | pause / update (s) | staleness | recycled |",
              "|---|---|---|---|---|---|"]
    if "trained_tokens_per_s" in c:
        lines.append(f"| co-located ({c['ranks']} ranks) | {c['trained_tokens_per_s']:.0f} | {c['engine_busy']:.0%} | "
                     "- | 0 | 0 |")
    if "trained_tokens_per_s" in a:
        lines.append(f"| async ({a['generators']} gen) | {a['trained_tokens_per_s']:.0f} | {a['engine_busy']:.0%} | "
                     f"{a['pause_per_update_s']:.4f} | {a['staleness']} | {a['recycled']} |")
    if "trained_tokens_per_s" in c and "trained_tokens_per_s" in a:
        lines += ["", f"async / co-located: {a['trained_tokens_per_s'] / c['trained_tokens_per_s']:.2f}x"]
        if "session_tokens_per_s" in a:    # the steps after warm-up train what was queued during it too
            lines.append(f"(a lower bound: every token the generator made over its whole session, warm-up and "
                         f"pipeline fill included, {a['session_tokens_per_s']:.0f} tokens/s: "
                         f"{a['session_tokens_per_s'] / c['trained_tokens_per_s']:.2f}x)")
    if g and t and "trained_tokens_per_s" in a:
        ideal = min(g, t)
        lines.append(f"ideal min(gen alone {g:.0f}, train alone {t:.0f}) = {ideal:.0f} tokens/s; async reaches "
                     f"{a['trained_tokens_per_s'] / ideal:.0%} of it")
        if shared:     # one GPU cannot run both at full speed: the bound of alternating with a free switch
            serial = 1 / (1 / g + 1 / t)
            lines.append(f"(one GPU: that ideal needs two; doing both in turn on one, with a free switch, gives "
                         f"1 / (1/gen + 1/train) = {serial:.0f} tokens/s, and async reaches "
                         f"{a['trained_tokens_per_s'] / serial:.0%} of that)")
    lines += [f"- {k}: error" for k, v in P.items() if "error" in v]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
