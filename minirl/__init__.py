"""minirl: minimal RL training for LLMs. Generate with vLLM, train with FSDP2, place with Ray.

    from minirl import WeightManager, parse_vllm_outputs, clipped_policy_loss, get_logprobs

The math (minirl.core) and data contract (minirl.data) import only torch; WeightManager
(minirl.colocated), RolloutServer and TrainWorker (minirl.async_rl) load vLLM / Ray when first
touched.
"""

from minirl.core import (approx_kl, clip_fraction, clipped_policy_loss, compute_advantages,
                         entropy_from_logits, get_logprobs, kl_k1, kl_k2, kl_k3,
                         masked_importance_weights, truncated_importance_weights)
from minirl.data import (Rollout, RolloutBatch, TrainBatch, collate, load_rollouts,
                         parse_vllm_outputs, save_rollouts)

_LAZY = {
    "WeightManager": "minirl.colocated", "WeightManagerConfig": "minirl.colocated",
    "SyncError": "minirl.colocated",
    "RolloutServer": "minirl.async_rl", "TrainWorker": "minirl.async_rl",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minirl' has no attribute {name!r}")


__all__ = ["compute_advantages", "clipped_policy_loss", "get_logprobs", "entropy_from_logits",
           "kl_k1", "kl_k2", "kl_k3", "truncated_importance_weights", "masked_importance_weights",
           "clip_fraction", "approx_kl", "Rollout", "RolloutBatch", "TrainBatch", "collate",
           "parse_vllm_outputs", "save_rollouts", "load_rollouts", *_LAZY]
