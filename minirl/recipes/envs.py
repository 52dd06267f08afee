"""Built-in environments: episodes small enough that the tiny CPU model learns them (tests and demos).
An environment is `sample(n, seed) -> (prompts, metadata)` plus `async episode(ep) -> reward` (see
minirl.episodes); run one with `launch/colocated.py --env NAME` or `launch/async.py --env NAME`.

- `lookup`: a tool environment. The prompt names a key ("c:"); the model's first turn is the tool
  call, the tool (async, with a simulated latency and a timeout) answers with the key's hidden digit
  ("7="), and the second turn scores 1.0 if it starts with that digit. Only the tool's answer holds
  the digit, so the policy can learn only by reading the environment's tokens.
- `feedback`: multi-turn feedback. The prompt is "a+1="; a right first answer scores 1.0, a wrong one
  gets the feedback "no,b=" (b the right digit) and a second try scores 0.5 if right.
- `*-noise`: the same with the environment's digit replaced by a random one (the ablation: `lookup-noise`
  cannot be learned beyond guessing a digit, ~0.1).

CPU only, no downloads. `python -m minirl.recipes.envs lookup` prints an episode's text with a random model.
"""

from __future__ import annotations

import asyncio
import random
import string
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LookupEnv:
    """A key-value lookup tool between two turns of one token."""
    noise: bool = False
    """Ablation: the tool answers a random digit instead of the key's."""
    latency_s: tuple[float, float] = (0.0, 0.0)
    """The tool's simulated latency, drawn uniformly from this range per call."""
    timeout_s: float = 5.0
    """Per tool call; a timed-out call is an episode error (EpisodeConfig.on_error decides)."""

    def sample(self, n: int, seed: int) -> tuple[list[str], list[int]]:
        """n (key, value) pairs drawn one after another: the first n of a longer run are these (a resume
        with a larger --steps keeps every prompt's value)."""
        rng = random.Random(seed)
        pairs = [(f"{rng.choice(string.ascii_lowercase)}:", rng.randrange(10)) for _ in range(n)]
        return [k for k, _ in pairs], [v for _, v in pairs]

    async def lookup(self, key: str, value: int, rng: random.Random) -> str:
        await asyncio.sleep(rng.uniform(*self.latency_s))
        return f"{rng.randrange(10) if self.noise else value}="

    async def episode(self, ep) -> float:
        rng = random.Random(f"{ep.uid}/{ep.index}")
        call = await ep.generate(max_tokens=1)                      # the tool call (its argument)
        ep.add_text(await ep.call(self.lookup, call.text, ep.metadata, rng, timeout_s=self.timeout_s))
        answer = await ep.generate(max_tokens=1)
        return 1.0 if answer.text.startswith(str(ep.metadata)) else 0.0


@dataclass(frozen=True, kw_only=True)
class FeedbackEnv:
    """Two tries at "a+1=", with feedback naming the answer after a wrong first one."""
    noise: bool = False
    """Ablation: the feedback names a random digit."""

    def sample(self, n: int, seed: int) -> tuple[list[str], list[str]]:
        rng = random.Random(seed)
        digits = [rng.randrange(10) for _ in range(n)]
        return [f"{a}+1=" for a in digits], [str((a + 1) % 10) for a in digits]

    async def episode(self, ep) -> float:
        first = await ep.generate(max_tokens=1)
        ep.turn_rewards.append(1.0 if first.text.startswith(ep.metadata) else 0.0)
        if ep.turn_rewards[0]:
            return 1.0
        hint = random.Random(f"{ep.uid}/{ep.index}").randrange(10) if self.noise else ep.metadata
        ep.add_text(f"no,{hint}=")
        second = await ep.generate(max_tokens=1)
        ep.turn_rewards.append(0.5 if second.text.startswith(ep.metadata) else 0.0)
        return ep.turn_rewards[-1]


ENVS = {"lookup": LookupEnv(), "lookup-noise": LookupEnv(noise=True),
        "feedback": FeedbackEnv(), "feedback-noise": FeedbackEnv(noise=True)}


def get_env(name: str):
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; built-in environments: {sorted(ENVS)}")
    return ENVS[name]


def workload(task, env: str | None = None):
    """(episode function, sample(n, seed)): environment `env`'s, else the one-turn episode scored by
    task.reward and task.sample (a minirl.recipes.tasks.Task)."""
    from minirl.episodes import single_turn
    if env:
        e = get_env(env)
        return e.episode, e.sample
    return single_turn(task.reward), task.sample


if __name__ == "__main__":
    import sys
    from minirl import vllm_compat as vc
    from minirl.episodes import run_episodes
    from minirl.recipes.tiny import build_tiny_model
    e = get_env(sys.argv[1] if len(sys.argv) > 1 else "lookup")
    llm = vc.build_llm(str(build_tiny_model("/tmp/minirl-envs-tiny")), dtype="float32", max_model_len=64,
                       **vc.engine_kwargs({}, sleep=False, seed=0, colocated=False))
    prompts, meta = e.sample(3, seed=0)
    for b in run_episodes(llm, e.episode, prompts, metadata=meta, seed=0):
        print(repr(b[0].prompt), b[0].completion, b[0].reward, b[0].loss_mask, b[0].finish_reason)
