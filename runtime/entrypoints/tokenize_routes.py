"""`POST /tokenize` and `POST /detokenize`, with the fields SGLang and vLLM use.

    /tokenize    {"prompt" | "text": str | [str], "add_special_tokens": true}
                 -> {"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}
    /detokenize  {"tokens": [int] | [[int]], "skip_special_tokens": false}
                 -> {"text": str | [str], "prompt": same}      (SGLang names it text, vLLM prompt)

Both run on the server's own tokenizer in the HTTP process; `model` is accepted and ignored.
Token ids outside the vocabulary are a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from .errors import APIError, json_response


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str] | None = None
    text: str | list[str] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


def tokenize(tokenizer: Any, body: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    """Pure: the /tokenize answer for one request (raises APIError on bad input)."""
    if (body.prompt is None) == (body.text is None):
        raise APIError(400, "Send exactly one of 'prompt' or 'text'", param="prompt")
    prompt = body.prompt if body.prompt is not None else body.text
    texts = [prompt] if isinstance(prompt, str) else prompt
    ids = [tokenizer.encode(t, add_special_tokens=body.add_special_tokens) for t in texts]
    if isinstance(prompt, str):
        return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": max_model_len}
    return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": max_model_len}


def detokenize(tokenizer: Any, body: DetokenizeRequest, vocab_size: int) -> dict[str, Any]:
    """Pure: the /detokenize answer for one request (raises APIError on ids outside the vocab)."""
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    seqs: list[list[int]] = body.tokens if batch else [body.tokens]   # type: ignore[list-item]
    for seq in seqs:
        bad = next((t for t in seq if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
    texts = [tokenizer.decode(seq, skip_special_tokens=body.skip_special_tokens) for seq in seqs]
    text: str | list[str] = texts if batch else texts[0]
    return {"text": text, "prompt": text}


def add_tokenize_routes(app: FastAPI, tm: Any) -> None:
    """Adds the two routes; `tm` is the TokenizerManager (its tokenizer, context_len, vocab_size)."""

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> Response:
        return json_response(tokenize(tm.tokenizer, body, tm.context_len))

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        return json_response(detokenize(tm.tokenizer, body, tm.vocab_size))
