"""Shared helpers for the benchmarks: machine and load recording, percentiles, result files,
launching a server, and the Qwen2-shaped random models the throughput benchmarks run on.

Every benchmark writes `<output-dir>/<name>.json` (figures + machine + load + command) and
`<output-dir>/<name>.md` (the Markdown table it also prints).

The machine is shared, so a figure means little without the load it ran under. `LoadMonitor`
samples /proc/stat while a run goes on and splits the busy CPU time into the part used by this
benchmark's own process tree (the engine or server it started included) and the rest ("other").
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results"
READY_LINE = "The server is fired up and ready to roll!"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------- machine and load
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, RAM, library versions and torch threads of this machine."""
    import torch

    mem_total = 0
    try:
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {
        "hostname": platform.node(), "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(),
        "mem_total_gib": round(mem_total / 2**30, 1), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": _cpu_flags(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_flags() -> list[str]:
    """The CPU features that decide bf16 matmul speed (AMX, AVX512-BF16, AVX512F)."""
    wanted = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def read_cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies summed over all cores, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)     # idle + iowait
    total = sum(parts[:8])                                     # guest time is already in user
    return total - idle, total


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime jiffies) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def process_tree(root: int) -> dict[int, int]:
    """pid -> cpu jiffies for `root` and all its descendants."""
    stats: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                stats[int(name)] = st
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats and pid not in tree:
            tree[pid] = stats[pid][1]
            frontier.extend(p for p, (ppid, _) in stats.items() if ppid == pid)
    return tree


def rss_bytes(pid: int, peak: bool = False) -> int:
    """Resident set size of a process (VmHWM, its lifetime peak, with `peak=True`); 0 if gone."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_breakdown(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM (peak), RssAnon (heap: tensors, KV) and RssFile (mapped files, e.g. mmap'd
    safetensors) of a process, in MiB; empty when the process is gone."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


@dataclass
class LoadMonitor:
    """Samples whole-machine and own-process-tree CPU use in a background thread.

    with LoadMonitor() as load: ...run...
    load.summary() -> {"busy_fraction", "own_busy_fraction", "other_busy_fraction", ...}

    Fractions are of all cores (1.0 = every core busy). `own` counts this process and its
    descendants, `extra_pids` (a server started elsewhere) and theirs.
    """

    interval: float = 0.5
    extra_pids: list[int] = field(default_factory=list)
    _first: dict[int, int] = field(default_factory=dict)
    _last: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _busy_fracs: list[float] = field(default_factory=list)

    def __enter__(self) -> LoadMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = read_cpu_times()
        self._first = self._sample_tree()
        self._last = dict(self._first)
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._thread.start()

    def _sample_tree(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for root in [os.getpid(), *self.extra_pids]:
            out.update(process_tree(root))
        return out

    def _run(self) -> None:
        prev = read_cpu_times()
        while not self._stop.wait(self.interval):
            self._record(prev)
            prev = read_cpu_times()

    def _record(self, prev: tuple[int, int]) -> None:
        now = read_cpu_times()
        if now[1] > prev[1]:
            self._busy_fracs.append((now[0] - prev[0]) / (now[1] - prev[1]))
        for pid, jiffies in self._sample_tree().items():
            self._last[pid] = max(jiffies, self._last.get(pid, 0))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.cpu1 = read_cpu_times()
        for pid, jiffies in self._sample_tree().items():
            self._last[pid] = max(jiffies, self._last.get(pid, 0))
        self.t1 = time.monotonic()

    def summary(self) -> dict[str, Any]:
        busy = self.cpu1[0] - self.cpu0[0]
        total = max(self.cpu1[1] - self.cpu0[1], 1)
        own = sum(j - self._first.get(pid, 0) for pid, j in self._last.items())
        busy_frac = busy / total
        own_frac = min(own / total, busy_frac)
        return {
            "wall_s": round(self.t1 - self.t0, 3), "cores": os.cpu_count(),
            "busy_fraction": round(busy_frac, 3), "own_busy_fraction": round(own_frac, 3),
            "other_busy_fraction": round(busy_frac - own_frac, 3),
            "max_busy_fraction_sampled": round(max(self._busy_fracs), 3) if self._busy_fracs else None,
            "loadavg_1m_at_end": os.getloadavg()[0],
        }


# ----------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) as numpy's default; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0, qs: Sequence[int] = (50, 90, 99)) -> dict[str, Any]:
    """mean and percentiles of `values` times `scale` (e.g. 1000 for seconds -> ms)."""
    out: dict[str, Any] = {"count": len(values)}
    out["mean"] = sum(values) / len(values) * scale if values else None
    for q in qs:
        p = percentile(values, q)
        out[f"p{q}"] = p * scale if p is not None else None
    return out


# ----------------------------------------------------------------- results
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


# ----------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """`python -m radixlm.launch_server` in a child process, logging to a file.

    with LaunchedServer(["--model-path", p]) as server: server.base_url ...
    """

    def __init__(self, server_args: Sequence[str], timeout: float = 300.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="radixlm-bench-server-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "radixlm.launch_server", "--host", "127.0.0.1",
               "--port", str(self.port), *server_args]
        print(f"launching: {' '.join(shlex.quote(c) for c in cmd)}  (log: {self.log_path})")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        self.command = cmd
        self._wait_ready(timeout)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if READY_LINE in self.log_path.read_text(errors="replace") or self._healthy():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        """/health answers 200 once the server has started (quiet log levels hide the ready line)."""
        import httpx

        try:
            return httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------- models
# The real Qwen2-0.5B shape, and a tiny one for tests and smoke runs.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=2048),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def default_model_cache() -> Path:
    return Path(os.environ.get("RADIXLM_BENCH_MODELS", Path(tempfile.gettempdir()) / "radixlm-bench-models"))


def _corpus(max_bytes: int = 1_500_000) -> list[str]:
    """Deterministic training text: the standard library's .py files, in name order."""
    import sysconfig

    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        texts.append(path.read_bytes().decode("utf-8", errors="ignore"))
        total += len(texts[-1])
        if total >= max_bytes:
            break
    return texts


def build_tokenizer(vocab_size: int, out_dir: Path, bpe_size: int = 4096) -> None:
    """A byte-level BPE (trained on stdlib source, ChatML specials at ids 0-2) whose vocabulary is
    padded with `<extra_N>` tokens to exactly `vocab_size`, so every id the model samples decodes
    and real text tokenizes like text (distinct words get distinct ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, bpe_size), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(1_500_000 if vocab_size > bpe_size else 300_000), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer.from_str(json.dumps(data))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     additional_special_tokens=SPECIAL_TOKENS)
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))


def make_qwen2_model(size: str = "0.5b", vocab_size: int | None = None, seed: int = 0,
                     cache_dir: str | Path | None = None) -> str:
    """Builds (once, then reuses) a random Qwen2-shaped bf16 model folder; returns its path.

    `size` is a key of MODEL_SHAPES; `vocab_size` overrides the shape's vocabulary.
    initializer_range 0.1 keeps greedy argmax away from ties (see MACHINE_FACTS.md).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(MODEL_SHAPES[size])
    if vocab_size:
        shape["vocab_size"] = vocab_size
    root = Path(cache_dir) if cache_dir else default_model_cache()
    folder = root / f"qwen2-{size}-v{shape['vocab_size']}-s{seed}-bpe"
    if (folder / "DONE").exists():
        return str(folder)
    building = Path(f"{folder}.building-{os.getpid()}")
    building.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**shape, initializer_range=0.1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(building))
    build_tokenizer(shape["vocab_size"], building)
    del model
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    building.rename(folder)
    (folder / "DONE").write_text("ok\n")
    return str(folder)


def count_params(model_path: str) -> int:
    """Parameters stored in a model folder's safetensors files (tied weights counted once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                total += math.prod(st.get_slice(key).get_shape())
    return total


def add_output_dir_arg(parser: Any) -> None:
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                        help="folder for the JSON and Markdown results (default: %(default)s)")


def run_against_server(args: Any, bench: Callable[[Any, str], Awaitable[dict[str, Any]]]
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs `bench(args, base_url)` against `--base-url`, or against a server started for the run
    with `--launch` (`--model-path`, `--server-args`). Returns (results, load summary)."""
    import asyncio

    server = None
    if args.launch:
        extra = (["--model-path", args.model_path] if args.model_path else []) + shlex.split(args.server_args)
        server = LaunchedServer(extra)
    base_url = server.base_url if server else args.base_url.rstrip("/")
    try:
        with LoadMonitor() as load:
            results = asyncio.run(bench(args, base_url))
    finally:
        if server:
            server.stop()
    results["server_command"] = shlex.join(server.command) if server else None
    return results, load.summary()
