"""Log-probs of sampled tokens at a real vocabulary: what the training step pays beside the model.

    python benchmarks/logprobs.py --out benchmarks/results/logprobs.json          # one GPU, ~1 min
    python benchmarks/logprobs.py --baseline old_core.py --out ...                  # beside another core.py
    python benchmarks/logprobs.py --rows 512 --compile eager                       # CPU smoke run

Times minirl.core.token_logprobs on bf16 logits of one packed micro-batch (default 16,384 rows x the
151,936-token Qwen3 vocabulary, 5 GB): forward alone, forward with the entropy from the same pass,
forward + backward, and entropy_from_logits (a separate pass, what logging entropy cost before), each
the median of --repeat runs timed with CUDA events after two warm-ups; and the memory each holds
beyond the logits (and, for backward, their gradient). Rows "minirl fused": the same functions with
compile= (on CUDA minirl.kernels' Triton kernels), the trainer's path there, and how far its numbers
are from the plain path's. For scale: the LM head's matmul forward and
backward at the same rows (hidden --hidden). --baseline PATH loads another core.py (e.g. an earlier
commit's: `git show REV:minirl/core.py > old_core.py`) and times its functions the same way (its fused
path too, where it has one).
Hardware: one CUDA GPU (on CPU it runs, slowly, at --rows 512).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minirl import core  # noqa: E402


def timed(fn, device, repeat: int) -> dict:
    """Median seconds of fn() and the peak bytes it allocated beyond what was live before."""
    for _ in range(2):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return {"s": round(statistics.median(times), 5), "extra_gib": None if peak is None else round(peak / 2**30, 3)}


def measure(mod, logits, targets, temperature: float, repeat: int, device, **kw) -> dict:
    """mod's token_logprobs (with kw, e.g. compile=) / entropy_from_logits on these logits
    (entropy=True only where it exists)."""
    fused = "entropy" in inspect.signature(mod.token_logprobs).parameters
    out = {}
    with torch.no_grad():
        out["forward"] = timed(lambda: mod.token_logprobs(logits, targets, temperature=temperature, **kw),
                               device, repeat)
        if fused:
            out["forward_with_entropy"] = timed(
                lambda: mod.token_logprobs(logits, targets, temperature=temperature, entropy=True, **kw),
                device, repeat)
        out["entropy_from_logits"] = timed(lambda: mod.entropy_from_logits(logits, temperature=temperature),
                                           device, repeat)
    x = logits.detach().requires_grad_()
    grad_out = torch.ones(len(targets), device=device)

    def fwd_bwd():
        torch.autograd.grad(mod.token_logprobs(x, targets, temperature=temperature, **kw), x, grad_out)
    out["forward_backward"] = timed(fwd_bwd, device, repeat)
    # what a step that logs entropy paid: fused where it exists, else forward + backward + a separate pass
    out["step_cost_s"] = round(out["forward_backward"]["s"] + (
        out["forward_with_entropy"]["s"] - out["forward"]["s"] if fused else out["entropy_from_logits"]["s"]), 5)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024, help="LM head input width (Qwen3-0.6B: 1024, 4B: 2560)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="another core.py to time beside this one")
    ap.add_argument("--compile", default=None, help="the compile= the fused rows pass (default: inductor "
                    "on CUDA, none on CPU: no fused rows); its rows are named 'minirl fused'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.compile or ("inductor" if device.type == "cuda" else None)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, device=device, dtype=torch.bfloat16, generator=g)
    head = (torch.randn(args.vocab, args.hidden, device=device, dtype=torch.bfloat16, generator=g)
            / args.hidden ** 0.5).requires_grad_()
    with torch.no_grad():
        logits = (hidden @ head.T) * 3                                   # (rows, V) bf16, logit-like spread
    targets = torch.randint(0, args.vocab, (args.rows,), device=device, generator=g)
    mods = {"minirl": (core, {})}
    if backend:
        mods["minirl fused"] = (core, {"compile": backend})
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_core", args.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        takes = backend and "compile" in inspect.signature(base.token_logprobs).parameters
        mods["baseline"] = (base, {"compile": backend} if takes else {})      # its fused path, where it has one
    h = hidden.detach().requires_grad_()
    up = torch.randn_like(logits)

    def head_fwd_bwd():
        torch.autograd.grad(h @ head.T, (h, head), up)
    doc = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "rows": args.rows, "vocab": args.vocab, "hidden": args.hidden,
           "logits_gib": round(logits.numel() * logits.element_size() / 2**30, 3),
           "lm_head_matmul_forward_backward": timed(head_fwd_bwd, device, args.repeat) if device.type == "cuda"
           else {"s": None}, "runs": {}}          # bf16 matmuls on CPU: minutes
    for name, (mod, kw) in mods.items():
        for temp in args.temperatures:
            doc["runs"][f"{name} T={temp}"] = measure(mod, logits, targets, temp, args.repeat, device, **kw)
    if backend:                                           # the fused path's numbers against the reference
        doc["fused_vs_reference"] = agreement(logits[:2048], targets[:2048], backend)
    print(markdown(doc))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
        Path(args.out).with_suffix(".md").write_text(markdown(doc) + "\n")
    return doc


def agreement(logits, targets, backend: str) -> dict:
    """Largest differences of the fused path's log-probs, entropies and gradient from the reference's."""
    x = logits.detach().requires_grad_()
    diffs = {}
    for temp in (1.0, 0.7):
        ref, ref_ent = core.token_logprobs(x, targets, temperature=temp, entropy=True)
        got, got_ent = core.token_logprobs(x, targets, temperature=temp, entropy=True, compile=backend)
        ref_g, got_g = (torch.autograd.grad(v.sum(), x)[0].float() for v in (ref, got))
        diffs[f"T={temp}"] = {"logprob": (got - ref).abs().max().item(), "entropy": (got_ent - ref_ent).abs().max().item(),
                              "grad": (got_g - ref_g).abs().max().item()}
    return diffs


def markdown(doc) -> str:
    keys = ("forward", "forward_with_entropy", "forward_backward", "entropy_from_logits")
    lines = [f"token_logprobs on {doc['device']} (torch {doc['torch']}): {doc['rows']} rows x {doc['vocab']} vocab, "
             f"bf16 logits {doc['logits_gib']} GiB. Seconds (GiB allocated beyond the logits; backward: their gradient included); the LM head's "
             f"matmul forward + backward at hidden {doc['hidden']}: {doc['lm_head_matmul_forward_backward']['s']} s.", "",
             "| run | " + " | ".join(keys) + " | a step that logs entropy |", "|---|" + "---:|" * (len(keys) + 1)]
    for name, r in doc["runs"].items():
        cells = [f"{r[k]['s']} ({r[k]['extra_gib']})" if k in r else "-" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['step_cost_s']} |")
    if "fused_vs_reference" in doc:
        lines += ["", f"Fused vs reference, largest differences (the first 2,048 rows at most): {doc['fused_vs_reference']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
