"""Held-out evaluation: greedy pass@1 (temperature 0, n=1), sampled pass@k with the unbiased estimator
(Chen et al. 2021), mean completion length and truncation rate, as `eval/...` metrics for the tracker.
`evaluate` runs a vllm.LLM (any engine holding the weights to judge); `eval_metrics` is the pure part.
Tests: tests/test_tasks.py. Hardware: the engine's (CPU or GPU).

    m = evaluate(wm.as_vllm(), prompts, answers, task.reward, max_tokens=1024, samples=8, k=4)
    tracker.log(m, step)      # eval/pass@1, eval/pass@4, eval/len_mean, eval/truncated, ...
"""

from __future__ import annotations

import time
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples, c of them correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_metrics(greedy: list[tuple[float, int, str]], sampled: list[list[tuple[float, int, str]]], *,
                 k: int, correct: float = 1.0) -> dict:
    """Metrics from (reward, completion tokens, finish reason) per completion: `greedy` one per prompt,
    `sampled` a list of n per prompt. A completion is correct when its reward >= `correct`."""
    if len(greedy) != len(sampled) or not greedy:
        raise ValueError(f"eval_metrics: {len(greedy)} greedy and {len(sampled)} sampled prompts "
                         f"(need equal, > 0)")
    everything = greedy + [s for group in sampled for s in group]
    hits = [sum(r >= correct for r, _, _ in group) for group in sampled]
    return {"eval/pass@1": sum(r >= correct for r, _, _ in greedy) / len(greedy),
            "eval/reward_mean": sum(r for r, _, _ in greedy) / len(greedy),
            "eval/sampled_pass@1": sum(h / len(g) for h, g in zip(hits, sampled)) / len(sampled),
            **({} if k == 1 else          # sampled pass@1 is eval/sampled_pass@1: keep the greedy eval/pass@1
               {f"eval/pass@{k}": sum(pass_at_k(len(g), h, k) for h, g in zip(hits, sampled)) / len(sampled)}),
            "eval/len_mean": sum(n for _, n, _ in everything) / len(everything),
            "eval/truncated": sum(f == "length" for _, _, f in everything) / len(everything),
            "eval/prompts": len(greedy)}


def evaluate(llm, prompts: list, answers: list, reward_fn, *, max_tokens: int, samples: int = 4,
             k: int = 4, temperature: float = 1.0, seed: int = 0, correct: float = 1.0) -> dict:
    """Greedy and `samples` sampled completions per prompt from `llm`, scored by
    reward_fn(prompt, completion, answer): eval_metrics plus eval/time (seconds)."""
    from minirl.vllm_compat import SamplingParams
    if len(prompts) != len(answers) or not prompts:
        raise ValueError(f"evaluate: {len(prompts)} prompts and {len(answers)} answers (need equal, > 0)")
    if not 1 <= k <= samples:                      # before any generation: pass@k needs k of the samples
        raise ValueError(f"evaluate: k={k} must be in [1, samples={samples}]: raise samples or lower k")
    t0 = time.perf_counter()
    runs = []
    for params in (SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens),
                   SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens, seed=seed)):
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([[(float(reward_fn(p, o.text, a)), len(o.token_ids), o.finish_reason)
                      for o in out.outputs] for p, a, out in zip(prompts, answers, outs)])
    return {**eval_metrics([g[0] for g in runs[0]], runs[1], k=k, correct=correct),
            "eval/time": time.perf_counter() - t0}
