"""The checkout's own import graph resolves without an install.

`runtime/`, `kernels/` and `frontend_lang/` become `radixlm.runtime`, `radixlm.kernels` and
`radixlm.frontend_lang` only through setup.py's package_dir, so inside those folders every import of a
sibling module must be relative (an editor or a static tool reading the tree then finds the file).
This test walks every module's AST: no absolute `radixlm.runtime|kernels|frontend_lang` import, and
every relative import names a module or package that exists in the tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("runtime", "kernels", "frontend_lang")
MAPPED = tuple(f"radixlm.{f}" for f in FOLDERS)


def _modules():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _exists(base: Path, dotted: str) -> bool:
    target = base.joinpath(*dotted.split(".")) if dotted else base
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def test_no_absolute_imports_of_mapped_packages():
    bad = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                    if n == "radixlm.runtime" or n.startswith(MAPPED)]
    assert not bad, "use relative imports inside the mapped folders:\n" + "\n".join(bad)


def test_relative_imports_resolve_in_the_tree():
    missing = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level > 0):
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            module = node.module or ""
            if _exists(base, module):
                if not node.module:  # `from . import x`: each x is a module or a name in __init__
                    for alias in node.names:
                        if not _exists(base, alias.name) and not (base / "__init__.py").is_file():
                            missing.append(f"{path.relative_to(ROOT)}:{node.lineno} .{alias.name}")
                continue
            missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {'.' * node.level}{module}")
    assert not missing, "relative imports that do not resolve in the checkout:\n" + "\n".join(missing)
