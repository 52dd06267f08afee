"""Co-located GRPO: the same devices generate with vLLM, then train with FSDP2, every step.

    python launch/colocated.py                          # tiny local model, CPU, ~1 min
    torchrun --nproc_per_node 2 launch/colocated.py     # two ranks (gloo on CPU, NCCL on GPU)
    ray job submit --working-dir . -- python launch/colocated.py --ray 2

The training block and the command line are launch/common.py's, shared by both loops: only
where rollouts come from differs (`diff launch/colocated.py launch/async.py`). Default: a tiny
random Qwen3 and the built-in `succ` task ("7+1=" -> "8"), where a random model scores ~1/64.
Real data: `--task gsm8k --data train.jsonl --eval-size 200 --eval-every 10` (README: the recipe).
Writes RUN_DIR/metrics.jsonl, TensorBoard logs and reward_curve.png (held-out pass@k beside the
reward). Hardware: CPU, or GPUs. How a run ends (errors, Ctrl-C, --resume): common.main.
"""

import common

if __name__ == "__main__":          # the command line and the run's inputs, checked before torch, vLLM and Ray load
    args, task = common.start(__doc__, "runs/colocated")

import time                         # noqa: E402

from minirl import WeightManager              # noqa: E402
from minirl.episodes import run_episodes      # noqa: E402
from minirl.recipes.envs import workload      # noqa: E402


def train(args, wm: WeightManager, log, task, ckpt=None, start=1, evaluate=None):
    """The loop: generate with the latest weights, score, train. One screen, user code."""
    episode, sample = workload(task, args.env)                  # one turn scored by task.reward, or --env's

    def rollouts(step, round):                                  # one round of prompts, scored
        seed = (args.seed * 1000 + step) * 64 + wm.rank.rank + round * 2**40   # prompts and samples
        prompts, answers = sample(args.prompts, seed=seed)      # depend on the step only: exact resume
        llm, version = wm.as_vllm(), wm.policy_version          # syncs weights if they changed
        return run_episodes(llm, episode, prompts, group_size=args.group_size, metadata=answers, seed=seed * 1000,
                            sampling={"max_tokens": args.max_tokens}, policy_version=version, device=wm.device)

    if evaluate is not None and start == 1:                     # held-out pass@1 / pass@k before training
        log(0, evaluate())
    for step in range(start, args.steps + 1):
        t1 = time.perf_counter()
        batches, kept = common.select(lambda round: rollouts(step, round), args)   # --dynamic-sampling: refills
        t2 = time.perf_counter()
        wm.as_trainable()                                       # the engine sleeps, the trainer wakes
        metrics = common.train_step(wm.trainer, batches, args, step) | kept
        t3 = time.perf_counter()
        log(step, common.with_timings(metrics, wm, t2 - t1, t3 - t2))
        if evaluate is not None and common.eval_due(args, step):
            log(step, evaluate())
        if ckpt is not None and step % args.save_every == 0:
            wm.save_checkpoint(ckpt, step)


def run(args, task=None):
    """Build the WeightManager (and the model if none was given), train, plot; all closed on any exit.
    task: common.prepare's (made and checked before any model)."""
    task = task or common.make_task(args)                       # prompts, references, reward_fn
    with WeightManager(common.model_path(args), config=common.manager_config(args), **common.llm_kwargs(args)) as wm:
        ckpt, start = common.resumed(args, wm)
        with common.tracked(args, wm.trainer, start) as log:
            train(args, wm, log, task, ckpt, start, common.evaluator(args, task, wm))


if __name__ == "__main__":
    common.main(run, args, task)
