"""Req: one request inside the scheduler, from arrival to its last token.

Token regions of a request (all_ids = origin_input_ids + output_ids):

    [0, len(prefix_indices))      KV owned by the prefix cache (locked through last_node)
    [.., kv_committed_len)        KV owned by this request; all of [0, kv_committed_len) is in
                                  its req_to_token row (written by the KVManager only)
    [kv_committed_len, seq_len)   no KV yet: the next forward pass computes these

Only `kv_committed_len` (how far the KV is computed) and the id lists are stored; every other
length is derived. Not to be confused with `cached_tokens`, the prefix-cache hit reported to
the client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampling_params import SamplingParams
from .io_struct import TokenizedGenerateReq

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    priority: int = 0
    group_rid: str | None = None
    session_id: str | None = None        # an open session keeps this request's KV locked when it finishes
    deadline: float | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    # memory
    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)
    last_node: Any = None
    # progress
    finished_reason: dict | None = None
    to_abort: str | None = None          # abort message, acted on at the next step boundary
    cached_tokens: int = 0               # prefix-cache hit at first admission (reported)
    sent_len: int = 0                    # output tokens already sent to the detokenizer
    sent_first: bool = False
    num_preemptions: int = 0             # times retracted to free KV (then recomputed)
    forward_passes: int = 0
    jump_forward_tokens: int = 0
    penalty_state: Any = None            # PenaltyState (layers/sampling_batch_info.py), once penalized
    # speculative decoding (runtime/speculative): this step's proposals, verified after token seq_len-1
    draft_ids: list[int] = field(default_factory=list)
    spec_state: Any = None               # SpecState (proposer index, acceptance history), once decoding
    spec_verify_ct: int = 0              # verify passes
    spec_accepted_tokens: int = 0        # proposals accepted into the output
    # structured generation
    grammar: Any = None                  # GrammarMatcher, once compiled
    grammar_future: Any = None
    grammar_wait_start: float = 0.0
    # logprobs, accumulated as [logprob, token_id] pairs
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs_done: bool = False

    @staticmethod
    def from_wire(msg: TokenizedGenerateReq) -> Req:
        return Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                   return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                   top_logprobs_num=msg.top_logprobs_num, stream=msg.stream, priority=msg.priority,
                   group_rid=msg.group_rid, session_id=msg.session_id,
                   deadline=time.monotonic() + msg.timeout if msg.timeout else None)

    # ------------------------------------------------------------ lengths
    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        return self.seq_len - self.kv_committed_len

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (decode steps read only the output tail)."""
        P = len(self.origin_input_ids)
        if start >= P:
            return self.output_ids[start - P: end - P]
        return (self.origin_input_ids + self.output_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and not self.input_logprobs_done

    @property
    def input_logprob_start(self) -> int:
        """First prompt index whose logprob is reported (-1 means the prompt's last token only)."""
        if self.logprob_start_len is None or self.logprob_start_len < 0:
            return max(self.prompt_len - 1, 0)
        return min(self.logprob_start_len, max(self.prompt_len - 1, 0))

    def max_prefix_for_match(self) -> int:
        """Longest prefix that may come from the cache: input logprobs need their logits computed,
        and the last token must always be computed to produce the next one."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.input_logprob_start - 1, 0))
        return max(limit, 0)

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)
