"""kernels/cpu_moe (the fused MoE experts) against SparseMoeBlock's torch loop (forward_native).

Random blocks, bf16 expert weights packed in kernels/cpu_gemm's layout; n=1 (decode), a batch where
some experts get no tokens, Qwen2-MoE's shared expert, odd sizes (an intermediate that is not a
multiple of 64 blocks); fp32 blocks keep the torch loop. Skips only where the CPU lacks AVX2.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu_gemm import gemm_enabled
from radixlm.runtime.layers.moe import SparseMoeBlock
from radixlm.runtime.layers.packed_linear import pack_linear_weights

needs_gemm = pytest.mark.skipif(not gemm_enabled(), reason="needs AVX512 or AVX2 (kernels/cpu_gemm)")


def make_block(dtype, hidden=64, experts=8, top_k=2, inter=48, shared=0, renormalize=True, seed=0):
    torch.manual_seed(seed)
    block = SparseMoeBlock(hidden, experts, top_k, inter, renormalize, shared)
    for p in block.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.2).to(dtype)
    return block


def packed_pair(monkeypatch, **kw):
    """(reference block with plain weights, the same block packed for the kernel)."""
    monkeypatch.setenv("RADIXLM_CPU_LINEAR_KERNEL", "gemm")
    ref, fused = make_block(torch.bfloat16, **kw), make_block(torch.bfloat16, **kw)
    pack_linear_weights(fused)
    return ref, fused


@needs_gemm
@pytest.mark.parametrize("n, kw", [
    (1, dict()),
    (5, dict(experts=16, top_k=2)),                    # 10 pairs over 16 experts: some get none
    (33, dict(experts=8, top_k=3, inter=96, renormalize=False)),
    (7, dict(shared=40)),                              # Qwen2-MoE's gated shared expert
    (3, dict(hidden=96, inter=200, experts=4, top_k=4)),
    (6, dict(inter=128, experts=4, top_k=2)),         # gate_up and SiLU * up in one pass
])
def test_kernel_matches_torch_loop_bf16(monkeypatch, n, kw) -> None:
    ref, fused = packed_pair(monkeypatch, **kw)
    assert fused.fused_tables() is not None
    x = (torch.randn(n, kw.get("hidden", 64)) * 0.5).to(torch.bfloat16)
    with torch.inference_mode():
        want, got = ref.forward_native(x).float(), fused(x).float()
        packed_loop = fused.forward_native(x).float()      # the torch loop over the same packed weights
    # the kernel adds the weighted expert outputs in fp32 and rounds once; the loop rounds each term
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-2 * scale
    assert (got - packed_loop).abs().max().item() <= 2e-2 * scale
    assert (got - want).abs().mean().item() <= 2e-3 * scale


@needs_gemm
def test_ids_and_weights_are_used(monkeypatch) -> None:
    """One expert's output through the kernel equals that expert alone times its weight."""
    _, fused = packed_pair(monkeypatch, experts=4, top_k=1)
    mod, gate_up, down, inter = fused.fused_tables()[:4]
    x = (torch.randn(3, 64) * 0.5).to(torch.bfloat16)
    ids = torch.tensor([[2], [0], [2]])
    w = torch.tensor([[0.5], [1.0], [0.25]])
    with torch.inference_mode():
        got = mod.experts_forward(x, ids, w, gate_up, down, inter).float()
        for t in range(3):
            want = fused.experts[int(ids[t, 0])](x[t:t + 1]).float() * w[t, 0]
            torch.testing.assert_close(got[t:t + 1], want, rtol=1e-2, atol=1e-3)
    with pytest.raises(RuntimeError, match="out of range"):
        mod.experts_forward(x, torch.tensor([[4], [0], [1]]), w, gate_up, down, inter)


@needs_gemm
@pytest.mark.parametrize("inter", [48, 128])      # 128: gate_up and SiLU * up in one pass (whole 64-row blocks)
def test_one_expert_at_weight_one_is_that_expert_bit_for_bit(monkeypatch, inter) -> None:
    _, fused = packed_pair(monkeypatch, experts=4, top_k=1, inter=inter)
    f = fused.fused_tables()
    x = (torch.randn(9, 64) * 0.5).to(torch.bfloat16)
    ids = torch.tensor([[2], [0], [2], [3], [1], [2], [2], [0], [2]])   # expert 2: 5 rows (tiles of 4 + 1)
    with torch.inference_mode():
        got = f.mod.experts_forward(x, ids, torch.ones(9, 1), f.gate_up, f.down, f.inter)
        want = torch.cat([fused.experts[int(ids[t, 0])](x[t:t + 1]) for t in range(9)])
    assert torch.equal(got, want)


def test_fp32_and_unpacked_blocks_keep_the_torch_loop(monkeypatch) -> None:
    block = make_block(torch.float32)
    pack_linear_weights(block)                             # fp32 weights are left plain
    assert block.fused_tables() is None
    x = torch.randn(4, 64)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), block.forward_native(x), rtol=0, atol=0)
    assert make_block(torch.bfloat16).fused_tables() is None   # never packed
