"""The command line that every benchmark shares: `python -m minillm.bench <name>`.

The options every command takes (--device, --threads, --out, --no-csv) and their checks,
`command` (the main() of every benchmark) and `dispatch`, which runs
minillm.bench.<name>.main. Written with chapter 3's benchmark; chapters 3 to 7 use
it."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from ..utils import pick_device

__all__ = ["DEFAULT_OUT", "writable_folder", "add_run_arguments",
           "check_run_arguments", "usage_errors", "torch_threads", "report", "command",
           "BENCHMARKS", "dispatch"]


DEFAULT_OUT = "bench-results"


def writable_folder(folder: str | Path) -> Path:
    """Create `folder` if needed and check that a file can be written there."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out={str(folder)!r} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"--out={str(folder)!r}: cannot write there "
                         f"({e.strerror or e})") from None
    return folder


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--device, --threads, --out and --no-csv: what every benchmark command takes."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda if available")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads, 1 to {os.cpu_count() or 1} "
                             "(default: torch's choice)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for the CSV files (default: ./{DEFAULT_OUT})")
    parser.add_argument("--no-csv", action="store_true", help="print the table only")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model and --dtype: the commands that serve a real model (chapters 10, 11)."""
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="bundled, smollm2-135m-instruct, or a name LLM() takes")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32",
                        "bfloat16", "float16"], help="auto: bfloat16 on a GPU; on a CPU "
                        "chapter 7's rule (the checkpoint's dtype, the CPU's features)")


def check_model_arguments(args: argparse.Namespace,
                          device: torch.device) -> torch.dtype:
    """--model (an unknown name: the error names the allowed ones) and --dtype, checked
    before any work. Returns the dtype."""
    from .folders import model_folder
    folder = model_folder(args.model)
    if args.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        from ..model.config import ModelConfig
        from ..model.loader import resolve_dtype  # chapter 7's rule on a CPU
        return resolve_dtype(ModelConfig.from_hf(folder), "auto", device)
    return getattr(torch, args.dtype)


def check_run_arguments(args: argparse.Namespace) -> torch.device:
    """--threads, --device and --out, checked before any work. Returns the device."""
    cpus = os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= cpus:
        raise ValueError(f"--threads={args.threads}: allowed 1 to {cpus} "
                         "(the CPUs of this machine)")
    device = pick_device(args.device)  # 'cuda' without a GPU: ValueError
    if not args.no_csv:
        writable_folder(args.out)
    return device


@contextmanager
def usage_errors(parser: argparse.ArgumentParser):
    """A ValueError that the run itself finds (e.g. a KV pool beyond this machine's
    memory) ends the command as a usage error (status 2), not a traceback."""
    try:
        yield
    except ValueError as e:
        parser.error(str(e))


@contextmanager
def torch_threads(threads: int | None):
    """Run the body with `threads` torch CPU threads (None: unchanged), then restore."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def report(table: str, write_files, args: argparse.Namespace) -> int:
    """Print the table; unless --no-csv, write the files. Returns the exit status."""
    print(table)
    if args.no_csv:
        return 0
    try:
        paths = write_files(args.out)
    except OSError as e:
        print(f"error: could not write the CSV files to {args.out}: {e}",
              file=sys.stderr)
        return 1
    for path in paths:
        print("wrote", path)
    return 0


def command(parser: Callable[[], argparse.ArgumentParser],
            check: Callable, run: Callable) -> Callable[[list[str] | None], int]:
    """The main() of every benchmark: parse the arguments, check each one before any
    work (a bad one ends the command as a usage error, status 2), run with --threads
    torch threads, print the table and, unless --no-csv, write the CSV files.
    check(args) -> what run needs; run(args, checked) -> (table, write(folder)).
    With MINILLM_BENCH_DRY_RUN=1 it stops after the checks (tools/gpu_check.sh's
    dry run: a typo costs no GPU minutes)."""
    def main(argv: list[str] | None = None) -> int:
        p = parser()
        args = p.parse_args(argv)
        try:
            checked = check(args)
        except (ValueError, FileNotFoundError) as e:
            p.error(str(e))  # prints the usage and the message, exits with status 2
        if os.environ.get("MINILLM_BENCH_DRY_RUN") == "1":
            print(f"dry run: {p.prog} {' '.join(argv or sys.argv[1:])}: arguments "
                  "checked, nothing run")
            return 0
        with torch_threads(args.threads), usage_errors(p):
            table, write_files = run(args, checked)
        return report(table, write_files, args)
    return main


BENCHMARKS = {"kv": "naive loop vs KV cache vs transformers (chapter 3)",
              "serving": "one workload, every way of serving it (chapter 4)",
              "quant": "bytes, speed and quality of each INT8 mode (chapter 5)",
              "paged": "slots against paged KV memory, same budget (chapter 6)",
              "decode": "decode speed, every way (chapter 7)",
              "article": "the article's task: 7B, INT8, 8 GB, 200 ms (chapter 7)",
              "spec": "speculative decoding: drafts, acceptance, speed (chapter 10)",
              "structured": "structured output: parse rates, mask cost (chapter 11)"}


def dispatch(argv: list[str] | None = None) -> int:
    """`python -m minillm.bench <name> [options]`: runs minillm.bench.<name>.main."""
    argv = sys.argv[1:] if argv is None else list(argv)
    names = "\n".join(f"  {k:<9}{v}" for k, v in BENCHMARKS.items())
    usage = f"usage: python -m minillm.bench {{{','.join(BENCHMARKS)}}} ..."
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{usage}\n\nbenchmarks:\n{names}")
        return 0 if argv else 2
    if argv[0] not in BENCHMARKS:
        print(f"{usage}\nerror: {argv[0]!r} is not a benchmark; allowed: "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"minillm.bench.{argv[0]}").main(argv[1:])
