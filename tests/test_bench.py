"""The benchmarks run end to end on CPU (tiny model) and record what they claim to.

Their figures are not checked here (speed is for the GPU runs); what is checked: every setting
ran, every verified sync agreed with the trainer, and the markdown shows each setting."""

import json
import math
import sys
from pathlib import Path

import pytest

from conftest import run_py

ROOT = Path(__file__).resolve().parents[1]


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


def test_logprobs_benchmark_smoke(tmp_path):
    """Both cores ran at every temperature, and minirl's compiled path (--compile eager here); only the
    ones with entropy=True have the fused-entropy run (the baseline here: a core.py whose token_logprobs
    has no entropy, as before e0700ab); the fused rows' numbers agree with the reference's (on CPU they
    take the plain path: this checks the plumbing; tests/test_kernels.py checks the kernels)."""
    old = tmp_path / "old_core.py"
    old.write_text("from minirl import core\nfrom minirl.core import entropy_from_logits\n\n"
                   "def token_logprobs(logits, targets, *, temperature=1.0):\n"
                   "    return core.token_logprobs(logits, targets, temperature=temperature)\n")
    out = tmp_path / "lp.json"
    p = run_py(["benchmarks/logprobs.py", "--rows", "64", "--vocab", "1000", "--repeat", "1", "--baseline",
                str(old), "--compile", "eager", "--out", str(out)], timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert set(runs) == {f"{n} T={t}" for n in ("minirl", "minirl fused", "baseline") for t in (1.0, 0.7)}
    assert all(d["logprob"] < 1e-4 and d["entropy"] < 1e-3 for d in doc["fused_vs_reference"].values())
    assert all("forward_with_entropy" in r for n, r in runs.items() if n.startswith("minirl"))
    assert not any("forward_with_entropy" in r for n, r in runs.items() if n.startswith("baseline"))
    assert all(r["forward_backward"]["s"] > 0 for r in runs.values())
    assert "| baseline T=0.7 |" in out.with_suffix(".md").read_text()


def test_step_benchmark_smoke(tmp_path):
    """minirl's side of the whole-step benchmark: every step's phases, its engine steps (one prefill
    step, then a decode step per further token: at most 16), what the plan chose, and nonzero
    advantages from the DIGITS reward on a random model (every step trains and syncs a change);
    with --lengths lognormal each step's completions are cut at varied lengths (a median of 0.35 x 16
    tokens: far fewer than 4 x 8 x 16 in all), and each training step records its compile work."""
    out = tmp_path / "step.json"
    p = run_py(["benchmarks/step.py", "--shape", "tiny", "--prompts", "4", "--steps", "3", "--max-tokens", "16",
                "--sides", "minirl", "--lengths", "lognormal", "--models-dir", str(tmp_path / "models"),
                "--work", str(tmp_path / "w"), "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    side = json.loads(out.read_text())["sides"]["minirl"]
    assert len(side["steps"]) == 3 and side["sleep_level"] == 0 and side["activation_checkpointing"] is False
    for s in side["steps"]:
        assert 2 <= s["engine_steps"] <= 16 and s["prefill_steps"] == 1 and s["max_batch_tokens"] > 4 * 8
        rollouts_s = s["generate_s"] + s["sync_s"] - s["sync_sleep_s"]    # the engine sleeps in the training phase
        assert 0 < s["engine_s"] <= s["rollout_wall_s"] <= rollouts_s and s["train_s"] > 0
        assert s["sync_s"] == pytest.approx(sum(s[f"sync_{k}_s"] for k in ("wake", "sync", "verify", "sleep", "offload")))
        assert 0 < s["rollout_cpu_s"] and 0 <= s["gc_s"] < s["rollout_wall_s"]
        assert 0 < s["reward"] < 1 and s["adv_abs_mean"] > 0 and s["grad_norm"] > 0   # the weights move
        assert s["generated_tokens"] < 0.7 * 4 * 8 * 16
        assert s["train_graphs"] == 0 and s["train_compile_s"] == 0 and s["train_alloc_retries"] == 0  # CPU: eager
    assert all(s["probe_gap"] is not None and s["sync_sync_s"] > 0 and s["sync_verify_s"] > 0
               for s in side["steps"][1:])                                            # and every sync is checked
    assert len({s["generated_tokens"] for s in side["steps"]}) == 3                   # drawn anew each step
    assert all(s["kv_reads"] > s["generated_tokens"] for s in side["steps"])          # prompt + earlier tokens
    assert "| minirl |" in out.with_suffix(".md").read_text()


def test_step_floor_hand_worked():
    """The floor by hand: 1e9 parameters, 10 engine steps, 1e6 KV tokens of 1,000 bytes on an H200:
    (2e9 x 10 + 1e9) / 4.8e12 = 4.375 ms generation, 6e9 x 1e4 / 989.4e12 training; an unknown
    device has none. A sequence of prompt 4 sampling 3 tokens reads 4 + 5 + 6 = 15 KV tokens."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step
    f = step.floor(int(1e9), 1000, 10, 1e6, 1e4, "NVIDIA H200")
    assert f["generation_s"] == pytest.approx(4.375e-3) and f["training_s"] == pytest.approx(6e13 / 989.4e12)
    assert f["step_s"] == pytest.approx(f["generation_s"] + f["training_s"])
    assert step.floor(int(1e9), 1000, 10, 1e6, 1e4, "cpu") is None
    assert step.kv_reads(4, 3) == 15 and step.kv_reads(4, 0) == 0 and step.kv_reads(1, 1) == 1
    cfg = {"num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128}
    assert step.kv_bytes(cfg) == 112 * 1024                                     # Qwen3-0.6B: 112 KiB a token


def test_step_floor_of_a_committed_json():
    """--floor-of on a committed H100 step (0.6B, 512 completions of 256 tokens after prompts of 4):
    KV 512 x (256 x 4 + 256 x 255 / 2) tokens of 112 KiB and 257 reads of the bf16 weights at 3.35 TB/s."""
    src = ROOT / "benchmarks/results/2026-12-06-e/step_qwen3-0.6b_256_minirl.json"
    p = run_py(["benchmarks/step.py", "--floor-of", str(src)], timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out, doc = json.loads(p.stdout), json.loads(src.read_text())
    n = doc["n_params"]
    gen = (2 * n * 257 + 512 * (256 * 4 + 256 * 255 // 2) * 112 * 1024) / 3.35e12
    assert out["floor"]["generation_s"] == pytest.approx(gen, rel=1e-6)
    m = doc["sides"]["minirl"]["median"]
    assert out["minirl"]["generation_of_floor"] == pytest.approx(gen / m["generate_s"], rel=1e-6)
    assert 0 < out["minirl"]["step_of_floor"] < 1 and 0 < out["minirl"]["generation_of_floor"] < 1


def test_decode_host_benchmark_smoke(tmp_path):
    """Every lever's rollout ran on the same engine (ignore_eos: every completion max_tokens long, one
    engine step a token after the prefill), and the host profile lists the engine's step."""
    out = tmp_path / "dh.json"
    p = run_py(["benchmarks/decode_host.py", "--shape", "tiny", "--prompts", "4", "--max-tokens", "16",
                "--repeats", "1", "--models-dir", str(tmp_path / "models"), "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    best = doc["best"]
    assert len(best) == 6 and doc["engine_process"] is False
    assert best["generate, no logprobs, ignore_eos"]["tokens"] == 4 * 8 * 16
    assert best["episodes (launch's rollout)"]["tokens"] == best["episodes, vLLM's own log-prob path"]["tokens"]
    assert all(0 < b["tokens"] <= 4 * 8 * 16 and 2 <= b["engine_steps"] <= 17 and b["wall_s"] > 0 for b in best.values())
    host = doc["host_profile"]
    assert host["top"] and 0 < sum(f["share"] for f in host["top"]) <= 1.0001
    parts = host["parts"]                                  # the engine's step inside minirl's, each step timed
    assert parts["episodes.py:_step"]["calls"] == parts["llm_engine.py:step"]["calls"] >= 2
    assert 0 < parts["scheduler.py:schedule"]["cum_s"] < parts["llm_engine.py:step"]["cum_s"] \
        <= parts["episodes.py:_step"]["cum_s"] < parts["episodes.py:_serve"]["cum_s"]
    assert Path(out.with_suffix(".prof.txt")).read_text().strip()


def test_train_phase_benchmark_smoke(tmp_path):
    """Every variant trained (finite gradients from nonzero advantages: no step refused), with its own
    micro-batch budget, and the same tokens; MFU and step times recorded."""
    out = tmp_path / "tp.json"
    p = run_py(["benchmarks/train_phase.py", "--shape", "tiny", "--prompts", "4", "--group-size", "4",
                "--completion", "32", "--steps", "2", "--variants", "default,mb32k+keep+pinned",
                "--models-dir", str(tmp_path / "models"), "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = json.loads(out.read_text())["variants"]
    assert [(r["variant"], r.get("error"), r["config"]["micro_batch_tokens"]) for r in runs] == [
        ("default", None, 16384), ("mb32k+keep+pinned", None, 32768)]
    for r in runs:
        assert len(r["steps"]) == 3 and {s["tokens"] for s in r["steps"]} == {16 * 32}
        assert r["median"]["step_s"] > 0 and r["mfu"] > 0


def test_learning_smoke(tmp_path):
    """minirl's side of the learning benchmark on the tiny model (arith without a chat template): two
    steps with finite rewards on both clocks, the in-loop evaluation, the final policy as an HF folder,
    and the one evaluator's pass@1 of the base and final models in [0, 1]."""
    out = tmp_path / "learning"
    p = run_py(["benchmarks/learning.py", "--out", str(out), "--model", "tiny", "--sides", "minirl", "--seeds", "0",
                "--steps", "2", "--prompts", "4", "--group-size", "2", "--max-tokens", "8", "--eval-size", "4",
                "--eval-every", "2", "--eval-samples", "2", "--timeout", "300"], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "learning.json").read_text())
    run = doc["runs"]["minirl/0"]
    assert [s["step"] for s in run["steps"]] == [1, 2] and "error" not in run and run["returncode"] == 0
    assert all(math.isfinite(s["reward"]) and 0 < s["wall_s"] and 0 < s["train_s"] <= s["wall_s"] for s in run["steps"])
    assert [e["step"] for e in run["evals"]] == [0, 2] and run["startup_s"] > 0 and run["eval_in_loop_s"] > 0
    assert run["prompt_order_ok"]       # the prompts it trained on are the ones TRL's dataset would hold
    assert (Path(run["final_dir"]) / "model.safetensors").exists() and (Path(run["final_dir"]) / "config.json").exists()
    for ev in (doc["base_eval"], run["final_eval"]):
        assert ev["prompts"] == 4 and all(0 <= ev[k] <= 1 for k in ("greedy_pass@1", "sampled_pass@1"))
    assert "| minirl | 1 |" in (out / "learning.md").read_text() and (out / "learning.png").exists()
