"""SamplingBatchInfo: one decode step's sampling parameters, as batched tensors.

The scheduler builds one per step from each request's `SamplingParams` and token lists; the
`Sampler` consumes it. Everything optional (penalties, logit_bias, the min_new_tokens ban, the
grammar vocab mask) is `None` when no request in the batch uses it, so a plain batch costs a few
tiny tensors and no [bs, vocab] work.

Semantics, per request (row):
- greedy rows (`temperature < 1e-5` or `top_k == 1`) take the argmax of the processed logits;
  their temperature is stored as 1.0 so that the scaled logits stay finite.
- `top_k == -1` is stored as `vocab_size` (disabled).
- frequency / presence penalties count OUTPUT tokens only; the repetition penalty (HF style)
  covers prompt and output tokens. Each penalized request keeps its counts / seen set in a
  `PenaltyState` across steps (built from the prompt once, then one new token or so per step);
  `build` stacks those rows instead of rebuilding them from the whole sequence.
- while `len(output) < min_new_tokens`, the eos ids and the request's `stop_token_ids` are banned.
  `ignore_eos` does not ban anything here (as in SGLang): the scheduler simply does not stop on eos.
- a request with `sampling_seed` gets a per-step seed derived from (seed, len(output)), so its
  draws do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams
from ..utils import to_device

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingBatchInfo:
    vocab_size: int
    temperatures: torch.Tensor              # [bs, 1] float32, 1.0 on greedy rows
    top_ps: torch.Tensor                    # [bs] float32
    top_ks: torch.Tensor                    # [bs] int64, vocab_size when disabled
    min_ps: torch.Tensor                    # [bs] float32
    is_greedy: torch.Tensor                 # [bs] bool
    has_filter: torch.Tensor                # [bs] bool: sampled row with top-k, top-p or min-p
    is_all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int                          # largest top_k over filtered rows (vocab_size if unbounded)
    # Penalties; None when no request uses them.
    frequency_penalties: torch.Tensor | None = None   # [bs, 1] float32
    presence_penalties: torch.Tensor | None = None    # [bs, 1] float32
    output_counts: torch.Tensor | None = None         # [bs, V] float32, count of each output token
    repetition_penalties: torch.Tensor | None = None  # [bs, 1] float32
    seen_tokens: torch.Tensor | None = None           # [bs, V] bool, token in prompt or output
    logit_bias: torch.Tensor | None = None            # [bs, V] float32
    # min_new_tokens ban as (row, token id) pairs: logits[ban_rows[j], ban_ids[j]] = -inf.
    ban_rows: torch.Tensor | None = None              # [num_bans] int64
    ban_ids: torch.Tensor | None = None               # [num_bans] int64
    vocab_mask: torch.Tensor | None = None            # [bs, V] bool (True = allowed) or int32 bitmask
    # (row, seed for this step) of every seeded request; other rows use the global RNG.
    row_seeds: tuple[tuple[int, int], ...] = ()

    @property
    def any_filter(self) -> bool:
        return self.need_top_k or self.need_top_p or self.need_min_p

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    @classmethod
    def build(cls, params: list[SamplingParams], input_ids: list[list[int]], output_ids: list[list[int]],
              vocab_size: int, eos_token_ids: list[int], device: torch.device | str,
              vocab_mask: torch.Tensor | None = None,
              penalty_states: list[PenaltyState | None] | None = None) -> SamplingBatchInfo:
        """Batches the parameters of `params[i]` for the request with tokens `input_ids[i]` (prompt)
        and `output_ids[i]` (generated so far). Reads the lists, modifies nothing but the states.

        `penalty_states[i]`, if given, is request i's state kept across steps (None for a request
        without penalties); `build` brings it up to date with `output_ids[i]`. Without them, the
        states are built here from the lists (the same values, at the cost of the whole sequence).

        `vocab_mask`, if given, is a bool [bs, vocab_size] tensor (True = allowed) or the int32 bitmask
        [bs, ceil(vocab_size / 32)] of kernels/vocab_mask (applied without unpacking to bool); each row
        must allow at least one token.
        """
        bs = len(params)
        if len(input_ids) != bs or len(output_ids) != bs:
            raise ValueError("params, input_ids and output_ids must have one entry per request")
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        filtered = [not g and (k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)
                    for p, g, k in zip(params, greedy, top_ks, strict=True)]
        filtered_params = [p for p, f in zip(params, filtered, strict=True) if f]
        info = cls(
            vocab_size=vocab_size,
            temperatures=_tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                                 torch.float32, device).view(bs, 1),
            top_ps=_tensor([p.top_p for p in params], torch.float32, device),
            top_ks=_tensor(top_ks, torch.int64, device),
            min_ps=_tensor([p.min_p for p in params], torch.float32, device),
            is_greedy=_tensor(greedy, torch.bool, device),
            has_filter=_tensor(filtered, torch.bool, device),
            is_all_greedy=all(greedy),
            need_top_k=any(p.top_k != -1 and p.top_k < vocab_size for p in filtered_params),
            need_top_p=any(p.top_p < 1.0 for p in filtered_params),
            need_min_p=any(p.min_p > 0.0 for p in filtered_params),
            max_top_k=max((k for k, f in zip(top_ks, filtered, strict=True) if f), default=1),
            row_seeds=tuple((i, step_seed(p.sampling_seed, len(out)))
                            for i, (p, out) in enumerate(zip(params, output_ids, strict=True))
                            if p.sampling_seed is not None),
        )
        if penalty_states is None:
            penalty_states = [PenaltyState(p, ids, vocab_size, device) if p.has_penalties else None
                              for p, ids in zip(params, input_ids, strict=True)]
        info._add_penalties(params, penalty_states, output_ids, device)
        info._add_logit_bias(params, device)
        info._add_min_tokens_ban(params, output_ids, eos_token_ids, device)
        if vocab_mask is not None:
            width = (vocab_size + 31) // 32 if vocab_mask.dtype == torch.int32 else vocab_size
            if tuple(vocab_mask.shape) != (bs, width):
                raise ValueError(f"vocab_mask must have shape {(bs, width)}, "
                                 f"got {tuple(vocab_mask.shape)}")
            dtype = torch.int32 if vocab_mask.dtype == torch.int32 else torch.bool
            info.vocab_mask = vocab_mask.to(device=device, dtype=dtype)
        return info

    # ------------------------------------------------------------------ builders
    def _add_penalties(self, params: list[SamplingParams], states: list[PenaltyState | None],
                       output_ids: list[list[int]], device: torch.device | str) -> None:
        bs = len(params)
        for state, out in zip(states, output_ids, strict=True):
            if state is not None:
                state.update(out)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            self.frequency_penalties = _tensor([p.frequency_penalty for p in params], torch.float32,
                                               device).view(bs, 1)
            self.presence_penalties = _tensor([p.presence_penalty for p in params], torch.float32,
                                              device).view(bs, 1)
            self.output_counts = _stack_rows([s.counts if s else None for s in states], self.vocab_size,
                                             torch.float32, device)
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalties = _tensor([p.repetition_penalty for p in params], torch.float32,
                                                device).view(bs, 1)
            self.seen_tokens = _stack_rows([s.seen if s else None for s in states], self.vocab_size,
                                           torch.bool, device)

    def _add_logit_bias(self, params: list[SamplingParams], device: torch.device | str) -> None:
        if not any(p.logit_bias for p in params):
            return
        rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
        ids = [tid for p in params for tid in p.logit_bias]
        values = [v for p in params for v in p.logit_bias.values()]
        bias = torch.zeros(len(params), self.vocab_size, dtype=torch.float32, device=device)
        bias[_tensor(rows, torch.int64, device), _tensor(ids, torch.int64, device)] = _tensor(
            values, torch.float32, device)
        self.logit_bias = bias

    def _add_min_tokens_ban(self, params: list[SamplingParams], output_ids: list[list[int]],
                            eos_token_ids: list[int], device: torch.device | str) -> None:
        rows: list[int] = []
        ids: list[int] = []
        for i, (p, out) in enumerate(zip(params, output_ids, strict=True)):
            if len(out) < p.min_new_tokens:
                banned = sorted(t for t in {*eos_token_ids, *p.stop_token_ids} if t < self.vocab_size)  # others never occur
                rows.extend([i] * len(banned))
                ids.extend(banned)
        if rows:
            self.ban_rows = _tensor(rows, torch.int64, device)
            self.ban_ids = _tensor(ids, torch.int64, device)


class PenaltyState:
    """One request's penalty inputs, kept from step to step.

    `counts` [V] float32: how often each token occurs in the output (frequency / presence
    penalties; None when the request has neither). `seen` [V] bool: the tokens of the prompt and
    the output (repetition penalty; None when it is 1.0). `update` folds in the output tokens
    added since its last call, so a step costs the new tokens, not the whole sequence.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 device: torch.device | str):
        self.counts = self.seen = None
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self.seen[_tensor(list(prompt_ids), torch.int64, device)] = True
        self.device = device
        self.num_output = 0                     # output tokens folded in so far

    def update(self, output_ids: list[int]) -> None:
        if len(output_ids) <= self.num_output:
            return
        new = _tensor(output_ids[self.num_output:], torch.int64, self.device)
        self.num_output = len(output_ids)
        if self.counts is not None:
            self.counts.index_put_((new,), torch.ones_like(new, dtype=torch.float32), accumulate=True)
        if self.seen is not None:
            self.seen[new] = True


def is_plain_greedy(params: list[SamplingParams], output_ids: list[list[int]]) -> bool:
    """True when every row is greedy and no step of the pipeline applies to any row (no penalties,
    logit_bias or pending min_new_tokens ban): the next tokens are then just the argmax of the raw
    logits, and building a SamplingBatchInfo can be skipped. Grammar masks and logprobs are the
    caller's to check."""
    for p, out in zip(params, output_ids, strict=True):
        if not p.is_greedy or p.has_penalties or p.logit_bias or len(out) < p.min_new_tokens:
            return False
    return True


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request at output position `step` (a 63-bit mix of both)."""
    return _mix64((seed & _MASK64) ^ _mix64(step)) >> 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: spreads nearby inputs over the whole 64-bit range."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)   # pinned staging on CUDA


def _stack_rows(rows: list[torch.Tensor | None], vocab_size: int, dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """[len(rows), vocab_size]: each row, or zeros where it is None (one copy, no per-token work)."""
    zero = None
    out = []
    for row in rows:
        if row is None:
            if zero is None:
                zero = torch.zeros(vocab_size, dtype=dtype, device=device)
            row = zero
        out.append(row)
    return torch.stack(out)
