"""Co-located backend on Ray: one placement group of N bundles, one actor per bundle holding an
FSDP2 rank and its in-process vLLM engine (a minirl WeightManager).

Two ways to drive it:
- SPMD: `run_spmd(fn, *args, num_workers=N)` runs `fn(*args)` in every actor at once, after
  wiring them into one torch.distributed world; `fn` builds its WeightManager and runs the loop
  (launch/colocated.py --ray N does exactly that).
- Verbs: `ColocatedGroup(model, num_workers=N, ...)` gives a driver (a script or notebook)
  generate / forward_backward / optim_step / sync_weights on all ranks at once; forward_backward
  is Trainer.forward_backward, so its gradient is the token mean over the whole global batch.

Bundles are {"CPU": 1, "GPU": 1} on a GPU cluster, {"CPU": 1} on a CPU one. Every ray.get has
a timeout. Hardware: CPU or one GPU per rank.
"""

from __future__ import annotations

import os

import ray

from actors import placement


@ray.remote(max_restarts=0)
class ColocatedWorker(placement.RankActor):
    """One rank: an SPMD function, or the verbs over its WeightManager."""

    wm = None

    def setup(self, model: str, lr, config, llm_kwargs: dict) -> dict:
        from minirl.colocated import WeightManager
        self.wm = WeightManager(model, lr=lr, config=config, **llm_kwargs)
        return {"rank": self.wm.rank.rank, "device": str(self.wm.device), "pid": os.getpid()}

    def generate(self, prompts: list, sampling: dict, group_size: int, reward_fn, *, metadata=None,
                 uids=None) -> list:
        """group_size completions per prompt with the latest weights, scored, with advantages,
        on CPU (ready to travel)."""
        from vllm import SamplingParams
        from minirl.data import parse_vllm_outputs
        llm, version = self.wm.as_vllm(), self.wm.policy_version
        sp = SamplingParams(**{"temperature": 1.0, "logprobs": 0, **sampling, "n": group_size})
        outputs = llm.generate(prompts, sp, use_tqdm=False)
        batches = parse_vllm_outputs(outputs, group_size, reward_fn, metadata=metadata, uids=uids,
                                     policy_version=version, device="cpu")
        return [b.compute_advantages() for b in batches]

    def forward_backward(self, rollouts: list, loss_fn, **kwargs) -> dict:
        self.wm.as_trainable()
        return self.wm.trainer.forward_backward(rollouts, loss_fn, **kwargs)

    def optim_step(self) -> dict:
        self.wm.as_trainable()
        return self.wm.trainer.optim_step()

    def sync_weights(self) -> dict:
        self.wm.as_vllm()
        return {"policy_version": self.wm.policy_version, **self.wm.timings}

    def close(self):
        if self.wm is not None:
            self.wm.close()


def start_workers(num_workers: int, *, bundle: dict | None = None, timeout_s: float = 600.0):
    """Place N co-located workers, one per bundle of one placement group, wired into one world."""
    return placement.start_ranks(ColocatedWorker, num_workers, bundle=bundle, timeout_s=timeout_s)


def run_spmd(fn, *args, num_workers: int, bundle: dict | None = None, timeout_s: float | None = None):
    """Run fn(*args) on N co-located workers at once (SPMD); return their results by rank."""
    pg, workers = start_workers(num_workers, bundle=bundle)
    try:
        return placement.get([w.run.remote(fn, *args) for w in workers], timeout_s, "SPMD run")
    finally:
        for w in workers:
            ray.kill(w)
        placement.remove(pg)


class ColocatedGroup:
    """Driver-side handle on N co-located workers, the verbs as blocking calls.

    ColocatedGroup(model, num_workers=2, lr=1e-6, config=WeightManagerConfig(...), **llm_kwargs).
    generate() spreads prompts over the ranks; forward_backward() spreads rollouts over the ranks
    by tokens; optim_step() and sync_weights() run on all ranks.
    """

    def __init__(self, model: str, num_workers: int = 1, *, lr: float | None = None, config=None,
                 bundle: dict | None = None, timeout_s: float = 600.0, **llm_kwargs):
        self.timeout = timeout_s
        self.pg, self.workers = start_workers(num_workers, bundle=bundle, timeout_s=timeout_s)
        try:
            self.info = self._get([w.setup.remote(model, lr, config, llm_kwargs) for w in self.workers], "setup")
        except BaseException:          # a rank's setup raised: its actors and group go before the error
            for w in self.workers:
                ray.kill(w, no_restart=True)
            placement.remove(self.pg)
            raise

    def _get(self, refs, what):
        return placement.get(refs, self.timeout, f"co-located workers ({what})")

    def generate(self, prompts: list, sampling: dict, group_size: int, reward_fn, *, metadata=None) -> list:
        n = len(self.workers)
        refs = [w.generate.remote(prompts[i::n], sampling, group_size, reward_fn,
                                  metadata=None if metadata is None else metadata[i::n],
                                  uids=list(range(len(prompts)))[i::n])
                for i, w in enumerate(self.workers)]
        return sorted((b for part in self._get(refs, "generate") for b in part), key=lambda b: b.uid)

    def forward_backward(self, rollouts: list, loss_fn, **kwargs) -> dict:
        """Gradients of loss_fn's token mean over all `rollouts`, split over the ranks by tokens. kwargs:
        Trainer.forward_backward's; `temperature` the one generate() sampled at (its log-probs are at it)."""
        from minirl.data import split_by_tokens
        parts = split_by_tokens(rollouts, len(self.workers))
        return self._get([w.forward_backward.remote(p, loss_fn, **kwargs) for w, p in zip(self.workers, parts)],
                         "forward_backward")[0]

    def optim_step(self) -> list[dict]:
        return self._get([w.optim_step.remote() for w in self.workers], "optim_step")

    def sync_weights(self) -> list[dict]:
        return self._get([w.sync_weights.remote() for w in self.workers], "sync_weights")

    def shutdown(self) -> None:
        try:
            self._get([w.close.remote() for w in self.workers], "close")
        finally:
            for w in self.workers:
                ray.kill(w)
            placement.remove(self.pg)
