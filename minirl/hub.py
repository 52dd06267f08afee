"""RolloutHub: the bookkeeping of the async backend, as one plain class (no Ray, no threads).

It keeps consistent a pool of prompts that generators lease (`take_prompts`) and give back when
they die (`release_worker`); a bounded buffer of finished RolloutBatches (one per prompt) that the
trainer takes (`take_batches`), re-issuing those of a too-old policy; the staleness bound, policy
version and run's end; and exactly-once accounting: every prompt uid is in one state

      pending -> leased -> buffered -> delivered
         ^--------'---------'   (worker lost / batch too stale)

and is delivered once, however often it was generated: a batch for a uid already buffered or
delivered (a restarted worker finishing a prompt twice) is dropped, counted in "duplicates".

actors/queue.py wraps one hub in an async Ray actor and adds the blocking calls. Tests:
`pytest tests/test_hub.py`. Hardware: CPU (any).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from minirl.data import RolloutBatch


@dataclass
class PromptItem:
    """One prompt to generate a group of completions for."""

    uid: Any                # unique per prompt, hashable (a dataset index, say); RolloutBatch.uid repeats it
    prompt: Any             # a str or a list of token ids, passed to the generator as-is
    metadata: Any = None    # whatever the reward function needs (a reference answer, say)
    attempts: int = 0       # times re-issued (worker lost, batch too stale); 0 when first generated


class RolloutHub:
    """Prompt pool + bounded rollout buffer + exactly-once accounting. Not thread-safe: one
    owner (a test, or the single event loop of the queue actor) calls it."""

    def __init__(self, max_batches: int, *, model_id: str | None = None, name: str = "hub"):
        if int(max_batches) < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        self.max_batches = int(max_batches)
        self.model_id = model_id
        self.name = name    # used in error messages (the queue actor passes its Ray name)
        self._items: dict[Any, PromptItem] = {}          # every uid not yet delivered
        self._pending: OrderedDict[Any, None] = OrderedDict()   # FIFO; front = next out
        self._leases: dict[Any, str] = {}                # uid -> worker_id, in lease order
        self._buffer: OrderedDict[Any, RolloutBatch] = OrderedDict()  # FIFO of finished batches
        self._delivered: set = set()
        self._closed = False
        self._recycled_stale = self._duplicates = self._version = 0
        self._weights: Any = None
        self._workers: dict[str, Any] = {}
        # Set by the trainer: generators more versions behind start no new work; older batches
        # are recycled at take time.
        self.max_staleness: int | None = None
        self.trainer_done = False   # the trainer trained and synced its last batch (the run's end)

    def _known(self, uid) -> bool:
        """Pending, leased, buffered or delivered."""
        return uid in self._items or uid in self._delivered

    # -- prompts ---------------------------------------------------------------------------------

    def add_prompts(self, items: list[PromptItem], *, skip_known: bool = False) -> int:
        """Append prompts to the pending pool, all or none; returns how many. skip_known skips
        uids the hub already knows (e.g. restored from a checkpoint) instead of refusing them."""
        if self._closed:
            raise ValueError("add_prompts after close_prompts: the prompt pool is closed")
        items = list(items)
        if skip_known:
            items = [it for it in items if not isinstance(it, PromptItem) or not self._known(it.uid)]
        seen = set()
        for it in items:
            if not isinstance(it, PromptItem):
                raise TypeError(f"add_prompts takes minirl.hub.PromptItem objects, got "
                                f"{type(it).__name__}: wrap it as PromptItem(uid=..., prompt=...)")
            if self._known(it.uid) or it.uid in seen:
                raise ValueError(f"duplicate prompt uid {it.uid!r}: uids must be unique over the "
                                 "whole run (delivered ones included)")
            seen.add(it.uid)
        for it in items:
            self._items[it.uid] = replace(it)
            self._pending[it.uid] = None
        return len(items)

    def snapshot(self) -> dict:
        """For a checkpoint: buffered batches with their prompts, and the pending and leased prompts."""
        return {"buffered": [(replace(self._items[u]), b) for u, b in self._buffer.items()],
                "in_flight": [replace(self._items[u]) for u in self._leases],
                "pending": [replace(self._items[u]) for u in self._pending]}

    def restore(self, delivered: list, buffered: list) -> None:
        """Resume from a checkpoint: `delivered` uids are never issued again; `buffered`
        [(PromptItem, RolloutBatch)] go back into the buffer as they were."""
        self._delivered.update(delivered)
        for item, batch in buffered:
            if self._known(item.uid):
                raise ValueError(f"restore: prompt uid {item.uid!r} is already known to the queue")
            self._items[item.uid] = replace(item)
            self._buffer[item.uid] = batch

    def close_prompts(self) -> None:
        """No more prompts will come; finished() can become True."""
        self._closed = True

    def set_max_staleness(self, max_staleness: int) -> None:
        if int(max_staleness) < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = int(max_staleness)

    def set_trainer_done(self) -> None:
        self.trainer_done = True

    def take_prompts(self, worker_id: str, k: int, version: int | None = None) -> list[PromptItem] | None:
        """Lease up to k pending prompts (oldest first, as copies) to `worker_id`; [] when none are
        pending; None, leasing nothing, when its weights' `version` lags more than max_staleness."""
        if (self._pending and version is not None and self.max_staleness is not None
                and self._version - version > self.max_staleness):
            return None
        out = []
        while self._pending and len(out) < k:
            uid, _ = self._pending.popitem(last=False)
            self._leases[uid] = worker_id
            out.append(replace(self._items[uid]))
        return out

    def release_worker(self, worker_id: str) -> int:
        """A worker died or was removed: its leased prompts go back to the front of the pending
        queue (in lease order), each with attempts+1. Returns how many."""
        uids = [u for u, w in self._leases.items() if w == worker_id]
        for u in uids:
            del self._leases[u]
        self._requeue_front(uids)
        return len(uids)

    def _requeue_front(self, uids: list) -> None:
        for u in reversed(uids):
            self._items[u].attempts += 1
            self._pending[u] = None
            self._pending.move_to_end(u, last=False)

    # -- rollouts --------------------------------------------------------------------------------

    def space(self) -> int:
        """Free batch slots (0 when full)."""
        return max(0, self.max_batches - len(self._buffer))

    def put_batches(self, worker_id: str, batches: list) -> int:
        """Buffer finished RolloutBatches (.uid = their PromptItem's; all checked before any is
        taken); returns how many were accepted. A uid unknown, buffered or delivered is dropped as
        a duplicate; else the batch is accepted from any worker (first finisher wins), clearing
        its lease and its pending entry. No space check: the caller waits for space() >= 1, so
        the buffer may exceed max_batches by at most len(batches) - 1."""
        batches = list(batches)
        for b in batches:
            if not isinstance(b, RolloutBatch):
                raise TypeError(f"put_batches takes minirl.data.RolloutBatch objects, got "
                                f"{type(b).__module__}.{type(b).__name__}: wrap the G rollouts of "
                                "one prompt as RolloutBatch(rollouts, uid=prompt_item.uid)")
            if b.uid is None:
                raise ValueError("RolloutBatch.uid is None: set it to the uid of the PromptItem it answers")
            if len(b) == 0:
                raise ValueError(f"RolloutBatch for uid {b.uid!r} has no rollouts")
        accepted = 0
        for b in batches:
            if b.uid not in self._items or b.uid in self._buffer:
                self._duplicates += 1
                continue
            self._leases.pop(b.uid, None)
            self._pending.pop(b.uid, None)
            self._buffer[b.uid] = b
            accepted += 1
        return accepted

    def take_batches(self, n: int, min_version: int | None = None, *, partial_at_end: bool = False
                     ) -> list[RolloutBatch] | None:
        """The oldest n buffered batches, marked delivered (never returned again), or None (taking
        nothing) if fewer are buffered. First, batches with policy_version < min_version (default:
        version - max_staleness) are dropped and their prompts re-queued at the front with
        attempts+1 (stats: recycled_stale). partial_at_end: once prompts are closed and none is
        pending or leased, return whatever fresh batches remain, possibly [] (the end)."""
        if not 1 <= n <= self.max_batches:
            raise ValueError(f"take_batches(n={n}) on a hub with max_batches={self.max_batches}: n must be "
                             "in [1, max_batches] (make the queue at least as big as one training step)")
        if min_version is None:
            min_version = 0 if self.max_staleness is None else self._version - self.max_staleness
        stale = [u for u, b in self._buffer.items() if b.policy_version < min_version]
        for u in stale:
            del self._buffer[u]
        self._requeue_front(stale)
        self._recycled_stale += len(stale)
        if len(self._buffer) < n:
            if not (partial_at_end and self._closed and not self._pending and not self._leases):
                return None
            n = len(self._buffer)
        out = [self._buffer.popitem(last=False)[1] for _ in range(n)]
        for b in out:
            del self._items[b.uid]
            self._delivered.add(b.uid)
        return out

    # -- weights / version / workers -------------------------------------------------------------

    def set_version(self, version: int, weights: Any = None) -> None:
        """Publish the trainer's policy version and, optionally, an opaque handle to its weights
        (e.g. [object_refs], wrapped so Ray passes them through); weights=None clears the handle."""
        self._version = int(version)
        self._weights = weights

    def weights(self) -> tuple[int, Any]:
        """(version, weights handle) as last published by set_version."""
        return self._version, self._weights

    def register_worker(self, worker_id: str, handle: Any = None) -> None:
        """Record a generator (and a handle to it); a re-registered id (a restarted worker) first
        gets its leased prompts released."""
        self.release_worker(worker_id)
        self._workers[worker_id] = handle

    def unregister_worker(self, worker_id: str) -> int:
        """Forget a worker and release its leases; returns how many prompts went back."""
        self._workers.pop(worker_id, None)
        return self.release_worker(worker_id)

    def workers(self) -> dict[str, Any]:
        return dict(self._workers)

    def check_model(self, model_id: str | None) -> None:
        """Raise ValueError if both this hub's and the caller's model ids are set and differ."""
        if self.model_id is not None and model_id is not None and model_id != self.model_id:
            raise ValueError(f"queue {self.name} serves model {self.model_id} but this worker was "
                             f"started with model {model_id}")

    # -- status ----------------------------------------------------------------------------------

    def finished(self) -> bool:
        """Prompts are closed and nothing is pending, leased or buffered."""
        return self._closed and not self._items

    def stats(self) -> dict:
        return {"pending": len(self._pending), "leased": len(self._leases), "buffered": len(self._buffer),
                "delivered": len(self._delivered), "recycled_stale": self._recycled_stale,
                "duplicates": self._duplicates, "max_batches": self.max_batches, "version": self._version,
                "workers": len(self._workers), "closed": self._closed, "max_staleness": self.max_staleness,
                "trainer_done": self.trainer_done}


__all__ = ["PromptItem", "RolloutHub"]
