"""RolloutServer: the generation side of the async backend, a pool of GenerationActors (one
placement group each) that feed a named rollout queue.

    server = RolloutServer(model, "rollouts", reward_fn=fn, num_generators=2, group_size=8)
    server.submit(prompts, metadata=answers)
    server.run()                     # returns once the trainer has taken every prompt

Each generator runs its own lease -> generate -> put loop; the server starts those loops,
restarts one whose actor died (the queue gets its leased prompts back), grows the pool
(add_generator: a pending placement group asks the autoscaler for a node) and shrinks it
(remove_generator: drains first). Every wait has a timeout. Hardware: CPU or GPUs.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import ray

from actors import placement
from actors.generation import GenerationActor
from actors.queue import DEFAULT_NAMESPACE, create_queue


class RolloutServer:
    """RolloutServer(model, queue_address, reward_fn=..., num_generators, group_size, sampling,
    queue_size, prompts_per_call, resources, seed, llm_kwargs): reward_fn follows
    parse_vllm_outputs' contract, `sampling` are SamplingParams kwargs, llm_kwargs go to each
    vllm.LLM, `resources` is one replica's bundle (default {"CPU": 1, "GPU": 1} on a GPU cluster)."""

    def __init__(self, model: str, queue_address: str = "minirl-rollouts", *, reward_fn,
                 num_generators: int = 1, group_size: int = 8, sampling: dict | None = None,
                 queue_size: int = 64, prompts_per_call: int = 8, resources: dict | None = None,
                 namespace: str = DEFAULT_NAMESPACE, seed: int = 0, call_timeout_s: float = 600.0,
                 ready_timeout_s: float = 600.0, llm_kwargs: dict | None = None):
        from minirl.trainer import check_model_path, model_identity
        placement.ray_init(namespace)
        self.model, self.name, self.namespace = check_model_path(model), queue_address, namespace
        self.per_call, self.timeout, self.ready_timeout = prompts_per_call, call_timeout_s, ready_timeout_s
        self.resources = resources or placement.default_bundle()
        self.queue = create_queue(queue_address, max_batches=queue_size, namespace=namespace,
                                  model_id=model_identity(self.model))
        self.gen_kwargs = {"reward_fn": reward_fn, "group_size": group_size, "sampling": sampling,
                           **(llm_kwargs or {})}
        self.seed, self._replicas = seed, 0
        self.generators: dict[str, dict] = {}   # worker_id -> {"actor", "pg", "ready", "run", ...}
        self.stats = {"prompts": 0, "tokens": 0, "failures": 0, "stale_waits": 0}
        self._thread, self._error = None, None
        for wid in [self.add_generator(wait=False) for _ in range(num_generators)]:
            self._wait_ready(wid)

    # -- the pool ------------------------------------------------------------------------------

    def add_generator(self, resources: dict | None = None, *, wait: bool = True) -> str:
        """One more replica in its own placement group (pending until the cluster can place it);
        it loads the current weights before it takes prompts."""
        wid = f"gen-{uuid.uuid4().hex[:8]}"
        bundle = dict(resources or self.resources)
        pg = placement.create([bundle], strategy="STRICT_PACK", name=f"{self.name}-{wid}")
        actor = GenerationActor.options(**placement.on_bundle(
            pg, 0, num_cpus=bundle.get("CPU", 1), num_gpus=bundle.get("GPU", 0))).remote(
            self.model, wid, self.name, self.namespace, {**self.gen_kwargs, "seed": self.seed + self._replicas},
            self.timeout)
        self._replicas += 1
        self.generators[wid] = {"actor": actor, "pg": pg, "ready": False, "run": None,
                                "info": actor.info.remote(), "retry_at": 0.0}
        if wait:
            self._wait_ready(wid)
        return wid

    def _wait_ready(self, wid: str) -> None:
        g = self.generators[wid]
        placement.wait_ready(g["pg"], self.ready_timeout, f"generator {wid}")
        placement.get(g["info"], self.ready_timeout, f"generator {wid}")
        g["ready"] = True

    def remove_generator(self, worker_id: str | None = None, *, timeout_s: float | None = None) -> str:
        """Drain a replica (its batch in hand is kept), then stop it and free its placement group.
        Default: the newest replica."""
        wid = worker_id or list(self.generators)[-1]
        g = self.generators[wid]
        g["draining"] = True
        ray.get(g["actor"].stop.remote(), timeout=self.timeout)
        if g["run"] is not None:
            ray.wait([g["run"]], timeout=timeout_s or self.timeout)
        placement.get(self.queue.unregister_worker.remote(wid), self.timeout, "rollout queue")
        ray.kill(g["actor"], no_restart=True)
        placement.remove(g["pg"])
        del self.generators[wid]
        return wid

    # -- prompts and the run ---------------------------------------------------------------------

    def submit(self, prompts: list, *, metadata: list | None = None, uids: list | None = None,
               close: bool = True, skip_known: bool = False) -> int:
        """Add prompts (text or token ids) to the queue; close=True says no more come. skip_known
        skips uids the queue already knows (after restore()). Returns how many were added."""
        from minirl.hub import PromptItem
        for name, seq in (("metadata", metadata), ("uids", uids)):
            if seq is not None and len(seq) != len(prompts):
                raise ValueError(f"{len(seq)} {name} entries for {len(prompts)} prompts")
        items = [PromptItem(uid=i if uids is None else uids[i], prompt=p,
                            metadata=None if metadata is None else metadata[i]) for i, p in enumerate(prompts)]
        added = placement.get(self.queue.add_prompts.remote(items, skip_known=skip_known), self.timeout, "rollout queue")
        if close:
            placement.get(self.queue.close_prompts.remote(), self.timeout, "rollout queue")
        return added

    def restore(self, checkpoint) -> dict:
        """Resume the prompt bookkeeping of a checkpointed async run (TrainWorker.save_checkpoint):
        prompts trained before it never come back, the rollouts it had queued return to the
        queue. `checkpoint`: a checkpoint directory or a Checkpointer root (its latest)."""
        from minirl.checkpoint import Checkpointer, read_state
        path = checkpoint if (Path(checkpoint) / "state.json").exists() else Checkpointer(checkpoint).latest()
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint under {checkpoint}")
        ck = read_state(path)
        trained, queued = ck["state"]["trained_uids"], ck["objects"].get("queue", {}).get("buffered", [])
        placement.get(self.queue.restore.remote(trained, queued), self.timeout, "rollout queue")
        return {"path": ck["path"], "trained": len(trained), "queued": len(queued)}

    def run(self, prompts: list | None = None, *, metadata=None, uids=None, timeout_s: float | None = None,
            block: bool = True) -> dict:
        """Generate until the trainer has taken every prompt; block=False runs the pool from a
        background thread (join with wait()). Returns the server's counters."""
        if prompts is not None:
            self.submit(prompts, metadata=metadata, uids=uids)
        self._thread = threading.Thread(target=self._watch, args=(timeout_s,), daemon=True)
        self._thread.start()
        return self.wait() if block else dict(self.stats)

    def wait(self, timeout_s: float | None = None) -> dict:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"rollout server still running after {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"rollout server failed: {self._error}") from self._error
        return dict(self.stats)

    def wait_trainer_done(self, timeout_s: float = 600.0) -> None:
        """Block until the trainer says it trained and synced its last batch (the run's end)."""
        if not placement.get(self.queue.wait_trainer_done.remote(timeout_s), timeout_s + 30, "rollout queue"):
            raise TimeoutError(f"the trainer did not finish within {timeout_s} s of the last rollout")

    def _watch(self, timeout_s):
        try:
            deadline = None if timeout_s is None else time.time() + timeout_s
            while True:
                finished = placement.get(self.queue.finished.remote(), self.timeout, "rollout queue")
                for wid, g in list(self.generators.items()):
                    if not g["ready"] and ray.wait([g["info"]], timeout=0)[0]:
                        g["ready"] = True     # placed (perhaps on a node the autoscaler just added)
                    if (g["ready"] and g["run"] is None and not finished and not g.get("draining")
                            and time.time() >= g["retry_at"]):
                        g["run"] = g["actor"].run.remote(self.per_call)
                runs = {g["run"]: w for w, g in self.generators.items() if g["run"] is not None}
                if not runs and finished:
                    return
                for ref in ray.wait(list(runs), num_returns=1, timeout=0.5)[0] if runs else ():
                    self._finished_run(runs[ref], ref)
                if not runs:
                    time.sleep(0.2)
                if deadline is not None and time.time() > deadline:
                    raise TimeoutError(f"rollout server: not finished after {timeout_s} s ({self.queue_stats()})")
        except BaseException as e:    # surfaced by wait()
            self._error = e

    def _finished_run(self, wid: str, ref) -> None:
        g = self.generators.get(wid)
        if g is not None:
            g["run"] = None
        try:
            for k, v in ray.get(ref).items():
                self.stats[k] += v
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            self.stats["failures"] += 1
            self.last_failure = repr(e)[:500]
            placement.get(self.queue.release_worker.remote(wid), self.timeout, "rollout queue")
            if g is not None:
                g["retry_at"] = time.time() + 1.0          # let the actor restart

    def queue_stats(self) -> dict:
        return placement.get(self.queue.stats.remote(), self.timeout, "rollout queue")

    def shutdown(self, *, remove_queue: bool = False) -> None:
        for g in self.generators.values():
            ray.kill(g["actor"], no_restart=True)
            placement.remove(g["pg"])
        self.generators.clear()
        if remove_queue:
            ray.kill(self.queue)
