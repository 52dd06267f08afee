"""Training-metric logging: `Tracker.log(metrics, step)` goes to a tqdm bar, TensorBoard, W&B or MLflow,
and always to run_dir/metrics.jsonl, appended (a resumed run continues it; with start_step, its records
of steps >= start_step, logged after the checkpoint it resumes from, are dropped first, and the bar
starts at start_step - 1): per call "step", unix "time", then the metrics as plain ints/floats,
non-finite ones null with their keys in "nonfinite" (the other backends get the raw float). run_dir
also holds config.json (the `config` dict) and tb/. Only rank 0 writes; CPU, any machine.

    with Tracker("runs/gsm8k", total_steps=200, config=cfg) as tracker:
        for step in range(1, 201):      # the bar's position is `step`: count from 1
            tracker.log({"reward/mean": r, "loss": loss, "time/generate": t_gen}, step=step)
    python -m minirl.recipes.tracking plot runs/gsm8k [--out curves.png] [--keys loss kl]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import time
from functools import partial
from pathlib import Path

BACKENDS = ("tensorboard", "wandb", "mlflow")
RESERVED = ("step", "time", "nonfinite")
_mlflow_key = partial(re.sub, r"[^A-Za-z0-9_\-. /]", "_")    # characters MLflow does not accept -> _


def _to_number(key, v):
    """Plain int/float from a python, numpy or torch scalar (bools become 0/1)."""
    if hasattr(v, "item") and not isinstance(v, (int, float)):
        v = v.item()                      # torch / numpy scalar; raises for multi-element tensors
    try:
        return int(v) if isinstance(v, int) else float(v)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r}: cannot log a {type(v).__name__} ({v!r})") from None


def _flatten(d, prefix=""):
    """{"model": {"name": "x"}} -> {"model.name": "x"} (for MLflow params)."""
    return {fk: fv for k, v in d.items() for fk, fv in
            (_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}


class Tracker(contextlib.AbstractContextManager):
    """Metrics to a tqdm bar, metrics.jsonl, TensorBoard, W&B / MLflow; a no-op on ranks other than 0."""

    def __init__(self, run_dir, *, backends=("tensorboard",), total_steps=None, config=None,
                 project="minirl", run_name=None, console=True, rank=None, start_step=None):
        backends = (backends,) if isinstance(backends, str) else tuple(backends or ())
        if bad := [b for b in backends if b not in BACKENDS]:
            raise ValueError(f"unknown tracking backend(s) {bad}; valid: {list(BACKENDS)}")
        if rank is None:
            import torch.distributed as dist
            initialized = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if initialized else int(os.environ.get("RANK", 0))
        self.rank, self.enabled, self.run_dir = rank, rank == 0, Path(run_dir)
        self._file = self._bar = self._tb = self._wandb = self._mlflow = None
        if not self.enabled:
            return
        for name in [b for b in backends if b in ("wandb", "mlflow")]:     # fail before writing files
            try:
                setattr(self, f"_{name}", __import__(name))
            except ImportError as e:
                raise ImportError(f"backend {name!r} needs the {name} package: pip install {name}") from e
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = dict(config or {})
        if config:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        path = self.run_dir / "metrics.jsonl"
        if start_step is not None and path.exists():     # a resumed run logs these steps again
            kept = [r for r in read_metrics(path) if r["step"] < start_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, path)       # a kill right here leaves the old file or the new one whole
        elif path.exists() and (data := path.read_bytes()) and not data.endswith(b"\n"):
            path.write_bytes(data[:data.rfind(b"\n") + 1])   # a torn last record goes: the next would join it
        self._file = open(path, "a", encoding="utf-8")
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        if self._wandb is not None:
            self._wandb.init(project=project, name=run_name, config=config, dir=str(self.run_dir))
        if self._mlflow is not None:
            self._mlflow.set_experiment(project)
            self._mlflow.start_run(run_name=run_name)
            if config:
                self._mlflow.log_params({_mlflow_key(k): str(v) for k, v in _flatten(config).items()})
        if console:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total_steps, initial=max((start_step or 1) - 1, 0),   # resumed: from there
                             desc=run_name or self.run_dir.name, dynamic_ncols=True)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        step = int(step)
        values = {str(k): _to_number(k, v) for k, v in metrics.items()}
        if clash := [k for k in values if k in RESERVED]:
            raise ValueError(f"metric names {clash} are reserved by the JSONL record")
        nonfinite = [k for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)]
        record = {"step": step, "time": time.time(), **values, **dict.fromkeys(nonfinite)}
        record |= {"nonfinite": nonfinite} if nonfinite else {}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, global_step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({_mlflow_key(k): float(v) for k, v in values.items()}, step=step)
        if self._bar is not None:       # postfix e.g. 'reward=0.41 loss=0.0123 | gen=12.3 train=4.56'
            main = [f"{k.split('/')[0]}={values[k]:.3g}" for k in ("reward/mean", "loss") if k in values]
            times = [f"{k[5:]}={v:.3g}" for k, v in values.items() if k.startswith("time/")]
            self._bar.n = step
            self._bar.set_postfix_str(" | ".join(p for p in (" ".join(main), " ".join(times)) if p))

    def close(self) -> None:
        for obj, method in ((self._bar, "close"), (self._tb, "close"), (self._wandb, "finish"),
                            (self._mlflow, "end_run"), (self._file, "close")):
            if obj is not None:
                getattr(obj, method)()
        self._file = self._bar = self._tb = self._wandb = self._mlflow = None

    def __exit__(self, *exc):
        self.close()


def read_metrics(jsonl_path) -> list[dict]:
    """The records of a metrics.jsonl (a run dir works too); a torn last line is skipped."""
    path = Path(jsonl_path) / "metrics.jsonl" if Path(jsonl_path).is_dir() else Path(jsonl_path)
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines[:-1]]
    try:
        return records + [json.loads(ln) for ln in lines[-1:]]
    except json.JSONDecodeError:        # only a crash mid-write may leave a broken last line
        return records


def plot_metrics(jsonl_path, out_png, *, keys=None) -> Path:
    """One PNG: a subplot of reward/* curves, one of eval/pass@* curves, one of time/* curves, one per
    extra key in `keys` (headless); ValueError naming a key in `keys` that no record holds."""
    from matplotlib.figure import Figure
    records = read_metrics(jsonl_path)
    names = sorted({k for r in records for k in r if k not in RESERVED})
    if missing := [k for k in keys or [] if k not in names]:
        raise ValueError(f"no metric {missing[0]!r} in {jsonl_path}; keys present: {names}")
    prefixes = ("reward/", "eval/pass@", "time/")
    panels = [(t.strip("/@"), [k for k in names if k.startswith(t)]) for t in prefixes]
    panels = [p for p in panels if p[1]] + [(k, [k]) for k in (keys or [])]
    if not panels:
        raise ValueError(f"nothing to plot in {jsonl_path}; keys present: {names}")
    fig = Figure(figsize=(8, 3 * len(panels)), layout="tight")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, ks) in zip(axes, panels):
        for k in ks:
            pts = [(r["step"], math.nan if r[k] is None else r[k]) for r in records if k in r]
            ax.plot(*zip(*pts), label=k, marker="." if len(pts) < 50 else None)  # NaN = gap
        ax.set_title(title + (" (s)" if title == "time" else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minirl.recipes.tracking")
    ap.add_argument("cmd", choices=["plot"], help="plot: reward and timing curves of a run as a PNG")
    ap.add_argument("path", help="a run dir or its metrics.jsonl")
    ap.add_argument("--out", help="PNG path (default: metrics.png next to the JSONL)")
    ap.add_argument("--keys", nargs="*", default=None, help="extra metric keys to plot")
    args = ap.parse_args(argv)
    jsonl = Path(args.path) / "metrics.jsonl" if Path(args.path).is_dir() else Path(args.path)
    if not jsonl.is_file():
        ap.error(f"no metrics at {jsonl}: give a run dir (launch --run-dir) or its metrics.jsonl")
    try:
        print(plot_metrics(jsonl, args.out or jsonl.with_name("metrics.png"), keys=args.keys))
    except ValueError as e:       # nothing to plot, or a key no record holds: a usage error, no traceback
        ap.error(str(e))


if __name__ == "__main__":
    main()
