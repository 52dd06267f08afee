"""The one trainer under both backends: an FSDP2 model, its AdamW, and the step verbs.

    trainer = Trainer("Qwen/Qwen3-0.6B", TrainerConfig(lr=1e-6))
    metrics = trainer.forward_backward(rollouts, loss_fn)   # gradients of the global token mean
    trainer.optim_step()                                   # clip, refuse non-finite, step

forward_backward packs rollouts into rows of at most micro_batch_tokens tokens (positions restart
per rollout, attention never crosses rollouts: flash varlen on CUDA, a block-diagonal mask on
CPU), computes logits only where a token is scored, and accumulates the gradient of sum(loss) /
num_global_tokens over every micro-batch and rank: the token mean of the whole global batch,
however the rollouts split. `loss_fn(logprobs, batch, logits) -> (per_token_loss, {name:
per_token_value})` sees one minirl.data.PackedBatch. The trainer also owns the policy version,
checkpoints and the full-weight gathering both backends use to move weights to vLLM. One rank
per process. bf16 compute with fp32 master weights and AdamW state on CUDA, fp32 on CPU.

Bigger models on fewer GPUs: `lora=LoRAConfig(...)` trains PEFT adapters only (the engine gets
merged weights, checkpoints hold the adapters); `cpu_offload` keeps parameters, gradients and AdamW
state on the host (FSDP2's CPUOffloadPolicy); `reference=True` adds a frozen reference policy whose
log-probs of each packed micro-batch reach loss_fn as `batch.ref_logprobs` (for a KL penalty).
Loading and sharding the model: minirl.model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from minirl.core import token_logprobs
from minirl.data import pack, split_by_tokens
from minirl.distributed import init_distributed, pick_device
from minirl.lora import LoRAConfig, adapters_off, base_name, merge_bucket
from minirl.model import _decoder_layers, check_model_path, load_fsdp_model, model_identity, precision, \
    recompute_layers, recomputed_layers
from minirl.weights import bucket_fingerprint, bucket_layout, full_weight_buckets, gather_during_forward, reshard


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
    layer, an int that many (evenly spaced), False none. None: none, unless measure_peak() finds that
    neither a full micro-batch nor half of one (then micro_batch_tokens is halved) would fit without
    it (CUDA); then the fewest layers that make a full micro-batch fit."""
    micro_batch_tokens: int | None = None
    """Token budget of one packed micro-batch (a longer rollout gets a row of its own). None:
    planned. Where measure_peak() runs (the co-located memory plan on CUDA) the largest of
    PLANNED_TOKENS that fits without recomputation (if none does: 16,384 tokens, recomputing the
    fewest layers); elsewhere 16,384."""
    activation_memory_budget: float | None = None
    """torch.compile's activation memory budget for the compiled decoder layers, in (0, 1]
    (torch._functorch.config.activation_memory_budget): 1 keeps what its partitioner saves for
    backward by default; lower values have it recompute more in backward instead, the cheapest ops
    first (norms, rotary, SwiGLU's product before any matmul). Needs compile. None: planned. Where
    measure_peak() plans micro_batch_tokens, 1 or LOW_MEMORY_BUDGET when only that lets a longer
    micro-batch fit without recomputing layers (Qwen3-4B on an H200: 16,384 tokens instead of 8,192,
    a training phase 3% shorter); elsewhere 1."""
    attention: str = "auto"
    """"varlen" (torch's flash varlen kernel, CUDA), "sdpa" (a block-diagonal mask), "auto"."""
    seed: int = 0
    dist_timeout_s: float = 600.0
    """Timeout of every collective in the training process group."""
    trust_remote_code: bool = False
    lora: LoRAConfig | None = None
    """Train low-rank adapters only (PEFT); None: full fine-tuning."""
    cpu_offload: bool = False
    """Keep parameters, gradients and AdamW state on the host; each FSDP unit is copied to the
    device for its forward and backward, the optimizer steps on the CPU (FSDP2 CPUOffloadPolicy)."""
    reference: bool = False
    """A frozen reference policy (the starting weights): its log-probs of every packed
    micro-batch reach loss_fn as batch.ref_logprobs. With lora, the model with adapters off
    (no extra memory); else (or with lora.also_train) a second FSDP2 model in the compute dtype,
    sharded like the trainer."""
    reference_offload: bool = False
    """Keep the reference policy's shards on the host (CPUOffloadPolicy) between its forwards."""
    compile: bool | str | Callable | None = None
    """torch.compile each decoder layer (dynamic shapes: one compile for every packed length) and the
    log-probs' pass over the logits (core.token_logprobs(compile=)); it fuses the elementwise work
    (norms, rotary, SwiGLU, casts, softmax over the vocabulary) that dominates a small model's step.
    None: on CUDA (inductor), off on CPU; True: inductor; a str: that backend; False: eager."""


PLANNED_TOKENS = (32768, 16384, 8192)
"""The micro-batch sizes measure_peak chooses from when micro_batch_tokens is left to it, largest
first. Larger micro-batches train faster where they fit (fewer FSDP2 gathers and launches, larger
matmuls): Qwen3-0.6B's training phase of 512 x 1,088 tokens took 5.56 s at 32,768 against 6.25 s at
16,384 on an H200 (benchmarks/train_phase.py, benchmarks/results/2026-12-04)."""

LOW_MEMORY_BUDGET = 0.6
"""The activation memory budget measure_peak tries when a micro-batch does not fit at 1. Qwen3-4B's
training phase of 512 x 320 tokens on an H200 (benchmarks/train_phase.py,
benchmarks/results/2026-12-04-b): 8,192-token micro-batches at budget 1 took 8.57 s and peaked at
99.5 GiB; 16,384 tokens at 0.8 took 8.15 s at 116.4 GiB, at 0.6 8.34 s at 106.2 GiB (at 1 they
would need ~142 GiB). 0.6 keeps a planned step's peak near the shorter rows' at most of the gain."""

_BUDGET_BOUND = 0.5
"""measure_peak runs a trial at LOW_MEMORY_BUDGET only where the activations at budget 1 (the small
trials' line), scaled by this, would fit: 0.55 of them remained at 0.6 in the measurement above."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters, their gradients and AdamW state); t otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def predict_peak(n1: int, peak1: int, n2: int, peak2: int, n: int) -> float:
    """The peak at n tokens on the line through two trials (gradients are the same at any size,
    activations grow linearly in tokens)."""
    return peak2 + (peak2 - peak1) / (n2 - n1) * (n - n2)


class Trainer:
    """One FSDP2 training rank: model, AdamW, policy version, checkpoints, weight gathering.

    Trainer(model, config): `model` is a local HF directory or a hub name. Collective verbs
    (forward_backward, optim_step, gather, checkpoints) are called by every rank in the same order.
    """

    def __init__(self, model: str, config: TrainerConfig | None = None):
        cfg = config or TrainerConfig()
        self.planned_tokens = cfg.micro_batch_tokens is None
        """micro_batch_tokens was left to measure_peak (TrainerConfig.micro_batch_tokens None)."""
        cfg = self.config = replace(cfg, micro_batch_tokens=PLANNED_TOKENS[1]) if self.planned_tokens else cfg
        if cfg.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {cfg.micro_batch_tokens}")
        budget = cfg.activation_memory_budget
        if budget is not None and not 0 < budget <= 1:
            raise ValueError(f"activation_memory_budget must be in (0, 1] (1: what torch.compile saves by "
                             f"default) or None (planned), got {budget}")
        self.path = check_model_path(model)
        self.compute_dtype = precision(cfg.mixed_precision, pick_device(int(os.environ.get("LOCAL_RANK", 0))))
        self.rank = init_distributed(cfg.dist_timeout_s)
        self.device = self.rank.device
        torch.manual_seed(cfg.seed)        # the same on every rank while loading: LoRA's initial A agrees
        if cfg.reference_offload and not cfg.reference:
            raise ValueError("reference_offload=True without reference=True: set reference=True too")
        load = dict(attention=cfg.attention, trust_remote_code=cfg.trust_remote_code)
        self.compile = "inductor" if cfg.compile is True or (
            cfg.compile is None and self.device.type == "cuda") else cfg.compile or None
        """The torch.compile backend of the decoder layers and the fused log-probs (None: eager)."""
        if cfg.activation_memory_budget is not None and self.compile is None:
            raise ValueError("activation_memory_budget is torch.compile's (its partitioner decides what "
                             "backward recomputes), and this trainer runs eager: set compile=True, or "
                             "drop activation_memory_budget")
        self.memory_budget = 1.0 if cfg.activation_memory_budget is None else cfg.activation_memory_budget
        """The activation memory budget the decoder layers compile with (see TrainerConfig)."""
        self.model = load_fsdp_model(self.path, self.device, self.rank.world_size, self.compute_dtype,
                                     activation_checkpointing=cfg.activation_checkpointing or False,
                                     lora=cfg.lora, offload=cfg.cpu_offload, compile=self.compile, **load)
        self.reference = None
        """The frozen reference policy (FSDP2, eval mode), unless LoRA's base model serves as one."""
        if cfg.reference and (cfg.lora is None or cfg.lora.also_train):
            self.reference = load_fsdp_model(self.path, self.device, self.rank.world_size, self.compute_dtype,
                                             offload=cfg.reference_offload, dtype=self.compute_dtype,
                                             **load).requires_grad_(False).eval()
        torch.manual_seed(cfg.seed + self.rank.rank)               # per rank from here on (dropout)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay,
                                           fused=self.device.type == "cuda" and not cfg.cpu_offload)
        self._allocate_optimizer_state()
        self.optimizer.register_step_post_hook(lambda *_: setattr(self, "stepped", True))
        self.policy_version = 0
        """The version of the last published weights (publish() counts them)."""
        self.memory_plan: dict | None = None
        """What measure_peak tried and chose (CUDA): usable and AdamW GiB, trials, verdict."""
        self.stepped = False
        """True when the optimizer stepped since the last publish()."""
        self._state_host: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # (device, host) pairs
        self._state_where = "device"      # "device", "to_host" (copies in flight) or "host"
        self._state_ready: torch.cuda.Event | None = None   # the copies back, for the next step

    # -- the step verbs ---------------------------------------------------------------------------

    def forward_backward(self, rollouts, loss_fn, *, temperature: float = 1.0,
                         num_global_tokens: int | None = None, entropy: bool = True) -> dict[str, float]:
        """Accumulate the gradient of sum(loss_fn's per-token loss) / num_global_tokens.

        `rollouts` are this rank's (any split: see rebalance). num_global_tokens defaults to the
        scored tokens of every rank's rollouts (an all-reduce), which makes the result the token
        mean over the global batch; pass it to spread one batch over several calls. Ranks may
        hold different numbers of micro-batches (the short ones run empty passes). With entropy,
        loss_fn's batch.entropy holds each scored token's entropy at `temperature`, from the same
        pass over the logits as the log-probs. Returns the global token means of the loss and of
        every value loss_fn reports, and "tokens".
        """
        with self._explain_oom(f"forward_backward (micro-batches of <= {self.config.micro_batch_tokens} tokens)"):
            return self._forward_backward(list(rollouts), loss_fn, temperature, num_global_tokens, entropy)

    def _forward_backward(self, rollouts, loss_fn, temperature, num_global_tokens, entropy) -> dict[str, float]:
        self.model.train()
        mbs = pack(rollouts, self.config.micro_batch_tokens)
        counts = torch.tensor([sum(mb.num_tokens for mb in mbs), len(mbs)], device=self.device)
        if self.rank.world_size > 1:
            dist.all_reduce(counts[:1])
            dist.all_reduce(counts[1:], op=dist.ReduceOp.MAX)
        total = int(counts[0]) if num_global_tokens is None else int(num_global_tokens)
        scale = self.rank.world_size / max(total, 1)       # FSDP2 averages gradients over ranks
        sums: dict[str, torch.Tensor] = {}
        budget = (torch._functorch.config.patch(activation_memory_budget=self.memory_budget) if self.compile
                  else contextlib.nullcontext())        # read where the layers compile: their first pass
        with budget:
            for i in range(int(counts[1])):
                mb = mbs[i].to(self.device) if i < len(mbs) else None
                ids = mb.input_ids if mb else torch.zeros(1, 2, dtype=torch.long, device=self.device)
                keep = mb.scored if mb else torch.zeros(0, dtype=torch.long, device=self.device)
                extra = dict(position_ids=mb.position_ids, cu_seq_lens_q=mb.cu_seqlens,
                             cu_seq_lens_k=mb.cu_seqlens, max_length_q=mb.max_seqlen,
                             max_length_k=mb.max_seqlen) if mb else {}
                ref = self._reference_logprobs(ids, keep, extra, mb, temperature) if self.config.reference \
                    else None
                logits = self.model(ids, use_cache=False, logits_to_keep=keep, **extra).logits[0]  # (n, V)
                if mb is None:
                    (logits.sum() * 0).backward()              # an empty pass: FSDP2 collectives match
                    continue
                mb.ref_logprobs = ref                          # (n,) fp32 or None
                out = token_logprobs(logits, mb.targets, temperature=temperature, entropy=entropy,
                                     compile=self.compile)
                lp, mb.entropy = out if entropy else (out, None)                   # (n,), (n,) or None
                per_token, stats = loss_fn(lp, mb, logits)
                loss = per_token.sum()
                (loss * scale).backward()
                for k, v in {"loss": loss, **stats}.items():
                    sums[k] = sums.get(k, 0.0) + v.detach().float().sum()
        keys = sorted(sums)
        vec = torch.stack([torch.as_tensor(sums[k], device=self.device) for k in keys]) if keys else None
        if vec is not None and self.rank.world_size > 1:
            dist.all_reduce(vec)
        out = {k: float(v) / max(total, 1) for k, v in zip(keys, vec.tolist())} if keys else {}
        return {**out, "tokens": total, "micro_batches": int(counts[1])}

    @torch.no_grad()
    def _reference_logprobs(self, ids, keep, extra, mb, temperature: float):
        """The reference policy's log-probs of mb's scored tokens (n,) fp32 (None for an empty pass,
        which still runs the forward: FSDP2 collectives match across ranks)."""
        if self.reference is not None:
            logits = self.reference(ids, use_cache=False, logits_to_keep=keep, **extra).logits[0]
            reshard(self.reference)                        # a no-grad forward leaves the root unsharded
        else:                                              # LoRA: the base model is the reference
            with adapters_off(self.model):
                was = self.model.training
                logits = self.model.eval()(ids, use_cache=False, logits_to_keep=keep, **extra).logits[0]
                self.model.train(was)
        return None if mb is None else token_logprobs(logits, mb.targets, temperature=temperature,
                                                       compile=self.compile).float()

    def optim_step(self) -> dict[str, float]:
        """Clip the gradient norm, refuse a non-finite one, step AdamW, free the gradients."""
        self._optimizer_state_here()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.config.max_grad_norm or float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not torch.isfinite(torch.tensor(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {norm}: the step was refused (weights "
                                     "unchanged). Look for NaN/inf rewards, advantages or log-probs")
        with self._explain_oom("the AdamW step"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm}

    @contextlib.contextmanager
    def _explain_oom(self, what: str):
        """torch's out-of-memory error inside `what` becomes a MemoryError that says what this rank
        holds, what the device has and which levers would make the step fit. The step's gradients
        are freed (the step is lost, the weights are unchanged) so the process can go on."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(e))
            held = {"weights": [p for p in self.model.parameters()],
                    "gradients": [p.grad for p in self.model.parameters() if p.grad is not None],
                    "AdamW state": [t for st in self.optimizer.state.values() for t in st.values()
                                    if torch.is_tensor(t) and t.dim()]}
            on = self.device.type                          # offloaded state is not on the device
            sizes = {k: sum(_local(t).numel() * t.element_size() for t in v if t.device.type == on) / 2**30
                     for k, v in held.items()}
            total = torch.cuda.mem_get_info(self.device)[1] / 2**30 if self.device.type == "cuda" else None
            reshard(self.model)
            self.optimizer.zero_grad(set_to_none=True)
            levers = self._memory_levers()
            levers.append(f"a smaller micro_batch_tokens (now {self.config.micro_batch_tokens}); more GPUs "
                          "(every trainer part is sharded), or a smaller model")
            raise MemoryError(
                f"training ran out of device memory in {what}"
                + (f" asking for {asked.group(1)} more" if asked else "") + ": this rank held "
                + ", ".join(f"{k} {v:.1f} GiB" for k, v in sizes.items()) + " (activations on top)"
                + (f" of the {total:.1f} GiB {torch.cuda.get_device_name(self.device)}" if total else "")
                + ". The step's gradients were freed (weights unchanged). Levers: " + "; ".join(levers) + "."
            ) from e

    def _memory_levers(self) -> list[str]:
        """The settings of this trainer that would lower its device memory, as a user sets them."""
        cfg, levers = self.config, []
        if cfg.lora is None:
            levers.append("LoRA (TrainerConfig(lora=LoRAConfig()), launch --lora-rank 16): gradients and "
                          "AdamW state for the adapters only")
        if not cfg.cpu_offload:
            levers.append("cpu_offload=True (--offload): weights, gradients and AdamW state on the host")
        if self.reference is not None and not cfg.reference_offload:
            levers.append("reference_offload=True (--reference-offload)")
        if self.recomputed_layers < self.num_layers:
            levers.append("activation_checkpointing=True (every layer recomputed)")
        return levers

    def rebalance(self, rollouts: list) -> list:
        """Every rank's rollouts, re-split so each rank holds about as many tokens (collective)."""
        if self.rank.world_size == 1:
            return list(rollouts)
        parts = [None] * self.rank.world_size
        dist.all_gather_object(parts, list(rollouts))
        mine = split_by_tokens([r for p in parts for r in p], self.rank.world_size)[self.rank.rank]
        return [r.to(self.device) for r in mine]

    def _allocate_optimizer_state(self) -> None:
        """AdamW's moments, allocated now by a step of AdamW itself over zero gradients at lr 0 (the
        moments stay zero, the weights and their decay unchanged; its step count goes back to 0):
        exactly the state the first real step would create. Allocated here, on a device that holds
        only the weights, it lies in segments of its own. Created by the first step, it filled the
        blocks the step's activations had freed, and the allocator could return none of those
        segments: at the Qwen3-4B shape on an H200, 4.8 GiB was reserved but unallocated when the
        second training step ran out of memory, and 5.6 GiB when the engine's generation beside the
        trainer did (1,024-token completions)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in self.optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        with self._explain_oom("allocating AdamW's state at load"):
            self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        for st in self.optimizer.state.values():
            st["step"].zero_()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of AdamW's state on this rank's device (moments and step counts; none with
        cpu_offload): what optimizer_to_host() frees there."""
        return sum(_local(t).numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if torch.is_tensor(t) and t.device.type == self.device.type)

    def optimizer_to_host(self, *, wait: bool = True) -> None:
        """Copy AdamW's state into host buffers (pinned on CUDA, made at the first call), then free
        its device memory: the tensors stay, holding no storage, so a co-located engine can use
        that memory while it generates. On CUDA the copies run on a side stream; wait=False returns
        at once (the device is freed by the next call, or optimizer_to_device()). The verbs that
        read the state (optim_step, checkpoints) bring it back themselves."""
        cuda = self.device.type == "cuda"
        if self._state_where == "device":
            if self._state_host is None:
                self._state_host = self._host_buffers()
            if cuda:
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))   # the last step wrote it
            with torch.cuda.stream(self._copy_stream) if cuda else contextlib.nullcontext():
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
        """Bring AdamW's state back from optimizer_to_host(): its device memory is allocated now
        (before a training step's activations, so in segments of its own), the copies run on a side
        stream beside the step's forward and backward, and optim_step waits for them."""
        if self._state_where == "to_host":
            self.optimizer_to_host()
        if self._state_where != "host":
            return
        cuda = self.device.type == "cuda"
        for t, h in self._state_host:
            t.untyped_storage().resize_(h.numel() * h.element_size())
        if cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream) if cuda else contextlib.nullcontext():
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

    @functools.cached_property
    def _copy_stream(self):
        return torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _host_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device tensor, host view) for each tensor of AdamW's state on the device, the views in
        one host buffer (one pinned allocation: PyTorch's pinned allocator rounds each one up to a
        power of two). A state tensor that is a view of a larger storage cannot be freed alone."""
        pairs, offsets, total = [], [], 0
        for st in self.optimizer.state.values():
            for v in st.values():
                t = _local(v) if torch.is_tensor(v) else None
                if t is None or t.device.type != self.device.type or t.numel() == 0:
                    continue
                nbytes = t.numel() * t.element_size()
                if not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != nbytes:
                    raise RuntimeError("AdamW's state holds a view of a larger tensor; it cannot be moved "
                                       "to the host alone: run without offload_optimizer")
                pairs.append(t)
                offsets.append(total)
                total += -(-nbytes // 64) * 64
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return [(t, buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
                for t, o in zip(pairs, offsets)]

    def measure_peak(self, reserve: int = 0, largest: int | None = None) -> int:
        """Bytes allocated (CUDA) at the peak of one forward_backward over a full micro-batch of
        random tokens, weights, gradients and AdamW's state (allocated at load) included. With
        activation_checkpointing None, recomputes the fewest decoder layers that make that
        micro-batch fit: two small trials (1/8 and 1/4 of it) predict the full one's peak without
        recomputation (activations grow linearly in tokens), so a micro-batch far too big is never
        run (its failed attempt would fill the device); when half of it would fit,
        micro_batch_tokens is halved instead (a warning says so); else, or when the full
        micro-batch did not fit after all, the fewest layers (_fewest_layers). With micro_batch_tokens
        left to it (planned_tokens), the largest of PLANNED_TOKENS predicted by the small trials (of
        the largest) and confirmed by its own to fit without recomputation, none above `largest`, at
        the activation memory budget of 1 or else (activation_memory_budget None, compiled layers) at
        LOW_MEMORY_BUDGET, whose trial runs where _BUDGET_BOUND of the line's activations would fit;
        if none does, 16,384 tokens and the fewest layers at the budget it started with. Usable: 95% of
        the device, or all of it but `reserve` bytes when given (what shares it, e.g. a sleeping
        engine, and headroom). The trials and the verdict are in self.memory_plan and logged. Leaves
        no gradients behind; MemoryError when it does not fit."""
        n = self.config.micro_batch_tokens
        total = torch.cuda.mem_get_info(self.device)[1]
        limit = total - reserve if reserve else total * 0.95
        self.memory_plan = {"usable_gib": limit / 2**30, "trials": []}
        none = None                 # the full micro-batch's peak without recomputation (predicted, then measured)
        auto = self.config.activation_checkpointing is None
        if auto and self.planned_tokens:
            sizes = [m for m in PLANNED_TOKENS if largest is None or m <= largest] or [PLANNED_TOKENS[-1]]
            big = sizes[0]
            small = {m: self._plan_trial(0, m) for m in (big // 8, big // 4)}
            if None not in small.values():
                line = lambda m: predict_peak(big // 8, small[big // 8], big // 4, small[big // 4], m)
                base, budget = line(0), self.memory_budget      # weights, gradients, AdamW: no activations
                low = [LOW_MEMORY_BUDGET] if self.compile and self.config.activation_memory_budget is None \
                    and LOW_MEMORY_BUDGET < budget else []
                for m in sizes:                        # the largest that fits, trials only where predicted to
                    for b in [budget, *low]:           # at the budget the line was drawn at, else the low one
                        guess = line(m) if b == budget else base + _BUDGET_BOUND * (line(m) - base)
                        if guess > limit:
                            continue
                        self._use_memory_budget(b)
                        peak = small[m] if m in small and b == budget else self._plan_trial(0, m)
                        if peak is not None and peak <= limit:
                            self.config = replace(self.config, micro_batch_tokens=m)
                            return self._plan_done(peak, limit, m)
                self._use_memory_budget(budget)
                none = line(n)
            return self._plan_done(self._fewest_layers(n, none, limit), limit, n)
        if auto and n >= 64:
            small = [self._plan_trial(0, n // 8), self._plan_trial(0, n // 4)]
            if None not in small:
                predicted = lambda m: predict_peak(n // 8, small[0], n // 4, small[1], m)
                none = predicted(n)
                if none > limit and predicted(n // 2) <= limit:
                    logging.getLogger(__name__).warning(   # half the tokens, nothing recomputed: faster
                        "micro_batch_tokens %d -> %d: a full micro-batch would not fit in training memory "
                        "without recomputation (%.1f GiB usable); activation_checkpointing=True keeps %d",
                        n, n // 2, limit / 2**30, n)
                    n, none = n // 2, predicted(n // 2)
                    self.config = replace(self.config, micro_batch_tokens=n)
        if not auto or n < 64 or (none is not None and none <= limit):
            peak = self._plan_trial(0 if auto else None, n)
            if not auto or (peak is not None and peak <= limit):
                return self._plan_done(peak, limit, n)
            none = peak                            # measured (None: out of memory)
        return self._plan_done(self._fewest_layers(n, none, limit), limit, n)

    def _use_memory_budget(self, budget: float) -> None:
        """Compile the decoder layers at this activation memory budget from the next pass on
        (torch.compiler.reset(): everything this process compiled compiles again at its next call)."""
        if budget != self.memory_budget:
            self.memory_budget = budget
            torch.compiler.reset()

    def _plan_trial(self, layers: int | None, tokens: int) -> int | None:
        """_trial_peak with that many layers recomputing (None: as they are), agreed over the ranks
        and recorded in memory_plan["trials"]; None: out of memory."""
        if layers is not None:
            self.recompute_activations(layers)
        peak = self.agreed_max([self._trial_peak(tokens)])[0]
        self.memory_plan["trials"].append([tokens, self.recomputed_layers,
                                           None if peak is None else round(peak / 2**30, 2),
                                           self.memory_budget])
        return peak

    def _fewest_layers(self, n: int, none: float | None, limit: float) -> int | None:
        """For an n-token micro-batch whose peak without recomputation (`none`; None: out of memory) is
        over the limit: a trial recomputing every layer, then the fewest layers on the line through
        the nearest trials that fit and that do not (the peak falls by about the same amount with each
        layer recomputed; a trial out of memory halves the range instead), four partial trials at
        most. Leaves that many layers recomputing; returns their peak (None when every layer does
        not fit either)."""
        layers = self.num_layers
        hi, hi_peak = layers, self._plan_trial(layers, n)   # the fewest layers known to fit
        if hi_peak is None or hi_peak > limit:
            return hi_peak
        lo, lo_peak = 0, none                               # the most known not to (None: out of memory)
        for _ in range(4):
            if hi - lo <= 1:
                break
            if lo_peak is None:
                k = (lo + hi + 1) // 2
            else:
                k = lo + math.ceil((lo_peak - limit) / max((lo_peak - hi_peak) / (hi - lo), 1.0))
                if k >= hi:
                    break
                k = max(k, lo + 1)
            peak = self._plan_trial(k, n)
            if peak is not None and peak <= limit:
                hi, hi_peak = k, peak
                break
            lo, lo_peak = k, peak
        if self.recomputed_layers != hi:
            self.recompute_activations(hi)
        return hi_peak

    def _plan_done(self, peak: int | None, limit: float, n: int) -> int:
        """measure_peak's verdict: logged and recorded, or MemoryError naming the levers."""
        plan, layers = self.memory_plan, self.num_layers
        plan.update(micro_batch_tokens=n, recomputed_layers=self.recomputed_layers,
                    activation_memory_budget=self.memory_budget,
                    peak_gib=None if peak is None else round(peak / 2**30, 2))
        if peak is not None and peak <= limit:
            logging.getLogger(__name__).info(
                "training memory: %d-token micro-batches, %d of %d decoder layers recomputed, activation "
                "memory budget %g, peak %.1f GiB of %.1f usable (trials [tokens, layers recomputed, GiB, "
                "budget]: %s)", n, self.recomputed_layers, layers, self.memory_budget, peak / 2**30,
                limit / 2**30, plan["trials"])
            return peak
        on = self.recomputes
        need = "ran out of device memory" if peak is None else f"peaks at {peak / 2**30:.1f} GiB"
        raise MemoryError(f"one micro-batch of {n} tokens does not fit in training memory on "
                          f"{torch.cuda.get_device_name(self.device)} (activation checkpointing "
                          f"{'on, ' + str(self.recomputed_layers) + ' layers' if on else 'off'}): its "
                          f"forward_backward {need} (weights, gradients and AdamW's state included), and "
                          f"{limit / 2**30:.1f} GiB is usable. Levers: a lower micro_batch_tokens, "
                          + "; ".join([*self._memory_levers(), "more GPUs, or a smaller model"]))

    @property
    def recomputes(self) -> bool:
        """Whether backward recomputes any decoder layer's activations (HF gradient checkpointing)."""
        return self.recomputed_layers > 0

    @property
    def num_layers(self) -> int:
        """The model's decoder layers (each one FSDP unit)."""
        return len(_decoder_layers(self.model))

    @property
    def recomputed_layers(self) -> int:
        """How many decoder layers recompute their activations in backward."""
        return recomputed_layers(self.model)

    def recompute_activations(self, layers: int | None = None) -> None:
        """Recompute that many decoder layers from now, evenly spaced (None: all; what
        activation_checkpointing=True sets at load)."""
        recompute_layers(self.model, layers)

    def agreed_max(self, values: list[int | None]) -> list[int | None]:
        """Each value's largest over the ranks (None, e.g. an out-of-memory trial, wins): memory
        decisions taken on these are the same on every rank, so their collectives stay in step."""
        if self.rank.world_size == 1:
            return list(values)
        big = 1 << 62
        t = torch.tensor([big if v is None else int(v) for v in values], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [None if x >= big else x for x in t.tolist()]

    def _trial_peak(self, n: int) -> int | None:
        """Peak bytes allocated by one forward_backward over n random tokens (None: out of memory),
        accumulating into gradients that already exist, as every micro-batch after a step's first
        does (a first one's backward frees activations as it makes gradients: it peaks lower)."""
        from minirl.data import Rollout
        dev = self.device
        ids = torch.randint(0, self.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        dummy = Rollout(prompt_ids=ids[:1].tolist(), completion_ids=ids[1:].tolist(), reward=0.0,
                        sampling_logprobs=[0.0] * (n - 1), device=str(dev))
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            self.forward_backward([dummy], lambda lp, mb, logits: (-lp, {}))
            peak = torch.cuda.max_memory_allocated(dev)
        except MemoryError:                        # forward_backward's out-of-memory error (resharded)
            peak = None
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return peak

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
        from minirl.core import get_logprobs
        lora = self.config.lora
        emit = on_bucket if lora is None else (lambda b: on_bucket(merge_bucket(b, lora.scale)))
        if probe_ids is None:
            for bucket in full_weight_buckets(self.model, dtype=dtype):
                emit(bucket)
            return None, None
        fp = torch.zeros((), dtype=torch.int64, device=self.device)

        def both(bucket):
            nonlocal fp
            bucket = bucket if lora is None else merge_bucket(bucket, lora.scale)
            on_bucket(bucket)
            fp = fp + bucket_fingerprint(bucket if names is None else [(n, t) for n, t in bucket if n in names])

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
        Hugging Face directory on rank 0: config, tokenizer, fp32 safetensors. Collective."""
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer
        sd: dict[str, torch.Tensor] = {}
        self.gather(lambda b: sd.update((n, t.to("cpu", copy=True)) for n, t in b), dtype=torch.float32)
        if self.rank.rank == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            save_file({n: t.contiguous() for n, t in sd.items()}, str(Path(out_dir) / "model.safetensors"),
                      metadata={"format": "pt"})
            remote = self.config.trust_remote_code
            AutoConfig.from_pretrained(self.path, trust_remote_code=remote).save_pretrained(out_dir)
            AutoTokenizer.from_pretrained(self.path).save_pretrained(out_dir)

    def load_checkpoint(self, ckpt, path=None) -> dict:
        """Restore model, optimizer, RNG and policy version (the latest checkpoint by default).
        Raises CheckpointError if it was made with another model, tokenizer or precision."""
        self._optimizer_state_here()
        out = ckpt.load(self.model, self.optimizer, path=path, compat=self.compat())
        self._state_host = None          # loading may replace the state's tensors: new host buffers
        self.policy_version, self.stepped = out["state"]["policy_version"], False
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def close(self) -> None:
        if self.rank.owns_group and dist.is_initialized():
            dist.destroy_process_group()
