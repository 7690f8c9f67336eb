"""`POST /tokenize` and `POST /detokenize` through the real server: SGLang's and vLLM's fields,
a round trip that gives the text back, batches, and 400s for bad input."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server_fixtures import server_fixture

TEXTS = ["def fibonacci(n):\n    return n", "import os, sys", "héllo wörld ✓"]


server = server_fixture("--max-total-tokens", "4096")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=30)


@pytest.mark.parametrize("field", ["prompt", "text"])
def test_tokenize_matches_the_tokenizer_and_round_trips(server, llama_path, field):
    tok = AutoTokenizer.from_pretrained(llama_path)
    context_len = server.get_json("/get_model_info")["max_model_len"]
    for text in TEXTS:
        r = post(server, "/tokenize", {"model": "default", field: text})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out == {"tokens": tok.encode(text), "count": len(tok.encode(text)), "max_model_len": context_len}
        back = post(server, "/detokenize", {"model": "default", "tokens": out["tokens"],
                                            "skip_special_tokens": True}).json()
        assert back["text"] == back["prompt"] == text


def test_add_special_tokens_and_batches(server, llama_path):
    tok = AutoTokenizer.from_pretrained(llama_path)
    plain = post(server, "/tokenize", {"prompt": TEXTS[0], "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(TEXTS[0], add_special_tokens=False)
    batch = post(server, "/tokenize", {"prompt": TEXTS}).json()
    assert batch["tokens"] == [tok.encode(t) for t in TEXTS] and batch["count"] == [len(tok.encode(t)) for t in TEXTS]
    back = post(server, "/detokenize", {"tokens": batch["tokens"], "skip_special_tokens": True}).json()
    assert back["text"] == TEXTS


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "text": "b"}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_is_400(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
