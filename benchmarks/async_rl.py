"""Benchmark: async weight transport and end-to-end rollouts/s, against the machine's own
all-reduce and against the co-located backend on the same devices.

    python benchmarks/async_rl.py --shape qwen3-0.6b --gpus 2      # 2 GPUs: 1 generates, 1 trains
    python benchmarks/async_rl.py --shape qwen3-0.6b --gpus 1 --fraction 0.5   # one shared GPU
    python benchmarks/async_rl.py --shape tiny --gpus 0 --steps 3  # CPU smoke test (gloo)

Parts (each in a fresh process, with a timeout):
  allreduce   NCCL (gloo on CPU) all-reduce bus bandwidth between two processes, both GPUs
              visible (torchrun-style) - the ceiling a weight broadcast is compared with.
  async/<t>   RolloutServer (1 generator) + one training actor, transport t in {collective,
              object_store}: per sync bytes, seconds, GB/s; rollouts trained per second.
  colocated   the same loop co-located on the same devices (run_spmd, one rank per device).
Writes --out (JSON) and a markdown table beside it. Hardware: 0, 1 or 2 GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(msg):
    print(f"[bench_async {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- all-reduce ceiling ------------------------------------------------------------------------

def _allreduce_rank(rank, world, port, size_mb, out):
    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    dev = f"cuda:{rank}" if cuda else "cpu"
    x = torch.ones(size_mb << 18, device=dev)          # size_mb MiB of fp32
    for _ in range(3):
        dist.all_reduce(x)
    times = []
    for _ in range(10):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    nbytes = x.numel() * 4
    if rank == 0:
        out.put({"bytes": nbytes, "seconds": t, "algbw_GBps": nbytes / t / 1e9,
                 "busbw_GBps": nbytes / t / 1e9 * 2 * (world - 1) / world, "backend": "nccl" if cuda else "gloo"})
    dist.destroy_process_group()


def _two_processes(target, size_mb):
    """Run target(rank, 2, port, size_mb, queue) in two spawned processes; the result one puts."""
    import torch.multiprocessing as mp
    from minirl.distributed import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, 2, port, size_mb, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    return res


def part_allreduce(args):
    return _two_processes(_allreduce_rank, args.allreduce_mb)


def _broadcast_rank(rank, world, port, size_mb, out):
    """One process per GPU, each seeing only its own (as in Ray actors): minirl's BroadcastGroup."""
    import os
    if os.environ.get("BENCH_GPUS", "0") != "0":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    from minirl.transport import BroadcastGroup
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    g = BroadcastGroup("127.0.0.1", port, rank, world, prefix="bench", device=dev, timeout_s=120)
    n = size_mb << 19                                   # bf16 elements
    bucket = [("w", torch.ones(n, dtype=torch.bfloat16, device=dev))]
    from minirl.transport import BucketMeta
    meta = BucketMeta.of(bucket)
    times = []
    for i in range(8):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.send(bucket) if rank == 0 else g.recv(meta)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[2:])
    if rank == 1:
        out.put({"bytes": n * 2, "seconds": t, "GBps": n * 2 / t / 1e9, "visible": "one GPU per process"})
    g.close()


def part_broadcast(args):
    os.environ["BENCH_GPUS"] = str(args.gpus)      # inherited by the spawned processes
    return _two_processes(_broadcast_rank, args.allreduce_mb)


# ---- async and co-located runs ------------------------------------------------------------------

def _loop(worker, steps):
    """Pull, one optimizer step, sync; record sync timings. Same loss as launch/async.py."""
    import torch
    from minirl import ppo_loss_fn
    syncs, rollouts_done = [], 0
    for step, batches in enumerate(worker.pull_rollouts(), 1):
        rollouts = [r for b in batches for r in b.compute_advantages()]
        worker.trainer.forward_backward(rollouts, ppo_loss_fn(clip_high=0.28))
        worker.trainer.optim_step()
        syncs.append(worker.sync_weights())
        rollouts_done += len(rollouts)
        if step == 1:                            # steady state: from the end of step 1
            t_first, n_first = time.perf_counter(), rollouts_done
    if worker.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t_first
    return {"syncs": syncs, "rollouts": rollouts_done, "steady_rollouts_per_s": (rollouts_done - n_first) / wall,
            "queue": worker.queue_stats()}


def part_async(args, model, transport):
    import ray
    from actors.server import RolloutServer
    from actors.training import start_trainers
    from minirl.recipes.tasks import get_task
    gpus = args.gpus
    ray.init(address="local", num_cpus=8, num_gpus=gpus, include_dashboard=False, namespace="minirl",
             log_to_driver=False)
    frac = args.fraction if gpus == 1 else 1.0
    gen_res = {"CPU": 1, **({"GPU": frac} if gpus else {})}
    task = get_task("succ")
    n = args.steps * args.prompts
    prompts, answers = task.sample(n, seed=0)
    srv = RolloutServer(model, f"bench-{transport}", reward_fn=task.reward, num_generators=1,
                        group_size=args.group_size, sampling={"max_tokens": args.max_tokens, "ignore_eos": True},
                        queue_size=2 * args.prompts, prompts_per_call=args.prompts, resources=gen_res,
                        llm_kwargs={"max_model_len": 256, "enforce_eager": True,
                                    **({"gpu_memory_utilization": args.gen_util} if gpus else {})})
    srv.submit(prompts, metadata=answers)
    pg, (trainer,) = start_trainers(1, model, f"bench-{transport}", bundle=gen_res, lr=1e-6,
                                    batch_size=args.prompts, max_staleness=1, transport=transport)
    srv.run(block=False)
    out = ray.get(trainer.run.remote(_loop, args.steps), timeout=args.timeout)
    srv.wait(timeout_s=120)
    keys = ["bytes", "group_s", "acks_s", "gen_load_s", "sync_s"]
    later = out["syncs"][1:] or out["syncs"]        # the first collective sync builds the group
    med = {k: statistics.median(s[k] for s in later) for k in keys if k in later[0]}
    med["GBps_whole_sync"] = med["bytes"] / med["sync_s"] / 1e9 if med.get("sync_s") else None
    res = {"transport": transport, "sync_median": med, "first_sync": out["syncs"][0],
           "rollouts_per_s": out["steady_rollouts_per_s"], "queue": out["queue"], "server": srv.stats}
    srv.shutdown(remove_queue=True)
    ray.shutdown()
    return res


def _colocated_job(model, args_list):
    import importlib.util
    sys.path.insert(0, str(ROOT / "launch"))              # for its `import common`
    spec = importlib.util.spec_from_file_location("colocated_launch", str(ROOT / "launch/colocated.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.common.parse_args(mod.__doc__, "runs/colocated", args_list + ["--model", model])
    mod.run(args)
    return True


def part_colocated(args, model):
    import ray
    from actors.colocated import run_spmd
    ranks = max(args.gpus, 1)
    ray.init(address="local", num_cpus=8, num_gpus=args.gpus, include_dashboard=False, log_to_driver=False)
    run_dir = Path(args.work) / "colocated"
    opts = ["--steps", str(args.steps), "--prompts", str(args.prompts // ranks), "--group-size",
            str(args.group_size), "--max-tokens", str(args.max_tokens), "--lr", "1e-6", "--backends", "",
            "--run-dir", str(run_dir)]
    bundle = {"CPU": 1, **({"GPU": 1} if args.gpus else {})}
    run_spmd(_colocated_job, model, opts, num_workers=ranks, bundle=bundle, timeout_s=args.timeout)
    ray.shutdown()
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steady = rows[1:]
    step_s = statistics.median(r["time/rollouts"] + r["time/train"] for r in steady)
    parts = {k: statistics.median(r[k] for r in steady if k in r)
             for k in steady[0] if k.startswith("sync/")}
    return {"ranks": ranks, "rollouts_per_s": args.prompts * args.group_size / step_s,
            "step_s": step_s, "switch_median": parts}


# ---- driver ---------------------------------------------------------------------------------------

def child(part, args):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from models import build_random_model
    model = str(Path(args.work) / f"model-{args.shape}")
    if not Path(model, "config.json").exists():
        import torch
        build_random_model(model, args.shape, device="cuda" if torch.cuda.is_available() else None)
    if part == "allreduce":
        return part_allreduce(args)
    if part == "broadcast":
        return part_broadcast(args)
    if part.startswith("async/"):
        return part_async(args, model, part.split("/")[1])
    return part_colocated(args, model)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--fraction", type=float, default=0.5, help="GPU share per actor when --gpus 1")
    p.add_argument("--gen-util", type=float, default=0.3, help="generator gpu_memory_utilization")
    p.add_argument("--parts", default="allreduce,async/collective,async/object_store,colocated")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--allreduce-mb", type=int, default=512)
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--work", default="/tmp/bench_async")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.child:
        res = child(args.child, args)
        Path(args.work, "child.json").write_text(json.dumps(res))
        return
    run_parts(args, Path(args.out or ROOT / "benchmarks/results" / f"async_{args.shape}_{args.gpus}gpu.json"),
              markdown, grace_s=60)


def run_parts(args, out: Path, markdown, grace_s: float) -> dict:
    """Each of args.parts in a fresh process (this script with --child PART, which writes
    WORK/child.json), within args.timeout + grace_s; writes out (JSON) and its .md as parts finish."""
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")}, "parts": {}}
    for part in args.parts.split(","):
        log(f"{part} ...")
        Path(args.work, "child.json").unlink(missing_ok=True)
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, sys.argv[0], *sys.argv[1:], "--child", part],
                               timeout=args.timeout + grace_s, capture_output=True, text=True)
            ok = r.returncode == 0 and Path(args.work, "child.json").exists()
            doc["parts"][part] = (json.loads(Path(args.work, "child.json").read_text()) if ok
                                  else {"error": r.stderr[-3000:]})
        except subprocess.TimeoutExpired:
            doc["parts"][part] = {"error": f"timed out after {args.timeout + grace_s} s"}
        doc["parts"][part]["wall_s"] = time.time() - t0
        log(f"{part}: {json.dumps(doc['parts'][part])[:600]}")
        out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return doc


def markdown(doc):
    s, P = doc["settings"], doc["parts"]
    lines = [f"# async transport and rollouts/s: {s['shape']}, {s['gpus']} GPU(s)", "",
             f"{s['steps']} steps x {s['prompts']} prompts x {s['group_size']} samples x "
             f"{s['max_tokens']} tokens (ignore_eos), eager engines.", ""]
    ar = P.get("allreduce", {})
    if "busbw_GBps" in ar:
        lines.append(f"- all-reduce ({ar['backend']}, {ar['bytes'] / 2**20:.0f} MiB): bus bandwidth "
                     f"{ar['busbw_GBps']:.1f} GB/s")
    bc = P.get("broadcast", {})
    if "GBps" in bc:
        frac = f" = {bc['GBps'] / ar['busbw_GBps']:.0%} of all-reduce" if "busbw_GBps" in ar else ""
        lines.append(f"- minirl BroadcastGroup alone ({bc['visible']}, {bc['bytes'] / 2**20:.0f} MiB): "
                     f"{bc['GBps']:.1f} GB/s{frac}")
    for t in ("collective", "object_store"):
        a = P.get(f"async/{t}", {})
        if "sync_median" in a:
            m = a["sync_median"]
            lines.append(f"- async {t}: {m['bytes'] / 2**20:.0f} MiB per sync, whole verified sync "
                         f"{m['sync_s']:.3f} s ({m['GBps_whole_sync'] or 0:.2f} GB/s); "
                         f"{a['rollouts_per_s']:.1f} rollouts/s")
        elif a:
            lines.append(f"- async {t}: error")
    c = P.get("colocated", {})
    if "rollouts_per_s" in c:
        lines.append(f"- co-located ({c['ranks']} rank(s)): {c['rollouts_per_s']:.1f} rollouts/s, step "
                     f"{c['step_s']:.2f} s; switch parts (median s): "
                     + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in c["switch_median"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
