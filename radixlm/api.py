"""The DSL's public names, re-exported for `import radixlm as sgl` (see frontend_lang/api.py)."""

from __future__ import annotations

from radixlm.frontend_lang.api import (
    OpenAI,
    Runtime,
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    greedy_token_selection,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)
from radixlm.frontend_lang.backend.base import BackendError
from radixlm.frontend_lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "separate_reasoning",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end",
    "set_default_backend", "flush_cache", "get_server_info",
    "RuntimeEndpoint", "Runtime", "OpenAI", "BackendError", "ProgramState", "ProgramStateGroup",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
]
