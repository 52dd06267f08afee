"""Async GRPO: generators fill a named Ray queue while the trainer trains; weights flow back.

    python launch/async.py                              # tiny local model, CPU, local Ray: both roles
    ray job submit --no-wait --working-dir . --runtime-env-json "$ENV" -- python launch/async.py --role server
    ray job submit --working-dir . --runtime-env-json "$ENV" -- python launch/async.py --role trainer
                         # two jobs meeting by the queue's name (--queue), ENV carrying one MINIRL_QUEUE_TOKEN

The training block and the command line are launch/common.py's, shared by both loops: only
where rollouts come from differs (`diff launch/colocated.py launch/async.py`). Default: a tiny
random Qwen3 and the built-in `succ` task ("7+1=" -> "8"), where a random model scores ~1/64.
Real data: `--task gsm8k --data train.jsonl --eval-size 200 --eval-every 10` (README: the recipe).
Writes RUN_DIR/metrics.jsonl, TensorBoard logs and reward_curve.png (held-out pass@k beside the
reward). Hardware: CPU, or GPUs. How a run ends (errors, Ctrl-C, --resume): common.main.
"""

import common

if __name__ == "__main__":          # the command line and the run's inputs, checked before torch, vLLM and Ray load
    args, task = common.start(__doc__, "runs/async", async_loop=True)

import time                         # noqa: E402

from actors.training import TrainWorker       # noqa: E402


def train(args, worker: TrainWorker, log, ckpt=None, start=1, evaluate=None):
    """The loop: take rollouts generated elsewhere, train, push weights. One screen, user code."""
    if evaluate is not None and start == 1:                     # held-out pass@1 / pass@k before training
        log(0, evaluate())
    t1 = time.perf_counter()
    for step, batches in zip(range(start, args.steps + 1), worker.pull_rollouts()):   # <= max_staleness versions old
        t2 = time.perf_counter()
        metrics = common.train_step(worker.trainer, batches, args, step, off_policy="tis",   # stale tokens
                                    max_staleness=args.max_staleness)
        worker.sync_weights()                                   # push weights to the generators
        t3 = time.perf_counter()
        log(step, common.with_timings(metrics, worker, t2 - t1, t3 - t2))
        if evaluate is not None and common.eval_due(args, step):
            log(step, evaluate())
        if ckpt is not None and step % args.save_every == 0:
            worker.save_checkpoint(ckpt, step)
        t1 = time.perf_counter()


def run(args, task=None):
    """Build the TrainWorker (and the generation side, by --role), train, plot; all closed on any exit.
    task: common.prepare's (made and checked before any model; None for --role trainer)."""
    srv = common.start_server(args, task)                       # --role server: the whole job
    if args.role == "server":
        return
    with common.train_worker(args, srv) as worker:
        ckpt, start = common.resumed(args, worker)
        with common.tracked(args, worker.trainer, start) as log:
            train(args, worker, log, ckpt, start, common.evaluator(args, task, srv))


if __name__ == "__main__":
    common.main(run, args, task)
