"""The Trainer's verbs on CPU (tiny model, fp32, gloo): packing worked by hand, packed and
unpacked micro-batches and the single-process seed loop give the same loss and gradients, two
ranks with uneven rollouts give the update of one rank, a non-finite gradient is refused.

Needs: CPU only. The two-rank test starts torchrun (fresh processes, ~30 s).
"""

import dataclasses
import json
import logging

import pytest
import torch

from conftest import run_py
from minirl import Rollout, clipped_policy_loss, collate, entropy_from_logits, get_logprobs, memory, pack, ppo_loss_fn
from minirl.core import masked_mean
from minirl.data import split_by_tokens
from minirl.trainer import _local


def _rollouts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P, C = 2 + i % 3, 3 + (2 * i) % 5
        ids = torch.randint(2, 60, (P + C,), generator=g).tolist()
        mask = [1] * C if i % 2 == 0 else [int(j % 3 != 1) for j in range(C)]
        out.append(Rollout(prompt_ids=ids[:P], completion_ids=ids[P:], loss_mask=mask, reward=0.0,
                           sampling_logprobs=(-torch.rand(C, generator=g) * 4).tolist(),
                           advantage=float(torch.randn(1, generator=g)), uid=i))
    return out


def test_pack_by_hand():
    a = Rollout(prompt_ids=[7, 8], completion_ids=[9, 10, 11], sampling_logprobs=[-1.0, -2.0, -3.0],
                reward=0.0, advantage=0.5, loss_mask=[1, 0, 1])
    b = Rollout(prompt_ids=[3], completion_ids=[4, 5], sampling_logprobs=[-4.0, -5.0], reward=0.0,
                advantage=-1.0)
    (mb,) = pack([a, b], max_tokens=8)
    # a (5 tokens) then b (3): positions restart, logits at row position p score token p+1.
    assert mb.input_ids.tolist() == [[7, 8, 9, 10, 11, 3, 4, 5]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 5, 8] and mb.max_seqlen == 5
    # a's completion tokens 9 (mask 1), 10 (mask 0: not scored), 11 (mask 1); b's 4 and 5.
    assert mb.scored.tolist() == [1, 3, 5, 6]
    assert mb.targets.tolist() == [9, 11, 4, 5]
    assert mb.old_logprobs.tolist() == [-1.0, -3.0, -4.0, -5.0]
    assert mb.advantages.tolist() == [0.5, 0.5, -1.0, -1.0]
    assert mb.seq_index.tolist() == [0, 0, 1, 1] and mb.num_tokens == 4
    # A budget of 5 tokens: two rows; a rollout longer than the budget still gets a row.
    assert [m.input_ids.shape[1] for m in pack([a, b], max_tokens=5)] == [5, 3]
    assert [m.input_ids.shape[1] for m in pack([a, b], max_tokens=2)] == [5, 3]


def test_split_by_tokens_balances_and_keeps_order():
    rs = _rollouts(9)
    parts = split_by_tokens(rs, 3)
    assert sorted(r.uid for p in parts for r in p) == list(range(9))
    loads = [sum(r.num_tokens for r in p) for p in parts]
    assert max(loads) - min(loads) <= max(r.num_tokens for r in rs)
    assert all([r.uid for r in p] == sorted(r.uid for r in p) for p in parts)


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from minirl.trainer import Trainer, TrainerConfig
    return Trainer(tiny_model, TrainerConfig(lr=1e-3, max_grad_norm=None))


def _grads(model):
    out = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return out


def test_packed_unpacked_and_seed_loop_agree(trainer):
    rs = _rollouts()
    loss_fn = ppo_loss_fn(clip_high=0.28, entropy=False)
    results = {}
    for budget in (10_000, 1):                       # one packed row; one row per rollout
        trainer.micro_batch_tokens = budget
        out = trainer.forward_backward(rs, loss_fn)
        results[budget] = (out, _grads(trainer.model))
    # The seed loop: right-padded batch, token mean of the clipped loss over the loss mask.
    batch = collate(rs)
    lp = get_logprobs(trainer.model(batch.input_ids, attention_mask=batch.attention_mask).logits,
                      batch.input_ids)
    loss = clipped_policy_loss(lp, batch.old_logprobs, batch.advantages, mask=batch.loss_mask,
                               clip_high=0.28)
    loss.backward()
    seed = _grads(trainer.model)
    (packed, g1), (unpacked, g2) = results[10_000], results[1]
    assert packed["micro_batches"] == 1 and unpacked["micro_batches"] == len(rs)
    assert packed["tokens"] == unpacked["tokens"] == int(batch.loss_mask.sum())
    assert packed["loss"] == pytest.approx(unpacked["loss"], abs=1e-6)
    assert packed["loss"] == pytest.approx(loss.item(), abs=1e-6)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(g1[n], seed[n], atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in g1.values())


def test_logged_entropy_is_the_sampling_distributions(trainer):
    """ppo_loss_fn's entropy comes from the trainer's log-prob pass (batch.entropy): the token mean
    of the entropy of softmax(logits / T) at every scored position of the unpacked forward."""
    rs = _rollouts()
    batch = collate(rs)
    with torch.no_grad():
        logits = trainer.model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        want = float(masked_mean(entropy_from_logits(logits, temperature=0.8), batch.loss_mask))
    out = trainer.forward_backward(rs, ppo_loss_fn(), temperature=0.8)
    trainer.model.zero_grad(set_to_none=True)
    assert out["entropy"] == pytest.approx(want, abs=1e-5) and want > 0
    seen = []
    trainer.forward_backward(rs, lambda lp, mb, lg: (seen.append(mb.entropy) or lp, {}), entropy=False)
    trainer.model.zero_grad(set_to_none=True)
    assert seen and all(e is None for e in seen)
    # Without the trainer's pass, ppo_loss_fn takes it from the logits at the same temperature (was: T = 1).
    out = trainer.forward_backward(rs, ppo_loss_fn(), temperature=0.8, entropy=False)
    trainer.model.zero_grad(set_to_none=True)
    assert out["entropy"] == pytest.approx(want, abs=1e-5)


def _step_both(a, b, g: torch.Generator) -> None:
    """One optimizer step of trainers a and b on the same random gradients."""
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        grad = torch.randn(p.full_tensor().shape, generator=g)
        p.grad = torch.distributed.tensor.distribute_tensor(grad, p.device_mesh, p.placements)
        q.grad = torch.distributed.tensor.distribute_tensor(grad.clone(), q.device_mesh, q.placements)
    a.optim_step(), b.optim_step()


def _same_weights(a, b) -> bool:
    return all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_adamw_state_allocated_at_load_steps_as_the_state_its_first_step_creates(tiny_model):
    """The Trainer allocates AdamW's moments when it loads (so they lie apart from the step's
    activations on a GPU): zero moments, step count 0, weights as loaded, no step counted. Two steps
    on the same gradients then give exactly the weights of a trainer whose state AdamW creates
    lazily (a step count left at 1, a learning rate left at 0 or a weight decay applied at load
    would each differ)."""
    from minirl.trainer import Trainer, TrainerConfig
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=None)
    a, b = Trainer(tiny_model, cfg), Trainer(tiny_model, cfg)
    assert not a.stepped
    assert len(a.optimizer.state) == len(list(a.model.parameters()))
    for st in a.optimizer.state.values():
        assert float(st["step"]) == 0 and not st["exp_avg"].full_tensor().any() and not st["exp_avg_sq"].full_tensor().any()
    assert _same_weights(a, b)
    b.optimizer.state.clear()                       # b: AdamW creates its state at the first step
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        _step_both(a, b, g)
    assert a.stepped
    assert _same_weights(a, b)


def test_optimizer_state_to_host_frees_it_and_steps_as_if_it_had_stayed(tiny_model):
    """AdamW's state moved to the host holds no storage where it lived (what a co-located engine
    then uses), comes back bit for bit, and the steps after each round trip give exactly the
    weights of a trainer whose state never moved (a moment lost, zeroed or mixed up would
    differ); optim_step brings it back by itself."""
    from minirl.trainer import Trainer, TrainerConfig
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=None)
    a, b = Trainer(tiny_model, cfg), Trainer(tiny_model, cfg)
    assert a.optimizer_state_bytes == sum(2 * _local(p).numel() * 4 + 4 for p in a.model.parameters())
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        _step_both(a, b, g)
        before = [_local(t).clone() for st in a.optimizer.state.values() for t in st.values()]
        a.optimizer_to_host(wait=i != 1)
        a.optimizer_to_host()                               # the second call finishes (or is a no-op)
        state = [_local(t) for st in a.optimizer.state.values() for t in st.values()]
        assert all(t.untyped_storage().nbytes() == 0 for t in state)
        if i != 2:                                          # the last round: optim_step brings it back
            a.optimizer_to_device()
            assert all(torch.equal(t, u) for t, u in zip(state, before))
    assert _same_weights(a, b)
    _step_both(a, b, g)
    assert _same_weights(a, b)


def test_checkpoints_with_adamw_state_on_the_host(tiny_model, tmp_path):
    """A save while AdamW's state is on the host writes the real state (it comes back first); after
    a load (which may replace the state's tensors) moving it out frees the tensors AdamW now
    holds, and the steps still equal a trainer that never moved or saved its state."""
    from minirl.checkpoint import Checkpointer
    from minirl.trainer import Trainer, TrainerConfig
    cfg = TrainerConfig(lr=1e-2, max_grad_norm=None)
    a, b = Trainer(tiny_model, cfg), Trainer(tiny_model, cfg)
    g = torch.Generator().manual_seed(1)
    _step_both(a, b, g)
    ckpt = Checkpointer(tmp_path / "ck")
    a.optimizer_to_host()
    a.save_checkpoint(ckpt, 1)
    a.optimizer_to_host()
    a.load_checkpoint(ckpt)
    a.optimizer_to_host()
    assert all(_local(t).untyped_storage().nbytes() == 0 for st in a.optimizer.state.values() for t in st.values())
    _step_both(a, b, g)
    assert _same_weights(a, b)


def test_a_resumed_trainer_steps_at_its_own_learning_rate(tiny_model, tmp_path):
    """A checkpoint brings back AdamW's moments and step counts, while the learning rate is the
    resuming trainer's (launch --resume --lr): AdamW's update lr * m_hat / (sqrt(v_hat) + eps) is
    linear in lr (no weight decay), so from the same weights, moments and gradients a trainer
    resumed at lr 1e-3 moves every weight a tenth of what the saving one (lr 1e-2) does."""
    from minirl.checkpoint import Checkpointer
    from minirl.trainer import Trainer, TrainerConfig
    a = Trainer(tiny_model, TrainerConfig(lr=1e-2, max_grad_norm=None))
    b = Trainer(tiny_model, TrainerConfig(lr=1e-3, max_grad_norm=None))
    g = torch.Generator().manual_seed(2)
    _step_both(a, b, g)
    ckpt = Checkpointer(tmp_path / "ck")
    a.save_checkpoint(ckpt, 1)
    b.load_checkpoint(ckpt)
    assert _same_weights(a, b) and all(float(st["step"]) == 1 for st in b.optimizer.state.values())
    assert [grp["lr"] for grp in b.optimizer.param_groups] == [1e-3]
    before = [p.full_tensor().clone() for p in a.model.parameters()]
    _step_both(a, b, g)
    for w, p, q in zip(before, a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(q.full_tensor() - w, (p.full_tensor() - w) / 10, rtol=1e-3, atol=1e-7)


def test_non_finite_gradient_is_refused(trainer):
    rs = _rollouts(2)
    rs[0].advantage = float("nan")
    before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="advantages hold"):      # the loss refuses a NaN input
        trainer.forward_backward(rs, ppo_loss_fn(entropy=False))
    rs[0].advantage = 1.0
    for bad in (0, -5):                       # a negative count flipped the gradient's sign; 0 scaled it up
        with pytest.raises(ValueError, match=f"num_global_tokens must be >= 1 .*got {bad}"):
            trainer.forward_backward(rs, ppo_loss_fn(entropy=False), num_global_tokens=bad)
    trainer.forward_backward(rs, ppo_loss_fn(entropy=False))
    with torch.no_grad():
        next(trainer.model.parameters()).grad.mul_(float("nan"))  # a gradient gone non-finite
    with pytest.raises(FloatingPointError, match="refused"):
        trainer.optim_step()
    assert all(torch.equal(before[n], p.full_tensor()) for n, p in trainer.model.named_parameters())
    assert all(p.grad is None for p in trainer.model.parameters())


def test_out_of_device_memory_names_what_was_held_and_the_levers(trainer, monkeypatch):
    rs, calls = _rollouts(3), []
    trainer.micro_batch_tokens = 1                   # a row per rollout
    inner = ppo_loss_fn(entropy=False)

    def loss_fn(lp, mb, logits):        # the second micro-batch runs out, after the first's backward
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.64 GiB. GPU 0 ...")
        return inner(lp, mb, logits)
    before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(MemoryError, match=r"forward_backward .* asking for 4.64 GiB more: this rank held "
                                          r"weights [\d.]+ GiB.*Levers: LoRA.*cpu_offload=True.*"
                                          r"micro_batch_tokens \(now 1\)"):
        trainer.forward_backward(rs, loss_fn)
    assert all(p.grad is None for p in trainer.model.parameters())      # the first one's gradients freed
    assert all(torch.equal(before[n], p.full_tensor()) for n, p in trainer.model.named_parameters())
    assert trainer.forward_backward(rs, inner)["micro_batches"] == 3      # the trainer goes on
    monkeypatch.setattr(trainer.optimizer, "step", lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    with pytest.raises(MemoryError, match="the AdamW step"):
        trainer.optim_step()
    assert all(p.grad is None for p in trainer.model.parameters())


def test_a_micro_batch_too_big_for_the_device_is_refused_with_its_numbers(trainer, monkeypatch):
    gib = 2**30                         # measure_peak's verdict (CUDA), its device calls stood in for
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 10 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "a 10 GiB GPU")
    monkeypatch.setattr(memory, "trial_peak", lambda tr, n: 10 * gib)
    monkeypatch.setattr(trainer, "config", dataclasses.replace(trainer.config, activation_checkpointing=True))
    with pytest.raises(MemoryError, match=r"peaks at 10.0 GiB \(weights, gradients and AdamW's state included\), "
                                          r"and 9.5 GiB is usable. Levers: a lower micro_batch_tokens, LoRA"):
        memory.measure_peak(trainer)
    monkeypatch.setattr(memory, "trial_peak", lambda tr, n: 9 * gib)
    assert memory.measure_peak(trainer).peak_bytes == 9 * gib
    with pytest.raises(MemoryError, match=r"and 8.5 GiB is usable"):       # 1.5 GiB kept for what shares the device
        memory.measure_peak(trainer, reserve=3 * gib // 2)


@pytest.mark.parametrize("lora", [False, True])
def test_export_hf_writes_the_fp32_master_weights_under_bf16_compute(tiny_model, tmp_path, lora):
    """With bf16 compute FSDP2 unshards bf16 copies of the fp32 master weights: the export (fp32
    safetensors) holds the master weights themselves, with LoRA merged from the fp32 adapters."""
    from safetensors.torch import load_file
    from minirl.lora import LoRAConfig
    from minirl.trainer import Trainer, TrainerConfig
    cfg = LoRAConfig(rank=4, alpha=8.0) if lora else None
    tr = Trainer(tiny_model, TrainerConfig(mixed_precision="bf16", lora=cfg))
    with torch.no_grad():
        for n, p in tr.model.named_parameters():      # B = 0 at load: give the adapters something to merge
            if ".lora_B." in n:
                _local(p).normal_()
    master = {n: p.full_tensor() for n, p in tr.model.named_parameters()}
    want = {}
    for n, w in master.items():
        if ".lora_" in n:
            continue
        if n.endswith(".base_layer.weight"):
            m = n.removesuffix(".base_layer.weight")
            w = w + cfg.scale * master[f"{m}.lora_B.default.weight"] @ master[f"{m}.lora_A.default.weight"]
            n = f"{m}.weight"
        want[n] = w
    tr.export_hf(tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == want.keys()
    for n in want:
        assert exported[n].dtype == torch.float32
        torch.testing.assert_close(exported[n], want[n], atol=1e-6, rtol=1e-6)


def test_a_step_with_every_token_masked_trains_nothing(trainer):
    rs = _rollouts(3)
    for r in rs:          # e.g. every completion truncated under an over-long filter
        r.loss_mask = [0] * len(r.completion_ids)
    before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    out = trainer.forward_backward(rs, ppo_loss_fn())
    assert out["tokens"] == 0 and out["loss"] == 0.0
    assert trainer.optim_step()["grad_norm"] == 0.0
    assert all(torch.equal(before[n], p.full_tensor()) for n, p in trainer.model.named_parameters())


def test_a_step_with_nothing_trained_keeps_the_version(trainer):
    """optim_step with no gradient (no rollout on any rank: every group filtered out) changes no weight,
    so publish() keeps the version: no new version for the same weights, no sync, no staleness counted."""
    trainer.optim_step()                                         # whatever an earlier test left
    version = trainer.publish()
    assert all(p.grad is None for p in trainer.model.parameters())
    assert trainer.forward_backward([], ppo_loss_fn())["micro_batches"] == 0
    assert trainer.optim_step() == {"grad_norm": 0.0}
    assert trainer.publish() == version
    trainer.forward_backward(_rollouts(2), ppo_loss_fn())
    trainer.optim_step()
    assert trainer.publish() == version + 1


def test_compiled_layers_give_the_eager_gradients(tiny_model, trainer):
    """TrainerConfig.compile wraps each decoder layer in torch.compile (on CUDA by default; here the
    aot_eager backend traces the same graphs without generating kernels). The log-probs take
    minirl.kernels' Triton kernels on CUDA (tests/test_kernels.py), nothing compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from minirl.trainer import Trainer, TrainerConfig
    rs = _rollouts(4)
    torch._dynamo.reset()                 # earlier tests' compiles of the same functions count against its limit
    counter = CompileCounterWithBackend("aot_eager")
    compiled = Trainer(tiny_model, TrainerConfig(seed=0, compile=counter))
    grads = []
    for tr in (trainer, compiled):
        tr.optimizer.zero_grad(set_to_none=True)
        tr.forward_backward(rs, ppo_loss_fn(entropy=False))
        grads.append({n: p.grad.full_tensor().clone() for n, p in tr.model.named_parameters()})
        tr.optimizer.zero_grad(set_to_none=True)
    assert all(hasattr(layer, "_compiled_call_impl") and layer._compiled_call_impl is not None
               for layer in compiled.model.model.layers)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6)
    frames = counter.frame_count
    assert frames > 0
    ops = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("rsqrt" in o for o in ops) and not any("logsumexp" in o for o in ops)   # RMSNorm; no log-probs
    compiled.gather(lambda bucket: None, dtype=torch.float32, probe_ids=[3, 4, 5])   # the sync's probe
    assert counter.frame_count == frames            # runs eagerly: no second graph to compile


TWO_RANKS = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_trainer import _rollouts
from minirl import ppo_loss_fn
from minirl.lora import LoRAConfig
from minirl.trainer import Trainer, TrainerConfig
opened = []                                     # closed last: the first one owns the process group
for mode in {modes!r}:                         # one launch for every mode (each one costs a torch import)
    out_dir = {out!r} + "/" + mode
    tr = Trainer({model!r}, TrainerConfig(lr=1e-3, eps=1e-3,  # eps: AdamW's first step smooth in the gradient
                                          lora=LoRAConfig(rank=4) if mode == "lora" else None,
                                          cpu_offload=mode == "offload"))
    opened.append(tr)
    rs = _rollouts(7)
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = rs if world == 1 else (rs[:2] if rank == 0 else rs[2:])     # uneven on purpose
    if mode == "empty" and world > 1:                                   # one rank with nothing to train
        mine = rs if rank == 0 else []
    out = tr.forward_backward(mine, ppo_loss_fn(entropy=False))
    grads = {{n: p.grad.full_tensor() for n, p in tr.model.named_parameters() if p.grad is not None}}
    tr.optim_step()
    weights = {{}}                              # after the step, as the engine gets them (LoRA: merged)
    tr.gather(lambda bucket: weights.update((n, t.clone()) for n, t in bucket), dtype=torch.float32)
    tr.export_hf(out_dir + f"/hf_{{world}}")    # collective; rank 0 writes
    if mode == "full":                         # a checkpoint saved twice: every rank refuses, none waits
        from minirl.checkpoint import Checkpointer, CheckpointError
        ck = Checkpointer(out_dir + f"/ck_{{world}}")
        tr.save_checkpoint(ck, 1)
        try:
            tr.save_checkpoint(ck, 1)
        except CheckpointError as e:
            open(out_dir + f"/resave_{{world}}_{{rank}}.txt", "w").write(str(e))
    if rank == 0:
        torch.save((grads, weights), out_dir + f"/grads_{{world}}.pt")
        json.dump(out, open(out_dir + f"/out_{{world}}.json", "w"))
    dist.barrier()                              # both ranks go on together
for tr in reversed(opened):
    tr.close()
"""
MODES = ["full", "lora", "offload", "empty"]


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model, tmp_path_factory):
    """TWO_RANKS on 1 and then 2 ranks (torchrun), every mode in each: the directory of their outputs."""
    from conftest import ROOT
    out = tmp_path_factory.mktemp("two_ranks")
    for mode in MODES:
        (out / mode).mkdir()
    script = out / "two_ranks.py"
    script.write_text(TWO_RANKS.format(tests=str(ROOT / "tests"), model=tiny_model, out=str(out), modes=MODES))
    for n in (1, 2):
        res = run_py(["-m", "torch.distributed.run", "--nproc_per_node", str(n), str(script)], timeout=400)
        assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_with_uneven_rollouts_give_the_one_rank_update(two_rank_runs, mode):
    """Gradients, and the weights the engine gets after the step (LoRA: merged), of 1 and 2 ranks;
    "empty": one rank holds every rollout, the other none (its metrics still meet the other's)."""
    d = two_rank_runs / mode
    (g1, w1), (g2, w2) = (torch.load(d / f"grads_{n}.pt") for n in (1, 2))
    if mode == "full":                                  # rank 1 waited at the save's barrier before
        assert all("already exists" in (d / f"resave_2_{r}.txt").read_text() for r in (0, 1))
    o1, o2 = (json.load(open(d / f"out_{n}.json")) for n in (1, 2))
    assert o1["tokens"] == o2["tokens"] and o1["loss"] == pytest.approx(o2["loss"], abs=1e-6)
    assert g1.keys() == g2.keys() and all(".lora_" in n for n in g1) == (mode == "lora")
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], atol=1e-6, rtol=1e-5)
    assert w1.keys() == w2.keys() and not any("lora" in n for n in w1)
    for n in w1:
        torch.testing.assert_close(w1[n], w2[n], atol=1e-6, rtol=1e-5)
    from safetensors.torch import load_file
    exported = load_file(d / "hf_2" / "model.safetensors")     # the 2-rank export: the same weights
    assert exported.keys() == w2.keys() and all(torch.equal(exported[n], w2[n]) for n in w2)


def test_packed_attention_on_cpu_stays_within_each_rollout(tmp_path, monkeypatch):
    """CPU's packed attention (TrainerConfig.attention="auto": SDPA once per rollout, with
    varlen_attn's contract) inside transformers (registration, the cu_seq_lens kwargs, the mask
    hook, grouped-query heads): a packed row gives each sequence's own logits, and a padded batch
    takes the exact SDPA path."""
    from transformers import AutoModelForCausalLM
    from minirl import model as model_mod
    from minirl.recipes.tiny import build_tiny_model
    calls = []
    kernel = model_mod._sdpa_varlen

    def spy(q, k, v, cu_q, cu_k, *args, **kw):
        calls.append((cu_q.dtype, torch.equal(cu_q, cu_k), kw.get("window_size"), kw.get("enable_gqa")))
        return kernel(q, k, v, cu_q, cu_k, *args, **kw)
    name = model_mod._attention("auto", torch.device("cpu"))
    assert name == "minirl_varlen"
    monkeypatch.setattr(model_mod, "_sdpa_varlen", spy)
    path = build_tiny_model(tmp_path / "gqa", hidden_size=256, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    rs = _rollouts(3)
    (mb,) = pack(rs, max_tokens=1000)
    with torch.no_grad():
        packed = model(mb.input_ids, position_ids=mb.position_ids, use_cache=False, cu_seq_lens_q=mb.cu_seqlens,
                       max_length_q=mb.max_seqlen).logits[0]
        assert calls and set(calls) == {(torch.int32, True, (-1, 0), True)}     # causal, grouped heads
        for s, r in enumerate(rs):
            a, b = mb.cu_seqlens[s], mb.cu_seqlens[s + 1]
            torch.testing.assert_close(packed[a:b], ref(r.token_ids).logits[0], atol=1e-5, rtol=1e-5)
        batch = collate(rs)                                  # right-padded, with an attention mask
        torch.testing.assert_close(model(batch.input_ids, attention_mask=batch.attention_mask).logits,
                                   ref(batch.input_ids, attention_mask=batch.attention_mask).logits)


def test_packed_attention_on_cpu_keeps_a_sliding_window(tmp_path):
    """A model whose layers attend within a sliding window (here 4 tokens) keeps it in CPU's packed
    attention: each rollout of a packed row gets transformers' own SDPA logits."""
    from transformers import AutoModelForCausalLM
    from minirl import model as model_mod
    from minirl.recipes.tiny import build_tiny_model
    path = build_tiny_model(tmp_path / "window")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    (path / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=model_mod._attention("auto", torch.device("cpu")))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    assert model.model.layers[0].self_attn.sliding_window == 4
    rs = _rollouts(3)                                        # 5, 8 and 11 tokens
    (mb,) = pack(rs, max_tokens=1000)
    with torch.no_grad():
        packed = model(mb.input_ids, position_ids=mb.position_ids, use_cache=False, cu_seq_lens_q=mb.cu_seqlens,
                       max_length_q=mb.max_seqlen).logits[0]
        for s, r in enumerate(rs):
            a, b = mb.cu_seqlens[s], mb.cu_seqlens[s + 1]
            torch.testing.assert_close(packed[a:b], ref(r.token_ids).logits[0], atol=1e-5, rtol=1e-5)


def test_predict_peak_on_the_line_through_two_trials():
    """Trials of 2,048 and 4,096 tokens peaking at 20 and 24 GiB (gradients + 2 GiB per 1,024 tokens
    of activations) put 16,384 tokens at 24 + 4 * 12 / 2 = 48 GiB; a flat line stays flat."""
    from minirl.memory import predict_peak
    G = 2**30
    assert predict_peak(2048, 20 * G, 4096, 24 * G, 16384) == 48 * G
    assert predict_peak(1024, 5 * G, 2048, 5 * G, 16384) == 5 * G


def test_training_that_would_not_fit_beside_the_sleeping_engine_recomputes_or_is_refused(tiny_model, monkeypatch):
    """WeightManager's check when the engine first sleeps (its device calls stood in for): 60 GiB
    free of 140, headroom max(2 GiB, 10%) = 14 GiB, so a step needing 46 GiB fits and 47 does not."""
    from minirl.memory import MemoryPlan, beside_sleeping_engine
    from minirl.trainer import Trainer, TrainerConfig
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (60 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "a 140 GiB GPU")
    fit = lambda tr, need: tr.apply(beside_sleeping_engine(tr, MemoryPlan(peak_bytes=need, held_bytes=0, user_set=(
        ("recomputed_layers",) if tr.config.activation_checkpointing is not None else ()))))
    auto = Trainer(tiny_model, TrainerConfig(lr=1e-3))
    fit(auto, 46 * gib)
    assert not auto.model.is_gradient_checkpointing
    fit(auto, 47 * gib)
    assert auto.model.is_gradient_checkpointing                      # left to minirl: recomputation on
    chosen = Trainer(tiny_model, TrainerConfig(lr=1e-3, activation_checkpointing=False))
    with pytest.raises(MemoryError, match=r"needs 47.0 GiB beside the weights and 14.0 GiB of headroom; "
                                          r"60.0 GiB is free .* Levers: activation_checkpointing=True"):
        fit(chosen, 47 * gib)
    assert not chosen.model.is_gradient_checkpointing


@pytest.mark.parametrize("per_token_mib, expect", [(0.25, (16384, False)), (0.5, (16384, True)), (1.0, (16384, True))])
def test_a_micro_batch_the_user_set_is_kept_and_recomputes_when_it_does_not_fit(tiny_model, monkeypatch,
                                                                                  per_token_mib, expect):
    """measure_peak with micro_batch_tokens set and activation_checkpointing left, its trials stood in
    for: a peak of 2 GiB + per_token_mib per token (a quarter of that when recomputing), AdamW 1 GiB,
    10 GiB usable. 16384 tokens at 0.25 MiB: 7 GiB, fits. At 0.5 MiB 11 GiB does not: the size the
    user set is kept and layers recompute (2 + 2 + 1 = 5 GiB), though 8,192 tokens would fit; at 1 MiB
    likewise (2 + 4 + 1 = 7 GiB)."""
    from minirl.trainer import Trainer, TrainerConfig
    gib = 2**30
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3, micro_batch_tokens=16384))
    ckpt = lambda: bool(getattr(tr.model, "is_gradient_checkpointing", False))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: int(2 * gib + n * per_token_mib * 2**20 / (4 if ckpt() else 1)) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib)
    peak = plan.peak_bytes
    assert (plan.micro_batch_tokens, ckpt()) == expect
    n, on = expect
    assert peak == int(2 * gib + n * per_token_mib * 2**20 / (4 if on else 1)) + gib <= 10 * gib


@pytest.mark.parametrize("per_token_mib, bump_gib, chosen, tried", [
    (0.125, 0, 32768, [4096, 8192, 32768]), (0.125, 5, 16384, [4096, 8192, 32768, 16384]),
    (0.25, 0, 16384, [4096, 8192, 16384]), (0.75, 0, 8192, [4096, 8192])])
def test_a_planned_micro_batch_is_the_largest_that_fits(tiny_model, monkeypatch, caplog, per_token_mib, bump_gib,
                                                        chosen, tried):
    """micro_batch_tokens left to measure_peak, its trials stood in for: 2 GiB + per_token_mib a token,
    AdamW 1 GiB, 10 GiB usable. The trials of 4,096 and 8,192 tokens draw the line; the largest of
    32,768 / 16,384 / 8,192 on it under the line runs a trial of its own (8,192's is the small one).
    At 0.125 MiB 32,768 tokens peak at 7 GiB; when that trial comes out 5 GiB above the line, 16,384
    (5 GiB) is chosen. At 0.25 MiB 32,768 would peak at 11 GiB (no trial) and 16,384 at 7; at 0.75 MiB
    only 8,192 fits (9 GiB). Nothing recomputes and no warning is logged: the size was left to it."""
    from minirl.trainer import Trainer, TrainerConfig
    gib, seen = 2**30, []
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3))
    assert tr.config.micro_batch_tokens is None and tr.micro_batch_tokens == 4096    # what runs on CPU (no plan)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    peak = lambda n: int(2 * gib + n * per_token_mib * 2**20 + (bump_gib * gib if n == 32768 else 0))
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: seen.append(n) or peak(n) + gib)
    with caplog.at_level(logging.INFO, logger="minirl.memory"):
        plan = memory.measure_peak(tr, reserve=2 * gib)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"{chosen}-token micro-batches" in str(plan)
    assert (plan.micro_batch_tokens, tr.recomputed_layers, seen) == (chosen, 0, tried)
    assert plan.peak_bytes == peak(chosen) + gib <= 10 * gib
    assert plan.micro_batch_tokens == chosen


@pytest.mark.parametrize("per_token_mib, ratio, chosen, low, tried", [
    (0.6, 0.55, 16384, True, [4096, 8192, 16384]), (0.7, 0.7, 8192, False, [4096, 8192, 16384]),
    (0.25, 0.55, 32768, True, [4096, 8192, 32768]), (1.2, 0.55, 8192, True, [4096, 8192, 8192])])
def test_a_planned_micro_batch_tries_the_low_memory_budget_before_shorter_rows(
        tiny_model, monkeypatch, per_token_mib, ratio, chosen, low, tried):
    """Compiled layers, micro_batch_tokens and activation_memory_budget left to measure_peak, its
    trials stood in for: 2 GiB + per_token_mib a token at budget 1, `ratio` of those activations at
    LOW_MEMORY_BUDGET, AdamW 1 GiB, 10 GiB usable. Each size is tried at budget 1, then at the low one
    where half the line's activations would fit. At 0.6 MiB 16,384 tokens need 12.6 GiB at 1 and
    8.3 at the low budget: chosen there. At 0.7 MiB with a ratio of 0.7 its trial (10.8 GiB) does not
    fit: 8,192 tokens at 1 (8.6 GiB, a small trial), the budget back at 1. At 0.25 MiB 32,768
    tokens at the low budget (7.4 GiB) come before 16,384 at 1. At 1.2 MiB only 8,192 tokens at the
    low budget fit (8.4 GiB). The budget changes recompile (torch.compiler.reset)."""
    from minirl.memory import LOW_MEMORY_BUDGET
    from minirl.trainer import Trainer, TrainerConfig
    gib, seen, resets = 2**30, [], []
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3, compile=True))
    assert tr.memory_budget == 1.0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(tr.memory_budget))
    act = lambda n: n * per_token_mib * 2**20 * (ratio if tr.memory_budget < 1 else 1)
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: seen.append((n, tr.memory_budget)) or int(2 * gib + act(n)) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib)
    got = plan.peak_bytes
    budget = LOW_MEMORY_BUDGET if low else 1.0
    assert (plan.micro_batch_tokens, tr.memory_budget, tr.recomputed_layers) == (chosen, budget, 0)
    assert [n for n, _ in seen] == tried and seen[-1][1] == LOW_MEMORY_BUDGET     # the last trial at the low one
    assert resets == ([LOW_MEMORY_BUDGET] if low else [LOW_MEMORY_BUDGET, 1.0])
    assert got == int(2 * gib + act(chosen)) + gib <= 10 * gib
    assert plan.activation_memory_budget == budget


@pytest.mark.parametrize("kw, tokens, user_set", [
    ({}, 8192, ()), (dict(micro_batch_tokens=16384), 16384, ("micro_batch_tokens",)),
    (dict(micro_batch_tokens=4096, activation_checkpointing=False), 4096, ("micro_batch_tokens", "recomputed_layers"))])
def test_a_plan_leaves_the_config_as_given_and_names_what_was_set(tiny_model, monkeypatch, kw, tokens, user_set):
    """The plan reaches the trainer through apply(); the user's TrainerConfig is the same object,
    unchanged. Stood-in trials of 2 GiB + 0.5 MiB a token (a quarter recomputing), AdamW 1 GiB, 10 GiB usable: left to it,
    8,192 tokens fit (7 GiB), 16,384 (11) do not; a 16,384 the user set is kept (layers recompute); a
    4,096 set with activation_checkpointing=False is kept and named as set. On CPU nothing is
    measured, the trainer's settings given are named as set too, and the engine's are not (CUDA's)."""
    from minirl.colocated import WeightManagerConfig
    from minirl.trainer import Trainer, TrainerConfig
    gib, cfg = 2**30, TrainerConfig(lr=1e-3, **kw)
    tr = Trainer(tiny_model, cfg)
    cpu = memory.plan(tr, {}, WeightManagerConfig(trainer=cfg, sleep_level=0))
    assert cpu.micro_batch_tokens == kw.get("micro_batch_tokens", 4096) and cpu.peak_bytes is None
    assert cpu.user_set == tuple(k for k in ("micro_batch_tokens", "recomputed_layers") if k in kw or
                                 k == "recomputed_layers" and "activation_checkpointing" in kw)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: int(2 * gib + n * 2**19 / (4 if tr.recomputed_layers else 1)) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib)
    tr.apply(plan)
    assert tr.config is cfg and cfg == TrainerConfig(lr=1e-3, **kw)
    assert (plan.micro_batch_tokens, tr.micro_batch_tokens, plan.user_set) == (tokens, tokens, user_set)
    assert ("micro-batches (set)" in str(plan)) == bool(user_set)

def test_a_set_memory_budget_is_kept_and_checked(tiny_model, monkeypatch):
    """A budget the user set is the one every trial runs at (no low one is tried: 8,192 tokens at
    0.75 MiB a token); out of (0, 1], or on an eager trainer, it is refused."""
    from minirl.trainer import Trainer, TrainerConfig
    gib, seen = 2**30, []
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3, compile=True, activation_memory_budget=0.9))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: seen.append(tr.memory_budget) or int(2 * gib + n * 0.75 * 2**20) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib)
    assert (plan.micro_batch_tokens, tr.memory_budget, set(seen)) == (8192, 0.9, {0.9})
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"activation_memory_budget must be in \(0, 1\]"):
            Trainer(tiny_model, TrainerConfig(compile=True, activation_memory_budget=bad))
    with pytest.raises(ValueError, match="runs eager: set compile=True"):
        Trainer(tiny_model, TrainerConfig(compile=False, activation_memory_budget=0.5))


def test_the_memory_budget_reaches_the_compiled_layers(tiny_model):
    """Compiled (inductor, CPU) forward_backward of the same rollouts at budget 1, then at 0.3 (the
    plan's switch, recompiling): backward keeps fewer bytes of activations at 0.3, and recomputing
    them gives the same gradients."""
    from minirl.core import ppo_loss_fn
    from minirl.data import Rollout
    from minirl.trainer import Trainer, TrainerConfig
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3, compile=True))
    rollouts = [Rollout(prompt_ids=[1, 2, 3], completion_ids=list(range(4, 40 + 3 * i)), reward=1.0,
                        advantage=0.5 - i % 2, sampling_logprobs=[-1.0] * (36 + 3 * i)) for i in range(4)]
    weights = {p.to_local().untyped_storage().data_ptr() for p in tr.model.parameters()}

    def saved_bytes_and_grads():
        storages = {}
        def keep(t):
            s = t.untyped_storage()
            if s.data_ptr() not in weights:
                storages[s.data_ptr()] = s.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            tr.forward_backward(rollouts, ppo_loss_fn())
        grads = [p.grad.full_tensor().clone() for p in tr.model.parameters()]
        tr.optimizer.zero_grad(set_to_none=True)
        return sum(storages.values()), grads

    full, g_full = saved_bytes_and_grads()
    tr.use_memory_budget(0.3)
    low, g_low = saved_bytes_and_grads()
    assert low < 0.8 * full
    for a, b in zip(g_full, g_low):
        torch.testing.assert_close(a, b)
    tr.close()


def test_a_planned_micro_batch_stays_under_largest(tiny_model, monkeypatch):
    """With largest=16,384 (a resident engine's plan) the trials are those of 16,384 (2,048 and
    4,096 tokens, then its own), although 32,768 would fit (2 + 4 + 1 = 7 of 10 GiB)."""
    from minirl.trainer import Trainer, TrainerConfig
    gib, seen = 2**30, []
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: seen.append(n) or int(2 * gib + n * 2**17) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib, largest=16384)
    assert (plan.micro_batch_tokens, seen) == (16384, [2048, 4096, 16384])


def test_a_planned_micro_batch_that_never_fits_recomputes_at_16384(tmp_path, monkeypatch):
    """Planned, but 8,192 tokens do not fit either (2 GiB + 1 MiB a token, 10 GiB usable, AdamW 1 GiB):
    16,384 tokens with the fewest of 8 layers recomputed, as a user's 16,384 would (the test below)."""
    from minirl.recipes.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    gib = 2**30
    tr = Trainer(str(build_tiny_model(tmp_path / "m8", num_layers=8)), TrainerConfig(lr=1e-3))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    peak = lambda n, k: 2 * gib + n * 2**20 * (1 - 0.75 * k / 8)
    tried = []
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: tried.append((n, tr.recomputed_layers)) or int(peak(n, tr.recomputed_layers)) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib)
    assert (plan.micro_batch_tokens, tr.recomputed_layers) == (16384, 6)
    assert tried == [(4096, 0), (8192, 0), (16384, 8), (16384, 6)]


@pytest.mark.parametrize("held_gib, tokens", [(6.5, 8192), (8.5, 4096), (9.5, None)])
def test_a_plan_where_no_layer_count_fits_16384_halves_the_rows(tmp_path, monkeypatch, held_gib, tokens):
    """Planned, what the trainer holds (held_gib, AdamW's 1 GiB included) leaves little room: 1 MiB a
    token, a quarter of it with all 8 layers recomputed, 10 GiB usable. 16,384 tokens with every layer
    (held + 4 GiB) do not fit; then half as many rows, every layer recomputing: 8,192 (held + 2 GiB)
    or 4,096 (held + 1 GiB) fit, or MemoryError at 4,096 naming the levers."""
    from minirl.recipes.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    gib = 2**30
    tr = Trainer(str(build_tiny_model(tmp_path / "m8", num_layers=8)), TrainerConfig(lr=1e-3))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    peak = lambda n, k: held_gib * gib + n * 2**20 * (1 - 0.75 * k / 8)
    tried = []
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: tried.append((n, tr.recomputed_layers)) or int(peak(n, tr.recomputed_layers)))
    halved = [(8192, 8), (4096, 8)][:2 if tokens != 8192 else 1]
    if tokens is None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "a 12 GiB GPU")
        with pytest.raises(MemoryError, match=r"one micro-batch of 4096 tokens does not fit .* \(activation "
                                              r"checkpointing on, 8 layers\): its forward_backward peaks at 10.5 GiB"):
            memory.measure_peak(tr, reserve=2 * gib)
    else:
        plan = memory.measure_peak(tr, reserve=2 * gib)
        assert (plan.micro_batch_tokens, plan.recomputed_layers) == (tokens, 8)
        assert plan.peak_bytes == int(peak(tokens, 8)) <= 10 * gib
    assert tried == [(4096, 0), (8192, 0), (16384, 8), *halved]


@pytest.mark.parametrize("bump_gib, layers", [(0.0, 6), (0.5, 7)])
def test_the_fewest_layers_that_fit_are_recomputed(tmp_path, monkeypatch, bump_gib, layers):
    """measure_peak left to itself, an 8-layer model, its trials stood in for: a peak of 2 GiB + 1 MiB
    a token, each recomputed layer taking 3/4 of its eighth away; AdamW 1 GiB, 10 GiB usable. 16,384
    tokens peak at 18 GiB without recomputation and 6 GiB with all 8 layers (1.5 GiB a layer); 8,192
    tokens (10 + 1 GiB) do not fit either, so the fewest layers that do: 18 + 1 - 10 = 9 GiB to
    save, 6 layers (2 + 16 * 7/16 + 1 = 10 GiB). When a partial trial peaks 0.5 GiB above that
    line, 6 layers do not fit and the next count, 7, does (2 + 5.5 + 0.5 + 1 = 9 GiB)."""
    from minirl.recipes.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    gib = 2**30
    tr = Trainer(str(build_tiny_model(tmp_path / "m8", num_layers=8)), TrainerConfig(lr=1e-3, micro_batch_tokens=16384))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    peak = lambda n, k: 2 * gib + n * 2**20 * (1 - 0.75 * k / 8) + (bump_gib * gib if 0 < k < 8 else 0)
    tried = []
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: tried.append((n, tr.recomputed_layers)) or int(peak(n, tr.recomputed_layers)) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib)
    got = plan.peak_bytes
    assert (plan.micro_batch_tokens, tr.recomputed_layers) == (16384, layers)
    assert got == int(peak(16384, layers)) + gib <= 10 * gib
    assert tried == [(2048, 0), (4096, 0), (16384, 8), *[(16384, k) for k in range(6, layers + 1)]]



def test_a_full_trial_over_its_prediction_recomputes_the_fewest_layers_not_all(tmp_path, monkeypatch):
    """The small trials predict that 16,384 tokens fit (2 GiB + 0.4 MiB a token: 8.4 + 1 GiB AdamW of
    10 usable) but the full trial peaks 3 GiB above its line (12.4 GiB). Its measured peak, not the
    prediction, draws the line to the every-layer trial (2 + 1.6 + 1 = 4.6 GiB, 0.975 GiB a layer):
    ceil(2.4 / 0.975) = 3 of 8 layers, which fit (7.6 GiB); not every layer, which also fits."""
    from minirl.recipes.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    gib = 2**30
    tr = Trainer(str(build_tiny_model(tmp_path / "m8", num_layers=8)), TrainerConfig(lr=1e-3, micro_batch_tokens=16384))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    peak = lambda n, k: 2 * gib + n * 0.4 * 2**20 * (1 - 0.75 * k / 8) + (3 * gib if (n, k) == (16384, 0) else 0)
    tried = []
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: tried.append((n, tr.recomputed_layers)) or int(peak(n, tr.recomputed_layers)) + gib)
    plan = memory.measure_peak(tr, reserve=2 * gib)
    got = plan.peak_bytes
    assert (plan.micro_batch_tokens, tr.recomputed_layers) == (16384, 3)
    assert got == int(peak(16384, 3)) + gib <= 10 * gib
    assert tried == [(2048, 0), (4096, 0), (16384, 0), (16384, 8), (16384, 3)]
    assert plan.recomputed_layers == 3 and [list(t[:2]) for t in plan.trials] == [list(t) for t in tried]


def test_a_partial_trial_out_of_memory_halves_the_range(tmp_path, monkeypatch):
    """As the test above, but every trial recomputing fewer than 6 of the 8 layers runs out of memory
    (None), the full one without recomputation too: no line to draw, so the range 0..8 is halved (4
    fails), then 4..8 (6 fits), and 6 is what stays recomputing."""
    from minirl.recipes.tiny import build_tiny_model
    from minirl.trainer import Trainer, TrainerConfig
    gib = 2**30
    tr = Trainer(str(build_tiny_model(tmp_path / "m8", num_layers=8)), TrainerConfig(lr=1e-3, micro_batch_tokens=16384))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 12 * gib))
    peak = lambda n, k: None if (n == 16384 and k < 6) else int(2 * gib + n * 0.4 * 2**20 * (1 - 0.75 * k / 8))
    tried = []
    monkeypatch.setattr(memory, "trial_peak", lambda _, n: tried.append((n, tr.recomputed_layers)) or (
        None if peak(n, tr.recomputed_layers) is None else peak(n, tr.recomputed_layers) + gib))
    memory.measure_peak(tr, reserve=2 * gib)
    assert tried == [(2048, 0), (4096, 0), (16384, 0), (16384, 8), (16384, 4), (16384, 6)]
    assert tr.recomputed_layers == 6


def test_a_memory_trial_accumulates_into_existing_gradients(tiny_model, monkeypatch):
    """A trial measures a micro-batch after a step's first: every gradient already there while it
    runs (the first one's backward frees activations as its gradients appear, so it peaks lower: at
    4B, 15 GiB lower, and a plan made on it ran out of memory at the second step), none left after."""
    from minirl.trainer import Trainer, TrainerConfig
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3))
    seen = []
    monkeypatch.setattr(tr, "forward_backward", lambda rollouts, fn: seen.append(
        [p.grad is not None and p.grad.shape == p.shape for p in tr.model.parameters()]))
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 123)
    assert memory.trial_peak(tr, 64) == 123
    assert len(seen) == 1 and all(seen[0]) and len(seen[0]) > 0
    assert all(p.grad is None for p in tr.model.parameters())

MEMORY_RANKS = """
import dataclasses, json, torch, torch.distributed as dist
from minirl import memory
from minirl.trainer import Trainer, TrainerConfig
gib = 2**30
tr = Trainer({model!r}, TrainerConfig(lr=1e-3, micro_batch_tokens=16384))
rank = dist.get_rank()
ckpt = lambda: bool(getattr(tr.model, "is_gradient_checkpointing", False))
per_token = 0.25 if rank == 0 else 0.5                 # MiB: rank 1's trials peak higher
torch.cuda.mem_get_info = lambda dev=None: ((60 if rank == 0 else 50) * gib, 140 * gib)
torch.cuda.empty_cache = lambda: None
memory.trial_peak = lambda _, n: int(2 * gib + n * per_token * 2**20 / (4 if ckpt() else 1)) + gib
plan = memory.measure_peak(tr, reserve=130 * gib)     # 10 GiB usable
peak = plan.peak_bytes                                 # + 14 GiB headroom: rank 0 fits in 60, rank 1 not in 50
tr.apply(memory.beside_sleeping_engine(tr, dataclasses.replace(plan, peak_bytes=40 * gib, held_bytes=0)))
json.dump([plan.micro_batch_tokens, peak / gib, ckpt()], open({out!r} + f"/rank{{rank}}.json", "w"))
dist.barrier()
tr.close()
"""


@pytest.mark.slow
def test_every_rank_takes_the_memory_decision_of_the_shortest(tiny_model, tmp_path):
    """Two ranks whose stood-in trials and free memory differ: alone, rank 0 would keep 16,384-token
    micro-batches without recomputation (the test above); agreed, both keep the 16,384 set and
    recompute (rank 1's line: 11 GiB at 16,384 tokens of 10 usable; recomputing, 5 GiB), and all
    layers once the engine sleeps (rank 1 lacks 4 GiB), so their collectives stay in step."""
    script = tmp_path / "memory_ranks.py"
    script.write_text(MEMORY_RANKS.format(model=tiny_model, out=str(tmp_path)))
    res = run_py(["-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert got[0] == got[1] == [16384, 5.0, True]
