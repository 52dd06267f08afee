"""Training on tokens an older policy sampled (the async backend): a decoupled PPO loss that
corrects them with the importance-sampling functions of minirl.core, and the staleness metrics
of a step. Pure torch, no Ray or vLLM. Tests: tests/test_inflight.py. Hardware: any.

    loss_fn = decoupled_loss_fn("tis")                 # Trainer.forward_backward's loss_fn
    metrics = staleness_metrics(rollouts, trainer.policy_version, max_staleness=1)

Decoupled PPO (Hilton et al. 2021; AReaL): the PPO ratio is taken against the proximal policy,
here the trainer's own policy at this forward pass (detached), and each token is weighted by
pi_proximal / pi_sampler, the gap the sampler's staleness (and any engine mismatch) opened:
truncated at `cap` (TIS, Yao et al. 2025) or masked outside [low, high] (MIS). Against the plain
PPO loss with the sampler as "old" policy, stale tokens are not clipped away wholesale. Departure:
the proximal policy is re-read at every forward, so with several optimizer steps per batch the
trust region is re-anchored at each (exact for one optimizer step per batch, the loops' default).
"""

from __future__ import annotations

from minirl.core import clipped_surrogate, masked_importance_weights, policy_stats, truncated_importance_weights


def decoupled_loss_fn(correction: str = "tis", *, clip_low: float = 0.2, clip_high: float | None = 0.28,
                      cap: float = 2.0, low: float = 0.5, high: float = 2.0, entropy: bool = True):
    """A loss_fn for Trainer.forward_backward: per token w * clipped_surrogate(pi, pi_prox, A) with
    w = min(pi_prox / pi_sampler, cap) ("tis") or 1[low <= pi_prox / pi_sampler <= high] ("mis").
    Reports clip_frac / approx_kl / ratio against the sampler (as ppo_loss_fn) and is_weight."""
    if correction not in ("tis", "mis"):
        raise ValueError(f"correction={correction!r}: choose 'tis' (truncated weights) or 'mis' (masked)")
    if correction == "tis" and not cap > 0:              # weights min(ratio, cap) <= 0: the gradient flips or vanishes
        raise ValueError(f"TIS cap must be > 0 (weights are min(pi_prox / pi_sampler, cap)), got {cap}; e.g. 2.0")
    if correction == "mis" and not 0 <= low <= high:     # low > high masks every token
        raise ValueError(f"MIS keeps tokens with low <= pi_prox / pi_sampler <= high: need 0 <= low <= high, "
                         f"got low={low}, high={high}; e.g. 0.5 and 2.0")

    def loss_fn(logprobs, batch, logits):
        old, adv = batch.old_logprobs, batch.advantages                    # (n,), (n,): sampler's
        prox = logprobs.detach().float()                                   # (n,) the proximal policy
        w = (truncated_importance_weights(prox, old, cap=cap) if correction == "tis"
             else masked_importance_weights(prox, old, low=low, high=high))  # (n,) detached
        per_token = w * clipped_surrogate(logprobs, prox, adv, clip_low=clip_low, clip_high=clip_high)
        return per_token, {**policy_stats(prox, batch, logits, clip_low, clip_high, entropy), "is_weight": w}
    return loss_fn


def staleness_metrics(rollouts: list, version: int, max_staleness: int) -> dict[str, float]:
    """For a step trained at `version`: rollouts whose tokens span several policy versions (an in-flight
    update), and the histogram of lag = version - oldest token version (staleness_k: how many lag
    k; staleness_over: past max_staleness, which the queue's admission rules out)."""
    lags = [version - r.policy_version for r in rollouts]
    spans = [r.info.get("versions", (r.policy_version, r.policy_version)) for r in rollouts]
    return {"async/rollouts_spanning_versions": sum(a != b for a, b in spans),
            "async/staleness_mean": sum(lags) / max(len(lags), 1), "async/staleness_max": max(lags, default=0),
            **{f"async/staleness_{k}": sum(lag == k for lag in lags) for k in range(max_staleness + 1)},
            "async/staleness_over": sum(lag > max_staleness for lag in lags)}
