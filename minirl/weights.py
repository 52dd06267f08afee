"""Trainer-side weight gathering: FSDP2 shards -> full tensors in HF names, bucket by bucket.

Every rank calls `full_weight_buckets` in the same order (each DTensor.full_tensor() is an
all-gather), so every rank ends up holding each full bucket, in turn, never the whole model.
Plain (unsharded) modules work too. Pure torch; CPU or GPU.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

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
    """Yield [(hf_name, full tensor)] buckets covering every parameter once. Tensors are cast to
    `dtype` and moved to `device` when given.

    FSDP2 models: one bucket per FSDP unit (each decoder layer, then the root's own
    parameters), gathered with the unit's own unshard(): one all-gather per unit, in the
    mixed-precision param dtype (bf16 on GPU), never more than one unit unsharded at a time.
    Plain modules: buckets of about bucket_bytes in parameter order. A bucket's tensors may
    alias storage that is freed when the next bucket is asked for: copy what you keep.
    Collective for FSDP2: call on every rank of the model's process group and consume every
    bucket.
    """
    def cast(t):
        t = t.detach()
        if dtype is not None:
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        bucket, size = [], 0
        for name, p in model.named_parameters():
            bucket.append((hf_name(name), cast(p)))
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket
        return
    reshard(model)
    prefix = {id(m): name for name, m in model.named_modules()}
    inner = [m for m in units if m is not model]
    for unit in inner:
        unit.unshard()
        try:     # the unit's unsharded storage is freed on reshard: use the bucket before next()
            yield [(hf_name(f"{prefix[id(unit)]}.{n}"), cast(p)) for n, p in unit.named_parameters()]
        finally:
            unit.reshard()
    if isinstance(model, FSDPModule):        # the root's own parameters (embeddings, final norm)
        model.unshard()
        try:
            bucket = [(hf_name(n), cast(p)) for n, p in model.named_parameters()
                      if not isinstance(p, DTensor)]
            if bucket:
                yield bucket
        finally:
            model.reshard()


def fingerprint(tensors) -> torch.Tensor:
    """(sum, sum of |x|) in float64 over tensors, as a 2-vector on their device: a cheap
    signature that changes when any element does (no float64 copies are made)."""
    out = None
    for t in tensors:
        v = torch.stack([t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)])
        out = v if out is None else out + v
    return out


def bucket_fingerprint(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return fingerprint(t for _, t in bucket)
