"""Engine-step instrumentation for the benchmarks (benchmarks/episodes.py, benchmarks/step.py): every
step's seconds, scheduled tokens and whether it held a prefill, and the CUDA-graph size limit. It
reaches into vLLM's engine and scheduler (0.22 GPU, 0.32 CPU), as minirl/vllm_compat.py does.
"""

from __future__ import annotations

import contextlib
import time

from minirl.vllm_compat import LLM


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
    engine = llm.llm_engine
    scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
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
