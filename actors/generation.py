"""GenerationActor: a Ray actor around one minirl.generator.Generator, fed by the rollout hub.

    actor = GenerationActor.options(...).remote(model, worker_id, queue_name, gen_kwargs)
    n = ray.get(actor.work.remote(8))      # lease <= 8 prompts, generate, push batches

The actor restarts after a crash (max_restarts=-1); its __init__ re-registers with the hub and
loads the trainer's latest weights from the object store before it generates again. Weights
arrive by `load_from_store` (object store) or `recv_broadcast` (collective group). They may
come while `work` waits on a full queue (backpressure) - the trainer must not wait on a
generator that waits on the trainer - so calls run on a few threads and a lock keeps every
weight load out of the engine's generate. Hardware: one GPU or CPU cores.
"""

from __future__ import annotations

import os
import threading
import time

import ray

from actors.queue import connect_queue


@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)
class GenerationActor:
    def __init__(self, model: str, worker_id: str, queue_name: str, namespace: str,
                 gen_kwargs: dict, call_timeout_s: float = 600.0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from minirl.generator import Generator
        self.worker_id, self.timeout = worker_id, call_timeout_s
        self._engine = threading.Lock()          # generate and weight loads never overlap
        self.hub = connect_queue(queue_name, namespace=namespace)
        from minirl.colocated import model_identity
        self._get(self.hub.check_model.remote(model_identity(model)))
        self.gen = Generator(model, **gen_kwargs)
        self.group = None
        self.restarts = ray.get_runtime_context().was_current_actor_reconstructed
        self._bootstrap()
        me = ray.get_runtime_context().current_actor
        self._get(self.hub.register_worker.remote(worker_id, me))

    def _get(self, ref, timeout=None):
        try:
            return ray.get(ref, timeout=timeout or self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(f"generator {self.worker_id}: the rollout hub did not answer within "
                               f"{timeout or self.timeout} s") from e

    def _bootstrap(self) -> bool:
        """Load the trainer's latest weights if the hub has some newer than ours."""
        version, refs = self._get(self.hub.weights.remote())
        if refs and version > self.gen.version:
            self.load_from_store(version, refs)
            return True
        return False

    # -- generation --------------------------------------------------------------------------

    def work(self, max_prompts: int, max_staleness: int | None = None) -> dict:
        """Lease up to max_prompts prompts, generate, push the batches (blocking while the queue is
        full). Returns counts; generates nothing when its weights are too stale to be used."""
        hub_version = self._get(self.hub.version.remote())
        if max_staleness is not None and hub_version - self.gen.version > max_staleness:
            if not self._bootstrap():
                return {"prompts": 0, "stale": True, "version": self.gen.version}
        items = self._get(self.hub.take_prompts.remote(self.worker_id, max_prompts, 1.0))
        if not items:
            return {"prompts": 0, "stale": False, "version": self.gen.version}
        t0 = time.perf_counter()
        with self._engine:
            batches = self.gen.generate(items)   # stamped with the version the engine holds
        for b in batches:
            for r in b:
                r.info["worker_id"] = self.worker_id
        t1 = time.perf_counter()
        self._get(self.hub.put.remote(self.worker_id, batches, self.timeout))
        tokens = sum(len(r.completion_ids) for b in batches for r in b)
        return {"prompts": len(items), "stale": False, "version": self.gen.version, "tokens": tokens,
                "generate_s": t1 - t0, "put_s": time.perf_counter() - t1}

    # -- weights -----------------------------------------------------------------------------

    def load_from_store(self, version: int, refs: list) -> dict:
        """refs: one ObjectRef per packed bucket (minirl.transport.pack_bucket), owned by the trainer."""
        from minirl.transport import unpack_bucket
        t0 = time.perf_counter()
        buckets = (unpack_bucket(ray.get(ref, timeout=self.timeout), self.gen.device) for ref in refs)
        with self._engine:
            if version <= self.gen.version:      # a bootstrap raced a push: already current
                return {"load_s": 0.0, "total_s": 0.0, "version": self.gen.version}
            out = self.gen.load_weights(version, buckets)
        return {**out, "total_s": time.perf_counter() - t0, "version": version}

    def join_group(self, host: str, port: int, rank: int, world_size: int, prefix: str,
                   timeout_s: float) -> bool:
        from minirl.transport import BroadcastGroup
        if self.group is not None:
            self.group.close()
        self.group = BroadcastGroup(host, port, rank, world_size, prefix=prefix,
                                    device=self.gen.device, timeout_s=timeout_s)
        return True

    def recv_broadcast(self, version: int, metas: list) -> dict:
        """Receive len(metas) buckets from the trainer over the collective group and load them."""
        if self.group is None:
            raise RuntimeError(f"generator {self.worker_id} is in no broadcast group")
        t0 = time.perf_counter()
        with self._engine:
            out = self.gen.load_weights(version, (self.group.recv(m) for m in metas))
        return {**out, "total_s": time.perf_counter() - t0, "version": version}

    # -- introspection ------------------------------------------------------------------------

    def info(self) -> dict:
        return {"worker_id": self.worker_id, "version": self.gen.version, "restarted": self.restarts,
                "device": str(self.gen.device), "pid": os.getpid()}

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.gen.prompt_logprobs(token_ids)
