"""The training side of the async backend: TrainWorker (a minirl Trainer fed by the rollout
queue, pushing weights to the generators) and TrainingActor, one rank of it on Ray.

    worker = TrainWorker(model, "rollouts", config=TrainerConfig(lr=1e-6), max_staleness=1)
    for batches in worker.pull_rollouts():          # every token >= version - max_staleness (RolloutHub)
        ...worker.trainer.forward_backward(...) / optim_step(), or worker.model / worker.optimizer...
        worker.sync_weights()                       # publish a version, push it, verify it arrived
    worker.finish()                                 # the run's end: waits until the server side saw it
    pg, trainers = start_trainers(2, model, "rollouts", lr=1e-6)   # SPMD: run(fn) on every rank

Rank 0 pulls each step's batches and shares them, split by tokens; if the queue restarted, it rejoins
it first (what it pulled, its version, weights). Weights go through the object store or a collective
group (actors/weights.py), verified unless verify_sync=False. Hardware: CPU or one GPU per rank.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace

import ray

from actors import placement, tokens
from actors.queue import DEFAULT_NAMESPACE, connect_queue
from actors.weights import WeightPusher
from minirl.checkpoint import trained_uids
from minirl.data import RolloutBatch, split_by_tokens
from minirl.distributed import on_rank0
from minirl.hub import QueueRestarted
from minirl.model import check_model_path, model_identity
from minirl.trainer import Trainer, TrainerConfig
from minirl.weights import check_tolerance


STARVED_S = 10.0
"""While the trainer waits for a batch, a generator the queue has refused work this long for its stale
weights, with none published for it to load (the collective transport publishes none), gets the trainer's
weights pushed again: a lone generator restarted under it would wait for a push that waits for its batches."""


class TrainWorker:
    """TrainWorker(model, queue_address, lr=..., config=TrainerConfig(...), max_staleness=1, batch_size=8,
    transport="object_store" | "collective"). Under torchrun (or several Ray actors) every rank makes one."""

    def __init__(self, model: str, queue_address: str = "minirl-rollouts", *, lr: float | None = None,
                 config: TrainerConfig | None = None, max_staleness: int = 1, batch_size: int = 8,
                 transport: str = "object_store", verify_sync: bool = True, probe_tolerance: float | None = None,
                 namespace: str = DEFAULT_NAMESPACE, pull_timeout_s: float = 600.0, sync_timeout_s: float = 600.0,
                 queue_token: str | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        check_tolerance(probe_tolerance)
        placement.ray_init(namespace)
        self.queue = connect_queue(queue_address, namespace=namespace, token=queue_token,   # actors/tokens.py
                                   model_id=model_identity(check_model_path(model)))
        self.max_staleness, self.batch_size = max_staleness, batch_size
        self.pull_timeout, self.timeout = pull_timeout_s, sync_timeout_s
        self._step_prompts = batch_size * int(os.environ.get("WORLD_SIZE", 1))  # the queue admits work by it
        if int(os.environ.get("RANK", 0)) == 0:     # before the model loads: generation overlaps it, admitted
            self._announce_bound()
        self.trainer = Trainer(model, replace(config or TrainerConfig(), **({} if lr is None else {"lr": lr})))
        self.rank, self.device = self.trainer.rank, self.trainer.device
        self.trainer.policy_version = self._q(self.queue.stats)["version"]
        self.pusher = WeightPusher(self.trainer, self.queue, transport, verify=verify_sync, timeout_s=sync_timeout_s,
                                   tolerance=probe_tolerance)
        self.trained_uids, self.timings = [], {}     # trained_uids: every prompt pulled (once), in order

    model, optimizer = property(lambda self: self.trainer.model), property(lambda self: self.trainer.optimizer)
    policy_version = property(lambda self: self.trainer.policy_version)

    def pull_rollouts(self, batch_size: int | None = None):
        """Yield this rank's share (split by tokens) of each `batch_size` x world RolloutBatches,
        until the queue is finished (the last pull may hold fewer). Tensors on this rank's device."""
        n, world = batch_size or self.batch_size, self.rank.world_size
        while True:
            deadline = time.monotonic() + self.pull_timeout
            while (got := on_rank0(lambda: self._pull(n * world, deadline), self.rank, "pull rollouts")) is None:
                self.sync_weights()     # a generator waits for weights no published ones serve: push again
            if not got:
                return
            self.trained_uids += [b.uid for b in got if b.uid is not None]
            got += [RolloutBatch([r.as_padding() for r in got[0]])] * max(0, world - len(got))
            mine = split_by_tokens(got, world)[self.rank.rank]
            yield [RolloutBatch([r.to(self.device) for r in b], uid=b.uid) for b in mine]

    def _pull(self, n: int, deadline: float) -> list | None:
        """Rank 0: the queue's next n batches, waiting until `deadline` (time.monotonic); None when a
        generator was refused work STARVED_S for its stale weights meanwhile."""
        t = max(0.0, deadline - time.monotonic())
        return self._q(self.queue.get, n, t, starved_s=STARVED_S, wait_s=t, call=uuid.uuid4().hex)   # made again:
        # the same batches (RolloutQueueActor._once)

    def _announce_bound(self) -> None:
        """The one writer of the queue's staleness bound (RolloutHub's admission): this trainer's
        max_staleness and prompts per step, at its start and again to a restarted queue."""
        self._q(self.queue.set_max_staleness, self.max_staleness, self._step_prompts)

    def _q(self, method, *args, wait_s: float = 0.0, **kwargs):
        """A queue call, made again across a restart of the queue's actor; if the restarted queue waits
        for this trainer (QueueRestarted), it first rejoins with its bound, what it pulled, its version
        and weights."""
        try:
            return placement.call(method, *args, timeout_s=wait_s + self.timeout, what="rollout queue", **kwargs)
        except QueueRestarted:
            self._announce_bound()
            self._q(self.queue.rejoin_trainer, self.trained_uids, self.policy_version, self.pusher.published)
            return self._q(method, *args, wait_s=wait_s, **kwargs)

    def sync_weights(self) -> dict:
        """Publish the trainer's weights as a version and push them to every generator; with
        verification, raise SyncError unless each generator's probe log-probs match. Collective."""
        t0 = time.perf_counter()
        self.timings = {**self.pusher.push(), "sync_s": time.perf_counter() - t0}
        return self.timings

    def save_checkpoint(self, ckpt, step: int, *, state: dict | None = None, export_hf: bool = False):
        """Trainer state, the prompts trained so far and what the queue holds. Call right after
        sync_weights() at the end of a step. Collective."""
        queue = on_rank0(lambda: self._q(self.queue.snapshot), self.rank, "snapshot the queue", share=False) or {}
        objects = {"queue": queue, "trained_uids": list(self.trained_uids)}     # uids as they are (a tuple stays one)
        return self.trainer.save_checkpoint(ckpt, step, state=state, objects=objects, export_hf=export_hf)

    def load_checkpoint(self, ckpt, path=None) -> dict:
        """Restore the trainer and its trained prompts; the queue rolls back to them (RolloutHub.rollback),
        the restored weights replace every generator's. Running or fresh (restored) queue. Collective."""
        out = self.trainer.load_checkpoint(ckpt, path)
        self.trained_uids = trained_uids(out)
        self.trainer.policy_version = on_rank0(
            lambda: self._q(self.queue.rollback, self.trained_uids, self.policy_version), self.rank,
            "roll the queue back")
        self.pusher.forget_checksums()   # of versions another trainer made, or its own pre-restore weights
        self.sync_weights()
        return out

    def finish(self, wait_s: float | None = None) -> bool:
        """Tell the server side the trainer trained and synced its last batch, and wait (up to wait_s,
        default the sync timeout; 0: no wait) until it saw so (its wait_trainer_done): a queue restarted
        meanwhile is told again. Whether it was seen (rank 0; True elsewhere)."""
        t = self.timeout if wait_s is None else wait_s
        return self.rank.rank != 0 or self._q(self.queue.finish_trainer, t, wait_s=t)

    def queue_stats(self) -> dict:    # recycled_stale, waited_for_old, ... (RolloutHub.stats)
        return self._q(self.queue.stats)

    def close(self) -> None:
        self.pusher.close()
        self.trainer.close()


@ray.remote(max_restarts=0)
class TrainingActor(placement.RankActor):
    worker = None

    def setup(self, model: str, queue_address: str, kwargs: dict) -> dict:
        self.worker = TrainWorker(model, queue_address, **kwargs)
        return {"rank": self.worker.rank.rank, "device": str(self.worker.device)}

    def run(self, fn, *args):
        """fn(worker, *args) on this rank's TrainWorker (SPMD)."""
        return fn(self.worker, *args)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def start_trainers(num: int, model: str, queue_address: str, *, bundle: dict | None = None,
                   timeout_s: float = 600.0, **kwargs):
    """(pg, actors): N training ranks in one placement group, each a TrainWorker(model, queue_address, **kw)
    (a rank's error is raised once the ranks and their group are gone)."""
    kwargs.setdefault("queue_token", tokens.known(kwargs.get("namespace", DEFAULT_NAMESPACE), queue_address))
    return placement.start_ranks(TrainingActor, num, bundle=bundle, timeout_s=timeout_s,
                                 setup=lambda a: a.setup.remote(model, queue_address, kwargs))
