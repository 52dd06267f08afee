"""Soak: the async backend under generator, trainer and queue kills at seeded random moments, for
--minutes; it ends with every prompt trained exactly once, or says what broke.

    python benchmarks/soak.py --minutes 30 --out benchmarks/results/DAY/soak_cpu.json
    python benchmarks/soak.py --minutes 3 --out /tmp/soak.json            # a short trial
    python benchmarks/soak.py --gpu --minutes 6 --out $OUT/soak_gpu.json  # one GPU shared by every actor

The tiny model and the `succ` task on a private local Ray cluster (CPU): --generators generators, one
trainer rank checkpointing every --save-every steps. Prompts enter in waves while the run lasts (the
queue is closed at the end). A chaos loop waits a seeded 5..--max-gap s, then kills one of:
  generator      SIGKILL; Ray restarts it, it loads the current weights, its leases come back
  queue          the queue actor, SIGKILL; Ray restarts it empty, the server and the trainer rejoin it
  trainer        its actor and placement group; a new rank loads the latest checkpoint (the queue rolls
                 back what the dead one pulled past it) and trains on
  queue+trainer  both at once
A trainer is killed only once it has checkpointed since it started. At the end: the trained uids
(the last trainer's, those restored from checkpoints included) are exactly 0..N-1 once each; no policy
version was reused after a trainer kill (the new trainer's version is past every version the queue
saw); every generator holds the final weights;
no generator's run() failed.
Writes --out (JSON) and a markdown table beside it. Hardware: CPU (2 cores: about 2 steps a second);
--gpu: one GPU that the generators (each an eager engine holding GPU_ENGINE) and the trainer share.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("RAY_AUTH_MODE", "disabled")    # a private local cluster (Ray 2.60 token auth)
KINDS = ["generator", "queue", "trainer", "queue+trainer"]
WAVE = 64                                   # prompts added whenever fewer than a wave wait
LLM = {"max_model_len": 128, "enforce_eager": True}
GPU_SHARE = 0.3                             # --gpu: each actor's bundle of the one GPU (Ray places them all on it)
GPU_ENGINE = {"kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.05}   # vLLM sizes nothing from free memory


def train_loop(worker, root: str, every: int, resume: bool):
    """In the trainer's actor: load the latest checkpoint (resume), then train until the queue is
    finished, checkpointing every `every` steps. The version after the load goes to ROOT/../loads.jsonl
    (a killed trainer returns nothing). Returns (that version, the trained uids)."""
    from minirl.checkpoint import Checkpointer
    from minirl.core import ppo_loss_fn
    ckpt = Checkpointer(root, keep=2)
    if resume:
        worker.load_checkpoint(ckpt)
    loaded = worker.policy_version
    with open(Path(root).parent / "loads.jsonl", "a") as f:
        f.write(json.dumps({"resume": resume, "version": loaded}) + "\n")
    step = len(worker.trained_uids) // worker.batch_size
    for batches in worker.pull_rollouts():
        step += 1
        worker.trainer.forward_backward([r for b in batches for r in b.compute_advantages()], ppo_loss_fn())
        worker.trainer.optim_step()
        worker.sync_weights()
        if step % every == 0:
            worker.save_checkpoint(ckpt, step)
        time.sleep(0.05)
    return loaded, list(worker.trained_uids)


def soak(args) -> dict:
    import ray

    from actors.server import RolloutServer
    from actors.training import start_trainers
    from minirl.checkpoint import Checkpointer, read_state
    from minirl.recipes.tasks import get_task
    from minirl.recipes.tiny import build_tiny_model

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rng, task, work = random.Random(args.seed), get_task("succ"), Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    model, root, name = str(build_tiny_model(work / "model")), str(work / "ck"), f"soak-{args.seed}"
    bundle = {"CPU": 1, **({"GPU": GPU_SHARE} if args.gpu else {})}
    ray.init(address="local", num_cpus=4 + args.generators, num_gpus=1 if args.gpu else 0,
             object_store_memory=300 * 2**20, include_dashboard=False, namespace="minirl", log_to_driver=False)
    srv = RolloutServer(model, name, reward_fn=task.reward, num_generators=args.generators, group_size=4,
                        sampling={"max_tokens": 2}, queue_size=8, prompts_per_call=4, resources=bundle,
                        llm_kwargs={**LLM, **(GPU_ENGINE if args.gpu else {})})
    submitted = [0]

    def feed(close: bool = False) -> None:
        if close or srv.queue_stats()["pending"] < WAVE:
            n = 0 if close else WAVE
            prompts, answers = task.sample(n, seed=args.seed * 10**6 + submitted[0]) if n else ([], [])
            srv.submit(prompts, metadata=answers, uids=list(range(submitted[0], submitted[0] + n)), close=close)
            submitted[0] += n

    def trainer(resume: bool):
        pg, (actor,) = start_trainers(1, model, name, bundle=bundle, lr=1e-3, batch_size=4, max_staleness=1)
        return pg, actor, actor.run.remote(train_loop, root, args.save_every, resume)

    def checkpointed_since(t: float) -> bool:
        latest = Checkpointer(root).latest()
        return latest is not None and latest.stat().st_mtime > t

    feed()
    srv.run(block=False)
    pg, actor, run = trainer(False)
    started, kills, resumes = time.time(), [], []
    out = {"seed": args.seed, "generators": args.generators, "kinds": args.kinds,
           "device": "gpu" if args.gpu else "cpu", "kill_log": kills, "error": None}
    try:
        trainer_since, end = time.time(), time.time() + 60 * args.minutes
        while time.time() < end:
            wake = time.time() + rng.uniform(5, args.max_gap)
            while time.time() < wake:
                feed()
                ready, _ = ray.wait([run], timeout=1.0)
                if ready:
                    ray.get(run)                       # the trainer failed: raise its error
                    raise RuntimeError("the trainer returned before the queue was closed")
                try:
                    srv.wait(timeout_s=0)              # the server's pool stopped: raise its error
                    raise RuntimeError("the server's pool stopped before the queue was closed")
                except TimeoutError:
                    pass                               # still running
            if args.kinds == ["none"]:               # the control: the same run, nothing killed
                continue
            kind = rng.choice(args.kinds)
            if "trainer" in kind and not checkpointed_since(trainer_since):
                kind = {"trainer": "generator", "queue+trainer": "queue"}[kind]
                if kind not in args.kinds:
                    continue
            q = srv.queue_stats()
            kills.append({"t": round(time.time() - started, 1), "kind": kind, "delivered": q["delivered"],
                          "version": q["version"]})
            print(f"{kills[-1]['t']:7.1f} s  kill {kind:13s} delivered {q['delivered']:5d}  "
                  f"version {q['version']}", flush=True)
            if kind == "generator":
                ray.kill(srv.generators[rng.choice(sorted(srv.generators))]["actor"], no_restart=False)
            if "queue" in kind:
                ray.kill(srv.queue.handle, no_restart=False)
            if "trainer" in kind:
                ray.kill(actor)
                if kind == "trainer":              # what the queue saw last, the dead trainer's pushes included
                    q = srv.queue_stats()
                ray.util.remove_placement_group(pg)
                try:
                    ray.get(run, timeout=60)
                except ray.exceptions.RayError:
                    pass
                ck = read_state(Checkpointer(root).latest())["state"]
                pg, actor, run = trainer(True)
                trainer_since = time.time()
                resumes.append({"lost_version": q["version"], "checkpoint_version": ck["policy_version"],
                                "checkpoint_trained": len(ck["trained_uids"])})
        feed(close=True)
        _, trained = ray.get(run, timeout=900)
        out["server"] = srv.wait(timeout_s=300)
        loads = [json.loads(ln) for ln in (work / "loads.jsonl").read_text().splitlines()]
        for r, load in zip(resumes, [ld for ld in loads if ld["resume"]]):
            r["loaded"] = load["version"]          # past every version the queue saw
            r["ok"] = r["loaded"] > r["lost_version"]
        q = srv.queue_stats()
        info = [ray.get(g["actor"].info.remote(), timeout=120) for g in srv.generators.values()]
        counts = Counter(trained)
        out |= {"trained": len(trained), "distinct": len(counts),
                "twice_or_more": sorted(u for u, c in counts.items() if c > 1)[:20],
                "missing": sorted(set(range(submitted[0])) - set(counts))[:20],
                "final_version": q["version"], "generator_versions": sorted({i["version"] for i in info}),
                "rolled_back": q["rolled_back"], "recycled_stale": q["recycled_stale"]}
        out["exactly_once"] = sorted(trained) == list(range(submitted[0]))
        out["versions_not_reused"] = all(r.get("ok") for r in resumes)
        out["generators_on_final"] = out["generator_versions"] == [q["version"]]
    except Exception as e:                     # what broke, after what kills: the result says so
        out["error"] = f"{type(e).__name__}: {e}"[:3000]
        print("error:", out["error"].splitlines()[0], flush=True)
    out |= {"minutes": round((time.time() - started) / 60, 1), "prompts": submitted[0],
            "kills": dict(Counter(k["kind"] for k in kills)), "resumes": resumes}
    out["generator_failures"] = out.get("server", {}).get("failures")   # a generator's run() that raised
    out["failure_causes"] = srv.pool.failure_causes                        # ... and what it said
    out["ok"] = out["error"] is None and out["generator_failures"] == 0 and all(
        out.get(k) for k in ("exactly_once", "versions_not_reused", "generators_on_final"))
    try:
        srv.shutdown(remove_queue=True)
        ray.kill(actor)
        ray.util.remove_placement_group(pg)
    finally:
        ray.shutdown()
    return out


def table(out: dict) -> str:
    get = lambda k: out.get(k, "-")
    rows = [("minutes", out["minutes"]), ("prompts submitted", out["prompts"]), ("trained", get("trained")),
            ("distinct", get("distinct")), ("kills", ", ".join(f"{k} {v}" for k, v in out["kills"].items())),
            ("trainer resumes", len(out["resumes"])), ("final policy version", get("final_version")),
            ("rolled back", get("rolled_back")), ("recycled (stale)", get("recycled_stale")),
            ("every prompt trained exactly once", get("exactly_once")),
            ("no version reused after a trainer kill", get("versions_not_reused")),
            ("generators on the final weights", get("generators_on_final")),
            ("generator failures (a run() that raised)", get("generator_failures")),
            ("error", (out["error"] or "none").splitlines()[0][:300])]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long kills go on (then the run finishes)")
    ap.add_argument("--max-gap", type=float, default=40.0, help="seconds between kills at most (at least 5)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--kinds", type=lambda s: s.split(","), default=KINDS,
                    help=f"comma list of what to kill, from {','.join(KINDS)} (default: all; none: the control)")
    ap.add_argument("--save-every", type=int, default=5, help="trainer steps between checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", action="store_true", help="generators and trainer share one GPU (else CPU only)")
    ap.add_argument("--work", default="/tmp/minirl-soak", help="model, checkpoints (scratch)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = soak(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *sys.argv[1:]])
    Path(args.out).write_text(json.dumps({"command": command, **out}, indent=1, default=str))
    Path(args.out).with_suffix(".md").write_text(f"`{command}`\n\n{table(out)}")
    print(table(out))
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
