"""Text -> token ids for the request path, and a cheap early check for prompts far over the context.

    encode_texts(tokenizer, texts)                      # == tokenizer(texts)["input_ids"]
    check_prefix_fits(tokenizer, texts, context_len)    # ValueError when a text's head already overflows

HF tokenizers' `__call__` computes offsets and several per-token lists that the runtime never reads;
the Rust `encode_batch_fast` skips offsets (about 3x faster on long texts) and, like `encode_batch`,
runs without the GIL, so a long prompt tokenized on a worker thread barely delays the event loop.
Pure functions: they only read the tokenizer.
"""

from __future__ import annotations

from typing import Any

PREFIX_MARGIN_TOKENS = 64     # slack for the last pre-token of a prefix, which may merge differently


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, special tokens added as `tokenizer(texts)` adds them."""
    fast = getattr(getattr(tokenizer, "_tokenizer", None), "encode_batch_fast", None)
    if fast is None:
        return tokenizer(texts)["input_ids"]
    return [enc.ids for enc in fast(texts, add_special_tokens=True)]


def check_prefix_fits(tokenizer: Any, texts: list[str], context_len: int, prefix_chars: int) -> None:
    """Raises ValueError for a text whose first `prefix_chars` characters alone make more than
    context_len + PREFIX_MARGIN_TOKENS tokens: the whole text cannot fit, so it is refused without
    tokenizing the rest (a multi-megabyte prompt costs milliseconds, not seconds)."""
    heads = [t[:prefix_chars] for t in texts if len(t) > prefix_chars]
    if not heads:
        return
    for ids in encode_texts(tokenizer, heads):
        if len(ids) > context_len + PREFIX_MARGIN_TOKENS:
            raise ValueError(f"The input is longer than the model's context length of {context_len} tokens "
                             f"(its first {prefix_chars} characters alone make {len(ids)} tokens)")
