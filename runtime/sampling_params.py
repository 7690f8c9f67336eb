"""SamplingParams: the validated, normalized form of a request's `sampling_params` dict.

Field names and defaults follow SGLang's native API, and every key of SGLang's `SamplingParams` is
accepted. `from_dict` accepts nulls for optional fields, empty grammar strings (unset) and `top_k: -1`
(disabled), and raises ValueError with a message a client can act on. Keys accepted but without effect:
`custom_params` (no custom logit processors here); `stream_interval` paces streamed chunks;
`beam_width` may only be 1 and `watermark` only null.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

_MAX_TOP_K = 1 << 30
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_BYTES = 256
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
# sampling keys a model's generation_config.json may set (see `apply_defaults`)
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None
    stream_interval: int | None = None
    beam_width: int | None = None
    custom_params: dict | None = None
    watermark: Any = None

    # ----------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Parse a request's dict; `defaults` (e.g. from generation_config.json) fill keys left unset."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError("sampling_params must be an object")
        known = cls.__dataclass_fields__
        unknown = sorted(k for k in d if k not in known)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs = {k: v for k, v in (defaults or {}).items() if d.get(k) is None}
        kwargs.update((k, v) for k, v in d.items() if v is not None)
        p = cls()
        for name, value in kwargs.items():
            setattr(p, name, _coerce(name, value, getattr(p, name)))
        p.normalize()
        p.validate()
        return p

    def normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = [s for s in self.stop_regex if s]
        for name in GRAMMAR_FIELDS:      # an empty constraint means "unset", as in SGLang
            if getattr(self, name) in ("", {}):
                setattr(self, name, None)
        if self.top_k in (0, -1) or self.top_k >= _MAX_TOP_K:
            self.top_k = -1
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            import json

            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            import json

            self.structural_tag = json.dumps(self.structural_tag)

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(f"{name} must be a finite number")
        if self.temperature < 0:
            bad("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p must be in [0, 1]")
        if self.top_k < -1:
            bad("top_k must be -1 (disabled) or >= 1")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty must be in (0, 2]")
        if self.max_new_tokens < 0:
            bad("max_new_tokens must be >= 0")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens must be in [0, max_new_tokens]")
        if self.n < 1 or self.n > 128:
            bad("n must be in [1, 128]")
        if sum(getattr(self, name) is not None for name in GRAMMAR_FIELDS) > 1:
            bad("Only one of regex, json_schema, ebnf and structural_tag may be set")
        if len(self.stop) > 32:
            bad("at most 32 stop strings are allowed")
        self._validate_stop_regex()
        for tid in self.stop_token_ids:
            if tid < 0:
                bad("stop_token_ids must be non-negative")
        if self.beam_width is not None and self.beam_width != 1:
            bad("beam_width: beam search is not supported by radixlm (only beam_width 1)")
        if self.watermark not in (None, False, {}, []):
            bad("watermark: watermarking is not supported by radixlm")
        if self.stream_interval is not None and self.stream_interval < 1:
            bad("stream_interval must be >= 1")
        for bias in self.logit_bias.values():
            if not math.isfinite(bias):
                bad("logit_bias values must be finite")

    def _validate_stop_regex(self) -> None:
        import re

        if len(self.stop_regex) > MAX_STOP_REGEX_COUNT:
            raise ValueError(f"at most {MAX_STOP_REGEX_COUNT} stop_regex patterns are allowed")
        for pattern in self.stop_regex:
            if len(pattern.encode("utf-8", "surrogatepass")) > MAX_STOP_REGEX_BYTES:
                raise ValueError(f"stop_regex is longer than {MAX_STOP_REGEX_BYTES} bytes")
            try:
                re.compile(pattern)
            except (re.error, RecursionError, OverflowError) as e:
                raise ValueError(f"Invalid stop_regex {pattern!r}: {e}") from None

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks that need the model's vocabulary size. Stop token ids outside the vocabulary are
        kept (they can never match), as SGLang does."""
        for tid in self.logit_bias:
            if not 0 <= tid < vocab_size:
                raise ValueError(f"logit_bias token id {tid} is out of range [0, {vocab_size})")

    # -------------------------------------------------------------- views
    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the grammar constraint, if any."""
        for kind in GRAMMAR_FIELDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Type-check one field; ints are accepted where floats are expected, never bool for numbers."""
    if name == "logit_bias":
        if not isinstance(value, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        out = {}
        for k, v in value.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias key {k!r} is not a token id") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError("logit_bias values must be numbers")
            out[tid] = _finite_float("logit_bias values", v)
        return out
    if name in ("stop", "stop_regex"):
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return list(value)
        raise ValueError(f"{name} must be a string or a list of strings")
    if name in ("structural_tag", "json_schema"):
        if isinstance(value, (str, dict)):
            return value
        raise ValueError(f"{name} must be a string or an object")
    if name == "custom_params":
        if isinstance(value, dict):
            return value
        raise ValueError("custom_params must be an object")
    if name == "watermark":
        return value
    if name in ("stream_interval", "beam_width"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be an integer")
    if name == "stop_token_ids":
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return list(value)
        raise ValueError("stop_token_ids must be a list of integers")
    if name == "sampling_seed":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError("sampling_seed must be an integer")
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                isinstance(value, float) and not math.isfinite(value) or value != int(value):
            raise ValueError(f"{name} must be an integer")   # (int(inf) would raise OverflowError)
        return int(value)
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number")
        return _finite_float(name, value)
    if default is None or isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string")
        return value
    return value


def _finite_float(name: str, value: int | float) -> float:
    """float(value), refusing integers beyond the float range (float() raises OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number") from None
