"""GeneratorPool: the generation actors of an async run, one placement group each.

    pool = GeneratorPool(model, "rollouts", namespace, gen_kwargs, resources=..., seed=0)
    pool.add(); pool.remove(wid); pool.watch()      # watch: until the queue is finished

Each generator keeps prompts_per_call prompts in flight (GenerationActor.run); the pool starts
those loops, starts one again after its actor died and came back (the queue gets the dead one's
leased prompts back at once), grows (add: a pending placement group asks the autoscaler for a
node) and shrinks (remove: drains first). After the queue's actor restarted, watch hands the ready
generators to the server's rejoin. Every wait has a timeout. Hardware: CPU or GPUs.
"""

from __future__ import annotations

import time
import uuid

import ray

from actors import placement
from actors.generation import GenerationActor
from minirl.weights import SyncError


class GeneratorPool:
    def __init__(self, model: str, queue, queue_name: str, namespace: str, gen_kwargs: dict, *,
                 resources: dict, seed: int = 0, prompts_per_call: int = 8, call_timeout_s: float = 600.0,
                 ready_timeout_s: float = 600.0):
        self.model, self.queue, self.name, self.namespace = model, queue, queue_name, namespace
        self.gen_kwargs, self.resources, self.seed, self._replicas = gen_kwargs, resources, seed, 0
        self.per_call, self.timeout, self.ready_timeout = prompts_per_call, call_timeout_s, ready_timeout_s
        self.generators: dict[str, dict] = {}   # worker_id -> {"actor", "pg", "ready", "run", ...}
        self.failure_causes: dict[str, int] = {}     # what runs that raised said, and how often
        self.stats = {"prompts": 0, "tokens": 0, "failures": 0, "failed_starts": 0, "lost_runs": 0,
                      "stale_waits": 0, "loads": 0, "load_s": 0.0, "loads_in_flight": 0, "busy_s": 0.0, "serve_s": 0.0}
        self.stopped = False                    # stop(): watch() returns
        self.failed, self.error = {}, None      # the queue's failures and error as last seen: a rejoin's

    def add(self, resources: dict | None = None, *, wait: bool = True) -> str:
        """One more replica in its own placement group (pending until the cluster can place it);
        it loads the current weights before it takes prompts. wait: until it is ready, else it and its
        group are removed with the error."""
        wid = f"gen-{uuid.uuid4().hex[:8]}"
        bundle = dict(resources or self.resources)
        pg = placement.create([bundle], strategy="STRICT_PACK", name=f"{self.name}-{wid}")
        try:               # the actor takes what its bundle has (a GPU-only bundle: no CPU)
            actor = GenerationActor.options(**placement.on_bundle(
                pg, 0, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0))).remote(
                self.model, wid, self.name, self.namespace, {**self.gen_kwargs, "seed": self.seed + self._replicas},
                self.timeout, getattr(self.queue, "token", None))
            self._replicas += 1
            self.generators[wid] = {"actor": actor, "pg": pg, "ready": False, "run": None,
                                    "info": actor.info.remote(), "retry_at": 0.0}
            if wait:
                self.wait_ready(wid)
        except BaseException:    # not made, not placed in time, or its start failed: nothing left to start later
            if (g := self.generators.pop(wid, None)) is not None:
                ray.kill(g["actor"], no_restart=True)
            placement.remove(pg)
            raise
        return wid

    def wait_ready(self, wid: str) -> None:
        g = self.generators[wid]
        placement.wait_ready(g["pg"], self.ready_timeout, f"generator {wid}")
        try:
            placement.get(g["info"], self.ready_timeout, f"generator {wid}")
        except ray.exceptions.RayActorError as e:      # its __init__ raised: say why, not just "died"
            raise RuntimeError(f"generator {wid} failed to start: {placement.cause(e)}") from None
        g["ready"] = True

    def remove(self, worker_id: str | None = None, *, timeout_s: float | None = None) -> str:
        """Drain a replica (its batch in hand is kept), then stop it and free its placement group.
        Default: the newest replica."""
        wid = worker_id or list(self.generators)[-1]
        g = self.generators[wid]
        g["draining"] = True
        ray.get(g["actor"].stop.remote(), timeout=self.timeout)
        if g["run"] is not None:
            ray.wait([g["run"]], timeout=timeout_s or self.timeout)
        placement.call(self.queue.unregister_worker, wid, timeout_s=self.timeout, what="rollout queue")
        ray.kill(g["actor"], no_restart=True)
        placement.remove(g["pg"])
        del self.generators[wid]
        return wid

    def stop(self, thread) -> None:
        """End watch() (running in `thread`, if any) and wait for it."""
        self.stopped = True
        if thread is not None:
            thread.join(self.timeout)

    def watch(self, timeout_s: float | None = None, rejoin=None) -> None:
        """Keep every ready generator's loop running until the queue is finished; rejoin(ready
        generators {worker_id: actor}) is called when the queue's actor restarted and awaits the server.
        add() and remove() may run in another thread meanwhile: it iterates over copies of the pool."""
        deadline = None if timeout_s is None else time.time() + timeout_s
        failing = None                            # since when a rejoin has failed
        while not self.stopped:
            if not ray.is_initialized():          # the driver shut Ray down: never auto-start another
                raise RuntimeError("rollout server: Ray was shut down while the pool ran")
            q = placement.call(self.queue.stats, timeout_s=self.timeout, what="rollout queue")
            if q["failed"] > len(self.failed):    # kept for a restarted queue, which lost them
                self.failed = placement.call(self.queue.failures, timeout_s=self.timeout, what="rollout queue")
            self.error = q["error"] or self.error
            if "server" in q["awaiting"] and rejoin is not None:
                try:
                    rejoin({w: g["actor"] for w, g in list(self.generators.items()) if g["ready"]})
                    failing = None
                except ray.exceptions.RayError as e:
                    failing = failing or time.time()    # the queue died again, or Ray lost an argument
                    if time.time() - failing > self.timeout or not _transient(e):
                        raise
                    continue                            # made again on the next turn
            finished = q["finished"]
            for wid, g in list(self.generators.items()):
                if not g["ready"] and ray.wait([g["info"]], timeout=0)[0]:
                    self._started(wid)    # placed (perhaps on a node the autoscaler just added), or failed
                if (g["ready"] and g["run"] is None and not finished and not g.get("draining")
                        and time.time() >= g["retry_at"]):
                    g["run"] = g["actor"].run.remote(self.per_call)
            runs = {g["run"]: w for w, g in list(self.generators.items()) if g["run"] is not None}
            if not runs and finished:
                return
            for ref in ray.wait(list(runs), num_returns=1, timeout=0.5)[0] if runs else ():
                self._finished_run(runs[ref], ref)
            if not runs:
                time.sleep(0.2)
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"rollout server: not finished after {timeout_s} s")

    def _started(self, wid: str) -> None:
        """A generator added without waiting answered: ready, or its start failed (it is removed, the
        cause counted; with no generator left, the run stops with it)."""
        g = self.generators[wid]
        try:
            placement.get(g["info"], self.timeout, f"generator {wid}")
            g["ready"] = True
            return
        except ray.exceptions.RayActorError as e:
            self._drop(wid, f"failed to start: {placement.cause(e)[:300]}")

    def _drop(self, wid: str, why: str) -> None:
        """A generator that cannot start: removed with its placement group, the cause counted; with no
        generator left, the run stops with it."""
        self.failure_causes[why] = self.failure_causes.get(why, 0) + 1
        self.stats["failed_starts"] += 1
        g = self.generators.pop(wid)
        ray.kill(g["actor"], no_restart=True)
        placement.remove(g["pg"])
        if not self.generators:
            raise RuntimeError(f"rollout server: generator {wid} {why}; no generator is left")

    def _finished_run(self, wid: str, ref) -> None:
        g = self.generators.get(wid)
        if g is not None:
            g["run"] = None
        try:
            for k, v in ray.get(ref).items():
                self.stats[k] = self.stats.get(k, 0) + v
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            if getattr(e, "actor_init_failed", False) and g is not None:   # restarted, and its start failed:
                placement.call(self.queue.unregister_worker, wid, timeout_s=self.timeout, what="rollout queue")
                return self._drop(wid, f"failed to restart: {placement.cause(e)[:300]}")   # gone for good
            lost = isinstance(e, ray.exceptions.RayActorError)      # its actor died or is restarting
            self.stats["lost_runs" if lost else "failures"] += 1
            if not lost:                                           # run() raised: what it said, counted
                why = placement.cause(e)[:300]
                self.failure_causes[why] = self.failure_causes.get(why, 0) + 1
                if isinstance(e, SyncError) or isinstance(getattr(e, "cause", None), SyncError):   # as a push's:
                    raise RuntimeError(f"rollout server: generator {wid}: {why}") from None   # run again, it would
                    # lease on the weights that failed their check
            placement.call(self.queue.release_worker, wid, timeout_s=self.timeout, what="rollout queue")
            if g is not None:
                g["retry_at"] = time.time() + 1.0          # let the actor restart



def _transient(error: Exception) -> bool:
    """A fault of the call, not of its content: the actor died, or Ray could not read an argument."""
    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.RaySystemError)) or isinstance(
        getattr(error, "cause", None), ray.exceptions.RaySystemError)
