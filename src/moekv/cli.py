"""The `moekv` command line: generate | serve | eval | bench.

Each subcommand lives in its own module with `add_arguments(parser)` and `run(args) -> int`;
this file only wires them up (lazily, so `moekv --help` stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moekv.errors import MoekvError

# (command, module, help). Nested commands ("eval kv", "bench serve") use a tuple path.
COMMANDS = [
    (("generate",), "moekv.entrypoints.generate_cli", "generate text from a prompt and print stats"),
    (("serve",), "moekv.entrypoints.openai.cli", "run the OpenAI-compatible HTTP server"),
    (("eval", "kv"), "moekv.eval.kv_fidelity", "KV-cache fidelity: perplexity and KL per cache format"),
    (("eval", "weights"), "moekv.eval.weight_fidelity", "FP8 weight fidelity: perplexity and KL, 16-bit vs FP8"),
    (("bench", "serve"), "moekv.bench.serve", "load-test a running server"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekv", description="moekv: an MoE inference engine with a "
                                     "low-bit paged KV cache")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in COMMANDS:
        if len(path) == 1:
            sub = top.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                group_parser = top.add_parser(path[0], help=f"{path[0]} subcommands")
                groups[path[0]] = group_parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND",
                                                              required=True)
            sub = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        sub.set_defaults(_path=path)
        try:
            importlib.import_module(module).add_arguments(sub)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("moekv"):
                sub.set_defaults(_missing=f"`moekv {' '.join(path)}` is not available in this build")
            else:
                sub.set_defaults(_missing=f"`moekv {' '.join(path)}` needs the optional dependency "
                                          f"{exc.name!r}: pip install 'moekv[serve]'")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = getattr(args, "_missing", None)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except MoekvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
