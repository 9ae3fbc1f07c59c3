"""Chapter 3's benchmark: naive loop vs KV cache vs transformers (total time, time to
first token, ms per token, KV memory, and the same ids). Chapter 3 runs
`run_kv_benchmark`; `python -m minillm.bench kv --help` runs it as a command."""
from __future__ import annotations

import argparse
import statistics
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .cli import BENCHMARKS, add_run_arguments, check_run_arguments, command
from .folders import MODELS, model_folder, model_label
from .measure import (Measurement, check_counts, check_fits, hardware_name, in_turns,
                      measure, memory_kind, minillm_methods, random_prompt,
                      transformers_method)
from .results import Result
from ..model.config import ModelConfig
from ..model.loader import load_model
from ..utils import pick_device

__all__ = ["run_kv_benchmark", "summarise", "format_table", "write_csv",
           "kv_parser", "check_kv_args", "run_kv_command", "main"]


def run_kv_benchmark(model_path, new_tokens: int = 100, prompt_tokens: int = 256,
                     repeats: int = 3, device: str | torch.device | None = None,
                     dtype: torch.dtype | None = None,
                     methods: tuple[str, ...] = ("naive", "cache", "transformers"),
                     progress: bool = True) -> Result:
    """The source article's table on this machine: naive vs KV cache vs transformers.

    Greedy, exactly `new_tokens` tokens, from a random prompt of `prompt_tokens` tokens.
    One warm-up run per method, then `repeats` runs with the methods interleaved (a busy
    machine slows all of them alike); medians are reported.
    """
    check_counts(new_tokens, prompt_tokens, repeats)
    allowed = ("naive", "cache", "transformers")
    if not methods or isinstance(methods, str) or set(methods) - set(allowed):
        raise ValueError(f"methods={methods!r}: a tuple of {allowed}")
    config = ModelConfig.from_hf(model_path)  # a bad folder fails here, before loading
    check_fits(config, new_tokens, prompt_tokens)
    device = pick_device(None if device is None else torch.device(device).type)
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    model = load_model(model_path, dtype=dtype, device=device)
    prompt = random_prompt(config.vocab_size, prompt_tokens)
    ours = dict(zip(("naive", "cache"), minillm_methods(model)))
    runs = [ours[m] for m in allowed[:2] if m in methods]
    if "transformers" in methods:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        hf = hf.to(device).eval()
        runs.append(transformers_method(hf))
    with tqdm(total=repeats * len(runs), desc=f"kv benchmark x{len(runs)} methods",
              disable=not progress) as bar:
        results = in_turns(
            {m.name: partial(measure, m, prompt, new_tokens, device) for m in runs},
            repeats, after=lambda *_: bar.update(1),
            warm_up={m.name: partial(measure, m, prompt, min(new_tokens, 4), device)
                     for m in runs})
    return summarise(results, model, model_path, device, dtype, len(prompt), new_tokens,
                     repeats)


def summarise(results: dict[str, list[Measurement]], model, model_path, device, dtype,
              prompt_tokens: int, new_tokens: int, repeats: int) -> Result:
    """Medians per method, and the facts a result file needs to explain itself."""
    baseline = next(iter(results.values()))[0].tokens
    c = model.config
    params = {id(p): p.numel() for p in model.parameters()}  # tied weights once
    info = {"model": Path(model_path).name, "device": device.type,
            "hardware": hardware_name(device), "torch": torch.__version__,
            "dtype": str(dtype).replace("torch.", ""),
            "layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
            "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab": c.vocab_size,
            "params_M": round(sum(params.values()) / 1e6, 1),
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "repeats": repeats, "memory_kind": memory_kind(device)}
    rows, steps = [], []
    for name, ms in results.items():
        rows.append({"method": name,
                     "total_s": statistics.median(m.total_s for m in ms),
                     "ttft_s": statistics.median(m.ttft_s for m in ms),
                     "per_token_ms": statistics.median(m.per_token_s for m in ms) * 1e3,
                     "memory_MiB": max(m.memory_bytes for m in ms) / 2**20,
                     "same_tokens": ms[0].tokens == baseline})
        per_token = zip(*(m.step_s for m in ms))  # token by token, over the repeats
        steps += [{"method": name, "token": t + 2, "seconds": statistics.median(times)}
                  for t, times in enumerate(per_token)]
    for r in rows:
        r["speedup_vs_first"] = rows[0]["per_token_ms"] / r["per_token_ms"]
    return Result(rows, info, {"steps": steps}, kind="kv", work=(
        f"{prompt_tokens}-token prompt + {new_tokens} new tokens, median of {repeats}"))


def format_table(result: Result) -> str:
    """The summary as aligned text, the way the source article printed it."""
    head = (f"{'method':<26}{'total s':>9}{'TTFT s':>9}{'ms/token':>10}"
            f"{'memory MiB':>12}{'speed-up':>10}{'same ids':>10}")
    lines = [result.describe(), head]
    for r in result.rows:
        lines.append(f"{r['method']:<26}{r['total_s']:>9.3f}{r['ttft_s']:>9.3f}"
                     f"{r['per_token_ms']:>10.2f}{r['memory_MiB']:>12.1f}"
                     f"{r['speedup_vs_first']:>9.1f}x{str(r['same_tokens']):>10}")
    lines.append(f"memory: {result.info['memory_kind']}; "
                 "speed-up: per-token time against the first row")
    return "\n".join(lines)


def write_csv(result: Result, folder: str | Path) -> list[Path]:
    """<stem>.csv (summary, hardware) and <stem>_steps.csv (each token's time)."""
    return result.write(folder)


def kv_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench kv",
                                     description=BENCHMARKS["kv"])
    parser.add_argument("--model", default="bundled",
                        help=f"{' | '.join(MODELS)} | a model folder")
    parser.add_argument("--new-tokens", type=int, default=100, help="at least 2")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="at least 1")
    parser.add_argument("--repeats", type=int, default=3, help="at least 1")
    add_run_arguments(parser)
    return parser


def check_kv_args(args: argparse.Namespace) -> tuple[Path, torch.device]:
    """Every argument, checked before any work. Returns (model folder, device)."""
    check_counts(args.new_tokens, args.prompt_tokens, args.repeats)
    device = check_run_arguments(args)
    folder = model_folder(args.model)
    check_fits(ModelConfig.from_hf(folder), args.new_tokens, args.prompt_tokens)
    return folder, device


def run_kv_command(args: argparse.Namespace, checked) -> tuple:
    folder, device = checked
    result = run_kv_benchmark(folder, args.new_tokens, args.prompt_tokens,
                              args.repeats, device)
    result.info["model"] = model_label(args.model, folder)
    return format_table(result), lambda out: write_csv(result, out)


main = command(kv_parser, check_kv_args, run_kv_command)
