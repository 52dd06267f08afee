"""The generation pool grows and shrinks on an autoscaling Ray cluster (fake nodes, one machine).

A private Ray cluster with Ray's fake multi-node provider: a head with 3 CPUs (trainer, queue,
driver) and a worker node type `gen_pool` ({CPU: 1, gen_pool: 1}, 0..2 nodes). The rollout
server starts with no generator and asks for replicas with resources {"CPU": 1, "gen_pool": 1},
which only a gen_pool node has, so every replica's placement group stays pending until the
autoscaler adds a node for it. Scenario (prompts arrive in three phases of 16, so the run
cannot end before the pool has changed):

1. scale up from zero: replica A's group is pending, a gen_pool node appears, A starts and the
   trainer (on the head) trains phase 1 (4 steps, policy version 4), then waits for prompts;
2. scale up while training: replica B gets a second node and bootstraps the trainer's current
   weights (version 4) from the object store: its info() version equals the hub's, and every
   batch it generates carries a policy version >= 4, never the initial weights' 0;
3. scale down: A is drained and removed while phase 2 runs; phase 3 is served by B alone; the
   trainer trains every uid exactly once, and the idle gen_pool nodes go away afterwards.

test_cluster_yaml_is_a_valid_autoscaler_config checks launch/cluster.yaml (the AWS version of
this layout) the way `ray up` would before launching anything.

Which replica made a batch: GenerationActor records it in Rollout.info["worker_id"].

The cluster is started with `ray start --head --block` in its own session, on its own ports and
temp dir, and stopped by signalling only that session's processes: never `ray stop`, which
would kill every Ray process on the machine (other tests run Ray here at the same time).

Needs: CPU only, a few GB of RAM; about 1 minute on a 2-core box (more under load: every wait
has its own deadline).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

from minirl import ppo_loss_fn
from minirl.recipes.tasks import get_task

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # loop and actor class travel

ROOT = Path(__file__).resolve().parents[1]
LLM = {"max_model_len": 128, "enforce_eager": True}
GEN_BUNDLE = {"CPU": 1, "gen_pool": 1}
PHASE = 16                    # prompts per phase; the trainer takes 4 per step
T0 = time.time()


def log(msg):
    print(f"[autoscale {time.time() - T0:6.1f}s] {msg}", flush=True)


def wait_for(pred, timeout_s, what, every=0.5, show=None):
    """Poll pred() until truthy (returned) or raise TimeoutError after timeout_s."""
    deadline, last = time.time() + timeout_s, 0.0
    while True:
        out = pred()
        if out:
            return out
        if time.time() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s" + (f" ({show()})" if show else ""))
        if show is not None and time.time() - last > 10:
            log(f"waiting for {what}: {show()}")
            last = time.time()
        time.sleep(every)


# -- a private fake autoscaling cluster ----------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    """Every live process whose session id is `sid` (Ray workers change their process group,
    never their session, so this finds all of our cluster's processes and nothing else)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":     # fields[3]: session; [0]: state
            pids.append(int(d))
    return pids


def _kill_session(sid: int, grace_s: float, reap=lambda: None) -> None:
    """SIGTERM every process of session `sid`, then SIGKILL what is left after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while time.time() < deadline:
            reap()
            if not _session_pids(sid):
                return
            time.sleep(0.2)


_WATCHDOG = """
import os, signal, sys, time
parent, sid = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:      # reparented: the test process died without its teardown
    time.sleep(1)
_kill_session(sid, 10.0)
"""


class PrivateAutoscalingCluster:
    """Ray's fake multi-node autoscaling cluster (ray.cluster_utils.AutoscalingCluster), minus
    its `ray stop --force` calls and its dependency on the example.yaml the wheel lacks.

    start(): writes the autoscaler config and runs `ray start --head --block
    --autoscaling-config=...` in a new session (RAY_FAKE_CLUSTER=1, AUTOSCALER_UPDATE_INTERVAL_S=1,
    RAY_AUTH_MODE=disabled), on free ports and a private temp dir (so `ray.init("auto")`
    elsewhere never finds it). The autoscaler (v1) launches fake worker nodes from its monitor
    process, i.e. inside that session; provider.gcs_address points them at our GCS rather than
    the default port 6379. shutdown(): SIGTERM, then SIGKILL, to that session only. A watchdog
    process does the same if the test process dies without tearing down (e.g. kill -9).
    """

    def __init__(self, head_resources: dict, worker_node_types: dict, **config):
        self.head_resources = dict(head_resources)
        self.worker_node_types = worker_node_types
        self.extra = config
        self.proc = self.watchdog = None
        self.address = None

    def config(self, gcs_address: str) -> dict:
        cfg = {"cluster_name": "minirl-fake", "max_workers": 8, "upscaling_speed": 1.0,
               "idle_timeout_minutes": 0.2,
               "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                            "disable_node_updaters": True, "disable_launch_config_check": True,
                            "gcs_address": gcs_address},
               "head_node_type": "ray.head.default", "auth": {}, "docker": {},
               "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
               "worker_setup_commands": [], "head_start_ray_commands": [],
               "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
               "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": []}
        cfg["available_node_types"] = {
            **self.worker_node_types,
            "ray.head.default": {"resources": self.head_resources, "node_config": {}, "max_workers": 0}}
        cfg.update(self.extra)
        return cfg

    def start(self, timeout_s: float = 120.0) -> str:
        from ray._private.services import get_node_ip_address
        self.tmp = Path(tempfile.mkdtemp(prefix="rayas-", dir="/tmp"))   # short: socket paths
        port = _free_port()
        self.address = f"{get_node_ip_address()}:{port}"
        cfg_path = self.tmp / "autoscaler.json"
        cfg_path.write_text(json.dumps(self.config(self.address)))
        res = dict(self.head_resources)
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin) if ray_bin.exists() else shutil.which("ray"), "start", "--head", "--block",
               f"--autoscaling-config={cfg_path}", f"--port={port}",
               f"--temp-dir={self.tmp / 'ray'}", "--include-dashboard=false",
               f"--ray-client-server-port={_free_port()}",
               f"--dashboard-agent-listen-port={_free_port()}",
               "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats",
               f"--num-cpus={res.pop('CPU', 1)}",
               f"--object-store-memory={res.pop('object_store_memory', 300 * 2**20)}"]
        if res:
            cmd.append(f"--resources={json.dumps(res)}")
        dist_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"}
        env = {k: v for k, v in os.environ.items() if k not in dist_vars}
        env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_AUTH_MODE="disabled",
                   AUTOSCALER_METRIC_PORT=str(_free_port()),      # default 44217 may be taken
                   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",      # SIGTERM: stop at once
                   PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.log_path = self.tmp / "ray_start.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        marker = self.tmp / "ray" / "ray_current_cluster"
        wait_for(lambda: marker.exists() or self.proc.poll() is not None, timeout_s,
                 "the fake cluster's head to start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        # The fake worker nodes are started by the autoscaler without fate sharing: if this
        # process is killed (no teardown), a watchdog kills the session for us.
        import inspect
        src = inspect.getsource(_session_pids) + inspect.getsource(_kill_session) + _WATCHDOG
        self.watchdog = subprocess.Popen([sys.executable, "-c", "import os, signal, time\n" + src,
                                          str(os.getpid()), str(self.proc.pid)],
                                         start_new_session=True, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log(f"head up at {self.address} (session {self.proc.pid}, temp dir {self.tmp})")
        return self.address

    def shutdown(self, grace_s: float = 10.0, keep_logs: bool = False) -> None:
        """SIGTERM every process of our session, SIGKILL what is left after grace_s."""
        if self.proc is None:
            return
        sid, t0 = self.proc.pid, time.time()
        _kill_session(sid, grace_s, reap=self.proc.poll)   # poll(): reap our child (no zombie)
        self.proc.wait(timeout=grace_s)
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
        left = _session_pids(sid)
        log(f"cluster stopped in {time.time() - t0:.1f} s (session {sid}; {len(left)} processes left)")
        if keep_logs:
            log(f"logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.proc = self.watchdog = None


@pytest.fixture(scope="module")
def fake_cluster(request):
    cluster = PrivateAutoscalingCluster(
        head_resources={"CPU": 3, "object_store_memory": 300 * 2**20},
        worker_node_types={"gen_pool": {
            "resources": {**GEN_BUNDLE, "object_store_memory": 150 * 2**20},
            "node_config": {}, "min_workers": 0, "max_workers": 2}},
        max_workers=2, idle_timeout_minutes=0.2)
    failed_before = request.session.testsfailed
    try:
        address = cluster.start()
        ray.init(address=address, namespace="minirl", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown(keep_logs=request.session.testsfailed > failed_before
                         or bool(os.environ.get("MINIRL_KEEP_RAY_LOGS")))


# -- helpers --------------------------------------------------------------------------------------

def train_loop(worker):
    """One optimizer step (the trainer's verbs) and one weight sync per pull, until the queue is
    finished. Records, per batch, (uid, its policy_version, the replica that made it)."""
    seen = []
    for batches in worker.pull_rollouts():
        seen += [(b.uid, b.policy_version, b.rollouts[0].info.get("worker_id"), worker.policy_version)
                 for b in batches]
        worker.trainer.forward_backward([r for b in batches for r in b.compute_advantages()], ppo_loss_fn())
        worker.trainer.optim_step()
        worker.sync_weights()
    return {"seen": seen, "version": worker.policy_version}


def gen_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("gen_pool")]


def pg_state(pg) -> str:
    return ray.util.placement_group_table(pg).get("state")


def pg_node(pg) -> str:
    return ray.util.placement_group_table(pg)["bundles_to_node_id"][0]


# -- the tests ------------------------------------------------------------------------------------

def test_cluster_yaml_is_a_valid_autoscaler_config():
    """launch/cluster.yaml passes what `ray up` runs first (defaults filled in, then the
    schema), and has the node types the docs promise."""
    import copy
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config
    cfg = yaml.safe_load((ROOT / "launch" / "cluster.yaml").read_text())
    full = prepare_config(copy.deepcopy(cfg))
    validate_config(full)
    types = full["available_node_types"]
    assert full["head_node_type"] in types and full["provider"]["type"] == "aws"
    gen, trainer = types["gen_gpu"], types["trainer"]
    assert gen["min_workers"] == 0 and gen["max_workers"] >= 1
    assert gen["resources"]["gen_pool"] >= 1 and gen["resources"]["GPU"] >= 1
    assert trainer["min_workers"] == trainer["max_workers"] == 1 and trainer["resources"]["trainer"] >= 1
    assert "gen_pool" not in trainer["resources"] and "gen_pool" not in types[full["head_node_type"]]["resources"]
    assert full["max_workers"] >= trainer["max_workers"] + gen["max_workers"]
    assert full["idle_timeout_minutes"] > 0
    assert any('pip install -q -e ".[gpu]"' in c for c in full["setup_commands"])


def test_generation_pool_scales_up_from_zero_and_down(fake_cluster, tiny_model):
    from actors.training import start_trainers
    from actors.server import RolloutServer

    t_start = time.time()
    task = get_task("succ")
    prompts, answers = task.sample(3 * PHASE, seed=7)

    def phase(i, close):
        s = slice(i * PHASE, (i + 1) * PHASE)
        server.submit(prompts[s], metadata=answers[s], uids=list(range(s.start, s.stop)), close=close)

    assert ray.cluster_resources().get("gen_pool", 0) == 0 and gen_nodes() == []
    server = RolloutServer(tiny_model, "q-autoscale", reward_fn=task.reward, num_generators=0,
                           group_size=4, sampling={"max_tokens": 2}, resources=GEN_BUNDLE,
                           llm_kwargs=LLM, queue_size=16, prompts_per_call=4,
                           ready_timeout_s=180, call_timeout_s=180)
    assert server.generators == {}
    phase(0, close=False)
    pg, (trainer,) = start_trainers(1, tiny_model, "q-autoscale", bundle={"CPU": 1}, lr=1e-3,
                                    batch_size=4, max_staleness=1, pull_timeout_s=300)
    server.run(block=False)
    done = trainer.run.remote(train_loop)
    log(f"server (no generators) and trainer up; {server.queue_stats()}")

    def show():
        return (f"gen nodes {len(gen_nodes())}, queue {server.queue_stats()}, "
                f"replicas {[(w, g['ready']) for w, g in server.generators.items()]}")

    def add_and_wait(what):
        n_before = len(gen_nodes())
        t0 = time.time()
        wid = server.add_generator(wait=False)
        g = server.generators[wid]
        assert pg_state(g["pg"]) == "PENDING"       # nothing can host it: demand for the autoscaler
        wait_for(lambda: len(gen_nodes()) > n_before, 120, f"{what}: a new gen_pool node", show=show)
        t1 = time.time()
        wait_for(lambda: pg_state(g["pg"]) == "CREATED", 60, f"{what}: its placement group", show=show)
        wait_for(lambda: g["ready"], 180, f"{what}: the replica to start", show=show)
        log(f"{what} {wid}: node after {t1 - t0:.1f} s, ready after {time.time() - t0:.1f} s "
            f"on node ...{pg_node(g['pg'])[-5:]}")
        return wid, g

    # 1. Scale up from zero; phase 1 trains to version 4, then the trainer waits for prompts.
    wa, ga = add_and_wait("scale-up 1")
    wait_for(lambda: server.queue_stats()["delivered"] == PHASE and server.queue_stats()["version"] == 4,
             120, "phase 1 to be trained", show=show)
    log(f"phase 1 trained: {server.queue_stats()}")

    # 2. Scale up while the trainer holds version 4: B must start from those weights.
    wb, gb = add_and_wait("scale-up 2")
    info, hub_version = ray.get(gb["actor"].info.remote(), timeout=60), server.queue_stats()["version"]
    log(f"replica B: {info}, hub version {hub_version}")
    assert hub_version == 4 and info["version"] == 4 and not info["restarted"]
    assert pg_node(ga["pg"]) != pg_node(gb["pg"])
    assert set(ray.get(server.queue.workers.remote(), timeout=60)) == {wa, wb}

    # 3. Scale down: drain and remove A while phase 2 is being generated; B serves phase 3.
    node_a = pg_node(ga["pg"])
    phase(1, close=False)
    wait_for(lambda: server.queue_stats()["delivered"] >= PHASE + 4, 120, "phase 2 to start", show=show)
    t0 = time.time()
    assert server.remove_generator(wa, timeout_s=120) == wa
    log(f"removed {wa} in {time.time() - t0:.1f} s; {server.queue_stats()}")
    assert wa not in server.generators and pg_state(ga["pg"]) == "REMOVED"
    assert set(ray.get(server.queue.workers.remote(), timeout=60)) == {wb}
    phase(2, close=True)

    out = ray.get(done, timeout=300)
    stats = server.wait(timeout_s=120)
    log(f"run finished: server {stats}, queue {server.queue_stats()}, trainer version {out['version']}")
    seen = out["seen"]
    assert sorted(u for u, *_ in seen) == list(range(3 * PHASE))     # none lost, none twice
    assert out["version"] == 3 * PHASE // 4
    assert all(trainer_v - v <= 1 for _, v, _, trainer_v in seen)      # staleness bound held
    by = {w: [(u, v) for u, v, who, _ in seen if who == w] for w in (wa, wb)}
    assert {who for _, _, who, _ in seen} <= {wa, wb}
    assert by[wa] and by[wb]                                          # both served
    assert min(v for _, v in by[wb]) >= 4          # B never generated with its initial weights
    assert all(u >= PHASE for u, _ in by[wb])      # B joined after phase 1 was trained
    assert all(u < 2 * PHASE for u, _ in by[wa])   # nothing from A after its removal
    log(f"A made {len(by[wa])} batches, B {len(by[wb])}; B's versions "
        f"{sorted({v for _, v in by[wb]})}; failures {stats['failures']}")

    # Give the nodes back: A's node first (idle since its removal), then B's.
    server.shutdown(remove_queue=True)
    ray.get(trainer.close.remote(), timeout=60); ray.kill(trainer); ray.util.remove_placement_group(pg)
    t0 = time.time()
    nodes = lambda: f"gen_pool nodes {[n[-5:] for n in gen_nodes()]}"   # noqa: E731 (queue is gone)
    wait_for(lambda: node_a not in gen_nodes(), 90, "A's node to be released", show=nodes)
    wait_for(lambda: not gen_nodes(), 90, "every gen_pool node to be released", show=nodes)
    log(f"gen_pool nodes released {time.time() - t0:.1f} s after shutdown; "
        f"test took {time.time() - t_start:.1f} s")
