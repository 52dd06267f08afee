"""A catalog of bad inputs to the library API: each must fail fast with the right error type and a
message that names the problem (and usually the fix), never a silent wrong result or a torch error
from deep inside. One case per row; every case runs under a 30 s timeout.

Needs: CPU only, no engine: vLLM outputs are built from vLLM's own RequestOutput classes.
Run: python -m pytest tests/test_bad_inputs.py -q
"""

import json
import math

import pytest
import torch
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

from minirl.colocated import WeightManagerConfig
from minirl.checkpoint import Checkpointer, CheckpointError, verify
from minirl.core import (aggregate, clipped_policy_loss, compute_advantages, entropy_from_logits, get_logprobs,
                         ppo_loss_fn, token_logprobs, truncated_importance_weights)
from minirl.data import (Rollout, RolloutBatch, collate, load_rollouts, pack, parse_vllm_outputs,
                         save_rollouts, split_by_tokens)
from minirl.trainer import Trainer, TrainerConfig
from minirl.weights import SyncError, check_sync, check_tolerance, probe_gap

pytestmark = pytest.mark.timeout(30)
NAN, INF = float("nan"), float("inf")


def _rollout(**kw):
    return Rollout(**{"prompt_ids": [1, 2], "completion_ids": [3, 4], "sampling_logprobs": [-0.5, -1.0],
                      "reward": 1.0, **kw})


def _output(prompt, n=1, logprobs=True):
    """A vLLM RequestOutput for `prompt` with n one-token completions (token 7, log-prob -0.1)."""
    comps = [CompletionOutput(index=i, text="x", token_ids=[7], cumulative_logprob=-0.1,
                              logprobs=[{7: Logprob(-0.1)}] if logprobs else None, finish_reason="length")
             for i in range(n)]
    return RequestOutput(request_id=prompt, prompt=prompt, prompt_token_ids=[ord(c) for c in prompt],
                         prompt_logprobs=None, outputs=comps, finished=True)


LP = torch.full((2, 3), -0.5)         # (B=2, C=3) log-probs
ONE = torch.tensor([1.0, -1.0])       # one advantage per sequence

# (id, call, error type, phrase of the message)
CORE = [
    ("adv-group-0", lambda: compute_advantages([1.0, 2.0], 0), ValueError, "group_size must be >= 1"),
    ("adv-partial-group", lambda: compute_advantages([1.0] * 5, 2), ValueError, "do not split into groups"),
    ("adv-nan-reward", lambda: compute_advantages([1.0, NAN], 2), ValueError, "NaN or inf"),
    ("logprobs-3d", lambda: token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long)),
     ValueError, "pass (N, V) logits"),
    ("logprobs-temperature-0", lambda: token_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),
                                                      temperature=0), ValueError, "temperature must be > 0"),
    ("entropy-temperature-0", lambda: entropy_from_logits(torch.zeros(2, 4), temperature=0), ValueError,
     "temperature must be > 0"),
    ("logprobs-chunk-0", lambda: token_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),
                                                chunk_size=0), ValueError, "chunk_size must be >= 1"),
    ("get-logprobs-mismatch", lambda: get_logprobs(torch.zeros(1, 5, 4), torch.zeros(1, 6, dtype=torch.long)),
     ValueError, "disagree"),
    ("aggregate-mode", lambda: aggregate(LP, None, "seq-sum"), ValueError, "unknown aggregation"),
    ("aggregate-mask-shape", lambda: aggregate(LP, torch.ones(1, 3)), ValueError, "does not match"),
    ("aggregate-max-tokens-0", lambda: aggregate(LP, None, "seq-mean-token-sum-norm", max_tokens=0),
     ValueError, "max_tokens must be >= 1"),
    ("loss-broadcast-one-over-four", lambda: clipped_policy_loss(torch.zeros(1, 3), torch.zeros(4, 3),
                                                                 torch.ones(4)), ValueError, "leading"),
    ("loss-new-shorter", lambda: clipped_policy_loss(torch.zeros(2, 2), LP, ONE), ValueError, "at least"),
    ("loss-nan-advantage", lambda: clipped_policy_loss(LP, LP, torch.tensor([NAN, 1.0])), ValueError,
     "advantages hold 1 NaN or inf"),
    ("loss-inf-old", lambda: clipped_policy_loss(LP, LP.clone().fill_(-INF), ONE), ValueError,
     "old_logprobs hold"),
    ("loss-nan-new", lambda: clipped_policy_loss(LP.clone().fill_(NAN), LP, ONE), ValueError,
     "new_logprobs hold"),
    ("loss-adv-count", lambda: clipped_policy_loss(LP, LP, torch.ones(3)), ValueError, "do not fit"),
    ("loss-adv-shape", lambda: clipped_policy_loss(LP, LP, torch.ones(2, 4)), ValueError, "do not fit"),
    ("loss-adv-string", lambda: clipped_policy_loss(LP, LP, "1.0"), TypeError, "advantages must be a number"),
    ("loss-list-logprobs", lambda: clipped_policy_loss([[-0.5] * 3] * 2, LP, ONE), TypeError,
     "must be tensors"),
    ("loss-clip-low", lambda: clipped_policy_loss(LP, LP, ONE, clip_low=1.5), ValueError, "clip_low must be"),
    ("loss-dual-clip", lambda: clipped_policy_loss(LP, LP, ONE, dual_clip=1.0), ValueError, "dual_clip"),
    ("ppo-loss-fn-clip", lambda: ppo_loss_fn(clip_low=-0.1), ValueError, "trust region"),
    ("ppo-loss-fn-dual", lambda: ppo_loss_fn(dual_clip=0.5), ValueError, "dual_clip must be > 1"),
    ("tis-level", lambda: truncated_importance_weights(LP, LP, level="seq"), ValueError, "level must be"),
    ("tis-broadcast", lambda: truncated_importance_weights(torch.zeros(1, 3), LP), ValueError, "leading"),
]

DATA = [
    ("rollout-empty-prompt", lambda: _rollout(prompt_ids=[]), ValueError, "empty prompt"),
    ("rollout-logprob-count", lambda: _rollout(sampling_logprobs=[-0.5]), ValueError, "sampling log-probs"),
    ("rollout-mask-count", lambda: _rollout(loss_mask=[1]), ValueError, "loss_mask entries"),
    ("rollout-mask-values", lambda: _rollout(loss_mask=[0.5, 1]), ValueError, "loss_mask entries must be 0 or 1"),
    ("rollout-nan-reward", lambda: _rollout(reward=NAN), ValueError, "NaN or inf"),
    ("rollout-inf-logprob", lambda: _rollout(sampling_logprobs=[-INF, -1.0]), ValueError, "NaN or inf"),
    ("parse-a-string", lambda: parse_vllm_outputs("1+1=", 2, lambda p, c: 0.0), TypeError,
     "takes the list llm.generate"),
    ("parse-strings", lambda: parse_vllm_outputs(["1+1=", "2+2="], 2, lambda p, c: 0.0), TypeError,
     "RequestOutputs"),
    ("parse-dicts", lambda: parse_vllm_outputs([{"prompt": "a"}], 1, lambda p, c: 0.0), TypeError,
     "RequestOutputs"),
    ("parse-group-0", lambda: parse_vllm_outputs([], 0, lambda p, c: 0.0), ValueError, "group_size must be"),
    ("parse-group-float", lambda: parse_vllm_outputs([], 2.0, lambda p, c: 0.0), ValueError, "an int >= 1"),
    ("parse-reward-not-callable", lambda: parse_vllm_outputs([], 2, 1.0), TypeError, "must be callable"),
    ("parse-n1-mixed-prompts", lambda: parse_vllm_outputs([_output(p) for p in "ABC"], 3, lambda p, c: 0.0),
     ValueError, "never mix prompts"),
    ("parse-n1-interleaved-short", lambda: parse_vllm_outputs([_output(p) for p in "ABAB" + "A"], 2,
                                                              lambda p, c: 0.0), ValueError, "'A' has 3"),
    ("parse-n-vs-group", lambda: parse_vllm_outputs([_output("A", n=2)], 3, lambda p, c: 0.0), ValueError,
     "do not form groups of 3"),
    ("parse-metadata-count", lambda: parse_vllm_outputs([_output("A", n=2)], 2, lambda p, c, m: 0.0,
                                                        metadata=[1, 2]), ValueError, "metadata entries"),
    ("parse-no-logprobs", lambda: parse_vllm_outputs([_output("A", logprobs=False)], 1, lambda p, c: 0.0),
     ValueError, "logprobs=0"),
    ("parse-reward-raises", lambda: parse_vllm_outputs([_output("A")], 1, lambda p, c: 1 / 0), RuntimeError,
     "reward_fn raised ZeroDivisionError"),
    ("parse-reward-none", lambda: parse_vllm_outputs([_output("A")], 1, lambda p, c: None), TypeError,
     "finite float"),
    ("parse-reward-nan", lambda: parse_vllm_outputs([_output("A")], 1, lambda p, c: NAN), ValueError,
     "must be finite"),
    ("collate-empty", lambda: collate([]), ValueError, "no rollouts"),
    ("collate-batches", lambda: collate([RolloutBatch([_rollout()])]), TypeError, "flatten RolloutBatches"),
    ("pack-max-tokens-0", lambda: pack([_rollout()], 0), ValueError, "max_tokens must be >= 1"),
    ("pack-batches", lambda: pack([RolloutBatch([_rollout()])], 8), TypeError, "takes Rollouts"),
    ("split-parts-0", lambda: split_by_tokens([_rollout()], 0), ValueError, "parts must be >= 1"),
]

SYNC = [
    ("tolerance-negative", lambda: check_tolerance(-1e-3), ValueError, "finite number >= 0"),
    ("tolerance-nan", lambda: check_tolerance(NAN), ValueError, "finite number >= 0"),
    ("tolerance-string", lambda: check_tolerance("0.01"), ValueError, "finite number >= 0"),
    ("sync-nan-gap", lambda: check_sync(probe_gap([-1.0, NAN], [-1.0, -2.0]), False, tolerance=None,
                                        engine_dtype=torch.float32, where="vLLM", version=3), SyncError,
     "differ by inf"),
    ("probe-lengths", lambda: probe_gap([0.0], [0.5, 0.5, 0.5]), ValueError, "1 trainer log-probs and 3 engine"),
    ("sync-stuck", lambda: check_sync(0.0, True, tolerance=None, engine_dtype=torch.float32, where="vLLM",
                                      version=3), SyncError, "changed nothing"),
    ("trainer-max-grad-norm-negative", lambda: Trainer("/nonexistent/model", TrainerConfig(max_grad_norm=-1.0)),
     ValueError, "max_grad_norm must be > 0"),           # refused before the model is looked for
    ("trainer-max-grad-norm-0", lambda: Trainer("/nonexistent/model", TrainerConfig(max_grad_norm=0.0)),
     ValueError, "max_grad_norm must be > 0"),
    ("checkpointer-keep-0", lambda: Checkpointer("/tmp/none", keep=0), ValueError, "keep must be >= 1"),
    ("checkpoint-step-float", lambda: Checkpointer("/tmp/none").save(1.5, None, None), ValueError,
     "step must be an int >= 0"),
]


@pytest.mark.parametrize("call, err, phrase", [c[1:] for c in CORE + DATA + SYNC],
                         ids=[c[0] for c in CORE + DATA + SYNC])
def test_bad_input(call, err, phrase):
    with pytest.raises(err) as e:
        call()
    assert phrase in str(e.value), str(e.value)


def test_weight_manager_config_refuses_bad_tolerance():
    for bad in (-1.0, NAN, INF):
        with pytest.raises(ValueError, match="probe_tolerance must be a finite number"):
            WeightManagerConfig(probe_tolerance=bad)


def test_group_size_one_warns():
    with pytest.warns(UserWarning, match="every GRPO advantage is 0"):
        adv = compute_advantages([0.3, 0.9], 1)
    assert adv.tolist() == [0.0, 0.0]


def test_truncated_and_garbled_rollout_files(tmp_path):
    path = save_rollouts(tmp_path / "r.jsonl", [RolloutBatch([_rollout(), _rollout(reward=0.0)], uid="a")])
    lines = path.read_text().splitlines(keepends=True)
    (tmp_path / "cut.jsonl").write_text(lines[0])
    with pytest.raises(ValueError, match="has 1 of its 2 rollouts"):
        load_rollouts(tmp_path / "cut.jsonl")
    (tmp_path / "half.jsonl").write_text(lines[0] + lines[1][:20])
    with pytest.raises(ValueError, match="half.jsonl:2: not a rollout"):
        load_rollouts(tmp_path / "half.jsonl")
    (tmp_path / "nan.jsonl").write_text(lines[0].replace('"reward": 1.0', '"reward": NaN'))
    with pytest.raises(ValueError, match="nan.jsonl:1: .*NaN or inf"):
        load_rollouts(tmp_path / "nan.jsonl")
    with pytest.raises(TypeError, match="takes RolloutBatches"):
        save_rollouts(tmp_path / "x.jsonl", [RolloutBatch([_rollout()], uid="a"), [_rollout()]])
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.tmp").exists()   # the temp file too


def test_checkpoint_misuse(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.load(model, opt)
    path = ckpt.save(1, model, opt, state={"x": 1})
    with pytest.raises(CheckpointError, match="no checkpoint at .*step_1: no such directory"):
        ckpt.load(model, opt, path=tmp_path / "ck" / "step_1")             # a mistyped step
    with pytest.raises(CheckpointError, match="holds checkpoints .*step_00000001.* it is not one"):
        ckpt.load(model, opt, path=tmp_path / "ck")                         # the root, not a checkpoint
    with pytest.raises(CheckpointError, match="already exists"):
        ckpt.save(1, model, opt)
    with pytest.raises(CheckpointError, match="cannot checkpoint these objects"):
        ckpt.save(2, model, opt, objects={"f": math.sqrt})          # a function is not data
    (path / "MANIFEST.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="MANIFEST.json is corrupt"):
        verify(path)
    (path / "MANIFEST.json").write_text(json.dumps({"format": 2, "files": {"state.json": {"size": 1}}}))
    with pytest.raises(CheckpointError, match="wrong size"):
        verify(path)
    (path / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify(path)
