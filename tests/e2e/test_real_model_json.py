"""On a real model (SmolLM2-135M-Instruct), JSON-schema constrained output equals the model's own
unconstrained output when that output already satisfies the schema: the default json.dumps layout
(", " and ": ") is what the model writes, so the constraint changes nothing."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.real_model import smollm2_gguf
from tests.server_fixtures import ServerProcess, server_fixture

pytestmark = pytest.mark.slow

server = server_fixture("--dtype", "float32", "--context-length", "2048", "--max-total-tokens", "8192",
                        model=smollm2_gguf, timeout=900)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = ('People, one JSON object per line:\n{"name": "Bob", "age": 25}\n{"name": "Carol", "age": 41}\n'
          '{"name": "Dave", "age": 33}\n')


def test_json_schema_output_equals_unconstrained(server: ServerProcess) -> None:
    def generate(**extra: object) -> str:
        body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 32, **extra}}
        r = httpx.post(server.url("/generate"), json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    free = generate(stop="\n")
    jsonschema.validate(json.loads(free), SCHEMA)          # the premise: the model's own line fits
    assert generate(json_schema=json.dumps(SCHEMA)) == free
