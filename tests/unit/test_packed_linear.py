"""Prepacked weights, in both layouts (kernels/cpu_gemm's and oneDNN's): outputs match F.linear
(oneDNN's bit for bit, the gemm layout within one bf16 rounding), dense copies freed, tied
embeddings kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels import cpu_gemm
from radixlm.runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixlm.runtime.layers.packed_linear import GemmWeight, onednn_supported, pack_linear_weights, packing_supported
from radixlm.runtime.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(not packing_supported(torch.empty(2, 2, dtype=torch.bfloat16)),
                                reason="no packed bf16 layout on this CPU")


@pytest.fixture(params=["gemm", "onednn"])
def layout(request, monkeypatch):
    """Which packed layout pack_linear_weights uses in this test."""
    if request.param == "gemm" and not cpu_gemm.cpu_supports_gemm():
        pytest.skip("the gemm layout needs AVX512 or AVX2")
    if request.param == "onednn" and not onednn_supported(torch.empty(2, 2, dtype=torch.bfloat16)):
        pytest.skip("oneDNN has no bf16 matmul on this CPU (AVX2)")
    monkeypatch.setenv("RADIXLM_DISABLE_CPU_GEMM", "1" if request.param == "onednn" else "0")
    monkeypatch.setenv("RADIXLM_CPU_LINEAR_KERNEL", request.param)
    cpu_gemm.load_cpu_gemm.cache_clear()
    yield request.param
    cpu_gemm.load_cpu_gemm.cache_clear()


def bf16_step(t: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(t.float().abs().clamp_min(1e-30))) - 7)


def same(layout: str, got: torch.Tensor, want: torch.Tensor, rounded_before: torch.Tensor | None = None) -> bool:
    """Bit for bit for oneDNN's layout; within one bf16 step for the gemm layout, plus one step of
    `rounded_before` where the result was rounded there too (a bias added after the product: the
    gemm's and F.linear's products may round apart, and the bias can cancel most of them)."""
    if layout == "onednn":
        return torch.equal(got, want)
    tol = bf16_step(want) + (bf16_step(rounded_before) if rounded_before is not None else 0)
    return got.shape == want.shape and bool(((got.float() - want.float()).abs() <= tol + 1e-6).all())


class TinyBlock(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.embed = VocabParallelEmbedding(300, 64)
        self.up = MergedColumnParallelLinear(64, [96, 96], bias=bias)
        self.down = RowParallelLinear(192, 64, bias=bias)
        self.head = ParallelLMHead(300, 64, tied_to=self.embed)
        self.untied_head = ParallelLMHead(300, 64)


def make_block(dtype: torch.dtype, bias: bool) -> TinyBlock:
    torch.manual_seed(0)
    block = TinyBlock(bias)
    for p in block.parameters():
        p.data = torch.randn(p.shape).to(dtype) * 0.1
    return block


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 67, 300])
def test_packed_outputs_equal_f_linear(layout, bias, rows):
    block = make_block(torch.bfloat16, bias)
    dense = {name: p.detach().clone() for name, p in block.named_parameters()}
    x = torch.randn(rows, 64).to(torch.bfloat16)
    h = torch.randn(rows, 192).to(torch.bfloat16)[:, :192]
    assert pack_linear_weights(block) == 4
    assert isinstance(block.up.packed_weight, GemmWeight) == (layout == "gemm")
    with torch.inference_mode():
        assert same(layout, block.up(x), F.linear(x, dense["up.weight"], dense.get("up.bias")))
        product = F.linear(h, dense["down.weight"])
        down_ref = product + dense["down.bias"] if bias else product
        assert same(layout, block.down(h), down_ref, product if bias else None)
        assert same(layout, block.head(x), F.linear(x, dense["embed.weight"]).float())
        assert same(layout, block.untied_head(x), F.linear(x, dense["untied_head.weight"]).float())


def test_packing_frees_dense_weights_but_keeps_the_tied_embedding(layout):
    block = make_block(torch.bfloat16, bias=False)
    table = block.embed.weight.detach().clone()
    pack_linear_weights(block)
    assert block.up.weight.numel() == 0 and block.down.weight.numel() == 0
    assert block.untied_head.weight.numel() == 0
    assert torch.equal(block.embed.weight, table)          # the tied LM head's table stays
    ids = torch.tensor([0, 5, 299])
    assert torch.equal(block.embed(ids), table[ids])
    assert pack_linear_weights(block) == 0                 # packing twice is a no-op


def test_fp32_and_disabled_packing_keep_plain_weights(monkeypatch):
    assert pack_linear_weights(make_block(torch.float32, bias=False)) == 0
    monkeypatch.setenv("RADIXLM_DISABLE_PACKED_WEIGHTS", "1")
    block = make_block(torch.bfloat16, bias=False)
    assert pack_linear_weights(block) == 0
    assert block.up.packed_weight is None and block.up.weight.numel() == 192 * 64
