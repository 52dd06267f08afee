"""Tasks: prompts, reference answers and a reward function. Built in: digit toys for demos and tests
("3+4=", scored 1.0 when the completion starts with the one-digit answer; a random model scores about
1/64), and dataset tasks read from local files: `gsm8k` (`#### x` answers), `math` (`\\boxed{}`
answers) and `code` (tests run in a sandbox), from JSONL, CSV, parquet or saved datasets, with a
held-out split for evaluation. Prompts of dataset tasks go through the tokenizer's chat template when it
has one (system prompt, Qwen3 thinking on/off), so the model is trained as it is served. CPU, no
downloads (`datasets` reads the files).

    python -m minirl.recipes.tasks add                                   # a few toy prompts and answers
    task = load_task("gsm8k", data="gsm8k_train.jsonl", tokenizer=tok, eval_size=200)
    prompts, answers = task.sample(32, seed=step)                # reward_fn: task.reward
"""

from __future__ import annotations

import csv
import random
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from minirl.recipes import rewards


def prefix_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion starts with the answer, else 0.0 (the toys' reward)."""
    return 1.0 if completion.startswith(answer) else 0.0


@dataclass(frozen=True)
class Task:
    """A prompt source and its reward function (minirl's reward_fn(prompt, completion, reference))."""

    name: str
    make: Callable[[random.Random], tuple[str, Any]]      # rng -> (prompt, reference answer)
    reward: Callable[[str, str, Any], float] = prefix_reward
    held_out: tuple = ()                                  # ((prompt, reference), ...) for evaluation

    def sample(self, n: int, seed: int) -> tuple[list[str], list]:
        """n (prompt, answer) pairs, reproducible from seed (dataset tasks: rows drawn with replacement)."""
        rng = random.Random(seed)
        pairs = [self.make(rng) for _ in range(n)]
        return [p for p, _ in pairs], [a for _, a in pairs]


def _copy(rng):
    d = rng.randrange(10)
    return f"{d}=", str(d)


def _add(rng, b: int | None = None):      # 'a+b=' -> last digit of a+b; b drawn after a unless given
    a = rng.randrange(10)
    b = rng.randrange(10) if b is None else b
    return f"{a}+{b}=", str((a + b) % 10)


TASKS = {t.name: t for t in (Task("copy", _copy), Task("succ", partial(_add, b=1)), Task("add", _add))}

ARITH_RANGE = 30
"""`arith` asks "What is a + b?" for a, b in [0, ARITH_RANGE): 900 problems."""


def arith_held_out(a: int, b: int) -> bool:
    """The fifth of `arith`'s problems kept for evaluation (never trained on): six a's for every b."""
    return (a + 2 * b) % 5 == 0


def arith_task(*, tokenizer=None, eval_size: int = 0, seed: int = 0, system_prompt: str | None = None,
               thinking: bool | None = None) -> Task:
    """A GSM8K-style arithmetic set made here: "What is 12 + 13?" -> "25", through the tokenizer's chat
    template when it has one, scored 1.0 when the completion's final answer (`####`, `\\boxed{}` or
    its last number) is the sum (rewards.gsm8k_reward). The 720 training problems are drawn with
    replacement; `eval_size` of the 180 held-out ones (arith_held_out, shuffled by seed) evaluate.
    SmolLM2-135M-Instruct starts at 27% greedy and about 11% sampled at temperature 1 (held out)."""
    pairs = [(a, b) for a in range(ARITH_RANGE) for b in range(ARITH_RANGE)]
    held = [p for p in pairs if arith_held_out(*p)]
    if not 0 <= eval_size <= len(held):
        raise ValueError(f"--eval-size {eval_size}: the arith task holds out {len(held)} problems; use at most that")
    item = lambda a, b: (render(f"What is {a} + {b}?", tokenizer, system_prompt=system_prompt, thinking=thinking),
                         str(a + b))
    train = [item(*p) for p in pairs if not arith_held_out(*p)]
    random.Random(seed).shuffle(held)
    return Task("arith", lambda rng: train[rng.randrange(len(train))], rewards.gsm8k_reward,
                tuple(item(*p) for p in held[:eval_size]))


GENERATED = {"arith": arith_task}
"""Tasks made here that render through the model's chat template (no --data)."""


def math_boxed_reward(prompt: str, completion: str, answer) -> float:
    """reward_fn for MATH-style data: the completion's last `\\boxed{}` equals the answer (no last-number
    fallback)."""
    return rewards.math_reward(completion, answer, fallback_last_number=False)


def tests_reward(prompt: str, completion: str, tests) -> float:
    """reward_fn for code data: the fraction of `tests` the completion's code passes (rewards.code_reward)."""
    return rewards.code_reward(completion, tests)


@dataclass(frozen=True)
class DataSpec:
    """Defaults of a dataset task: its fields, the instruction appended to each question, its reward."""

    prompt_key: str
    answer_key: str
    instruction: str
    reward: Callable


DATA_TASKS = {
    "gsm8k": DataSpec("question", "answer", "Let's think step by step and output the final answer after "
                      '"####".', rewards.gsm8k_reward),
    "math": DataSpec("problem", "solution", "Please reason step by step, and put your final answer within "
                     "\\boxed{}.", math_boxed_reward),
    "code": DataSpec("prompt", "tests", "Write the Python solution in one ```python code block.",
                     tests_reward),
}


def load_rows(path, fields: tuple[str, ...]) -> list[dict]:
    """Rows of a JSONL/JSON, CSV, parquet or `datasets.save_to_disk` directory (read by `datasets`),
    keeping `fields`. CSV cells are read as the text written (`007` stays "007", `NA` and empty cells
    stay strings, not nulls). Errors name the file and a missing field with the fields present."""
    import datasets
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--data {p}: no such file or directory")
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{p} is a DatasetDict without a 'train' split (splits: {list(ds)}): "
                                 f"point --data at one split's directory, e.g. {p / next(iter(ds))}")
            ds = ds["train"]
    elif p.suffix == ".csv":
        with open(p, newline="") as f:
            reader = csv.reader(f)
            header, first_row = next(reader, []), next(reader, None)
        if first_row is None:           # datasets would say 'Instruction "train" corresponds to no data'
            raise ValueError(f"{p} holds no rows")
        text = datasets.Features({name: datasets.Value("string") for name in header})
        ds = datasets.load_dataset("csv", data_files=str(p), split="train", features=text,
                                   keep_default_na=False)
    elif (kind := {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(p.suffix)) is not None:
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    else:
        raise ValueError(f"--data {p}: unknown format {p.suffix!r}; use .jsonl, .json, .csv, .parquet or a "
                         f"directory written by datasets' save_to_disk")
    if missing := [f for f in fields if f not in ds.column_names]:
        raise KeyError(f"{p} has no field {missing[0]!r} (fields: {ds.column_names}); "
                       f"name the right one with --prompt-key / --answer-key")
    if len(ds) == 0:
        raise ValueError(f"{p} holds no rows")
    return ds.select_columns(list(fields)).to_list()


def render(question: str, tokenizer=None, *, system_prompt: str | None = None,
           thinking: bool | None = None) -> str:
    """The prompt text: through the tokenizer's chat template (a user turn, optional system turn, the
    assistant's turn opened; thinking passed as enable_thinking, Qwen3-style) when it has one, else the
    question as is (then system_prompt / thinking are an error: they would be dropped)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        if system_prompt is not None or thinking is not None:
            raise ValueError("--system-prompt / --thinking need a tokenizer with a chat template; "
                             "this model's tokenizer has none (prompts are used as plain text)")
        return question
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
    kw = {} if thinking is None else {"enable_thinking": thinking}
    return tokenizer.apply_chat_template(msgs + [{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True, **kw)


def _check_prompt(path, i: int, prompt) -> None:
    if not isinstance(prompt, str):
        raise TypeError(f"{path} row {i}: the prompt field must be a str, got {type(prompt).__name__}: "
                        f"{prompt!r:.80}")
    if not prompt.strip():
        raise ValueError(f"{path} row {i}: the prompt field is empty")


def _check_reference(name: str, path, i: int, ref) -> None:
    ok = (isinstance(ref, str) or (isinstance(ref, list) and ref and all(isinstance(t, str) for t in ref))
          if name == "code" else isinstance(ref, (str, int, float)) and not isinstance(ref, bool))
    if not ok:
        want = "a str or a non-empty list of str (tests)" if name == "code" else "a str or a number"
        raise TypeError(f"{path} row {i}: the answer field must be {want}, "
                        f"got {type(ref).__name__}: {ref!r:.80}")
    if isinstance(ref, str) and not ref.strip() or isinstance(ref, list) and not all(t.strip() for t in ref):
        raise ValueError(f"{path} row {i}: the answer field is empty (an empty test passes any code; an "
                         f"empty answer fails every completion)")
    if name == "code" and isinstance(ref, str) and ref.strip()[:1] == "[" and ref.strip()[-1:] == "]":
        raise TypeError(f"{path} row {i}: the tests field is text that spells a list ({ref!r:.60}); run as "
                        f"one test it is an expression that never fails. A list of tests needs JSONL or "
                        f"parquet (CSV holds only text); in CSV give one test (Python asserts) per row")


def load_task(name: str, *, data=None, tokenizer=None, prompt_key: str | None = None,
              answer_key: str | None = None, eval_size: int = 0, seed: int = 0,
              system_prompt: str | None = None, thinking: bool | None = None,
              instruction: str | None = None) -> Task:
    """A built-in toy (no data; eval_size prompts held out from its generator) or a dataset task:
    rows of `data`, shuffled by seed, the first eval_size held out, the rest drawn for training."""
    if name in TASKS:
        if data is not None:
            raise ValueError(f"--task {name} is a built-in toy and takes no --data; dataset tasks: "
                             f"{sorted(DATA_TASKS)}")
        held = TASKS[name].sample(eval_size, seed=-1 - seed) if eval_size else ([], [])
        return replace(TASKS[name], held_out=tuple(zip(*held)))
    if name in GENERATED:
        if data is not None:
            raise ValueError(f"--task {name} makes its own problems and takes no --data")
        return GENERATED[name](tokenizer=tokenizer, eval_size=eval_size, seed=seed, system_prompt=system_prompt,
                               thinking=thinking)
    if name not in DATA_TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)} and {sorted(GENERATED)}, "
                         f"dataset tasks: {sorted(DATA_TASKS)}")
    if data is None:
        raise ValueError(f"--task {name} needs --data PATH (JSONL, CSV, parquet or a saved dataset "
                         f"directory)")
    spec = DATA_TASKS[name]
    pk, ak = prompt_key or spec.prompt_key, answer_key or spec.answer_key
    rows = load_rows(data, (pk, ak))
    if not 0 <= eval_size < len(rows):
        raise ValueError(f"--eval-size {eval_size} leaves no training rows: {data} holds {len(rows)}")
    instr = spec.instruction if instruction is None else instruction
    pairs = []
    for i, row in enumerate(rows):
        _check_prompt(data, i, row[pk])
        _check_reference(name, data, i, row[ak])
        question = f"{row[pk]}\n{instr}" if instr else row[pk]
        pairs.append((render(question, tokenizer, system_prompt=system_prompt, thinking=thinking), row[ak]))
    random.Random(seed).shuffle(pairs)
    train = pairs[eval_size:]
    return Task(name, lambda rng: train[rng.randrange(len(train))], spec.reward, tuple(pairs[:eval_size]))


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]


if __name__ == "__main__":
    for p, a in zip(*get_task(sys.argv[1] if len(sys.argv) > 1 else "add").sample(5, seed=0)):
        print(f"{p!r} -> {a!r}")
