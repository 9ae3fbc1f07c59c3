"""The engine's fast paths beside llama.cpp on the whole workload, in one run, in turns.

    python tools/versus_llama_cpp.py                     # SmolLM2-135M-Instruct, 2 threads
    python tools/versus_llama_cpp.py --repeats 1 --no-csv

For each precision (float32: the lossless fast path against llama.cpp F32; 8 bits:
int8-a8-tiles against Q8_0; 4 bits: int4-a8 against Q4_0), four workloads, every way once
per round, rounds in turns, medians reported:

- next token at batch 1: ms per token (128-token prompt, 64 new tokens, the median gap);
- first token of a 128- and of a 1,024-token prompt: ms from the request to its first
  token (one request alone);
- batch 32: 32 requests of 128 random tokens each, 64 new tokens each, all at once:
  tokens/s of the whole run (prefill included) and of its decode steps alone.

The engine loads each mode as LLM(folder, quantization=mode) does (its 8-bit head in
blocks of 32, in tiles: as the GGUF files' Q8_0 head) and runs every option of its fast
path (compile_decode, fuse_projections, attention_backend="in_place", inductor's C++
wrapper); llama.cpp (llama-cpp-python) runs
the same weights written as GGUF files (chapter 2's writer), batched through its own
llama_batch API with one sequence id per request, its KV cache in float16. Needs
llama-cpp-python (see ../shared/notes or the README for building it on an AMX CPU).
Writes data/benchmarks/versus_llama_cpp_<model>_cpu.csv.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minillm.bench.decode import engine_run, gguf_copy  # noqa: E402
from minillm.perf.cpu_defaults import FAST_PATH  # noqa: E402
from minillm.bench.folders import model_folder  # noqa: E402
from minillm.bench.measure import greedy, random_prompt  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.model.loader import load_model  # noqa: E402

PRECISIONS = {"float32": (None, "F32"), "8 bits": ("int8-a8-tiles", "Q8_0"),
              "4 bits": ("int4-a8", "Q4_0")}
FAST = FAST_PATH  # what LLM(folder) runs on a CPU: appendix 7d, section 6
BATCH, PROMPT, NEW, LONG = 32, 128, 64, 1024


class Ours:
    """The engine on one model, with its fast path: one engine per workload shape."""

    def __init__(self, model):
        # no prefix cache: every round's prompts are new to both (llama.cpp's KV is
        # cleared before each run)
        self.one = LLMEngine(model, max_num_seqs=1, kv_cache="paged",
                             max_model_len=LONG + NEW, enable_prefix_caching=False,
                             **FAST)
        self.many = LLMEngine(model, max_num_seqs=BATCH, kv_cache="paged",
                              max_model_len=PROMPT + NEW, enable_prefix_caching=False,
                              **FAST)

    def next_token_ms(self, prompt) -> float:
        return engine_run(self.one, prompt, NEW, 1, torch.device("cpu"))["ms_per_token"]

    def first_token_ms(self, prompt) -> float:
        start = time.perf_counter()
        rid = self.one.add_request(prompt, greedy(2))
        while not self.one.requests[rid].output_ids:
            self.one.step()
        ms = (time.perf_counter() - start) * 1e3
        while self.one.has_unfinished():
            self.one.step()
        self.one.pop(rid)
        return ms

    def batch(self, prompts) -> tuple[float, float]:
        e = self.many
        first = len(e.history)
        start = time.perf_counter()
        rids = [e.add_request(p, greedy(NEW)) for p in prompts]
        while e.has_unfinished():
            e.step()
        seconds = time.perf_counter() - start
        decode = [r for r in e.history[first:] if not r.is_prefill]
        decode_s = sum(r.end - r.start for r in decode)
        tokens = sum(r.useful_rows for r in decode)
        for rid in rids:
            e.pop(rid)
        return len(prompts) * NEW / seconds, tokens / decode_s


class LlamaCpp:
    """llama.cpp on a GGUF file, through llama-cpp-python's low-level batch API."""

    def __init__(self, path: Path, threads: int):
        import llama_cpp
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=threads,
                                   verbose=False)  # the model; its own context unused
        self.contexts = {n: self._context(n, threads) for n in (1, BATCH)}
        self.ctx = self.contexts[1]
        self.vocab = self.llm.n_vocab()
        self.batch_ = llama_cpp.llama_batch_init(2048, 0, BATCH)

    def _context(self, sequences: int, threads: int):
        """A context for `sequences` at once, each with its own KV stream (llama.cpp's
        non-unified cache: a sequence attends to its own cells only)."""
        params = self.lib.llama_context_default_params()
        params.n_ctx = sequences * (LONG + NEW if sequences == 1 else PROMPT + NEW)
        params.n_batch, params.n_ubatch = 2048, 512  # llama-server's defaults
        params.n_seq_max, params.kv_unified = sequences, False
        params.n_threads = params.n_threads_batch = threads
        return self.lib.llama_init_from_model(self.llm._model.model, params)

    def _clear(self):
        mem = self.lib.llama_get_memory(self.ctx)
        self.lib.llama_memory_clear(mem, True)

    def _decode(self, items) -> list[int]:
        """items: (token, position, sequence, wants logits); the argmax of each row that
        wants logits, in order."""
        b = self.batch_
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i, (*_, logits) in enumerate(items):
            if logits:
                row = self.lib.llama_get_logits_ith(self.ctx, i)
                out.append(int(np.ctypeslib.as_array(row, shape=(self.vocab,)).argmax()))
        return out

    def _prefill(self, prompts) -> list[int]:
        """Every prompt's tokens, up to 2,048 a call; the first token of each."""
        items = [(t, p, s, p == len(prompt) - 1)
                 for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        firsts = []
        for i in range(0, len(items), 2048):
            firsts += self._decode(items[i:i + 2048])
        return firsts

    def run(self, prompts, n) -> tuple[float, float, list[float]]:
        """(seconds in all, seconds of the decode steps, the gaps between steps)."""
        self.ctx = self.contexts[1 if len(prompts) == 1 else BATCH]
        self._clear()
        start = time.perf_counter()
        last = self._prefill(prompts)
        decode_start = time.perf_counter()
        gaps, before = [], decode_start
        for step in range(1, n):
            last = self._decode([(t, len(p) + step - 1, s, True)
                                 for s, (t, p) in enumerate(zip(last, prompts))])
            now = time.perf_counter()
            gaps.append(now - before)
            before = now
        end = time.perf_counter()
        return end - start, end - decode_start, gaps

    def next_token_ms(self, prompt) -> float:
        return statistics.median(self.run([prompt], NEW)[2]) * 1e3

    def first_token_ms(self, prompt) -> float:
        self.ctx = self.contexts[1]
        self._clear()
        start = time.perf_counter()
        self._prefill([prompt])
        return (time.perf_counter() - start) * 1e3

    def batch(self, prompts) -> tuple[float, float]:
        seconds, decode_s, _ = self.run(prompts, NEW)
        return len(prompts) * NEW / seconds, len(prompts) * (NEW - 1) / decode_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS),
                        choices=list(PRECISIONS))
    parser.add_argument("--no-csv", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = model_folder(args.model)
    base = load_model(folder, dtype=torch.float32)
    vocab = base.config.vocab_size
    short, long_ = random_prompt(vocab, PROMPT), random_prompt(vocab, LONG, seed=1)
    many = [random_prompt(vocab, PROMPT, seed=2 + i) for i in range(BATCH)]
    ways = {}
    for precision in args.precisions:
        mode, kind = PRECISIONS[precision]
        print(f"building {precision}: the engine ({mode or 'float32'}) and llama.cpp "
              f"{kind}", flush=True)
        model = load_model(folder, dtype=torch.float32, quantization=mode) if mode \
            else base  # the mode with its head, as LLM(folder, quantization=mode)
        ways[precision, "minillm"] = Ours(model)
        ways[precision, f"llama.cpp {kind}"] = LlamaCpp(gguf_copy(folder, kind),
                                                        args.threads)
    tasks = {"next token, batch 1 (ms)": lambda w: w.next_token_ms(short),
             "first token, 128 (ms)": lambda w: w.first_token_ms(short),
             "first token, 1,024 (ms)": lambda w: w.first_token_ms(long_),
             "batch 32": lambda w: w.batch(many)}
    got = {(way, task): [] for way in ways for task in tasks}
    for round_ in range(args.repeats + 1):  # round 0 warms up and compiles
        for task, run in tasks.items():
            for way, w in ways.items():
                value = run(w)
                if round_:
                    got[way, task].append(value)
        print(f"round {round_} done", flush=True)
    rows = []
    for (precision, who), w in ways.items():
        row = {"precision": precision, "way": who}
        for task in tasks:
            values = got[(precision, who), task]
            if task == "batch 32":
                row["batch 32 tokens/s"] = statistics.median(v[0] for v in values)
                row["batch 32 decode tokens/s"] = statistics.median(v[1] for v in values)
            else:
                row[task] = statistics.median(values)
        rows.append(row)
    import pandas as pd
    table = pd.DataFrame(rows)
    print(table.round(1).to_string(index=False))
    for precision in args.precisions:
        ours, theirs = [r for r in rows if r["precision"] == precision]
        print(f"{precision}: ours/llama.cpp time at batch 1 "
              f"{ours['next token, batch 1 (ms)'] / theirs['next token, batch 1 (ms)']:.2f}; "
              f"first token of 1,024 {ours['first token, 1,024 (ms)'] / theirs['first token, 1,024 (ms)']:.2f}; "
              f"batch-32 tokens/s {ours['batch 32 tokens/s'] / theirs['batch 32 tokens/s']:.2f}")
    if not args.no_csv:
        from minillm.bench.measure import hardware_name
        table["hardware"] = hardware_name("cpu")  # the CPU and torch's threads
        table["llama_cpp_python"] = __import__("llama_cpp").__version__
        table["torch"] = torch.__version__
        out = ROOT / "data" / "benchmarks" / f"versus_llama_cpp_{args.model}_cpu.csv"
        table.to_csv(out, index=False)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
