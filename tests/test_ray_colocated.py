"""Co-located backend on Ray actors (CPU): the verbs from a driver, and the SPMD loop over two
ranks in one placement group.

Needs: CPU only; starts a private local Ray cluster. Slow-ish (vLLM engines in actors).
"""

import json
import sys

import pytest
import ray

from actors.colocated import ColocatedGroup, run_spmd
from minirl.recipes.tasks import get_task

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_verbs_from_the_driver(ray_local, tiny_model):
    """generate / forward_backward / optim_step / sync_weights on two ranks from the driver; the
    loss over an uneven split (23 rollouts) is the single-process loop's token mean."""
    import torch
    from transformers import AutoModelForCausalLM
    from minirl import clipped_policy_loss, collate, get_logprobs, ppo_loss_fn
    task = get_task("succ")
    group = ColocatedGroup(tiny_model, num_workers=2, lr=1e-3, enforce_eager=True, max_model_len=128)
    try:
        assert [i["rank"] for i in group.info] == [0, 1]
        prompts, answers = task.sample(6, seed=0)
        batches = group.generate(prompts, {"max_tokens": 2}, 4, task.reward, metadata=answers)
        assert [b.uid for b in batches] == list(range(6))
        assert all(r.policy_version == 0 for b in batches for r in b)
        rollouts = [r for b in batches for r in b][:-1]         # 23: the ranks get uneven shares
        for i, r in enumerate(rollouts):                         # (a random model's rewards are
            r.advantage = (i % 5 - 2) / 2                        # nearly all 0: no gradient)
        out = group.forward_backward(rollouts, ppo_loss_fn(clip_high=0.28, entropy=False))
        assert out["tokens"] == sum(len(r.completion_ids) for r in rollouts)
        hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        batch = collate(rollouts)
        with torch.no_grad():
            lp = get_logprobs(hf(batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
        want = clipped_policy_loss(lp, batch.old_logprobs, batch.advantages, mask=batch.loss_mask, clip_high=0.28)
        assert abs(out["loss"] - want.item()) < 1e-5 and abs(want.item()) > 1e-3
        assert all(o["grad_norm"] > 0 for o in group.optim_step())
        synced = group.sync_weights()
        assert [s["policy_version"] for s in synced] == [1, 1]
        assert all(s["probe_gap"] < 2e-3 for s in synced)   # each rank's engine == the shards
        batches = group.generate(prompts, {"max_tokens": 2}, 4, task.reward, metadata=answers)
        assert all(r.policy_version == 1 for b in batches for r in b), [r.policy_version for b in batches for r in b]
        hot = [r for b in group.generate(prompts, {"max_tokens": 2, "temperature": 0.5}, 4, task.reward,
                                         metadata=answers) for r in b]
        ratio = {t: group.forward_backward(hot, ppo_loss_fn(entropy=False), temperature=t)["ratio"] for t in (0.5, 1.0)}
        assert abs(ratio[0.5] - 1) < 1e-4 < abs(ratio[1.0] - 1)      # sampled at 0.5: on-policy only at 0.5
    finally:
        group.shutdown()


def _spmd_job(run_dir, root):
    import importlib.util
    import sys
    sys.path.insert(0, f"{root}/launch")                  # for its `import common`
    spec = importlib.util.spec_from_file_location("colocated_launch", f"{root}/launch/colocated.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.common.parse_args(mod.__doc__, run_dir, ["--steps", "3", "--prompts", "8", "--backends", ""])
    mod.run(args)
    return True


def test_spmd_loop_on_two_actors(ray_local, tmp_path):
    from conftest import ROOT
    assert run_spmd(_spmd_job, str(tmp_path), str(ROOT), num_workers=2) == [True, True]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3 and rows[-1]["policy_version"] == 2


def test_a_group_whose_setup_fails_leaves_nothing_behind(ray_local, tmp_path):
    """A rank whose setup raises: ColocatedGroup raises that error, its actors and placement group gone."""
    from ray.util.placement_group import placement_group_table
    before = set(placement_group_table())
    with pytest.raises(FileNotFoundError, match="not found"):
        ColocatedGroup(str(tmp_path / "no-model"), num_workers=1, timeout_s=120)
    new = {k: v["state"] for k, v in placement_group_table().items() if k not in before}
    assert new and set(new.values()) == {"REMOVED"}, new
