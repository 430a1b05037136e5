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

from minisgl.server_args import SGLANG_OPTIONS_ALREADY_SO, SGLANG_OPTIONS_REFUSED, ServerArgs


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="minisgl", description="A compact, teachable LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.")
    ServerArgs.add_cli_args(serve)
    for name, why in SGLANG_OPTIONS_ALREADY_SO.items():
        serve.add_argument("--" + name.replace("_", "-"), action="store_true", dest="sglang_" + name,
                           help=f"SGLang's flag, accepted as is: {why}.")  # fmt: skip
    for name, why in SGLANG_OPTIONS_REFUSED.items():  # (argparse's "unrecognized arguments" would not say why)
        serve.add_argument("--" + name.replace("_", "-"), default=None, dest="sglang_refused_" + name, metavar="VALUE",
                           help=f"SGLang's flag, refused: {why}.")  # fmt: skip

    gen = sub.add_parser("generate", help="Generate one completion in-process and print it.")
    gen.add_argument("--model", "--model-path", dest="model_path", default=None, help="Model directory. Default: the built-in model.")
    gen.add_argument("--prompt", required=True, help="Prompt text (used as is, no chat template).")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate (default 32).")
    gen.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default 0: greedy).")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="cpu, cuda or auto.")
    return parser, {"serve": serve, "generate": gen}


def _generate(args: argparse.Namespace) -> int:
    from minisgl import Engine

    engine = Engine(args.model_path, device=args.device)  # a bad setting raises ValueError here
    try:
        out = engine.generate(args.prompt, {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature})
    finally:
        engine.shutdown()
    print(out["text"], flush=True)
    return 0


def _say_sglang_flags(args: argparse.Namespace) -> None:
    for name, why in SGLANG_OPTIONS_ALREADY_SO.items():
        if getattr(args, "sglang_" + name):
            print(f"--{name.replace('_', '-')}: nothing to change, {why}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, commands = _build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "serve":
        from minisgl.entrypoints.http_server import launch_server
        from minisgl.server_args import resolve_server_args

        for name, why in SGLANG_OPTIONS_REFUSED.items():
            if getattr(args, "sglang_refused_" + name) is not None:
                commands["serve"].error(f"--{name.replace('_', '-')}: {why}")
        try:  # settings that cannot work: argparse's one-line error (exit 2), not a traceback
            server_args = resolve_server_args(ServerArgs.from_cli_args(args))
        except ValueError as e:
            commands["serve"].error(str(e))
        _say_sglang_flags(args)
        launch_server(server_args)  # exits with the server's status
        return 0
    try:
        return _generate(args)
    except ValueError as e:
        commands["generate"].error(str(e))
    except KeyboardInterrupt:  # Ctrl-C: the Engine aborted and shut down; no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
