"""Logprob helpers: turn logits into the logprobs that requests with `return_logprob` get back.

Which logits go in (this follows SGLang's default):
- input (prompt) token logprobs: the RAW model logits, `compute_logprobs(logits)`;
- output token logprobs: the distribution the token was drawn from, i.e. after logit_bias,
  penalties and masks, divided by temperature, before top-k/top-p/min-p. `Sampler.sample(...,
  return_logprobs=True)` returns exactly that tensor; greedy rows use temperature 1.

Top logprobs are `(logprob, token_id)` pairs, best first, the order of the wire triples
`[logprob, token_id, text]`.
"""

from __future__ import annotations

import torch


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, in float32. `logits`: [n, V] (any float dtype)."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor | list[int]) -> list[float]:
    """`logprobs[i, token_ids[i]]` for each row i, as Python floats. `logprobs`: [n, V]."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=logprobs.device).view(-1, 1)
    if ids.shape[0] != logprobs.shape[0]:
        raise ValueError(f"need one token id per row: {ids.shape[0]} ids for {logprobs.shape[0]} rows")
    return logprobs.gather(1, ids).view(-1).tolist()


def top_k_logprobs(logprobs: torch.Tensor, k_per_row: list[int]) -> list[list[tuple[float, int]]]:
    """For each row i, its `k_per_row[i]` best `(logprob, token_id)` pairs, best first (an empty
    list for k = 0). One top-k over the batch with the largest k."""
    if len(k_per_row) != logprobs.shape[0]:
        raise ValueError(f"need one k per row: {len(k_per_row)} ks for {logprobs.shape[0]} rows")
    max_k = min(max(k_per_row, default=0), logprobs.shape[-1])
    if max_k <= 0:
        return [[] for _ in k_per_row]
    values, indices = torch.topk(logprobs, max_k, dim=-1, sorted=True)
    values_list, indices_list = values.tolist(), indices.tolist()
    return [list(zip(values_list[i][:k], indices_list[i][:k], strict=True)) for i, k in enumerate(k_per_row)]
