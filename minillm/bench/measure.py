"""What every benchmark measures with: a clock on the forward passes, the ways to
generate (methods), one timed run, and random prompts. Written with chapter 3's
benchmark (chapter 3 also times `transformers_method` with the profiler; chapter 7 names
its hardware with `hardware_name`); the other benchmarks share it."""
from __future__ import annotations

import copy
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..generate import generate
from ..kv.contiguous import KVCache
from ..model.config import ModelConfig
from ..model.naive import naive_generate
from ..quant.int8 import MODES, quantize
from ..sampling import SamplingParams
from ..utils import synchronize

__all__ = ["hardware_name", "StepClock", "Method", "greedy", "minillm_methods",
           "FastMode", "FAST_MODES", "fast_copy",
           "transformers_method", "weight_nbytes", "Measurement", "memory_kind",
           "measure", "in_turns", "random_prompt", "check_counts", "check_fits"]


def hardware_name(device: str | torch.device) -> str:
    """The GPU's name, or the CPU's model name and the number of threads torch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, torch threads: {torch.get_num_threads()}"


class StepClock:
    """Notes the moment each forward pass of `module` ends (after a device sync).

    Every generation loop here runs one forward per new token, so the gaps between
    these moments are the per-token latencies, whatever loop (ours or transformers')
    drives the model.
    """
    def __init__(self, module: torch.nn.Module, device: str | torch.device):
        self.module, self.device = module, torch.device(device)
        self.ends: list[float] = []

    def _tick(self, module, args, output) -> None:
        synchronize(self.device)
        self.ends.append(time.perf_counter())

    def __enter__(self) -> "StepClock":
        self.ends = []
        self._handle = self.module.register_forward_hook(self._tick)
        synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.stop = time.perf_counter()
        self._handle.remove()


@dataclass
class Method:
    """One way to generate: `run(prompt_ids, n)` -> (new ids, KV cache bytes held)."""
    name: str
    module: torch.nn.Module  # the model whose forward passes are clocked
    run: Callable[[list[int], int], tuple[list[int], int]]


def greedy(n: int) -> SamplingParams:
    """Greedy decoding of exactly n tokens (EOS does not stop it): every benchmark's."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def minillm_methods(model) -> list[Method]:
    def naive(prompt, n):
        return naive_generate(model, prompt, greedy(n)), 0

    def cached(prompt, n):
        cache = KVCache.from_model(model, len(prompt) + n)
        return generate(model, prompt, greedy(n), cache=cache), cache.nbytes
    return [Method("naive loop", model, naive),
            Method("KV cache (minillm)", model, cached)]


def transformers_method(hf_model) -> Method:
    """transformers' generate() with its default (dynamic) KV cache, greedy, EOS off."""
    import transformers

    config = copy.deepcopy(hf_model.generation_config)
    config.eos_token_id = -1  # no token has id -1: EOS never stops it (ignore_eos)
    config.do_sample = False
    config.return_dict_in_generate = True

    def run(prompt, n):
        ids = torch.tensor([prompt], device=hf_model.device)
        config.max_new_tokens = n
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # it warns that -1 is not a token id
        try:
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                    generation_config=config)
        finally:
            transformers.logging.set_verbosity(verbosity)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        layers = getattr(cache, "layers", [])
        kv_bytes = sum(t.nbytes for layer in layers for t in (layer.keys, layer.values)
                       if t is not None)
        return out.sequences[0, len(prompt):].tolist(), kv_bytes
    return Method("transformers generate()", hf_model, run)


@dataclass(frozen=True)
class FastMode:
    """How the benchmarks run one of the fast modes: the chapter that builds it, the
    dtype of the model around its layers, and its LM head's mode and group_size."""
    chapter: str
    dtype: torch.dtype = torch.bfloat16
    head: str = "int8"
    head_group_size: int | None = None

    def label(self, mode: str) -> str:
        groups = self.head_group_size
        return (f"{mode} + {self.head} head" if groups is None
                else f"{mode} + {self.head} head in blocks of {groups}")


FAST_MODES = {"int8": FastMode("ch. 5"), "int4": FastMode("ch. 5"),
              # the appendix's section 6: activations in blocks of 32. Its kernel reads
              # float32 (a float32 model: no casts around it); the head's weights in
              # blocks of 32 too, as llama.cpp's Q8_0 (more exact; a slower head)
              "int8-a8": FastMode("ch. 7", torch.float32, "int8-a8", 32),
              # section 7: int4 codes in tiles of 16 outputs, the head in 8 bits in
              # blocks of 32 and in tiles too: as a llama.cpp Q4_0 file of SmolLM2,
              # whose head is Q8_0
              "int4-a8": FastMode("ch. 7", torch.float32, "int8-a8-tiles")}


def fast_copy(model, mode: str | None):
    """A copy of the model: without a mode in bfloat16; with one, in its FAST_MODES
    dtype, its linear layers in that mode (chapter 5's fused kernels) and its LM head
    as FAST_MODES says (a tied head stops sharing its weight with the embedding)."""
    fast = FAST_MODES.get(mode, FastMode("ch. 5"))
    copied = copy.deepcopy(model).to(fast.dtype)
    if mode is None:
        return copied
    quantize(copied, mode)
    copied.lm_head = MODES[fast.head].layer.from_linear(copied.lm_head,
                                                     fast.head_group_size)
    return copied


def weight_nbytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters; tied weights are counted once."""
    return sum({p.data_ptr(): p.nbytes for p in module.parameters()}.values())


@dataclass
class Measurement:
    method: str
    total_s: float          # wall time of the whole call
    ttft_s: float           # time to first token: the prompt's forward pass
    step_s: list[float]     # the time of each later token
    memory_bytes: int       # see memory_kind
    tokens: list[int]

    @property
    def per_token_s(self) -> float:
        return statistics.fmean(self.step_s) if self.step_s else float("nan")


def memory_kind(device: str | torch.device) -> str:
    if torch.device(device).type == "cuda":
        return ("weights + peak extra CUDA memory during the call "
                "(torch.cuda.max_memory_allocated)")
    return "weights + KV cache tensor bytes (CPU: no allocator statistics)"


def measure(method: Method, prompt: list[int], n: int,
            device: str | torch.device) -> Measurement:
    """Run one generation of n tokens and time every forward pass."""
    device = torch.device(device)
    weights = weight_nbytes(method.module)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with StepClock(method.module, device) as clock:
        tokens, kv_bytes = method.run(prompt, n)
    if len(clock.ends) != n or len(tokens) != n:
        raise RuntimeError(f"{method.name}: expected {n} tokens from {n} forward "
                           f"passes, got {len(tokens)} tokens from {len(clock.ends)}")
    if device.type == "cuda":
        memory = weights + torch.cuda.max_memory_allocated(device) - base
    else:
        memory = weights + kv_bytes
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    total, ttft = clock.stop - clock.start, clock.ends[0] - clock.start
    return Measurement(method.name, total, ttft, steps, memory, tokens)


def in_turns(ways: dict[str, Callable[[], object]], rounds: int,
             warm_up: dict[str, Callable[[], object]] | None = None,
             after: Callable[[str, int, object], None] | None = None
             ) -> dict[str, list]:
    """Every way once per round, for `rounds` rounds: a busy moment or a slow drift of
    the machine hits every way alike. `warm_up[name]()` runs first, once per way (first
    calls pay for lazy initialisation, caches, compiling); `after(name, round, result)`
    is told of each run (progress). Returns each way's results, round by round."""
    for run in (warm_up or {}).values():
        run()
    runs: dict[str, list] = {name: [] for name in ways}
    for r in range(rounds):
        for name, run in ways.items():
            runs[name].append(run())
            if after is not None:
                after(name, r, runs[name][-1])
    return runs


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """Token ids drawn at random (fixed seed): speed does not depend on which."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (length,), generator=g).tolist()


def check_counts(new_tokens, prompt_tokens, repeats) -> None:
    """The token counts and repeats of a benchmark, checked before any work."""
    counts = [("new_tokens", new_tokens, 2), ("prompt_tokens", prompt_tokens, 1),
              ("repeats", repeats, 1)]
    for name, value, low in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            why = " (the tokens after the first are timed)" if low == 2 else ""
            raise ValueError(f"{name}={value!r}: must be an int >= {low}{why}")


def check_fits(config: ModelConfig, new_tokens: int, prompt_tokens: int) -> None:
    if prompt_tokens + new_tokens > config.context_length:
        raise ValueError(f"prompt_tokens={prompt_tokens} + new_tokens={new_tokens} = "
                         f"{prompt_tokens + new_tokens} positions do not fit the "
                         f"model's context of {config.context_length}")
