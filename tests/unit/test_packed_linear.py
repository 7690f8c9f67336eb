"""Prepacked oneDNN weights: same outputs as F.linear, dense copies freed, tied embeddings kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixlm.runtime.layers.packed_linear import pack_linear_weights, packing_supported
from radixlm.runtime.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(not packing_supported(torch.empty(2, 2, dtype=torch.bfloat16)),
                                reason="oneDNN bf16 matmul not available on this CPU")


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
def test_packed_outputs_equal_f_linear(bias, rows):
    block = make_block(torch.bfloat16, bias)
    dense = {name: p.detach().clone() for name, p in block.named_parameters()}
    x = torch.randn(rows, 64).to(torch.bfloat16)
    h = torch.randn(rows, 192).to(torch.bfloat16)[:, :192]
    assert pack_linear_weights(block) == 4
    with torch.inference_mode():
        assert torch.equal(block.up(x), F.linear(x, dense["up.weight"], dense.get("up.bias")))
        down_ref = F.linear(h, dense["down.weight"])
        if bias:
            down_ref = down_ref + dense["down.bias"]
        assert torch.equal(block.down(h), down_ref)
        assert torch.equal(block.head(x), F.linear(x, dense["embed.weight"]).float())
        assert torch.equal(block.untied_head(x), F.linear(x, dense["untied_head.weight"]).float())


def test_packing_frees_dense_weights_but_keeps_the_tied_embedding():
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
