"""Requests with a grammar constraint (regex, JSON schema, EBNF, structural tag) wait here while it compiles.

Compilation runs in the grammar backend's worker processes, so the scheduler loop never blocks on it.
An invalid constraint (or one over a size, time or memory limit) finishes only that request, with an
abort reason that carries `status_code: 400` so the client gets a clear 400.
"""

from __future__ import annotations

from collections.abc import Callable

from ..server_args import ServerArgs
from .req import Req


class GrammarQueue:
    def __init__(self, args: ServerArgs, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.pending: list[Req] = []
        self._backend = None

    @property
    def backend(self):
        if self._backend is None:            # outlines-core vocabulary is built on first use
            from ..constrained.grammar_backend import GrammarBackend

            self._backend = GrammarBackend(
                self.tokenizer, self.vocab_size, self.eos_token_ids,
                whitespace_pattern=self.args.constrained_json_whitespace_pattern,
                compile_timeout=self.args.grammar_compile_timeout, backend=self.args.grammar_backend,
                max_constraint_bytes=self.args.max_constraint_bytes,
                memory_limit_mb=self.args.grammar_compile_memory_mb)
        return self._backend

    def add(self, req: Req) -> None:
        import time

        kind, spec = req.sampling_params.constraint
        req.grammar_future = self.backend.request(kind, spec)
        req.grammar_wait_start = time.monotonic()
        if self.args.tp_size > 1:
            # every TP rank must release the request at the same step: wait for it here instead of
            # polling (compile times differ across ranks)
            try:
                req.grammar_future.result(timeout=self.args.grammar_compile_timeout)
            except Exception:  # noqa: BLE001 - poll() turns the failure into a GrammarError
                pass
        self.pending.append(req)

    def pop_ready(self, on_error: Callable[[Req, dict], None]) -> list[Req]:
        """Requests whose grammar is compiled (their matcher set); failures go to `on_error`."""
        if not self.pending:
            return []
        from ..constrained.grammar_backend import GrammarError

        ready = []
        for req in list(self.pending):
            result = self.backend.poll(req.grammar_future, req.grammar_wait_start)
            if result is None:
                continue
            self.pending.remove(req)
            if isinstance(result, GrammarError):
                on_error(req, {"type": "abort", "message": str(result), "status_code": 400})
            else:
                req.grammar = result.new_matcher()
                ready.append(req)
        return ready

    def shutdown(self) -> None:
        """Kill the compile workers (if they were started)."""
        if self._backend is not None:
            self._backend.shutdown()

    def discard(self, req: Req) -> None:
        if req in self.pending:
            self.pending.remove(req)
