"""The benchmarks run end to end on CPU (tiny model) and record what they claim to.

Their figures are not checked here (speed is for the GPU runs); what is checked: every setting
ran, every verified sync agreed with the trainer, and the markdown shows each setting."""

import json

from conftest import run_py


def test_switch_benchmark_smoke(tmp_path):
    out = tmp_path / "switch.json"
    p = run_py(["benchmarks/switch.py", "--shape", "tiny", "--reps", "2", "--batch", "2", "--seq", "16",
                "--models-dir", str(tmp_path / "models"), "--out", str(out)], timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert set(res) == {"resident-verified", "resident"}        # no sleep mode on CPU
    on, off = res["resident-verified"], res["resident"]
    assert len(on["steps"]) == 2 and all(s["probe_gap"] < 2e-3 and s["policy_version"] > 0 for s in on["steps"])
    assert all("probe_gap" not in s and s["switch_s"] > 0 for s in off["steps"])
    md = out.with_suffix(".md").read_text()
    assert "| resident-verified |" in md and "| resident |" in md
