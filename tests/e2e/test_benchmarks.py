"""Every benchmark runs end to end in a tiny configuration and writes valid JSON + Markdown.

These tests check that the benchmarks work, not how fast anything is: the figures depend on the
(shared) machine. One tiny server serves the serving benchmarks of this module.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def load_bench(name: str) -> Any:
    """Imports benchmarks/<name>.py (benchmarks/ is not a package; its scripts import `common`)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def read_result(out_dir: Path, stem: str) -> dict[str, Any]:
    doc = json.loads((out_dir / f"{stem}.json").read_text())
    assert doc["benchmark"] == stem
    assert doc["machine"]["cpu_cores"] >= 1
    assert 0.0 <= doc["load"]["busy_fraction"] <= 1.0
    assert (out_dir / f"{stem}.md").read_text().startswith(f"### {stem}")
    return doc


@pytest.fixture(scope="module")
def server(qwen2_path: str):
    common = load_bench("common")
    with common.launch_bench_server(["--model-path", qwen2_path, "--device", "cpu", "--dtype", "float32",
                                "--max-total-tokens", "8192", "--log-level", "warning"]) as srv:
        yield srv


def test_percentile_matches_linear_interpolation() -> None:
    common = load_bench("common")
    assert common.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert common.percentile([1.0, 2.0, 3.0], 90) == pytest.approx(2.8)
    assert common.percentile([], 50) is None
    assert common.summarize([0.1, 0.3], scale=1000)["p50"] == pytest.approx(200.0)


def test_parse_metric_sums_label_sets() -> None:
    bench = load_bench("bench_serving")
    text = ('# HELP x\nradixlm:prefix_cache_hits_total{model_name="a"} 12.0\n'
            'radixlm:prefix_cache_hits_total{model_name="b"} 3.0\nradixlm:prefix_cache_hits_created 1.7e9\n')
    assert bench.parse_metric(text, "radixlm:prefix_cache_hits_total") == 15.0
    assert bench.parse_metric(text, "radixlm:prefix_cache_queries_total") is None
    assert bench.hit_rate((10.0, 100.0), (40.0, 200.0)) == pytest.approx(0.3)


def test_bench_one_batch(qwen2_path: str, tmp_path: Path) -> None:
    bench = load_bench("bench_one_batch")
    bench.main(["--model-path", qwen2_path, "--dtype", "float32", "--batch-sizes", "1", "3", "--input-len", "8",
                "--decode-steps", "2", "--warmup-steps", "0", "--bandwidth-mib", "16", "--output-dir", str(tmp_path)])
    doc = read_result(tmp_path, "bench_one_batch")
    assert [r["batch_size"] for r in doc["rows"]] == [1, 3]
    assert doc["roofline_batch1_tok_s"] > 0 and doc["batch1_fraction_of_roofline"] > 0


def test_bench_speculative(llama_path: str, tmp_path: Path) -> None:
    bench = load_bench("bench_speculative")
    bench.main(["--model-path", llama_path, "--dtype", "float32", "--max-concurrency", "1", "3", "--num-prompts", "1",
                "3", "--max-new-tokens", "8", "--random-input-len", "16", "--max-total-tokens", "4096",
                "--agent-turns", "3", "--output-dir", str(tmp_path)])
    doc = read_result(tmp_path, "bench_speculative")
    assert [(r["workload"], r["concurrency"]) for r in doc["results"]] == [
        ("edit", 1), ("edit", 3), ("agent", 1), ("agent", 3), ("random", 1), ("random", 3)]
    assert all(r["greedy_identical"] and r["on"]["output_tokens"] == r["off"]["output_tokens"] > 0
               for r in doc["results"])
    agent = [r for r in doc["results"] if r["workload"] == "agent"]
    # every conversation has its first step and more; one whose prompt outgrew the tiny model's context
    # (2,048) ended instead of reaching the scheduler
    assert all(r["num_prompts"] < r["on"]["requests"] <= 3 * r["num_prompts"] for r in agent)
    assert sum(r["on"]["skipped"] for r in agent) > 0


def test_bench_offline_throughput(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_BENCH_MODELS", str(tmp_path / "models"))
    bench = load_bench("bench_offline_throughput")
    bench.main(["--model-size", "tiny", "--num-requests", "6", "--min-input", "8", "--max-input", "40",
                "--min-output", "2", "--max-output", "6", "--max-running-requests", "4",
                "--poll-interval", "0.05", "--output-dir", str(tmp_path)])
    doc = read_result(tmp_path, "bench_offline_throughput")
    assert doc["engine"]["output_tokens"] == doc["workload"]["output_tokens"] == doc["hf"]["output_tokens"]
    assert doc["speedup"] > 0
    assert doc["engine"]["scheduler_rss_peak_mib"] > 0


@pytest.mark.parametrize("dataset,backend", [("random", "radixlm"), ("generated-shared-prefix", "radixlm-openai"),
                                             ("multi-turn", "radixlm")])
def test_bench_serving(server: Any, tmp_path: Path, dataset: str, backend: str) -> None:
    bench = load_bench("bench_serving")
    bench.main(["--base-url", server.base_url, "--backend", backend, "--dataset", dataset, "--num-prompts", "4",
                "--input-len", "8", "24", "--output-len", "2", "6", "--gsp-groups", "2", "--gsp-prompts-per-group",
                "2", "--gsp-system-len", "64", "--num-conversations", "2", "--turns", "2", "--max-concurrency", "2",
                "4", "--quiet", "--output-dir", str(tmp_path)])
    doc = read_result(tmp_path, f"bench_serving_{dataset}")
    assert [r["max_concurrency"] for r in doc["runs"]] == [2, 4]
    for run in doc["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0, run["errors"]
        assert run["ttft_ms"]["p50"] > 0 and run["output_throughput"] > 0
        assert run["cache_hit_rate"] is not None, doc["runs"]


def test_bench_prefix_cache_and_plots(server: Any, tmp_path: Path) -> None:
    bench = load_bench("bench_prefix_cache")
    bench.main(["--base-url", server.base_url, "--num-requests", "3", "--system-tokens", "150", "--max-tokens", "3",
                "--quiet", "--output-dir", str(tmp_path)])
    doc = read_result(tmp_path, "bench_prefix_cache")
    assert [p["mode"] for p in doc["passes"]] == ["unique", "shared"]
    shared = doc["passes"][1]
    assert shared["cached_token_fraction"] > 0.5       # the warm-up request cached the system prompt
    assert doc["ttft_p50_ratio_unique_over_shared"] > 0
    plots = load_bench("plots")
    made = plots.make_plots(tmp_path)
    assert [p.name for p in made] == ["ttft_shared_vs_unique.png"]
    assert made[0].read_bytes()[:4] == b"\x89PNG"


def test_bench_serving_side_by_side(server: Any, tmp_path: Path) -> None:
    """--compare-base-url: the same benchmark against a second server (here the same one through its
    OpenAI routes), one table with both systems and the ratios."""
    bench = load_bench("bench_serving")
    bench.main(["--base-url", server.base_url, "--backend", "radixlm", "--num-prompts", "2", "3", "--input-len", "8",
                "16", "--output-len", "2", "4", "--max-concurrency", "1", "3", "--repeats", "2",
                "--compare-base-url", server.base_url, "--compare-backend", "openai", "--compare-name", "peer",
                "--quiet-wait", "2", "--quiet", "--output-dir", str(tmp_path)])
    doc = read_result(tmp_path, "bench_serving_random_vs_peer")
    # which server goes first alternates with the repeat
    assert [(r["system"], r["max_concurrency"], r["repeat"]) for r in doc["runs"]] == [
        (s, c, k) for c in (1, 3) for k in (0, 1) for s in (("radixlm", "peer") if k == 0 else ("peer", "radixlm"))]
    assert all(0.0 <= r["quiet_wait_s"] <= 2.5 for r in doc["runs"]), doc["runs"]
    assert [r["completed"] for r in doc["runs"]] == [2] * 4 + [3] * 4, doc["runs"]   # one count per concurrency
    assert all(r["failed"] == 0 for r in doc["runs"]), doc["runs"]
    # radixlm's OpenAI side has neither vLLM's /reset_prefix_cache nor llama.cpp's /slots
    assert [r["cache_reset"] for r in doc["runs"][:2]] == [True, False]
    assert len(doc["rows"]) == 4 and all(r["output_throughput_ratio"] > 0 for r in doc["rows"])
    table = (tmp_path / "bench_serving_random_vs_peer.md").read_text()
    assert "out tok/s radixlm/peer" in table
    assert "**Not a cold comparison**: the prefix cache of peer could not be reset" in table   # said, not buried
    agree = doc["greedy_agreement"]        # one server behind both names: greedy texts are equal
    assert len(agree) == 4 and all(r["same"] and r["texts"][0] for r in agree), agree


def test_profile_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_BENCH_MODELS", str(tmp_path / "models"))
    bench = load_bench("profile_step")
    result = bench.main(["--model-size", "tiny", "--dtype", "float32", "--batch-size", "3", "--input-len", "12",
                         "--steps", "2", "--warmup-steps", "1", "--max-total-tokens", "1024",
                         "--output-dir", str(tmp_path)])
    read_result(tmp_path, "profile_step_bs3")
    assert result["steps"] == 2 and result["phase_ms_mean"]["model forward"] > 0
    assert 0.0 <= result["outside_model_forward_fraction"] <= 1.0


def test_profile_wave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_BENCH_MODELS", str(tmp_path / "models"))
    bench = load_bench("profile_wave")
    result = bench.main(["--model-size", "tiny", "--dtype", "float32", "--num-prompts", "5", "--input-len", "8", "20",
                         "--output-len", "3", "--max-total-tokens", "1024", "--server-arg", "max_prefill_tokens=32",
                         "--output-dir", str(tmp_path)])
    read_result(tmp_path, "profile_wave_n5")
    assert result["prefill_tokens"] >= 5 * 8 and result["prefill_steps"] >= 2      # 32-token steps: chunked
    assert all(s["prefill"] + s["decodes"] <= 32 for s in result["first_steps"])   # decodes count in the budget
    assert 0 < result["first_token_p50_s"] <= result["first_token_max_s"] <= result["total_s"]
