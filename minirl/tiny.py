"""A tiny causal LM and character tokenizer, built locally in about a second.

Tests and the default demo share it: no network, loads in transformers and in vLLM's CPU
build (head_dim 64 >= 32). Random weights, so it knows nothing until trained.

    python -m minirl.tiny /tmp/tiny        # writes config, safetensors and tokenizer there
"""

from __future__ import annotations

import json
import os
import string
import sys
from pathlib import Path

SPECIAL = ["<pad>", "<eos>"]
# One token per character; 62 of them, so with the 2 specials the vocabulary is exactly 64
# (every id the model can sample decodes to a character).
CHARS = list(string.digits) + list("+-*=?:, ") + list(string.ascii_lowercase) + list("ABCDEFGHIJKLMNOPQR")


def vocab() -> dict[str, int]:
    """Token -> id for the character tokenizer (specials, then CHARS)."""
    return {tok: i for i, tok in enumerate(SPECIAL + CHARS)}


def build_tokenizer():
    """A `PreTrainedTokenizerFast` that maps every character to one token (no merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="?", clean_up_tokenization_spaces=False)


def build_tiny_model(path: str | os.PathLike, *, hidden_size: int = 128, num_layers: int = 2,
                     num_heads: int = 2, intermediate_size: int = 256, vocab_size: int = 64,
                     tie_word_embeddings: bool = True, seed: int = 0) -> Path:
    """Write a random-init Qwen3 causal LM plus the character tokenizer to `path`.

    Returns `path`. Rebuilding with the same arguments gives bit-identical weights.
    vocab_size is padded above the tokenizer's ids (vLLM and HF accept that).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = Path(path)
    tokenizer = build_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim}: vLLM's CPU attention needs head_dim >= 32; "
                         "raise hidden_size or lower num_heads")
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        head_dim=head_dim, max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None, eos_token_id=vocab()["<eos>"], pad_token_id=vocab()["<pad>"],
        torch_dtype="float32", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Fix generation defaults so vLLM applies none of its own (explicit SamplingParams rule anyway).
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab()["<eos>"]}))
    return path


# Real Qwen3 shapes (random weights): what a benchmark needs to measure realistic sizes offline.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936),
}


def filler_token(i: int) -> str:
    """The token string of filler id i (ids past the character vocabulary)."""
    return f"<|f{i}|>"


def build_covering_tokenizer(vocab_size: int):
    """The character tokenizer, padded with filler tokens so that every id below vocab_size
    decodes to something ("<|f123|>"): vLLM can then detokenize any id a model samples.
    Text still encodes character by character into the first 64 ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    v = vocab()
    if vocab_size < len(v):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the character vocabulary ({len(v)})")
    v.update({filler_token(i): i for i in range(len(v), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="?", clean_up_tokenization_spaces=False)


def build_random_model(path: str | os.PathLike, shape: str, *, dtype="bfloat16", device=None,
                       seed: int = 0, max_shard_size: str = "2GB") -> Path:
    """Write a random-init Qwen3ForCausalLM of a real model's shape, plus a tokenizer that
    covers every id, to `path`; returns `path`.

    shape: "qwen3-0.6b" or "qwen3-4b" (exact Qwen3 dimensions, tied embeddings, rope_theta 1e6,
    max_position_embeddings 40960), or "tiny" (build_tiny_model's model). Weights are
    initialised on `device` (e.g. "cuda": seconds for 4B, where CPU takes minutes) and saved in
    `dtype` as safetensors shards of at most max_shard_size. The tokenizer is the character one
    (ids 0..63) padded with filler tokens up to the vocabulary size.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if shape != "tiny" and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose one of {', '.join(['tiny', *SHAPES])}")
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a torch floating-point dtype")
    path = Path(path)
    if shape == "tiny":
        build_tiny_model(path, seed=seed)
        if torch_dtype != torch.float32:   # re-save in the asked dtype (a few hundred KB)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
            (path / "model.safetensors").unlink()   # (a mapped file stays readable)
            model.save_pretrained(path)
        return path

    dims = SHAPES[shape]
    tokenizer = build_covering_tokenizer(dims["vocab_size"])
    config = Qwen3Config(
        **dims, max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6,
        rms_norm_eps=1e-6, max_window_layers=dims["num_hidden_layers"], use_sliding_window=False,
        bos_token_id=None, eos_token_id=vocab()["<eos>"], pad_token_id=vocab()["<pad>"],
        torch_dtype=str(torch_dtype).removeprefix("torch."),
    )
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.to("cpu")   # save from host memory whatever the safetensors version does with CUDA
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    del model
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab()["<eos>"]}))
    return path


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))
