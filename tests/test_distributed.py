"""minirl.distributed's rendezvous port (CPU, no Ray): held from the moment it is named, so two runs
on one host never race for it, and shared by the process group this process builds on it; and a
queue error on rank 0 of a multi-rank async trainer raised on every rank (two gloo processes).

Run: `pytest tests/test_distributed.py`. Hardware: CPU.
"""

import socket
import time

import pytest
import torch.distributed as dist

from minirl.distributed import free_port, listen


def test_the_rendezvous_port_is_held_from_the_moment_it_is_named():
    store = listen("127.0.0.1", 1, timeout_s=10)
    with socket.socket() as s, pytest.raises(OSError):      # another process could not take it now
        s.bind(("127.0.0.1", store.port))
    with socket.socket() as s:                              # free_port's is free again until bound
        s.bind(("127.0.0.1", free_port()))
    # what init_process_group's env:// / tcp:// rendezvous does on rank 0 shares the listening server
    shared, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{store.port}?rank=0&world_size=1"))
    shared.set("k", "v")
    assert (rank, world) == (0, 1) and store.get("k") == b"v"


def _pull_where_rank0_fails(rank: int, port: int, out) -> None:
    """One rank of test_a_failed_pull_on_rank_0_raises_on_every_rank (spawned)."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from actors.training import TrainWorker
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    from minirl.distributed import on_rank0
    me = SimpleNamespace(rank=rank, world_size=2)
    out[f"values{rank}"] = (on_rank0(lambda: 5, me, "count"), on_rank0(lambda: 5, me, "count", share=False))
    worker = object.__new__(TrainWorker)          # only what pull_rollouts reads
    worker.rank, worker.batch_size, worker.pull_timeout, worker.trained_uids = (
        SimpleNamespace(rank=rank, world_size=2), 1, 1.0, [])
    worker.queue = SimpleNamespace(get=None)

    def unreachable(method, *args, **kwargs):
        raise TimeoutError("rollout queue did not answer within 601 s")
    worker._q = unreachable
    t0 = time.time()
    try:
        next(worker.pull_rollouts())
        out[rank] = ("no error", "", time.time() - t0)
    except Exception as e:
        out[rank] = (type(e).__name__, str(e), time.time() - t0)
    while rank == 0 and 1 not in out and time.time() - t0 < 40:   # an actor lives on after its call failed
        time.sleep(0.1)
    dist.destroy_process_group()


def test_a_failed_pull_on_rank_0_raises_on_every_rank():
    """Rank 0 pulls for every rank: when its queue call fails, the other ranks raise its error at once
    instead of waiting in the broadcast until the process group's timeout."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_pull_where_rank0_fails, args=(port, out), nprocs=2, join=True)
    assert out["values0"] == (5, 5) and out["values1"] == (5, None)     # shared, or rank 0's alone
    assert out[0][:2] == ("TimeoutError", "rollout queue did not answer within 601 s")
    assert out[1][0] == "RuntimeError" and "rank 0 could not pull rollouts: TimeoutError: rollout queue" in out[1][1]
    assert out[1][2] < 20, out[1]            # not the group's 30 s timeout
