"""Benchmark: the whole co-located GRPO step, minirl beside TRL's GRPOTrainer (vLLM colocate).

Each side runs in a fresh process on the same device, one after the other, on the same
workload: a random-init model of a real shape (benchmarks/models.py: the real 151,936-token
vocabulary), the built-in `succ` task's prompts scored by DIGITS (the fraction of the completion's
characters that are digits: the filler tokens of a random model's vocabulary, `<|f123|>`, hold
3-6 of them, so rewards differ within every group, advantages are nonzero and every step moves
the weights and syncs real changes), P prompts x G samples, completions
of at most T tokens (a random model almost never samples its EOS, so nearly all are T long; with
`--lengths lognormal` minirl's are cut at log-normal lengths, as a stop rule would end them),
bf16 compute with fp32 master weights, one optimizer step per batch, `--steps` steps.

- minirl: launch/colocated.py as a user runs it, with only model, batch and length flags
  (--model --prompts --group-size --max-tokens --max-model-len --steps); its metrics.jsonl
  gives the phases (sync: the engine's wake, load, check and sleep, each out of the phase it ran in;
  generation; training).
- TRL: GRPOTrainer(use_vllm=True, vllm_mode="colocate") with its defaults except what matching
  needs (each change is listed in the JSON under trl.changes): fp32 master weights, the batch
  (per_device_train_batch_size x gradient_accumulation_steps = P x G completions per optimizer
  step), lengths, and gradient checkpointing off where the micro-batch fits without it. Its phases are timed by
  wrapping its weight sync, vLLM call and generate-and-score step.

Reported per side: medians over the steps after --warmup of the step, generation, sync and
training seconds; generated and trained tokens/s; the device's peak memory in use (sampled every
50 ms through cudaMemGetInfo, both processes' engines included); trainer MFU = 6 * N * tokens
trained (prompt + completion) / training seconds / peak, N the model's parameter count, peak
989.4 TFLOP/s (H100 / H200 dense bf16). The floor beside them (`floor`): generation no faster than
reading the bf16 weights once an engine step and every running sequence's KV cache once a step at the
device's bandwidth (H100 3.35 TB/s, H200 4.8 TB/s; the KV reads counted from the rollouts' prompt and
completion lengths), training no faster than 6 N x tokens at the peak; `python benchmarks/step.py
--floor-of STEP.json` prints it for a JSON written before it was recorded. minirl's steps also
record their generation's engine steps (count, ms a step, sequences at once), its wall, CPU and garbage-collector seconds (and full collections,
objects frozen out of them), each training step's torch.compile graphs and seconds and allocator
retries, and what the memory plan chose (sleep level, micro-batch tokens, recomputed layers of all).

    python benchmarks/step.py --shape qwen3-0.6b --max-tokens 256 --out $OUT/step_qwen3-0.6b_256.json
    python benchmarks/step.py --shape tiny --prompts 4 --steps 3 --sides minirl --out /tmp/step.json  # CPU

Hardware: one CUDA GPU (an H200 for the figures in benchmarks/results), or CPU for the minirl
side's smoke test (TRL needs CUDA here).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PEAK_FLOPS = 989.4e12
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}    # HBM bytes/s by a substring of the device's name


def floor(n_params: int, kv_bytes: int, engine_steps: float, kv_tokens: float, trained_tokens: float,
          device: str) -> dict | None:
    """The step's floor on `device` (None where its bandwidth is unknown): generation reads the bf16
    weights (2 N bytes) every engine step and `kv_tokens` tokens of KV cache (`kv_bytes` a token) in
    all, at the device's bandwidth; training does 6 N flops a trained token at PEAK_FLOPS."""
    bw = next((b for name, b in BANDWIDTH.items() if name in device), None)
    if bw is None:
        return None
    gen = (2 * n_params * engine_steps + kv_bytes * kv_tokens) / bw
    train = 6 * n_params * trained_tokens / PEAK_FLOPS
    return {"generation_s": gen, "training_s": train, "step_s": gen + train, "bandwidth": bw}


def kv_reads(prompt_len: int, completion_len: int) -> int:
    """KV tokens one sequence's decoding reads: its t-th sampled token (t = 0..L-1) attends to the
    prompt and the t tokens before it, so sum_t (P + t) = L P + L (L - 1) / 2."""
    return completion_len * prompt_len + completion_len * (completion_len - 1) // 2


class MemorySampler:
    """The device's peak memory in use (total - free), sampled every `every` seconds."""

    def __init__(self, every: float = 0.05):
        import torch
        self.peak, self.cuda = 0, torch.cuda.is_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        if self.cuda:
            self._thread.start()

    def _run(self, every):
        import torch
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(every)

    def stop(self) -> float:
        self._stop.set()
        return self.peak / 2**30


def digit_fraction(prompt: str, completion: str, answer=None) -> float:
    """The DIGITS reward: the fraction of the completion's characters that are digits (0 if empty)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def digits_task():
    """`succ`'s prompts scored by digit_fraction (a task the launch scripts accept as --task digits)."""
    from minirl.recipes import tasks
    task = tasks.Task("digits", tasks.TASKS["succ"].make, digit_fraction)
    tasks.TASKS.setdefault("digits", task)
    return task


def run_minirl(args, model: str) -> dict:
    import importlib.util
    digits_task()                                         # before the launcher reads its --task choices
    sys.path.insert(0, str(ROOT / "launch"))              # for its `import common`
    spec = importlib.util.spec_from_file_location("colocated", ROOT / "launch" / "colocated.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run_dir = Path(args.work) / f"minirl-{args.shape}-{args.max_tokens}-{int(time.time())}"   # a fresh metrics.jsonl
    argv = ["--model", model, "--task", "digits", "--prompts", str(args.prompts), "--group-size", str(args.group_size),
            "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_tokens + 64),
            "--steps", str(args.steps), "--backends", "", "--run-dir", str(run_dir), "--traceback",  # a failure's trace kept
            *args.minirl_args]
    if args.lengths == "lognormal":
        varied_lengths(mod, args)                         # before the records: they time this loop's rollouts
    engine, seen = _record_engine_steps(mod), {}
    training = _record_training(mod)
    real_close = mod.WeightManager.close

    def close(wm):                                        # what the memory plan chose, for the record
        plan = wm.memory_plan
        seen.update(sleep_level=plan.sleep_level, offload_optimizer=plan.offload_optimizer,
                    micro_batch_tokens=plan.micro_batch_tokens, activation_checkpointing=plan.recomputed_layers > 0,
                    recomputed_layers=plan.recomputed_layers, layers=wm.trainer.num_layers,
                    memory_plan=dataclasses.asdict(plan))
        return real_close(wm)
    mod.WeightManager.close = close
    if args.profile:
        _profile_last_step(mod, args)
    mem = MemorySampler()
    t0 = time.time()
    mod.common.main(mod.run, mod.common.parse_args(mod.__doc__, str(run_dir), argv))
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    starts = [t0] + [r["time"] for r in rows[:-1]]
    steps = []
    for r, start in zip(rows, starts):
        parts = {f"sync_{k}": r.get(f"sync/{k}", 0.0) for k in ("wake_s", "sync_s", "verify_s", "sleep_s", "offload_s")}
        sync, slept = sum(parts.values()), parts["sync_sleep_s"]   # the engine sleeps in the training phase
        n = args.prompts * args.group_size
        steps.append({"step_s": r["time"] - start, "sync_s": sync, **parts,
                      "generate_s": r["time/rollouts"] - (sync - slept), "train_s": r["time/train"] - slept,
                      "generated_tokens": r["len/completion"] * n,
                      "trained_tokens": (r["len/completion"] + r["len/prompt"]) * n, "loss": r["loss"],
                      "reward": r["reward/mean"], "adv_abs_mean": r["adv/abs_mean"], "grad_norm": r["grad_norm"],
                      "probe_gap": r.get("sync/probe_gap")})
    for s, e, c in zip(steps, engine, training):
        s.update(e, **c)
    return {"argv": argv, "steps": steps, "peak_memory_gib": mem.stop(), **seen, "command":
            "python launch/colocated.py " + " ".join(argv)}


def _allocator() -> tuple[int, int]:
    """The CUDA allocator's retries (its cache freed to fit an allocation) and device allocations so far."""
    import torch
    st = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return st.get("num_alloc_retries", 0), st.get("num_device_alloc", 0)


def _record_training(mod) -> list[dict]:
    """Each training step's torch.compile work and allocator events (launch's train_step wrapped):
    graphs compiled by Dynamo, the seconds Dynamo and Inductor spent compiling, and the CUDA
    allocator's retries (its cache freed to fit an allocation) and fresh device allocations. A step
    slow only once with none of these lost its time elsewhere (e.g. kernels built at first launch)."""
    import torch._dynamo.utils as du
    calls, real = [], mod.common.train_step

    def seconds() -> float:                               # frames (forward included), then backward graphs
        times = getattr(du, "compilation_time_metrics", {})
        return sum(sum(times.get(k, ())) for k in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"))

    def train_step(*a, **kw):
        graphs, t, (retries, allocs) = du.counters["stats"]["unique_graphs"], seconds(), _allocator()
        out = real(*a, **kw)
        now = _allocator()
        calls.append({"train_graphs": du.counters["stats"]["unique_graphs"] - graphs,
                      "train_compile_s": round(seconds() - t, 3), "train_alloc_retries": now[0] - retries,
                      "train_device_allocs": now[1] - allocs})
        return out
    mod.common.train_step = train_step
    return calls


def varied_lengths(mod, args) -> None:
    """The --lengths lognormal workload: each of the loop's rollouts (run_episodes wrapped) runs one
    turn whose max_tokens is drawn per episode from a log-normal (median --length-median x
    --max-tokens, sigma --length-sigma, cut at --max-tokens), as a stop rule ending completions at
    varied lengths would, scored by DIGITS; seeded by the rollout's number and the episode's."""
    import random
    real, calls = mod.run_episodes, itertools.count(1)

    def run_episodes(llm, episode, *a, **kw):
        k = next(calls)

        async def cut(ep) -> float:
            rng = random.Random(f"{args.length_seed}/{k}/{ep.index}")
            n = rng.lognormvariate(math.log(args.length_median * args.max_tokens), args.length_sigma)
            turn = await ep.generate(max_tokens=max(1, min(args.max_tokens, round(n))))
            return digit_fraction(ep.prompt, turn.text)
        return real(llm, cut, *a, **kw)
    mod.run_episodes = run_episodes


def _record_engine_steps(mod) -> list[dict]:
    """Each generation phase's engine steps (vllm_compat.recorded_steps around the loop's
    run_episodes): how many, their mean milliseconds, the most tokens one scheduled (the sequences
    decoding at once) and how many mixed in prefill; and the phase's wall, this thread's CPU
    seconds and the seconds in Python's garbage collector (a CPU-bound engine loop shows CPU
    close to wall; so does one spin-waiting on the device), every thread's CPU seconds, the
    host's 1-minute load, and the CUDA allocator's retries (a full cache freed and the allocation
    tried again) and fresh device allocations in the phase. One dict per call, in step order."""
    import gc
    import os
    from minirl import vllm_compat as vc
    calls, real, in_gc = [], mod.run_episodes, [0.0, 0.0, 0]

    def collecting(phase, info):
        if phase == "start":
            in_gc[1] = time.perf_counter()
        else:
            in_gc[0] += time.perf_counter() - in_gc[1]
            in_gc[2] += info["generation"] == 2

    def run_episodes(llm, *a, **kw):
        in_gc[0], in_gc[2], wall, cpu = 0.0, 0, time.perf_counter(), time.thread_time()
        every, (retries, allocs) = time.process_time(), _allocator()
        gc.callbacks.append(collecting)
        try:
            with vc.recorded_steps(llm) as steps:
                out = real(llm, *a, **kw)
        finally:
            gc.callbacks.remove(collecting)
        tokens, now = [n for _, n, _ in steps if n], _allocator()
        reads = sum(kv_reads(len(r.prompt_ids), len(r.completion_ids)) for batch in out for r in batch)
        calls.append({"engine_steps": len(steps), "engine_step_ms": 1e3 * sum(t for t, _, _ in steps) / max(len(steps), 1),
                      "engine_s": sum(t for t, _, _ in steps), "max_batch_tokens": max(tokens, default=0),
                      "prefill_steps": sum(bool(p) for _, _, p in steps), "rollout_wall_s": time.perf_counter() - wall,
                      "rollout_cpu_s": time.thread_time() - cpu, "gc_s": in_gc[0], "gc_full": in_gc[2],
                      "gc_frozen": gc.get_freeze_count(), "process_cpu_s": time.process_time() - every,
                      "loadavg_1m": os.getloadavg()[0], "alloc_retries": now[0] - retries,
                      "device_allocs": now[1] - allocs, "kv_reads": reads})
        return out
    mod.run_episodes = run_episodes
    return calls


def _profile_last_step(mod, args) -> None:
    """With --profile DIR: the last step's generation and training run under torch.profiler; the
    top operators by device and by host time go to DIR/{generate,train}.txt, with the share of the
    phase's wall time the device was busy (summed kernel time / wall). That step is left out of
    the medians."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)

    def profiled(fn, name):
        def wrapper(*a, **kw):
            if wrapper.calls < args.steps - 1:
                wrapper.calls += 1
                return fn(*a, **kw)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            t = time.perf_counter()
            with profile(activities=acts) as prof:
                result = fn(*a, **kw)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            wall = time.perf_counter() - t
            ev = prof.key_averages()
            dev = sum(e.self_device_time_total for e in ev) / 1e6
            lines = [f"{name}: wall {wall:.3f} s, device busy {dev:.3f} s ({100 * dev / wall:.0f}%)", "",
                     ev.table(sort_by="self_device_time_total" if acts[1:] else "self_cpu_time_total", row_limit=30),
                     ev.table(sort_by="self_cpu_time_total", row_limit=25)]
            (out / f"{name}.txt").write_text("\n".join(lines))
            return result
        wrapper.calls = 0
        return wrapper

    mod.common.train_step = profiled(mod.common.train_step, "train")
    mod.run_episodes = profiled(mod.run_episodes, "generate")   # the loop's rollouts


def run_trl(args, model: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    task = digits_task()
    prompts, answers = task.sample(args.prompts * (args.steps + 1), seed=0)
    mb = args.trl_micro_batch
    n = args.prompts * args.group_size
    changes = {"model_init_kwargs": {"dtype": "float32"}, "per_device_train_batch_size": mb,
               "gradient_accumulation_steps": n // mb, "num_generations": args.group_size,
               "max_completion_length": args.max_tokens, "vllm_max_model_length": args.max_tokens + 64,
               "use_vllm": True, "vllm_mode": "colocate", "gradient_checkpointing": args.trl_grad_ckpt,
               "max_steps": args.steps, "report_to": "none", "save_strategy": "no", "logging_steps": 1}
    if not torch.cuda.is_available():           # a CPU smoke test of this harness only
        changes.update(use_cpu=True, bf16=False)
    config = GRPOConfig(output_dir=str(Path(args.work) / "trl"), **{**changes, "model_init_kwargs":
                        {"dtype": torch.float32}})

    def reward(prompts, completions, answer, **_):
        return [task.reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    phases: dict[str, float] = {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(obj, name, key):
        real = getattr(obj, name)

        def wrapper(*a, **kw):
            sync()
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                sync()
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapper)

    steps, mark = [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            sync()
            mark["t"] = time.perf_counter()
            phases.clear()

        def on_step_end(self, *a, **kw):
            sync()
            p = dict(phases)
            step = time.perf_counter() - mark["t"]
            steps.append({"step_s": step, "sync_s": p.get("sync", 0.0), "generate_s": p.get("generate", 0.0),
                          "rollout_s": p.get("rollout", 0.0), "train_s": step - p.get("rollout", 0.0)})

    mem = MemorySampler()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, callbacks=[Clock()],
                          train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}))
    timed(trainer.vllm_generation, "sync_weights", "sync")
    timed(trainer.vllm_generation, "generate", "generate")
    timed(trainer, "_generate_and_score_completions", "rollout")
    gen_len = []
    real_score = trainer._generate_and_score_completions

    def score(*a, **kw):           # completion lengths, for the token counts
        out = real_score(*a, **kw)
        gen_len.append((float(out["completion_mask"].sum()), int(out["prompt_ids"].numel())))
        return out
    trainer._generate_and_score_completions = score
    trainer.train()
    per_step = len(gen_len) // max(len(steps), 1)
    for i, s in enumerate(steps):
        part = gen_len[i * per_step:(i + 1) * per_step]
        s["generated_tokens"] = sum(c for c, _ in part)
        s["trained_tokens"] = sum(c + p for c, p in part)
    return {"changes": changes, "engine": "vLLM's default compilation (as minirl's)",
            "steps": steps, "peak_memory_gib": mem.stop(), "trl": __import__("trl").__version__}


def summarize(side: dict, args, n_params: int) -> dict:
    steps = side["steps"][:-1] if args.profile and len(side["steps"]) > 1 else side["steps"]
    keep = steps[args.warmup:] or steps
    med = {k: statistics.median(s[k] for s in keep) for k in keep[0] if isinstance(keep[0][k], (int, float))}
    med["generated_tokens_per_s"] = med["generated_tokens"] / med["step_s"]
    med["trained_tokens_per_s"] = med["trained_tokens"] / med["step_s"]
    med["mfu"] = 6 * n_params * med["trained_tokens"] / med["train_s"] / PEAK_FLOPS
    med["other_s"] = med["step_s"] - med["generate_s"] - med["sync_s"] - med["train_s"]
    return med


def kv_bytes(config) -> int:
    """Bytes of bf16 KV cache a token: K and V of every layer's KV heads."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2


def add_floor(doc: dict, config: dict) -> None:
    """doc["floor"] from minirl's medians (its engine steps and KV reads; for a JSON without them,
    completions of equal length: every row of the README's table), and each side's share of it."""
    m = doc["sides"].get("minirl", {}).get("median")
    if m is None:
        return
    n = doc["workload"]["prompts"] * doc["workload"]["group_size"]
    P, L = (m["trained_tokens"] - m["generated_tokens"]) / n, m["generated_tokens"] / n
    doc["floor"] = f = floor(doc["n_params"], kv_bytes(config), m.get("engine_steps", L + 1),
                             m.get("kv_reads", n * (L * P + L * (L - 1) / 2)), m["trained_tokens"], doc["device"])
    for r in doc["sides"].values():
        if f and "median" in r:
            r["median"].update(generation_of_floor=f["generation_s"] / r["median"]["generate_s"],
                               step_of_floor=f["step_s"] / r["median"]["step_s"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--models-dir", default="/tmp/bench_models")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--sides", default="minirl,trl")
    p.add_argument("--trl-micro-batch", type=int, default=64, help="TRL's per_device_train_batch_size")
    p.add_argument("--trl-grad-ckpt", action="store_true", help="TRL with gradient checkpointing (its default)")
    p.add_argument("--lengths", default="max", choices=["max", "lognormal"],
                   help="minirl: completions as the model ends them (random weights: all --max-tokens long), "
                        "or cut at log-normal lengths (varied_lengths)")
    p.add_argument("--length-median", type=float, default=0.35, help="lognormal: median, a fraction of --max-tokens")
    p.add_argument("--length-sigma", type=float, default=0.8, help="lognormal: sigma of log(length)")
    p.add_argument("--length-seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/bench_step")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, metavar="DIR", help="minirl: profile the last step into DIR")
    p.add_argument("--minirl-args", type=shlex.split, default=[], metavar="ARGS",
                   help="more launch/colocated.py flags, one string (e.g. --compilation-config '{...}')")
    p.add_argument("--floor-of", metavar="JSON", help="print the floor of a step JSON written without it")
    p.add_argument("--side", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.floor_of:
        from models import SHAPES
        doc = json.loads(Path(args.floor_of).read_text())
        add_floor(doc, SHAPES[doc["shape"]])
        print(json.dumps({"floor": doc.get("floor"), **{side: {k: r["median"][k] for k in (
            "step_s", "generate_s", "generation_of_floor", "step_of_floor") if k in r["median"]}
            for side, r in doc["sides"].items() if "median" in r}}, indent=1))
        return
    model = str(Path(args.models_dir) / args.shape)
    if args.side:                                  # one side, in this fresh process
        res = (run_minirl if args.side == "minirl" else run_trl)(args, model)
        print("RESULT " + json.dumps(res), flush=True)
        return
    import torch
    from models import build_random_model
    if not Path(model, "config.json").exists():
        build_random_model(model, args.shape, device="cuda" if torch.cuda.is_available() else None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()              # the sides measure the device: give it back
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(model)
        n_params = sum(x.numel() for x in AutoModelForCausalLM.from_config(config).parameters())
    doc = {"shape": args.shape, "n_params": n_params, "workload": vars(args), "device":
           torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "sides": {}}
    out = Path(args.out or ROOT / "benchmarks/results" / f"step_{args.shape}_{args.max_tokens}.json")
    for side in args.sides.split(","):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side], capture_output=True,
                             text=True, timeout=args.timeout)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"error": (res.stdout[-2000:] + res.stderr[-6000:])}
        r["process_s"] = time.perf_counter() - t0
        if "steps" in r:
            r["median"] = summarize(r, args, n_params)
        doc["sides"][side] = r
        add_floor(doc, config.to_dict())
        print(side, r.get("median", r.get("error")), flush=True)
        out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(markdown(doc))


def markdown(doc) -> str:
    w = doc["workload"]
    rows = [f"# Whole GRPO step, {doc['shape']} ({doc['n_params'] / 1e9:.2f}B parameters) on {doc['device']}\n",
            f"{w['prompts']} prompts x {w['group_size']} samples, completions of {w['max_tokens']} tokens at most; "
            f"medians of steps {w['warmup'] + 1}..{w['steps']}.\n",
            "| side | step s | generation s | sync s | training s | other s | generated tok/s | trained tok/s | "
            "peak memory GiB | trainer MFU |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for side, r in doc["sides"].items():
        m = r.get("median")
        if m is None:
            rows.append(f"| {side} | error: see JSON | | | | | | | | |")
            continue
        rows.append(f"| {side} | {m['step_s']:.2f} | {m['generate_s']:.2f} | {m['sync_s']:.3f} | {m['train_s']:.2f} | "
                    f"{m['other_s']:.2f} | "
                    f"{m['generated_tokens_per_s']:,.0f} | {m['trained_tokens_per_s']:,.0f} | "
                    f"{r['peak_memory_gib']:.1f} | {100 * m['mfu']:.1f}% |")
    if doc.get("floor"):
        f = doc["floor"]
        rows.append(f"\nFloor on this device: generation {f['generation_s']:.2f} s + training {f['training_s']:.2f} s "
                    f"= {f['step_s']:.2f} s; " + "; ".join(
                        f"{side} at {100 * r['median']['generation_of_floor']:.0f}% of it in generation, "
                        f"{100 * r['median']['step_of_floor']:.0f}% over the step"
                        for side, r in doc["sides"].items() if "median" in r) + ".")
    if "minirl" in doc["sides"] and "trl" in doc["sides"] and "median" in doc["sides"]["trl"] \
            and "median" in doc["sides"]["minirl"]:
        ratio = doc["sides"]["trl"]["median"]["step_s"] / doc["sides"]["minirl"]["median"]["step_s"]
        rows.append(f"\nminirl's step throughput / TRL's: **{ratio:.2f}x**.")
    rows.append("\nMFU = 6 N (prompt + completion tokens trained) / training seconds / 989.4 TFLOP/s. "
                "Other: the rest of the step (scoring; for TRL also its old-log-prob forward, "
                "vllm_importance_sampling_correction being its default). TRL's changes from its defaults "
                "are in the JSON.")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
