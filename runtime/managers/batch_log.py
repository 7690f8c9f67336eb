"""Operator log lines of the scheduler, in SGLang's format, at INFO:

    Prefill batch. #new-seq: 2, #new-token: 310, #cached-token: 64, token usage: 0.01, #running-req: 5, #queue-req: 0
    Decode batch. #running-req: 7, #token: 2210, token usage: 0.03, gen throughput (token/s): 92.41, #queue-req: 0

With speculative decoding on, the decode line also has `accept len: 2.31` (tokens per verify pass
since the last decode line: accepted proposals + the model's own token) after the token usage.

One prefill line per step that prefills (new requests or chunks), one decode line every
`decode_log_interval` steps that decode. Off the hot path: a step that logs nothing costs a
counter increment and one pass over the batch's lengths.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batch_planner import StepBatch
    from .scheduler import Scheduler

logger = logging.getLogger("radixlm.scheduler")


class BatchLog:
    def __init__(self, decode_log_interval: int):
        self.decode_log_interval = decode_log_interval
        self.decode_steps = 0
        self.last_time = time.monotonic()
        self.last_generated = 0
        self.last_verify = (0, 0)          # (verify passes, accepted proposals) at the last decode line

    def batch(self, scheduler: Scheduler, batch: StepBatch) -> None:
        """Called once per step, before the forward pass (reads lengths, changes nothing)."""
        if not logger.isEnabledFor(logging.INFO):
            return
        new_seq = new_tok = cached = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            if req.kv_committed_len < req.prompt_len:
                new_seq, new_tok, cached = new_seq + 1, new_tok + n, cached + req.kv_committed_len
        if new_seq:
            logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                        "#running-req: %d, #queue-req: %d", new_seq, new_tok, cached, _usage(scheduler),
                        len(scheduler.running) - new_seq, len(scheduler.waiting))
        if new_seq == len(batch.reqs) or self.decode_log_interval <= 0:
            return
        self.decode_steps += 1
        if self.decode_steps % self.decode_log_interval == 0:
            self._decode_line(scheduler)

    def _decode_line(self, scheduler: Scheduler) -> None:
        now = time.monotonic()
        tokens = scheduler.generated_tokens - self.last_generated
        tput = tokens / (now - self.last_time) if now > self.last_time else 0.0
        self.last_time, self.last_generated = now, scheduler.generated_tokens
        spec = ""
        if scheduler.spec is not None:
            t = scheduler.spec.totals
            verify, accepted = t.verify_ct - self.last_verify[0], t.accepted_tokens - self.last_verify[1]
            self.last_verify = (t.verify_ct, t.accepted_tokens)
            spec = f"accept len: {(accepted + verify) / verify if verify else 0.0:.2f}, "
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %sgen throughput (token/s): "
                    "%.2f, #queue-req: %d", len(scheduler.running), scheduler.kv.used_tokens(), _usage(scheduler),
                    spec, tput, len(scheduler.waiting))


def _usage(scheduler: Scheduler) -> float:
    kv = scheduler.kv
    return kv.used_tokens() / kv.total_tokens if kv.total_tokens else 0.0
