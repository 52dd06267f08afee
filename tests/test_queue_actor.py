"""Tests for actors/queue.py: the rollout queue actor and its client helpers, on a real Ray.

Run: `pytest tests/test_queue_actor.py` (one private local Ray cluster for the module, about
15 s). Hardware: CPU (any; 2 cores is enough).

Covers backpressure (a producer actor blocks on a full queue until the trainer takes),
get / put timeouts that name the queue, staleness set by typed calls, connect_queue failing fast on a wrong name,
create_queue's get-or-create and its refusal of a conflicting config, a run's queue refusing every
call without its token (another job looking it up by name), batches surviving the
death of the actor that produced them, and take_prompts waking on add / close.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from actors.queue import RolloutQueueActor, connect_queue, create_queue  # noqa: E402
from minirl.data import Rollout, RolloutBatch  # noqa: E402
from minirl.hub import PromptItem  # noqa: E402

pytestmark = pytest.mark.slow  # starts a Ray cluster
T = 30  # ray.get timeout for every call in this file

# tests/ is not importable in Ray workers: ship this module's actors and helpers by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


def name() -> str:
    return f"rq-test-{uuid.uuid4().hex[:8]}"


def batch(uid, version=0) -> RolloutBatch:
    return RolloutBatch([Rollout(prompt_ids=[1, 2], completion_ids=[3], sampling_logprobs=[-0.5],
                                 reward=1.0, uid=uid, policy_version=version)], uid=uid)


def get(ref):
    return ray.get(ref, timeout=T)


@ray.remote(num_cpus=0)
class Producer:
    """A generator stand-in: connects by name, leases prompts, puts one batch per call."""

    def __init__(self, queue_name):
        self.q = connect_queue(queue_name, timeout_s=10)

    def produce(self, k, version=0):
        items = ray.get(self.q.take_prompts.remote("producer", k, timeout_s=5), timeout=T)
        for it in items:       # one put per batch: each waits for a free slot
            ray.get(self.q.put.remote("producer", [batch(it.uid, version)], timeout_s=20),
                    timeout=T)
        return [it.uid for it in items]


def test_before_a_trainer_bound_a_producer_leases_only_what_the_buffer_holds():
    """No trainer has set its staleness bound yet: a generator asking for 4 prompts gets the 2 the
    buffer holds (it leased all 4, and the last ones trained stale or blocked its put), the rest after
    the consumer took those."""
    qn = name()
    q = create_queue(qn, max_batches=2, detached=False)
    get(q.add_prompts.remote([PromptItem(uid=i, prompt=[i]) for i in range(4)]))
    p = Producer.remote(qn)
    assert get(p.produce.remote(4)) == [0, 1]
    s = get(q.stats.remote())
    assert s["buffered"] == 2 == s["max_batches"] and s["leased"] == 0 and s["pending"] == 2
    assert get(p.produce.remote(4)) == []                                   # full: nothing more leased
    assert [b.uid for b in get(q.get.remote(2, timeout_s=10))] == [0, 1]
    assert get(p.produce.remote(4)) == [2, 3]
    assert [b.uid for b in get(q.get.remote(2, timeout_s=10))] == [2, 3]
    ray.kill(p)
    ray.kill(q)


def test_put_timeout_when_full():
    qn = name()
    q = create_queue(qn, max_batches=1, detached=False)
    get(q.add_prompts.remote([PromptItem(uid=i, prompt="x") for i in range(2)]))
    get(q.take_prompts.remote("w", 2))
    assert get(q.put.remote("w", [batch(0)], timeout_s=1)) == 1
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"rollout queue {qn} stayed full for 0.5 s"):
        get(q.put.remote("w", [batch(1)], timeout_s=0.5))
    assert time.monotonic() - t0 < 10
    ray.kill(q)


class _OneGroup:
    """A Generator stand-in for GenerationActor.run: its serve delivers one finished group."""
    policy_version, stats = 0, {}

    def serve(self, lease, deliver, **kw):
        deliver([batch(1)], [])


def test_a_generators_put_to_a_full_queue_fails_with_the_queues_reason():
    """The queue's own TimeoutError (stayed full: is the trainer running?), not the generator's call
    timing out at the same moment as if the queue did not answer."""
    import threading
    from actors.generation import GenerationActor
    qn = name()
    q = create_queue(qn, max_batches=1, detached=False)
    get(q.add_prompts.remote([PromptItem(uid=i, prompt="x") for i in range(2)]))
    get(q.take_prompts.remote("w", 2))
    get(q.put.remote("w", [batch(0)]))
    gen = object.__new__(GenerationActor.__ray_metadata__.modified_class)     # no engine: _OneGroup
    gen.worker_id, gen.timeout, gen.queue, gen.gen, gen._stop = "w", 1.0, q, _OneGroup(), threading.Event()
    with pytest.raises(TimeoutError, match=f"rollout queue {qn} stayed full for 1.0 s"):
        gen.run(1)
    ray.kill(q)


def test_a_stop_that_lands_before_its_run_still_drains_it():
    """remove_generator's stop and the pool's run are sent from two threads to an actor that runs
    calls concurrently: a stop that arrives first must still end the run (it waited its whole timeout)."""
    import threading
    from actors.generation import GenerationActor
    seen = []

    class Gen(_OneGroup):
        def serve(self, lease, deliver, stop, **kw):
            seen.append(stop.is_set())
    gen = object.__new__(GenerationActor.__ray_metadata__.modified_class)     # no engine, no queue
    gen.worker_id, gen.timeout, gen.queue, gen.gen, gen._stop = "w", 1.0, None, Gen(), threading.Event()
    gen.stop()
    gen.run(1)
    assert seen == [True]


def test_a_run_stopped_by_the_generation_side_wakes_a_waiting_get_with_its_cause():
    """The server's pool failed (its last generator lost, say): the trainer's get, waiting for batches,
    raises that cause at once (it waited its whole timeout, then asked whether generators run)."""
    import types

    from actors.server import RolloutServer
    q = create_queue(name(), max_batches=4)
    waiting = q.get.remote(2, 20.0)
    fails = types.SimpleNamespace(watch=lambda *a: (_ for _ in ()).throw(RuntimeError("no generator is left")))
    srv = types.SimpleNamespace(pool=fails, queue=q, _rejoin=None, _error=None,
                                _q=lambda method, *args: get(method.remote(*args)))
    t = time.monotonic()
    RolloutServer._watch(srv, None)
    with pytest.raises(ray.exceptions.RayTaskError, match="the generation side stopped: no generator is left"):
        get(waiting)
    assert time.monotonic() - t < 10 and isinstance(srv._error, RuntimeError)
    assert get(q.finished.remote())
    ray.kill(q)


def test_get_timeout_names_the_queue():
    qn = name()
    q = create_queue(qn, max_batches=4, detached=False)
    t0 = time.monotonic()
    get(q.set_version.remote(2))
    get(q.set_max_staleness.remote(0))
    with pytest.raises(TimeoutError) as ei:
        get(q.get.remote(3, timeout_s=0.5))
    msg = str(ei.value)
    assert qn in msg and "no 3 batches due" in msg and "'version': 2" in msg and "'buffered': 0" in msg
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="max_batches=4"):     # can never be satisfied
        get(q.get.remote(5, timeout_s=0.5))
    ray.kill(q)


def test_get_recycles_stale_and_waits_for_fresh():
    qn = name()
    q = create_queue(qn, max_batches=4, detached=False)
    get(q.add_prompts.remote([PromptItem(uid="a", prompt="x")]))
    get(q.take_prompts.remote("w", 1))
    get(q.put.remote("w", [batch("a", version=0)]))
    get(q.set_version.remote(1))
    get(q.set_max_staleness.remote(0))
    waiting = q.get.remote(1, timeout_s=20)                     # blocks: the only batch is stale
    items = get(q.take_prompts.remote("w", 1, timeout_s=10))  # recycled prompt comes back
    assert [(it.uid, it.attempts) for it in items] == [("a", 1)]
    get(q.put.remote("w", [batch("a", version=1)]))
    assert [b.uid for b in get(waiting)] == ["a"]
    s = get(q.stats.remote())
    assert s["recycled_stale"] == 1 and s["delivered"] == 1
    ray.kill(q)


def test_get_returns_none_once_a_generator_is_starved_for_weights():
    """get(..., starved_s): no batch, and a registered generator refused work for its stale weights
    that long (nothing published it could load): None, for the trainer to push; without starved_s
    the same get waits on to its timeout."""
    qn = name()
    q = create_queue(qn, max_batches=4, detached=False)
    get(q.add_prompts.remote([PromptItem(uid="a", prompt="x")]))
    get(q.set_max_staleness.remote(0))
    get(q.set_version.remote(2))
    get(q.register_worker.remote("w"))
    waiting = q.get.remote(1, 20.0, True, 1.0)
    t0 = time.monotonic()
    assert get(q.take_prompts.remote("w", 1, 1)) is None          # version 1 lags 2 by more than 0
    assert get(waiting) is None and 0.9 < time.monotonic() - t0 < 5
    with pytest.raises(TimeoutError, match="no 1 batches due within 0.5 s"):
        get(q.get.remote(1, 0.5))
    ray.kill(q)


def test_connect_queue_wrong_name_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(LookupError, match="no rollout queue named nope-.* in namespace minirl: "
                                          "start the RolloutServer first"):
        connect_queue(f"nope-{uuid.uuid4().hex[:6]}", timeout_s=1)
    assert time.monotonic() - t0 < 5


def test_create_queue_get_or_create_and_conflicts():
    qn = name()
    q1 = create_queue(qn, max_batches=3, model_id="org/a")
    q2 = create_queue(qn, max_batches=3, model_id="org/a")
    assert q1._actor_id == q2._actor_id
    q3 = connect_queue(qn, model_id="org/a")
    assert q3._actor_id == q1._actor_id
    with pytest.raises(ValueError, match="max_batches=3, not 5"):
        create_queue(qn, max_batches=5)
    with pytest.raises(ValueError, match="serves model org/a but this worker was started with model org/b"):
        create_queue(qn, max_batches=3, model_id="org/b")
    with pytest.raises(ValueError, match=f"queue {qn} serves model org/a but this worker was "
                                         "started with model org/b"):
        connect_queue(qn, model_id="org/b")
    with pytest.raises(LookupError):                          # namespaces are separate
        connect_queue(qn, namespace="other", timeout_s=0.3)
    ray.kill(q1)


def test_queue_of_a_run_refuses_callers_without_its_token():
    qn = name()
    q = create_queue(qn, max_batches=2, token="run-a-secret")
    get(q.add_prompts.remote([PromptItem(uid=0, prompt="p0")]))
    raw = ray.get_actor(qn, namespace="minirl")              # what any job on the cluster can look up
    for ref in (raw.put.remote("w", [batch(0)]), raw.take_prompts.remote("w", 1), raw.weights.remote(),
                raw.set_version.remote(5, None), raw.get.remote(1, 0.1), raw.stats.remote()):
        with pytest.raises(PermissionError, match=rf"rollout queue {qn} belongs to another run \(no token given\)"
                                                  ": pass the token of the run that created it"):
            get(ref)
    with pytest.raises(PermissionError, match="a wrong token given"):
        connect_queue(qn, token="run-b")
    with pytest.raises(PermissionError, match=f"rollout queue {qn} belongs to another run"):
        create_queue(qn, max_batches=2, token="run-b")       # a second run naming the same queue
    s = get(q.stats.remote())
    assert (s["pending"], s["leased"], s["buffered"], s["version"]) == (1, 0, 0, 0)   # nothing got in
    mine = connect_queue(qn)                                  # this process created it: it knows the token
    assert [it.uid for it in get(mine.take_prompts.remote("w", 1))] == [0]
    ray.kill(q.handle)


def test_batches_survive_producer_death():
    qn = name()
    q = create_queue(qn, max_batches=4, detached=False)
    get(q.add_prompts.remote([PromptItem(uid=i, prompt="x") for i in range(3)]))
    p = Producer.remote(qn)
    assert get(p.produce.remote(3, version=7)) == [0, 1, 2]
    ray.kill(p)
    with pytest.raises(ray.exceptions.RayActorError):
        get(p.produce.remote(1))
    out = get(q.get.remote(3, timeout_s=5))
    assert [b.uid for b in out] == [0, 1, 2]
    assert all(isinstance(b, RolloutBatch) and b.policy_version == 7 for b in out)
    assert out[0].rollouts[0].sampling_logprobs == [-0.5]
    ray.kill(q)


def test_take_prompts_wakes_on_add_and_returns_empty_after_close():
    qn = name()
    q = create_queue(qn, max_batches=2, detached=False)
    assert get(q.take_prompts.remote("w", 2)) == []              # timeout_s=0: poll
    waiting = q.take_prompts.remote("w", 2, timeout_s=20)
    time.sleep(0.3)
    get(q.add_prompts.remote([PromptItem(uid=0, prompt="x")]))
    assert [it.uid for it in get(waiting)] == [0]
    get(q.close_prompts.remote())
    t0 = time.monotonic()
    assert get(q.take_prompts.remote("v", 2, timeout_s=0.5)) == []   # 0 is leased: not finished
    assert time.monotonic() - t0 >= 0.4
    waiting = q.take_prompts.remote("v", 2, timeout_s=20)
    get(q.put.remote("w", [batch(0)]))
    get(q.get.remote(1, timeout_s=5))
    t0 = time.monotonic()
    assert get(waiting) == []                                      # woken by finished
    assert get(q.take_prompts.remote("v", 2, timeout_s=20)) == []  # at once
    assert time.monotonic() - t0 < 5
    assert get(q.finished.remote())
    ray.kill(q)


def test_workers_versions_and_type_errors():
    qn = name()
    q = create_queue(qn, max_batches=2, detached=False)
    get(q.add_prompts.remote([PromptItem(uid=i, prompt="x") for i in range(3)]))
    get(q.register_worker.remote("g0"))
    assert get(q.take_prompts.remote("g0", 2))
    assert get(q.workers.remote()) == {"g0": None}
    assert get(q.unregister_worker.remote("g0")) == 2
    assert get(q.stats.remote())["pending"] == 3
    ref = ray.put({"w": 1})
    get(q.set_version.remote(4, [[ref]]))                       # refs wrapped: passed through
    v, w = get(q.weights.remote())
    assert v == 4 and get(w[0][0]) == {"w": 1}
    with pytest.raises(TypeError, match="RolloutBatch"):
        get(q.put.remote("g0", [{"uid": 0}]))
    assert get(q.stats.remote())["buffered"] == 0
    ray.kill(q)


def test_actor_class_is_cpu_free():
    assert RolloutQueueActor._default_options.get("num_cpus") == 0


@ray.remote(num_cpus=0)
class _AwaitingServer:
    """A rebuilt queue as the pool sees it: awaiting the server until it rejoins, then finished."""

    def __init__(self):
        self.joined = False

    def stats(self):
        return {"awaiting": [] if self.joined else ["server"], "finished": self.joined, "failed": 0, "error": None}

    def rejoin(self):
        self.joined = True


@pytest.mark.parametrize("fault, survives", [(ray.exceptions.RaySystemError("an argument was lost"), True),
                                             (ValueError("duplicate prompt uid 3"), False)])
def test_the_pool_makes_a_rejoin_that_ray_failed_again(fault, survives):
    """A rejoin Ray failed (the queue died again, an argument it could not read) is made again on the
    watch's next turn; a fault of the rejoin's content ends the watch with it."""
    from actors.pool import GeneratorPool
    q, calls = _AwaitingServer.remote(), []
    pool = GeneratorPool("model", q, "q-rejoin", "minirl", {}, resources={"CPU": 1}, call_timeout_s=T)

    def rejoin(generators):
        calls.append(generators)
        if len(calls) == 1:
            raise fault
        ray.get(q.rejoin.remote(), timeout=T)
    if survives:
        pool.watch(timeout_s=T, rejoin=rejoin)
        assert len(calls) == 2 and ray.get(q.stats.remote(), timeout=T)["finished"]
    else:
        with pytest.raises(ValueError, match="duplicate"):
            pool.watch(timeout_s=T, rejoin=rejoin)
    ray.kill(q)


@ray.remote(num_cpus=0)
class _Unstartable:
    def __init__(self):
        raise ValueError("no_such_engine_arg")

    def info(self):
        return {}


def test_the_pool_removes_a_generator_whose_start_failed():
    """A generator added without waiting (as an autoscaled one is) whose start failed is removed with its
    placement group and the cause counted, not marked ready and run again every second; with no
    generator left, the watch stops with the cause."""
    from ray.util.placement_group import placement_group_table

    from actors import placement
    from actors.pool import GeneratorPool
    q = _AwaitingServer.remote()                      # never finished: only the failure ends the watch
    pool = GeneratorPool("model", q, "q-unstartable", "minirl", {}, resources={"CPU": 1}, call_timeout_s=T)
    pg = placement.create([{"CPU": 0.01}], strategy="STRICT_PACK", name="q-unstartable-gen-x")
    actor = _Unstartable.remote()
    pool.generators["gen-x"] = {"actor": actor, "pg": pg, "ready": False, "run": None,
                                "info": actor.info.remote(), "retry_at": 0.0}
    with pytest.raises(RuntimeError, match="generator gen-x failed to start: .*no_such_engine_arg.*no generator is left"):
        pool.watch(timeout_s=T)
    assert pool.stats["failed_starts"] == 1 and pool.stats["lost_runs"] == 0 and not pool.generators
    assert placement_group_table()[pg.id.hex()]["state"] == "REMOVED"
    ray.kill(q)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class _Flaky:
    """Called slowly, it dies; restarted, its start fails (as a generator's engine out of memory)."""

    def __init__(self):
        if ray.get_runtime_context().was_current_actor_reconstructed:
            raise RuntimeError("CUDA out of memory rebuilding the engine")

    def slow(self, s):
        time.sleep(s)
        os._exit(1)

    def run(self, k):
        os._exit(1)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class _DiesOnce:
    def slow(self, s):
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            time.sleep(s)
            os._exit(1)
        return "restarted"


@ray.remote(num_cpus=0)
class _Queue:
    def stats(self):
        return {"awaiting": [], "finished": False, "failed": 0, "error": None}

    def release_worker(self, wid):
        return 0

    def unregister_worker(self, wid):
        return 0


def test_a_call_that_waited_long_is_made_again_on_the_restarted_actor():
    """placement.call's restart window counts from the actor's death, not from the call: a trainer's
    get that waited longer than restart_s when the queue died lands on the restarted queue."""
    from actors import placement
    actor = _DiesOnce.remote()
    assert placement.call(actor.slow, 3, timeout_s=T, what="queue", restart_s=1.5) == "restarted"
    ray.kill(actor)


def test_the_pool_removes_a_generator_whose_restart_failed():
    """A generator that died and whose restart failed in its start is removed (cause counted, placement
    group freed, gone from the queue), not run again every second until the server's timeout."""
    from actors import placement
    from actors.pool import GeneratorPool
    q = _Queue.remote()
    pool = GeneratorPool("model", q, "q-flaky", "minirl", {}, resources={"CPU": 1}, call_timeout_s=T)
    pg = placement.create([{"CPU": 0.01}], strategy="STRICT_PACK", name="q-flaky-gen-x")
    pool.generators["gen-x"] = {"actor": _Flaky.remote(), "pg": pg, "ready": True, "run": None, "info": None,
                                "retry_at": 0.0}
    with pytest.raises(RuntimeError, match="generator gen-x failed to restart: .*out of memory.*no generator is left"):
        pool.watch(timeout_s=T)
    assert pool.stats["failed_starts"] == 1 and not pool.generators
    ray.kill(q)


@ray.remote(num_cpus=0)
class _Mismatched:
    def run(self, k):        # loading the latest weights, their probe did not match the trainer's
        from minirl.weights import SyncError
        raise SyncError("generator gen-x (loading the latest weights): probe gap 0.4 > 0.01")


def test_a_generator_whose_weights_fail_their_check_stops_the_run():
    """A generator's weights failing their check while it runs (a load from the object store) stop the
    run, as a push's do, naming the check: run again it would lease on those weights."""
    from actors.pool import GeneratorPool
    q = _Queue.remote()
    pool = GeneratorPool("model", q, "q-mismatch", "minirl", {}, resources={"CPU": 1}, call_timeout_s=T)
    pool.generators["gen-x"] = {"actor": _Mismatched.remote(), "pg": None, "ready": True, "run": None,
                                "info": None, "retry_at": 0.0}
    with pytest.raises(RuntimeError, match=r"generator gen-x: .*probe gap 0.4"):
        pool.watch(timeout_s=T)
    assert pool.stats["failures"] == 1
    ray.kill(q)


def test_a_replica_added_that_is_not_placed_in_time_is_removed():
    """add(wait=True) past its ready timeout (no node has the resources) raises and leaves nothing that
    would start later: no replica in the pool, its placement group removed."""
    from ray.util.placement_group import placement_group_table

    from actors.pool import GeneratorPool
    pool = GeneratorPool("model", None, "q-unplaced", "minirl", {}, resources={"CPU": 64}, call_timeout_s=T,
                         ready_timeout_s=1.0)
    for resources in (None, {"GPU": 1}):     # a GPU-only bundle (here never placed): the actor asks no CPU of it
        before = set(placement_group_table())
        with pytest.raises(TimeoutError, match="still PENDING after 1.0 s"):
            pool.add(resources)
        groups = {k: v["state"] for k, v in placement_group_table().items() if k not in before}
        assert not pool.generators and list(groups.values()) == ["REMOVED"]


def test_a_take_made_again_with_its_call_id_gets_the_same_answer():
    """Ray may report a live actor unavailable after the call ran (placement.call then makes it again):
    add_prompts, take_prompts and get with the call's id answer it as the first time, with no second lease or
    take, also while the first still waits; a new id leases and takes anew."""
    n = name()
    q = create_queue(n, max_batches=8)
    items = [PromptItem(uid=u, prompt="p") for u in range(6)]
    assert get(q.add_prompts.remote(items, call="add-1")) == get(q.add_prompts.remote(items, call="add-1")) == 6
    with pytest.raises(ray.exceptions.RayTaskError, match="duplicate prompt uid 0"):    # a new call: refused
        get(q.add_prompts.remote(items, call="add-2"))
    first = get(q.take_prompts.remote("g", 2, call="lease-1"))
    assert [it.uid for it in get(q.take_prompts.remote("g", 2, call="lease-1"))] == [it.uid for it in first] == [0, 1]
    assert [it.uid for it in get(q.take_prompts.remote("g", 2, call="lease-2"))] == [2, 3]
    waiting = q.get.remote(2, 20.0, call="take-1")                # waits: nothing buffered yet
    again = q.get.remote(2, 20.0, call="take-1")                  # made again while the first waits
    get(q.put.remote("g", [batch(0), batch(1)]))
    assert [b.uid for b in get(waiting)] == [b.uid for b in get(again)] == [0, 1]
    assert get(q.stats.remote())["delivered"] == 2 and get(q.stats.remote())["leased"] == 2
    ray.kill(q)
