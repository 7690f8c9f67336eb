"""Startup mistakes give one clear error line and exit 1, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixlm.launch_server", "--port", "1", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["missing_path", "bad_arch", "long_context", "tp_size"])
def test_clear_startup_errors(case, llama_path, tmp_path):
    if case == "missing_path":
        args, expect = ["--model-path", str(tmp_path / "nope")], "does not exist"
    elif case == "bad_arch":
        model = tmp_path / "m"
        shutil.copytree(llama_path, model)
        cfg = json.loads((model / "config.json").read_text())
        cfg["architectures"] = ["FancyNewForCausalLM"]
        (model / "config.json").write_text(json.dumps(cfg))
        args, expect = ["--model-path", str(model)], "LlamaForCausalLM"      # names the supported ones
    elif case == "long_context":
        args, expect = ["--model-path", llama_path, "--context-length", "100000"], "max_position_embeddings"
    else:
        args, expect = ["--model-path", llama_path, "--tp-size", "3"], "divisible"
    out = _launch(*args)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "radixlm-server: error:" in out.stderr and expect in out.stderr, out.stderr


def test_help_explains_flags():
    out = subprocess.run([sys.executable, "-m", "radixlm.launch_server", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model-path", "--tp-size", "--schedule-policy", "--chunked-prefill-size", "--api-key"):
        assert flag in out.stdout
