"""Bigger models on fewer GPUs, on CPU: LoRA (merge worked by hand, the verified sync of merged
weights, adapter-only checkpoints with exact resume, the merged export, the demo learning), the
reference policy and its KL penalty (by hand, and zero until the policy moves), host offload's
configuration path (a no-op on CPU: the GPU run is the real check), and the memory estimate.

Needs: CPU only. One in-process engine (~15 s); the demo runs in a fresh process (~60 s).
"""

import json

import pytest
import torch
from vllm import SamplingParams

from conftest import run_py
from minirl import parse_vllm_outputs, ppo_loss_fn
from minirl.colocated import SyncError, WeightManager, WeightManagerConfig
from minirl.memory import GIB, HOST_RESERVE, check_fits, estimate_memory
from minirl.lora import LoRAConfig, merge_bucket
from minirl.reference import kl_penalty
from minirl.recipes.tasks import get_task
from minirl.trainer import Trainer, TrainerConfig
from test_trainer import _rollouts


def test_merge_bucket_by_hand():
    # W = I, A = [[1, 2]] (rank 1, in 2), B = [[1], [0]] (out 2), scale 2:
    # W + 2 * B @ A = [[1 + 2, 0 + 4], [0, 1]] = [[3, 4], [0, 1]]; the norm passes through.
    bucket = [("m.q.base_layer.weight", torch.eye(2)),
              ("m.q.lora_A.default.weight", torch.tensor([[1., 2.]])),
              ("m.q.lora_B.default.weight", torch.tensor([[1.], [0.]])),
              ("m.norm.weight", torch.ones(2))]
    out = dict(merge_bucket(bucket, 2.0))
    assert list(out) == ["m.q.weight", "m.norm.weight"]
    assert out["m.q.weight"].tolist() == [[3., 4.], [0., 1.]]
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRAConfig(rank=0).check()
    for alpha in (0.0, float("nan")):       # scale 0 (or NaN): B @ A never reaches the output, nothing trains
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            LoRAConfig(alpha=alpha).check()


def test_an_adapter_on_a_tied_lm_head_is_refused(tiny_model, tmp_path):
    """A tied lm_head's weight is the embedding's: no merged weight can carry its adapter (the sync
    and the export send the embedding alone). Untied, the lm_head's adapter merges as any other."""
    from transformers import AutoModelForCausalLM
    from minirl.lora import apply_lora
    from minirl.recipes.tiny import build_tiny_model
    cfg = LoRAConfig(rank=4, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match=r"\['lm_head'\] share their weight"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), cfg)
    untied = build_tiny_model(tmp_path / "untied", tie_word_embeddings=False)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(untied), cfg)
    with torch.no_grad():
        model.lm_head.lora_B.default.weight.fill_(1.0)
    merged = dict(merge_bucket(list(model.named_parameters()), cfg.scale))
    assert not torch.equal(merged["lm_head.weight"], model.lm_head.base_layer.weight)


def test_kl_penalty_by_hand():
    # log p = [-1, -2], log q = [-2, -2]: k1 = [1, 0]; k2 = [0.5, 0]; k3 = e^-1 - 1 + 1 = [0.3679, 0].
    class Batch:
        ref_logprobs = torch.tensor([-2., -2.])
    lp = torch.tensor([-1., -2.])
    base = lambda lp, batch, logits: (torch.zeros(2), {})                 # noqa: E731
    for est, want in (("k1", [1., 0.]), ("k2", [0.5, 0.]), ("k3", [0.36788, 0.])):
        loss, stats = kl_penalty(base, coef=0.1, estimator=est)(lp, Batch, None)
        assert torch.allclose(stats["kl_ref"], torch.tensor(want), atol=1e-5)
        assert torch.allclose(loss, 0.1 * torch.tensor(want), atol=1e-6)
    Batch.ref_logprobs = None
    with pytest.raises(ValueError, match="reference=True"):
        kl_penalty(base, coef=0.1)(lp, Batch, None)
    with pytest.raises(ValueError, match="choose one of"):
        kl_penalty(base, coef=0.1, estimator="k4")
    for coef in (float("nan"), float("inf")):     # a NaN loss at the first token (inf * k3 = inf * 0 = NaN)
        with pytest.raises(ValueError, match="finite number >= 0"):
            kl_penalty(base, coef=coef)


def test_memory_estimate_by_hand_and_the_error(tiny_model):
    # The tiny Qwen3: embeddings 64 x 128 = 8,192 (tied); per layer q, k, v, o 4 x 128 x 128 = 65,536,
    # q/k norms 2 x 64, MLP 3 x 128 x 256 = 98,304, two norms 2 x 128: 164,224; 2 layers + final norm 128.
    n = 8192 + 2 * 164224 + 128
    full = estimate_memory(tiny_model, TrainerConfig(), max_model_len=128)
    assert full["params"] == n and full["trained_params"] == n
    assert (full["weights"], full["gradients"], full["optimizer"]) == (4 * n, 4 * n, 8 * n)
    # LoRA rank 4 on q and v (128 -> 128): 2 modules x 4 x (128 + 128) per layer, 2 layers = 4,096.
    qv = LoRAConfig(rank=4, target_modules=("q_proj", "v_proj"))
    lora = estimate_memory(tiny_model, TrainerConfig(lora=qv))
    assert lora["trained_params"] == 4096 and lora["optimizer"] == 8 * 4096
    off = estimate_memory(tiny_model, TrainerConfig(cpu_offload=True, reference=True), world=2)
    assert off["weights"] == off["optimizer"] == 0 and off["reference"] == 2 * n / 2
    assert off["host"] == 16 * n / 2 and off["host_reference"] == 0     # fp32 weights, grads, AdamW: on the host
    both = estimate_memory(tiny_model, TrainerConfig(cpu_offload=True, reference=True, reference_offload=True))
    assert both["reference"] == 0 and both["host"] == 16 * n + 2 * n
    check_fits(both, both["needed"], "this GPU", host_available=both["host"] + HOST_RESERVE)
    with pytest.raises(MemoryError, match=r"does not fit in host memory: it keeps 0\.0 GiB .* 8\.0 GiB is available.*LoRA"):
        check_fits(both, both["needed"], "this GPU", host_available=both["host"] + HOST_RESERVE - 1)
    assert full["host"] == 0
    check_fits(full, full["needed"], "this GPU")                          # exactly enough
    with pytest.raises(MemoryError) as e:
        check_fits(full | {"reference": 1.0 * GIB}, GIB, "an H200")
    msg = str(e.value)
    assert f"needs at least {full['needed'] / GIB:.1f} GiB" in msg and "1.0 GiB is there" in msg
    assert "LoRA" in msg and "cpu_offload=True" in msg and "reference_offload=True" in msg
    assert "offload_optimizer=True" in msg
    # LoRA saves ~98% of AdamW's state and the reference; the gradients only where they, not the
    # engine, are the larger while training (here the engine is: the 1 GiB reference and the state).
    assert full["engine"] > full["gradients"]
    assert f"launch --lora-rank 16) saves ~{(8 * n * 0.98 + GIB) / GIB:.1f} GiB" in msg
    # AdamW's state on the host while generating: it counts beside the gradients (the engine asleep),
    # not beside the engine, and in the host's part; then it is no lever.
    moved = estimate_memory(tiny_model, TrainerConfig(), max_model_len=128, offload_optimizer=True)
    assert moved["host_optimizer"] == moved["host"] == 8 * n
    assert moved["needed"] == 4 * n + max(4 * n + 8 * n, full["engine"])
    assert full["needed"] == 4 * n + 8 * n + max(4 * n, full["engine"])
    with pytest.raises(MemoryError) as e:
        check_fits(moved | {"needed": 2.0 * GIB}, GIB, "an H200")
    assert "offload_optimizer=True" not in str(e.value)


def test_memory_estimate_counts_also_train_modules_as_trained(tiny_model):
    # LoRA rank 4 on q and v (4,096 adapter parameters) with also_train=("embed_tokens",): the
    # tied 64 x 128 embeddings (8,192) train in full too, with gradients and AdamW state, as the
    # trainer's trainable parameters show; the weights hold the model and the adapters once.
    n = 8192 + 2 * 164224 + 128
    cfg = TrainerConfig(lora=LoRAConfig(rank=4, target_modules=("q_proj", "v_proj"), also_train=("embed_tokens",)))
    est = estimate_memory(tiny_model, cfg)
    tr = Trainer(tiny_model, cfg)
    trained = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    tr.close()
    assert trained == 4096 + 8192 == est["trained_params"]
    assert (est["weights"], est["gradients"], est["optimizer"]) == (4 * (n + 4096), 4 * trained, 8 * trained)


def test_memory_estimate_of_an_fp32_run_counts_fp32_engine_and_reference(tiny_model):
    # mixed_precision="fp32" computes in fp32: the engine (its dtype the trainer's compute dtype) and
    # the reference hold 4 bytes a parameter, and a KV cache entry twice a bf16 one.
    bf16 = estimate_memory(tiny_model, TrainerConfig(reference=True), max_model_len=128)
    fp32 = estimate_memory(tiny_model, TrainerConfig(reference=True, mixed_precision="fp32"), max_model_len=128)
    n = bf16["params"]
    assert fp32["reference"] == 2 * bf16["reference"] == 4 * n
    assert fp32["engine"] - 4 * GIB == 2 * (bf16["engine"] - 4 * GIB)


def test_reference_and_offload_trainer(tiny_model):
    """Full fine-tuning with a separate (offloaded) reference: KL 0 until the policy moves, then
    positive; the reference stays frozen; offload's configuration path builds and trains."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-2, cpu_offload=True, reference=True, reference_offload=True))
    assert isinstance(tr.model._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
    frozen = {n: p.full_tensor().clone() for n, p in tr.reference.named_parameters()}
    loss_fn = kl_penalty(ppo_loss_fn(), coef=0.1)
    first = tr.forward_backward(_rollouts(5), loss_fn)
    tr.optim_step()
    second = tr.forward_backward(_rollouts(5), loss_fn)
    tr.optimizer.zero_grad(set_to_none=True)
    assert first["kl_ref"] == 0.0 and second["kl_ref"] > 1e-4
    assert all(torch.equal(p.full_tensor(), frozen[n]) for n, p in tr.reference.named_parameters())
    with pytest.raises(ValueError, match="reference=True too"):
        Trainer(tiny_model, TrainerConfig(reference_offload=True))


@pytest.fixture(scope="module")
def lora_wm(tiny_model):
    cfg = TrainerConfig(lr=1e-2, lora=LoRAConfig(rank=4, alpha=8.0), reference=True)
    m = WeightManager(tiny_model, config=WeightManagerConfig(trainer=cfg), enforce_eager=True,
                      max_model_len=128)
    yield m
    m.close()


def _step(wm, seed):
    task = get_task("succ")
    prompts, answers = task.sample(4, seed=seed)
    outputs = wm.as_vllm().generate(prompts, SamplingParams(n=4, max_tokens=2, logprobs=0, seed=seed),
                                    use_tqdm=False)
    rollouts = [r for b in parse_vllm_outputs(outputs, group_size=4, reward_fn=task.reward, metadata=answers)
                for r in b]
    for i, r in enumerate(rollouts):      # a random model's rewards are nearly all 0: fixed advantages
        r.advantage = (-1.0) ** i         # make the policy move
    wm.as_trainable()
    out = wm.trainer.forward_backward(rollouts, kl_penalty(ppo_loss_fn(), coef=0.1))
    return out | wm.trainer.optim_step()


def test_lora_trains_adapters_only_and_syncs_merged_weights(lora_wm, monkeypatch):
    wm = lora_wm
    trained = {n for n, p in wm.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(len(g["params"]) for g in wm.optimizer.param_groups) == len(trained)
    base = {n: p.full_tensor().clone() for n, p in wm.model.named_parameters() if n not in trained}
    first = _step(wm, 0)
    assert first["kl_ref"] == 0.0                      # B = 0: the adapted model is the base model
    wm.as_vllm()                                       # verified: probe log-probs of merged == adapted
    assert wm.last_probe_gap < (1e-4 if wm.engine_dtype == torch.float32 else 0.05) and wm.policy_version == 1
    assert _step(wm, 1)["kl_ref"] > 0
    assert all(torch.equal(p.full_tensor(), base[n]) for n, p in wm.model.named_parameters() if n in base)
    # A sync that hands vLLM the base weights without the adapters is caught by the probe.
    import minirl.trainer as trainer_mod
    monkeypatch.setattr(trainer_mod, "merge_bucket", lambda b, s: merge_bucket(b, 0.0))
    with pytest.raises(SyncError, match="log-probs of the probe differ"):
        wm.as_vllm()
    monkeypatch.undo()
    wm.mark_dirty()
    wm.as_vllm()                                       # the real merge again: it passes
    # What a broadcast announces to receivers is what gather hands out: merged, base names.
    sent = []
    wm.trainer.gather(lambda b: sent.append([(n, tuple(t.shape), t.dtype) for n, t in b]), dtype=torch.bfloat16)
    assert wm.trainer.bucket_layout(torch.bfloat16) == sent
    assert not any("lora_" in n or "base_layer" in n for b in sent for n, _, _ in b)


def test_lora_checkpoint_holds_adapters_resumes_exactly_and_exports_merged(lora_wm, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM
    from minirl.checkpoint import Checkpointer
    from minirl.weights import reshard
    wm, ckpt = lora_wm, Checkpointer(tmp_path / "ck")
    _step(wm, 2)
    path = wm.save_checkpoint(ckpt, 3, export_hf=True)
    saved = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    # No base weights, except that torch's state dict keeps a tied embedding's lm_head alias.
    assert len(model_keys) > 1 and {k for k in model_keys if ".lora_" not in k} <= {"model.lm_head.weight"}
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    wm.model.eval()
    with torch.no_grad():
        want = wm.model(ids).logits
    reshard(wm.model)
    hf = AutoModelForCausalLM.from_pretrained(path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(ids).logits - want).abs().max() < 1e-5                 # the merged model, base names
    a = _step(wm, 4)
    after_a = {n: p.full_tensor().clone() for n, p in wm.model.named_parameters() if p.requires_grad}
    wm.load_checkpoint(ckpt)
    b = _step(wm, 4)                                   # same rollouts (seeded) from the restored state
    assert a == b
    assert all(torch.equal(p.full_tensor(), after_a[n])
               for n, p in wm.model.named_parameters() if p.requires_grad)


@pytest.mark.slow
def test_demo_learns_with_lora(tmp_path):
    """launch/colocated.py with LoRA adapters (and a KL-penalised reference) learns the task. The
    tiny model learns it mostly through its embeddings (frozen, even full fine-tuning reached only
    0.13 after 20 steps), so they train in full beside the adapters (--lora-also-train)."""
    res = run_py(["launch/colocated.py", "--steps", "16", "--backends", "", "--lora-rank", "16",
                  "--lora-also-train", "embed_tokens", "--lr", "5e-3", "--kl-coef", "0.001",
                  "--run-dir", str(tmp_path)])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4      # ran: 0.05 -> 0.27
    assert last > 0.18 and last > first + 0.12, rewards
    assert rows[0]["kl_ref"] == 0.0 and rows[-1]["kl_ref"] > 0
