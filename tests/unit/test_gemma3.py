"""Gemma 3 (text) against HF transformers fp32: embedding scaling, (1 + w) norms, sandwich norms, q/k norm,
query_pre_attn_scalar, GeGLU, a final logit soft-cap, and alternating 16-token sliding / global
layers with their own rope bases (prompts longer than the window). Logits for batched prefill,
prefix extend and decode (kernels on and off), and greedy tokens for a prompt whose prefix comes
from shared KV slots (a radix-cache hit)."""

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


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_hidden_layers=4, vocab_size=500, max_position_embeddings=256,
                              initializer_range=0.1, eos_token_id=2, bos_token_id=0, pad_token_id=1,
                              sliding_window=16, query_pre_attn_scalar=32, final_logit_softcapping=30.0,
                              layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=rope)
    config.architectures = ["Gemma3ForCausalLM"]
    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, p in hf.named_parameters():              # norms away from 1, so a misplaced norm shows
        if "norm" in name:                            # Gemma scales by (1 + w): w around 0
            p.data.uniform_(-0.5, 0.5)
    hf.save_pretrained(str(folder))
    ours = ModelConfig.from_path(str(folder))
    assert ours.sliding_window_layers == (0, 2) and ours.local_rope_theta == 10000.0 and ours.rope_theta == 1e6
    return ours, load_model(ours, "cpu", show_progress=False), hf.eval()


@pytest.mark.parametrize("use_kernels", [True, False])
def test_gemma3_matches_hf(gemma3, use_kernels: bool) -> None:
    config, model, hf = gemma3
    assert model.model.decoder_blocker() == "embedding scaling (Gemma)"   # the one-call CPU decoder stays off
    runner = PagedRunner(model, config, page_size=16, num_pages=64, use_kernels=use_kernels)
    assert_prefill_extend_decode_match_hf(runner, hf, config.vocab_size, TOL)


def test_gemma3_greedy_from_shared_prefix(gemma3) -> None:
    config, model, hf = gemma3
    runner = PagedRunner(model, config, page_size=16, num_pages=64)
    assert_greedy_from_shared_prefix_matches_hf(runner, hf, config.vocab_size)
