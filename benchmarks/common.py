"""Shared helpers for the benchmarks, one module per concern, re-exported here:

    common_load      machine info, /proc CPU and RSS readings, LoadMonitor
    common_stats     percentile, summarize
    common_results   result files (JSON + Markdown), tables, --output-dir
    common_server    launch_bench_server, run_against_server (--base-url or --launch)
    common_models    the Qwen2-shaped random models and their tokenizer

Benchmarks import this module (`import common`) after putting benchmarks/ on sys.path.
"""

from __future__ import annotations

from common_load import (  # noqa: F401
    LoadMonitor,
    cpu_model,
    machine_info,
    process_tree,
    read_cpu_times,
    rss_breakdown,
    rss_bytes,
    wait_for_quiet,
)
from common_models import (  # noqa: F401
    MODEL_SHAPES,
    add_model_args,
    count_params,
    default_model_cache,
    make_qwen2_model,
)
from common_results import (  # noqa: F401
    DEFAULT_OUTPUT_DIR,
    REPO_ROOT,
    add_output_dir_arg,
    fmt,
    json_safe,
    machine_line,
    markdown_table,
    write_results,
)
from common_server import launch_bench_server, run_against_server  # noqa: F401
from common_stats import percentile, summarize  # noqa: F401
