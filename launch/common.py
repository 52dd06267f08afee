"""What launch/colocated.py and launch/async.py share: the command line, the training block of a
step (advantages, loss, optimizer steps, metrics) and the run's set-up. Written once so the two
loops differ only in where rollouts come from. Not run on its own. Hardware: the loop's.

torch is imported inside the functions, not at the top: with --ray this module travels to the
actors pickled by value, and cloudpickle, seeing a global `torch` and the name `backends`
(args.backends), would try to pickle the torch.backends module ("cannot pickle 'GenericModule'").
"""

import argparse
import contextlib
import json
import random
import sys
from pathlib import Path

from minirl.core import ppo_loss_fn
from minirl.trainer import TrainerConfig


def parse_args(doc: str, run_dir: str, argv=None):
    """The command line of both loops; flags marked (co-located) or (async) matter to one only."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default=None, help="HF name or path (default: build the tiny model)")
    add("--task", default="succ", help="built-in task: copy, succ, add")
    add("--steps", type=int, default=60)
    add("--prompts", type=int, default=32, help="prompts per step per rank")
    add("--group-size", type=int, default=8)
    add("--max-tokens", type=int, default=2, help="completion tokens at most")
    add("--max-model-len", type=int, default=256)
    add("--epochs", type=int, default=1, help="passes over each batch")
    add("--optim-steps", type=int, default=1, help="optimizer steps per pass (gradients accumulated)")
    add("--micro-batch-tokens", type=int, default=16384, help="tokens per packed micro-batch")
    add("--activation-checkpointing", action="store_true")
    add("--lr", type=float, default=2e-3)
    add("--seed", type=int, default=0)
    add("--run-dir", default=run_dir)
    add("--backends", default="tensorboard", help="comma list: tensorboard,wandb,mlflow")
    add("--save-every", type=int, default=0, metavar="K", help="checkpoint every K steps (0: never)")
    add("--resume", action="store_true", help="continue from the latest checkpoint in RUN_DIR")
    add("--eager", action="store_true", help="vLLM without CUDA graphs (always so on CPU)")
    add("--no-verify", action="store_true", help="skip the check of every weight sync")
    add("--no-sync", action="store_true", help="(co-located) ablation: never load trained weights into vLLM")
    add("--sleep-level", type=int, default=None, choices=[0, 2], help="(co-located) default: planned")
    add("--kv-cache-gib", type=float, default=None, help="(co-located) default: planned")
    add("--gpu-memory-utilization", type=float, default=None, help="(co-located) vLLM's own, not the plan")
    add("--ray", type=int, default=0, metavar="N", help="(co-located) run on N Ray actors (SPMD)")
    add("--role", default="both", choices=["both", "server", "trainer"], help="(async) this job's side")
    add("--queue", default="minirl-rollouts", help="(async) name of the rollout queue")
    add("--generators", type=int, default=1, help="(async)")
    add("--max-staleness", type=int, default=1, help="(async) policy versions a rollout may lag")
    add("--transport", default="object_store", choices=["object_store", "collective"], help="(async)")
    add("--gen-resources", default=None, type=json.loads,
        help='(async) one generator\'s bundle, e.g. \'{"CPU": 1, "GPU": 1, "gen_pool": 1}\'')
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "group_size", "max_tokens", "epochs", "optim_steps", "micro_batch_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def trainer_config(args) -> TrainerConfig:
    return TrainerConfig(lr=args.lr, seed=args.seed, micro_batch_tokens=args.micro_batch_tokens,
                         activation_checkpointing=True if args.activation_checkpointing else None)


def manager_config(args):
    from minirl.colocated import WeightManagerConfig
    return WeightManagerConfig(trainer=trainer_config(args), sync_weights=not args.no_sync,
                               verify_sync=not args.no_verify, sleep_level=args.sleep_level,
                               kv_cache_gib=args.kv_cache_gib)


def llm_kwargs(args) -> dict:
    kw = {"max_model_len": args.max_model_len, "max_num_seqs": min(1024, args.prompts * args.group_size)}
    if getattr(args, "gpu_memory_utilization", None) is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return {**kw, "enforce_eager": True} if args.eager else kw


def train_step(trainer, batches, args, step: int) -> dict:
    """GRPO advantages, then args.epochs passes over the batch, each in args.optim_steps optimizer
    steps of accumulated packed micro-batches; every loss is the token mean over the global
    batch. Returns the step's metrics (token means over every rank)."""
    import torch
    staleness = trainer.policy_version - min(b.policy_version for b in batches)   # versions behind
    for b in batches:
        b.compute_advantages()
    rollouts = [r for b in batches for r in b]
    mine = trainer.rebalance(rollouts)                   # ranks hold about as many tokens
    loss_fn, seen = ppo_loss_fn(clip_high=0.28), []
    for epoch in range(args.epochs):
        random.Random(step * 100 + epoch).shuffle(mine)
        for k in range(args.optim_steps):
            out = trainer.forward_backward(mine[k::args.optim_steps], loss_fn)
            seen.append({**out, **trainer.optim_step()})
    mean = {k: sum(m[k] for m in seen) / len(seen) for k in seen[0]}
    rewards = torch.tensor([r.reward for r in rollouts])
    adv = torch.tensor([r.advantage for r in rollouts])
    return {"reward/mean": rewards.mean(), "reward/max": rewards.max(), "adv/std": adv.std(),
            "adv/abs_mean": adv.abs().mean(), "loss": mean["loss"], "clip_frac": mean["clip_frac"],
            "approx_kl": mean["approx_kl"], "entropy": mean["entropy"], "ratio_mean": mean["ratio"],
            "grad_norm": mean["grad_norm"], "tokens/trained": mean["tokens"], "staleness": staleness,
            "len/completion": sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
            "len/prompt": sum(len(r.prompt_ids) for r in rollouts) / len(rollouts)}


def with_timings(metrics: dict, owner, rollouts_s: float, train_s: float) -> dict:
    """The step's metrics plus the policy version, the phases' seconds and the last weight
    sync's parts (owner: a WeightManager or TrainWorker)."""
    return {**metrics, "policy_version": owner.policy_version, "time/rollouts": rollouts_s,
            "time/train": train_s, **{f"sync/{k}": v for k, v in owner.timings.items()}}


@contextlib.contextmanager
def tracked(args, trainer):
    """log(step, metrics): metrics averaged over the ranks, written by rank 0 (metrics.jsonl,
    TensorBoard...); the reward curve is drawn at the end."""
    import torch
    import torch.distributed as dist
    from minirl.tracking import Tracker, plot_metrics
    backends = tuple(b for b in args.backends.split(",") if b)
    with Tracker(args.run_dir, backends=backends, total_steps=args.steps, config=vars(args)) as tracker:
        def log(step, metrics):
            keys = sorted(metrics)
            v = torch.tensor([float(metrics[k]) for k in keys], device=trainer.device)
            dist.all_reduce(v)
            tracker.log(dict(zip(keys, (v / dist.get_world_size()).tolist())), step)
        yield log
    if trainer.rank.rank == 0:
        print("reward curve:", plot_metrics(Path(args.run_dir) / "metrics.jsonl",
                                            Path(args.run_dir) / "reward_curve.png"))


def resumed(args, owner):
    """(checkpointer or None, first step): restores owner (a WeightManager or TrainWorker) from
    the latest checkpoint with --resume."""
    from minirl.checkpoint import Checkpointer
    ckpt = Checkpointer(Path(args.run_dir) / "checkpoints") if args.save_every or args.resume else None
    start = owner.load_checkpoint(ckpt)["step"] + 1 if args.resume else 1
    return (ckpt if args.save_every else None), start


def model_path(args) -> str:
    from minirl.tiny import build_tiny_model
    return args.model or str(build_tiny_model(Path(args.run_dir) / "tiny-model"))


def start_server(args):
    """(async) The generation side: a pool of vLLM actors working through every prompt of the
    run. With --role server this is the whole job: it returns (shut down) when the trainer is done."""
    from actors.server import RolloutServer
    from minirl.tasks import get_task
    if args.role == "trainer":
        return None
    task = get_task(args.task)
    prompts, answers = task.sample(args.steps * args.prompts, seed=args.seed)
    srv = RolloutServer(model_path(args), args.queue, reward_fn=task.reward, num_generators=args.generators,
                        group_size=args.group_size, sampling={"max_tokens": args.max_tokens},
                        queue_size=args.prompts * (args.max_staleness + 1), resources=args.gen_resources,
                        seed=args.seed, llm_kwargs={**llm_kwargs(args), "max_num_seqs": 256})
    if args.resume:                      # prompts trained before the checkpoint never come back
        print("restored:", srv.restore(Path(args.run_dir) / "checkpoints"))
    srv.submit(prompts, metadata=answers, skip_known=args.resume)
    if args.role == "server":
        print("server:", srv.run())
        srv.wait_trainer_done()          # the trainer still trains and syncs the last batches
        srv.shutdown(remove_queue=True)
        return srv
    srv.run(block=False)
    return srv


def train_worker(args):
    """(async) The training side: a Trainer fed by the rollout queue."""
    from actors.training import TrainWorker
    return TrainWorker(model_path(args), args.queue, config=trainer_config(args), batch_size=args.prompts,
                       max_staleness=args.max_staleness, transport=args.transport,
                       verify_sync=not args.no_verify)


def finish(worker, srv) -> None:
    """(async) Tell the server side the trainer is done, then wait for it and stop it."""
    worker.finish()
    worker.close()
    if srv is not None:
        print("server:", srv.wait())
        srv.shutdown(remove_queue=True)


def main(run, args) -> None:
    """run(args) here, or with --ray N on N Ray actors at once (SPMD)."""
    if not getattr(args, "ray", 0):
        return run(args)
    import ray
    from actors.colocated import run_spmd
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # travels with `run`
    run_spmd(run, args, num_workers=args.ray)
