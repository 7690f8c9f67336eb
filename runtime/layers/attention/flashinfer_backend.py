"""The CUDA attention backend: FlashInfer's batch prefill and decode wrappers over our paged KV.

Per forward pass, `init_forward_metadata` builds the paged metadata once
(`radixlm.kernels.flashinfer_meta`) and calls `plan` on one wrapper: the prefill wrapper for
EXTEND (prefills and chunks, with any decodes), the decode wrapper for DECODE. Every layer then
calls that wrapper's `run` with its own K/V buffers viewed as pages; plan once, run per layer,
as FlashInfer intends.

FlashInfer is imported inside `__init__`, after checking CUDA, so this module imports on CPU
without flashinfer installed (importing flashinfer on CPU succeeds but every kernel fails).

FlashInfer API facts used here (from its docs and source; no code copied):
- `BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD")` and
  `BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", use_tensor_cores=...)`;
  the workspace is a uint8 CUDA tensor (their examples use 128 MiB) and may be shared by wrappers.
- prefill `plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
  num_qo_heads, num_kv_heads, head_dim, page_size, *, causal, sm_scale, q_data_type, kv_data_type)`;
  the 7th argument was renamed `head_dim` -> `head_dim_qk` across versions, so it goes
  positionally; everything after `page_size` goes by keyword (positional use is deprecated).
- decode `plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  *, sm_scale, q_data_type, kv_data_type)`.
- `run(q, paged_kv_cache)` with `paged_kv_cache = (k_cache, v_cache)`, each
  `[num_pages, page_size, num_kv_heads, head_dim]` for "NHD"; q is `[nnz, num_qo_heads, head_dim]`
  (decode: `[batch, ...]`); returns the output with q's shape. Causal prefill aligns the queries
  with the last qo_len KV positions.
- `plan` reads the indptrs on the host (a device->host copy when they live on the device), so it
  must not run inside a CUDA graph; we build them on the host (`build_paged_meta_host`).
- Both wrappers take `backend=`: "auto" picks FA3 for paged prefill on SM90 (three JIT modules per
  dtype); we pin "fa2", as SGLang does (FlashInfer issue 1340: FA3 paged was slower there).
- The float workspace "must be initialized to 0 for its first use" (the wrappers' docstring).
- Sliding windows: both `plan`s take `window_left=` (-1: none; else a query at position i sees
  keys [i - window_left, i]); it selects a kernel variant at plan time, so each window gets its own
  wrapper pair (as SGLang keeps one wrapper per window kind), planned with the same metadata and
  run by the layers whose `sliding_window_size` it is. Windows are known from the constructor's
  `sliding_window_sizes` or found at the first layer that uses one (outside a CUDA-graph capture).
- Attention soft-capping (Gemma 2): both `plan`s take `logits_soft_cap=`; one cap for the whole
  model (the constructor's `logit_cap`), planned into every wrapper.
- CUDA graphs: `BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True,
  use_tensor_cores=..., paged_kv_indptr_buffer=[bs + 1], paged_kv_indices_buffer=[max pages],
  paged_kv_last_page_len_buffer=[bs], backend=...)` has a fixed batch size; its `plan()` copies
  into those buffers, so a graph captured over `run()` replays with whatever the last plan wrote.
"""

from __future__ import annotations

import torch

from ....kernels.flashinfer_meta import (
    PagedMeta,
    build_paged_meta_host,
    paged_kv_view,
)
from ...model_executor.forward_batch import ForwardBatch
from .base import AttentionBackend, RadixAttention, register_backend

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
FLASHINFER_KERNEL_BACKEND = "fa2"   # both wrappers; "auto" would JIT FA3 modules on SM90 too
# FlashInfer's FA2 kernels dispatch on these head dims; others are not validated by the library
# (not a multiple of 64: illegal memory access; not a multiple of 16: silently wrong results,
# flashinfer-ai/flashinfer#4299), so we refuse them up front.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why this backend cannot run a model with this head_dim and dtype, or None if it can."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of FlashInfer's {SUPPORTED_HEAD_DIMS}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not float16 or bfloat16"
    return None


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Large GQA groups run faster on the tensor-core (prefill-kernel) decode path."""
    return num_heads // num_kv_heads >= 4


@register_backend("flashinfer")
class FlashInferAttnBackend(AttentionBackend):
    """Paged attention with FlashInfer (CUDA only). Heads are this TP rank's heads.

    `sm_scale` is the scale planned once per pass (default head_dim ** -0.5); a layer whose
    `scaling` differs has its q rescaled so the result is still `softmax(q k^T * layer.scaling)`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device: torch.device | str, dtype: torch.dtype,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, sm_scale: float | None = None,
                 sliding_window_sizes: tuple[int, ...] = (), logit_cap: float = 0.0):
        reason = flashinfer_unsupported_reason(head_dim, dtype)
        if reason:
            raise ValueError(f"The flashinfer attention backend cannot run this model: {reason}; "
                             "use --attention-backend torch_native (or --dtype bfloat16/float16)")
        if not torch.cuda.is_available() or torch.device(device).type != "cuda":
            raise RuntimeError("The flashinfer attention backend needs a CUDA device; "
                               "use --attention-backend torch_native on CPU")
        try:
            import flashinfer
        except ImportError as exc:
            raise RuntimeError("The flashinfer attention backend needs FlashInfer: "
                               "pip install 'radixlm[cuda]' (flashinfer-python)") from exc
        self._init_state(num_heads, num_kv_heads, head_dim, page_size, device, dtype, sm_scale)
        self.logit_cap = logit_cap
        self._flashinfer = flashinfer
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = self._new_prefill_wrapper()
        self.decode_wrapper = self._new_decode_wrapper()
        self._pass_decode_wrapper = self.decode_wrapper
        for window in sliding_window_sizes:
            if window >= 0:
                self._add_window(window)

    def _new_prefill_wrapper(self):
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                    backend=FLASHINFER_KERNEL_BACKEND)

    def _add_window(self, window: int) -> None:
        """Eager wrappers for a sliding window (and a twin for every CUDA-graph decode wrapper)."""
        self.window_wrappers[window] = (self._new_prefill_wrapper(), self._new_decode_wrapper())
        for main, twins in self._graph_twins.values():
            twins[window] = self._new_decode_wrapper(self._graph_buffers[id(main)])

    def _new_decode_wrapper(self, graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """A decode wrapper on the shared workspace; with `graph_buffers` (indptr [bs + 1], indices,
        last_page_len [bs], int32 on the device) a CUDA-graph one of batch size bs over them."""
        kwargs = {}
        if graph_buffers is not None:
            indptr, indices, last = graph_buffers
            kwargs = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                          paged_kv_last_page_len_buffer=last)
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=decode_uses_tensor_cores(self.num_heads, self.num_kv_heads),
            backend=FLASHINFER_KERNEL_BACKEND, **kwargs)

    def _init_state(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                    device: torch.device | str, dtype: torch.dtype, sm_scale: float | None) -> None:
        """Everything but the wrappers (tests give a CPU stand-in the same state)."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.sm_scale = sm_scale if sm_scale is not None else head_dim ** -0.5
        self._pass_decode_wrapper = None     # the decode wrapper the last plan_decode planned
        self.window_wrappers: dict[int, tuple[object, object]] = {}   # window_left -> (prefill, decode)
        self._pass_window_decode: dict[int, object] = {}     # window_left -> decode wrapper planned this pass
        self._graph_twins: dict[int, tuple[object, dict[int, object]]] = {}  # id(graph wrapper) -> (it, twins)
        self._graph_buffers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._kv_dtype: torch.dtype | None = None
        self.logit_cap = 0.0                 # > 0: every layer's scores soft-capped (Gemma 2), in each plan

    # ------------------------------------------------------------ once per pass
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Builds the paged metadata and plans the wrapper this pass uses; stores the metadata on
        `forward_batch.attn_metadata`. No device->host sync: the indptrs are built on the host."""
        fb = forward_batch
        table = fb.req_to_token_pool.req_to_token
        kv_dtype = fb.kv_cache.dtype
        meta = build_paged_meta_host(table, fb.req_pool_indices, fb.prefix_lens_cpu, fb.seq_lens_cpu,
                                     self.page_size)
        self._kv_dtype = kv_dtype
        if fb.forward_mode.is_decode:
            self.plan_decode(self.decode_wrapper, meta, kv_dtype)
        else:
            self._plan_prefill(self.prefill_wrapper, meta, kv_dtype, -1)
            for window, (prefill, _) in self.window_wrappers.items():
                self._plan_prefill(prefill, meta, kv_dtype, window)
        fb.attn_metadata = meta

    def _plan_kwargs(self, window: int) -> dict:
        kwargs = {"window_left": window} if window >= 0 else {}
        if self.logit_cap > 0:
            kwargs["logits_soft_cap"] = self.logit_cap
        return kwargs

    def _plan_prefill(self, wrapper, meta: PagedMeta, kv_dtype: torch.dtype, window: int) -> None:
        kwargs = self._plan_kwargs(window)
        wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                     self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
                     causal=True, sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=kv_dtype, **kwargs)

    def _plan_one_decode(self, wrapper, meta: PagedMeta, kv_dtype: torch.dtype, window: int) -> None:
        kwargs = self._plan_kwargs(window)
        wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                     self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
                     sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=kv_dtype, **kwargs)

    def plan_decode(self, wrapper, meta: PagedMeta, kv_dtype: torch.dtype) -> None:
        """Plans `wrapper` (the eager decode wrapper, or a CUDA-graph one whose batch size is
        `meta.batch_size`) and makes it the one the next decode layers run; the sliding-window
        twins of that wrapper are planned alongside. Never inside a capture."""
        self._plan_one_decode(wrapper, meta, kv_dtype, -1)
        self._pass_decode_wrapper = wrapper
        twins = (self._graph_twins[id(wrapper)][1] if id(wrapper) in self._graph_twins
                 else {w: decode for w, (_, decode) in self.window_wrappers.items()})
        for window, twin in twins.items():
            self._plan_one_decode(twin, meta, kv_dtype, window)
        self._pass_window_decode = dict(twins)

    def new_graph_decode_wrapper(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor):
        """A CUDA-graph decode wrapper of batch size `last_page_len.numel()` over these fixed buffers
        (with a twin over the same buffers for each sliding window; plan_decode plans them together)."""
        buffers = (indptr, indices, last_page_len)
        wrapper = self._new_decode_wrapper(buffers)
        self._graph_buffers[id(wrapper)] = buffers
        self._graph_twins[id(wrapper)] = (wrapper, {w: self._new_decode_wrapper(buffers) for w in self.window_wrappers})
        return wrapper

    # ------------------------------------------------------------ per layer
    def forward_extend(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        window = layer.sliding_window_size
        if window < 0:
            return self._run(self.prefill_wrapper, q, layer, fb)
        if window not in self.window_wrappers:              # first sight of this window: plan it now
            self._first_window(window)
            self._plan_prefill(self.window_wrappers[window][0], fb.attn_metadata, self._kv_dtype, window)
        return self._run(self.window_wrappers[window][0], q, layer, fb)

    def forward_decode(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        window = layer.sliding_window_size
        if window < 0:
            return self._run(self._pass_decode_wrapper, q, layer, fb)
        if window not in self._pass_window_decode:
            if id(self._pass_decode_wrapper) in self._graph_twins:
                raise RuntimeError(f"sliding window {window} was not known when the CUDA graphs were made; "
                                   "pass sliding_window_sizes to the backend or --disable-cuda-graph")
            self._first_window(window)
            decode = self.window_wrappers[window][1]
            self._plan_one_decode(decode, fb.attn_metadata, self._kv_dtype, window)
            self._pass_window_decode[window] = decode
        return self._run(self._pass_window_decode[window], q, layer, fb)

    def _first_window(self, window: int) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"sliding window {window} first seen inside a CUDA-graph capture")
        self._add_window(window)

    def _run(self, wrapper, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim] -> out: same shape, in self.dtype
        if not isinstance(fb.attn_metadata, PagedMeta):
            raise RuntimeError("init_forward_metadata must run before the layers of a forward pass")
        if layer.logit_cap != self.logit_cap:
            raise RuntimeError(f"layer {layer.layer_id} soft-caps at {layer.logit_cap}, the backend was planned "
                               f"with {self.logit_cap}")
        if layer.scaling != self.sm_scale:
            q = q * (layer.scaling / self.sm_scale)
        q = q.to(self.dtype).contiguous()
        k_pages = paged_kv_view(fb.kv_cache.k_buffer[layer.layer_id], self.page_size)
        v_pages = paged_kv_view(fb.kv_cache.v_buffer[layer.layer_id], self.page_size)
        return wrapper.run(q, (k_pages, v_pages))
