"""OLMo 2 against HF transformers fp32: post-attention / post-MLP norms and the q/k RMSNorm over the
whole projection. Logits for batched prefill, prefix extend and decode (kernels on and off), and
greedy tokens for a prompt whose prefix comes from shared KV slots (a radix-cache hit)."""

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
def olmo2(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Olmo2Config

    config = Olmo2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=500, max_position_embeddings=256, initializer_range=0.1,
                         tie_word_embeddings=False, eos_token_id=2, bos_token_id=0, pad_token_id=1)
    folder = tmp_path_factory.mktemp("olmo2")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, p in hf.named_parameters():              # norms away from 1, so a misplaced norm shows
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    hf.save_pretrained(str(folder))
    ours = ModelConfig.from_path(str(folder))
    return ours, load_model(ours, "cpu", show_progress=False), hf.eval()


@pytest.mark.parametrize("use_kernels", [True, False])
def test_olmo2_matches_hf(olmo2, use_kernels: bool) -> None:
    config, model, hf = olmo2
    assert model.model.decoder_blocker() == "post-attention / post-MLP norms"   # the one-call CPU decoder stays off
    runner = PagedRunner(model, config, page_size=16, num_pages=64, use_kernels=use_kernels)
    assert_prefill_extend_decode_match_hf(runner, hf, config.vocab_size, TOL)


def test_olmo2_greedy_from_shared_prefix(olmo2) -> None:
    config, model, hf = olmo2
    runner = PagedRunner(model, config, page_size=16, num_pages=64)
    assert_greedy_from_shared_prefix_matches_hf(runner, hf, config.vocab_size)
