"""Which kernel multiplies a GGUF weight kept quantized, by row count, chosen by timing on this CPU once.

    choose_quant_kernels(weights)          # at load (gguf_quant.attach_quantized): times what is not cached
    kernel_for(qtype, in_features, dtype, rows)   # "vnni" | "gemm" | "dequant"

All three read the same repacked bytes (kernels/cpu_quant), so the choice costs no memory and is made
per row count, not once per weight:

- **vnni**: quant.h / kquant.h `linear`, the decode kernel (GEMV and small batches: 4 rows of x per
  pass over a 16-row group, x quantized to int8 per block of 32);
- **gemm**: qgemm.h, the prefill kernel (same int8 activations, register tiles of several rows of x
  x several groups, x in L2-sized chunks);
- **dequant**: tiles of about TILE_BYTES of weight rows dequantized to bf16 (`dequantize_bf16`) and
  multiplied by F.linear (oneDNN: its AMX kernels where the CPU has them and the tile state was
  granted, kernels/cpu_amx.py). No bf16 copy of the whole weight is kept. bf16 x only.

Auto mode (`--cpu-quant-kernel auto`, RADIXLM_CPU_QUANT_KERNEL) times the candidates per (GGUF type,
in_features, x dtype) at ROWS rows, on the first TIME_OUT_ROWS output rows of the largest weight of
that kind (the kernels' time per output row does not depend on the count), the best of PASSES clean
passes (passes during which another process took the CPU are dropped, as linear_select.py does;
when none is clean, the kinds are ranked by their CPU time per thread instead, not cached in the file,
and kept for this process in linear_select.NOISY). A
call with n rows then uses the winner of the largest bucket <= n; below ROWS[0] rows, vnni. Timing
stops after MEASURE_BUDGET_S: untimed kinds use DEFAULT. The times are cached in linear_select's JSON
file, keyed by CPU model + flags, torch version, threads, oneDNN cap and the cpu_quant sources' hash,
so later starts on the same kind of machine time nothing. A forced kernel (`vnni`, `gemm`,
`dequant`) is used at every row count (dequant falls back to gemm for fp32 x).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ...kernels import cpu_quant
from .. import env

logger = logging.getLogger(__name__)

KERNELS = ("vnni", "gemm", "dequant")          # also the preference order on ties
ROWS = (16, 64, 256, 1024)
TIE = 0.03
PASSES = 2
MAX_PASSES = 6
MEASURE_BUDGET_S = 15.0
TIME_OUT_ROWS = 4096                           # enough that the weight is not L2-resident, as in a real layer
TILE_BYTES = 2 << 20                           # bf16 bytes of one dequantized weight tile
DEFAULT = ((16, "vnni"), (64, "gemm"))          # untimed kinds: gemm from 64 rows on

# (qtype, in_features, dtype) -> ((min rows, kernel), ...), ascending
_plans: dict[tuple[int, int, torch.dtype], tuple[tuple[int, str], ...]] = {}


def kernel_for(qtype: int, in_features: int, dtype: torch.dtype, rows: int) -> str:
    """The kernel for an [rows, in_features] x of `dtype` against a weight of GGUF type `qtype`."""
    mode = env.CPU_QUANT_KERNEL.get()
    if mode != "auto":
        return "gemm" if mode == "dequant" and dtype != torch.bfloat16 else mode
    choice = "vnni"
    for at, kernel in _plans.get((qtype, in_features, dtype), DEFAULT):
        if rows >= at:
            choice = kernel
    return choice


def machine_key() -> str:
    from .linear_select import environment_key, sources_hash  # (linear_select imports quant_linear, us)

    return f"quant|{environment_key()}|cpu_quant={sources_hash(Path(cpu_quant.__file__).parent, '*.[ch]*')}"


def candidates(dtype: torch.dtype) -> list[str]:
    out = ["vnni", "gemm"]
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        out.append("dequant")
    return out


def _time(calls: dict, rows: int, in_features: int, dtype: torch.dtype, deadline: float) -> tuple[dict, bool]:
    """({kernel: µs per call}, quiet) at `rows` rows of x."""
    from .linear_select import ranked_times, time_passes

    x = (torch.randn(rows, in_features) * 0.5).to(dtype)
    return ranked_times(time_passes({k: (lambda call=call: call(x)) for k, call in calls.items()}, 1, PASSES,
                                    MAX_PASSES, deadline))


def measure(part, in_features: int, dtype: torch.dtype, deadline: float) -> tuple[dict[str, dict[str, float]], bool]:
    """({rows: {kernel: µs}}, quiet) for a QuantPart's kind, on its first TIME_OUT_ROWS output rows."""
    from . import quant_linear as ql

    mod = cpu_quant.load_cpu_quant()
    rows = min(part.rows, TIME_OUT_ROWS)
    groups = -(-rows // 16)
    nbytes = ql._fn(mod, part.qtype, "packed_bytes")(part.qtype, groups * 16, in_features)
    sub = ql.QuantPart(part.qtype, rows if groups * 16 > part.rows else groups * 16, part.data[:nbytes], True)
    calls = {k: (lambda x, k=k: ql.part_linear(sub, x, in_features, k)) for k in candidates(dtype)}
    out: dict[str, dict[str, float]] = {}
    quiet = True
    with torch.inference_mode():
        for r in ROWS:
            if time.perf_counter() > deadline:
                return out, False
            out[str(r)], q = _time(calls, r, in_features, dtype, deadline)
            quiet = quiet and q
    return out, quiet


def plan_of(times: dict[str, dict[str, float]]) -> tuple[tuple[int, str], ...]:
    """Per bucket the fastest kernel (ties within TIE to the earlier of KERNELS)."""
    plan = []
    for r in sorted(times, key=int):
        t = times[r]
        best = min(t.values())
        plan.append((int(r), next(k for k in KERNELS if k in t and t[k] <= best * (1 + TIE))))
    return tuple(plan)


def choose_quant_kernels(weights: list, dtype: torch.dtype) -> dict[tuple[int, int], tuple[tuple[int, str], ...]]:
    """Sets the plan of every (type, in_features) among `weights` (QuantWeights) for x of `dtype`.

    Side effects: in auto mode, times the kinds not in the cache file and writes them there; logs one
    line per kind. Returns {(qtype, in_features): plan}. Nothing to do when the kernel is off."""
    from .linear_select import NOISY, cache_file, load_cache, save_cache

    if env.CPU_QUANT_KERNEL.get() != "auto" or cpu_quant.load_cpu_quant() is None:
        return {}
    kinds: dict[tuple[int, int], object] = {}
    for w in weights:
        for p in w.parts:
            if p.packed and ((p.qtype, w.in_features) not in kinds or p.rows > kinds[p.qtype, w.in_features].rows):
                kinds[p.qtype, w.in_features] = p
    start = time.perf_counter()
    machine = machine_key()
    cached = load_cache(cache_file())
    fresh, busy, out = {}, 0, {}
    for (qtype, k), part in sorted(kinds.items()):
        key = f"{machine}|type={qtype}|in={k}|{str(dtype).removeprefix('torch.')}|out_rows={TIME_OUT_ROWS}"
        times = cached.get(key) or NOISY.get(key)
        if not times or any(str(r) not in times for r in ROWS):
            times, quiet = measure(part, k, dtype, start + MEASURE_BUDGET_S)
            if quiet:
                fresh[key] = times
            else:
                busy += 1
                NOISY[key] = times
        if times:
            _plans[qtype, k, dtype] = out[qtype, k] = plan_of(times)
            logger.info("GGUF type %d, in %d: %s; µs per call (first %d output rows) by rows: %s", qtype, k,
                        ", ".join(f"{kern} from {r}" for r, kern in out[qtype, k]), TIME_OUT_ROWS,
                        "; ".join(f"{r}: " + " ".join(f"{kk} {v:.0f}" for kk, v in t.items()) for r, t in times.items()))
    if fresh:
        save_cache(cache_file(), fresh)
    if busy:
        logger.warning("GGUF quantized kernels: the CPU was busy while %d kind(s) were timed; their choice may "
                       "be off and is not cached", busy)
    logger.info("GGUF quantized kernels chosen for %d kind(s) in %.1f s", len(kinds), time.perf_counter() - start)
    return out
