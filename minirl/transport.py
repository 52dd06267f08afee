"""Moving full weights from the trainer (rank 0) to generation workers, two ways; CPU or GPU.

- Object store: `pack_bucket` makes a bucket [(name, tensor)] numpy arrays for ray.put (bf16 viewed
  as int16); every generator ray.gets it and `unpack_bucket`s it onto its device.
- Collective broadcast: `BroadcastGroup`, a standalone process group (gloo on CPU, NCCL on CUDA)
  over a TCPStore hosted by the trainer (rank 0; generators 1..). One flat buffer per dtype per bucket.
Pure torch + numpy (no ray import): actors and TrainWorker do the calling.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, np.ndarray]]:
    """[(name, tensor)] -> [(name, dtype, numpy array)] on CPU, for ray.put. Always copies: the bucket
    may alias FSDP's unsharded storage, which must stay resizable (a numpy view would pin it)."""
    cpu = [(name, t.detach().to("cpu", copy=True).contiguous()) for name, t in bucket]
    return [(name, str(t.dtype), t.view(_VIEW.get(t.dtype, t.dtype)).numpy()) for name, t in cpu]


def unpack_bucket(packed, device=None) -> list[tuple[str, torch.Tensor]]:
    """Inverse of pack_bucket; arrays may be read-only views of shared memory (never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # "array is not writable": we only read
        return [(name, torch.from_numpy(arr).view(_DTYPES[dtype]).to(device)) for name, dtype, arr in packed]


@dataclass(frozen=True)
class BucketMeta:
    """What receivers need to rebuild a broadcast bucket: per dtype, the names and shapes."""

    groups: list[tuple[str, list[tuple[str, tuple[int, ...]]]]]   # [(dtype, [(name, shape)])]

    @staticmethod
    def of(bucket: list[tuple[str, torch.Tensor]]) -> "BucketMeta":
        return BucketMeta.of_layout([(name, t.shape, t.dtype) for name, t in bucket])

    @staticmethod
    def of_layout(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> "BucketMeta":
        """From [(name, shape, dtype)] (minirl.weights.bucket_layout's buckets)."""
        by: dict[str, list] = {}
        for name, shape, dtype in layout:
            by.setdefault(str(dtype), []).append((name, tuple(shape)))
        return BucketMeta(list(by.items()))


class BroadcastGroup:
    """A standalone process group for weight broadcast: rank 0 sends, all others receive. Every member
    builds it with the same host/port/prefix/world_size at about the same time (rank 0 hosts the
    TCPStore); a new membership uses a new prefix."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, prefix: str,
                 device: torch.device, timeout_s: float = 300.0, store=None):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        self.store = store if store is not None else dist.TCPStore(
            host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
        pstore = dist.PrefixStore(prefix, self.store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(pstore, rank, world_size, timeout)

    def _bcast(self, t: torch.Tensor) -> None:
        self.pg.broadcast([t], dist.BroadcastOptions()).wait()    # rootRank defaults to 0

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: broadcast a bucket (one flat buffer per dtype)."""
        for dt, _ in BucketMeta.of(bucket).groups:
            self._bcast(torch.cat([t.reshape(-1).to(self.device) for _, t in bucket if str(t.dtype) == dt]))

    def recv(self, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
        """Ranks > 0: receive one bucket described by `meta`."""
        out = []
        for dtype, items in meta.groups:
            sizes = [math.prod(shape) for _, shape in items]
            flat = torch.empty(sum(sizes), dtype=_DTYPES[dtype], device=self.device)
            self._bcast(flat)
            out += [(name, t.view(shape)) for (name, shape), t in zip(items, flat.split(sizes))]
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):   # best effort on a group being torn down (or no shutdown)
            self.pg.shutdown()
