"""The distribution: a built wheel installs into a fresh venv and imports as radixlm.* (no top-level
`runtime` or `kernels` packages), with the demo model and the dashboard page inside.

The dependencies (torch & co.) come from the *running* interpreter's environment: a `.pth` file in
the new venv lists this interpreter's site-packages folders. (`venv --system-site-packages` made from
`sys.executable` would see the *base* interpreter's folders instead, which need not hold torch when
pytest runs inside a venv.) Folders listed by a `.pth` line are added without running their own
`.pth` files, so an editable install of radixlm in the running environment stays invisible."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_and_imports_in_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    # isolated build: pip fetches the build backend pyproject.toml names, whatever this env has
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("radixlm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.startswith(("runtime/", "kernels/", "frontend_lang/")) for n in names)
    assert "radixlm/runtime/managers/scheduler.py" in names
    assert "radixlm/runtime/entrypoints/static/dashboard.html" in names
    assert {"radixlm/kernels/cpu_attention/paged_attention.cpp", "radixlm/kernels/cpu_attention/simd.h",
            "radixlm/kernels/cpu_ops/fused_ops.cpp", "radixlm/kernels/cpu_ops/fused_ops.h",
            "radixlm/kernels/cpu_gemm/gemm.h", "radixlm/kernels/cpu_decoder/decoder.cpp",
            "radixlm/kernels/cpu_build.py"} <= set(names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site_dir = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    (Path(site_dir) / "_running_env.pth").write_text("\n".join(running_site_packages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import radixlm, radixlm.runtime.managers.scheduler, radixlm.kernels.flashinfer_meta, "
            "radixlm.frontend_lang.api; from radixlm.runtime.server_args import default_model_path; "
            "print(radixlm.__file__); print(default_model_path()); print(radixlm.Engine, radixlm.function)")
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    first, model_dir = out.stdout.splitlines()[:2]
    assert str(venv) in first and str(ROOT) not in first
    assert str(venv) in model_dir


def running_site_packages() -> list[str]:
    """The site-packages folders of the interpreter running the tests (venv and base alike)."""
    return [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
