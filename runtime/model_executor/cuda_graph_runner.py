"""CudaGraphRunner: decode passes replayed from CUDA graphs, one graph per batch-size bucket.

    runner = CudaGraphRunner(model, kv_cache, attn_backend, max_bs=args.cuda_graph_max_bs)  # captures
    if runner.can_run(fb):
        hidden = runner(fb)              # [bs, hidden]; logits and sampling run outside the graph

Eager decode on a large GPU is bound by kernel launches (hundreds per step for a small model);
a graph replays them all in one launch. As in SGLang and nano-vllm:

- Buckets: 1, 2, 4, 8, then every 8 up to `max_bs` (`capture_batch_sizes`). A batch of bs requests
  runs in the smallest bucket b >= bs; the rows [bs, b) are padding.
- Fixed buffers (`GraphBuffers`, sized for `max_bs`): input ids, positions, out_cache_loc, and
  FlashInfer's indptr / indices / last_page_len. Every graph reads and writes only these, so a
  replay sees whatever was copied in before it. Per bucket b the graph uses the first b rows.
- Padding rows: token 0 at position 0, KV written to slot 0 (page 0 is reserved for padding
  writes, see memory_pool.py), attending one token of page 0. Their outputs are dropped.
- FlashInfer: one CUDA-graph decode wrapper per bucket (`use_cuda_graph=True` over views of the
  fixed buffers); `plan()` runs before each replay, outside the graph (it reads the indptrs on
  the host: they are built there), and writes the plan into those buffers and the workspace.

Region table of the fixed buffers for a batch of bs requests in bucket b:

    input_ids / positions / out_cache_loc   [0, bs) the batch's      [bs, b) 0 (padding)
    kv_last_page_len                        [0, bs) the batch's      [bs, b) 1
    kv_indptr                               [0, bs] the batch's      (bs, b] +1 per padding row
    kv_indices                              [0, n)  the batch's pages, then b - bs zeros (page 0)

Graphs are captured largest first into one shared memory pool. `--disable-cuda-graph` turns this
off; `--cuda-graph-max-bs` sets the largest bucket (larger decode batches run eager).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from ...kernels.flashinfer_meta import PagedMeta, build_paged_meta_host
from .forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256   # largest bucket when --cuda-graph-max-bs is not given (and max running allows)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, 16, 24, ... (every 8), up to and including `max_bs`."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = {b for b in (1, 2, 4) if b <= max_bs} | set(range(8, max_bs + 1, 8)) | {max_bs}
    return sorted(sizes)


def pick_bucket(sizes: list[int], bs: int) -> int | None:
    """The smallest bucket that holds `bs` requests (`sizes` ascending), or None if none does."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


def pad_decode_meta(meta: PagedMeta, bucket: int) -> PagedMeta:
    """`meta` (bs decode requests, indptrs on the host) extended with bucket - bs padding requests,
    each one token in page 0. The real requests' entries are unchanged."""
    pad = bucket - meta.batch_size
    if pad < 0:
        raise ValueError(f"batch of {meta.batch_size} does not fit bucket {bucket}")
    steps = torch.arange(1, pad + 1, dtype=torch.int32)
    return PagedMeta(
        qo_indptr=torch.arange(bucket + 1, dtype=torch.int32),
        kv_indptr=torch.cat([meta.kv_indptr, meta.kv_indptr[-1] + steps]),
        kv_indices=torch.cat([meta.kv_indices, meta.kv_indices.new_zeros(pad)]),
        kv_last_page_len=torch.cat([meta.kv_last_page_len, torch.ones(pad, dtype=torch.int32)]),
    )


@dataclass
class GraphBuffers:
    """The fixed device tensors every captured graph reads and writes (first b rows per bucket)."""

    input_ids: torch.Tensor         # [max_bs] int64
    positions: torch.Tensor         # [max_bs] int64
    out_cache_loc: torch.Tensor     # [max_bs] int64
    kv_indptr: torch.Tensor         # [max_bs + 1] int32
    kv_indices: torch.Tensor        # [max_pages + max_bs] int32
    kv_last_page_len: torch.Tensor  # [max_bs] int32

    @staticmethod
    def allocate(max_bs: int, max_pages: int, device: torch.device | str) -> GraphBuffers:
        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        return GraphBuffers(zeros(max_bs, torch.int64), zeros(max_bs, torch.int64), zeros(max_bs, torch.int64),
                            zeros(max_bs + 1, torch.int32), zeros(max_pages + max_bs, torch.int32),
                            zeros(max_bs, torch.int32))

    def copy_in(self, fb: ForwardBatch, bucket: int) -> None:
        """Writes the batch's input ids, positions and KV slots into rows [0, bs) and padding
        (token 0, position 0, slot 0) into [bs, bucket). Device-side copies only."""
        bs = fb.batch_size
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_cache_loc, fb.out_cache_loc)):
            buf[:bs].copy_(src, non_blocking=True)
            buf[bs:bucket].zero_()


class CudaGraph:
    """One captured CUDA graph: `capture(fn, pool)` records fn (its output tensor is kept);
    `replay()` re-runs the recorded kernels, which write that same output tensor."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None

    def capture(self, fn, pool):
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()
        return self.graph.pool()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


@dataclass
class _Bucket:
    graph: CudaGraph
    wrapper: object               # the bucket's CUDA-graph FlashInfer decode wrapper
    fb: ForwardBatch              # the static batch the graph was captured over


class CudaGraphRunner:
    """Captures the decode forward of `model` per bucket at construction; replays it per step.

    `attn_backend` is the FlashInfer backend (it makes the graph wrappers and plans them).
    `graph_cls` makes the graphs (CudaGraph; tests pass a CPU stand-in with the same two methods).
    """

    def __init__(self, model: torch.nn.Module, kv_cache, attn_backend, max_bs: int,
                 graph_cls: type = CudaGraph):
        self.model, self.kv_cache, self.backend = model, kv_cache, attn_backend
        self.page_size = kv_cache.page_size
        self.sizes = capture_batch_sizes(max_bs)
        max_pages = kv_cache.k_buffer[0].shape[0] // self.page_size
        self.buffers = GraphBuffers.allocate(self.sizes[-1], max_pages, kv_cache.k_buffer[0].device)
        self.buckets: dict[int, _Bucket] = {}
        start = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for b in reversed(self.sizes):                     # largest first: the pool fits the rest
                pool = self._capture(b, graph_cls(), pool)
        logger.info("CUDA graphs: captured %d decode batch sizes (%s) in %.1f s", len(self.sizes),
                    ", ".join(map(str, self.sizes)), time.perf_counter() - start)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode and 1 <= fb.batch_size <= self.sizes[-1]

    def _static_batch(self, b: int) -> ForwardBatch:
        """The batch a bucket's graph runs over: views of the fixed buffers. Nothing reads its
        table or lengths (the FlashInfer plan holds them), so those are placeholders."""
        bufs = self.buffers
        zeros = bufs.input_ids[:b]
        return ForwardBatch(ForwardMode.DECODE, bufs.input_ids[:b], bufs.positions[:b], bufs.out_cache_loc[:b],
                            req_pool_indices=zeros, seq_lens=zeros, prefix_lens=zeros, seq_lens_cpu=[1] * b,
                            prefix_lens_cpu=[0] * b, req_to_token_pool=None, kv_cache=self.kv_cache,
                            attn_backend=self.backend)

    def _plan(self, wrapper, meta: PagedMeta, fb: ForwardBatch) -> None:
        """Plans `wrapper` outside any capture (it fills the fixed buffers) and hands `fb` the meta."""
        self.backend.plan_decode(wrapper, meta, self.kv_cache.dtype)
        fb.attn_metadata = meta

    def _capture(self, b: int, graph, pool):
        """Captures bucket b over a batch of b padding requests; returns the (shared) memory pool."""
        bufs = self.buffers
        wrapper = self.backend.new_graph_decode_wrapper(bufs.kv_indptr[: b + 1], bufs.kv_indices,
                                                        bufs.kv_last_page_len[:b])
        fb = self._static_batch(b)
        empty = PagedMeta(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                          bufs.kv_indices[:0], torch.zeros(0, dtype=torch.int32))
        self._plan(wrapper, pad_decode_meta(empty, b), fb)

        def forward() -> torch.Tensor:
            return self.model(fb.input_ids, fb.positions, fb)

        for _ in range(2):                                  # warm up: lazy inits happen outside capture
            forward()
        if bufs.input_ids.is_cuda:
            torch.cuda.synchronize()
        pool = graph.capture(forward, pool)
        self.buckets[b] = _Bucket(graph, wrapper, fb)
        return pool

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        """hidden [bs, hidden] of a DECODE batch (`can_run(fb)`). Side effects: K/V written at
        fb.out_cache_loc (and slot 0 for padding rows); the bucket's wrapper is re-planned;
        `fb.attn_metadata` holds the padded metadata. The result is a view of the graph's output,
        valid until the next replay."""
        bs = fb.batch_size
        b = pick_bucket(self.sizes, bs)
        bucket = self.buckets[b]
        self.buffers.copy_in(fb, b)
        meta = build_paged_meta_host(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                     fb.prefix_lens_cpu, fb.seq_lens_cpu, self.page_size)
        padded = pad_decode_meta(meta, b)
        self._plan(bucket.wrapper, padded, bucket.fb)
        fb.attn_metadata = padded
        return bucket.graph.replay()[:bs]
