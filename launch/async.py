"""Async GRPO: generators fill a named Ray queue while the trainer trains; weights flow back.

    python launch/async.py                          # tiny local model, CPU, local Ray: both roles
    ray job submit --working-dir . -- python launch/async.py --role server   # generation job
    ray job submit --working-dir . -- python launch/async.py --role trainer  # training job
    python launch/async.py --max-staleness 0        # exactly on-policy

Same loss code as launch/colocated.py; only where rollouts come from differs (`diff` the two).
The two roles find each other by the queue's name (--queue). Writes runs/async/metrics.jsonl
and reward_curve.png. Hardware: CPU, or GPUs for generators and trainer.
"""

import argparse
import json
import random
import time
from pathlib import Path

import ray
import torch

from minirl import clipped_policy_loss, collate, get_logprobs
from minirl.async_rl import RolloutServer, TrainWorker
from minirl.colocated import WeightManagerConfig
from minirl.core import (approx_kl, clip_fraction, entropy_from_logits, log_ratio_stats,
                         masked_mean)
from minirl.tasks import get_task


def train(args, worker: TrainWorker, log, ckpt=None, start=1):
    """The loop: take rollouts generated elsewhere, train, push weights. User code."""
    for step, batches in enumerate(worker.pull_rollouts(), start):   # <= max_staleness versions old
        t1 = time.perf_counter()
        model, optimizer = worker.model, worker.optimizer
        for b in batches:
            b.compute_advantages()
        all_rollouts = [r for b in batches for r in b]
        stats = []
        for epoch in range(args.epochs):
            random.Random(step * 100 + epoch).shuffle(all_rollouts)
            for i in range(0, len(all_rollouts), args.micro_batch):
                batch = collate(all_rollouts[i:i + args.micro_batch])
                out = model(batch.input_ids, attention_mask=batch.attention_mask)
                lp = get_logprobs(out.logits, batch.input_ids)               # (B, T-1)
                loss = clipped_policy_loss(lp, batch.old_logprobs, batch.advantages,
                                           mask=batch.loss_mask, clip_high=0.28)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
                with torch.no_grad():
                    entropy = masked_mean(entropy_from_logits(out.logits[:, :-1]), batch.loss_mask)
                stats.append([loss.item(),
                              clip_fraction(lp, batch.old_logprobs, batch.advantages,
                                            mask=batch.loss_mask, clip_high=0.28).item(),
                              approx_kl(lp, batch.old_logprobs, batch.loss_mask).item(), entropy.item(),
                              log_ratio_stats(lp, batch.old_logprobs, batch.loss_mask)["ratio_mean"]])
        worker.sync_weights()                                   # push weights to the generators
        t2 = time.perf_counter()
        loss, clipfrac, kl, entropy, ratio = torch.tensor(stats).mean(0).tolist()
        rewards = torch.tensor([r.reward for r in all_rollouts])
        adv = torch.tensor([r.advantage for r in all_rollouts])
        tokens = sum(len(r.completion_ids) for r in all_rollouts)
        staleness = worker.policy_version - 1 - min(b.policy_version for b in batches)
        log(step, {"reward/mean": rewards.mean(), "reward/max": rewards.max(), "loss": loss,
                   "clip_frac": clipfrac, "approx_kl": kl, "entropy": entropy, "ratio_mean": ratio,
                   "adv/std": adv.std(), "adv/abs_mean": adv.abs().mean(),
                   "len/completion": tokens / len(all_rollouts), "policy_version": worker.policy_version,
                   "staleness": staleness, "time/train": t2 - t1, "tokens_per_s/train": tokens / (t2 - t1),
                   **{f"sync/{k}": v for k, v in worker.timings.items()}})
        if ckpt is not None and step % args.save_every == 0:
            worker.save_checkpoint(ckpt, step)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF name or path (default: build the tiny model)")
    p.add_argument("--task", default="succ", help="built-in task: copy, succ, add")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step per rank")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/async")
    p.add_argument("--backends", default="tensorboard", help="comma list: tensorboard,wandb,mlflow")
    p.add_argument("--role", default="both", choices=["both", "server", "trainer"],
                   help="server: generation pool only; trainer: training only; both: one process")
    p.add_argument("--queue", default="minirl-rollouts", help="name of the rollout queue (queue_address)")
    p.add_argument("--generators", type=int, default=1)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--transport", default="object_store", choices=["object_store", "collective"])
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="checkpoint every K steps into RUN_DIR/checkpoints (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--gen-resources", default=None, type=json.loads,
                   help='one replica\'s bundle, e.g. \'{"CPU": 1, "GPU": 1, "gen_pool": 1}\'')
    p.add_argument("--max-model-len", type=int, default=256)
    return p.parse_args(argv)


def server(args, model):
    """The generation side: a pool of vLLM actors working through every prompt of the run."""
    task = get_task(args.task)
    prompts, answers = task.sample(args.steps * args.prompts, seed=args.seed)
    # A buffer of (max_staleness + 1) steps: more would only hold batches that go stale.
    srv = RolloutServer(model, args.queue, reward_fn=task.reward, num_generators=args.generators,
                        group_size=args.group_size, sampling={"max_tokens": args.max_tokens},
                        queue_size=args.prompts * (args.max_staleness + 1), resources=args.gen_resources,
                        seed=args.seed, llm_kwargs={"max_model_len": args.max_model_len,
                                                    "enforce_eager": True})
    if args.resume:                      # prompts trained before the checkpoint never come back
        print("restored:", srv.restore(Path(args.run_dir) / "checkpoints"))
    srv.submit(prompts, metadata=answers, skip_known=args.resume)
    return srv


def trainer(args, model):
    """The training side: pull, train, sync; metrics and the reward curve on rank 0."""
    from minirl.checkpoint import Checkpointer
    from minirl.tracking import Tracker, plot_metrics
    cfg = WeightManagerConfig(seed=args.seed)
    worker = TrainWorker(model, args.queue, lr=args.lr, config=cfg, batch_size=args.prompts,
                         max_staleness=args.max_staleness, transport=args.transport)
    ckpt = Checkpointer(Path(args.run_dir) / "checkpoints") if args.save_every or args.resume else None
    start = worker.load_checkpoint(ckpt)["step"] + 1 if args.resume else 1
    backends = tuple(b for b in args.backends.split(",") if b)
    with Tracker(args.run_dir, backends=backends, total_steps=args.steps, config=vars(args)) as tracker:
        train(args, worker, lambda step, metrics: tracker.log(metrics, step),
              ckpt if args.save_every else None, start)
    if worker.rank.rank == 0:
        print("reward curve:", plot_metrics(Path(args.run_dir) / "metrics.jsonl",
                                            Path(args.run_dir) / "reward_curve.png"))
        print("queue:", worker.queue_stats())
        ray.get(worker.hub.set_config.remote(trainer_done=True), timeout=60)   # the server may now remove the queue
    worker.close()


if __name__ == "__main__":
    from minirl.tiny import build_tiny_model
    args = parse_args()
    model = args.model or str(build_tiny_model(Path(args.run_dir) / "tiny-model"))
    if args.role == "server":
        srv = server(args, model)
        print("server:", srv.run())
        # Every prompt is taken, but the trainer still trains on the last ones, pushes their
        # weights through the queue and the generators, and reads the queue's stats: wait for it.
        deadline = time.monotonic() + 600
        while not ray.get(srv.hub.config.remote(), timeout=60).get("trainer_done"):
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer did not finish within 600 s of the last rollout")
            time.sleep(0.5)
        srv.shutdown(remove_queue=True)
    elif args.role == "trainer":
        trainer(args, model)
    else:
        srv = server(args, model)
        srv.run(block=False)
        trainer(args, model)
        print("server:", srv.wait())
        srv.shutdown(remove_queue=True)
