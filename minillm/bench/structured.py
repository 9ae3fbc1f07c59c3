"""Chapter 11's benchmark: what structured output buys and what it costs. (a) Parse
rates of three extraction tasks (an address, an invoice line, a label), free against
constrained with each backend, greedy and sampled. (b) The mask's share of decoding at
batch 1 and 16 with each backend (xgrammar, the hand-built "minillm") against free
decoding, in turns (each round runs every way once), median of the rounds, from
StructuredOutputManager.mask_seconds over the elapsed time, and ms per token; the
hand-built backend's masks are cached per automaton state, so it is measured warm
(the warm-up run filled the cache) and cold ("minillm cold": compiled again before
each run, every mask built again). (c) Each backend's compile time per task (the
hand-built one builds its masks later, when a state is first reached).
`python -m minillm.bench structured -h`."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import torch

from .cli import (BENCHMARKS, add_model_arguments, add_run_arguments,
                  check_model_arguments, check_run_arguments, command)
from .folders import model_folder
from .measure import hardware_name, in_turns
from .results import Result
from ..engine.llm import LLM
from ..model.loader import load_model
from ..structured.backends import BACKENDS, token_vocab, xgrammar_available
from ..sampling import SamplingParams
from ..structured.params import StructuredOutputsParams
from ..tokenizer import Tokenizer
from ..utils import synchronize

__all__ = ["TEXT", "TASKS", "LABELS", "parses", "run_structured_benchmark",
           "format_table", "structured_parser", "check_structured_args", "main"]

TEXT = {"type": "string", "maxLength": 40}  # bounded: an answer cannot run on
ADDRESS = {"type": "object", "properties": {"street": TEXT, "city": TEXT,
                                            "postcode": TEXT},
           "required": ["street", "city", "postcode"]}
COUNT = {"type": "integer", "minimum": 0, "maximum": 10000}  # bounded too
PRICE = {"type": "number", "minimum": 0, "maximum": 10000}
INVOICE = {"type": "object", "properties": {
    "item": TEXT, "quantity": COUNT, "unit_price": PRICE},
    "required": ["item", "quantity", "unit_price"]}
LABELS = ["positive", "negative", "neutral"]
TASKS = {  # name -> (the request, its JSON Schema or None for a label)
    "address": ("Extract the address as JSON with keys street, city, postcode: "
                "Please deliver to 221 Elm Road, Bristol, BS1 4DJ by Friday.", ADDRESS),
    "invoice": ("Extract the invoice line as JSON with keys item, quantity, "
                "unit_price: 12 notebooks at 2.75 each.", INVOICE),
    "label": ("Is this review positive, negative or neutral? Answer with one word. "
              "Review: the blender is loud but it works fine.", None),
}


def parses(text: str, schema: dict | None) -> bool:
    """Does the answer load and validate (a label: is it one of the labels)?"""
    if schema is None:
        return text.strip().lower() in LABELS
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def constraint(task: str) -> StructuredOutputsParams:
    schema = TASKS[task][1]
    return (StructuredOutputsParams(json=schema) if schema is not None
            else StructuredOutputsParams(choice=LABELS))


def _ask(llm, texts: list[str], params) -> list:
    """The answers of one request per text: chat when the model has a template."""
    if getattr(llm.engine.tokenizer, "chat_template", None):
        return llm.chat([[{"role": "user", "content": t}] for t in texts], params,
                        use_tqdm=False)
    return llm.generate(texts, params, use_tqdm=False)


def parse_rates(llms: dict, ways: list[str], max_tokens: int, samples: int) -> list:
    rows = []
    for task, (text, schema) in TASKS.items():
        for sampling, temperature, n in [("greedy", 0.0, 1),
                                         (f"T=0.8 x{samples}", 0.8, samples)]:
            for way in ways:
                so = None if way == "free" else constraint(task)
                params = SamplingParams(n=n, temperature=temperature, seed=0,
                                        max_tokens=max_tokens, structured_outputs=so)
                answers = _ask(llms[way], [text], params)[0].outputs
                rows.append({
                    "part": "parse", "task": task, "sampling": sampling, "way": way,
                    "parse_rate": sum(parses(a.text, schema) for a in answers) / n,
                    "ended_on_their_own": sum(a.finish_reason == "stop"
                                              for a in answers) / n,
                    "mean_tokens": statistics.mean(len(a.token_ids) for a in answers),
                    "example": answers[0].text[:80]})  # what the first one wrote
                print(f"parse {task}, {sampling}, {way}: {rows[-1]['parse_rate']:.2f}",
                      file=sys.stderr, flush=True)  # progress
    return rows


def _cost_once(llm, batch: int, constrained: bool, max_tokens: int,
               device, cold: bool = False) -> dict:
    """One run of `batch` address requests: ms per token, the mask's share. cold:
    the compiled grammars forgotten first (compiled again, masks built again)."""
    from minillm.structured.engine import structured_output_manager
    manager = structured_output_manager(llm.engine)
    if cold:
        manager.compiled.clear()
    so = constraint("address") if constrained else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            ignore_eos=not constrained, structured_outputs=so)
    before, steps = manager.mask_seconds, len(llm.engine.history)
    start = time.perf_counter()
    outs = _ask(llm, [TASKS["address"][0]] * batch, params)
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    mask = manager.mask_seconds - before
    return {"ms_per_token": seconds / tokens * 1000 * batch,
            "mask_share": mask / seconds,
            "mask_ms_per_step": mask * 1000 / max(1, len(llm.engine.history) - steps)}


def mask_cost(llms: dict, ways: list[str], batches, rounds: int, max_tokens: int,
              device) -> list:
    for way in ways:  # warm-up (and the hand-built backend's mask cache)
        _cost_once(llms[way], 1, way != "free", 8, device)
    rows = []
    for batch in batches:
        def show(way, r, x, batch=batch):
            print(f"cost batch {batch}, round {r + 1}, {way}: "
                  f"{x['ms_per_token']:.1f} ms/token, mask {x['mask_share']:.1%}",
                  file=sys.stderr, flush=True)

        runs = in_turns({w: partial(_cost_once, llms[w], batch, w != "free", max_tokens,
                                    device, cold=w.endswith(" cold")) for w in ways},
                        rounds, after=show)
        for way in ways:
            ratio = [a["ms_per_token"] / b["ms_per_token"]
                     for a, b in zip(runs[way], runs["free"])]
            rows.append({"part": "cost", "batch": batch, "way": way, **{
                k: statistics.median(x[k] for x in runs[way])
                for k in ("ms_per_token", "mask_share", "mask_ms_per_step")},
                "vs_free": statistics.median(ratio)})
    return rows


def compile_times(model, tokenizer, backends: list[str], rounds: int) -> list:
    """Each task's constraint compiled by a fresh backend (no cache), median ms."""
    vocab = token_vocab(tokenizer, model.config.vocab_size)
    stop = sorted(model.config.eos_token_ids)
    rows = []
    for way in backends:
        for task in TASKS:
            took = []
            for _ in range(rounds):
                backend = BACKENDS[way](vocab, stop, model.config.vocab_size)
                start = time.perf_counter()
                backend.compile(constraint(task))
                took.append((time.perf_counter() - start) * 1000)
            rows.append({"part": "compile", "task": task, "way": way,
                         "compile_ms": statistics.median(took)})
    return rows


def run_structured_benchmark(model: str = "smollm2-135m-instruct",
                             dtype=torch.bfloat16, device="cpu", max_tokens: int = 100,
                             samples: int = 4, rounds: int = 3, batches=(1, 16),
                             cost_tokens: int = 32,
                             backends=("xgrammar", "minillm")) -> Result:
    """Rows of three parts ("parse", "cost", "compile") and the run's info."""
    folder = model_folder(model)
    target = load_model(folder, dtype=dtype, device=device)
    tokenizer = Tokenizer.from_pretrained(folder)
    ways = ["free", *backends]
    cost_ways = ways + ["minillm cold"] * ("minillm" in backends)
    llms = {w: LLM(target, tokenizer, max_num_seqs=max(max(batches), samples),
                   max_model_len=min(1024, target.config.context_length),
                   structured_outputs_config={"backend": "minillm" if w == "free"
                                              else w.split()[0]})
            for w in cost_ways}
    rows = parse_rates(llms, ways, max_tokens, samples)
    rows += mask_cost(llms, cost_ways, list(batches), rounds, cost_tokens, device)
    rows += compile_times(target, tokenizer, list(backends), rounds)
    info = {"model": model, "dtype": str(dtype).removeprefix("torch."),
            "device": torch.device(device).type, "hardware": hardware_name(device),
            "torch": torch.__version__, "max_tokens": max_tokens,
            "cost_tokens": cost_tokens, "rounds": rounds}
    return Result(rows, info, kind="structured", key="way", work=(
        f"{max_tokens} new tokens (masks: {cost_tokens}), median of {rounds} rounds"))


def format_table(rows: list[dict]) -> str:
    lines = [f"{'task':<8} {'sampling':<9} {'way':<9} {'parses':>6} {'ended':>6} "
             f"{'tokens':>6}  first answer"]
    for r in (r for r in rows if r["part"] == "parse"):
        lines.append(f"{r['task']:<8} {r['sampling']:<9} {r['way']:<9} "
                     f"{r['parse_rate']:>6.2f} {r['ended_on_their_own']:>6.2f} "
                     f"{r['mean_tokens']:>6.1f}  {r['example'][:36]!r}")
    lines += ["", f"{'batch':>5} {'way':<12} {'ms/token':>8} {'vs free':>8} "
              f"{'mask share':>10} {'mask ms/step':>12}"]
    for r in (r for r in rows if r["part"] == "cost"):
        lines.append(f"{r['batch']:>5} {r['way']:<12} {r['ms_per_token']:>8.2f} "
                     f"{r['vs_free']:>7.2f}x {r['mask_share']:>10.1%} "
                     f"{r['mask_ms_per_step']:>12.3f}")
    lines += ["", f"{'task':<8} {'backend':<9} {'compile ms':>10}"]
    for r in (r for r in rows if r["part"] == "compile"):
        lines.append(f"{r['task']:<8} {r['way']:<9} {r['compile_ms']:>10.1f}")
    return "\n".join(lines)


def structured_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm.bench structured",
                                description=BENCHMARKS["structured"])
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=int, default=100,
                   help="max_tokens of the parse-rate answers")
    p.add_argument("--samples", type=int, default=4,
                   help="sampled answers per task (temperature 0.8)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16],
                   help="requests at once in the mask-cost part")
    p.add_argument("--cost-tokens", type=int, default=32,
                   help="max_tokens of each request in the mask-cost part")
    p.add_argument("--backends", nargs="+", default=["xgrammar", "minillm"],
                   choices=list(BACKENDS))
    add_run_arguments(p)
    return p


def check_structured_args(args: argparse.Namespace) -> tuple:
    """Every argument before any work; returns (device, dtype)."""
    device = check_run_arguments(args)
    for name, values, low, high in [("--max-tokens", [args.max_tokens], 1, 512),
                                    ("--samples", [args.samples], 1, 64),
                                    ("--rounds", [args.rounds], 1, 50),
                                    ("--batch", args.batch, 1, 64),
                                    ("--cost-tokens", [args.cost_tokens], 1, 512)]:
        bad = [v for v in values if not low <= v <= high]
        if bad:
            raise ValueError(f"{name}={bad[0]}: allowed {low} to {high}")
    if len(set(args.backends)) != len(args.backends):
        raise ValueError(f"--backends={args.backends}: each at most once")
    if "xgrammar" in args.backends and not xgrammar_available():
        raise ValueError("--backends xgrammar: xgrammar is not installed "
                         "(pip install xgrammar), or give --backends minillm")
    return device, check_model_arguments(args, device)


def _run(args, checked):
    device, dtype = checked
    result = run_structured_benchmark(
        args.model, dtype, device, args.max_tokens, args.samples, args.rounds,
        args.batch, args.cost_tokens, args.backends)
    return format_table(result.rows), result.write  # structured_<model>_<device>.csv


main = command(structured_parser, check_structured_args, _run)
