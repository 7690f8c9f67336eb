"""Model-free scheduling fixtures: real Req, KVManager and BatchPlanner, and a fake forward pass.

`FakeLoop` drives the planner the way `Scheduler.step` does, through the same calls (plan,
`requeue`, `KVManager.commit`, append one token per request it reports ready, release finished
requests), with the next token a deterministic function of the sequence instead of a model, and
checks after every step that each KV slot is in exactly one place: free, in the prefix cache, or owned by a request.
"""

from __future__ import annotations

import torch

from radixlm.runtime.managers.batch_planner import BatchPlanner, StepBatch, requeue
from radixlm.runtime.managers.io_struct import TokenizedGenerateReq
from radixlm.runtime.managers.req import Req
from radixlm.runtime.mem_cache.kv_manager import KVManager
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

CONTEXT_LEN = 256


def make_req(rid: str, ids: list[int], max_new_tokens: int = 8, priority: int = 0, **sampling) -> Req:
    """A real Req, built from the wire message as the scheduler builds it."""
    params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    return Req.from_wire(TokenizedGenerateReq(rid=rid, input_ids=list(ids), sampling_params=params,
                                              priority=priority))


def make_kv(total_tokens: int, page_size: int = 1, max_running: int = 8,
            disable_radix_cache: bool = False) -> KVManager:
    return KVManager(total_tokens // page_size, page_size, max_running, CONTEXT_LEN, "cpu", disable_radix_cache)


def next_token(req: Req) -> int:
    """A deterministic stand-in for the model's greedy choice."""
    return 3 + (sum(req.all_ids) * 31 + req.seq_len) % 97


def owned_pages(kv: KVManager, req: Req) -> set[int]:
    row = kv.req_to_token_pool.req_to_token[req.req_pool_idx]
    return set((row[len(req.prefix_indices): req.kv_committed_len].long() // kv.page_size).tolist())


def assert_slots_partitioned(kv: KVManager, running: list[Req]) -> None:
    """free + cached + request-owned == total, with no page in two places."""
    P = kv.page_size
    cache_pages = set((kv.prefix_cache.all_values() // P).tolist())
    assert len(cache_pages) * P == kv.prefix_cache.total_size()
    seen = set(cache_pages)
    for req in running:
        if req.req_pool_idx is None:
            continue
        pages = owned_pages(kv, req)
        assert not pages & seen, f"{req.rid} shares a page it does not own"
        seen |= pages
    assert len(seen) * P + kv.free_tokens() == kv.total_tokens
    assert kv.prefix_cache.evictable_size() + kv.prefix_cache.protected_size() == kv.prefix_cache.total_size()


class FakeLoop:
    def __init__(self, kv: KVManager, max_running: int = 8, **server_args):
        # unresolved args: pin the prefill budgets the tests were written for (resolved() picks per device)
        server_args.setdefault("chunked_prefill_size", 8192)
        server_args.setdefault("max_prefill_tokens", 16384)
        server_args.setdefault("prefill_step_tokens", 0)
        self.args = ServerArgs(**server_args)
        self.kv = kv
        self.planner = BatchPlanner(self.args, kv, max_running)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.finished: list[Req] = []
        self.batches: list[StepBatch] = []

    def submit(self, *reqs: Req) -> None:
        self.waiting.extend(reqs)

    def step(self) -> StepBatch:
        batch = self.planner.plan(self.running, self.waiting)
        requeue(batch, self.running, self.waiting)
        self.batches.append(batch)
        if batch.reqs:
            assert batch.out_cache_loc is not None and len(batch.out_cache_loc) == sum(batch.extend_lens)
            table = self.kv.req_to_token_pool.req_to_token
            offset = 0
            for req, n in zip(batch.reqs, batch.extend_lens):   # the manager wrote this pass's slots
                row = table[req.req_pool_idx, req.kv_committed_len: req.kv_committed_len + n].long()
                assert torch.equal(row, batch.out_cache_loc[offset: offset + n])
                offset += n
        for i in self.kv.commit(batch.reqs, batch.extend_lens):
            req = batch.reqs[i]
            req.output_ids.append(next_token(req))
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                req.finished_reason = {"type": "length"}
                self.running.remove(req)
                self.kv.cache_finished_req(req)
                self.finished.append(req)
        assert_slots_partitioned(self.kv, self.running)
        return batch

    def run(self, max_steps: int = 1000) -> None:
        steps = 0
        while self.waiting or self.running:
            self.step()
            steps += 1
            assert steps < max_steps, "the planner made no progress"
        assert self.kv.is_fully_free()
