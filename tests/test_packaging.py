"""The distribution: a built wheel installs into a fresh venv and imports as radixlm.* (no top-level
`runtime` or `kernels` packages), with the demo model and the dashboard page inside."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_and_imports_in_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("radixlm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.startswith(("runtime/", "kernels/", "frontend_lang/")) for n in names)
    assert "radixlm/runtime/managers/scheduler.py" in names
    assert "radixlm/runtime/entrypoints/static/dashboard.html" in names
    assert {"radixlm/kernels/cpu_attention/paged_attention.cpp", "radixlm/kernels/cpu_attention/simd.h"} <= set(names)
    venv = tmp_path / "venv"
    # system site-packages provide torch & co.; the wheel itself goes in without dependencies
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300)
    code = ("import radixlm, radixlm.runtime.managers.scheduler, radixlm.kernels.flashinfer_meta, "
            "radixlm.frontend_lang.api; from radixlm.runtime.server_args import default_model_path; "
            "print(radixlm.__file__); print(default_model_path()); print(radixlm.Engine, radixlm.function)")
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    first, model_dir = out.stdout.splitlines()[:2]
    assert str(venv) in first and str(ROOT) not in first
    assert str(venv) in model_dir
