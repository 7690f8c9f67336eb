"""Every environment variable radixlm reads, in one typed registry (nothing else reads os.environ).

    from radixlm.runtime import env
    env.DISABLE_CPU_GEMM.get()            # this process's value, typed; the default when unset
    env.NUM_THREADS.get(some_mapping)     # the value in another environment (a child's)
    env.child_environ(server_args)        # a copy of os.environ for child processes, every switch
                                          # set from server_args
    env.environ_copy()                    # a plain copy of os.environ (for subprocess.Popen)

Each entry has its name, type, default, help text and the ServerArgs field it backs. A field that
is backed takes the variable's value as its default when ServerArgs is built, and its flag's help
names the variable, so the order is: flag (or Engine keyword) > environment variable > default.

The C++ kernels (kernels/*) and the layers below the model runner read the registry, not
ServerArgs. A scheduler is a child process, so the launcher starts every child with
`child_environ(server_args)`: whatever the flag said is what the kernels see in the child. Code
that runs a model in its own process without the launcher (unit tests' harnesses) follows this
process's environment for those switches.

Entries without a field are paths or test switches, not server behaviour: the cache folders and
`RADIXLM_REQUIRE_TEST_DEPS` (read by tests/helpers.py `missing_dependency`; .ci/run sets it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FALSE_WORDS = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: `get()` parses it (ValueError naming the variable when it is bad)."""

    name: str
    type: type                      # bool, int or str
    default: Any
    help: str
    field: str | None = None        # the ServerArgs field it backs (its flag), or None
    choices: tuple[str, ...] | None = None

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value in `environ` (default: this process's environment), or the default when unset."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or (raw == "" and self.type is not bool):
            return self.default
        return self.parse(raw)

    def parse(self, raw: str) -> Any:
        if self.type is bool:
            return raw.strip().lower() not in FALSE_WORDS
        if self.type is int:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{self.name}={raw!r} is not an integer") from None
        if self.choices and raw not in self.choices:
            raise ValueError(f"{self.name}={raw!r} is not one of {', '.join(self.choices)}")
        return raw

    def set(self, value: Any) -> None:
        """Sets (None: removes) the variable in this process's environment, for code in this process
        that reads it later (oneDNN reads ONEDNN_MAX_CPU_ISA at its first matmul)."""
        text = self.format(value)
        if text is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = text

    def format(self, value: Any) -> str | None:
        """The text that `get` reads back as `value`; None for None (the variable is then unset)."""
        if value is None:
            return None
        if self.type is bool:
            return "1" if value else "0"
        return str(value)


REGISTRY: dict[str, EnvVar] = {}


def _var(name: str, type_: type, default: Any, help_: str, field: str | None = None,
         choices: tuple[str, ...] | None = None) -> EnvVar:
    var = EnvVar(name, type_, default, help_, field, choices)
    REGISTRY[name] = var
    return var


# ------------------------------------------------------------------ CPU threads and memory
NUM_THREADS = _var("RADIXLM_NUM_THREADS", int, None, "torch threads per scheduler process (default: the "
                   "available cores // (tp_size * dp_size), at least 1).", "num_threads")
CPU_FIXED_THREADS = _var("RADIXLM_CPU_FIXED_THREADS", bool, False, "On CPU, keep the torch thread count fixed instead of "
                     "dropping one thread while other processes keep a core busy (runtime/managers/thread_adapter.py).",
                     "cpu_fixed_threads")
DISABLE_CPU_PRELOAD = _var("RADIXLM_DISABLE_CPU_PRELOAD", bool, False, "On CPU, do not LD_PRELOAD tcmalloc into "
                           "the scheduler and detokenizer even when it is installed.", "disable_cpu_preload")
# ------------------------------------------------------------------ CPU fast paths
DISABLE_CPU_KERNELS = _var("RADIXLM_DISABLE_CPU_KERNELS", bool, False, "On CPU, use the torch code instead of "
                           "every radixlm C++ kernel (attention, fused ops, gemm, one-call decoder).",
                           "disable_cpu_kernels")
DISABLE_CPU_GEMM = _var("RADIXLM_DISABLE_CPU_GEMM", bool, False, "On CPU, do not use radixlm's bf16 "
                        "gemm: packed bf16 weights then use oneDNN's layout (where oneDNN has bf16).", "disable_cpu_gemm")
DISABLE_FUSED_OPS = _var("RADIXLM_DISABLE_FUSED_OPS", bool, False, "On CPU, run RMSNorm, SiLU-and-mul and rotary "
                         "in torch instead of radixlm's fused C++ ops.", "disable_fused_ops")
DISABLE_GGUF_QUANT = _var("RADIXLM_DISABLE_GGUF_QUANT", bool, False, "Load a GGUF file's weights dequantized to the "
                          "serving dtype (bf16) instead of keeping Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights "
                          "quantized in memory (about 3.5x the memory and the bytes read per decode step).", "disable_gguf_quant")
DISABLE_CPU_DECODER = _var("RADIXLM_DISABLE_CPU_DECODER", bool, False, "On CPU, run decode steps through the "
                           "Python forward, layer by layer, instead of radixlm's one-call C++ decoder (same "
                           "results; the C++ loop drops the per-op Python work, the CPU counterpart of CUDA "
                           "graphs).", "disable_cpu_decoder")
DISABLE_PACKED_WEIGHTS = _var("RADIXLM_DISABLE_PACKED_WEIGHTS", bool, False, "On CPU, keep bf16/fp16 linear "
                              "weights in their plain layout instead of packing them once (radixlm's "
                              "bf16 gemm layout in 2 MiB pages, or oneDNN's, as timed; slower matmuls "
                              "without).", "disable_packed_weights")
CPU_LINEAR_KERNEL = _var("RADIXLM_CPU_LINEAR_KERNEL", str, "auto", "Kernel of the CPU bf16/fp16 linear "
                         "layers: auto (time radixlm's bf16 gemm (AVX512-BF16, or fp32 FMAs on AVX2), oneDNN's packed matmul (AMX where "
                         "the CPU has it) and plain F.linear per weight shape once, cached per CPU model in "
                         "linear_select.json beside the kernel cache), or force gemm, onednn or torch.",
                         "cpu_linear_kernel", ("auto", "gemm", "onednn", "torch"))
CPU_QUANT_KERNEL = _var("RADIXLM_CPU_QUANT_KERNEL", str, "auto", "Kernel of the matmuls of GGUF weights kept "
                        "quantized: auto (time, per GGUF type and input size, the decode kernel (vnni), the "
                        "int8 prefill GEMM (gemm) and bf16 weight tiles through oneDNN (dequant) at 16 to 1024 "
                        "rows once, cached beside linear_select.json's bf16 choices; each call then uses the "
                        "winner for its row count), or force vnni, gemm or dequant at every row count.",
                        "cpu_quant_kernel", ("auto", "vnni", "gemm", "dequant"))
CPU_EXTEND_KERNEL = _var("RADIXLM_CPU_EXTEND_KERNEL", str, "auto", "Kernel of the CPU extend (prefill) attention "
                         "for bf16 models: auto (time radixlm's AVX512/AVX2 kernel (simd) against the brgemm one "
                         "(flash attention on AMX tiles, or on vdpbf16ps where the CPU has AVX512-BF16 without AMX) once per head shape, cached "
                         "beside linear_select.json's choices; extends of at least 16 new tokens per request take "
                         "the winner), or force brgemm or simd for every extend. Decode always runs the simd "
                         "kernel.", "cpu_extend_kernel", ("auto", "brgemm", "simd"))
CPU_DECODE_SPLIT = _var("RADIXLM_CPU_DECODE_SPLIT", str, "auto", "How the one-call CPU decoder runs a decode "
                        "step of bf16 gemm-layout weights with at least 8 requests per thread: auto (time the "
                        "whole batch on every thread against one part of the batch per thread, each through "
                        "every layer alone, per batch size and context length, and use the faster), or force "
                        "off or on. The outputs are the same either way.", "cpu_decode_split", ("auto", "off", "on"))
CPU_KERNEL_ISA = _var("RADIXLM_CPU_KERNEL_ISA", str, None, "SIMD path of the C++ CPU kernels (default: the "
                      "best this CPU runs, avx512 then avx2).", "cpu_kernel_isa", ("avx512", "avx2"))
REQUIRE_KERNELS = _var("RADIXLM_REQUIRE_KERNELS", bool, False, "Fail (RuntimeError) when a C++ CPU kernel that "
                       "is not disabled cannot be built or this CPU has no AVX2/AVX512, instead of warning and "
                       "using the torch code. .ci/run sets it.", "require_kernels")
# ------------------------------------------------------------------ paths and test switches
KERNEL_CACHE = _var("RADIXLM_KERNEL_CACHE", str, None, "Folder of the built C++ kernels (default: "
                    "~/.cache/radixlm/kernels).")
CACHE_DIR = _var("RADIXLM_CACHE_DIR", str, None, "radixlm's cache folder: downloaded and converted models "
                 "(default: ~/.cache/radixlm).")
LINEAR_SELECT_CACHE = _var("RADIXLM_LINEAR_SELECT_CACHE", str, None, "JSON file of the measured CPU linear "
                           "kernel choices (default: linear_select.json in the kernel cache folder).")
ONEDNN_MAX_CPU_ISA = _var("ONEDNN_MAX_CPU_ISA", str, None, "oneDNN's own cap on the instruction set it uses "
                          "(read by oneDNN at its first matmul). radixlm sets it to AVX512_CORE_BF16 in "
                          "its process when the CPU advertises AMX but the kernel refuses the tile state.")
MKL_CBWR = _var("MKL_CBWR", str, None, "MKL's reproducibility mode (read by MKL at its first call). With "
                "speculative decoding on CPU, radixlm sets it to AUTO,STRICT in the scheduler process when "
                "unset: fp32 matmuls then give a row the same bits in a batch of any size.")
REQUIRE_TEST_DEPS = _var("RADIXLM_REQUIRE_TEST_DEPS", bool, False, "Tests: fail instead of skipping when an "
                         "optional test dependency is missing (the real SmolLM2 model, SGLang's client, "
                         "sglang-router, chromium). .ci/run sets it.")

BY_FIELD: dict[str, EnvVar] = {v.field: v for v in REGISTRY.values() if v.field}


def environ_copy() -> dict[str, str]:
    """A copy of this process's environment (to pass to a child process, possibly amended)."""
    return dict(os.environ)


def child_environ(server_args: Any, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with every field-backed variable set to the
    value of its ServerArgs field (removed where the field is None), so a child process reads
    through the registry what the flags said."""
    out = dict(os.environ if base is None else base)
    for var in BY_FIELD.values():
        text = var.format(getattr(server_args, var.field))
        if text is None:
            out.pop(var.name, None)
        else:
            out[var.name] = text
    return out


def without_flags() -> list[EnvVar]:
    """The variables that have no ServerArgs field (shown at the end of --help)."""
    return [v for v in REGISTRY.values() if v.field is None]
