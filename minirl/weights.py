"""Trainer-side weight gathering: FSDP2 shards -> full tensors in HF names, bucket by bucket.

Every rank calls `full_weight_buckets` in the same order (each DTensor.full_tensor() is an
all-gather), so every rank ends up holding each full bucket, in turn, never the whole model.
Plain (unsharded) modules work too. Pure torch; CPU or GPU.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch < 2.6
    FSDPModule = ()

_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """Strip wrapper prefixes (torch.compile, checkpoint wrappers) from a parameter name."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def reshard(model: nn.Module) -> None:
    """Return every FSDP2 module to its sharded state (a no-grad forward leaves the root
    unsharded, with plain tensors where DTensors should be)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def full_weight_buckets(model: nn.Module, *, dtype: torch.dtype | None = None,
                        bucket_bytes: int = 512 << 20, device: torch.device | None = None
                        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield [(hf_name, full tensor)] lists of about bucket_bytes, in parameter order (so layer
    by layer). Tensors are cast to `dtype` and moved to `device` when given. Collective: call
    on every rank of the model's process group and consume every bucket."""
    reshard(model)
    bucket, size = [], 0
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if dtype is not None:
            t = t.to(dtype)
        if device is not None:
            t = t.to(device)
        bucket.append((hf_name(name), t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def bucket_fingerprint(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """(sum, sum of squares) in float64 over a bucket's tensors, as a 2-vector."""
    out = torch.zeros(2, dtype=torch.float64, device=bucket[0][1].device)
    for _, t in bucket:
        x = t.double()
        out[0] += x.sum()
        out[1] += (x * x).sum()
    return out
