"""LoRA for the Trainer through PEFT: adapters injected into the HF model before FSDP2 shards it,
merged into the base weights (W + alpha/rank * B @ A, under the base model's HF names) whenever
the engine or an export receives them (the README's "Bigger models" section).

    trainer = Trainer(path, TrainerConfig(lora=LoRAConfig(rank=16, alpha=32)))

Pure torch + peft (`pip install -e ".[lora]"`); CPU or GPU.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the named linear layers; the rest of the model stays frozen."""

    rank: int = 16
    alpha: float = 32.0
    """Scale of the update: W + (alpha / rank) * B @ A."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                       "down_proj")
    """Names (last component) of the nn.Linear layers that get an adapter."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (off in the sync's probe and the reference)."""
    also_train: tuple[str, ...] = ()
    """Modules (last name component) trained in full beside the adapters, e.g. ("embed_tokens",)
    (with tied embeddings, the lm_head too); they keep their names and are checkpointed."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRAConfig.alpha must be a finite number > 0 (the update is scaled by alpha / rank; "
                             f"0 trains nothing), got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoRAConfig.target_modules is empty: name the linear layers to adapt, "
                             "e.g. ('q_proj', 'v_proj')")


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """Inject cfg's adapters into `model` in place (B = 0: the model is unchanged), freeze every
    other parameter; ValueError naming the available layers when a target is not an nn.Linear, or
    naming a target whose weight is tied to another module's."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ImportError("LoRA needs peft: pip install -e '.[lora]'") from e
    cfg.check()
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if bad := sorted(set(cfg.target_modules) - linear):
        raise ValueError(f"LoRA target_modules {bad} are not linear layers of {type(model).__name__}: "
                         f"choose among {sorted(linear)}")
    seen, tied = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (tied if id(p) in seen else seen).add(id(p))
    if bad := sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                      and n.rsplit(".", 1)[-1] in cfg.target_modules and id(m.weight) in tied}):
        raise ValueError(f"LoRA target_modules {bad} share their weight with another module (tied embeddings): "
                         "no merged weight can carry their adapter; leave them out (also_train trains them in full)")
    extra = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in cfg.also_train]
    if bad := sorted(set(cfg.also_train) - {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}):
        raise ValueError(f"LoRA also_train {bad} are not modules of {type(model).__name__}")
    model = inject_adapter_in_model(LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                               target_modules=list(cfg.target_modules), bias="none"), model)
    for m in extra:
        m.requires_grad_(True)
    return model


def base_name(name: str) -> str | None:
    """A PEFT parameter's name in the base model (None for the adapters themselves)."""
    return None if ".lora_A." in name or ".lora_B." in name else name.replace(".base_layer.", ".")


def merge_bucket(bucket: list[tuple[str, torch.Tensor]], scale: float) -> list[tuple[str, torch.Tensor]]:
    """A gathered bucket in the base model's names: every `X.base_layer.weight` with its
    `X.lora_A.default.weight` (r, in) and `X.lora_B.default.weight` (out, r) becomes `X.weight` =
    W + scale * B @ A (computed in fp32, in W's dtype); other weights pass through."""
    named = dict(bucket)
    out = []
    for name, t in bucket:
        if name.endswith(".base_layer.weight"):
            mod = name.removesuffix(".base_layer.weight")
            a, b = named[f"{mod}.lora_A.default.weight"], named[f"{mod}.lora_B.default.weight"]
            t = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)       # (out, in)
        if base_name(name) is not None:     # the adapters themselves are merged in, not sent
            out.append((base_name(name), t))
    return out


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Run `model` as its base model (every adapter bypassed) inside the block. Flips PEFT's
    disable flag only (enable_adapters() would also toggle requires_grad on FSDP2's shards)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m in layers:
            m._disable_adapters = False
