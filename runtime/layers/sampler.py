"""Sampler: picks the next token of every request in a batch from the model's last-position logits.

One step, vectorized over the batch (the only per-row Python work is drawing noise for seeded rows):

    1. logit_bias                  logits += bias
    2. penalties                   repetition (HF style, prompt + output), then
                                   frequency * count + presence * (count > 0) (output only)
    3. min_new_tokens ban          eos / stop ids -> -inf
    4. grammar vocab mask          disallowed -> -inf
    5. greedy rows                 argmax of the processed logits
       other rows                  softmax(logits / temperature), then top-k, top-p (on the
                                   top-k-renormalized distribution) and min-p filtering, then a draw

If the ban of step 3 leaves a row with no allowed token (for example a grammar that only allows
eos before min_new_tokens), the ban is lifted for that row: the grammar wins.

Draws use the exponential race: token = argmax(p / q) with q ~ Exp(1) per token, which samples
exactly from p. Seeded rows fill q from their own `torch.Generator`, seeded per step (see
`sampling_batch_info.step_seed`), so a seeded request gives the same tokens alone or in any batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...kernels import cpu_ops
from ...kernels.vocab_mask import apply_vocab_mask
from .sampling_batch_info import SamplingBatchInfo

_NEG_INF = float("-inf")
# Filtering takes a `topk` of the candidates instead of a full sort when the batch's largest
# top_k is at most this.
TOPK_PATH_LIMIT = 1024


class SamplerOutput(NamedTuple):
    next_token_ids: torch.Tensor       # [bs] int64
    # [bs, V] float32: log_softmax(processed logits / temperature), clamped to the float32 minimum,
    # or None when not asked for. This is what SGLang reports by default for output tokens.
    logprobs: torch.Tensor | None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, int64 [rows] (the first one on ties; a row with a NaN
    gives its first NaN's index), as `x.max(dim=-1).indices`. On CPU through the fused ops' C++
    argmax (kernels/cpu_ops) when they are loaded: for a [64, 49152] fp32 batch on a 2-core Zen 4,
    0.11 ms against 1.8 for `max(dim)` and 1.4 for torch.argmax."""
    if x.dim() == 2 and x.shape[-1] > 0 and cpu_ops.fits(x):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        cpu_ops.call("argmax_rows", out, x)
        return out
    return x.max(dim=-1).indices


class Sampler:
    """Stateless; one instance per model runner."""

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Next token ids [bs] int64 for `logits` [bs, V]. Does not modify `logits`."""
        return self.sample(logits, info).next_token_ids

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """Argmax of each row of `logits` [bs, V] as int64 [bs]: what `sample` returns for a batch
        that `sampling_batch_info.is_plain_greedy` accepts (ties go to the lowest id in both)."""
        return argmax_rows(logits)

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo, return_logprobs: bool = False
               ) -> SamplerOutput:
        """Like `__call__`, and optionally also the logprobs of the distribution sampled from
        (after bias, penalties and masks, scaled by temperature, before top-k/top-p/min-p).
        """
        if logits.dim() != 2 or logits.shape != (info.batch_size, info.vocab_size):
            raise ValueError(f"logits must have shape {(info.batch_size, info.vocab_size)}, "
                             f"got {tuple(logits.shape)}")
        logits = process_logits(logits.float(), info)
        greedy_ids = argmax_rows(logits)
        need_scaled = return_logprobs or not info.is_all_greedy
        logprobs = None
        if need_scaled:
            logprobs = torch.log_softmax(logits / info.temperatures, dim=-1)
        if info.is_all_greedy:
            next_ids = greedy_ids
        else:
            sampled_ids = sample_from_probs(logprobs.exp(), info)
            next_ids = torch.where(info.is_greedy, greedy_ids, sampled_ids)
        if return_logprobs:
            logprobs = logprobs.clamp_min(torch.finfo(torch.float32).min)
        return SamplerOutput(next_ids.to(torch.int64), logprobs if return_logprobs else None)


def process_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Steps 1-4 of the module docstring. Never modifies `logits`; returns it as is when the
    batch uses none of these steps."""
    out = logits
    if info.logit_bias is not None:
        out = out + info.logit_bias
    out = apply_penalties(out, info)
    if info.ban_rows is not None:
        unbanned = out
        out = out.index_put((info.ban_rows, info.ban_ids), torch.tensor(_NEG_INF, device=out.device))
        if info.vocab_mask is not None:
            unbanned = _masked(unbanned, info.vocab_mask)
            out = _masked(out, info.vocab_mask)
        # A row the ban emptied falls back to its unbanned logits.
        emptied = torch.isneginf(out).all(dim=-1, keepdim=True)
        out = torch.where(emptied, unbanned, out)
    elif info.vocab_mask is not None:
        out = _masked(out, info.vocab_mask)
    return out


def _masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` with disallowed tokens at -inf. An int32 bitmask is applied by bit
    operations (kernels/vocab_mask: ~20x faster than unpacking to bool + masked_fill at bs 32, 49k)."""
    if mask.dtype == torch.bool:
        return logits.masked_fill(~mask, _NEG_INF)
    out = logits.clone()
    apply_vocab_mask(out, mask)
    return out


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Repetition penalty over seen tokens (positive logits divided, negative multiplied), then
    frequency and presence penalties over output-token counts. Out of place."""
    if info.seen_tokens is not None:
        penalty = info.repetition_penalties
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(info.seen_tokens, penalized, logits)
    if info.output_counts is not None:
        counts = info.output_counts
        logits = logits - info.frequency_penalties * counts - info.presence_penalties * (counts > 0)
    return logits


def sample_from_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """One token id per row of `probs` [bs, V], after top-k / top-p / min-p filtering.

    The noise is drawn per token id, so a row picks the same token whichever candidate set the
    batch uses: rows without a filter pick over the whole vocabulary; filtered rows pick among
    their candidates in descending order (see `sorted_candidates`).
    """
    noise = exponential_noise(info, probs.shape)               # [bs, V], by token id
    plain_ids = argmax_rows(probs / noise)
    if not info.any_filter:
        return plain_ids
    cand_probs, cand_ids = sorted_candidates(probs, info)      # [bs, K] each
    pick = argmax_rows(cand_probs / noise.gather(1, cand_ids)).unsqueeze(1)
    return torch.where(info.has_filter, cand_ids.gather(1, pick).view(-1), plain_ids)


def sorted_candidates(probs: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(filtered probs, token ids) of each row's candidates in descending order, [bs, K] each.

    A full sort of a large vocabulary is slow, so: when every filtered row has top_k <= the
    limit, K is the largest top_k (a `topk`); else a `topk` of the limit is kept when it provably
    holds every token a filtered row can keep (its top-p or min-p cut falls inside), and only
    otherwise the rows are fully sorted. All paths keep the same tokens with the same probs.
    """
    vocab = probs.shape[-1]
    limit = min(TOPK_PATH_LIMIT, vocab - 1)
    full_mass = probs.sum(dim=-1, keepdim=True)                # top-p total of unbounded rows
    if info.max_top_k <= limit:
        values, ids = torch.topk(probs, info.max_top_k, dim=-1, sorted=True)
        return filter_sorted_probs(values, info, full_mass), ids
    if limit >= 1:
        values, ids = torch.topk(probs, limit, dim=-1, sorted=True)
        if bool(_holds_kept_set(values, info, full_mass).all()):
            return filter_sorted_probs(values, info, full_mass), ids
    # Stable sort: among equal probs the lower token id ranks first, as argmax picks it.
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return filter_sorted_probs(values, info, full_mass), ids


def _holds_kept_set(values: torch.Tensor, info: SamplingBatchInfo, full_mass: torch.Tensor) -> torch.Tensor:
    """[bs] bool: the K best tokens `values` [bs, K] include every token the row's filters keep."""
    k = values.shape[-1]
    unbounded = info.top_ks >= info.vocab_size
    # The token at rank K would have exactly this mass before it (the same sums as a full sort).
    cut_by_top_p = torch.cumsum(values, dim=-1)[:, -1] > info.top_ps * full_mass.view(-1)
    cut_by_min_p = values[:, -1] < values[:, 0] * info.min_ps
    return ~info.has_filter | (info.top_ks <= k) | (unbounded & (cut_by_top_p | cut_by_min_p))


def filter_sorted_probs(sorted_probs: torch.Tensor, info: SamplingBatchInfo,
                        full_mass: torch.Tensor) -> torch.Tensor:
    """`sorted_probs` [bs, K]: the K best probs of each row, descending. Zeroes ranks >= top_k,
    then tokens outside top_p of the top-k mass (`full_mass` [bs, 1] for rows without top_k),
    then tokens below min_p * max prob. Returns unnormalized probs; column 0 always stays."""
    if info.need_top_k:
        ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device).view(1, -1)
        sorted_probs = sorted_probs.masked_fill(ranks >= info.top_ks.view(-1, 1), 0.0)
    if info.need_top_p:
        # Mass strictly before each token; a token is kept while that is <= top_p * total.
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))
        unbounded = (info.top_ks >= info.vocab_size).view(-1, 1)
        total = torch.where(unbounded, full_mass, cumulative[:, -1:])
        sorted_probs = sorted_probs.masked_fill(before > info.top_ps.view(-1, 1) * total, 0.0)
    if info.need_min_p:
        threshold = sorted_probs[:, :1] * info.min_ps.view(-1, 1)
        sorted_probs = sorted_probs.masked_fill(sorted_probs < threshold, 0.0)
    return sorted_probs


def exponential_noise(info: SamplingBatchInfo, shape: torch.Size) -> torch.Tensor:
    """q ~ Exp(1) (as -log U) per row and token id, shape [bs, V], strictly positive.

    Unseeded rows draw from the global RNG; a seeded row from its own generator, so its noise
    does not depend on the rest of the batch."""
    device = info.temperatures.device
    noise = torch.rand(shape, device=device).log_().neg_()
    for row, seed in info.row_seeds:
        generator = torch.Generator(device=device).manual_seed(seed)
        noise[row] = torch.rand(shape[-1], generator=generator, device=device).log_().neg_()
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
