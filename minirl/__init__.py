"""minirl: minimal RL training for LLMs. Generate with vLLM, train with FSDP2, place with Ray.

    from minirl import WeightManager, parse_vllm_outputs, clipped_policy_loss, get_logprobs

The math (minirl.core) and data contract (minirl.data) import only torch; Trainer
(minirl.trainer) loads transformers, WeightManager (minirl.colocated) vLLM, when first touched.
Nothing here imports Ray: the async backend's Ray side (RolloutServer, TrainWorker) is in actors/.
"""

from minirl.core import (approx_kl, clip_fraction, clipped_policy_loss, clipped_surrogate,
                         compute_advantages, entropy_from_logits, get_logprobs, kl_k1, kl_k2, kl_k3,
                         masked_importance_weights, ppo_loss_fn, token_logprobs,
                         truncated_importance_weights)
from minirl.data import (PackedBatch, Rollout, RolloutBatch, TrainBatch, collate, load_rollouts, pack,
                         parse_vllm_outputs, save_rollouts)

_LAZY = {
    "WeightManager": "minirl.colocated", "WeightManagerConfig": "minirl.colocated",
    "SyncError": "minirl.weights", "Trainer": "minirl.trainer", "TrainerConfig": "minirl.trainer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minirl' has no attribute {name!r}")


__all__ = ["compute_advantages", "clipped_policy_loss", "clipped_surrogate", "ppo_loss_fn",
           "get_logprobs", "token_logprobs", "entropy_from_logits", "kl_k1", "kl_k2", "kl_k3",
           "truncated_importance_weights", "masked_importance_weights", "clip_fraction", "approx_kl",
           "Rollout", "RolloutBatch", "TrainBatch", "PackedBatch", "collate", "pack",
           "parse_vllm_outputs", "save_rollouts", "load_rollouts", *_LAZY]
