"""Benchmark: which training modes fit co-located on one GPU, for Qwen3 0.6B / 1.7B / 4B / 8B shapes.

Each cell (shape x mode x reference) runs in a fresh process: a WeightManager on a random-init
model of the real shape (benchmarks/models.py), then `--steps` co-located GRPO steps at a fixed
batch (as_vllm -> generate --prompts x --group-size completions of --max-tokens tokens ->
as_trainable -> forward_backward -> optim_step; a warm-up step first, not reported). Modes: full
(fp32 master weights + AdamW on the GPU), lora (rank 16, all linear layers), offload (parameters,
gradients and AdamW state on the host); each without and with a reference policy (KL, k3, 0.01:
with LoRA the base model is the reference; with full/offload a second model, on the host with
offload). Fixed settings for every cell, so that cells compare and start fast: activation
checkpointing on, layers not compiled, the engine asleep (level 2) while training with a --kv-cache-gib KV cache, eager
(no CUDA graphs); the memory plan's start-up trial is skipped. Cells that
WeightManager's own check (minirl.memory.check_fits: the device, and host memory with offload)
refuses are not started ("does not fit (estimate): " and its message); a cell that fails to fit
later reports the MemoryError's message. Peak memory: the device's used memory
(total - free, polled every 20 ms: trainer, engine and caches together) and torch's peak
allocation (the trainer's tensors). All cells without a reference run first, smallest shape
first, then those with one, within --budget seconds; cells left over are reported as not run.

    python benchmarks/modes.py --out $OUT/modes                         # one H200, < 9 min
    python benchmarks/modes.py --shapes tiny --modes full,lora --steps 1 --out /tmp/modes   # CPU smoke
    python benchmarks/modes.py --merge benchmarks/results/2026-12-01-d/lease_a/modes_h200_partial.json --out $OUT/modes
                                      # the cells that run has not measured (its rows are kept, marked)

Writes OUT/modes.json (every cell, its steps, device, versions) and OUT/modes.md (the table).
Hardware: one CUDA GPU; CPU with --shapes tiny (no memory figures there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("full", "lora", "offload")
SHAPES = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")


def trainer_config(mode: str, reference: bool, args):
    from minirl.lora import LoRAConfig
    from minirl.trainer import TrainerConfig
    return TrainerConfig(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens, reference=reference,
                         activation_checkpointing=True, compile=False,   # no per-cell compile time
                         lora=LoRAConfig(rank=16) if mode == "lora" else None, cpu_offload=mode == "offload",
                         reference_offload=reference and mode == "offload")


def measure(model: str, mode: str, reference: bool, args) -> dict:
    """In this process: one WeightManager, a warm-up step and args.steps timed GRPO steps."""
    import torch
    from vllm import SamplingParams
    from minirl import WeightManager, parse_vllm_outputs, ppo_loss_fn
    from minirl.colocated import WeightManagerConfig
    from minirl.memory import estimate_memory
    from minirl.reference import kl_penalty
    from minirl.recipes.tasks import get_task
    cuda = torch.cuda.is_available()
    used, stop = [0], threading.Event()

    def poll():                        # the whole device's used memory: trainer + engine + caches
        while not stop.wait(0.02):
            free, total = torch.cuda.mem_get_info()
            used[0] = max(used[0], total - free)
    if cuda:
        threading.Thread(target=poll, daemon=True).start()
    t0 = time.perf_counter()
    cfg = trainer_config(mode, reference, args)
    kw = dict(max_model_len=args.max_tokens + 64, max_num_seqs=args.prompts * args.group_size,
              enforce_eager=True)
    if cuda:                           # sized here: the memory plan's start-up trial is skipped
        kv = args.kv_cache_gib * 2**30
        engine = estimate_memory(model, cfg, max_model_len=kw["max_model_len"])["engine"] + kv
        kw |= {"kv_cache_memory_bytes": int(kv),
               "gpu_memory_utilization": round(engine / torch.cuda.mem_get_info()[1] + 0.01, 3)}
    wm = WeightManager(model, config=WeightManagerConfig(trainer=cfg, sleep_level=2 if cuda else None), **kw)
    build_s = time.perf_counter() - t0
    task, loss_fn = get_task("succ"), ppo_loss_fn()
    if reference:
        loss_fn = kl_penalty(loss_fn, coef=0.01, estimator="k3")
    steps = []
    for step in range(args.steps + 1):
        prompts, answers = task.sample(args.prompts, seed=step)
        t1 = time.perf_counter()
        llm = wm.as_vllm()
        t2 = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(n=args.group_size, max_tokens=args.max_tokens,
                                                       min_tokens=args.max_tokens, logprobs=0, seed=step),
                               use_tqdm=False)
        batches = parse_vllm_outputs(outputs, args.group_size, task.reward, metadata=answers,
                                     policy_version=wm.policy_version, device=wm.device)
        for b in batches:
            b.compute_advantages()
        t3 = time.perf_counter()
        wm.as_trainable()
        out = wm.trainer.forward_backward([r for b in batches for r in b], loss_fn) | wm.trainer.optim_step()
        if cuda:
            torch.cuda.synchronize()
        t4 = time.perf_counter()
        steps.append({"step_s": t4 - t1, "switch_s": t2 - t1, "generate_s": t3 - t2, "train_s": t4 - t3,
                      "tokens": out["tokens"], "kl_ref": out.get("kl_ref"), **wm.timings})
    stop.set()
    result = {"build_s": build_s, "sleep_level": wm.memory_plan.sleep_level, "steps": steps[1:],
              "step_s": sorted(s["step_s"] for s in steps[1:])[len(steps[1:]) // 2],
              "peak_device_gib": used[0] / 2**30 if cuda else None,
              "peak_torch_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    wm.close()
    return result


def cells(args):
    return [(s, m, r) for r in (False, True) for s in args.shapes.split(",") for m in args.modes.split(",")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--shapes", default=",".join(SHAPES)), add("--modes", default=",".join(MODES))
    add("--models-dir", default="/tmp/bench_models")
    add("--steps", type=int, default=2, help="timed steps per cell (after one warm-up)")
    add("--prompts", type=int, default=8), add("--group-size", type=int, default=8)
    add("--max-tokens", type=int, default=128, help="completion length (min_tokens too: fixed)")
    add("--micro-batch-tokens", type=int, default=8192), add("--kv-cache-gib", type=float, default=4.0)
    add("--budget", type=float, default=510, help="seconds for all cells (models built inside)")
    add("--out", default=str(ROOT / "benchmarks/results/modes"))
    add("--merge", default=None, metavar="MODES_JSON", help="keep the cells an earlier run measured; run the rest")
    add("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    if args.worker:                                  # one cell, in a fresh process
        shape, mode, ref = args.worker.split(":")
        try:
            res = measure(str(Path(args.models_dir) / shape), mode, ref == "ref", args)
        except MemoryError as e:
            res = {"error": f"does not fit: {e}"}
        print("RESULT " + json.dumps(res), flush=True)
        return
    import psutil
    import torch
    from models import build_random_model
    from switch import _commit, _versions
    from minirl.memory import check_fits, estimate_memory
    cuda, start = torch.cuda.is_available(), time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "versions": _versions(),
           "minirl": _commit(str(ROOT)), "argv": sys.argv[1:], "cells": {}}
    done = json.loads(Path(args.merge).read_text())["cells"] if args.merge else {}
    for shape, mode, ref in cells(args):
        (out / "modes.json").write_text(json.dumps(doc, indent=1))   # every cell so far, merged ones too
        name = f"{shape}:{mode}:{'ref' if ref else 'noref'}"
        if "step_s" in done.get(name, {}):
            doc["cells"][name] = {**done[name], "from": args.merge}
            continue
        model = Path(args.models_dir) / shape
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            doc["cells"][name] = {"error": "not run (time budget)"}
            continue
        if not (model / "config.json").exists():
            build_random_model(model, shape, device="cuda" if cuda else None)
            torch.cuda.empty_cache() if cuda else None
        if cuda:
            est = estimate_memory(str(model), trainer_config(mode, ref, args),
                                  max_model_len=args.max_tokens + 64)
            try:                       # the check WeightManager makes, here before a process starts
                check_fits(est, torch.cuda.mem_get_info()[1], torch.cuda.get_device_name(),
                           host_available=psutil.virtual_memory().available)
            except MemoryError as e:
                doc["cells"][name] = {"error": f"does not fit (estimate): {e}", "estimate": est}
                continue
        t0 = time.perf_counter()
        try:
            res = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", name],
                                 capture_output=True, text=True, timeout=left - 10)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            cell = json.loads(line[7:]) if line else {"error": _failure(res.returncode, res.stderr)}
        except subprocess.TimeoutExpired:
            cell = {"error": "not finished (time budget)"}
        doc["cells"][name] = {**cell, "process_s": time.perf_counter() - t0}
        print(name, {k: v for k, v in doc["cells"][name].items() if k != "steps"}, flush=True)
    doc["total_s"] = time.perf_counter() - start
    (out / "modes.json").write_text(json.dumps(doc, indent=1))
    (out / "modes.md").write_text(markdown(doc, args))


def _failure(returncode: int, stderr: str) -> str:
    """The last error line of a failed cell (an OOM or a traceback's message); a process killed
    without one (e.g. the host out of memory) by its exit code."""
    lines = [x for x in stderr.splitlines() if "Error" in x or "error" in x]
    if lines:
        return lines[-1].strip()[:400]
    return f"the cell's process exited with code {returncode} and no Python error" + (
        " (killed by a signal: e.g. the host out of memory)" if returncode < 0 or returncode == 137 else "")


def markdown(doc, args) -> str:
    rows = [f"# Training modes co-located on one {doc['device']} (minirl {doc['minirl']})\n",
            f"`python benchmarks/modes.py {' '.join(doc['argv'])}`: {args.prompts} prompts x "
            f"{args.group_size} completions x {args.max_tokens} tokens per step, median of the timed "
            f"steps after a warm-up (column 'steps'); engines eager; total {doc.get('total_s', 0):.0f} s.\n",
            "| shape | mode | reference | step s | generate s | train s | peak device GiB | peak torch GiB | "
            "sleep level | steps | note |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, c in doc["cells"].items():
        shape, mode, ref = name.split(":")
        head = f"| {shape} | {mode} | {'yes' if ref == 'ref' else 'no'} |"
        if "error" in c:
            rows.append(f"{head} | | | | | | | {c['error'][:300].replace('|', '/')} |")
            continue
        med = lambda k: sorted(s[k] for s in c["steps"])[len(c["steps"]) // 2]    # noqa: E731
        gib = lambda v: "-" if v is None else f"{v:.1f}"                            # noqa: E731
        note = f"earlier run ({Path(c['from']).name})" if "from" in c else ""
        rows.append(f"{head} {c['step_s']:.2f} | {med('generate_s'):.2f} | {med('train_s'):.2f} | "
                    f"{gib(c['peak_device_gib'])} | {gib(c['peak_torch_gib'])} | {c['sleep_level']} | {len(c['steps'])} | {note} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
