"""The Trainer on a real GPU: packed rows through torch's flash varlen attention give the
log-probs and gradients of unpacked rows and of the SDPA path, and the whole-batch token mean.

Needs one CUDA GPU with torch.nn.attention.varlen (torch >= 2.10); skipped otherwise. Run on the
GPU machine: `python -m pytest tests/gpu -q` (MINIRL_RESULTS_DIR=$OUT also writes what was seen).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")]


def _run(trainer, rollouts, budget):
    from minirl import ppo_loss_fn
    trainer.micro_batch_tokens = budget
    out = trainer.forward_backward(rollouts, ppo_loss_fn(entropy=False))
    grads = {n: p.grad.full_tensor().float().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return out, grads


def test_varlen_packing_matches_unpacked_and_sdpa(tmp_path):
    from minirl.recipes.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    model = str(build_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2))  # GQA
    varlen = Trainer(model, TrainerConfig(attention="varlen"))
    sdpa = Trainer(model, TrainerConfig(attention="sdpa"))
    assert varlen.model.config._attn_implementation == "minirl_varlen"
    from test_trainer import _rollouts      # tests/ is on the path (its conftest)
    rs = _rollouts(12)
    packed, g_packed = _run(varlen, rs, 4096)
    unpacked, g_unpacked = _run(varlen, rs, 1)
    ref, g_ref = _run(sdpa, rs, 4096)
    seen = {"losses": [packed["loss"], unpacked["loss"], ref["loss"]],
            "micro_batches": [packed["micro_batches"], unpacked["micro_batches"]], "max_rel_grad_diff": {}}
    assert packed["micro_batches"] == 1 and unpacked["micro_batches"] == len(rs)
    for name, g in (("unpacked", g_unpacked), ("sdpa", g_ref)):
        rel = max(float((g_packed[n] - g[n]).norm() / g[n].norm().clamp(min=1e-12)) for n in g)
        seen["max_rel_grad_diff"][name] = rel
        assert rel < 0.05, (name, rel)            # bf16 compute: a few percent at most
    assert abs(packed["loss"] - unpacked["loss"]) < 1e-2 and abs(packed["loss"] - ref["loss"]) < 1e-2
    _record("test_varlen.json", seen)


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_token_logprobs_on_cuda_match_fp64(compile):
    """The chunked log-probs, their gradient and the fused entropy on bf16 CUDA logits at a real
    vocabulary's width equal the fp64 reference of the same bf16 values, on the plain path and on
    the fused one the trainer takes on CUDA (compile="inductor": minirl.kernels' Triton kernels)."""
    from minirl import kernels
    from minirl.core import token_logprobs
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(300, 151936, device="cuda", generator=g) * 3).bfloat16().requires_grad_()
    assert compile is None or kernels.usable(x)
    tg = torch.randint(0, 151936, (300,), device="cuda", generator=g)
    for temp in (1.0, 0.7):
        lp, ent = token_logprobs(x, tg, temperature=temp, entropy=True, chunk_size=64, compile=compile)
        (grad,) = torch.autograd.grad(lp.sum(), x)
        ref_x = (x.detach().double() / temp).requires_grad_()
        ref_logp = torch.log_softmax(ref_x, -1)
        ref_lp = ref_logp.gather(-1, tg[:, None]).squeeze(-1)
        (ref_grad,) = torch.autograd.grad(ref_lp.sum(), ref_x)
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-4, rtol=0)
        torch.testing.assert_close(ent.double(), -(ref_logp.exp() * ref_logp).sum(-1).detach(), atol=1e-3, rtol=0)
        torch.testing.assert_close(grad.double(), ref_grad / temp, atol=1e-6, rtol=1e-2)  # a bf16 gradient


def test_fused_token_logprobs_memory_on_cuda():
    """The fused path's forward + backward over 8,192 rows of bf16 logits at the real vocabulary
    holds at most the logits' gradient plus half the logits' size beyond them (the issue's bound:
    2x the logits), whatever rows per chunk it takes."""
    from minirl.core import token_logprobs
    x = (torch.randn(8192, 151936, device="cuda") * 3).bfloat16().requires_grad_()
    tg = torch.randint(0, 151936, (8192,), device="cuda")
    size = x.numel() * x.element_size()
    for _ in range(2):                       # the first call compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp, _ = token_logprobs(x, tg, temperature=0.7, entropy=True, compile="inductor")
        (grad,) = torch.autograd.grad(lp.sum(), x)
        extra = torch.cuda.max_memory_allocated() - base
        del grad, lp
    assert extra <= 1.5 * size, f"{extra / 2**30:.2f} GiB beyond {size / 2**30:.2f} GiB of logits"
    _record("test_fused_logprobs_memory.json", {"logits_gib": size / 2**30, "extra_gib": extra / 2**30})


def _record(name: str, seen: dict) -> None:
    """Write what a test saw as $MINIRL_RESULTS_DIR/name (nothing when the variable is unset)."""
    if os.environ.get("MINIRL_RESULTS_DIR"):
        out = Path(os.environ["MINIRL_RESULTS_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(seen, indent=1))


def test_optimizer_state_to_host_frees_the_device_and_steps_unchanged(tmp_path):
    """On CUDA (fused AdamW, pinned host buffer, side-stream copies): moving AdamW's state to the
    host frees its device memory, bringing it back overlaps a forward and backward, and the step
    after each round trip gives exactly the weights of a trainer whose state stayed."""
    from minirl import ppo_loss_fn
    from minirl.recipes.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    from test_trainer import _rollouts
    model = str(build_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2))
    cfg = TrainerConfig(lr=1e-3, max_grad_norm=None)
    a, b = Trainer(model, cfg), Trainer(model, cfg)
    rs, seen = _rollouts(8), {}
    for i in range(3):
        before = torch.cuda.memory_allocated()
        a.optimizer_to_host(wait=i == 0)
        a.optimizer_to_host()
        seen.setdefault("freed", []).append(before - torch.cuda.memory_allocated())
        assert before - torch.cuda.memory_allocated() >= a.optimizer_state_bytes
        a.optimizer_to_device()
        for t in (a, b):
            t.forward_backward(rs, ppo_loss_fn(entropy=False))
            t.optim_step()
        assert all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(a.model.parameters(), b.model.parameters()))
    seen["state_bytes"] = a.optimizer_state_bytes
    if os.environ.get("MINIRL_RESULTS_DIR"):
        out = Path(os.environ["MINIRL_RESULTS_DIR"]) / "optimizer_offload.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(seen))
