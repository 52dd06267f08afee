"""Chat messages as the tokens that continue a sampled conversation (multi-turn episodes).

    ids = chat_delta(tokenizer, [{"role": "tool", "content": "42"}])   # after a turn that ended its turn
    end = turn_end(tokenizer)        # what the template closes a turn with: <|im_end|>, <end_of_turn>, ...

Episode.add_messages (minirl/episodes.py) appends both: the sampled turns stay as sampled, only the
new messages are rendered. Tokenizer work only (CPU); no engine.
"""

from __future__ import annotations

BASE = [{"role": "user", "content": "0"}, {"role": "assistant", "content": "0"}]
"""The conversation the new messages are rendered after; its assistant turn stands for a sampled one."""


def _render(tokenizer, messages: list[dict], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def turn_end(tokenizer) -> str:
    """The special token the chat template closes an assistant turn with: the first after the turn's
    content (Gemma's <end_of_turn>, whose eos_token is <eos>; Llama 3's <|eot_id|>), else eos_token."""
    alone = _render(tokenizer, BASE, False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids = [i for i in tokenizer.encode(alone[alone.rfind("0") + 1:], add_special_tokens=False) if i in special]
    return tokenizer.convert_ids_to_tokens(ids[0]) if ids else tokenizer.eos_token or ""


def chat_delta(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` as they continue a conversation whose last turn ended with turn_end:
    template(BASE + messages) after BASE's n-th (last) turn end, tokenized alone. Earlier messages must
    render as alone (the first) and as with one message after them (Qwen3 renders a last assistant turn
    apart); else ValueError."""
    end, alone = turn_end(tokenizer), _render(tokenizer, BASE, False)
    n = alone.count(end) if end else 0
    cut = lambda text: sum(len(p) + len(end) for p in text.split(end)[:n]) if 0 < n <= text.count(end) else len(alone)
    head = _render(tokenizer, BASE + [{"role": "user", "content": "1"}], False)
    full = _render(tokenizer, BASE + list(messages), add_generation_prompt)
    if full[:cut(full)] != head[:cut(head)] or not full.startswith(_render(tokenizer, BASE[:1], False)):
        raise ValueError("the chat template renders earlier messages differently once new ones follow, so "
                         "incremental rendering cannot be exact: render these turns yourself and use ep.append")
    return tokenizer.encode(full[cut(full):], add_special_tokens=False)
