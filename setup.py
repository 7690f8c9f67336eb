"""Maps the repository folders onto the `radixlm` import namespace.

runtime/ -> radixlm.runtime, frontend_lang/ -> radixlm.frontend_lang, kernels/ -> radixlm.kernels.
Metadata lives in pyproject.toml; this file only computes the package list.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = {"radixlm": "radixlm", "radixlm.runtime": "runtime",
           "radixlm.frontend_lang": "frontend_lang", "radixlm.kernels": "kernels"}

packages, package_dir = [], {}
for pkg, folder in FOLDERS.items():
    package_dir[pkg] = folder
    for init in sorted((ROOT / folder).rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT / folder)
        packages.append(".".join([pkg, *rel.parts]) if rel.parts else pkg)

setup(packages=packages, package_dir=package_dir,
      package_data={"radixlm": ["demo_model/*"], "radixlm.runtime": ["entrypoints/static/*"],
                    "radixlm.kernels.cpu_attention": ["*.cpp", "*.h"], "radixlm.kernels.cpu_ops": ["*.cpp", "*.h"],
                    "radixlm.kernels.cpu_gemm": ["*.cpp", "*.h"], "radixlm.kernels.cpu_decoder": ["*.cpp"]},
      include_package_data=True)
