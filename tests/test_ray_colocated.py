"""Co-located backend on Ray actors (CPU): the verbs from a driver, and the SPMD loop over two
ranks in one placement group.

Needs: CPU only; starts a private local Ray cluster. Slow-ish (vLLM engines in actors).
"""

import json
import sys

import pytest
import ray

from actors.colocated import ColocatedGroup, run_spmd
from minirl.tasks import get_task

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_verbs_from_the_driver(ray_local, tiny_model):
    task = get_task("succ")
    group = ColocatedGroup(tiny_model, num_workers=2, lr=1e-3, reward_fn=task.reward,
                           enforce_eager=True, max_model_len=128)
    try:
        assert [i["rank"] for i in group.info] == [0, 1]
        prompts, answers = task.sample(6, seed=0)
        batches = group.generate(prompts, {"max_tokens": 2}, group_size=4, metadata=answers)
        assert [b.uid for b in batches] == list(range(6))
        assert all(r.policy_version == 0 for b in batches for r in b)
        rollouts = [r for b in batches for r in b]
        out = group.forward_backward(rollouts[:-1])         # 23 rollouts: one rank gets padding
        assert sum(o["tokens"] for o in out) == sum(len(r.completion_ids) for r in rollouts[:-1])
        group.optim_step()
        synced = group.sync_weights()
        assert [s["policy_version"] for s in synced] == [1, 1]
        assert all(s["probe_gap"] < 2e-3 for s in synced)   # each rank's engine == the shards
        batches = group.generate(prompts, {"max_tokens": 2}, group_size=4, metadata=answers)
        assert all(r.policy_version == 1 for b in batches for r in b)
    finally:
        group.shutdown()


def _spmd_job(run_dir, root):
    import importlib.util
    spec = importlib.util.spec_from_file_location("colocated_launch", f"{root}/launch/colocated.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parse_args(["--steps", "3", "--prompts", "8", "--backends", "", "--run-dir", run_dir])
    mod.run(args)
    return True


def test_spmd_loop_on_two_actors(ray_local, tmp_path):
    from conftest import ROOT
    assert run_spmd(_spmd_job, str(tmp_path), str(ROOT), num_workers=2) == [True, True]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3 and rows[-1]["policy_version"] == 2
