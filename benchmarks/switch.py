"""Benchmark: the train -> generate -> train switch of the co-located backend.

For a random-init model of a real shape it builds one WeightManager per setting (in a fresh
process each: one sleep-enabled engine per process) and runs K steps of the seed API:
    model, optimizer = wm.as_trainable(); one step on B x S random tokens; wm.as_vllm()
timing as_trainable() and as_vllm() at the call site (the switch: both, the train step
excluded), with wm.timings' parts beside them. Settings: the engine resident (sleep level 0) or
sleeping (level 2), every sync verified or not. Only the seed API is used, so --minirl-from can
point at another checkout (e.g. a git worktree of an earlier commit) to compare two versions of
minirl in one lease.

    python benchmarks/switch.py --shape qwen3-4b --out $OUT/switch_h200_qwen3-4b.json
    python benchmarks/switch.py --shape qwen3-4b --eager --minirl-from /tmp/old --out $OUT/old.json
    python benchmarks/switch.py --shape tiny --reps 2 --out /tmp/switch.json     # CPU smoke test

Writes --out (JSON: every step of every setting, medians, device, versions) and a markdown
table beside it. Hardware: one CUDA GPU (~1 min per setting for 4B), or CPU with --shape tiny
(no sleep mode there: level 2 is skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {"resident-verified": (0, True), "resident": (0, False), "sleep2-verified": (2, True),
            "sleep2": (2, False)}


def measure(model: str, sleep_level: int, verify: bool, args) -> dict:
    """In this process: K timed switches of one WeightManager, through the seed API only."""
    import torch
    from minirl import get_logprobs
    from minirl.colocated import WeightManager, WeightManagerConfig
    kw = {"max_model_len": args.seq + 64, "gpu_memory_utilization": args.gpu_memory_utilization,
          **({"enforce_eager": True} if args.eager else {})}
    wm = WeightManager(model, lr=1e-6, config=WeightManagerConfig(sleep_level=sleep_level, verify_sync=verify), **kw)
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(args.reps + 1):                    # the first step warms up; not reported
        ids = torch.randint(0, 60, (args.batch, args.seq), generator=g).to(wm.device)
        t0 = time.perf_counter()
        net, optimizer = wm.as_trainable()
        t1 = time.perf_counter()
        loss = -get_logprobs(net(ids).logits, ids).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if wm.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        wm.as_vllm()
        t3 = time.perf_counter()
        steps.append({"as_trainable_s": t1 - t0, "train_step_s": t2 - t1, "as_vllm_s": t3 - t2,
                      "switch_s": (t1 - t0) + (t3 - t2), "policy_version": wm.policy_version, **wm.timings})
    keys = [k for k in steps[1] if isinstance(steps[1][k], (int, float))]
    out = {"sleep_level": wm.memory_plan.sleep_level, "verify": verify, "steps": steps[1:],
           "median": {k: statistics.median(s[k] for s in steps[1:] if k in s) for k in keys}}
    wm.close()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-4b", help="tiny, qwen3-0.6b or qwen3-4b")
    p.add_argument("--models-dir", default="/tmp/bench_models")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of " + ", ".join(SETTINGS))
    p.add_argument("--minirl-from", default=str(ROOT), help="the checkout whose minirl is measured")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:                                  # one setting, in a fresh process
        level, verify = SETTINGS[args.worker]
        model = str(Path(args.models_dir) / args.shape)
        print("RESULT " + json.dumps(measure(model, level, verify, args)), flush=True)
        return
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    import torch
    from models import build_random_model
    model = Path(args.models_dir) / args.shape
    if not (model / "config.json").exists():
        build_random_model(model, args.shape, device="cuda" if torch.cuda.is_available() else None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()              # the sides measure the device: give it back
    doc = {"shape": args.shape, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else
           platform.processor() or "cpu", "versions": _versions(), "argv": sys.argv[1:], "results": {},
           "minirl": _commit(args.minirl_from)}
    out = Path(args.out or ROOT / "benchmarks/results" / f"switch_{args.shape}.json")
    for name in args.settings.split(","):
        if SETTINGS[name][0] == 2 and not torch.cuda.is_available():
            continue                                 # no sleep mode on CPU
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", name]
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.minirl_from, os.environ.get("PYTHONPATH")]))}
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        doc["results"][name] = (json.loads(line[7:]) if line else {"error": res.stderr[-3000:]})
        doc["results"][name]["process_s"] = time.perf_counter() - t0
        print(name, doc["results"][name].get("median", doc["results"][name].get("error")), flush=True)
        out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(markdown(doc))


def markdown(doc) -> str:
    rows = [f"# Switch, {doc['shape']} on {doc['device']}, minirl at {doc['minirl']}\n",
            f"`python benchmarks/switch.py {' '.join(doc['argv'])}`\n",
            "| setting | switch s | as_vllm s | as_trainable s | sync s | verify s | probe gap |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in doc["results"].items():
        m = r.get("median")
        if m is None:
            rows.append(f"| {name} | error | | | | | |")
            continue
        f = lambda k: f"{m[k]:.3f}" if k in m else "-"   # noqa: E731
        rows.append(f"| {name} | {f('switch_s')} | {f('as_vllm_s')} | {f('as_trainable_s')} | {f('sync_s')} | "
                    f"{f('verify_s')} | {m['probe_gap']:.4f} |" if "probe_gap" in m else
                    f"| {name} | {f('switch_s')} | {f('as_vllm_s')} | {f('as_trainable_s')} | {f('sync_s')} | - | - |")
    return "\n".join(rows) + "\n\nMedians of the reported steps (the first, a warm-up, is dropped).\n"


def _commit(path: str) -> str:
    """The commit of the code at `path`: its COMMIT file (a `git archive` snapshot's stamp), else
    HEAD when `path` is a checkout's top (not a folder inside another checkout), else the path."""
    stamp = Path(path) / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    git = lambda *a: subprocess.run(["git", "-C", path, *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    top = git("rev-parse", "--show-toplevel")
    return git("rev-parse", "--short", "HEAD") if top and Path(top).resolve() == Path(path).resolve() else path


def _versions() -> dict:
    import ray
    import torch
    import transformers
    import vllm
    return {"torch": torch.__version__, "vllm": vllm.__version__, "transformers": transformers.__version__,
            "ray": ray.__version__, "python": platform.python_version()}


if __name__ == "__main__":
    main()
