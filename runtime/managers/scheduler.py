"""The scheduler process: receive, plan, run, process. One loop, read aloud:

    while True:
        recv_requests()                 # new requests, aborts, control messages
        batch = planner.plan(...)       # running decodes + chunked prefill + admitted waiting
        logits = runner.forward(batch)  # one forward pass over the paged KV
        process(batch, logits)          # sample, stop rules, radix cache, emit token ids

When nothing can run it blocks on the socket (with a timeout for timers), so an idle server
costs no CPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import torch

from ..mem_cache.kv_event_publisher import make_kv_events
from ..mem_cache.kv_manager import KVManager
from ..mem_cache.session_locks import SessionLocks
from ..model_executor.forward_batch import ForwardMode
from ..model_executor.model_runner import ModelRunner
from ..server_args import ServerArgs
from .batch_log import BatchLog
from .batch_planner import BatchPlanner, StepBatch, requeue
from .grammar_queue import GrammarQueue
from .io_struct import (
    AbortReq,
    BatchTokenIDOut,
    CloseSessionReq,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateOut,
    GetInternalStateReq,
    OpenSessionReq,
    SchedulerStats,
    StepTime,
    TokenizedGenerateReq,
)
from .output_processor import OutputProcessor
from .req import Req

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
STATS_INTERVAL = 0.5


class Scheduler:
    def __init__(self, server_args: ServerArgs, tp_rank: int = 0, dp_rank: int = 0):
        self.args = server_args
        self.tp_rank, self.dp_rank = tp_rank, dp_rank
        self.runner = runner = ModelRunner(server_args, tp_rank, dp_rank)
        self.kv_events, self.kv_event_publisher = make_kv_events(
            server_args.kv_events_config, runner.page_size, str(runner.device),
            not server_args.disable_radix_cache, tp_rank, dp_rank)
        self.kv = KVManager(runner.num_pages, runner.page_size, runner.max_running_requests, runner.context_len,
                            runner.device, server_args.disable_radix_cache, self.kv_events)
        self.prefix_cache = self.kv.prefix_cache
        self.sessions = SessionLocks(self.kv)
        self.planner = BatchPlanner(server_args, self.kv, runner.max_running_requests)
        from ..hf_tokenizer import get_tokenizer

        self.tokenizer = get_tokenizer(server_args.tokenizer_path)
        cfg = runner.model_config
        self.output = OutputProcessor(self.tokenizer, cfg.eos_token_ids, cfg.vocab_size, runner.context_len,
                                      runner.device, jump_forward=not server_args.disable_jump_forward)
        self.grammar_queue = GrammarQueue(server_args, self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.outbox: list = []
        self.gen_tokens = deque(maxlen=64)     # (time, tokens) per step, for throughput
        self.generated_tokens = 0
        self.last_stats = 0.0
        self.log = BatchLog(server_args.decode_log_interval)
        self.spec = None
        self.step_times: list[StepTime] = []     # TP > 1, rank 0: decode step costs not yet broadcast
        if server_args.speculative_algorithm:
            from ..speculative.ngram_spec import NgramSpeculator

            self.spec = NgramSpeculator(server_args, self.output, self.kv)

    # --------------------------------------------------------------- loop
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_queue.pending)

    def step(self) -> None:
        """One scheduling step: abort/timeout housekeeping, plan, forward, process."""
        self._handle_aborts()
        self.waiting.extend(self.grammar_queue.pop_ready(self._finish_early))
        if self.waiting and not self.running and self.sessions.held_tokens():
            head = self.waiting[0]           # sessions must not starve the pool: unlock what it lacks
            self.sessions.reclaim(head.prompt_len + head.sampling_params.max_new_tokens)
        if self.spec is not None:
            self.spec.propose(self.running, self.runner.context_len)
        batch = self.planner.plan(self.running, self.waiting)
        requeue(batch, self.running, self.waiting)
        if batch.reqs:
            rows = self.spec.decode_rows(batch) if self.spec is not None else 0
            start = time.perf_counter()
            self._run_batch(batch)
            seconds = time.perf_counter() - start
            if rows:
                self._observe_step(rows, seconds)
            if batch.prompt_tokens:
                self.planner.pace.observe(sum(batch.extend_lens), seconds)
        self._flush_outputs()

    def _observe_step(self, rows: int, seconds: float) -> None:
        """Teaches the speculator a decode step's cost. With TP > 1 only rank 0's measurement counts:
        it goes out with the next step's messages (drain_step_times) and every rank applies it there."""
        if self.args.tp_size == 1:
            self.spec.cost.observe(rows, seconds)
        elif self.tp_rank == 0:
            self.step_times.append(StepTime(rows, seconds))

    def drain_step_times(self) -> list:
        out, self.step_times = self.step_times, []
        return out

    def _run_batch(self, batch: StepBatch) -> None:
        self.log.batch(self, batch)
        if self.spec is not None and any(req.draft_ids for req in batch.reqs):
            self._process(batch, *self.spec.forward(batch, self.runner, self.kv.req_to_token_pool, self.output))
            return
        mode = ForwardMode.DECODE if batch.is_decode else ForwardMode.EXTEND
        ids: list[int] = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            ids.extend(req.token_slice(req.kv_committed_len, req.kv_committed_len + n))
        rows = [req.req_pool_idx for req in batch.reqs]
        fb = self.runner.make_forward_batch(mode, ids, rows, batch.prefix_lens, batch.seq_lens,
                                            batch.out_cache_loc, self.kv.req_to_token_pool)
        lp_rows, spans = self.output.logprob_rows(batch)
        logits = self.runner.forward(fb, lp_rows)
        self._process(batch, logits, spans)

    def _process(self, batch: StepBatch, logits, spans, verify_logits: list | None = None) -> None:
        """`verify_logits[i]`: [1 + K, vocab] for a request that verified K proposals (else None)."""
        out = self.output
        if spans or any(req.wants_input_logprobs for req in batch.reqs):
            out.record_input_logprobs(spans, logits.extra_logits, batch)
        for req in batch.reqs:
            req.forward_passes += 1
        to_sample: list[tuple[int, Req]] = []
        verify: list[tuple[int, Req]] = []
        commit_lens = [n - len(req.draft_ids) for req, n in zip(batch.reqs, batch.extend_lens)]
        for i in self.kv.commit(batch.reqs, commit_lens):     # whole sequence computed: sample
            req = batch.reqs[i]
            if req.wants_input_logprobs:
                req.input_logprobs_done = True
            if req.draft_ids:
                verify.append((i, req))
            elif not out.finished_before_sampling(req):
                to_sample.append((i, req))
        if verify:
            n = self.spec.verify([req for _, req in verify], [verify_logits[i] for i, _ in verify])
            self.gen_tokens.append((time.monotonic(), n))
            self.generated_tokens += n
        if to_sample:
            rows = logits.next_token_logits
            if len(to_sample) < rows.shape[0]:   # only then a copy (64 x 49152 fp32: ~2 ms on 2 cores)
                rows = rows[torch.tensor([i for i, _ in to_sample], device=rows.device)]
            reqs = [req for _, req in to_sample]
            for req, tid in zip(reqs, out.sample(reqs, rows)):
                out.append_token(req, tid)
            self.gen_tokens.append((time.monotonic(), len(reqs)))
            self.generated_tokens += len(reqs)
        for req in batch.reqs:
            if req.finished:
                self._release(req)

    def _release(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:
            session_key = (req.all_ids[: req.kv_committed_len] if self.sessions.is_open(req.session_id)
                           else None)
            self.kv.cache_finished_req(req)
            if session_key:
                self.sessions.hold(req.session_id, req.rid, session_key)
        self.outbox.append(self.output.make_output(req))

    def _flush_outputs(self) -> None:
        for req in self.running:
            if self.output.should_emit(req):
                self.outbox.append(self.output.make_output(req))
        if self.outbox:
            self.send(BatchTokenIDOut(self.outbox))
            self.outbox = []
        self._publish_kv_events()
        now = time.monotonic()
        if now - self.last_stats > STATS_INTERVAL:
            self.last_stats = now
            self.send(self.stats())

    # ---------------------------------------------------------- messages
    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            req = Req.from_wire(msg)
            if msg.sampling_params.constraint is not None:
                self.grammar_queue.add(req)
            else:
                self.waiting.append(req)
        elif isinstance(msg, AbortReq):
            self._mark_abort(msg.rid, msg.message)
        elif isinstance(msg, FlushCacheReq):
            self.send(self._flush_cache())
        elif isinstance(msg, OpenSessionReq):
            self.sessions.open(msg.session_id, msg.capacity)
        elif isinstance(msg, CloseSessionReq):
            if msg.rids is None:
                self.sessions.close(msg.session_id)
            else:
                self.sessions.release(msg.session_id, msg.rids)
        elif isinstance(msg, StepTime):
            self.spec.cost.observe(msg.rows, msg.seconds)
        elif isinstance(msg, GetInternalStateReq):
            self.send(GetInternalStateOut(self.internal_state()))
        else:
            logger.warning("scheduler ignored an unknown message %r", type(msg).__name__)

    def _mark_abort(self, rid: str, message: str | None) -> None:
        for req in [*self.waiting, *self.running, *self.grammar_queue.pending]:
            if (not rid or req.rid == rid or req.group_rid == rid) and req.to_abort is None:
                req.to_abort = message or "aborted"

    def timeout_aborts(self) -> list[AbortReq]:
        """Abort messages for requests past their deadline. Only TP rank 0 calls this; the messages
        travel with the received ones, so every rank aborts at the same step."""
        now = time.monotonic()
        return [AbortReq(req.rid, "timeout") for req in [*self.waiting, *self.running, *self.grammar_queue.pending]
                if req.deadline is not None and now > req.deadline and req.to_abort is None]

    def _handle_aborts(self) -> None:
        for req in [*self.waiting, *self.running, *self.grammar_queue.pending]:
            if req.to_abort is not None:
                self._finish_early(req, {"type": "abort", "message": req.to_abort})

    def _finish_early(self, req: Req, reason: dict) -> None:
        """Finishes a request outside a forward pass (abort, timeout, grammar error)."""
        req.finished_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        self.grammar_queue.discard(req)
        self._release(req)

    def _flush_cache(self) -> FlushCacheOut:
        if self.has_work():
            return FlushCacheOut(False, "Cannot flush the cache while requests are running or waiting")
        self.sessions.clear()          # open sessions recompute their next turn
        self.kv.flush()
        self._publish_kv_events()
        return FlushCacheOut(True, "Cache flushed")

    def _publish_kv_events(self) -> None:
        """One batch with what the radix cache reported since the last call (--kv-events-config)."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_events.take())

    # ------------------------------------------------------------- stats
    def gen_throughput(self) -> float:
        """Generated tokens per second over the last 5 s of steps."""
        window = [(t, n) for t, n in self.gen_tokens if t > time.monotonic() - 5]
        span = (window[-1][0] - window[0][0]) if len(window) > 1 else 0.0
        return sum(n for _, n in window[1:]) / span if span > 0 else 0.0

    def stats(self) -> SchedulerStats:
        kv, planned = self.kv, self.planner.stats()
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            num_grammar_queue_reqs=len(self.grammar_queue.pending), kv_used_tokens=kv.used_tokens(),
            kv_evictable_tokens=kv.evictable_tokens(), max_total_tokens=kv.total_tokens,
            num_preemptions=planned.num_preemptions, prefix_cache_queries=planned.prefix_cache_queries,
            prefix_cache_hits=planned.prefix_cache_hits, late_divergence_misses=planned.late_divergence_misses,
            generated_tokens=self.generated_tokens, gen_throughput=self.gen_throughput(), dp_rank=self.dp_rank,
            **self._spec_stats())

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        t = self.spec.totals
        return {"spec_verify_ct": t.verify_ct, "spec_draft_tokens": t.draft_tokens,
                "spec_accepted_tokens": t.accepted_tokens}

    def internal_state(self) -> dict:
        kv, planned, pool = self.kv, self.planner.stats(), self.kv.req_to_token_pool
        return {
            "kv_total_tokens": kv.total_tokens, "kv_free_tokens": kv.free_tokens(),
            "kv_evictable_tokens": kv.evictable_tokens(), "kv_protected_tokens": kv.protected_tokens(),
            "kv_fully_free": kv.is_fully_free() and not self.has_work(),
            "req_rows_total": pool.size, "req_rows_free": pool.available_size(),
            "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "kv_request_tokens": sum(req.kv_committed_len for req in self.running),   # paging-waste baseline
            "num_preemptions": planned.num_preemptions,
            "radix_tree_tokens": self.prefix_cache.total_size(),
            "session_locked_tokens": self.sessions.held_tokens(),
            "prefix_cache_queries": planned.prefix_cache_queries, "prefix_cache_hits": planned.prefix_cache_hits,
            "late_divergence_misses": planned.late_divergence_misses,
            "last_divergence_position": planned.last_divergence_position,
            **({"avg_spec_accept_length": self.spec.accept_length(), **self._spec_stats()} if self.spec else {}),
            **self.runner.info(),
        }

    def check_idle_invariants(self) -> None:
        """At idle every slot is free or evictable, unless open sessions lock some (not checked then)."""
        if not self.sessions.held_tokens() and not self.kv.is_fully_free():
            msg = f"KV leak at idle: {self.internal_state()}"
            if self.args.debug_check_kv:
                raise AssertionError(msg)
            logger.error(msg)

    def send(self, msg) -> None:     # replaced by the process wiring (rank 0 only sends)
        pass


def set_torch_threads() -> None:
    from ..env import NUM_THREADS  # the launcher sets it per scheduler (runtime/env.py)

    n = NUM_THREADS.get() or max(os.cpu_count() or 1, 1)
    torch.set_num_threads(n)
