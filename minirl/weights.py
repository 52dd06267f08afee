"""Trainer-side weight gathering: FSDP2 shards -> full tensors in HF names, bucket by bucket.

Every rank calls `full_weight_buckets` in the same order (each FSDP unit's unshard() is an
all-gather), so every rank ends up holding each full bucket, in turn, never the whole model.
Plain (unsharded) modules work too. Pure torch; CPU or GPU.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

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


def _groups(model: nn.Module, bucket_bytes: int):
    """[(fsdp_unit or None, [(hf_name, name_in_unit, param)])] in gather order: one group per
    FSDP unit (each decoder layer, then the root's own parameters), or size-bounded groups for
    plain modules. Call with the model resharded."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        groups, cur, size = [], [], 0
        for name, p in model.named_parameters():
            cur.append((hf_name(name), name, p))
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                groups.append((None, cur))
                cur, size = [], 0
        return groups + ([(None, cur)] if cur else [])
    prefix = {id(m): name for name, m in model.named_modules()}
    groups, inner = [], set()
    for unit in units:
        if unit is model:
            continue
        params = [(hf_name(f"{prefix[id(unit)]}.{n}"), n, p) for n, p in unit.named_parameters()]
        inner |= {id(p) for *_, p in params}
        groups.append((unit, params))
    own = [(hf_name(n), n, p) for n, p in model.named_parameters() if id(p) not in inner]
    if own:
        groups.append((model if isinstance(model, FSDPModule) else None, own))
    return groups


def bucket_layout(model: nn.Module, *, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20
                  ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """The (name, full shape, dtype) of every tensor full_weight_buckets will yield, bucket by
    bucket, without gathering anything (receivers of a broadcast allocate from it)."""
    reshard(model)
    return [[(h, tuple(p.shape), dtype or p.dtype) for h, _, p in params]
            for _, params in _groups(model, bucket_bytes)]


@torch.no_grad()
def full_weight_buckets(model: nn.Module, *, dtype: torch.dtype | None = None,
                        bucket_bytes: int = 512 << 20, device: torch.device | None = None
                        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield [(hf_name, full tensor)] buckets covering every parameter once, cast to `dtype` and
    moved to `device` when given. FSDP2: one bucket per unit (each decoder layer, then the root's
    own parameters) via its unshard(), one all-gather in the param dtype, one unit unsharded at a
    time; collective (every rank, every bucket consumed). Plain modules: ~bucket_bytes buckets.
    A bucket's tensors may alias storage freed when the next one is asked for: copy what you keep.
    """
    reshard(model)
    yield from _gather(_groups(model, bucket_bytes), _caster(dtype, device))


@torch.no_grad()
def gather_during_forward(model: nn.Module, forward, on_bucket, *, dtype: torch.dtype | None = None,
                          bucket_bytes: int = 512 << 20):
    """Run `forward()` (a no-grad forward of `model`), handing each FSDP unit's full parameters to
    `on_bucket([(hf_name, tensor)])` while the forward has it unsharded: one unshard pass serves
    forward and weight sync. Units it did not run, and plain modules, are gathered after it.
    Every parameter goes to on_bucket once, in full_weight_buckets' buckets (forward order first;
    tensors may alias storage freed after on_bucket returns). Returns forward()'s result, the
    model resharded. Collective for FSDP2, like full_weight_buckets."""
    cast = _caster(dtype)
    reshard(model)
    groups = _groups(model, bucket_bytes)
    pending = {id(u): params for u, params in groups if u is not None}

    def hook(unit, args, output):     # registered first: runs before FSDP's reshard-after-forward
        params = pending.pop(id(unit), None)
        if params is not None:
            on_bucket(_bucket(unit, params, cast))

    handles = [u.register_forward_hook(hook, prepend=True) for u, _ in groups if u is not None]
    try:
        out = forward()
    finally:
        for h in handles:
            h.remove()
        reshard(model)
    for bucket in _gather([(u, p) for u, p in groups if u is None or id(u) in pending], cast):
        on_bucket(bucket)
    return out


def _caster(dtype: torch.dtype | None, device: torch.device | None = None):
    return lambda t: t.detach().to(device=device, dtype=dtype)     # None keeps the tensor's own


def _bucket(unit: nn.Module, params, cast) -> list[tuple[str, torch.Tensor]]:
    live = dict(unit.named_parameters())       # the unit's unsharded tensors while it is unsharded
    return [(h, cast(live[n])) for h, n, _ in params]


def _gather(groups, cast) -> Iterator[list[tuple[str, torch.Tensor]]]:
    for unit, params in groups:
        if unit is None:
            yield [(h, cast(p)) for h, _, p in params]
            continue
        unit.unshard()
        try:     # the unit's unsharded storage is freed on reshard: use the bucket before next()
            yield _bucket(unit, params, cast)
        finally:
            unit.reshard()


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors) -> torch.Tensor:
    """A checksum of the tensors' contents, as an int64 scalar on their device: each tensor's
    elements in order, read as 64-bit words (the last few as integers of their own width),
    summed mod 2**64. Changing any one element changes it; the layout in memory does not.
    One integer reduction per tensor; contiguous, 8-byte aligned tensors are not copied."""
    sums = [_content_sum(t) for t in tensors]
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.int64)


def _content_sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)                      # copies only a non-contiguous tensor
    per_word = 8 // flat.element_size()
    aligned = flat.storage_offset() % per_word == 0    # words must start 8-byte aligned
    if aligned and flat.numel() % per_word == 0:       # nearly every weight: one reduction
        return flat.view(torch.int64).sum()
    if not aligned:
        flat = flat.clone()
    n = flat.numel() - flat.numel() % per_word
    tail = flat[n:].view(_BITS[flat.element_size()]).sum(dtype=torch.int64)
    return flat[:n].view(torch.int64).sum() + tail


def bucket_fingerprint(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return fingerprint(t for _, t in bucket)


# ----------------------------------------------------------------------------------------------
# Verifying a sync: the same check for the co-located engine and for async generators


class SyncError(RuntimeError):
    """A weight sync did not put the trainer's weights into the engine."""


def probe_gap(trainer_lp, engine_lp) -> float:
    """Mean |trainer - engine| log-prob over the probe's tokens; inf when either is not finite
    (a NaN never passes a tolerance)."""
    gap = (torch.as_tensor(engine_lp, dtype=torch.float64) -
           torch.as_tensor(trainer_lp, dtype=torch.float64)).abs().mean().item()
    return gap if math.isfinite(gap) else math.inf


def check_sync(gap: float, stuck: bool, *, tolerance: float | None, engine_dtype: torch.dtype,
               where: str, version: int) -> None:
    """Raise SyncError when the engine's weights did not change although the trainer's did
    (`stuck`), or the probe gap exceeds the tolerance (default 2e-3 for fp32 engines, else 0.05)."""
    if tolerance is None:
        tolerance = 2e-3 if engine_dtype == torch.float32 else 0.05
    if stuck:
        raise SyncError(f"weight sync changed nothing in {where} although the trainer's weights "
                        f"changed (policy version {version})")
    if not gap <= tolerance:
        raise SyncError(f"after sync, {where} and the trainer's log-probs of the probe differ by "
                        f"{gap:.4f} on average (tolerance {tolerance}): {where} does not hold the "
                        f"trainer's weights (policy version {version})")
