"""Turns a GenerateReqInput (native /generate body, or what Engine.generate builds) into wire
requests: single vs batch, per-item fields, tokenization, validation, n > 1 expansion.

Every problem is a ValueError with a message a client can act on, raised before anything is sent.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from typing import Any

from ..sampling_params import MODEL_DEFAULT_KEYS, SamplingParams
from ..server_args import ServerArgs
from .io_struct import GenerateReqInput, TokenizedGenerateReq
from .request_validation import check_logprob_start, validate_generate_fields
from .text_encoding import encode_texts

logger = logging.getLogger(__name__)

PER_ITEM_FIELDS = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")


class RequestBuilder:
    def __init__(self, server_args: ServerArgs, tokenizer: Any, vocab_size: int, context_len: int,
                 max_total_tokens: int | None):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.max_total_tokens = max_total_tokens
        self.sampling_defaults = (model_sampling_defaults(server_args.model_path)
                                  if server_args.sampling_defaults == "model" else {})

    def build(self, obj: GenerateReqInput, in_flight: Any) -> tuple[list[TokenizedGenerateReq], bool, bool]:
        """(wire requests, is a single request, return_text_in_logprobs). `in_flight` holds the rids
        already running, which a new request may not reuse."""
        return self._prepare(obj, in_flight)

    def _prepare(self, obj: GenerateReqInput, in_flight: Any) -> tuple[list[TokenizedGenerateReq], bool, bool]:
        """Normalizes single/batch input into wire requests (n > 1 expanded). Raises ValueError."""
        validate_generate_fields(obj, self.server_args.max_top_logprobs)
        items, is_single = self._split_items(obj)
        texts = [it["text"] for it in items if it.get("text") is not None]
        encoded = iter(encode_texts(self.tokenizer, texts)) if texts else iter(())
        reqs: list[TokenizedGenerateReq] = []
        for i, it in enumerate(items):
            ids = list(next(encoded)) if it.get("text") is not None else it["input_ids"]
            where = "" if is_single else f"item {i}: "
            try:
                reqs.extend(self._make_reqs(it, ids, obj))
            except ValueError as e:
                raise ValueError(f"{where}{e}") from None
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids) or any(rid in in_flight for rid in rids):
            raise ValueError("Duplicate request id (rid) among the requests in flight")
        return reqs, is_single and len(reqs) == 1, bool(obj.return_text_in_logprobs)

    def _split_items(self, obj: GenerateReqInput) -> tuple[list[dict[str, Any]], bool]:
        """One dict of per-item fields for each prompt of the request."""
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
        items = [{key: p} for p in prompts]
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
        return items, is_single

    def _make_reqs(self, it: dict[str, Any], ids: Any, obj: GenerateReqInput) -> list[TokenizedGenerateReq]:
        self._check_ids(ids)
        raw_params = it["sampling_params"]
        params = SamplingParams.from_dict(raw_params, self.sampling_defaults)
        params.verify_vocab(self.vocab_size)
        self._check_constraint_size(params)
        self._check_lengths(len(ids), params, explicit=bool(raw_params) and raw_params.get("max_new_tokens")
                            is not None)
        start = it["logprob_start_len"]
        start = -1 if start is None else start
        top_n = it["top_logprobs_num"] or 0
        if not isinstance(start, int) or start < -1:
            raise ValueError("logprob_start_len must be -1 (output only) or a prompt position >= 0")
        if not isinstance(top_n, int) or not 0 <= top_n <= self.vocab_size:
            raise ValueError(f"top_logprobs_num must be in [0, {self.vocab_size}]")
        if start >= 0:
            check_logprob_start(start, len(ids))
        rid = it["rid"] if it["rid"] is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError("rid must be a non-empty string")
        base = dict(input_ids=list(ids), return_logprob=bool(it["return_logprob"]), logprob_start_len=start,
                    top_logprobs_num=top_n, stream=bool(obj.stream), priority=obj.priority or 0,
                    timeout=obj.timeout if obj.timeout is not None else self.server_args.request_timeout)
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
