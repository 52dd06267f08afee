"""How the launch scripts start and end, as a user meets them: --help and a bad flag answer at once;
a mistake in the data, the task or the checkpoint is one line 'error: ...' with exit status 2
before any model or engine starts; SIGINT (Ctrl-C) or SIGTERM during a run stops it without a
traceback, printing the step reached, the last checkpoint and the command that resumes, which
continues from that step at the run's checkpoint cadence.

Needs: CPU only; fresh processes. The interrupt test runs two short real jobs (slow, ~2 min on
2 cores); the others take a few seconds each.
"""

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, run_py

SCRIPT = "launch/colocated.py"


def test_help_answers_in_under_three_seconds():
    run_py([SCRIPT, "--help"], timeout=120)                 # once to warm the file cache and .pyc files
    t = time.perf_counter()
    res = run_py([SCRIPT, "--help"], timeout=120)
    elapsed = time.perf_counter() - t
    assert res.returncode == 0 and "--resume" in res.stdout and "--traceback" in res.stdout
    assert elapsed < 3, f"--help took {elapsed:.1f} s"
    res = run_py(["launch/async.py", "--dynamic-sampling"], timeout=120)
    assert (res.returncode, res.stderr) == (2, "error: --dynamic-sampling is co-located only (launch/colocated.py)\n")


def _checkpoint(run: Path, step: int) -> None:
    """What a complete checkpoint looks like to Checkpointer.latest and the launcher (never loaded here)."""
    path = run / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step}))
    (path / "MANIFEST.json").write_text("{}")


MISTAKES = {   # case: (flags, the line printed, set-up)
    "data field": (["--task", "gsm8k", "--data", "{tmp}/rows.jsonl"],
                   "error: {tmp}/rows.jsonl has no field 'question' (fields: ['q', 'answer']); name the right "
                   "one with --prompt-key / --answer-key", None),
    "data format": (["--task", "gsm8k", "--data", "{tmp}/rows.xyz"],
                    "error: --data {tmp}/rows.xyz: unknown format '.xyz'; use .jsonl, .json, .csv, .parquet or a "
                    "directory written by datasets' save_to_disk", None),
    "env": (["--env", "lookups"], "error: argument --env: invalid choice: 'lookups' (choose from 'lookup', "
            "'lookup-noise', 'feedback', 'feedback-noise')", None),
    "no checkpoint": (["--resume"], "error: no checkpoint in {tmp}/run/checkpoints: drop --resume or point "
                      "--run-dir at the run", None),
    "resume setting": (["--resume", "--prompts", "16"], "error: --resume: --prompts 16 differs from the run's 8 "
                       "({tmp}/run/args.json): drop --prompts to keep the run's, or start a new run in another "
                       "--run-dir", lambda run: (run / "args.json").write_text('{"prompts": 8}')),
    "steps done": (["--resume", "--steps", "4"], "error: --steps 4: the run's checkpoint "
                   "{tmp}/run/checkpoints/step_00000004 is at step 4 already; pass a larger --steps to train on",
                   lambda run: _checkpoint(run, 4)),
    "earlier run": (["--save-every", "2"], "error: {tmp}/run/checkpoints holds an earlier run's checkpoint (step 4): "
                    "pass --resume to continue it, or another --run-dir to start afresh", lambda run: _checkpoint(run, 4)),
    "offload beside a resident engine": (["--offload-optimizer", "on", "--sleep-level", "0"],
                                         "error: --offload-optimizer on with --sleep-level 0: a resident engine keeps "
                                         "its KV cache while the trainer steps, so AdamW's state has to stay; drop one "
                                         "of them", None),
    "KV cache sized twice": (["--kv-cache-gib", "2", "--gpu-memory-utilization", "0.5"], "error: --kv-cache-gib and "
                             "--gpu-memory-utilization both size the engine's KV cache: give one of them", None),
    "budget without compile": (["--activation-memory-budget", "0.5", "--no-compile"], "error: "
                               "--activation-memory-budget is torch.compile's (its partitioner decides what backward "
                               "recomputes): drop --no-compile (or the budget)", None),
    "model path": (["--model", "{tmp}/no-model"], "error: --model {tmp}/no-model: no model directory there "
                   "(config.json, weights, tokenizer): pass a Hugging Face model directory or a hub name 'org/name'",
                   None),
    "earlier run, not saving": ([], "error: {tmp}/run/checkpoints holds an earlier run's checkpoint (step 4): pass "
                                "--resume to continue it, or another --run-dir to start afresh",
                                lambda run: _checkpoint(run, 4)),   # its args.json, which --resume reads, kept
}


@pytest.mark.parametrize("case", MISTAKES)
def test_input_mistakes_end_in_one_line_before_any_model(case, tmp_path):
    flags, line, setup = MISTAKES[case]
    tmp = tmp_path.resolve()
    (tmp / "rows.jsonl").write_text('{"q": "1+1?", "answer": "2"}\n')
    (tmp / "rows.xyz").write_text("question,answer\n1+1?,2\n")
    run = tmp / "run"
    run.mkdir()
    if setup:
        setup(run)
    t = time.perf_counter()
    res = run_py([SCRIPT, "--backends", "", "--run-dir", str(run), *[f.format(tmp=tmp) for f in flags]], timeout=120)
    elapsed, out = time.perf_counter() - t, res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("error:")] == [line.format(tmp=tmp)]
    assert "Traceback" not in out and "Starting to load model" not in out       # vLLM's first line
    assert not (run / "tiny-model").exists() and elapsed < 30                     # no model was built


def test_traceback_flag_keeps_the_whole_trace(tmp_path):
    res = run_py([SCRIPT, "--resume", "--traceback", "--run-dir", str(tmp_path)], timeout=120)
    assert res.returncode == 1 and "Traceback" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("FileNotFoundError: no checkpoint in")


def _interrupted(cmd: list[str], run: Path, step: int, sig: int) -> tuple[int, str]:
    """Start cmd in its own session, send sig to the session (as a terminal's Ctrl-C does) once the
    checkpoint of `step` exists, and return (exit status, stdout + stderr); nothing of it may be left."""
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT"}}
    log = run.parent / f"log-{step}.txt"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 400
        while not (run / "checkpoints" / f"step_{step:08d}" / "MANIFEST.json").exists():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(p.pid, sig)
        status = p.wait(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _session(pid) == p.pid]
    assert not left, f"processes left of the run: {left}"
    return status, log.read_text()


def _session(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.slow
def test_interrupt_reports_what_was_kept_and_the_printed_command_resumes(tmp_path):
    run = tmp_path.resolve() / "run"
    argv = [SCRIPT, "--steps", "50", "--save-every", "2", "--prompts", "8", "--group-size", "4", "--backends", "",
            "--run-dir", str(run)]
    status, out = _interrupted([PYTHON, *argv], run, 2, signal.SIGINT)
    assert status == 130 and "Traceback" not in out, out[-3000:]
    lines = out.splitlines()
    stop = next(ln for ln in lines if ln.startswith("SIGINT: stopped after step "))
    reached = int(stop.split()[4])
    assert stop == f"SIGINT: stopped after step {reached} of 50" and reached >= 2
    kept = _last_kept(run)                                       # steps are fast: later saves may land first
    assert kept % 2 == 0 and 2 <= kept <= reached
    assert f"last checkpoint: {run}/checkpoints/step_{kept:08d} (step {kept})" in lines
    resume = next(ln for ln in lines if ln.startswith("resume: "))[len("resume: "):]
    assert shlex.split(resume) == [os.path.relpath(PYTHON, ROOT), *argv, "--resume"]

    status, out = _interrupted(shlex.split(resume), run, kept + 2, signal.SIGTERM)   # the printed command, again
    assert status == 143 and "Traceback" not in out, out[-3000:]
    assert f"resuming from step {kept} (checkpoint {run}/checkpoints/step_{kept:08d})" in out
    assert f" {kept}/50 [" in out                                # the bar starts where the run was
    again = _last_kept(run)
    assert again >= kept + 2 and f"last checkpoint: {run}/checkpoints/step_{again:08d} (step {again})" in out.splitlines()
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= again


def _last_kept(run: Path) -> int:
    """The step of the run's last complete checkpoint on disk (the report must name this one)."""
    return max(int(p.name[len("step_"):]) for p in (run / "checkpoints").glob("step_*") if (p / "MANIFEST.json").exists())


INSIDE_A_TASK = """
import asyncio, signal, sys
sys.path.insert(0, "launch")
from common import Interrupted, interruptible

async def episode(i):
    await asyncio.sleep(0)
    if i == 5:
        signal.raise_signal(signal.SIGINT)        # arrives while this task's code runs
    await asyncio.sleep(30)

async def session():
    await asyncio.gather(*(episode(i) for i in range(10)))

try:
    with interruptible():
        asyncio.run(session())
except Interrupted as e:
    print("interrupted", e.signum)
"""


def test_interrupt_inside_an_episode_task_ends_the_session_without_a_trace():
    """A signal landing inside a running asyncio task (an episode) stops the whole session: every task
    cancelled, Interrupted raised out of asyncio.run, nothing logged about a task's lost exception."""
    res = run_py(["-c", INSIDE_A_TASK], timeout=60)
    assert (res.returncode, res.stdout.split()[:2], res.stderr) == (0, ["interrupted", "2"], ""), res.stderr


INSIDE_A_SAVE = """
import signal, sys, types
sys.path.insert(0, "launch")
from common import ending, interruptible

def save():                    # as torch.distributed.checkpoint's save: what the write raised is kept,
    try:                       # and an exception of its own raised after, chained to nothing
        signal.raise_signal(signal.SIGINT)
    except BaseException as e:
        failure = e
    raise RuntimeError(f"checkpoint failed: {failure!r}")

args = types.SimpleNamespace(traceback=False, run_dir=sys.argv[1], steps=5, save_every=2)
with interruptible(), ending(args, status=1):
    save()
"""


def test_an_interrupt_that_cuts_a_checkpoint_short_still_ends_as_an_interrupt(tmp_path):
    """SIGINT landing inside a checkpoint write, which replaces the interrupt by an error of its own:
    the run still ends as interrupted (status 130, what was kept), not with that error's traceback."""
    res = run_py(["-c", INSIDE_A_SAVE, str(tmp_path)], timeout=60)
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
    assert "SIGINT: stopped before this run logged a step" in res.stderr.splitlines()


def _lines(text: str) -> list[str]:
    """Output lines as a terminal leaves them: a progress bar's redraws (\\r) count once."""
    return [ln.split("\r")[-1] for ln in text.splitlines() if ln.split("\r")[-1].strip()]


@pytest.mark.slow
def test_a_default_run_speaks_plainly_and_verbose_shows_the_libraries(tmp_path):
    """Without flags a run prints its directory, settings, progress bar and results, and other
    libraries' errors only: no INFO / WARNING line, no deprecation, no loader bar, in a user's shell
    (Ray's auth mode unset: a co-located run starts no Ray, whose token warning would show). --verbose
    brings vLLM's own lines back (so the quiet is minirl's doing)."""
    argv = [SCRIPT, "--steps", "2", "--prompts", "4", "--group-size", "2", "--backends", ""]
    res = run_py([*argv, "--run-dir", str(tmp_path / "a")], timeout=300, env={"RAY_AUTH_MODE": None})
    assert res.returncode == 0, res.stderr[-3000:]
    lines = _lines(res.stdout + res.stderr)
    ours = ("run dir: ", "settings: ", "a: ", "reward curve: ", "reward: ")
    others = [ln for ln in lines if not ln.startswith(ours)]
    assert len(others) <= 2 and not [ln for ln in lines if "INFO" in ln or "WARNING" in ln or "Warning" in ln
                                       or "Loading" in ln], lines
    assert [ln for ln in lines if ln.startswith("reward: ")][0].endswith("(step 2)")
    assert "generator" not in [ln for ln in lines if ln.startswith("settings: ")][0]   # async settings: async only
    res = run_py([*argv, "--run-dir", str(tmp_path / "b"), "--verbose"], timeout=300)
    assert res.returncode == 0 and any("INFO" in ln for ln in _lines(res.stdout + res.stderr))
