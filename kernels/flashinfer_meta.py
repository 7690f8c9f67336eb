"""Builds FlashInfer's paged-KV metadata from a batch's req->token table (pure torch, CPU-testable).

Our KV buffers are `[num_slots, kv_heads, head_dim]` with `num_slots = (num_pages + 1) * P`
(P = page_size); slot `s` is row `s % P` of page `s // P`, page 0 reserved. So the paged view
FlashInfer wants is simply `buffer.view(num_pages + 1, P, kv_heads, head_dim)` ("NHD" layout).
A request's tokens `[k*P, (k+1)*P)` always share one page (see memory_pool.py), so its page list
is the page of every P-th token: `req_to_token[row, 0:seq_len:P] // P`.

Per request i of a batch (all in tokens unless said otherwise):

    [0, prefix_len)        KV already cached
    [prefix_len, seq_len)  this pass's queries (qo_len = seq_len - prefix_len)
    pages                  ceil(seq_len / P) page ids; the last holds ((seq_len - 1) % P) + 1 tokens

FlashInfer facts this module relies on (from the FlashInfer docs and source; no code copied):
- The paged KV layout is CSR: request i's pages are `paged_kv_indices[kv_indptr[i]:kv_indptr[i+1]]`,
  `paged_kv_last_page_len[i]` is in `[1, page_size]`, so kv_len = (num_pages - 1) * P + last_len.
- `qo_indptr` is the prefix sum of per-request query counts (`[batch + 1]`). All index tensors
  are int32.
- With `causal=True` and qo_len < kv_len, query j of a request sits at kv position
  `kv_len - qo_len + j` (the queries are the last qo_len tokens), i.e. the bottom-right-aligned
  causal mask. `paged_attention_ref` implements exactly this.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..runtime.utils import ceil_div, to_device


class PagedMeta(NamedTuple):
    """FlashInfer's paged-attention metadata for one forward pass (all int32; on the table's device,
    except the indptrs and last-page lengths from `build_paged_meta_host`, which stay on the host)."""

    qo_indptr: torch.Tensor         # [bs + 1]  prefix sum of qo_len (query tokens per request)
    kv_indptr: torch.Tensor         # [bs + 1]  prefix sum of pages per request
    kv_indices: torch.Tensor        # [kv_indptr[-1]]  page ids, request after request
    kv_last_page_len: torch.Tensor  # [bs]  tokens in each request's last page, in [1, page_size]

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len.numel())


def _prefix_sum(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    out[1:] = torch.cumsum(counts, dim=0)
    return out


def build_paged_meta(req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int, total_pages: int | None = None) -> PagedMeta:
    """Metadata for attending each request's queries `[prefix_len, seq_len)` over its KV `[0, seq_len)`.

    `req_to_token`: the `[rows, context_len]` slot table; `req_rows`, `prefix_lens`, `seq_lens`: `[bs]`
    (every seq_len >= 1). The indptrs and last-page lengths are computed where the lengths live (on
    the host for `build_paged_meta_host`); `kv_indices` is gathered on the table's device.
    `total_pages`, if the caller knows it (sum of ceil(seq_len / P), e.g. from CPU lengths), spares a
    device->host sync. Reads the table only.
    """
    P = page_size
    seq = seq_lens.to(torch.int64)
    qo_lens = seq - prefix_lens.to(device=seq.device, dtype=torch.int64)
    num_pages = (seq + P - 1) // P                                     # [bs]
    kv_indptr = _prefix_sum(num_pages)
    if total_pages is None:
        total_pages = int(num_pages.sum())
    # One entry per (request, page k): the slot of token k*P names the page.
    device = req_to_token.device
    rows = req_rows.to(device=device, dtype=torch.int64)
    indptr = to_device(kv_indptr, device).to(torch.int64)              # pinned copy on CUDA
    owner = torch.repeat_interleave(torch.arange(rows.numel(), device=device), indptr[1:] - indptr[:-1],
                                    output_size=total_pages)           # [total_pages]
    page_k = torch.arange(total_pages, device=device) - indptr[:-1][owner]
    first_slots = req_to_token[rows[owner], page_k * P].to(torch.int64)
    kv_indices = (first_slots // P).to(torch.int32)
    kv_last_page_len = ((seq - 1) % P + 1).to(torch.int32)
    return PagedMeta(_prefix_sum(qo_lens), kv_indptr, kv_indices, kv_last_page_len)


def build_decode_meta(req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                      page_size: int, total_pages: int | None = None) -> PagedMeta:
    """Decode case: one query per request (prefix_len = seq_len - 1)."""
    return build_paged_meta(req_to_token, req_rows, seq_lens - 1, seq_lens, page_size, total_pages)


def build_paged_meta_host(req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens_cpu: list[int],
                          seq_lens_cpu: list[int], page_size: int) -> PagedMeta:
    """`build_paged_meta` from the batch's CPU lengths, as SGLang plans: `qo_indptr`, `kv_indptr` and
    `kv_last_page_len` stay on the host (FlashInfer's `plan()` reads them there, so nothing comes
    back from the device); `kv_indices` is gathered on the table's device."""
    seq = torch.tensor(seq_lens_cpu, dtype=torch.int64)
    return build_paged_meta(req_to_token, req_rows, torch.tensor(prefix_lens_cpu, dtype=torch.int64), seq,
                            page_size, total_pages_of(seq_lens_cpu, page_size))


def paged_kv_view(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[num_slots, kv_heads, head_dim]` -> `[num_slots // P, P, kv_heads, head_dim]` (a view, "NHD")."""
    num_slots, kv_heads, head_dim = buffer.shape
    if num_slots % page_size:
        raise ValueError(f"KV buffer of {num_slots} slots is not a whole number of pages of {page_size}")
    return buffer.view(num_slots // page_size, page_size, kv_heads, head_dim)


def total_pages_of(seq_lens_cpu: list[int], page_size: int) -> int:
    """Number of kv_indices entries for these lengths, computed on the host."""
    return sum(ceil_div(s, page_size) for s in seq_lens_cpu)
