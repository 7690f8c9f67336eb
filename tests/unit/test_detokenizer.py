"""IncrementalDetokenizer: incremental text equals a full decode, UTF-8 and stop-string hold-back.

Pure tests (no processes): token deltas go in as ReqTokenOut, text deltas come out.
"""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from radixlm.runtime.managers.detokenizer_manager import IncrementalDetokenizer, stop_safe_end
from radixlm.runtime.managers.io_struct import BatchTokenIDOut, DecodeParams, ReqTokenOut

UNICODE_TEXT = "x = 'héllo wörld' # €42 — 😀🎉 ok\n\tdef f(): return \"日本語\"  # ça va ?"


@pytest.fixture(scope="module")
def tokenizer(llama_path: str):
    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture()
def detok(tokenizer) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer)


def make_out(rid: str, ids: list[int], finish: dict | None = None, first: bool = True, **kw) -> ReqTokenOut:
    """A ReqTokenOut; `kw` are DecodeParams fields, sent only when `first` (as the scheduler does)."""
    return ReqTokenOut(rid=rid, new_token_ids=ids, finish_reason=finish, prompt_tokens=1,
                       completion_tokens=0, cached_tokens=0, decode=DecodeParams(**kw) if first else None)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int], finish: dict | None,
           rid: str = "r", **kw) -> list[str]:
    """Feeds `ids` in chunks of the given sizes (the last carries `finish`); returns the deltas."""
    deltas, pos = [], 0
    for i, size in enumerate(chunks):
        last = i == len(chunks) - 1
        part = ids[pos:] if last else ids[pos:pos + size]
        pos += size
        deltas.append(detok.process(make_out(rid, part, finish if last else None, first=i == 0, **kw)))
    return deltas


def random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 5]))
    return sizes or [0]


LENGTH = {"type": "length", "length": 0}


# ----------------------------------------------------------------- equals a full decode
@pytest.mark.parametrize("skip,spaces", [(True, True), (False, True), (False, False), (True, False)])
def test_random_streams_equal_full_decode(tokenizer, detok, skip: bool, spaces: bool):
    rng = random.Random(1234)
    multibyte = tokenizer.encode(UNICODE_TEXT)
    specials = sorted(detok.special_ids)
    for trial in range(60):
        ids = [rng.choice(multibyte) if rng.random() < 0.4 else
               rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randint(1, 40))]
        deltas = stream(detok, ids, random_chunks(rng, len(ids)), LENGTH, rid=f"r{trial}",
                        skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert "".join(deltas) == detok.decode(ids, skip, spaces)
        if skip or not spaces:   # where the flag has no effect, the reference is HF's own decode
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.states == {}


def test_text_roundtrip_never_sends_partial_utf8(tokenizer, detok):
    ids = tokenizer.encode(UNICODE_TEXT)
    deltas = stream(detok, ids, [1] * len(ids), LENGTH)
    assert "".join(deltas) == UNICODE_TEXT
    assert all("\ufffd" not in d for d in deltas)
    # a token sequence that splits a 4-byte emoji sends nothing until the character is complete
    emoji = tokenizer.encode("😀")
    assert len(emoji) > 1
    assert stream(detok, emoji, [1] * len(emoji), LENGTH, rid="e")[:-1] == [""] * (len(emoji) - 1)


def test_unfinished_partial_utf8_is_flushed_at_finish(tokenizer, detok):
    emoji = tokenizer.encode("😀")
    part = emoji[:-1]
    deltas = stream(detok, part, [1] * len(part), LENGTH)
    assert "".join(deltas) == tokenizer.decode(part)
    assert deltas[-1].endswith("\ufffd")


def test_spaces_between_special_tokens(tokenizer, detok):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id] + tokenizer.encode("world")
    joined = stream(detok, ids, [1] * len(ids), LENGTH, rid="a", skip_special_tokens=False)
    assert "".join(joined) == "hello <|im_end|> world"
    tight = stream(detok, ids, [1] * len(ids), LENGTH, rid="b", skip_special_tokens=False,
                   spaces_between_special_tokens=False)
    assert "".join(tight) == "hello<|im_end|>world"
    skipped = stream(detok, ids, [1] * len(ids), LENGTH, rid="c")
    assert "".join(skipped) == "helloworld"


# ----------------------------------------------------------------- stop strings
def test_stop_string_prefix_is_held_back_then_trimmed(tokenizer, detok):
    text = "value = compute(x) # STOP here"
    ids = tokenizer.encode(text)
    # the scheduler finishes the request at the token that completes the stop string
    last = next(i for i in range(len(ids)) if "# STOP" in tokenizer.decode(ids[:i + 1]))
    sent = ""
    for i, tid in enumerate(ids[:last]):
        sent += detok.process(make_out("r", [tid], None, first=i == 0, stop_strs=["# STOP"]))
        assert tokenizer.decode(ids[:i + 1]).startswith(sent)
        assert "#" not in sent                       # the would-be stop string never leaks
    assert sent == "value = compute(x) "             # "#" and "# ST" were held back as they appeared
    finish = {"type": "stop", "matched": "# STOP"}
    sent += detok.process(make_out("r", ids[last:last + 1], finish, first=False))
    assert sent == "value = compute(x) "
    assert "r" not in detok.states


def test_ignored_stop_occurrence_is_sent(tokenizer, detok):
    """A full stop string the scheduler did not finish on (min_new_tokens) is ordinary text."""
    ids = tokenizer.encode("a STOP b STOP")
    last = len(ids) - 1
    finish = {"type": "stop", "matched": "STOP"}
    deltas = stream(detok, ids, [1] * last + [1], finish, stop_strs=["STOP"])
    assert "".join(deltas) == "a STOP b "


def test_stop_string_not_trimmed_with_no_stop_trim(tokenizer, detok):
    ids = tokenizer.encode("abc STOP")
    finish = {"type": "stop", "matched": "STOP"}
    deltas = stream(detok, ids, [1] * len(ids), finish, stop_strs=["STOP"], no_stop_trim=True)
    assert "".join(deltas) == "abc STOP"


def test_held_prefix_is_released_when_it_diverges(tokenizer, detok):
    ids = tokenizer.encode("if x == y: pass")
    deltas = stream(detok, ids, [1] * len(ids), None, stop_strs=["==>", "y: return"])
    assert "".join(deltas) == "if x == y: pass"     # nothing left held once the text diverged


def test_stop_token_text_is_trimmed(tokenizer, detok):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("done") + [eos]
    finish = {"type": "stop", "matched": eos}
    keep = dict(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(stream(detok, ids, [len(ids)], finish, rid="a", **keep)) == "done"
    assert "".join(stream(detok, ids, [len(ids)], finish, rid="b", no_stop_trim=True, **keep)) == \
        "done<|im_end|>"
    # a stop token id that is ordinary text is trimmed too
    word = tokenizer.encode(" end")
    assert len(word) == 1
    ids = tokenizer.encode("the") + word
    finish = {"type": "stop", "matched": word[0]}
    assert "".join(stream(detok, ids, [1] * len(ids), finish, rid="c")) == "the"


def test_stop_safe_end():
    assert stop_safe_end("hello wor", 0, ["world"]) == 6
    assert stop_safe_end("hello wor", 7, ["world"]) == 9          # a stop cannot start in sent text
    assert stop_safe_end("hello w", 6, ["world"]) == 6
    assert stop_safe_end("hello", 0, ["xyz"]) == 5
    assert stop_safe_end("a\n", 0, ["\n\n", "a\nb"]) == 0
    assert stop_safe_end("", 0, ["x"]) == 0


def test_batch_keeps_rids_apart(tokenizer, detok):
    a, b = tokenizer.encode("alpha beta"), tokenizer.encode("gamma 😀")
    texts = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):
        outs = [make_out(rid, ids[i:i + 1], LENGTH if i == len(ids) - 1 else None)
                for rid, ids in (("a", a), ("b", b)) if i < len(ids)]
        for item in detok.process_batch(BatchTokenIDOut(outs)).outputs:
            texts[item.rid] += item.text_delta
            assert item.token.rid == item.rid
    assert texts == {"a": "alpha beta", "b": "gamma 😀"}
    assert detok.states == {}
