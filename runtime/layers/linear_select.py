"""Which kernel each CPU linear weight uses, chosen by timing the candidates on this CPU once.

    kernels = choose_kernels(modules)      # {id(module): "gemm" | "onednn" | "torch"}
    last_selection()                       # what the last call chose and how (the startup block)

Candidates, where this CPU and the weight allow them: **gemm** (kernels/cpu_gemm: AVX512-BF16, or
fp32 FMAs on AVX512/AVX2 CPUs; bf16 with an even in_features), **onednn** (oneDNN's packed matmul,
where oneDNN has the dtype: not bf16 on AVX2-only CPUs; its AMX kernels where the CPU has AMX and
the kernel granted the tile state, kernels/cpu_amx.py) and **torch** (F.linear on the plain weight). `--cpu-linear-kernel` / RADIXLM_CPU_LINEAR_KERNEL: `auto` measures; `gemm`,
`onednn` or `torch` forces one (a weight the forced kernel cannot take gets the next of gemm ->
onednn -> torch).

Measuring: each distinct (out, in, dtype, bias) shape is timed at decode batches DECODE_ROWS and,
except for the LM head (it sees one row per request), at PREFILL_ROWS rows, round-robin over the
candidates, the best of a few passes (retried while the CPU is busy). Shapes are timed in order of
the bytes a step reads from them (count x size: the LM head and the MLP first); timing stops after
MEASURE_BUDGET_S, and a shape left untimed takes the kernel that won the most timed bytes. A pass
runs the matmul over enough copies of the weight to exceed twice the last-level cache, so decode is
timed reading weights from memory, as in a real step. The gemm copies sit in 2 MiB pages, as its
arena does.

One layout per weight (two would double the weights' memory): the winner minimises
0.5 * (geometric mean of its decode slowdowns against each bucket's best) + 0.5 * (its prefill
slowdown), so decode (TPOT) and prefill (TTFT) count alike; ties within TIE go to the earlier of
gemm, onednn, torch.

Timing passes during which another process took the CPU are dropped (measure()); shapes that got
no quiet pass keep their noisy times for this process (NOISY: a later load in the same process reuses
them, so two models built in one process multiply alike) but are not written to the file.

The times go into a JSON file (default <kernel cache>/linear_select.json, RADIXLM_LINEAR_SELECT_CACHE),
keyed by CPU model name + flags hash, torch version, thread count, oneDNN ISA cap, the gemm
sources' hash and the shape, so later starts on the same kind of machine measure nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...kernels import cpu_gemm
from ...kernels.cpu_build import cpu_flags, cpu_model_name, kernel_cache_root
from .. import env
from ..mem_cache.huge_pages import huge_page_empty
from . import packed_linear as pl
from .neighbour_load import NeighbourLoad

logger = logging.getLogger(__name__)

CANDIDATES = ("gemm", "onednn", "torch")      # also the preference order on ties
DECODE_ROWS = (1, 4, 16, 64)
PREFILL_ROWS = 256
TIE = 0.03
PASSES = 3                                    # clean timed passes per bucket and candidate (best is kept)
MAX_PASSES = 8                                # rounds: at most MAX_PASSES // PASSES = 2 blocks per bucket
NEIGHBOUR_SHARE = 0.2                         # other processes' share of the cores a quiet block allows
MIN_BLOCK_S = 0.15                            # /proc/stat counts in 10 ms ticks
MAX_BLOCK_ROUNDS = 64
MEASURE_BUDGET_S = 15.0                       # then the rest is untimed (untimed_choice)
MAX_COPIES = 64
CACHE_VERSION = 1
NOISY: dict[str, Any] = {}                    # timings with no quiet pass: this process only, never in the file


@dataclass(frozen=True)
class Shape:
    out_features: int
    in_features: int
    dtype: torch.dtype
    bias: bool
    lm_head: bool

    @property
    def key(self) -> str:
        return (f"{self.out_features}x{self.in_features}|{str(self.dtype).removeprefix('torch.')}"
                f"|bias={int(self.bias)}|lm_head={int(self.lm_head)}")

    @property
    def rows(self) -> tuple[int, ...]:
        return DECODE_ROWS if self.lm_head else (*DECODE_ROWS, PREFILL_ROWS)


@dataclass
class Selection:
    """What choose_kernels decided: mode, per-shape choice and times (µs per call, by rows)."""

    mode: str
    measured: int = 0                  # shapes timed now (0: every shape came from the cache)
    busy: int = 0                      # of those, timed while another process took the CPU (not cached)
    seconds: float = 0.0
    cache_file: str = ""
    choices: dict[str, str] = field(default_factory=dict)
    times: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for c in self.choices.values():
            counts[c] = counts.get(c, 0) + 1
        kinds = ", ".join(f"{n} shape(s) {c}" for c, n in counts.items()) or "no weights"
        if self.mode != "auto":
            return f"{kinds} (forced by --cpu-linear-kernel {self.mode})"
        how = (f"measured {self.measured} shape(s) in {self.seconds:.1f} s" if self.measured
               else "from the cache")
        return f"{kinds} (auto: {how}; {self.cache_file})"


_last: Selection | None = None       # the process's last selection, for the startup block


def last_selection() -> Selection | None:
    return _last


def cache_file() -> Path:
    return Path(env.LINEAR_SELECT_CACHE.get() or kernel_cache_root() / "linear_select.json")


def environment_key() -> str:
    """What kernel timings depend on besides the kernels' own code: CPU model + flags hash, torch
    version, threads, oneDNN cap (quant_select.py keys its times with it too)."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return (f"{cpu_model_name()}|flags={flags}|torch={torch.__version__}|threads={torch.get_num_threads()}"
            f"|onednn_isa={env.ONEDNN_MAX_CPU_ISA.get() or 'default'}")


def sources_hash(folder: Path, pattern: str) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob(pattern)))).hexdigest()[:12]


def machine_key() -> str:
    """environment_key() and the gemm sources: what the times depend on."""
    return f"{environment_key()}|gemm={sources_hash(Path(cpu_gemm.__file__).parent, 'gemm.*')}"


@dataclass
class PassTimes:
    """One candidate's timed passes (µs per call): the best pass timed while the neighbours were
    quiet, the best of any pass, and the best CPU time per thread; `clean` counts the quiet passes."""
    clean_us: float = math.inf
    any_us: float = math.inf
    cpu_us: float = math.inf
    clean: int = 0


def time_passes(calls: dict[str, Callable[[], None]], per_call: int, passes: int, max_passes: int,
                deadline: float) -> dict[str, PassTimes]:
    """Times each of `calls` (one run makes `per_call` kernel calls) round-robin, in blocks of at
    least `passes` rounds and MIN_BLOCK_S (the first round of the first block warms up: page faults,
    oneDNN's primitive cache). A block is quiet when other processes took at most NEIGHBOUR_SHARE of
    the machine during it (neighbour_load.py); its passes then count as clean. Blocks repeat until
    one is quiet, max_passes // passes blocks have run, or the deadline has passed."""
    threads = torch.get_num_threads()
    out = {k: PassTimes() for k in calls}
    for block_no in range(max(1, max_passes // passes)):
        block = {k: math.inf for k in calls}
        n, start = 0, time.perf_counter()
        with NeighbourLoad() as load:
            while n < passes or (time.perf_counter() - start < MIN_BLOCK_S and n < MAX_BLOCK_ROUNDS):
                for k, call in calls.items():
                    c0, t0 = time.process_time(), time.perf_counter()
                    call()
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    if block_no or n:               # not the warm-up round
                        block[k] = min(block[k], wall / per_call * 1e6)
                        out[k].cpu_us = min(out[k].cpu_us, cpu / threads / per_call * 1e6)
                n += 1
        for k, t in out.items():
            t.any_us = min(t.any_us, block[k])
        if load.share is None or load.share <= NEIGHBOUR_SHARE:
            for k, t in out.items():
                t.clean += n
                t.clean_us = min(t.clean_us, block[k])
            break
        if time.perf_counter() > deadline:
            break
    return out


def ranked_times(t: dict[str, PassTimes]) -> tuple[dict[str, float], bool]:
    """({kernel: µs per call}, quiet) from time_passes: the quiet block's best passes, or, when no
    block was quiet, the best CPU time per thread (beside a busy neighbour it ranks kernels better
    than wall time). Used by the selectors that time one call per candidate (GGUF, extend attention)."""
    if min(p.clean for p in t.values()) == 0:
        return {k: round(p.cpu_us, 1) for k, p in t.items()}, False
    return {k: round(p.clean_us, 1) for k, p in t.items()}, True


def load_cache(path: Path) -> dict[str, Any]:
    """The cached times ({key: {rows: {candidate: µs}}}); {} when absent, unreadable or of another version."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if data.get("version") == CACHE_VERSION else {}


def save_cache(path: Path, new: dict[str, Any]) -> None:
    """Merges `new` into the file, written atomically (a temp file renamed); logs and goes on if it cannot."""
    try:
        entries = {**load_cache(path), **new}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("Could not write the linear kernel cache %s: %s", path, e)


def candidates(weight: torch.Tensor, bias: torch.Tensor | None) -> list[str]:
    """The kernels that can run this weight here, in preference order."""
    out = []
    if pl.load_cpu_gemm() is not None and pl.gemm_fits(weight, bias):
        out.append("gemm")
    if pl.onednn_supported(weight):
        out.append("onednn")
    return [*out, "torch"]


def pick(times: dict[str, dict[str, float]], allowed: list[str]) -> str:
    """The winner by the rule in the module docstring, among `allowed` (all present in every bucket)."""
    def slowdowns(rows: list[str]) -> dict[str, float]:
        if not rows:
            return {c: 1.0 for c in allowed}
        logs = {c: 0.0 for c in allowed}
        for r in rows:
            best = min(times[r][c] for c in allowed)
            for c in allowed:
                logs[c] += math.log(times[r][c] / best)
        return {c: math.exp(v / len(rows)) for c, v in logs.items()}

    decode = slowdowns([r for r in times if int(r) <= max(DECODE_ROWS)])
    prefill = slowdowns([r for r in times if int(r) > max(DECODE_ROWS)])
    score = {c: 0.5 * decode[c] + 0.5 * prefill[c] for c in allowed}
    best = min(score.values())
    return next(c for c in allowed if score[c] <= best * (1 + TIE))


def untimed_choice(choices: dict[str, str], by_shape: dict[Shape, list[nn.Module]], allowed: list[str]) -> str:
    """For a weight left untimed: the kernel that won the most weight bytes among the timed shapes
    (`choices`, by shape key) if this weight allows it, else the first it allows."""
    won: dict[str, int] = {}
    for shape, group in by_shape.items():
        if shape.key in choices:
            won[choices[shape.key]] = won.get(choices[shape.key], 0) + len(group) * group[0].weight.numel()
    for kernel in sorted(won, key=won.get, reverse=True):
        if kernel in allowed:
            return kernel
    return allowed[0]


def forced(mode: str, allowed: list[str]) -> str:
    """The forced kernel, or the next of gemm -> onednn -> torch that this weight allows."""
    order = CANDIDATES[CANDIDATES.index(mode):]
    return next(c for c in order if c in allowed)


def _copies_for(weight: torch.Tensor) -> int:
    """How many weight copies one decode pass reads: twice the last-level cache, at most MAX_COPIES."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        llc = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0)
    except (OSError, ValueError):
        llc = 32 << 20
    return max(1, min(MAX_COPIES, math.ceil(2 * llc / (weight.numel() * weight.element_size()))))


def _make_calls(kernel: str, weight: torch.Tensor, bias: torch.Tensor | None, copies: int) -> list:
    """`copies` callables x -> linear(x) with the weight in `kernel`'s layout, each its own copy."""
    empty = weight.new_empty((0, weight.shape[1]))
    if kernel == "gemm":
        gemm = pl.load_cpu_gemm()
        size = gemm.packed_numel(*weight.shape)
        arena = huge_page_empty(size * copies, torch.bfloat16)
        packs = []
        for i in range(copies):
            gemm.pack(weight, arena[i * size: (i + 1) * size])
            packs.append(pl.GemmWeight(arena[i * size: (i + 1) * size], weight.shape[0]))
        return [lambda x, p=p: pl.linear(x, empty, p, bias) for p in packs]
    if kernel == "onednn":
        packs = [torch.ops.mkldnn._reorder_linear_weight(weight.clone(), pl.BATCH_HINT) for _ in range(copies)]
        return [lambda x, p=p: pl.linear(x, empty, p, bias) for p in packs]
    dense = [weight.clone() for _ in range(copies)]
    return [lambda x, w=w: pl.linear(x, w, None, bias) for w in dense]


def measure(shape: Shape, weight: torch.Tensor, bias: torch.Tensor | None,
            kernels_: list[str], deadline: float = math.inf) -> tuple[dict[str, dict[str, float]], bool]:
    """({rows: {kernel: µs per call}}, quiet) for this weight, timed as the module docstring says.

    Passes count only while other processes left the CPU alone (time_passes); when no block of a
    bucket was quiet the best of all passes is kept and `quiet` is False (the caller does not cache
    such times). Past `deadline` (perf_counter) a bucket stops after one block and no further
    bucket is timed."""
    weight = weight.detach().contiguous()
    copies = _copies_for(weight)
    calls = {k: _make_calls(k, weight, bias, copies) for k in kernels_}
    out: dict[str, dict[str, float]] = {}
    quiet = True
    with torch.inference_mode():
        for rows in shape.rows:
            if time.perf_counter() > deadline:          # out of time: the buckets timed so far decide
                return out, False
            x = (torch.randn(rows, shape.in_features) * 0.1).to(shape.dtype)
            use = copies if rows < 16 else min(copies, 2)     # from 16 rows on the matmul is compute-bound
            runs = {k: (lambda cs=calls[k][:use], x=x: [c(x) for c in cs]) for k in kernels_}
            t = time_passes(runs, use, PASSES, MAX_PASSES, deadline)
            quiet = quiet and min(p.clean for p in t.values()) > 0
            out[str(rows)] = {k: round(p.clean_us if p.clean else p.any_us, 2) for k, p in t.items()}
    return out, quiet


def shape_of(module: nn.Module) -> Shape:
    from .vocab_embedding import ParallelLMHead

    w, b = module.weight, getattr(module, "bias", None)
    return Shape(w.shape[0], w.shape[1], w.dtype, b is not None, isinstance(module, ParallelLMHead))


def choose_kernels(modules: list[nn.Module]) -> dict[int, str]:
    """{id(module): kernel} for these modules (bf16/fp16 CPU weights). Side effects: times the shapes
    not in the cache file and writes them there (auto mode); logs one line per shape."""
    global _last
    mode = env.CPU_LINEAR_KERNEL.get()
    start = time.perf_counter()
    by_shape: dict[Shape, list[nn.Module]] = {}
    for m in modules:
        by_shape.setdefault(shape_of(m), []).append(m)
    sel = Selection(mode, cache_file=str(cache_file()))
    machine = machine_key() if mode == "auto" else ""
    cached = load_cache(cache_file()) if mode == "auto" else {}
    fresh: dict[str, Any] = {}
    out: dict[int, str] = {}
    # The weights a step reads most are timed first, so an exhausted budget leaves only the small
    # ones untimed (the LM head was once left untimed, and its default cost 4 ms a step on AMX).
    order = sorted(by_shape.items(), key=lambda kv: -len(kv[1]) * kv[1][0].weight.numel())
    untimed: list[tuple[Shape, list[nn.Module], list[str]]] = []
    for shape, group in order:
        first = group[0]
        allowed = candidates(first.weight, getattr(first, "bias", None))
        if mode != "auto":
            choice = forced(mode, allowed)
        else:
            key = f"{machine}|{shape.key}"
            times = cached.get(key) or NOISY.get(key, {})
            if not all(r in times and set(allowed) <= set(times[r]) for r in map(str, shape.rows)):
                if time.perf_counter() > start + MEASURE_BUDGET_S:
                    times, quiet = {}, False
                else:
                    times, quiet = measure(shape, first.weight, getattr(first, "bias", None), allowed,
                                           start + MEASURE_BUDGET_S)
                sel.measured += 1
                if quiet:
                    fresh[key] = times
                else:
                    sel.busy += 1
                    NOISY[key] = times
            if not times:
                untimed.append((shape, group, allowed))
                continue
            choice = pick(times, allowed)
            sel.times[shape.key] = times
            logger.info("Linear %s (%d weights): %s; µs per call by rows: %s", shape.key, len(group), choice,
                        "; ".join(f"{r}: " + " ".join(f"{k} {times[r][k]:.0f}" for k in allowed) for r in times))
        sel.choices[shape.key] = choice
        out.update({id(m): choice for m in group})
    for shape, group, allowed in untimed:         # out of time: what won the timed weights, by bytes
        choice = untimed_choice(sel.choices, by_shape, allowed)
        logger.info("Linear %s (%d weights): %s (not timed: the measuring budget ran out)", shape.key,
                    len(group), choice)
        sel.choices[shape.key] = choice
        out.update({id(m): choice for m in group})
    if fresh:
        save_cache(cache_file(), fresh)
    sel.seconds = time.perf_counter() - start
    if sel.busy:
        logger.warning("CPU linear kernels: the CPU was busy with other work while %d shape(s) were timed; "
                       "their choice may be off and is not cached (the next start times them again)", sel.busy)
    _last = sel
    logger.info("CPU linear kernels: %s", sel.summary())
    return out
