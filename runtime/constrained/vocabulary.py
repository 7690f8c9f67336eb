"""Build an outlines-core `Vocabulary` from a local HF tokenizer, never from the hub.

outlines-core matches regexes over raw bytes, so every token needs the exact bytes it stands for:
- byte-level BPE (GPT-2, Llama 3, Qwen): each character of the token string maps back to one byte
  through GPT-2's byte-to-unicode table ("Ġ" is a space, "Ċ" a newline);
- sentencepiece style (Llama 2, Mistral): "<0xNN>" byte-fallback tokens are that one byte, and "▁"
  stands for a space;
- added tokens that are not special are their literal text.
Special tokens (eos, bos, chat markers, every added token marked special) are left out, so a grammar
can never emit them; ids at or above `vocab_size` (the model's logits width) are left out too.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import outlines_core

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPM_SPACE = "\u2581"  # "▁"


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: printable stand-in character -> raw byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of eos, bos, pad and every added token marked special."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(tid))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return ids


def _is_byte_level(tokenizer: Any, tokens: dict[str, int]) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        described = f"{backend.decoder} {backend.pre_tokenizer}"
        if "ByteLevel" in described:
            return True
        if "Metaspace" in described or "ByteFallback" in described:
            return False
    table = unicode_to_byte()
    sample = list(tokens)[:2000]
    byte_level = sum(all(ch in table for ch in tok) for tok in sample)
    return byte_level == len(sample) and not any(_SPM_SPACE in tok for tok in sample)


def _token_to_bytes(token: str, byte_level: bool) -> bytes | None:
    if byte_level:
        table = unicode_to_byte()
        if all(ch in table for ch in token):
            return bytes(table[ch] for ch in token)
        return token.encode("utf-8")
    fallback = _BYTE_FALLBACK.match(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return token.replace(_SPM_SPACE, " ").encode("utf-8")


def token_bytes_table(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """Raw bytes of every token id below `vocab_size`; None for special, unknown and empty tokens."""
    tokens: dict[str, int] = tokenizer.get_vocab()
    byte_level = _is_byte_level(tokenizer, tokens)
    special = special_token_ids(tokenizer)
    added_text = {
        int(tid): added.content
        for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if not getattr(added, "special", False)
    }
    table: list[bytes | None] = [None] * vocab_size
    for token, tid in tokens.items():
        if tid >= vocab_size or tid < 0 or tid in special:
            continue
        raw = added_text[tid].encode("utf-8") if tid in added_text else _token_to_bytes(token, byte_level)
        table[tid] = raw or None
    return table


def vocabulary_from_table(table: list[bytes | None], eos_token_id: int) -> outlines_core.Vocabulary:
    """An outlines-core Vocabulary of every non-None entry (eos itself is always left out)."""
    by_bytes: dict[bytes, list[int]] = {}
    for tid, raw in enumerate(table):
        if raw is not None and tid != eos_token_id:
            by_bytes.setdefault(raw, []).append(tid)
    return outlines_core.Vocabulary(eos_token_id, by_bytes)


def build_vocabulary(
    tokenizer: Any, vocab_size: int, eos_token_id: int | None = None
) -> outlines_core.Vocabulary:
    """The outlines-core Vocabulary of `tokenizer`, built offline.

    eos_token_id defaults to the tokenizer's eos; outlines-core allows it only in final states.
    """
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("build_vocabulary needs an eos token id (the tokenizer has none)")
    return vocabulary_from_table(token_bytes_table(tokenizer, vocab_size), int(eos))
