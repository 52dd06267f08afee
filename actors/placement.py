"""Placement groups for minirl's two layouts, with timeouts and clear errors.

- Co-located: one placement group of N bundles; bundle i hosts rank i (trainer + its engine).
- Async: one placement group per generation replica (so a lost node only reschedules that
  replica, and a pending group asks the autoscaler for a node), trainers on their own.

Bundles ask for a GPU when the cluster has GPUs, else CPUs only, so the same code runs on a
CPU test cluster. Which device a process uses is decided inside it (torch.cuda.is_available()).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def ray_init(namespace: str = "minirl", logging_level: int = logging.INFO) -> None:
    """Join (or start) a Ray cluster unless this process already has; logging_level: Ray's own
    logger in this process (logging.WARNING: no "Started a local Ray instance" line)."""
    if not ray.is_initialized():
        ray.init(namespace=namespace, log_to_driver=True, logging_level=logging_level)


def require_ray() -> None:
    """Without this, Ray would quietly start a fresh local cluster that holds no queue."""
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized: call ray.init(address=...) with the cluster "
                           "that runs the rollout queue first")


def get(ref, timeout_s: float, what: str):
    """ray.get with a timeout whose error names what did not answer."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"{what} did not answer within {timeout_s} s") from e


def call(method, *args, timeout_s: float, what: str, restart_s: float = 60.0, **kwargs):
    """method.remote(*args, **kwargs), got within timeout_s; if its actor dies (RayActorError) the call
    is made again, for up to restart_s after that death (a call may have waited long before it), so it
    lands on the restarted actor (the rollout queue's)."""
    deadline = None
    while True:
        try:
            return get(method.remote(*args, **kwargs), timeout_s, what)
        except ray.exceptions.RayActorError:
            deadline = deadline or time.monotonic() + restart_s
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def cause(error: Exception) -> str:
    """The real cause of an actor's death (what its __init__ raised), not Ray's wrapper text."""
    inner = getattr(error, "cause", None)
    text = str(getattr(inner, "error_message", None) or inner or error)
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
    return lines[-1] if lines else text


def cluster_gpus() -> float:
    return ray.cluster_resources().get("GPU", 0.0)


def default_bundle(gpus: float | None = None, cpus: float = 1.0, extra: dict | None = None) -> dict:
    """{"CPU": cpus, "GPU": 1} on a GPU cluster, {"CPU": cpus} otherwise (plus `extra`)."""
    if gpus is None:
        gpus = 1.0 if cluster_gpus() >= 1 else 0.0
    b = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **(extra or {})}
    return b


def create(bundles: list[dict], *, strategy: str = "PACK", name: str = ""):
    """Create a placement group (it may stay pending until the autoscaler adds nodes)."""
    return placement_group(bundles, strategy=strategy, name=name)


def wait_ready(pg, timeout_s: float, what: str) -> None:
    """Block until `pg` is placed, or raise TimeoutError naming what is missing."""
    if pg.wait(timeout_seconds=timeout_s):
        return
    table = placement_group_table(pg)
    raise TimeoutError(f"{what}: placement group {table.get('bundles')} still {table.get('state')} "
                       f"after {timeout_s} s; the cluster has {ray.available_resources()} free. "
                       "Add nodes (or let the autoscaler add them) or ask for fewer resources.")


def is_ready(pg) -> bool:
    return placement_group_table(pg).get("state") == "CREATED"


def on_bundle(pg, index: int, **options) -> dict:
    """.options(...) keyword arguments that pin an actor to bundle `index` of `pg`."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index), **options}


def remove(pg) -> None:
    remove_placement_group(pg)


class RankActor:
    """Base for actors that form one torch.distributed world (co-located workers, trainers):
    rank 0 names an address, every rank gets RANK / WORLD_SIZE / MASTER_* before it builds its
    process group. One GPU (or none) is visible per actor, so LOCAL_RANK is 0."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def address(self) -> tuple[str, int]:
        """Rank 0: the host and port of the world's rendezvous, already listening (kept by this actor)."""
        from minirl.distributed import listen
        ip = ray.util.get_node_ip_address()
        self._rendezvous = listen(ip, self.world_size)
        return ip, self._rendezvous.port

    def configure(self, master_addr: str, master_port: int) -> None:
        import os
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))

    def run(self, fn, *args):
        """Run fn(*args) here (SPMD: every rank at once)."""
        return fn(*args)


def start_ranks(actor_cls, num: int, *, bundle: dict | None = None, timeout_s: float = 600.0,
                args: tuple = (), setup: Callable | None = None):
    """One placement group of `num` bundles, one actor_cls(rank, num, *args) per bundle, wired
    into one world, then setup(actor) (an actor call) on each. Returns (pg, actors). If any of it
    fails, the actors and their group are removed before the error is raised."""
    ray_init()
    bundle, actors = bundle or default_bundle(), []
    pg = create([dict(bundle)] * num, strategy="PACK")
    try:
        wait_ready(pg, timeout_s, f"{num} training or co-located ranks")
        actors = [actor_cls.options(**on_bundle(pg, i, num_cpus=bundle.get("CPU", 1),
                                                num_gpus=bundle.get("GPU", 0))).remote(i, num, *args)
                  for i in range(num)]
        addr, port = ray.get(actors[0].address.remote(), timeout=timeout_s)
        ray.get([a.configure.remote(addr, port) for a in actors], timeout=timeout_s)
        ray.get([setup(a) for a in actors] if setup else [], timeout=timeout_s)
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove(pg)
        raise
    return pg, actors
