"""PNG plots from the benchmarks' JSON results (matplotlib, no display needed).

    python benchmarks/plots.py                     # reads and writes benchmarks/results/
    python benchmarks/plots.py --results-dir DIR --output-dir DIR

Makes whichever of these it has results for:
  ttft_shared_vs_unique*.png    bench_prefix_cache*.json: TTFT distribution (CDF) of both passes
  throughput_vs_concurrency.png bench_serving_*.json with several --max-concurrency runs
  throughput_vs_hf.png          bench_offline_throughput.json: Engine vs HF generate
  one_batch_decode.png          bench_one_batch.json: decode tok/s by batch size, with the roofline
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import matplotlib  # noqa: E402
import matplotlib.ticker  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _footer(fig: Any, doc: dict[str, Any]) -> None:
    fig.text(0.01, 0.01, common.machine_line(doc["machine"], doc.get("load")), fontsize=6, color="gray")


def _save(fig: Any, out: Path) -> Path:
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")
    return out


def plot_ttft(doc: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, color in (("unique", "tab:red"), ("shared", "tab:green")):
        ttfts = sorted(t * 1e3 for p in doc["passes"] if p["mode"] == mode for t in p["ttft_s_all"])
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, ys, where="post", color=color, label=f"{mode} system prompt (p50 {doc[mode + '_ttft_ms']:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{doc['num_requests']} concurrent chats, {doc['system_prompt_tokens']}-token system prompt: "
                 f"{doc['ttft_p50_ratio_unique_over_shared']:.1f}x", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    _footer(fig, doc)
    return _save(fig, out)


def plot_concurrency(docs: list[dict[str, Any]], out: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for doc in docs:
        runs = [r for r in doc["runs"] if r["max_concurrency"]]
        xs = [r["max_concurrency"] for r in runs]
        label = doc["benchmark"].removeprefix("bench_serving_")
        ax1.plot(xs, [r["output_throughput"] for r in runs], marker="o", label=label)
        ax2.plot(xs, [r["ttft_ms"]["p50"] for r in runs], marker="o", label=label)
    ax1.set_ylabel("output tokens/s")
    ax2.set_ylabel("TTFT p50 (ms)")
    ticks = sorted({r["max_concurrency"] for d in docs for r in d["runs"] if r["max_concurrency"]})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("max concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("bench_serving: throughput and latency vs concurrency", fontsize=10)
    _footer(fig, docs[0])
    return _save(fig, out)


def plot_vs_hf(doc: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    names, values = [], []
    for key, label in (("engine", "radixlm Engine"), ("hf", "HF generate\n(static batches)")):
        if doc.get(key):
            names.append(label)
            values.append(doc[key]["output_tok_s"])
    bars = ax.bar(names, values, color=["tab:blue", "tab:gray"][:len(values)])
    ax.bar_label(bars, fmt="%.1f tok/s")
    ax.set_ylim(0, max(values, default=1) * 1.15)
    ax.set_ylabel("output tokens/s")
    w = doc["workload"]
    title = f"{w['num_requests']} requests, {doc['num_params'] / 1e6:.0f}M-param model"
    if "speedup" in doc:
        title += f": {doc['speedup']:.2f}x"
    ax.set_title(title, fontsize=10)
    _footer(fig, doc)
    return _save(fig, out)


def plot_one_batch(doc: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = doc["rows"]
    ax.plot([r["batch_size"] for r in rows], [r["decode_tok_s"] for r in rows], marker="o", label="decode (median step)")
    xs = [r["batch_size"] for r in rows]
    ax.plot(xs, [b * doc["roofline_batch1_tok_s"] for b in xs], color="tab:red", ls="--",
            label="bandwidth bound: weights read once per step")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["batch_size"] for r in rows], [str(r["batch_size"]) for r in rows])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"one static batch, {doc['weight_bytes'] / 1e6:.0f} MB of weights", fontsize=10)
    _footer(fig, doc)
    return _save(fig, out)


def make_plots(results_dir: str | Path, output_dir: str | Path | None = None) -> list[Path]:
    src = Path(results_dir)
    out = Path(output_dir) if output_dir else src
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for path in sorted(src.glob("bench_prefix_cache*.json")):
        if doc := _load(path):
            suffix = path.stem.removeprefix("bench_prefix_cache")
            made.append(plot_ttft(doc, out / f"ttft_shared_vs_unique{suffix}.png"))
    serving = [d for p in sorted(src.glob("bench_serving_*.json")) if (d := _load(p))
               and len([r for r in d.get("runs", []) if r["max_concurrency"]]) > 1]
    if serving:
        made.append(plot_concurrency(serving, out / "throughput_vs_concurrency.png"))
    if doc := _load(src / "bench_offline_throughput.json"):
        made.append(plot_vs_hf(doc, out / "throughput_vs_hf.png"))
    if doc := _load(src / "bench_one_batch.json"):
        made.append(plot_one_batch(doc, out / "one_batch_decode.png"))
    return made


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(prog="plots.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", default=str(common.DEFAULT_OUTPUT_DIR), help="(default: %(default)s)")
    p.add_argument("--output-dir", help="where the PNGs go (default: --results-dir)")
    args = p.parse_args(argv)
    made = make_plots(args.results_dir, args.output_dir)
    if not made:
        print(f"no benchmark results found in {args.results_dir}")
    return made


if __name__ == "__main__":
    main()
