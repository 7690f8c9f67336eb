"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) against HF transformers fp32.

Tiny random models built here with transformers: Qwen2-MoE with its gated shared expert and one
dense layer (mlp_only_layers), norm_topk_prob off; Qwen3-MoE with norm_topk_prob on; Mixtral with
its block_sparse_moe / w1 w2 w3 names. Checks logits and greedy tokens (batched prefill, prefix
extend, decode, a prefix served from shared KV slots as the radix cache serves it), the grouped
expert computation against a per-token loop, bf16 expert weights packed like the dense ones, and
one model through the Engine with the radix cache on.
"""

from __future__ import annotations

import pytest
import torch
from test_models_vs_hf import (
    PagedRunner,
    assert_engine_radix_cache_matches_hf,
    assert_greedy_from_shared_prefix_matches_hf,
    assert_prefill_extend_decode_match_hf,
    load_ours,
    random_prompts,
    save_random_hf_model,
)

from radixlm.runtime.layers.moe import SparseMoeBlock, route
from radixlm.runtime.layers.packed_linear import pack_linear_weights
from radixlm.runtime.models.weight_loader import load_model

NEW_TOKENS = 6
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
              max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False, rms_norm_eps=1e-6,
              eos_token_id=2, bos_token_id=0, pad_token_id=0)


def hf_config(name: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if name == "qwen2_moe":
        return Qwen2MoeConfig(**COMMON, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                              norm_topk_prob=False)
    if name == "qwen3_moe":
        return Qwen3MoeConfig(**COMMON, num_hidden_layers=2, num_experts=8, num_experts_per_tok=3,
                              moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)
    return MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "mixtral"])
def moe_model(request, tmp_path_factory, llama_path: str):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_random_hf_model(hf_config(request.param), folder, tokenizer_from=llama_path)
    config, model = load_ours(folder)
    assert config.moe is not None
    return request.param, str(folder), config, model, hf


def test_layer_kinds_follow_the_config(moe_model) -> None:
    name, _, config, model, _ = moe_model
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    want = {"qwen2_moe": ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"]}.get(name, ["SparseMoeBlock"] * 2)
    assert kinds == want
    assert (model.model.layers[0].mlp.shared_expert is not None) == (name == "qwen2_moe")
    assert model.model.decoder_blocker() is None     # the one-call CPU decoder takes MoE layers (test_cpu_decoder)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_prefill_extend_decode_match_hf(moe_model, use_kernels: bool) -> None:
    _, _, config, model, hf = moe_model
    runner = PagedRunner(model, config, page_size=16, num_pages=64, use_kernels=use_kernels)
    assert_prefill_extend_decode_match_hf(runner, hf, config.vocab_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_with_shared_prefix_matches_hf(moe_model, page_size: int) -> None:
    """B reuses A's KV slots for their 32 shared tokens, prefills the rest, then decodes."""
    _, _, config, model, hf = moe_model
    runner = PagedRunner(model, config, page_size, num_pages=512 // page_size)
    assert_greedy_from_shared_prefix_matches_hf(runner, hf, config.vocab_size, NEW_TOKENS)


@pytest.mark.parametrize("renormalize,shared", [(False, 0), (True, 24)])
def test_grouped_experts_equal_a_per_token_loop(renormalize: bool, shared: int) -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(32, num_experts=6, top_k=2, intermediate_size=16, renormalize=renormalize,
                           shared_intermediate_size=shared)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(11, 32)
    with torch.no_grad():
        out = block(x)
        weights, ids = route(block.gate(x), 2, renormalize)
        for t in range(x.shape[0]):
            want = sum(weights[t, j] * block.experts[int(ids[t, j])](x[t:t + 1])[0] for j in range(2))
            if shared:
                want = want + torch.sigmoid(block.shared_expert_gate(x[t:t + 1]))[0] * block.shared_expert(x[t:t + 1])[0]
            torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)
    if not renormalize:
        assert (weights.sum(-1) < 0.999).any()            # Qwen's default: the top-k weights are not rescaled


def test_bf16_expert_weights_are_packed(moe_model) -> None:
    """bf16 experts go through pack_linear_weights like the dense layers, and the output stays
    close to the unpacked bf16 model (packing changes at most bf16 rounding)."""
    import dataclasses

    _, _, config, _, _ = moe_model
    config16 = dataclasses.replace(config, dtype=torch.bfloat16)
    plain, packed = load_model(config16, "cpu", show_progress=False), load_model(config16, "cpu", show_progress=False)
    count = pack_linear_weights(packed)
    expert_linears = sum(2 * len(layer.mlp.experts) for layer in packed.model.layers
                         if isinstance(layer.mlp, SparseMoeBlock))
    if count == 0:
        pytest.skip("weight packing unsupported or disabled on this machine")
    assert count >= expert_linears
    (ids,) = random_prompts(config.vocab_size, [24], seed=4)
    a = PagedRunner(plain, config16, 16, 16).extend([0], [0], [ids])
    b = PagedRunner(packed, config16, 16, 16).extend([0], [0], [ids])
    assert (a - b).abs().max().item() <= 0.1 * max(1.0, a.abs().max().item())


def test_engine_radix_cache(moe_model) -> None:
    """Through the scheduler with the radix cache and chunked prefill: the second round is served
    from the cache and equals HF greedy."""
    name, path, config, _, hf = moe_model
    if name != "qwen3_moe":
        pytest.skip("one architecture through the Engine is enough (the Engine start is slow here)")
    assert_engine_radix_cache_matches_hf(path, hf, config.vocab_size, [40, 12, 20], context_length=256,
                                         min_cached=32, new_tokens=NEW_TOKENS)


def test_engine_tp2(moe_model) -> None:
    """TP=2 over gloo (each expert's intermediate size split, the MoE output all-reduced once): the
    same two rounds equal HF greedy."""
    name, path, config, _, hf = moe_model
    assert_engine_radix_cache_matches_hf(path, hf, config.vocab_size, [40, 12, 20], context_length=256,
                                         min_cached=32, new_tokens=NEW_TOKENS, tp_size=2)
