"""The switch benchmark runs end to end on CPU (tiny model) and records what it claims to.

Its figures are not checked here (speed is for the GPU run); what is checked: every part ran,
raw vLLM reloads keep greedy outputs, minirl's verified syncs agree with the trainer, and the
generation servers answered every call in ABBA order with per-cycle ratios."""

import json

from conftest import run_py


def test_bench_switch_smoke(tmp_path):
    out = tmp_path / "switch.json"
    p = run_py(["launch/bench_switch.py", "--shapes", "tiny", "--prompts", "8", "--new-tokens", "8",
                "--reps", "2", "--gen-cycles", "2", "--models-dir", str(tmp_path / "models"),
                "--out", str(out)], timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads(out.read_text())["results"][0]
    assert rec["errors"] == []
    raw, mr, gen = rec["raw"], rec["minirl"], rec["generate"]
    assert raw["greedy_unchanged_after_reload"] and raw["cycle_level2"]["median"]["load_s"] > 0
    assert all(r["all_loaded"] for r in raw["cycle_level2"]["reps"])
    on, off = mr["passes"]["L0-on"], mr["passes"]["L0-off"]
    assert all(r["probe_gap"] < 2e-3 and r["policy_version"] > 0 for r in on["reps"])
    assert "probe_gap" not in off["median"] or off["median"]["probe_gap"] is None
    sides = ["raw", "raw_minirl_settings", "minirl"]
    assert [c["side"] for c in gen["calls"]] == sides + sides[::-1]             # ABBA
    assert all(c["tok_s"] > 0 and c["output_tokens"] == 8 * 8 for c in gen["calls"])
    assert len(gen["minirl/raw"]["per_cycle"]) == 2 and gen["servers"]["minirl"]["sleep_level"] == 0
    assert rec["ratio"]["generate_tok_s_minirl/raw"] == gen["minirl/raw"]["median"]
    md = out.with_suffix(".md").read_text()
    assert "| tiny | minirl, resident (no sleep), verify on |" in md
