"""Chapter 6's benchmark: one seeded workload served by slots, the paged cache and the
paged cache with prefix caching, all in the same KV memory (speed, latency, concurrency,
the share of reserved positions that hold a token, preemptions, the same tokens).
Chapter 6 shows its recorded runs; `python -m minillm.bench paged --help` runs it."""
from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

import minillm
from .cli import (BENCHMARKS, add_run_arguments, check_run_arguments,
                               command)
from .folders import MODELS, model_folder, model_label
from .measure import greedy, hardware_name, in_turns, random_prompt
from .results import Result
from .workloads import (Request, add_workload_arguments,
                                     check_workload, is_int, make_workload,
                                     next_batch, percentile, shakespeare_missing)
from ..engine import LLMEngine
from ..kv.blocks import check_block_size
from ..model.config import ModelConfig
from ..model.loader import load_model
from ..utils import pick_device

__all__ = ["PAGED_METHODS", "method_key", "paged_workload", "make_engine", "serve",
           "used_share", "summarise_engine", "check_paged_args",
           "run_paged_benchmark", "paged_info", "format_paged_table",
           "write_paged_csv", "paged_parser", "check_cli_args", "run_paged_command",
           "main"]


PAGED_METHODS = {  # key (for the command line) -> name (in tables and plots)
    "slots": "slots",
    "paged": "paged",
    "paged-prefix": "paged + prefix cache",
}


def method_key(method: str) -> str | None:
    """The key of a method given by key or by name (None: no such method)."""
    names = {name: key for key, name in PAGED_METHODS.items()}
    return method if method in PAGED_METHODS else names.get(method)


def paged_workload(config: ModelConfig, num_requests: int,
                   prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
                   shared_prefix: int, seed: int, model_path=None,
                   rate: float | None = None) -> list[Request]:
    """make_workload's requests, each prompt starting with the same `shared_prefix`
    seeded random tokens (after BOS, if the prompt has one)."""
    requests = make_workload(config, num_requests, prompt_tokens, output_tokens, rate,
                             seed, model_path)
    if shared_prefix:
        prefix = random_prompt(config.vocab_size, shared_prefix, seed)
        for r in requests:
            k = int(model_path is not None and config.bos_token_id is not None
                    and r.prompt_ids[0] == config.bos_token_id)
            r.prompt_ids = r.prompt_ids[:k] + prefix + r.prompt_ids[k:]
    return requests


def make_engine(model, key: str, kv_positions: int, max_model_len: int,
                block_size: int, max_num_seqs: int) -> LLMEngine:
    """The engine of one method, on `kv_positions` positions of KV memory."""
    if key == "slots":
        return LLMEngine(model, None, kv_positions // max_model_len,
                         max_model_len=max_model_len, kv_cache="slots")
    return LLMEngine(model, None, max_num_seqs, max_model_len=max_model_len,
                     kv_cache="paged", num_blocks=kv_positions // block_size,
                     block_size=block_size,
                     enable_prefix_caching=key == "paged-prefix")


def serve(engine: LLMEngine, requests: list[Request], bar=None
          ) -> tuple[float, list]:
    """Add each request when its arrival time has come (offline: all at once), step
    until all finish. Returns (seconds, the finished sequences in request order)."""
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        idle = not engine.has_unfinished()
        if pending and (idle or t0 + pending[0].arrival_s <= time.perf_counter()):
            for r in next_batch(pending, t0, len(pending)):  # waits only when idle
                engine.add_request(r.prompt_ids, greedy(r.output_len), str(r.index),
                                   arrival_time=t0 + r.arrival_s)
        for out in engine.step():
            if out.finished and bar is not None:
                bar.update(1)
    wall = time.perf_counter() - t0
    return wall, [engine.pop(str(r.index)) for r in requests]


def used_share(history) -> float:
    """Time-averaged share of the reserved KV positions that hold a token."""
    held = sum((s.end - s.start) * s.kv_tokens for s in history)
    reserved = sum((s.end - s.start) * s.kv_reserved for s in history)
    return held / reserved if reserved else float("nan")


def summarise_engine(name: str, engine: LLMEngine, wall: float, seqs: list,
                     reference: list | None) -> dict:
    """The row of one engine: speed, latency, concurrency, memory, work, tokens."""
    ttft = [s.ttft for s in seqs]
    e2e = [s.finish_time - s.arrival_time for s in seqs]
    useful = sum(len(s.output_ids) for s in seqs)
    decode = [s.rows for s in engine.history if not s.is_prefill]
    scheduler = engine.scheduler
    blocks = getattr(engine.kv, "blocks", None)
    return {"method": name, "requests": len(seqs), "useful_tokens": useful,
            "wall_s": wall, "output_tok_s": useful / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
            "max_num_seqs": scheduler.max_num_seqs,
            "kv_capacity": engine.kv.usage()[1],
            "max_running": max(decode, default=0),
            "used_share": used_share(engine.history),
            "preemptions": getattr(scheduler, "num_preemptions", 0),
            "recomputed_tokens": getattr(scheduler, "num_recomputed", 0),
            "prefix_hit_blocks": blocks.hits if blocks is not None else 0,
            "same_tokens": (None if reference is None else
                            [s.output_ids for s in seqs] == reference)}


def check_paged_args(model_path, num_requests, kv_positions, max_model_len,
                     block_size, methods, prompt_tokens, output_tokens, shared_prefix,
                     seed, max_num_seqs, rate=None
                     ) -> tuple[ModelConfig, tuple[str, ...]]:
    """Every argument, checked before any work. Returns (model config, method keys)."""
    check_workload(num_requests, rate, seed, prompt_tokens, output_tokens)
    for name, value, low in [("kv_positions", kv_positions, 1),
                             ("max_model_len", max_model_len, 1),
                             ("shared_prefix", shared_prefix, 0)]:
        if not is_int(value, low):
            raise ValueError(f"{name}={value!r}: must be an int >= {low}")
    if max_num_seqs is not None and not is_int(max_num_seqs, 1):
        raise ValueError(f"max_num_seqs={max_num_seqs!r}: must be None (as many as "
                         "num_requests) or an int >= 1")
    check_block_size(block_size)
    names = (methods,) if isinstance(methods, str) else tuple(methods or ())
    keys = tuple(method_key(m) for m in names)
    if not keys or None in keys or len(set(keys)) != len(keys):
        raise ValueError(f"methods={methods!r}: a tuple of different names from "
                         f"{tuple(PAGED_METHODS.values())} (or keys "
                         f"{tuple(PAGED_METHODS)})")
    if kv_positions < max_model_len:
        raise ValueError(f"kv_positions={kv_positions} holds no slot of "
                         f"max_model_len={max_model_len} positions")
    config = ModelConfig.from_hf(model_path)  # a bad folder fails here, before loading
    if max_model_len > config.context_length:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                         f"context of {config.context_length}")
    longest = prompt_tokens[1] + shared_prefix + output_tokens[1]
    if longest > max_model_len:
        raise ValueError(f"prompt_tokens={tuple(prompt_tokens)}, shared_prefix="
                         f"{shared_prefix} and output_tokens={tuple(output_tokens)}: "
                         f"up to {longest} positions do not fit max_model_len="
                         f"{max_model_len}")
    if -(-longest // block_size) > kv_positions // block_size:
        raise ValueError(f"kv_positions={kv_positions}: {kv_positions // block_size} "
                         f"blocks of {block_size} do not hold a request of {longest} "
                         "positions")
    return config, keys


def run_paged_benchmark(model_path, num_requests: int = 48, kv_positions: int = 3072,
                        max_model_len: int = 512, block_size: int = 16,
                        methods: tuple[str, ...] = tuple(PAGED_METHODS.values()),
                        prompt_tokens: tuple[int, int] = (32, 160),
                        output_tokens: tuple[int, int] = (64, 256),
                        shared_prefix: int = 0, seed: int = 0,
                        device: str | torch.device | None = None,
                        max_num_seqs: int | None = None, rate: float | None = None,
                        progress: bool = True) -> Result:
    """Serve one workload with each engine on the same KV memory; see the appendix
    of Chapter 6. methods: names or keys of PAGED_METHODS. max_num_seqs: the paged
    engines' cap on running requests (None: num_requests). rate: None (offline) or
    requests per second (Poisson arrivals)."""
    config, keys = check_paged_args(
        model_path, num_requests, kv_positions, max_model_len, block_size, methods,
        prompt_tokens, output_tokens, shared_prefix, seed, max_num_seqs, rate)
    device = pick_device(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    source = "random" if shakespeare_missing(model_path) else "shakespeare"
    requests = paged_workload(config, num_requests, prompt_tokens, output_tokens,
                              shared_prefix, seed,
                              model_path if source == "shakespeare" else None, rate)
    cap = max_num_seqs or num_requests
    model = load_model(model_path, dtype=dtype, device=device)
    warm = [Request(i, r.prompt_ids, min(r.output_len, 4), 0.0)
            for i, r in enumerate(requests[:2])]
    def run(key: str, work: list[Request], shown: bool = False):
        engine = make_engine(model, key, kv_positions, max_model_len, block_size, cap)
        with tqdm(total=len(work), desc=PAGED_METHODS[key], unit="req",
                  disable=not (progress and shown)) as bar:
            return (engine, *serve(engine, work, bar))

    with torch.inference_mode():  # one round: each engine serves the workload once
        runs = in_turns({k: partial(run, k, requests, True) for k in keys}, 1,
                        warm_up={k: partial(run, k, warm) for k in keys})
    rows, reference = [], None
    for key, [(engine, wall, seqs)] in runs.items():
        rows.append(summarise_engine(PAGED_METHODS[key], engine, wall, seqs, reference))
        if reference is None:
            reference = [s.output_ids for s in seqs]
            rows[0]["same_tokens"] = True
    for r in rows:
        r["speedup_vs_first"] = r["output_tok_s"] / rows[0]["output_tok_s"]
    info = paged_info(model, model_path, device, dtype, requests, source, seed,
                      prompt_tokens, output_tokens, shared_prefix, kv_positions,
                      max_model_len, block_size, PAGED_METHODS[keys[0]], rate)
    prefix = f" + a shared {shared_prefix}-token prefix" if shared_prefix else ""
    work = (f"{info['num_requests']} requests ({info['arrivals']}), prompts "
            f"{info['prompt_tokens']}{prefix}, outputs {info['output_tokens']} tokens "
            f"({info['mean_tokens']:.0f} on average), {kv_positions} KV positions")
    return Result(rows, info, kind="paged", stem_extra=tuple(
        ([f"prefix{shared_prefix}"] if shared_prefix else [])
        + ([f"rate{rate:g}"] if rate is not None else [])),
        names=PAGED_METHODS, score="output_tok_s", lower_is_better=False, work=work)


def paged_info(model, model_path, device, dtype, requests, source, seed,
               prompt_tokens, output_tokens, shared_prefix, kv_positions,
               max_model_len, block_size, reference_method, rate=None) -> dict:
    """The facts a result file needs to explain itself."""
    params = {id(p): p.numel() for p in model.parameters()}  # tied weights once
    tokens = [len(r.prompt_ids) + r.output_len for r in requests]
    return {"model": Path(model_path).name, "device": device.type,
            "hardware": hardware_name(device), "torch": torch.__version__,
            "minillm": minillm.__version__, "python": sys.version.split()[0],
            "dtype": str(dtype).replace("torch.", ""),
            "params_M": round(sum(params.values()) / 1e6, 1),
            "num_requests": len(requests), "seed": seed, "rate": rate,
            "arrivals": "offline" if rate is None else f"Poisson {rate:g} req/s",
            "prompts": source,
            "prompt_tokens": f"{prompt_tokens[0]}-{prompt_tokens[1]}",
            "output_tokens": f"{output_tokens[0]}-{output_tokens[1]}",
            "shared_prefix": shared_prefix,
            "drawn_output_tokens": sum(r.output_len for r in requests),
            "mean_tokens": sum(tokens) / len(tokens),
            "kv_positions": kv_positions, "max_model_len": max_model_len,
            "block_size": block_size, "same_tokens_reference": reference_method}


def format_paged_table(result: Result) -> str:
    """The rows as aligned text: speed, latency, concurrency, memory."""
    head = (f"{'method':<22}{'tok/s':>8}{'TTFT p50/p99 s':>16}{'e2e p50 s':>10}"
            f"{'running':>8}{'used':>7}{'preempt':>8}{'hits':>6}{'speed-up':>9}"
            f"{'same':>6}")
    lines = [result.describe(), head]
    for r in result.rows:
        same = {None: "-", True: "yes", False: "NO"}[r["same_tokens"]]
        lines.append(
            f"{r['method']:<22}{r['output_tok_s']:>8.1f}"
            f"{r['ttft_p50_s']:>8.2f}/{r['ttft_p99_s']:<7.2f}{r['e2e_p50_s']:>10.2f}"
            f"{r['max_running']:>8}{r['used_share']:>7.0%}{r['preemptions']:>8}"
            f"{r['prefix_hit_blocks']:>6}{r['speedup_vs_first']:>8.2f}x{same:>6}")
    lines.append("running: most requests in one decode step; used: time-averaged "
                 "share of the reserved KV positions that hold a token; hits: "
                 "prefix-cache blocks; same: tokens equal "
                 f"{result.info['same_tokens_reference']}'s")
    return "\n".join(lines)


def write_paged_csv(result: Result, folder: str | Path) -> list[Path]:
    """<folder>/paged_<model>_<device>[_prefix<N>][_rate<R>].csv: one row per
    engine, with `info`."""
    return result.write(folder)


def paged_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minillm.bench paged",
        description=BENCHMARKS["paged"])
    parser.add_argument("--model", default="bundled",
                        help=f"{' | '.join(MODELS)} | a model folder")
    add_workload_arguments(parser, 48, (32, 160), (64, 256))
    parser.add_argument("--kv-positions", type=int, default=3072,
                        help="the KV memory of every engine, in positions")
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="the longest request (a slot's size)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per block: a power of two")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the paged engines' cap on running requests "
                             "(default: --requests)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of a prompt start shared by every request")
    parser.add_argument("--methods", nargs="+", choices=list(PAGED_METHODS),
                        default=list(PAGED_METHODS), help="default: all")
    add_run_arguments(parser)
    return parser


def check_cli_args(args: argparse.Namespace) -> tuple[Path, torch.device]:
    """Every argument, checked before any work. Returns (model folder, device)."""
    device = check_run_arguments(args)
    folder = model_folder(args.model)
    check_paged_args(folder, args.requests, args.kv_positions, args.max_model_len,
                     args.block_size, tuple(args.methods), tuple(args.prompt_tokens),
                     tuple(args.output_tokens), args.shared_prefix, args.seed,
                     args.max_num_seqs, args.rate)
    return folder, device


def run_paged_command(args: argparse.Namespace, checked) -> tuple:
    folder, device = checked
    result = run_paged_benchmark(
        folder, args.requests, args.kv_positions, args.max_model_len,
        args.block_size, tuple(args.methods), tuple(args.prompt_tokens),
        tuple(args.output_tokens), args.shared_prefix, args.seed, device,
        args.max_num_seqs, args.rate)
    result.info["model"] = model_label(args.model, folder)
    return format_paged_table(result), lambda out: write_paged_csv(result, out)


main = command(paged_parser, check_cli_args, run_paged_command)
