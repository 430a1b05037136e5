"""Command line (`minisgl ...`). In: argv. Out: a running server, or a completion on stdout.

    minisgl serve [--model PATH] [--port 30000] [every ServerArgs flag]   -> launch_server
    minisgl generate --model PATH --prompt "..." [--max-new-tokens N] [--temperature T]
                                                                          -> minisgl.Engine

The serve flags are generated from the ServerArgs dataclass (SGLang's names), so
`minisgl serve --help` lists every option the engine has.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from minisgl.server_args import ServerArgs


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minisgl", description="A compact, teachable LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.")
    ServerArgs.add_cli_args(serve)

    gen = sub.add_parser("generate", help="Generate one completion in-process and print it.")
    gen.add_argument("--model", "--model-path", dest="model_path", default=None, help="Model directory. Default: the built-in model.")
    gen.add_argument("--prompt", required=True, help="Prompt text (used as is, no chat template).")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate (default 32).")
    gen.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default 0: greedy).")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="cpu, cuda or auto.")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from minisgl import Engine

    engine = Engine(args.model_path, device=args.device)
    try:
        out = engine.generate(args.prompt, {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature})
    finally:
        engine.shutdown()
    print(out["text"], flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "serve":
        from minisgl.entrypoints.http_server import launch_server

        launch_server(ServerArgs.from_cli_args(args))  # exits with the server's status
        return 0
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
