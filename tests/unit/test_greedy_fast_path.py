"""The greedy fast path (no SamplingBatchInfo) picks exactly what the full sampling pipeline picks."""

from __future__ import annotations

import torch

from radixlm.runtime.layers.sampler import Sampler
from radixlm.runtime.layers.sampling_batch_info import SamplingBatchInfo, is_plain_greedy
from radixlm.runtime.sampling_params import SamplingParams


def test_fast_path_equals_full_pipeline_on_plain_greedy_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.7)]
    outs = [[5, 6], []]
    assert is_plain_greedy(params, outs)
    for _ in range(5):
        logits = torch.randn(2, 300, generator=gen)
        logits[1, 17] = logits[1, 3] = logits[1].max() + 1.0     # a tie: both paths take the lower id
        info = SamplingBatchInfo.build(params, [[1, 2], [3]], outs, 300, [0], "cpu")
        assert Sampler.greedy(logits).tolist() == Sampler()(logits, info).tolist()
    assert Sampler.greedy(logits)[1].item() == 3


def test_fast_path_refused_when_any_step_applies() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert not is_plain_greedy([greedy, SamplingParams(temperature=0.8)], [[], []])
    assert not is_plain_greedy([SamplingParams(temperature=0.0, repetition_penalty=1.2)], [[]])
    assert not is_plain_greedy([SamplingParams(temperature=0.0, presence_penalty=0.5)], [[]])
    assert not is_plain_greedy([SamplingParams(temperature=0.0, logit_bias={3: 5.0})], [[]])
    assert not is_plain_greedy([SamplingParams(temperature=0.0, min_new_tokens=2)], [[7]])
    assert is_plain_greedy([SamplingParams(temperature=0.0, min_new_tokens=2)], [[7, 8]])
