"""`RuntimeEndpoint`: the DSL backend for a radixlm (or SGLang) server, over the native HTTP API.

    GET  /get_model_info   model_path, tokenizer_path -> chat template
    POST /generate         {"text", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                            "top_logprobs_num", "return_text_in_logprobs"} -> {"text", "output_ids", "meta_info"}
                           streaming: SSE `data: {...}` with cumulative text, then `data: [DONE]`
                           `max_new_tokens: 0` prefills only (caches a prefix, scores select)
    POST /open_session, /close_session, `session_params` on /generate: multi-turn programs and
                           forks keep their KV in a server session (sessions.py)

Server errors (`{"error": {"message": ...}}`) are raised as `BackendError` with that message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx

from ..chat_template import detect_chat_template, get_chat_template
from ..choices import ChoicesDecision, ChoicesSamplingMethod, decide, mean_logprob
from ..ir import SglSamplingParams
from .base import BackendError, BaseBackend, PromptState
from .sessions import ProgramSession, SessionCursor

logger = logging.getLogger(__name__)

# select asks for logprobs from this many tokens before the prompt's end, so that a choice whose
# first token merges with the prompt's last token(s) is still scored over all its tokens.
SELECT_MARGIN_TOKENS = 8


class RuntimeEndpoint(BaseBackend):
    supports_prefix_cache = True

    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None,
                 chat_template_name: str | None = None, timeout: float | None = 3600.0,
                 use_sessions: bool = True, session_capacity: int = 65536) -> None:
        """`use_sessions`: multi-turn programs and forks use server sessions (off by itself when
        the server has none); `session_capacity`: each program session's `capacity_of_str_len`."""
        self.base_url = base_url.rstrip("/")
        self.use_sessions = use_sessions
        self.session_capacity = session_capacity
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.base_url, headers=headers, verify=True if verify is None else verify,
            timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self.model_info: dict[str, Any] = self._request("GET", "/get_model_info")
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = detect_chat_template(self.model_info)

    # ------------------------------------------------------------ plumbing
    def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            resp = self._client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"request to {self.base_url}{path} failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise error_from_response(resp)
        return resp.json() if resp.content else None

    def generate_raw(self, body: dict[str, Any]) -> Any:
        """POST /generate with `body` and return the decoded JSON (a list for list inputs)."""
        return self._request("POST", "/generate", body)

    def close(self) -> None:
        self._client.close()

    shutdown = close

    # ---------------------------------------------------------------- info
    def get_model_name(self) -> str:
        return self.model_info.get("model_path", "")

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def cache_prefix(self, prefix_str: str) -> None:
        self.generate_raw({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    # ------------------------------------------------------------ sessions
    def new_session_cursor(self) -> SessionCursor | None:
        return SessionCursor(ProgramSession(self, self.session_capacity)) if self.use_sessions else None

    def open_session(self, capacity: int) -> str | None:
        """A new server session's id; None (and sessions off) when the server has no sessions."""
        try:
            return self._request("POST", "/open_session", {"capacity_of_str_len": capacity})
        except BackendError as exc:
            if exc.status_code in (404, 405):
                self.use_sessions = False
            logger.warning("DSL programs run without server sessions: /open_session answered %s", exc)
            return None

    def close_session(self, session_id: str) -> None:
        try:
            self._request("POST", "/close_session", {"session_id": session_id})
        except BackendError as exc:   # the server went away or flushed it: nothing is left to free
            logger.info("closing session %s: %s", session_id, exc)

    def _enter_session(self, s: PromptState, body: dict[str, Any], force_open: bool = False
                       ) -> tuple[dict[str, Any], str | None]:
        """(the body to send, its rid in the state's session or None when sent outside one)."""
        cursor = getattr(s, "session_", None)
        if cursor is None or body.get("sampling_params", {}).get("n") not in (None, 1):
            return body, None
        return cursor.prepare(dict(body), s.text_, force_open)

    @staticmethod
    def _session_refused(s: PromptState, rid: str | None, exc: BackendError) -> bool:
        """A 400 about the session (a gateway sent the turn to another worker, the server was
        restarted): the program's session is turned off and the request is sent without it."""
        if rid is None or exc.status_code != 400 or "session" not in exc.message:
            return False
        s.session_.session.disable(exc.message)
        return True

    def _session_request(self, s: PromptState, body: dict[str, Any], force_open: bool = False) -> Any:
        prompt_len = len(s.text_)
        session_body, rid = self._enter_session(s, body, force_open)
        try:
            result = self.generate_raw(session_body)
        except BackendError as exc:
            if not self._session_refused(s, rid, exc):
                raise
            result, rid = self.generate_raw(body), None
        if rid is not None:
            s.session_.advance(rid, prompt_len)
        return result

    def cache_fork_prefix(self, s: PromptState) -> None:
        body = {"text": s.text_, "sampling_params": {"max_new_tokens": 0}}
        self._session_request(s, body, force_open=True)

    # ---------------------------------------------------------- generation
    def _generate_body(self, text: str, params: SglSamplingParams, stream: bool) -> dict[str, Any]:
        if stream and params.n not in (None, 1):
            raise ValueError("gen(n > 1) cannot stream")
        return {"text": text, "sampling_params": params.to_srt_kwargs(), "stream": stream,
                **params.logprob_kwargs()}

    def generate(self, s: PromptState, sampling_params: SglSamplingParams) -> tuple[Any, Any]:
        """(text, meta_info); with n > 1, (list of n texts, list of n meta_infos)."""
        obj = self._session_request(s, self._generate_body(s.text_, sampling_params, stream=False))
        if isinstance(obj, list):
            return [o["text"] for o in obj], [o["meta_info"] for o in obj]
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s: PromptState, sampling_params: SglSamplingParams
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
        body = self._generate_body(s.text_, sampling_params, stream=True)
        prompt_len = len(s.text_)
        session_body, rid = self._enter_session(s, body)
        try:
            yield from self._stream(session_body)
        except BackendError as exc:
            if not self._session_refused(s, rid, exc):   # (a refusal comes before any chunk)
                raise
            rid = None
            yield from self._stream(body)
        if rid is not None:
            s.session_.advance(rid, prompt_len)

    def _stream(self, body: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        try:
            with self._client.stream("POST", "/generate", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise error_from_response(resp)
                seen = 0
                for obj in iter_sse(resp.iter_lines()):
                    text = obj["text"]
                    yield text[seen:], obj["meta_info"]
                    seen = len(text)
        except httpx.HTTPError as exc:
            raise BackendError(f"streaming request to {self.base_url}/generate failed: {exc!r}") from exc

    # -------------------------------------------------------------- select
    def select(self, s: PromptState, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Scores each choice by the mean logprob of its own tokens given the prompt.

        1. Prefill the prompt alone (max_new_tokens 0): it enters the radix cache, and its
           `prompt_tokens` P tells where the choices start.
        2. One batched request of [prompt, prompt + choice_1, ...] with logprobs from P - margin:
           the prompt's own tail tokens show where each choice's tokenization departs from the
           prompt's (a boundary merge moves that point before P); the choice span runs from
           there to the end.
        """
        prompt = s.text_
        head = self.generate_raw({"text": prompt, "sampling_params": {"max_new_tokens": 0}})
        prompt_len = head["meta_info"]["prompt_tokens"]
        margin = SELECT_MARGIN_TOKENS
        while True:
            start = max(prompt_len - margin, 0)
            results = self.generate_raw({
                "text": [prompt] + [prompt + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True, "logprob_start_len": start, "return_text_in_logprobs": True,
            })
            spans = choice_spans(results[0], results[1:])
            if spans is not None or start == 0:
                break
            margin *= 4  # the merge reached back past the window: widen it
        if spans is None:
            raise BackendError("select: could not align the choices' tokens with the prompt's")
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            unconditional = self._unconditional_logprobs(spans)
        return decide(
            choices_method, temperature, choices=choices,
            normalized_prompt_logprobs=[mean_logprob(span) for span in spans],
            input_token_logprobs=spans,
            output_token_logprobs=[r["meta_info"].get("output_token_logprobs") or [] for r in results[1:]],
            unconditional_token_logprobs=unconditional,
        )

    def _unconditional_logprobs(self, spans: list[list[Any]]) -> list[list[Any]]:
        results = self.generate_raw({
            "input_ids": [[entry[1] for entry in span] for span in spans],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True,
        })
        return [r["meta_info"]["input_token_logprobs"] for r in results]


def _input_window(result: dict[str, Any]) -> tuple[int, list[list[Any]]]:
    """(position of the first returned entry, entries): entries cover the prompt's last tokens."""
    meta = result["meta_info"]
    entries = meta.get("input_token_logprobs") or []
    return meta["prompt_tokens"] - len(entries), entries


def choice_spans(prompt_result: dict[str, Any], choice_results: list[dict[str, Any]]) -> list[list[Any]] | None:
    """For each `prompt + choice` result, the logprob entries of the choice's own tokens: from the
    first position whose token differs from the prompt's tokenization (or lies past its end).
    None when that point is the window's first position (it may start earlier)."""
    prompt_first, prompt_entries = _input_window(prompt_result)
    prompt_len = prompt_result["meta_info"]["prompt_tokens"]
    prompt_ids = {prompt_first + j: entry[1] for j, entry in enumerate(prompt_entries)}
    spans = []
    for result in choice_results:
        first, entries = _input_window(result)
        window_start = max(first, prompt_first)
        split = len(entries)
        for j, entry in enumerate(entries):
            pos = first + j
            if pos >= prompt_len or prompt_ids.get(pos) != entry[1]:
                split = j
                break
        pos = first + split
        if pos < prompt_len and pos <= window_start and window_start > 0:
            return None
        spans.append(entries[split:])
    return spans


def iter_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of an SSE stream of `data: {...}` lines, up to `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        obj = json.loads(payload)
        if isinstance(obj, dict) and "error" in obj and "text" not in obj:
            raise BackendError(_error_message(obj))
        yield obj


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("error", "detail", "message"):
            if body.get(key):
                return body[key] if isinstance(body[key], str) else json.dumps(body[key])
    return json.dumps(body)


def error_from_response(resp: httpx.Response) -> BackendError:
    try:
        message = _error_message(resp.json())
    except ValueError:
        message = resp.text or resp.reason_phrase
    return BackendError(message, resp.status_code)
