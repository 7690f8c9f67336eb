"""Phi-3 LongRoPE and partial rotary (Phi-4-mini's shape: partial_rotary_factor 0.75 plus longrope)
against HF transformers fp32, on a tiny random model with original_max_position_embeddings 64 and
max_position_embeddings 256.

transformers picks short or long factors per call from the sequence's length; radixlm picks once
per server from --context-length (layers/rotary.py `longrope_parameters`). So: served with a context
of 64 (short factors), every prompt matches HF, through batched prefill, prefix extend, decode and a
radix-cache prefix hit; served with the full 256 (long factors), prompts longer than 64 match HF,
including a shared 70-token prefix and greedy decoding past it, and a short prompt does not (it
would under HF's per-length switch: the test shows which choice is made)."""

from __future__ import annotations

import pytest
import torch
from test_models_vs_hf import (
    PagedRunner,
    assert_greedy_from_shared_prefix_matches_hf,
    assert_prefill_extend_decode_match_hf,
    hf_greedy_tokens,
    hf_logits,
    load_ours,
    random_prompts,
    save_random_hf_model,
)

from radixlm.runtime.models.model_config import ModelConfig

TOL = 1e-3
ORIGINAL, MAX_POS = 64, 256


def phi3_config(rotary_factor: float, head_dim: int = 16):
    from transformers import Phi3Config

    dims = int(head_dim * rotary_factor) // 2
    g = torch.Generator().manual_seed(5)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": rotary_factor,
            "short_factor": (1 + torch.rand(dims, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(dims, generator=g)).tolist()}
    return Phi3Config(hidden_size=4 * head_dim, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=500, max_position_embeddings=MAX_POS,
                      original_max_position_embeddings=ORIGINAL, initializer_range=0.1, tie_word_embeddings=False,
                      eos_token_id=2, bos_token_id=0, pad_token_id=1, rope_parameters=rope)


@pytest.fixture(scope="module", params=[0.75, 1.0], ids=["partial", "full"])
def phi3(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3_longrope")
    hf = save_random_hf_model(phi3_config(request.param), folder)
    models = {ctx: load_ours(folder, context_length=ctx) for ctx in (ORIGINAL, MAX_POS)}
    return request.param, models, hf


def test_config_reads_longrope_and_rotary_dim(phi3) -> None:
    factor, models, _ = phi3
    config, model = models[MAX_POS]
    assert config.rotary_dim == (12 if factor < 1 else None)
    assert config.rope_scaling["factor"] == MAX_POS / ORIGINAL
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_cache.shape == (MAX_POS, (12 if factor < 1 else 16) // 2)
    # cos(0) is the attention factor sqrt(1 + ln(4) / ln(64))
    assert abs(rope.cos_cache[0, 0].item() - (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(64.0))).sqrt()
               ) < 1e-6


@pytest.mark.parametrize("use_kernels", [True, False])
def test_short_context_matches_hf(phi3, use_kernels: bool) -> None:
    """Context 64 = the original length: short factors, HF's choice for every sequence that fits."""
    _, models, hf = phi3
    config, model = models[ORIGINAL]
    runner = PagedRunner(model, config, page_size=16, num_pages=64, use_kernels=use_kernels)
    assert_prefill_extend_decode_match_hf(runner, hf, config.vocab_size, TOL)


def test_short_context_greedy_from_shared_prefix(phi3) -> None:
    _, models, hf = phi3
    config, model = models[ORIGINAL]
    assert_greedy_from_shared_prefix_matches_hf(PagedRunner(model, config, page_size=16, num_pages=64), hf,
                                                config.vocab_size)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_long_context_matches_hf_past_the_original_length(phi3, use_kernels: bool) -> None:
    """Context 256: long factors. Two prompts sharing a 70-token prefix (the second reuses the first's
    KV slots, a radix-cache hit), logits vs HF, then 6 greedy tokens each step vs HF's argmax."""
    _, models, hf = phi3
    config, model = models[MAX_POS]
    runner = PagedRunner(model, config, page_size=16, num_pages=64, use_kernels=use_kernels)
    shared, tail_a, tail_b = random_prompts(config.vocab_size, [70, 9, 13], seed=4)
    a = shared + tail_a
    assert (runner.extend([0], [0], [a]) - hf_logits(hf, a)).abs().max().item() <= TOL
    runner.pool.req_to_token[1, :70] = runner.pool.req_to_token[0, :70]
    b = shared + tail_b
    got = runner.extend([1], [70], [tail_b])
    assert (got - hf_logits(hf, b)[70:]).abs().max().item() <= TOL
    ours = [int(got[-1].argmax())]
    for _ in range(5):
        ours.append(int(runner.extend([1], [len(b) + len(ours) - 1], [[ours[-1]]])[-1].argmax()))
    assert ours == hf_greedy_tokens(hf, b, 6)


def test_long_context_short_prompt_uses_long_factors(phi3) -> None:
    """The documented difference: under a 256 context a 20-token prompt is rotated with the long
    factors (HF would switch to the short ones), so its logits are not HF's."""
    _, models, hf = phi3
    config, model = models[MAX_POS]
    (ids,) = random_prompts(config.vocab_size, [20], seed=6)
    got = PagedRunner(model, config, page_size=16, num_pages=64).extend([0], [0], [ids])
    assert (got - hf_logits(hf, ids)).abs().max().item() > 100 * TOL


def test_partial_rotary_refused_where_transformers_ignores_it(tmp_path) -> None:
    import json

    from radixlm.runtime.models.model_config import ModelLoadError

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 100, "partial_rotary_factor": 0.5}))
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        ModelConfig.from_path(str(tmp_path))


def test_one_call_decoder_takes_partial_rotary(phi3, tmp_path) -> None:
    """The one-call CPU decoder rotates the table's width (12 of 16 lanes here) as the Python forward
    does: the same hidden states and K/V writes, bit for bit (tests/unit/test_cpu_decoder.py)."""
    from radixlm.kernels.cpu_decoder import load_cpu_decoder
    from tests.unit.test_cpu_decoder import _runner, assert_decoder_matches_python_forward

    if load_cpu_decoder() is None:
        pytest.skip("C++ decoder unavailable on this machine")
    _, models, _ = phi3
    runner = _runner(models[MAX_POS][0].path, "float32")
    assert runner.model.model.decoder_blocker() is None
    assert_decoder_matches_python_forward(runner)
