"""A Hugging Face causal LM loaded to train: path and identity, precision, attention over packed
rows (flash varlen on CUDA, SDPA once per rollout elsewhere), FSDP2 sharding per decoder
layer, and which decoder layers recompute their activations. Used by minirl.trainer.Trainer.

    model = load_fsdp_model(check_model_path("Qwen/Qwen3-0.6B"), device, world, torch.bfloat16)
    recompute_layers(model, 4)            # 4 of its decoder layers recompute in backward, evenly spaced

Hardware: CPU or CUDA.
"""

from __future__ import annotations

import hashlib
from importlib.util import find_spec
from pathlib import Path

import torch

from minirl.lora import LoRAConfig, apply_lora


def check_model_path(model: str) -> str:
    """A local HF directory (resolved) or a hub name; FileNotFoundError naming what is wrong."""
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json: pass a Hugging Face model directory "
                                    "(config.json, weights, tokenizer) or a hub name")
        return str(p.resolve())
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} not found: no such directory, and not a hub name "
                                "of the form 'org/name'")
    try:  # a hub name: resolvable from the local cache or the hub?
        from transformers import AutoConfig
        AutoConfig.from_pretrained(model)
    except Exception as e:
        raise FileNotFoundError(f"model {model!r} is neither a local directory nor loadable from the "
                                f"Hugging Face hub ({type(e).__name__}: {e}); download it first or "
                                "pass its local path") from e
    return model


def model_identity(model: str) -> str:
    """What two processes compare to check they serve the same model: a hub name as is; for a
    local directory, a hash of config.json and the weight files' names and sizes."""
    p = Path(model)
    if not p.is_dir():
        return model
    h = hashlib.sha1((p / "config.json").read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{p.name}@{h.hexdigest()[:12]}"


def precision(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype for mixed_precision=name on device; ValueError for what cannot work."""
    if name == "fp16":
        raise ValueError("mixed_precision='fp16' needs loss scaling, which minirl does not do: use 'bf16'")
    if name not in ("auto", "bf16", "fp32"):
        raise ValueError(f"mixed_precision={name!r}: choose 'auto', 'bf16' or 'fp32'")
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"mixed_precision='bf16' but {torch.cuda.get_device_name(device)} has no bf16: "
                         "use 'fp32'")
    return torch.bfloat16 if name == "bf16" or (name == "auto" and device.type == "cuda") else torch.float32


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]   # FSDP2 subclasses
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no "
                         "_no_split_modules): minirl shards per decoder layer")
    return layers


_VARLEN_PARAMS: set = set()     # varlen_attn's keyword names in this torch (filled on registration)


@torch.compiler.disable      # a loop over the rollouts: compiled layers run it eagerly between graphs
def _sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, 0), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract (packed (T, H, D) rows, causal; window_size
    (W, 0): each query sees itself and the W keys before it) by SDPA once per rollout, where that
    kernel is missing (CPU): one block-diagonal mask over a packed row costs the row's length
    squared (SmolLM2-135M, 128 rollouts of 50 tokens: 1.8x the time, +5 GiB)."""
    cu, left = cu_q.tolist(), window_size[0]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))                                 # (H, T, D)

    def window(n):                  # query position - key position in [0, left]
        d = torch.arange(n, device=q.device)
        d = d[:, None] - d
        return (d >= 0) & (d <= left)
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, a:b], k[:, a:b], v[:, a:b], is_causal=left < 0, attn_mask=None if left < 0 else window(b - a),
        scale=scale, enable_gqa=enable_gqa) for a, b in zip(cu, cu[1:])], dim=1).transpose(0, 1)


def _varlen_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                      cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers attention over packed rows, attention within each rollout: (B, H, T, D) in,
    (B, T, H, D) out, by torch's flash varlen kernel on CUDA, _sdpa_varlen elsewhere. Rows without
    cu_seq_lens are one sequence each; a layer's sliding_window keeps each query to its window; a
    padded batch (an attention mask: collate's right padding) takes transformers' exact SDPA path
    instead."""
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if query.is_cuda:
        from torch.nn.attention.varlen import varlen_attn as kernel
    else:
        kernel = _sdpa_varlen
    B, H, T, D = query.shape
    if cu_seq_lens_q is None:
        cu_seq_lens_q, max_length_q = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=query.device), T
    q = query.transpose(1, 2).reshape(B * T, H, D)
    k, v = (x.transpose(1, 2).reshape(B * T, -1, D) for x in (key, value))
    left = -1 if kwargs.get("sliding_window") is None else kwargs["sliding_window"] - 1   # a sliding-window layer
    extra = {"window_size": (left, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}   # causal
    if k.shape[1] != H and "enable_gqa" in _VARLEN_PARAMS:     # grouped K/V heads, read in place
        extra["enable_gqa"] = True        # (torch < 2.13 takes them without the flag: FA2 groups heads)
    out = kernel(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **extra)
    return out.view(B, T, H, D), None


def _attention(name: str, device: torch.device) -> str:
    """The transformers attn_implementation for TrainerConfig.attention (registers minirl's)."""
    if name not in ("auto", "varlen", "sdpa"):
        raise ValueError(f"attention={name!r}: choose 'auto', 'varlen' or 'sdpa'")
    has_varlen = device.type == "cuda" and find_spec("torch.nn.attention.varlen") is not None
    if name == "varlen" and not has_varlen:
        raise ValueError("attention='varlen' needs CUDA and torch.nn.attention.varlen (torch >= 2.10): "
                         "use 'sdpa' or 'auto'")
    if name == "sdpa" or device.type == "cuda" and not has_varlen:
        return "sdpa"
    import inspect
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    if has_varlen:
        from torch.nn.attention.varlen import varlen_attn
    _VARLEN_PARAMS.update(inspect.signature(varlen_attn if has_varlen else _sdpa_varlen).parameters)
    AttentionInterface.register("minirl_varlen", _varlen_attention)
    AttentionMaskInterface.register(
        "minirl_varlen", lambda **kw: None if kw.get("attention_mask") is None else sdpa_mask(**kw))
    return "minirl_varlen"


def load_fsdp_model(path: str, device: torch.device, world: int, compute_dtype: torch.dtype, *,
                    activation_checkpointing: bool = False, attention: str = "auto",
                    trust_remote_code: bool = False, lora: LoRAConfig | None = None,
                    offload: bool = False, dtype: torch.dtype = torch.float32, compile: str | None = None):
    """Load an HF causal LM in `dtype` (fp32: master weights), inject LoRA adapters if asked, and
    shard it with FSDP2: each decoder layer, then the root; with `offload` the shards stay on the host."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation=_attention(attention, device),
                                                 trust_remote_code=trust_remote_code)
    if lora is not None:
        model = apply_lora(model, lora)
    if activation_checkpointing:
        recompute_layers(model, None if activation_checkpointing is True else activation_checkpointing)
    kw = dict(mesh=init_device_mesh(device.type, (world,)),
              mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
              offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy())
    for layer in _decoder_layers(model):
        fully_shard(layer, **kw)
        if compile:
            layer.compile(backend=compile, dynamic=True)
    fully_shard(model, **kw)
    if not offload:
        return model.to(device)
    for m in model.modules():             # the shards stay on the host, buffers go to the device
        for name, b in m.named_buffers(recurse=False):
            setattr(m, name, b.to(device))
    return model


def recompute_layers(model: torch.nn.Module, k: int | None = None) -> None:
    """Recompute the activations of k decoder layers (None: all), evenly spaced, in backward; the
    others keep theirs."""
    layers = _decoder_layers(model)
    n = len(layers) if k is None else k
    if not 0 <= n <= len(layers):
        raise ValueError(f"activation_checkpointing={k}: the model has {len(layers)} decoder layers; "
                         f"pass 0..{len(layers)}, True (all) or None (planned)")
    if n == 0:
        return model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    chosen = {i * len(layers) // n for i in range(n)}
    for i, layer in enumerate(layers):           # HF reads each layer's flag at every call
        layer.gradient_checkpointing = i in chosen


def recomputed_layers(model: torch.nn.Module) -> int:
    """How many decoder layers recompute their activations in backward."""
    return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in _decoder_layers(model))
