"""The co-located backend's memory plan: how one rank's trainer and vLLM engine share its device.

    plan = memory.plan(trainer, llm_kwargs, WeightManagerConfig())   # measures on CUDA: a MemoryPlan
    trainer.apply(plan); print(plan)      # WeightManager does both at start: wm.memory_plan, logged

Applied once: the trainer's part by Trainer.apply, the engine's as vllm.LLM kwargs, AdamW's place
by the WeightManager. The user's configs are never rewritten: what the user set is kept (named in
plan.user_set), the rest planned. Decisions on measurements take the largest over the ranks
(agreed_max), so their collectives stay in step. On CPU nothing is measured: training state and
engine (kv_cache_gib, as the engine's kv_cache_memory_bytes) must fit the RAM. In order on CUDA:
1. Before loading (check_before_loading): the trainer's weights, gradients, AdamW state and
   reference and the engine with two max_model_len sequences of KV cache must fit; else MemoryError.
2. Sleep level 2 unless set; set, with the engine sized by the user (gpu_memory_utilization,
   kv_cache_memory_bytes): nothing is measured.
3. The training step (measure_peak): trial steps of random tokens against the device less what a
   sleeping engine keeps (ENGINE_ASLEEP) and _headroom. activation_checkpointing set: one trial.
   Else trials of 1/8 and 1/4 of a micro-batch draw the line of peak against tokens. Size left:
   from the largest PLANNED_TOKENS down (16,384 at most beside a resident engine), a trial where
   the line fits at budget 1 (or the one set), then (compiled, budget left) at LOW_MEMORY_BUDGET
   where _BUDGET_BOUND of its activations fit; the first that fits wins; none: 16,384 tokens and
   the fewest layers; not even all of them: half as many tokens, every layer recomputing, down to
   SMALLEST_TOKENS. Size set: kept (as every setting the user gives); a trial where the line says
   it fits, else the fewest layers: a trial recomputing every layer, then the count on the line
   between the nearest trials that fit and do not (out of memory: the range halves), four at most.
4. AdamW's state to the host while generating (offload_optimizer left) where the engine sleeps, the
   KV cache wanted (kv_cache_gib, else max_num_seqs x max_model_len) would leave less than the
   headroom free beside the trainer, and the host has 1.5x the state + 4 GiB.
5. KV cache: the wanted size, cut to what is free beside the trainer's weights and state (asleep,
   less max(2 GiB, 3%)) or its step's peak (resident, less the headroom); under two max_model_len
   sequences, or kv_cache_gib set and more than is free: MemoryError. Left alone when the user sized
   the engine.
6. When the engine first sleeps (beside_sleeping_engine): the step must fit beside it with the
   headroom; else every layer recomputes (a revised plan, applied again) or, set, MemoryError.
Hardware: CPU or CUDA GPUs; trials run on CUDA only (the tests stand in for the device).
"""

from __future__ import annotations

import gc
import logging
import math
import os
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from minirl import vllm_compat as vc
from minirl.distributed import pick_device
from minirl.model import recompute_layers
from minirl.trainer import Trainer, TrainerConfig, memory_levers

GIB = 1 << 30
log = logging.getLogger(__name__)

PLANNED_TOKENS = (32768, 16384, 8192)
"""The micro-batch sizes a plan chooses from, largest first: larger ones train faster where they
fit (fewer FSDP2 gathers and launches, larger matmuls; benchmarks/results/2026-12-04)."""

SMALLEST_TOKENS = 4096
"""The smallest micro-batch a plan halves down to, every layer recomputing, before MemoryError."""

LOW_MEMORY_BUDGET = 0.6
"""The activation memory budget a plan tries when a micro-batch does not fit at 1
(benchmarks/results/2026-12-04-b: Qwen3-4B, 16,384 tokens at 0.6 beat 8,192 at 1)."""

_BUDGET_BOUND = 0.5
"""A trial at LOW_MEMORY_BUDGET runs only where the line's activations at budget 1, scaled by this,
would fit (0.55 of them remained at 0.6 in the measurement above)."""

ENGINE_ASLEEP = 6 * GIB
"""What a sleeping engine keeps on the device (CUDA graphs, buffers; Qwen3-4B, 512 sequences, H200)."""

HOST_RESERVE = 8 * GIB
"""Host memory a training process holds besides offloaded state."""


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What plan() decided for one rank (the defaults: nothing measured). Settings: the first six
    fields (kv_cache_bytes None: the engine's default or the user's size); user_set names those the
    user set, kept as given. engine_kwargs: what goes to vllm.LLM. Measured: a training step's peak
    (weights, gradients, AdamW state included), what the trainer holds between steps, the trials'
    limit, and each trial (tokens, layers recomputed, GiB or None: out of memory, budget)."""

    micro_batch_tokens: int = 16384
    recomputed_layers: int = 0
    activation_memory_budget: float = 1.0
    sleep_level: int = 0
    kv_cache_bytes: int | None = None
    offload_optimizer: bool = False
    user_set: tuple[str, ...] = ()
    engine_kwargs: dict = field(default_factory=dict)
    peak_bytes: int | None = None
    held_bytes: int | None = None
    usable_bytes: float | None = None
    trials: tuple[tuple, ...] = ()

    def __str__(self) -> str:
        set_ = lambda name: " (set)" if name in self.user_set else ""
        gib = lambda b: "-" if b is None else f"{b / GIB:.1f}"
        return (f"memory plan: {self.micro_batch_tokens}-token micro-batches{set_('micro_batch_tokens')}, "
                f"{self.recomputed_layers} decoder layers recomputed{set_('recomputed_layers')}, activation memory "
                f"budget {self.activation_memory_budget:g}{set_('activation_memory_budget')}, peak "
                f"{gib(self.peak_bytes)} GiB of {gib(self.usable_bytes)}; engine sleep level {self.sleep_level}"
                f"{set_('sleep_level')}, KV cache {gib(self.kv_cache_bytes)} GiB{set_('kv_cache_bytes')}, AdamW's "
                f"state on the {'host' if self.offload_optimizer else 'device'} while generating"
                f"{set_('offload_optimizer')}; trials [tokens, layers recomputed, GiB, budget]: "
                f"{[list(t) for t in self.trials]}")


def plan(trainer: Trainer, kw: dict, cfg) -> MemoryPlan:
    """The plan for this rank (cfg: a colocated.WeightManagerConfig, kw: the user's vllm.LLM kwargs),
    logged; MemoryError naming what was needed, what there was, and the levers, when nothing fits.
    The engine's settings are CUDA's: on CPU the engine never sleeps and none of them is set."""
    p = _plan(trainer, kw, cfg)
    if trainer.device.type == "cuda":
        size = cfg.kv_cache_gib or kw.get("kv_cache_memory_bytes") or kw.get("gpu_memory_utilization")
        given = {"sleep_level": cfg.sleep_level, "offload_optimizer": cfg.offload_optimizer, "kv_cache_bytes": size}
        p = replace(p, user_set=p.user_set + tuple(k for k, v in given.items() if v is not None))
    log.info("%s", p)
    return p


def _plan(trainer: Trainer, kw: dict, cfg) -> MemoryPlan:
    n_params = sum(p.numel() for p in trainer.model.parameters())
    if trainer.device.type != "cuda":
        import psutil
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))      # fp32 training state sharded, an engine a rank
        kv = (kw.get("kv_cache_memory_bytes", vc.DEFAULT_CPU_KV_CACHE_BYTES) if cfg.kv_cache_gib is None
              else int(cfg.kv_cache_gib * GIB))
        need = n_params * (16 / trainer.rank.world_size + 4) + kv
        avail = psutil.virtual_memory().available / local
        if (short := agreed_max(trainer, int(need - avail))) > 0:      # every rank decides alike
            raise MemoryError(f"the model does not fit in RAM: training + engine need ~{need / GIB:.1f} GiB a rank, "
                              f"{avail / GIB:.1f} GiB is available to each of this host's {local} rank(s)"
                              + (f" (another host lacks {short / GIB:.1f} GiB)" if need <= avail else "")
                              + ". Use a smaller model or more machines.")
        return replace(_as_loaded(trainer), engine_kwargs={"kv_cache_memory_bytes": kv} if cfg.kv_cache_gib else {})
    user_sized = "gpu_memory_utilization" in kw or "kv_cache_memory_bytes" in kw
    level = 2 if cfg.sleep_level is None else cfg.sleep_level        # offload_optimizer with 0: refused before
    if cfg.sleep_level is not None and user_sized:
        return replace(_as_loaded(trainer), sleep_level=level, offload_optimizer=bool(cfg.offload_optimizer))
    headroom = _headroom(torch.cuda.mem_get_info(trainer.device)[1])
    # a resident engine's KV cache has to fit beside the step's peak: planned rows of 16,384 at most
    fit = measure_peak(trainer, reserve=ENGINE_ASLEEP + headroom, largest=PLANNED_TOKENS[1] if level == 0 else None)
    fit = replace(fit, sleep_level=level, held_bytes=torch.cuda.memory_allocated(trainer.device))   # no gradients
    if user_sized:
        return replace(fit, offload_optimizer=bool(cfg.offload_optimizer))
    return _engine_fit(trainer, n_params, fit, kw, cfg, headroom)


def _as_loaded(trainer: Trainer, n: int | None = None) -> MemoryPlan:
    """The trainer's settings as they are (with n-token micro-batches), and those the user set."""
    tc = trainer.config
    given = {"micro_batch_tokens": tc.micro_batch_tokens, "recomputed_layers": tc.activation_checkpointing,
             "activation_memory_budget": tc.activation_memory_budget}
    return MemoryPlan(micro_batch_tokens=n or trainer.micro_batch_tokens, recomputed_layers=trainer.recomputed_layers,
                      activation_memory_budget=trainer.memory_budget,
                      user_set=tuple(k for k, v in given.items() if v is not None))


def _engine(n_params: int, mc, dsize: int) -> tuple[float, int]:
    """(bytes of the engine but its KV cache: weights, activations, graphs, sampler; KV bytes a token)."""
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return n_params * dsize * 1.05 + 4 * GIB, 2 * mc.num_hidden_layers * mc.num_key_value_heads * head_dim * dsize


def _engine_fit(trainer: Trainer, n_params: int, fit: MemoryPlan, kw: dict, cfg, headroom: float) -> MemoryPlan:
    """Steps 4 and 5 of the table: AdamW's place, the KV cache and the engine kwargs."""
    free, total = torch.cuda.mem_get_info(trainer.device)
    mc = trainer.model.config
    engine, per_token = _engine(n_params, mc, torch.finfo(trainer.compute_dtype).bits // 8)
    max_len = kw.get("max_model_len") or mc.max_position_embeddings
    want = cfg.kv_cache_gib * GIB if cfg.kv_cache_gib is not None else kw.get("max_num_seqs", 256) * max_len * per_token
    state, offload = trainer.optimizer_state_bytes, bool(cfg.offload_optimizer)
    if cfg.offload_optimizer is None:   # the KV cache wanted would leave too little free
        import psutil
        host = psutil.virtual_memory().available / int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        offload = (fit.sleep_level == 2 and state > 0 and want > free - headroom - engine
                   and host > 1.5 * state + 4 * GIB)
        offload = bool(agreed_max(trainer, int(offload)))     # every rank decides alike
    fit, free = replace(fit, offload_optimizer=offload), free + offload * state
    kv = min(want, free - headroom - (fit.peak_bytes - fit.held_bytes) - engine if fit.sleep_level == 0
             else free - max(2 * GIB, 0.03 * total) - engine)   # resident: beside the peak, asleep: the weights
    kv = -agreed_max(trainer, -int(kv))                          # the smallest over the ranks: they decide alike
    if kv < 2 * max_len * per_token:
        lever = ("sleep_level=2 (or leave it unset), " if fit.sleep_level == 0 else
                 "" if offload else "offload_optimizer=True (AdamW's state on the host while generating), ")
        raise MemoryError(
            f"trainer and engine do not fit on {torch.cuda.get_device_name(trainer.device)}: training "
            f"{n_params / 1e9:.2f}B parameters over {trainer.rank.world_size} GPU(s) peaks at "
            f"{fit.peak_bytes / GIB:.1f} GiB and keeps {(fit.held_bytes - offload * state) / GIB:.1f} GiB while "
            f"generating; the engine needs {engine / GIB:.1f} GiB plus a KV cache of at least "
            f"{2 * max_len * per_token / GIB:.2f} GiB (two {max_len}-token sequences), and {free / GIB:.1f} of "
            f"{total / GIB:.1f} GiB is free. Levers: {lever}a smaller micro_batch_tokens or "
            "activation_checkpointing=True, a shorter max_model_len, more GPUs, or a smaller model.")
    if cfg.kv_cache_gib is not None and kv < want:      # a size the user set is kept, or refused
        raise MemoryError(
            f"kv_cache_gib={cfg.kv_cache_gib:g} does not fit on {torch.cuda.get_device_name(trainer.device)}: "
            f"{kv / GIB:.1f} GiB is left for the KV cache beside the trainer and the engine's {engine / GIB:.1f} "
            f"GiB. Levers: kv_cache_gib={math.floor(kv / GIB * 10) / 10:g} or less, or unset (what is left), "
            + ("" if offload or fit.sleep_level == 0 else "offload_optimizer=True, ") + "more GPUs.")
    return replace(fit, kv_cache_bytes=int(kv), engine_kwargs={
        "kv_cache_memory_bytes": int(kv), "gpu_memory_utilization": round((engine + kv) / total + 0.005, 4)})


def _headroom(total: int) -> float:
    """Room a planned training step leaves free, for the allocator's fragmentation between steps."""
    return max(2 * GIB, 0.10 * total)


def agreed_max(trainer: Trainer, value: int | None) -> int | None:
    """The value's largest over the ranks (None, e.g. an out-of-memory trial, wins)."""
    if trainer.rank.world_size == 1:
        return value
    big = 1 << 62
    t = torch.tensor(big if value is None else int(value), dtype=torch.int64, device=trainer.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if t.item() >= big else t.item()


def predict_peak(n1: int, peak1: int, n2: int, peak2: int, n: int) -> float:
    """The peak at n tokens on the line through two trials (gradients fixed, activations linear in tokens)."""
    return peak2 + (peak2 - peak1) / (n2 - n1) * (n - n2)


# -- the training step (step 3 of the table) ----------------------------------------------------

def measure_peak(trainer: Trainer, reserve: int = 0, largest: int | None = None) -> MemoryPlan:
    """The training step's plan (micro_batch_tokens, recomputed layers, budget, peak, trials) by
    trial steps on the trainer, against 95% of the device or all of it but `reserve` bytes, planned
    sizes up to `largest`. Leaves the trainer's layers and budget as planned, and no gradients;
    MemoryError when nothing fits."""
    tc = trainer.config
    total = torch.cuda.mem_get_info(trainer.device)[1]
    trial = _Trials(trainer, total - reserve if reserve else total * 0.95)
    n = PLANNED_TOKENS[1] if tc.micro_batch_tokens is None else tc.micro_batch_tokens
    if tc.activation_checkpointing is not None:              # set: the layers as loaded
        return trial.verdict(n, trial(n))
    if tc.micro_batch_tokens is None:
        n, peak = _largest_that_fits(trial, largest)
        while (peak is None or peak > trial.limit) and n > SMALLEST_TOKENS:   # every layer recomputing
            n //= 2
            peak = trial(n, trainer.num_layers)
        return trial.verdict(n, peak)
    line = trial.line(n)[1] if n >= 64 else None
    none = None if line is None else line(n)                # the full micro-batch's peak, predicted
    if n < 64 or (none is not None and none <= trial.limit):
        peak = trial(n, 0)
        if peak is not None and peak <= trial.limit:
            return trial.verdict(n, peak)
        none = peak                                          # measured (None: out of memory)
    return trial.verdict(n, _fewest_layers(trial, n, none))


class _Trials:
    """One plan's trial steps on a trainer, each agreed over the ranks and recorded."""

    def __init__(self, trainer: Trainer, limit: float):
        self.trainer, self.limit, self.rows = trainer, limit, []

    def __call__(self, tokens: int, layers: int | None = None) -> int | None:
        """The peak of a step of `tokens`, `layers` recomputing (None: as they are); None: out of memory."""
        tr = self.trainer
        if layers is not None:
            recompute_layers(tr.model, layers)
        peak = agreed_max(tr, trial_peak(tr, tokens))
        self.rows.append((tokens, tr.recomputed_layers, None if peak is None else round(peak / GIB, 2),
                          tr.memory_budget))
        return peak

    def line(self, n: int):
        """Trials of n // 8 and n // 4 tokens, nothing recomputed: ({tokens: peak}, the line through
        them: tokens -> peak, or None when one ran out of memory)."""
        small = {m: self(m, 0) for m in (n // 8, n // 4)}
        return small, None if None in small.values() else (
            lambda m: predict_peak(n // 8, small[n // 8], n // 4, small[n // 4], m))

    def verdict(self, n: int, peak: int | None) -> MemoryPlan:
        """The training step's plan, or MemoryError naming the levers."""
        tr, limit = self.trainer, self.limit
        if peak is not None and peak <= limit:
            return replace(_as_loaded(tr, n), peak_bytes=peak, usable_bytes=limit, trials=tuple(self.rows))
        k = tr.recomputed_layers
        need = "ran out of device memory" if peak is None else f"peaks at {peak / GIB:.1f} GiB"
        raise MemoryError(f"one micro-batch of {n} tokens does not fit in training memory on "
                          f"{torch.cuda.get_device_name(tr.device)} (activation checkpointing "
                          f"{f'on, {k} layers' if k else 'off'}): its forward_backward {need} (weights, "
                          f"gradients and AdamW's state included), and {limit / GIB:.1f} GiB is usable. Levers: "
                          "a lower micro_batch_tokens, " + "; ".join([*memory_levers(tr),
                                                                      "more GPUs, or a smaller model"]))


def _largest_that_fits(trial: _Trials, largest: int | None) -> tuple[int, int | None]:
    """(tokens, peak) of the largest PLANNED_TOKENS that fits without recomputation, none above
    `largest`; else 16,384 tokens with _fewest_layers (told its peak on the small trials' line)."""
    sizes = [m for m in PLANNED_TOKENS if largest is None or m <= largest] or [PLANNED_TOKENS[-1]]
    tr, n = trial.trainer, PLANNED_TOKENS[1]
    small, line = trial.line(sizes[0])
    if line is None:
        return n, _fewest_layers(trial, n, None)
    base, budget = line(0), tr.memory_budget                 # weights, gradients, AdamW: no activations
    low = [LOW_MEMORY_BUDGET] if tr.compile and tr.config.activation_memory_budget is None \
        and LOW_MEMORY_BUDGET < budget else []
    for m in sizes:                        # the largest that fits, trials only where predicted to
        for b in [budget, *low]:           # at the budget the line was drawn at, else the low one
            guess = line(m) if b == budget else base + _BUDGET_BOUND * (line(m) - base)
            if guess > trial.limit:
                continue
            tr.use_memory_budget(b)
            peak = small[m] if m in small and b == budget else trial(m, 0)
            if peak is not None and peak <= trial.limit:
                return m, peak
    tr.use_memory_budget(budget)
    return n, _fewest_layers(trial, n, line(n))


def _fewest_layers(trial: _Trials, n: int, none: float | None) -> int | None:
    """The fewest decoder layers recomputing that make n tokens fit (the peak falls by about the
    same amount with each), left recomputing, and their peak (None: not even all of them);
    `none`: the peak without recomputation (None: out of memory)."""
    tr, limit = trial.trainer, trial.limit
    hi, hi_peak = tr.num_layers, trial(n, tr.num_layers)     # the fewest layers known to fit
    if hi_peak is None or hi_peak > limit:
        return hi_peak
    lo, lo_peak = 0, none                                    # the most known not to (None: out of memory)
    for _ in range(4):          # k on the line between them, lo + 1 at least (out of memory: halfway)
        k = ((lo + hi + 1) // 2 if lo_peak is None else
             lo + max(1, math.ceil((lo_peak - limit) / max((lo_peak - hi_peak) / (hi - lo), 1.0))))
        if k >= hi:
            break
        peak = trial(n, k)
        if peak is not None and peak <= limit:
            hi, hi_peak = k, peak
            break
        lo, lo_peak = k, peak
    if tr.recomputed_layers != hi:
        recompute_layers(tr.model, hi)
    return hi_peak


def trial_peak(trainer: Trainer, n: int) -> int | None:
    """Peak bytes allocated by one forward_backward over n random tokens (None: out of memory),
    accumulating into gradients that already exist, as every micro-batch after a step's first
    does (a first one's backward frees activations as it makes gradients: it peaks lower)."""
    from minirl.data import Rollout
    dev = trainer.device
    ids = torch.randint(0, trainer.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    dummy = Rollout(prompt_ids=ids[:1].tolist(), completion_ids=ids[1:].tolist(), reward=0.0,
                    sampling_logprobs=[0.0] * (n - 1), device=str(dev))
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        for p in trainer.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        trainer.forward_backward([dummy], lambda lp, mb, logits: (-lp, {}))
        peak = torch.cuda.max_memory_allocated(dev)
    except (MemoryError, torch.OutOfMemoryError):   # forward_backward's (resharded), or the gradients'
        peak = None
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()                    # a failed trial's activations may wait in cycles through its traceback
    torch.cuda.empty_cache()
    return peak


# -- before loading, and once the engine sleeps (steps 1 and 6 of the table) ----------------------

def check_before_loading(model: str, tc: TrainerConfig, max_model_len: int | None,
                         offload_optimizer: bool | None = False) -> None:
    """Step 1 on the CUDA device this rank will train on (the one init_distributed picks: asking the
    current one, cuda:0, would put a context of every rank of a host on it), the host's memory shared
    by its LOCAL_WORLD_SIZE processes. offload_optimizer=None (the plan's to choose): the mode fits
    if it fits either way."""
    import psutil
    dev = pick_device()
    ways = (False, True) if offload_optimizer is None else (offload_optimizer,)
    host = psutil.virtual_memory().available / int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    for i, off in enumerate(ways):
        est = estimate_memory(model, tc, world=int(os.environ.get("WORLD_SIZE", 1)), max_model_len=max_model_len,
                              offload_optimizer=off)
        try:
            return check_fits(est, torch.cuda.mem_get_info(dev)[1], torch.cuda.get_device_name(dev), host)
        except MemoryError:
            if i == len(ways) - 1:
                raise


def estimate_memory(model: str, trainer: TrainerConfig, *, world: int = 1, max_model_len: int | None = None,
                    offload_optimizer: bool = False) -> dict[str, float]:
    """Bytes one GPU needs at least, by part, before anything is built (the model is read on the
    meta device): the trainer's fp32 weights, gradients and AdamW moments (shards of `world`; 0 on
    the device when cpu_offload; with LoRA those of the adapters and the also_train modules), the
    reference policy and the engine's weights (bf16 on CUDA, fp32 with mixed_precision="fp32") + 4
    GiB + a KV cache for two max_model_len-token sequences; no activations. "needed" = what stays
    resident while generating + the larger of the gradients and the engine (asleep while training).
    "host" = what offload keeps in host memory instead. offload_optimizer (the co-located config's):
    AdamW's state waits on the host while the engine is awake, so it counts beside the gradients."""
    from transformers import AutoConfig, AutoModelForCausalLM
    mc = AutoConfig.from_pretrained(model, trust_remote_code=trainer.trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(mc, trust_remote_code=trainer.trust_remote_code)
    n = sum(p.numel() for p in meta.parameters())
    lora = trainer.lora
    adapters = 0 if lora is None else sum(lora.rank * (m.in_features + m.out_features) for name, m in
                                          meta.named_modules() if isinstance(m, torch.nn.Linear)
                                          and name.rsplit(".", 1)[-1] in lora.target_modules)
    full = {} if lora is None else {id(p): p.numel() for name, m in meta.named_modules()   # also_train: in full
                                    if name.rsplit(".", 1)[-1] in lora.also_train for p in m.parameters()}
    trained = n if lora is None else adapters + sum(full.values())
    on_device = 0 if trainer.cpu_offload else 1
    separate_ref = trainer.reference and not (lora and not lora.also_train)
    dsize = 4 if trainer.mixed_precision == "fp32" else 2          # the compute dtype: engine and reference
    engine, per_token = _engine(n, mc, dsize)
    state = {"weights": 4 * (n + adapters) / world, "gradients": 4 * trained / world,
             "optimizer": 8 * trained / world}                      # on the device, or on the host with offload
    est = {k: v * on_device for k, v in state.items()} | {
        "reference": dsize * n / world * (separate_ref and not trainer.reference_offload),
        "engine": engine + 2 * (max_model_len or mc.max_position_embeddings) * per_token,
        "params": n, "trained_params": trained,
        "host_reference": dsize * n / world * (separate_ref and trainer.reference_offload)}
    est["host_optimizer"] = est["optimizer"] * offload_optimizer     # while generating
    est["host"] = sum(state.values()) * (1 - on_device) + est["host_reference"] + est["host_optimizer"]
    return est | {"needed": _needed(est)}


def _needed(est: dict[str, float], trained: float = 1.0) -> float:
    """estimate_memory's "needed", with `trained` times the gradients and AdamW state."""
    moved = est["host_optimizer"] * trained                                # beside the gradients, not the engine
    resident = est["weights"] + est["optimizer"] * trained - moved + est["reference"]
    return resident + max(est["gradients"] * trained + moved, est["engine"])


def check_fits(est: dict[str, float], available: float, where: str, host_available: float | None = None) -> None:
    """MemoryError when estimate_memory's `needed` exceeds `available` bytes (or its `host` part
    exceeds `host_available`): each part's need, what there is, and the levers with what they save."""
    if host_available is not None and est["host"] and est["host"] + HOST_RESERVE > host_available:
        raise MemoryError(
            f"offload does not fit in host memory: it keeps {est['host'] / GIB:.1f} GiB there (fp32 weights, "
            f"gradients and AdamW state; {est['host_reference'] / GIB:.1f} GiB of it the reference) beside the "
            f"~{HOST_RESERVE / GIB:.0f} GiB the process itself holds (CUDA context, libraries, the engine's host "
            f"side), {host_available / GIB:.1f} GiB is available. Levers: LoRA (TrainerConfig(lora=LoRAConfig()), "
            "launch --lora-rank 16) keeps only the adapters' state; more GPUs on more hosts (the state is "
            "sharded); the reference on the device (reference_offload=False); or a smaller model.")
    if est["needed"] <= available:
        return
    g = {k: v / GIB for k, v in est.items() if k not in ("params", "trained_params")}
    parts = ", ".join(f"{k} {g[k]:.1f}" for k in ("weights", "gradients", "optimizer", "reference", "engine"))
    levers = []
    if est["trained_params"] == est["params"]:
        lora = _needed(est) - _needed(est | {"reference": 0.0}, 0.02)   # ~2% trained; the reference: adapters off
        levers.append(f"LoRA (TrainerConfig(lora=LoRAConfig()), launch --lora-rank 16) saves ~{lora / GIB:.1f} GiB")
    if est["weights"] > 0:
        levers.append(f"cpu_offload=True (--offload) saves {g['weights'] + g['optimizer']:.1f} GiB of "
                      "weights and AdamW state (slower steps)")
    if est["optimizer"] > 0 and not est["host_optimizer"]:
        levers.append(f"offload_optimizer=True (--offload-optimizer on) keeps AdamW's {g['optimizer']:.1f} GiB on the "
                      "host while generating")
    if est["reference"] > 0:
        levers.append(f"reference_offload=True (--reference-offload) or LoRA saves {g['reference']:.1f} GiB")
    levers.append("more GPUs (every trainer part is sharded), a shorter max_model_len, or a smaller model")
    raise MemoryError(f"this mode does not fit on {where}: it needs at least {g['needed']:.1f} GiB "
                      f"({parts} GiB; activations come on top), {available / GIB:.1f} GiB is there. "
                      f"Levers: {'; '.join(levers)}.")


def beside_sleeping_engine(trainer: Trainer, plan: MemoryPlan) -> MemoryPlan:
    """Step 6: the plan, or with every layer recomputing when its training step (its peak above
    what the trainer holds) does not fit beside the sleeping engine with _headroom, as the rank
    shortest of memory finds; MemoryError when recomputation was set by the user."""
    if plan.peak_bytes is None or plan.held_bytes is None:
        return plan
    need = plan.peak_bytes - plan.held_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(trainer.device)
    headroom = _headroom(total)
    short = agreed_max(trainer, int(need + headroom - free))    # every rank decides alike
    if short <= 0 or plan.recomputed_layers == trainer.num_layers:
        return plan
    what = (f"a training step needs {need / GIB:.1f} GiB beside the weights and {headroom / GIB:.1f} GiB "
            f"of headroom; {free / GIB:.1f} GiB is free beside the sleeping engine"
            + (f" (another rank lacks {short / GIB:.1f} GiB)" if need + headroom <= free else ""))
    if "recomputed_layers" in plan.user_set:
        raise MemoryError(f"{what} on {torch.cuda.get_device_name(trainer.device)}. Levers: "
                          "activation_checkpointing=True (or leave it unset), a smaller micro_batch_tokens, "
                          "LoRA, more GPUs, or a smaller model.")
    log.warning("%s: activation checkpointing on, every layer", what)   # once per run
    return replace(plan, recomputed_layers=trainer.num_layers)
