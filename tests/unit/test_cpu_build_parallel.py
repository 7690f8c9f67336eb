"""kernels/cpu_build.planned_builds / start_builds: a first start compiles its C++ extensions in
parallel child processes, and the loaders then load those builds instead of compiling again.

Two tiny extensions (a pybind11 function each, seconds to compile) in a temporary kernel cache."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest

from radixlm.kernels import cpu_build

SOURCE = """#include <pybind11/pybind11.h>
int answer() { return %d; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


@pytest.mark.skipif(cpu_build.pick_isa() is None or cpu_build.kernels_disabled(), reason="no C++ kernels here")
def test_planned_builds_run_in_child_processes_and_the_loaders_load_them(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("RADIXLM_KERNEL_CACHE", str(tmp_path / "cache"))   # the children inherit it
    loaders = []
    for value in (1, 2):
        source = tmp_path / f"tiny{value}.cpp"
        source.write_text(SOURCE % value)
        kind = f"test_tiny{value}"
        loaders.append(functools.cache(functools.partial(cpu_build.load_extension, kind, "a test kernel", None,
                                                         [source], [])))
    plans = cpu_build.planned_builds(loaders)   # a cached loader: its uncached body runs, dry
    assert [p["kind"] for p in plans] == ["test_tiny1", "test_tiny2"]
    assert not list((tmp_path / "cache").glob("*/*.so")), "the dry run compiled something"
    assert cpu_build.start_builds([]) is None

    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        thread = cpu_build.start_builds(plans, jobs=2)
        thread.join(timeout=600)
        assert not thread.is_alive()
        assert "Compiling 2 C++ CPU extensions" in caplog.text and "compiled in" in caplog.text
        assert cpu_build.planned_builds(loaders) == []
        caplog.clear()
        assert [loader().answer() for loader in loaders] == [1, 2]
    assert "Compiling" not in caplog.text, "a loader compiled what the children had built"
