"""minirl.recipes.tracking on CPU: JSONL/config files, ranks, TensorBoard, fake W&B/MLflow, plots, CLI."""

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from minirl.recipes.tracking import Tracker, plot_metrics, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tracker(tmp_path, **kw):
    kw.setdefault("backends", ())
    kw.setdefault("console", False)
    kw.setdefault("rank", 0)
    return Tracker(tmp_path / "run", **kw)


def test_jsonl_records_and_scalar_types(tmp_path):
    with _tracker(tmp_path) as t:
        t.log({"reward/mean": torch.tensor(0.5), "loss": np.float32(0.25), "n": np.int64(3),
               "ok": True, "time/generate": 1.5}, step=1)
        t.log({"loss": 0.125}, step=2)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    r = [json.loads(x) for x in lines]
    assert r[0]["step"] == 1 and isinstance(r[0]["time"], float)
    assert r[0]["reward/mean"] == 0.5 and r[0]["loss"] == 0.25
    assert r[0]["n"] == 3 and type(r[0]["n"]) is int and r[0]["ok"] == 1
    assert r[0]["time/generate"] == 1.5 and "nonfinite" not in r[0]
    assert r[1] == {"step": 2, "time": r[1]["time"], "loss": 0.125}
    assert read_metrics(tmp_path / "run") == r


def test_append_on_resume_and_config(tmp_path):
    cfg = {"lr": 1e-6, "model": {"name": "tiny", "layers": 2}}
    with _tracker(tmp_path, config=cfg) as t:
        t.log({"loss": 1.0}, step=1)
    with _tracker(tmp_path, config=cfg) as t:       # resumed run: same dir, same file
        t.log({"loss": 0.5}, step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == cfg
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:   # a crash mid-write
        f.write('{"step": 3, "lo')
    assert len(read_metrics(tmp_path / "run")) == 2


def test_nonfinite_written_as_null_and_listed(tmp_path):
    with _tracker(tmp_path) as t:
        t.log({"loss": float("nan"), "kl": torch.tensor(float("inf")), "ok": 1.0}, step=3)
    line = (tmp_path / "run" / "metrics.jsonl").read_text().strip()
    assert "NaN" not in line and "Infinity" not in line       # strict JSON
    r = json.loads(line)
    assert r["loss"] is None and r["kl"] is None and r["ok"] == 1.0
    assert sorted(r["nonfinite"]) == ["kl", "loss"]


def test_bad_values_and_reserved_keys(tmp_path):
    with _tracker(tmp_path) as t:
        with pytest.raises(TypeError, match="text"):
            t.log({"text": "hello"}, step=1)
        with pytest.raises(ValueError, match="reserved"):
            t.log({"step": 1}, step=1)


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    with _tracker(tmp_path, rank=1, backends=("tensorboard",), config={"a": 1}) as t:
        t.log({"loss": 1.0}, step=1)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "2")                          # default rank from the env
    import torch.distributed as dist                         # (when no process group exists)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    t = Tracker(tmp_path / "run2", backends=(), console=False)
    assert t.rank == 2 and not t.enabled
    t.log({"loss": 1.0}, step=1)
    t.close()
    assert not (tmp_path / "run2").exists()


def test_console_bar(tmp_path, capsys):
    with _tracker(tmp_path, console=True, total_steps=4) as t:
        t.log({"reward/mean": 0.5, "loss": 0.1234, "time/generate": 2.0, "other": 9.0}, step=2)
        assert t._bar.n == 2
    err = capsys.readouterr().err
    assert "reward=0.5" in err and "loss=0.123" in err and "generate=2" in err
    assert "other" not in err
    with _tracker(tmp_path, console=False) as t:
        t.log({"loss": 1.0}, step=1)
    assert capsys.readouterr() == ("", "")
    with _tracker(tmp_path, console=True, total_steps=30, start_step=11) as t:   # resumed from step 10
        assert t._bar.n == 10
    assert "10/30" in capsys.readouterr().err


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _tracker(tmp_path, backends=("tensorboard",)) as t:
        t.log({"reward/mean": 0.25, "time/train": 1.0}, step=1)
        t.log({"reward/mean": 0.75}, step=2)
    tb = tmp_path / "run" / "tb"
    assert list(tb.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"reward/mean", "time/train"} <= set(acc.Tags()["scalars"])
    ev = acc.Scalars("reward/mean")
    assert [e.step for e in ev] == [1, 2]
    assert [e.value for e in ev] == pytest.approx([0.25, 0.75])


def _fake_module(name, calls, funcs):
    mod = types.ModuleType(name)
    for f in funcs:
        setattr(mod, f, lambda *a, _f=f, **kw: calls.append((_f, a, kw)))
    return mod


def test_wandb_adapter(tmp_path, monkeypatch):
    calls = []
    fake = _fake_module("wandb", calls, ["init", "log", "finish"])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = {"lr": 0.1}
    with _tracker(tmp_path, backends=("wandb",), config=cfg, project="p", run_name="r") as t:
        t.log({"reward/mean": torch.tensor(0.5), "loss": float("nan")}, step=7)
    assert [c[0] for c in calls] == ["init", "log", "finish"]
    assert calls[0][2] == {"project": "p", "name": "r", "config": cfg,
                           "dir": str(tmp_path / "run")}
    (values,), kw = calls[1][1], calls[1][2]
    assert kw == {"step": 7} and values["reward/mean"] == 0.5 and math.isnan(values["loss"])


def test_mlflow_adapter(tmp_path, monkeypatch):
    calls = []
    fns = ["set_experiment", "start_run", "log_params", "log_metrics", "end_run"]
    monkeypatch.setitem(sys.modules, "mlflow", _fake_module("mlflow", calls, fns))
    cfg = {"lr": 0.1, "model": {"name": "tiny"}}
    with _tracker(tmp_path, backends=["mlflow"], config=cfg, project="p", run_name="r") as t:
        t.log({"reward/mean": 0.5, "time/gen:vllm": 2}, step=3)
    assert [c[0] for c in calls] == fns
    assert calls[0][1] == ("p",) and calls[1][2] == {"run_name": "r"}
    assert calls[2][1] == ({"lr": "0.1", "model.name": "tiny"},)
    assert calls[3][1] == ({"reward/mean": 0.5, "time/gen_vllm": 2.0},)
    assert calls[3][2] == {"step": 3}


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_backend_import_error(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)           # makes `import name` fail
    with pytest.raises(ImportError, match=f"pip install {name}"):
        _tracker(tmp_path, backends=(name,))
    assert not (tmp_path / "run").exists()


def test_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="tensorboard"):
        _tracker(tmp_path, backends=("neptune",))


def _write_run(tmp_path):
    with _tracker(tmp_path) as t:
        for s in range(1, 6):
            t.log({"reward/mean": s / 5, "reward/std": 0.1, "loss": 1 / s if s != 3 else math.nan,
                   "time/generate": 1.0 + s, "time/train": 0.5}, step=s)
    return tmp_path / "run" / "metrics.jsonl"


def test_plot_metrics_png(tmp_path):
    jsonl = _write_run(tmp_path)
    out = plot_metrics(jsonl, tmp_path / "plots" / "m.png", keys=["loss"])
    assert out == tmp_path / "plots" / "m.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    with pytest.raises(ValueError, match=r"no metric 'los' in .*metrics\.jsonl; keys present: .*'loss'"):
        plot_metrics(jsonl, tmp_path / "plots" / "typo.png", keys=["los"])     # not an empty panel
    assert not (tmp_path / "plots" / "typo.png").exists()


def test_cli_plot(tmp_path):
    _write_run(tmp_path)
    out = tmp_path / "cli.png"
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "minirl.recipes.tracking", "plot", str(tmp_path / "run"),
                          "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    (tmp_path / "empty").mkdir()                               # a run dir with no metrics: a usage error
    res = subprocess.run([sys.executable, "-m", "minirl.recipes.tracking", "plot", str(tmp_path / "empty")],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no metrics at" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = subprocess.run([sys.executable, "-m", "minirl.recipes.tracking", "plot", str(tmp_path / "run"),
                          "--keys", "los"], cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no metric 'los'" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_resume_drops_the_steps_logged_after_the_checkpoint(tmp_path):
    """Killed after logging steps 1-4 (and an eval record at 4), resumed from the step-2 checkpoint:
    steps 3 and 4 are logged again, so the file must hold each step once, in order."""
    with _tracker(tmp_path) as t:
        for step in (1, 2, 3, 4):
            t.log({"loss": float(step)}, step=step)
        t.log({"eval/pass@1": 0.5}, step=4)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:    # the kill tore a write
        f.write('{"step": 5, "lo')
    with _tracker(tmp_path, start_step=3) as t:
        for step in (3, 4):
            t.log({"loss": 10.0 * step}, step=step)
    recs = read_metrics(tmp_path / "run")
    assert [(r["step"], r.get("loss")) for r in recs] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 4     # no torn line left
    with _tracker(tmp_path, start_step=1) as t:                  # resumed from nothing: starts over
        t.log({"loss": 0.0}, step=1)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:    # torn again, then appended to without start_step
        f.write('{"step": 2, "lo')
    with _tracker(tmp_path) as t:
        t.log({"loss": 3.0}, step=3)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 3]


def test_plot_has_an_eval_panel(tmp_path, monkeypatch):
    with _tracker(tmp_path) as t:
        t.log({"reward/mean": 0.1}, step=1)
        t.log({"eval/pass@1": 0.2, "eval/pass@4": 0.5, "eval/len_mean": 9.0}, step=1)
        t.log({"reward/mean": 0.3}, step=2)
        t.log({"eval/pass@1": 0.4, "eval/pass@4": 0.7, "eval/len_mean": 8.0}, step=2)
    from matplotlib.figure import Figure
    panels, savefig = [], Figure.savefig
    def spy(fig, *a, **kw):
        panels.extend((ax.get_title(), [ln.get_label() for ln in ax.get_lines()]) for ax in fig.axes)
        return savefig(fig, *a, **kw)
    monkeypatch.setattr(Figure, "savefig", spy)
    out = plot_metrics(tmp_path / "run" / "metrics.jsonl", tmp_path / "p.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert panels == [("reward", ["reward/mean"]), ("eval/pass", ["eval/pass@1", "eval/pass@4"])]
