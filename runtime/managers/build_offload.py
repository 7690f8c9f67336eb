"""Builds wire requests without blocking the event loop on large inputs.

    builder = OffloadedBuilder(request_builder, max_top_logprobs, context_len)
    reqs, is_single, text_in_logprobs = await builder.build(obj)

Small inputs are built inline (no thread hop). An input of LARGE_INPUT characters / token ids or
more is validated, checked for an obviously over-long prompt (its head alone overflows the
context: refused without tokenizing the rest) and tokenized on one worker thread, so /health and
other requests keep being served meanwhile. The tokenizer is shared with the loop thread: nothing
mutates it after loading (no truncation or padding changes), and the Rust encode/decode calls only
borrow it immutably. Rids in use are not checked here (the TokenizerManager's RidRegistry does).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .io_struct import GenerateReqInput, TokenizedGenerateReq
from .request_validation import input_size, validate_generate_fields
from .text_encoding import check_prefix_fits

LARGE_INPUT = 64 * 1024
HEAD_CHARS_PER_TOKEN = 16     # the head checked for overflow: this many characters per context token

Built = tuple[list[TokenizedGenerateReq], bool, bool]


class OffloadedBuilder:
    def __init__(self, requests: Any, max_top_logprobs: int, context_len: int):
        self.requests = requests
        self.max_top_logprobs = max_top_logprobs
        self.context_len = context_len
        self._pool: ThreadPoolExecutor | None = None

    async def build(self, obj: GenerateReqInput) -> Built:
        """RequestBuilder.build(obj), on the worker thread for large inputs. Raises ValueError."""
        if input_size(obj) < LARGE_INPUT:
            return self.requests.build(obj, ())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixlm-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._build_large, obj)

    def _build_large(self, obj: GenerateReqInput) -> Built:
        validate_generate_fields(obj, self.max_top_logprobs)
        texts = [t for t in (obj.text if isinstance(obj.text, list) else [obj.text]) if isinstance(t, str)]
        head = max(LARGE_INPUT, HEAD_CHARS_PER_TOKEN * self.context_len)
        check_prefix_fits(self.requests.tokenizer, texts, self.context_len, head)
        return self.requests.build(obj, ())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
