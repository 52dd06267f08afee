"""Tests for minirl.core, the policy-gradient math (advantages, log-probs, PPO loss, KL, IS weights).

CPU only: no GPU, Ray or vLLM needed, and the whole file runs in a few seconds. Each feature is
checked three ways: small examples worked out by hand (the arithmetic is in the comments), property
tests with hypothesis, and comparisons of get_logprobs against the naive log_softmax + gather
(values, gradients, torch.autograd.gradcheck in float64, and what the autograd graph saves).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.core import (
    AGGREGATIONS, aggregate, approx_kl, clip_fraction, clipped_policy_loss, compute_advantages,
    entropy_from_logits, get_logprobs, token_logprobs, kl_k1, kl_k2, kl_k3,
    masked_importance_weights, masked_mean, truncated_importance_weights,
)

PROPS = settings(max_examples=40, deadline=None)
L = math.log


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=rtol)


def naive_logprobs(logits, token_ids, temperature=1.0):
    """Reference: full log_softmax in fp32 (fp64 for fp64 logits), then gather."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(x[..., :-1, :], dim=-1)
    return logp.gather(-1, token_ids[..., 1:, None].long()).squeeze(-1)


# ==============================================================================================
# compute_advantages


def test_advantages_hand_worked():
    # group 0 = [1, 0, 0]: mean 1/3 -> [1-1/3, 0-1/3, 0-1/3] = [2/3, -1/3, -1/3]
    # group 1 = [1, 1, 1]: mean 1   -> [0, 0, 0]
    adv = compute_advantages([1, 0, 0, 1, 1, 1], 3)
    assert adv.dtype == torch.float32 and adv.shape == (6,)
    close(adv, [2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    # A 2-D (n, G) input and a tensor input are flattened the same way.
    close(compute_advantages(torch.tensor([[1.0, 0, 0], [1, 1, 1]]), 3), adv)


def test_advantages_normalize_std_population():
    # group [1, 0, 0]: deviations [2/3, -1/3, -1/3]; population var = (4/9 + 1/9 + 1/9) / 3 = 2/9,
    # std = sqrt(2)/3 = 0.4714 -> A = [2/3, -1/3, -1/3] / (sqrt(2)/3 + eps) = [sqrt 2, -1/sqrt 2, ...]
    # (the sample std, sqrt(1/3) = 0.577, would give [1.1547, -0.5774, -0.5774] instead).
    # group [1, 1, 1]: deviations 0, std 0 -> 0 / (0 + eps) = 0, not NaN.
    eps = 1e-6
    std = math.sqrt(2) / 3
    adv = compute_advantages([1, 0, 0, 1, 1, 1], 3, normalize_std=True, eps=eps)
    close(adv, [(2 / 3) / (std + eps), (-1 / 3) / (std + eps), (-1 / 3) / (std + eps), 0, 0, 0],
          atol=1e-5, rtol=1e-5)
    close(adv[:3], [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], atol=1e-5, rtol=1e-5)
    # eps really is added to the std: group [0, 2] has deviations [-1, 1], std 1 -> [-1/1.5, 1/1.5]
    close(compute_advantages([0, 2], 2, normalize_std=True, eps=0.5), [-1 / 1.5, 1 / 1.5])


def test_advantages_errors():
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages([1, 0, 0, 1], 3)           # 4 rewards do not split into groups of 3
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages([1, 0], 0)
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages([1.0, float("nan"), 0.0], 3)
    with pytest.raises(ValueError):
        compute_advantages([1.0, float("inf"), 0.0], 3)


@PROPS
@pytest.mark.filterwarnings("ignore:group_size=1")     # g=1 is legal; test_bad_inputs checks the warning
@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_advantages_groups_sum_to_zero(n, g, data):
    rewards = data.draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=n * g, max_size=n * g))
    adv = compute_advantages(rewards, g).view(n, g).double()
    scale = max(1.0, max(abs(r) for r in rewards))
    assert (adv.sum(1).abs() <= 1e-5 * g * g * scale).all()


@PROPS
@pytest.mark.filterwarnings("ignore:group_size=1")     # g=1 is legal; test_bad_inputs checks the warning
@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_advantages_normalized_sum_to_zero_and_bounded(n, g, data):
    # Rewards on a 0.25 grid (exact in fp32), like verifiable / partial-credit rewards.
    grid = st.integers(-16, 16).map(lambda k: k / 4)
    rewards = data.draw(st.lists(grid, min_size=n * g, max_size=n * g))
    adv = compute_advantages(rewards, g, normalize_std=True).view(n, g).double()
    assert (adv.sum(1).abs() <= 1e-4).all()
    # A z-score over G values never exceeds sqrt(G - 1) in magnitude.
    assert (adv.abs() <= math.sqrt(max(g - 1, 0)) + 1e-4).all()


# ==============================================================================================
# clipped_policy_loss, hand-worked

# Five tokens, old p = 0.5 except where noted, clip_low = 0.2, clip_high = 0.28
# -> trust region [0.8, 1.28].  loss_token = -min(r*A, clip(r, 0.8, 1.28)*A).
HAND = [
    # (old p, new p, A, expected loss)
    (0.5, 0.6, +1.0, -1.2),    # r = 1.2 inside: -min(1.2, 1.2) = -1.2
    (0.5, 0.7, +1.0, -1.28),   # r = 1.4, A > 0: -min(1.4, 1.28) = -1.28  (clipped at 1+clip_high)
    (0.5, 0.3, -1.0, +0.8),    # r = 0.6, A < 0: -min(-0.6, -0.8) = 0.8   (clipped at 1-clip_low)
    (0.5, 0.3, +1.0, -0.6),    # r = 0.6, A > 0: -min(0.6, 0.8) = -0.6    (pessimistic, not clipped)
    (0.5, 0.7, -1.0, +1.4),    # r = 1.4, A < 0: -min(-1.4, -1.28) = 1.4  (pessimistic, not clipped)
    (0.4, 0.5, +2.0, -2.5),    # r = 1.25 < 1.28, A = 2: -min(2.5, 2.5) = -2.5
]


@pytest.mark.parametrize("old_p,new_p,adv,expected", HAND)
def test_clipped_loss_single_tokens(old_p, new_p, adv, expected):
    loss = clipped_policy_loss(t([L(new_p)]), t([L(old_p)]), adv, clip_low=0.2, clip_high=0.28)
    close(loss, expected, atol=1e-5)


def test_clipped_loss_tokens_together_and_symmetric_default():
    new = t([L(h[1]) for h in HAND])
    old = t([L(h[0]) for h in HAND])
    adv = t([h[2] for h in HAND])
    # token-mean of the per-token losses: (-1.2 - 1.28 + 0.8 - 0.6 + 1.4 - 2.5) / 6 = -3.38 / 6
    close(clipped_policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28), -3.38 / 6, atol=1e-5)
    # clip_high=None means symmetric [0.8, 1.2]: token 1 becomes -1.2, token 5 -min(2.5, 2.4) = -2.4
    # -> (-1.2 - 1.2 + 0.8 - 0.6 + 1.4 - 2.4) / 6 = -3.2 / 6
    close(clipped_policy_loss(new, old, adv, clip_low=0.2), -3.2 / 6, atol=1e-5)


def test_dual_clip_bounds_negative_advantage():
    # r = 0.5 / 0.05 = 10, A = -1: plain PPO loss = -min(-10, -1.28) = 10 (unbounded in r);
    # dual_clip = 3: -max(min(-10, -1.28), 3 * -1) = -max(-10, -3) = 3.
    new = t([L(0.5)], torch.float64).float().requires_grad_()
    old = t([L(0.05)])
    close(clipped_policy_loss(new, old, -1.0, clip_high=0.28), 10.0, atol=1e-4)
    loss = clipped_policy_loss(new, old, -1.0, clip_high=0.28, dual_clip=3.0)
    close(loss, 3.0, atol=1e-6)
    loss.backward()
    assert new.grad.item() == 0.0                           # bounded: no gradient through r
    # A > 0 with the same ratio is untouched by dual_clip: -min(10, 1.28) = -1.28
    close(clipped_policy_loss(new, old, 1.0, clip_high=0.28, dual_clip=3.0), -1.28, atol=1e-5)
    # dual_clip does not bite when r * A is above -c * A: r = 1.4, A = -1 -> 1.4 < 3
    close(clipped_policy_loss(t([L(0.7)]), t([L(0.5)]), -1.0, clip_high=0.28, dual_clip=3.0), 1.4,
          atol=1e-5)
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_policy_loss(new, old, -1.0, dual_clip=1.0)


# 2 x 3 aggregation example. new == old, so r = 1 everywhere and loss_token = -A; with
# A = -[[1, 2, 3], [4, 5, 6]] the per-token loss is [[1, 2, 3], [4, 5, 6]].
# mask [[1, 1, 0], [1, 0, 0]] keeps 1, 2 (row 0) and 4 (row 1).
PER_TOKEN = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1, 1, 0], [1, 0, 0]]
AGG_CASES = [
    ("token-mean", None, (1 + 2 + 4) / 3),                   # 7/3
    ("seq-mean-token-mean", None, ((1 + 2) / 2 + 4 / 1) / 2),  # (1.5 + 4) / 2 = 2.75
    ("seq-mean-token-sum-norm", None, ((1 + 2) / 3 + 4 / 3) / 2),  # max_tokens = T = 3: 7/6
    ("seq-mean-token-sum-norm", 4, ((1 + 2) / 4 + 4 / 4) / 2),     # (0.75 + 1) / 2 = 7/8
]


@pytest.mark.parametrize("mode,max_tokens,expected", AGG_CASES)
def test_aggregation_modes_hand_worked(mode, max_tokens, expected):
    per_token, mask = t(PER_TOKEN), torch.tensor(MASK)
    close(aggregate(per_token, mask, mode, max_tokens=max_tokens), expected)
    old = torch.log(torch.rand(2, 3, generator=torch.Generator().manual_seed(0)))
    loss = clipped_policy_loss(old.clone(), old, -per_token, mask=mask, aggregation=mode,
                               max_tokens=max_tokens)
    close(loss, expected, atol=1e-6)


def test_aggregate_without_mask_and_1d():
    # no mask: token-mean = 21/6 = 3.5; seq-mean-token-mean = (2 + 5)/2 = 3.5;
    # sum-norm = (6/3 + 15/3)/2 = 3.5 (all equal when every row is full length)
    for mode in AGGREGATIONS:
        close(aggregate(t(PER_TOKEN), None, mode), 3.5)
    # a 1-D input is one sequence: [1, 2, 3] masked [1, 1, 0] -> token-mean 1.5, sum-norm 3/3 = 1
    close(aggregate(t([1.0, 2.0, 3.0]), t([1, 1, 0]), "token-mean"), 1.5)
    close(aggregate(t([1.0, 2.0, 3.0]), t([1, 1, 0]), "seq-mean-token-sum-norm"), 1.0)
    # a sequence masked out entirely is left out of seq-mean-token-mean's divisor, not averaged in as 0:
    # rows [1, 2 | 3] and [4, 5, 6 masked out] -> (1 + 2) / 2 = 1.5 (not 1.5 / 2 = 0.75)
    close(aggregate(t(PER_TOKEN), t([[1, 1, 0], [0, 0, 0]]), "seq-mean-token-mean"), 1.5)
    # ... and of seq-mean-token-sum-norm's: (1 + 2) / 3 = 1 (not 1 / 2): a padding row changes nothing
    close(aggregate(t(PER_TOKEN), t([[1, 1, 0], [0, 0, 0]]), "seq-mean-token-sum-norm"), 1.0)
    close(aggregate(t(PER_TOKEN), torch.zeros(2, 3), "seq-mean-token-sum-norm"), 0.0)
    # nothing counted -> 0, not NaN
    close(aggregate(t(PER_TOKEN), torch.zeros(2, 3), "seq-mean-token-mean"), 0.0)
    close(aggregate(t(PER_TOKEN), torch.zeros(2, 3), "token-mean"), 0.0)
    close(masked_mean(t([1.0, 2.0, 3.0]), t([0, 1, 1])), 2.5)
    close(masked_mean(t(PER_TOKEN), t(MASK), dim=-1), [1.5, 4.0])


def test_seed_call_shape_full_sequence_vs_completion():
    # token_ids = prompt (P = 4) + completion (C = 3), T = 7; get_logprobs gives T - 1 = 6 values,
    # the last C = 3 of which score the completion. A Python-float advantage broadcasts.
    g = torch.Generator().manual_seed(1)
    V, P, C = 11, 4, 3
    token_ids = torch.randint(0, V, (P + C,), generator=g)
    logits = torch.randn(P + C, V, generator=g, requires_grad=True)
    new = get_logprobs(logits, token_ids)
    assert new.shape == (P + C - 1,)
    old = (new.detach()[-C:] + torch.tensor([0.1, -0.3, 0.05])).clone()
    for adv in (0.7, -1.3):
        full = clipped_policy_loss(new, old, adv, clip_high=0.28)
        only = clipped_policy_loss(new[-C:], old, adv, clip_high=0.28)
        close(full, only, atol=0, rtol=0)
    # and the gradient reaches only the logits rows that score completion tokens (rows P-1 .. T-2);
    # ratios exp(-[0.1, -0.1, 0.05]) all lie inside [0.8, 1.2], so no completion row is clipped.
    old_in = (new.detach()[-C:] + torch.tensor([0.1, -0.1, 0.05])).clone()
    clipped_policy_loss(new, old_in, 0.7).backward()
    row_has_grad = logits.grad.abs().sum(-1) > 0
    assert row_has_grad.tolist() == [False] * (P - 1) + [True] * C + [False]


def test_batched_with_per_sequence_advantages():
    # old p = 0.5 everywhere; new p = [[0.6, 0.7], [0.3, 0.5]] -> r = [[1.2, 1.4], [0.6, 1.0]];
    # A = [+1, -1] per sequence, trust region [0.8, 1.28]:
    #   seq 0: -min(1.2, 1.2) = -1.2, -min(1.4, 1.28) = -1.28
    #   seq 1: -min(-0.6, -0.8) = 0.8, -min(-1, -1) = 1.0
    # token-mean = (-1.2 - 1.28 + 0.8 + 1.0) / 4 = -0.17
    old = torch.full((2, 2), L(0.5))
    new = torch.log(t([[0.6, 0.7], [0.3, 0.5]]))
    adv = t([1.0, -1.0])
    close(clipped_policy_loss(new, old, adv, clip_high=0.28), -0.17, atol=1e-6)
    # seq-mean-token-mean: ((-1.2 - 1.28)/2 + (0.8 + 1.0)/2) / 2 = (-1.24 + 0.9)/2 = -0.17 too;
    # with mask [[1, 0], [1, 1]]: (-1.2 + 0.9) / 2 = -0.15
    close(clipped_policy_loss(new, old, adv, clip_high=0.28, mask=t([[1, 0], [1, 1]]),
                              aggregation="seq-mean-token-mean"), -0.15, atol=1e-6)
    # A (B, T-1) new_lp (3 prompt positions in front) gives the same loss.
    longer = torch.cat([torch.full((2, 3), -7.0), new], dim=1)
    close(clipped_policy_loss(longer, old, adv, clip_high=0.28), -0.17, atol=1e-6)
    # Per-token (B, C) advantages equal to the broadcast (B,) ones give the same loss.
    close(clipped_policy_loss(new, old, adv[:, None].expand(2, 2), clip_high=0.28), -0.17,
          atol=1e-6)
    with pytest.raises(ValueError, match="advantages"):
        clipped_policy_loss(new, old, t([1.0, 2.0, 3.0]))


# ==============================================================================================
# clipped_policy_loss, properties

token_cases = st.lists(
    st.tuples(st.floats(-1.0, 1.0), st.floats(-3.0, 0.0), st.floats(-2.0, 2.0)),  # log r, old, A
    min_size=1, max_size=8)
clips = st.floats(0.05, 0.5)


@PROPS
@given(token_cases, clips, clips)
def test_clipped_objective_never_exceeds_unclipped(cases, clip_low, clip_high):
    for log_r, old_lp, a in cases:
        new, old = t([old_lp + log_r]), t([old_lp])
        surr = -clipped_policy_loss(new, old, a, clip_low=clip_low, clip_high=clip_high)
        r = torch.exp(new - old)
        assert surr.item() <= (r * a).item() + 1e-6 * (1 + abs((r * a).item()))


@PROPS
@given(token_cases, clips, clips)
def test_gradient_zero_exactly_in_clipped_region(cases, clip_low, clip_high):
    old = t([c[1] for c in cases])
    new = (old + t([c[0] for c in cases])).requires_grad_()
    adv = t([c[2] for c in cases])
    clipped_policy_loss(new, old, adv, clip_low=clip_low, clip_high=clip_high).backward()
    grad = new.grad
    r = torch.exp(new.detach() - old)               # the ratio exactly as the loss computes it
    m = 1e-4                                        # stay off the kinks at 1-clip_low, 1+clip_high
    clipped = ((adv > 0) & (r > 1 + clip_high + m)) | ((adv < 0) & (r < 1 - clip_low - m))
    inside = (r > 1 - clip_low + m) & (r < 1 + clip_high - m) & (adv.abs() > 1e-3)
    pessimistic = (((adv > 1e-3) & (r < 1 - clip_low - m))
                   | ((adv < -1e-3) & (r > 1 + clip_high + m)))
    assert (grad[clipped] == 0).all()
    for sel in (inside, pessimistic):
        assert (grad[sel] != 0).all()
        # d/dnew of -(r * A) / N = -A * r / N
        close(grad[sel], -adv[sel] * r[sel] / len(cases), atol=1e-6, rtol=1e-5)
    # clip_fraction counts exactly the clipped tokens (the ones with zero gradient)
    close(clip_fraction(new.detach(), old, adv, clip_low=clip_low, clip_high=clip_high),
          (((adv > 0) & (r > 1 + clip_high)) | ((adv < 0) & (r < 1 - clip_low))).float().mean())


# ==============================================================================================
# get_logprobs


def test_get_logprobs_hand_worked():
    # V = 2. Row 0 = [0, log 3] -> p = [1/4, 3/4]; token_ids[1] = 1 -> log 3/4.
    #        Row 1 = [0, 0]     -> p = [1/2, 1/2]; token_ids[2] = 0 -> log 1/2.
    #        Row 2 is never read (it would score a token after the end): NaN there is harmless.
    logits = t([[0.0, L(3)], [0.0, 0.0], [float("nan"), float("nan")]])
    ids = torch.tensor([0, 1, 0])          # token 0 is the prompt, never scored
    close(get_logprobs(logits, ids), [L(0.75), L(0.5)])
    # temperature 2: row 0 / 2 = [0, log 3 / 2] -> p(1) = sqrt 3 / (1 + sqrt 3)
    close(get_logprobs(logits, ids, temperature=2.0),
          [L(math.sqrt(3) / (1 + math.sqrt(3))), L(0.5)])


shapes = st.tuples(st.integers(1, 3), st.integers(2, 7), st.integers(2, 9))   # B, T, V


def _random_case(B, T, V, seed, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, ids, g


@PROPS
@given(shapes, st.floats(0.3, 2.0), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_get_logprobs_matches_naive_fp32(shape, temp, chunk, seed):
    logits, ids, g = _random_case(*shape, seed)
    logits.requires_grad_()
    ours = get_logprobs(logits, ids, temperature=temp, chunk_size=chunk)
    ref = naive_logprobs(logits, ids, temp)
    assert ours.dtype == torch.float32 and ours.shape == (shape[0], shape[1] - 1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # gradients against autograd of the naive version, for a random upstream gradient
    up = torch.randn(ours.shape, generator=g)
    (g_ours,) = torch.autograd.grad(ours, logits, up)
    (g_ref,) = torch.autograd.grad(ref, logits, up)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-5, rtol=1e-5)
    assert (g_ours[:, -1] == 0).all()                 # the last logit row scores nothing
    # chunk_size smaller than T gives the same values as one chunk
    torch.testing.assert_close(get_logprobs(logits, ids, temperature=temp, chunk_size=1024), ours,
                               atol=1e-6, rtol=1e-6)


@PROPS
@given(shapes, st.floats(0.3, 2.0), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_get_logprobs_bf16_logits(shape, temp, chunk, seed):
    # bf16 logits are upcast to fp32 inside, so the result must equal the fp32 reference computed
    # from the *same* bf16 values upcast, to fp32 rounding: atol = rtol = 1e-5.
    logits, ids, g = _random_case(*shape, seed, dtype=torch.bfloat16)
    logits.requires_grad_()
    ours = get_logprobs(logits, ids, temperature=temp, chunk_size=chunk)
    assert ours.dtype == torch.float32
    up_logits = logits.detach().float().requires_grad_()
    ref = naive_logprobs(up_logits, ids, temp)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # The gradient comes back in bf16: it must be the fp32 gradient rounded to bf16 (within
    # bf16's own tolerance, rtol 1.6e-2: the two fp32 values may round to neighbouring bf16s).
    up = torch.randn(ours.shape, generator=g)
    (g_ours,) = torch.autograd.grad(ours, logits, up)
    (g_ref,) = torch.autograd.grad(ref, up_logits, up)
    assert g_ours.dtype == torch.bfloat16
    torch.testing.assert_close(g_ours, g_ref.bfloat16(), atol=1e-4, rtol=1.6e-2)


@pytest.mark.parametrize("temp,chunk", [(1.0, 1024), (0.7, 2), (1.6, 1)])
def test_get_logprobs_gradcheck_fp64(temp, chunk):
    logits, ids, _ = _random_case(2, 5, 4, seed=3, dtype=torch.float64, scale=1.0)
    logits.requires_grad_()
    out = get_logprobs(logits, ids, temperature=temp, chunk_size=chunk)
    assert out.dtype == torch.float64                 # fp64 logits stay fp64
    torch.testing.assert_close(out, naive_logprobs(logits, ids, temp), atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: get_logprobs(x, ids, temperature=temp, chunk_size=chunk), (logits,))
    # 2-D (T, V) input goes through the same path
    assert torch.autograd.gradcheck(
        lambda x: get_logprobs(x, ids[0], temperature=temp, chunk_size=chunk), (logits[0].detach()
                                                                             .requires_grad_(),))


def test_get_logprobs_2d_input():
    logits, ids, _ = _random_case(1, 6, 5, seed=4)
    out2d = get_logprobs(logits[0], ids[0], chunk_size=2)
    assert out2d.shape == (5,)
    torch.testing.assert_close(out2d, get_logprobs(logits, ids)[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out2d, naive_logprobs(logits[0], ids[0]), atol=1e-5, rtol=1e-5)


def _saved_tensors(fn):
    """Run fn() and return (shape, dtype) of every tensor autograd saved for backward."""
    saved = []

    def pack(x):
        saved.append((tuple(x.shape), x.dtype))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return saved


def test_get_logprobs_saves_no_fp32_vocab_tensor():
    B, T, V = 2, 16, 64
    logits, ids, _ = _random_case(B, T, V, seed=5, dtype=torch.bfloat16)
    logits.requires_grad_()
    old = torch.full((B, 5), -1.0)

    def big_fp32(saved):
        # anything with a vocab-sized last dim and at least (B, T-1, V) elements, in fp32 or wider
        return [s for s in saved if s[0] and s[0][-1] == V and math.prod(s[0]) >= B * (T - 1) * V
                and s[1] in (torch.float32, torch.float64)]

    # Control: the naive version saves full fp32 (B, T, V) tensors, so the hook does see them.
    naive = _saved_tensors(lambda: naive_logprobs(logits, ids))
    assert big_fp32(naive)
    # get_logprobs and the whole loss on top of it: only the bf16 logits are vocab-sized (as
    # the (B*T, V) view get_logprobs works on: no copy).
    saved = _saved_tensors(
        lambda: clipped_policy_loss(get_logprobs(logits, ids, chunk_size=4), old, 1.0))
    assert not big_fp32(saved), saved
    vocab_sized = [s for s in saved if s[0] and s[0][-1] == V]
    assert vocab_sized == [((B * T, V), torch.bfloat16)]
    # ... and the rest are (B*T)-sized (the targets of every row) or smaller
    assert all(math.prod(s[0]) <= B * T for s in saved if s not in vocab_sized)


def test_get_logprobs_extra_peak_memory_is_at_most_twice_the_logits():
    """Forward + backward of get_logprobs on bf16 logits of a real vocabulary's width hold at
    most 2x the logits' own bytes on top of them (their gradient, 1x, plus bounded fp32 chunks),
    whatever the batch shape: one big batch of short rows here, where chunking along the
    sequence alone made one fp32 block of the whole batch (7.5x). Live bytes are the
    allocator's own events (torch.profiler, profile_memory), not the process's RSS."""
    from torch.profiler import ProfilerActivity, profile
    B, T, V = 8, 128, 32000
    logits = torch.randn(B, T, V, dtype=torch.bfloat16).requires_grad_()
    ids, up = torch.randint(0, V, (B, T)), torch.randn(B, T - 1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (grad,) = torch.autograd.grad(get_logprobs(logits, ids), logits, up)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    size = logits.numel() * logits.element_size()
    assert live == grad.numel() * grad.element_size()       # what is left: the gradient
    assert size <= peak <= 2 * size, peak / size


def test_get_logprobs_errors():
    logits = torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match="disagree"):
        get_logprobs(logits, torch.zeros(2, 5, dtype=torch.long))       # T mismatch
    with pytest.raises(ValueError, match="disagree"):
        get_logprobs(logits, torch.zeros(3, 4, dtype=torch.long))       # B mismatch
    with pytest.raises(ValueError, match="disagree"):
        get_logprobs(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))  # 2-D, T mismatch
    ids = torch.zeros(2, 4, dtype=torch.long)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            get_logprobs(logits, ids, temperature=bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="chunk_size"):
            get_logprobs(logits, ids, chunk_size=bad)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))


# ==============================================================================================
# entropy


def test_entropy():
    # uniform over V -> log V, at any temperature
    V = 7
    close(entropy_from_logits(torch.zeros(2, 3, V)), torch.full((2, 3), L(V)), atol=1e-6)
    close(entropy_from_logits(torch.full((4, V), 2.5), temperature=0.5, chunk_size=3),
          torch.full((4,), L(V)), atol=1e-6)
    # p = [1/4, 3/4]: H = -(1/4 log 1/4 + 3/4 log 3/4) = 0.5623
    h = -(0.25 * L(0.25) + 0.75 * L(0.75))
    close(entropy_from_logits(t([[0.0, L(3)]]).bfloat16().float()), [h], atol=1e-2)
    close(entropy_from_logits(t([[0.0, L(3)]])), [h], atol=1e-6)
    # a masked (-inf) token has p = 0 and contributes 0 log 0 = 0: [0, 0, -inf] -> log 2, not NaN
    x = t([[0.0, 0.0, float("-inf")]]).requires_grad_()
    e = entropy_from_logits(x)
    close(e, [L(2)], atol=1e-6)
    e.sum().backward()
    assert torch.isfinite(x.grad).all()
    # chunking does not change the result; gradient matches the closed form on random logits
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 6, generator=g, requires_grad=True)
    ref = -(torch.softmax(x / 1.3, -1) * torch.log_softmax(x / 1.3, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(x, temperature=1.3, chunk_size=2), ref)
    # no position at all (every token of a micro-batch masked): an empty result, not an error
    assert entropy_from_logits(torch.zeros(0, V)).shape == (0,)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(x, chunk_size=0)


def test_token_logprobs_entropy_from_the_same_pass():
    """entropy=True: each row's entropy of softmax(logits / T) beside the log-probs, hand-worked, and
    equal to entropy_from_logits; no gradient through it, and the log-probs and their gradient unchanged."""
    # p = [1/4, 3/4] (logits [0, log 3]): log p(1) = log 3/4, H = 0.5623; at T = 2 the same logits
    # are [0, log 3 / 2]: p(1) = sqrt 3 / (1 + sqrt 3)
    h = -(0.25 * L(0.25) + 0.75 * L(0.75))
    lp, ent = token_logprobs(t([[0.0, L(3)]]), torch.tensor([1]), entropy=True)
    close(lp, [L(0.75)], atol=1e-6)
    close(ent, [h], atol=1e-6)
    q = math.sqrt(3) / (1 + math.sqrt(3))
    close(token_logprobs(t([[0.0, L(3)]]), torch.tensor([0]), temperature=2.0, entropy=True)[1],
          [-(q * L(q) + (1 - q) * L(1 - q))], atol=1e-6)
    # a masked (-inf) logit: p = 0 adds 0 log 0 = 0, not NaN
    close(token_logprobs(t([[0.0, 0.0, float("-inf")]]), torch.tensor([0]), entropy=True)[1], [L(2)], atol=1e-6)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 50, generator=g).bfloat16().requires_grad_()
    tg = torch.randint(0, 50, (37,), generator=g)
    for temp, chunk in [(1.0, None), (0.7, 5), (1.3, 100)]:
        lp, ent = token_logprobs(x, tg, temperature=temp, chunk_size=chunk, entropy=True)
        assert not ent.requires_grad and ent.dtype == torch.float32
        torch.testing.assert_close(ent, entropy_from_logits(x.detach(), temperature=temp))
        (grad,) = torch.autograd.grad(lp.sum(), x)
        plain = token_logprobs(x, tg, temperature=temp, chunk_size=chunk)
        assert torch.equal(lp, plain)
        assert torch.equal(grad, torch.autograd.grad(plain.sum(), x)[0])


# ==============================================================================================
# KL estimators


def test_kl_hand_worked():
    # log p = log 0.5, log q = log 0.25:  log p - log q = log 2 = 0.693147
    #   k1 = log 2 = 0.693147
    #   k2 = (log 2)^2 / 2 = 0.240227
    #   k3 = q/p - 1 - log(q/p) = 0.5 - 1 - log 0.5 = -0.5 + 0.693147 = 0.193147
    lp, ref = t([L(0.5)]), t([L(0.25)])
    close(kl_k1(lp, ref), [L(2)])
    close(kl_k2(lp, ref), [L(2) ** 2 / 2])
    close(kl_k3(lp, ref), [0.5 - 1 + L(2)])
    # swapped: k1 = -log 2 < 0 (k1 can be negative); k3 = 2 - 1 - log 2 = 0.306853
    close(kl_k1(ref, lp), [-L(2)])
    close(kl_k3(ref, lp), [1 - L(2)])
    # identical distributions: all zero
    for k in (kl_k1, kl_k2, kl_k3):
        close(k(lp, lp), [0.0])


@PROPS
@given(st.lists(st.tuples(st.floats(-20, 0), st.floats(-20, 0)), min_size=1, max_size=16))
def test_kl_k2_k3_nonnegative(pairs):
    lp, ref = t([p[0] for p in pairs]), t([p[1] for p in pairs])
    assert (kl_k2(lp, ref) >= 0).all()
    assert (kl_k3(lp, ref) >= 0).all()
    # and both are exactly 0 where the log-probs agree
    assert (kl_k2(lp, lp) == 0).all()
    assert (kl_k3(lp, lp) == 0).all()


# ==============================================================================================
# importance weights

# train p = [0.6, 0.3, 0.9], sampler p = [0.5, 0.5, 0.3] -> token ratios [1.2, 0.6, 3.0]
TRAIN = torch.log(t([0.6, 0.3, 0.9]))
SAMP = torch.log(t([0.5, 0.5, 0.3]))


def test_truncated_importance_weights():
    # token level, cap 2: [min(1.2, 2), min(0.6, 2), min(3, 2)] = [1.2, 0.6, 2.0]
    close(truncated_importance_weights(TRAIN, SAMP), [1.2, 0.6, 2.0], atol=1e-6)
    close(truncated_importance_weights(TRAIN, SAMP, cap=5.0), [1.2, 0.6, 3.0], atol=1e-5)
    # sequence level, mask [1, 1, 0]: exp(log 1.2 + log 0.6) = 0.72, broadcast to every token
    close(truncated_importance_weights(TRAIN, SAMP, t([1, 1, 0]), level="sequence"),
          [0.72] * 3, atol=1e-6)
    # sequence level, no mask: 1.2 * 0.6 * 3 = 2.16 -> capped at 2
    close(truncated_importance_weights(TRAIN, SAMP, level="sequence"), [2.0] * 3)
    close(truncated_importance_weights(TRAIN, SAMP, level="sequence", cap=3.0), [2.16] * 3,
          atol=1e-5)
    # batched (B, C): one weight per row
    w = truncated_importance_weights(torch.stack([TRAIN, SAMP]), torch.stack([SAMP, SAMP]),
                                     level="sequence", cap=10.0)
    close(w, [[2.16] * 3, [1.0] * 3], atol=1e-5)
    # detached even when the trainer log-probs carry a gradient
    assert not truncated_importance_weights(TRAIN.clone().requires_grad_(), SAMP).requires_grad
    # train log-probs covering the prompt too (T-1 > C) are right-aligned
    longer = torch.cat([t([-9.0, -9.0]), TRAIN])
    close(truncated_importance_weights(longer, SAMP), [1.2, 0.6, 2.0], atol=1e-6)
    with pytest.raises(ValueError, match="level"):
        truncated_importance_weights(TRAIN, SAMP, level="sentence")


def test_masked_importance_weights():
    # token ratios [1.2, 0.6, 3.0]; keep low <= r <= high
    close(masked_importance_weights(TRAIN, SAMP), [1, 1, 0])               # [0.5, 2]
    close(masked_importance_weights(TRAIN, SAMP, low=0.7), [1, 0, 0])      # 0.6 < 0.7
    close(masked_importance_weights(TRAIN, SAMP, high=3.5), [1, 1, 1])
    # sequence level: 0.72 (mask [1,1,0]) is kept; 2.16 (no mask) > 2 drops the whole sequence
    close(masked_importance_weights(TRAIN, SAMP, t([1, 1, 0]), level="sequence"), [1, 1, 1])
    close(masked_importance_weights(TRAIN, SAMP, level="sequence"), [0, 0, 0])
    # bounds are inclusive: a ratio of exactly 1 survives low = high = 1
    close(masked_importance_weights(torch.zeros(3), torch.zeros(3), low=1.0, high=1.0), [1, 1, 1])
    w = masked_importance_weights(TRAIN.clone().requires_grad_(), SAMP)
    assert w.dtype == torch.float32 and not w.requires_grad


# ==============================================================================================
# statistics


def test_clip_fraction_hand_worked():
    new = t([L(h[1]) for h in HAND])
    old = t([L(h[0]) for h in HAND])
    adv = t([h[2] for h in HAND])
    # with [0.8, 1.28] only tokens 1 (A>0, r=1.4) and 2 (A<0, r=0.6) are clipped: 2/6
    close(clip_fraction(new, old, adv, clip_low=0.2, clip_high=0.28), 2 / 6)
    # symmetric [0.8, 1.2]: token 5 (A>0, r=1.25) is clipped too: 3/6
    close(clip_fraction(new, old, adv, clip_low=0.2), 3 / 6)
    # masking out token 1: 1 clipped of 5 counted
    close(clip_fraction(new, old, adv, mask=t([1, 0, 1, 1, 1, 1]), clip_high=0.28), 1 / 5)
    # batched with (B,) advantages and longer new log-probs
    close(clip_fraction(torch.cat([t([[0.0], [0.0]]), new[None, :2].expand(2, 2)], 1),
                        old[None, :2].expand(2, 2), t([1.0, -1.0]), clip_high=0.28), 1 / 4)


def test_approx_kl_hand_worked():
    # samples from old; k3 with p = old, q = new: new = log .25, old = log .5 -> 0.193147;
    # second token new == old -> 0. Mean = 0.0965736; with mask [1, 0] -> 0.193147
    new, old = torch.log(t([0.25, 0.5])), torch.log(t([0.5, 0.5]))
    close(approx_kl(new, old), (0.5 - 1 + L(2)) / 2)
    close(approx_kl(new, old, t([1, 0])), 0.5 - 1 + L(2))
    close(approx_kl(torch.cat([t([-3.0]), new]), old), (0.5 - 1 + L(2)) / 2)   # right-aligned


# ==============================================================================================
# errors


def test_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(x, None, "sum")
    with pytest.raises(ValueError, match="unknown aggregation"):
        clipped_policy_loss(x, x, 1.0, aggregation="seq-sum")
    with pytest.raises(ValueError, match="at least"):
        clipped_policy_loss(torch.zeros(2, 2), x, 1.0)        # new_lp shorter than old_lp
    with pytest.raises(ValueError, match="at least"):
        clip_fraction(torch.zeros(2), torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="at least"):
        truncated_importance_weights(torch.zeros(2), torch.zeros(3))


def test_fingerprint_is_a_content_checksum():
    import struct
    from minirl.weights import fingerprint
    # Elements read as little-endian 64-bit words, leftovers at their own width: bf16 1.0 = 0x3F80
    assert fingerprint([torch.tensor([1.0], dtype=torch.bfloat16)]).item() == 0x3F80
    word = struct.unpack("<q", struct.pack("<ff", 1.0, -2.0))[0]          # 0xC00000003F800000
    assert word == 0x3F800000 - (0x40000000 << 32)
    assert fingerprint([torch.tensor([1.0, -2.0, 1.0])]).item() == word + 0x3F800000
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    x = torch.randn(11, dtype=torch.bfloat16)
    # The same contents give the same checksum whatever the layout (transposed, misaligned view)
    assert fingerprint([w.t()]) == fingerprint([w.t().contiguous()])
    assert fingerprint([x[1:]]) == fingerprint([x[1:].clone()])
    before = fingerprint([w, x]).item()
    w[3, 5] += 0.01                                                       # one element moves
    assert fingerprint([w, x]).item() != before
    assert fingerprint([]).item() == 0
