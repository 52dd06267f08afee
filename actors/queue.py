"""The rollout queue: one named async Ray actor holding a minirl.hub.RolloutHub, plus helpers.

    q = create_queue("rollouts", max_batches=64, model_id="Qwen/Qwen3-4B")   # trainer side
    q = connect_queue("rollouts", model_id="Qwen/Qwen3-4B")                   # generator side
    ray.get(q.add_prompts.remote([PromptItem(uid=i, prompt=p) for i, p in ...]), timeout=60)
    items = ray.get(q.take_prompts.remote("gen-0", 8, timeout_s=5.0), timeout=65)   # generator
    ray.get(q.put.remote("gen-0", batches, timeout_s=300.0), timeout=360)          # generator
    batches = ray.get(q.get.remote(16, min_version=v - 1, timeout_s=300.0), timeout=360)  # trainer

The actor exposes the hub's methods unchanged (non-blocking) and three blocking ones, each woken
by an asyncio.Condition that is notified on every state change:
- put(worker_id, batches, timeout_s): waits until the buffer has a free slot, then puts
  (backpressure: a full buffer blocks producers); TimeoutError if it stays full.
- get(n, min_version, timeout_s): waits until take_batches(n, min_version) returns n batches;
  TimeoutError naming the queue, n, min_version and the stats otherwise.
- take_prompts(worker_id, k, timeout_s): waits until a prompt is pending; returns [] at once
  when the hub is finished (closed, nothing pending, leased or buffered), and [] on timeout
  (so [] means "nothing now": check finished() to tell whether to stop).
timeout_s=None waits forever; 0 does not wait.

Batches cross as values (each RolloutBatch is pickled into the actor's heap), never as
producer-owned ObjectRefs, so they survive the generator that made them. The actor keeps its
state in memory only: if it dies, the queue is gone (it is not restarted). It takes no CPU
(num_cpus=0), so placement groups that reserve every CPU do not starve it.

Tests: `pytest tests/test_queue_actor.py` (starts a private local Ray cluster; ~10-20 s).
Hardware: CPU (any).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import ray

from minirl.hub import PromptItem, RolloutHub

DEFAULT_NAMESPACE = "minirl"
RPC_TIMEOUT_S = 60.0
"""Timeout of every ray.get the helpers make (actor start-up included)."""


@ray.remote(num_cpus=0, max_concurrency=1000)
class RolloutQueueActor:
    """A RolloutHub behind an asyncio lock, with blocking put / get / take_prompts."""

    def __init__(self, max_batches: int, *, model_id: str | None = None, name: str = "rollouts"):
        self.name = name
        self.hub = RolloutHub(max_batches, model_id=model_id, name=name)
        self._cond = asyncio.Condition()
        self._settings: dict = {}

    # -- plumbing --------------------------------------------------------------------------------

    def _fingerprint(self) -> tuple:
        return tuple(self.hub.stats().values())

    async def _apply(self, fn: Callable, *args):
        """Run one hub call under the lock and wake every waiter."""
        async with self._cond:
            try:
                return fn(*args)
            finally:
                self._cond.notify_all()

    async def _until(self, attempt: Callable, timeout_s: float | None):
        """Under the lock, call attempt() now and after every state change until it returns
        something other than None (returned), or until timeout_s passes (None). attempt may
        change the hub; waiters are woken only when it did, so two waiters never ping-pong."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        async with self._cond:
            while True:
                before = self._fingerprint()
                out = attempt()
                if self._fingerprint() != before:
                    self._cond.notify_all()
                if out is not None:
                    return out
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._cond.wait(), left)
                except asyncio.TimeoutError:
                    pass

    # -- blocking calls --------------------------------------------------------------------------

    async def put(self, worker_id: str, batches: list, timeout_s: float | None = 300.0) -> int:
        """Wait for a free slot, then put_batches (may overshoot max_batches by len-1).
        Returns how many were accepted (duplicates are dropped)."""
        out = await self._until(
            lambda: self.hub.put_batches(worker_id, batches) if self.hub.space() >= 1 else None,
            timeout_s)
        if out is None:
            raise TimeoutError(f"rollout queue {self.name} stayed full for {timeout_s} s: is the "
                               f"trainer running? (stats: {self.hub.stats()})")
        return out

    async def get(self, n: int, min_version: int = 0, timeout_s: float | None = 300.0,
                  partial_at_end: bool = False) -> list:
        """Wait until n fresh batches (policy_version >= min_version) are buffered; return the
        oldest n. Stale ones are recycled on the way (see RolloutHub.take_batches). With
        partial_at_end, the last call returns what remains and later ones [] (the end)."""
        out = await self._until(lambda: self.hub.take_batches(n, min_version, partial_at_end=partial_at_end),
                                timeout_s)
        if out is None:
            raise TimeoutError(f"rollout queue {self.name}: no {n} batches with policy_version >= "
                               f"{min_version} within {timeout_s} s (stats: {self.hub.stats()}): "
                               "are the generators running and registered?")
        return out

    async def take_prompts(self, worker_id: str, k: int, timeout_s: float | None = 0.0) -> list:
        """Lease up to k prompts, waiting up to timeout_s for one to be pending. [] when the hub
        is finished or on timeout."""
        if k < 1:
            return []
        out = await self._until(
            lambda: self.hub.take_prompts(worker_id, k) or ([] if self.hub.finished() else None),
            timeout_s)
        return [] if out is None else out

    # -- the hub's own methods (non-blocking) ----------------------------------------------------

    async def add_prompts(self, items: list[PromptItem], skip_known: bool = False) -> int:
        return await self._apply(lambda: self.hub.add_prompts(items, skip_known=skip_known))

    async def snapshot(self) -> dict:
        return self.hub.snapshot()

    async def restore(self, delivered: list, buffered: list) -> None:
        return await self._apply(self.hub.restore, delivered, buffered)

    async def close_prompts(self) -> None:
        return await self._apply(self.hub.close_prompts)

    async def release_worker(self, worker_id: str) -> int:
        return await self._apply(self.hub.release_worker, worker_id)

    async def put_batches(self, worker_id: str, batches: list) -> int:
        return await self._apply(self.hub.put_batches, worker_id, batches)

    async def take_batches(self, n: int, min_version: int = 0) -> list | None:
        return await self._apply(self.hub.take_batches, n, min_version)

    async def set_version(self, version: int, weights: Any = None) -> None:
        return await self._apply(self.hub.set_version, version, weights)

    async def register_worker(self, worker_id: str, handle: Any = None) -> None:
        return await self._apply(self.hub.register_worker, worker_id, handle)

    async def unregister_worker(self, worker_id: str) -> int:
        return await self._apply(self.hub.unregister_worker, worker_id)

    async def space(self) -> int:
        return self.hub.space()

    async def version(self) -> int:
        return self.hub.version()

    async def weights(self) -> tuple[int, Any]:
        return self.hub.weights()

    async def workers(self) -> dict[str, Any]:
        return self.hub.workers()

    async def finished(self) -> bool:
        return self.hub.finished()

    async def stats(self) -> dict:
        return self.hub.stats()

    async def check_model(self, model_id: str | None) -> None:
        self.hub.check_model(model_id)

    async def config(self) -> dict:
        return {"name": self.name, "max_batches": self.hub.max_batches,
                "model_id": self.hub.model_id, **self._settings}

    async def set_config(self, **settings) -> None:
        """Settings the trainer publishes for the generators (e.g. max_staleness)."""
        self._settings.update(settings)


# ----------------------------------------------------------------------------------------------
# Client helpers


def _require_ray() -> None:
    # Without this, Ray would quietly start a fresh local cluster that holds no queue.
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized: call ray.init(address=...) with the cluster "
                           "that runs the rollout queue first")


def create_queue(name: str, *, max_batches: int, namespace: str = DEFAULT_NAMESPACE,
                 model_id: str | None = None, detached: bool = True):
    """Get or create the queue actor called `name` in `namespace`; returns its handle.

    detached=True: it outlives its creator (kill it with ray.kill, or it dies with the cluster).
    If a queue of that name already exists with another max_batches, or another model_id (when
    both are set), raise ValueError rather than silently sharing it.
    """
    _require_ray()
    # Beside its creator (soft): never on an autoscaled generation node, which it would keep
    # alive (and take its in-memory contents down with when the node goes).
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    handle = RolloutQueueActor.options(
        name=name, namespace=namespace, lifetime="detached" if detached else None,
        get_if_exists=True, scheduling_strategy=here).remote(max_batches, model_id=model_id, name=name)
    cfg = ray.get(handle.config.remote(), timeout=RPC_TIMEOUT_S)
    if cfg["max_batches"] != max_batches:
        raise ValueError(f"rollout queue {name} in namespace {namespace} already exists with "
                         f"max_batches={cfg['max_batches']}, not {max_batches}: use the same "
                         "value, another name, or ray.kill the old queue")
    if model_id is not None and cfg["model_id"] is not None and cfg["model_id"] != model_id:
        raise ValueError(f"rollout queue {name} in namespace {namespace} already exists serving "
                         f"model {cfg['model_id']}, not {model_id}")
    return handle


def connect_queue(name: str, *, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 30.0,
                  model_id: str | None = None):
    """The handle of an existing queue, polling for up to timeout_s while it starts.

    Raises LookupError when no such queue appears in time, and (when model_id is given) the
    queue's ValueError if it serves another model.
    """
    _require_ray()
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            handle = ray.get_actor(name, namespace=namespace)
            break
        except ValueError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LookupError(f"no rollout queue named {name} in namespace {namespace}: start "
                                  "the RolloutServer first, or check queue_address") from None
            time.sleep(min(delay, left))
            delay = min(2 * delay, 1.0)
    if model_id is not None:
        ray.get(handle.check_model.remote(model_id), timeout=RPC_TIMEOUT_S)
    return handle


__all__ = ["RolloutQueueActor", "create_queue", "connect_queue", "PromptItem",
           "DEFAULT_NAMESPACE", "RPC_TIMEOUT_S"]
