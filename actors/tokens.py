"""The run token of a rollout queue: only the run that created the queue may call it.

    q = QueueClient(handle, token)          # q.put.remote(...) sends put(..., token=token)
    @guarded                                # on an actor method: PermissionError on a wrong token

RolloutServer makes a random token (or takes token= / MINIRL_QUEUE_TOKEN) and creates the queue
with it; its generators get it as an argument, trainers in the same process find it here
(remember / known), trainers in another job read MINIRL_QUEUE_TOKEN. A queue created without
a token (create_queue(token=None)) is open to every caller. Tests: tests/test_queue_actor.py.
Hardware: CPU (any).
"""

from __future__ import annotations

import os
import secrets

ENV = "MINIRL_QUEUE_TOKEN"
_KNOWN: dict[tuple[str, str], str] = {}     # (namespace, name) -> token of queues this process created


def for_run(token: str | None = None) -> str:
    """The run's token: `token`, else $MINIRL_QUEUE_TOKEN, else a new random one."""
    return token or os.environ.get(ENV) or secrets.token_hex(16)


def remember(namespace: str, name: str, token: str | None) -> None:
    if token:
        _KNOWN[(namespace, name)] = token


def known(namespace: str, name: str) -> str | None:
    """The token of queue `name`: created by this process, else $MINIRL_QUEUE_TOKEN, else None."""
    return _KNOWN.get((namespace, name)) or os.environ.get(ENV) or None


def guarded(method, like=None):
    """An async actor method that first checks the caller's `token` keyword against self.token
    (no functools.wraps: Ray would check calls against the wrapped signature, without `token`)."""
    async def call(self, *args, token: str | None = None, **kwargs):
        if self.token is not None and token != self.token:
            raise PermissionError(
                f"rollout queue {self.name} belongs to another run ({'no' if token is None else 'a wrong'} "
                f"token given): pass the token of the run that created it (RolloutServer.token, or set "
                f"{ENV} in every job of the run), or name another queue")
        return await method(self, *args, **kwargs)
    like = like or method
    call.__name__, call.__qualname__, call.__doc__ = like.__name__, like.__qualname__, like.__doc__
    return call


class QueueClient:
    """A queue actor's handle whose every call carries the run's token; `handle` is the actor's."""

    def __init__(self, handle, token: str):
        self.handle, self.token = handle, token

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(getattr(self.handle, method), self.token)


class _Method:
    def __init__(self, method, token: str):
        self.method, self.token = method, token

    def remote(self, *args, **kwargs):
        return self.method.remote(*args, token=self.token, **kwargs)


__all__ = ["ENV", "QueueClient", "for_run", "guarded", "known", "remember"]
