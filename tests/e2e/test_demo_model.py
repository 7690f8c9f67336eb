"""The bundled demo model (`radixlm/demo_model/`): it is shipped, loads in our runtime, and answers.

The held-out prompts come from `scripts/train_demo_model.py` itself (its fixed split), so they are
prompts the model never saw in training. The model is trained by that script, never by these tests:

- the fast test drives our real scheduler in-process (`SchedulerHarness`) on 50 held-out arithmetic
  prompts and requires >= 90% exact answers;
- the server tests start the real server with no `--model-path` (so it serves the bundled model; about
  10 s on 2 cores), ask the same prompts through the OpenAI chat API, and run DSL programs against it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

from radixlm.runtime.server_args import default_model_path
from tests.helpers import SchedulerHarness
from tests.server_fixtures import REPO_ROOT, ServerProcess, start_server

DEMO_DIR = Path(default_model_path())
TRAIN_SCRIPT = REPO_ROOT / "scripts" / "train_demo_model.py"
MIN_ACCURACY = 0.9
SHIPPED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", "MODEL_CARD.md")


def load_training_script() -> ModuleType:
    """Imports scripts/train_demo_model.py (not a package module) for its held-out split."""
    spec = importlib.util.spec_from_file_location("train_demo_model", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_demo_model"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def heldout() -> dict[str, list[tuple[str, str]]]:
    script = load_training_script()
    return script.heldout_qa(script.make_split(), per_task=50)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_DIR))


def accuracy(expected: list[str], got: list[str]) -> float:
    return sum(e == g.strip() for e, g in zip(expected, got, strict=True)) / len(expected)


def misses(items: list[tuple[str, str]], got: list[str]) -> list[tuple[str, str, str]]:
    return [(q, e, g) for (q, e), g in zip(items, got) if e != g.strip()][:5]


# ----------------------------------------------------------------- shipped files, in-process runtime
def test_demo_model_is_shipped_and_small() -> None:
    for name in SHIPPED_FILES:
        assert (DEMO_DIR / name).is_file(), f"missing {DEMO_DIR / name}"
    assert (DEMO_DIR / "model.safetensors").stat().st_size < 20 * 1024 * 1024
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    card = (DEMO_DIR / "MODEL_CARD.md").read_text()
    assert "Held-out accuracy" in card and "train_demo_model.py" in card


def test_tokenizer_chat_template_and_eos(tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert json.loads((DEMO_DIR / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id


def test_heldout_arithmetic_through_scheduler(heldout, tokenizer) -> None:
    """50 held-out sums/differences, greedy, through our real scheduler and model runner."""
    items = heldout["arithmetic"]
    assert len(items) == 50
    harness = SchedulerHarness(str(DEMO_DIR))
    for i, (question, _) in enumerate(items):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        harness.submit(f"q{i}", ids, max_new_tokens=8, temperature=0)
    results = harness.run()
    got = [tokenizer.decode(results[f"q{i}"]["output_ids"], skip_special_tokens=True) for i in range(len(items))]
    assert all(results[f"q{i}"]["finish_reason"] is not None for i in range(len(items)))
    score = accuracy([e for _, e in items], got)
    assert score >= MIN_ACCURACY, f"accuracy {score:.2f}; misses: {misses(items, got)}"


# ----------------------------------------------------------------- the real server with no --model-path
@pytest.fixture(scope="module")
def default_server():
    """`python -m radixlm.launch_server` with no --model-path: it must serve the bundled model."""
    server = start_server(None, "--device", "cpu")
    yield server
    server.stop()


def test_server_serves_bundled_model_by_default(default_server: ServerProcess) -> None:
    info = default_server.get_json("/get_model_info")
    assert Path(info["model_path"]).resolve() == DEMO_DIR.resolve(), info


def test_heldout_arithmetic_through_openai_chat(default_server: ServerProcess, heldout) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=default_server.url("/v1"), api_key="unused")
    model = client.models.list().data[0].id
    items = heldout["arithmetic"]

    def ask(question: str) -> str:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, [q for q, _ in items]))
    score = accuracy([e for _, e in items], got)
    assert score >= MIN_ACCURACY, f"accuracy {score:.2f}; misses: {misses(items, got)}"


def test_dsl_few_shot_programs(default_server: ServerProcess, heldout) -> None:
    """A plain-text few-shot program and a chat program, run as batches against the server."""
    import radixlm as sgl

    @sgl.function
    def few_shot_arithmetic(s, question):
        s += "Q: What is 12 + 7?\nA: 19\nQ: What is 40 - 15?\nA: 25\nQ: What is 33 + 18?\nA: 51\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, stop="\n", temperature=0)

    @sgl.function
    def chat_capital(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))

    backend = sgl.RuntimeEndpoint(default_server.base_url)
    arith = heldout["arithmetic"][:20]
    states = few_shot_arithmetic.run_batch([{"question": q} for q, _ in arith], backend=backend, num_threads=4)
    got = [state["answer"] for state in states]
    assert accuracy([e for _, e in arith], got) >= MIN_ACCURACY, misses(arith, got)
    capitals = heldout["capital"][:20]
    states = chat_capital.run_batch([{"question": q} for q, _ in capitals], backend=backend, num_threads=4)
    got = [state["answer"] for state in states]
    assert accuracy([e for _, e in capitals], got) >= 0.8, misses(capitals, got)
