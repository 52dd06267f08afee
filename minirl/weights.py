"""Trainer-side weight gathering: FSDP2 shards -> full tensors in HF names, bucket by bucket, and
the checks that a sync arrived. Every rank calls `full_weight_buckets` in the same order (each
unit's unshard() is an all-gather) and holds each full bucket in turn, never the whole model.
A plain (unsharded) module is one bucket. Pure torch; CPU or GPU.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

def reshard(model: nn.Module) -> None:
    """Reshard every FSDP2 module (a no-grad forward leaves the root unsharded, without DTensors)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _groups(model: nn.Module):
    """[(fsdp_unit or None, [(hf_name, name_in_unit, param)])] in gather order: one group per FSDP
    unit (each layer, then the root's own); a plain module's parameters are one group (unit None)."""
    prefix = {id(m): name for name, m in model.named_modules()}
    groups, inner = [], set()
    for unit in [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]:
        params = [(f"{prefix[id(unit)]}.{n}", n, p) for n, p in unit.named_parameters()]
        inner |= {id(p) for *_, p in params}
        groups.append((unit, params))
    own = [(n, n, p) for n, p in model.named_parameters() if id(p) not in inner]
    return groups + ([(model if isinstance(model, FSDPModule) else None, own)] if own else [])


def bucket_layout(model: nn.Module, *, dtype: torch.dtype | None = None
                  ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """full_weight_buckets' (name, full shape, dtype) per bucket, gathering nothing (for receivers)."""
    reshard(model)
    return [[(h, tuple(p.shape), dtype or p.dtype) for h, _, p in params] for _, params in _groups(model)]


@torch.no_grad()
def full_weight_buckets(model: nn.Module, *, dtype: torch.dtype | None = None
                        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield [(hf_name, full tensor)] buckets covering every parameter once, cast to `dtype` when
    given: one per FSDP2 unit (collective, see the module docstring). Tensors may alias storage
    freed at the next bucket: copy what you keep."""
    reshard(model)
    yield from _gather(_groups(model), dtype)


@torch.no_grad()
def gather_during_forward(model: nn.Module, forward, on_bucket, *, dtype: torch.dtype | None = None):
    """Run `forward()` (a no-grad forward of `model`), handing each FSDP unit's full parameters to
    `on_bucket([(hf_name, tensor)])` while the forward has it unsharded; units it skipped, and plain
    modules, follow. Every parameter goes once, in full_weight_buckets' buckets. Returns forward()'s
    result, the model resharded. Collective for FSDP2."""
    reshard(model)
    groups = _groups(model)
    pending = {id(u): params for u, params in groups if u is not None}

    def hook(unit, args, output):     # registered first: runs before FSDP's reshard-after-forward
        if (params := pending.pop(id(unit), None)) is not None:
            on_bucket(_bucket(unit, params, dtype))

    handles = [u.register_forward_hook(hook, prepend=True) for u, _ in groups if u is not None]
    try:
        out = forward()
    finally:
        for h in handles:
            h.remove()
        reshard(model)
    for bucket in _gather([(u, p) for u, p in groups if u is None or id(u) in pending], dtype):
        on_bucket(bucket)
    return out


def _bucket(unit: nn.Module, params, dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
    live = dict(unit.named_parameters())       # the unit's unsharded tensors while it is unsharded
    return [(h, live[n].detach().to(dtype=dtype)) for h, n, _ in params]     # dtype None keeps each one's


def _gather(groups, dtype: torch.dtype | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    for unit, params in groups:
        if unit is None:
            yield [(h, p.detach().to(dtype=dtype)) for h, _, p in params]
            continue
        unit.unshard()
        try:     # the unit's unsharded storage is freed on reshard: use the bucket before next()
            yield _bucket(unit, params, dtype)
        finally:
            unit.reshard()


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors) -> torch.Tensor:
    """A checksum of the tensors' contents, an int64 scalar on their device: the elements read as
    64-bit words (the last few as integers of their own width), summed mod 2**64. Any one changed
    element changes it, memory layout does not; contiguous, 8-byte aligned tensors are not copied."""
    sums = [_content_sum(t) for t in tensors]
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.int64)


def _content_sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)                      # copies only a non-contiguous tensor
    per_word = 8 // flat.element_size()
    aligned = flat.storage_offset() % per_word == 0    # words must start 8-byte aligned
    if aligned and flat.numel() % per_word == 0:       # nearly every weight: one reduction
        return flat.view(torch.int64).sum()
    flat = flat if aligned else flat.clone()
    n = flat.numel() - flat.numel() % per_word
    tail = flat[n:].view(_BITS[flat.element_size()]).sum(dtype=torch.int64)
    return flat[:n].view(torch.int64).sum() + tail


class SyncError(RuntimeError):
    """A weight sync (co-located engine or async generator) did not bring the trainer's weights."""


def probe_gap(trainer_lp, engine_lp) -> float:
    """Mean |trainer - engine| log-prob over the probe's tokens; inf if not finite (NaN never passes)."""
    if len(trainer_lp) != len(engine_lp):        # broadcast, one value would be compared against them all
        raise ValueError(f"the probe has {len(trainer_lp)} trainer log-probs and {len(engine_lp)} engine ones: "
                         "both must score the same probe tokens")
    gap = (torch.as_tensor(engine_lp, dtype=torch.float64) -
           torch.as_tensor(trainer_lp, dtype=torch.float64)).abs().mean().item()
    return gap if math.isfinite(gap) else math.inf


def check_tolerance(tolerance) -> None:
    """ValueError unless the probe tolerance is None or a finite number >= 0 (checked at config time)."""
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not math.isfinite(tolerance) or tolerance < 0):
        raise ValueError(f"probe_tolerance must be a finite number >= 0 (the largest mean |engine - trainer| "
                         f"probe log-prob gap a sync may show) or None; got {tolerance!r}")


def check_sync(gap: float, stuck: bool, *, tolerance: float | None, engine_dtype: torch.dtype,
               where: str, version: int) -> None:
    """Raise SyncError when the engine's weights did not change although the trainer's did
    (`stuck`), or the probe gap exceeds the tolerance (default 2e-3 for fp32 engines, else 0.1: a
    correct bf16 sync's rounding grows with the model, 0.008 at 0.6B to 0.052 at 8B)."""
    if tolerance is None:
        tolerance = 2e-3 if engine_dtype == torch.float32 else 0.1
    if stuck:
        raise SyncError(f"weight sync changed nothing in {where} although the trainer's weights "
                        f"changed (policy version {version})")
    if not gap <= tolerance:
        raise SyncError(f"after sync, {where} and the trainer's log-probs of the probe differ by {gap:.4f} "
                        f"(tolerance {tolerance}): {where} lacks the trainer's weights (version {version}). If "
                        "the weights are right and this is rounding (bf16 gaps grow with the model's size), set "
                        "probe_tolerance above the gap (WeightManagerConfig; async: TrainWorker)")
