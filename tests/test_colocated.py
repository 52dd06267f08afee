"""WeightManager on real vLLM (CPU build) + FSDP2 (gloo): the seed loop, sync, its checks,
learning end to end, and two ranks under torchrun.

Needs: CPU only (2 cores is enough). The job-level tests start fresh processes.
"""

import collections
import contextlib
import json
import re

import pytest
import torch
from vllm import SamplingParams

from conftest import run_py
from minirl import clipped_policy_loss, get_logprobs, parse_vllm_outputs
from minirl import colocated, vllm_compat as vc
from minirl.colocated import SyncError, WeightManager, WeightManagerConfig
from minirl.recipes.tasks import get_task
from minirl.trainer import TrainerConfig


def _rollouts(wm, n_prompts=4, group=4, seed=0):
    task = get_task("succ")
    prompts, answers = task.sample(n_prompts, seed=seed)
    llm = wm.as_vllm()
    outputs = llm.generate(prompts, SamplingParams(n=group, temperature=1.0, max_tokens=2, logprobs=0),
                           use_tqdm=False)
    batches = parse_vllm_outputs(outputs, group, task.reward, metadata=answers, policy_version=wm.policy_version,
                                 device=wm.device)
    return batches


def test_seed_loop_verbatim_then_sync(wm):
    batches = _rollouts(wm)
    v0 = wm.policy_version
    assert all(r.policy_version == v0 for b in batches for r in b)
    for b in batches: b.compute_advantages()
    all_rollouts = [r for b in batches for r in b]
    model, optimizer = wm.as_trainable()
    slept = wm.timings["sleep_s"]                          # this switch's, in the training phase's log
    for epoch in range(2):
        for rollout in all_rollouts:
            out = model(rollout.token_ids, output_hidden_states=True)
            loss = clipped_policy_loss(get_logprobs(out.logits, rollout.token_ids),
                                       rollout.old_logprobs, rollout.advantage)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
    assert torch.isfinite(loss)
    llm = wm.as_vllm()                                     # syncs: the optimizer stepped
    assert wm.policy_version == v0 + 1
    assert wm.last_probe_gap < 2e-3 and {"wake_s", "sync_s", "verify_s", "probe_gap"} <= set(wm.timings)
    assert wm.timings["sleep_s"] == slept                  # the round trip: that sleep, then this wake and sync
    batches = _rollouts(wm, seed=1)
    assert all(r.policy_version == v0 + 1 for b in batches for r in b)
    assert llm is wm.as_vllm()                             # no step -> no sync, same engine
    assert wm.policy_version == v0 + 1


def _step(wm):
    model, opt = wm.as_trainable()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    loss = -get_logprobs(model(ids).logits, ids).mean()
    opt.zero_grad(); loss.backward(); opt.step()


class _Sabotage:
    """Replace vllm_compat.weight_update with a loader that misbehaves in a chosen way."""

    def __init__(self, wm, mode):
        self.wm, self.mode, self.real = wm, mode, vc.weight_update

    @contextlib.contextmanager
    def __call__(self, llm):
        wm, mode = self.wm, self.mode
        with self.real(llm) as load:
            class L:
                loaded = load.loaded

                def __call__(self, bucket):
                    if mode == "noise":
                        load([(n, t + 0.05 * torch.randn_like(t)) for n, t in bucket])
                    elif mode == "partial":
                        load([(n, t) for n, t in bucket if "layers.1." not in n])
                    elif mode == "noop":
                        self.loaded |= wm._expected        # claims success, loads nothing
            yield L()


@pytest.mark.parametrize("mode, msg", [("noise", "probe differ"), ("partial", "did not accept"),
                                       ("noop", "changed nothing")])
def test_broken_sync_raises(wm, monkeypatch, mode, msg):
    _step(wm)
    monkeypatch.setattr(vc, "weight_update", _Sabotage(wm, mode))
    with pytest.raises(SyncError, match=msg):
        wm.as_vllm()
    monkeypatch.undo()
    wm.mark_dirty()                    # repair for the tests that follow
    wm.as_trainable()
    wm.as_vllm()
    assert wm.last_probe_gap < 2e-3


def test_a_change_to_linear_weights_alone_is_no_stuck_sync(wm):
    """Only a linear layer's weight changes (late in a converged run, or LoRA): the engine's checksum
    on CPU cannot see linear weights (vLLM repacks them), so the trainer's checksum covers the same
    weights as the engine's, and the sync passes on its probe log-probs. Before, it raised 'changed
    nothing' although the weights had arrived."""
    model, _ = wm.as_trainable()
    with torch.no_grad():
        w = model.model.layers[0].self_attn.o_proj.weight
        w.add_(0.05 * torch.randn_like(w))
    wm.mark_dirty()
    wm.as_vllm()                       # raises SyncError if the sync is judged stuck or the probe differs
    assert wm.last_probe_gap < 2e-3


def test_tied_embedding_change_reaches_lm_head(wm):
    """A changed (tied) embedding must change vLLM's output layer too (regression: on CPU the
    tied lm_head kept a packed copy of the old embedding)."""
    model, _ = wm.as_trainable()
    assert wm.model.config.tie_word_embeddings
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.add_(0.05 * torch.randn_like(emb))
    wm.mark_dirty()
    wm.as_vllm()                       # raises SyncError if the probe disagrees
    assert wm.last_probe_gap < 2e-3


def test_generate_after_as_trainable_is_an_error(wm):
    llm = wm.as_vllm()
    wm.as_trainable()
    with pytest.raises(RuntimeError, match="as_vllm"):
        llm.generate(["1+1="], SamplingParams(max_tokens=1))
    wm.as_vllm().generate(["1+1="], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("kwargs, err, msg", [
    (dict(model="/nonexistent/model"), FileNotFoundError, "not found"),
    (dict(model="not-a-hub-name/with/slashes"), FileNotFoundError, "not found"),
    (dict(config=WeightManagerConfig(trainer=TrainerConfig(mixed_precision="fp16"))), ValueError, "loss scaling"),
    (dict(config=WeightManagerConfig(trainer=TrainerConfig(mixed_precision="int8"))), ValueError, "mixed_precision"),
    (dict(config=WeightManagerConfig(sleep_level=3)), ValueError, "sleep_level"),
    (dict(enable_sleep_mode=True), ValueError, "no sleep mode on CPU"),
    (dict(distributed_executor_backend="mp"), ValueError, "external_launcher"),
    (dict(config=WeightManagerConfig(offload_optimizer=True)), ValueError, "on CPU: the state is in host memory"),
    (dict(config=WeightManagerConfig(kv_cache_gib=2.0), gpu_memory_utilization=0.5), ValueError,
     "kv_cache_gib=2.0 and gpu_memory_utilization"),
    (dict(config=WeightManagerConfig(kv_cache_gib=2.0), kv_cache_memory_bytes=2**30), ValueError,
     "kv_cache_gib=2.0 and kv_cache_memory_bytes"),
])
def test_bad_arguments_fail_before_any_work(tiny_model, kwargs, err, msg, monkeypatch):
    """Refused before the model loads (a Trainer built would be work done: here it fails the test)."""
    def loaded(*a, **kw):
        raise AssertionError("a Trainer was built before the arguments were checked")
    monkeypatch.setattr(colocated, "Trainer", loaded)
    kwargs = {"model": tiny_model, **kwargs}
    with pytest.raises(err, match=msg):
        WeightManager(kwargs.pop("model"), **kwargs)


@pytest.mark.parametrize("gib", [0, -1.0, float("nan")])
def test_kv_cache_gib_must_be_positive(gib):
    """A KV cache of no size was planned as 'does not fit' (a MemoryError naming the wrong cause)."""
    with pytest.raises(ValueError, match="kv_cache_gib must be > 0"):
        WeightManagerConfig(kv_cache_gib=gib)


def test_engine_graph_mode_by_device_and_head_size(tiny_model, tmp_path):
    """Full CUDA graphs for every step on Hopper where they are exact (head_dim 128), decode-only
    graphs there for other head sizes (head_dim 64: wrong prefill attention under full graphs),
    vLLM's own mode elsewhere; a user's compilation_config, enforce_eager or adapter serving win.
    Triton's attention kernel on Hopper unless the user names a backend."""
    from minirl.recipes.tiny import build_tiny_model
    mode = vc.default_compilation
    assert mode({}, 128, (9, 0)) == {"cudagraph_mode": "FULL"}
    assert mode({}, 64, (9, 0)) == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert mode({}, 256, (9, 0)) == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    for other in [(8, 0), (10, 0), (12, 0)]:
        assert mode({}, 128, other) is None, other
    for user in ({"compilation_config": {"mode": 0}}, {"enforce_eager": True}, {"enable_lora": True}):
        assert mode(user, 128, (9, 0)) is None, user
    assert "compilation_config" not in vc.engine_kwargs({}, sleep=False, seed=0, colocated=False)
    attention = vc.default_attention                 # Triton's kernel on Hopper unless the user names one
    assert attention({}, (9, 0)) == {"attention_backend": "TRITON_ATTN"}
    assert attention({"enable_lora": True}, (9, 0)) == {"attention_backend": "TRITON_ATTN"}
    for user in ({"attention_backend": "FLASH_ATTN"}, {"attention_config": {"backend": "FLASH_ATTN"}}):
        assert attention(user, (9, 0)) == {}, user
    for other in [(8, 0), (10, 0)]:
        assert attention({}, other) == {}, other
    assert vc.head_dim(tiny_model) == 64                                   # hidden 128 / 2 heads
    assert vc.head_dim(str(build_tiny_model(tmp_path / "m", hidden_size=256, num_heads=2))) == 128


def test_closing_one_manager_leaves_another_working(tiny_model):
    """Two WeightManagers in one process (a notebook comparing two runs): closing the first leaves
    the second's engine and trainer working (vLLM's engine teardown also tore down the process's
    distributed state, and the first trainer the process group: the second failed on its next step)."""
    first = WeightManager(tiny_model, lr=1e-3, enforce_eager=True, max_model_len=64)
    with WeightManager(tiny_model, lr=1e-3, enforce_eager=True, max_model_len=64) as second:
        first.close()
        assert _rollouts(second, n_prompts=2, group=2)
        _step(second)
        second.as_vllm()                                 # a verified sync of the changed weights
        assert second.policy_version == 1 and second.last_probe_gap < 2e-3
        assert _rollouts(second, n_prompts=2, group=2)


def test_model_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        WeightManager(str(tmp_path))


def test_model_that_does_not_fit(tiny_model, monkeypatch):
    import psutil
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1 << 20))
    with pytest.raises(MemoryError, match="does not fit"):
        WeightManager(tiny_model)


def test_the_check_before_loading_asks_the_ranks_own_device(tiny_model, monkeypatch):
    """Rank 2 of a host of 4 GPUs checks cuda:2, the device it will train on: asking the current device
    (cuda:0 before set_device) would put a context of every rank on GPU 0. CUDA stood in for."""
    from minirl import memory
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: asked.append(d) or (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: asked.append(d) or "GPU")
    monkeypatch.setenv("LOCAL_RANK", "2")
    memory.check_before_loading(tiny_model, TrainerConfig(), 256)
    assert asked == [torch.device("cuda", 2)] * 2


# ---- whole jobs in fresh processes ----------------------------------------------------------

def _rewards(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["reward/mean"] for r in rows], rows


@pytest.mark.slow
def test_demo_learns_and_needs_sync(tmp_path):
    """The default demo's reward rises from real rollouts; with sync off it does not."""
    args = ["launch/colocated.py", "--steps", "24", "--backends", ""]
    res = run_py([*args, "--run-dir", str(tmp_path / "on"), "--verbose"])    # vLLM's own logs shown
    assert res.returncode == 0, res.stderr[-3000:]
    on, rows = _rewards(tmp_path / "on")
    first, last = sum(on[:4]) / 4, sum(on[-4:]) / 4
    assert rows[-1]["policy_version"] == 23
    assert last > 0.4 and last > first + 0.3, on
    assert (tmp_path / "on" / "reward_curve.png").stat().st_size > 1000
    logs = collections.Counter(m.groups() for m in re.finditer(r"(INFO|WARNING) [\d-]+ [\d:.]+ \[(\S+)\]",
                                                                 res.stdout + res.stderr))
    assert logs and max(logs.values()) < 12, logs.most_common(3)      # none of them every step (24)

    res = run_py([*args, "--run-dir", str(tmp_path / "off"), "--no-sync"])
    assert res.returncode == 0, res.stderr[-3000:]
    off, rows = _rewards(tmp_path / "off")
    assert rows[-1]["policy_version"] == 0         # optimizer stepped, engine never synced
    assert sum(off[-4:]) / 4 < 0.15, off           # stays at the random model's ~1/64


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path):
    res = run_py(["-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/colocated.py",
                  "--steps", "4", "--prompts", "8", "--backends", "", "--run-dir", str(tmp_path)])
    assert res.returncode == 0, res.stderr[-3000:]
    rewards, rows = _rewards(tmp_path)
    assert len(rows) == 4 and rows[-1]["policy_version"] == 3     # every rank synced 3 times
    assert all(r["sync/probe_gap"] < 2e-3 for r in rows[1:])     # each rank's engine == shards


FREEZE = """
import gc, json, sys
from minirl import Rollout, ppo_loss_fn
from minirl.colocated import WeightManager, WeightManagerConfig
ids = list(range(5, 15))

def step(m):
    m.as_trainable()
    m.trainer.forward_backward([Rollout(prompt_ids=ids[:3], completion_ids=ids[3:], reward=1.0,
                                        sampling_logprobs=[-1.0] * 7, advantage=1.0)], ppo_loss_fn())
    m.trainer.optim_step()
    m.as_vllm()
    return gc.get_freeze_count()

if __name__ == "__main__":
    m = WeightManager(sys.argv[1], lr=1e-3, config=WeightManagerConfig(freeze_gc=sys.argv[2] == "on"),
                      enforce_eager=True, max_model_len=128)
    m.as_vllm(), m.as_trainable(), m.as_vllm()            # a switch with nothing trained
    at_start = gc.get_freeze_count()
    garbage = [[] for _ in range(50_000)]                 # alive at the first step's end
    first = step(m)
    del garbage
    second = step(m)
    m.close()
    json.dump([at_start, first, second, gc.get_freeze_count(), m.policy_version], open(sys.argv[3], "w"))
"""


@pytest.mark.parametrize("freeze", ["on", "off"])
def test_the_heap_is_frozen_once_trained_weights_reach_the_engine(tiny_model, tmp_path, freeze):
    """vLLM freezes its start-up heap itself; the first as_vllm() that loads trained weights
    freezes what the first step added (not a switch with nothing trained, not again later, never
    with freeze_gc=False); after close() nothing stays frozen. In a fresh process: closing an
    engine tears down vLLM's process-wide state that the session's engine uses."""
    script, out = tmp_path / "freeze.py", tmp_path / "freeze.json"
    script.write_text(FREEZE)
    res = run_py([str(script), tiny_model, freeze, str(out)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    at_start, first, second, after_close, version = json.loads(out.read_text())
    assert (first > at_start + 50_000) == (freeze == "on") and version == 2
    assert second <= first and after_close == 0


def test_activation_checkpointing_gives_the_same_gradients(tiny_model, wm):
    """load_fsdp_model(activation_checkpointing=True) recomputes every layer in backward, =1 the
    first of the two alone (each recomputed layer starts its forward twice a step, the other once):
    same loss and gradients as without (fp32, CPU), in the process group the session already has."""
    from minirl.model import _decoder_layers, load_fsdp_model, recomputed_layers
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    grads = []
    for ckpt, calls in ((False, [1, 1]), (True, [2, 2]), (1, [2, 1])):
        m = load_fsdp_model(tiny_model, wm.device, 1, torch.float32, activation_checkpointing=ckpt)
        m.train()
        seen = [0, 0]
        for i, layer in enumerate(_decoder_layers(m)):
            layer.register_forward_pre_hook(lambda *_, i=i: seen.__setitem__(i, seen[i] + 1))
        loss = -get_logprobs(m(ids).logits, ids).mean()
        loss.backward()
        assert seen == calls and recomputed_layers(m) == sum(c - 1 for c in calls)
        grads.append({n: p.grad.full_tensor().clone() for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys() == grads[2].keys()
    assert all(torch.allclose(grads[0][n], g[n], atol=1e-6) for g in grads[1:] for n in grads[0])
    with pytest.raises(ValueError, match=r"activation_checkpointing=3: the model has 2 decoder layers"):
        load_fsdp_model(tiny_model, wm.device, 1, torch.float32, activation_checkpointing=3)


@pytest.mark.parametrize("ckpt", [False, True])
def test_gather_during_forward_is_the_full_gather(tiny_model, wm, ckpt):
    """The probe forward's own unshards deliver every weight, once, exactly as
    full_weight_buckets does; the forward's result is untouched; units the forward skips are
    gathered after it; the model ends resharded."""
    from torch.distributed.fsdp import FSDPModule
    from minirl.model import load_fsdp_model
    from minirl.weights import full_weight_buckets, gather_during_forward, reshard
    m = load_fsdp_model(tiny_model, wm.device, 1, torch.float32, activation_checkpointing=ckpt)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = m(ids).logits
    reshard(m)
    ref = [[(n, t.clone()) for n, t in b] for b in full_weight_buckets(m, dtype=torch.bfloat16)]
    units = [u for u in m.modules() if isinstance(u, FSDPModule) and u is not m]
    calls = []
    for u in units:                       # count explicit unshards (the fallback path)
        u.unshard = (lambda orig, u: lambda *a, **k: (calls.append(u), orig(*a, **k))[1])(u.unshard, u)
    for forward, n_fallback in ((lambda: m(ids).logits, 0), (lambda: None, len(units))):
        calls.clear()
        got = []
        out = gather_during_forward(m, forward, lambda b: got.append([(n, t.clone()) for n, t in b]),
                                    dtype=torch.bfloat16)
        assert len(calls) == n_fallback
        assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in ref]
        assert all(a.dtype == torch.bfloat16 and torch.equal(a, b)
                   for bg, br in zip(got, ref) for (_, a), (_, b) in zip(bg, br))
        assert all(type(p).__name__ == "DTensor" for p in m.parameters())      # resharded
    assert torch.equal(gather_during_forward(m, lambda: m(ids).logits, lambda b: None), expected)


@pytest.mark.parametrize("sleep_level, want, offload, level, kv_gib, offloaded", [
    (None, 30, None, 2, 30.0, False), (0, 50, None, 0, 40.04, False),
    (None, 85, None, 2, 85.0, True), (None, 85, False, 2, 79.04, False)])
def test_the_memory_plan_puts_the_engine_to_sleep_unless_told_to_keep_it(monkeypatch, sleep_level, want, offload,
                                                                       level, kv_gib, offloaded):
    """The plan's arithmetic on a stood-in 100 GiB device, 1B parameters (bf16 engine: 1.96 GiB of
    weights + 4 GiB working memory), trainer weights 4 GiB and AdamW 8 GiB (12 allocated at load),
    a measured step peaking 44 GiB (32 above them), 10 GiB headroom, 3 GiB margin, 88 GiB free. By
    default the engine sleeps while training, even when it would fit beside the step's peak (a 30
    GiB KV cache would): the training step gets its memory. Resident (sleep_level=0) the KV cache
    has to fit beside the step's peak: 88 - 10 - 32 - 5.96 = 40.04 GiB, and a 50 GiB want is cut to
    that. A KV cache that would leave less than the headroom free beside the weights and AdamW (85
    GiB > 88 - 10 - 5.96) sends AdamW's state to the host while generating, which frees its 8 GiB:
    the 85 GiB fit (96 - 3 - 5.96 = 87.04); told not to, the cache is cut to 79.04 GiB."""
    from minirl.memory import GIB
    n_params = 10**9
    planned.clear()
    got_level, kw, need, got_offload = _stood_in_plan(monkeypatch, 88, want, sleep_level=sleep_level,
                                                      offload_optimizer=offload)
    assert got_level == level and need == 32 * GIB and got_offload == offloaded
    assert planned == [16384 if level == 0 else None]      # resident: the KV cache before longer rows
    engine = n_params * 2 * 1.05 + 4 * GIB
    free = (88 + 8 * offloaded) * GIB
    beside = free - 3 * GIB - engine if level else free - (10 + 32) * GIB - engine
    assert kw["kv_cache_memory_bytes"] == int(min(want * GIB, beside)) and abs(kw["kv_cache_memory_bytes"] / GIB - kv_gib) < 0.05


@pytest.mark.parametrize("offload, host_gib", [(None, 64), (False, 64), (None, 15)])
def test_the_memory_plan_sends_adamw_to_the_host_when_only_that_fits_the_engine(monkeypatch, offload, host_gib):
    """The stood-in device above with 8 GiB free beside the trainer: the engine (5.96 GiB) and a
    KV cache of two 1 GiB tokens do not fit with the 3 GiB margin, but do once AdamW's 8 GiB go
    to the host (16 - 3 - 5.96 = 7.04 GiB of cache). Told not to, or with less host memory than
    1.5x the state + 4 GiB, the plan raises and names that lever."""
    from minirl.memory import GIB
    if offload is None and host_gib > 16:
        level, kw, _, got = _stood_in_plan(monkeypatch, 8, 30, host_gib=host_gib, offload_optimizer=offload)
        assert got and abs(kw["kv_cache_memory_bytes"] / GIB - 7.04) < 0.05
        return
    with pytest.raises(MemoryError, match=r"keeps 12.0 GiB while generating.*offload_optimizer=True"):
        _stood_in_plan(monkeypatch, 8, 30, host_gib=host_gib, offload_optimizer=offload)


@pytest.mark.parametrize("gib, offload, fits", [(50, None, True), (85, None, True), (85, False, False)])
def test_a_kv_cache_size_set_is_kept_or_refused(monkeypatch, gib, offload, fits):
    """kv_cache_gib on the stood-in device above (88 GiB free, asleep): 50 GiB fits; 85 GiB fits
    once AdamW's state goes to the host; kept on the device, 79.04 GiB is left, and the size set is
    refused (it was cut silently) with what is left and the levers."""
    from minirl.memory import GIB
    if fits:
        _, kw, _, offloaded = _stood_in_plan(monkeypatch, 88, 1, kv_cache_gib=float(gib), offload_optimizer=offload)
        assert kw["kv_cache_memory_bytes"] == gib * GIB and offloaded == (gib == 85)
        return
    with pytest.raises(MemoryError, match=r"kv_cache_gib=85 does not fit on a stood-in GPU: 79.0 GiB is left .* "
                                          r"kv_cache_gib=79 or less, or unset \(what is left\), "
                                          r"offload_optimizer=True"):
        _stood_in_plan(monkeypatch, 88, 1, kv_cache_gib=float(gib), offload_optimizer=offload)


def test_the_cpu_memory_check_counts_an_engine_per_rank_and_shares_the_host(monkeypatch):
    """On CPU each rank holds its shard of the fp32 weights, gradients and AdamW state (16 bytes a
    parameter over the ranks) beside an fp32 engine of its own (4 bytes a parameter, unsharded) and
    its KV cache, and the ranks on one host share its memory: 1B parameters over 2 ranks of one host
    need 8 + 4 GB + 0.25 GiB = 11.4 GiB a rank, more than the 8 GiB each has of 16 GiB."""
    import types

    import psutil

    from minirl import memory
    from minirl.memory import GIB
    model = types.SimpleNamespace(parameters=lambda: [types.SimpleNamespace(numel=lambda: 10**9)])
    trainer = types.SimpleNamespace(model=model, rank=types.SimpleNamespace(world_size=2), device=torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=16 * GIB))
    agreed = []        # the ranks' largest shortfall (all_reduce MAX over a process group; here: this rank's)
    monkeypatch.setattr(memory, "agreed_max", lambda trainer, v: agreed.append(v) or v)
    with pytest.raises(MemoryError, match=r"training \+ engine need ~11.4 GiB a rank, 8.0 GiB is available to each "
                                          r"of this host's 2 rank\(s\)\. Use"):
        memory.plan(trainer, {}, WeightManagerConfig())
    # Enough here but not on another host: every rank refuses alike and says why.
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=32 * GIB))
    monkeypatch.setattr(memory, "agreed_max", lambda trainer, v: agreed.append(v) or GIB)
    with pytest.raises(MemoryError, match=r"16.0 GiB is available .* \(another host lacks 1.0 GiB\)"):
        memory.plan(trainer, {}, WeightManagerConfig())
    assert agreed[0] > 0 > agreed[1]
    # kv_cache_gib counts and reaches the engine (it was ignored on CPU: the 256 MiB default)
    monkeypatch.setattr(memory, "agreed_max", lambda trainer, v: v)
    with pytest.raises(MemoryError, match=r"need ~19.2 GiB a rank, 16.0 GiB is available"):
        memory.plan(trainer, {}, WeightManagerConfig(kv_cache_gib=8))
    trainer.config, trainer.micro_batch_tokens = TrainerConfig(), 16384
    trainer.recomputed_layers, trainer.memory_budget = 0, 1.0
    plan = memory.plan(trainer, {}, WeightManagerConfig(kv_cache_gib=4))
    assert plan.engine_kwargs == {"kv_cache_memory_bytes": 4 * GIB}


planned: list = []   # the largest micro-batch each stood-in plan let measure_peak choose


def _stood_in_plan(monkeypatch, free_gib: float, want: int, *, host_gib: float = 64, **cfg):
    """memory.plan on a stood-in 100 GiB device and trainer: 1B parameters, 12 GiB allocated (4 of
    weights, 8 of AdamW's state), a step peaking at 44 GiB, 1 GiB of KV cache a token, `want`
    sequences of one token, `free_gib` free, `host_gib` of host memory available. `planned` records
    the `largest` micro-batch each plan let measure_peak choose."""
    import types

    import psutil

    from minirl import memory
    from minirl.colocated import WeightManagerConfig
    from minirl.memory import GIB, MemoryPlan
    mc = types.SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=GIB // 4,
                               max_position_embeddings=10)      # 1 GiB of KV cache a token (bf16)
    model = types.SimpleNamespace(config=mc, parameters=lambda: [types.SimpleNamespace(numel=lambda: 10**9)])
    trainer = types.SimpleNamespace(model=model, rank=types.SimpleNamespace(world_size=1),
                                    device=torch.device("cuda"), compute_dtype=torch.bfloat16,
                                    optimizer_state_bytes=8 * GIB)
    monkeypatch.setattr(memory, "measure_peak", lambda trainer, reserve, largest: planned.append(largest)
                        or MemoryPlan(peak_bytes=44 * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (int(free_gib * GIB), 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "a stood-in GPU")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=host_gib * GIB))
    p = memory.plan(trainer, {"max_num_seqs": want, "max_model_len": 1}, WeightManagerConfig(**cfg))
    return p.sleep_level, p.engine_kwargs, p.peak_bytes - p.held_bytes, p.offload_optimizer


def test_a_load_that_failed_is_made_again_by_the_next_as_vllm(wm, monkeypatch):
    """The engine's load raised midway: the next as_vllm() loads the trainer's weights again
    (before, the version was published and the next call returned the engine with its old weights)."""
    _step(wm)

    @contextlib.contextmanager
    def failing(llm):
        raise RuntimeError("load failed")
        yield
    monkeypatch.setattr(vc, "weight_update", failing)
    with pytest.raises(RuntimeError, match="load failed"):
        wm.as_vllm()
    monkeypatch.undo()
    before = vc.fingerprint(wm.llm)
    wm.as_vllm()
    assert vc.fingerprint(wm.llm) != before and "sync_s" in wm.timings
    assert wm.last_probe_gap < 2e-3


def test_a_sync_that_failed_its_check_is_checked_again_by_the_next_as_vllm(wm, monkeypatch):
    """as_vllm() raised SyncError: calling it again syncs and checks again, against the last weights
    that passed (before, it returned the engine that had failed, as if it held the latest weights)."""
    _step(wm)
    monkeypatch.setattr(vc, "weight_update", _Sabotage(wm, "noop"))
    for _ in range(2):
        with pytest.raises(SyncError, match="changed nothing"):
            wm.as_vllm()
    monkeypatch.undo()
    wm.as_vllm()
    assert wm.last_probe_gap < 2e-3


def test_a_failed_setup_leaves_no_engine_or_trainer_behind(tiny_model):
    """WeightManager() raised after its engine was built: the engine is shut down and the trainer
    closed before the error (before, both stayed alive, the engine's memory with them)."""
    from minirl import trainer as trainer_module
    engines, trainers = set(vc._LIVE), set(trainer_module._OPEN)
    with pytest.raises(Exception):
        WeightManager(tiny_model, config=WeightManagerConfig(probe_text=""), enforce_eager=True, max_model_len=64)
    assert set(vc._LIVE) == engines and set(trainer_module._OPEN) == trainers


@pytest.mark.parametrize("text", ["", "a"])
def test_a_probe_text_under_two_tokens_is_refused(tiny_model, text):
    """The probe scores every token after the first: with fewer than two there is nothing to compare
    (before, "" failed in the embedding and "a" made every sync raise SyncError with an inf gap)."""
    with pytest.raises(ValueError, match="probe_text"):
        WeightManager(tiny_model, config=WeightManagerConfig(probe_text=text), enforce_eager=True, max_model_len=64)
