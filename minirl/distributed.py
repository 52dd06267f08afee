"""torch.distributed set-up for every minirl process that trains (CPU or CUDA): `init_distributed()`.

Device and backend follow what the process has (torch.cuda.is_available()), never Ray's GPU ids:
NCCL (+gloo for CPU tensors) on CUDA, else gloo; each group has a timeout. Alone: a one-rank world
over an in-memory store (no TCP store listening on every interface; gloo binds the host's address).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False    # init_distributed created the process group (its owner may destroy it)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen(host: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """A rendezvous server bound now on a port the OS picks (`.port`): a process group this process
    then builds with that port (env:// or a store given) shares it (multi-tenant), so no other process
    can take the port between picking and binding, as it could with free_port()."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True)


def pick_device(local_rank: int | None = None) -> torch.device:
    """cuda:<local_rank mod visible GPUs> when CUDA works in this process, else cpu; local_rank None:
    LOCAL_RANK, else RANK, else 0 (what init_distributed reads)."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    cuda = torch.cuda.is_available()
    return torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> Rank:
    """Join (or create) the default process group; returns this process's place in it. Reads
    RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (set by torchrun and minirl's Ray
    actors; without them: a one-rank world) and leaves them set for vLLM's external_launcher."""
    alone = "RANK" not in os.environ and not dist.is_initialized()
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0")))
    device = pick_device(local_rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=device if cuda else None, **store)
    return Rank(dist.get_rank(), dist.get_world_size(), device, created)


def on_rank0(call, rank, what: str, *, share: bool = True):
    """call() on rank 0 alone; with share its value is broadcast to every rank (else None there). What
    it raised is raised on every rank: the others would wait in their next collective until the
    group's timeout. Collective when rank.world_size > 1."""
    got = error = None
    if rank.rank == 0:
        try:
            got = call()
        except Exception as e:
            if rank.world_size == 1:
                raise
            error = e
    if rank.world_size > 1:
        box = [("failed", f"{type(error).__name__}: {error}") if error is not None else ("ok", got if share else None)]
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "failed":
            if error is not None:
                raise error
            raise RuntimeError(f"rank 0 could not {what}: {box[0][1]}")
        got = box[0][1] if rank.rank else got
    return got

