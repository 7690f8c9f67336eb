"""BatchPlanner: decides what the next forward pass computes, and finds the KV slots for it.

One step's batch is every running request (decodes: their few uncached tokens; a chunked
prefill: its next chunk) plus newly admitted waiting requests, as extends over

    [kv_committed_len, kv_committed_len + extend_len)   of each request's all_ids.

When decode memory runs out it evicts unlocked cache, then retracts requests (fewest output
tokens first); a retracted request keeps its KV in the tree (evictable) and is recomputed later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..mem_cache.chunked_trie import ChunkedTrie
from ..mem_cache.kv_manager import KVManager
from ..mem_cache.miss_diagnosis import MissDiagnosis
from ..server_args import ServerArgs
from .prefill_pace import PrefillPace
from .req import Req
from .schedule_policy import PrefillBudget, order_waiting

logger = logging.getLogger(__name__)

DECODE_RESERVE_CLIP = 4096
IN_BATCH_SHARE = 32


@dataclass
class StepBatch:
    """One forward pass (`reqs`, `extend_lens`, `out_cache_loc`), and the queue moves it implies:
    `admitted` leave the waiting queue for the running one, `retracted` go back to the front of
    the waiting queue (see `requeue`)."""

    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor | None = None
    admitted: list[Req] = field(default_factory=list)
    retracted: list[Req] = field(default_factory=list)
    prompt_tokens: int = 0          # of extend_lens, the rows that prefill prompts (not decodes)

    @property
    def prefix_lens(self) -> list[int]:
        return [req.kv_committed_len for req in self.reqs]

    @property
    def seq_lens(self) -> list[int]:
        return [req.kv_committed_len + n for req, n in zip(self.reqs, self.extend_lens)]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)


def requeue(batch: StepBatch, running: list[Req], waiting: list[Req]) -> None:
    """Applies a plan's queue moves to the caller's queues (the scheduler owns them)."""
    for req in batch.retracted:
        running.remove(req)
    waiting[:0] = reversed(batch.retracted)      # the last one retracted goes first
    for req in batch.admitted:
        waiting.remove(req)
        running.append(req)


@dataclass
class PlannerStats:
    """Cumulative admission counters (for metrics and /get_server_info)."""

    num_preemptions: int             # requests retracted to free KV
    prefix_cache_queries: int        # prompt tokens of first admissions
    prefix_cache_hits: int           # of which came from the cache
    late_divergence_misses: int
    last_divergence_position: int | None


class BatchPlanner:
    """Admission, chunking and preemption over one KVManager; it never touches slots itself."""

    def __init__(self, args: ServerArgs, kv: KVManager, max_running_requests: int):
        self.args = args
        self.kv = kv
        self.page_size = kv.page_size
        self.max_running = max_running_requests
        self.chunk_tokens = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
        self.pace = PrefillPace(args.prefill_step_tokens or 0, args.max_prefill_tokens, measured=args.tp_size == 1)
        self.new_token_ratio = min(0.4 * args.schedule_conservativeness, 1.0)
        self.num_preemptions = 0
        self.prefix_queries = 0       # prompt tokens of first admissions (cumulative)
        self.prefix_hits = 0          # of which came from the cache
        self.miss_diagnosis = MissDiagnosis()

    # ------------------------------------------------------------- plan
    def plan(self, running: list[Req], waiting: list[Req]) -> StepBatch:
        """Returns the next batch, its KV slots allocated and written into the requests' rows.

        Reads the scheduler's queues and never changes them: the batch says which requests the
        scheduler moves (`requeue`). Admitted requests get a row, a locked prefix and kv_committed_len
        set; retracted ones (preempted for memory) have given all their KV back.
        """
        batch = StepBatch()
        batch.retracted = self._fit_running(running)
        running = [req for req in running if req not in batch.retracted]
        decoding = [req for req in running if req.kv_committed_len >= req.prompt_len]
        for req in decoding:
            batch.reqs.append(req)
            batch.extend_lens.append(req.extend_len + len(req.draft_ids))   # + speculative proposals
        budget = PrefillBudget(
            rem_total_tokens=self.kv.available_tokens() - self._decode_reserve(running) - self._need(batch),
            rem_input_tokens=self._prefill_room(sum(batch.extend_lens)), chunk_tokens=self.chunk_tokens,
            rem_reqs=self.max_running - len(running), page_size=self.page_size)
        budget.rem_reqs += len(running) - len(decoding)   # chunked requests already hold a row
        for req in running:
            if req.kv_committed_len < req.prompt_len:             # a chunked prefill continues first
                n = budget.take(req.extend_len, self._reserve_of(req))
                if n:
                    batch.reqs.append(req)
                    batch.extend_lens.append(n)
                    batch.prompt_tokens += n
        self._admit(batch, budget, running, [*reversed(batch.retracted), *waiting])
        if batch.reqs:
            batch.out_cache_loc = self._alloc(batch)
        return batch

    def _prefill_room(self, decode_tokens: int) -> int:
        """New prompt tokens this step may take: --max-prefill-tokens counts the whole step, decode
        tokens included (as vLLM's max_num_batched_tokens and SGLang's mixed chunk do), so a full
        step has exactly that many rows: on an AMX Xeon oneDNN's bf16 matmuls cost 15-20% more per
        row just past 2,048 rows than at 2,048. Prefill keeps at least a quarter of it whatever
        the decodes take, so waiting requests are never starved by a large decode batch."""
        limit = self.args.max_prefill_tokens
        return max(limit - decode_tokens, limit // 4)

    def _admit(self, batch: StepBatch, budget: PrefillBudget, running: list[Req], waiting: list[Req]) -> None:
        """Admits waiting requests in policy order until a budget runs out (into `batch.admitted`).

        In-batch prefix sharing: a request whose uncached part repeats (>= IN_BATCH_SHARE tokens)
        a prompt being prefilled in this step, or by a running chunked prefill, waits one step;
        by then that prompt is in the tree and this request hits it instead of recomputing it.

        Once the step holds the pace's target of new prompt tokens (--prefill-step-tokens,
        prefill_pace.py) it takes no further request.
        """
        if not waiting:
            return
        step_target = self.pace.target()
        radix = not self.args.disable_radix_cache
        in_flight = ChunkedTrie()
        for req in running:
            if req.kv_committed_len < req.prompt_len:
                in_flight.insert(req.origin_input_ids)
        for req in order_waiting(self.args.schedule_policy, waiting, self.kv.prefix_cache, radix):
            if step_target > 0 and batch.prompt_tokens >= step_target:
                break
            admitted = self._try_admit(req, batch, budget, in_flight if radix else None)
            if admitted is None:
                continue
            if not admitted:
                break
            batch.admitted.append(req)
            batch.prompt_tokens += batch.extend_lens[-1]
            in_flight.insert(req.origin_input_ids)

    def _try_admit(self, req: Req, batch: StepBatch, budget: PrefillBudget,
                   in_flight: ChunkedTrie | None) -> bool | None:
        """True: admitted; False: out of budget (stop admitting); None: deferred one step."""
        match = self.kv.match_prefix(req.all_ids[: req.max_prefix_for_match()])
        prefix_len = len(match.kv_indices)
        if in_flight is not None and in_flight.match(req.origin_input_ids) >= prefix_len + IN_BATCH_SHARE:
            return None
        budget.rem_total_tokens -= self.kv.lock(match.last_node)
        n = budget.take(req.seq_len - prefix_len, self._reserve_of(req))
        if not n or not self.kv.admit(req, match):
            self.kv.unlock(match.last_node)
            return False
        if req.num_preemptions == 0:
            req.cached_tokens = prefix_len
            self.prefix_queries += req.prompt_len
            self.prefix_hits += prefix_len
            if not self.args.disable_radix_cache:
                self.miss_diagnosis.observe(req.origin_input_ids, prefix_len)
        batch.reqs.append(req)
        batch.extend_lens.append(n)
        return True

    # ------------------------------------------------------------ memory
    def _reserve_of(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens(), DECODE_RESERVE_CLIP) * self.new_token_ratio)

    def _decode_reserve(self, running: list[Req]) -> int:
        return sum(self._reserve_of(req) for req in running)

    def _need(self, batch: StepBatch) -> int:
        """KV slots that allocating this batch will consume (whole new pages)."""
        return self.kv.new_slots_needed(batch.prefix_lens, batch.seq_lens)

    def _fit_running(self, running: list[Req]) -> list[Req]:
        """Makes room for every decoding request's next tokens; returns the requests it retracted
        (fewest output tokens first) to get it. Does not change `running`."""
        running = list(running)
        retracted: list[Req] = []
        while True:
            decoding = [req for req in running if req.kv_committed_len >= req.prompt_len]
            need = self._need(StepBatch(decoding, [req.extend_len + len(req.draft_ids) for req in decoding]))
            if self.kv.ensure_free(need):
                return retracted
            if any(req.draft_ids for req in decoding):      # drop speculation before preempting anyone
                for req in decoding:
                    req.draft_ids = []
                continue
            if len(running) <= 1:
                return retracted
            victim = min(running, key=lambda req: (len(req.output_ids), -req.arrival_time))
            running.remove(victim)
            victim.draft_ids = []
            self.kv.cache_finished_req(victim)      # no row, lock or prefix left: recomputed later
            victim.num_preemptions += 1
            retracted.append(victim)
            self.num_preemptions += 1
            logger.debug("retracted %s (%d output tokens) to free KV", victim.rid, len(victim.output_ids))

    def _alloc(self, batch: StepBatch) -> torch.Tensor:
        loc = self.kv.alloc_extend(batch.reqs, batch.extend_lens)
        if loc is None:
            raise RuntimeError(f"KV allocation failed after admission checks (need {self._need(batch)}); "
                               "this is a bug")
        return loc

    def stats(self) -> PlannerStats:
        return PlannerStats(self.num_preemptions, self.prefix_queries, self.prefix_hits,
                            self.miss_diagnosis.count, self.miss_diagnosis.last_position)
