"""Tasks (toys, datasets from JSONL / CSV / parquet / saved directories, chat templates), the DAPO switches
(minirl.recipes.filters), evaluation metrics (minirl.evaluation), a short GSM8K-format run of
launch/colocated.py and a short launch/async.py run, both with evaluation (marked slow). CPU only;
about 2 minutes on 2 idle cores, nearly all of it the two launch runs.
"""

import csv
import json
import math
import re

import pytest

from conftest import run_py
from minirl.recipes import filters
from minirl.data import Rollout, RolloutBatch
from minirl.evaluation import eval_metrics, pass_at_k
from minirl.recipes.rewards import gsm8k_reward
from minirl.recipes.tasks import get_task, load_rows, load_task, render
from minirl.recipes.tiny import build_tokenizer

ROWS = [{"question": f"q{i}", "answer": f"so {i}\n#### {i}", "extra": i} for i in range(10)]


def _write(tmp_path, kind, rows=ROWS):
    import datasets
    ds = datasets.Dataset.from_list(rows)
    names = {"jsonl": "d.jsonl", "csv": "d.csv", "parquet": "d.parquet", "saved": "saved", "dict": "dd"}
    path = tmp_path / names[kind]
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "parquet":
        ds.to_parquet(str(path))
    elif kind == "saved":
        ds.save_to_disk(str(path))
    else:
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(path))
    return path


# ---------------------------------------------------------------------------------- tasks, data

def test_toys_unchanged():
    """The demo's prompts (hence its reward curve) are what they were: these values come from the
    generator before datasets existed (succ is 'a+1=' with a drawn first)."""
    assert get_task("succ").sample(5, seed=0) == (["6+1=", "6+1=", "0+1=", "4+1=", "8+1="], ["7", "7", "1", "5", "9"])
    assert get_task("succ").reward("6+1=", "7x", "7") == 1.0 and get_task("succ").reward("6+1=", "x7", "7") == 0.0


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "saved", "dict"])
def test_load_rows_every_format(tmp_path, kind):
    rows = load_rows(_write(tmp_path, kind), ("question", "answer"))
    assert rows == [{"question": r["question"], "answer": r["answer"]} for r in ROWS]


def test_load_rows_errors_name_the_file_and_fields(tmp_path):
    path = _write(tmp_path, "jsonl")
    with pytest.raises(KeyError, match=r"d\.jsonl has no field 'problem'.*\['question', 'answer', 'extra'\]"):
        load_rows(path, ("problem", "answer"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(tmp_path / "nope.jsonl", ("question",))
    (tmp_path / "d.xlsx").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unknown format '\.xlsx'; use \.jsonl, \.json, \.csv, \.parquet"):
        load_rows(tmp_path / "d.xlsx", ("question",))


def test_load_rows_csv_reads_text_and_names_missing_fields(tmp_path):
    path = _write(tmp_path, "csv")
    with pytest.raises(KeyError, match=r"d\.csv has no field 'problem'.*\['question', 'answer', 'extra'\]"):
        load_rows(path, ("problem", "answer"))
    (tmp_path / "n.csv").write_text("question,answer\nq1,007\nq2,NA\nq3,\n")
    rows = load_rows(tmp_path / "n.csv", ("question", "answer"))
    assert [r["answer"] for r in rows] == ["007", "NA", ""]             # cells as written: no 7, no nulls
    (tmp_path / "h.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"h\.csv holds no rows"):
        load_rows(tmp_path / "h.csv", ("question",))


def test_gsm8k_task_from_csv(tmp_path):
    """A round trip through CSV: multi-line answers with commas survive, and answers that CSV leaves as
    text ("1,000", "007") score against the numbers a model writes."""
    rows = [{"question": "What is 7 + 0, twice?", "answer": "7 + 0 = 7\n#### 7"},
            {"question": "Count to a thousand", "answer": "1,000"},
            {"question": "Which agent?", "answer": "007"}]
    task = load_task("gsm8k", data=_write(tmp_path, "csv", rows), instruction="")
    refs = dict(zip(*task.sample(50, seed=0)))
    assert refs == {r["question"]: r["answer"] for r in rows}
    assert task.reward("", "so the answer is #### 7.0", refs["What is 7 + 0, twice?"]) == 1.0
    assert task.reward("", "#### 1000", refs["Count to a thousand"]) == 1.0
    assert task.reward("", "It is agent 7", refs["Which agent?"]) == 1.0
    assert task.reward("", "It is agent ab7c", refs["Which agent?"]) == 0.0
    bad = tmp_path / "bad.csv"
    bad.write_text("question,answer\nq1,72\nq2,\n")
    with pytest.raises(ValueError, match=r"bad\.csv row 1: the answer field is empty"):
        load_task("gsm8k", data=bad)


def test_code_task_from_csv_needs_one_test_per_row(tmp_path):
    """CSV holds text, so a list of tests arrives as a string such as "['assert f(1) == 2']", which run as
    one test is an expression that never fails: refused. One test per row works."""
    listed = [{"prompt": "add one", "tests": str(["assert f(1) == 2", "assert f(2) == 3"])}]
    with pytest.raises(TypeError, match=r"row 0: the tests field is text that spells a list.*JSONL or"):
        load_task("code", data=_write(tmp_path, "csv", listed))
    one = [{"prompt": "add one", "tests": "assert f(1) == 2\nassert f(2) == 3"},
           {"prompt": "noop", "tests": "pass"}]
    task = load_task("code", data=_write(tmp_path, "csv", one), eval_size=1, instruction="")
    prompt, tests = task.held_out[0]
    assert isinstance(tests, str) and tests in {r["tests"] for r in one}


def test_load_task_holds_out_by_seed(tmp_path):
    path = _write(tmp_path, "jsonl")
    task = load_task("gsm8k", data=path, eval_size=3, seed=5, instruction="")
    again = load_task("gsm8k", data=path, eval_size=3, seed=5, instruction="")
    other = load_task("gsm8k", data=path, eval_size=3, seed=6, instruction="")
    assert task.held_out == again.held_out != other.held_out and len(task.held_out) == 3
    held = {p for p, _ in task.held_out}
    train = set(task.sample(200, seed=0)[0])
    assert train == {r["question"] for r in ROWS} - held            # 7 training rows, none held out
    prompt, answer = task.held_out[0]
    assert answer == ROWS[int(prompt[1:])]["answer"]                 # references stay with their prompt
    assert task.reward(prompt, "... #### " + prompt[1:], answer) == 1.0
    with pytest.raises(ValueError, match="leaves no training rows"):
        load_task("gsm8k", data=path, eval_size=10)
    with pytest.raises(ValueError, match="needs --data"):
        load_task("gsm8k")
    with pytest.raises(ValueError, match="takes no --data"):
        load_task("succ", data=path)
    toy = load_task("add", eval_size=4, seed=0)
    assert [p for p, _ in toy.held_out] == get_task("add").sample(4, seed=-1)[0]


def test_load_task_field_mapping_and_code_references(tmp_path):
    rows = [{"text": "add one", "checks": ["assert f(1) == 2"]}, {"text": "noop", "checks": ["assert True"]}]
    task = load_task("code", data=_write(tmp_path, "jsonl", rows), prompt_key="text", answer_key="checks",
                     instruction="")
    assert set(task.sample(20, seed=0)[0]) == {"add one", "noop"} and task.held_out == ()
    assert task.reward("p", "```python\ndef f(x):\n    return x + 1\n```", ["assert f(1) == 2"]) == 1.0
    bad = [{"text": "x", "checks": 3}]
    with pytest.raises(TypeError, match=r"row 0: the answer field must be a str or a non-empty list of str"):
        load_task("code", data=_write(tmp_path, "parquet", bad), prompt_key="text", answer_key="checks")


def test_load_task_refuses_a_missing_or_non_text_prompt(tmp_path):
    """A row without the prompt field (JSONL reads it as null) or with a list or an empty string in it
    would train on the text "None", the list's repr or the instruction alone: refused, naming the row."""
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"question": "q0", "answer": "#### 0"}) + "\n" + json.dumps({"answer": "#### 1"}) + "\n")
    with pytest.raises(TypeError, match=r"missing\.jsonl row 1: the prompt field must be a str, got NoneType"):
        load_task("gsm8k", data=missing)
    listed = [{"text": ["add", "one"], "checks": ["assert f(1) == 2"]}]
    with pytest.raises(TypeError, match=r"row 0: the prompt field must be a str, got list"):
        load_task("code", data=_write(tmp_path, "parquet", listed), prompt_key="text", answer_key="checks")
    bad = tmp_path / "bad.csv"
    bad.write_text("question,answer\nq1,72\n,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv row 1: the prompt field is empty"):
        load_task("gsm8k", data=bad)


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")


def test_render_through_the_chat_template():
    tok = build_tokenizer()
    assert render("2+2?", tok) == "2+2?"                             # no template: the text as is
    with pytest.raises(ValueError, match="need a tokenizer with a chat template"):
        render("2+2?", tok, system_prompt="be brief")
    tok.chat_template = TEMPLATE
    assert render("2+2?", tok) == "<user>2+2?</user><assistant>"
    assert render("2+2?", tok, thinking=False, system_prompt="be brief") == \
        "<system>be brief</system><user>2+2?</user><assistant><think></think>"
    assert render("2+2?", tok, thinking=True) == "<user>2+2?</user><assistant>"


# --------------------------------------------------------------------------------------- filters

def _batch(rewards, lengths=None, finish=None):
    lengths = lengths or [2] * len(rewards)
    finish = finish or ["stop"] * len(rewards)
    return RolloutBatch([Rollout([1], [5] * n, [-1.0] * n, r, finish_reason=f)
                         for r, n, f in zip(rewards, lengths, finish)])


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (6, 0.0),             # max 10, cache 4: free up to 6 tokens
    (7, -0.25), (8, -0.5), (9, -0.75),
    (10, -1.0), (12, -1.0),
])
def test_overlong_penalty_value(length, expected):
    assert filters.overlong_penalty_value(length, 10, 4) == expected


def test_overlong_penalty_and_filter():
    assert filters.overlong_penalty_value(9, 10, 0) == 0.0 and filters.overlong_penalty_value(12, 10, 0) == 0.0
    with pytest.raises(ValueError, match="cache must be in"):
        filters.overlong_penalty_value(1, 10, 11)
    b = _batch([1.0, 1.0, 0.0, 0.0], lengths=[2, 8, 10, 4], finish=["stop", "stop", "length", "stop"])
    m = filters.overlong_penalty([b], max_tokens=10, cache=4)
    assert b.rewards == [1.0, 0.5, -1.0, 0.0]
    assert m == {"overlong/penalty_mean": -1.5 / 4, "overlong/penalized": 0.5}
    b.compute_advantages()                    # mean 0.125: the truncated one keeps -1.125 but no mask
    assert filters.overlong_filter([b]) == {"overlong/masked": 0.25}
    assert [r.loss_mask for r in b] == [None, None, [0] * 10, None] and b[2].advantage == -1.125


def test_dynamic_sampling_refills_and_counts():
    rounds = [[_batch([1, 1]), _batch([0, 1]), _batch([0, 0])],       # round 0: one varied group
              [_batch([1, 0]), _batch([0.5, 0.5]), _batch([1, 0])],   # round 1: two more
              [_batch([0, 1])] * 3]
    calls = []
    def generate(r):
        calls.append(r)
        return rounds[r]
    got, m = filters.dynamic_sampling(generate, 3, max_rounds=4)
    assert calls == [0, 1] and got == [rounds[0][1], rounds[1][0], rounds[1][2]]
    assert m == {"dynsamp/groups_dropped": 3, "dynsamp/rounds": 2, "dynsamp/topped_up": 0}
    calls.clear()                             # capped at one round: topped up with dropped groups
    got, m = filters.dynamic_sampling(generate, 3, max_rounds=1)
    assert calls == [0] and got == [rounds[0][1], rounds[0][0], rounds[0][2]]
    assert m == {"dynsamp/groups_dropped": 2, "dynsamp/rounds": 1, "dynsamp/topped_up": 2}
    with pytest.raises(ValueError, match="must be >= 1"):
        filters.dynamic_sampling(generate, 0)


# ------------------------------------------------------------------------------------ evaluation

@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0), (4, 4, 4, 1.0), (4, 1, 1, 0.25),
    (4, 1, 2, 0.5),                           # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),                           # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),                 # C(7,5) = 21, C(10,5) = 252
    (3, 2, 2, 1.0),                           # n - c < k: every k-subset holds a correct one
])
def test_pass_at_k(n, c, k, expected):
    assert math.isclose(pass_at_k(n, c, k), expected)


def test_evaluate_refuses_k_above_samples_before_generating():
    """evaluate(samples < k) is refused before any generation (before, pass_at_k raised after it all)."""
    from minirl.evaluation import evaluate

    class NoEngine:
        def generate(self, *a, **kw):
            raise AssertionError("generated before the arguments were checked")
    with pytest.raises(ValueError, match=r"k=4 must be in \[1, samples=2\]"):
        evaluate(NoEngine(), ["1+1="], ["2"], lambda p, c, a: 0.0, max_tokens=2, samples=2, k=4)


def test_pass_at_k_bad_args():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(n, c, k)


def test_eval_metrics_hand_worked():
    greedy = [(1.0, 3, "stop"), (0.0, 8, "length")]
    sampled = [[(1.0, 2, "stop"), (0.0, 8, "length"), (0.0, 4, "stop"), (0.0, 3, "stop")],   # 1 of 4
               [(0.5, 8, "length"), (0.0, 1, "stop"), (1.0, 2, "stop"), (1.0, 3, "stop")]]   # 2 of 4
    m = eval_metrics(greedy, sampled, k=2)
    assert m["eval/pass@1"] == 0.5 and m["eval/reward_mean"] == 0.5 and m["eval/prompts"] == 2
    assert m["eval/sampled_pass@1"] == (0.25 + 0.5) / 2
    assert math.isclose(m["eval/pass@2"], (0.5 + (1 - 1 / 6)) / 2)     # 1 - C(3,2)/C(4,2); 1 - C(2,2)/C(4,2)
    assert m["eval/len_mean"] == (3 + 8 + 17 + 14) / 10 and m["eval/truncated"] == 3 / 10
    with pytest.raises(ValueError, match="1 greedy and 2 sampled"):
        eval_metrics(greedy[:1], sampled, k=2)


def test_eval_metrics_k1_keeps_greedy_pass_at_1():
    """k=1 (--eval-k 1): eval/pass@1 stays the greedy score, not the sampled one written over it."""
    m = eval_metrics([(1.0, 3, "stop")], [[(0.0, 2, "stop"), (0.0, 4, "stop")]], k=1)
    assert m["eval/pass@1"] == 1.0 and m["eval/sampled_pass@1"] == 0.0


# ------------------------------------------------------------------------------------ end to end

@pytest.mark.slow
def test_gsm8k_run_logs_evaluation(tmp_path):
    """launch/colocated.py on a GSM8K-format JSONL: evaluation before step 1 and after each step
    (eval/... next to the training records), dynamic sampling and the over-long penalty on."""
    rows = [{"question": f"what is {a} plus {b}", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
            for a in range(4) for b in range(4)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    p = run_py(["launch/colocated.py", "--run-dir", str(run), "--backends", "", "--task", "gsm8k",
                "--data", str(data), "--steps", "2", "--prompts", "4", "--group-size", "2", "--max-tokens", "4",
                "--eval-size", "4", "--eval-every", "1", "--eval-samples", "2", "--eval-k", "2",
                "--dynamic-sampling", "--refill-rounds", "2", "--overlong-cache", "2"], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval/pass@1" in r]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and [r["step"] for r in steps] == [1, 2]
    for r in evals:
        assert r["eval/prompts"] == 4 and 0 <= r["eval/pass@2"] <= 1 and r["eval/len_mean"] <= 4
        assert r["eval/pass@1"] == r["eval/reward_mean"]          # GSM8K rewards are 0 or 1
    for r in steps:
        assert r["dynsamp/rounds"] in (1, 2) and r["overlong/penalty_mean"] <= 0
        assert r["len/prompt"] > 80              # the question plus the GSM8K instruction
        assert not [k for k in r if k.startswith("async/")]     # co-located: no staleness to report
    assert (run / "reward_curve.png").exists()


@pytest.mark.slow
def test_async_run_evaluates_on_a_generator(tmp_path):
    """launch/async.py with --eval-every: the trainer evaluates on a generator before step 1 (the
    starting weights, version 0) and after its syncs, and logs which policy version it judged (the one
    it had just pushed). Every prompt is generated once: the generators start after the trainer gave
    the queue its staleness bound (before, they leased all at version 0 and step 3 recycled them)."""
    run = tmp_path / "run"
    p = run_py(["launch/async.py", "--run-dir", str(run), "--backends", "", "--task", "add", "--steps", "3",
                "--prompts", "8", "--eval-size", "4", "--eval-every", "1",
                "--eval-samples", "2", "--eval-k", "2", "--queue", f"q-{tmp_path.name}"], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3] and [r["eval/policy_version"] for r in evals] == [0, 1, 2, 3]
    assert "server: 24 prompts, " in p.stdout, p.stdout[-2000:]            # 3 steps x 8 prompts, none again
    assert all(r["eval/prompts"] == 4 and 0 <= r["eval/pass@2"] <= 1 for r in evals)
    assert all("async/staleness_0" in r for r in recs if "loss" in r)


def test_gsm8k_recipe_rows_and_flags(tmp_path):
    """benchmarks/gsm8k_recipe.py (run on a GPU): its synthetic rows are right by construction and
    its flags are ones launch/colocated.py accepts."""
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "launch"))
    import common
    import gsm8k_recipe
    rows = gsm8k_recipe.synth_rows(40, seed=1)
    assert rows == gsm8k_recipe.synth_rows(40, seed=1) and len({r["question"] for r in rows}) == 40
    for r in rows:
        b, a, c = map(int, re.findall(r"\d+", r["question"]))          # b boxes of a, c given away
        assert gsm8k_reward(r["question"], f"#### {a * b - c}", r["answer"]) == 1.0
        assert gsm8k_reward(r["question"], f"#### {a * b - c + 1}", r["answer"]) == 0.0
    args = gsm8k_recipe.parse(["--out", str(tmp_path / "x.json")])
    argv = gsm8k_recipe.recipe_argv(args, "m", tmp_path / "d.jsonl", tmp_path / "run")
    launch = common.parse_args("doc", "runs/x", argv)
    assert (launch.max_tokens, launch.eval_every, launch.overlong_cache, launch.task) == (1024, 2, 256, "gsm8k")
    with pytest.raises(SystemExit):
        gsm8k_recipe.parse(["--out", "x.json", "--rows", "64"])        # no rows left to train on


def test_arith_task_holds_out_a_fifth_and_renders_the_template():
    """arith: 900 problems, the 180 held out (a + 2b = 0 mod 5) never drawn for training, prompts
    through the chat template, references the sums, scored on the final number."""
    from transformers import PreTrainedTokenizerFast
    from minirl.recipes.tiny import build_tokenizer
    tok: PreTrainedTokenizerFast = build_tokenizer()
    tok.chat_template = TEMPLATE
    task = load_task("arith", tokenizer=tok, eval_size=180, seed=3)
    held = {p for p, _ in task.held_out}
    train = set(task.sample(20000, seed=0)[0])
    assert len(held) == 180 and len(train) == 720 and not held & train
    assert "<user>What is 1 + 2?</user><assistant>" in held       # 1 + 2*2 = 5: held out
    assert "<user>What is 2 + 1?</user><assistant>" in train
    for prompt, answer in task.held_out:
        a, b = map(int, prompt.split("What is ")[1].split("?")[0].split(" + "))
        assert answer == str(a + b) and (a + 2 * b) % 5 == 0
    assert task.reward("", "12 + 13 = 25", "25") == 1.0 and task.reward("", "25, no: 24", "25") == 0.0
    assert load_task("arith", eval_size=5, seed=3).held_out != load_task("arith", eval_size=5, seed=4).held_out
    with pytest.raises(ValueError, match="holds out 180"):
        load_task("arith", eval_size=181)
    with pytest.raises(ValueError, match="takes no --data"):
        load_task("arith", data="x.jsonl")
