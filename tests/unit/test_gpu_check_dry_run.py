"""`scripts/gpu_check.sh --dry-run` passes on CPU without the wheels (as in CI), and its checker
fails when the wheel list misses a dependency."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_passes_without_wheels(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DRY RUN PASS" in out.stdout and "[FAIL]" not in out.stdout
    assert "phases well-formed" in out.stdout and "[SKIP] wheel files" in out.stdout


def test_dry_run_checker_catches_a_missing_wheel(capsys) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check_wheels", REPO / "scripts" / "gpu_check_wheels.py")
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    listed = checker.wheel_list()
    assert listed["flashinfer-python"] == "0.6.13" and "pyzmq" in listed
    results: list[bool] = []
    checker.check_project(results, {k: v for k, v in listed.items() if k != "pyzmq"})
    assert results == [False, True] and "missing: ['pyzmq']" in capsys.readouterr().out
    assert checker.applies_on_gpu_machine('cffi; implementation_name == "pypy"') is False
    assert checker.applies_on_gpu_machine("requests") is True
