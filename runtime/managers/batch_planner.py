"""BatchPlanner: decides what the next forward pass computes, and finds the KV slots for it.

One step's batch is every running request (decodes: their few uncached tokens; a chunked
prefill: its next chunk) plus newly admitted waiting requests, as extends over

    [cached_len, cached_len + extend_len)   of each request's all_ids.

When decode memory runs out it evicts unlocked cache, then retracts requests (fewest output
tokens first); a retracted request keeps its KV in the tree (evictable) and is recomputed later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixlm.runtime.managers.req import Req
from radixlm.runtime.managers.schedule_policy import PrefillBudget, order_waiting
from radixlm.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.runtime.mem_cache.miss_diagnosis import MissDiagnosis
from radixlm.runtime.router.dp_router import ApproxTree
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

DECODE_RESERVE_CLIP = 4096
IN_BATCH_SHARE = 32


@dataclass
class StepBatch:
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor | None = None

    @property
    def prefix_lens(self) -> list[int]:
        return [r.cached_len for r in self.reqs]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)


class BatchPlanner:
    def __init__(self, args: ServerArgs, tree, req_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 max_running_requests: int):
        self.args = args
        self.tree = tree
        self.req_pool = req_pool
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.max_running = max_running_requests
        self.chunk_tokens = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
        self.new_token_ratio = min(0.4 * args.schedule_conservativeness, 1.0)
        self.num_retractions = 0
        self.prefix_queries = 0       # prompt tokens of first admissions (cumulative)
        self.prefix_hits = 0          # of which came from the cache
        self.miss_diagnosis = MissDiagnosis()

    # ------------------------------------------------------------- plan
    def plan(self, running: list[Req], waiting: list[Req]) -> tuple[StepBatch, list[Req]]:
        """Returns the batch and the requests retracted to the waiting queue.

        Side effects: admitted requests leave `waiting` and join `running` with a row, a locked
        prefix and cached_len set; retracted ones move the other way.
        """
        retracted = self._fit_running(running)
        for r in retracted:
            waiting.insert(0, r)
        batch = StepBatch()
        decoding = [r for r in running if r.cached_len >= r.prompt_len]
        for r in decoding:
            batch.reqs.append(r)
            batch.extend_lens.append(r.extend_len)
        budget = PrefillBudget(
            rem_total_tokens=self._free_tokens() - self._decode_reserve(running) - self._need(batch),
            rem_input_tokens=self.args.max_prefill_tokens, chunk_tokens=self.chunk_tokens,
            rem_reqs=self.max_running - len(running), page_size=self.page_size)
        budget.rem_reqs += len(running) - len(decoding)   # chunked requests already hold a row
        for r in running:
            if r.cached_len < r.prompt_len:                 # a chunked prefill continues first
                n = budget.take(r, r.extend_len, self._reserve_of(r))
                if n:
                    batch.reqs.append(r)
                    batch.extend_lens.append(n)
        self._admit(batch, budget, running, waiting)
        if batch.reqs:
            batch.out_cache_loc = self._alloc(batch)
        return batch, retracted

    def _admit(self, batch: StepBatch, budget: PrefillBudget, running: list[Req], waiting: list[Req]) -> None:
        """Admits waiting requests in policy order until a budget runs out.

        In-batch prefix sharing: a request whose uncached part repeats (>= IN_BATCH_SHARE tokens)
        a prompt being prefilled in this step, or by a running chunked prefill, waits one step;
        by then that prompt is in the tree and this request hits it instead of recomputing it.
        """
        if not waiting:
            return
        radix = not self.args.disable_radix_cache
        in_flight = ApproxTree()
        for r in running:
            if r.cached_len < r.prompt_len:
                in_flight.insert(r.origin_input_ids)
        for req in order_waiting(self.args.schedule_policy, waiting, self.tree, radix):
            admitted = self._try_admit(req, batch, budget, in_flight if radix else None)
            if admitted is None:
                continue
            if not admitted:
                break
            waiting.remove(req)
            running.append(req)
            in_flight.insert(req.origin_input_ids)

    def _try_admit(self, req: Req, batch: StepBatch, budget: PrefillBudget,
                   in_flight: ApproxTree | None) -> bool | None:
        """True: admitted; False: out of budget (stop admitting); None: deferred one step."""
        limit = req.max_prefix_for_match() // self.page_size * self.page_size
        match = self.tree.match_prefix(req.all_ids[:limit])
        prefix_len = len(match.kv_indices)
        if in_flight is not None and in_flight.match(req.origin_input_ids) >= prefix_len + IN_BATCH_SHARE:
            return None
        evictable_before = self.tree.evictable_size()
        self.tree.inc_lock_ref(match.last_node)
        budget.rem_total_tokens -= evictable_before - self.tree.evictable_size()
        n = budget.take(req, req.seq_len - prefix_len, self._reserve_of(req))
        row = self.req_pool.alloc() if n else None
        if row is None:
            self.tree.dec_lock_ref(match.last_node)
            if n:
                budget.taken.pop()
            return False
        req.req_pool_idx = row
        req.prefix_indices = match.kv_indices
        req.last_node = match.last_node
        req.cached_len = prefix_len
        if prefix_len:
            self.req_pool.req_to_token[row, :prefix_len] = match.kv_indices.to(self.req_pool.req_to_token.dtype)
        if req.num_retractions == 0:
            req.cached_tokens = prefix_len
            self.prefix_queries += req.prompt_len
            self.prefix_hits += prefix_len
            if not self.args.disable_radix_cache:
                self.miss_diagnosis.observe(req.origin_input_ids, prefix_len)
        batch.reqs.append(req)
        batch.extend_lens.append(n)
        return True

    # ------------------------------------------------------------ memory
    def _free_tokens(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    def _reserve_of(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens(), DECODE_RESERVE_CLIP) * self.new_token_ratio)

    def _decode_reserve(self, running: list[Req]) -> int:
        return sum(self._reserve_of(r) for r in running)

    def _need(self, batch: StepBatch) -> int:
        """KV slots that allocating this batch will consume (whole new pages)."""
        P = self.page_size
        return sum((-(-(r.cached_len + n) // P) - -(-r.cached_len // P)) * P
                   for r, n in zip(batch.reqs, batch.extend_lens))

    def _ensure(self, need: int) -> bool:
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available_size() >= need

    def _fit_running(self, running: list[Req]) -> list[Req]:
        """Makes room for every decoding request's next tokens, retracting requests if needed."""
        retracted: list[Req] = []
        while True:
            decoding = [r for r in running if r.cached_len >= r.prompt_len]
            need = self._need(StepBatch(decoding, [r.extend_len for r in decoding]))
            if self._ensure(need) or len(running) <= 1:
                return retracted
            victim = min(running, key=lambda r: (len(r.output_ids), -r.arrival_time))
            running.remove(victim)
            self.tree.cache_finished_req(victim)
            victim.reset_for_recompute()
            retracted.append(victim)
            self.num_retractions += 1
            logger.debug("retracted %s (%d output tokens) to free KV", victim.rid, len(victim.output_ids))

    def _alloc(self, batch: StepBatch) -> torch.Tensor:
        need = self._need(batch)
        if not self._ensure(need):
            raise RuntimeError(f"KV allocation failed after admission checks (need {need}); this is a bug")
        table = self.req_pool.req_to_token
        last = [int(table[r.req_pool_idx, r.cached_len - 1]) if r.cached_len else 0 for r in batch.reqs]
        ends = [r.cached_len + n for r, n in zip(batch.reqs, batch.extend_lens)]
        loc = self.allocator.alloc_extend(batch.prefix_lens, ends, last)
        assert loc is not None
        return loc
