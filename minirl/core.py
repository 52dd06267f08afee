"""The math of policy-gradient RL for LLMs as plain torch functions: no ray or vllm, CPU or GPU.

Tested against hand-worked numbers (`python -m pytest tests/test_core.py -q`). B rollouts, T tokens,
V vocab. Log-probs are natural-log probabilities of the *realised* tokens: get_logprobs(logits,
token_ids) has one per position t >= 1 (token t given tokens < t, read from logits at t-1), so it is
one shorter than token_ids. Masks are 1 for tokens that count (completion tokens the policy chose).
"""

from __future__ import annotations

import warnings

import torch


# ------------------------------------------------------------------------------------ advantages
def compute_advantages(rewards, group_size: int, *, normalize_std: bool = False,
                       eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages A_i = r_i - mean(group), optionally / (population std(group) + eps) (Dr.GRPO
    leaves it off). rewards: flat (n*G,), group by group (prompt 0's G samples, then 1's...); fp32."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of group_size={group_size}: "
                         "pass whole groups")
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards contain NaN or inf: {r.tolist()}")
    if group_size == 1:
        warnings.warn("group_size=1: every GRPO advantage is 0 (a reward minus its own mean), so training "
                      "does nothing; sample several completions per prompt (group_size >= 2)", stacklevel=2)
    g = r.view(-1, group_size)                                   # (n, G)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (g.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.flatten()


# ------------------------------------------------------------ log-probs of realised tokens, lean
_BLOCK_BYTES = 128 << 20    # the most fp32 (chunk, V) work done at once


def _chunk_tokens(n: int, vocab: int, chunk_size: int | None) -> int:
    """Rows per chunk: chunk_size, else <= n/8 rows and <= _BLOCK_BYTES of fp32 (< 1/4 of bf16 logits)."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size if chunk_size is not None else max(1, min(n // 8, _BLOCK_BYTES // (4 * vocab)))


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / T)[target] for (N, V) logits, a chunk of rows at a time, and (when asked)
    each row's entropy. Forward keeps only the logits; backward rebuilds each chunk's softmax and
    writes (onehot - p) * g / T into the (N, V) result in the logits' dtype, in place where it can.
    With `fused` (minirl.kernels' Triton kernels) each chunk is one kernel each way that reads the
    logits where they lie: forward keeps each row's log-sum-exp, backward is one pass."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, entropy, fused):
        acc = torch.promote_types(logits.dtype, torch.float32)   # fp32 (fp64 stays fp64)
        out = torch.empty(len(logits), dtype=acc, device=logits.device)
        ent = torch.empty(len(logits) if entropy else 0, dtype=acc, device=logits.device)
        lse = torch.empty(len(logits) if fused else 0, dtype=acc, device=logits.device)
        for s in range(0, len(logits), chunk):
            if fused:
                got = fused[0](logits[s:s + chunk], targets[s:s + chunk], temperature, entropy)
                out[s:s + chunk], lse[s:s + chunk] = got[0], got[1]
                if entropy:
                    ent[s:s + chunk] = got[2]
                continue
            logp = torch.log_softmax(_scaled(logits[s:s + chunk], temperature, acc), -1, dtype=acc)   # (c, V)
            out[s:s + chunk] = logp.gather(-1, targets[s:s + chunk, None]).squeeze(-1)
            if entropy:                                        # -sum p log p; entr(0) = 0: -inf logits, no NaN
                ent[s:s + chunk] = torch.special.entr(logp.exp_(), out=logp).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk, ctx.fused = temperature, chunk, fused
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _):
        logits, targets, lse = ctx.saved_tensors
        temp, chunk, fused = ctx.temperature, ctx.chunk, ctx.fused
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            tgt = targets[s:s + chunk, None]
            if fused:
                fused[1](logits[s:s + chunk], tgt, lse[s:s + chunk, None], grad_out[s:s + chunk, None],
                         temp, grad[s:s + chunk])
                continue
            p = torch.softmax(_scaled(logits[s:s + chunk], temp, grad_out.dtype), -1, dtype=grad_out.dtype)
            g = grad_out[s:s + chunk, None] / temp                              # (c, 1)
            at_target = g * (1 - p.gather(-1, tgt))                            # d/dx[target]
            grad[s:s + chunk] = p.mul_(g.neg_()).scatter_(-1, tgt, at_target)   # elsewhere -g p / T
        return grad, None, None, None, None, None


def _kernels(x: torch.Tensor):
    """minirl.kernels' (forward, backward) where they take logits x (CUDA: bf16, fp16 or fp32,
    contiguous), else None: the plain chunked path."""
    try:
        from minirl import kernels
    except ImportError:                     # no triton
        return None
    return (kernels.forward, kernels.backward) if kernels.usable(x) else None


_FUSED_ROWS = 4096
"""Rows per chunk of the fused path at least: its kernels hold nothing of (rows, V), so fewer
chunks, fewer launches."""


def _scaled(x: torch.Tensor, temperature: float, acc: torch.dtype) -> torch.Tensor:
    """x / temperature in acc (a new tensor), or x itself at temperature 1 (softmax casts it)."""
    return x if temperature == 1.0 else x.to(acc, copy=True).div_(temperature)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int | None = None, entropy: bool = False, compile: str | None = None):
    """log p(targets[i]) under softmax(logits[i] / temperature): (N, V), (N,) -> (N,), no shift.
    fp32 (fp64 for fp64 logits), differentiable, chunked: never an fp32 copy of the logits. With
    entropy=True returns (log-probs, entropies): each row's entropy (nats, no gradient) from the
    same pass. compile (the trainer passes its torch.compile backend): set, the fused path where its
    kernels take the logits (minirl.kernels: CUDA); None, or logits they do not take: plain torch."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: pass "
                         "(N, V) logits and the (N,) token ids they score")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (1.0 for plain log_softmax), got {temperature}")
    fused = _kernels(logits) if compile else None
    chunk = _chunk_tokens(*logits.shape, chunk_size)
    if fused and chunk_size is None:
        chunk = max(chunk, _FUSED_ROWS)
    lp, ent = _TokenLogprobs.apply(logits, targets.to(device=logits.device, dtype=torch.long),
                                   float(temperature), chunk, entropy, fused)
    return (lp, ent) if entropy else lp


def get_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *, temperature: float = 1.0,
                 chunk_size: int | None = None) -> torch.Tensor:
    """out[..., t-1] = log p(token_ids[t] | < t) for logits (B, T, V) or (T, V) of token_ids (B, T)
    or (T,): T-1 entries, the completion's (C tokens after P) are out[:, P-1:]. temperature divides
    the logits first, as vLLM's logprobs_mode="processed_logprobs" (minirl's default) does."""
    if logits.dim() not in (2, 3) or logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} "
                         "disagree: pass the logits the model returned for exactly these token_ids")
    targets = token_ids.roll(-1, dims=-1).reshape(-1)     # token t+1 at t; the last one's is unused
    return token_logprobs(logits.reshape(-1, logits.shape[-1]), targets, temperature=temperature,
                          chunk_size=chunk_size).view(token_ids.shape)[..., :-1]


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int | None = None) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / T) at every position: (..., T, V) -> (..., T), fp32.
    Chunked; differentiable (for an entropy bonus), so wrap it in no_grad() when only logging."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (1.0 for plain softmax), got {temperature}")
    flat = logits.reshape(-1, logits.shape[-1])
    chunk = _chunk_tokens(*flat.shape, chunk_size)
    parts = []
    for s in range(0, max(flat.shape[0], 1), chunk):      # at least one (maybe empty) chunk
        logp = torch.log_softmax(flat[s:s + chunk].float() / temperature, dim=-1)   # (c, V)
        p = logp.exp()
        parts.append(-(p * logp.masked_fill(p == 0, 0.0)).sum(-1))    # 0 log 0 = 0: -inf logits, no NaN
    return torch.cat(parts).view(logits.shape[:-1])


# ------------------------------------------------------------------------ masks and aggregation
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None, dim=None) -> torch.Tensor:
    """Mean of x over entries where mask is 1 (all of x when mask is None); 0 where nothing counts."""
    if mask is None:
        return x.mean(dim=dim)
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor | None = None, mode: str = "token-mean",
              *, max_tokens: int | None = None) -> torch.Tensor:
    """Reduce a (B, T) per-token loss ((T,): one sequence) to a scalar. "token-mean": over all counted
    tokens (DAPO; long answers weigh more). "seq-mean-token-mean": per sequence, then over sequences
    (GRPO). "seq-mean-token-sum-norm": each sequence's sum / max_tokens (default T), then over
    sequences (Dr.GRPO: no length bias from the divisor). The sequence means leave out sequences with
    no counted token (Rollout.as_padding's), which would otherwise average in as 0."""
    if mask is not None and mask.shape != per_token.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match the per-token loss "
                         f"{tuple(per_token.shape)}: pass one mask entry per scored token, as old_logprobs")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (the longest completion allowed), got {max_tokens}")
    mask = torch.ones_like(per_token) if mask is None else mask.to(per_token)
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1)
    counted = mask.sum(-1)
    sequences = (counted > 0).sum().clamp(min=1)           # a masked-out sequence is no 0 in the mean
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / counted.clamp(min=1)).sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        return (masked.sum(-1) / (per_token.shape[-1] if max_tokens is None else max_tokens)).sum() / sequences
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def _align(new_lp: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(new_lp cut to ref's length from the right, ref), fp32 on new_lp's device: completions come last."""
    if not (isinstance(new_lp, torch.Tensor) and isinstance(ref, torch.Tensor)):
        raise TypeError(f"log-probs must be tensors, got {type(new_lp).__name__} and {type(ref).__name__}: "
                        "pass get_logprobs(...) and rollout.old_logprobs (or torch.tensor(...))")
    if new_lp.dim() not in (1, 2) or new_lp.shape[:-1] != ref.shape[:-1]:
        raise ValueError(f"new log-probs {tuple(new_lp.shape)} and old log-probs {tuple(ref.shape)} disagree "
                         "in their leading (sequence) dimensions: pass (B, T) and (B, C) for the same B "
                         "sequences, or (T,) and (C,) for one; nothing is broadcast")
    n, m = new_lp.shape[-1], ref.shape[-1]
    if n < m:
        raise ValueError(f"new log-probs have {n} positions but old log-probs {m}: new_lp must cover at "
                         "least the scored tokens (pass get_logprobs of the whole prompt + completion)")
    new = (new_lp if n == m else new_lp[..., n - m:]).float()
    return new, ref.to(new)


def _as_adv(adv, like: torch.Tensor) -> torch.Tensor:
    """advantages as fp32 broadcastable to `like` (B, C) or (C,): a scalar, one per sequence (B,), or
    one per token (like's shape); anything else is refused rather than broadcast."""
    try:
        a = torch.as_tensor(adv, dtype=torch.float32, device=like.device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"advantages must be a number or a tensor of numbers, got {type(adv).__name__} "
                        f"({e})") from e
    per_seq = a.dim() == 1 and like.dim() == 2                    # one advantage per sequence
    if a.dim() and not (per_seq and a.shape[0] == like.shape[0]) and a.shape != like.shape:
        per = f"({like.shape[0]},)" if like.dim() == 2 else "(B,) for (B, C)"
        raise ValueError(f"advantages {tuple(a.shape)} do not fit {tuple(like.shape)} old log-probs: pass a "
                         f"scalar, one per sequence {per} or one per token {tuple(like.shape)}")
    return a[:, None] if per_seq else a


def _check_finite(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first input holding NaN or inf (one device sync when all are finite):
    a non-finite loss would turn every weight NaN at the next optimizer step."""
    if bool(torch.stack([torch.isfinite(t).all() for t in tensors.values()]).all()):
        return
    name, t = next((k, v) for k, v in tensors.items() if not torch.isfinite(v).all())
    bad = int((~torch.isfinite(t)).sum())
    hint = {"advantages": "compute advantages from finite rewards (compute_advantages refuses others)",
            "old_logprobs": "the sampling log-probs must come from SamplingParams(logprobs=0) of the sampled "
                            "tokens; put 0 (not NaN) at padded positions",
            "new_logprobs": "the policy's logits are not finite: its weights may already be NaN (restore a "
                            "checkpoint) or the learning rate is too high"}[name]
    raise ValueError(f"{name} hold {bad} NaN or inf entries of {t.numel()}: {hint}")


def _check_clip(clip_low: float, clip_high: float | None, dual_clip: float | None = None) -> float:
    """clip_high (clip_low when None), after checking the trust region [1 - clip_low, 1 + clip_high]
    and dual_clip (None or > 1)."""
    ch = clip_low if clip_high is None else clip_high
    if not (0 <= clip_low < 1 and ch >= 0):
        raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {clip_low}, {clip_high}: the "
                         "trust region is [1 - clip_low, 1 + clip_high] (e.g. 0.2 and 0.28)")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    return ch


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float | None) -> torch.Tensor:
    """True where the clip switched the gradient off: ratio out of range on the side A pushes to."""
    high = low if high is None else high
    return ((adv > 0) & (ratio > 1 + high)) | ((adv < 0) & (ratio < 1 - low))


def clipped_surrogate(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages, *,
                      clip_low: float = 0.2, clip_high: float | None = None,
                      dual_clip: float | None = None) -> torch.Tensor:
    """Per-token PPO loss -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A), r = exp(new - old), fp32
    shaped like old_logprobs. clip_high defaults to clip_low (DAPO's clip-higher: 0.2 / 0.28);
    dual_clip=c > 1 caps negative-advantage tokens' loss at -c*A (Ye et al. 2020)."""
    new, old = _align(new_logprobs, old_logprobs)
    adv = _as_adv(advantages, old)
    _check_finite(advantages=adv, old_logprobs=old, new_logprobs=new.detach())
    ch = _check_clip(clip_low, clip_high, dual_clip)
    ratio = torch.exp(new - old)
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + ch) * adv)
    if dual_clip is not None:
        surr = torch.where(adv < 0, torch.maximum(surr, dual_clip * adv), surr)
    return -surr


def clipped_policy_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages, *,
                        mask: torch.Tensor | None = None, clip_low: float = 0.2,
                        clip_high: float | None = None, dual_clip: float | None = None,
                        aggregation: str = "token-mean", max_tokens: int | None = None) -> torch.Tensor:
    """clipped_surrogate reduced by `aggregate(..., mask, aggregation)`. old_logprobs and mask (B, C)
    or (C,); advantages a scalar, (B,) or (B, C); new_logprobs may be longer (its last C entries
    count), so get_logprobs(out.logits, r.token_ids) scores exactly r's completion tokens."""
    per_token = clipped_surrogate(new_logprobs, old_logprobs, advantages, clip_low=clip_low,
                                  clip_high=clip_high, dual_clip=dual_clip)
    return aggregate(per_token, mask, aggregation, max_tokens=max_tokens)


def ppo_loss_fn(*, clip_low: float = 0.2, clip_high: float | None = 0.28,
                dual_clip: float | None = None, entropy: bool = True):
    """A loss_fn for Trainer.forward_backward: loss_fn(logprobs (n,), batch, logits (n, V)) ->
    (clipped surrogate (n,), policy_stats: per-token {name: (n,)}); the sampler is the old policy."""
    _check_clip(clip_low, clip_high, dual_clip)

    def loss_fn(logprobs, batch, logits):
        per_token = clipped_surrogate(logprobs, batch.old_logprobs, batch.advantages, clip_low=clip_low,
                                      clip_high=clip_high, dual_clip=dual_clip)
        return per_token, policy_stats(logprobs.float(), batch, logits, clip_low, clip_high, entropy)
    return loss_fn


@torch.no_grad()
def policy_stats(logprobs: torch.Tensor, batch, logits: torch.Tensor, clip_low: float, clip_high: float | None,
                 entropy: bool) -> dict:
    """Per-token stats of a loss_fn against the sampler (batch.old_logprobs, batch.advantages):
    clip_frac, approx_kl (k3), ratio (pi_theta / pi_sampler) and, if `entropy`, entropy
    (batch.entropy, the Trainer's, else entropy_from_logits(logits) at batch.temperature)."""
    old, adv = batch.old_logprobs, batch.advantages                            # (n,), (n,)
    ratio = torch.exp(logprobs - old)
    stats = {"clip_frac": _clipped(ratio, adv, clip_low, clip_high).float(), "approx_kl": kl_k3(old, logprobs),
             "ratio": ratio}
    if entropy:
        stats["entropy"] = (batch.entropy if batch.entropy is not None
                            else entropy_from_logits(logits, temperature=batch.temperature))
    return stats


# ----------------------- KL estimators (Schulman, "Approximating KL divergence"), samples from p
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log q: unbiased for KL(p||q), high variance, can be negative. Per token."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)^2 / 2: biased, low variance, always >= 0. Per token."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = q/p - 1 - log(q/p): unbiased for KL(p||q), always >= 0 (GRPO's KL). Per token."""
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


# -------------------------------------- importance weights, trainer (pi_theta) vs sampler (vLLM)
def _log_ratio(train_logprobs, sampling_logprobs, mask, level):
    """log(pi_train / pi_sampler) per token or summed per sequence; train_logprobs right-aligned."""
    lr = torch.sub(*_align(train_logprobs, sampling_logprobs))     # (B, C)
    if level == "token":
        return lr
    if level == "sequence":
        return (lr if mask is None else lr * mask.to(lr.dtype)).sum(-1, keepdim=True).expand_as(lr)
    raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")


def truncated_importance_weights(train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                                 mask: torch.Tensor | None = None, *, cap: float = 2.0,
                                 level: str = "token") -> torch.Tensor:
    """TIS (Yao et al. 2025): w = min(pi_train / pi_sampler, cap), detached, to multiply the
    per-token loss by; per token, or (level="sequence") the product over each sequence's counted
    tokens. sampling_logprobs and mask (B, C) or (C,); train_logprobs may be longer (right-aligned)."""
    return torch.exp(_log_ratio(train_logprobs, sampling_logprobs, mask, level)).clamp(max=cap).detach()


def masked_importance_weights(train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                              mask: torch.Tensor | None = None, *, low: float = 0.5,
                              high: float = 2.0, level: str = "token") -> torch.Tensor:
    """MIS: 1 where low <= pi_train / pi_sampler <= high, else 0 (detached); multiply into the mask:
    drops the tokens (or sequences) whose sampler and trainer disagree too much."""
    w = torch.exp(_log_ratio(train_logprobs, sampling_logprobs, mask, level))
    return ((w >= low) & (w <= high)).to(torch.float32).detach()


# ---------------------------------------------------------------------- statistics worth logging
@torch.no_grad()
def clip_fraction(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages, *,
                  mask: torch.Tensor | None = None, clip_low: float = 0.2,
                  clip_high: float | None = None) -> torch.Tensor:
    """Fraction of counted tokens whose gradient the clip switched off (ratio out of range on A's side)."""
    new, old = _align(new_logprobs, old_logprobs)
    adv = _as_adv(advantages, old).expand_as(old)
    return masked_mean(_clipped(torch.exp(new - old), adv, clip_low, clip_high).float(), mask)


@torch.no_grad()
def approx_kl(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean k3 estimate of KL(old || new) over counted tokens (samples come from old)."""
    new, old = _align(new_logprobs, old_logprobs)
    return masked_mean(kl_k3(old, new), mask)
