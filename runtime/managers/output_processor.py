"""After a forward pass: sample, record logprobs, apply grammar and stop rules, cache and emit.

For each request of the step, with [p, p + n) the tokens just computed:

    p + n <  seq_len   a chunk of a longer prefill: insert it into the tree, sample nothing
    p + n == seq_len   the last token's logits pick the next token (prefill-only requests finish)
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from ...kernels.vocab_mask import allocate_vocab_mask
from ..layers.logits_processor import compute_logprobs, gather_token_logprobs, top_k_logprobs
from ..layers.sampler import Sampler
from ..layers.sampling_batch_info import PenaltyState, SamplingBatchInfo, is_plain_greedy
from .batch_planner import StepBatch
from .io_struct import DecodeParams, ReqTokenOut
from .req import Req

STOP_STR_LOOKBACK_TOKENS = 8   # decode this many tokens beyond the longest stop string's length


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], vocab_size: int, context_len: int,
                 device: torch.device, jump_forward: bool):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.device = device
        self.jump_forward = jump_forward
        self.sampler = Sampler()

    # ------------------------------------------------------ input logprobs
    @staticmethod
    def logprob_rows(batch: StepBatch) -> tuple[list[int], list[tuple[Req, int, int]]]:
        """Flat token rows whose logits are needed for input logprobs, and per request the
        (req, first row index into that list, first prompt position j) they cover.
        Position j's logits give the logprob of input token j + 1."""
        rows: list[int] = []
        spans: list[tuple[Req, int, int]] = []
        offset = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            p = req.kv_committed_len
            if req.wants_input_logprobs:
                lo = max(p, req.input_logprob_start - 1)
                hi = min(p + n, req.prompt_len - 1)
                if hi > lo:
                    spans.append((req, len(rows), lo))
                    rows.extend(offset + j - p for j in range(lo, hi))
            offset += n
        return rows, spans

    def record_input_logprobs(self, spans: list[tuple[Req, int, int]], extra: torch.Tensor | None,
                              batch: StepBatch) -> None:
        lp = compute_logprobs(extra) if extra is not None else None
        for req in batch.reqs:
            if req.wants_input_logprobs and req.input_token_logprobs is None:
                req.input_token_logprobs, req.input_top_logprobs = [], []
                if req.input_logprob_start == 0:
                    req.input_token_logprobs.append((None, req.origin_input_ids[0]))
                    req.input_top_logprobs.append(None)
        end_of = {id(r): r.kv_committed_len + n for r, n in zip(batch.reqs, batch.extend_lens)}
        for req, start, lo in spans:
            hi = min(end_of[id(req)], req.prompt_len - 1)
            block = lp[start:start + hi - lo]
            ids = req.origin_input_ids[lo + 1: hi + 1]
            vals = gather_token_logprobs(block, ids)
            req.input_token_logprobs.extend(zip(vals, ids))
            tops = top_k_logprobs(block, [req.top_logprobs_num] * len(ids)) if req.top_logprobs_num else (
                [None] * len(ids))
            req.input_top_logprobs.extend(tops)

    # ------------------------------------------------------------ sampling
    def sample(self, reqs: list[Req], logits: torch.Tensor) -> list[int]:
        want_lp = any(r.return_logprob for r in reqs)
        params = [r.sampling_params for r in reqs]
        if not want_lp and all(r.grammar is None for r in reqs) and is_plain_greedy(
                params, [r.output_ids for r in reqs]):
            return self.sampler.greedy(logits[:, : self.vocab_size]).tolist()   # no per-step tensors
        mask = None
        if any(r.grammar is not None for r in reqs):
            words = allocate_vocab_mask(len(reqs), self.vocab_size)     # int32 bitmask, all allowed
            for i, r in enumerate(reqs):
                if r.grammar is not None:
                    r.grammar.fill_vocab_mask(words[i])
            mask = words.to(self.device)                                # applied as bits by the sampler
        info = SamplingBatchInfo.build(params, [r.origin_input_ids for r in reqs],
                                       [r.output_ids for r in reqs], self.vocab_size, sorted(self.eos_token_ids),
                                       self.device, vocab_mask=mask,
                                       penalty_states=[self._penalty_state(r) for r in reqs])
        out = self.sampler.sample(logits[:, : self.vocab_size], info, return_logprobs=want_lp)
        ids = out.next_token_ids.tolist()
        if want_lp:
            rows = [i for i, r in enumerate(reqs) if r.return_logprob]
            lp = out.logprobs[rows]
            vals = gather_token_logprobs(lp, [ids[i] for i in rows])
            tops = top_k_logprobs(lp, [reqs[i].top_logprobs_num for i in rows])
            for k, i in enumerate(rows):
                reqs[i].output_token_logprobs.append((vals[k], ids[i]))
                if reqs[i].top_logprobs_num:
                    reqs[i].output_top_logprobs.append(tops[k])
        return ids

    def _penalty_state(self, req: Req) -> PenaltyState | None:
        """The request's penalty state, made from its prompt on its first penalized step."""
        if not req.sampling_params.has_penalties:
            return None
        if req.penalty_state is None:
            req.penalty_state = PenaltyState(req.sampling_params, req.origin_input_ids, self.vocab_size,
                                             self.device)
        return req.penalty_state

    # -------------------------------------------------------- token rules
    def append_token(self, req: Req, tid: int) -> None:
        req.output_ids.append(tid)
        if req.grammar is not None:
            req.grammar.accept_token(tid)
        self.check_finished(req, tid)
        if not req.finished and req.grammar is not None and self.jump_forward:
            self._jump_forward(req)

    def _jump_forward(self, req: Req) -> None:
        budget = min(req.remaining_new_tokens(), self.context_len - req.seq_len - 1)
        if budget <= 0:
            return
        forced = req.grammar.jump_forward_tokens(None)
        if not forced:
            return
        # Cutting at the budget ends the request (length), so the matcher running ahead is harmless.
        forced = forced[:budget]
        req.output_ids.extend(forced)
        req.jump_forward_tokens += len(forced)
        if req.return_logprob:   # forced tokens have probability one under the constraint
            req.output_token_logprobs.extend((0.0, t) for t in forced)
            if req.top_logprobs_num:
                req.output_top_logprobs.extend([(0.0, t)] for t in forced)
        self.check_finished(req, forced[-1])

    @staticmethod
    def finished_before_sampling(req: Req) -> bool:
        """A request that asks for no new tokens (prefill only) finishes when its prompt is computed."""
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return True
        return False

    def check_finished(self, req: Req, last: int) -> None:
        """The stop rules after each new token (the one place they are decided; the detokenizer
        only holds back text that may become a stop, and trims at the `matched` stop it is told):
        stop token ids, eos, stop strings, stop_regex (after min_new_tokens), then max_new_tokens,
        the context length and a terminated grammar."""
        sp = req.sampling_params
        out_len = len(req.output_ids)
        if out_len >= sp.min_new_tokens:
            if last in sp.stop_token_ids:
                req.finished_reason = {"type": "stop", "matched": last}
                return
            if not sp.ignore_eos and last in self.eos_token_ids:
                req.finished_reason = {"type": "stop", "matched": last}
                return
            if sp.stop:
                tail = self.tokenizer.decode(req.output_ids[-(self._stop_window(sp.stop)):],
                                             skip_special_tokens=sp.skip_special_tokens)
                for s in sp.stop:
                    if s in tail:
                        req.finished_reason = {"type": "stop", "matched": s}
                        return
            if sp.stop_regex and self._match_stop_regex(req):
                return
        if out_len >= sp.max_new_tokens:
            req.finished_reason = {"type": "length", "length": sp.max_new_tokens}
        elif req.seq_len >= self.context_len:
            req.finished_reason = {"type": "length", "length": out_len}
        elif req.grammar is not None and req.grammar.is_terminated() and not (
                not sp.ignore_eos and last in self.eos_token_ids):
            req.finished_reason = {"type": "stop", "matched": None}

    @staticmethod
    def _stop_window(stops: list[str]) -> int:
        return max(len(s) for s in stops) + STOP_STR_LOOKBACK_TOKENS

    def _match_stop_regex(self, req: Req) -> bool:
        """Stop at the first `stop_regex` match in the output text (a window of it when every
        pattern's match length is bounded, else all of it); `matched` is the pattern."""
        sp = req.sampling_params
        window = stop_regex_window(sp.stop_regex)
        ids = req.output_ids if window is None else req.output_ids[-(window + STOP_STR_LOOKBACK_TOKENS):]
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        for pattern in sp.stop_regex:
            if re.search(pattern, text):
                req.finished_reason = {"type": "stop", "matched": pattern}
                return True
        return False

    # ------------------------------------------------------------ emitting
    @staticmethod
    def make_output(req: Req) -> ReqTokenOut:
        sp = req.sampling_params
        new = req.output_ids[req.sent_len:]
        out = ReqTokenOut(
            rid=req.rid, new_token_ids=list(new), finish_reason=req.finished_reason,
            prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, jump_forward_tokens=req.jump_forward_tokens,
            forward_passes=req.forward_passes, spec_verify_ct=req.spec_verify_ct,
            spec_accepted_tokens=req.spec_accepted_tokens)
        if not req.sent_first:
            out.decode = DecodeParams(sp.skip_special_tokens, sp.spaces_between_special_tokens,
                                      list(sp.stop), list(sp.stop_regex), sp.no_stop_trim)
        if req.return_logprob:
            if not req.sent_first:
                out.input_token_logprobs = list(req.input_token_logprobs or [])
                out.input_top_logprobs = list(req.input_top_logprobs or []) if req.top_logprobs_num else None
            out.output_token_logprobs = req.output_token_logprobs[req.sent_len:]
            if req.top_logprobs_num:
                out.output_top_logprobs = req.output_top_logprobs[req.sent_len:]
        req.sent_len = len(req.output_ids)
        req.sent_first = True
        return out

    @staticmethod
    def should_emit(req: Req) -> bool:
        """Streamed requests get every step; others their first token (for TTFT) and their end."""
        if req.finished:
            return True
        if len(req.output_ids) <= req.sent_len:
            return False
        if not req.sent_first:
            return True
        interval = req.sampling_params.stream_interval or 1
        return req.stream and len(req.output_ids) - req.sent_len >= interval


@lru_cache(maxsize=1024)
def _max_match_len(pattern: str) -> int | None:
    """Most characters one match of `pattern` can span, or None when unbounded (or unknown)."""
    from re import _constants, _parser  # sre_parse's modules (sre_parse itself is deprecated)

    try:
        _, high = _parser.parse(pattern).getwidth()
    except Exception:  # noqa: BLE001
        return None
    return None if high >= _constants.MAXREPEAT else int(high)


def stop_regex_window(patterns: list[str]) -> int | None:
    """Tokens to decode for the stop_regex check (a token spans at least one character)."""
    widths = [_max_match_len(p) for p in patterns]
    return None if any(w is None for w in widths) else max(widths, default=0)

