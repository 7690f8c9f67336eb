"""Turns a GenerateReqInput (the one request model: the native /generate body, what the OpenAI
routes and Engine.generate build) into wire requests, in one pass:

    builder = RequestBuilder(server_args, tokenizer, vocab_size, context_len, max_total_tokens)
    reqs, is_single, text_in_logprobs = await builder.build(obj)

    validate_generate_fields   the raw fields, once (request_validation.py)
    check_prefix_fits          large inputs only: a text whose head alone overflows the context is
                               refused without tokenizing the rest
    _split_items               single vs batch: one single-prompt GenerateReqInput per prompt
    encode_texts               text -> token ids (all texts of the request in one call)
    sessions.resolve           session_params: the input grows by the conversation it continues
    _make_reqs                 token ids, sampling params and lengths checked; n > 1 expanded

Every problem is a ValueError with a message a client can act on, raised before anything is sent.
An input of LARGE_INPUT characters / token ids or more is built on one worker thread, so /health and
other requests keep being served meanwhile; smaller ones are built inline (no thread hop). The
tokenizer is shared with the loop thread: nothing mutates it after loading (no truncation or padding
changes), and the Rust encode/decode calls only borrow it immutably. HF tokenizers' `__call__`
computes offsets and several per-token lists that the runtime never reads; the Rust
`encode_batch_fast` skips offsets (about 3x faster on long texts) and runs without the GIL, so a long
prompt tokenized on the worker thread barely delays the event loop. Rids in use are not checked here
(the TokenizerManager's RidRegistry does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..sampling_params import MODEL_DEFAULT_KEYS, SamplingParams
from ..server_args import ServerArgs
from .io_struct import GenerateReqInput, TokenizedGenerateReq
from .request_validation import check_logprob_start, input_size, validate_generate_fields
from .sessions import SessionStore

logger = logging.getLogger(__name__)

PER_ITEM_FIELDS = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")
LARGE_INPUT = 64 * 1024
HEAD_CHARS_PER_TOKEN = 16     # the head checked for overflow: this many characters per context token
PREFIX_MARGIN_TOKENS = 64     # slack for the last pre-token of a head, which may merge differently

Built = tuple[list[TokenizedGenerateReq], bool, bool]


class RequestBuilder:
    def __init__(self, server_args: ServerArgs, tokenizer: Any, vocab_size: int, context_len: int,
                 max_total_tokens: int | None, sessions: SessionStore | None = None):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.max_total_tokens = max_total_tokens
        self.sampling_defaults = (model_sampling_defaults(server_args.model_path)
                                  if server_args.sampling_defaults == "model" else {})
        self._pool: ThreadPoolExecutor | None = None
        self.sessions = sessions         # the TokenizerManager's; None: session_params is refused

    async def build(self, obj: GenerateReqInput) -> Built:
        """(wire requests with n > 1 expanded, is a single request, return_text_in_logprobs), built on
        the worker thread for a large input. Raises ValueError."""
        if input_size(obj) < LARGE_INPUT:
            return self._build(obj, large=False)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixlm-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._build, obj, True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _build(self, obj: GenerateReqInput, large: bool) -> Built:
        validate_generate_fields(obj, self.server_args.max_top_logprobs)
        if large:
            texts = [t for t in (obj.text if isinstance(obj.text, list) else [obj.text]) if isinstance(t, str)]
            head = max(LARGE_INPUT, HEAD_CHARS_PER_TOKEN * self.context_len)
            check_prefix_fits(self.tokenizer, texts, self.context_len, head)
        items, is_single = _split_items(obj)
        texts = [it.text for it in items if it.text is not None]
        encoded = iter(encode_texts(self.tokenizer, texts)) if texts else iter(())
        reqs: list[TokenizedGenerateReq] = []
        session = obj.session_params
        if session is not None and (not is_single or self.sessions is None):
            raise ValueError("session_params takes a single prompt, not a batch" if self.sessions is not None
                             else "Sessions are not available here")
        for i, it in enumerate(items):
            ids = list(next(encoded)) if it.text is not None else it.input_ids
            try:
                if session is not None:
                    ids = self.sessions.resolve(session, ids)
                reqs.extend(self._make_reqs(it, ids))
            except ValueError as e:
                raise ValueError(f"{'' if is_single else f'item {i}: '}{e}") from None
        if session is not None:
            if len(reqs) != 1:
                raise ValueError("session_params needs n = 1 (one continuation per request)")
            reqs[0].session_id = session["id"]
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise ValueError("Duplicate request id (rid) among the requests in flight")
        return reqs, is_single and len(reqs) == 1, bool(obj.return_text_in_logprobs)

    def _make_reqs(self, item: GenerateReqInput, ids: Any) -> list[TokenizedGenerateReq]:
        """The wire request(s) of one prompt; its raw fields were validated by _build already."""
        self._check_ids(ids)
        raw_params = item.sampling_params
        params = SamplingParams.from_dict(raw_params, self.sampling_defaults)
        params.verify_vocab(self.vocab_size)
        self._check_constraint_size(params)
        self._check_lengths(len(ids), params, explicit=bool(raw_params) and raw_params.get("max_new_tokens")
                            is not None)
        start = -1 if item.logprob_start_len is None else item.logprob_start_len
        top_n = item.top_logprobs_num or 0
        if top_n > self.vocab_size:        # --max-top-logprobs may exceed a small vocabulary
            raise ValueError(f"top_logprobs_num must be in [0, {self.vocab_size}]")
        if start >= 0:
            check_logprob_start(start, len(ids))
        rid = item.rid if item.rid is not None else uuid.uuid4().hex
        base = dict(input_ids=list(ids), return_logprob=bool(item.return_logprob), logprob_start_len=start,
                    top_logprobs_num=top_n, stream=bool(item.stream), priority=item.priority or 0,
                    timeout=item.timeout if item.timeout is not None else self.server_args.request_timeout)
        if params.n == 1:
            return [TokenizedGenerateReq(rid=rid, sampling_params=params, **base)]
        return [TokenizedGenerateReq(rid=f"{rid}-{j}", sampling_params=_sample_params(params, j),
                                     group_rid=rid, **base) for j in range(params.n)]

    def _check_ids(self, ids: Any) -> None:
        if not isinstance(ids, list) or not ids:
            raise ValueError("The input is empty: give a non-empty prompt")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"Input token id {t!r} is not an integer in [0, {self.vocab_size})")

    def _check_constraint_size(self, params: SamplingParams) -> None:
        constraint = params.constraint
        limit = self.server_args.max_constraint_bytes
        if constraint is not None and len(constraint[1].encode("utf-8", "surrogatepass")) > limit:
            raise ValueError(f"The {constraint[0]} constraint is {len(constraint[1].encode('utf-8', 'surrogatepass'))} "
                             f"bytes, over the limit of {limit} (--max-constraint-bytes)")

    def _check_lengths(self, prompt_len: int, params: SamplingParams, explicit: bool) -> None:
        """Prompt and output must fit the context; an implicit max_new_tokens is clamped to it."""
        ctx = self.context_len
        if prompt_len > ctx or (prompt_len == ctx and params.max_new_tokens > 0):
            raise ValueError(f"The input has {prompt_len} tokens, which does not leave room to generate "
                             f"in the model's context length of {ctx} tokens")
        if explicit and prompt_len + params.max_new_tokens > ctx:
            raise ValueError(f"Requested {prompt_len} prompt tokens + {params.max_new_tokens} max_new_tokens "
                             f"= {prompt_len + params.max_new_tokens}, more than the context length of {ctx}")
        params.max_new_tokens = min(params.max_new_tokens, ctx - prompt_len)
        params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        if self.max_total_tokens and prompt_len + params.max_new_tokens > self.max_total_tokens:
            raise ValueError(f"The request needs up to {prompt_len + params.max_new_tokens} tokens of KV cache, "
                             f"but the KV pool holds only {self.max_total_tokens}")


def _split_items(obj: GenerateReqInput) -> tuple[list[GenerateReqInput], bool]:
    """One single-prompt GenerateReqInput for each prompt of the request (per-item lists resolved)."""
    if (obj.text is None) == (obj.input_ids is None):
        raise ValueError("Exactly one of `text` and `input_ids` must be given")
    if obj.text is not None:
        if isinstance(obj.text, str):
            prompts, is_single = [obj.text], True
        elif isinstance(obj.text, list) and all(isinstance(t, str) for t in obj.text):
            prompts, is_single = list(obj.text), False
        else:
            raise ValueError("`text` must be a string or a list of strings")
        key = "text"
    else:
        ids = obj.input_ids
        if not isinstance(ids, list):
            raise ValueError("`input_ids` must be a list of token ids or a list of such lists")
        is_single = not ids or not isinstance(ids[0], list)
        prompts = [ids] if is_single else ids
        key = "input_ids"
    if not prompts:
        raise ValueError("The batch is empty")
    items: list[dict[str, Any]] = [{key: p} for p in prompts]
    for name in PER_ITEM_FIELDS:
        value = getattr(obj, name)
        if isinstance(value, list):
            if is_single or len(value) != len(items):
                raise ValueError(f"`{name}` must be a single value or a list with one entry per prompt")
            for it, v in zip(items, value, strict=True):
                it[name] = v
        elif name == "rid" and value is not None and not is_single:
            raise ValueError("`rid` must be a list with one id per prompt for a batch")
        else:
            for it in items:
                it[name] = value
    return [dataclasses.replace(obj, **it) for it in items], is_single


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, special tokens added as `tokenizer(texts)` adds them."""
    fast = getattr(getattr(tokenizer, "_tokenizer", None), "encode_batch_fast", None)
    if fast is None:
        return tokenizer(texts)["input_ids"]
    return [enc.ids for enc in fast(texts, add_special_tokens=True)]


def check_prefix_fits(tokenizer: Any, texts: list[str], context_len: int, prefix_chars: int) -> None:
    """Raises ValueError for a text whose first `prefix_chars` characters alone make more than
    context_len + PREFIX_MARGIN_TOKENS tokens: the whole text cannot fit, so it is refused without
    tokenizing the rest (a multi-megabyte prompt costs milliseconds, not seconds)."""
    heads = [t[:prefix_chars] for t in texts if len(t) > prefix_chars]
    if not heads:
        return
    for ids in encode_texts(tokenizer, heads):
        if len(ids) > context_len + PREFIX_MARGIN_TOKENS:
            raise ValueError(f"The input is longer than the model's context length of {context_len} tokens "
                             f"(its first {prefix_chars} characters alone make {len(ids)} tokens)")


def _sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """The params of sample j of an n > 1 request: n = 1, and a distinct seed when one is set."""
    seed = None if params.sampling_seed is None else params.sampling_seed + j
    return dataclasses.replace(params, n=1, sampling_seed=seed)


def model_sampling_defaults(model_path: str | None) -> dict[str, float | int]:
    """temperature / top_p / top_k / min_p / repetition_penalty from the model's generation_config.json
    (`--sampling-defaults model`); {} when the file is missing or unreadable."""
    path = os.path.join(model_path or "", "generation_config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    defaults = {k: config[k] for k in MODEL_DEFAULT_KEYS
                if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
