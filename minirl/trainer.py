"""The one trainer under both backends: an FSDP2 model, its AdamW, and the step verbs.

    trainer = Trainer("Qwen/Qwen3-0.6B", TrainerConfig(lr=1e-6))
    metrics = trainer.forward_backward(rollouts, loss_fn)   # gradients of the global token mean
    trainer.optim_step()                                   # clip, refuse non-finite, step

`loss_fn(logprobs, batch, logits) -> (per_token_loss, {name: per_token_value})` sees one packed
minirl.data.PackedBatch; the README's "The loop" and "API" sections say how a step runs. The
trainer also owns the policy version, checkpoints and the full-weight gathering both backends use.
One rank per process; CPU or CUDA. Loading and sharding: minirl.model; memory plans: minirl.memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from minirl.checkpoint import full_state_dict
from minirl.core import get_logprobs, token_logprobs
from minirl.data import pack, split_by_tokens
from minirl.distributed import init_distributed, pick_device
from minirl.lora import LoRAConfig, adapters_off, base_name, merge_bucket
from minirl.model import _decoder_layers, check_model_path, load_fsdp_model, model_identity, precision, \
    recompute_layers, recomputed_layers
from minirl.weights import bucket_layout, fingerprint, full_weight_buckets, gather_during_forward, reshard


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Optimizer, precision and batching of one Trainer."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping; the norm is still checked)."""
    mixed_precision: str = "auto"
    """"auto" (bf16 compute + fp32 master weights on CUDA, fp32 on CPU), "bf16" or "fp32"."""
    activation_checkpointing: bool | int | None = None
    """Recompute decoder layers' activations in backward (HF gradient checkpointing): True every
    layer, an int that many (evenly spaced), False none. None: none, or the fewest layers that make
    a micro-batch fit in the co-located memory plan (minirl.memory, CUDA)."""
    micro_batch_tokens: int | None = None
    """Token budget of one packed micro-batch (a longer rollout gets a row of its own). None: on CUDA
    16,384, or the largest of memory.PLANNED_TOKENS that fits in the co-located memory plan; on CPU
    4,096 (SmolLM2-135M: larger ones only cost memory, and 32 x 8 rollouts then overran 24 GiB)."""
    activation_memory_budget: float | None = None
    """torch.compile's activation memory budget for the compiled decoder layers, in (0, 1]: 1 keeps
    what its partitioner saves for backward by default; lower values recompute more, the cheapest ops
    first. Needs compile. None: 1, or memory.LOW_MEMORY_BUDGET where only that lets a longer planned
    micro-batch fit."""
    attention: str = "auto"
    """"varlen" (torch's flash varlen kernel, CUDA), "sdpa" (a block-diagonal mask over each packed
    row), "auto" (varlen on CUDA; elsewhere SDPA once per rollout)."""
    seed: int = 0
    dist_timeout_s: float = 600.0
    """Timeout of every collective in the training process group."""
    trust_remote_code: bool = False
    lora: LoRAConfig | None = None
    """Train low-rank adapters only (PEFT); None: full fine-tuning."""
    cpu_offload: bool = False
    """Keep parameters, gradients and AdamW state on the host (FSDP2 CPUOffloadPolicy)."""
    reference: bool = False
    """A frozen reference policy (the starting weights) whose log-probs reach loss_fn as
    batch.ref_logprobs: with lora, the model with adapters off; else (or with lora.also_train) a
    second FSDP2 model in the compute dtype."""
    reference_offload: bool = False
    """Keep the reference policy's shards on the host (CPUOffloadPolicy) between its forwards."""
    compile: bool | str | Callable | None = None
    """torch.compile each decoder layer (dynamic shapes), and take the fused log-probs over the logits
    (core.token_logprobs(compile=): minirl.kernels' Triton kernels on CUDA, plain torch elsewhere).
    None: on CUDA (inductor), off on CPU; True: inductor; a str: that backend; False: eager."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters, their gradients and AdamW state); t otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


class Trainer:
    """One FSDP2 training rank: model, AdamW, policy version, checkpoints, weight gathering. `model`: a
    local HF directory or a hub name. Every rank calls the collective verbs (forward_backward,
    optim_step, gather, checkpoints) in the same order."""

    def __init__(self, model: str, config: TrainerConfig | None = None):
        cfg = self.config = config or TrainerConfig()      # as the user gave it, never rewritten
        device = pick_device(int(os.environ.get("LOCAL_RANK", 0)))
        # the token budget of a packed micro-batch: the config's, the device's, or a memory plan's (apply)
        self.micro_batch_tokens = cfg.micro_batch_tokens if cfg.micro_batch_tokens is not None else (
            16384 if device.type == "cuda" else 4096)
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if cfg.max_grad_norm is not None and not cfg.max_grad_norm > 0:     # < 0 flipped every gradient
            raise ValueError(f"max_grad_norm must be > 0 (the largest global gradient norm) or None (no "
                             f"clipping), got {cfg.max_grad_norm}")
        budget = cfg.activation_memory_budget
        if budget is not None and not 0 < budget <= 1:
            raise ValueError(f"activation_memory_budget must be in (0, 1] (1: what torch.compile saves by "
                             f"default) or None (planned), got {budget}")
        self.path = check_model_path(model)
        self.compute_dtype = precision(cfg.mixed_precision, device)
        self.rank = init_distributed(cfg.dist_timeout_s)
        _OPEN.add(self)
        self.device = self.rank.device
        torch.manual_seed(cfg.seed)        # the same on every rank while loading: LoRA's initial A agrees
        if cfg.reference_offload and not cfg.reference:
            raise ValueError("reference_offload=True without reference=True: set reference=True too")
        self.compile = "inductor" if cfg.compile is True or (    # the torch.compile backend (None: eager)
            cfg.compile is None and self.device.type == "cuda") else cfg.compile or None
        if budget is not None and self.compile is None:
            raise ValueError("activation_memory_budget is torch.compile's (its partitioner decides what "
                             "backward recomputes), and this trainer runs eager: set compile=True, or "
                             "drop activation_memory_budget")
        self.memory_budget = 1.0 if budget is None else budget
        load = functools.partial(load_fsdp_model, self.path, self.device, self.rank.world_size, self.compute_dtype,
                                 attention=cfg.attention, trust_remote_code=cfg.trust_remote_code)
        self.model = load(activation_checkpointing=cfg.activation_checkpointing or False, lora=cfg.lora,
                          offload=cfg.cpu_offload, compile=self.compile)
        self.reference = None     # the frozen reference policy (FSDP2, eval), unless LoRA's base model is one
        if cfg.reference and (cfg.lora is None or cfg.lora.also_train):
            self.reference = load(offload=cfg.reference_offload, dtype=self.compute_dtype).requires_grad_(False).eval()
        torch.manual_seed(cfg.seed + self.rank.rank)               # per rank from here on (dropout)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                           fused=self.device.type == "cuda" and not cfg.cpu_offload)
        with _explain_oom(self, "allocating AdamW's state at load"):
            _allocate_state(self.optimizer)
        torch.cuda.empty_cache()                   # a no-op unless CUDA is in use
        self.optimizer.register_step_post_hook(lambda *_: setattr(self, "stepped", True))
        self.policy_version = 0           # the version of the last published weights (publish() counts them)
        self.stepped = False              # the optimizer stepped since the last publish()
        self._state_host: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # (device, host) pairs
        self._state_where = "device"      # "device", "to_host" (copies in flight) or "host"
        self._state_ready: torch.cuda.Event | None = None   # the copies back, for the next step
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # for the copies

    # -- the step verbs ---------------------------------------------------------------------------

    def forward_backward(self, rollouts, loss_fn, *, temperature: float = 1.0,
                         num_global_tokens: int | None = None, entropy: bool = True) -> dict[str, float]:
        """Accumulate the gradient of sum(loss_fn's per-token loss) / num_global_tokens over this rank's
        `rollouts`. num_global_tokens defaults to the scored tokens of every rank's rollouts (the token
        mean over the global batch). With entropy, batch.entropy holds each scored token's entropy at
        `temperature`. Returns the global token means of the loss and of every value loss_fn reports,
        "tokens" and "micro_batches"."""
        if num_global_tokens is not None and not num_global_tokens >= 1:      # < 0 flipped the gradient
            raise ValueError(f"num_global_tokens must be >= 1 (the tokens the loss is averaged over, every "
                             f"rank's), got {num_global_tokens}; None: the scored tokens of this step's rollouts")
        budget = (torch._functorch.config.patch(activation_memory_budget=self.memory_budget) if self.compile
                  else contextlib.nullcontext())        # read where the layers compile: their first pass
        with _explain_oom(self, f"forward_backward (micro-batches of <= {self.micro_batch_tokens} tokens)"), budget:
            self.model.train()
            mbs = pack(list(rollouts), self.micro_batch_tokens)
            counts = torch.tensor([sum(mb.num_tokens for mb in mbs), len(mbs)], device=self.device)
            if self.rank.world_size > 1:
                dist.all_reduce(counts[:1])
                dist.all_reduce(counts[1:], op=dist.ReduceOp.MAX)
            total = int(counts[0]) if num_global_tokens is None else int(num_global_tokens)
            scale = self.rank.world_size / max(total, 1)       # FSDP2 averages gradients over ranks
            sums: dict[str, torch.Tensor] = {}
            for i in range(int(counts[1])):
                mb = mbs[i].to(self.device) if i < len(mbs) else None
                ids = mb.input_ids if mb else torch.zeros(1, 2, dtype=torch.long, device=self.device)
                keep = mb.scored if mb else torch.zeros(0, dtype=torch.long, device=self.device)
                extra = dict(position_ids=mb.position_ids, cu_seq_lens_q=mb.cu_seqlens,
                             cu_seq_lens_k=mb.cu_seqlens, max_length_q=mb.max_seqlen,
                             max_length_k=mb.max_seqlen) if mb else {}
                ref = self._reference_logprobs(ids, keep, extra, mb, temperature) if self.config.reference else None
                logits = self.model(ids, use_cache=False, logits_to_keep=keep, **extra).logits[0]  # (n, V)
                if mb is None:
                    (logits.sum() * 0).backward()              # an empty pass: FSDP2 collectives match
                    continue
                mb.ref_logprobs, mb.temperature = ref, temperature      # (n,) fp32 or None
                out = token_logprobs(logits, mb.targets, temperature=temperature, entropy=entropy,
                                     compile=self.compile)
                lp, mb.entropy = out if entropy else (out, None)                   # (n,), (n,) or None
                per_token, stats = loss_fn(lp, mb, logits)
                loss = per_token.sum()
                (loss * scale).backward()
                for k, v in {"loss": loss, **stats}.items():
                    sums[k] = sums.get(k, 0.0) + v.detach().float().sum()
            keys = sorted(sums)             # none on a rank that had nothing to train: gather, not all_reduce
            local = dict(zip(keys, torch.stack([sums[k] for k in keys]).tolist())) if keys else {}
            if self.rank.world_size > 1:
                parts = [None] * self.rank.world_size
                dist.all_gather_object(parts, local)
                local = {k: sum(p.get(k, 0.0) for p in parts) for k in sorted(set().union(*parts))}
            out = {k: v / max(total, 1) for k, v in local.items()}
        return {**out, "tokens": total, "micro_batches": int(counts[1])}

    @torch.no_grad()
    def _reference_logprobs(self, ids, keep, extra, mb, temperature: float):
        """The reference policy's log-probs of mb's scored tokens (n,) fp32 (None for an empty pass,
        which still runs the forward: FSDP2 collectives match across ranks)."""
        if self.reference is not None:
            logits = self.reference(ids, use_cache=False, logits_to_keep=keep, **extra).logits[0]
            reshard(self.reference)                        # a no-grad forward leaves the root unsharded
        else:                                              # LoRA: the base model is the reference
            with adapters_off(self.model):                 # without dropout, then back to the mode it was in
                was = self.model.training
                logits = self.model.eval()(ids, use_cache=False, logits_to_keep=keep, **extra).logits[0]
                self.model.train(was)
        return None if mb is None else token_logprobs(logits, mb.targets, temperature=temperature,
                                                       compile=self.compile).float()

    def optim_step(self) -> dict[str, float]:
        """Clip the gradient norm, refuse a non-finite one, step AdamW, free the gradients. With no
        gradient (nothing trained since the last step, e.g. every group filtered out) no weight
        changes, so nothing steps and publish() keeps the version."""
        if all(p.grad is None for p in self.model.parameters()):
            return {"grad_norm": 0.0}
        self._optimizer_state_here()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm or float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not torch.isfinite(torch.tensor(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {norm}: the step was refused (weights "
                                     "unchanged). Look for NaN/inf rewards, advantages or log-probs")
        with _explain_oom(self, "the AdamW step"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm}

    def rebalance(self, rollouts: list) -> list:
        """Every rank's rollouts, re-split so each rank holds about as many tokens (collective)."""
        if self.rank.world_size == 1:
            return list(rollouts)
        parts = [None] * self.rank.world_size
        dist.all_gather_object(parts, list(rollouts))
        mine = split_by_tokens([r for p in parts for r in p], self.rank.world_size)[self.rank.rank]
        return [r.to(self.device) for r in mine]

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of AdamW's state on this rank's device (moments and step counts; none with
        cpu_offload): what optimizer_to_host() frees there."""
        return sum(_local(t).numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if torch.is_tensor(t) and t.device.type == self.device.type)

    def optimizer_to_host(self, *, wait: bool = True) -> None:
        """Copy AdamW's state into host buffers (pinned on CUDA), then free its device memory (the
        tensors stay, holding no storage) for a co-located engine. On CUDA the copies run on a side
        stream; wait=False returns at once (the device is freed by the next call, or
        optimizer_to_device()). optim_step and checkpoints bring the state back themselves."""
        cuda = self.device.type == "cuda"
        if self._state_where == "device":
            if self._state_host is None:
                self._state_host = _host_buffers(self.optimizer, self.device)
            if cuda:
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))   # the last step wrote it
            with torch.cuda.stream(self._copy_stream):     # None (CPU): the copies run here
                for t, h in self._state_host:
                    h.copy_(t, non_blocking=cuda)
            self._state_where = "to_host"
        if self._state_where == "to_host" and (wait or not cuda):
            if cuda:
                self._copy_stream.synchronize()
            for t, _ in self._state_host:
                t.untyped_storage().resize_(0)
            self._state_where = "host"

    def optimizer_to_device(self) -> None:
        """Bring AdamW's state back from optimizer_to_host(): allocated now (before a step's
        activations), copied on a side stream beside the step's forward and backward."""
        if self._state_where == "to_host":
            self.optimizer_to_host()
        if self._state_where != "host":
            return
        cuda = self.device.type == "cuda"
        for t, h in self._state_host:
            t.untyped_storage().resize_(h.numel() * h.element_size())
        if cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            for t, h in self._state_host:
                t.copy_(h, non_blocking=cuda)
            self._state_ready = self._copy_stream.record_event() if cuda else None
        self._state_where = "device"

    def _optimizer_state_here(self) -> None:
        """AdamW's state on the device, its copies back finished for this stream."""
        self.optimizer_to_device()
        if self._state_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._state_ready)
            self._state_ready = None

    def apply(self, plan) -> None:
        """Train as a memory plan says (minirl.memory.MemoryPlan): its micro_batch_tokens, recomputed
        decoder layers and activation memory budget. The one place a plan reaches the trainer."""
        self.micro_batch_tokens = plan.micro_batch_tokens
        self.use_memory_budget(plan.activation_memory_budget)
        if self.recomputed_layers != plan.recomputed_layers:
            recompute_layers(self.model, plan.recomputed_layers)

    def use_memory_budget(self, budget: float) -> None:
        """Compile the decoder layers at this activation memory budget from the next pass on
        (torch.compiler.reset(): everything this process compiled compiles again at its next call)."""
        if budget != self.memory_budget:
            self.memory_budget = budget
            torch.compiler.reset()

    @property
    def num_layers(self) -> int:
        """The model's decoder layers (each one FSDP unit)."""
        return len(_decoder_layers(self.model))

    @property
    def recomputed_layers(self) -> int:            # minirl.model.recomputed_layers
        return recomputed_layers(self.model)

    # -- weights ----------------------------------------------------------------------------------

    def publish(self) -> int:
        """The version of the weights as they are now: a new one if the optimizer stepped since
        the last publish(), else the same."""
        if self.stepped:
            self.policy_version += 1
            self.stepped = False
        return self.policy_version

    def bucket_layout(self, dtype: torch.dtype) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """The (name, full shape, dtype) of every bucket gather() hands out, in order, gathering
        nothing (for receivers of a broadcast): with LoRA, the merged weights' base names."""
        layout = bucket_layout(self.model, dtype=dtype)
        if self.config.lora is None:
            return layout
        return [[(base_name(n), shape, d) for n, shape, d in b if base_name(n)] for b in layout]

    def gather(self, on_bucket, *, dtype: torch.dtype, probe_ids: list[int] | None = None,
               names: set[str] | None = None):
        """Hand every full weight to on_bucket([(hf_name, tensor)]), one FSDP unit at a time
        (collective). With probe_ids, the trainer's forward of the probe does the gathering, and
        (checksum of the weights handed over, the probe's log-probs) come back; else (None, None).
        names: the checksum covers these weights only (those an engine's own checksum can see)."""
        lora = self.config.lora
        if probe_ids is None:
            for bucket in full_weight_buckets(self.model, dtype=dtype):
                on_bucket(bucket if lora is None else merge_bucket(bucket, lora.scale))
            return None, None
        fp = torch.zeros((), dtype=torch.int64, device=self.device)

        def both(bucket):
            nonlocal fp
            bucket = bucket if lora is None else merge_bucket(bucket, lora.scale)
            on_bucket(bucket)
            fp = fp + fingerprint(t for n, t in bucket if names is None or n in names)

        ids = torch.tensor([probe_ids], device=self.device)
        was = self.model.training          # the probe runs without dropout, and eagerly: compiled
        with torch.compiler.set_stance("force_eager"):    # layers would compile a second graph for it
            logits = gather_during_forward(self.model, lambda: self.model.eval()(ids).logits, both, dtype=dtype)
        self.model.train(was)
        return fp.cpu(), get_logprobs(logits, ids)[0].cpu()

    # -- checkpoints ------------------------------------------------------------------------------

    def compat(self) -> dict:
        """What a checkpoint must share with the run resuming from it."""
        from minirl.checkpoint import tokenizer_hash
        lora = self.config.lora
        return {"model": model_identity(self.path), "tokenizer": tokenizer_hash(self.path),
                "mixed_precision": self.config.mixed_precision, "optimizer": "AdamW",
                "lora": None if lora is None else [lora.rank, lora.alpha, sorted(lora.target_modules),
                                                   sorted(lora.also_train)]}

    def save_checkpoint(self, ckpt, step: int, *, state: dict | None = None, objects: dict | None = None,
                        export_hf: bool = False):
        """ckpt.save(...) of model, optimizer, RNG, the policy version (weights stepped since the
        last publish are the next version's) and `state` (JSON). Collective. Returns the path."""
        state = {"policy_version": self.policy_version + int(self.stepped), **(state or {})}
        self._optimizer_state_here()
        hf = None if not export_hf else self.path if self.config.lora is None else self.export_hf
        return ckpt.save(step, self.model, self.optimizer, state=state, compat=self.compat(),
                         objects=objects, hf_from=hf)

    def export_hf(self, out_dir) -> None:
        """Write the policy (with LoRA: the merged weights, under the base model's names) as a
        Hugging Face directory on rank 0: config, tokenizer, fp32 safetensors. Collective; only rank 0
        copies the weights to its host."""
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer
        full = full_state_dict(self.model)   # the master weights (gather() hands over the compute dtype's copies)
        if self.rank.rank == 0:
            lora = self.config.lora
            sd = [(n, full[n].float()) for n, _ in self.model.named_parameters()]     # a tied weight once
            sd = dict(sd if lora is None else merge_bucket(sd, lora.scale))
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            save_file({n: t.contiguous() for n, t in sd.items()}, str(Path(out_dir) / "model.safetensors"),
                      metadata={"format": "pt"})
            remote = self.config.trust_remote_code
            AutoConfig.from_pretrained(self.path, trust_remote_code=remote).save_pretrained(out_dir)
            AutoTokenizer.from_pretrained(self.path).save_pretrained(out_dir)

    def load_checkpoint(self, ckpt, path=None) -> dict:
        """Restore model, AdamW's state (its lr and settings stay this config's), RNG and policy version
        (the latest checkpoint by default). Raises CheckpointError if it was made with another model,
        tokenizer or precision."""
        self._optimizer_state_here()
        out = ckpt.load(self.model, self.optimizer, path=path, compat=self.compat())
        self._state_host = None          # loading may replace the state's tensors: new host buffers
        cfg = self.config                # AdamW's settings are this config's, not the saved run's
        for g in self.optimizer.param_groups:
            g.update(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.policy_version, self.stepped = out["state"]["policy_version"], False
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def close(self) -> None:
        """Destroy the process group if this trainer created it and no other trainer of this process
        is open (a notebook's second run uses it)."""
        _OPEN.discard(self)
        if self.rank.owns_group and dist.is_initialized() and not len(_OPEN):
            dist.destroy_process_group()


_OPEN: weakref.WeakSet = weakref.WeakSet()
"""The Trainers of this process not closed yet."""


def _allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments, allocated by a step of AdamW over zero gradients at lr 0 (moments zero,
    weights unchanged, step count back to 0): at load they lie in segments of their own, not in
    blocks the first step's activations freed (which fragmented the device)."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for st in optimizer.state.values():
        st["step"].zero_()
    optimizer.zero_grad(set_to_none=True)


def _host_buffers(optimizer, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(device tensor, host view) for each tensor of AdamW's state on the device, the views in
    one host buffer (one pinned allocation: PyTorch's pinned allocator rounds each one up to a
    power of two). A state tensor that is a view of a larger storage cannot be freed alone."""
    pairs, total = [], 0                                # (tensor, offset in the buffer)
    for t in (_local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)):
        if t.device.type != device.type or t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != nbytes:
            raise RuntimeError("AdamW's state holds a view of a larger tensor; it cannot be moved "
                               "to the host alone: run without offload_optimizer")
        pairs.append((t, total))
        total += -(-nbytes // 64) * 64
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return [(t, buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)) for t, o in pairs]


@contextlib.contextmanager
def _explain_oom(trainer: Trainer, what: str):
    """torch's out-of-memory error inside `what` becomes a MemoryError that says what this rank
    holds, what the device has and which levers would make the step fit. The step's gradients
    are freed (the step is lost, the weights are unchanged) so the process can go on."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(e))
        held = {"weights": list(trainer.model.parameters()),
                "gradients": [p.grad for p in trainer.model.parameters() if p.grad is not None],
                "AdamW state": [t for st in trainer.optimizer.state.values() for t in st.values()
                                if torch.is_tensor(t) and t.dim()]}
        on = trainer.device.type                          # offloaded state is not on the device
        sizes = {k: sum(_local(t).numel() * t.element_size() for t in v if t.device.type == on) / 2**30
                 for k, v in held.items()}
        total = torch.cuda.mem_get_info(trainer.device)[1] / 2**30 if on == "cuda" else None
        reshard(trainer.model)
        trainer.optimizer.zero_grad(set_to_none=True)
        levers = [*memory_levers(trainer), f"a smaller micro_batch_tokens (now {trainer.micro_batch_tokens}); "
                  "more GPUs (every trainer part is sharded), or a smaller model"]
        raise MemoryError(
            f"training ran out of device memory in {what}"
            + (f" asking for {asked.group(1)} more" if asked else "") + ": this rank held "
            + ", ".join(f"{k} {v:.1f} GiB" for k, v in sizes.items()) + " (activations on top)"
            + (f" of the {total:.1f} GiB {torch.cuda.get_device_name(trainer.device)}" if total else "")
            + ". The step's gradients were freed (weights unchanged). Levers: " + "; ".join(levers) + "."
        ) from e


def memory_levers(trainer: Trainer) -> list[str]:
    """The settings of a trainer that would lower its device memory, as a user sets them."""
    cfg, levers = trainer.config, []
    if cfg.lora is None:
        levers.append("LoRA (TrainerConfig(lora=LoRAConfig()), launch --lora-rank 16): gradients and "
                      "AdamW state for the adapters only")
    if not cfg.cpu_offload:
        levers.append("cpu_offload=True (--offload): weights, gradients and AdamW state on the host")
    if trainer.reference is not None and not cfg.reference_offload:
        levers.append("reference_offload=True (--reference-offload)")
    if trainer.recomputed_layers < trainer.num_layers:
        levers.append("activation_checkpointing=True (every layer recomputed)")
    return levers
