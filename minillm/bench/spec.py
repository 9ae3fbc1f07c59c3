"""Chapter 10's benchmark: tokens per second with and without speculative decoding, on
answers that quote their input ("grounded") and on free text ("open"), at batch 1 and
with many requests at once. Every way runs in turns, greedy; each way's answers are
checked against plain decoding's (speculation must not change them).
`python -m minillm.bench spec -h`."""
from __future__ import annotations

import argparse
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
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer

__all__ = ["PASSAGES", "TASKS", "conversations", "ways", "run_spec_benchmark",
           "format_table", "spec_parser", "check_spec_args", "main"]

PASSAGES = [
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million square "
    "kilometres are covered by the rainforest. The region includes territory belonging to "
    "nine nations. The majority of the forest is contained within Brazil, with 60% of the "
    "rainforest, followed by Peru with 13%, and Colombia with 10%.",
    "The Great Barrier Reef is the world's largest coral reef system. It is composed of "
    "over 2,900 individual reefs and 900 islands stretching for over 2,300 kilometres. The "
    "reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be "
    "seen from outer space and is the world's biggest single structure made by living "
    "organisms.",
    "Python is a high-level, general-purpose programming language. Its design philosophy "
    "emphasizes code readability with the use of significant indentation. Python is "
    "dynamically typed and garbage-collected. It supports multiple programming paradigms, "
    "including structured, object-oriented and functional programming. Guido van Rossum "
    "began working on Python in the late 1980s.",
]
QUESTIONS = ["Which countries hold the rainforest?", "Where is the reef and how big is it?",
             "What does Python's design emphasize?"]
OPEN = ["Write a short story about a cat who learns to fly.",
        "Write a poem about the sea at night.",
        "Describe your perfect weekend in a few sentences."]
TASKS = {
    "grounded": [f"Answer using sentences copied from the text. {q}\n\n{p}"
                 for q, p in zip(QUESTIONS, PASSAGES)],
    "open": OPEN,
}


def conversations(task: str, n: int) -> list[list[dict]]:
    """n chat requests of a task (its prompts, repeated in turn)."""
    texts = TASKS[task]
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]


def ways(folder, ks: list[int], drafts: list[str]) -> dict:
    """Each way's speculative_config: plain (None), prompt lookup per k, and the model
    itself quantized as its draft model (k = 3)."""
    out = {"plain": None}
    for k in ks:
        out[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k,
                               "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    for q in drafts:
        out[f"draft {q} k=3"] = {"model": folder, "quantization": q,
                                 "num_speculative_tokens": 3}
    return out


def _serve(llm, convs, max_tokens: int) -> tuple[list, float]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    if getattr(llm.engine.tokenizer, "chat_template", None):
        outs = llm.chat(convs, sp, use_tqdm=False)
    else:  # a model without a chat template (the bundled one): the text as it is
        outs = llm.generate([c[0]["content"] for c in convs], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def run_spec_benchmark(model: str = "smollm2-135m-instruct", dtype=torch.bfloat16,
                       device="cpu", max_tokens: int = 128, rounds: int = 3,
                       ks=(2, 4), drafts=("int4",), concurrency=(1, 16)) -> Result:
    """Rows: task, requests at once, way, tokens/s (median of the rounds), its ratio
    to plain decoding in the same rounds, the acceptance rate, and how many answers
    differ from plain decoding's (0 in float32; in bfloat16 a forward over several
    positions rounds differently from one over each, as a larger batch does)."""
    folder = model_folder(model)
    target = load_model(folder, dtype=dtype, device=device)
    tokenizer = Tokenizer.from_pretrained(folder)
    llms = {way: LLM(target, tokenizer, max_num_seqs=max(concurrency),
                     max_model_len=min(1024, target.config.context_length),
                     **({} if c is None else {"speculative_config": c}))
            for way, c in ways(folder, list(ks), list(drafts)).items()}
    rows = []
    for task in TASKS:
        for n in concurrency:
            convs = conversations(task, n if n > 1 else len(TASKS[task]))
            batches = [[c] for c in convs] if n == 1 else [convs]
            def warm_up(llm):
                _serve(llm, convs[:1], 8)
                if llm.engine.runner.speculator is not None:
                    llm.engine.runner.speculator.stats.__init__()

            def run(way, llm) -> tuple[list, float]:
                ids, seconds = [], 0.0
                for b in batches:
                    out, s = _serve(llm, b, max_tokens)
                    ids, seconds = ids + out, seconds + s
                print(f"{task}, {n} at once, {way}: {sum(map(len, ids)) / seconds:.1f} "
                      "tokens/s", file=sys.stderr, flush=True)  # progress
                return ids, seconds

            runs = in_turns({w: partial(run, w, x) for w, x in llms.items()}, rounds,
                            warm_up={w: partial(warm_up, x) for w, x in llms.items()})
            speed = {w: [sum(map(len, ids)) / s for ids, s in r]
                     for w, r in runs.items()}
            differ = {w: max(sum(a != b for a, b in zip(ids, plain[0]))
                             for (ids, _), plain in zip(r, runs["plain"]))
                      for w, r in runs.items()}
            for way, llm in llms.items():
                spec = llm.engine.runner.speculator
                stats = spec and spec.stats
                ratio = statistics.median(
                    a / b for a, b in zip(speed[way], speed["plain"]))
                rows.append({"task": task, "requests_at_once": n, "way": way,
                             "tokens_per_s": statistics.median(speed[way]),
                             "vs_plain": ratio, "acceptance": stats and
                             stats.acceptance_rate, "answers_differing": differ[way]})
    info = {"model": model, "dtype": str(dtype).removeprefix("torch."),
            "device": torch.device(device).type, "hardware": hardware_name(device),
            "torch": torch.__version__, "max_tokens": max_tokens, "rounds": rounds}
    return Result(rows, info, kind="spec", key="way", score="tokens_per_s",
                  lower_is_better=False, work=f"{max_tokens} new tokens, median of "
                  f"{rounds} rounds in turns")


def format_table(rows: list[dict]) -> str:
    head = (f"{'task':<9} {'at once':>7} {'way':<16} {'tokens/s':>9} "
            f"{'vs plain':>8} {'accept':>7} {'differ':>6}")
    lines = [head]
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"{r['task']:<9} {r['requests_at_once']:>7} {r['way']:<16} "
                     f"{r['tokens_per_s']:>9.1f} {r['vs_plain']:>7.2f}x {acc:>7} "
                     f"{r['answers_differing']:>6}")
    return "\n".join(lines)


def spec_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm.bench spec",
                                description=BENCHMARKS["spec"])
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4],
                   help="prompt lookup's num_speculative_tokens, one way each")
    p.add_argument("--drafts", nargs="*", default=["int4"],
                   choices=["int4", "int8"], help="the model quantized as its draft")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16],
                   help="requests at once (1: one after another)")
    add_run_arguments(p)
    return p


def check_spec_args(args: argparse.Namespace) -> tuple:
    """Every argument before any work; returns (device, dtype)."""
    device = check_run_arguments(args)
    for name, values, low, high in [("--max-tokens", [args.max_tokens], 1, 512),
                                    ("--rounds", [args.rounds], 1, 50),
                                    ("--ks", args.ks, 1, 16),
                                    ("--concurrency", args.concurrency, 1, 64)]:
        bad = [v for v in values if not low <= v <= high]
        if bad:
            raise ValueError(f"{name}={bad[0]}: allowed {low} to {high}")
    return device, check_model_arguments(args, device)


def _run(args, checked):
    device, dtype = checked
    result = run_spec_benchmark(args.model, dtype, device, args.max_tokens,
                                args.rounds, args.ks, args.drafts, args.concurrency)
    return format_table(result.rows), result.write  # spec_<model>_<device>.csv


main = command(spec_parser, check_spec_args, _run)
