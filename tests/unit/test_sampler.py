"""Tests for the sampler, SamplingBatchInfo and the logprob helpers (pure tensors, CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from radixlm.runtime.layers.logits_processor import compute_logprobs, gather_token_logprobs, top_k_logprobs
from radixlm.runtime.layers.sampler import Sampler, apply_penalties, argmax_rows, process_logits, sorted_candidates
from radixlm.runtime.layers.sampling_batch_info import PenaltyState, SamplingBatchInfo, step_seed
from radixlm.runtime.sampling_params import SamplingParams

VOCAB = 16
EOS = 15


def make_info(params: list[SamplingParams], vocab: int = VOCAB, input_ids: list[list[int]] | None = None,
              output_ids: list[list[int]] | None = None, vocab_mask: torch.Tensor | None = None,
              eos: list[int] | None = None) -> SamplingBatchInfo:
    bs = len(params)
    return SamplingBatchInfo.build(
        params, input_ids or [[1, 2]] * bs, output_ids or [[]] * bs, vocab, [EOS] if eos is None else eos,
        "cpu", vocab_mask=vocab_mask)


def sp(**kwargs) -> SamplingParams:
    return SamplingParams.from_dict(kwargs)


def repeat_rows(probs: list[float], n: int) -> torch.Tensor:
    """n identical rows of logits whose softmax is `probs`."""
    return torch.log(torch.tensor(probs)).repeat(n, 1)


def frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).double() / ids.numel()


def chi_square(ids: torch.Tensor, expected_probs: list[float]) -> float:
    observed = torch.bincount(ids, minlength=len(expected_probs)).double()
    expected = torch.tensor(expected_probs, dtype=torch.float64) * ids.numel()
    return float(((observed - expected) ** 2 / expected).sum())


# ----------------------------------------------------------------- greedy and filters
def test_greedy_is_argmax_and_logits_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB)
    before = logits.clone()
    info = make_info([sp(temperature=0.0)] * 5)
    assert info.is_all_greedy
    ids = Sampler()(logits, info)
    assert ids.dtype == torch.int64 and ids.shape == (5,)
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB).repeat(50, 1)
    info = make_info([sp(temperature=1.5, top_k=1)] * 200)
    assert torch.equal(Sampler()(logits, info), logits.argmax(-1))


def test_tiny_top_p_is_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB).repeat(50, 1)
    info = make_info([sp(temperature=1.0, top_p=1e-6)] * 200)
    assert not info.is_all_greedy and info.need_top_p
    assert torch.equal(Sampler()(logits, info), logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, VOCAB)
    params = [sp(temperature=0.0), sp(temperature=1.0)] * 3
    ids = Sampler()(logits, make_info(params))
    assert torch.equal(ids[0::2], logits[0::2].argmax(-1))


def test_top_k_keeps_only_k_best_with_renormalized_frequencies() -> None:
    torch.manual_seed(4)
    logits = repeat_rows([0.1, 0.4, 0.2, 0.3], 20000)
    ids = Sampler()(logits, make_info([sp(top_k=2)] * 20000, vocab=4))
    assert set(ids.tolist()) == {1, 3}
    assert chi_square(ids, [1e-9, 4 / 7, 1e-9, 3 / 7]) < 20


def test_top_k_per_row_in_a_batch_with_unbounded_rows() -> None:
    torch.manual_seed(15)
    logits = repeat_rows([0.1, 0.4, 0.2, 0.3], 6000)
    params = [sp(top_k=2), sp(top_p=0.99), sp()] * 2000
    info = make_info(params, vocab=4)
    assert info.need_top_k and info.max_top_k == 4  # the top_p row is unbounded: full sort
    assert info.has_filter.tolist()[:3] == [True, True, False]
    ids = Sampler()(logits, info)
    assert set(ids[0::3].tolist()) == {1, 3}
    assert set(ids[1::3].tolist()) == set(ids[2::3].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(("top_p", "kept"), [(0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_nucleus(top_p: float, kept: set[int]) -> None:
    torch.manual_seed(5)
    logits = repeat_rows([0.5, 0.3, 0.15, 0.05], 5000)
    ids = Sampler()(logits, make_info([sp(top_p=top_p)] * 5000, vocab=4))
    assert set(ids.tolist()) == kept


def test_top_p_applies_after_top_k_renormalization() -> None:
    # top_k=2 leaves [0.5, 0.3] -> renormalized [0.625, 0.375]; top_p=0.6 then keeps only token 0.
    logits = repeat_rows([0.5, 0.3, 0.15, 0.05], 2000)
    ids = Sampler()(logits, make_info([sp(top_k=2, top_p=0.6)] * 2000, vocab=4))
    assert set(ids.tolist()) == {0}


def reference_kept(probs: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    """Plain per-row reference: token id -> prob of the tokens top-k, then top-p over the top-k
    mass, then min-p keep."""
    pairs = sorted(enumerate(probs.tolist()), key=lambda t: (-t[1], t[0]))
    if p.top_k != -1:
        pairs = pairs[: p.top_k]
    total, before, kept = sum(q for _, q in pairs), 0.0, []
    for tid, q in pairs:
        if before > p.top_p * total:
            break
        kept.append((tid, q))
        before += q
    return {tid: q for tid, q in kept if q >= kept[0][1] * p.min_p and q > 0}


@pytest.mark.parametrize("which", ["topk_of_max_top_k", "topk_of_limit", "full_sort"])
def test_candidates_match_reference_on_every_path(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 3000  # larger than TOPK_PATH_LIMIT
    gen = torch.Generator().manual_seed(17)
    probs = torch.softmax(torch.randn(6, vocab, generator=gen) * 2.5, dim=-1)
    params = {"topk_of_max_top_k": [sp(top_k=7), sp(top_k=50, top_p=0.8), sp(top_k=3, min_p=0.3)] * 2,
              "topk_of_limit": [sp(top_p=0.6), sp(min_p=0.05), sp(top_k=20, top_p=0.9)] * 2,
              "full_sort": [sp(top_p=0.999), sp(top_k=1500), sp(top_p=0.3, min_p=0.01)] * 2}[which]
    sorts = []
    monkeypatch.setattr(torch, "sort", lambda *a, _sort=torch.sort, **k: sorts.append(1) or _sort(*a, **k))
    values, ids = sorted_candidates(probs, make_info(params, vocab=vocab))
    assert bool(sorts) == (which == "full_sort")
    assert values.shape[1] == {"topk_of_max_top_k": 50, "topk_of_limit": 1024, "full_sort": vocab}[which]
    for row, p in enumerate(params):
        got = {int(t): float(v) for t, v in zip(ids[row], values[row], strict=True) if v > 0}
        expected = reference_kept(probs[row], p)
        assert got.keys() == expected.keys(), row
        assert got == pytest.approx(expected)


def test_min_p_drops_tokens_below_threshold() -> None:
    torch.manual_seed(6)
    logits = repeat_rows([0.5, 0.3, 0.15, 0.05], 20000)
    ids = Sampler()(logits, make_info([sp(min_p=0.5)] * 20000, vocab=4))
    assert set(ids.tolist()) == {0, 1}
    assert chi_square(ids[ids < 2], [0.625, 0.375]) < 20


def test_temperature_sampling_distribution() -> None:
    torch.manual_seed(7)
    base = [0.1, 0.2, 0.3, 0.4]
    n = 20000
    for temperature in (1.0, 2.0, 0.5):
        ids = Sampler()(repeat_rows(base, n), make_info([sp(temperature=temperature)] * n, vocab=4))
        scaled = [p ** (1 / temperature) for p in base]
        expected = [p / sum(scaled) for p in scaled]
        assert chi_square(ids, expected) < 20  # 3 dof: p < 2e-4 to fail by chance
        if temperature != 1.0:
            assert chi_square(ids, base) > 100  # the temperature really changed the distribution


# ----------------------------------------------------------------- penalties, bias, masks
def test_penalty_math_matches_hand_computation() -> None:
    torch.manual_seed(8)
    vocab = 6
    logits = torch.tensor([[1.5, -2.0, 0.7, -0.3, 2.2, 0.0]])
    prompt, output = [0, 1], [1, 2, 2]
    params = sp(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    info = make_info([params], vocab=vocab, input_ids=[prompt], output_ids=[output])
    expected = []
    for tid, x in enumerate(logits[0].tolist()):
        if tid in prompt + output:
            x = x / 1.5 if x > 0 else x * 1.5
        count = output.count(tid)
        x -= 0.3 * count + (0.2 if count else 0.0)
        expected.append(x)
    got = apply_penalties(logits, info)
    torch.testing.assert_close(got[0], torch.tensor(expected), rtol=0, atol=1e-6)


def test_penalties_only_touch_their_own_rows() -> None:
    logits = torch.randn(3, VOCAB)
    params = [sp(), sp(frequency_penalty=1.0, repetition_penalty=2.0), sp()]
    info = make_info(params, output_ids=[[3, 3], [3, 4], [5]])
    got = apply_penalties(logits, info)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_kept_penalty_states_equal_a_rebuild_every_step() -> None:
    """States carried across steps (one or more new tokens at a time, batches changing) give the
    same tensors and the same penalized logits as building from the whole sequences."""
    params = [sp(repetition_penalty=1.3), sp(frequency_penalty=0.5, presence_penalty=0.2), sp(),
              sp(repetition_penalty=0.8, frequency_penalty=-0.4)]
    prompts = [[1, 2, 2], [3], [4, 5], [6, 6, 7]]
    outputs: list[list[int]] = [[], [], [], []]
    states = [PenaltyState(p, ids, VOCAB, "cpu") if p.has_penalties else None for p, ids in zip(params, prompts)]
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        rows = [i for i in range(4) if (i + step) % 3]          # a different batch each step
        for i in rows:
            outputs[i].extend(torch.randint(0, VOCAB, (1 + step % 2,), generator=gen).tolist())
        args = ([params[i] for i in rows], [prompts[i] for i in rows], [outputs[i] for i in rows], VOCAB,
                [EOS], "cpu")
        kept = SamplingBatchInfo.build(*args, penalty_states=[states[i] for i in rows])
        fresh = SamplingBatchInfo.build(*args)
        for name in ("output_counts", "seen_tokens"):
            a, b = getattr(kept, name), getattr(fresh, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (step, name)
        logits = torch.randn(len(rows), VOCAB, generator=gen)
        assert torch.equal(apply_penalties(logits, kept), apply_penalties(logits, fresh))


def test_plain_batch_builds_no_vocab_sized_tensors() -> None:
    info = make_info([sp(), sp(temperature=0.7, top_k=5)], output_ids=[[1, 2], [3]])
    for name in ("output_counts", "seen_tokens", "logit_bias", "ban_rows", "vocab_mask"):
        assert getattr(info, name) is None, name
    assert info.top_ks.tolist() == [VOCAB, 5]
    assert info.temperatures.shape == (2, 1)


def test_logit_bias_forces_a_token() -> None:
    torch.manual_seed(9)
    logits = torch.randn(300, VOCAB)
    params = [sp(logit_bias={"3": 100.0})] * 150 + [sp(temperature=0.0, logit_bias={"7": 100.0})] * 150
    ids = Sampler()(logits, make_info(params))
    assert set(ids[:150].tolist()) == {3}
    assert set(ids[150:].tolist()) == {7}


def test_vocab_mask_is_respected() -> None:
    torch.manual_seed(10)
    logits = torch.randn(400, VOCAB)
    mask = torch.zeros(400, VOCAB, dtype=torch.bool)
    mask[:, [2, 5, 11]] = True
    params = [sp(temperature=0.0)] * 200 + [sp(temperature=2.0)] * 200
    ids = Sampler()(logits, make_info(params, vocab_mask=mask))
    assert set(ids.tolist()) <= {2, 5, 11}
    allowed_logits = logits[:200].masked_fill(~mask[:200], float("-inf"))
    assert torch.equal(ids[:200], allowed_logits.argmax(-1))


def test_vocab_mask_wins_over_logit_bias() -> None:
    logits = torch.zeros(1, VOCAB)
    mask = torch.ones(1, VOCAB, dtype=torch.bool)
    mask[0, 4] = False
    ids = Sampler()(logits, make_info([sp(temperature=0.0, logit_bias={"4": 50.0})], vocab_mask=mask))
    assert ids.item() != 4


def test_min_new_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 50.0
    logits[:, 9] = 40.0
    logits[:, 1] = 30.0
    params = sp(temperature=0.0, min_new_tokens=3, stop_token_ids=[9])
    ids = Sampler()(logits, make_info([params] * 3, output_ids=[[4], [4, 4], [4, 4, 4]]))
    assert ids.tolist() == [1, 1, EOS]  # banned while len(output) < 3


def test_ignore_eos_does_not_ban_eos() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0
    ids = Sampler()(logits, make_info([sp(temperature=0.0, ignore_eos=True)]))
    assert ids.item() == EOS


def test_min_new_tokens_ban_is_lifted_when_grammar_allows_only_eos() -> None:
    logits = torch.randn(2, VOCAB)
    mask = torch.zeros(2, VOCAB, dtype=torch.bool)
    mask[0, EOS] = True
    mask[1, [EOS, 6]] = True
    params = [sp(temperature=1.0, min_new_tokens=5)] * 2
    ids = Sampler()(logits, make_info(params, output_ids=[[1], [1]], vocab_mask=mask))
    assert ids.tolist() == [EOS, 6]


# ----------------------------------------------------------------- seeds
def sample_seeded(batch_logits: torch.Tensor, batch_params: list[SamplingParams],
                  batch_outputs: list[list[int]]) -> list[int]:
    torch.manual_seed(len(batch_params) * 7919)  # a different global RNG state per batch shape
    info = make_info(batch_params, output_ids=batch_outputs)
    return Sampler()(batch_logits, info).tolist()


@pytest.mark.parametrize("seeded", [sp(temperature=1.0, top_p=0.95, sampling_seed=1234),
                                    sp(temperature=0.9, sampling_seed=42)])  # alone: no filter step
def test_seeded_row_is_identical_alone_and_batched(seeded: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(11)
    row = torch.randn(VOCAB, generator=gen)
    others = torch.randn(6, VOCAB, generator=gen)
    other_params = [sp(temperature=0.8), sp(temperature=0.0),
                    sp(frequency_penalty=0.5, logit_bias={"1": 2.0}),
                    sp(top_k=3, sampling_seed=99), sp(min_p=0.2), sp(repetition_penalty=1.3)]
    other_outputs = [[1], [], [2, 2, 3], [4], [5, 6], [7]]
    picks = []
    for step in range(12):
        out = [0] * step
        alone = sample_seeded(row.view(1, -1), [seeded], [out])[0]
        batched_a = sample_seeded(torch.stack([others[0], row, others[2]]),
                                  [other_params[0], seeded, other_params[2]],
                                  [other_outputs[0], out, other_outputs[2]])[1]
        batched_b = sample_seeded(torch.cat([others[3:], row.view(1, -1)]),
                                  other_params[3:] + [seeded], other_outputs[3:] + [out])[3]
        assert alone == batched_a == batched_b, step
        picks.append(alone)
    assert len(set(picks)) > 1


def test_seeded_row_is_identical_on_topk_and_sort_paths() -> None:
    vocab = 3000  # larger than TOPK_PATH_LIMIT, so an uncovered unbounded row forces the full sort
    gen = torch.Generator().manual_seed(16)
    logits = torch.randn(3, vocab, generator=gen) * 3
    for seeded in (sp(top_k=40, top_p=0.9, sampling_seed=77), sp(top_p=0.7, sampling_seed=78)):
        # alone; with a top_k row; with a row whose top-p cut is inside the top 1024; with a row
        # that needs the full sort.
        batches = [([seeded], [0]), ([sp(top_k=300), seeded], [1, 0]),
                   ([seeded, sp(top_p=0.5)], [0, 2]), ([sp(top_p=0.99999), seeded], [2, 0])]
        for step in range(8):
            picks = []
            for params, rows in batches:
                info = make_info(params, vocab=vocab, output_ids=[[0] * step] * len(params))
                picks.append(Sampler()(logits[rows], info)[params.index(seeded)].item())
            assert len(set(picks)) == 1, (step, picks)


def test_seeded_draws_vary_by_step_and_seed() -> None:
    logits = torch.zeros(1, 1000)  # uniform: a repeated token would be a 1-in-1000 coincidence
    params = [sp(sampling_seed=5)]
    by_step = [Sampler()(logits, make_info(params, vocab=1000, output_ids=[[0] * s])).item()
               for s in range(8)]
    assert len(set(by_step)) >= 6
    other_seed = [Sampler()(logits, make_info([sp(sampling_seed=6)], vocab=1000, output_ids=[[0] * s])).item()
                  for s in range(8)]
    assert other_seed != by_step
    assert step_seed(5, 0) != step_seed(5, 1) != step_seed(6, 1)
    assert 0 <= step_seed(-3, 10**6) < 2**63


# ----------------------------------------------------------------- logprobs
def test_compute_and_gather_logprobs() -> None:
    torch.manual_seed(12)
    logits = torch.randn(4, VOCAB, dtype=torch.bfloat16)
    logprobs = compute_logprobs(logits)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, torch.log_softmax(logits.float(), dim=-1))
    ids = [3, 0, 15, 7]
    got = gather_token_logprobs(logprobs, ids)
    assert got == pytest.approx([logprobs[i, t].item() for i, t in enumerate(ids)])
    assert gather_token_logprobs(logprobs, torch.tensor(ids)) == got
    with pytest.raises(ValueError):
        gather_token_logprobs(logprobs, [1, 2])


def test_top_k_logprobs() -> None:
    torch.manual_seed(13)
    logprobs = compute_logprobs(torch.randn(3, VOCAB))
    result = top_k_logprobs(logprobs, [2, 0, 5])
    assert [len(r) for r in result] == [2, 0, 5]
    for row, pairs in zip(logprobs, result, strict=True):
        order = torch.argsort(row, descending=True).tolist()
        assert [tid for _, tid in pairs] == order[: len(pairs)]
        assert all(math.isclose(lp, row[tid].item()) for lp, tid in pairs)
    assert top_k_logprobs(logprobs, [0, 0, 0]) == [[], [], []]
    assert len(top_k_logprobs(logprobs, [VOCAB + 5, 1, 1])[0]) == VOCAB


def test_sampler_logprobs_are_of_the_processed_scaled_distribution() -> None:
    torch.manual_seed(14)
    logits = torch.randn(2, VOCAB)
    mask = torch.ones(2, VOCAB, dtype=torch.bool)
    mask[1, :8] = False
    params = [sp(temperature=0.5, logit_bias={"2": 1.0}), sp(temperature=0.0)]
    info = make_info(params, vocab_mask=mask)
    out = Sampler().sample(logits, info, return_logprobs=True)
    processed = process_logits(logits, info)
    expected = torch.log_softmax(processed / torch.tensor([[0.5], [1.0]]), dim=-1)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out.logprobs[finite], expected[finite])
    assert torch.all(out.logprobs[~finite] == torch.finfo(torch.float32).min)
    assert Sampler().sample(logits, info).logprobs is None


def test_shape_errors() -> None:
    info = make_info([sp()] * 2)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(3, VOCAB), info)
    with pytest.raises(ValueError):
        make_info([sp()] * 2, vocab_mask=torch.ones(2, VOCAB + 1, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [5, 100, 49152])
def test_argmax_rows_is_torch_argmax(dtype, vocab):
    """argmax_rows (C++ on CPU, else max(dim)) picks what torch.argmax picks: the first index on
    ties, a NaN's index, index 0 for a row of -inf."""
    gen = torch.Generator().manual_seed(vocab)
    ties = torch.randint(0, 3, (8, vocab), generator=gen).to(dtype)           # many equal maxima
    x = torch.randn(8, vocab, generator=gen).to(dtype)
    x[:, vocab // 3] = 100
    x[:, vocab // 2] = 100
    x[1, vocab - 1] = float("nan")
    x[2, :] = float("-inf")
    for t in (ties, x, x[:, : vocab - 1]):
        assert torch.equal(argmax_rows(t), torch.argmax(t, dim=-1))
    assert argmax_rows(x).dtype == torch.int64
