"""RolloutServer: the generation side of the async backend: the named rollout queue, its
prompts, and a GeneratorPool (actors/pool.py) of vLLM actors that feed it.

    server = RolloutServer(model, "rollouts", reward_fn=fn, num_generators=2, group_size=8)
    server.submit(prompts, metadata=answers)
    server.run()                     # returns once the trainer has taken every prompt
    server.wait_trainer_done()       # ... and once it has trained and synced the last of them

Bad settings are refused before any engine starts. A failed request is never retried:
on_failure="stop" (default) ends the run with its cause (the trainer's pull and wait() raise it),
"skip" records it (failures()). The pool grows and shrinks at run time (add_generator,
remove_generator). If the queue's actor dies, Ray restarts it, the server sends its prompts and
generators again, the trainer what it trained: each prompt trains once. Hardware: CPU or GPUs."""

from __future__ import annotations

import contextlib
import threading
import uuid

import ray

from actors import placement, tokens
from actors.pool import GeneratorPool
from actors.queue import DEFAULT_NAMESPACE, create_queue


class RolloutServer:
    """RolloutServer(model, queue_address, reward_fn=... or episode=..., num_generators, group_size,
    sampling, ...): reward_fn follows parse_vllm_outputs' contract (each call bounded by reward_timeout_s);
    `episode` (an async episode of minirl.episodes, under `episode_config`) replaces reward_fn's one-turn
    episode; `sampling`: SamplingParams kwargs; llm_kwargs: each vllm.LLM's; `resources`: one replica's bundle
    (default {"CPU": 1, "GPU": 1} on GPUs); `token`: the run's, the queue refuses others (actors/tokens.py)."""

    def __init__(self, model: str, queue_address: str = "minirl-rollouts", *, reward_fn=None,
                 num_generators: int = 1, group_size: int = 8, sampling: dict | None = None,
                 queue_size: int = 64, prompts_per_call: int = 8, resources: dict | None = None,
                 namespace: str = DEFAULT_NAMESPACE, seed: int = 0, call_timeout_s: float = 600.0,
                 ready_timeout_s: float = 600.0, llm_kwargs: dict | None = None, on_failure: str = "stop",
                 reward_timeout_s: float | None = 300.0, episode=None, episode_config=None,
                 token: str | None = None):
        from minirl import faults, model as models
        faults.check_settings("RolloutServer", group_size, sampling, episode or reward_fn, reward_timeout_s, on_failure,
                       {"num_generators": (num_generators, 0), "queue_size": (queue_size, 1),
                        "prompts_per_call": (prompts_per_call, 1), "call_timeout_s": (call_timeout_s, 1e-9),
                        "ready_timeout_s": (ready_timeout_s, 1e-9)})
        placement.ray_init(namespace)
        self.model, self.timeout = models.check_model_path(model), call_timeout_s
        self.token = tokens.for_run(token)
        self.queue = create_queue(queue_address, max_batches=queue_size, namespace=namespace, token=self.token,
                                  model_id=models.model_identity(self.model), on_failure=on_failure)
        gen = {"reward_fn": reward_fn, "group_size": group_size, "sampling": sampling, "episode": episode,
               "episode_config": episode_config, "reward_timeout_s": reward_timeout_s, **(llm_kwargs or {})}
        self.pool = GeneratorPool(self.model, self.queue, queue_address, namespace, gen,
                                  resources=resources or placement.default_bundle(), seed=seed,
                                  prompts_per_call=prompts_per_call, call_timeout_s=call_timeout_s,
                                  ready_timeout_s=ready_timeout_s)
        self.generators, self.stats = self.pool.generators, self.pool.stats
        self._thread, self._error, self._items, self._closed = None, None, [], False   # items: for a rejoin
        try:
            for wid in [self.pool.add(wait=False) for _ in range(num_generators)]:
                self.pool.wait_ready(wid)
        except BaseException:     # a generator failed to start (or an interrupt): nothing is left behind
            self.shutdown(remove_queue=True)
            raise

    def add_generator(self, resources: dict | None = None, *, wait: bool = True) -> str:
        return self.pool.add(resources, wait=wait)

    def remove_generator(self, worker_id: str | None = None, *, timeout_s: float | None = None) -> str:
        return self.pool.remove(worker_id, timeout_s=timeout_s)

    # -- prompts and the run ---------------------------------------------------------------------

    def submit(self, prompts: list, *, metadata: list | None = None, uids: list | None = None,
               close: bool = True, skip_known: bool = False) -> int:
        """Add prompts (text or token ids) to the queue; close=True says no more come. skip_known
        skips uids the queue already knows (after restore()). Returns how many were added."""
        from minirl.hub import prompt_items
        items = prompt_items(prompts, metadata, uids)
        added = self._q(self.queue.add_prompts, items, skip_known=skip_known, call=uuid.uuid4().hex)   # made
        # again: the same count (RolloutQueueActor._once)
        self._items += items
        if close:
            self._q(self.queue.close_prompts)
            self._closed = True
        return added

    def restore(self, checkpoint) -> dict:
        """Resume the prompt bookkeeping of a checkpoint (TrainWorker.save_checkpoint; a directory or a
        Checkpointer root): prompts trained before it never come back, its queued rollouts return."""
        from minirl.checkpoint import checkpointed_queue
        path, trained, queued, failed = checkpointed_queue(checkpoint)
        self._q(self.queue.restore, trained, queued, failed)
        return {"path": path, "trained": len(trained), "queued": len(queued), "failed": len(failed)}

    def run(self, prompts: list | None = None, *, metadata=None, uids=None, timeout_s: float | None = None,
            block: bool = True) -> dict:
        """Generate until the trainer has taken every prompt; block=False runs the pool from a
        background thread (join with wait()). Returns the server's counters."""
        if prompts is not None:
            self.submit(prompts, metadata=metadata, uids=uids)
        self._thread = threading.Thread(target=self._watch, args=(timeout_s,), daemon=True)
        self._thread.start()
        return self.wait() if block else dict(self.stats)

    def wait(self, timeout_s: float | None = None, *, trainer_done: bool = False) -> dict:
        """The server's counters once the queue is finished (run(block=False)'s end); raises what ended it.
        trainer_done: the trainer (in this process) has finished, so the pool stops within 60 s even
        if the queue restarted after that end (it would wait for a trainer to rejoin)."""
        if self._thread is not None and trainer_done:
            self._thread.join(min(60.0, timeout_s or 60.0))
            self.pool.stopped = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"rollout server still running after {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"rollout server failed: {self._error}") from self._error
        if (q := self.queue_stats())["error"] is not None:     # on_failure="stop"
            raise RuntimeError(q["error"])
        return {**self.stats, "failed": q["failed"]}

    def failures(self) -> dict:
        """uid -> cause of every prompt whose request failed (skipped under on_failure="skip")."""
        return self._q(self.queue.failures)

    def wait_trainer_done(self, timeout_s: float = 600.0) -> None:
        """Block until the trainer says it trained and synced its last batch (the run's end); the
        trainer's finish() waits for this, to tell a queue restarted meanwhile again."""
        if not placement.call(self.queue.wait_trainer_done, timeout_s, timeout_s=timeout_s + 30, what="the queue"):
            raise TimeoutError(f"the trainer did not finish within {timeout_s} s of the last rollout")

    def _watch(self, timeout_s):
        try:
            self.pool.watch(timeout_s, self._rejoin)
        except BaseException as e:    # surfaced by wait(), and by the queue to the trainer (its get raises it)
            self._error = e
            with contextlib.suppress(Exception):
                self._q(self.queue.stop_run, f"the generation side stopped: {e}")

    def _rejoin(self, generators: dict) -> None:
        """The queue's actor restarted empty: its prompts, whether closed, the ready generators again,
        the versions they hold (a restored trainer publishes above them), and the failures and error
        the pool saw."""
        infos = {a.info.remote(): w for w, a in generators.items()}
        answered, _ = ray.wait(list(infos), num_returns=len(infos), timeout=min(self.timeout, 60.0))
        versions = []
        for ref in answered:
            try:
                versions.append(ray.get(ref)["version"])
            except ray.exceptions.RayError:      # died meanwhile: restarting, it says its version itself
                pass
        self._q(self.queue.rejoin_server, self._items, self._closed, generators, versions, self.pool.failed,
                self.pool.error)

    def evaluate(self, prompts: list, answers: list, reward_fn, **eval_kwargs) -> dict:
        """eval/... metrics (minirl.evaluation.evaluate) of one generator's current weights, and their version."""
        actor = next(iter(self.generators.values()))["actor"]     # a running pool holds >= 1
        return placement.get(actor.evaluate.remote(prompts, answers, reward_fn, eval_kwargs), self.timeout, "eval")

    def queue_stats(self) -> dict:
        return self._q(self.queue.stats)

    def _q(self, method, *args, **kwargs):      # a queue call, made again across a restart of its actor
        return placement.call(method, *args, timeout_s=self.timeout, what="rollout queue", **kwargs)

    def shutdown(self, *, remove_queue: bool = False) -> None:
        self.pool.stop(self._thread)          # the pool's loop ends first: no Ray call outlives us
        for g in self.generators.values():
            ray.kill(g["actor"], no_restart=True)
            placement.remove(g["pg"])
        self.generators.clear()
        if remove_queue:
            ray.kill(self.queue.handle)

