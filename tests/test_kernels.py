"""minirl.kernels (the Triton log-prob kernels the trainer runs on CUDA) against core's plain path, run
by Triton's interpreter on CPU: subprocesses, since TRITON_INTERPRET is read when the kernels are
defined. On CUDA the same kernels meet the trainer in tests/gpu/test_trainer_gpu.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import json
import torch
from minirl import core, kernels
torch.manual_seed(0)
worst = {}
for dtype in (torch.bfloat16, torch.float32):
    for V in (5000, 9000):                                # one and three blocks of 4,096, the last partial
        x = (torch.randn(6, V) * 3).to(dtype)
        x[1, :4500] = float("-inf")                       # a whole first block masked
        x[2, 7:] = float("-inf")                          # all but 7 tokens masked
        tg = torch.tensor([3, 4600, 5, 0, 10, V - 1])
        for T in (1.0, 0.7):
            lp, lse, ent = kernels.forward(x, tg, T, True)
            ref = core.token_logprobs(x.double(), tg, temperature=T, entropy=True)
            only = kernels.forward(x, tg, T, False)
            g = torch.rand(6) if T != 1.0 else torch.full((1,), 0.5).expand(6)   # expand: stride 0
            out = torch.empty_like(x)
            kernels.backward(x, tg[:, None], lse[:, None], g[:, None], T, out)
            xd = x.double().requires_grad_()
            (core.token_logprobs(xd, tg, temperature=T) * g.double()).sum().backward()
            for k, d in {"lp": lp - ref[0], "ent": ent - ref[1], "lp_alone": only[0] - lp,
                         "lse": lse.double() - torch.logsumexp(x.double() / T, -1),
                         "grad": (out.double() - xd.grad) / xd.grad.abs().clamp(min=1e-3)}.items():
                worst[k] = max(worst.get(k, 0.0), d.abs().max().item())
print(json.dumps(worst))
"""


def test_kernels_match_the_reference_log_probs_entropies_and_gradients():
    """Hand-checkable cases: rows with a masked first block and with all but seven logits masked,
    vocabularies of one and three blocks, T = 1 and 0.7, bf16 and fp32 logits, against fp64 torch;
    the broadcast g a loss's sum() hands backward (stride 0)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    assert worst["lp"] < 1e-4 and worst["lse"] < 1e-4 and worst["ent"] < 1e-4, worst
    assert worst["lp_alone"] == 0.0, worst            # entropy or not, the same log-probs
    assert worst["grad"] < 2 ** -7, worst              # relative: bf16's step (the interpreter truncates)


FUSED = r"""
import math
import torch
from minirl import kernels
from minirl.core import token_logprobs
kernels.usable = lambda x: x.dtype != torch.float64 and x.is_contiguous()   # CPU tensors, interpreted
g = torch.Generator().manual_seed(9)
for dt in (torch.float32, torch.bfloat16, torch.float64):             # fp64: the plain path
    x = (3 * torch.randn(37, 50, generator=g)).to(dt)
    x[3, 7] = float("-inf")
    x.requires_grad_()
    tg = torch.randint(0, 50, (37,), generator=g)
    w = torch.arange(37.0, dtype=torch.promote_types(dt, torch.float32))
    for temp, chunk in [(1.0, None), (0.7, 5), (1.3, 100)]:
        ref, ref_ent = token_logprobs(x, tg, temperature=temp, chunk_size=chunk, entropy=True)
        got, got_ent = token_logprobs(x, tg, temperature=temp, chunk_size=chunk, entropy=True, compile="inductor")
        plain = token_logprobs(x, tg, temperature=temp, chunk_size=chunk, compile="inductor")
        assert got.dtype == ref.dtype and got_ent.dtype == ref_ent.dtype and not got_ent.requires_grad
        torch.testing.assert_close(got, ref)
        torch.testing.assert_close(plain, ref)
        torch.testing.assert_close(got_ent, ref_ent)
        assert torch.isfinite(got_ent).all()
        (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
        (g_got,) = torch.autograd.grad((got * w).sum(), x)
        assert g_got.dtype == dt
        torch.testing.assert_close(g_got, g_ref)
# hand-worked: logits [0, log 3] -> p = [1/4, 3/4]; d log p(1) / dx = onehot - p = [-1/4, 1/4]
x = torch.tensor([[0.0, math.log(3)]]).requires_grad_()
lp = token_logprobs(x, torch.tensor([1]), compile="inductor")
torch.testing.assert_close(lp, torch.tensor([math.log(0.75)]), atol=1e-6, rtol=0)
torch.testing.assert_close(torch.autograd.grad(lp.sum(), x)[0], torch.tensor([[-0.25, 0.25]]), atol=1e-6, rtol=0)
print("ok")
"""


def test_token_logprobs_fused_path_equals_the_reference():
    """token_logprobs(compile=...) through the kernels (the trainer's path on CUDA) gives the plain
    path's log-probs, entropies and gradients: temperatures, chunkings (the kernels on each chunk's
    slice), fp32 / bf16 logits (fp64: the plain path), a masked (-inf) logit, a gradient weighted
    per row, and a hand-worked two-token case."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", FUSED], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
