"""RolloutHub: the async backend's bookkeeping, one plain class (no Ray, no threads): a pool of prompts
generators lease (`take_prompts`) and give back when they die (`release_worker`); a bounded buffer of finished
RolloutBatches (one per prompt) the trainer takes (`take_batches`); staleness bound, policy version, run's end.
Exactly-once accounting (a second batch for a uid, from a restarted worker, is dropped: "duplicates"):

      pending -> leased -> buffered -> delivered
         ^--------'---------'-----------'   (worker lost / batch too stale / trainer rolled back)
                    '-> failed               (its request failed: fail_prompts)

A failed prompt is never retried: on_failure="stop" (default) ends the run, the trainer's next take_batches
raising the cause; "skip" records it in failures(). rollback() resumes a restored trainer. A hub rebuilt after
its actor died (restarted=True) holds leases and deliveries until the server (rejoin_server) and the live
trainer (rejoin_trainer) sent their state again.

Staleness by admission (the trainer's max_staleness S and batch size B: set_max_staleness, which only the
trainer calls, as it starts and before it rejoins a restarted hub). The guarantee: every token trained at
trainer version t (the step that publishes t + 1) was sampled with weights of version >= t - S. A batch's
policy_version is its oldest token's, so its deadline is policy_version + S (the last version that may train
it); a prompt leased to a generator holding version g gets the deadline g + S. Two rules keep every deadline:
  (a) admission (admission_room): a prompt is leased only if, for every t >= its deadline, the open prompts
      (leased or buffered) with deadlines <= t fit in the steps left until t:
      #{open: deadline <= t} <= (t - version) * B + (B - taken at this version, >= 0); and at most
      max_batches are open (one step per version: the trainer publishes after each take; a take at a
      version whose share it took already, after a step that changed no weight, opens a new share).
      Before the trainer set its bound: at most max_batches open (a queue sized B x (S + 1) admits so
      its first S + 1 steps, all at version 0).
  (b) take_batches(n) at version t delivers the n open prompts of the earliest deadlines (among equal
      deadlines finished ones first) and waits while any of those is unfinished rather than train newer ones
      ("waited_for_old"), bounded by the caller's timeout.
By (a) the prompts due at version t never outnumber B, by (b) they are all in step t's batch, so finished work
is not wasted; max_staleness=0 stays on-policy. A safety net re-queues batches past their deadline anyway
("recycled_stale": a restored buffer, admission=False, a bound unlike the queue's size, several takes per
version). With admission the leases bound the buffer: a put never waits.

actors/queue.py wraps a hub in an async Ray actor. Tests: `pytest tests/test_hub.py`. Hardware: CPU.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from minirl.data import RolloutBatch, check_per_prompt


@dataclass
class PromptItem:
    """One prompt to generate a group of completions for."""
    uid: Any                # unique per prompt, hashable (a dataset index, say); RolloutBatch.uid repeats it
    prompt: Any             # a str or a list of token ids, passed to the generator as-is
    metadata: Any = None    # whatever the reward function needs (a reference answer, say)
    attempts: int = 0       # times re-issued (worker lost, batch too stale); 0 when first generated


def prompt_items(prompts: list, metadata: list | None = None, uids: list | None = None) -> list[PromptItem]:
    """PromptItems of prompts (text or token ids), their metadata and uids (default: positions)."""
    check_per_prompt(len(prompts), metadata=metadata, uids=uids)
    return [PromptItem(uid=i if uids is None else uids[i], prompt=p,
                       metadata=None if metadata is None else metadata[i]) for i, p in enumerate(prompts)]


def _span(r) -> tuple[int, int]:
    """(oldest, newest) policy version of a rollout's tokens."""
    lo, hi = r.info.get("versions") or (r.policy_version, r.policy_version)
    return int(lo), int(hi)


def admission_room(dues: list[int], deadline: int, version: int, batch_size: int, taken: int,
                   max_batches: int) -> int:
    """Rule (a): how many more prompts of this deadline may be leased, given the deadlines of the
    open prompts, the trainer's version, its batch size and the prompts taken at this version."""
    room = max_batches - len(dues)
    for t in sorted({deadline, *(d for d in dues if d > deadline)}):
        steps = (t - version) * batch_size + max(0, batch_size - taken)
        room = min(room, steps - sum(d <= t for d in dues))
    return max(0, room)


def _orphan(orphaned: list, version: int | None, newest: int | None = None) -> bool:
    """Weights of a trainer that died after its last checkpoint (its versions (lo, hi] in `orphaned`)
    among versions version..newest."""
    newest = version if newest is None else newest
    return version is not None and any(lo < newest and version <= hi for lo, hi in orphaned)


def _orphan_tokens(orphaned: list, batch: RolloutBatch) -> bool:
    """Some token sampled with orphaned weights (a rollout's versions: the span its turns ran over,
    weights loading between engine steps; else its policy_version)."""
    return any(_orphan(orphaned, *_span(r)) for r in batch)


def _checked(batches) -> list[RolloutBatch]:
    """put_batches' argument as a list, refused unless each is a RolloutBatch with a uid and rollouts."""
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
    return batches


class QueueRestarted(RuntimeError):
    """The queue's actor restarted with an empty hub: the trainer must rejoin_trainer first."""


class RolloutHub:
    """Prompt pool + bounded rollout buffer + exactly-once accounting; not thread-safe (one owner)."""

    def __init__(self, max_batches: int, *, model_id: str | None = None, name: str = "hub",
                 on_failure: str = "stop", restarted: bool = False, admission: bool = True):
        if int(max_batches) < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        if on_failure not in ("stop", "skip"):
            raise ValueError(f"on_failure={on_failure!r}: choose 'stop' (a failed prompt ends the run) "
                             "or 'skip' (it is recorded in failures() and the run goes on)")
        self.on_failure, self.max_batches = on_failure, int(max_batches)
        self.model_id, self.name = model_id, name    # name: for error messages (the queue actor's)
        self._items: dict[Any, PromptItem] = {}          # every uid not yet delivered
        self._pending: OrderedDict[Any, None] = OrderedDict()   # FIFO; front = next out
        self._leases: dict[Any, str] = {}                # uid -> worker_id, in lease order
        self._buffer: OrderedDict[Any, RolloutBatch] = OrderedDict()  # FIFO of finished batches
        self._delivered: dict[Any, PromptItem | None] = {}   # kept for rollback (None: restored)
        self._failed: dict[Any, str] = {}                # uid -> why its request failed
        self.error: str | None = None                    # on_failure="stop": the failure that ends the run
        self._orphaned: list[tuple[int, int]] = []       # (lo, hi]: versions of a trainer that died
        self._closed = self.trainer_done = self.done_seen = False
        self._recycled_stale = self._duplicates = self._version = self._rolled_back = self._top_version = 0
        self._weights, self._workers = None, {}      # the trainer's weights handle; worker_id -> handle
        self.max_staleness = self.batch_size = None    # the trainer's bound, its prompts a step: set_max_staleness
        self.admission = admission              # False: the old rule (lease while fresh, recycle late)
        self._deadline, self._order = {}, {}    # leased uid -> generator's version at lease + S; -> lease number
        self._lease_no = itertools.count()      # the next lease number
        self._taken, self._waited = (0, 0), set()   # (version, prompts delivered at it); uids take_batches waited for
        self._starved: dict[str, float] = {}    # worker_id -> since when take_prompts refused it (stale weights)
        self.restarted = restarted                 # rebuilt after its actor died: empty until both rejoin
        self.awaiting: set[str] = {"server", "trainer"} if restarted else set()

    def _known(self, uid) -> bool:     # pending, leased, buffered, delivered or failed
        return uid in self._items or uid in self._delivered or uid in self._failed

    def _saw(self, version: int | None) -> None:
        """A generator holds weights of `version`: a trainer published it (a rebuilt hub learns so the
        versions a lost trainer published; rollback publishes above them, never reusing one)."""
        if version is not None:
            self._top_version = max(self._top_version, int(version))

    def add_prompts(self, items: list[PromptItem], *, skip_known: bool = False) -> int:
        """Append prompts to the pending pool, all or none; returns how many. skip_known skips
        uids the hub already knows (e.g. restored from a checkpoint) instead of refusing them."""
        if self._closed:
            raise ValueError("add_prompts after close_prompts: the prompt pool is closed")
        items = [it for it in items if not (skip_known and isinstance(it, PromptItem) and self._known(it.uid))]
        seen = set()
        for it in items:
            if not isinstance(it, PromptItem):
                raise TypeError(f"add_prompts takes minirl.hub.PromptItem objects, got "
                                f"{type(it).__name__}: wrap it as PromptItem(uid=..., prompt=...)")
            if self._known(it.uid) or it.uid in seen:
                raise ValueError(f"duplicate prompt uid {it.uid!r}: uids must be unique over the "
                                 "whole run (delivered ones included)")
            seen.add(it.uid)
        self._items.update((it.uid, replace(it)) for it in items)
        self._pending.update((it.uid, None) for it in items)
        return len(items)

    def snapshot(self) -> dict:
        """For a checkpoint: buffered batches with their prompts, the pending, leased and failed; after a rebuild,
        QueueRestarted until the trainer rejoined (rolling its trained uids back)."""
        self._check_trainer_joined()
        return {"buffered": [(replace(self._items[u]), b) for u, b in self._buffer.items()],
                "in_flight": [replace(self._items[u]) for u in self._leases],
                "pending": [replace(self._items[u]) for u in self._pending], "failed": dict(self._failed)}

    def restore(self, delivered: list, buffered: list, failed: dict | None = None) -> None:
        """Resume from a checkpoint: `delivered` uids are never issued again, nor `failed` ones ({uid: cause},
        failures() again); `buffered` [(PromptItem, RolloutBatch)] go back into the buffer as they were. Call it
        before the prompts are added."""
        failed = dict(failed or {})
        if early := [u for u in (*delivered, *failed, *(it.uid for it, _ in buffered)) if u in self._items]:
            raise ValueError(f"restore: prompt uids {early[:5]} were added to the queue before restore (they would "
                             "train again): restore the checkpoint first, then add the prompts with skip_known=True")
        self._delivered.update(dict.fromkeys(u for u in delivered if u not in self._delivered))
        self._failed.update(failed)
        for item, batch in buffered:
            if self._known(item.uid):
                raise ValueError(f"restore: prompt uid {item.uid!r} is already known to the queue")
            self._items[item.uid] = replace(item)
            self._buffer[item.uid] = batch

    def close_prompts(self) -> None:
        """No more prompts will come; finished() can become True."""
        self._closed = True

    def set_max_staleness(self, max_staleness: int, batch_size: int | None = None) -> None:
        """The trainer's staleness bound and (for admission) how many prompts one of its steps takes."""
        if int(max_staleness) < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if batch_size is not None and not 1 <= int(batch_size) <= self.max_batches:     # a step takes that many
            raise ValueError(f"batch_size={batch_size} must be in [1, max_batches={self.max_batches}]: a larger queue "
                             "(RolloutServer queue_size; launch: the server's --prompts x (--max-staleness + 1))")
        self.max_staleness = int(max_staleness)
        self.batch_size = None if batch_size is None else int(batch_size)

    def _admits(self) -> bool:
        return self.admission and self.max_staleness is not None and self.batch_size is not None

    def _due(self, uid) -> int:     # the last trainer version that may train this open prompt
        if uid in self._buffer:
            return self._buffer[uid].policy_version + self.max_staleness
        return self._deadline.get(uid, self._version + self.max_staleness)

    def _taken_now(self) -> int:     # prompts delivered at the current version (its step's share)
        return self._taken[1] if self._taken[0] == self._version else 0

    def _forget(self, uid) -> None:     # drop its lease, pending entry, batch and deadline; its item stays
        for book in (self._leases, self._pending, self._buffer, self._deadline, self._order):
            book.pop(uid, None)

    def set_trainer_done(self) -> None:     # the trainer synced its last batch
        self._check_trainer_joined()
        self.trainer_done = True

    def see_trainer_done(self) -> bool:
        """Whether the trainer is done (the server asks); then done_seen (a hub rebuilt before is told again)."""
        self.done_seen = self.done_seen or self.trainer_done
        return self.trainer_done

    def _check_trainer_joined(self) -> None:
        if "trainer" in self.awaiting:
            raise QueueRestarted(f"rollout queue {self.name} restarted and lost its state: the trainer must "
                                 "rejoin_trainer (TrainWorker does) before it takes batches or finishes")

    def take_prompts(self, worker_id: str, k: int, version: int | None = None) -> list[PromptItem] | None:
        """Lease up to k pending prompts (oldest first, as copies) to `worker_id`; [] when none are
        pending; None, leasing nothing, when its weights' `version` lags more than max_staleness."""
        self._saw(version)
        lags = version is not None and self.max_staleness is not None and self._version - version > self.max_staleness
        if self._pending and (_orphan(self._orphaned, version) or lags):
            self._starved.setdefault(worker_id, time.monotonic())
            return None
        self._starved.pop(worker_id, None)
        if self.error is not None or self.awaiting or self.trainer_done:   # the run stops or ended, or a rebuilt
            return []                                                      # hub waits for its state
        k = min(k, len(self._pending))
        due = (self._version if version is None else version) + (self.max_staleness or 0)
        if self._admits():
            dues = [self._due(u) for u in (*self._leases, *self._buffer)]    # rule (a): [] until the trainer steps
            k = min(k, admission_room(dues, due, self._version, self.batch_size, self._taken_now(), self.max_batches))
        elif self.admission:         # before the trainer's bound: what the buffer holds (else stale by its first steps)
            k = min(k, max(0, self.max_batches - len(self._leases) - len(self._buffer)))
        uids = [self._pending.popitem(last=False)[0] for _ in range(k)]
        self._leases.update(dict.fromkeys(uids, worker_id))
        self._order.update((u, next(self._lease_no)) for u in uids)
        if self.max_staleness is not None:           # else due when the trainer sets it (_due)
            self._deadline.update(dict.fromkeys(uids, due))
        return [replace(self._items[u]) for u in uids]

    def release_worker(self, worker_id: str) -> int:
        """A lost worker's leases go back to the pending queue's front (in order, attempts+1); how many."""
        self._starved.pop(worker_id, None)       # a lost or re-registered worker: not starved
        return self._requeue_front([u for u, w in self._leases.items() if w == worker_id])

    def _requeue_front(self, uids: list) -> int:
        for u in reversed(uids):
            self._forget(u)
            self._items[u].attempts += 1
            self._pending[u] = None
            self._pending.move_to_end(u, last=False)
        return len(uids)

    def space(self) -> int:
        """Free batch slots (0 when full; with admission at least 1: a step may be waiting for exactly that batch)."""
        return max(1 if self._admits() else 0, self.max_batches - len(self._buffer))

    def put_batches(self, worker_id: str, batches: list) -> int:
        """Buffer RolloutBatches (.uid = their PromptItem's; all checked first); returns how many were
        accepted: the first finisher of a uid wins, others are dropped duplicates. No space check:
        callers wait for space() >= 1 (the buffer may exceed max_batches by len(batches) - 1)."""
        batches = _checked(batches)
        self._saw(max((_span(r)[1] for b in batches for r in b), default=None))
        before, orphans = len(self._buffer), [b.uid for b in batches if _orphan_tokens(self._orphaned, b)]
        self._requeue_front([u for u in orphans if self._leases.get(u) == worker_id])
        for b in batches:
            if b.uid in self._items and b.uid not in self._buffer and b.uid not in orphans:
                self._leases.pop(b.uid, None)
                self._pending.pop(b.uid, None)
                self._buffer[b.uid] = b
        accepted = len(self._buffer) - before
        self._duplicates += len(batches) - accepted
        return accepted

    def take_batches(self, n: int, min_version: int | None = None, *, partial_at_end: bool = False
                     ) -> list[RolloutBatch] | None:
        """n buffered batches, marked delivered, or None (taking nothing) if they are not there yet:
        with admission, the n open prompts due first (rule (b) of the module docstring); else the oldest
        n buffered. First, batches of policy_version < min_version (default version - max_staleness)
        go back to the front (recycled_stale: the safety net). partial_at_end: once prompts are closed,
        none pending or leased, what's left. With admission n also becomes the batch size it counts by."""
        if self.error is not None:
            raise RuntimeError(self.error)
        self._check_trainer_joined()
        if not 1 <= n <= self.max_batches:
            raise ValueError(f"take_batches(n={n}) on a hub with max_batches={self.max_batches}: n must be "
                             "in [1, max_batches] (make the queue at least as big as one training step)")
        if min_version is None:
            min_version = 0 if self.max_staleness is None else self._version - self.max_staleness
        stale = [u for u, b in self._buffer.items() if b.policy_version < min_version]
        self._recycled_stale += self._requeue_front(stale)
        at_end = partial_at_end and self._closed and not self._pending and not self._leases
        if self._admits() and not at_end:
            if self._taken_now() >= n:      # a second step at this version: nobody leases for it until now
                self._taken = (self._version, 0)
            self.batch_size = n
            first = sorted((*self._leases, *self._buffer),
                           key=lambda u: (self._due(u), u not in self._buffer, self._order.get(u, -1)))[:n]
            if len(first) < n or any(u not in self._buffer for u in first):
                if len(self._buffer) >= n:            # the old rule would train newer ones now
                    self._waited.update(u for u in first if u not in self._buffer)
                return None
            out = [self._buffer.pop(u) for u in first]
        elif len(self._buffer) < n and not at_end:
            return None
        else:
            out = [self._buffer.popitem(last=False)[1] for _ in range(min(n, len(self._buffer)))]
        self._taken = (self._version, self._taken_now() + len(out))
        for b in out:
            self._delivered[b.uid] = self._items.pop(b.uid)
            self._forget(b.uid)
        return out

    def fail_prompts(self, worker_id: str, failures: list) -> int:
        """[(uid, cause)]: these prompts' requests failed (too long a prompt, reward_fn raised...);
        on_failure="stop": the first sets `error`, which take_batches raises and which finishes the
        run. Uids not pending or leased are ignored. Returns how many were taken."""
        taken = 0
        for uid, cause in failures:
            if uid not in self._items or uid in self._buffer:
                continue
            self._forget(uid)
            del self._items[uid]
            self._failed[uid] = str(cause)
            taken += 1
            if self.on_failure == "stop" and self.error is None:
                self.error = (f"rollout queue {self.name}: prompt uid {uid!r} failed on {worker_id}: {cause}. "
                              "The run stops (on_failure='stop'): fix the prompt, reward_fn or sampling, "
                              "or build the RolloutServer with on_failure='skip' to record and skip it")
        return taken

    def stop_run(self, cause: str) -> None:
        """The generation side failed: the run stops with `cause` (take_batches raises it at once)."""
        self.error = self.error or f"rollout queue {self.name}: {cause}"

    def failures(self) -> dict:     # uid -> cause of every prompt whose request failed
        return dict(self._failed)

    def rollback(self, trained: list, version: int) -> int:
        """A trainer restored from a checkpoint that trained exactly `trained` at policy `version`:
        uids delivered since come back (pending, at the front), `trained` ones count as delivered,
        and weights newer than `version` (the lost trainer's) are orphaned: their batches refused,
        their handle dropped. Returns the version to publish next: above every version seen and one
        more (the lost trainer's last push may have reached generators unheard of)."""
        return self._roll(trained, version, self._top_version + 1)

    def _roll(self, trained: list, version: int, top: int) -> int:
        trained, version = set(trained), int(version)
        lost = [u for u in self._delivered if u not in trained]
        if missing := [u for u in lost if self._delivered[u] is None]:
            raise ValueError(f"rollback: uids {missing[:5]} were restored as trained but the trainer's "
                             "checkpoint did not train them: resume from the newest checkpoint")
        for u in lost:
            self._items[u] = self._delivered.pop(u)
            self._leases[u] = "rollback"        # requeued below, at the front with attempts + 1
        for u in trained - self._delivered.keys():
            self._forget(u)
            self._delivered[u] = self._items.pop(u, None)
        if top > version:
            self._orphaned.append((version, top))
            self._weights = None
            orphans = [u for u, b in self._buffer.items() if _orphan_tokens(self._orphaned, b)]
            self._rolled_back += self._requeue_front(orphans)
            version = top + 1
        self._rolled_back += self.release_worker("rollback")    # delivered earliest: at the very front
        self._version = self._top_version = max(version, self._top_version)
        return self._version

    def rejoin_server(self, items: list[PromptItem], closed: bool, workers: dict, versions: list = (),
                      failed: dict | None = None, error: str | None = None) -> int:
        """After a restart: the server's prompts (known uids skipped), whether it closed them, its generators
        {worker_id: handle}, their versions, the failures {uid: cause} and error it saw. How many were added."""
        self._saw(max(versions, default=None))
        self._failed.update((u, c) for u, c in (failed or {}).items() if u not in self._delivered)
        self.error = self.error or error
        added = self.add_prompts(items, skip_known=True) if not self._closed else 0
        self._closed = self._closed or closed
        for wid, handle in workers.items():
            self.register_worker(wid, handle)
        self.awaiting.discard("server")
        return added

    def rejoin_trainer(self, trained: list, version: int, weights: Any) -> int:
        """After a restart: the live trainer's pulled uids (never issued again), its policy version and
        weights handle (its bound came first: set_max_staleness). Returns its version."""
        version = self._roll(trained, version, self._top_version)    # a live trainer knows its last version
        self.set_version(version, weights)
        self.awaiting.discard("trainer")
        return version

    def set_version(self, version: int, weights: Any = None) -> None:
        """Publish the trainer's policy version and an opaque handle to its weights (None clears it)."""
        self._version = int(version)
        self._top_version = max(self._top_version, self._version)
        self._weights = weights
        self._starved.clear()          # refused for older weights: counted again from their next ask

    def starved(self, for_s: float) -> list[str]:
        """Registered workers take_prompts refused (stale or orphaned weights) for >= for_s s, no version
        published since nor weights they could load (the collective transport's): only a push serves them."""
        return [] if self._weights is not None else sorted(
            w for w, t in self._starved.items() if w in self._workers and time.monotonic() - t >= for_s)

    def weights(self) -> tuple[int, Any]:     # (version, weights handle) as set_version published them
        return self._version, self._weights

    def register_worker(self, worker_id: str, handle: Any = None) -> None:
        """Record a generator (and a handle to it); a re-registered id (restarted) first loses its leases."""
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

    def finished(self) -> bool:
        """Prompts closed and none open or buffered; or a failure stopped the run; or the trainer is done."""
        return (self._closed and not self._items and not self.awaiting) or self.error is not None or self.trainer_done

    def stats(self) -> dict:
        return {"pending": len(self._pending), "leased": len(self._leases), "buffered": len(self._buffer),
                "delivered": len(self._delivered), "recycled_stale": self._recycled_stale,
                "waited_for_old": len(self._waited), "batch_size": self.batch_size, "admission": self._admits(),
                "duplicates": self._duplicates, "max_batches": self.max_batches, "version": self._version,
                "workers": len(self._workers), "closed": self._closed, "max_staleness": self.max_staleness,
                "trainer_done": self.trainer_done, "done_seen": self.done_seen, "failed": len(self._failed),
                "error": self.error, "rolled_back": self._rolled_back, "on_failure": self.on_failure,
                "awaiting": sorted(self.awaiting), "finished": self.finished(), "restarted": self.restarted}
