"""Algorithm switches that real runs use, as small functions the loop calls (DAPO, Yu et al. 2025):
dynamic sampling (drop groups whose rewards are all equal, refill the batch), over-long filtering
(truncated completions count for nothing) and the soft over-long penalty. Pure Python over
RolloutBatches; tests: tests/test_tasks.py. CPU or GPU (no device work).

    batches, m = dynamic_sampling(lambda r: generate_round(r), size=32, max_rounds=4)
    m |= overlong_penalty(batches, max_tokens=1024, cache=256)      # before advantages
    m |= overlong_filter(batches)                                   # after them: loss_mask 0
"""

from __future__ import annotations

from typing import Callable


def varied(batch) -> bool:
    """True if the group's rewards are not all equal (it has a non-zero GRPO advantage)."""
    return len(set(batch.rewards)) > 1


def dynamic_sampling(generate: Callable[[int], list], size: int, *, max_rounds: int = 4) -> tuple[list, dict]:
    """DAPO dynamic sampling: call generate(round) (round 0, 1, ...: a fresh set of prompts each) and keep
    the groups whose rewards vary, until `size` are kept or `max_rounds` rounds ran. Returns (size
    groups, metrics: groups_dropped (all-equal groups generated), rounds, topped_up). Short after
    max_rounds: topped up with dropped groups (zero advantage, so no gradient; the batch keeps its
    size, ranks their step count); fewer than `size` only if generate returned fewer in all."""
    if size < 1 or max_rounds < 1:
        raise ValueError(f"dynamic_sampling: size and max_rounds must be >= 1, got {size}, {max_rounds}")
    kept, dropped, rounds = [], [], 0
    while len(kept) < size and rounds < max_rounds:
        for b in generate(rounds):
            (kept if varied(b) else dropped).append(b)
        rounds += 1
    fill = min(max(0, size - len(kept)), len(dropped))
    return kept[:size] + dropped[:fill], {"dynsamp/groups_dropped": len(dropped), "dynsamp/rounds": rounds,
                                          "dynsamp/topped_up": fill}


def overlong_penalty_value(length: int, max_tokens: int, cache: int) -> float:
    """DAPO soft over-long punishment: 0 up to max_tokens - cache tokens, then linear down to -1 at
    max_tokens (and -1 beyond). cache=0: no penalty."""
    if not 0 <= cache <= max_tokens:
        raise ValueError(f"overlong cache must be in [0, max_tokens={max_tokens}], got {cache}")
    free = max_tokens - cache
    if cache == 0 or length <= free:
        return 0.0
    return -1.0 if length >= max_tokens else (free - length) / cache


def overlong_penalty(batches, *, max_tokens: int, cache: int) -> dict:
    """Add overlong_penalty_value(len(completion)) to every reward (call before compute_advantages).
    Returns metrics: the mean penalty and the fraction of completions penalised."""
    pens = []
    for r in (r for b in batches for r in b):
        pens.append(overlong_penalty_value(len(r.completion_ids), max_tokens, cache))
        r.reward += pens[-1]
    n = max(len(pens), 1)
    return {"overlong/penalty_mean": sum(pens) / n, "overlong/penalized": sum(p < 0 for p in pens) / n}


def overlong_filter(batches) -> dict:
    """Over-long filtering: a truncated completion (finish_reason "length") gets loss_mask 0, so it
    adds no gradient (its group's advantages are kept as computed). Returns the fraction masked."""
    rollouts = [r for b in batches for r in b]
    cut = [r for r in rollouts if r.finish_reason == "length"]
    for r in cut:
        r.loss_mask = [0] * len(r.completion_ids)
    return {"overlong/masked": len(cut) / max(len(rollouts), 1)}
