"""`Runtime`: starts a radixlm server in a child process and talks to it through a RuntimeEndpoint.

    runtime = Runtime(model_path="...", disable_radix_cache=False)   # any ServerArgs field
    sgl.set_default_backend(runtime)
    ...
    runtime.shutdown()          # also runs at interpreter exit

The server runs as `python -m radixlm.launch_server` in its own session (process group), on a
free loopback port, started by radixlm.testing.server (the launcher the tests and benchmarks use);
its log goes to a temp file (`runtime.log_path`). `shutdown()` stops the server and every process
it started (the scheduler/detokenizer children) and waits for them.
"""

from __future__ import annotations

import atexit
import json
from typing import Any

from radixlm.testing.server import ServerProcess, free_port, launch_server_process, server_cli_args

from .runtime_endpoint import RuntimeEndpoint


class Runtime:
    def __init__(self, model_path: str | None = None, log_level: str = "error", launch_timeout: float = 300.0,
                 api_key: str | None = None, **server_args: Any) -> None:
        from ...runtime.server_args import ServerArgs

        host = server_args.pop("host", "127.0.0.1")
        port = server_args.pop("port", None) or free_port(host)
        args = {"model_path": model_path, "log_level": log_level, **server_args}
        ServerArgs.from_kwargs(host=host, port=port, api_key=api_key, **args)  # unknown names fail here
        self.server_args = {**args, "host": host, "port": port, "api_key": api_key}
        self.url = f"http://{host}:{port}"
        self.api_key = api_key
        self.endpoint: RuntimeEndpoint | None = None
        self._server: ServerProcess | None = None
        atexit.register(self.shutdown)
        self._server = launch_server_process(None, *server_cli_args(args), api_key=api_key, host=host, port=port,
                                             timeout=launch_timeout, ready="health", new_session=True,
                                             log_prefix="radixlm-runtime")
        self.log_path = str(self._server.log_path)
        try:
            self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int | None:
        return self._server.proc.pid if self._server is not None else None

    def log_tail(self, lines: int = 60) -> str:
        return self._server.log_tail(lines) if self._server is not None else ""

    # --------------------------------------------------------------- stopping
    def shutdown(self, timeout: float = 20.0) -> None:
        """Stops the server and every process it started; safe to call twice."""
        if self.endpoint is not None:
            self.endpoint.close()
        server, self._server = self.__dict__.get("_server"), None
        if server is not None:
            server.stop(grace=timeout)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if self.__dict__.get("_server") is not None:
            self.shutdown()

    # ------------------------------------------------------- convenience API
    def cache_prefix(self, prefix: str) -> None:
        self._endpoint().cache_prefix(prefix)

    def flush_cache(self) -> None:
        self._endpoint().flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self._endpoint().get_server_info()

    def get_tokenizer(self) -> Any:
        from ...runtime.hf_tokenizer import get_tokenizer

        path = self.server_args.get("tokenizer_path") or self._endpoint().model_info.get("tokenizer_path")
        return get_tokenizer(path or self.server_args["model_path"])

    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | None = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None) -> str:
        """One native /generate call; returns the JSON text of the answer (as SGLang's Runtime does)."""
        body = {"text": prompt, "sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        return json.dumps(self._endpoint().generate_raw({k: v for k, v in body.items() if v is not None}))

    def _endpoint(self) -> RuntimeEndpoint:
        if self.endpoint is None:
            raise RuntimeError("This Runtime has been shut down")
        return self.endpoint

