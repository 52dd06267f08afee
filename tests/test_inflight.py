"""Continuous generation and in-flight weight updates (minirl.generator.Generator.serve), rewards off
the engine loop (EpisodeRunner.reward) and the off-policy loss of the async loop (minirl.offpolicy).

Needs: CPU only; one tiny vLLM engine in this process (no Ray). About half a minute.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from minirl import vllm_compat as vc
from minirl.data import Rollout
from minirl.episodes import EpisodeConfig, EpisodeRunner
from minirl.generator import Generator
from minirl.hub import PromptItem
from minirl.offpolicy import decoupled_loss_fn, staleness_metrics

X = 7          # the token the "certain" weights always sample


@pytest.fixture(scope="module")
def gen(tiny_model):
    g = Generator(tiny_model, reward_fn=lambda p, c: 0.0, group_size=1,
                  sampling={"max_tokens": 48, "ignore_eos": True}, max_model_len=128, enforce_eager=True)
    yield g
    g.close()


def certain_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's weights changed so that token X is certain after any context, whatever the KV
    cache holds: attention and MLP outputs are zero (the last hidden state is the current token's
    embedding), every embedding is ones and X's ten times that; with tied embeddings X's logit is
    10 x 128 against 128 for any other token."""
    from safetensors.torch import load_file
    sd = load_file(f"{path}/model.safetensors")
    for name in sd:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = torch.zeros_like(sd[name])
    emb = torch.ones_like(sd["model.embed_tokens.weight"])
    emb[X] *= 10
    sd["model.embed_tokens.weight"], sd["model.norm.weight"] = emb, torch.ones_like(sd["model.norm.weight"])
    return list(sd.items())


def serve_in_thread(gen, items, target, got):
    stop = threading.Event()

    def lease(k):
        if not items:
            return None
        out = items[:k]
        del items[:k]
        return out
    t = threading.Thread(target=gen.serve, args=(lease, lambda b, f: got.append((b, f))),
                         kwargs={"target": target, "stop": stop}, daemon=True)
    t.start()
    return t


def test_long_request_spans_two_versions_after_an_in_flight_load(gen, tiny_model):
    """A 48-token request is running when weights of version 1 load between two engine steps: its
    tokens up to the load are the random model's (log-probs ~ -4), every token after it is X with
    log-prob 0 (the new weights, with the KV of the old ones kept), and the rollout says (0, 1). The
    load's probe ran as a request beside it and matches the engine's own log-probs afterwards."""
    got = []
    t = serve_in_thread(gen, [PromptItem(uid="long", prompt="1+2=")], 1, got)
    deadline = time.monotonic() + 60
    while gen.runner.stats["steps"] < 12 and time.monotonic() < deadline:
        time.sleep(0.002)
    out = gen.load_weights(1, [certain_weights(tiny_model)], probe_ids=[3, 4, 5, 6])
    t.join(60)
    assert not t.is_alive() and out["in_flight"] >= 1 and out["version"] == 1 and out["changed"]
    (batches, failures), = got
    r = batches[0][0]
    assert failures == [] and r.info["versions"] == (0, 1) and r.policy_version == 0
    ids, lps = r.completion_ids, r.sampling_logprobs
    m = next(i for i, lp in enumerate(lps) if lp > -1e-3)             # where the new weights took over
    assert 10 <= m < len(ids) - 5, (m, lps)
    assert all(lp < -0.5 for lp in lps[:m]) and all(lp > -1e-3 for lp in lps[m:]) and set(ids[m:]) == {X}
    assert out["probe_logprobs"] == pytest.approx(gen.prompt_logprobs([3, 4, 5, 6]), rel=1e-4)
    assert gen.stats["loads_in_flight"] >= 1


def test_continuous_serving_delivers_every_group_once_and_failures_by_uid(gen):
    """Six prompts, two in flight at a time: each group is delivered once, as it finishes (short ones
    leased after the long one overtake it), new prompts enter while it runs; a reward_fn error is
    that prompt's failure, naming it."""
    def reward(prompt, completion):
        if prompt == "bad":
            raise ValueError("no score")
        return 1.0

    async def episode(ep):
        turn = await ep.generate(max_tokens=60 if ep.uid == 0 else 2, ignore_eos=True)
        return await ep.runner.reward(reward, ep.prompt, turn.text)
    g, before = gen, (gen.episode, gen.group_size, dict(gen.runner.stats))
    g.episode, g.group_size = episode, 2
    try:
        items = [PromptItem(uid=i, prompt="bad" if i == 3 else f"{i}+1=") for i in range(6)]
        got = []
        serve_in_thread(g, items, 2, got).join(120)
        delivered = [b.uid for bs, _ in got for b in bs]
        failed = [f for _, fs in got for f in fs]
        assert sorted(delivered) == [0, 1, 2, 4, 5] and delivered[-1] == 0 and len(failed) == 1
        assert failed[0][0] == 3 and "ValueError: no score" in failed[0][1] and "prompt uid=3" in failed[0][1]
        v = g.policy_version
        assert all(len(b) == 2 and b[0].info["versions"] == (v, v) for bs, _ in got for b in bs)
        assert g.runner.stats["requests"] - before[2]["requests"] == 12
        assert 0 < g.runner.stats["busy_s"] - before[2]["busy_s"] < g.runner.stats["serve_s"] - before[2]["serve_s"]
    finally:
        g.episode, g.group_size = before[:2]


def test_a_session_starts_groups_while_other_threads_post_engine_calls():
    """feed() looks for an exclusive call in the mailbox before each group it starts, while other threads
    post engine calls there (load_weights, prompt_logprobs): a post landing during that look must not end
    the session. A stood-in generator and runner, thread switches forced every microsecond, 200 rounds
    of 50 prompts: all 10,000 groups start."""
    import collections
    import sys

    from minirl.generator import _Job, _Session
    g = object.__new__(Generator)
    g._mailbox, g._tasks, g._state, g.group_size, g.episode = collections.deque(), set(), threading.Lock(), 1, None
    started = []
    g.runner = SimpleNamespace(start_group=lambda *a, **k: started.append(k["uid"]), wake=lambda: None)
    s, done = _Session(g, None, None, 50, threading.Event()), threading.Event()

    def post():                           # as _in_engine posts (the oldest dropped: a short mailbox)
        while not done.is_set():
            with g._state:
                g._mailbox.append(_Job(None, None, False, set()))
                if len(g._mailbox) > 3:
                    g._mailbox.popleft()
    poster = threading.Thread(target=post, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        poster.start()
        for _ in range(200):
            s.inbox.extend(PromptItem(uid=len(started) + i, prompt="1+1=") for i in range(50))
            assert s.feed()
    finally:
        done.set()
        sys.setswitchinterval(interval)
        poster.join(10)
    assert started == list(range(10_000)) and not s.inbox


def test_an_engine_call_that_timed_out_before_it_ran_never_runs():
    """An engine call posted to a session that did not reach it within timeout_s is withdrawn: the
    TimeoutError says so and the session skips it (before, it ran later: a load_weights its caller was
    told had failed changed the weights after all). One already running is reported as such."""
    import collections
    g = object.__new__(Generator)
    g._mailbox, g._tasks, g._state, g._serving = collections.deque(), set(), threading.Lock(), True
    g._engine, g.runner, ran = threading.Lock(), SimpleNamespace(wake=lambda: None), []
    with pytest.raises(TimeoutError, match=r"waited 0.2 s .*\(withdrawn: it will not run\)"):
        g._in_engine(lambda: ran.append(1), timeout_s=0.2)
    g._between_steps()                          # the session reaches the mailbox at last
    assert ran == [] and not g._mailbox
    g.runner.requests_in_flight = 0
    release = threading.Event()
    threading.Timer(0.1, g._between_steps).start()      # the session takes it, and it outlasts its wait
    with pytest.raises(TimeoutError, match=r"\(it runs still and may finish\)"):
        g._in_engine(lambda: release.wait(5), timeout_s=0.3)
    release.set()


def test_a_withdrawn_exclusive_call_holds_back_no_group():
    """An exclusive engine call (evaluation) waits for running requests, new groups held back; once its
    caller withdrew it (timed out), groups start again and the calls behind it run, while requests run."""
    import collections

    from minirl.generator import _Session
    g = object.__new__(Generator)
    g._mailbox, g._tasks, g._state, g._serving = collections.deque(), set(), threading.Lock(), True
    g._engine, g.group_size, g.episode, started, ran = threading.Lock(), 1, None, [], []
    g.runner = SimpleNamespace(wake=lambda: None, requests_in_flight=3,
                               start_group=lambda *a, **k: started.append(k["uid"]))
    with pytest.raises(TimeoutError, match=r"\(withdrawn: it will not run\)"):
        g._in_engine(lambda: ran.append("exclusive"), exclusive=True, timeout_s=0.2)
    threading.Timer(0.1, g._between_steps).start()       # the session's next step, requests still running
    assert g._in_engine(lambda: ran.append("load") or 7, timeout_s=5) == 7
    s = _Session(g, None, None, 4, threading.Event())
    s.inbox.append(PromptItem(uid=0, prompt="1+1="))
    s.feed()
    assert ran == ["load"] and started == [0] and not g._mailbox


def test_slow_reward_does_not_block_generation(gen):
    """One episode's reward_fn sleeps 1.5 s (sync: in a worker thread) while the other episodes keep
    taking turns; an async reward and a reward past reward_timeout_s (named in the error) too."""
    stamps, window = [], {}

    def slow_reward(prompt, completion):
        window["start"] = time.monotonic()
        time.sleep(1.5)
        window["end"] = time.monotonic()
        return 1.0

    async def async_reward(prompt, completion):
        await asyncio.sleep(0.01)
        return 0.5

    async def episode(ep):
        if ep.prompt == "slow":
            turn = await ep.generate(max_tokens=1)
            return await ep.runner.reward(slow_reward, ep.prompt, turn.text)
        for _ in range(40):
            await ep.generate(max_tokens=2, ignore_eos=True)
            stamps.append(time.monotonic())
            await asyncio.sleep(0.02)
        return await ep.runner.reward(async_reward, ep.prompt, "")

    runner = EpisodeRunner(gen.llm, config=EpisodeConfig(max_turns=64))
    batches = runner.run(episode, ["slow", "1+1=", "2+1="])
    assert [b[0].reward for b in batches] == [1.0, 0.5, 0.5]
    during = [s for s in stamps if window["start"] < s < window["end"]]
    assert len(during) >= 10, (len(during), len(stamps))      # turns went on while the reward slept

    capped = EpisodeRunner(gen.llm, config=EpisodeConfig(max_turns=64, reward_timeout_s=0.2))
    with pytest.raises(RuntimeError, match=r"prompt uid=0 .*'slow'.*reward_fn did not return within 0.2 s"):
        capped.run(episode, ["slow"])


def test_decoupled_loss_hand_worked():
    """pi = (0.5, 0.2), sampler (0.25, 0.4), A = (1, -1): pi/sampler = (2, 0.5). TIS (cap 2) weights
    (2, 0.5); the PPO ratio against the proximal policy (pi itself) is 1, so the loss is -w*A =
    (-2, 0.5) and d loss / d log pi = (-2, 0.5). Cap 1.5: (1.5, 0.5). MIS [0.6, 1.8]: both dropped."""
    lp = torch.log(torch.tensor([0.5, 0.2])).requires_grad_()
    batch = SimpleNamespace(old_logprobs=torch.log(torch.tensor([0.25, 0.4])), advantages=torch.tensor([1.0, -1.0]))
    per_token, stats = decoupled_loss_fn("tis", entropy=False)(lp, batch, None)
    assert per_token.tolist() == pytest.approx([-2.0, 0.5])
    per_token.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-2.0, 0.5])
    assert stats["ratio"].tolist() == pytest.approx([2.0, 0.5]) and stats["clip_frac"].tolist() == [1.0, 1.0]
    capped, _ = decoupled_loss_fn("tis", cap=1.5, entropy=False)(lp, batch, None)
    assert capped.tolist() == pytest.approx([-1.5, 0.5])
    masked, stats = decoupled_loss_fn("mis", low=0.6, high=1.8, entropy=False)(lp, batch, None)
    assert masked.tolist() == [0.0, 0.0] and stats["is_weight"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="choose 'tis'"):
        decoupled_loss_fn("is")


def test_decoupled_loss_refuses_weights_that_flip_or_drop_every_token():
    """cap <= 0 gives weights <= 0 (the gradient flipped or gone), low > high masks every token: refused."""
    for kw, phrase in (({"cap": -1.0}, "cap must be > 0"), ({"cap": 0.0}, "cap must be > 0")):
        with pytest.raises(ValueError, match=phrase):
            decoupled_loss_fn("tis", **kw)
    with pytest.raises(ValueError, match="low <= high"):
        decoupled_loss_fn("mis", low=2.0, high=0.5)


def test_staleness_metrics_histogram_and_spans():
    def r(v, span):
        return Rollout(prompt_ids=[1], completion_ids=[2], sampling_logprobs=[0.0], reward=0.0, policy_version=v,
                       info={"versions": span})
    m = staleness_metrics([r(3, (3, 3)), r(2, (2, 3)), r(2, (2, 2)), r(0, (0, 1))], version=3, max_staleness=1)
    assert m["async/rollouts_spanning_versions"] == 2
    assert (m["async/staleness_0"], m["async/staleness_1"], m["async/staleness_over"]) == (1, 2, 1)
    assert m["async/staleness_max"] == 3 and m["async/staleness_mean"] == pytest.approx(5 / 4)


def test_checked_load_after_an_unchecked_one_reports_what_it_changed(gen, tiny_model):
    """A bootstrap load (no probe) then the trainer's checked push of the same weights: `changed` is
    False (measured from the weights the push found, not from the last checked load's)."""
    from safetensors.torch import load_file
    original = list(load_file(f"{tiny_model}/model.safetensors").items())
    before = gen.policy_version
    gen.load_weights(before + 1, [original])                                     # unchecked
    assert not gen.load_weights(before + 1, [original], probe_ids=[3, 4])["changed"]
    assert gen.load_weights(before + 2, [certain_weights(tiny_model)], probe_ids=[3, 4])["changed"]


def test_a_generator_says_which_weights_its_checksum_sees(gen, tiny_model):
    """On CPU the engine's checksum sees embeddings and norms only (vLLM repacks linear weights out of
    sight): a checked load names them, so the trainer compares its checksum of the same weights, and a
    load that changed linear weights alone is not mistaken for one that changed nothing."""
    from safetensors.torch import load_file
    sd = load_file(f"{tiny_model}/model.safetensors")
    out = gen.load_weights(gen.policy_version + 1, [list(sd.items())], probe_ids=[3, 4])
    seen = set(out["fingerprinted"])
    assert "model.embed_tokens.weight" in seen and "model.norm.weight" in seen
    assert not [n for n in seen if n.endswith("proj.weight")] and seen <= set(sd)
    sd["model.layers.0.mlp.down_proj.weight"] += 0.1                     # invisible to the checksum
    assert not gen.load_weights(gen.policy_version + 1, [list(sd.items())], probe_ids=[3, 4])["changed"]
    gen.load_weights(gen.policy_version + 1, [list(load_file(f"{tiny_model}/model.safetensors").items())])


def test_a_prompt_the_engine_refuses_fails_alone(gen):
    """Token ids out of the vocabulary: vLLM refuses the request when it enters; that prompt is a
    failure naming it, the others are delivered and the session goes on."""
    got = []
    items = [PromptItem(uid=u, prompt=p) for u, p in (("a", [5, 6]), ("bad", [5, 99999]), ("b", [7, 8]))]
    serve_in_thread(gen, items, 3, got).join(60)
    assert sorted(b.uid for bs, _ in got for b in bs) == ["a", "b"]
    (uid, cause), = [f for _, fs in got for f in fs]
    assert uid == "bad" and "prompt uid='bad'" in cause and "out of vocabulary" in cause


def test_a_tool_that_never_returns_does_not_hold_the_generator(gen):
    """The async side: an episode's sync tool never returns (until an event set 30 s later); at its
    0.5 s timeout the prompt is a failure naming ToolTimeout, the other prompt is delivered, serve()
    returns as soon as the lease runs dry, and the generator counts the abandoned thread."""
    release = threading.Event()
    threading.Timer(30.0, release.set).start()

    async def episode(ep):
        turn = await ep.generate(max_tokens=2)
        if ep.uid == "stuck":
            await ep.call(release.wait, timeout_s=0.5)
        return 1.0
    g, before = gen, (gen.episode, gen.runner.stats["abandoned_threads"])
    g.episode = episode
    got, t = [], time.perf_counter()
    try:
        serve_in_thread(g, [PromptItem(uid="stuck", prompt="1+1="), PromptItem(uid="ok", prompt="2+1=")], 2,
                        got).join(60)
        elapsed = time.perf_counter() - t
    finally:
        g.episode = before[0]
        release.set()
    assert elapsed < 5, f"serve() waited {elapsed:.1f} s for a stuck tool"
    assert [b.uid for bs, _ in got for b in bs] == ["ok"]
    (uid, cause), = [f for _, fs in got for f in fs]
    assert uid == "stuck" and "ToolTimeout" in cause and "'wait'" in cause
    assert g.runner.stats["abandoned_threads"] - before[1] == 1 and g.stats["abandoned_threads"] >= 1


def test_a_prompt_with_no_room_is_a_failure_not_an_empty_group(gen):
    """The async side: a prompt longer than max_model_len is delivered as that prompt's failure (the
    hub's on_failure decides), never as a group of empty completions; the others are delivered."""
    got = []
    items = [PromptItem(uid="a", prompt="1+1="), PromptItem(uid="long", prompt=[5] * 300)]
    serve_in_thread(gen, items, 2, got).join(60)
    assert [b.uid for bs, _ in got for b in bs] == ["a"]
    (uid, cause), = [f for _, fs in got for f in fs]
    assert uid == "long" and "PromptTooLong" in cause and "300 tokens" in cause


def test_a_failed_load_leaves_every_layer_it_did_not_finish_on_its_old_weights(gen, tiny_model):
    """A load vLLM cannot take (a weight of the wrong shape) and one whose buckets stop half-way through
    a layer both raise, and the engine goes on with its old weights there, its version unchanged; the
    next load works. Before, vLLM's layerwise reload left every layer after the failed one on the meta
    device (no request could run) and replayed the bad weight at every later load; a half-sent layer
    was processed with whatever its new storage held for the rest."""
    from safetensors.torch import load_file
    sd, probe = load_file(f"{tiny_model}/model.safetensors"), [3, 4, 5, 6]
    gen.load_weights(gen.policy_version + 1, [list(sd.items())])
    before, version = gen.prompt_logprobs(probe), gen.policy_version
    up = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(RuntimeError):
        gen.load_weights(version + 1, [list({**sd, up: sd[up].reshape(sd[up].shape[::-1])}.items())])
    assert gen.prompt_logprobs(probe) == pytest.approx(before, rel=1e-5) and gen.policy_version == version

    def half_a_layer():
        yield [("model.layers.0.mlp.gate_proj.weight", sd["model.layers.0.mlp.gate_proj.weight"] + 1)]
        raise ConnectionError("the trainer went away")
    with pytest.raises(ConnectionError):
        gen.load_weights(version + 1, half_a_layer())
    assert gen.prompt_logprobs(probe) == pytest.approx(before, rel=1e-5) and gen.policy_version == version
    out = gen.load_weights(version + 1, [list(sd.items())], probe_ids=probe)
    assert out["probe_logprobs"] == pytest.approx(before, rel=1e-5) and gen.policy_version == version + 1


def test_a_checked_load_after_a_failed_one_reports_what_it_changed(gen, tiny_model):
    """A load that fails after some layers took their new weights (here the embedding, then the
    sender goes away), then a checked load of those same weights: `changed` is False. Before, it was
    measured from the weights before the failed load and said True for a load that changed nothing."""
    from safetensors.torch import load_file
    sd = load_file(f"{tiny_model}/model.safetensors")
    gen.load_weights(gen.policy_version + 1, [list(sd.items())], probe_ids=[3, 4])
    sd["model.embed_tokens.weight"] += 0.1

    def embedding_then_gone():
        yield [("model.embed_tokens.weight", sd["model.embed_tokens.weight"])]
        raise ConnectionError("the trainer went away")
    with pytest.raises(ConnectionError):
        gen.load_weights(gen.policy_version + 1, embedding_then_gone(), probe_ids=[3, 4])
    assert not gen.load_weights(gen.policy_version + 1, [list(sd.items())], probe_ids=[3, 4])["changed"]
    gen.load_weights(gen.policy_version + 1, [list(load_file(f"{tiny_model}/model.safetensors").items())])
