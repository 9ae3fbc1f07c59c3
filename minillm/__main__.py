"""The command line: `python -m minillm COMMAND` (or `minillm COMMAND`, once installed).
`serve` is Chapter 9's OpenAI-compatible server; `bench` runs the book's benchmarks, the
same as `python -m minillm.bench`. `python -m minillm COMMAND --help` shows a command's
flags."""
from __future__ import annotations

import argparse
import importlib
import sys

from minillm import __version__

COMMANDS = {  # name -> (module, its function of argv that returns the status, help)
    "serve": ("minillm.serve.cli", "main",
              "serve a model behind OpenAI's API, as `vllm serve` (Chapter 9)"),
    "bench": ("minillm.bench.cli", "dispatch",
              "run one of the book's benchmarks: bench NAME (bench --help lists them)"),
}
def parser() -> argparse.ArgumentParser:
    """The top level: only lists the commands; each command parses its own flags."""
    p = argparse.ArgumentParser(
        prog="python -m minillm",
        description="minillm, the inference engine of the book 'Build an LLM inference "
                    "engine from scratch'.",
        epilog="`python -m minillm COMMAND --help` shows a command's flags and their "
               "defaults, e.g. `python -m minillm serve --help`.")
    p.add_argument("--version", action="version", version=f"minillm {__version__}")
    commands = p.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, _, text) in COMMANDS.items():
        commands.add_parser(name, help=text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        module, function, _ = COMMANDS[argv[0]]
        return getattr(importlib.import_module(module), function)(argv[1:])
    p = parser()
    if not argv:  # no command: the usage, and status 2 as argparse's errors
        p.print_help(sys.stderr)
        return 2
    try:
        p.parse_args(argv)  # --help, --version (status 0) or an error (status 2)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    p.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
