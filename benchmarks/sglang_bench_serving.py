"""Runs SGLang's own `python -m sglang.bench_serving`, unmodified, where torchvision cannot be installed.

    python benchmarks/sglang_bench_serving.py --backend sglang --base-url http://127.0.0.1:30000 ...

Takes exactly `sglang.bench_serving`'s arguments. Needs the `sglang` package, 0.5.21 or later (tested
with 0.5.23; see "SGLang's own client" in benchmarks/README.md): run it with the interpreter that has it.

Why: every sglang 0.5.x bench_serving imports torchvision at module level. Up to 0.5.20 through
`sglang.srt.utils.common`; since 0.5.21 through `sglang.srt.disaggregation.utils` (for one string,
FAKE_BOOTSTRAP_HOST), which imports `sglang.srt.configs` and with it a vision-model config that imports
torchvision. The index's torchvision wheels are CUDA builds that do not load against torch 2.13.0+cpu
("operator torchvision::nms does not exist"). When that import fails, this runner registers a module
with that one constant (used only by `--pd-separated`, which radixlm does not serve) and then runs
`sglang.bench_serving` as `__main__`: the benchmark's own code, arguments and request functions run
as they are. Side effects: the ones of sglang.bench_serving (HTTP requests, stdout, --output-file).
"""

from __future__ import annotations

import runpy
import sys
import types

DISAGG_UTILS = "sglang.srt.disaggregation.utils"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"   # the value sglang uses for its PD-disaggregation warm-up


def provide_disaggregation_utils() -> bool:
    """Imports sglang's module when it imports; otherwise registers the one name bench_serving reads
    from it. Returns True when the stand-in was registered."""
    try:
        __import__(DISAGG_UTILS)
        return False
    except ImportError:
        for name in [m for m in sys.modules if m == DISAGG_UTILS or m.startswith("sglang.srt.configs")]:
            del sys.modules[name]   # drop what the failed import left half-initialised
        module = types.ModuleType(DISAGG_UTILS)
        module.FAKE_BOOTSTRAP_HOST = FAKE_BOOTSTRAP_HOST
        sys.modules[DISAGG_UTILS] = module
        return True


def main() -> None:
    provide_disaggregation_utils()
    sys.argv[0] = "sglang.bench_serving"
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
