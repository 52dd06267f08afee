"""Benchmark: multi-turn episodes with tool waits against single-turn generation of the same tokens,
on one engine through minirl.episodes (continuous batching: a turn's next request enters as soon as
its tool answers, while the other episodes generate).

    python benchmarks/episodes.py                                  # one H200: Qwen3-0.6B shape, CUDA graphs
    python benchmarks/episodes.py --shape tiny --episodes 16 --turn-tokens 8 16 --latency-ms 0 50   # CPU smoke

Workload (seeded): E episodes at once (default 256), each of T turns (3) whose sampled lengths are
drawn uniformly from --turn-tokens (forced: ignore_eos, max_tokens), with --env-tokens tool tokens
appended after each turn but the last, following a tool wait drawn uniformly from --latency-ms.
The baseline generates, on the same engine and path, E single-turn requests of each episode's total
sampled length. Reported: sampled tokens/s of each (after a warm-up of both), and their ratio
(target >= 0.9: tool waits hidden by concurrency); a raw `llm.generate` of the baseline as a check
of the path's own overhead. Where the time goes, per run: engine steps, seconds inside them
(vllm_compat.recorded_steps) vs the loop's own (wall minus steps: admission, the asyncio loop, tool
waits with nothing to step, Rollout assembly), ms per step, and the steps whose batch held prefill
tokens (a prompt, a new turn) against decode-only ones, with their mean ms. Writes --out (JSON) and a
markdown table beside it. Random-init weights (benchmarks/models.py), nothing downloaded.
Hardware: one GPU (about 2 minutes), or CPU (smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def plan(args, seed: int) -> list[dict]:
    """Per episode: its turns' lengths, tool latencies (s) and tool tokens."""
    rng = random.Random(seed)
    lo, hi = args.turn_tokens
    return [{"lengths": [rng.randint(lo, hi) for _ in range(args.turns)],
             "latency": [rng.uniform(*args.latency_ms) / 1000 for _ in range(args.turns - 1)],
             "tool": [[rng.randrange(2, 60) for _ in range(args.env_tokens)] for _ in range(args.turns - 1)]}
            for _ in range(args.episodes)]


def episodes(runner, work: list[dict], prompts: list[list[int]]) -> dict:
    async def episode(ep):
        w = work[ep.index]
        for k, n in enumerate(w["lengths"]):
            await ep.generate(max_tokens=n, ignore_eos=True)
            if k < len(w["latency"]):
                await ep.call(asyncio.sleep, w["latency"][k])      # the tool's latency
                ep.append(w["tool"][k])
        return 0.0
    return timed(runner.llm, lambda: runner.run(episode, prompts), runner)


def single_turn(runner, work: list[dict], prompts: list[list[int]]) -> dict:
    async def episode(ep):
        await ep.generate(max_tokens=sum(work[ep.index]["lengths"]), ignore_eos=True)
        return 0.0
    return timed(runner.llm, lambda: runner.run(episode, prompts), runner)


def timed(llm, fn, runner=None) -> dict:
    """Run fn (RolloutBatches through runner, or llm.generate's outputs) with its engine steps recorded."""
    from minirl import vllm_compat as vc
    before = dict(runner.stats) if runner is not None else {}
    with vc.recorded_steps(llm) as steps:
        t0 = time.perf_counter()
        batches = fn()
        wall = time.perf_counter() - t0
    if runner is None:
        sampled = sum(len(o.outputs[0].token_ids) for o in batches)
    else:
        sampled = sum(sum(r.loss_mask) for b in batches for r in b)
    out = {"wall_s": round(wall, 3), "sampled_tokens": sampled, "tokens_per_s": round(sampled / wall, 1)}
    if runner is not None:
        out.update(turns=sum(r.info["turns"] for b in batches for r in b),
                   episode_s=[r.info["episode_s"] for b in batches for r in b],
                   admissions=runner.stats["admissions"] - before["admissions"],
                   loop_turns=runner.stats["yields"] - before["yields"],   # event-loop turns between steps
                   busy_s=round(runner.stats["busy_s"] - before["busy_s"], 3),   # steps + admissions
                   idle_s=round(runner.stats["idle_s"] - before["idle_s"], 3))   # every episode in a tool
    return {**out, **step_summary(steps, wall - out.get("idle_s", 0.0), vc.cudagraph_limit(llm))}


def step_summary(steps: list[tuple], wall: float, graph_limit: int | None = None) -> dict:
    """Engine steps of one run (vllm_compat.recorded_steps' records): how many, seconds inside them,
    the rest of `wall` (the run's time less idle waits: the loop's own), mean ms a step; steps whose
    batch held prefill tokens vs decode-only ones (None where the scheduler was out of reach), the
    prefill steps' mean scheduled tokens, and how many steps scheduled more tokens than the largest
    CUDA graph (graph_limit: those run without one)."""
    ms = lambda xs: round(1e3 * sum(xs) / len(xs), 3) if xs else None
    inside = sum(s for s, _, _ in steps)
    prefill = [s for s, _, p in steps if p is True]
    decode = [s for s, _, p in steps if p is False]
    known = bool(prefill or decode)
    tokens = [n for _, n, p in steps if p is True and n is not None]
    return {"engine_steps": len(steps), "step_s": round(inside, 3), "loop_s": round(wall - inside, 3),
            "ms_per_step": ms([s for s, _, _ in steps]),
            "prefill_steps": len(prefill) if known else None, "prefill_ms": ms(prefill),
            "prefill_tokens": round(sum(tokens) / len(tokens), 1) if tokens else None,
            "decode_steps": len(decode) if known else None, "decode_ms": ms(decode),
            "over_graph_limit": sum(n > graph_limit for _, n, _ in steps if n is not None) if graph_limit else None,
            "loop_ms_per_step": round(1e3 * (wall - inside) / len(steps), 3) if steps else None}


def raw_generate(llm, work, prompts) -> dict:
    from minirl import vllm_compat as vc
    sps = [vc.SamplingParams(max_tokens=sum(w["lengths"]), ignore_eos=True, logprobs=0, detokenize=False)
           for w in work]
    return timed(llm, lambda: llm.generate([vc.TokensPrompt(prompt_token_ids=p) for p in prompts], sps,
                                           use_tqdm=False))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", help="benchmarks/models.py shape, or tiny")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, nargs=2, default=[128, 384], metavar=("LO", "HI"))
    p.add_argument("--env-tokens", type=int, default=32, help="tool tokens appended after a turn")
    p.add_argument("--latency-ms", type=float, nargs=2, default=[0.0, 500.0], metavar=("LO", "HI"))
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--compilation-config", type=json.loads, default=None, metavar="JSON",
                   help="vLLM's compilation_config (default: minirl's engine default); '{}': vLLM's own")
    p.add_argument("--engine-kwargs", type=json.loads, default={}, metavar="JSON",
                   help='more vllm.LLM arguments, e.g. \'{"attention_backend": "FLASH_ATTN"}\'')
    p.add_argument("--admit-wait-steps", type=int, nargs="+", default=None,
                   help="EpisodeConfig.admit_wait_steps (default: its default); several: one episode run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/episodes.json")
    args = p.parse_args(argv)
    from models import build_random_model
    from minirl import vllm_compat as vc
    from minirl.episodes import EpisodeConfig, EpisodeRunner

    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_model(Path(tmp) / args.shape, args.shape, device=None if vc.ON_CPU else "cuda")
        if not vc.ON_CPU:
            import torch
            torch.cuda.empty_cache()                  # the engine plans its memory from what is free
        max_len = args.prompt_tokens + args.turns * (args.turn_tokens[1] + args.env_tokens) + 8
        user = {"max_model_len": max_len, "max_num_seqs": args.episodes, **({"enforce_eager": True} if args.eager else {}),
                **({} if args.compilation_config is None else {"compilation_config": args.compilation_config}),
                **args.engine_kwargs}
        t0 = time.perf_counter()
        llm = vc.build_llm(str(path), **vc.engine_kwargs(user, sleep=False, seed=args.seed, colocated=False))
        start_s = time.perf_counter() - t0
        waits = args.admit_wait_steps or [EpisodeConfig().admit_wait_steps]
        runners = [EpisodeRunner(llm, config=EpisodeConfig(admit_wait_steps=w)) for w in waits]
        rng = random.Random(args.seed + 1)
        prompts = [[rng.randrange(2, 60) for _ in range(args.prompt_tokens)] for _ in range(args.episodes)]
        warm = plan(args, args.seed + 99)
        episodes(runners[0], warm, prompts), single_turn(runners[0], warm, prompts)     # warm-up
        threads = sorted({t.name for t in threading.enumerate()})   # they share the GIL with the engine loop
        work = plan(args, args.seed)
        multis = [episodes(r, work, prompts) for r in runners]
        single = single_turn(runners[0], work, prompts)
        raw = raw_generate(llm, work, prompts)
        vc.shutdown(llm)
    # No episode can end before its own tokens (as fast as in the single-turn run) plus its tool waits:
    bound = max(t + sum(w["latency"]) for t, w in zip(single.pop("episode_s"), work))
    for m, w in zip(multis, waits):
        m.update(admit_wait_steps=w, ratio=round(m["tokens_per_s"] / single["tokens_per_s"], 3))
        m.pop("episode_s")
    multi = multis[0]
    doc = {"config": vars(args), "engine_start_s": round(start_s, 1), "episodes": multi, "single_turn": single,
           "raw_llm_generate": raw, "ratio": multi["ratio"],
           "critical_path_s": round(bound, 3), "ratio_bound": round(single["wall_s"] / bound, 3),
           "admission": multis, "path_vs_raw": round(single["tokens_per_s"] / raw["tokens_per_s"], 3),
           "versions": versions(), "threads": threads}
    print(json.dumps(doc, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))


def versions() -> dict:
    import torch
    import vllm
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"vllm": vllm.__version__, "torch": torch.__version__, "device": dev}


def markdown(doc) -> str:
    c = doc["config"]
    rows = [("episodes (%d turns, tool waits %g-%g ms)" % (c["turns"], *c["latency_ms"]), doc["episodes"]),
            ("single turn, same tokens (same path)", doc["single_turn"]),
            ("single turn, raw llm.generate", doc["raw_llm_generate"])]
    lines = [f"# Episodes vs single-turn generation: {c['shape']}, {c['episodes']} at once",
             "", f"`python benchmarks/episodes.py {' '.join(sys.argv[1:])}` on {doc['versions']}", "",
             "| run | sampled tokens | wall s | tokens/s |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {r['sampled_tokens']} | {r['wall_s']} | {r['tokens_per_s']} |" for name, r in rows]
    lines += ["", f"episodes / single-turn: **{doc['ratio']}x** (target >= 0.9); path / raw: {doc['path_vs_raw']}x", "",
              f"Critical path: no episode ends before its own tokens (timed in the single-turn run) plus its tool "
              f"waits, {doc['critical_path_s']} s for the slowest, so the best ratio this workload allows is "
              f"{doc['ratio_bound']}x.", "", "| admit_wait_steps | wall s | tokens/s | ratio | engine steps | admissions |",
              "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {m['admit_wait_steps']} | {m['wall_s']} | {m['tokens_per_s']} | {m['ratio']} | {m['engine_steps']} | "
              f"{m['admissions']} |" for m in doc["admission"]]
    keys = ("engine_steps", "loop_turns", "step_s", "idle_s", "loop_s", "ms_per_step", "loop_ms_per_step", "prefill_steps",
            "prefill_ms", "prefill_tokens", "decode_steps", "decode_ms", "over_graph_limit")
    lines += ["", "Where the time goes: seconds inside engine steps, idle (every episode in a tool call, nothing "
              "to step), the loop's own (the rest: admission, asyncio, Rollout assembly; for llm.generate its "
              "own loop and request setup), per step; steps whose batch held prefill tokens vs decode-only ones "
              "(with the prefill steps' mean scheduled tokens); steps larger than the largest CUDA graph. "
              f"Threads beside the loop: {doc['threads']}.", "",
              "| run | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    lines += [f"| {name} | " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for name, r in rows]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
