"""OutputProcessor without a model: stop tokens and strings, eos, min/max new tokens, the context
limit, sampling from given logits, input-logprob rows and what is emitted when. Uses the bundled
demo model's tokenizer (a local file) for stop strings."""

from __future__ import annotations

import pytest
import torch
from sched_fakes import make_req

from radixlm.runtime.managers.batch_planner import StepBatch
from radixlm.runtime.managers.output_processor import OutputProcessor

EOS = 2
CONTEXT_LEN = 64
VOCAB = 768


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from radixlm.runtime.server_args import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture
def out(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer, [EOS], VOCAB, CONTEXT_LEN, torch.device("cpu"), jump_forward=True)


def feed(out: OutputProcessor, req, tokens: list[int]) -> int:
    """Appends tokens until the request finishes; returns how many were taken."""
    for i, tid in enumerate(tokens):
        out.append_token(req, tid)
        if req.finished:
            return i + 1
    return len(tokens)


def test_stop_token_id_finishes_with_the_matched_id(out) -> None:
    req = make_req("a", [5, 6], max_new_tokens=10, stop_token_ids=[40])
    assert feed(out, req, [7, 8, 40, 9]) == 3
    assert req.finished_reason == {"type": "stop", "matched": 40}


def test_eos_stops_unless_ignored(out) -> None:
    req = make_req("a", [5], max_new_tokens=10)
    assert feed(out, req, [7, EOS, 8]) == 2 and req.finished_reason == {"type": "stop", "matched": EOS}
    req = make_req("b", [5], max_new_tokens=4, ignore_eos=True)
    assert feed(out, req, [7, EOS, 8, EOS, 9]) == 4
    assert req.finished_reason == {"type": "length", "length": 4}


def test_min_new_tokens_suppresses_stops_until_reached(out) -> None:
    req = make_req("a", [5], max_new_tokens=10, min_new_tokens=3, stop_token_ids=[40])
    assert feed(out, req, [40, EOS, 40, 9]) == 3
    assert req.finished_reason == {"type": "stop", "matched": 40}


def test_max_new_tokens_and_context_limit_finish_by_length(out) -> None:
    req = make_req("a", [5], max_new_tokens=3)
    assert feed(out, req, [7, 8, 9, 10]) == 3 and req.finished_reason == {"type": "length", "length": 3}
    req = make_req("b", [5] * (CONTEXT_LEN - 2), max_new_tokens=100)
    assert feed(out, req, [7, 8, 9]) == 2
    assert req.finished_reason == {"type": "length", "length": 2} and req.seq_len == CONTEXT_LEN


def test_stop_string_matches_across_tokens(out, tokenizer) -> None:
    text = tokenizer.encode(" Hello world")
    req = make_req("a", [5], max_new_tokens=20, stop=["llo wo"])
    taken = feed(out, req, text + [7, 8])
    assert req.finished_reason == {"type": "stop", "matched": "llo wo"}
    assert "llo wo" in tokenizer.decode(req.output_ids) and "llo wo" not in tokenizer.decode(req.output_ids[:-1])
    assert taken < len(text)


def test_greedy_sampling_picks_the_argmax_and_records_logprobs(out) -> None:
    greedy = make_req("g", [5, 6], temperature=0.0)
    greedy.return_logprob, greedy.top_logprobs_num = True, 2
    other = make_req("o", [5], temperature=0.0)
    logits = torch.full((2, VOCAB), -5.0)
    logits[0, 123], logits[0, 7] = 4.0, 3.0
    logits[1, 77] = 2.0
    assert out.sample([greedy, other], logits) == [123, 77]
    (lp, tid), = greedy.output_token_logprobs
    assert tid == 123 and lp == pytest.approx(float(torch.log_softmax(logits[0], -1)[123]), abs=1e-5)
    assert [t for _, t in greedy.output_top_logprobs[0]] == [123, 7]
    assert other.output_token_logprobs == []


def test_logprob_rows_cover_the_requested_prompt_positions() -> None:
    plain = make_req("p", [3, 4, 5, 6])
    lp = make_req("l", [10, 11, 12, 13, 14, 15])
    lp.return_logprob, lp.logprob_start_len = True, 2
    lp.kv_committed_len = 1                                 # position 0 is cached; this pass computes [1, 6)
    batch = StepBatch([plain, lp], [4, 5])
    rows, spans = OutputProcessor.logprob_rows(batch)
    # logits at prompt position j give the logprob of token j + 1; start_len 2 needs j = 1 .. 4
    assert spans == [(lp, 0, 1)]
    assert rows == [4 + 0, 4 + 1, 4 + 2, 4 + 3]       # flat rows of positions 1..4 (after plain's 4)


def test_emission_streams_every_step_otherwise_first_token_and_end(out) -> None:
    stream, plain = make_req("s", [5], max_new_tokens=3), make_req("p", [5], max_new_tokens=3)
    stream.stream = True
    assert not OutputProcessor.should_emit(stream) and not OutputProcessor.should_emit(plain)
    sent = {"s": [], "p": []}
    for tid in (7, 8, 9):
        for req in (stream, plain):
            out.append_token(req, tid)
            if OutputProcessor.should_emit(req):
                sent[req.rid].append(OutputProcessor.make_output(req))
    assert [o.new_token_ids for o in sent["s"]] == [[7], [8], [9]]
    assert [o.new_token_ids for o in sent["p"]] == [[7], [8, 9]]    # first token (TTFT), then the rest
    last = sent["p"][-1]
    assert last.finish_reason == {"type": "length", "length": 3} and last.completion_tokens == 3
    assert (last.prompt_tokens, plain.sent_len) == (1, 3)
