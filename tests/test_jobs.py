"""The launch scripts as Ray Jobs on a private head node (`ray start --head ... --block`).

Needs: CPU only (4 logical CPUs of Ray resources on a 2-core box), `ray[default]` (dashboard +
job server). The module starts its own head on free ports with a private --temp-dir and stops
only that cluster at the end: it terminates the `--block` process (which shuts down what it
started) and then SIGKILLs, by pid, anything of this cluster still alive: its process group,
the processes it spawned, and any process whose command line or cwd names its temp dir. Never
`ray stop` (that kills every Ray process on the host). Slow: ~2-3 min on a 2-core machine.
"""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
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


class Head:
    def __init__(self):
        self.temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")   # short: unix socket paths
        self.port, self.dashboard_port = _free_port(), _free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.log = Path(self.temp_dir + ".log")
        cmd = [str(BIN / "ray"), "start", "--head", "--port", str(self.port),
               "--dashboard-port", str(self.dashboard_port),
               # ports that otherwise default to fixed numbers another cluster may hold
               "--ray-client-server-port", str(_free_port()),
               "--dashboard-agent-listen-port", str(_free_port()),
               "--num-cpus", "4", "--object-store-memory", "300000000", "--disable-usage-stats",
               "--include-dashboard", "true", "--temp-dir", self.temp_dir, "--block"]
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=self.log.open("w"),
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


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        h.client = h.wait_ready()
        yield h
    finally:
        killed = h.stop()
        left = [p for p in _cluster_pids(h.proc.pid, h.temp_dir) if _is_ours(p, h)]
        assert not left, f"processes of the test cluster survived teardown: {left}"
        print(f"test cluster stopped; SIGKILLed leftovers: {killed}")


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


def test_cli_submit(head):
    """The documented command: `ray job submit --working-dir . -- python ...` from the repo."""
    r = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", head.address,
                        "--working-dir", ".", "--", "python", "-c", "import minirl; print('ok')"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "succeeded" in out.lower() and "\nok\n" in out.replace("\r", ""), out[-5000:]


def test_colocated_job(head, tmp_path):
    run_dir = tmp_path / "colocated"
    job = submit(head, f"python launch/colocated.py --ray 2 --steps 3 --prompts 8 --backends '' "
                       f"--run-dir {run_dir}")
    status, logs = wait_job(head, job)
    assert status == "SUCCEEDED", logs[-8000:]
    assert "reward curve:" in logs, logs[-8000:]
    assert (run_dir / "reward_curve.png").stat().st_size > 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["policy_version"] == 2          # versions 0, 1, 2 generated the 3 steps


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
    lines = [ln for ln in s_logs.splitlines() if ln.startswith("server: {")]
    assert lines, s_logs[-8000:]
    stats = ast.literal_eval(lines[-1].removeprefix("server: "))     # the server's counters
    assert stats["failures"] == 0 and stats["prompts"] >= 32, stats  # stale ones are redone
    assert stats["tokens"] > 0
