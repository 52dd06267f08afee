"""Episodes: multi-turn, tool-using generation, token in / token out, on one continuously batched
vLLM engine. Single-turn generation is the one-turn episode of the same path. Hardware: CPU or GPU.
The README's "Episodes" section is the guide (context, chat rendering, the Rollout, endings).

    async def episode(ep):                      # ep.prompt / ep.metadata / ep.uid: the task
        turn = await ep.generate()              # the engine consumes ep.token_ids, samples a turn
        obs = await ep.call(my_tool, turn.text) # a tool call with a timeout (sync: in a thread)
        ep.add_messages([{"role": "tool", "content": obs}])   # or ep.append(token_ids)
        return 1.0 if ... else 0.0              # the final reward (ep.turn_rewards: per turn)

    batches = run_episodes(llm, episode, prompts, group_size=8, metadata=answers)   # RolloutBatches

`EpisodeRunner` owns an engine and steps it in an asyncio loop that turns between steps whenever an
episode may run: `run()` starts every episode at once; `serve(feed)` is the long-lived form (the
async generators'), feed() starting new groups and `between_steps` loading weights between steps.
Tests: tests/test_episodes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from typing import Any, Awaitable, Callable, Sequence

import torch

from minirl.chat import chat_delta, turn_end
from minirl.data import Rollout, RolloutBatch, _check_reward, check_per_prompt
from minirl.faults import bounded, in_thread


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    max_turns: int = 8
    """generate() calls per episode at most; one more ends the episode with "max_turns"."""
    tool_timeout_s: float = 30.0
    """Default timeout of one ep.call(...); a timeout raises ToolTimeout inside the episode."""
    episode_timeout_s: float = 600.0
    """Wall-clock limit of one episode (generation included); past it the episode is an error."""
    on_error: str = "raise"
    """"raise": an episode error stops the run naming the episode and task; "record": kept with
    error_reward, finish_reason "error" and info["error"]."""
    error_reward: float = 0.0
    limit_reward: float = 0.0
    """Reward of an episode ended by max_turns / max_model_len ."""
    reward_timeout_s: float | None = None
    """Limit of one reward call (EpisodeRunner.reward, single_turn's reward_fn); past it the episode
    fails with TimeoutError naming reward_fn (None: no limit)."""
    reward_workers: int = 32
    """Threads that run sync reward functions beside the engine loop."""
    admit_wait_steps: int = 0
    """Engine steps a new turn's request may wait so that others enter with it (fewer mixed
    prefill steps, which cannot replay decode-only CUDA graphs); 0, or nothing else runs: at once."""
    gc_threshold: int | None = 50_000
    """Python's collector threshold (youngest generation) while a session runs, restored after:
    full scans of every live object come that much less often. None leaves the collector as it is."""

    def __post_init__(self):
        if self.on_error not in ("raise", "record"):
            raise ValueError(f"EpisodeConfig(on_error={self.on_error!r}): choose 'raise' or 'record'")


def _is_async(fn) -> bool:
    """An async function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _check_no_stop(sampling: dict) -> None:
    """ValueError for stop strings: turns are sampled as token ids, which vLLM cannot match them in."""
    if sampling.get("stop"):
        raise ValueError(f"sampling stop={sampling['stop']!r}: episodes sample token ids without detokenizing "
                         "(detokenize=False), so vLLM cannot match stop strings: end turns with stop_token_ids "
                         "(the strings' token ids) or check turn.text in the episode")


def check_group_size(group_size) -> None:
    """ValueError unless group_size is an int >= 1 (episodes per prompt)."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}: episodes per prompt, an int >= 1 (GRPO compares "
                         "completions within a group: 2 or more, e.g. 8)")


class ToolTimeout(TimeoutError):
    """An ep.call(...) ran past its timeout."""


class PromptTooLong(ValueError):
    """An episode's context leaves no room for its first turn (max_model_len): its prompt cannot be
    generated for. Its group fails, whatever on_error says: never trained as empty completions."""


class EpisodeEnd(Exception):
    """Raised by ep.generate() when the episode may not generate again (turn limit, context full)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Turn:
    """One sampled turn: token ids exactly as the engine produced them, their log-probs."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None        # vLLM's: "stop", "length"
    versions: tuple[int, int]        # policy version at submission and at the step it finished
    text: str = ""


class Episode:
    """The token context of one episode and its verbs; made by EpisodeRunner, used by episode code."""

    def __init__(self, runner: "EpisodeRunner", prompt, metadata, uid, index: int, prompt_ids: list[int],
                 seed: int | None):
        self.runner, self.prompt, self.metadata, self.uid, self.index = runner, prompt, metadata, uid, index
        self.token_ids: list[int] = list(prompt_ids)     # everything the engine will consume
        self.loss_mask: list[int] = [0] * len(prompt_ids)
        self.logprobs: list[float] = [0.0] * len(prompt_ids)
        self.turns: list[Turn] = []
        self.turn_rewards: list[float] = []
        self.info: dict = {}
        self._seed = seed

    @property
    def name(self) -> str:
        return f"episode {self.index} of prompt uid={self.uid!r} ({str(self.prompt)[:60]!r})"

    async def generate(self, **sampling) -> Turn:
        """Sample one turn from the whole context (SamplingParams kwargs override the runner's but
        logprobs/detokenize/n; max_tokens and min_tokens are cut to the room left). Raises PromptTooLong
        when the first turn has no room, EpisodeEnd at the turn limit or with no room left for a later
        turn (the runner ends the episode there with that finish reason)."""
        r = self.runner
        if len(self.turns) >= r.config.max_turns:
            raise EpisodeEnd("max_turns")
        room = r.max_model_len - len(self.token_ids)
        if room < 1 and not self.turns:
            raise PromptTooLong(f"{self.name} is {len(self.token_ids)} tokens before its first turn; the engine "
                                f"holds {r.max_model_len} (max_model_len) and needs room for a sampled token: "
                                "shorten the prompt or raise max_model_len")
        if room < 1:
            raise EpisodeEnd("max_model_len")
        _check_no_stop(sampling)
        kw = {**r.sampling, **sampling, "logprobs": 0, "detokenize": False, "n": 1}   # what a Turn needs
        kw["max_tokens"] = min(kw.get("max_tokens") or room, room)
        if (kw.get("min_tokens") or 0) > room:
            kw["min_tokens"] = room                        # vLLM refuses min_tokens > max_tokens
        if self._seed is not None and "seed" not in sampling:
            kw["seed"] = self._seed + 7919 * len(self.turns)
        v0 = r.policy_version
        r._generating += 1
        try:
            ids, lps, reason, v1 = await r.submit(self.token_ids, kw)
        finally:
            r._generating -= 1
        turn = Turn(ids, lps, reason, (v0, v1), r.tokenizer.decode(ids, skip_special_tokens=True))
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += lps
        self.turns.append(turn)
        return turn

    def append(self, token_ids: Sequence[int]) -> None:
        """Append environment / tool / template tokens (loss_mask 0): the engine consumes them next turn."""
        ids = [int(t) for t in token_ids]
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_text(self, text: str) -> list[int]:
        """Tokenize text alone (no special tokens) and append it; returns the ids."""
        ids = self.runner.tokenizer.encode(text, add_special_tokens=False)
        self.append(ids)
        return ids

    def add_messages(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Render only these new chat messages (minirl.chat.chat_delta) and append them; if the context
        ends with a sampled turn that did not end with the template's turn end (cut by max_tokens, or
        another stop token), that token comes first."""
        tok = self.runner.tokenizer
        ids = chat_delta(tok, messages, add_generation_prompt=add_generation_prompt)
        end = tok.convert_tokens_to_ids(e) if (e := turn_end(tok)) else None
        if self.loss_mask[-1] and end is not None and self.token_ids[-1] != end:
            ids = [end] + ids
        self.append(ids)
        return ids

    async def call(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs):
        """Run a tool: an async function awaited, a sync one in a daemon thread of its own, either with
        a timeout (default EpisodeConfig.tool_timeout_s); raises ToolTimeout naming the tool and this
        episode. A sync tool still running then is abandoned (runner.stats["abandoned_threads"]).
        info["tool_calls"], ["tool_s"] and ["tool_timeouts"] add up this episode's calls."""
        timeout = self.runner.config.tool_timeout_s if timeout_s is None else timeout_s
        sync, limit = not _is_async(fn), asyncio.timeout(timeout)
        t0 = time.perf_counter()
        try:
            async with limit:
                return await (in_thread(fn, *args, **kwargs) if sync else fn(*args, **kwargs))
        except TimeoutError as e:
            if not limit.expired():                      # the tool's own (a socket's, say): as it is
                raise
            self.info["tool_timeouts"] = self.info.get("tool_timeouts", 0) + 1
            self.runner.stats["abandoned_threads"] += sync
            raise ToolTimeout(f"tool {getattr(fn, '__name__', fn)!r} ran past {timeout} s in {self.name}") from e
        finally:
            self.info["tool_calls"] = self.info.get("tool_calls", 0) + 1
            self.info["tool_s"] = self.info.get("tool_s", 0.0) + time.perf_counter() - t0

    @property
    def text(self) -> str:
        """The sampled turns' text, joined."""
        return "".join(t.text for t in self.turns)

    def to_rollout(self, reward: float, finish_reason: str, device: str = "cpu") -> Rollout:
        """The Rollout: prompt = the context before the first sampled token, completion = the rest up
        to the last sampled token; loss_mask 1 exactly on sampled tokens, log-probs aligned."""
        mask, n = self.loss_mask, len(self.token_ids)
        sampled = bool(self.turns) and 1 in mask
        first = mask.index(1) if sampled else n
        last = n - mask[::-1].index(1) if sampled else n     # one past the last sampled token
        first = max(1, min(first, last))          # a causal LM needs >= 1 prompt token
        versions = [t.versions for t in self.turns]
        span = (min((v[0] for v in versions), default=self.runner.policy_version),
                max((v[1] for v in versions), default=self.runner.policy_version))
        return Rollout(
            prompt_ids=self.token_ids[:first], completion_ids=self.token_ids[first:last],
            sampling_logprobs=self.logprobs[first:last], loss_mask=self.loss_mask[first:last],
            reward=reward, finish_reason=finish_reason,
            policy_version=span[0],
            prompt=self.prompt if isinstance(self.prompt, str) else None,
            completion=self.text, uid=self.uid, device=device,
            info={"turns": len(self.turns), "turn_versions": versions, "versions": span,
                  "turn_rewards": list(self.turn_rewards),
                  "turn_finish": [t.finish_reason for t in self.turns], **self.info})


EpisodeFn = Callable[[Episode], Awaitable[float]]
_QUIET_S = 0.1      # the longest the engine loop steps without letting the event loop turn


def single_turn(reward_fn: Callable) -> EpisodeFn:
    """The one-turn episode: generate once, score with reward_fn(prompt, completion[, metadata])
    (minirl's reward_fn contract; sync or async def) off the engine loop (EpisodeRunner.reward)."""
    async def episode(ep: Episode) -> float:
        turn = await ep.generate()
        args = (ep.prompt, turn.text) if ep.metadata is None else (ep.prompt, turn.text, ep.metadata)
        return await ep.runner.reward(reward_fn, *args)
    episode.reward_fn = reward_fn                       # what its rewards' errors name
    return episode


def _explain_generation_oom(e: torch.OutOfMemoryError) -> MemoryError:
    """torch's out-of-memory error in an engine step as a MemoryError that says what the device had
    and which levers leave the step more room."""
    m = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(e))
    asked = f" asking for {m.group(1)} more" if m else ""
    have = ""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        idle = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        have = (f": {free / 2**30:.2f} of {total / 2**30:.1f} GiB free, {idle / 2**30:.2f} GiB reserved by "
                "PyTorch's allocator but unallocated")
    return MemoryError(
        f"generation ran out of device memory in an engine step{asked}"
        f"{have}. The engine's KV cache and what shares the device (a co-located trainer's weights and AdamW state) "
        "leave too little for the step's working memory. Levers: a smaller KV cache (WeightManagerConfig.kv_cache_gib, "
        "launch --kv-cache-gib, or the engine's kv_cache_memory_bytes / gpu_memory_utilization), fewer sequences "
        "at once (the engine's max_num_seqs; launch: --prompts x --group-size), a shorter max_model_len, or LoRA "
        "/ cpu_offload for the trainer.")


class EpisodeRunner:
    """Runs many episodes at once on one vLLM engine (continuous batching). `llm`: a vllm.LLM
    (minirl's ManagedLLM or plain); `sampling`: SamplingParams kwargs for every turn (logprobs 0
    forced, detokenize off: turns are decoded once by the tokenizer)."""

    def __init__(self, llm, *, sampling: dict | None = None, config: EpisodeConfig = EpisodeConfig(),
                 tokenizer=None):
        from minirl import vllm_compat as vc
        self.vc, self.llm, self.config = vc, llm, config
        self.sampling = {"temperature": 1.0, **(sampling or {}), "logprobs": 0, "detokenize": False, "n": 1}
        _check_no_stop(self.sampling)
        if self.sampling.get("seed") is not None:
            raise ValueError(f"sampling seed={self.sampling['seed']!r}: one seed for every episode samples a group's "
                             "completions alike (zero advantages): pass run(seed=...) (Generator: seed=), which "
                             "seeds each episode apart, or ep.generate(seed=...) for one turn")
        self.tokenizer = tokenizer or llm.get_tokenizer()   # its chat template renders messages
        self.max_model_len = vc.max_model_len(llm)
        self.policy_version = 0        # set by the owner when it loads weights (between steps)
        self.stats = {"steps": 0, "requests": 0, "admissions": 0, "episodes": 0, "errors": 0, "limits": 0, "yields": 0,
                      "abandoned_threads": 0, "busy_s": 0.0, "idle_s": 0.0, "serve_s": 0.0}   # in steps/idle/sessions
        self._ids = count()
        self._futures: dict[str, asyncio.Future] = {}   # requests in flight: those not _held are in the engine
        self._held: dict[str, tuple] = {}          # requests waiting to enter (admit_wait_steps)
        self._held_steps = 0
        self._work: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups: set[asyncio.Task] = set()     # a session's groups in flight
        self._failed: BaseException | None = None    # a done() callback raised: the session ends
        self._pool = None                            # reward threads (made on first use)
        self._live = self._generating = 0            # episodes running / of them waiting on a turn
        self.between_steps: Callable[[], None] | None = None   # e.g. an in-flight weight load

    def prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt: ids as given, a str as vLLM tokenizes it, chat messages by the template."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(list(prompt), tokenize=True, add_generation_prompt=True,
                                                      return_dict=False)
        return [int(t) for t in prompt]

    async def submit(self, token_ids: list[int], sampling: dict) -> tuple[list[int], list[float], str, int]:
        """One turn's request; resolves to (sampled ids, their log-probs, finish reason, the policy
        version at the step it finished) when it finishes."""
        out, version = await self.request(token_ids, self.vc.request_params(**sampling))
        c = out.outputs[0]
        return list(c.token_ids), self.vc.take_logprobs(self.llm, out), c.finish_reason, version

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token t | <t), t >= 1, of a token prompt on the engine's current weights, as one request
        among the running ones (vllm_compat.prompt_logprobs' numbers, without stepping anyone else)."""
        out, _ = await self.request(list(token_ids), self.vc.prompt_logprob_params())
        return self.vc.read_prompt_logprobs(out, token_ids)

    @property
    def requests_in_flight(self) -> int:
        return len(self._futures)

    async def request(self, token_ids: list[int], params) -> tuple[Any, int]:
        """One engine request (SamplingParams as given); resolves to (its final RequestOutput, the policy
        version at the step it finished)."""
        rid = str(next(self._ids))
        fut = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        self._held[rid] = (list(token_ids), params)
        self.stats["requests"] += 1
        self._work.set()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():           # finished, then cancelled before it was taken:
                self.vc.abort_requests(self.llm, [rid])      # what the tap read for it goes
            raise
        finally:
            if self._futures.pop(rid, None) is not None:     # cancelled (episode timeout): free the engine
                if self._held.pop(rid, None) is None:
                    self.vc.abort_requests(self.llm, [rid])

    def _admit(self) -> None:
        """Held requests enter the engine: all at once, after admit_wait_steps or when nothing runs."""
        if not self._held:
            return
        if len(self._futures) > len(self._held) and self._held_steps < self.config.admit_wait_steps:
            self._held_steps += 1
            return
        for rid, (ids, params) in self._held.items():
            try:
                self.vc.add_request(self.llm, rid, ids, params)
            except Exception as e:                   # this request only (ids vLLM refuses): its episode fails
                if (fut := self._futures.pop(rid, None)) is not None and not fut.done():
                    fut.set_exception(e)
        self.stats["admissions"] += 1
        self._held.clear()
        self._held_steps = 0

    def _step(self) -> int:
        """One engine step (new requests enter first); returns how many requests it finished."""
        self._admit()
        try:
            finished = [out for out in self.vc.engine_step(self.llm) if out.finished]
        except torch.OutOfMemoryError as e:
            raise _explain_generation_oom(e) from e
        for out in finished:
            fut = self._futures.pop(out.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result((out, self.policy_version))   # stamped before any load between steps
            else:                                            # cancelled as it finished: no one takes
                self.vc.abort_requests(self.llm, [out.request_id])   # it, so what the tap read goes
        self.stats["steps"] += 1
        return len(finished)

    def _quiet(self, since: float) -> bool:
        """Only the engine can wake anyone now: every running episode waits on a turn, and the event
        loop has no ready callback nor a due timer; then its turn between two steps is skipped, for at
        most _QUIET_S. An event loop without these attributes turns every step."""
        loop = self._loop
        ready, timers = getattr(loop, "_ready", None), getattr(loop, "_scheduled", None)
        if ready is None or timers is None or ready or self._generating < self._live:
            return False
        return (not timers or timers[0].when() > loop.time()) and time.perf_counter() - since < _QUIET_S

    def run(self, episode: EpisodeFn, prompts: Sequence, *, group_size: int = 1, metadata: Sequence | None = None,
            uids: Sequence | None = None, seed: int | None = None, device: str = "cpu") -> list[RolloutBatch]:
        """group_size episodes per prompt, all at once; one RolloutBatch per prompt, in order.
        seed: episode k's turns sample with seeds derived from seed + k (reproducible runs)."""
        check_per_prompt(len(prompts), metadata=metadata, uids=uids)
        check = getattr(self.llm, "_minirl_check", None)
        if check is not None:
            check()                                    # e.g. WeightManager: the engine is awake
        out: list = [None] * len(prompts)

        def done(i, batch):
            if isinstance(batch, BaseException):
                raise batch                            # on_error="raise": the first episode error ends the run
            out[i] = batch

        todo = list(enumerate(prompts))

        def feed() -> bool:                            # every group at the first call, then none
            while todo:
                i, p = todo.pop(0)
                self.start_group(episode, p, group_size=group_size, device=device,
                                 metadata=None if metadata is None else metadata[i],
                                 uid=i if uids is None else uids[i], index=i * group_size,
                                 seed=None if seed is None else seed + i * group_size,
                                 done=lambda b, i=i: done(i, b))
            return False
        asyncio.run(self._serve(feed, idle_s=1.0))
        return out

    # -- a session: groups enter while others run (serve), weight loads between steps -----------

    def serve(self, feed: Callable[[], bool], *, idle_s: float = 0.05) -> None:
        """Run a session in this thread. Before each engine step (and every idle_s, or at wake(), while
        nothing runs) feed() may start groups (start_group); it returns False once no more will come,
        and serve returns when no group is left. If feed() or a group's done() raises, the session
        ends (episodes cancelled, requests aborted) with that error. `between_steps()` runs after
        every step and idle turn."""
        asyncio.run(self._serve(feed, idle_s))

    def wake(self) -> None:
        """From another thread: a session waiting for work runs feed() and between_steps() now."""
        loop, work = self._loop, self._work
        if loop is not None and work is not None:
            loop.call_soon_threadsafe(work.set)

    def start_group(self, episode: EpisodeFn, prompt, *, group_size: int = 1, metadata=None, uid=None,
                    seed: int | None = None, index: int = 0, device: str = "cpu",
                    done: Callable[[Any], None]) -> None:
        """Start group_size episodes of one prompt in the running session (from feed(), in its thread);
        done(RolloutBatch, or the first episode error of the group) once all of them ended.
        Episode g samples with seed + g (None: unseeded) and is named by index + g."""
        check_group_size(group_size)
        ids = self.prompt_ids(prompt)
        eps = [Episode(self, prompt, metadata, uid, index + g, ids, None if seed is None else seed + g)
               for g in range(group_size)]
        task = asyncio.ensure_future(self._group(episode, eps, device, done))
        self._groups.add(task)
        task.add_done_callback(self._groups.discard)

    async def _group(self, episode: EpisodeFn, eps: list[Episode], device: str, done) -> None:
        tasks = [asyncio.ensure_future(self._one(episode, ep, device)) for ep in eps]
        try:
            result = RolloutBatch(list(await asyncio.gather(*tasks)), uid=eps[0].uid)
        except Exception as e:                         # the group's first error; the others stop
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)   # their requests leave the engine
            result = e
        try:
            done(result)
        except BaseException as e:
            self._failed = self._failed or e
        self._groups.discard(asyncio.current_task())   # before the wake-up: a session woken first would
        self._work.set()                               # see this group and wait out idle_s for nothing

    async def _serve(self, feed: Callable[[], bool], idle_s: float) -> None:
        self._loop, self._work, self._failed = asyncio.get_running_loop(), asyncio.Event(), None
        t_start = turned = time.perf_counter()
        self._live = self._generating = 0
        thresholds = gc.get_threshold()
        if self.config.gc_threshold is not None:
            gc.set_threshold(max(self.config.gc_threshold, thresholds[0]), *thresholds[1:])
        try:
            while True:
                if self._failed is not None:
                    raise self._failed
                if not feed() and not self._groups:
                    return
                busy = bool(self._futures)
                if busy:
                    t0 = time.perf_counter()
                    finished = self._step()
                    self.stats["busy_s"] += time.perf_counter() - t0
                if self.between_steps is not None:
                    self.between_steps()               # e.g. a weight load: the next step samples with it
                if busy:
                    if finished or not self._quiet(turned):
                        await asyncio.sleep(0)         # episodes run: tool calls, next turns enter
                        turned = time.perf_counter()
                        self.stats["yields"] += 1
                else:                                  # every episode is in a tool call, or none runs
                    self._work.clear()
                    t0 = time.perf_counter()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._work.wait(), idle_s)
                    self.stats["idle_s"] += time.perf_counter() - t0
        finally:
            groups = list(self._groups)
            for t in groups:
                t.cancel()
            await asyncio.gather(*groups, return_exceptions=True)
            if self._futures:                          # a failed run leaves nothing in the engine
                self.vc.abort_requests(self.llm, [r for r in self._futures if r not in self._held])
                self._futures.clear()
            self._held.clear()
            self._groups.clear()
            self._loop = self._work = None
            gc.set_threshold(*thresholds)
            self.stats["serve_s"] += time.perf_counter() - t_start

    async def reward(self, fn: Callable, *args):
        """fn(*args) off the engine loop: an async function awaited, a sync one in a worker thread;
        either bounded by config.reward_timeout_s (TimeoutError naming reward_fn)."""
        t = self.config.reward_timeout_s
        if _is_async(fn):
            limit = asyncio.timeout(t)
            try:
                async with limit:
                    return await fn(*args)
            except TimeoutError:
                if not limit.expired():                  # reward_fn's own: as it is
                    raise
                raise TimeoutError(f"reward_fn did not return within {t} s") from None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.reward_workers, thread_name_prefix="reward")
        return await asyncio.get_running_loop().run_in_executor(self._pool, bounded(fn, t, "reward_fn"), *args)

    async def _one(self, episode: EpisodeFn, ep: Episode, device: str) -> Rollout:
        self._live += 1
        try:
            t0 = time.perf_counter()
            deadline, work = asyncio.timeout(self.config.episode_timeout_s), episode(ep)
            if not inspect.isawaitable(work):            # a plain def: every episode would be an error
                raise TypeError(f"the episode function returned {type(work).__name__}, not a coroutine: "
                                "define it with `async def episode(ep)` (it awaits ep.generate)")
            try:
                async with deadline:
                    reward = await work
                    reason = (ep.turns[-1].finish_reason if ep.turns else None) or "stop"
            except EpisodeEnd as end:
                reward, reason = self.config.limit_reward, end.reason
                self.stats["limits"] += 1
            except PromptTooLong:                      # the request fails: nothing to train on
                self.stats["errors"] += 1
                raise
            except (Exception, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise                              # the runner stops this episode (group error, session end)
                self.stats["errors"] += 1
                what = (f"ran past episode_timeout_s={self.config.episode_timeout_s}" if deadline.expired()
                        else f"raised {type(e).__name__}: {e}")
                if self.config.on_error == "raise":
                    raise RuntimeError(f"{ep.name} {what} (after {len(ep.turns)} turns)") from e
                ep.info["error"] = what
                reward, reason = self.config.error_reward, "error"
            self.stats["episodes"] += 1
            ep.info["episode_s"] = time.perf_counter() - t0
            if reward is None and ep.turn_rewards:
                reward = sum(ep.turn_rewards)
            try:
                reward = _check_reward(reward, ep.prompt, ep.text,
                                       "reward_fn" if hasattr(episode, "reward_fn") else "the episode function")
            except (TypeError, ValueError) as e:
                raise type(e)(f"{ep.name}: {e}") from None
            return ep.to_rollout(reward, reason, device)
        finally:
            self._live -= 1


def run_episodes(llm, episode: EpisodeFn, prompts: Sequence, *, group_size: int = 1, sampling: dict | None = None,
                 config: EpisodeConfig = EpisodeConfig(), tokenizer=None, policy_version: int = 0,
                 **kwargs) -> list[RolloutBatch]:
    """Co-located helper: episodes on `llm` (e.g. WeightManager.as_vllm()), Rollouts stamped with
    `policy_version` (WeightManager.policy_version). kwargs: EpisodeRunner.run's (device: "cpu")."""
    runner = EpisodeRunner(llm, sampling=sampling, config=config, tokenizer=tokenizer)
    runner.policy_version = int(policy_version)
    return runner.run(episode, prompts, group_size=group_size, **kwargs)
