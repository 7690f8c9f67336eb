"""KVManager: the one owner of KV bookkeeping in a scheduler.

It holds the req->token table (`ReqToTokenPool`), the slot allocator and the prefix cache
(`RadixCache`, or `ChunkCache` with `--disable-radix-cache`). It is the only code that writes
`req_to_token` and the only code that frees KV slots; the K/V buffers themselves live in the
model runner. At every moment a usable slot is in exactly one of three places:

    free         in the allocator
    cached       in the prefix cache (evictable, or protected while a request locks its node)
    owned        by one request: row[len(req.prefix_indices), req.kv_committed_len) of its table row,
                 plus the slots `alloc_extend` gave it for the pass being computed

The life of a request, as the planner and the scheduler drive it:

    match = kv.match_prefix(ids)              no lock; valid until the next evict
    kv.lock(match.last_node)                  the prefix is now safe from eviction
    kv.admit(req, match)                      a row; row[0, prefix_len) = the matched slots
    loc = kv.alloc_extend(reqs, extend_lens)  row[kv_committed_len, kv_committed_len + n) = fresh slots
    ... forward pass ...
    kv.commit(reqs, extend_lens)              kv_committed_len += n; a finished chunk or prefill is shared
                                              (cache_unfinished_req: share it, lock the longer prefix)
    kv.trim_draft(req, accepted, drafted)     after a speculative verify pass (alloc_extend gave the
                                              last token + `drafted` proposals slots, commit counted 1):
                                              keep the accepted proposals' KV, free the rejected pages
    kv.cache_finished_req(req)                done, aborted or retracted: share, free the rest

Not thread-safe: only the scheduler loop calls it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Protocol

import torch

from ..utils import align_down, align_up, to_device
from .base_cache import BasePrefixCache, InsertResult, MatchResult
from .memory_pool import ReqToTokenPool, TokenToKVPoolAllocator, new_slots_needed

if TYPE_CHECKING:
    from .kv_events import KVEventRecorder
    from .tree_node import TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class KVReq(Protocol):
    """The attributes of a scheduler request that the KV manager reads and writes."""

    req_pool_idx: int | None       # row in req_to_token
    all_ids: list[int]             # prompt + output token ids
    prompt_len: int                # len(origin_input_ids)
    seq_len: int                   # len(all_ids)
    kv_committed_len: int          # tokens at the front of the row whose KV slots are held
    prefix_indices: torch.Tensor   # slots of the cache-owned prefix (len == prefix length)
    last_node: TreeNode | None     # node this request has locked


def make_prefix_cache(disable_radix_cache: bool, page_size: int, device: str | torch.device,
                      events: KVEventRecorder | None = None) -> BasePrefixCache:
    """The radix cache (reporting to `events` when given), or ChunkCache, which caches nothing
    and so has no events to report."""
    if disable_radix_cache:
        from .chunk_cache import ChunkCache

        return ChunkCache(page_size, device)
    from .radix_cache import RadixCache

    return RadixCache(page_size, device, events)


def write_slots(table: torch.Tensor, rows: list[int], starts: list[int], ends: list[int],
                slots: torch.Tensor) -> None:
    """table[rows[i], starts[i]:ends[i]] = the next ends[i] - starts[i] of `slots`, in order.

    The one place the req->token table is written (KVManager, and tests that drive raw pools).
    One-token spans (decodes) go in one indexed write; longer spans are one slice copy each.
    """
    slots = slots.to(device=table.device, dtype=table.dtype)
    offsets = list(itertools.accumulate((e - s for s, e in zip(starts, ends)), initial=0))
    single = [i for i in range(len(rows)) if ends[i] - starts[i] == 1]
    if single:
        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=table.device)

        table[index([rows[i] for i in single]), index([starts[i] for i in single])] = \
            slots[index([offsets[i] for i in single])]
    for i, (row, start, end) in enumerate(zip(rows, starts, ends)):
        if end - start > 1:
            table[row, start:end] = slots[offsets[i]: offsets[i + 1]]


class KVManager:
    def __init__(self, num_pages: int, page_size: int, max_running_requests: int, context_len: int,
                 device: str | torch.device, disable_radix_cache: bool = False,
                 kv_events: KVEventRecorder | None = None):
        self.page_size = page_size
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 1, context_len + 8, device)
        self.allocator = TokenToKVPoolAllocator(num_pages, page_size, device)
        self.prefix_cache = make_prefix_cache(disable_radix_cache, page_size, device, kv_events)
        # row -> (end, slot of token end-1) as `alloc_extend` last wrote it: a host copy, so that
        # continuing a partly filled page (page_size > 1) reads no slot back from a device table
        self._tail_slot: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------- sizes
    @property
    def total_tokens(self) -> int:
        """Usable KV slots (the pool size, page 0 excluded)."""
        return self.allocator.size

    def free_tokens(self) -> int:
        return self.allocator.available_size()

    def evictable_tokens(self) -> int:
        return self.prefix_cache.evictable_size()

    def protected_tokens(self) -> int:
        return self.prefix_cache.protected_size()

    def available_tokens(self) -> int:
        """Slots an allocation may use: free now, or freed by evicting unlocked cache."""
        return self.allocator.available_size() + self.prefix_cache.evictable_size()

    def used_tokens(self) -> int:
        """Slots owned by requests or locked in the cache."""
        return self.total_tokens - self.available_tokens()

    def is_fully_free(self) -> bool:
        """True at idle: every slot free or evictable, no lock held, every row free."""
        pool = self.req_to_token_pool
        return (self.available_tokens() == self.total_tokens and self.protected_tokens() == 0
                and pool.available_size() == pool.size)

    def new_slots_needed(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """Slots that allocating tokens [prefix_lens[i], seq_lens[i]) of each request will take."""
        return sum(new_slots_needed(p, s, self.page_size) for p, s in zip(prefix_lens, seq_lens))

    # --------------------------------------------------------- admission
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key` (page-aligned). Does not lock; see BasePrefixCache."""
        return self.prefix_cache.match_prefix(key[: align_down(len(key), self.page_size)])

    def lock(self, node: TreeNode | None) -> int:
        """Protects `node`'s path from eviction; returns how many tokens stopped being evictable."""
        before = self.prefix_cache.evictable_size()
        self.prefix_cache.inc_lock_ref(node)
        return before - self.prefix_cache.evictable_size()

    def unlock(self, node: TreeNode | None) -> None:
        """Undoes one `lock(node)`."""
        self.prefix_cache.dec_lock_ref(node)

    def admit(self, req: KVReq, match: MatchResult) -> bool:
        """Gives `req` a row holding the matched prefix; False (no change) when no row is free.

        The caller has locked `match.last_node`; from here the request holds that lock. Sets
        `req_pool_idx`, `prefix_indices`, `last_node` and `kv_committed_len = len(match.kv_indices)`.
        """
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        prefix_len = len(match.kv_indices)
        self._tail_slot.pop(row, None)
        write_slots(self.req_to_token_pool.req_to_token, [row], [0], [prefix_len], match.kv_indices)
        req.req_pool_idx, req.prefix_indices, req.last_node = row, match.kv_indices, match.last_node
        req.kv_committed_len = prefix_len
        return True

    # -------------------------------------------------------- allocation
    def ensure_free(self, num_tokens: int) -> bool:
        """Evicts unlocked cache until `num_tokens` slots are free; False if it cannot."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.allocator.free(self.prefix_cache.evict(short))
        return self.allocator.available_size() >= num_tokens

    def alloc_extend(self, reqs: list[KVReq], extend_lens: list[int]) -> torch.Tensor | None:
        """Slots for tokens [kv_committed_len, kv_committed_len + n) of each request, written into its row.

        Evicts cache as needed. Returns the int64 slots in request order (the pass's
        `out_cache_loc`, on the table's device), or None, changing nothing, when even eviction
        cannot make room.
        """
        prefix_lens = [req.kv_committed_len for req in reqs]
        ends = [p + n for p, n in zip(prefix_lens, extend_lens)]
        if not self.ensure_free(self.new_slots_needed(prefix_lens, ends)):
            return None
        table = self.req_to_token_pool.req_to_token
        rows = [req.req_pool_idx for req in reqs]
        host_loc = self.allocator.alloc_extend(prefix_lens, ends, self._last_locs(rows, prefix_lens))
        assert host_loc is not None, "allocation failed after ensure_free"
        if self.page_size > 1 and host_loc.numel():
            last = (torch.tensor(ends) - torch.tensor(prefix_lens)).cumsum(0) - 1
            for row, p, end, slot in zip(rows, prefix_lens, ends, host_loc[last.clamp(min=0)].tolist()):
                if end > p:
                    self._tail_slot[row] = (end, slot)
        loc = to_device(host_loc, table.device)  # the one host->device copy of out_cache_loc (pinned on CUDA)
        write_slots(table, rows, prefix_lens, ends, loc)
        return loc

    def _last_locs(self, rows: list[int], prefix_lens: list[int]) -> list[int]:
        """The slot of token prefix_len-1 of each row, which the page allocator reads only when
        that token's page is partly filled (page_size > 1, prefix_len not page-aligned): from the
        host copy when it is current, else read from the table (a device sync on CUDA)."""
        P = self.page_size
        if P == 1:
            return [0] * len(rows)
        table = self.req_to_token_pool.req_to_token
        out = []
        for row, p in zip(rows, prefix_lens):
            if p % P == 0:
                out.append(0)
            else:
                end, slot = self._tail_slot.get(row, (-1, 0))
                out.append(slot if end == p else int(table[row, p - 1]))
        return out

    # ----------------------------------------------------------- caching
    def commit(self, reqs: list[KVReq], extend_lens: list[int]) -> list[int]:
        """The forward pass over tokens [kv_committed_len, kv_committed_len + n) of each request is done.

        Advances each `kv_committed_len` by its n. A request still mid-prefill (a chunk) shares what it
        has computed with the cache, and so does one whose prefill just completed (its prompt is
        then in the tree for others); decodes share nothing until they finish. Returns the indices
        (into `reqs`) of the requests whose whole sequence is now computed: those sample a token.
        """
        ready: list[int] = []
        for i, (req, n) in enumerate(zip(reqs, extend_lens)):
            was_prefill = req.kv_committed_len < req.prompt_len
            req.kv_committed_len += n
            done = req.kv_committed_len >= req.seq_len
            if was_prefill or not done:
                self.cache_unfinished_req(req)
            if done:
                ready.append(i)
        return ready

    def trim_draft(self, req: KVReq, accepted: int, drafted: int) -> None:
        """A verify pass computed KV for tokens [e, e + drafted) of the row (e = kv_committed_len, after
        `commit` counted the last token), of which the first `accepted` are now in the output: keeps
        those (kv_committed_len += accepted) and frees the pages that hold only rejected proposals.
        Rejected slots in the kept tail page stay with the request (a page is freed whole); the next
        allocation continues that page over them."""
        assert 0 <= accepted <= drafted, (accepted, drafted)
        end = req.kv_committed_len + drafted
        req.kv_committed_len += accepted
        first_free = align_up(req.kv_committed_len, self.page_size)
        if end > first_free:
            row = req.req_pool_idx
            self.allocator.free(self.req_to_token_pool.req_to_token[row, first_free:end].to(torch.int64))
        if drafted > accepted:
            self._tail_slot.pop(req.req_pool_idx, None)      # the host copy is past the kept tail

    def cache_finished_req(self, req: KVReq) -> None:
        """The request is done (finished, aborted or retracted): share its KV, free the rest.

        Region table of the request's row, P = page_size, `ins` = the cache's InsertResult:
          [0, prefix_len)                       cache-owned prefix, locked by req.last_node  -> unlocked
          [prefix_len, ins.prefix_len)          the request's copies of tokens the cache had -> freed
          [ins.prefix_len, ins.cached_len)      new to the cache                             -> cache
          [ins.cached_len, kv_committed_len)    partial last page (or no cache at all)       -> freed
        Afterwards the request owns nothing: no row, no lock, empty `prefix_indices`,
        `kv_committed_len` 0 (a retracted request is recomputed from here). Idempotent: on a request without a row
        (never admitted, or already cached) it only drops a held lock.
        """
        row = req.req_pool_idx
        if row is not None:
            slots = self._row_slots(req)
            ins = self._insert(req, slots)
            self.allocator.free(slots[ins.cached_len:])
            self.req_to_token_pool.free(row)
        self.prefix_cache.dec_lock_ref(req.last_node)
        req.req_pool_idx, req.last_node, req.prefix_indices, req.kv_committed_len = None, None, _EMPTY, 0

    def cache_unfinished_req(self, req: KVReq) -> None:
        """The request keeps running (a chunk of its prefill is done): share its KV so far.

        Same region table as `cache_finished_req`, except that [ins.cached_len, kv_committed_len) stays
        with the request, and the row's [0, ins.cached_len) is rewritten to the cache's slots, which
        the request then locks (`prefix_indices`, `last_node` updated; the old lock is dropped).
        """
        assert req.req_pool_idx is not None, "cache_unfinished_req on a request without a row"
        ins = self._insert(req, self._row_slots(req))
        match = self.prefix_cache.match_prefix(req.all_ids[: ins.cached_len])
        assert len(match.kv_indices) == ins.cached_len, "just-inserted prefix did not match in full"
        write_slots(self.req_to_token_pool.req_to_token, [req.req_pool_idx], [0], [ins.cached_len],
                    match.kv_indices)
        self.prefix_cache.inc_lock_ref(match.last_node)   # lock the new path before unlocking the old
        self.prefix_cache.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = match.kv_indices, match.last_node

    def flush(self) -> None:
        """Forgets the whole cache and frees every slot and row. Only valid with no request running."""
        self.prefix_cache.reset()
        self._tail_slot.clear()
        self.allocator.clear()
        self.req_to_token_pool.clear()

    # ----------------------------------------------------------- helpers
    def _row_slots(self, req: KVReq) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)

    def _insert(self, req: KVReq, slots: torch.Tensor) -> InsertResult:
        """Offers the page-aligned part of the row to the cache and frees the duplicates."""
        aligned_len = align_down(len(slots), self.page_size)
        ins = self.prefix_cache.insert(req.all_ids[:aligned_len], slots[:aligned_len])
        self.allocator.free(slots[len(req.prefix_indices): ins.prefix_len])
        return ins
