"""benchmarks/bench_structured.py runs end to end in a tiny configuration and writes valid output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_structured_tiny(tmp_path, llama_path):
    spec = importlib.util.spec_from_file_location("bench_structured", ROOT / "benchmarks" / "bench_structured.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--num-requests", "2", "--max-new-tokens", "8", "--skip-32k",
                       "--output-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_structured.json").read_text())
    cases = doc["cases"]
    assert cases["unconstrained"]["output_tokens"] == 16
    assert cases["json_schema, jump-forward on"]["forward_passes"] > 0
    assert cases["compile"]["compile_s_2k_vocab"] > 0
    assert (tmp_path / "bench_structured.md").exists()
