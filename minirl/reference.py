"""A KL penalty toward the reference policy, wrapped around any Trainer loss_fn.

    trainer = Trainer(path, TrainerConfig(reference=True))        # the frozen starting weights
    loss_fn = kl_penalty(ppo_loss_fn(), coef=0.01, estimator="k3")
    trainer.forward_backward(rollouts, loss_fn)                   # metrics gain "kl_ref"

Per token: loss + coef * k(logprobs, ref_logprobs), with k one of Schulman's estimators of
KL(pi_theta || pi_ref) (minirl.core.kl_k1/k2/k3) on the tokens the sampler drew. Pure torch; CPU or GPU.
"""

from __future__ import annotations

import math

from minirl.core import kl_k1, kl_k2, kl_k3

ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(loss_fn, *, coef: float, estimator: str = "k3"):
    """loss_fn plus coef * KL estimate per token; reports the estimate as "kl_ref" (also when coef
    is 0: the KL is then logged, not trained on). The batch must carry ref_logprobs."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r}: choose one of {sorted(ESTIMATORS)}")
    if not 0 <= coef < math.inf:
        raise ValueError(f"KL coefficient must be a finite number >= 0, got {coef}")
    kl = ESTIMATORS[estimator]

    def with_kl(logprobs, batch, logits):
        if batch.ref_logprobs is None:
            raise ValueError("kl_penalty needs the reference policy's log-probs: build the trainer with "
                             "TrainerConfig(reference=True) (launch scripts: --kl-coef > 0 or --reference)")
        per_token, stats = loss_fn(logprobs, batch, logits)
        k = kl(logprobs.float(), batch.ref_logprobs)                      # (n,)
        return per_token + coef * k if coef else per_token, {**stats, "kl_ref": k.detach()}
    return with_kl
