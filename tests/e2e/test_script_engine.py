"""The README's offline Engine snippet, and TP=2 / DP=2 Engines, run as plain scripts with no
`if __name__ == "__main__"` guard (children must never re-import the user's main module)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import hf_greedy

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def readme_engine_snippet() -> str:
    """The README's Python block that builds `radixlm.Engine(model_path="path/to/model")`."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if 'radixlm.Engine(model_path="path/to/model")' in b)


def run_script(tmp_path: Path, source: str) -> list[dict]:
    """Runs `source` as `python script.py` from an empty folder; returns its RESULT lines."""
    script = tmp_path / "script.py"
    script.write_text(source)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=500)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "bootstrapping phase" not in out.stderr
    return [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]


def test_readme_engine_snippet_as_plain_script(llama_path, tmp_path):
    from transformers import AutoTokenizer

    snippet = readme_engine_snippet().replace("path/to/model", llama_path)
    assert "__main__" not in snippet
    source = "import json\n" + snippet + textwrap.dedent("""
        print("RESULT " + json.dumps({"text": out["text"], "ids": out["output_ids"],
                                      "prompt_tokens": out["meta_info"]["prompt_tokens"]}))
    """)
    (result,) = run_script(tmp_path, source)
    prompt_ids = AutoTokenizer.from_pretrained(llama_path).encode("The capital of France is")
    assert result["prompt_tokens"] == len(prompt_ids)
    assert 0 < len(result["ids"]) <= 8
    assert result["ids"] == hf_greedy(llama_path, prompt_ids, 8)[:len(result["ids"])]


def test_tp2_and_dp2_engines_as_plain_script(llama_path, tmp_path):
    prompt = [5, 17, 99, 230, 41, 7, 300, 12]
    source = textwrap.dedent(f"""
        import json
        import radixlm

        params = {{"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
        engine = radixlm.Engine(model_path={llama_path!r}, tp_size=2, dtype="float32", max_total_tokens=4000,
                                api_key="sk-never-shown")
        out = engine.generate(input_ids={prompt}, sampling_params=params)
        info = engine.get_server_info()
        print("RESULT " + json.dumps({{"ids": out["output_ids"], "tp": info["tp_size"], "key": info["api_key"],
                                      "leaked": "sk-never-shown" in json.dumps(info, default=str)}}))
        engine.shutdown()
        engine = radixlm.Engine(model_path={llama_path!r}, dp_size=2, dtype="float32", max_total_tokens=4000)
        outs = engine.generate(input_ids=[{prompt}] * 2, sampling_params=params)
        print("RESULT " + json.dumps({{"ids": [o["output_ids"] for o in outs], "dp": engine.server_args.dp_size}}))
    """)            # the second engine is left for interpreter exit to shut down
    tp, dp = run_script(tmp_path, source)
    expected = hf_greedy(llama_path, prompt, 6)
    assert tp == {"ids": expected, "tp": 2, "key": "<redacted>", "leaked": False}
    assert dp == {"ids": [expected, expected], "dp": 2}
