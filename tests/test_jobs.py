"""The launch scripts as Ray Jobs on private head nodes (`ray start --head ... --block`).

Needs: CPU only, a venv with `ray[default]` (dashboard + job server). test_readme_ray_block runs
the README's "Running on Ray" block line by line on a copy of the working tree (what a fresh
clone holds, plus the venv as `.venv`) with a fresh HOME (no Ray token yet); the async test
submits two jobs to a head of 4 logical CPUs through the SDK. Every head starts on free ports
with a private --temp-dir and is stopped alone: the test terminates its `--block` process (which
shuts down what it started) and then SIGKILLs, by pid, anything of that cluster still alive: its
process group, the processes it spawned, and any process whose command line or cwd names its
temp dir. Never `ray stop` (that kills every Ray process on the host). Slow: ~3-4 min on a 2-core
machine.
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent            # the venv's bin: `ray` and the jobs' `python`
EXCLUDES = [".venv", ".git", "runs", ".gpukit", "*.egg-info", "__pycache__", ".pytest_cache",
            ".hypothesis"]
DONE = {"SUCCEEDED", "FAILED", "STOPPED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Not inherited by the cluster (and so by the jobs): a cluster address, or this pytest process's
# torch.distributed world (init_distributed sets RANK/MASTER_PORT/... in os.environ).
DROP = {"RAY_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    return {**env, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _proc_info(pid: int):
    """(ppid, pgid, cmdline, cwd) of a live process, or None (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in "ZX":
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        return int(fields[1]), int(fields[2]), cmd, cwd
    except (OSError, IndexError, ValueError):
        return None


def _names(temp_dir: str, cmd: str, cwd: str) -> bool:
    """Does a command line or cwd name this temp dir (not merely one that starts like it)?"""
    return (re.search(re.escape(temp_dir) + r"(/|\s|$)", cmd) is not None
            or cwd == temp_dir or cwd.startswith(temp_dir + "/"))


def _cluster_pids(root_pid: int, temp_dir: str) -> set[int]:
    """Processes of this cluster: descendants of `root_pid`, members of its process group,
    and anything whose command line or cwd names the private temp dir. Workers and job
    drivers start their own sessions, so the process group alone is not enough."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            info = _proc_info(int(d))
            if info is not None:
                table[int(d)] = info
    mine = {pid for pid, (_, pgid, cmd, cwd) in table.items()
            if pgid == root_pid or _names(temp_dir, cmd, cwd)}
    if root_pid in table:
        mine.add(root_pid)
    grew = True
    while grew:                       # close over children
        new = {pid for pid, (ppid, *_) in table.items() if ppid in mine} - mine
        mine |= new
        grew = bool(new)
    return mine


HEAD_START = [str(BIN / "ray"), "start", "--head", "--num-cpus", "4", "--object-store-memory", "300000000",
              "--disable-usage-stats", "--include-dashboard", "true"]


class Head:
    """`start` (a `ray start --head ...` command) on free ports, a private temp dir, --block."""

    def __init__(self, start: list[str] = HEAD_START, env: dict | None = None, cwd: Path | None = None):
        self.temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")   # short: unix socket paths
        self.port, self.dashboard_port = _free_port(), _free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.log = Path(self.temp_dir + ".log")
        cmd = [*start, "--port", str(self.port), "--dashboard-port", str(self.dashboard_port),
               # ports that otherwise default to fixed numbers another cluster may hold
               "--ray-client-server-port", str(_free_port()),
               "--dashboard-agent-listen-port", str(_free_port()),
               "--temp-dir", self.temp_dir, "--block"]
        self.proc = subprocess.Popen(cmd, env=_env() if env is None else env, cwd=cwd, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.seen: set[int] = set()

    def wait_ready(self, timeout_s: float = 120.0):
        from ray.job_submission import JobSubmissionClient
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                client = JobSubmissionClient(self.address)
                client.list_jobs()
                return client
            except Exception as e:      # connection refused while the dashboard starts
                if time.monotonic() > deadline:
                    raise TimeoutError(f"dashboard {self.address} not up after {timeout_s} s: {e}\n"
                                       f"{self.log.read_text()}") from e
                time.sleep(0.5)

    def wait_http(self, token: str | None, timeout_s: float = 120.0):
        """Wait until the job server lists jobs (with the bearer token, if any)."""
        deadline = time.monotonic() + timeout_s
        while _http_status(f"{self.address}/api/jobs/", token) != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job server {self.address} not up after {timeout_s} s:\n"
                                   f"{self.log.read_text()}")
            time.sleep(0.5)

    def stop(self) -> list:
        """Stop this cluster only; return what had to be SIGKILLed (for the check)."""
        self.seen |= _cluster_pids(self.proc.pid, self.temp_dir)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)   # --block: shuts down what it started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        killed = []
        deadline = time.monotonic() + 15
        while True:
            left = {p for p in self.seen | _cluster_pids(self.proc.pid, self.temp_dir)
                    if _proc_info(p) is not None and _is_ours(p, self)}
            if not left:
                break
            if time.monotonic() > deadline:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.append((pid, _proc_info(pid)))
                    except ProcessLookupError:
                        pass
                time.sleep(1)
                break
            time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.log.unlink(missing_ok=True)
        return killed


def _is_ours(pid: int, head: Head) -> bool:
    """Guard against pid reuse: a pid we saw is still ours only if it still names our cluster
    (temp dir, GCS port, or our process group)."""
    info = _proc_info(pid)
    if info is None:
        return False
    _, pgid, cmd, cwd = info
    return (pgid == head.proc.pid or _names(head.temp_dir, cmd, cwd)
            or re.search(rf":{head.port}\b", cmd) is not None)


def _stop(h: Head):
    killed = h.stop()
    left = [p for p in _cluster_pids(h.proc.pid, h.temp_dir) if _is_ours(p, h)]
    assert not left, f"processes of the test cluster survived teardown: {left}"
    assert not Path(h.temp_dir).exists()
    print(f"test cluster stopped; SIGKILLed leftovers: {killed}")


def _http_status(url: str, token: str | None) -> int | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:                     # connection refused while the dashboard starts
        return None


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        h.client = h.wait_ready()
        yield h
    finally:
        _stop(h)


@pytest.fixture
def heads():
    """Heads a test starts itself (append them); each stopped alone at teardown."""
    started: list[Head] = []
    try:
        yield started
    finally:
        for h in started:
            _stop(h)


def submit(head: Head, entrypoint: str, **kw) -> str:
    runtime_env = {"working_dir": str(ROOT), "excludes": EXCLUDES,
                   "env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}}
    return head.client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, **kw)


def wait_job(head: Head, job_id: str, timeout_s: float = 240.0) -> tuple[str, str]:
    """Poll until the job ends; (status, logs). Stops the job on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(head.client.get_job_status(job_id))
        if status.split(".")[-1] in DONE:
            return status.split(".")[-1], head.client.get_job_logs(job_id)
        if time.monotonic() > deadline:
            head.client.stop_job(job_id)
            raise TimeoutError(f"job {job_id} still {status} after {timeout_s} s; logs:\n"
                               f"{head.client.get_job_logs(job_id)[-5000:]}")
        time.sleep(1.0)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


README = ROOT / "README.md"
# Not in the shell of a fresh login: the test run's Ray auth mode and token, its venv, its vLLM setting.
FRESH_DROP = DROP | {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_API_SERVER_ADDRESS",
                     "VIRTUAL_ENV", "VLLM_ENABLE_V1_MULTIPROCESSING"}


def readme_block(section: str) -> list[str]:
    """The non-blank lines of the first ```bash block under the README heading `section`."""
    text = README.read_text()
    body = text[text.index(f"\n{section}\n"):]
    end = body.find("\n## ", 1)                                     # the next section
    body = body if end < 0 else body[:end]
    block = re.search(r"^```bash\n(.*?)^```", body, re.M | re.S)
    assert block, f"no bash block under {section!r} in README.md"
    return [ln for ln in block[1].splitlines() if ln.strip()]


def _clone(dest: Path) -> Path:
    """What a fresh clone of the working tree holds (tracked files and untracked ones git does
    not ignore, as they are now), plus this interpreter's venv linked as .venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():                   # not a tracked file deleted in the tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    return dest


def _bash(script: str, env: dict, cwd: Path, timeout_s: float) -> str:
    """Run `script` under `bash -e -o pipefail` (any failing line fails it); its output. On a
    timeout the whole process group is killed."""
    p = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        raise TimeoutError(f"still running after {timeout_s} s:\n{script}\n{out[-8000:]}")
    assert p.returncode == 0, f"exited {p.returncode}:\n{script}\n{out[-8000:]}"
    return out


def test_readme_ray_block(heads, tmp_path):
    """README "Running on Ray" as printed, in the shell of a fresh clone with a fresh HOME (no Ray
    token yet, PATH without the venv): every line runs verbatim under bash -e, except that
    `ray start --head` gets this test's free ports, private temp dir and --block appended (a head it
    can stop alone), and the last line, `ray stop`, is done by the fixture's teardown (`ray stop`
    stops every Ray process on the host). The run dir of the block's job must outlive Ray's copy
    of the working dir: it is checked after the job, in the clone."""
    if not (Path(sys.prefix) / "bin" / "activate").is_file():
        pytest.skip("the block activates .venv: run the tests from a virtualenv")
    lines = readme_block("## Running on Ray")
    starts = [i for i, ln in enumerate(lines) if ln.startswith("ray start --head")]
    assert len(starts) == 1 and shlex.split(lines[-1], comments=True) == ["ray", "stop"], lines
    before, start, after = lines[:starts[0]], lines[starts[0]], lines[starts[0] + 1:-1]
    submit = [ln for ln in after if ln.startswith("ray job submit")]
    assert len(submit) == 1 and "--working-dir ." in submit[0], lines
    steps = int(re.search(r"--steps (\d+)", submit[0])[1])
    run_dir = re.search(r"--run-dir (\S+)", submit[0])[1]
    assert run_dir.startswith("$PWD/"), f"the run dir must be absolute, outside Ray's copy: {run_dir}"

    clone, home = _clone(tmp_path / "minirl"), tmp_path / "home"
    home.mkdir()
    venv_bin = (Path(sys.prefix) / "bin").resolve()
    env = {k: v for k, v in os.environ.items() if k not in FRESH_DROP}
    env |= {"HOME": str(home), "PYTHONUNBUFFERED": "1",
            "PATH": os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                    if d and Path(d).resolve() != venv_bin),
            # caches only (vLLM's model-architecture info): not part of what the block sets up
            "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))}

    dump = tmp_path / "env"                       # the shell as the lines before `ray start` leave it
    _bash("\n".join([*before, f"env -0 > {shlex.quote(str(dump))}"]), env, clone, 120)
    env = dict(kv.split("=", 1) for kv in dump.read_text().split("\0") if "=" in kv)
    token = None
    if env.get("RAY_AUTH_MODE") == "token":
        token = (home / ".ray" / "auth_token").read_text().strip()
    h = Head(shlex.split(start, comments=True), env, cwd=clone)
    heads.append(h)
    h.wait_http(token)
    if token:                                     # token auth is on: no token, no jobs
        assert _http_status(f"{h.address}/api/jobs/", None) == 401

    out = _bash("\n".join(after), env | {"RAY_ADDRESS": h.address}, clone, 300)
    assert "succeeded" in out.lower() and "reward curve:" in out, out[-8000:]
    run = Path(run_dir.replace("$PWD", str(clone)))
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["policy_version"] == steps - 1     # versions 0 .. steps-1 generated the steps
    assert (run / "reward_curve.png").stat().st_size > 0
    assert f'{{"step": {steps}, ' in out                   # the block shows the last step's metrics


def test_async_as_two_jobs(head, tmp_path):
    """Generation and training as separate jobs, joined only by the queue's name and the run's token."""
    queue, token = f"q-jobs-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex   # token: the queue refuses other jobs
    common = f"--queue {queue} --steps 4 --prompts 8"
    server = submit(head, f"MINIRL_QUEUE_TOKEN={token} python launch/async.py --role server {common} "
                          f"--run-dir {tmp_path / 's'}")
    trainer = submit(head, f"MINIRL_QUEUE_TOKEN={token} python launch/async.py --role trainer {common} "
                           f"--run-dir {tmp_path / 't'} "
                           "--backends ''")
    t_status, t_logs = wait_job(head, trainer)
    s_status, s_logs = wait_job(head, server)
    assert t_status == "SUCCEEDED", t_logs[-8000:]
    assert s_status == "SUCCEEDED", s_logs[-8000:]
    records = read_jsonl(tmp_path / "t" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["policy_version"] == 4
    assert max(r["staleness"] for r in records) <= 1
    assert "reward curve:" in t_logs
    lines = [m.groups() for ln in s_logs.splitlines()          # the server's counters
             if (m := re.fullmatch(r"server: (\d+) prompts, (\d+) tokens generated, (\d+) failed, (\d+) weight loads", ln))]
    assert lines, s_logs[-8000:]
    prompts, tokens, failed, loads = map(int, lines[-1])
    assert failed == 0 and prompts >= 32 and tokens > 0 and loads >= 1, lines   # stale ones are redone
