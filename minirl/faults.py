"""Calls bounded in time, and settings checked before any engine, for the async generators (actors/generation.py):

    reward = bounded(reward_fn, 30.0, "reward_fn")      # TimeoutError instead of a hang
    value = await asyncio.wait_for(in_thread(tool, x), 5.0)   # a thread nobody joins
    check_settings("RolloutServer", group_size, sampling, reward_fn, 30.0, "stop", {})   # before engines

No Ray here. Tests: `pytest tests/test_async_faults.py tests/test_episodes.py`. Hardware: CPU (any).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Callable


def bounded(fn: Callable, timeout_s: float | None, what: str = "the call") -> Callable:
    """fn, but a call still running after timeout_s raises TimeoutError naming `what` (Python
    cannot interrupt it: it goes on in a daemon thread, its result unused). None: fn itself."""
    if timeout_s is None:
        return fn
    if not timeout_s > 0:
        raise ValueError(f"{what}: timeout must be > 0 s (or None: no bound), got {timeout_s}")

    def call(*args, **kwargs):
        box: list = []
        worker = threading.Thread(target=lambda: box.append(_outcome(fn, args, kwargs)), daemon=True)
        worker.start()
        worker.join(timeout_s)
        if not box:
            raise TimeoutError(f"{what} did not return within {timeout_s} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value
    return call


def in_thread(fn: Callable, *args, **kwargs) -> asyncio.Future:
    """fn(*args, **kwargs) in a daemon thread of its own, as a future of the running event loop.
    Unlike asyncio.to_thread nothing ever joins that thread, so a call that never returns holds
    neither the loop, asyncio.run's shutdown, nor the interpreter's exit; its result goes unused."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        outcome = _outcome(fn, args, kwargs)
        with contextlib.suppress(RuntimeError):     # the loop closed meanwhile: nobody waits for it
            loop.call_soon_threadsafe(settle, *outcome)
    threading.Thread(target=work, daemon=True, name=f"minirl-{getattr(fn, '__name__', 'call')}").start()
    return future


def _outcome(fn, args, kwargs) -> tuple[bool, object]:
    try:
        return True, fn(*args, **kwargs)
    except Exception as e:
        return False, e


def check_settings(who: str, group_size, sampling: dict | None, reward_fn, reward_timeout_s, on_failure: str,
                   minimums: dict) -> None:
    """Refuse, naming the fix, settings with which every request would fail: group_size < 1,
    SamplingParams vLLM rejects (max_tokens=0, unknown keys...), a reward_fn that is not callable,
    reward_timeout_s <= 0, an unknown on_failure, and minimums {name: (value, lowest allowed)}."""
    from minirl import vllm_compat as vc
    for name, (v, low) in {"group_size": (group_size, 1), **minimums}.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low:
            raise ValueError(f"{who}: {name}={v!r}, must be a number >= {low:g}")
    if not callable(reward_fn):
        raise TypeError(f"{who}: reward_fn must be callable as reward_fn(prompt, completion[, metadata]), "
                        f"got {reward_fn!r:.80}")
    if reward_timeout_s is not None and not reward_timeout_s > 0:
        raise ValueError(f"{who}: reward_timeout_s={reward_timeout_s!r}, must be > 0 s (or None: unbounded)")
    if on_failure not in ("stop", "skip"):
        raise ValueError(f"{who}: on_failure={on_failure!r}: choose 'stop' (a failed prompt ends the run) "
                         "or 'skip' (it is recorded and the run goes on)")
    try:
        vc.SamplingParams(**{"logprobs": 0, **(sampling or {}), "n": group_size})
    except Exception as e:        # vLLM's VLLMValidationError is no ValueError
        raise ValueError(f"{who}: sampling={sampling!r} with n=group_size={group_size}: {e}") from None
