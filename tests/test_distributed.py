"""minirl.distributed's rendezvous port (CPU, no Ray): held from the moment it is named, so two runs
on one host never race for it, and shared by the process group this process builds on it.

Run: `pytest tests/test_distributed.py`. Hardware: CPU.
"""

import socket

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
