"""Reuse the token ids a chat turn was generated with when the next turn sends it back as history.

An agent loop sends the whole conversation every turn. Re-tokenizing the model's own earlier output
often gives different ids than the ones it generated (BPE merges text the model emitted as separate
tokens), so the radix cache would miss from that point on. `GeneratedHistory` remembers recent
completions as (prompt text, prompt ids, output ids). A new prompt whose text starts with a remembered
prompt reuses those prompt ids, then the output ids for as long as the new text repeats the output's
bytes exactly, and tokenizes only the rest. The ids then mean exactly the text the template rendered,
and the prefix the earlier turn computed is found in the cache.

Consequences: such a prompt's ids (and `usage.prompt_tokens`) can differ from a fresh tokenization of
the same text. Never reused: special tokens of the output (they stop the reuse), and anything when
the new prompt holds client text with special-token text in it (those prompts tokenize fresh, so
typed markers stay plain text). Entries live in an LRU of `max_entries`; thread-safe enough for the
single asyncio thread it is used from (no locking).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .chat_template import ChatPrompt


@dataclass(frozen=True)
class _Turn:
    prompt_text: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


class GeneratedHistory:
    """Recent (prompt, output) token ids, keyed by prompt text."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_entries: int = 512):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._turns: OrderedDict[tuple[str, tuple[int, ...]], _Turn] = OrderedDict()
        self._token_bytes: list[bytes | None] | None = None
        self.reused_tokens = 0      # output ids reused so far (for tests and logs)

    def record(self, prompt_text: str, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Remember one finished choice. Mutates the LRU."""
        key = (prompt_text, tuple(output_ids))
        self._turns[key] = _Turn(prompt_text, tuple(prompt_ids), tuple(output_ids))
        self._turns.move_to_end(key)
        while len(self._turns) > self.max_entries:
            self._turns.popitem(last=False)

    def encode(self, prompt: ChatPrompt) -> list[int]:
        """The prompt's ids, reusing a remembered turn's ids where the text repeats it."""
        text = prompt.text
        if len(prompt.pieces) > 1 or not self._turns:   # client text with special-token text: fresh
            return prompt.token_ids(self.tokenizer)
        best: tuple[int, list[int]] | None = None        # (chars covered, ids)
        for turn in reversed(self._turns.values()):
            if len(turn.prompt_text) > len(text) or not text.startswith(turn.prompt_text):
                continue
            if best is not None and len(turn.prompt_text) + len(turn.output_ids) <= best[0]:
                continue
            covered, ids = self._extend(turn, text)
            if best is None or covered > best[0]:
                best = (covered, ids)
        if best is None:
            return prompt.token_ids(self.tokenizer)
        covered, ids = best
        return ids + prompt.token_ids(self.tokenizer, start=covered)

    def _extend(self, turn: _Turn, text: str) -> tuple[int, list[int]]:
        """(chars of text covered, ids): the prompt ids plus the output ids the text repeats."""
        table = self._table()
        data = text.encode("utf-8")
        pos = len(turn.prompt_text.encode("utf-8"))
        boundaries = [(pos, 0)]         # (byte offset, output tokens) at char boundaries
        for k, tid in enumerate(turn.output_ids):
            piece = table[tid] if 0 <= tid < len(table) else None
            if not piece or not data.startswith(piece, pos):
                break
            pos += len(piece)
            if pos == len(data) or (data[pos] & 0xC0) != 0x80:
                boundaries.append((pos, k + 1))
        pos, count = boundaries[-1]
        self.reused_tokens += count
        return len(data[:pos].decode("utf-8")), list(turn.prompt_ids) + list(turn.output_ids[:count])

    def _table(self) -> list[bytes | None]:
        if self._token_bytes is None:
            from ..constrained.vocabulary import token_bytes_table

            self._token_bytes = token_bytes_table(self.tokenizer, self.vocab_size)
        return self._token_bytes
