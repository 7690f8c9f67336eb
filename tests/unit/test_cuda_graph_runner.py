"""CudaGraphRunner logic on CPU: buckets, padding, the fixed buffers, and one whole decode step.

The whole-step test runs the real runner over a tiny model with two stand-ins: a graph whose
replay re-runs the captured function over the same fixed buffers, and a FlashInfer CUDA-graph
decode wrapper that, like the library, copies `plan()`'s arguments into its fixed buffers and
computes from those buffers (with `paged_attention_ref`). The hidden states must equal the eager
torch_native forward. The real capture is checked by scripts/gpu_check.sh (graphs on/off).
"""

from __future__ import annotations

import types

import pytest
import torch
from test_flashinfer_meta import make_batch

from radixlm.kernels.flashinfer_meta import build_paged_meta_host, paged_kv_view
from radixlm.kernels.paged_attention_ref import paged_attention_ref
from radixlm.runtime.layers.attention.base import create_backend
from radixlm.runtime.layers.attention.flashinfer_backend import FlashInferAttnBackend
from radixlm.runtime.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    GraphBuffers,
    capture_batch_sizes,
    pad_decode_meta,
    pick_bucket,
)
from radixlm.runtime.model_executor.forward_batch import ForwardMode
from radixlm.runtime.models.model_config import ModelConfig
from radixlm.runtime.models.weight_loader import load_model


def test_capture_batch_sizes_and_bucket_choice() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        capture_batch_sizes(0)
    sizes = capture_batch_sizes(40)
    assert [pick_bucket(sizes, bs) for bs in (1, 2, 3, 5, 8, 9, 17, 33, 40, 41)] == \
        [1, 2, 4, 8, 8, 16, 24, 40, 40, None]


def decode_lens() -> list[tuple[int, int]]:
    return [(s - 1, s) for s in (1, 9, 16, 17, 40)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_padding_rows_leave_the_real_rows_unchanged(page_size: int) -> None:
    fb, q, _, _ = make_batch(decode_lens(), page_size, 4, 2, 8, seed=3, mode=ForwardMode.DECODE)
    meta = build_paged_meta_host(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                 fb.prefix_lens_cpu, fb.seq_lens_cpu, page_size)
    padded = pad_decode_meta(meta, 8)
    assert padded.batch_size == 8 and padded.kv_indptr.tolist()[:6] == meta.kv_indptr.tolist()
    assert padded.kv_indptr.tolist()[5:] == [int(meta.kv_indptr[-1]) + i for i in range(4)]
    assert padded.kv_indices[-3:].tolist() == [0, 0, 0] and padded.kv_last_page_len[-3:].tolist() == [1, 1, 1]
    kp, vp = (paged_kv_view(b[0], page_size) for b in (fb.kv_cache.k_buffer, fb.kv_cache.v_buffer))
    q_pad = torch.cat([q, torch.randn(3, *q.shape[1:])])
    plain = paged_attention_ref(q, kp, vp, *meta, 0.3)
    with_pad = paged_attention_ref(q_pad, kp, vp, *padded, 0.3)
    assert torch.equal(plain, with_pad[:5])
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_meta(meta, 4)


def test_copy_in_writes_the_batch_then_padding() -> None:
    fb, _, _, _ = make_batch(decode_lens(), 1, 4, 2, 8, seed=4, mode=ForwardMode.DECODE)
    fb.input_ids = torch.arange(11, 16)
    bufs = GraphBuffers.allocate(16, 32, "cpu")
    for buf in (bufs.input_ids, bufs.positions, bufs.out_cache_loc):
        buf.fill_(-7)                                        # stale values from an earlier step
    bufs.copy_in(fb, 8)
    assert bufs.input_ids[:8].tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert bufs.positions[:5].tolist() == fb.positions.tolist() and bufs.positions[5:8].tolist() == [0] * 3
    assert bufs.out_cache_loc[:5].tolist() == fb.out_cache_loc.tolist()
    assert bufs.out_cache_loc[5:8].tolist() == [0, 0, 0]      # slot 0: the reserved padding page
    assert bufs.input_ids[8:].tolist() == [-7] * 8            # rows past the bucket are not touched


class ReplayByCall:
    """Graph stand-in: `capture` runs fn once and keeps its output; `replay` re-runs fn over the
    same fixed buffers and writes that output tensor in place, as a real replay does."""

    def capture(self, fn, pool):
        self.fn, self.out = fn, fn()
        return pool

    def replay(self) -> torch.Tensor:
        self.out.copy_(self.fn())
        return self.out


class GraphDecodeStandIn:
    """FlashInfer's CUDA-graph decode wrapper contract: fixed batch size, `plan()` copies into the
    given buffers, `run()` computes from the buffers (never from plan's arguments)."""

    def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto", use_cuda_graph=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert layout == "NHD" and backend == "fa2" and use_cuda_graph
        self.indptr, self.indices, self.last = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                                                paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last, heads, kv_heads, head_dim, page_size, *, sm_scale, q_data_type,
             kv_data_type):
        assert last.numel() == self.last.numel() and indptr.is_cpu     # fixed batch size; host indptr
        self.indptr.copy_(indptr)
        self.last.copy_(last)
        self.indices[: indices.numel()].copy_(indices)
        self.sm_scale = sm_scale

    def run(self, q, paged_kv_cache):
        k_pages, v_pages = paged_kv_cache
        qo = torch.arange(self.last.numel() + 1, dtype=torch.int32)
        return paged_attention_ref(q, k_pages, v_pages, qo, self.indptr, self.indices[: int(self.indptr[-1])],
                                   self.last, self.sm_scale)


@pytest.mark.parametrize("page_size", [1, 4])
def test_graph_runner_step_equals_eager(llama_path: str, page_size: int) -> None:
    cfg = ModelConfig.from_path(llama_path)
    model = load_model(cfg, "cpu", show_progress=False)
    backend = FlashInferAttnBackend.__new__(FlashInferAttnBackend)
    backend._init_state(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size, "cpu", torch.float32, None)
    backend._flashinfer = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=GraphDecodeStandIn)
    backend.workspace = torch.zeros(8, dtype=torch.uint8)
    lens = [(s - 1, s) for s in (1, 9, 16, 17, 40)]
    fb, _, _, _ = make_batch(lens, page_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, seed=9,
                             mode=ForwardMode.DECODE, num_layers=cfg.num_layers)
    fb.input_ids = torch.randint(3, cfg.vocab_size, (fb.batch_size,), generator=torch.Generator().manual_seed(1))
    runner = CudaGraphRunner(model, fb.kv_cache, backend, max_bs=8, graph_cls=ReplayByCall)
    assert sorted(runner.buckets) == [1, 2, 4, 8]
    native = create_backend("torch_native")
    native.init_forward_metadata(fb)
    fb.attn_backend = native
    with torch.inference_mode():
        eager = model(fb.input_ids, fb.positions, fb)
        assert runner.can_run(fb)
        replayed = runner(fb)
    assert replayed.shape == eager.shape
    assert (replayed - eager).abs().max().item() <= 1e-4


def test_each_pass_computes_its_own_rope(llama_path: str, monkeypatch) -> None:
    """A CUDA graph replays no Python, so nothing computed in an earlier pass may be reused by a
    later one: the rope cos/sin gathered for the warm-up's positions were once reused by the
    capture itself, and every replay on the H200 rotated by position 0 (greedy diverged at the
    first graph decode). Here the same positions tensor, an inference tensor (no version counter),
    is refilled in place between two passes, as the graph buffers are; the second pass must equal
    a pass over a fresh tensor. The torch rope path runs (the fused CPU op keeps no cos/sin)."""
    from radixlm.runtime.layers import rotary

    monkeypatch.setattr(rotary.cpu_ops, "fits", lambda *tensors: False)
    cfg = ModelConfig.from_path(llama_path)
    model = load_model(cfg, "cpu", show_progress=False)
    fb, _, _, _ = make_batch(decode_lens(), 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, seed=5,
                             mode=ForwardMode.DECODE, num_layers=cfg.num_layers)
    fb.input_ids = torch.randint(3, cfg.vocab_size, (fb.batch_size,), generator=torch.Generator().manual_seed(2))
    native = create_backend("torch_native")
    native.init_forward_metadata(fb)
    fb.attn_backend = native
    with torch.inference_mode():
        positions = torch.zeros_like(fb.positions)
        assert positions.is_inference()
        model(fb.input_ids, positions, fb)                  # a pass at position 0 (the capture's warm-up)
        positions.copy_(fb.positions)
        refilled = model(fb.input_ids, positions, fb)
        fresh = model(fb.input_ids, fb.positions.clone(), fb)
    assert torch.equal(refilled, fresh)
