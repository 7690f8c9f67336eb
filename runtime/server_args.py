"""ServerArgs: every knob of the runtime in one frozen dataclass.

The argparse parser is built from the fields (name -> `--name-with-dashes`, the `help` metadata
becomes the help text), so a flag and its field can never drift apart. Derived values are
properties or are resolved once in `resolved()`; nothing else mutates the args.

Fields backed by an environment variable (runtime/env.py, e.g. --disable-cpu-gemm and
RADIXLM_DISABLE_CPU_GEMM) take the variable's value as their default when the args are built; the
flag's help names the variable. The launcher hands the final values to the child processes' kernels
through the environment (`env.child_environ`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from . import env
from .parsers.reasoning import REASONING_PARSERS
from .parsers.tool_call import TOOL_CALL_PARSERS

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random", "priority")
ATTENTION_BACKENDS = ("torch_native", "flashinfer")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
GRAMMAR_BACKEND_NAMES = ("outlines", "xgrammar", "llguidance", "none")
# (chunked_prefill_size, max_prefill_tokens, prefill_step_tokens) when not given: SGLang's on CUDA; on
# CPU the size of vLLM's CPU server step (max_num_batched_tokens 2048), about 1.2 s of prefill for
# SmolLM2 on 2 cores, which a burst's requests share a few at a time (steps of ~0.3 s, prefill_pace.py)
PREFILL_DEFAULTS = {"cuda": (8192, 16384, 0), "cpu": (2048, 2048, -1)}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32", "fp8_e5m2", "fp8_e4m3")


def _f(default: Any, help: str, choices: tuple | None = None, **kw) -> Any:
    meta = {"help": help}
    if choices:
        meta["choices"] = choices
    if "default_factory" in kw:
        return field(default_factory=kw["default_factory"], metadata=meta)
    return field(default=default, metadata=meta)


def _env(name: str) -> Any:
    """A field whose default, help and choices come from its entry in runtime/env.py."""
    var = env.BY_FIELD[name]
    meta: dict[str, Any] = {"help": var.help, "env": var.name}
    if var.choices:
        meta["choices"] = var.choices
    return field(default_factory=var.get, metadata=meta)


@dataclass(frozen=True)
class ServerArgs:
    # --- model and tokenizer
    model_path: str | None = _f(None, "Local folder, hub id, .gguf file or smollm2-135m-instruct. "
                                      "Default: the bundled demo model.")
    load_format: str = _f("auto", "Checkpoint format (auto: .gguf files are GGUF, folders safetensors).",
                          ("auto", "safetensors", "gguf"))
    disable_gguf_quant: bool = _env("disable_gguf_quant")
    tokenizer_path: str | None = _f(None, "Tokenizer folder or hub id (default: --model-path).")
    served_model_name: str | None = _f(None, "Model name shown by the OpenAI API (default: --model-path).")
    chat_template: str | None = _f(None, "Chat template: a .jinja file, or a name (chatml, llama-3, qwen, default).")
    dtype: str = _f("auto", "Weight and activation dtype.", ("auto", "bfloat16", "float16", "float32"))
    device: str = _f("auto", "Device to run on (auto picks cuda when available).", ("auto", "cpu", "cuda"))
    context_length: int | None = _f(None, "Max tokens per request (prompt + output). Default: the model's.")
    trust_remote_code: bool = _f(False, "Accepted for compatibility; custom model code is never run.")
    json_model_override_args: str = _f("{}", "A JSON object of config.json fields to override, e.g. "
                                       "'{\"num_hidden_layers\": 4}' (layers past it are not loaded).")
    # --- memory
    mem_fraction_static: float = _f(0.8, "Fraction of free memory (GPU, or RAM on CPU) for weights + KV.")
    max_total_tokens: int | None = _f(None, "KV pool size in tokens (overrides --mem-fraction-static).")
    max_running_requests: int | None = _f(None, "Max requests decoding at once (default: derived from KV).")
    page_size: int = _f(1, "Tokens per KV page.")
    # --- scheduling
    chunked_prefill_size: int | None = _f(None, "Max prompt tokens prefilled for one request per step "
                                          "(-1: off; default: 8192 on CUDA, 2048 on CPU).")
    max_prefill_tokens: int | None = _f(None, "Max tokens in one step's batch: new prompt tokens plus the running "
                                        "requests' decode tokens, with at least a quarter left to prompts "
                                        "(default: 16384 on CUDA, 2048 on CPU, where a 16k-token step takes "
                                        "seconds and holds back every first token and every decode token "
                                        "until it ends).")
    prefill_step_tokens: int | None = _f(None, "Once one step's new prompt tokens reach this, it admits no further "
                                         "waiting request (whole requests: none is cut to fill the step); each "
                                         "request then gets its first token when its own prompt is done, not when "
                                         "a full --max-prefill-tokens step ends. -1: auto, the tokens of about 0.3 s "
                                         "of this server's measured prefill (512 until measured; 512 with TP > 1); "
                                         "0: off, fill every step (default: -1 on CPU, 0 on CUDA).")
    schedule_policy: str = _f("fcfs", "Order of the waiting queue.", SCHEDULE_POLICIES)
    schedule_conservativeness: float = _f(1.0, "Scales the reserved decode-growth estimate (higher is safer).")
    disable_radix_cache: bool = _f(False, "Turn off prefix caching (ChunkCache).")
    kv_events_config: str | None = _f(None, "Publish KV-cache events for KV-aware routers: a JSON object as "
                                      "vLLM's/SGLang's, e.g. '{\"publisher\": \"zmq\", \"endpoint\": "
                                      "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": "
                                      "\"kv-events\"}' (README, KV-cache events).")
    max_queued_requests: int | None = _f(None, "Reject new requests with 503 when this many are waiting.")
    request_timeout: float | None = _f(None, "Abort requests that run longer than this many seconds.")
    max_request_bytes: int = _f(8 * 1024 * 1024, "Refuse HTTP bodies larger than this with 413.")
    max_top_logprobs: int = _f(20, "Largest top_logprobs_num a request may ask for (400 above).")
    max_response_bytes: int = _f(64 * 1024 * 1024, "Abort a request whose output would grow past this "
                                 "many bytes (estimated: text + logprob entries).")
    max_stream_buffer_bytes: int = _f(4 * 1024 * 1024, "Abort a stream once this much output waits "
                                      "unread by its client (estimated bytes).")
    http_header_timeout: float = _f(10.0, "Close connections whose request headers are not complete "
                                    "within this many seconds (slowloris guard).")
    http_body_timeout: float = _f(60.0, "Close connections whose request body is not complete within "
                                  "this many seconds after its headers.")
    http_send_timeout: float = _f(60.0, "Close connections that read none of the response for this many "
                                  "seconds (their request is aborted).")
    max_connections: int = _f(1024, "Open HTTP connections at most; more are closed at once.")
    # --- kernels and features
    attention_backend: str | None = _f(None, "Attention kernels (default: flashinfer on CUDA, else torch_native).",
                                       ATTENTION_BACKENDS)
    enable_torch_compile: bool = _f(False, "Compile the decode forward with torch.compile (inductor), once per "
                                    "batch-size class; the first decode pays the compile time (logged). "
                                    "Turns packed weights and the one-call CPU decoder off (inductor packs "
                                    "the weights of the graphs it compiles; the startup log says so).")
    disable_packed_weights: bool = _env("disable_packed_weights")
    disable_cpu_decoder: bool = _env("disable_cpu_decoder")
    disable_cpu_gemm: bool = _env("disable_cpu_gemm")
    cpu_linear_kernel: str = _env("cpu_linear_kernel")
    cpu_quant_kernel: str = _env("cpu_quant_kernel")
    cpu_extend_kernel: str = _env("cpu_extend_kernel")
    cpu_decode_split: str = _env("cpu_decode_split")
    disable_fused_ops: bool = _env("disable_fused_ops")
    disable_cpu_kernels: bool = _env("disable_cpu_kernels")
    cpu_kernel_isa: str | None = _env("cpu_kernel_isa")
    require_kernels: bool = _env("require_kernels")
    num_threads: int | None = _env("num_threads")
    disable_cpu_preload: bool = _env("disable_cpu_preload")
    cpu_fixed_threads: bool = _env("cpu_fixed_threads")
    disable_cuda_graph: bool = _f(False, "On CUDA, run decode steps eagerly instead of replaying captured "
                                  "CUDA graphs (one per batch-size bucket: 1, 2, 4, 8, 16, 24, ...).")
    cuda_graph_max_bs: int | None = _f(None, "Largest decode batch replayed from a CUDA graph; larger batches "
                                       "run eagerly (default: --max-running-requests, at most 256).")
    disable_jump_forward: bool = _f(False, "Decode forced grammar text token by token instead of jumping.")
    grammar_compile_timeout: float = _f(30.0, "Seconds allowed to compile one regex / JSON schema.")
    constrained_json_whitespace_pattern: str | None = _f(None, "Regex for whitespace allowed inside JSON output.")
    grammar_backend: str = _f("outlines", "Grammar backend for regex / JSON / EBNF constraints.",
                              GRAMMAR_BACKEND_NAMES)
    max_constraint_bytes: int = _f(64 * 1024, "Refuse regex / JSON schema / EBNF constraints larger than this.")
    grammar_compile_memory_mb: int = _f(2048, "Memory limit of one grammar compile (its worker is replaced).")
    sampling_defaults: str = _f("openai", "Defaults for unset sampling params: 'model' reads "
                                "generation_config.json, 'openai' uses the OpenAI defaults.", ("openai", "model"))
    kv_cache_dtype: str = _f("auto", "KV cache dtype: 'auto' or the model dtype (fp8 is not supported).",
                             KV_CACHE_DTYPES)
    enable_cache_report: bool = _f(False, "Always on in radixlm (this flag changes nothing): OpenAI usage always "
                                   "has prompt_tokens_details.cached_tokens, which SGLang adds only with it.")
    tool_call_parser: str | None = _f(None, "Parser for tool calls in chat output (e.g. qwen25, llama3).",
                                      tuple(TOOL_CALL_PARSERS))
    reasoning_parser: str | None = _f(None, "Parser that splits reasoning text from content (e.g. qwen3).",
                                      tuple(REASONING_PARSERS))
    # --- speculative decoding (runtime/speculative)
    speculative_algorithm: str | None = _f(None, "Speculative decoding: NGRAM (or ngram) proposes the next tokens "
                                           "from the request's own prompt and output (prompt lookup, no draft "
                                           "model) and verifies them in one forward pass. Default: off.",
                                           ("ngram", "NGRAM"))
    speculative_num_draft_tokens: int = _f(6, "Most tokens proposed (and verified) per speculating request per step "
                                           "(fewer where the measured cost says they do not pay).")
    speculative_ngram_min_match_window_size: int = _f(1, "Shortest n-gram (ending at the last token) that "
                                                      "must match earlier text to propose.")
    speculative_ngram_max_match_window_size: int = _f(12, "Longest n-gram compared; the longest match wins.")
    speculative_disable_by_batch_size: int = _f(2, "Do not speculate in steps with more decoding requests than "
                                                "this (a verify pass is no longer nearly free; vLLM's name).")
    disable_speculative_adaptive: bool = _f(False, "Verify all --speculative-num-draft-tokens proposals on "
                                            "every match, instead of only as many as the measured step cost and "
                                            "the request's acceptance say pay (for tests of the verify path).")
    # --- parallelism
    tp_size: int = _f(1, "Tensor-parallel ranks (one scheduler process each).")
    dp_size: int = _f(1, "Data-parallel replicas behind the router.")
    load_balance_method: str = _f("cache_aware", "How the DP router picks a replica.", LOAD_BALANCE_METHODS)
    dist_init_addr: str | None = _f(None, "host:port for torch.distributed init: node 0's address, the same on "
                                    "every node (default with one node: a free loopback port).")
    nnodes: int = _f(1, "Nodes the TP group spans; each runs tp_size / nnodes ranks.")
    node_rank: int = _f(0, "This node's rank (0 serves the HTTP API; the others run only their schedulers).")
    # --- server
    host: str = _f("127.0.0.1", "HTTP host.")
    port: int = _f(30000, "HTTP port.")
    api_key: str | None = _f(None, "Require `Authorization: Bearer KEY` on every route but /health and /metrics.")
    log_level: str = _f("info", "Log level.", ("debug", "info", "warning", "error"))
    log_requests: bool = _f(False, "Log every request's method, route and body (debug aid; bodies hold prompts).")
    log_level_http: str | None = _f(None, "Log level of the HTTP server (uvicorn); default: --log-level.",
                                    ("debug", "info", "warning", "error"))
    enable_access_log: bool = _f(False, "Log one uvicorn access line per HTTP request (method, path, status).")
    decode_log_interval: int = _f(40, "Log a decode batch line every this many decode steps (0: never).")
    enable_metrics: bool = _f(False, "Always on in radixlm (this flag changes nothing): the Prometheus /metrics "
                              "exporter is always served, which SGLang starts only with it.")
    random_seed: int = _f(0, "Seed for model init and unseeded sampling.")
    watchdog_interval: float = _f(0.5, "Seconds between child-process liveness checks.")
    debug_check_kv: bool = _f(False, "Assert free + evictable == total KV slots whenever the scheduler idles.")

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Adds one flag per field; a field backed by an environment variable takes its value as
        the default and names it in the help. The variables without a flag go in the epilog."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            default = _field_default(f)
            if "env" in f.metadata:
                help_ += f" Env twin: {f.metadata['env']}."
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=default, help=help_)
                continue
            if default is not None:
                help_ += f" (default: {default})"
            parser.add_argument(flag, type=_arg_type(f.type), default=default, choices=f.metadata.get("choices"),
                                help=help_)
        if parser.epilog is None:
            parser.epilog = "Environment variables without a flag: " + "; ".join(
                f"{v.name}: {v.help.rstrip('.')}" for v in env.without_flags()) + "."

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> ServerArgs:
        return ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})

    @staticmethod
    def from_kwargs(**kwargs: Any) -> ServerArgs:
        """Build from Python keyword arguments (Engine, Runtime); unknown names are an error."""
        names = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown server argument(s): {', '.join(unknown)}")
        return ServerArgs(**kwargs)

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ derived
    def resolved(self) -> ServerArgs:
        """Fill in defaults that depend on the environment (model path, device, backend)."""
        from .models.resolve import resolve_model_source

        source = resolve_model_source(self.model_path or default_model_path(), self.load_format)
        model_path = source.model_path
        served_name = self.served_model_name or (self.model_path if model_path != self.model_path else None)
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = self.attention_backend or ("flashinfer" if device == "cuda" else "torch_native")
        dist_addr = self.dist_init_addr
        if dist_addr is None and self.tp_size > 1 and self.nnodes == 1:     # several nodes must be told
            from .utils import free_port

            dist_addr = f"127.0.0.1:{free_port()}"
        chunk, prefill, step = PREFILL_DEFAULTS["cuda" if device == "cuda" else "cpu"]
        return self.replace(model_path=model_path, tokenizer_path=self.tokenizer_path or source.tokenizer_path
                            or model_path, served_model_name=served_name,
                            device=device, attention_backend=backend, dist_init_addr=dist_addr,
                            chunked_prefill_size=chunk if self.chunked_prefill_size is None
                            else self.chunked_prefill_size,
                            max_prefill_tokens=prefill if self.max_prefill_tokens is None else self.max_prefill_tokens,
                            prefill_step_tokens=step if self.prefill_step_tokens is None else self.prefill_step_tokens)

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError("--tp-size and --dp-size must be >= 1")
        self._validate_nodes()
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError("--max-total-tokens is too small")
        if self.prefill_step_tokens is not None and self.prefill_step_tokens < -1:
            raise ValueError("--prefill-step-tokens must be -1 (auto), 0 (off) or a number of tokens")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if self.max_top_logprobs < 0 or self.max_connections < 1:
            raise ValueError("--max-top-logprobs must be >= 0 and --max-connections >= 1")
        if min(self.http_header_timeout, self.http_body_timeout, self.http_send_timeout) <= 0:
            raise ValueError("--http-header-timeout, --http-body-timeout and --http-send-timeout must be > 0")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs must be >= 1")
        if self.max_constraint_bytes < 1:
            raise ValueError("--max-constraint-bytes must be >= 1")
        self.model_overrides  # noqa: B018 (raises on a bad --json-model-override-args)
        self._validate_kv_cache_dtype()
        if self.kv_events_config is not None:
            from .mem_cache.kv_events import KVEventsConfig

            KVEventsConfig.from_json(self.kv_events_config)
        if self.speculative_algorithm not in (None, "ngram", "NGRAM"):
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} is not supported; use NGRAM")
        if self.speculative_num_draft_tokens < 1 or self.speculative_disable_by_batch_size < 0:
            raise ValueError("--speculative-num-draft-tokens must be >= 1 and "
                             "--speculative-disable-by-batch-size >= 0")
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError("--speculative-ngram-min-match-window-size must be >= 1 and <= "
                             "--speculative-ngram-max-match-window-size")
        if self.grammar_backend == "llguidance":
            raise ValueError("--grammar-backend llguidance is not supported; use outlines (default) or xgrammar")
        if self.attention_backend == "flashinfer" and self.device == "cpu":
            raise ValueError("--attention-backend flashinfer needs a CUDA device; use torch_native on CPU")

    def _validate_nodes(self) -> None:
        """Multi-node tensor parallelism: every node runs tp_size / nnodes TP ranks of one group."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) and --nnodes >= 1 (got {self.node_rank}, "
                             f"{self.nnodes})")
        if self.nnodes == 1:
            return
        if not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT, the same on every node (node 0's "
                             "address, reachable from the others)")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if self.dp_size != 1:
            raise ValueError("--dp-size > 1 with --nnodes > 1 is not supported; put a gateway in front of "
                             "one server per node group instead")

    def _validate_kv_cache_dtype(self) -> None:
        """--kv-cache-dtype may only name the dtype the model runs in (the KV cache always uses it)."""
        if self.kv_cache_dtype == "auto":
            return
        wanted = _DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        model_dtype = self.dtype if self.dtype != "auto" else _config_dtype(self.model_path)
        if wanted != model_dtype:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is not supported: the KV cache uses the "
                             f"model dtype ({model_dtype or 'unknown'}); pass auto or that dtype")

    @property
    def model_overrides(self) -> dict[str, Any]:
        """--json-model-override-args as a dict (ValueError when it is not a JSON object)."""
        import json

        try:
            overrides = json.loads(self.json_model_override_args or "{}")
        except json.JSONDecodeError as err:
            raise ValueError(f"--json-model-override-args is not valid JSON: {err}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--json-model-override-args must be a JSON object, e.g. '{\"num_hidden_layers\": 4}'")
        return overrides

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path or "default"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _config_dtype(model_path: str | None) -> str | None:
    """The dtype named by a local model's config.json (float32 when it names none), or None."""
    import json

    try:
        with open(os.path.join(model_path or default_model_path(), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _field_default(f: dataclasses.Field) -> Any:
    """The field's default now (a default_factory, i.e. an environment variable, is read)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _arg_type(annotation: str) -> Any:
    text = str(annotation)
    if "int" in text and "float" not in text:
        return int
    if "float" in text:
        return float
    return str


def default_model_path() -> str:
    """The demo model shipped inside the package (see scripts/train_demo_model.py)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for cand in (os.path.join(here, "radixlm", "demo_model"), os.path.join(here, "demo_model")):
        if os.path.exists(os.path.join(cand, "config.json")):
            return cand
    import radixlm

    return os.path.join(os.path.dirname(radixlm.__file__), "demo_model")


