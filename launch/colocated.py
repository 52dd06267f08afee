"""Co-located GRPO: the same devices generate with vLLM, then train with FSDP2, every step.

    python launch/colocated.py                          # tiny local model, CPU, ~1 min
    torchrun --nproc_per_node 2 launch/colocated.py     # two ranks (gloo on CPU, NCCL on GPU)
    ray job submit --working-dir . -- python launch/colocated.py --ray 2

The training block and the command line are launch/common.py's, shared by both loops: only
where rollouts come from differs (`diff launch/colocated.py launch/async.py`). Default: a tiny
random Qwen3 and the built-in `succ` task ("7+1=" -> "8"), where a random model scores ~1/64.
Real data: `--task gsm8k --data train.jsonl --eval-size 200 --eval-every 10` (math, code alike;
README: the recipe). Writes RUN_DIR/metrics.jsonl, TensorBoard logs and reward_curve.png (held-out
pass@k beside the reward). Hardware: CPU, or GPUs. How a run ends (errors, Ctrl-C, --resume): common.main.
"""

import common

if __name__ == "__main__":          # the command line and the run's inputs, checked before torch and vLLM load
    args, task = common.start(__doc__, "runs/colocated")

import time                         # noqa: E402
from functools import partial       # noqa: E402

from minirl import WeightManager    # noqa: E402
from minirl.envs import workload              # noqa: E402
from minirl.episodes import run_episodes      # noqa: E402


def train(args, wm: WeightManager, log, task, ckpt=None, start=1):
    """The loop: generate with the latest weights, score, train. One screen, user code."""
    episode, sample = workload(task, args.env)                  # one turn scored by task.reward, or --env's

    def rollouts(step, round):                                  # one round of prompts, scored
        seed = (args.seed * 1000 + step) * 64 + wm.rank.rank + round * 2**40   # prompts and samples
        prompts, answers = sample(args.prompts, seed=seed)      # depend on the step only: exact resume
        llm = wm.as_vllm()                                      # syncs weights if they changed
        return run_episodes(llm, episode, prompts, group_size=args.group_size, metadata=answers,
                            sampling={"max_tokens": args.max_tokens}, seed=seed * 1000)

    for step in range(start - 1, args.steps + 1):
        if step >= start:
            t1 = time.perf_counter()
            batches, kept = common.select(partial(rollouts, step), args)   # --dynamic-sampling: refills
            t2 = time.perf_counter()
            wm.as_trainable()
            metrics = common.train_step(wm.trainer, batches, args, step)   # the loss and the metrics
            t3 = time.perf_counter()
            log(step, common.with_timings(metrics | kept, wm, t2 - t1, t3 - t2))
        if common.eval_due(args, step, start):                  # held-out pass@1 / pass@k, lengths
            log(step, common.evaluate(wm.as_vllm(), task, args, wm.rank.rank, wm.rank.world_size))
        if ckpt is not None and step >= start and step % args.save_every == 0:
            wm.save_checkpoint(ckpt, step)


def run(args, task=None):
    """Build the WeightManager (and the tiny model if none was given), train, plot; closed on any exit.
    task: common.make_task(args), made (and checked) before the model."""
    task = task or common.make_task(args)                       # prompts, references, reward_fn
    with WeightManager(common.model_path(args), config=common.manager_config(args), **common.llm_kwargs(args)) as wm:
        ckpt, start = common.resumed(args, wm)
        with common.tracked(args, wm.trainer, start) as log:
            train(args, wm, log, task, ckpt, start)


if __name__ == "__main__":
    common.main(run, args, task)                                # --ray N: on N Ray actors
