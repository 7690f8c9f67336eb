"""N-gram (prompt lookup) proposals: the next tokens guessed from the request's own text.

    index = NgramIndex()
    draft = index.propose(tokens, k=4, min_n=1, max_n=12)   # tokens = prompt + output so far

The last n tokens of `tokens` are looked up earlier in `tokens`; the tokens that followed the
match are the proposal, continued periodically where they reach the end (a match p tokens back
means the text repeats with period p). The longest n in [min_n, max_n] that matches wins (among
equally long matches, the most recent); with no match of even min_n tokens there is no proposal.

The index maps each token id to the positions where it occurs, filled incrementally (each call
indexes only the tokens added since the last one), so a step costs the lookup, not the sequence:
at most MAX_CANDIDATES most recent occurrences of the last token are compared backwards.
"""

from __future__ import annotations

MAX_CANDIDATES = 64     # most recent occurrences of the last token compared per lookup


class NgramIndex:
    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}     # token id -> positions (ascending)
        self.indexed = 0                              # tokens[0, indexed) are in `positions`

    def _index(self, tokens: list[int], end: int) -> None:
        for i in range(self.indexed, end):
            self.positions.setdefault(tokens[i], []).append(i)
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        """Up to `k` proposed next tokens (empty when no n-gram of at least `min_n` tokens matches).
        `tokens` only grows between calls (prompt + output of one request)."""
        return self.propose_with_match(tokens, k, min_n, max_n)[0]

    def propose_with_match(self, tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
        """propose(), and the length of the n-gram that matched (0 without a proposal)."""
        L = len(tokens)
        if k <= 0 or L < min_n + 1:
            return [], 0
        self._index(tokens, L - 1)          # the last token is the pattern's end, not a candidate
        cands = self.positions.get(tokens[-1])
        if not cands:
            return [], 0
        best_len, best_end = 0, -1
        for end in reversed(cands[-MAX_CANDIDATES:]):      # most recent first
            n = 1
            while n < max_n and end - n >= 0 and tokens[end - n] == tokens[L - 1 - n]:
                n += 1
            if n > best_len:
                best_len, best_end = n, end
                if n >= max_n:
                    break
        if best_len < min_n:
            return [], 0
        out = tokens[best_end + 1: best_end + 1 + k]
        period = L - 1 - best_end          # a match close to the end: the text repeats with this period
        while len(out) < k:
            out.append(out[len(out) - period])
        return out, best_len
