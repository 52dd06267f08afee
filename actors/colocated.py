"""Co-located backend on Ray: one placement group of N bundles, one actor per bundle holding
an FSDP2 rank and its in-process vLLM engine (a WeightManager).

Two ways to drive it:
- SPMD: `run_spmd(fn, *args, num_workers=N)` runs `fn(*args)` in every actor at once, after
  wiring them into one torch.distributed world; `fn` builds its WeightManager and runs the
  loop (launch/colocated.py --ray N does exactly that).
- Verbs: `ColocatedGroup(model, num_workers=N, ...)` gives the driver (a script or notebook)
  generate / forward_backward / optim_step / sync_weights calls on all ranks at once.

Bundles are {"CPU": 1, "GPU": 1} on a GPU cluster, {"CPU": 1} on a CPU one. Every ray.get has
a timeout. Hardware: CPU or one GPU per rank.
"""

from __future__ import annotations

import os

import ray

from actors import placement


@ray.remote(max_restarts=0)
class ColocatedWorker(placement.RankActor):
    """One rank: an SPMD function, or the verbs of minirl.colocated.ColocatedVerbs."""

    verbs = None

    def setup(self, model: str, lr: float, config, llm_kwargs: dict, verbs_kwargs: dict) -> dict:
        from minirl.colocated import ColocatedVerbs, WeightManager
        wm = WeightManager(model, lr=lr, config=config, **llm_kwargs)
        self.verbs = ColocatedVerbs(wm, **verbs_kwargs)
        return {"rank": wm.rank.rank, "device": str(wm.device), "pid": os.getpid()}

    def generate(self, *args, **kwargs):
        return self.verbs.generate(*args, **kwargs)

    def forward_backward(self, rollouts):
        return self.verbs.forward_backward(rollouts)

    def optim_step(self):
        return self.verbs.optim_step()

    def sync_weights(self):
        return self.verbs.sync_weights()

    def close(self):
        if self.verbs is not None:
            self.verbs.wm.close()


def _get(refs, timeout_s, what):
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"{what}: no answer from the co-located workers within {timeout_s} s") from e


def start_workers(num_workers: int, *, bundle: dict | None = None, timeout_s: float = 600.0):
    """Place N co-located workers, one per bundle of one placement group, wired into one world."""
    return placement.start_ranks(ColocatedWorker, num_workers, bundle=bundle, timeout_s=timeout_s)


def run_spmd(fn, *args, num_workers: int, bundle: dict | None = None, timeout_s: float | None = None):
    """Run fn(*args) on N co-located workers at once (SPMD); return their results by rank."""
    pg, workers = start_workers(num_workers, bundle=bundle)
    try:
        return _get([w.run.remote(fn, *args) for w in workers], timeout_s, "SPMD run")
    finally:
        for w in workers:
            ray.kill(w)
        placement.remove(pg)


class ColocatedGroup:
    """Driver-side handle on N co-located workers, with the verbs as blocking calls.

    ColocatedGroup(model, num_workers=2, lr=1e-6, reward_fn=fn, config=WeightManagerConfig(),
    **llm_kwargs). generate() spreads prompts over the ranks; forward_backward() spreads
    rollouts (FSDP2 averages the gradients); optim_step() and sync_weights() run on all ranks.
    """

    def __init__(self, model: str, num_workers: int = 1, *, lr: float = 1e-6, reward_fn=None,
                 config=None, bundle: dict | None = None, timeout_s: float = 600.0,
                 verbs_kwargs: dict | None = None, **llm_kwargs):
        self.timeout = timeout_s
        self.pg, self.workers = start_workers(num_workers, bundle=bundle, timeout_s=timeout_s)
        self.info = self._all("setup", model, lr, config, llm_kwargs,
                              {"reward_fn": reward_fn, **(verbs_kwargs or {})})

    def _all(self, method, *args):
        return _get([getattr(w, method).remote(*args) for w in self.workers], self.timeout, method)

    def generate(self, prompts: list, sampling: dict, group_size: int, *, metadata=None) -> list:
        n = len(self.workers)
        refs = [w.generate.remote(prompts[i::n], sampling, group_size,
                                  metadata=None if metadata is None else metadata[i::n],
                                  uids=list(range(len(prompts)))[i::n])
                for i, w in enumerate(self.workers)]
        batches = [b for part in _get(refs, self.timeout, "generate") for b in part]
        return sorted(batches, key=lambda b: b.uid)

    def forward_backward(self, rollouts: list) -> list[dict]:
        """Split rollouts over the ranks; short ranks get zero-weight padding so every rank runs
        the same number of passes (FSDP2's collectives need that)."""
        n = len(self.workers)
        parts = [rollouts[i::n] for i in range(n)]
        longest = max(len(p) for p in parts)
        parts = [p + [rollouts[0].as_padding()] * (longest - len(p)) for p in parts]
        return _get([w.forward_backward.remote(p) for w, p in zip(self.workers, parts)],
                    self.timeout, "forward_backward")

    def optim_step(self) -> list[dict]:
        return self._all("optim_step")

    def sync_weights(self) -> list[dict]:
        return self._all("sync_weights")

    def shutdown(self) -> None:
        try:
            self._all("close")
        finally:
            for w in self.workers:
                ray.kill(w)
            placement.remove(self.pg)
