"""The DSL's public names, re-exported for `import radixlm as sgl` (see frontend_lang/api.py)."""

from __future__ import annotations

from radixlm.frontend_lang import api as _dsl
from radixlm.frontend_lang.api import *  # noqa: F403 - the DSL's whole public API, named in its __all__
from radixlm.frontend_lang.backend.base import BackendError
from radixlm.frontend_lang.state import ProgramState, ProgramStateGroup

__all__ = [*_dsl.__all__, "BackendError", "ProgramState", "ProgramStateGroup"]
