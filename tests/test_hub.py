"""Tests for minirl.hub.RolloutHub, the async backend's bookkeeping (plain class, no Ray).

Run: `pytest tests/test_hub.py` (about a second). Hardware: CPU (any).

Covers leasing / putting / taking in FIFO order, requeueing a lost worker's prompts at the
front, recycling stale batches, dropping duplicates, the error messages, failed prompts (stop
or skip, never retried), rollback to a restored trainer, and an exactly-once property:
randomized runs with several workers, worker deaths (with late "zombie" puts from the dead),
random staleness, prompts added while running and trainer crashes resumed from a random
checkpoint must deliver every uid exactly once (to the surviving trainer) and end finished().
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.data import Rollout, RolloutBatch
from minirl.hub import PromptItem, RolloutHub, admission_room


def batch(uid, version=0, g=2) -> RolloutBatch:
    return RolloutBatch([Rollout(prompt_ids=[1, 2], completion_ids=[3], sampling_logprobs=[-0.5],
                                 reward=float(i), uid=uid, policy_version=version)
                         for i in range(g)], uid=uid)


def prompts(uids):
    return [PromptItem(uid=u, prompt=f"p{u}", metadata={"answer": u}) for u in uids]


def uids(xs):
    return [x.uid for x in xs]


def invariant(hub: RolloutHub, added: int):
    s = hub.stats()
    assert s["pending"] + s["leased"] + s["buffered"] + s["delivered"] + s["failed"] == added, s


def test_lease_put_take_fifo():
    hub = RolloutHub(max_batches=4)
    hub.add_prompts(prompts(range(5)))
    a = hub.take_prompts("a", 2)
    b = hub.take_prompts("b", 2)
    assert uids(a) == [0, 1] and uids(b) == [2, 3]
    assert a[0].prompt == "p0" and a[0].metadata == {"answer": 0} and a[0].attempts == 0
    assert hub.stats()["pending"] == 1 and hub.stats()["leased"] == 4
    assert hub.space() == 4
    assert hub.put_batches("b", [batch(3), batch(2)]) == 2
    assert hub.put_batches("a", [batch(0)]) == 1
    assert hub.space() == 1 and hub.stats()["leased"] == 1
    assert hub.take_batches(4) is None                       # only 3 buffered: take nothing
    assert hub.stats()["buffered"] == 3
    assert uids(hub.take_batches(2)) == [3, 2]               # oldest put first
    assert uids(hub.take_batches(1)) == [0]
    assert hub.stats()["delivered"] == 3
    invariant(hub, 5)


def test_take_prompts_empty_and_finished():
    hub = RolloutHub(max_batches=2)
    assert hub.take_prompts("a", 3) == []
    assert not hub.finished()                                # not closed yet
    hub.add_prompts(prompts([7]))
    hub.close_prompts()
    (item,) = hub.take_prompts("a", 3)
    assert not hub.finished()                                # leased
    hub.put_batches("a", [batch(7)])
    assert not hub.finished()                                # buffered
    hub.take_batches(1)
    assert hub.finished()
    with pytest.raises(ValueError, match="closed"):
        hub.add_prompts(prompts([8]))


def test_release_worker_requeues_at_front():
    hub = RolloutHub(max_batches=8)
    hub.add_prompts(prompts(range(6)))
    assert uids(hub.take_prompts("a", 2)) == [0, 1]
    assert uids(hub.take_prompts("b", 2)) == [2, 3]
    assert hub.release_worker("a") == 2
    assert hub.release_worker("a") == 0
    again = hub.take_prompts("c", 3)
    assert uids(again) == [0, 1, 4]                          # front, in lease order, then FIFO
    assert [x.attempts for x in again] == [1, 1, 0]
    # unregister_worker releases too; register of a known id (a restart) starts it clean
    hub.register_worker("b", handle="hb")
    assert hub.workers() == {"b": "hb"}
    assert hub.stats()["leased"] == 3 and uids(hub.take_prompts("b", 1)) == [2]
    assert hub.unregister_worker("c") == 3
    assert uids(hub.take_prompts("d", 10)) == [0, 1, 4, 3, 5]
    assert hub.workers() == {"b": "hb"}
    invariant(hub, 6)


def test_stale_batches_are_recycled_and_delivered_once():
    hub = RolloutHub(max_batches=4)
    hub.add_prompts(prompts([0, 1]))
    hub.close_prompts()
    hub.take_prompts("a", 2)
    hub.put_batches("a", [batch(0, version=0), batch(1, version=3)])
    out = hub.take_batches(1, min_version=2)                 # uid 0 is stale: recycled
    assert uids(out) == [1]
    s = hub.stats()
    assert s["recycled_stale"] == 1 and s["pending"] == 1 and s["buffered"] == 0
    assert hub.take_batches(1, min_version=2) is None
    (item,) = hub.take_prompts("b", 4)
    assert item.uid == 0 and item.attempts == 1
    hub.put_batches("b", [batch(0, version=2)])
    assert uids(hub.take_batches(1, min_version=2)) == [0]
    assert hub.finished() and hub.stats()["delivered"] == 2


def test_stale_check_uses_oldest_rollout_of_the_batch():
    hub = RolloutHub(max_batches=2)
    hub.add_prompts(prompts([0]))
    hub.take_prompts("a", 1)
    b = batch(0, version=5)
    b.rollouts[1].policy_version = 1                         # one old completion makes it stale
    hub.put_batches("a", [b])
    assert hub.take_batches(1, min_version=2) is None
    assert hub.stats()["recycled_stale"] == 1


def test_duplicates_dropped():
    hub = RolloutHub(max_batches=4)
    hub.add_prompts(prompts([0, 1]))
    hub.take_prompts("a", 2)
    assert hub.put_batches("a", [batch(0), batch(0)]) == 1   # second one: already buffered
    assert hub.put_batches("b", [batch(99)]) == 0            # unknown uid
    assert uids(hub.take_batches(1)) == [0]
    assert hub.put_batches("a2", [batch(0)]) == 0            # already delivered
    assert hub.stats()["duplicates"] == 3
    # a dead worker's late batch is accepted if its prompt is still undelivered (first wins)
    hub.release_worker("a")
    assert hub.stats()["pending"] == 1
    assert hub.put_batches("a", [batch(1)]) == 1
    assert hub.stats()["pending"] == 0 and hub.take_prompts("c", 5) == []
    invariant(hub, 2)


def test_errors():
    hub = RolloutHub(max_batches=2, model_id="org/model-a", name="rq")
    hub.add_prompts(prompts([0]))
    with pytest.raises(ValueError, match="duplicate prompt uid 0"):
        hub.add_prompts(prompts([1, 0]))
    assert hub.stats()["pending"] == 1                       # all or nothing: 1 was not added
    with pytest.raises(ValueError, match="duplicate prompt uid 2"):
        hub.add_prompts(prompts([2, 2]))
    with pytest.raises(TypeError, match="PromptItem"):
        hub.add_prompts([{"uid": 3, "prompt": "x"}])
    with pytest.raises(TypeError, match=r"got builtins\.list.*RolloutBatch\(rollouts, uid="):
        hub.put_batches("a", [batch(0).rollouts])
    with pytest.raises(TypeError, match="Rollout"):
        hub.put_batches("a", [batch(0), batch(0).rollouts[0]])
    assert hub.stats()["buffered"] == 0                      # nothing taken from a bad list
    with pytest.raises(ValueError, match="uid is None"):
        hub.put_batches("a", [batch(None)])
    with pytest.raises(ValueError, match="max_batches=2"):
        hub.take_batches(3)
    with pytest.raises(ValueError):
        RolloutHub(max_batches=0)
    hub.check_model("org/model-a")
    hub.check_model(None)
    with pytest.raises(ValueError, match="queue rq serves model org/model-a but this worker was "
                                         "started with model org/model-b"):
        hub.check_model("org/model-b")
    RolloutHub(max_batches=1).check_model("anything")       # unset on the hub: no check


def test_delivered_uid_cannot_be_re_added():
    hub = RolloutHub(max_batches=1)
    hub.add_prompts(prompts([0]))
    hub.take_prompts("a", 1)
    hub.put_batches("a", [batch(0)])
    hub.take_batches(1)
    with pytest.raises(ValueError, match="duplicate prompt uid 0"):
        hub.add_prompts(prompts([0]))


def test_version_and_weights():
    hub = RolloutHub(max_batches=1)
    assert hub.weights() == (0, None)
    hub.set_version(3, weights=["refs"])
    assert hub.weights() == (3, ["refs"])
    assert hub.stats()["version"] == 3
    hub.set_version(4)
    assert hub.weights() == (4, None)


def test_starved_names_the_workers_refused_for_stale_weights_until_served(monkeypatch):
    """starved(for_s): registered workers take_prompts refused (weights too stale) for at least for_s,
    with no version published since and no weights they could load; a lease (or []) for them, a new
    version, or unregistering ends it."""
    import minirl.hub
    now = [100.0]
    monkeypatch.setattr(minirl.hub.time, "monotonic", lambda: now[0])
    hub = RolloutHub(max_batches=4)
    hub.add_prompts(prompts(range(4)))
    hub.set_max_staleness(1)
    hub.set_version(3)
    for w in ("a", "b", "ghost"):
        hub.register_worker(w)
    assert hub.take_prompts("a", 1, version=1) is None and hub.take_prompts("b", 1, version=1) is None
    now[0] += 5.0
    assert hub.take_prompts("a", 1, version=1) is None      # still refused: counted from the first refusal
    assert hub.starved(5.0) == ["a", "b"] and hub.starved(5.5) == []
    hub.unregister_worker("b")
    assert hub.starved(0.0) == ["a"]
    assert uids(hub.take_prompts("a", 1, version=2)) == [0]  # served: no longer starved
    assert hub.starved(0.0) == []
    assert hub.take_prompts("a", 1, version=1) is None
    hub.set_version(4)                                        # a push: refusals count again from the next
    assert hub.starved(0.0) == []
    assert hub.take_prompts("a", 1, version=1) is None and hub.starved(0.0) == ["a"]
    hub.set_version(4, weights=["refs"])                      # published: it loads them itself
    assert hub.take_prompts("a", 1, version=1) is None and hub.starved(0.0) == []


def test_failed_prompt_stops_the_run_with_its_cause():
    hub = RolloutHub(max_batches=4, name="q1")
    hub.add_prompts(prompts(range(3)))
    hub.close_prompts()
    hub.take_prompts("a", 2)
    assert hub.fail_prompts("a", [(1, "ValueError: prompt is longer than max_model_len")]) == 1
    assert hub.put_batches("a", [batch(0)]) == 1
    assert hub.stats()["failed"] == 1 and hub.finished()        # the generators' loops end
    assert hub.take_prompts("b", 5) == []                       # nothing more is leased
    with pytest.raises(RuntimeError, match=r"q1: prompt uid 1 failed on a: ValueError: prompt is longer"
                                           r".*on_failure='skip'"):
        hub.take_batches(1)
    assert hub.failures() == {1: "ValueError: prompt is longer than max_model_len"}


def test_failed_prompt_skipped_and_recorded():
    hub = RolloutHub(max_batches=4, on_failure="skip")
    hub.add_prompts(prompts(range(4)))
    hub.close_prompts()
    hub.take_prompts("a", 4)
    hub.put_batches("a", [batch(0), batch(3)])
    assert hub.fail_prompts("a", [(1, "reward_fn raised KeyError: 'x'"), (0, "late"), (9, "unknown")]) == 1
    hub.fail_prompts("b", [(2, "TimeoutError: reward_fn did not return")])
    assert hub.failures() == {1: "reward_fn raised KeyError: 'x'", 2: "TimeoutError: reward_fn did not return"}
    assert hub.error is None and uids(hub.take_batches(4, partial_at_end=True)) == [0, 3]
    assert hub.finished() and hub.stats()["failed"] == 2
    invariant(hub, 4)
    with pytest.raises(ValueError, match="choose 'stop'"):
        RolloutHub(max_batches=1, on_failure="retry")


def test_failed_prompts_stay_failed_across_a_checkpoint():
    """on_failure="skip": a prompt that failed before the checkpoint is in its snapshot; the resumed
    queue knows it failed (failures()) and does not generate it again when the prompts come back."""
    hub = RolloutHub(max_batches=4, on_failure="skip")
    hub.add_prompts(prompts(range(4)))
    hub.take_prompts("a", 2)
    hub.fail_prompts("a", [(1, "reward_fn raised KeyError")])
    snap = hub.snapshot()
    assert snap["failed"] == {1: "reward_fn raised KeyError"}
    resumed = RolloutHub(max_batches=4, on_failure="skip")
    resumed.restore([], [], snap["failed"])
    assert resumed.add_prompts(prompts(range(4)), skip_known=True) == 3
    assert resumed.failures() == snap["failed"] and 1 not in uids(resumed.take_prompts("a", 4))


def test_rollback_redelivers_what_the_restored_trainer_did_not_train():
    hub = RolloutHub(max_batches=8)
    hub.add_prompts(prompts(range(8)))
    hub.close_prompts()
    hub.take_prompts("a", 6, version=0)
    hub.put_batches("a", [batch(0), batch(1)])
    assert uids(hub.take_batches(2)) == [0, 1]
    hub.set_version(1, weights=["v1"])                          # the trainer checkpoints here: [0, 1], v1
    hub.put_batches("a", [batch(2, 1), batch(3, 1)])
    assert uids(hub.take_batches(2)) == [2, 3]
    hub.set_version(2, weights=["v2"])
    hub.put_batches("a", [batch(4, 2)])                         # weights no restored trainer holds
    hub.set_version(3, weights=["v3"])                          # ... and the trainer dies
    assert hub.rollback([0, 1], 1) == 5            # above every version published and one more (a push unheard of)
    assert hub.weights() == (5, None)                           # the lost trainer's refs are gone
    assert hub.stats()["pending"] == 5 and hub.stats()["rolled_back"] == 3
    assert hub.put_batches("a", [batch(5, 3)]) == 0             # made with lost weights: refused, requeued
    assert hub.take_prompts("a", 1, version=3) is None          # an engine on lost weights must reload
    assert hub.take_prompts("b", 1, version=4) is None          # 4: perhaps pushed by the lost trainer
    assert uids(hub.take_prompts("b", 8, version=5)) == [5, 2, 3, 4, 6, 7]
    hub.put_batches("b", [batch(u, 5) for u in (2, 3, 4, 5, 6, 7)])
    assert sorted(uids(hub.take_batches(6))) == [2, 3, 4, 5, 6, 7]
    assert hub.finished() and hub.stats()["delivered"] == 8


def test_a_batch_with_tokens_of_orphaned_weights_is_refused():
    """A group that started on the checkpoint's version 1 and finished on the lost trainer's 2 (weights
    load between engine steps: info["versions"] spans 1..2) holds tokens no restored trainer made:
    refused and requeued, as one made at 2; one wholly at 1 is kept."""
    hub = RolloutHub(max_batches=4)
    hub.add_prompts(prompts(range(2)))
    hub.take_prompts("a", 2, version=1)
    hub.set_version(2)
    assert hub.rollback([], 1) == 4                             # (1, 3] orphaned: 3 may have been pushed
    spans = batch(0, 1)
    for r in spans:
        r.info["versions"] = (1, 2)
    assert hub.put_batches("a", [spans, batch(1, 1)]) == 1
    assert hub.stats()["pending"] == 1 and hub.stats()["buffered"] == 1


def test_a_rebuilt_queue_learns_the_lost_trainers_versions_from_the_generators():
    """The queue and the trainer die together: the rebuilt hub knows no version, but a generator on
    the lost trainer's version 67 leases (or delivers) before the trainer restored at 65 rolls back:
    66..68 are orphaned (68: a push that may have reached a generator unheard of), the trainer
    publishes 69, and that generator must reload."""
    for report in ("lease", "deliver"):
        hub = RolloutHub(max_batches=4, restarted=True)
        hub.rejoin_server(prompts(range(4)), True, {})
        if report == "lease":
            assert hub.take_prompts("g", 2, version=67) == []      # a rebuilt hub leases nothing yet
        else:
            assert hub.put_batches("g", [batch(9, 67)]) == 0        # unknown uid: dropped, version seen
        assert hub.rollback([], 65) == 69
        assert all(hub.take_prompts("g", 1, version=v) is None for v in (66, 67, 68))
        hub.set_version(69)
        hub.awaiting.clear()
        assert uids(hub.take_prompts("g", 2, version=69)) == [0, 1]


def test_rollback_on_a_fresh_queue_marks_trained_as_delivered():
    hub = RolloutHub(max_batches=2)                             # the queue actor restarted empty
    assert hub.rollback([0, 2], 5) == 5
    assert hub.add_prompts(prompts(range(4)), skip_known=True) == 2
    assert uids(hub.take_prompts("a", 4, version=5)) == [1, 3]
    hub.restore([7], [])
    with pytest.raises(ValueError, match="did not train them"):
        hub.rollback([0, 2], 5)                                 # 7 restored as trained, now unknown


def test_restore_after_the_prompts_were_added_is_refused():
    """restore() after add_prompts (submit, then restore) would issue the checkpoint's trained uids
    again: refused, naming the order, and nothing changes."""
    hub = RolloutHub(max_batches=4)
    hub.add_prompts(prompts(range(4)))
    assert uids(hub.take_prompts("a", 1)) == [0]
    for trained, queued in (([0, 1], []), ([], [(prompts([2])[0], batch(2))])):
        with pytest.raises(ValueError, match=r"added to the queue before restore.*restore the checkpoint first, "
                                             r"then add the prompts with skip_known=True"):
            hub.restore(trained, queued)
    assert hub.stats()["delivered"] == 0 and hub.stats()["buffered"] == 0
    invariant(hub, 4)


# ----------------------------------------------------------------------------------------------
# Exactly-once under random schedules


def simulate(seed: int, n_prompts: int = 40, n_workers: int = 3, max_batches: int = 6,
             step_batches: int = 4, max_lag: int = 1, crashes: bool = False, admission: bool = False) -> RolloutHub:
    rng = random.Random(seed)
    hub = RolloutHub(max_batches=max_batches)
    if admission:                                              # staleness by admission (rules a, b)
        hub.set_max_staleness(max_lag, step_batches)
    all_uids = list(range(n_prompts))
    to_add = list(all_uids)
    added = 0
    # each worker: its in-flight (uid, version it generated with); zombies: dead workers' work
    inflight: dict[str, list] = {f"w{i}": [] for i in range(n_workers)}
    zombies: list = []
    restarts = 0
    delivered = Counter()
    version = 0
    checkpoint = (Counter(), 0)         # (what the trainer had trained, its version) when it saved
    for _ in range(100_000):
        if hub.finished():
            break
        r = rng.random()
        w = rng.choice(list(inflight))
        if r < 0.1 and to_add:                                 # prompts arrive in chunks
            k = rng.randint(1, 10)
            hub.add_prompts(prompts(to_add[:k]))
            added += len(to_add[:k])
            to_add = to_add[k:]
            if not to_add:
                hub.close_prompts()
        elif r < 0.35:                                         # a worker leases prompts
            lag = rng.choice([0, 0, 0, 1, 2])                  # sometimes an old engine
            leased = hub.take_prompts(w, rng.randint(1, 4))
            inflight[w] += [(x.uid, max(0, version - lag)) for x in leased]
        elif r < 0.6 and inflight[w]:                          # a worker finishes some
            done = [inflight[w].pop(rng.randrange(len(inflight[w])))
                    for _ in range(rng.randint(1, len(inflight[w])))]
            if hub.space() >= 1:
                hub.put_batches(w, [batch(u, v) for u, v in done])
            else:
                inflight[w] += done                            # backpressure: retry later
        elif r < 0.65:                                         # a worker dies and restarts
            zombies += inflight[w]
            inflight[w] = []
            if rng.random() < 0.5:
                hub.release_worker(w)
            else:
                hub.register_worker(w)                         # restart with the same id
            restarts += 1
        elif r < 0.7 and zombies:                              # a dead worker's late result
            u, v = zombies.pop(rng.randrange(len(zombies)))
            hub.put_batches("zombie", [batch(u, v)])
        elif crashes and r < 0.72:                             # the trainer dies, resumes from its checkpoint
            delivered = Counter(checkpoint[0])
            version = hub.rollback(list(delivered), checkpoint[1])
            hub.set_version(version)
        elif crashes and r < 0.75:
            checkpoint = (Counter(delivered), version)
        else:                                                  # the trainer steps
            remaining = n_prompts - sum(delivered.values())
            n = max(1, min(step_batches, remaining))
            out = hub.take_batches(n, min_version=max(0, version - max_lag))
            if out is not None:
                assert all(b.policy_version >= version - max_lag for b in out)
                delivered.update(b.uid for b in out)
                version += 1
                hub.set_version(version)
        invariant(hub, added)
    assert hub.finished(), hub.stats()
    assert sorted(delivered) == all_uids
    assert set(delivered.values()) == {1}
    assert hub.stats()["delivered"] == n_prompts
    assert hub.stats()["pending"] == hub.stats()["leased"] == hub.stats()["buffered"] == 0
    return hub


@pytest.mark.parametrize("seed", range(20))
def test_exactly_once_seeded(seed):
    hub = simulate(seed)
    assert hub.stats()["delivered"] == 40


@pytest.mark.parametrize("seed", range(20))
def test_exactly_once_with_trainer_crashes_seeded(seed):
    hub = simulate(seed, crashes=True)
    assert hub.stats()["delivered"] == 40


def test_exactly_once_exercises_every_path():
    totals = Counter()
    for seed in range(20):
        s = simulate(seed, crashes=seed % 2 == 1).stats()
        totals.update({k: s[k] for k in ("recycled_stale", "duplicates", "rolled_back")})
    assert totals["recycled_stale"] > 0 and totals["duplicates"] > 0 and totals["rolled_back"] > 0


@pytest.mark.parametrize("seed", range(20))
def test_exactly_once_with_admission_seeded(seed):
    hub = simulate(seed, crashes=seed % 2 == 1, admission=True)
    assert hub.stats()["delivered"] == 40 and hub.stats()["admission"]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_prompts=st.integers(1, 30), crashes=st.booleans(),
       n_workers=st.integers(1, 4), max_batches=st.integers(1, 5), max_lag=st.integers(0, 2),
       admission=st.booleans())
def test_exactly_once_property(seed, n_prompts, n_workers, max_batches, max_lag, crashes, admission):
    simulate(seed, n_prompts=n_prompts, n_workers=n_workers, max_batches=max_batches,
             step_batches=max_batches, max_lag=max_lag, crashes=crashes, admission=admission)


# ---- a hub rebuilt after its actor died: held until the server and the live trainer rejoin -------

def _rebuilt(trainer_first: bool):
    """The queue had delivered 0-3 (the trainer pulled them), buffered 4 and leased 5 when it died."""
    from minirl.hub import QueueRestarted
    hub = RolloutHub(max_batches=4, restarted=True)
    assert hub.take_prompts("a", 2) == [] and not hub.finished()          # nothing leased, not the end
    for call in (lambda: hub.take_batches(1), hub.set_trainer_done):   # the trainer must rejoin first
        with pytest.raises(QueueRestarted, match="restarted and lost its state: the trainer must rejoin"):
            call()
    server = lambda: hub.rejoin_server(prompts(range(8)), True, {"a": "handle-a"})   # noqa: E731
    trainer = lambda: (hub.set_max_staleness(1, 2), hub.rejoin_trainer([0, 1, 2, 3], 5, ["ref"]))  # noqa: E731
    first, second = (trainer, server) if trainer_first else (server, trainer)
    first()
    assert hub.take_prompts("a", 2) == [] and hub.stats()["awaiting"] == ["server" if trainer_first else "trainer"]
    second()
    return hub


@pytest.mark.parametrize("trainer_first", [True, False])
def test_rebuilt_hub_after_rejoins_delivers_the_untrained_prompts_once(trainer_first):
    hub = _rebuilt(trainer_first)
    s = hub.stats()
    assert s["awaiting"] == [] and s["restarted"] and s["version"] == 5 and s["max_staleness"] == 1
    assert hub.weights() == (5, ["ref"]) and set(hub.workers()) == {"a"}
    got = hub.take_prompts("a", 8, version=5)
    assert uids(got) == [4, 5, 6, 7]                                     # trained ones never again
    assert hub.put_batches("a", [batch(u, version=5) for u in (0, 4, 5, 6, 7)]) == 4   # 0: a late duplicate
    assert uids(hub.take_batches(4)) == [4, 5, 6, 7] and hub.finished()
    assert hub.take_batches(1, partial_at_end=True) == []


def test_rebuilt_hub_drops_a_trained_batch_put_before_the_trainer_rejoins():
    hub = RolloutHub(max_batches=4, restarted=True)
    hub.rejoin_server(prompts(range(3)), True, {})
    assert hub.put_batches("a", [batch(0), batch(2)]) == 2              # a generator's put in flight
    hub.rejoin_trainer([0, 1], 3, None)
    assert uids(hub.take_batches(1)) == [2] and hub.stats()["delivered"] == 3 and hub.finished()


def test_rebuilt_hub_keeps_the_failures_and_the_error_the_server_saw_and_snapshots_after_the_trainer():
    """A failed prompt is never issued again, also after the queue's actor restarted empty (it was leased
    again and left failures()); the run's error survives; a checkpoint's snapshot waits for the trainer's
    rejoin (it held the trainer's trained uids as pending and no failures)."""
    from minirl.hub import QueueRestarted
    hub = RolloutHub(max_batches=4, restarted=True)
    hub.rejoin_server(prompts(range(4)), True, {}, failed={1: "reward_fn raised"})
    with pytest.raises(QueueRestarted):
        hub.snapshot()
    hub.rejoin_trainer([0], 2, None)
    assert hub.snapshot()["failed"] == hub.failures() == {1: "reward_fn raised"}
    assert uids(hub.take_prompts("a", 4, version=2)) == [2, 3]
    stopped = RolloutHub(max_batches=4, restarted=True)
    stopped.rejoin_server(prompts(range(4)), True, {}, error="uid 3 failed")
    assert stopped.finished() and stopped.stats()["error"] == "uid 3 failed"


# ----------------------------------------------------------------------------------------------
# Staleness by admission: a timed simulation of generators and a trainer around one hub


def timed_run(*, admission: bool, S: int, B: int = 4, n_prompts: int = 96, gens: int = 2, slots: int = 6,
              train_s: float = 1.0, load_delay_s: float = 0.3, gen_s=lambda rng: 0.5, seed: int = 0,
              steps_weights=lambda step: True) -> dict:
    """Generators keep `slots` prompts in flight (leasing with their weights' version; a prompt's
    tokens start at the version it starts with, new weights reach a generator load_delay_s after the
    trainer published them, in flight); the trainer takes B batches, trains train_s, publishes.
    Returns every trained batch's lag (trainer version - oldest token version) and the hub's stats.
    steps_weights(k): whether step k changed the weights (else it publishes the same version)."""
    rng = random.Random(seed)
    hub = RolloutHub(max_batches=64, admission=admission)
    hub.set_max_staleness(S, B)
    hub.add_prompts(prompts(range(n_prompts)))
    hub.close_prompts()
    version, busy_until, t, dt = 0, 0.0, 0.0, 0.05
    taken, lags, loads, steps = None, [], [], 0      # loads: (time, version) on the way to the generators
    g = {f"g{i}": {"v": 0, "run": []} for i in range(gens)}   # run: [(finish time, uid, start version)]
    while not hub.finished():
        t += dt
        assert t < 10_000, f"no progress: {hub.stats()}"
        if taken is not None and t >= busy_until:    # a step ends: publish its weights
            steps += 1
            version += bool(steps_weights(steps))
            hub.set_version(version)
            loads.append((t + load_delay_s, version))
            taken = None
        if taken is None:
            taken = hub.take_batches(B, partial_at_end=True)
            if taken is not None:
                lags += [version - b.policy_version for b in taken]
                busy_until = t + train_s
        for w, st in g.items():
            st["v"] = max([st["v"]] + [v for at, v in loads if at <= t])      # in-flight weight update
            done = [x for x in st["run"] if x[0] <= t]
            st["run"] = [x for x in st["run"] if x[0] > t]
            hub.put_batches(w, [batch(u, v) for _, u, v in done])
            got = hub.take_prompts(w, slots - len(st["run"]), version=st["v"]) or []
            st["run"] += [(t + gen_s(rng), it.uid, st["v"]) for it in got]
    return {"lags": lags, **hub.stats()}


def long_tail(rng):                                  # most prompts quick, a few 20x longer
    return 0.2 if rng.random() < 0.85 else 4.0


@pytest.mark.parametrize("S", [0, 1, 2])
@pytest.mark.parametrize("case", ["slow_trainer", "slow_generator"])
def test_staleness_by_admission_keeps_the_bound_and_recycles_nothing(S, case):
    """Every trained token is at most S versions old, nothing is recycled and every prompt trains once;
    the old rule (admission=False) in the same setup recycles (the slow-generator case) or trains older
    tokens. S=0 is exactly on-policy."""
    kw = dict(train_s=3.0, gen_s=lambda rng: 0.2) if case == "slow_trainer" else dict(train_s=0.3, gen_s=long_tail)
    new = timed_run(admission=True, S=S, **kw)
    assert max(new["lags"]) <= S and new["recycled_stale"] == 0, new
    assert new["delivered"] == 96 and len(new["lags"]) == 96                # each trained once
    if S == 0:
        assert set(new["lags"]) == {0}
    old = timed_run(admission=False, S=S, **kw)
    assert max(old["lags"]) <= S and old["delivered"] == 96                   # kept only by recycling
    if case == "slow_generator":
        assert old["recycled_stale"] > 0, old
        assert new["waited_for_old"] > 0 or S == 0                            # it waited instead


@pytest.mark.parametrize("S", [0, 1])
def test_steps_that_change_no_weight_keep_the_run_going(S):
    """Every third step changes no weight (each group filtered out: no optimizer step), so the trainer
    publishes the same version and takes again at it: that take opens a new share of admission (at
    S=0 the old rule leased nothing more: the run stood until the pull timed out), the bound holds."""
    run = timed_run(admission=True, S=S, train_s=0.3, gen_s=lambda rng: 0.2, steps_weights=lambda k: k % 3)
    assert run["delivered"] == 96 and max(run["lags"]) <= S and run["recycled_stale"] == 0, run


def test_admission_counts_by_deadline():
    """Hand-worked: B=2, S=1, trainer at version 0. A worker at version 0 (deadline 1) may lease
    (1 - 0 + 1) * 2 = 4 prompts; a worker lagging by 2 gets None; after one step (version 1, two
    delivered) a worker at version 1 (deadline 2) gets (2 - 1 + 1) * 2 - 2 open (due at 1) = 2."""
    hub = RolloutHub(max_batches=16)
    hub.set_max_staleness(1, 2)
    hub.add_prompts(prompts(range(12)))
    assert uids(hub.take_prompts("a", 10, version=0)) == [0, 1, 2, 3]
    assert hub.take_prompts("a", 10, version=0) == []
    hub.put_batches("a", [batch(3, 0), batch(2, 0)])
    assert [b.uid for b in hub.take_batches(2)] == [2, 3]    # equal deadlines: finished first
    hub.set_version(1)
    assert hub.take_prompts("b", 10, version=-1) is None      # lags 2 > S
    assert uids(hub.take_prompts("b", 10, version=1)) == [4, 5]
    hub.put_batches("b", [batch(u, 1) for u in (4, 5)])
    assert hub.take_batches(2) is None                        # 0 and 1 (due at 1) are still running
    assert hub.stats()["waited_for_old"] == 2
    hub.put_batches("a", [batch(0, 0), batch(1, 0)])
    assert [b.uid for b in hub.take_batches(2)] == [0, 1]
    assert hub.stats()["recycled_stale"] == 0


def test_a_trainer_step_larger_than_the_queue_is_refused_when_it_announces_its_bound():
    """TrainWorker announces its bound before its model loads: a step of more batches than the queue holds
    is refused there (it raised at the first take, after the model loaded)."""
    hub = RolloutHub(max_batches=4)
    with pytest.raises(ValueError, match=r"batch_size=5 must be in \[1, max_batches=4\]: a larger queue"):
        hub.set_max_staleness(1, 5)
    hub.set_max_staleness(1, 4)
    assert hub.stats()["batch_size"] == 4


def test_before_the_trainers_bound_leases_stop_at_what_the_buffer_holds():
    """Before the trainer announced its bound, generators lease no more prompts than the buffer holds:
    a step's batches never wait behind newer ones that filled it (a put that waited for room then would
    deadlock), and none is generated too early to train (an async launch of 3 steps of 8 prompts had
    leased all 24 at version 0 and generated 8 again as too stale)."""
    hub = RolloutHub(max_batches=2)
    hub.add_prompts(prompts(range(4)))
    assert uids(hub.take_prompts("a", 4, version=0)) == [0, 1]              # 2 open: all the buffer holds
    hub.put_batches("a", [batch(1)])
    assert hub.take_prompts("a", 4, version=0) == []                      # 1 open + 1 buffered
    hub.set_max_staleness(0, 2)
    assert hub.take_batches(2) is None and hub.space() >= 1                # waits for 0, whose put has room
    hub.put_batches("a", [batch(0)])
    assert uids(hub.take_batches(2)) == [0, 1] and hub.stats()["recycled_stale"] == 0
    assert uids(hub.take_prompts("a", 4, version=1)) == [2, 3]            # the trainer's bound admits the rest
    old = RolloutHub(max_batches=2, admission=False)                       # the old rule: no cap
    old.add_prompts(prompts(range(4)))
    assert uids(old.take_prompts("a", 4)) == [0, 1, 2, 3]


def test_a_trainer_done_before_the_prompts_ran_out_ends_the_run():
    """A trainer that trained the steps it was asked for (--role trainer --steps K under a server with more
    prompts) ends the run: nothing more is leased and the generators' loops end (the server job waited
    for the rest forever)."""
    hub = RolloutHub(max_batches=4)
    hub.add_prompts(prompts(range(8)))
    hub.close_prompts()
    assert uids(hub.take_prompts("a", 2)) == [0, 1] and not hub.finished()
    hub.set_trainer_done()
    assert hub.finished() and hub.take_prompts("a", 2) == []


def test_the_trainers_end_is_kept_until_the_server_saw_it():
    """finish_trainer's handshake (actors/queue.py): done, then seen; a rebuilt hub knows neither."""
    hub = RolloutHub(max_batches=2)
    assert not hub.see_trainer_done() and not hub.stats()["done_seen"]   # asked early: nothing seen
    hub.set_trainer_done()
    assert hub.stats()["trainer_done"] and not hub.stats()["done_seen"]
    assert hub.see_trainer_done() and hub.stats()["done_seen"]
    rebuilt = RolloutHub(max_batches=2, restarted=True)
    assert not rebuilt.see_trainer_done() and not rebuilt.stats()["done_seen"]


def test_the_server_rejoins_with_its_generators_versions():
    """A rebuilt hub hears the versions the server's generators hold with its state: a trainer restored
    at 65 after generators on the lost trainer's 67 publishes 69, even if no generator leased first."""
    hub = RolloutHub(max_batches=4, restarted=True)
    hub.rejoin_server(prompts(range(4)), True, {"g": None}, versions=[66, 67])
    assert hub.rollback([], 65) == 69


def test_admission_room_by_hand():
    """Rule (a) alone: dues of the open prompts, deadline, version, batch size B, taken, max_batches."""
    assert admission_room([], 0, 0, 2, 0, 4) == 2           # max_staleness 0: one step's B prompts
    assert admission_room([0, 0], 0, 0, 2, 0, 4) == 0       # two open ones fill that step
    assert admission_room([], 0, 0, 2, 2, 4) == 0           # this version's step took its B already
    assert admission_room([], 1, 0, 2, 0, 3) == 3           # two steps' room, capped by max_batches
    assert admission_room([2, 2, 2], 1, 0, 2, 0, 8) == 3    # by t=2: 3 steps x 2 - the 3 due then
