"""Chapter 5's benchmark: bytes, speed, peak memory and quality (perplexity, agreement
with float32) of each way to hold one model (float32, float16, w8a16, w8a8, fbgemm,
bnb-int8), and the 7B check (--seven-b). Chapter 5 shows its recorded runs;
`python -m minillm.bench quant --help` runs it."""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

import minillm
from .cli import (BENCHMARKS, add_run_arguments, check_run_arguments,
                               command)
from .folders import (MODELS, cached_build, model_folder, model_label,
                                   random_model_folder, source_hash)
from .measure import (Method, check_counts, check_fits, greedy, hardware_name,
                      in_turns, measure, random_prompt)
from .results import Result, file_stem, rows_table, write_csvs
from .workloads import heldout_ids, shakespeare_missing
from ..generate import generate
from ..kv.contiguous import KVCache
from ..memory import PRESETS
from ..model.config import ModelConfig
from ..model.loader import load_model
from ..quant.int8 import (FbgemmLinear, bnb_missing, fbgemm_missing, perplexity,
                           quantize)
from ..utils import pick_device, synchronize

__all__ = ["QUANT_MODES", "mode_missing", "is_bnb", "layer_nbytes", "swapped_layers",
           "linear_nbytes", "float16_nbytes", "model_nbytes", "quiet",
           "check_quant_args", "load_modes", "quality",
           "run_quant_benchmark", "timed", "summarise_mode", "size_first",
           "quant_info", "SEVEN_B_TARGETS", "hf_names", "sharded_random_folder",
           "seven_b_check", "format_quant_table", "write_quant_csv",
           "quant_parser", "quant_model_folder", "check_cli_args", "run_quant_command",
           "main"]


QUANT_MODES = ("float32", "float16", "w8a16", "w8a8", "fbgemm", "bnb-int8")


def mode_missing(mode: str, device: torch.device) -> str | None:
    """Why `mode` cannot run on `device` (None: it can)."""
    if mode == "fbgemm":
        if device.type != "cpu":
            return f"fbgemm runs on the CPU only, not on {device.type}"
        return fbgemm_missing()
    if mode == "bnb-int8":
        return bnb_missing()
    return None


def is_bnb(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Linear8bitLt"


def layer_nbytes(module: torch.nn.Module) -> int:
    """Bytes a linear layer stores: weight, scales and bias (float, ours or bnb's)."""
    if isinstance(module, FbgemmLinear):  # its packed weight is not in the state_dict
        return module.nbytes()
    return sum(t.nbytes for t in module.state_dict().values()
               if isinstance(t, torch.Tensor))


def swapped_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The layers quantize() swaps (every linear layer but lm_head), in any mode."""
    kinds = (torch.nn.Linear, FbgemmLinear, minillm.quant.int8.Int8Linear)
    return {name: m for name, m in model.named_modules()
            if (isinstance(m, kinds) or is_bnb(m))
            and name.rsplit(".", 1)[-1] != "lm_head"}


def linear_nbytes(model: torch.nn.Module) -> int:
    """Bytes of the swapped layers, scales and biases included."""
    return sum(layer_nbytes(m) for m in swapped_layers(model).values())


def float16_nbytes(model: torch.nn.Module) -> int:
    """Bytes the swapped layers of a float model would take in float16."""
    return sum(2 * (m.weight.numel() + (m.bias.numel() if m.bias is not None else 0))
               for m in swapped_layers(model).values())


def model_nbytes(model: torch.nn.Module) -> int:
    """Bytes of the whole model: parameters, buffers and the int8 layers' storage.
    A tensor shared by two modules (tied embeddings) counts once."""
    tensors, extra = {}, 0
    for m in model.modules():
        if isinstance(m, FbgemmLinear):
            extra += m.nbytes()
            continue
        own = (m.state_dict().values() if is_bnb(m)
               else [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        for t in own:
            if isinstance(t, torch.Tensor):
                tensors[(t.device, t.data_ptr())] = t.nbytes
    return sum(tensors.values()) + extra


@contextmanager
def quiet():
    """Silence the float16-on-CPU warning and bitsandbytes' cast message."""
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)  # it logs 'inputs will be cast' at every call
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="float16 on CPU")
            yield
    finally:
        logger.setLevel(level)


def check_quant_args(model_path, modes, new_tokens, prompt_tokens, repeats, device
                     ) -> tuple[ModelConfig, tuple[str, ...], torch.device, dict]:
    """Every argument, checked before any work.
    Returns (config, modes to run, device, {skipped mode: why})."""
    check_counts(new_tokens, prompt_tokens, repeats)
    names = (modes,) if isinstance(modes, str) else modes
    if (not isinstance(names, (tuple, list)) or not names
            or not all(isinstance(m, str) and m in QUANT_MODES for m in names)
            or len(set(names)) != len(names)):
        raise ValueError(f"modes={modes!r}: a tuple of different names from "
                         f"{QUANT_MODES}")
    device = pick_device(device)
    config = ModelConfig.from_hf(model_path)  # a bad folder fails here, before loading
    check_fits(config, new_tokens, prompt_tokens)
    why = {m: reason for m in names if (reason := mode_missing(m, device))}
    if why and tuple(names) != QUANT_MODES:
        mode, reason = next(iter(why.items()))
        raise ValueError(f"modes={tuple(names)}: {mode!r} cannot run here: {reason}")
    kept = tuple(m for m in names if m not in why)
    if not kept:
        raise ValueError(f"modes={tuple(names)}: none can run on {device.type}")
    return config, kept, device, why


def load_modes(model_path, modes, device, bar) -> tuple[dict, torch.nn.Module]:
    """{mode: model} and the float32 reference. The quantized modes quantize a copy of
    the float model (float32 on a CPU, float16 on a GPU)."""
    reference = load_model(model_path, dtype=torch.float32, device=device)
    base = reference
    if device.type != "cpu" and any(m not in ("float32", "float16") for m in modes):
        base = load_model(model_path, dtype=torch.float16, device=device)
    models = {}
    for mode in modes:
        bar.set_description(f"loading {mode}")
        if mode == "float32":
            models[mode] = reference
        elif mode == "float16":
            models[mode] = load_model(model_path, dtype=torch.float16, device=device)
        else:
            models[mode] = quantize(copy.deepcopy(base), mode)
        bar.update(1)
    return models, reference


@torch.no_grad()
def quality(model, ids: torch.Tensor, ref_next: torch.Tensor,
            text_ids, window: int) -> tuple[float, float]:
    """(next-token agreement with float32 on `ids`, perplexity of `text_ids`)."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    agree = (model(ids, positions).argmax(-1) == ref_next).float().mean().item()
    ppl = float("nan") if text_ids is None else perplexity(model, text_ids, window)
    return agree, ppl


def run_quant_benchmark(model_path, modes: tuple[str, ...] = QUANT_MODES,
                        new_tokens: int = 32, prompt_tokens: int = 64,
                        repeats: int = 3, device: str | torch.device | None = None,
                        progress: bool = True) -> Result:
    """Bytes, speed, peak memory and quality of each mode; see the appendix of
    Chapter 5. The full list of modes (the default) skips those that cannot run here
    and names them in info["skipped"]; a shorter list must run whole."""
    config, modes, device, skipped = check_quant_args(
        model_path, modes, new_tokens, prompt_tokens, repeats, device)
    has_text = shakespeare_missing(model_path) is None
    corpus = heldout_ids(str(model_path)) if has_text else None
    n_agree = min(512, config.context_length)
    agree_ids = (list(corpus[:n_agree]) if has_text
                 else random_prompt(config.vocab_size, n_agree, seed=1))
    text_ids = list(corpus[:4096]) if has_text else None
    window = min(256, config.context_length)
    prompt = random_prompt(config.vocab_size, prompt_tokens)
    steps = len(modes) * (2 + repeats)
    with quiet(), tqdm(total=steps, disable=not progress) as bar:
        models, reference = load_modes(model_path, modes, device, bar)
        ids = torch.tensor([agree_ids], device=device)
        with torch.no_grad():
            ref_next = reference(ids, torch.arange(n_agree, device=device)[None])
            ref_next = ref_next.argmax(-1)
        rows = {}
        for mode, model in models.items():
            bar.set_description(f"quality {mode}")
            agree, ppl = quality(model, ids, ref_next, text_ids, window)
            rows[mode] = {"mode": mode, "agreement": agree, "perplexity": ppl}
            bar.update(1)
        bar.set_description("timing, the modes in turns")
        times = in_turns(
            {m: partial(measure, timed(m, x), prompt, new_tokens, device)
             for m, x in models.items()}, repeats, after=lambda *_: bar.update(1),
            warm_up={m: partial(measure, timed(m, x), prompt, min(new_tokens, 4),
                                device) for m, x in models.items()})
    fp16 = float16_nbytes(reference)
    for mode, model in models.items():
        rows[mode].update(summarise_mode(model, times[mode], fp16, device))
    result = [size_first(rows[m]) for m in modes]
    base = result[0]
    for r in result:
        r["speedup"] = base["per_token_ms"] / r["per_token_ms"]
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        r["same_tokens"] = times[r["mode"]][0].tokens == times[base["mode"]][0].tokens
    info = quant_info(reference, model_path, device, prompt_tokens, new_tokens,
                      repeats, skipped, has_text, len(text_ids or ()), n_agree)
    return Result(result, info, kind="quant", key="mode", work=(
        f"{prompt_tokens}-token prompt + {new_tokens} new tokens, median of {repeats}"))


def timed(mode: str, model) -> Method:
    """Chapter 3's generate with a KV cache of exactly the needed size."""
    def run(prompt, n):
        cache = KVCache.from_model(model, len(prompt) + n)
        return generate(model, prompt, greedy(n), cache=cache), cache.nbytes
    return Method(mode, model, run)


def summarise_mode(model, ms, fp16_bytes: int, device) -> dict:
    """Bytes, medians of the timings, and the peak memory (GPU only)."""
    params = {p.data_ptr(): p.nbytes for p in model.parameters()}
    total = model_nbytes(model)
    peak = None  # measure() gives params + peak extra on a GPU; we want all bytes
    if device.type == "cuda":
        extra = max(m.memory_bytes for m in ms) - sum(params.values())
        peak = (total + extra) / 2**20
    per_token = statistics.median(m.per_token_s for m in ms)
    return {"linear_MiB": linear_nbytes(model) / 2**20,
            "linear_vs_fp16": linear_nbytes(model) / fp16_bytes,
            "model_MiB": total / 2**20,
            "ttft_ms": statistics.median(m.ttft_s for m in ms) * 1e3,
            "per_token_ms": per_token * 1e3, "tok_s": 1 / per_token,
            "peak_MiB": peak}


def size_first(row: dict) -> dict:
    order = ("mode", "linear_MiB", "linear_vs_fp16", "model_MiB", "ttft_ms",
             "per_token_ms", "tok_s", "peak_MiB", "perplexity", "agreement")
    return {k: row[k] for k in order}


def quant_info(model, model_path, device, prompt_tokens, new_tokens, repeats,
               skipped, has_text, ppl_tokens, agree_tokens) -> dict:
    """The facts a result file needs to explain itself."""
    c = model.config
    params = {id(p): p.numel() for p in model.parameters()}  # tied weights once
    return {"model": Path(model_path).name, "device": device.type,
            "hardware": hardware_name(device), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "minillm": minillm.__version__,
            "python": sys.version.split()[0],
            "base_dtype": "float32" if device.type == "cpu" else "float16",
            "params_M": round(sum(params.values()) / 1e6, 1), "layers": c.num_layers,
            "hidden": c.hidden_size, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "repeats": repeats,
            "perplexity_tokens": ppl_tokens if has_text else 0,
            "agreement_tokens": agree_tokens,
            "agreement_on": "held-out tokens" if has_text else "random token ids",
            "skipped": "; ".join(f"{m}: {why}" for m, why in skipped.items())}


SEVEN_B_TARGETS = {"memory_bytes": 8e9, "ttft_s": 0.2}  # 8 GB, 0.2 s


def hf_names(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Hugging Face Llama checkpoint."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    names = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        names += [(f"{p}.self_attn.q_proj.weight", (q, h)),
                  (f"{p}.self_attn.k_proj.weight", (kv, h)),
                  (f"{p}.self_attn.v_proj.weight", (kv, h)),
                  (f"{p}.self_attn.o_proj.weight", (h, q)),
                  (f"{p}.mlp.gate_proj.weight", (inter, h)),
                  (f"{p}.mlp.up_proj.weight", (inter, h)),
                  (f"{p}.mlp.down_proj.weight", (h, inter)),
                  (f"{p}.input_layernorm.weight", (h,)),
                  (f"{p}.post_attention_layernorm.weight", (h,))]
    names.append(("model.norm.weight", (h,)))
    if not config["tie_word_embeddings"]:
        names.append(("lm_head.weight", (config["vocab_size"], h)))
    return names


def sharded_random_folder(preset: str = "Llama-2-7B", folder: str | Path | None = None,
                          shard_bytes: int = 10**9, seed: int = 0) -> Path:
    """A random float16 Llama of a preset's shape, in shards of <= `shard_bytes`
    (a tensor larger than that gets a shard of its own), with the index file.
    Tensors are made one at a time: memory holds at most one shard. Built once, then
    reused from `folder` (default: the temp directory) while it matches what it was
    built from (Chapter 3's `cached_build`)."""
    from safetensors.torch import save_file
    if preset not in PRESETS or PRESETS[preset]["model_type"] != "llama":
        llamas = sorted(p for p in PRESETS if PRESETS[p]["model_type"] == "llama")
        raise ValueError(f"preset={preset!r}; allowed (Llama shapes): {llamas}")
    config = {**PRESETS[preset], "architectures": ["LlamaForCausalLM"],
              "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "bos_token_id": 0,
              "eos_token_id": 0, "torch_dtype": "float16", "hidden_act": "silu"}
    names = hf_names(config)
    shards, shard, size = [], {}, 0
    for name, shape in names:  # group the tensors into shards, in order
        nbytes = math.prod(shape) * 2
        if shard and size + nbytes > shard_bytes:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = shape
        size += nbytes
    shards.append(shard)

    def build(path: Path) -> None:
        g = torch.Generator().manual_seed(seed)
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, 1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, shape in shard.items():
                if name.endswith("norm.weight"):
                    tensors[name] = torch.ones(shape, dtype=torch.float16)
                else:
                    tensors[name] = torch.empty(shape, dtype=torch.float16).normal_(
                        0, 0.02, generator=g)
                weight_map[name] = file
                total += tensors[name].nbytes
            save_file(tensors, path / file, metadata={"format": "pt"})
            del tensors  # the next shard starts from nothing
        (path / "config.json").write_text(json.dumps(config, indent=2))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    recipe = {"config": config, "seed": seed, "shard_bytes": shard_bytes,
              "torch": torch.__version__, "code": source_hash(sharded_random_folder)}
    return cached_build(f"minillm-sharded-{preset.lower()}", recipe, build, folder)


def seven_b_check(device: str | torch.device = "cuda", preset: str = "Llama-2-7B",
                  prompt_tokens: int = 128, kv_tokens: int = 1024,
                  folder: str | Path | None = None, repeats: int = 3) -> dict:
    """Load a random checkpoint of `preset`'s shape in INT8 (quantize on load), with a
    KV cache of `kv_tokens`; time the first token of a `prompt_tokens` prompt. Reports
    the peak GPU memory (None on a CPU) and whether the 8 GB / 0.2 s targets are met."""
    check_counts(2, prompt_tokens, repeats)
    if (isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int)
            or kv_tokens <= prompt_tokens):
        raise ValueError(f"kv_tokens={kv_tokens!r}: must be an int > prompt_tokens="
                         f"{prompt_tokens} (the prompt and the first new token)")
    device = pick_device(device)
    if preset not in PRESETS or PRESETS[preset]["model_type"] != "llama":
        sharded_random_folder(preset)  # raises the ValueError that names the presets
    if kv_tokens > PRESETS[preset]["max_position_embeddings"]:
        raise ValueError(f"kv_tokens={kv_tokens} exceeds {preset}'s context of "
                         f"{PRESETS[preset]['max_position_embeddings']}")
    folder = sharded_random_folder(preset, folder)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with quiet():
        model = load_model(folder, dtype=torch.float16, device=device,
                           quantization="int8")
    cache = KVCache.from_model(model, kv_tokens)
    prompt = random_prompt(model.config.vocab_size, prompt_tokens)
    def first_token() -> float:
        synchronize(device)
        start = time.perf_counter()
        generate(model, prompt, greedy(1), cache=cache)  # returns ints: synced
        return time.perf_counter() - start

    ttft = statistics.median(in_turns({"ttft": first_token}, repeats,
                                      warm_up={"ttft": first_token})["ttft"])
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    weights = model_nbytes(model)
    return {"preset": preset, "device": device.type, "hardware": hardware_name(device),
            "torch": torch.__version__, "quantization": "int8 (w8a16, on load)",
            "int8_layers": sum(isinstance(m, minillm.quant.int8.Int8Linear)
                               for m in model.modules()),
            "weights_GB": weights / 1e9, "kv_cache_GB": cache.nbytes / 1e9,
            "peak_GB": None if peak is None else peak / 1e9,
            "ttft_s": ttft, "prompt_tokens": prompt_tokens, "kv_tokens": kv_tokens,
            "memory_ok": None if peak is None
            else peak <= SEVEN_B_TARGETS["memory_bytes"],
            "ttft_ok": ttft <= SEVEN_B_TARGETS["ttft_s"], "folder": str(folder)}


def format_quant_table(result: Result) -> str:
    """The rows as aligned text: bytes, then speed, then quality."""
    head = (f"{'mode':<10}{'linear MiB':>11}{'x fp16':>8}{'model MiB':>10}"
            f"{'TTFT ms':>9}{'ms/token':>10}{'speed-up':>9}{'peak MiB':>10}"
            f"{'perplexity':>11}{'agreement':>10}")
    lines = [result.describe(), head]
    for r in result.rows:
        peak = "-" if r["peak_MiB"] is None else f"{r['peak_MiB']:.1f}"
        lines.append(
            f"{r['mode']:<10}{r['linear_MiB']:>11.2f}{r['linear_vs_fp16']:>8.3f}"
            f"{r['model_MiB']:>10.1f}{r['ttft_ms']:>9.2f}{r['per_token_ms']:>10.2f}"
            f"{r['speedup']:>8.2f}x{peak:>10}{r['perplexity']:>11.4f}"
            f"{r['agreement']:>10.1%}")
    first = result.rows[0]["mode"]
    lines.append(f"x fp16: the swapped layers against the same layers in float16; "
                 f"speed-up: per-token time against {first}; agreement: next tokens "
                 f"equal to float32's on {result.info['agreement_tokens']} "
                 f"{result.info['agreement_on']}")
    if result.info["skipped"]:
        lines.append(f"skipped: {result.info['skipped']}")
    return "\n".join(lines)


def write_quant_csv(result: Result, folder: str | Path) -> list[Path]:
    """<folder>/quant_<model>_<device>.csv: one row per mode, with `info`."""
    return result.write(folder)


def quant_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minillm.bench quant",
        description=BENCHMARKS["quant"])
    parser.add_argument("--model", default="bundled",
                        help=f"{' | '.join(MODELS)} | a preset like SmolLM2-135M "
                             "(random weights) | a model folder")
    parser.add_argument("--modes", nargs="+", choices=QUANT_MODES,
                        default=list(QUANT_MODES),
                        help="default: all that can run here")
    parser.add_argument("--new-tokens", type=int, default=32, help="at least 2")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="at least 1")
    parser.add_argument("--repeats", type=int, default=3, help="at least 1")
    parser.add_argument("--seven-b", action="store_true",
                        help="check the 7B claim instead: a random INT8 model of "
                             "--preset's shape, peak GPU memory and TTFT")
    parser.add_argument("--preset", default="Llama-2-7B",
                        help="the shape for --seven-b (default Llama-2-7B)")
    add_run_arguments(parser)
    return parser


def quant_model_folder(name: str) -> Path:
    """'bundled', 'smollm2-135m', a preset name (random weights), or a model folder."""
    if name in PRESETS and not (Path(name) / "config.json").is_file():
        return random_model_folder(name)
    return model_folder(name)


def check_cli_args(args: argparse.Namespace) -> tuple[Path | None, torch.device]:
    """Every argument, checked before any work. Returns (model folder, device)."""
    device = check_run_arguments(args)
    if args.seven_b:
        llamas = [p for p in PRESETS if PRESETS[p]["model_type"] == "llama"]
        if args.preset not in llamas:
            raise ValueError(f"--preset={args.preset!r}; allowed: {llamas}")
        return None, device
    check_counts(args.new_tokens, args.prompt_tokens, args.repeats)
    if args.model in PRESETS and PRESETS[args.model]["model_type"] != "llama":
        raise ValueError(f"--model={args.model!r} is not a Llama shape; random "
                         "weights are made for Llama shapes only")
    folder = quant_model_folder(args.model)
    check_quant_args(folder, tuple(args.modes), args.new_tokens, args.prompt_tokens,
                     args.repeats, device)
    return folder, device


def run_quant_command(args: argparse.Namespace, checked) -> tuple:
    folder, device = checked
    if args.seven_b:
        check = seven_b_check(device, args.preset)
        table = "\n".join(f"{k:>14}: {v}" for k, v in check.items())
        stem = file_stem("quant_check", args.preset, check["device"])
        return table, lambda out: write_csvs(out, {stem: rows_table([check])})
    result = run_quant_benchmark(folder, tuple(args.modes), args.new_tokens,
                                 args.prompt_tokens, args.repeats, device)
    result.info["model"] = (args.model if args.model in PRESETS
                            else model_label(args.model, folder))
    return format_quant_table(result), lambda out: write_quant_csv(result, out)


main = command(quant_parser, check_cli_args, run_quant_command)
