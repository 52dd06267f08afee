"""Random-init models of real shapes for benchmarks and GPU tests: Qwen3 dimensions with the
real 151,936-token vocabulary, and a tokenizer that decodes every id (nothing is downloaded).

    python benchmarks/models.py qwen3-0.6b /tmp/models/qwen3-0.6b [cuda]

Hardware: any (initialising on CUDA takes seconds for 4B, on CPU minutes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minirl.recipes.tiny import build_tiny_model, vocab  # noqa: E402

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
}
"""Real Qwen3 dimensions; embeddings are tied unless a shape says tie_word_embeddings=False (8B)."""


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

    shape: a SHAPES key, e.g. "qwen3-0.6b" (exact Qwen3 dimensions, rope_theta 1e6,
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
        **{"tie_word_embeddings": True, **dims}, max_position_embeddings=40960, rope_theta=1e6,
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
    print(build_random_model(sys.argv[2], sys.argv[1], device=sys.argv[3] if len(sys.argv) > 3 else None))
