"""The rollout queue: one named async Ray actor over a minirl.hub.RolloutHub, plus helpers.

    q = create_queue("rollouts", max_batches=64, model_id=...)  # server side; connect_queue elsewhere
    ray.get(q.take_prompts.remote("gen-0", 8, version, 5.0))    # generator: [] none, None too stale
    ray.get(q.put.remote("gen-0", batches, 300.0))              # generator: waits for space
    ray.get(q.get.remote(16, 300.0))                            # trainer: the batches due first

Blocking calls wait on an asyncio.Condition notified on every state change, with a timeout.
Every call carries the run's token (actors/tokens.py). If the actor dies Ray restarts it empty;
it holds work until server and trainer rejoin (RolloutHub.rejoin_*; callers retry: placement.call).
Tests: tests/test_queue_actor.py, tests/test_async_faults.py. Hardware: CPU (any; num_cpus=0).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import ray

from actors import placement
from actors.tokens import QueueClient, guarded, known, remember
from minirl.hub import RolloutHub

DEFAULT_NAMESPACE = "minirl"
RPC_TIMEOUT_S = 60.0


def _locked(method):
    """An actor method (token checked) that runs the hub's `method` under the lock and wakes every waiter."""
    return guarded(lambda self, *args, **kw: self._until(lambda: method(self.hub, *args, **kw), 0), like=method)


@ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=-1, max_task_retries=0)
class RolloutQueueActor:
    def __init__(self, max_batches: int, *, model_id: str | None = None, name: str = "rollouts",
                 on_failure: str = "stop", token: str | None = None):
        self.name, self.token, self._cond = name, token, asyncio.Condition()    # token None: open to all
        again = ray.get_runtime_context().was_current_actor_reconstructed      # restarted by Ray: empty
        self.hub = RolloutHub(max_batches, model_id=model_id, name=name, on_failure=on_failure, restarted=again)
        self._answers: dict = {}     # (verb, worker) -> (call id, what that call got): see _once

    def _once(self, key, call: str | None, attempt):
        """attempt, but a call made again with the same id (its caller saw the actor unavailable, and Ray
        says it may have run: placement.call retries) gets that call's prompts, batches or count, not a
        second lease, take or add. Also while the first is still waiting here."""
        def once():
            if call is not None and self._answers.get(key, (None,))[0] == call:
                return self._answers[key][1]
            out = attempt()
            if call is not None and out not in (..., None, []):     # something taken or added
                self._answers[key] = (call, out)
            return out
        return once

    async def _until(self, attempt, timeout_s: float | None, poll_s: float | None = None):
        """Under the lock, attempt() now and after each state change (and every poll_s) until it is not
        ... (or timeout)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        async with self._cond:
            while True:
                before = tuple(self.hub.stats().values())
                out = attempt()
                if tuple(self.hub.stats().values()) != before:
                    self._cond.notify_all()
                left = None if deadline is None else deadline - loop.time()
                if out is not ... or (left is not None and left <= 0):
                    return out
                wait = left if poll_s is None else poll_s if left is None else min(left, poll_s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._cond.wait(), wait)

    @guarded
    async def put(self, worker_id: str, batches: list, timeout_s: float | None = 300.0) -> int:
        """Wait for a free slot, then buffer the batches; returns how many were accepted."""
        out = await self._until(lambda: self.hub.put_batches(worker_id, batches)
                                if self.hub.space() >= 1 else ..., timeout_s)
        if out is ...:
            raise TimeoutError(f"rollout queue {self.name} stayed full for {timeout_s} s: is the "
                               f"trainer running? (stats: {self.hub.stats()})")
        return out

    @guarded
    async def get(self, n: int, timeout_s: float | None = 300.0, partial_at_end: bool = True,
                  starved_s: float | None = None, call: str | None = None) -> list | None:
        """n batches within max_staleness, waiting for the ones due first (RolloutHub.take_batches);
        at the end (prompts closed, none pending or leased) what remains, then []. With starved_s: None
        instead of waiting on once a generator was refused work that long for its stale weights
        (RolloutHub.starved): the trainer pushes its weights again, then gets. call: an id (_once)."""
        def attempt():
            if (got := self.hub.take_batches(n, partial_at_end=partial_at_end)) is not None:
                return got
            return None if starved_s is not None and self.hub.starved(starved_s) else ...
        out = await self._until(self._once("get", call, attempt), timeout_s,
                                poll_s=None if starved_s is None else min(1.0, starved_s))
        if out is ...:
            raise TimeoutError(f"rollout queue {self.name}: no {n} batches due within {timeout_s:.3g} s (stats: "
                               f"{self.hub.stats()}): are the generators running? (a step waits for its prompts)")
        return out

    @guarded
    async def take_prompts(self, worker_id: str, k: int, version: int | None = None,
                           timeout_s: float | None = 0.0, call: str | None = None) -> list | None:
        """Lease up to k prompts, waiting up to timeout_s for one; [] when there is none (check
        finished()), None when `version` is too stale to start work. call: an id (_once)."""
        def attempt():
            got = self.hub.take_prompts(worker_id, k, version)
            return ... if got == [] and not self.hub.finished() else got
        out = await self._until(self._once(("take", worker_id), call, attempt), timeout_s)
        return [] if out is ... else out

    @guarded
    async def rollback(self, trained: list, version: int, timeout_s: float = 300.0) -> int:
        """RolloutHub.rollback (a restored trainer), after the server's state on a rebuilt queue."""
        out = await self._until(lambda: ... if "server" in self.hub.awaiting else self.hub.rollback(trained, version),
                                timeout_s)
        if out is ...:
            raise TimeoutError(f"rollout queue {self.name} restarted and the server has not sent its state "
                               f"within {timeout_s} s: is the RolloutServer running?")
        return out

    @guarded
    async def wait_trainer_done(self, timeout_s: float | None = 600.0) -> bool:   # the server: the run's end
        return await self._until(lambda: True if self.hub.see_trainer_done() else ..., timeout_s) is True

    @guarded
    async def finish_trainer(self, timeout_s: float | None = 600.0) -> bool:
        """The trainer is done; waits up to timeout_s until the server side saw it (wait_trainer_done).
        A restarted queue raises QueueRestarted: the trainer rejoins and says it again."""
        return await self._until(lambda: True if self.hub.set_trainer_done() or self.hub.done_seen else ...,
                                 timeout_s) is True

    @guarded
    async def add_prompts(self, items: list, *, skip_known: bool = False, call: str | None = None) -> int:
        """RolloutHub.add_prompts. call: an id (_once): made again, the count, not a duplicate uid error."""
        return await self._until(self._once("add", call, lambda: self.hub.add_prompts(items, skip_known=skip_known)), 0)

    close_prompts = _locked(RolloutHub.close_prompts)
    set_max_staleness, set_version = _locked(RolloutHub.set_max_staleness), _locked(RolloutHub.set_version)
    release_worker, register_worker = _locked(RolloutHub.release_worker), _locked(RolloutHub.register_worker)
    unregister_worker = _locked(RolloutHub.unregister_worker)
    restore = _locked(RolloutHub.restore)
    fail_prompts, failures = _locked(RolloutHub.fail_prompts), _locked(RolloutHub.failures)
    stop_run = _locked(RolloutHub.stop_run)
    snapshot, weights = _locked(RolloutHub.snapshot), _locked(RolloutHub.weights)
    workers, finished = _locked(RolloutHub.workers), _locked(RolloutHub.finished)
    stats, check_model = _locked(RolloutHub.stats), _locked(RolloutHub.check_model)
    rejoin_server, rejoin_trainer = _locked(RolloutHub.rejoin_server), _locked(RolloutHub.rejoin_trainer)


def create_queue(name: str, *, max_batches: int, namespace: str = DEFAULT_NAMESPACE,
                 model_id: str | None = None, detached: bool = True, on_failure: str = "stop",
                 token: str | None = None):
    """Get or create the queue actor `name` beside its creator (never on an autoscaled node, which it would
    keep alive); ValueError if it exists with other settings, PermissionError with another token (given
    one, a QueueClient: actors/tokens.py). detached: it outlives its creator (ray.kill it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    placement.require_ray()
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    handle = RolloutQueueActor.options(
        name=name, namespace=namespace, lifetime="detached" if detached else None, get_if_exists=True,
        scheduling_strategy=here).remote(max_batches, model_id=model_id, name=name, on_failure=on_failure,
                                         token=token)
    handle = QueueClient(handle, token) if token else handle
    have = ray.get(handle.stats.remote(), timeout=RPC_TIMEOUT_S)
    for key, want in (("max_batches", max_batches), ("on_failure", on_failure)):
        if have[key] != want:
            raise ValueError(f"rollout queue {name} in namespace {namespace} already exists with {key}="
                             f"{have[key]!r}, not {want!r}: use the same value, another name, or ray.kill it")
    ray.get(handle.check_model.remote(model_id), timeout=RPC_TIMEOUT_S)   # ValueError: another model
    remember(namespace, name, token)
    return handle


def connect_queue(name: str, *, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 30.0,
                  model_id: str | None = None, token: str | None = None):
    """An existing queue's handle, waiting up to timeout_s for it (LookupError); model_id: see check_model;
    token (default: tokens.known): a QueueClient that sends it (PermissionError: not the queue's)."""
    placement.require_ray()
    deadline, delay = time.monotonic() + timeout_s, 0.05
    while True:
        try:
            handle = ray.get_actor(name, namespace=namespace)
            break
        except ValueError:
            if time.monotonic() >= deadline:
                raise LookupError(f"no rollout queue named {name} in namespace {namespace}: start "
                                  "the RolloutServer first, or check queue_address") from None
            time.sleep(delay := min(2 * delay, 1.0))
    handle = QueueClient(handle, token) if (token := token or known(namespace, name)) else handle
    ray.get(handle.check_model.remote(model_id), timeout=RPC_TIMEOUT_S)   # also checks the token
    return handle


