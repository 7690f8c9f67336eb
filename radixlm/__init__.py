"""radixlm: a small LLM serving runtime (RadixAttention, continuous batching, structured generation).

Public names are loaded lazily so `import radixlm` stays fast (no torch, no transformers):
`radixlm.Engine` (the offline engine), `radixlm.ServerArgs`, and the DSL names of `radixlm.api`
(`function`, `gen`, `select`, `Runtime`, `RuntimeEndpoint`, ...), so `import radixlm as sgl` works.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": "radixlm.runtime.entrypoints.engine",
    "ServerArgs": "radixlm.runtime.server_args",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("__"):
        api = importlib.import_module("radixlm.api")
        if name not in getattr(api, "__all__", ()):
            raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
        value = getattr(api, name)
    else:
        raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    try:
        api_names = list(importlib.import_module("radixlm.api").__all__)
    except Exception:  # noqa: BLE001 - dir() must not fail
        api_names = []
    return sorted({*globals(), *_LAZY, *api_names})
