"""The detokenizer process: token ids in, text deltas out.

    scheduler --BatchTokenIDOut--> [IncrementalDetokenizer per rid] --BatchStrOut--> tokenizer manager

Every other message (control replies, stats) is forwarded unchanged. `IncrementalDetokenizer` is a
pure class (no sockets) so it can be unit-tested: per rid it decodes a short window of tokens at a
time, the way HF/vLLM incremental detokenization does, so merges across tokens come out right, and
it holds back text until it is final:

    text[:sent_len]             already sent to the tokenizer manager
    text[sent_len:end]          sent now
    text[end:]                  held: could be the start of a stop string, or of a stop_regex
                                match (a partial match that reaches the end of the text)
    ids[read_offset:]           held: their text ends in a partial UTF-8 character (U+FFFD)
"""

from __future__ import annotations

import logging
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import regex as _regex
import zmq

from ..server_args import ServerArgs
from .io_struct import (
    BatchStrOut,
    BatchTokenIDOut,
    ChildFailed,
    DecodeParams,
    DetokenizerReady,
    ReqStrOut,
    ReqTokenOut,
)
from .ipc import PortArgs, Puller, Pusher

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DecodeState:
    """Incremental decoding state of one request (output tokens only)."""

    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0      # start of the decode window; text before it is final
    read_offset: int = 0        # ids[:read_offset] are decoded into `text`
    text: str = ""              # text of ids[:read_offset]
    sent_len: int = 0           # chars of `text` already sent
    params: DecodeParams = field(default_factory=DecodeParams)   # from the request's first output


class IncrementalDetokenizer:
    """Turns per-step token deltas into text deltas. Not thread-safe; one instance per process."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added_text: dict[int, str] = {tid: str(tok) for tid, tok in added.items()}
        self.special_ids: set[int] = set(tokenizer.all_special_ids) | {
            tid for tid, tok in added.items() if getattr(tok, "special", False)}
        # added tokens that split the text into space-joined parts, when special tokens are kept / skipped
        self.split_ids_keep: frozenset[int] = frozenset(self.added_text)
        self.split_ids_skip: frozenset[int] = frozenset(self.added_text.keys() - self.special_ids)
        self.states: dict[str, DecodeState] = {}

    # ----------------------------------------------------------- decoding
    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Full decode with the detokenizer's semantics (the reference for incremental decoding).

        With `spaces_between_special_tokens` (and special tokens kept), added tokens and the runs of
        ordinary text between them are joined by one space, as HF's slow tokenizers do; fast
        tokenizers ignore the flag, so it is applied here."""
        split_ids = self.split_ids_skip if skip_special_tokens else self.split_ids_keep
        if not spaces_between_special_tokens or split_ids.isdisjoint(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for tid in ids:
            if skip_special_tokens and tid in self.special_ids:
                continue
            if tid in self.added_text:
                if run:
                    parts.append(self.tokenizer.decode(run))
                    run = []
                parts.append(self.added_text[tid])
            else:
                run.append(tid)
        if run:
            parts.append(self.tokenizer.decode(run))
        return " ".join(parts)

    def _advance(self, st: DecodeState, new_ids: list[int], skip: bool, spaces: bool, final: bool) -> None:
        """Appends tokens and moves complete text into `st.text` (all of it when `final`)."""
        st.ids.extend(new_ids)
        if st.read_offset == len(st.ids):
            return
        prefix_text = self.decode(st.ids[st.prefix_offset:st.read_offset], skip, spaces)
        window_text = self.decode(st.ids[st.prefix_offset:], skip, spaces)
        grew = len(window_text) > len(prefix_text)
        if grew and (final or not window_text.endswith(REPLACEMENT_CHAR)):
            st.text += window_text[len(prefix_text):]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    # --------------------------------------------------------- one output
    def process(self, out: ReqTokenOut) -> str:
        """Consumes one ReqTokenOut and returns the text delta to send for its rid.

        A finished request is trimmed at its matched stop (a stop string, or the stop token's
        text) unless `no_stop_trim`, and its state is dropped."""
        st = self.states.setdefault(out.rid, DecodeState())
        if out.decode is not None:
            st.params = out.decode
        p = st.params
        reason = out.finish_reason
        finished = reason is not None
        matched = reason.get("matched") if finished and reason.get("type") == "stop" else None
        new_ids = out.new_token_ids
        trim = finished and not p.no_stop_trim
        if trim and isinstance(matched, int) and new_ids and new_ids[-1] == matched:
            new_ids = new_ids[:-1]       # the stop token (eos / stop_token_ids) is not part of the text
        self._advance(st, new_ids, p.skip_special_tokens, p.spaces_between_special_tokens, finished)
        if finished:
            del self.states[out.rid]
            end = len(st.text)
            if trim and isinstance(matched, str) and matched:
                pos = _stop_position(st.text, st.sent_len, matched, matched in p.stop_regex)
                if pos != -1:
                    end = pos
        elif p.no_stop_trim:
            end = len(st.text)
        else:
            end = stop_safe_end(st.text, st.sent_len, p.stop_strs)
            if p.stop_regex:
                end = min(end, stop_regex_safe_end(st.text, st.sent_len, p.stop_regex))
        delta = st.text[st.sent_len:end]
        st.sent_len = max(st.sent_len, end)
        return delta

    def process_batch(self, batch: BatchTokenIDOut) -> BatchStrOut:
        return BatchStrOut([ReqStrOut(out.rid, self.process(out), out) for out in batch.outputs])


def stop_safe_end(text: str, start: int, stop_strs: list[str]) -> int:
    """The end of the text that can be sent: before any suffix of `text` that is a proper prefix of
    a stop string (it may still grow into the stop string). Never less than `start`."""
    end = len(text)
    for stop in stop_strs:
        for k in range(min(len(stop) - 1, len(text) - start), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return max(end, start)


def stop_regex_safe_end(text: str, start: int, patterns: list[str]) -> int:
    """The end of the text that can be sent: before the first (partial) match of any stop_regex in
    `text[start:]` (a partial match reaches the end of the text and may still complete)."""
    end = len(text)
    for pattern in patterns:
        m = _regex.search(pattern, text, pos=start, partial=True)
        if m is not None:
            end = min(end, m.start())
    return max(end, start)


def _stop_position(text: str, start: int, matched: str, is_regex: bool) -> int:
    """Where the output is cut at its matched stop string / stop_regex (-1: not found)."""
    if not is_regex:
        return text.find(matched, start)
    m = _regex.search(matched, text, pos=start) or _regex.search(matched, text)
    return -1 if m is None else max(m.start(), start)


# ------------------------------------------------------------------- the process
class DetokenizerManager:
    def __init__(self, tokenizer: Any, puller: Puller, pusher: Pusher):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.puller = puller
        self.pusher = pusher

    def handle(self, msg: Any) -> Any:
        if isinstance(msg, BatchTokenIDOut):
            return self.detokenizer.process_batch(msg)
        return msg

    def event_loop(self) -> None:
        """Blocks on the socket (no busy polling); runs until the process is killed."""
        while True:
            msg = self.puller.recv()
            self.pusher.send(self.handle(msg))


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, ready_writer: Any) -> None:
    """Process entry: load the tokenizer, bind, send `DetokenizerReady`, then serve forever."""
    from ..utils import configure_logging, kill_self_with_parent
    from .tokenizer_manager import load_tokenizer

    configure_logging(server_args.log_level, "detokenizer")
    kill_self_with_parent()
    try:
        tokenizer = load_tokenizer(server_args)
        ctx = zmq.Context()
        manager = DetokenizerManager(tokenizer, Puller(ctx, port_args.detokenizer_input),
                                     Pusher(ctx, port_args.tokenizer_input))
    except Exception as e:  # noqa: BLE001 - report any startup failure to the parent, then exit
        logger.error("detokenizer failed to start: %s", traceback.format_exc())
        ready_writer.send(ChildFailed("detokenizer", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    ready_writer.send(DetokenizerReady())
    try:
        manager.event_loop()
    except Exception:  # noqa: BLE001
        logger.error("detokenizer crashed: %s", traceback.format_exc())
        sys.exit(1)
