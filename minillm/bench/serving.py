"""Chapter 4's serving benchmark: one workload, every way of serving it (`transformers`
one by one and in static batches, our engine one by one, static and continuous), with
throughput, latency and the same tokens checked. Chapter 4 runs
`run_serving_benchmark`; `python -m minillm.bench serving --help` runs it."""
from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

import minillm
from .cli import (BENCHMARKS, add_run_arguments, check_run_arguments,
                               command)
from .folders import MODELS, model_folder, model_label
from .measure import StepClock, fast_copy, greedy, hardware_name, in_turns
from .results import Result
from .workloads import (PROMPT_SOURCES, Request,
                                     add_workload_arguments, check_workload, is_int,
                                     make_workload, next_batch, percentile,
                                     shakespeare_missing, wait_until)
from ..engine import LLMEngine
from ..generate import generate_tokens
from ..kv.contiguous import KVCache
from ..model.config import ModelConfig
from ..model.loader import load_model
from ..utils import pick_device

__all__ = ["METHODS", "DEFAULT_METHODS", "FAST_METHODS", "Served", "MethodRun", "run_transformers",
           "run_one_by_one", "run_engine", "summarise_run",
           "check_serving_args", "run_serving_benchmark", "serving_info",
           "format_serving_table", "write_serving_csv",
           "serving_parser", "check_cli_args", "run_serving_command", "main"]


METHODS = {  # key (for the command line) -> name (in tables and plots)
    "transformers-one-by-one": "transformers one by one",
    "transformers-static": "transformers static batched",
    "minillm-one-by-one": "minillm one by one",
    "minillm-static": "minillm static",
    "minillm-continuous": "minillm continuous",
    "minillm-unchunked": "minillm unchunked",  # continuous, whole prompts only
    # continuous, with chapter 5's fast modes (bfloat16 activations, int8 LM head)
    "minillm-bf16": "minillm continuous, bfloat16",
    "minillm-int8": "minillm continuous, int8 + int8 head, bfloat16",
    "minillm-int4": "minillm continuous, int4 + int8 head, bfloat16",
}
DEFAULT_METHODS = tuple(METHODS)[:5]  # the others: asked for by name
FAST_METHODS = {"minillm-bf16": None, "minillm-int8": "int8", "minillm-int4": "int4"}


@dataclass
class Served:
    """One request as a method served it. Times: seconds from the method's start;
    token_s: when each token was made."""
    index: int
    tokens: list[int]
    token_s: list[float]

    @property
    def first_token_s(self) -> float:
        return self.token_s[0]

    @property
    def finish_s(self) -> float:
        return self.token_s[-1]


@dataclass
class MethodRun:
    """One method over the whole workload."""
    method: str
    served: list[Served]   # in request order
    wall_s: float          # from the start to the end of the last request
    rows: int              # token rows computed while generating (padding included)
    padding_rows: int      # rows of requests that had already finished


def run_transformers(hf, requests: list[Request], batch_size: int, name: str,
                     bar=None) -> MethodRun:
    """generate() on batches of up to `batch_size` (1: one by one), left-padded."""
    import transformers
    device = hf.device
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = -1  # no token has id -1: EOS never stops it (ignore_eos)
    config.do_sample, config.return_dict_in_generate = False, False
    if config.pad_token_id is None:
        config.pad_token_id = 0
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    served, rows, useful = {}, 0, 0
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it warns that -1 is not a token id
    t0 = time.perf_counter()
    try:
        while pending:
            batch = next_batch(pending, t0, batch_size)
            T = max(len(r.prompt_ids) for r in batch)
            ids = torch.full((len(batch), T), config.pad_token_id)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):  # left padding: the prompts end together
                ids[j, T - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[j, T - len(r.prompt_ids):] = 1
            config.max_new_tokens = n = max(r.output_len for r in batch)
            with StepClock(hf, device) as clock:
                out = hf.generate(ids.to(device), attention_mask=mask.to(device),
                                  generation_config=config)
            if len(clock.ends) != n:
                raise RuntimeError(f"{name}: {len(clock.ends)} forward passes for "
                                   f"{n} tokens")
            for j, r in enumerate(batch):  # token k was made by forward pass k
                served[r.index] = Served(r.index, out[j, T:T + r.output_len].tolist(),
                                         [e - t0 for e in clock.ends[:r.output_len]])
            rows += len(batch) * n
            useful += sum(r.output_len for r in batch)
            if bar is not None:
                bar.update(len(batch))
    finally:
        transformers.logging.set_verbosity(verbosity)
    wall = time.perf_counter() - t0
    served = [served[i] for i in sorted(served)]
    return MethodRun(name, served, wall, rows, rows - useful)


def run_one_by_one(model, requests: list[Request], name: str, bar=None) -> MethodRun:
    """Chapter 3's loop with one KV cache, one request after the other."""
    longest = max(len(r.prompt_ids) + r.output_len for r in requests)
    cache = KVCache.from_model(model, longest)
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    served = {}
    t0 = time.perf_counter()
    while pending:
        r = next_batch(pending, t0, 1)[0]
        tokens, times = [], []
        for token in generate_tokens(model, r.prompt_ids, greedy(r.output_len),
                                     cache=cache):
            tokens.append(token)  # an int: the loop has synced with the device
            times.append(time.perf_counter())
        served[r.index] = Served(r.index, tokens, [t - t0 for t in times])
        if bar is not None:
            bar.update(1)
    wall = time.perf_counter() - t0
    n = sum(r.output_len for r in requests)
    return MethodRun(name, [served[i] for i in sorted(served)], wall, n, 0)


def run_engine(model, requests: list[Request], policy: str, max_num_seqs: int,
               max_num_batched_tokens: int, name: str, bar=None,
               enable_chunked_prefill: bool = True) -> MethodRun:
    """This chapter's engine. Between two steps, the requests whose arrival time has
    come are added (with that arrival time); with nothing to do it waits."""
    longest = max(len(r.prompt_ids) + r.output_len for r in requests)
    engine = LLMEngine(model, None, max_num_seqs, max_num_batched_tokens,
                       max_model_len=longest, policy=policy, kv_cache="slots",
                       enable_chunked_prefill=enable_chunked_prefill)
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    finished = []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_s <= now:
            r = pending.popleft()
            engine.add_request(r.prompt_ids, greedy(r.output_len), str(r.index),
                               arrival_time=t0 + r.arrival_s)
        if not engine.has_unfinished():
            wait_until(t0 + pending[0].arrival_s)
            continue
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                if bar is not None:
                    bar.update(1)
    wall = time.perf_counter() - t0
    served = []
    for rid in sorted(finished, key=int):
        seq = engine.pop(rid)
        served.append(Served(int(rid), seq.output_ids,
                             [t - t0 for t in seq.token_times]))
    rows = sum(step.rows for step in engine.history)
    padding = sum(step.tokens - step.useful_tokens for step in engine.history)
    return MethodRun(name, served, wall, rows, padding)  # a prompt's chunk: no padding


def summarise_run(run: MethodRun, requests: list[Request], reference: dict | None
                  ) -> tuple[dict, list[dict]]:
    """The summary row and the per-request records of one method."""
    records, all_gaps = [], []
    for r, s in zip(requests, run.served):
        n = len(s.tokens)
        tpot = (s.finish_s - s.first_token_s) / (n - 1) * 1e3 if n > 1 else None
        same = None if reference is None else s.tokens == reference[r.index]
        gaps = [1e3 * (b - a) for a, b in zip(s.token_s, s.token_s[1:])]
        all_gaps += gaps  # every gap between two tokens, for the ITL percentiles
        records.append({
            "method": run.method, "request": r.index,
            "prompt_tokens": len(r.prompt_ids), "output_tokens": n,
            "arrival_s": r.arrival_s, "first_token_s": s.first_token_s,
            "finish_s": s.finish_s, "ttft_s": s.first_token_s - r.arrival_s,
            "tpot_ms": tpot, "itl_max_ms": max(gaps) if gaps else None,
            "e2e_s": s.finish_s - r.arrival_s,
            "same_tokens": same})
    useful = sum(len(s.tokens) for s in run.served)
    row = {"method": run.method, "requests": len(records), "useful_tokens": useful,
           "padding_rows": run.padding_rows,
           "padding_share": run.padding_rows / run.rows if run.rows else 0.0,
           "wall_s": run.wall_s, "output_tok_s": useful / run.wall_s,
           "requests_s": len(records) / run.wall_s}
    for column, unit in (("ttft", "s"), ("tpot", "ms"), ("e2e", "s")):
        values = [x[f"{column}_{unit}"] for x in records
                  if x[f"{column}_{unit}"] is not None]
        for q in (50, 99):
            row[f"{column}_p{q}_{unit}"] = percentile(values, q)
    for q in (50, 99):
        row[f"itl_p{q}_ms"] = percentile(all_gaps, q) if all_gaps else None
    row["same_tokens"] = (None if reference is None
                          else all(x["same_tokens"] for x in records))
    return row, records


def check_serving_args(model_path, num_requests, max_num_seqs, rate, methods, seed,
                       prompt_tokens, output_tokens, prompts, max_num_batched_tokens,
                       long_prompts=None) -> tuple[ModelConfig, tuple[str, ...]]:
    """Every argument, checked before any work. Returns (model config, method keys)."""
    check_workload(num_requests, rate, seed, prompt_tokens, output_tokens,
                   long_prompts)
    if not is_int(max_num_seqs, 1):
        raise ValueError(f"max_num_seqs={max_num_seqs!r}: must be an int >= 1")
    budget = max_num_batched_tokens
    if budget is not None and not is_int(budget, 1):
        raise ValueError(f"max_num_batched_tokens={budget!r}: must be None (big "
                         "enough for a whole batch) or an int >= 1")
    keys = (methods,) if isinstance(methods, str) else tuple(methods or ())
    keys = tuple({name: key for key, name in METHODS.items()}.get(m, m) for m in keys)
    if not keys or set(keys) - set(METHODS) or len(set(keys)) != len(keys):
        raise ValueError(f"methods={methods!r}: a tuple of different names from "
                         f"{tuple(METHODS)}")
    if prompts not in PROMPT_SOURCES:
        raise ValueError(f"prompts={prompts!r}; allowed: {PROMPT_SOURCES}")
    config = ModelConfig.from_hf(model_path)  # a bad folder fails here, before loading
    prompt = max(prompt_tokens[1], long_prompts[1] if long_prompts else 0)
    longest = prompt + output_tokens[1]
    if longest > config.context_length:
        raise ValueError(f"prompt_tokens={tuple(prompt_tokens)}, long_prompts="
                         f"{long_prompts} and output_tokens={tuple(output_tokens)}: up "
                         f"to {longest} positions do not fit the model's context of "
                         f"{config.context_length}")
    if budget is not None and budget < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens={budget} is smaller than "
                         f"max_num_seqs={max_num_seqs}: every step gives each running "
                         "request a token")
    missing = shakespeare_missing(model_path)
    if prompts == "shakespeare" and missing:
        raise ValueError(f"prompts='shakespeare', but {missing}; use prompts='random'")
    if (any(k.startswith("transformers") for k in keys)
            and importlib.util.find_spec("transformers") is None):
        raise ValueError(f"methods={keys}: the transformers methods need the "
                         "`transformers` package (pip install transformers)")
    return config, keys


def run_serving_benchmark(model_path, num_requests: int = 64, max_num_seqs: int = 32,
                          rate: float | None = None,
                          methods: tuple[str, ...] = DEFAULT_METHODS, seed: int = 0,
                          device: str | torch.device | None = None,
                          dtype: torch.dtype | None = None,
                          prompt_tokens: tuple[int, int] = (16, 128),
                          output_tokens: tuple[int, int] = (16, 256),
                          prompts: str = "auto",
                          max_num_batched_tokens: int | None = None,
                          progress: bool = True, rounds: int = 1,
                          long_prompts: tuple[float, int] | None = None
                          ) -> Result:
    """Serve one seeded workload with each method; see the appendix of Chapter 4.

    methods: keys or names of METHODS. rate: None (offline) or requests per second.
    prompts: "shakespeare", "random", or "auto" (Shakespeare when possible).
    max_num_batched_tokens: the continuous engine's step budget (longer prompts
    are chunked); None: max_num_seqs x the longest prompt, so that a whole batch
    is admitted in one prefill. Static batching always gets that; "unchunked" at
    least the longest prompt plus a token for each running request, so that a
    whole prompt fits beside them.
    long_prompts: (share, tokens), see make_workload.
    rounds: serve the workload this many times in turns (each round runs every
    method once); each method's row is its run of median wall time.
    """
    config, keys = check_serving_args(model_path, num_requests, max_num_seqs, rate,
                                      methods, seed, prompt_tokens, output_tokens,
                                      prompts, max_num_batched_tokens, long_prompts)
    if not is_int(rounds, 1):
        raise ValueError(f"rounds={rounds!r}: must be an int >= 1")
    device = pick_device(None if device is None else torch.device(device).type)
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    missing = shakespeare_missing(model_path)
    if prompts == "auto" and missing:
        warnings.warn(f"random prompt ids: {missing}", stacklevel=2)
    source = "random" if prompts == "random" or missing else "shakespeare"
    requests = make_workload(config, num_requests, prompt_tokens, output_tokens, rate,
                             seed, model_path if source == "shakespeare" else None,
                             long_prompts)
    longest_prompt = max(len(r.prompt_ids) for r in requests)
    whole_batch = max_num_seqs * longest_prompt
    budget = max_num_batched_tokens or whole_batch
    model = load_model(model_path, dtype=dtype, device=device)
    hf = None
    if any(k.startswith("transformers") for k in keys):
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        hf = hf.to(device).eval()

    fast = {key: fast_copy(model, FAST_METHODS[key]) for key in keys
            if key in FAST_METHODS}  # chapter 5's modes, each its own copy

    def run(key, reqs, bar=None):
        name = METHODS[key]
        with torch.inference_mode():
            if key == "transformers-one-by-one":
                return run_transformers(hf, reqs, 1, name, bar)
            if key == "transformers-static":
                return run_transformers(hf, reqs, max_num_seqs, name, bar)
            if key == "minillm-one-by-one":
                return run_one_by_one(model, reqs, name, bar)
            if key == "minillm-static":
                return run_engine(model, reqs, "static", max_num_seqs, whole_batch,
                                  name, bar)
            if key == "minillm-unchunked":
                return run_engine(model, reqs, "continuous", max_num_seqs,
                                  max(budget, longest_prompt + max_num_seqs), name,
                                  bar,
                                  enable_chunked_prefill=False)
            return run_engine(fast.get(key, model), reqs, "continuous", max_num_seqs,
                              budget, name, bar)

    done = dict.fromkeys(keys, 0)

    def timed(key):
        done[key] += 1
        desc = METHODS[key] + (f" ({done[key]}/{rounds})" if rounds > 1 else "")
        with tqdm(total=num_requests, desc=desc, unit="req",
                  disable=not progress) as bar:
            return run(key, requests, bar)

    warm = [Request(i, r.prompt_ids, min(r.output_len, 4), 0.0)
            for i, r in enumerate(requests[:2])]
    every = in_turns({key: partial(timed, key) for key in keys}, rounds,
                     warm_up={key: partial(run, key, warm) for key in keys})
    runs = [sorted(rs, key=lambda r: r.wall_s)[len(rs) // 2]  # the median run
            for rs in every.values()]
    ours = [r for r in runs if r.method.startswith("minillm")]
    reference = ({s.index: s.tokens for s in ours[0].served} if ours else None)
    rows, records = [], []
    for r, rs in zip(runs, every.values()):
        row, recs = summarise_run(r, requests, reference)
        tok_s = [sum(len(s.tokens) for s in x.served) / x.wall_s for x in rs]
        row.update(rounds=rounds, output_tok_s_min=min(tok_s),
                   output_tok_s_max=max(tok_s))
        if row["same_tokens"] is not None:  # every round: the same tokens
            row["same_tokens"] = row["same_tokens"] and all(
                [s.tokens for s in x.served] == [s.tokens for s in r.served]
                for x in rs)
        rows.append(row)
        records += recs
    for r in rows:
        r["speedup_vs_first"] = r["output_tok_s"] / rows[0]["output_tok_s"]
    info = serving_info(model, model_path, device, dtype, requests, rate, seed,
                        max_num_seqs, budget, source, prompt_tokens, output_tokens,
                        reference_method=ours[0].method if ours else None)
    info.update(rounds=rounds, long_prompts=(None if long_prompts is None
                                             else f"{long_prompts[1]} tokens, "
                                                  f"share {long_prompts[0]:g}"))
    work = (f"{info['num_requests']} requests, {info['arrivals']}, prompts "
            f"{info['prompt_tokens']} tokens, outputs {info['output_tokens']} tokens")
    if info.get("long_prompts"):
        work += f", long prompts: {info['long_prompts']}"
    turns = f", the median of {rounds} rounds in turns" if rounds > 1 else ""
    return Result(rows, info, {"requests": records}, kind="serve", stem_extra=(
        "offline" if rate is None else f"rate{rate:g}",), names=METHODS,
        score="output_tok_s", lower_is_better=False, work=work,
        setup=f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={budget}{turns}")


def serving_info(model, model_path, device, dtype, requests, rate, seed, max_num_seqs,
                 budget, source, prompt_tokens, output_tokens, reference_method
                 ) -> dict:
    """The facts a result file needs to explain itself."""
    c = model.config
    params = {id(p): p.numel() for p in model.parameters()}  # tied weights once
    hf_version = None
    if importlib.util.find_spec("transformers") is not None:
        import transformers
        hf_version = transformers.__version__
    return {"model": Path(model_path).name, "device": device.type,
            "hardware": hardware_name(device), "torch": torch.__version__,
            "transformers": hf_version, "minillm": minillm.__version__,
            "python": sys.version.split()[0],
            "dtype": str(dtype).replace("torch.", ""),
            "params_M": round(sum(params.values()) / 1e6, 1), "layers": c.num_layers,
            "hidden": c.hidden_size, "num_requests": len(requests),
            "arrivals": "offline" if rate is None else f"Poisson {rate:g} req/s",
            "rate": rate, "seed": seed, "prompts": source,
            "prompt_tokens": f"{prompt_tokens[0]}-{prompt_tokens[1]}",
            "output_tokens": f"{output_tokens[0]}-{output_tokens[1]}",
            "drawn_output_tokens": sum(r.output_len for r in requests),
            "last_arrival_s": round(max(r.arrival_s for r in requests), 6),
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
            "same_tokens_reference": reference_method}


def format_serving_table(result: Result) -> str:
    """The summary as aligned text: throughput first, then the latencies."""
    head = (f"{'method':<28}{'tok/s':>8}{'req/s':>7}{'TTFT p50/p99 s':>16}"
            f"{'TPOT p50/p99 ms':>17}{'ITL p50/p99 ms':>17}{'e2e p50/p99 s':>15}"
            f"{'padding':>9}"
            f"{'speed-up':>9}{'same':>6}")
    lines = [result.describe(), head]
    for r in result.rows:
        same = {None: "-", True: "yes", False: "NO"}[r["same_tokens"]]
        lines.append(
            f"{r['method']:<28}{r['output_tok_s']:>8.1f}{r['requests_s']:>7.2f}"
            f"{r['ttft_p50_s']:>8.2f}/{r['ttft_p99_s']:<7.2f}"
            f"{r['tpot_p50_ms']:>8.1f}/{r['tpot_p99_ms']:<8.1f}"
            f"{r['itl_p50_ms']:>8.1f}/{r['itl_p99_ms']:<8.1f}"
            f"{r['e2e_p50_s']:>7.2f}/{r['e2e_p99_s']:<7.2f}"
            f"{r['padding_share']:>8.0%}{r['speedup_vs_first']:>8.1f}x{same:>6}")
    lines.append("tok/s: useful output tokens per second of wall time; speed-up: tok/s "
                 "against the first row; same: tokens equal "
                 f"{result.info['same_tokens_reference']}'s")
    return "\n".join(lines)


def write_serving_csv(result: Result, folder: str | Path) -> list[Path]:
    """<stem>.csv (one row per method, with `info`) and <stem>_requests.csv (one row
    per request and method); the stem is serve_<model>_<device>_<offline | rate<R>>."""
    return result.write(folder)


def serving_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minillm.bench serving",
        description=BENCHMARKS["serving"])
    parser.add_argument("--model", default="bundled",
                        help=f"{' | '.join(MODELS)} | a model folder")
    add_workload_arguments(parser, 64, (16, 128), (16, 256))
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="the batch size of every batched method (at least 1)")
    parser.add_argument("--long-prompts", type=float, nargs=2, default=None,
                        metavar=("SHARE", "TOKENS"),
                        help="each prompt is TOKENS long with probability SHARE")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the continuous engine's step budget; longer prompts "
                        "are chunked (default: max-num-seqs x the longest prompt)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS),
                        default=list(DEFAULT_METHODS),
                        help="default: the first five; minillm-unchunked: continuous "
                        "batching with every prompt computed whole in one step; "
                        "minillm-bf16/-int8/-int4: continuous, with chapter 5's fast "
                        "modes")
    parser.add_argument("--prompts", choices=PROMPT_SOURCES, default="auto",
                        help="auto: Shakespeare if data/plays and a tokenizer are there")
    parser.add_argument("--rounds", type=int, default=1,
                        help="serve the workload this many times, the methods in "
                        "turns; report each one's median run (at least 1)")
    add_run_arguments(parser)
    return parser


def check_cli_args(args: argparse.Namespace) -> tuple[Path, torch.device]:
    """Every argument, checked before any work. Returns (model folder, device)."""
    device = check_run_arguments(args)
    folder = model_folder(args.model)
    if args.long_prompts is not None:
        share, tokens = args.long_prompts
        args.long_prompts = (share, int(tokens) if tokens == int(tokens) else tokens)
    check_serving_args(folder, args.requests, args.max_num_seqs, args.rate,
                       tuple(args.methods), args.seed, tuple(args.prompt_tokens),
                       tuple(args.output_tokens), args.prompts,
                       args.max_num_batched_tokens, args.long_prompts)
    if not is_int(args.rounds, 1):
        raise ValueError(f"rounds={args.rounds!r}: must be an int >= 1")
    return folder, device


def run_serving_command(args: argparse.Namespace, checked) -> tuple:
    folder, device = checked
    result = run_serving_benchmark(
        folder, args.requests, args.max_num_seqs, args.rate, tuple(args.methods),
        args.seed, device, prompt_tokens=tuple(args.prompt_tokens),
        output_tokens=tuple(args.output_tokens), prompts=args.prompts,
        max_num_batched_tokens=args.max_num_batched_tokens, rounds=args.rounds,
        long_prompts=args.long_prompts)
    result.info["model"] = model_label(args.model, folder)
    return format_serving_table(result), lambda out: write_serving_csv(result, out)


main = command(serving_parser, check_cli_args, run_serving_command)
