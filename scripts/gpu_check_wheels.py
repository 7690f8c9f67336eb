"""The dry run of scripts/gpu_check.sh: is the wheel list complete, and are the phases well-formed?

    python scripts/gpu_check_wheels.py [WHEEL_DIR]      # exit 0 when every check passed

Without the wheel folder (CI) it checks what needs no download: every dependency of radixlm
(pyproject `dependencies` and the `cuda` extra) is on the GPU machine already or in
scripts/gpu_check_wheels.txt, the `cuda` extra pins the listed flashinfer version, and the phase
list of scripts/gpu_check.py is well-formed (unique names, positive deadlines, under 8 minutes in
all). With the folder it also checks each listed wheel is there exactly once, for CPython 3.12 on
manylinux x86_64, that every wheel's own requirements are met the same way, and that the wheels
plus the repository's tracked files stay under 64 MiB. Reads only; prints one line per check.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
WHEEL_LIST = REPO / "scripts" / "gpu_check_wheels.txt"
LIMIT_BYTES = 64 * 2**20
TOTAL_DEADLINE_S = 8 * 60
# What the GPU machine has (shared/MACHINE_FACTS.md) and what comes with those packages.
MACHINE_HAS = {
    "torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub", "numpy", "tqdm",
    "pyyaml", "packaging", "filelock", "jinja2", "markupsafe", "fsspec", "sympy", "networkx", "uvloop",
    "httpx", "httpcore", "anyio", "idna", "certifi", "h11", "sniffio", "prometheus-client", "regex",
    "msgpack", "typing-extensions", "ninja",
}
# flashinfer requirements its attention wrappers never import (other backends, CLI, AOT tools);
# `import flashinfer` and the FA2 JIT path were traced to need only the listed wheels.
UNUSED_FLASHINFER_REQS = {"cuda-tile", "einops", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "tabulate",
                          "cuda-python"}
# radixlm dependencies the GPU check does not exercise (xgrammar: EBNF grammars only, 10+ MB).
NOT_CARRIED = {"xgrammar"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return norm(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def wheel_list() -> dict[str, str | None]:
    """name -> pinned version (or None) from scripts/gpu_check_wheels.txt."""
    out = {}
    for line in WHEEL_LIST.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[norm(name)] = version or None
    return out


def check(results: list[bool], ok: bool, what: str) -> None:
    results.append(ok)
    print(f"[{'PASS' if ok else 'FAIL'}] {what}", flush=True)


def check_project(results: list[bool], listed: dict[str, str | None]) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cuda = project["optional-dependencies"]["cuda"]
    deps = [d for d in project["dependencies"] + cuda if "win32'" not in d or "!=" in d]
    missing = sorted({req_name(d) for d in deps} - MACHINE_HAS - set(listed) - NOT_CARRIED)
    check(results, not missing, f"every radixlm dependency is on the GPU machine or carried (missing: {missing})")
    pin = f"flashinfer-python=={listed.get('flashinfer-python')}"
    check(results, pin in cuda, f"pyproject's cuda extra pins {pin} (has {cuda})")


def check_phases(results: list[bool]) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_phases import PHASES

    names = [p.name for p in PHASES]
    ok = (len(set(names)) == len(names) and all(p.deadline_s > 0 and callable(p.run) for p in PHASES)
          and all(re.fullmatch(r"[a-z0-9_]+", n) for n in names))
    check(results, ok, f"phases well-formed: {', '.join(names)}")
    total = sum(p.deadline_s for p in PHASES)
    check(results, total <= TOTAL_DEADLINE_S - 60, f"phase deadlines sum to {total} s (<= 7 min, 1 min left to install)")


GPU_MACHINE_ENV = {"python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                   "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def applies_on_gpu_machine(req: str) -> bool:
    """Whether a Requires-Dist line's environment marker holds on the GPU machine (CPython 3.12, Linux)."""
    from packaging.requirements import Requirement

    marker = Requirement(req).marker
    return marker is None or marker.evaluate(GPU_MACHINE_ENV)


def wheel_ok_for_gpu_machine(filename: str) -> bool:
    _, _, rest = filename[:-4].partition("-")
    tags = rest.split("-")[-3:]
    py, abi, plat = tags
    py_ok = any(t in ("py3", "cp312") or t.startswith("cp3") and abi == "abi3" for t in py.split("."))
    plat_ok = plat == "any" or ("x86_64" in plat and ("manylinux" in plat))
    return py_ok and plat_ok


def check_wheels(results: list[bool], listed: dict[str, str | None], folder: Path) -> None:
    files = sorted(folder.glob("*.whl"))
    by_name: dict[str, list[Path]] = {}
    for f in files:
        by_name.setdefault(norm(f.name.split("-")[0]), []).append(f)
    for name, version in listed.items():
        found = by_name.get(name, [])
        ok = len(found) == 1 and wheel_ok_for_gpu_machine(found[0].name) and (
            version is None or found[0].name.split("-")[1] == version)
        check(results, ok, f"wheel {name}{'==' + version if version else ''}: {[f.name for f in found]}")
    extra = sorted(set(by_name) - set(listed))
    check(results, not extra, f"no unlisted wheels in {folder.name} ({extra})")
    have = MACHINE_HAS | set(listed)
    for name, found in by_name.items():
        with zipfile.ZipFile(found[0]) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            reqs = [line.split(":", 1)[1] for line in z.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:") and "extra ==" not in line]
        unmet = sorted({req_name(r) for r in reqs if applies_on_gpu_machine(r)} - have - UNUSED_FLASHINFER_REQS)
        check(results, not unmet, f"requirements of {name} met (unmet: {unmet})")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True).stdout.split(b"\0")
    repo_bytes = sum((REPO / p.decode()).stat().st_size for p in tracked if p and (REPO / p.decode()).is_file())
    wheel_bytes = sum(f.stat().st_size for f in files)
    total = repo_bytes + wheel_bytes
    check(results, total <= LIMIT_BYTES, f"wheels {wheel_bytes / 2**20:.1f} MiB + repository {repo_bytes / 2**20:.1f} "
          f"MiB = {total / 2**20:.1f} MiB (limit 64 MiB)")


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else REPO / ".gpu_wheels"
    results: list[bool] = []
    listed = wheel_list()
    check_project(results, listed)
    check_phases(results)
    if folder.is_dir():
        check_wheels(results, listed, folder)
    else:
        print(f"[SKIP] wheel files: {folder} is absent (download command: {WHEEL_LIST.name}, README 'GPU check')")
    print("DRY RUN PASS" if all(results) else "DRY RUN FAIL")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
