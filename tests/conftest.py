"""Shared pytest set-up: the `--runslow` / `cuda` markers and the tiny offline model fixtures.

The tiny models are built once per version of their build code into `$TMPDIR/radixlm-tiny-models-<hash>` and
reused by later sessions; a lock file keeps parallel sessions from building them at the same time.
Helpers that need more shared fixtures add them in a clearly marked section below.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# Before torch loads OpenMP: sleeping (not spinning) worker threads keep the many test processes
# on a small machine from starving each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# What a scheduler process with speculative decoding sets before its first matmul (scheduler_process.
# reproducible_blas): MKL reads it once per process, and the in-process SchedulerHarness tests of
# speculation run after other tests' matmuls.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_SCRIPT = REPO_ROOT / "scripts" / "make_tiny_models.py"
TINY_SOURCES = (TINY_SCRIPT, REPO_ROOT / "radixlm" / "testing" / "models.py")   # their bytes key the cache
TINY_MODEL_NAMES = ("llama", "qwen2", "qwen3")


# ----------------------------------------------------------------- markers and options
# Servers the tests start log to $TMPDIR/<prefix>-<port>-*.log (radixlm.testing.server); a passing
# session removes the logs it made (radixlm.testing.server.LOG_FILES: only this process's, so a
# session running beside another never deletes a log the other is still reading), a failing one
# keeps them for reading.
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from radixlm.testing.server import LOG_FILES

    if exitstatus == 0:
        for path in LOG_FILES:
            path.unlink(missing_ok=True)


# A whole run (pytest with no paths: the testpaths) on an empty kernel cache compiles every C++ CPU
# extension the tests load, in the background, one per core at a time, from the start (collection
# included); a test that loads one meanwhile waits on its build (kernels/cpu_build.py). The AVX2
# builds are the ones the default suite's AVX2 tests force on an AVX512 CPU.
def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.args_source is not pytest.Config.ArgsSource.TESTPATHS or session.config.option.collectonly:
        return
    from functools import partial

    from radixlm.kernels.cpu_attention import load_cpu_attention
    from radixlm.kernels.cpu_build import planned_builds, start_builds
    from radixlm.kernels.cpu_decoder import load_cpu_decoder
    from radixlm.kernels.cpu_gemm import load_cpu_gemm
    from radixlm.kernels.cpu_moe import load_cpu_moe
    from radixlm.kernels.cpu_ops import load_cpu_ops
    from radixlm.kernels.cpu_quant import load_cpu_quant

    plans = planned_builds([load_cpu_decoder, load_cpu_attention, load_cpu_gemm, load_cpu_ops, load_cpu_quant,
                            load_cpu_moe, partial(load_cpu_ops, "avx2")])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXLM_CPU_KERNEL_ISA", "avx2")      # test_cpu_gemm's AVX2 run (a child process)
        plans += planned_builds([load_cpu_gemm])
    start_builds(plans)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow test: pass --runslow to run it")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    run_slow = config.getoption("--runslow")
    has_cuda = torch.cuda.is_available()
    for item in items:
        # markers, not `item.keywords`: keywords also hold folder names (a checkout under .../cuda/)
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(skip_slow)
        if item.get_closest_marker("cuda") and not has_cuda:
            item.add_marker(skip_cuda)


# ----------------------------------------------------------------- tiny models
def _load_tiny_script():
    spec = importlib.util.spec_from_file_location("make_tiny_models", TINY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_models_dir() -> Path:
    """The cache folder for this version of the build script and of transformers."""
    import transformers

    sources = b"".join(p.read_bytes() for p in TINY_SOURCES)
    digest = hashlib.sha256(sources + transformers.__version__.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"radixlm-tiny-models-{digest}"


def ensure_tiny_models() -> dict[str, str]:
    """Builds the tiny models unless a complete build is cached; returns name -> model folder."""
    target = tiny_models_dir()
    done = target / "DONE"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            building = Path(f"{target}.building-{os.getpid()}")
            shutil.rmtree(building, ignore_errors=True)
            _load_tiny_script().build_all(str(building))
            shutil.rmtree(target, ignore_errors=True)
            building.rename(target)
            done.write_text("ok\n")
    return {name: str(target / name) for name in TINY_MODEL_NAMES}


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, str]:
    # Build the CPU kernels (attention, fused ops, gemm, the one-call decoder) here, once, so a server
    # under test never spends its readiness timeout compiling them (a no-op when cached; None if they
    # cannot build).
    from radixlm.kernels.cpu_attention import load_cpu_attention
    from radixlm.kernels.cpu_decoder import load_cpu_decoder
    from radixlm.kernels.cpu_gemm import load_cpu_gemm
    from radixlm.kernels.cpu_ops import load_cpu_ops

    load_cpu_attention()
    load_cpu_ops()
    load_cpu_gemm()
    load_cpu_decoder()
    return ensure_tiny_models()


@pytest.fixture(scope="session")
def llama_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def qwen2_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def qwen3_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["qwen3"]


@pytest.fixture(scope="session", params=TINY_MODEL_NAMES)
def tiny_model_path(request: pytest.FixtureRequest, tiny_models: dict[str, str]) -> str:
    return tiny_models[request.param]


# ----------------------------------------------------------------- other helpers' fixtures go below
