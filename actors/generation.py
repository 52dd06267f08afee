"""GenerationActor: a Ray actor around one minirl.generator.Generator that feeds the queue.

    actor = GenerationActor.options(...).remote(model, worker_id, queue_name, namespace, gen_kwargs)
    ray.get(actor.run.remote(8))   # <= 8 prompts in flight, leased as others finish; until the end

The actor restarts after a crash (max_restarts=-1): __init__ registers with the queue again
(which releases what the dead one had leased) and loads the trainer's latest weights from the
object store before it generates, checked against the trainer's probe log-probs as every push is.
A prompt whose request fails (too long, reward_fn raised or ran past reward_timeout_s) is never
retried: it goes to the queue's fail_prompts with its cause.
`run` generates continuously (Generator.serve): each finished group is put as it finishes, and
new prompts are leased whenever fewer than max_prompts are open. Weights arrive by
`load_from_store` (object store; fetched first, then loaded) or `recv_broadcast` (collective
group) on another of the actor's threads and are applied between two engine steps while requests
run (generation pauses for the load alone). Hardware: one GPU or CPU cores.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import replace

import ray

from actors import placement
from actors.queue import connect_queue


@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)
class GenerationActor:
    def __init__(self, model: str, worker_id: str, queue_name: str, namespace: str,
                 gen_kwargs: dict, call_timeout_s: float = 600.0, token: str | None = None):
        from minirl.episodes import EpisodeConfig
        from minirl.generator import Generator
        from minirl.model import model_identity
        self.worker_id, self.timeout = worker_id, call_timeout_s
        self._stop = threading.Event()
        self.queue = connect_queue(queue_name, namespace=namespace, token=token)    # the run's token
        self._call(self.queue.check_model, model_identity(model))
        kw = dict(gen_kwargs)
        kw["episode_config"] = replace(kw.get("episode_config") or EpisodeConfig(),   # reward_fn off the loop
                                       reward_timeout_s=kw.pop("reward_timeout_s", None))
        self.gen = Generator(model, **kw)
        self.group = self.group_prefix = None      # the broadcast group it joined (collective transport)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._bootstrap()            # before registering: a push told of it meanwhile would fail (restarting)
        self._call(self.queue.register_worker, worker_id, ray.get_runtime_context().current_actor)
        self._bootstrap()            # and after: a push that did not see it registered published before this

    def _call(self, method, *args, wait_s: float = 0.0, **kwargs):
        """A queue call, made again if the queue's actor restarts meanwhile (placement.call); wait_s: how
        long the call itself may wait in the queue (the queue's own timeout ends it first)."""
        return placement.call(method, *args, timeout_s=wait_s + self.timeout,
                              what=f"generator {self.worker_id}: the rollout queue", **kwargs)

    def _bootstrap(self) -> bool:
        """Load the trainer's latest weights if the queue holds newer ones than the engine (object
        store), verified like a push: SyncError unless the engine's probe log-probs match the trainer's.
        Weights lost with their trainer (killed; Ray frees what it owned) are not loaded: the engine keeps
        its own and its version, and the restored trainer publishes anew (False)."""
        from minirl.weights import check_sync, probe_gap
        version, w = self._call(self.queue.weights)
        if not w or version <= self.gen.policy_version:
            return False
        try:
            ack = self.load_from_store(version, w["refs"], w["probe_ids"])
        except ray.exceptions.ObjectLostError:    # OwnerDiedError: fetched before any load, nothing changed
            return False
        if w["logprobs"] is not None:
            check_sync(probe_gap(w["logprobs"], ack["probe_logprobs"]), False, tolerance=w.get("tolerance"),
                       engine_dtype=w["dtype"], where=f"generator {self.worker_id} (loading the latest weights)",
                       version=version)
        return True

    def run(self, max_prompts: int) -> dict:
        """Generate with max_prompts prompts in flight, putting each group as it finishes, until the
        queue is finished (or stop() was called, also before this run began: a stop is for good).
        Leases nothing while the engine's weights are too stale (it loads newer ones from the object
        store, or waits for the next broadcast). Counts."""
        stats, loads = {"prompts": 0, "tokens": 0, "stale_waits": 0}, dict(self.gen.stats)

        def lease(k: int):
            items = self._call(self.queue.take_prompts, self.worker_id, k, self.gen.policy_version, 1.0,
                               call=uuid.uuid4().hex)    # made again: the same lease (RolloutQueueActor._once)
            if items is None:                    # too stale to start: newer weights first
                stats["stale_waits"] += 1
                if not self._bootstrap():
                    time.sleep(0.1)
                return []
            return None if not items and self._call(self.queue.finished) else items

        def deliver(batches: list, failed: list) -> None:
            for r in (r for b in batches for r in b):
                r.info["worker_id"] = self.worker_id
            if failed:                           # never retried: the queue's on_failure decides
                self._call(self.queue.fail_prompts, self.worker_id, failed)
            if batches:
                self._call(self.queue.put, self.worker_id, batches, self.timeout, wait_s=self.timeout)
            stats["prompts"] += len(batches) + len(failed)
            stats["tokens"] += sum(len(r.completion_ids) for b in batches for r in b)
        self.gen.serve(lease, deliver, target=max_prompts, stop=self._stop, join_s=self.timeout)
        return {**stats, **{k: v - loads[k] for k, v in self.gen.stats.items()}}   # this run's loads

    def stop(self) -> None:
        """Drain for good: run() leases no more and returns once the open prompts are delivered; a run
        that starts after this (the pool's, sent before it saw the replica draining) returns at once."""
        self._stop.set()

    # -- weights -----------------------------------------------------------------------------

    def load_from_store(self, version: int, refs: list, probe_ids: list | None = None) -> dict:
        """refs: one ObjectRef per packed bucket (minirl.transport.pack_bucket), owned by the trainer."""
        from minirl.transport import unpack_bucket
        packed = [ray.get(ref, timeout=self.timeout) for ref in refs]     # fetched before the pause
        buckets = (unpack_bucket(p, self.gen.device) for p in packed)
        # the trainer's push wins, also over newer weights (after its resume)
        return self.gen.load_weights(version, buckets, probe_ids=probe_ids, timeout_s=self.timeout)

    def join_group(self, host: str, port: int, rank: int, world_size: int, prefix: str,
                   timeout_s: float) -> bool:
        from minirl.transport import BroadcastGroup
        if self.group is not None:
            self.group.close()
        self.group = BroadcastGroup(host, port, rank, world_size, prefix=prefix,
                                    device=self.gen.device, timeout_s=timeout_s)
        self.group_prefix = prefix
        return True

    def recv_broadcast(self, version: int, metas: list, probe_ids: list | None = None) -> dict:
        """Receive len(metas) buckets from the trainer over the collective group and load them."""
        if self.group is None:
            raise RuntimeError(f"generator {self.worker_id} is in no broadcast group")
        return self.gen.load_weights(version, (self.group.recv(m) for m in metas), probe_ids=probe_ids,
                                     timeout_s=self.timeout)

    # -- introspection ------------------------------------------------------------------------

    def info(self) -> dict:
        return {"worker_id": self.worker_id, "version": self.gen.policy_version, "restarted": self.restarted,
                "device": str(self.gen.device), "pid": os.getpid(), "group": self.group_prefix}

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.gen.prompt_logprobs(token_ids)

    def evaluate(self, prompts: list, answers: list, reward_fn, eval_kwargs: dict) -> dict:
        """minirl.evaluation.evaluate on this engine's current weights (eval/policy_version says which)."""
        from minirl.evaluation import evaluate
        return self.gen.exclusive(lambda: {**evaluate(self.gen.llm, prompts, answers, reward_fn, **eval_kwargs),
                                           "eval/policy_version": self.gen.policy_version}, self.timeout)
