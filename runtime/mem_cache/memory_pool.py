"""Paged KV memory: the req->token table, the slot/page allocator, and the per-layer K/V buffers.

Slot numbering (page_size P):

    slots [0, P)                 page 0, reserved: padded writes land here and are never read
    slots [P, (num_pages+1)*P)   pages 1..num_pages, handed out by TokenToKVPoolAllocator

A request owns whole pages. Its table row `req_to_token[row, :seq_len]` holds the slot of every
token; tokens [k*P, (k+1)*P) of a request always sit in one page, so a prefix matched from the
radix tree (page-aligned) ends on a page boundary and the request's own tail page is private.
"""

from __future__ import annotations

import math

import torch

from ..utils import align_up, ceil_div
from .huge_pages import huge_page_empty, prefault


def new_slots_needed(prefix_len: int, seq_len: int, page_size: int) -> int:
    """Fresh slots (whole pages) that tokens [prefix_len, seq_len) of one request take.

    Tokens up to the end of prefix_len's page continue that page; the rest need new pages.
    """
    return (ceil_div(seq_len, page_size) - ceil_div(prefix_len, page_size)) * page_size


class ReqToTokenPool:
    """Rows of an int32 table `[size, context_len]`; a running request holds one row.

    Only `KVManager` writes the table; attention backends read it through the forward batch.
    """

    def __init__(self, size: int, context_len: int, device: str | torch.device):
        self.size = size
        self.context_len = context_len
        self.req_to_token = torch.zeros((size, context_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(size))

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def available_size(self) -> int:
        return len(self._free_rows)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))


class TokenToKVPoolAllocator:
    """Hands out KV slots in whole pages. `free` takes slot indices and returns their pages.

    Not thread-safe; only `KVManager` (in the scheduler loop) calls it.
    """

    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu"):
        self.page_size = page_size
        self.num_pages = num_pages
        self.size = num_pages * page_size          # usable token slots
        self.device = device
        self.clear()

    def clear(self) -> None:
        # The free pages, in allocation order, as a list of chunks: `free` appends one, and
        # `_take_pages` joins them only when the head chunk runs short (amortized O(1) per page).
        self._free_chunks: list[torch.Tensor] = [torch.arange(1, self.num_pages + 1, dtype=torch.int64)]
        self._num_free_pages = self.num_pages

    def available_size(self) -> int:
        """Free token slots (whole free pages only)."""
        return self._num_free_pages * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` fresh tokens starting on a page boundary (None if out of memory)."""
        pages = self._take_pages(ceil_div(num_tokens, self.page_size))
        if pages is None:
            return None
        return self._page_slots(pages)[:num_tokens]

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int],
                     last_locs: list[int]) -> torch.Tensor | None:
        """Slots for tokens [prefix_len, seq_len) of each request, concatenated in request order.

        `last_locs[i]` is the slot of token prefix_len-1 (ignored when prefix_len == 0). Tokens that
        still fit in that token's page continue it; the rest go to new pages. All-or-nothing.
        """
        P = self.page_size
        if P == 1:
            return self.alloc(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        new_pages = sum(new_slots_needed(p, s, P) for p, s in zip(prefix_lens, seq_lens)) // P
        pages = self._take_pages(new_pages)
        if pages is None:
            return None
        out, cursor = [], 0
        for p, s, last in zip(prefix_lens, seq_lens, last_locs):
            # region [p, fill_end)    continues the partially filled page of `last`
            #        [fill_end, s)    fresh pages, in order
            fill_end = min(s, align_up(p, P))
            if fill_end > p:
                out.append(torch.arange(last + 1, last + 1 + fill_end - p, dtype=torch.int64))
            n_new = new_slots_needed(p, s, P) // P
            if n_new:
                slots = self._page_slots(pages[cursor:cursor + n_new])
                out.append(slots[: s - fill_end])
                cursor += n_new
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages that hold `slots`. The caller must own every slot of those pages, and
        the slots of one page must stand together (as they do in a request's row or a tree node)."""
        if slots.numel() == 0:
            return
        pages = slots.to(torch.int64).cpu()
        if self.page_size > 1:
            pages = torch.unique_consecutive(pages // self.page_size)
        self._free_chunks.append(pages)
        self._num_free_pages += int(pages.numel())

    # ----------------------------------------------------------- helpers
    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > self._num_free_pages:
            return None
        if self._free_chunks[0].numel() < n:
            self._free_chunks = [torch.cat(self._free_chunks)]
        head = self._free_chunks[0]
        pages, rest = head[:n], head[n:]
        if rest.numel() or len(self._free_chunks) == 1:
            self._free_chunks[0] = rest
        else:
            self._free_chunks.pop(0)
        self._num_free_pages -= n
        return pages

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offs[None, :]).reshape(-1)


class KVCache:
    """Per-layer K and V buffers of shape `[num_slots, kv_heads, head_dim]` (num_slots includes page 0)."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.page_size = page_size
        self.num_slots = (num_pages + 1) * page_size
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        shape = (self.num_slots, kv_heads, head_dim)
        self.k_buffer = [self._zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffer = [self._zeros(shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
        """On CPU in 2 MiB pages (decode attention streams these rows; huge_pages.py says why), mapped
        now: a first touch inside a forward pass costs more than the write (huge_pages.prefault)."""
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        buf = huge_page_empty(math.prod(shape), dtype)
        prefault(buf)
        return buf.view(shape)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [num_tokens, kv_heads, head_dim]; loc: [num_tokens]
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)
