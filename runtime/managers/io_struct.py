"""Every message that crosses a process boundary, in one place.

    TokenizerManager --TokenizedGenerateReq / AbortReq / control--> Scheduler
    Scheduler        --BatchTokenIDOut / control replies--------> Detokenizer
    Detokenizer      --BatchStrOut / control replies (forwarded)--> TokenizerManager

Messages are plain dataclasses sent with pickle (see managers/ipc.py). Keep them flat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplingParams


# ----------------------------------------------------------------- requests
@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1          # -1: output positions only
    top_logprobs_num: int = 0
    stream: bool = False
    priority: int = 0                    # larger runs first under --schedule-policy priority
    group_rid: str | None = None         # n > 1: siblings share one prefill of the prompt
    timeout: float | None = None         # seconds since arrival before the scheduler aborts it
    session_id: str | None = None        # an open session: its KV stays locked after it finishes


@dataclass
class OpenSessionReq:
    session_id: str
    capacity: int                        # tokens the session may keep locked in the radix tree


@dataclass
class CloseSessionReq:
    session_id: str
    rids: list[str] | None = None        # None: close the session; else unlock these requests' KV


@dataclass
class AbortReq:
    rid: str                             # "" aborts everything
    message: str | None = None


@dataclass
class StepTime:
    """Rank 0's wall time of a decode step of `rows` rows, broadcast with the step's messages when
    TP > 1 so that every rank's speculator learns the same costs (and plans the same batches)."""
    rows: int
    seconds: float


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateOut:
    state: dict[str, Any]


# ------------------------------------------------------------------ outputs
@dataclass
class DecodeParams:
    """How the detokenizer turns one request's tokens into text: constant for the request, so it
    rides on the request's first ReqTokenOut only and the detokenizer keeps it."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_strs: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False


@dataclass
class ReqTokenOut:
    """What one request produced in one scheduler step (deltas, not cumulative lists)."""

    rid: str
    new_token_ids: list[int]
    finish_reason: dict[str, Any] | None   # {"type": "stop"|"length"|"abort", ...}
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    decode: DecodeParams | None = None     # set on the request's first output only
    # logprobs, as [logprob, token_id] pairs (text is added by the TokenizerManager)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    jump_forward_tokens: int = 0
    forward_passes: int = 0
    spec_verify_ct: int = 0                # speculative verify passes (cumulative)
    spec_accepted_tokens: int = 0          # proposals accepted (cumulative)


@dataclass
class BatchTokenIDOut:
    outputs: list[ReqTokenOut]


@dataclass
class ReqStrOut:
    rid: str
    text_delta: str                      # new text since the last message for this rid
    token: ReqTokenOut                   # the token-level record it was made from


@dataclass
class BatchStrOut:
    outputs: list[ReqStrOut]


@dataclass
class SchedulerStats:
    """Pushed by the scheduler a few times a second while busy (and once when it goes idle)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_grammar_queue_reqs: int
    kv_used_tokens: int                  # held by requests (evictable cache excluded)
    kv_evictable_tokens: int
    max_total_tokens: int
    num_preemptions: int
    prefix_cache_queries: int            # cumulative, in tokens
    prefix_cache_hits: int
    late_divergence_misses: int = 0
    generated_tokens: int = 0            # cumulative
    gen_throughput: float = 0.0
    spec_verify_ct: int = 0              # cumulative speculative verify passes
    spec_draft_tokens: int = 0           # cumulative proposals verified
    spec_accepted_tokens: int = 0        # cumulative proposals accepted
    dp_rank: int = 0


@dataclass
class SchedulerReady:
    """The readiness handshake each scheduler sends once its model and KV pool exist."""

    info: dict[str, Any]


@dataclass
class DetokenizerReady:
    """The detokenizer's readiness handshake: its tokenizer is loaded and its sockets are bound."""

    pass


@dataclass
class ChildFailed:
    """Sent (best effort) by a child process that hit an unrecoverable error."""

    who: str
    error: str


# ------------------------------------------------------- API-level input
@dataclass
class GenerateReqInput:
    """The one request model: the native `/generate` body (parsed from JSON by
    entrypoints/openai_protocol.GenerateRequest), what the OpenAI routes and Engine.generate build.
    Fields follow SGLang. managers/request_builder.py validates it and turns it into wire requests.

    Single: `text` is a str or `input_ids` a list[int]. Batch: a list of either; then
    `sampling_params`, `rid`, `return_logprob`, ... may each be a single value or a per-item list.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    priority: int | None = None
    timeout: float | None = None
    session_params: dict | None = None   # {id, rid, offset, replace, drop_previous_output} (sessions.py)
