"""Built-in verifiable tasks for demos and tests: prompts like "3+4=", scored 1.0 when the completion
starts with the one-digit answer. A random model (64-token vocabulary) scores about 1/64, so a rising
reward means the policy learned from its rollouts. CPU only, no downloads.

    python -m minirl.tasks add        # print a few prompts and answers
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable


@dataclass(frozen=True)
class Task:
    """A prompt generator and its reward function (minirl's reward_fn contract)."""

    name: str
    make: Callable[[random.Random], tuple[str, str]]      # rng -> (prompt, answer)

    def sample(self, n: int, seed: int) -> tuple[list[str], list[str]]:
        """n (prompt, answer) pairs, reproducible from seed."""
        rng = random.Random(seed)
        pairs = [self.make(rng) for _ in range(n)]
        return [p for p, _ in pairs], [a for _, a in pairs]

    @staticmethod
    def reward(prompt: str, completion: str, answer: str) -> float:
        """1.0 if the completion starts with the answer, else 0.0."""
        return 1.0 if completion.startswith(answer) else 0.0


def _copy(rng):
    d = rng.randrange(10)
    return f"{d}=", str(d)


def _add(rng, b: int | None = None):      # 'a+b=' -> last digit of a+b; b drawn after a unless given
    a = rng.randrange(10)
    b = rng.randrange(10) if b is None else b
    return f"{a}+{b}=", str((a + b) % 10)


TASKS = {t.name: t for t in (Task("copy", _copy), Task("succ", partial(_add, b=1)), Task("add", _add))}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]


if __name__ == "__main__":
    for p, a in zip(*get_task(sys.argv[1] if len(sys.argv) > 1 else "add").sample(5, seed=0)):
        print(f"{p!r} -> {a!r}")
