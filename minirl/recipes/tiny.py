"""A tiny random-init causal LM (it knows nothing until trained) and character tokenizer, built locally
in about a second for tests and the demo. CPU, no network; loads in transformers and vLLM's CPU build.

    python -m minirl.recipes.tiny /tmp/tiny        # writes config, safetensors and tokenizer there
"""

from __future__ import annotations

import json
import os
import string
import sys
from pathlib import Path

SPECIAL = ["<pad>", "<eos>"]
# 62 one-character tokens + 2 specials: a vocabulary of exactly 64 (every id decodes to a character).
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
                     num_heads: int = 2, num_kv_heads: int | None = None, intermediate_size: int = 256,
                     vocab_size: int = 64, tie_word_embeddings: bool = True, seed: int = 0) -> Path:
    """Write a random-init Qwen3 causal LM plus the character tokenizer to `path`; returns it.
    The same arguments give bit-identical weights; vocab_size may exceed the tokenizer's."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    path = Path(path)
    tokenizer = build_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim} < 32 (vLLM CPU attention): raise hidden_size or cut num_heads")
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, head_dim=head_dim,
        num_key_value_heads=num_kv_heads or num_heads, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=None, torch_dtype="float32",
        eos_token_id=vocab()["<eos>"], pad_token_id=vocab()["<pad>"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Fix generation defaults so vLLM applies none of its own (explicit SamplingParams rule anyway).
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab()["<eos>"]}))
    return path


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))
