"""TrainingActor: one FSDP2 training rank of the async backend (a minirl.async_rl.TrainWorker).

    pg, trainers = start_trainers(2, model, queue_address="rollouts", lr=1e-6)
    ray.get([t.run.remote(my_loop, args) for t in trainers])      # SPMD: my_loop(worker, args)

Ranks find each other through rank 0's address (gloo on CPU, NCCL on GPU, chosen inside the
process from what it really has). Hardware: CPU or one GPU per rank.
"""

from __future__ import annotations

import ray

from actors import placement


@ray.remote(max_restarts=0)
class TrainingActor(placement.RankActor):
    worker = None

    def setup(self, model: str, queue_address: str, kwargs: dict) -> dict:
        from minirl.async_rl import TrainWorker
        self.worker = TrainWorker(model, queue_address, **kwargs)
        return {"rank": self.worker.rank.rank, "device": str(self.worker.device)}

    def run(self, fn, *args):
        """fn(worker, *args) on this rank's TrainWorker (SPMD)."""
        return fn(self.worker, *args)

    def sync_weights(self) -> dict:
        return self.worker.sync_weights()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def start_trainers(num: int, model: str, queue_address: str, *, bundle: dict | None = None,
                   timeout_s: float = 600.0, **kwargs):
    """N training ranks in one placement group, each holding a TrainWorker(model, queue_address,
    **kwargs). Returns (pg, actors)."""
    pg, actors = placement.start_ranks(TrainingActor, num, bundle=bundle, timeout_s=timeout_s)
    ray.get([a.setup.remote(model, queue_address, kwargs) for a in actors], timeout=timeout_s)
    return pg, actors
