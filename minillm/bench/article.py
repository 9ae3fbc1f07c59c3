"""The source article's task (chapter 7, section 12): a 7B instruct model in INT8
with paged KV, the first token of a 128-token prompt in at most 200 ms, in at most 8 GB
of GPU memory as nvidia-smi counts it. Chapter 7 imports the targets, `article_task` and
`format_task` from here; `python -m minillm.bench article -h` runs it as a command."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from .cli import (BENCHMARKS, add_run_arguments, check_run_arguments,
                               command)
from .measure import hardware_name, in_turns, random_prompt
from .results import file_stem, rows_table, write_csvs
from ..memory import PRESETS, parameter_count

__all__ = ["SEVEN_B", "TARGETS", "gpu_memory_used", "int8_bytes", "chat_prompt",
           "random_model", "article_task", "format_task", "article_parser",
           "run_article", "main"]


SEVEN_B = "Qwen/Qwen2.5-7B-Instruct"  # the 7B instruct model the chapter asks for
TARGETS = {"gpu_GB": 8.0, "first_token_s": 0.200}  # the article's need


def gpu_memory_used(device) -> int | None:
    """Bytes in use on the GPU as nvidia-smi counts them: total - free, so the CUDA
    context, the allocator's reserve and other processes are in. None on a CPU."""
    if torch.device(device).type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def int8_bytes(config: dict) -> int:
    """Bytes of a Llama-family model's weights in this engine's INT8: one byte per
    weight of the linear layers (their float16 scales are a rounding error here),
    the embedding and the LM head in float16."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    tables = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    linear = parameter_count(config) - tables  # norms are a rounding error here
    return linear + tables * 2


def chat_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A question in the model's chat template, padded with a passage to `n_tokens`
    (or just under); random ids when there is no tokenizer (random weights)."""
    if tokenizer is None or tokenizer.chat_template is None:
        return random_prompt(len(tokenizer) if tokenizer else 32000, n_tokens)
    passage = ("The river rose in the spring and the town moved its market to the "
               "hill, where the old mill stood. ") * 40
    words = passage.split()

    def ids(k: int) -> list[int]:
        text = (" ".join(words[:k])
                + "\n\nIn one sentence: where did the market move?")
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True)
    low, high = 0, len(words)  # the most words whose prompt still fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(ids(mid)) <= n_tokens else (low, mid - 1)
    return ids(low)


def random_model(preset: str, device, dtype, quantization: str | None):
    """A random model of a PRESETS shape, built on the device and quantized layer by
    layer; the float copy's memory goes back to the driver before anything is read."""
    from minillm.model.config import ModelConfig
    from minillm.model.transformer import Transformer
    from minillm.quant.int8 import quantize
    config = ModelConfig.from_hf(dict(PRESETS[preset]))
    with torch.device(device):
        net = Transformer(config).to(dtype).eval()
    if quantization is not None:
        quantize(net, quantization)  # the same layers as load_model(quantization=)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return net


def article_task(model: str | Path = SEVEN_B, device=None, prompt_tokens: int = 128,
                 max_model_len: int = 1024, quantization: str = "int8",
                 repeats: int = 3) -> dict:
    """Load `model` (a Hub name, folder or .gguf; or a Llama preset of PRESETS:
    random weights) in `quantization`, with a paged KV pool of `max_model_len`
    tokens; time the first token of a `prompt_tokens` chat prompt (the median of
    `repeats`, after a warm-up) and read the GPU memory in use. Both are reported
    against the article's need."""
    from minillm.engine import LLMEngine
    from minillm.model.loader import check_quantization, load_model
    from minillm.model.sources import resolve_folder
    from minillm.sampling import SamplingParams
    from minillm.tokenizer import Tokenizer
    from minillm.utils import pick_device
    for name, value in [("prompt_tokens", prompt_tokens), ("repeats", repeats),
                        ("max_model_len", max_model_len)]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")
    if max_model_len <= prompt_tokens:
        raise ValueError(f"max_model_len={max_model_len} must exceed prompt_tokens="
                         f"{prompt_tokens} (the prompt and its first token)")
    check_quantization(quantization)
    device = pick_device(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if str(model) in PRESETS:  # random weights of the shape, made on the device
        net, tok = random_model(str(model), device, dtype, quantization), None
    else:
        folder = resolve_folder(model)
        net = load_model(folder, dtype=dtype, device=device,
                         quantization=quantization)
        tok = (Tokenizer.from_pretrained(folder)
               if (folder / "tokenizer.json").is_file() else None)
    engine = LLMEngine(net, tok, max_num_seqs=1, max_model_len=max_model_len,
                       kv_cache="paged")
    prompt = chat_prompt(tok, prompt_tokens)
    first = SamplingParams(temperature=0, max_tokens=1)

    def first_token() -> float:
        rid = engine.add_request(prompt, first)
        while engine.has_unfinished():
            engine.step()  # returns once the token is on the CPU: synchronized
        return engine.pop(rid).ttft

    times = in_turns({"ttft": first_token}, repeats, warm_up={"ttft": first_token})
    answer = ""
    if tok is not None:
        rid = engine.add_request(prompt, SamplingParams(temperature=0,
                                                        max_tokens=16))
        while engine.has_unfinished():
            engine.step()
        answer = engine.pop(rid).text
    used = gpu_memory_used(device)
    ttft = statistics.median(times["ttft"])
    weights = sum(t.nbytes for t in [*net.parameters(), *net.buffers()])
    return {"model": str(model), "device": device.type,
            "hardware": hardware_name(device), "torch": torch.__version__,
            "quantization": quantization,
            "dtype": str(dtype).removeprefix("torch."),
            "weights_GB": weights / 1e9, "kv_pool_GB": engine.kv.nbytes / 1e9,
            "gpu_used_GB": None if used is None else used / 1e9,
            "prompt_tokens": len(prompt), "first_token_s": ttft,
            "first_token_ok": ttft <= TARGETS["first_token_s"],
            "memory_ok": None if used is None else used / 1e9 <= TARGETS["gpu_GB"],
            "answer": answer}


def format_task(r: dict) -> str:
    """The result in a few lines, each against its target."""
    ok = {True: "meets", False: "misses"}
    limit = f"<= {TARGETS['gpu_GB']:.0f} GB"
    memory = (f"GPU memory: not measured on a CPU (target {limit})"
              if r["gpu_used_GB"] is None else f"GPU memory in use: "
              f"{r['gpu_used_GB']:.2f} GB: {ok[r['memory_ok']]} {limit}")
    return "\n".join([
        f"{r['model']} in {r['quantization']} ({r['dtype']}) on {r['hardware']}",
        f"weights {r['weights_GB']:.2f} GB, KV pool {r['kv_pool_GB']:.3f} GB",
        memory,
        f"first token of a {r['prompt_tokens']}-token prompt: "
        f"{r['first_token_s'] * 1e3:.0f} ms: {ok[r['first_token_ok']]} "
        f"<= {TARGETS['first_token_s'] * 1e3:.0f} ms",
        f"answer: {r['answer']!r}" if r["answer"] else "answer: (random weights)"])


def article_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench article",
                                     description=BENCHMARKS["article"])
    parser.add_argument("--model", default=SEVEN_B,
                        help="a Hub name, folder or .gguf file; or a Llama "
                             "preset such as Llama-2-7B (random weights)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--repeats", type=int, default=3)
    add_run_arguments(parser)
    return parser


def run_article(args, device):
    result = article_task(args.model, device, args.prompt_tokens,
                          args.max_model_len, args.quantization, args.repeats)
    stem = file_stem("article", Path(str(args.model)).name, device.type)
    return format_task(result), lambda out: write_csvs(out, {
        stem: rows_table([result])})


main = command(article_parser, check_run_arguments, run_article)
