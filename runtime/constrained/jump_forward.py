"""Jump-forward decoding: find the text a grammar forces next, and the tokens for it.

Forced text. For an index state s, let C(s) be every byte string the grammar may still produce. The
forced text F(s) is the longest common prefix of C(s); it satisfies

    F(s) = ""                                    if s is final (stopping here is allowed)
    F(s) = LCP over allowed tokens t of  bytes(t) + F(next(s, t))

`ForcedTextFinder` evaluates this with a memo per state. Whenever it gives up (too many allowed tokens,
too deep, too many states, a cycle) it uses the common prefix of the allowed tokens' bytes, or "", for
that state, which yields a prefix of the true F: the answer is always safe, only possibly shorter. Memo entries are shared by all requests of one
compiled grammar.

Tokens for the forced text. The tokens appended must be the ones the tokenizer would produce, but BPE
merges can cross the boundary between already generated text and the forced text (for example "," +
'"key"' may pre-tokenize as one punctuation run). `retokenize_forced` is conservative: it accepts the
jump only when encode(prev_text + forced) == encode(prev_text) + tail and the tail's bytes are exactly
the forced text. A merge across the far end (the forced text with what the model writes next) is not
prevented; grammars whose forced text ends in punctuation before letters or digits avoid it in practice.
"""

from __future__ import annotations

import threading
from typing import Any

import outlines_core


class ForcedTextFinder:
    """Computes F(state) for one Index, with limits so a call gives up quickly on open states."""

    def __init__(
        self,
        index: outlines_core.Index,
        token_bytes: list[bytes | None],
        max_branch: int = 32,
        max_scan: int = 16384,
        max_depth: int = 64,
        max_states: int = 256,
    ) -> None:
        self.index = index
        self.token_bytes = token_bytes
        self.max_branch = max_branch  # recurse into at most this many allowed tokens
        self.max_scan = max_scan  # with more allowed tokens than this, do not even compare them
        self.max_depth = max_depth
        self.max_states = max_states
        self._memo: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def forced_bytes(self, state: int) -> bytes:
        """F(state) as bytes ("" when nothing is forced). Thread-safe; memoized per state."""
        with self._lock:
            cached = self._memo.get(state)
            if cached is not None:
                return cached
            budget = [self.max_states]
            return self._solve(state, depth=0, in_progress=set(), budget=budget)

    def _solve(self, state: int, depth: int, in_progress: set[int], budget: list[int]) -> bytes:
        cached = self._memo.get(state)
        if cached is not None:
            return cached
        if state in in_progress or depth >= self.max_depth or budget[0] <= 0:
            return b""  # a cycle or a limit: "" is a safe lower bound, and is not memoized
        budget[0] -= 1
        result = self._expand(state, depth, in_progress, budget)
        self._memo[state] = result
        return result

    def _expand(self, state: int, depth: int, in_progress: set[int], budget: list[int]) -> bytes:
        if self.index.is_final_state(state):
            return b""
        tokens = self.index.get_allowed_tokens(state) or []
        if not tokens or len(tokens) > self.max_scan:
            return b""
        pieces = [self.token_bytes[t] if t < len(self.token_bytes) else None for t in tokens]
        if any(p is None for p in pieces):
            return b""
        common = _common_prefix(pieces)  # type: ignore[arg-type]
        if not common or len(tokens) > self.max_branch:
            return common  # every continuation starts with some token, so with `common`; no recursion
        in_progress.add(state)
        result: bytes | None = None
        for tid, piece in sorted(zip(tokens, pieces, strict=True), key=lambda item: -len(item[1])):  # type: ignore[arg-type]
            if result is not None and not result.startswith(piece):
                result = _common_prefix([result, piece])  # they differ within `piece`: its tail is moot
            else:
                next_state = self.index.get_next_state(state, tid)
                tail = b"" if next_state is None else self._solve(next_state, depth + 1, in_progress, budget)
                candidate = piece + tail
                result = candidate if result is None else _common_prefix([result, candidate])
            if result == common:
                break  # every candidate starts with `common`; the prefix cannot shrink below it
        in_progress.discard(state)
        return result or b""


def _common_prefix(items: list[bytes]) -> bytes:
    first, last = min(items), max(items)
    n = 0
    limit = min(len(first), len(last))
    while n < limit and first[n] == last[n]:
        n += 1
    return first[:n]


def valid_utf8_prefix(raw: bytes) -> str:
    """The longest prefix of `raw` that is complete UTF-8, decoded ("" if it starts mid-character)."""
    for cut in range(len(raw), max(len(raw) - 4, -1), -1):
        try:
            return raw[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def retokenize_forced(tokenizer: Any, prev_text: str, forced: str) -> list[int] | None:
    """Token ids for `forced` as the tokenizer would write them after `prev_text`, or None.

    None when the tokenizer merges across the boundary (encode(prev + forced) does not start with
    encode(prev)).
    """
    prev_ids = list(tokenizer.encode(prev_text, add_special_tokens=False)) if prev_text else []
    full_ids = list(tokenizer.encode(prev_text + forced, add_special_tokens=False))
    if full_ids[: len(prev_ids)] != prev_ids:
        return None
    tail = full_ids[len(prev_ids) :]
    return tail or None
