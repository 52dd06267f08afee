"""The rollout data contract on real vLLM outputs (CPU build, tiny local model).

Needs: CPU only. Uses the session WeightManager (in-process fp32 engine) for real
`RequestOutput`s, and an independent HF model loaded from the same directory for the
trainer-side log-probs.
"""

import math

import pytest
import torch
from vllm import SamplingParams

from minirl import (Rollout, RolloutBatch, clipped_policy_loss, collate, get_logprobs,
                    load_rollouts, parse_vllm_outputs, save_rollouts)
from minirl.recipes.tasks import get_task

# vLLM (fp32, CPU) vs HF eager (fp32, CPU): different kernels (fused qkv, oneDNN GEMMs,
# paged attention) agree to ~1e-6 here; 1e-4 leaves room across machines.
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def outputs(wm, hf_model):
    task = get_task("succ")
    prompts, answers = task.sample(6, seed=1)
    llm = wm.as_vllm()
    outs = llm.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=5, logprobs=0,
                                                seed=3), use_tqdm=False)
    return outs, answers


@pytest.fixture(scope="module")
def hf_model(tiny_model, wm):
    """A plain HF model (no FSDP) holding exactly the weights the engine generated with."""
    from transformers import AutoModelForCausalLM
    from minirl.weights import full_weight_buckets
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    wm.as_vllm()                         # engine == trainer (syncs if an earlier test trained)
    state = {n: t.clone() for bucket in full_weight_buckets(wm.model) for n, t in bucket}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}       # tied to the embedding
    return model


def test_parse_real_outputs(outputs, wm):
    outs, answers = outputs
    batches = parse_vllm_outputs(outs, 4, get_task("succ").reward, metadata=answers, policy_version=7)
    assert len(batches) == 6 and all(len(b) == 4 for b in batches)
    for i, (b, o) in enumerate(zip(batches, outs)):
        assert b.uid == i
        for r, c in zip(b, o.outputs):
            assert r.prompt_ids == list(o.prompt_token_ids)
            assert r.completion_ids == list(c.token_ids)
            assert len(r.sampling_logprobs) == len(r.completion_ids)
            assert r.finish_reason == c.finish_reason
            assert r.policy_version == 7 and r.device == "cpu"     # the version passed; tensors on the CPU
            assert r.reward == (1.0 if c.text.startswith(answers[i]) else 0.0)
            assert r.token_ids.shape == (1, len(r.prompt_ids) + len(r.completion_ids))
            assert r.old_logprobs.shape == (1, len(r.completion_ids))
            assert math.isclose(sum(r.sampling_logprobs), c.cumulative_logprob, rel_tol=1e-5)


def test_trainer_logprobs_match_vllm_sampling_logprobs(outputs, hf_model):
    """The first guard against the vLLM/trainer mismatch: same weights, same numbers."""
    outs, answers = outputs
    batches = parse_vllm_outputs(outs, 4, get_task("succ").reward, metadata=answers)
    worst = 0.0
    for r in (r for b in batches for r in b):
        with torch.no_grad():
            lp = get_logprobs(hf_model(r.token_ids).logits, r.token_ids)      # (1, P+C-1)
        completion_lp = lp[:, len(r.prompt_ids) - 1:]                         # the last C
        worst = max(worst, (completion_lp - r.old_logprobs).abs().max().item())
    assert worst < FP32_TOL, worst


def test_seed_loss_scores_exactly_the_completion(outputs, hf_model):
    outs, answers = outputs
    r = parse_vllm_outputs(outs, 4, get_task("succ").reward, metadata=answers)[0][0]
    r.advantage = 0.7
    out = hf_model(r.token_ids, output_hidden_states=True)
    lp = get_logprobs(out.logits, r.token_ids)
    loss = clipped_policy_loss(lp, r.old_logprobs, r.advantage)
    # On-policy (ratio == 1): loss = -mean_j(A * 1) = -A, with gradient only on completion rows.
    assert loss.item() == pytest.approx(-0.7, abs=1e-4)
    (g,) = torch.autograd.grad(loss, lp)
    P = len(r.prompt_ids)
    assert torch.all(g[:, :P - 1] == 0) and torch.all(g[:, P - 1:] != 0)


def test_group_shapes_and_errors(outputs):
    outs, answers = outputs
    reward = get_task("succ").reward
    with pytest.raises(ValueError, match="groups of 3"):
        parse_vllm_outputs(outs, 3, reward, metadata=answers)
    with pytest.raises(ValueError, match="metadata"):
        parse_vllm_outputs(outs, 4, reward, metadata=answers[:2])


@pytest.mark.parametrize("bad, err, msg", [
    (lambda p, c: float("nan"), ValueError, "finite"),
    (lambda p, c: float("inf"), ValueError, "finite"),
    (lambda p, c: None, TypeError, "finite float"),
    (lambda p, c: "1.0", TypeError, "finite float"),
    (lambda p, c: True, TypeError, "finite float"),
    (lambda p, c: 1 / 0, RuntimeError, "ZeroDivisionError"),
])
def test_bad_reward_fn_names_the_prompt(outputs, bad, err, msg):
    outs, _ = outputs
    with pytest.raises(err, match=msg) as e:
        parse_vllm_outputs(outs, 4, bad)
    assert repr(outs[0].prompt) in str(e.value)


def test_reward_fn_accepts_numpy_and_tensor(outputs):
    import numpy as np
    outs, _ = outputs
    b = parse_vllm_outputs(outs, 4, lambda p, c: np.float32(0.5))
    assert b[0][0].reward == 0.5
    b = parse_vllm_outputs(outs, 4, lambda p, c: torch.tensor(2.0))
    assert b[0][0].reward == 2.0


def test_missing_logprobs_is_a_clear_error(wm):
    llm = wm.as_vllm()
    outs = llm.generate(["1+1="], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logprobs=0"):
        parse_vllm_outputs(outs, 2, lambda p, c: 0.0)


def test_n1_repeated_prompts_group(wm):
    llm = wm.as_vllm()
    outs = llm.generate(["1+1="] * 3 + ["2+1="] * 3,
                        SamplingParams(max_tokens=2, logprobs=0), use_tqdm=False)
    batches = parse_vllm_outputs(outs, 3, lambda p, c: 1.0, uids=["a", "b"])
    assert [b.uid for b in batches] == ["a", "b"]
    assert all(r.prompt == "1+1=" for r in batches[0])
    # Interleaved n=1 outputs (A B A B A B) group by prompt, never by position.
    mixed = [outs[i] for i in (0, 3, 1, 4, 2, 5)]
    batches = parse_vllm_outputs(mixed, 3, lambda p, c: 1.0, uids=["a", "b"])
    assert [[r.prompt for r in b] for b in batches] == [["1+1="] * 3, ["2+1="] * 3]
    # A B A is not a group of three; a prompt short of its group is refused.
    with pytest.raises(ValueError, match=r"'1\+1=' has 2 n=1 completions.*group_size=3"):
        parse_vllm_outputs([outs[0], outs[3], outs[1]], 3, lambda p, c: 1.0)
    with pytest.raises(ValueError, match="never mix prompts"):
        parse_vllm_outputs(outs[:4] + outs[5:], 2, lambda p, c: 1.0)


def test_collate_aligns_with_get_logprobs(outputs, hf_model):
    outs, answers = outputs
    rollouts = [r for b in parse_vllm_outputs(outs, 4, get_task("succ").reward, metadata=answers)
                for r in b.compute_advantages()]
    batch = collate(rollouts)
    B, T = batch.input_ids.shape
    assert batch.old_logprobs.shape == batch.loss_mask.shape == (B, T - 1)
    assert batch.num_tokens == sum(len(r.completion_ids) for r in rollouts)
    with torch.no_grad():
        lp = get_logprobs(hf_model(batch.input_ids, attention_mask=batch.attention_mask).logits,
                          batch.input_ids)
    # Right padding leaves real positions untouched: batched log-probs == sampling log-probs.
    diff = ((lp - batch.old_logprobs).abs() * batch.loss_mask).max().item()
    assert diff < FP32_TOL
    # And the batched loss equals the token-weighted mean of per-rollout losses.
    per = [clipped_policy_loss(lp[i:i + 1], batch.old_logprobs[i:i + 1], batch.advantages[i],
                               mask=batch.loss_mask[i:i + 1]) * batch.loss_mask[i].sum()
           for i in range(B)]
    full = clipped_policy_loss(lp, batch.old_logprobs, batch.advantages, mask=batch.loss_mask)
    assert full.item() == pytest.approx((sum(per) / batch.num_tokens).item(), abs=1e-6)


def test_save_load_roundtrip_exact(outputs, tmp_path):
    outs, answers = outputs
    uids = list("abcde") + [("gsm8k", (3, "a"))]             # a tuple uid comes back a tuple (JSON: a list)
    batches = parse_vllm_outputs(outs, 4, get_task("succ").reward, metadata=answers, uids=uids)
    for b in batches:
        b.compute_advantages()
    path = save_rollouts(tmp_path / "r.jsonl", batches)
    back = load_rollouts(path)
    assert [b.uid for b in back] == uids and back[5][0].uid == ("gsm8k", (3, "a"))
    for b0, b1 in zip(batches, back):
        for r0, r1 in zip(b0, b1):
            assert r0 == r1                                  # every field, floats bit-exact
            assert torch.equal(r0.old_logprobs, r1.old_logprobs)
    (tmp_path / "bad.jsonl").write_text('{"batch": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_rollouts(tmp_path / "bad.jsonl")
    lines = path.read_text().splitlines(keepends=True)       # lost its last line at a line boundary
    (tmp_path / "cut.jsonl").write_text("".join(lines[:-1]))
    with pytest.raises(ValueError, match="batch 5 .* has 3 of its 4 rollouts"):
        load_rollouts(tmp_path / "cut.jsonl")


def test_rollout_validation():
    with pytest.raises(ValueError, match="sampling log-probs"):
        Rollout(prompt_ids=[1], completion_ids=[2, 3], sampling_logprobs=[-1.0], reward=0.0)
    with pytest.raises(ValueError, match="loss_mask"):
        Rollout(prompt_ids=[1], completion_ids=[2], sampling_logprobs=[-1.0], reward=0.0, loss_mask=[1, 1])
    with pytest.raises(ValueError, match="empty prompt"):
        Rollout(prompt_ids=[], completion_ids=[2], sampling_logprobs=[-1.0], reward=0.0)


def test_batch_advantages_and_masks():
    rs = [Rollout(prompt_ids=[1, 2], completion_ids=[3, 4], sampling_logprobs=[-1.0, -2.0],
                  reward=r, loss_mask=[1, 0]) for r in (1.0, 0.0, 0.0, 1.0)]
    b = RolloutBatch(rs).compute_advantages()
    assert [r.advantage for r in b] == [0.5, -0.5, -0.5, 0.5]     # r - mean(0.5)
    batch = collate(rs)
    # prompt P=2 -> completion log-probs sit at entries 1, 2 of the (T-1)=3 positions
    assert batch.loss_mask.tolist() == [[0, 1, 0]] * 4
    assert batch.old_logprobs.tolist() == [[0, -1.0, -2.0]] * 4


def test_tokenizer_decodes_only_the_completions_without_text():
    """With a tokenizer, an empty-text completion (say EOS at once) is decoded; the engine's text of
    the others (cut at a stop string) is kept, not replaced by the decode of all their tokens."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    class Tok:
        def batch_decode(self, seqs, skip_special_tokens=True):
            return [" ".join(map(str, s)) for s in seqs]
    comps = [CompletionOutput(index=i, text=text, token_ids=ids, cumulative_logprob=-0.1,
                              logprobs=[{t: Logprob(-0.1)} for t in ids], finish_reason="stop")
             for i, (text, ids) in enumerate((("42", [7, 8, 9]), ("", [2])))]    # "42", then the stop string
    out = RequestOutput(request_id="0", prompt="q", prompt_token_ids=[1], prompt_logprobs=None,
                        outputs=comps, finished=True)
    seen = []
    [batch] = parse_vllm_outputs([out], 2, lambda p, c: seen.append(c) or 0.0, tokenizer=Tok())
    assert seen == ["42", "2"] and [r.completion for r in batch] == ["42", "2"]
