"""Does vLLM compute what the trainer computes, in each engine setting? Prompt and sampled log-probs
of the engine beside HF transformers' on the same weights, before and after a weight load.

For each cell (a model shape x an engine setting), in its own process (one engine per process;
several cells at once): the engine (bf16, in process) scores a probe prompt and a mixed batch of
prompts of 5-130 tokens (prompt_logprobs: a prefill) and samples completions (logprobs of the
sampled tokens: decode steps); HF transformers (fp32, same device) scores the same tokens. Then
every weight moves (W + 2% of its std of noise), loaded through minirl's sync path
(vllm_compat.weight_update, as a co-located sync does), HF gets the same weights, and the
comparison runs again. Reported per cell: mean |engine - HF| over prompt tokens (probe, batch) and
over sampled tokens (the first completion token, from the prefill step, apart from the rest).

    python benchmarks/engine_exact.py --out $OUT/engine_exact.json                 # the matrix below
    python benchmarks/engine_exact.py --models tiny --settings eager,full --jobs 2  # a part of it
    python benchmarks/engine_exact.py --models tiny --settings eager --jobs 1       # CPU smoke test

Hardware: one CUDA GPU (vLLM 0.22 for the figures in benchmarks/results); CPU runs the eager cells.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# model shape -> build_tiny_model kwargs (random Qwen3, character tokenizer) or a Qwen3 config
MODELS = {
    "tiny": {"hidden_size": 128, "num_heads": 2},                       # head_dim 64, minirl's tiny model
    "tiny-hd128": {"hidden_size": 256, "num_heads": 2},                 # head_dim 128
    "tiny-gqa": {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2},  # head_dim 64, GQA 2:1
    "q06-2l": "qwen3-0.6b",                                             # Qwen3-0.6B dims, 2 layers
    "smollm2": None,                                                    # SmolLM2-135M-Instruct (head_dim 64, 9:3)
}
SETTINGS = {
    "eager": {"enforce_eager": True},
    "default": {},                                                      # minirl's engine default
    "full": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL"}},
    "decode": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
    "piecewise": {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
    "decode-compiled": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    "triton": {"attention_backend": "TRITON_ATTN"},                    # the default's graphs, Triton's kernel
    "fa3": {"attention_backend": "FLASH_ATTN"},                        # the default's graphs, FlashAttention
    "full-split1": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL"},
                    "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}},
}
PROBE = "The quick brown fox jumps over the lazy dog. 0123456789 = 3+4"


def build(name: str, root: Path, smollm2: str | None) -> str:
    path = root / name
    if name == "smollm2":                              # the pretrained SmolLM2-135M-Instruct
        from minirl.recipes.packaged import packaged_model
        return smollm2 or str(packaged_model("smollm2"))
    if (path / "config.json").exists():
        return str(path)
    spec = MODELS[name]
    if isinstance(spec, dict):
        from minirl.recipes.tiny import build_tiny_model
        return str(build_tiny_model(path, **spec))
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from models import SHAPES, build_covering_tokenizer
    dims = {**SHAPES[spec], "num_hidden_layers": 2}
    cfg = Qwen3Config(**{"tie_word_embeddings": True, **dims}, max_position_embeddings=4096, rope_theta=1e6,
                      bos_token_id=None, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    build_covering_tokenizer(dims["vocab_size"]).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return str(path)


def cell(model: str, setting: str) -> dict:
    """One cell, in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from minirl import vllm_compat as vc
    from vllm import SamplingParams, TokensPrompt

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    kw = {"max_model_len": 256, "max_num_seqs": 64, "dtype": "bfloat16" if cuda else "float32",
          **SETTINGS[setting]}
    if cuda:
        kw.update(gpu_memory_utilization=0.05, kv_cache_memory_bytes=1 << 30, max_num_seqs=256)
    t0 = time.perf_counter()
    llm = vc.build_llm(model, **vc.engine_kwargs(kw, sleep=False, seed=0, colocated=False))
    start_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(dev).eval()
    vocab = hf.config.vocab_size
    probe = tok.encode(PROBE)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(2, min(vocab, 60), (n,), generator=g).tolist() for n in (5, 17, 62, 130)]
    prompts = [torch.randint(2, min(vocab, 60), (n,), generator=g).tolist() for n in (4, 9, 12, 20, 7, 30, 3, 15)]

    @torch.no_grad()
    def hf_lp(ids: list[int]) -> torch.Tensor:        # log p(token t | < t), t >= 1
        x = torch.tensor([ids], device=dev)
        lp = torch.log_softmax(hf(x).logits[0, :-1].float(), -1)
        return lp.gather(-1, x[0, 1:, None])[:, 0].cpu()

    def prompt_gap(seqs: list[list[int]]) -> list[float]:
        outs = vc.LLM.generate(llm, [TokensPrompt(prompt_token_ids=s) for s in seqs], vc.prompt_logprob_params(),
                               use_tqdm=False)
        return [(torch.tensor(vc.read_prompt_logprobs(o, s)) - hf_lp(s)).abs().mean().item()
                for o, s in zip(outs, seqs)]

    def sampled_gap() -> dict:
        params = SamplingParams(n=4, temperature=1.0, max_tokens=24, logprobs=0, seed=1, ignore_eos=True)
        outs = vc.LLM.generate(llm, [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        first, rest = [], []
        for o, p in zip(outs, prompts):
            for c in o.outputs:
                ids = list(c.token_ids)
                diff = (torch.tensor(vc.sampled_logprobs(c)) - hf_lp(p + ids)[len(p) - 1:]).abs()
                first.append(diff[0].item())
                rest.extend(diff[1:].tolist())
        return {"first_token": sum(first) / len(first), "later_tokens": sum(rest) / max(len(rest), 1),
                "later_max": max(rest, default=0.0)}

    def measure() -> dict:
        return {"probe": prompt_gap([probe])[0], "probe_alone_again": prompt_gap([probe])[0],
                "batch": prompt_gap(batch), "sampled": sampled_gap()}

    res = {"model": model, "setting": setting, "engine_start_s": start_s, "before": measure()}
    with torch.no_grad():                              # every weight moves, as after a training step
        for _, w in hf.named_parameters():              # each tensor once (a tied head is the embedding)
            w += 0.02 * w.std() * torch.randn(w.shape, generator=g).to(w)
        with vc.weight_update(llm) as load:
            load([(k, w.to(torch.bfloat16 if cuda else torch.float32)) for k, w in hf.named_parameters()])
    llm.reset_prefix_cache()
    res["after_load"] = measure()
    cc = getattr(llm.llm_engine.vllm_config, "compilation_config", None)
    res["engine"] = {"cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)), "mode": str(getattr(cc, "mode", None))}
    vc.shutdown(llm)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,tiny-hd128,tiny-gqa,q06-2l")
    p.add_argument("--settings", default="eager,full")
    p.add_argument("--extra", default="tiny:default,tiny:decode,tiny:full-split1,tiny:piecewise,tiny:decode-compiled",
                   help="more model:setting cells")
    p.add_argument("--smollm2", default=None, help="the SmolLM2 folder (default: minirl.recipes.packaged's)")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--work", default="/tmp/engine_exact")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=None)
    p.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.cell:
        print("RESULT " + json.dumps(cell(*a.cell)), flush=True)
        return
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    cells = [(m, s) for m in a.models.split(",") for s in a.settings.split(",")]
    cells += [tuple(x.split(":")) for x in a.extra.split(",") if x]
    paths = {m: build(m, root, a.smollm2) for m in {m for m, _ in cells}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def run(c):
        m, s = c
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--cell", paths[m], s], capture_output=True, text=True,
                               timeout=a.timeout, env=env)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            out = json.loads(line[7:]) if line else {"error": r.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            out = {"error": f"timed out after {a.timeout} s"}
        out.update(model_name=m, setting=s, process_s=time.perf_counter() - t0)
        print(summary(out), flush=True)
        return out

    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(run, cells))
    doc = {"cells": results}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
        Path(a.out).with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


def summary(r: dict) -> str:
    if "error" in r:
        return f"{r['model_name']:>10} {r['setting']:>12}  ERROR {r['error'][-400:]}"
    f = lambda d: (f"probe {d['probe']:.4f} batch {max(d['batch']):.4f} sampled first {d['sampled']['first_token']:.4f} "
                   f"later {d['sampled']['later_tokens']:.4f}")
    return f"{r['model_name']:>10} {r['setting']:>12}  before: {f(r['before'])} | after load: {f(r['after_load'])}"


def markdown(results: list[dict]) -> str:
    rows = ["| model | setting | probe before / after | batch (max) before / after | first sampled token "
            "before / after | later sampled tokens before / after |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['model_name']} | {r['setting']} | error | | | |")
            continue
        b, a = r["before"], r["after_load"]
        rows.append(f"| {r['model_name']} | {r['setting']} | {b['probe']:.4f} / {a['probe']:.4f} | "
                    f"{max(b['batch']):.4f} / {max(a['batch']):.4f} | {b['sampled']['first_token']:.4f} / "
                    f"{a['sampled']['first_token']:.4f} | {b['sampled']['later_tokens']:.4f} / "
                    f"{a['sampled']['later_tokens']:.4f} |")
    return "Mean |vLLM - HF fp32| log-prob per token.\n\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
