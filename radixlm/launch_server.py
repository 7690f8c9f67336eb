"""`python -m radixlm.launch_server --model-path PATH [flags]` and the `radixlm-server` command.

Every flag comes from a ServerArgs field (see runtime/server_args.py); `--help` lists them all.
"""

from __future__ import annotations

import argparse
import sys

from radixlm.runtime.server_args import ServerArgs

DESCRIPTION = """\
Start the radixlm HTTP server: SGLang's native API (/generate, /health, /get_server_info, ...),
the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions) and Prometheus /metrics.
The server logs "The server is fired up and ready to roll!" once it can generate."""

EPILOG = """\
examples:
  radixlm-server --model-path ./my-model --port 30000
  python -m radixlm.launch_server --model-path ./my-model --api-key SECRET --chat-template chatml
  curl http://127.0.0.1:30000/generate -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 16}}'"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlm-server", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from radixlm.runtime.entrypoints.server_lifecycle import run_server

    try:
        run_server(ServerArgs.from_cli_args(args))
    except (ValueError, RuntimeError, OSError) as e:   # startup errors: a message, not a traceback
        print(f"radixlm-server: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
