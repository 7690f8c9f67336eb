"""runtime/layers/moe_grouped.py (the experts as two grouped matmuls, the CUDA path) against
SparseMoeBlock's torch loop, on CPU where torch's grouped matmul runs too: fp32 and bf16 blocks,
n = 0, 1 (decode), batches where some experts get no tokens, no renormalisation, Qwen2-MoE's shared
expert. Stacking the expert weights leaves one copy (each expert's weight a view) and the same
outputs. On CUDA the path runs only where `grouped_mm_supported` (bf16, sm90+); scripts/gpu_check
checks it there, with CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_moe import make_block

from radixlm.runtime.layers.moe import SparseMoeBlock, route
from radixlm.runtime.layers.moe_grouped import grouped_experts, grouped_mm_supported, stack_expert_weights


def grouped_forward(block: SparseMoeBlock, x: torch.Tensor, stacked) -> torch.Tensor:
    weights, ids = route(block.gate(x), block.top_k, block.renormalize)
    return block._add_shared_and_reduce(x, grouped_experts(x, ids, weights, *stacked))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, kw", [
    (0, dict()),
    (1, dict()),
    (5, dict(experts=16, top_k=2)),                    # 10 pairs over 16 experts: some get none
    (33, dict(experts=8, top_k=3, inter=96, renormalize=False)),
    (7, dict(shared=40)),                              # Qwen2-MoE's gated shared expert
])
def test_grouped_matches_torch_loop(dtype, n, kw) -> None:
    block = make_block(dtype, **kw)
    x = (torch.randn(n, kw.get("hidden", 64)) * 0.5).to(dtype)
    with torch.inference_mode():
        want = block.forward_native(x)
        stacked = stack_expert_weights(block.experts)
        again = block.forward_native(x)
        got = grouped_forward(block, x, stacked)
    assert torch.equal(again, want)                 # the views hold the same weights
    assert got.shape == want.shape and got.dtype == dtype
    if n == 0:
        return
    # one rounding per expert product either way, but the products are summed in another order
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() <= tol * max(want.abs().max().item(), 1e-6)


def test_stacking_keeps_one_copy() -> None:
    block = make_block(torch.bfloat16)
    gate_up, down = stack_expert_weights(block.experts)
    assert gate_up.shape == (8, 96, 64) and down.shape == (8, 64, 48)
    for i, expert in enumerate(block.experts):
        assert expert.gate_up_proj.weight.data_ptr() == gate_up[i].data_ptr()
        assert expert.down_proj.weight.data_ptr() == down[i].data_ptr()


def test_routing_reaches_the_right_expert() -> None:
    """With every token sent to expert 3 at weight 1, the output is expert 3 alone."""
    block = make_block(torch.float32)
    x = torch.randn(4, 64)
    stacked = stack_expert_weights(block.experts)
    ids = torch.full((4, 1), 3)
    with torch.inference_mode():
        got = grouped_experts(x, ids, torch.ones(4, 1), *stacked)
        want = block.experts[3](x)
    assert torch.allclose(got, want, atol=1e-6)


def test_supported_only_for_bf16_on_cuda_sm90() -> None:
    assert not grouped_mm_supported(torch.device("cpu"), torch.bfloat16)
    assert not grouped_mm_supported(torch.device("cuda"), torch.float16)


@pytest.mark.parametrize("supported", [True, False])
def test_the_cuda_dispatch(monkeypatch, supported: bool) -> None:
    """SparseMoeBlock.forward_cuda's choice, run on CPU: grouped matmuls where supported (stacked
    once), else the torch loop."""
    import radixlm.runtime.layers.moe as moe

    monkeypatch.setattr(moe, "grouped_mm_supported", lambda device, dtype: supported)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # CPU torch has no CUDA
    block = make_block(torch.float32, shared=40)
    x = torch.randn(9, 64)
    with torch.inference_mode():
        want = block.forward_native(x)
        got = block.forward_cuda(x)
        assert (len(block._stacked) == 2) == supported
        stacked = block._stacked
        again = block.forward_cuda(x)
    assert block._stacked is stacked and torch.equal(got, again)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    if not supported:
        assert torch.equal(got, want)
