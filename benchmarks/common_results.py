"""Result files of the benchmarks.

Every benchmark writes `<output-dir>/<name>.json` (figures + machine + load + command) and
`<output-dir>/<name>.md` (the Markdown table it also prints).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common_load import machine_info

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results"


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(machine: dict[str, Any], load: dict[str, Any] | None) -> str:
    text = f"Machine: {machine['cpu_cores']} cores, {machine['cpu_model']}, torch {machine['torch']}"
    if load:
        text += (f"; load during the run: {load['busy_fraction']:.0%} of all cores busy "
                 f"({load['own_busy_fraction']:.0%} this benchmark, {load['other_busy_fraction']:.0%} other)")
    return text


def write_results(name: str, output_dir: str | Path, results: dict[str, Any], table: str,
                  load: dict[str, Any] | None = None) -> Path:
    """Writes NAME.json and NAME.md under output_dir, prints the table; returns the JSON path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    command = "python " + " ".join(shlex.quote(a) for a in [_script_path(), *sys.argv[1:]])
    doc = {"benchmark": name, "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": command, "machine": machine, "load": load, **results}
    path = out / f"{name}.json"
    path.write_text(json.dumps(json_safe(doc), indent=2, default=str, allow_nan=False) + "\n")
    md = f"### {name}\n\n{table}\n\n{machine_line(machine, load)}\n\nCommand: `{command}`\n"
    (out / f"{name}.md").write_text(md)
    print("\n" + md)
    print(f"results: {path}")
    return path


def json_safe(value: Any) -> Any:
    """Replaces inf/nan floats (not valid JSON) by strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _script_path() -> str:
    arg0 = sys.argv[0] if sys.argv and sys.argv[0] else "?"
    try:
        return os.path.relpath(arg0, REPO_ROOT) if arg0.endswith(".py") else arg0
    except ValueError:
        return arg0


def add_output_dir_arg(parser: Any) -> None:
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                        help="folder for the JSON and Markdown results (default: %(default)s)")
