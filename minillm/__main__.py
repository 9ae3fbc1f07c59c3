"""The command line: `python -m minillm serve MODEL [options]` (or `minillm serve`),
the OpenAI-compatible server of Chapter 9. The benchmarks have their own:
`python -m minillm.bench`."""
from __future__ import annotations

import sys

USAGE = "usage: python -m minillm serve MODEL [--host H] [--port P] ... (serve -h)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"unknown command {argv[0]!r}; {USAGE}", file=sys.stderr)
        return 2
    from minillm.serve.cli import main as serve
    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
