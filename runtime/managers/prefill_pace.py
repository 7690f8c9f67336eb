"""How many new prompt tokens a step takes before it admits no further waiting request
(--prefill-step-tokens; BatchPlanner._admit applies it).

Every request prefilled in a step gets its first token when the step ends, so a burst packed
into 2,048-token steps waits, request by request, for the whole step that finishes it (about
1.2 s each for SmolLM2 on 2 Zen 4 cores). Steps of a few whole prompts give each its first token
when its own prompt is done; what they cost is the fixed part of a step (the scheduler's own
work, the weights streamed once more), a few ms. "auto" (-1, the CPU default) sizes steps by time,
not tokens: as many tokens as about STEP_SECONDS of this server's measured prefill, so a CPU or
model twice as fast takes twice the tokens and the fixed part stays a few percent of each step.
"""

from __future__ import annotations

import logging

from ..utils import align_down

logger = logging.getLogger(__name__)

AUTO = -1
STEP_SECONDS = 0.3      # a 512-token step of SmolLM2 on 2 Zen 4 cores; the fixed part is 2-4% of it
UNMEASURED = 512        # auto's target until a prefill step has been timed
MIN_TOKENS = 128
MIN_ROWS = 64           # steps smaller than this are mostly fixed cost: not timed
EMA = 0.25              # weight of the newest step in the running seconds-per-row


class PrefillPace:
    """setting: 0 off (steps fill --max-prefill-tokens), N > 0 that many tokens, AUTO by time
    (`measured=False` keeps it at UNMEASURED: tensor-parallel ranks must plan alike)."""

    def __init__(self, setting: int, max_tokens: int, measured: bool = True):
        self.setting = setting
        self.max_tokens = max_tokens
        self.measured = measured
        self.seconds_per_row: float | None = None
        self.logged = 0         # the target last logged: logged again when it moves by half

    def target(self) -> int:
        """New prompt tokens past which a step takes no further request (0: no such limit)."""
        if self.setting != AUTO:
            return max(self.setting, 0)
        if self.seconds_per_row is None:
            return min(UNMEASURED, self.max_tokens)
        tokens = align_down(int(STEP_SECONDS / self.seconds_per_row), 64)
        return max(MIN_TOKENS, min(tokens, self.max_tokens))

    def observe(self, rows: int, seconds: float) -> None:
        """One prefill step's wall time: `rows` tokens computed in all (prompts and decodes)."""
        if self.setting != AUTO or not self.measured or rows < MIN_ROWS or seconds <= 0:
            return
        per_row = seconds / rows
        old = self.seconds_per_row
        self.seconds_per_row = per_row if old is None else (1 - EMA) * old + EMA * per_row
        target = self.target()
        if not self.logged or 2 * abs(target - self.logged) >= self.logged:
            logger.info("Prefill steps: new requests up to %d prompt tokens a step (auto: about %.1f s of "
                        "prefill at %.2f ms per token)", target, STEP_SECONDS, self.seconds_per_row * 1e3)
            self.logged = target
