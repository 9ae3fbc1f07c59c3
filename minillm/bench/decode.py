"""Chapter 7's decode benchmark: ms per token and tokens/s of `transformers`'
`generate()`, chapter 3's loop, the engine eagerly, with CUDA graphs and with
torch.compile (off a GPU: also a compiled decode step per way), at batch 1 and at
larger batches, with the MBU of each and, at batch 1, what one decode step runs (aten
ops, kernel launches, CUDA graph launches: chapter 7, section 7). Chapter 7 (section 11)
runs `run_perf_benchmark`; `python -m minillm.bench decode -h` runs it as a command."""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from .cli import (BENCHMARKS, add_run_arguments, check_run_arguments,
                               command)
from .measure import (FAST_MODES, fast_copy, greedy, hardware_name, in_turns, measure,
                      minillm_methods, random_prompt, transformers_method)
from .results import Result
from ..engine import LLMEngine
from ..engine.graphs import compile_parts
from ..kernels.paged_decode import HEAD_DIMS
from ..memory import PRESETS
from ..model.config import ModelConfig
from ..model.loader import load_model
from ..model.transformer import Transformer
from ..perf.cpu_defaults import CPP_WRAPPER
from ..perf.mbu import (decode_bytes, launch_counts, measure_bandwidth, mbu, peak_for,
                    quiet_native_stderr)
from ..utils import bundled_model_path, synchronize

__all__ = ["COMPILED", "DTYPES", "LLAMA_CPP_KINDS", "llama_cpp_missing", "gguf_copy",
           "gguf_step_bytes", "llama_cpp_way", "check_llama_cpp", "model_pair", "engine_run",
           "step_launches", "add_launches", "loop_run", "round_robin",
           "agreement", "MAX_BATCH",
           "LAUNCHES", "check_perf_args", "run_perf_benchmark", "score",
           "COLUMNS", "format_table", "decode_parser",
           "check_decode_args", "run_decode_command", "main"]


COMPILED = "engine, compiled (ch. 7)"  # --compile off a GPU: section 14's runner

DTYPES = {"float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


def model_pair(name: str, dtype: torch.dtype, device: torch.device):
    """(our model, transformers' model) with the same weights, on `device`: the bundled
    model, a real checkpoint (a folder or a name LLM(...) takes, e.g.
    HuggingFaceTB/SmolLM2-135M-Instruct), or random weights of a preset's shape (made
    on the device, not on disk)."""
    import transformers
    if name == "bundled" or name not in PRESETS:
        path = bundled_model_path() if name == "bundled" else real_folder(name)
        ours = load_model(path, dtype=dtype, device=device)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return ours, hf.to(device).eval()
    if PRESETS[name]["model_type"] != "llama":
        llamas = sorted(p for p in PRESETS if PRESETS[p]["model_type"] == "llama")
        raise ValueError(f"--model={name!r}: allowed 'bundled' or {llamas}")
    hf_config = transformers.LlamaConfig(**PRESETS[name], rms_norm_eps=1e-5)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)       # made in its dtype, on its device
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(before)
    with torch.device("meta"):
        ours = Transformer(ModelConfig.from_hf(hf_config.to_dict())).to(dtype)
    ours = ours.to_empty(device=device)
    if ours.config.tie_word_embeddings:
        ours.lm_head.weight = ours.embed_tokens.weight
    ours.rope.reset_tables()
    with torch.no_grad():  # the same weights: ours are transformers' (HF names)
        for name_, p in ours.named_parameters():
            hf_name = name_ if name_ == "lm_head.weight" else "model." + name_
            p.copy_(hf.get_parameter(hf_name))
    return ours.eval(), hf.eval()


def real_folder(name: str):
    """The folder of a checkpoint named as LLM(...) takes it, or a ValueError."""
    from ..model.sources import resolve_folder
    llamas = sorted(p for p in PRESETS if PRESETS[p]["model_type"] == "llama")
    try:
        return resolve_folder(name)
    except (ValueError, OSError) as e:
        raise ValueError(f"--model={name!r}: not 'bundled', a preset {llamas} or a "
                         f"checkpoint ({e})") from None


LLAMA_CPP_KINDS = ("F32", "Q8_0", "Q4_0")  # llama.cpp's formats the command runs


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot run here (None: it can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return (f"llama-cpp-python is not installed ({e}): pip install llama-cpp-python "
                "(it builds llama.cpp from source; see the README)")
    return None


def gguf_copy(folder: Path, kind: str) -> Path:
    """The checkpoint written as a GGUF file in `kind`, once (chapter 2's write_gguf),
    kept in minillm's cache."""
    from ..model.gguf import cache_dir, file_hash, write_gguf
    weights = Path(folder) / "model.safetensors"
    out = cache_dir() / "gguf" / f"{Path(folder).name}-{file_hash(weights)}.{kind}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        write_gguf(folder, tmp, kind)
        tmp.replace(out)
    return out


def gguf_step_bytes(path: Path) -> int:
    """Bytes a decode step reads from a GGUF file's tensors: all of them, but one row
    of the embedding table unless it is also the output layer (tied)."""
    import gguf
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    if "output.weight" not in tensors:  # tied: the head reads the whole table
        return total
    emb = tensors["token_embd.weight"]
    rows = int(emb.shape[-1])  # GGUF shapes list the fastest dimension first
    return total - int(emb.n_bytes) + int(emb.n_bytes) // rows


def llama_cpp_way(folder: Path, kind: str, prompt: list[int], n: int):
    """(run, bytes read per step): llama.cpp (llama-cpp-python) on the checkpoint in
    `kind`, greedy, n tokens, the ms per token the median gap between tokens."""
    from llama_cpp import Llama
    path = gguf_copy(folder, kind)
    llm = Llama(str(path), n_ctx=len(prompt) + n + 8, n_batch=512, verbose=False,
                n_threads=torch.get_num_threads())

    def run() -> dict:
        ids, gaps, last = [], [], None
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0,
                                  repeat_penalty=1.0, reset=True):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            ids.append(int(token))
            last = now
            if len(ids) == n:
                break
        return {"ms_per_token": statistics.median(gaps) * 1e3, "ids": ids}
    return run, gguf_step_bytes(path)


def check_llama_cpp(model: str, kinds: tuple) -> None:
    """--llama-cpp's checks, before any work."""
    if not kinds:
        return
    if not set(kinds) <= set(LLAMA_CPP_KINDS) or len(set(kinds)) != len(kinds):
        raise ValueError(f"llama_cpp={kinds!r}: allowed formats {LLAMA_CPP_KINDS}")
    if model in PRESETS:
        raise ValueError(f"llama.cpp runs a checkpoint file; --model={model!r} is random "
                         "weights made in memory: give 'bundled' or a checkpoint")
    if llama_cpp_missing():
        raise ValueError(llama_cpp_missing())


def engine_run(engine, prompt: list[int], n: int, batch: int, device) -> dict:
    """Serve `batch` copies of the prompt, n tokens each, on `engine`: the median ms
    per decode step, tokens/s, seconds, and the first request's tokens."""
    first = len(engine.history)
    rids = [engine.add_request(prompt, greedy(n)) for _ in range(batch)]
    synchronize(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()                        # returns once the ids are on the CPU
    synchronize(device)
    seconds = time.perf_counter() - start
    decode = [r.end - r.start for r in engine.history[first:] if not r.is_prefill]
    out = {"ms_per_token": statistics.median(decode) * 1e3,
           "tokens_per_s": batch * n / seconds, "seconds": seconds,
           "ids": engine.pop(rids[0]).output_ids}
    if hasattr(engine.runner.forward, "compile_seconds"):  # compiled: so far
        out["compile_s"] = engine.runner.forward.compile_seconds
    return out


def step_launches(engine, prompt: list[int], device) -> dict:
    """What one decode step of one request on `engine` runs, counted by torch.profiler
    (chapter 7, section 7): aten ops, kernel launches and CUDA graph launches."""
    from torch.profiler import ProfilerActivity, profile
    first = len(engine.history)
    rid = engine.add_request(prompt, greedy(2))  # its prefill, then one decode step
    while not any(r.useful_rows for r in engine.history[first:]):
        engine.step()
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (
        device.type == "cuda")
    with quiet_native_stderr(), profile(activities=activities) as prof:
        engine.step()
        synchronize(device)
    assert not engine.history[-1].is_prefill and engine.history[-1].useful_rows == 1
    while engine.has_unfinished():
        engine.step()
    engine.pop(rid)
    counts = launch_counts(prof)
    return {k.replace(" ", "_") + "_per_step": v for k, v in counts.items()}


def add_launches(rows: list[dict], ways: dict, prompt: list[int], device) -> None:
    """Each engine way's row gets what one of its decode steps runs (step_launches)."""
    for row in rows:
        run = ways[row["way"]]
        if getattr(run, "func", None) is engine_run:  # partial(engine_run, engine, ..)
            row.update(step_launches(run.args[0], prompt, device))


def loop_run(method, prompt: list[int], n: int, device) -> dict:
    """One generation by chapter 3's loop or transformers: median ms per token."""
    m = measure(method, prompt, n, device)
    return {"ms_per_token": statistics.median(m.step_s) * 1e3, "ids": m.tokens}


def round_robin(ways: dict, repeats: int) -> list[dict]:
    """Run every way once per round, `repeats` + 1 rounds (the first warms up, records
    graphs, compiles): a slow drift of the machine hits every way alike. One row per
    way with the medians; first_run_s is the first round's time."""
    runs = in_turns(ways, repeats + 1)
    rows = []
    for name, (first, *timed) in runs.items():
        row = {"way": name, "ids": timed[0]["ids"]}
        for key in ("ms_per_token", "tokens_per_s"):
            if key in first:
                row[key] = statistics.median(r[key] for r in timed)
        if "seconds" in first:
            row["first_run_s"] = first["seconds"]
        if "compile_s" in first:  # compiled in the first round (a warm-up)
            row["compile_s"] = timed[-1]["compile_s"]
        rows.append(row)
    return rows


def agreement(ids: list[int], reference: list[int]) -> int:
    """How many leading tokens two greedy runs share. Random weights in float16 have
    near-tied logits: one rounding difference can flip a token, and all after it."""
    pairs = list(zip(ids, reference))
    return next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))


MAX_BATCH = 4096  # rows of one decode step


def check_perf_args(model, dtype, prompt_tokens, new_tokens, batches, repeats) -> None:
    """Every argument that needs no model, checked before any work."""
    llamas = sorted(p for p in PRESETS if PRESETS[p]["model_type"] == "llama")
    if not isinstance(model, str) or (model in PRESETS and model not in llamas):
        raise ValueError(f"model={model!r}: allowed 'bundled', {llamas} or a "
                         "checkpoint's folder or name")
    if model != "bundled" and model not in PRESETS:
        real_folder(model)  # a checkpoint that can be found, or a ValueError
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed {sorted(DTYPES)} or None")
    for name, v, low in [("prompt_tokens", prompt_tokens, 1),
                         ("new_tokens", new_tokens, 2), ("repeats", repeats, 1)]:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r}: must be an int >= {low}")
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                          for b in batches) or len(set(batches)) != len(batches):
        raise ValueError(f"batches={batches!r}: give different ints >= 1")
    if max(batches) > MAX_BATCH:
        raise ValueError(f"batches={batches!r}: at most {MAX_BATCH} requests at once")


def run_perf_benchmark(model: str = "bundled", device=None, dtype: str | None = None,
                       prompt_tokens: int = 128, new_tokens: int = 64,
                       batches: tuple = (1,), repeats: int = 3,
                       compile: bool = False, fast: tuple = (),
                       llama_cpp: tuple = ()) -> Result:
    """Decode at batch 1 (transformers, chapter 3's loop, the engine eager, with graphs,
    with torch.compile) and the engine at each batch size: one row per way and batch.
    fast: modes of FAST_MODES to run too (with a bfloat16 row), in turns, each in
    FAST_MODES's dtype and with its head; at the
    larger batches each eagerly and (with compile) fused, in place and compiled.
    compile off a GPU: every engine way at batch 1 also with its decode step compiled
    (compile_decode=True), and each fast mode compiled with its projections fused too
    (fuse_projections=True), fused and with attention_backend="in_place" (where the
    kernel takes the head size), and that with inductor's C++ wrapper, in the same
    turns; compile_s is what compiling took.
    llama_cpp: formats of LLAMA_CPP_KINDS in which llama.cpp runs the same checkpoint
    at batch 1, in the same turns (needs llama-cpp-python and a checkpoint)."""
    from functools import partial

    from minillm.utils import pick_device
    check_perf_args(model, dtype, prompt_tokens, new_tokens, batches, repeats)
    if not set(fast) <= set(FAST_MODES):
        raise ValueError(f"fast={fast!r}: allowed modes {tuple(FAST_MODES)}")
    check_llama_cpp(model, llama_cpp)
    device = pick_device(device)
    dtype = dtype or ("float16" if device.type == "cuda" else "float32")
    ours, hf = model_pair(model, DTYPES[dtype], device)
    n = new_tokens
    if prompt_tokens + n > ours.config.context_length:
        raise ValueError(f"prompt_tokens + new_tokens = {prompt_tokens + n}: more "
                         f"than the context of {ours.config.context_length}")
    prompt = random_prompt(ours.config.vocab_size, prompt_tokens)

    def engine(m, batch, graphs, compiled=False, fused=False, attention=None,
               inductor=None):
        e = LLMEngine(m, max_num_seqs=batch, kv_cache="paged",
                      max_model_len=prompt_tokens + n, cuda_graphs=graphs,
                      compile_decode=compiled, fuse_projections=fused,
                      attention_backend=attention, inductor_compile_config=inductor)
        return partial(engine_run, e, prompt, n, batch, device)
    # --compile off a GPU: each way's decode step compiled too (chapter 7, section 14)
    steps = compile and device.type != "cuda"
    eager, graphs = "engine (ch. 4, 6)", "engine + CUDA graphs (ch. 7)"
    ways = {"transformers generate()": partial(loop_run, transformers_method(hf),
                                               prompt, n, device),
            "KV cache loop (ch. 3)": partial(loop_run, minillm_methods(ours)[1],
                                             prompt, n, device),
            eager: engine(ours, 1, False), graphs: engine(ours, 1, True)}
    if steps:
        ways[COMPILED] = engine(ours, 1, False, True)
    held = {}  # way -> its own model (the bytes it reads differ)
    again = {}  # the fast ways also run at the larger batches: way -> engine settings
    for mode in ([None, *fast] if fast else []):  # chapter 5's fast modes
        label = "bfloat16" if mode is None else FAST_MODES[mode].label(mode)
        where = "ch. 5" if mode is None else FAST_MODES[mode].chapter
        dtype_ = "" if mode is None else f", {str(FAST_MODES[mode].dtype)[6:]}"
        way = f"engine, {label}{dtype_} ({where})"
        held[way] = fast_copy(ours, mode)
        ways[way] = engine(held[way], 1, False)
        again[way] = (held[way], False, False, None)
        if steps:  # the same model, its decode step compiled
            twin = f"engine, {label}, compiled (ch. 7)"
            held[twin], ways[twin] = held[way], engine(held[way], 1, False, True)
            # and with its projections stacked (ch. 7): a copy, as fusing is in place
            fused = f"engine, {label}, fused, compiled (ch. 7)"
            held[fused] = copy.deepcopy(held[way])
            ways[fused] = engine(held[fused], 1, False, True, fused=True)
            if ours.config.head_dim in HEAD_DIMS:  # and attending the pages in place
                in_place = f"engine, {label}, fused, in place, compiled (ch. 7)"
                held[in_place] = held[fused]
                ways[in_place] = engine(held[fused], 1, False, True, fused=True,
                                        attention="in_place")
                again[in_place] = (held[fused], True, True, "in_place")
                # and its kernels called from C++ rather than Python (inductor's
                # cpp_wrapper; compiled apart from the kernels: less compile time)
                cpp = f"engine, {label}, fused, in place, compiled, C++ wrapper (ch. 7)"
                held[cpp] = held[fused]
                ways[cpp] = engine(held[fused], 1, False, True, fused=True,
                                   attention="in_place", inductor=CPP_WRAPPER)
    if llama_cpp:  # the same checkpoint, written as GGUF files; its KV in float16
        folder = bundled_model_path() if model == "bundled" else real_folder(model)
        c = ours.config
        kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * (prompt_tokens + n // 2) * 2
        for kind in llama_cpp:
            ways[f"llama.cpp {kind}"], step = llama_cpp_way(folder, kind, prompt, n)
            held[f"llama.cpp {kind}"] = step + kv
    rows = [{"batch": 1, **r} for r in round_robin(ways, repeats)]
    add_launches(rows, ways, prompt, device)
    del hf, ways                             # transformers' memory goes back first
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for batch in [b for b in batches if b != 1]:
        ways = {eager: engine(ours, batch, False), graphs: engine(ours, batch, True)}
        ways.update({way: engine(m, batch, False, compiled, fused, attention)
                     for way, (m, compiled, fused, attention) in again.items()})
        rows += [{"batch": batch, **r} for r in round_robin(ways, repeats)]
    if compile:
        compile_parts(ours)
        for batch in batches:
            ways = {"engine + graphs + torch.compile": engine(ours, batch, True)}
            done = [{"batch": batch, **r} for r in round_robin(ways, repeats)]
            if batch == 1:
                add_launches(done, ways, prompt, device)
            rows += done
    label = model if model == "bundled" or model in PRESETS else (
        model.rstrip("/").split("/")[-1].removesuffix(".gguf"))  # a checkpoint's name
    return score(rows, ours, device, dtype, label, prompt_tokens, n, repeats, held)


def score(rows, model, device, dtype, name, prompt_tokens, n, repeats,
          held: dict | None = None) -> Result:
    """Add the ratios, the MBU and where and how it was measured to every row (held:
    way -> the model it ran, where not `model`): the result."""
    import transformers
    cuda = device.type == "cuda"
    gpu = peak_for(torch.cuda.get_device_name(device)) if cuda else None
    peak = gpu[0] if gpu else measure_bandwidth(device)
    held = held or {}
    base = {r["way"]: r for r in rows if r["batch"] == 1}
    reference = base["transformers generate()"]
    reference_ms, reference_ids = reference["ms_per_token"], reference["ids"]
    info = {"model": name, "dtype": dtype, "device": device.type,
            "hardware": hardware_name(device), "torch": torch.__version__,
            "transformers": transformers.__version__, "prompt_tokens": prompt_tokens,
            "new_tokens": n, "repeats": repeats,
            "peak_GB_per_s": round(peak / 1e9, 1),
            "peak_from": "data sheet" if gpu else "measured copy"}
    for r in rows:
        r.setdefault("tokens_per_s", r["batch"] * 1e3 / r["ms_per_token"])
        one = base.get(r["way"])
        r["x_batch_1"] = r["tokens_per_s"] / one["tokens_per_s"] if one else None
        if r["batch"] == 1:
            r["x_transformers"] = reference_ms / r["ms_per_token"]
            h = held.get(r["way"], model)  # a model, or the bytes (llama.cpp)
            step_bytes = h if isinstance(h, int) else decode_bytes(
                h, context=prompt_tokens + n // 2)
            r["MBU"] = mbu(step_bytes, r["ms_per_token"] / 1e3, peak)
            r["same_tokens_as_transformers"] = agreement(r["ids"], reference_ids)
        r.pop("ids", None)
        r.update(info)  # every row says where it ran, also read back from its CSV
    return Result(rows, info, kind="decode", key="way", digits=None, work=(
        f"{prompt_tokens}-token prompt + {n} new tokens, median of {repeats}"))


COLUMNS = [("way", "way", "{}"), ("batch", "batch", "{:.0f}"),
           ("ms_per_token", "ms/token", "{:.2f}"),
           ("tokens_per_s", "tokens/s", "{:.1f}"),
           ("x_transformers", "x HF", "{:.2f}"), ("x_batch_1", "x b1", "{:.1f}"),
           ("MBU", "MBU", "{:.0%}"),
           ("same_tokens_as_transformers", "same ids", "{:.0f}")]
LAUNCHES = ("kernel_launches_per_step", "kernels", "{:.0f}")


def format_table(rows: list[dict]) -> str:
    """A text table that fits 88 columns; rows may come back from the CSV file."""
    def cell(v, f):
        return "-" if v is None or v != v else f.format(v)  # v != v: NaN
    columns = COLUMNS + [LAUNCHES] * any(  # on a GPU: kernels launched per step
        (r.get("kernel_launches_per_step") or 0) > 0 for r in rows)
    cells = [[h for _, h, _ in columns]] + [
        [cell(r.get(c), f) for c, _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [" ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
             for row in cells]
    i = rows[0]
    return "\n".join([
        f"{i['model']}, {i['dtype']}, {i['hardware']}, torch {i['torch']}",
        f"{i['prompt_tokens']}-token prompt + {i['new_tokens']} new tokens, median of "
        f"{i['repeats']}; peak {i['peak_GB_per_s']} GB/s ({i['peak_from']})",
        "x HF: speed-up over transformers; x b1: tokens/s over batch 1",
        "same ids: how many tokens equal transformers' tokens",
        *["kernels: CUDA kernels one decode step launches"] * (LAUNCHES in columns),
        *lines])


def decode_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench decode",
                                     description=BENCHMARKS["decode"])
    llamas = sorted(p for p in PRESETS if PRESETS[p]["model_type"] == "llama")
    parser.add_argument("--model", default="bundled",
                        help=f"bundled | {' | '.join(llamas)} (random weights)")
    parser.add_argument("--dtype", default=None, help="default: float16 on a GPU, "
                        "float32 on a CPU")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1],
                        help="batch sizes of the engine, e.g. 1 64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="also the engine + graphs with torch.compile; off a GPU "
                        "also each engine way's decode step compiled (chapter 7, "
                        "section 14), e.g. --compile --fast int8 int4")
    parser.add_argument("--fast", nargs="+", default=[], choices=tuple(FAST_MODES),
                        help="also the fast modes, at every batch size (chapter 5's "
                        "int8 and int4 with an int8 LM head in bfloat16; chapter 7's "
                        "int8-a8 and int4-a8 with an int8-a8 head in blocks of 32, in "
                        "float32), e.g. --fast int8 int4 int8-a8 int4-a8")
    parser.add_argument("--llama-cpp", nargs="+", default=[], choices=LLAMA_CPP_KINDS,
                        help="also llama.cpp on the same checkpoint in these formats, "
                        "in the same turns (needs pip install llama-cpp-python), e.g. "
                        "--llama-cpp F32 Q8_0 Q4_0")
    add_run_arguments(parser)
    return parser


def check_decode_args(args: argparse.Namespace) -> torch.device:
    """Every argument, checked before any work. Returns the device."""
    check_perf_args(args.model, args.dtype, args.prompt_tokens, args.new_tokens,
                    tuple(args.batch), args.repeats)
    check_llama_cpp(args.model, tuple(args.llama_cpp))
    return check_run_arguments(args)


def run_decode_command(args: argparse.Namespace, device) -> tuple:
    result = run_perf_benchmark(args.model, device, args.dtype, args.prompt_tokens,
                                args.new_tokens, tuple(args.batch), args.repeats,
                                args.compile, tuple(args.fast), tuple(args.llama_cpp))
    return format_table(result.rows), result.write  # decode_<model>_<device>.csv


main = command(decode_parser, check_decode_args, run_decode_command)
