"""Admission control: refuse new requests with 503 + `Retry-After` when too many are waiting.

`--max-queued-requests N` bounds the queue in front of the schedulers. What counts as queued:

    in_flight  sub-requests the TokenizerManager has sent and not yet seen finish (a batch item
               and each of n > 1 samples is one sub-request, like one row in the scheduler)
    capacity   sub-requests the schedulers can run at once: max_running_requests x dp_size
    queued     max(in_flight - capacity, 0)

A new call that brings `incoming` sub-requests is refused when `queued` would then exceed N. The
rule is exact, cheap and needs no round trip to the schedulers. When the KV pool, not the row
count, limits the batch, more than N requests may wait inside the scheduler; lower
`--max-running-requests` to tighten the bound. An idle server never refuses (so one batch larger
than capacity + N still runs), and requests already admitted are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

RETRY_AFTER_S = 1


class OverloadedError(Exception):
    """Raised before anything is sent to the scheduler; the HTTP layer answers 503 with
    `Retry-After` (errors.to_api_error reads `status_code` and `headers`)."""

    status_code = 503

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


@dataclass(frozen=True)
class AdmissionControl:
    max_queued: int | None      # None: no limit
    capacity: int               # sub-requests the schedulers run at once

    def queued(self, in_flight: int) -> int:
        return max(in_flight - self.capacity, 0)

    def check(self, in_flight: int, incoming: int) -> None:
        """Raises OverloadedError when admitting `incoming` more sub-requests would leave more
        than `max_queued` waiting. Never raises when nothing is in flight."""
        if self.max_queued is None or in_flight == 0:
            return
        if self.queued(in_flight + incoming) > self.max_queued:
            raise OverloadedError(
                f"The server is overloaded: {self.queued(in_flight)} request(s) are already waiting "
                f"(--max-queued-requests {self.max_queued}); retry later")
