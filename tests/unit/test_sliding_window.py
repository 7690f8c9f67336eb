"""Sliding-window models against HF transformers fp32: a tiny random Mistral, Phi-3, Mixtral and
Qwen3-MoE (every layer windowed; Phi-3 also loads fused qkv/gate_up tensors) and a Qwen2 and Qwen2-MoE with
use_sliding_window (Qwen2: layers >= max_window_layers windowed; Qwen2-MoE: layers below it, as
transformers' configs say).

The window is 48 tokens and the prompts are longer (60-130), so a model that ignored the window
would differ. Runs the paged model directly (kernels on and off, page sizes 1 and 16, chunked
prefill, a prefix served from shared KV slots as the radix cache serves it) and once through the
Engine with the radix cache and chunked prefill on.
"""

from __future__ import annotations

import pytest
import torch
from test_models_vs_hf import (
    PagedRunner,
    assert_engine_radix_cache_matches_hf,
    hf_greedy_tokens,
    hf_logits,
    load_ours,
    random_prompts,
    save_random_hf_model,
)

WINDOW = 48
NEW_TOKENS = 8
TOL = 1e-3


@pytest.fixture(scope="module", params=["mistral", "qwen2", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"])
def swa_model(request, tmp_path_factory, llama_path: str):
    from transformers import (
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=2000, max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=0, pad_token_id=0, sliding_window=WINDOW)
    if request.param == "mistral":
        config = MistralConfig(**common, num_hidden_layers=2, head_dim=16)
    elif request.param == "phi3":                     # fused qkv_proj / gate_up_proj checkpoint tensors
        config = Phi3Config(**common, num_hidden_layers=2)
    elif request.param == "mixtral":                  # experts, every layer windowed
        config = MixtralConfig(**common, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    elif request.param == "qwen2_moe":                # experts + shared expert; layer 0 windowed (its
                                                      # config windows layers < max_window_layers)
        config = Qwen2MoeConfig(**common, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=128, norm_topk_prob=True)
    elif request.param == "qwen3_moe":                # use_sliding_window: every layer (no layer_types)
        config = Qwen3MoeConfig(**common, num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=64, norm_topk_prob=True, use_sliding_window=True)
    else:
        config = Qwen2Config(**common, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1)
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_random_hf_model(config, folder, tokenizer_from=llama_path)
    ours, model = load_ours(folder)
    assert ours.sliding_window == WINDOW
    expected = {"qwen2": (1, 2), "qwen2_moe": (0,)}.get(request.param, (0, 1))   # transformers' layer_types
    assert ours.sliding_window_layers == expected
    return str(folder), ours, model, hf


def our_greedy(runner: PagedRunner, row: int, ids: list[int], n: int, chunk: int | None = None,
               prefix_len: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Prefill ids[prefix_len:] (in chunks of `chunk`), then n-1 decodes; (prompt logits, tokens)."""
    chunk = chunk or len(ids)
    parts = [runner.extend([row], [p], [ids[p:p + chunk]]) for p in range(prefix_len, len(ids), chunk)]
    logits = torch.cat(parts)
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        out.append(int(runner.extend([row], [len(ids) + len(out) - 1], [[out[-1]]])[-1].argmax()))
    return logits, out


@pytest.mark.parametrize("use_kernels", [True, False])
@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 32)])
def test_greedy_and_logits_match_hf_past_the_window(swa_model, use_kernels: bool, page_size: int, chunk) -> None:
    _, config, model, hf = swa_model
    prompts = random_prompts(config.vocab_size, [60, 97, 130], seed=4)
    runner = PagedRunner(model, config, page_size, num_pages=4096 // page_size)
    runner.backend.kernels = runner.backend.kernels if use_kernels else None
    for row, ids in enumerate(prompts):
        logits, tokens = our_greedy(runner, row, ids, NEW_TOKENS, chunk)
        assert (logits - hf_logits(hf, ids)).abs().max().item() <= TOL
        assert tokens == hf_greedy_tokens(hf, ids, NEW_TOKENS), f"prompt {row} (len {len(ids)})"


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_hit_equals_cold_prefill(swa_model, page_size: int) -> None:
    """Request B reuses request A's KV slots for their 64 shared tokens (what a radix cache hit
    hands over) and prefills only the rest: same logits and tokens as a cold prefill of B."""
    _, config, model, hf = swa_model
    shared, tail_a, tail_b = random_prompts(config.vocab_size, [64, 40, 50], seed=5)
    a, b = shared + tail_a, shared + tail_b
    runner = PagedRunner(model, config, page_size, num_pages=4096 // page_size)
    our_greedy(runner, 0, a, NEW_TOKENS)
    runner.pool.req_to_token[1, :64] = runner.pool.req_to_token[0, :64]
    hit_logits, hit_tokens = our_greedy(runner, 1, b, NEW_TOKENS, prefix_len=64)
    cold_logits, cold_tokens = our_greedy(PagedRunner(model, config, page_size, num_pages=4096 // page_size),
                                          0, b, NEW_TOKENS)
    assert hit_tokens == cold_tokens == hf_greedy_tokens(hf, b, NEW_TOKENS)
    assert (hit_logits - cold_logits[64:]).abs().max().item() <= TOL


def test_engine_radix_cache_and_chunked_prefill(swa_model) -> None:
    """Through the scheduler: radix cache on, chunked prefill of 32, page size 16; the second round
    is served from the cache and still equals HF."""
    path, config, _, hf = swa_model
    assert_engine_radix_cache_matches_hf(path, hf, config.vocab_size, [80, 30, 45], context_length=512,
                                         min_cached=64, new_tokens=NEW_TOKENS)


def test_engine_tp2(swa_model) -> None:
    """TP=2 over gloo, windows on: the same two rounds equal HF greedy."""
    path, config, _, hf = swa_model
    assert_engine_radix_cache_matches_hf(path, hf, config.vocab_size, [80, 30, 45], context_length=512,
                                         min_cached=64, new_tokens=NEW_TOKENS, tp_size=2)
