"""Faults on the async backend (local Ray, CPU): bad settings refused before any engine starts, a
prompt whose request fails (too long, reward_fn raised or blocked) stopping the run or skipped
and recorded (never retried), a generator whose __init__ fails naming its cause, the trainer
alone killed between steps or inside a weight push and resumed from its checkpoint, the queue actor
killed at a seeded moment and restarted by Ray (server and trainer rejoin it), and the queue killed
after the trainer's finish(): every prompt trained exactly once, no version reused, and the
generators back on the trainer's weights; several seeds each (benchmarks/soak.py: all at once).

Run: `pytest tests/test_async_faults.py` (about 8 minutes on 2 cores). Hardware: CPU.
"""

import random
import sys
import time
from collections import Counter

import pytest
import ray

from actors.server import RolloutServer
from minirl.checkpoint import Checkpointer, read_state, trained_uids
from minirl.recipes.tasks import get_task
from test_checkpoint import _loop            # train, checkpoint every k steps, pause a moment

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # functions below run in actors

LLM = {"max_model_len": 128, "enforce_eager": True}
SETTINGS = {"reward_fn": lambda p, c: 0.0, "group_size": 4, "sampling": {"max_tokens": 2}}


def picky_reward(prompt, completion, answer):
    """succ's reward, except for prompts whose answer says to raise or to block."""
    if answer == "raise":
        raise KeyError("no reference answer for this prompt")
    if answer == "block":
        time.sleep(120)
    return float(completion.strip() == str(answer))


@pytest.mark.parametrize("change, error, msg", [
    ({"group_size": 0}, ValueError, "group_size=0, must be a number >= 1"),
    ({"sampling": {"max_tokens": 0}}, ValueError, "max_tokens must be at least 1"),
    ({"sampling": {"max_token": 2}}, ValueError, "Unexpected keyword argument 'max_token'"),
    ({"reward_fn": "math"}, TypeError, "reward_fn must be callable"),
    ({"reward_timeout_s": 0}, ValueError, "reward_timeout_s=0, must be > 0"),
    ({"on_failure": "retry"}, ValueError, "choose 'stop'"),
    ({"queue_size": 0}, ValueError, "queue_size=0"),
    ({"prompts_per_call": 0}, ValueError, "prompts_per_call=0"),
])
def test_bad_settings_refused_before_any_engine(tiny_model, change, error, msg):
    t0 = time.time()
    with pytest.raises(error, match=msg):
        RolloutServer(tiny_model, "never", **{**SETTINGS, **change})
    assert not ray.is_initialized() and time.time() - t0 < 120    # no cluster, no engine (import: slow)


def _failing_server(tiny_model, name, on_failure):
    """8 succ prompts; uid 2's reward raises, uid 5's blocks, uid 6 is longer than max_model_len."""
    prompts, answers = get_task("succ").sample(8, seed=1)
    answers[2], answers[5] = "raise", "block"
    prompts[6] = list(range(10, 210))
    srv = RolloutServer(tiny_model, name, reward_fn=picky_reward, num_generators=1, group_size=2,
                        sampling={"max_tokens": 2}, queue_size=8, prompts_per_call=4, llm_kwargs=LLM,
                        on_failure=on_failure, reward_timeout_s=2.0)
    srv.submit(prompts, metadata=answers)
    return srv


def test_failed_prompts_skipped_and_recorded(ray_local, tiny_model):
    srv = _failing_server(tiny_model, "q-skip", "skip")
    srv.run(block=False)
    taken = []
    while got := ray.get(srv.queue.get.remote(2, 120), timeout=150):
        taken += [b.uid for b in got]
    stats, failures = srv.wait(timeout_s=60), srv.failures()
    assert sorted(taken + list(failures)) == list(range(8))                 # each prompt once, none retried
    assert {2, 5} <= set(failures) and stats["failed"] == len(failures)
    assert "KeyError" in failures[2] and "no reference answer" in failures[2]
    assert "TimeoutError: reward_fn did not return within 2.0 s" in failures[5]
    if 6 in failures:                        # too long: failed, or an episode ended by max_model_len
        assert "max_model_len" in failures[6] or "maximum model length" in failures[6]
    srv.shutdown(remove_queue=True)


def test_failed_prompt_stops_the_run_with_its_cause(ray_local, tiny_model):
    srv = _failing_server(tiny_model, "q-stop", "stop")
    srv.run(block=False)
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"prompt uid (2|5|6) failed on gen-\w+: .*on_failure='skip'"):
        while ray.get(srv.queue.get.remote(2, 120), timeout=150):
            pass
    assert time.time() - t0 < 90                             # fails fast, no retry loop
    with pytest.raises(RuntimeError, match="The run stops"):
        srv.wait(timeout_s=60)                               # the server side ends too, with the cause
    srv.shutdown(remove_queue=True)


def test_generator_init_failure_names_its_cause(ray_local, tiny_model):
    """... and leaves nothing behind: the generators' placement groups are removed and the (detached) queue
    is gone, so a retry under its name with a new run's token is not refused as another run's."""
    from ray.util.placement_group import placement_group_table
    before = set(placement_group_table())
    with pytest.raises(RuntimeError, match=r"generator gen-\w+ failed to start: .*no_such_engine_arg"):
        RolloutServer(tiny_model, "q-init", **SETTINGS, llm_kwargs={**LLM, "no_such_engine_arg": 1},
                      ready_timeout_s=120)
    new = {k: v["state"] for k, v in placement_group_table().items() if k not in before}
    assert new and set(new.values()) == {"REMOVED"}, new
    deadline = time.time() + 30
    while _named("q-init") and time.time() < deadline:     # ray.kill takes effect shortly after
        time.sleep(0.2)
    assert not _named("q-init")


def _named(name: str) -> bool:
    try:
        ray.get_actor(name, namespace="minirl")
        return True
    except ValueError:
        return False


# ---- the trainer alone killed at a seeded moment, resumed from its checkpoint ------------------

N = 32


def _resume(worker, root):
    """Load the checkpoint (the queue rolls back, generators get the restored weights), then train."""
    worker.load_checkpoint(Checkpointer(root))
    gens = ray.get(worker.queue.workers.remote(), timeout=60)
    versions = {ray.get(h.info.remote(), timeout=60)["version"] for h in gens.values()}
    restored = (worker.policy_version, versions, list(worker.trained_uids))
    _loop(worker, root, 100)
    return restored, list(worker.trained_uids), worker.policy_version


def _running(tiny_model, name, seed):
    """A server generating N succ prompts on one generator, and one trainer rank: (server, pg, trainer)."""
    from actors.training import start_trainers
    prompts, answers = get_task("succ").sample(N, seed=seed)
    srv = RolloutServer(tiny_model, name, reward_fn=get_task("succ").reward, num_generators=1,
                        group_size=4, sampling={"max_tokens": 2}, queue_size=8, prompts_per_call=4,
                        llm_kwargs=LLM)
    srv.submit(prompts, metadata=answers)
    srv.run(block=False)
    return (srv, *start_trainers(1, tiny_model, name, **TRAIN))


TRAIN = {"lr": 1e-3, "batch_size": 4, "max_staleness": 1}


class _PausingQueue:
    """The trainer's queue handle, except that its first set_version at or past `version` (a weight push
    announced to the queue, the generators not yet told) writes `marker` and then hangs."""

    def __init__(self, queue, version: int, marker: str):
        self.queue, self.version, self.marker = queue, version, marker

    def __getattr__(self, name):
        return getattr(self.queue, name)

    @property
    def set_version(self):
        class Method:
            def remote(_, version, *args):
                ref = self.queue.set_version.remote(version, *args)
                if version >= self.version:
                    ray.get(ref, timeout=60)
                    open(self.marker, "w").close()
                    time.sleep(600)                     # killed here
                return ref
        return Method()


def _loop_pausing_in_a_push(worker, root, every, version, marker):
    worker.pusher.queue = _PausingQueue(worker.pusher.queue, version, marker)
    return _loop(worker, root, every)


@pytest.mark.parametrize("moment, seed", [("between steps", 0), ("between steps", 3), ("during a push", 0),
                                          ("during a push", 4)])
def test_trainer_killed_alone_and_resumed_trains_every_prompt_once(ray_local, tiny_model, tmp_path, moment, seed):
    """Killed after pulling past its newest checkpoint, between two steps or in a weight push (the
    queue already told of the new version, which the restored trainer must never publish again)."""
    from actors.training import start_trainers
    rng, root, marker = random.Random(seed), str(tmp_path / "ck"), tmp_path / "pushing"
    srv, pg, (trainer,) = _running(tiny_model, "q-trainer-kill", seed)
    deadline = time.time() + 300
    if moment == "during a push":                # checkpoints at steps 2, 4, ...; killed in step 3..6's push
        run1 = trainer.run.remote(_loop_pausing_in_a_push, root, 2, rng.randint(3, 6), str(marker))
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
    else:
        run1 = trainer.run.remote(_loop, root, 2)
        kill_at = rng.randint(10, 20)                # delivered: past the step-2 checkpoint
        while srv.queue_stats()["delivered"] < kill_at and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 1.0))
    while time.time() < deadline:            # the trainer has pulled past its newest checkpoint
        latest = Checkpointer(root).latest()
        if latest is not None and len(trained_uids(read_state(latest))) < srv.queue_stats()["delivered"]:
            break
        time.sleep(0.05)
    ray.kill(trainer)                        # the server and the generator keep running
    ray.util.remove_placement_group(pg)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(run1, timeout=60)
    lost_version = srv.queue_stats()["version"]
    ck = read_state(Checkpointer(root).latest())
    assert len(trained_uids(ck)) < srv.queue_stats()["delivered"]   # the dead trainer pulled past it
    assert moment != "during a push" or lost_version > ck["state"]["policy_version"]

    pg, (trainer,) = start_trainers(1, tiny_model, "q-trainer-kill", **TRAIN)
    (version, gen_versions, before), trained, final = ray.get(trainer.run.remote(_resume, root), timeout=600)
    srv.wait(timeout_s=120)
    assert before == trained_uids(ck)
    ck_version = read_state(Checkpointer(root).latest())["state"]["policy_version"]
    assert version == lost_version + 2      # never reused: above the lost ones and a push perhaps unheard of
    assert gen_versions == {version}                                # back on the restored weights
    assert sorted(trained) == list(range(N)) and set(Counter(trained).values()) == {1}
    assert srv.queue_stats()["rolled_back"] > 0
    info = [ray.get(g["actor"].info.remote(), timeout=60) for g in srv.generators.values()]
    assert {i["version"] for i in info} == {final}
    srv.shutdown(remove_queue=True)
    ray.kill(trainer)
    ray.util.remove_placement_group(pg)


# ---- the queue actor killed at a seeded moment: Ray restarts it, server and trainer rejoin ---------

@pytest.mark.parametrize("seed", [1, 5])
def test_queue_actor_killed_is_restored_and_trains_every_prompt_once(ray_local, tiny_model, tmp_path, seed):
    rng = random.Random(seed)
    srv, pg, (trainer,) = _running(tiny_model, "q-queue-kill", seed)
    run = trainer.run.remote(_loop, str(tmp_path / "ck"), 1000)
    kill_at, deadline = rng.randint(4, 24), time.time() + 300
    while srv.queue_stats()["delivered"] < kill_at and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.0))
    before = srv.queue_stats()
    ray.kill(srv.queue.handle, no_restart=False)   # SIGKILL; Ray restarts it with an empty hub
    seen = ray.get(run, timeout=400)
    srv.wait(timeout_s=120)
    trained = [u for u, _ in seen]
    assert sorted(trained) == list(range(N)) and set(Counter(trained).values()) == {1}, Counter(trained)
    assert max(lag for _, lag in seen) <= 1                    # the staleness bound held across the restart
    q = srv.queue_stats()
    assert q["restarted"] and q["awaiting"] == [] and q["delivered"] == N and q["version"] > before["version"]
    info = [ray.get(g["actor"].info.remote(), timeout=60) for g in srv.generators.values()]
    assert {i["version"] for i in info} == {q["version"]}     # generators on the trainer's weights
    srv.shutdown(remove_queue=True)
    ray.kill(trainer)
    ray.util.remove_placement_group(pg)


def _finish_loop(worker, root):
    seen = _loop(worker, root, 1000)
    return seen, worker.finish(wait_s=120)


@pytest.mark.parametrize("seed", [2])
def test_queue_killed_after_the_trainers_finish_the_server_still_sees_the_end(ray_local, tiny_model, tmp_path,
                                                                              seed):
    """The trainer says it is done, then the queue dies with that news: the trainer (still waiting for
    the server side to see it) tells the rebuilt queue again, so wait_trainer_done returns (it timed out)."""
    srv, pg, (trainer,) = _running(tiny_model, "q-after-finish", seed)
    run = trainer.run.remote(_finish_loop, str(tmp_path / "ck"))
    deadline = time.time() + 300
    while not srv.queue_stats()["trainer_done"] and time.time() < deadline:
        time.sleep(0.02)
    assert srv.queue_stats()["trainer_done"], "the trainer did not finish within 300 s"
    ray.kill(srv.queue.handle, no_restart=False)    # SIGKILL; Ray restarts it empty
    while not srv.queue_stats()["restarted"]:        # (a call may still reach the dying actor)
        time.sleep(0.02)
    srv.wait_trainer_done(timeout_s=120)
    seen, confirmed = ray.get(run, timeout=120)
    assert confirmed and sorted(u for u, _ in seen) == list(range(N))
    q = srv.queue_stats()
    assert q["restarted"] and q["trainer_done"] and q["done_seen"], q
    srv.shutdown(remove_queue=True)
    ray.kill(trainer)
    ray.util.remove_placement_group(pg)


# ---- exposure: a local co-located run listens on loopback only ----------------------------------

LISTENERS = """
import os, sys, psutil
from minirl.colocated import WeightManager
wm = WeightManager(sys.argv[1], lr=1e-3, enforce_eager=True, max_model_len=128)
wm.as_vllm().generate(["1+1="], use_tqdm=False)
me = [os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]
print("LISTEN", sorted({c.laddr.ip for c in psutil.net_connections("inet")
                        if c.status == psutil.CONN_LISTEN and c.pid in me}))
wm.close()
"""


def test_local_colocated_run_listens_on_loopback_only(tiny_model):
    from conftest import run_py
    out = run_py(["-c", LISTENERS, tiny_model], timeout=300, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("LISTEN")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    assert set(eval(line[0][len("LISTEN "):])) <= {"127.0.0.1", "::1"}, line   # no "::" / "0.0.0.0"
