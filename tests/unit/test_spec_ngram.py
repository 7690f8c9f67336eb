"""N-gram speculative decoding: the proposer, and the scheduler's outputs with and without it.

Greedy outputs must be identical token for token (radix cache on/off, page size 1 and 16, chunked
prefill, a batch), stops and max_new_tokens that end inside an accepted run must truncate exactly,
seeded sampling and penalties must see the same state, unseeded sampling must keep its distribution
(chi-square), and the KV pool must be fully free after (SchedulerHarness.run asserts it). The
prompts repeat themselves, so that proposals are accepted: every comparison also asserts that some
verify pass accepted proposals.
"""

from __future__ import annotations

import collections
import functools
import math
import os

import pytest
from helpers import SchedulerHarness, random_prompts

from radixlm.runtime.managers.io_struct import TokenizedGenerateReq
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.speculative.ngram import NgramIndex

# every proposal verified: these tests check the verify path, whatever a row costs on the tiny model
SPEC = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, speculative_disable_by_batch_size=64,
            disable_speculative_adaptive=True)


# ----------------------------------------------------------------- proposer
def test_longest_match_wins_and_falls_back_to_shorter():
    idx = NgramIndex()
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 1, 2, 3, 9, 8, 2, 3, 7, 2, 3]      # ends "2 3": [1 2 3] matches at 1..3, [8 2 3] nowhere
    assert idx.propose(toks, 3, 1, 4) == [7, 2, 3]   # most recent "2 3" (6..7) -> 7 ...
    toks2 = [4, 1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]      # "1 2 3" at 1..3 is longer than "2 3" at 6..7
    assert NgramIndex().propose(toks2, 2, 1, 4) == [9, 8]
    assert NgramIndex().propose(toks2, 2, 4, 6) == []     # no 4-gram repeats
    assert NgramIndex().propose([1, 2, 3, 4], 2, 1, 3) == []   # the last token never occurred before


def test_proposal_is_cut_at_k_and_at_the_end_and_index_grows():
    idx = NgramIndex()
    toks = [7, 7]
    assert idx.propose(toks, 4, 1, 3) == [7, 7, 7, 7]  # the continuation reaches the end: periodic
    assert NgramIndex().propose([1, 5, 6, 5, 6], 3, 1, 3) == [5, 6, 5]
    toks += [1, 2, 3, 4, 5, 7]
    assert idx.propose(toks, 2, 1, 3) == [1, 2]       # the most recent earlier 7 (position 1)
    toks += [1]
    assert idx.propose(toks, 3, 1, 3) == [2, 3, 4]    # "7 1" matched at 1..2
    assert idx.indexed == len(toks) - 1


# ----------------------------------------------------------------- scheduler
class Recorder:
    """Wraps the speculator's verify to record (rid, proposals, tokens appended, finished, output
    length before) per pass."""

    def __init__(self, h: SchedulerHarness):
        self.events: list[tuple[str, list[int], list[int], bool, int]] = []
        spec = h.scheduler.spec
        inner = spec.verify

        def verify(reqs, logits):
            before = [(r.rid, list(r.draft_ids), len(r.output_ids)) for r in reqs]
            n = inner(reqs, logits)
            for r, (rid, draft, start) in zip(reqs, before):
                self.events.append((rid, draft, r.output_ids[start:], r.finished, start))
            return n

        spec.verify = verify

    def max_accepted(self) -> int:
        return max((len(list(_accepted(e[1], e[2]))) for e in self.events), default=0)


def _accepted(draft: list[int], appended: list[int]):
    for d, a in zip(draft, appended):
        if d != a:
            return
        yield d


@functools.cache
def _prompts() -> list[list[int]]:
    base = random_prompts(4, 1900, seed=3, lo=10, hi=20)
    return [p * 3 for p in base]


def _run(path: str, reqs: list[tuple[str, list[int], dict]], **args) -> tuple[dict, SchedulerHarness, Recorder | None]:
    h = SchedulerHarness(path, **args)
    rec = Recorder(h) if args.get("speculative_algorithm") else None
    for rid, prompt, sampling in reqs:
        h.submit(rid, prompt, **sampling)
    res = h.run()
    return {rid: (r["output_ids"], r["finish_reason"]) for rid, r in res.items()}, h, rec


def _greedy_reqs(n_new: int = 40) -> list[tuple[str, list[int], dict]]:
    return [(f"r{i}", p, dict(max_new_tokens=n_new, temperature=0, ignore_eos=True)) for i, p in enumerate(_prompts())]


@pytest.mark.parametrize("config", [
    dict(),
    dict(disable_radix_cache=True),
    dict(page_size=16),
    dict(page_size=16, disable_radix_cache=True),
    dict(chunked_prefill_size=16, max_prefill_tokens=16),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_greedy_identical_with_and_without_speculation(llama_path, config):
    reqs = _greedy_reqs()
    plain, _, _ = _run(llama_path, reqs, **config)
    spec, h, rec = _run(llama_path, reqs, **config, **SPEC)
    assert spec == plain
    assert rec.max_accepted() >= 2, rec.events          # some verify pass accepted a run of proposals
    t = h.scheduler.spec.totals
    assert t.verify_ct > 0 and 0 < t.accepted_tokens <= t.draft_tokens
    assert h.scheduler.spec.accept_length() > 1.0
    out = h.results["r1"]["last"]
    assert out.spec_verify_ct > 0 and out.spec_accepted_tokens <= out.spec_verify_ct * 4


def test_radix_cache_never_holds_a_rejected_token(llama_path):
    # Every cached key is a prefix of some prompt + output, and its KV is right: continuing from
    # prompt + output (nearly all of it a cache hit) gives what a fresh server computes.
    reqs = _greedy_reqs()
    h = SchedulerHarness(llama_path, **SPEC)
    rec = Recorder(h)
    for rid, prompt, sampling in reqs:
        h.submit(rid, prompt, **sampling)
    res = h.run()
    assert any(len(list(_accepted(e[1], e[2]))) < len(e[1]) for e in rec.events)    # some were rejected
    seqs = [p + res[rid]["output_ids"] for rid, p, _ in reqs]
    for key in _cached_keys(h.scheduler.kv.prefix_cache.root):
        assert any(s[:len(key)] == key for s in seqs), key
    again = [(f"a{i}", s[:-1], dict(max_new_tokens=8, temperature=0, ignore_eos=True)) for i, s in enumerate(seqs)]
    for rid, prompt, sampling in again:
        h.submit(rid, prompt, **sampling)
    res2 = h.run()
    fresh, _, _ = _run(llama_path, again, disable_radix_cache=True)
    for rid, prompt, _ in again:
        assert res2[rid]["cached_tokens"] >= len(prompt) - 2
        assert res2[rid]["output_ids"] == fresh[rid][0]


def _cached_keys(node, prefix=()):
    for child in node.children.values():
        key = prefix + tuple(child.key)
        yield list(key)
        yield from _cached_keys(child, key)


@functools.cache
def _reference(llama_path: str, which: int = 1) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """Request `which`'s plain greedy output, and (start, accepted) of each verify pass of a spec run."""
    prompt = _prompts()[which]
    req = [("r", prompt, dict(max_new_tokens=40, temperature=0, ignore_eos=True))]
    plain, _, _ = _run(llama_path, req)
    _, _, rec = _run(llama_path, req, **SPEC)
    return plain["r"][0], tuple((e[4], len(list(_accepted(e[1], e[2])))) for e in rec.events)


def test_max_new_tokens_inside_an_accepted_run(llama_path):
    out, runs = _reference(llama_path)
    start, n = max(runs, key=lambda r: r[1])
    assert n >= 2
    # every length from the run's first token to past its end: in one batch, one request per length
    lens = list(range(start + 1, start + n + 2))
    prompt = _prompts()[1]
    reqs = [(f"m{k}", prompt, dict(max_new_tokens=k, temperature=0, ignore_eos=True)) for k in lens]
    res, _, rec = _run(llama_path, reqs, **SPEC)
    for k in lens:
        assert res[f"m{k}"] == (out[:k], {"type": "length", "length": k})
    assert rec.max_accepted() >= 1


def _inside_runs(runs) -> list[int]:
    """Output positions accepted in a verify pass with more accepted proposals after them."""
    return [s + j for s, n in runs for j in range(n - 1)]


def test_stop_string_inside_an_accepted_run(llama_path):
    out, runs = _reference(llama_path)
    prompt = _prompts()[1]
    q = _inside_runs(runs)[-1]
    # min_new_tokens = q + 1 makes the stop string count from position q on (it bans only stop ids)
    h = SchedulerHarness(llama_path, **SPEC)
    text = h.scheduler.tokenizer.decode([out[q]])
    assert text.strip()
    sampling = dict(max_new_tokens=40, temperature=0, ignore_eos=True, stop=[text], min_new_tokens=q + 1)
    rec = Recorder(h)
    h.submit("t", prompt, **sampling)
    res = h.run()["t"]
    assert res["output_ids"] == out[:q + 1] and res["finish_reason"] == {"type": "stop", "matched": text}
    last = rec.events[-1]
    assert last[3] and len(last[1]) > len(last[2])    # it finished with proposals still unverified
    plain, _, _ = _run(llama_path, [("t", prompt, sampling)])
    assert plain["t"][0] == res["output_ids"]


def _verify_direct(page_size: int, draft: list[int], targets: list[int], **sampling):
    """One verify pass driven by hand over a real KVManager: a 5-token prompt is prefilled, its first
    token sampled, then `draft` is verified against logits whose argmax is `targets`."""
    import torch

    from radixlm.runtime.managers.output_processor import OutputProcessor
    from radixlm.runtime.managers.req import Req
    from radixlm.runtime.mem_cache.kv_manager import KVManager
    from radixlm.runtime.server_args import ServerArgs
    from radixlm.runtime.speculative.ngram_spec import NgramSpeculator, SpecState

    V = 32
    kv = KVManager(num_pages=64 // page_size, page_size=page_size, max_running_requests=2, context_len=64,
                   device="cpu")
    out = OutputProcessor(None, [1], V, 64, torch.device("cpu"), jump_forward=False)
    spec = NgramSpeculator(ServerArgs(speculative_algorithm="ngram"), out, kv)
    req = Req("x", [3, 4, 5, 6, 7], SamplingParams.from_dict(dict(temperature=0, **sampling)))
    assert kv.admit(req, kv.match_prefix([]))
    kv.alloc_extend([req], [5])
    kv.commit([req], [5])
    req.output_ids.append(9)
    req.draft_ids = list(draft)
    req.spec_state = SpecState()
    kv.alloc_extend([req], [1 + len(draft)])
    kv.commit([req], [1])
    logits = torch.full((1 + len(draft), V), -5.0)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    n = spec.verify([req], [logits])
    return req, kv, n


@pytest.mark.parametrize("page_size", [1, 4])
def test_verify_stop_id_inside_a_run_and_kv_trim(page_size):
    # all 4 proposals agree, but 12 is a stop id: the output ends at it, the KV keeps what it saw
    req, kv, n = _verify_direct(page_size, [10, 11, 12, 13], [10, 11, 12, 13, 14], stop_token_ids=[12],
                                ignore_eos=True)
    assert n == 3 and req.output_ids == [9, 10, 11, 12]
    assert req.finished_reason == {"type": "stop", "matched": 12}
    assert req.kv_committed_len == req.seq_len - 1 == 8
    assert req.spec_verify_ct == 1 and req.spec_accepted_tokens == 2
    kv.cache_finished_req(req)
    assert kv.is_fully_free()


@pytest.mark.parametrize("page_size", [1, 4])
def test_verify_rejection_frees_the_rejected_pages(page_size):
    # proposals 10, 11 agree, 20 does not (the model says 12): 3 tokens appended, 2 proposals kept
    req, kv, n = _verify_direct(page_size, [10, 11, 20, 21, 22, 23, 24], [10, 11, 12], ignore_eos=True,
                                max_new_tokens=50)
    assert n == 3 and req.output_ids == [9, 10, 11, 12] and not req.finished
    assert req.kv_committed_len == 8 and req.extend_len == 1
    # slots held: the row's first 8 tokens, in whole pages (the rejected ones beyond them are free)
    held = kv.total_tokens - kv.free_tokens()
    assert held == -(-8 // page_size) * page_size
    kv.cache_finished_req(req)
    assert kv.is_fully_free()


def test_seeded_sampling_penalties_and_logprobs_same_state(llama_path):
    prompts = _prompts()
    reqs = [("seed", prompts[0], dict(max_new_tokens=30, temperature=0.7, sampling_seed=11, ignore_eos=True)),
            ("pen", prompts[1], dict(max_new_tokens=30, temperature=0, frequency_penalty=0.3, ignore_eos=True)),
            ("minnew", prompts[2], dict(max_new_tokens=30, temperature=0, min_new_tokens=20))]
    plain, _, _ = _run(llama_path, reqs)
    spec, h, rec = _run(llama_path, reqs, **SPEC)
    assert spec == plain
    assert rec.events
    # logprobs per accepted token: one entry per output token, close to the plain run's
    params = SamplingParams.from_dict(dict(max_new_tokens=30, temperature=0, ignore_eos=True))
    got = []
    for args in ({}, SPEC):
        hh = SchedulerHarness(llama_path, **args)
        hh.submit_raw(TokenizedGenerateReq(rid="lp", input_ids=prompts[1], sampling_params=params, return_logprob=True))
        r = hh.run()["lp"]
        got.append((r["output_ids"], r["output_token_logprobs"]))
        if args:
            assert hh.scheduler.spec.totals.accepted_tokens > 0
    (ids0, lp0), (ids1, lp1) = got
    assert ids0 == ids1 and len(lp1) == len(ids1) == 30
    assert [t for _, t in lp1] == ids1
    assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(lp0, lp1))


def test_speculation_off_above_the_batch_size_limit(llama_path):
    reqs = _greedy_reqs(12)
    plain, _, _ = _run(llama_path, reqs)
    spec, h, _ = _run(llama_path, reqs, **{**SPEC, "speculative_disable_by_batch_size": 2})
    assert spec == plain
    # all 4 decode together from the first decode step on: no verify pass at all
    assert h.scheduler.spec.totals.verify_ct == 0


@pytest.mark.parametrize("jump_forward", [True, False])
def test_grammar_requests_speculate_and_match(llama_path, jump_forward):
    # Proposals of a constrained request are verified under the grammar's mask of each position (the
    # matcher advanced only over accepted tokens); a jump-forward ends the run. Greedy outputs equal
    # plain decoding's, with and without jump-forward (outlines; xgrammar's matcher has the same
    # interface: tests/unit/grammar).
    import json

    schema = '{"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "array", "items": ' \
             '{"type": "string", "enum": ["xy", "xy xy"]}, "minItems": 4, "maxItems": 6}}, "required": ["a", "b"]}'
    reqs = [("json", _prompts()[0], dict(max_new_tokens=80, temperature=0, json_schema=schema)),
            ("regex", _prompts()[2], dict(max_new_tokens=40, temperature=0, regex="((ab|cd) ){12}")),
            ("plain", _prompts()[1], dict(max_new_tokens=40, temperature=0, ignore_eos=True))]
    kw = dict(disable_jump_forward=not jump_forward)
    plain, _, _ = _run(llama_path, reqs, **kw)
    spec, h, rec = _run(llama_path, reqs, **kw, **SPEC)
    assert spec == plain
    text = h.scheduler.tokenizer.decode(spec["json"][0], skip_special_tokens=True)
    assert json.loads(text)["b"]                            # a complete document (finished on the grammar)
    constrained = [e for e in rec.events if e[0] in ("json", "regex")]
    assert constrained and h.results["json"]["last"].spec_verify_ct + h.results["regex"]["last"].spec_verify_ct > 0
    assert any(list(_accepted(e[1], e[2])) for e in constrained), constrained   # some proposals accepted


def test_sampled_outputs_identical_over_many_seeds(llama_path):
    # With a seed every draw depends only on (seed, output position) and the logits, so the sampled
    # tokens must match plain decoding one for one: a stronger check than comparing distributions.
    prompt = _prompts()[1]
    reqs = [(f"s{seed}", prompt, dict(max_new_tokens=24, temperature=t, top_p=0.9 if seed % 2 else 1.0,
                                       sampling_seed=seed, ignore_eos=True))
            for seed in range(12) for t in (0.3,)]
    plain, _, _ = _run(llama_path, reqs)
    spec, h, _ = _run(llama_path, reqs, **SPEC)
    assert spec == plain
    assert h.scheduler.spec.totals.accepted_tokens > 0
    assert len({tuple(v[0]) for v in plain.values()}) > 1          # the seeds do give different texts


def _sampled_sequences(path: str, seed: int, n: int, bias: float = 0.0, **args):
    """The 6-token outputs of n unseeded requests (temperature 1, top-k 2) as a Counter. With `bias`,
    a wrong verifier that adds `bias` to every proposal's logit before sampling (a mutant)."""
    h = SchedulerHarness(path, max_running_requests=32, random_seed=seed, **args)
    if bias:
        spec = h.scheduler.spec
        inner = spec._verify_sampled

        def biased(reqs, drafts, logits):
            out = []
            for lg, draft in zip(logits, drafts):
                lg = lg.clone()
                for j, t in enumerate(draft):
                    lg[j, t] += bias
                out.append(lg)
            return inner(reqs, drafts, out)

        spec._verify_sampled = biased
    for i in range(n):
        h.submit(f"u{i}", _prompts()[1], max_new_tokens=6, temperature=1.0, top_k=2, ignore_eos=True)
    res = h.run()
    accepted = h.scheduler.spec.totals.accepted_tokens if h.scheduler.spec else 0
    return collections.Counter(tuple(r["output_ids"]) for r in res.values()), accepted


def _chi_square_same(a: collections.Counter, b: collections.Counter, z: float = 3.719) -> tuple[bool, str]:
    """Two-sample chi-square test of homogeneity over whole output sequences; cells expected below 5
    in either sample are pooled. True when equality is not rejected at p = 1e-4 (z = 3.719; the
    critical value by the Wilson-Hilferty approximation, no scipy here)."""
    na, nb = sum(a.values()), sum(b.values())
    rows, other = [], [0, 0]
    for cell in set(a) | set(b):
        if (a[cell] + b[cell]) * min(na, nb) / (na + nb) >= 5:
            rows.append((a[cell], b[cell]))
        else:
            other = [other[0] + a[cell], other[1] + b[cell]]
    if sum(other):
        rows.append(tuple(other))
    stat = 0.0
    for x, y in rows:
        for obs, n in ((x, na), (y, nb)):
            expected = (x + y) * n / (na + nb)
            stat += (obs - expected) ** 2 / expected
    df = len(rows) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical, f"chi2 {stat:.1f} on {df} df, critical {critical:.1f}"


def test_unseeded_sampling_distribution_unchanged(llama_path):
    # Unseeded draws differ run to run, so compare distributions: 1,500 sampled 6-token outputs with
    # and without speculation (different RNG seeds), chi-square over whole sequences. The test's power
    # is checked on a mutant verifier that favours proposals (+1 logit): it must be rejected.
    n = 1500
    plain, _ = _sampled_sequences(llama_path, 1, n)
    spec, accepted = _sampled_sequences(llama_path, 2, n, **SPEC)
    same, detail = _chi_square_same(plain, spec)
    assert same, detail
    assert accepted > n // 2, accepted          # proposals were accepted under sampling, often
    assert len(plain) > 20                      # a distribution, not one sequence
    wrong, _ = _sampled_sequences(llama_path, 2, n, bias=1.0, **SPEC)
    same, detail = _chi_square_same(plain, wrong)
    assert not same, f"the chi-square test did not see a verifier biased towards proposals: {detail}"


def test_decode_log_line_reports_accept_length(llama_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="radixlm.scheduler"):
        _run(llama_path, _greedy_reqs(24)[1:2], decode_log_interval=2, **SPEC)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert lines and all("accept len: " in line for line in lines)
    assert any(float(line.split("accept len: ")[1].split(",")[0]) > 1.0 for line in lines)


@pytest.mark.parametrize("bad,message", [
    (dict(speculative_algorithm="EAGLE"), "not supported"),
    (dict(speculative_num_draft_tokens=0), "num-draft-tokens"),
    (dict(speculative_ngram_min_match_window_size=3, speculative_ngram_max_match_window_size=2), "window"),
])
def test_bad_speculative_args_are_refused(bad, message):
    from radixlm.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match=message):
        ServerArgs.from_kwargs(**{"speculative_algorithm": "ngram", **bad}).validate()


@pytest.mark.parametrize("page_size,total", [(1, 240), (16, 256)])
def test_small_pool_drops_proposals_then_preempts_and_stays_exact(llama_path, page_size, total):
    # a pool too small for every request's next tokens: proposals go first, then requests are retracted
    reqs = _greedy_reqs(40)
    kw = dict(max_total_tokens=total, page_size=page_size, max_prefill_tokens=256, schedule_conservativeness=0.0)
    plain, _, _ = _run(llama_path, reqs, **kw)
    spec, h, rec = _run(llama_path, reqs, **kw, **SPEC)
    assert spec == plain
    assert h.scheduler.planner.stats().num_preemptions > 0 and rec.max_accepted() >= 1


# ----------------------------------------------------------------- adaptive policy
def test_step_cost_interpolates_and_assumes_the_prior_beyond():
    from radixlm.runtime.speculative.ngram_spec import ROW_PRIOR, StepCost

    cost = StepCost()
    assert cost.curve(1, 3) == []
    cost.observe(1, 10.0)
    cost.observe(4, 13.0)
    cost.observe(4, 13.0)
    got = cost.curve(1, 6)
    want = [10.0, 11.0, 12.0, 13.0, 13.0 * (1 + ROW_PRIOR), 13.0 * (1 + 2 * ROW_PRIOR)]
    assert got == pytest.approx(want)
    cost.observe(1, 20.0)                               # a running average, not the last sample
    assert 10.0 < cost.curve(1, 1)[0] < 20.0


def _decoding_req(rid: str, prompt: list[int], first: int):
    from radixlm.runtime.managers.req import Req

    req = Req(rid, list(prompt), SamplingParams.from_dict(dict(temperature=0, max_new_tokens=100)))
    req.output_ids.append(first)
    req.kv_committed_len = req.seq_len - 1
    return req


@pytest.mark.parametrize("row_cost,expect_rows", [(0.01, True), (1.0, False)])
def test_adaptive_proposals_only_where_rows_pay(row_cost, expect_rows):
    # A step of R rows takes 1 + row_cost * (R - 1): rows nearly free (a weight-bound CPU decode)
    # make the speculator propose several tokens; rows that cost a whole step (compute-bound) none.
    from radixlm.runtime.server_args import ServerArgs
    from radixlm.runtime.speculative.ngram_spec import NgramSpeculator

    spec = NgramSpeculator(ServerArgs(speculative_algorithm="ngram"), None, None)
    for rows in range(1, 12):
        spec.cost.observe(rows, 1 + row_cost * (rows - 1))
    req = _decoding_req("a", [5, 6, 7, 8, 9] * 4, 5)       # "... 9 5" repeats: proposals 6 7 8 9 5 6
    spec.propose([req], context_len=1000)
    if expect_rows:
        assert 3 <= len(req.draft_ids) <= 6 and req.draft_ids == [6, 7, 8, 9, 5, 6][:len(req.draft_ids)]
    else:
        assert req.draft_ids == []
    # a request that has been accepting everything gets at least as many rows as a new one
    spec.cost = type(spec.cost)()
    for rows in range(1, 12):
        spec.cost.observe(rows, 1 + 0.15 * (rows - 1))
    good, new = _decoding_req("g", [5, 6, 7, 8, 9] * 4, 5), _decoding_req("n", [1, 2, 3, 4] * 5, 1)
    spec.propose([good, new], context_len=1000)         # creates their states
    good.spec_state.accepted, good.spec_state.rejected = 20.0, 0.0
    spec.propose([good, new], context_len=1000)
    assert len(good.draft_ids) >= len(new.draft_ids) and len(good.draft_ids) >= 1


# ----------------------------------------------------------------- MKL's reproducible mode
def test_scheduler_process_asks_mkl_for_row_count_independent_sums(monkeypatch):
    """Speculation on CPU sets MKL_CBWR=AUTO,STRICT unless the environment chose a mode; off, nothing
    changes. (On an AMX Xeon, without it, these tests' fp32 greedy outputs parted with speculation.)"""
    from radixlm.runtime.managers.scheduler_process import reproducible_blas
    from radixlm.runtime.server_args import ServerArgs

    spec = ServerArgs.from_kwargs(model_path="x", device="cpu", speculative_algorithm="NGRAM")
    monkeypatch.delenv("MKL_CBWR", raising=False)
    reproducible_blas(ServerArgs.from_kwargs(model_path="x", device="cpu"))
    assert "MKL_CBWR" not in os.environ
    reproducible_blas(spec)
    assert os.environ["MKL_CBWR"] == "AUTO,STRICT"
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    reproducible_blas(spec)
    assert os.environ["MKL_CBWR"] == "AVX2"
