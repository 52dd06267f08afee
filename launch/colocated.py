"""Co-located GRPO: the same devices generate with vLLM, then train with FSDP2, every step.

    python launch/colocated.py                                 # tiny local model, CPU, ~1 min
    torchrun --nproc_per_node 2 launch/colocated.py            # two ranks (gloo on CPU, NCCL on GPU)
    python launch/colocated.py --model Qwen/Qwen3-0.6B --task add --steps 200
    ray job submit --working-dir . -- python launch/colocated.py --ray 2   # on a Ray cluster

Default: a tiny random Qwen3 built locally and the built-in `succ` task ("7+1=" -> "8"), where
a random model scores ~1/64. Writes runs/<name>/metrics.jsonl, TensorBoard logs and
reward_curve.png. Hardware: CPU, or one GPU per rank.
"""

import argparse
import random
import time

import torch
import torch.distributed as dist
from vllm import SamplingParams

from minirl import WeightManager, clipped_policy_loss, collate, get_logprobs, parse_vllm_outputs
from minirl.colocated import WeightManagerConfig
from minirl.core import (approx_kl, clip_fraction, entropy_from_logits, log_ratio_stats,
                         masked_mean)
from minirl.tasks import get_task


def train(args, wm: WeightManager, log, ckpt=None, start=1):
    """The loop: generate with the latest weights, score, train. One screen, user code."""
    task, rank = get_task(args.task), wm.rank.rank
    for step in range(start, args.steps + 1):
        seed = (args.seed * 1000 + step) * 64 + rank            # prompts and samples depend on
        prompts, answers = task.sample(args.prompts, seed=seed)  # the step only: exact resume
        sampling = [SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens,
                                   logprobs=0, seed=seed * 1000 + i) for i in range(len(prompts))]
        t0 = time.perf_counter()
        llm = wm.as_vllm()                                      # syncs weights if they changed
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        batches = parse_vllm_outputs(outputs, args.group_size, task.reward, metadata=answers)
        model, optimizer = wm.as_trainable()
        t1 = time.perf_counter()
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
        t2 = time.perf_counter()
        loss, clipfrac, kl, entropy, ratio = torch.tensor(stats).mean(0).tolist()
        rewards = torch.tensor([r.reward for r in all_rollouts])
        adv = torch.tensor([r.advantage for r in all_rollouts])
        tokens = sum(len(r.completion_ids) for r in all_rollouts)
        log(step, {"reward/mean": rewards.mean(), "reward/max": rewards.max(), "loss": loss,
                   "clip_frac": clipfrac, "approx_kl": kl, "entropy": entropy, "ratio_mean": ratio,
                   "adv/std": adv.std(), "adv/abs_mean": adv.abs().mean(),
                   "len/completion": tokens / len(all_rollouts), "policy_version": wm.policy_version,
                   "time/generate": t1 - t0, "time/train": t2 - t1, "tokens_per_s/generate": tokens / (t1 - t0),
                   **{f"switch/{k}": v for k, v in wm.timings.items()}})
        if ckpt is not None and step % args.save_every == 0:
            wm.save_checkpoint(ckpt, step)


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
    p.add_argument("--run-dir", default="runs/colocated")
    p.add_argument("--backends", default="tensorboard", help="comma list: tensorboard,wandb,mlflow")
    p.add_argument("--no-sync", action="store_true", help="ablation: never load trained weights into vLLM")
    p.add_argument("--no-verify", action="store_true", help="skip the per-sync probe check")
    p.add_argument("--ray", type=int, default=0, metavar="N", help="run on N Ray actors (SPMD)")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="checkpoint every K steps into RUN_DIR/checkpoints (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--max-model-len", type=int, default=256)
    return p.parse_args(argv)


def run(args):
    """Build the WeightManager (and the tiny model if none was given), train, plot."""
    from pathlib import Path
    from minirl.checkpoint import Checkpointer
    from minirl.tiny import build_tiny_model
    from minirl.tracking import Tracker, plot_metrics

    model = args.model or str(build_tiny_model(Path(args.run_dir) / "tiny-model"))
    cfg = WeightManagerConfig(seed=args.seed, sync_weights=not args.no_sync, verify_sync=not args.no_verify)
    wm = WeightManager(model, lr=args.lr, config=cfg, max_model_len=args.max_model_len,
                       enforce_eager=True)
    ckpt = Checkpointer(Path(args.run_dir) / "checkpoints") if args.save_every or args.resume else None
    start = wm.load_checkpoint(ckpt)["step"] + 1 if args.resume else 1
    backends = tuple(b for b in args.backends.split(",") if b)
    with Tracker(args.run_dir, backends=backends, total_steps=args.steps, config=vars(args)) as tracker:
        def log(step, metrics):   # average over ranks, then rank 0 writes
            # Imported here, not used as globals: `run` travels to the Ray actors pickled by value
            # (it lives in __main__), and cloudpickle, seeing the global `torch` and the name
            # `backends` (args.backends), would try to pickle torch.backends, a module subclass
            # it cannot pickle ("cannot pickle 'GenericModule' object").
            import torch
            import torch.distributed as dist
            keys = sorted(metrics)
            v = torch.tensor([float(metrics[k]) for k in keys], device=wm.device)
            dist.all_reduce(v)
            tracker.log(dict(zip(keys, (v / dist.get_world_size()).tolist())), step)
        train(args, wm, log, ckpt if args.save_every else None, start)
    if wm.rank.rank == 0:
        print("reward curve:", plot_metrics(Path(args.run_dir) / "metrics.jsonl",
                                            Path(args.run_dir) / "reward_curve.png"))
    wm.close()


if __name__ == "__main__":
    args = parse_args()
    if args.ray:
        from actors.colocated import run_spmd
        run_spmd(run, args, num_workers=args.ray)
    else:
        run(args)
