"""The GSM8K recipe at real shapes, a few steps: synthetic GSM8K-format rows (written here, nothing is
downloaded), a random-init model of a real shape (benchmarks/models.py), launch/colocated.py with
1,024-token completions, held-out evaluation every few steps, the over-long penalty. Reports seconds
per step (and its phases), evaluation seconds, eval/train token counts and the device's peak memory.
A random model learns nothing in a few steps (rewards stay ~0): this measures cost, not accuracy.

    python benchmarks/gsm8k_recipe.py --out $OUT/gsm8k_recipe_h200.json          # one H200, < 5 min
    python benchmarks/gsm8k_recipe.py --shape tiny --rows 40 --prompts 4 --group-size 2 \\
        --max-tokens 16 --max-model-len 256 --eval-size 8 --steps 2 --out /tmp/recipe.json             # CPU smoke run

Writes OUT (JSON: command, settings, per-step rows, eval rows, peak memory) and OUT with .md (a table).
Hardware: one CUDA GPU (the figures), or CPU with --shape tiny.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
NAMES = ["Ana", "Ben", "Cleo", "Dev", "Eli", "Fay"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books"]


def synth_rows(n: int, seed: int = 0) -> list[dict]:
    """n GSM8K-format rows ({"question", "answer"}, the answer's last line `#### x`): two-step word
    problems whose references are right by construction."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        who, what = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randrange(2, 50), rng.randrange(2, 20), rng.randrange(1, 30)
        total = a * b - c
        rows.append({"question": f"{who} buys {b} boxes of {what} with {a} {what} in each box, then gives "
                                 f"{c} {what} away. How many {what} does {who} have now?",
                     "answer": f"{who} buys {b} * {a} = <<{b}*{a}={a * b}>>{a * b} {what}.\n"
                               f"After giving {c} away: {a * b} - {c} = <<{a * b}-{c}={total}>>{total}.\n"
                               f"#### {total}"})
    return rows


def recipe_argv(args, model: str, data: Path, run_dir: Path) -> list[str]:
    """launch/colocated.py's flags for the recipe (what the README's real run sets, at bench length)."""
    return ["--model", model, "--task", "gsm8k", "--data", str(data), "--eval-size", str(args.eval_size),
            "--eval-every", str(args.eval_every), "--eval-samples", str(args.eval_samples), "--eval-k",
            str(args.eval_samples), "--steps", str(args.steps), "--prompts", str(args.prompts), "--group-size",
            str(args.group_size), "--max-tokens", str(args.max_tokens), "--max-model-len",
            str(args.max_model_len or args.max_tokens + 256), "--overlong-cache", str(args.max_tokens // 4), "--lr", "1e-6",
            "--backends", "", "--run-dir", str(run_dir)]


def run(args) -> dict:
    import importlib.util
    from models import build_random_model
    from step import MemorySampler
    work = Path(args.work)
    data = work / "gsm8k_synthetic.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in synth_rows(args.rows)))
    model = args.model or str(build_random_model(work / f"model-{args.shape}", args.shape,
                                                 device="cuda" if _cuda() else None))
    run_dir = work / f"run-{int(time.time())}"
    argv = recipe_argv(args, model, data, run_dir)
    sys.path.insert(0, str(ROOT / "launch"))              # for its `import common`
    spec = importlib.util.spec_from_file_location("colocated", ROOT / "launch" / "colocated.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mem, t0 = MemorySampler(), time.time()
    mod.common.main(mod.run, mod.common.parse_args(mod.__doc__, str(run_dir), argv))
    wall = time.time() - t0
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{"step": r["step"], "step_s": r["time/rollouts"] + r["time/train"], "rollouts_s": r["time/rollouts"],
              "train_s": r["time/train"], "len_completion": r["len/completion"], "truncated": r["len/truncated"],
              "reward": r["reward/mean"]} for r in recs if "loss" in r]
    evals = [{k.removeprefix("eval/"): v for k, v in r.items() if k.startswith("eval/") or k == "step"}
             for r in recs if "eval/pass@1" in r]
    later = steps[1:] or steps                             # the first step includes warm-up
    return {"command": "python launch/colocated.py " + " ".join(argv), "shape": args.shape, "wall_s": wall,
            "step_s_median": statistics.median(s["step_s"] for s in later),
            "eval_s_median": statistics.median(e["time"] for e in evals), "peak_memory_gib": mem.stop(),
            "steps": steps, "evals": evals, "settings": vars(args)}


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def markdown(res: dict) -> str:
    rows = [f"| {s['step']} | {s['step_s']:.2f} | {s['rollouts_s']:.2f} | {s['train_s']:.2f} | "
            f"{s['len_completion']:.0f} | {s['truncated']:.2f} |" for s in res["steps"]]
    ev = [f"| {e['step']} | {e['time']:.2f} | {e['pass@1']:.3f} | {e['len_mean']:.0f} | {e['truncated']:.2f} |"
          for e in res["evals"]]
    return "\n".join([f"# GSM8K recipe, {res['shape']}", "", f"`{res['command']}`", "",
                      f"median step {res['step_s_median']:.2f} s (steps after the first), median evaluation "
                      f"{res['eval_s_median']:.2f} s, peak device memory {res['peak_memory_gib']:.1f} GiB, "
                      f"wall {res['wall_s']:.0f} s", "",
                      "| step | step s | rollouts s | train s | completion tokens | truncated |",
                      "|---:|---:|---:|---:|---:|---:|", *rows, "",
                      "| eval at step | s | pass@1 | mean length | truncated |", "|---:|---:|---:|---:|---:|", *ev, ""])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON path (a .md table is written beside it)")
    p.add_argument("--shape", default="qwen3-0.6b", help="benchmarks/models.py SHAPES key, or tiny")
    p.add_argument("--model", default=None, help="a model directory instead of a random one")
    p.add_argument("--rows", type=int, default=400, help="synthetic GSM8K rows")
    p.add_argument("--eval-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-samples", type=int, default=4, help="also k of pass@k")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None, help="default: max-tokens + 256 (prompts ~220)")
    p.add_argument("--work", default="/tmp/minirl-gsm8k-recipe", help="data, model and run directory")
    args = p.parse_args(argv)
    if args.rows <= args.eval_size:
        p.error(f"--rows {args.rows} must exceed --eval-size {args.eval_size} (training needs rows)")
    return args


if __name__ == "__main__":
    a = parse()
    result = run(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
