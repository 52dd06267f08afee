"""The Trainer on a real GPU: packed rows through torch's flash varlen attention give the
log-probs and gradients of unpacked rows and of the SDPA path, and the whole-batch token mean.

Needs one CUDA GPU with torch.nn.attention.varlen (torch >= 2.10); skipped otherwise. Run on the
GPU machine: `python -m pytest tests/gpu -q` (MINIRL_RESULTS_DIR=$OUT also writes what was seen).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")]


def _rollouts(n=12, seed=0):
    from minirl import Rollout
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P, C = 3 + i % 7, 5 + (5 * i) % 40
        ids = torch.randint(2, 60, (P + C,), generator=g).tolist()
        out.append(Rollout(prompt_ids=ids[:P], completion_ids=ids[P:], reward=0.0,
                           sampling_logprobs=(-torch.rand(C, generator=g) * 4).tolist(),
                           advantage=float(torch.randn(1, generator=g))))
    return out


def _run(trainer, rollouts, budget):
    from minirl import ppo_loss_fn
    trainer.config = dataclasses.replace(trainer.config, micro_batch_tokens=budget)
    out = trainer.forward_backward(rollouts, ppo_loss_fn(entropy=False))
    grads = {n: p.grad.full_tensor().float().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return out, grads


def test_varlen_packing_matches_unpacked_and_sdpa(tmp_path):
    from minirl.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    model = str(build_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2))  # GQA
    varlen = Trainer(model, TrainerConfig(attention="varlen"))
    sdpa = Trainer(model, TrainerConfig(attention="sdpa"))
    assert varlen.model.config._attn_implementation == "minirl_varlen"
    rs = _rollouts()
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
    if os.environ.get("MINIRL_RESULTS_DIR"):
        Path(os.environ["MINIRL_RESULTS_DIR"], "test_varlen.json").write_text(json.dumps(seen, indent=1))
