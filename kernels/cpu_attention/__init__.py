"""CPU paged attention kernels (C++ extension), built on first use and cached.

`load_cpu_attention()` returns the compiled module, or None (with one warning) when it is
disabled or cannot be built; callers then use the torch code. The module has:

    decode(out, q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, num_splits)
    extend(out, q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, seq_lens, qo_indptr, scale)
    decode_num_splits(bs, max_seq_len), isa()

The same two ops are registered as `torch.ops.radixlm.cpu_paged_decode` / `cpu_paged_extend`
(custom ops that mutate `out`) so a torch.compile'd forward keeps them in one graph.

Both attention ops read K/V in place through `req_to_token[req_pool_indices[b], :seq_lens[b]]`
and write `out` (q's shape and dtype); see paged_attention.cpp for the exact contract.

The SIMD path follows the CPU: AVX512 (avx512f/bw/vl/dq) or AVX2+FMA, read from /proc/cpuinfo;
`RADIXLM_CPU_KERNEL_ISA=avx2|avx512` forces one. `RADIXLM_DISABLE_CPU_KERNELS=1` disables the
kernels. The build goes to `$RADIXLM_KERNEL_CACHE` (default ~/.cache/radixlm/kernels/<hash>),
one folder per source/flags/torch version, so later processes only load it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent
_SOURCES = ("paged_attention.cpp", "simd.h")
_ISA_FLAGS = {
    "avx512": ["-DRADIXLM_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "avx2": ["-DRADIXLM_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
_ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma"}}


def kernels_disabled() -> bool:
    return os.environ.get("RADIXLM_DISABLE_CPU_KERNELS", "0") not in ("", "0", "false", "False")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_isa(flags: set[str] | None = None) -> str | None:
    """The best SIMD path this CPU runs ('avx512', 'avx2'), or None."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get("RADIXLM_CPU_KERNEL_ISA")
    for isa in ([forced] if forced else ["avx512", "avx2"]):
        if isa in _ISA_NEEDS and _ISA_NEEDS[isa] <= flags:
            return isa
    return None


def _build_dir(isa: str, flags: list[str]) -> Path:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_SRC_DIR / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    root = Path(os.environ.get("RADIXLM_KERNEL_CACHE", Path.home() / ".cache" / "radixlm" / "kernels"))
    d = root / f"cpu_attention_{isa}_{h.hexdigest()[:16]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.cache
def load_cpu_attention(isa: str | None = None):
    """Builds (first time only) and imports the extension; None if disabled or on failure.

    Side effects: may compile into the cache folder (tens of seconds) and logs that it does.
    """
    if kernels_disabled():
        return None
    isa = isa or pick_isa()
    if isa is None:
        logger.warning("CPU attention kernels need AVX2+FMA or AVX512; using the torch attention code")
        return None
    flags = ["-O3", "-fopenmp", *_ISA_FLAGS[isa]]
    build_dir = _build_dir(isa, flags)
    name = f"radixlm_cpu_attention_{isa}"
    fresh = not any(build_dir.glob(f"{name}*.so"))
    if fresh:
        logger.info("Compiling CPU attention kernels (%s) into %s; first use only, about a minute", isa, build_dir)
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        mod = load(name=name, sources=[str(_SRC_DIR / "paged_attention.cpp")], extra_cflags=flags,
                   extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure falls back to torch code
        logger.warning("CPU attention kernels failed to build (%s: %s); using the torch attention code",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    if fresh:
        logger.info("CPU attention kernels (%s) built in %.1f s", isa, time.perf_counter() - t0)
    _register_custom_ops(mod)
    return mod


_registered: list = []   # the module behind torch.ops.radixlm.cpu_paged_* (first one loaded)


def _register_custom_ops(mod) -> None:
    """Registers the torch.compile-visible ops once per process (they call the first module loaded)."""
    if _registered:
        return
    _registered.append(mod)

    @torch.library.custom_op("radixlm::cpu_paged_decode", mutates_args=("out",), device_types="cpu")
    def cpu_paged_decode(out: Tensor, q: Tensor, k_buf: Tensor, v_buf: Tensor, req_to_token: Tensor,
                         req_pool_indices: Tensor, seq_lens: Tensor, scale: float, num_splits: int) -> None:
        _registered[0].decode(out, q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, num_splits)

    @torch.library.custom_op("radixlm::cpu_paged_extend", mutates_args=("out",), device_types="cpu")
    def cpu_paged_extend(out: Tensor, q: Tensor, k_buf: Tensor, v_buf: Tensor, req_to_token: Tensor,
                         req_pool_indices: Tensor, prefix_lens: Tensor, seq_lens: Tensor, qo_indptr: Tensor,
                         scale: float) -> None:
        _registered[0].extend(out, q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, seq_lens,
                              qo_indptr, scale)

    cpu_paged_decode.register_fake(lambda *args: None)
    cpu_paged_extend.register_fake(lambda *args: None)
