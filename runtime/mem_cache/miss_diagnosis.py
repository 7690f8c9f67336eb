"""Late-divergence miss diagnosis: "your prompts share a long span, but not at the front".

The radix cache only reuses a common *prefix*. A prompt that starts with something unique
(a timestamp, a uuid, the user's name) and then repeats a long system prompt misses the cache
entirely. This keeps a small sketch of recent prompts: content-defined anchors, i.e. hashes of
the K-token windows whose hash falls in a 1/SAMPLE slice, so the sketch does not depend on
where the text sits in the prompt. A new prompt whose anchors re-occur over a span of at least
`min_span` tokens *beyond* its prefix-cache hit is counted as a late-divergence miss.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

logger = logging.getLogger(__name__)

K = 16                 # window length in tokens
SAMPLE = 8             # keep windows whose hash % SAMPLE == 0
MAX_ANCHORS = 200_000  # sketch size bound (LRU)
WARN_EVERY_S = 10.0


class MissDiagnosis:
    def __init__(self, min_span: int = 256):
        self.min_span = min_span
        self.sketch: OrderedDict[int, None] = OrderedDict()
        self.count = 0
        self.last_position: int | None = None
        self._last_warn = 0.0

    @staticmethod
    def anchors(ids: list[int]) -> list[tuple[int, int]]:
        """(position, hash) of the sampled K-token windows of `ids`."""
        out = []
        for i in range(len(ids) - K + 1):
            h = hash(tuple(ids[i:i + K]))
            if h % SAMPLE == 0:
                out.append((i, h))
        return out

    def observe(self, ids: list[int], hit_len: int) -> bool:
        """Checks one newly admitted prompt against the sketch, then adds it. Returns True for a
        late-divergence miss."""
        if len(ids) < self.min_span:
            return False
        anchors = self.anchors(ids)
        shared = [pos for pos, h in anchors if pos >= hit_len and h in self.sketch]
        miss = bool(shared) and shared[-1] + K - shared[0] >= self.min_span
        for _, h in anchors:
            self.sketch[h] = None
            self.sketch.move_to_end(h)
        while len(self.sketch) > MAX_ANCHORS:
            self.sketch.popitem(last=False)
        if miss:
            self.count += 1
            self.last_position = hit_len
            now = time.monotonic()
            if now - self._last_warn > WARN_EVERY_S:
                self._last_warn = now
                logger.warning(
                    "Prefix-cache late-divergence miss: this prompt repeats a %d-token span seen in recent "
                    "prompts, but diverges from the cache at token %d, so the span is recomputed. Put "
                    "per-request text (ids, timestamps, names) after the shared part of the prompt.",
                    shared[-1] + K - shared[0], hit_len)
        return miss
