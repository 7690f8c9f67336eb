"""Gemma 2 against HF transformers fp32: Gemma 3's decoder without the q/k norm, with attention-score
soft-capping (small enough here to change every layer's output), a final logit soft-cap, and
alternating 16-token sliding / global layers (prompts longer than the window). Logits for batched
prefill, prefix extend and decode (C++ kernels and the torch path), and greedy tokens for a prompt
whose prefix comes from shared KV slots (a radix-cache hit)."""

from __future__ import annotations

import pytest
import torch
from test_models_vs_hf import (
    PagedRunner,
    assert_greedy_from_shared_prefix_matches_hf,
    assert_prefill_extend_decode_match_hf,
)

from radixlm.runtime.models.model_config import ModelConfig
from radixlm.runtime.models.weight_loader import load_model

TOL = 1e-3
ATTN_CAP = 1.0


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_hidden_layers=4, vocab_size=500, max_position_embeddings=256,
                          initializer_range=0.1, eos_token_id=2, bos_token_id=0, pad_token_id=1,
                          sliding_window=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                          attn_logit_softcapping=ATTN_CAP)
    config.architectures = ["Gemma2ForCausalLM"]
    folder = tmp_path_factory.mktemp("gemma2")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:                         # Gemma scales by (1 + w): w around 0
                p.uniform_(-0.5, 0.5)
            elif "q_proj" in name or "k_proj" in name:   # scores of a few units, so the cap bites
                p.mul_(4.0)
    hf.save_pretrained(str(folder))
    ours = ModelConfig.from_path(str(folder))
    assert ours.sliding_window_layers == (0, 2) and ours.attn_logit_softcapping == ATTN_CAP
    return ours, load_model(ours, "cpu", show_progress=False), hf.eval()


@pytest.mark.parametrize("use_kernels", [True, False])
def test_gemma2_matches_hf(gemma2, use_kernels: bool) -> None:
    config, model, hf = gemma2
    assert model.model.layers[1].self_attn.attn.logit_cap == ATTN_CAP
    assert_prefill_extend_decode_match_hf(PagedRunner(model, config, 16, 64, use_kernels), hf, config.vocab_size, TOL)


def test_gemma2_greedy_from_shared_prefix(gemma2) -> None:
    config, model, hf = gemma2
    assert_greedy_from_shared_prefix_matches_hf(PagedRunner(model, config, 16, 64), hf, config.vocab_size)


def test_gemma2_without_the_cap_differs(gemma2) -> None:
    """The soft-cap matters at these weights: the same model uncapped is far from HF."""
    config, model, hf = gemma2
    for layer in model.model.layers:
        layer.self_attn.attn.logit_cap = 0.0
    try:
        with pytest.raises(AssertionError):
            assert_prefill_extend_decode_match_hf(PagedRunner(model, config, 16, 64), hf, config.vocab_size, TOL)
    finally:
        for layer in model.model.layers:
            layer.self_attn.attn.logit_cap = ATTN_CAP
