"""Every combination of dtype, quantization, compile_decode, fuse_projections,
attention_backend and inductor settings that the README or a chapter names runs a step
through LLM(...), and gives the tokens of its eager twin (the same dtype and
quantization, no compiling, nothing fused); the one combination PyTorch's compiler
cannot build (chapter 5's fused int8 or int4 layers in a float32 model, compiled) is
refused with a clear message: by LLM(folder) before a weight is read, by LLMEngine(model)
before anything compiles."""
from __future__ import annotations

import time

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.perf.cpu_defaults import CPP_WRAPPER
from minillm.engine import LLMEngine
from minillm.model.loader import load_model
from minillm.perf.dtype_auto import cpu_bf16_features
from minillm.utils import bundled_model_path

torch.set_num_threads(1)
FAST = dict(compile_decode=True, fuse_projections=True, attention_backend="in_place")
COMBINATIONS = {  # name: (LLM's load arguments, its engine options)
    "float32, compiled": ({}, dict(compile_decode=True)),
    "float32, compiled, fused, in place": ({}, FAST),  # the lossless fast path
    "float32, all of that, C++ wrapper": ({}, dict(FAST,
                                                   inductor_compile_config=CPP_WRAPPER)),
    "auto, int8, compiled": (dict(dtype="auto", quantization="int8"),
                             dict(compile_decode=True)),
    "auto, int4, compiled": (dict(dtype="auto", quantization="int4"),
                             dict(compile_decode=True)),
    "bfloat16, int8, compiled, fused": (dict(dtype="bfloat16", quantization="int8"),
                                        dict(compile_decode=True,
                                             fuse_projections=True)),
    "float32, int8-a8, fast path": (dict(dtype="float32", quantization="int8-a8"), FAST),
    "float32, int4-a8, fast path": (dict(dtype="float32", quantization="int4-a8"), FAST),
    "float32, int8-a8-tiles, fast path": (dict(dtype="float32",
                                               quantization="int8-a8-tiles"), FAST),
}
TINY = str(bundled_model_path())  # head_dim 32: the in-place kernel takes it
PROMPTS = [[1, 5, 9, 13, 17], [1, 30, 31, 32]]


def tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_each_documented_combination_runs_to_its_eager_twins_tokens(name):
    load, options = COMBINATIONS[name]
    common = dict(max_num_seqs=2, max_model_len=64, **load)
    twin = tokens(LLM(TINY, **common))
    llm = LLM(TINY, **common, **options)
    assert tokens(llm) == twin
    assert llm.engine.runner.forward.compile_seconds > 0  # it compiled a step


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_fused_int_layers_in_float32_compiled_are_refused_before_loading(
        quantization, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("a weight was read before the refusal")
    monkeypatch.setattr("minillm.model.loader.load_model", no_load)
    with pytest.raises(ValueError, match=rf"compile_decode: quantization='{quantization}'"
                       r" in a float32 model.*dtype='bfloat16'"):
        LLM(TINY, dtype="float32", quantization=quantization, max_model_len=64,
            compile_decode=True)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_loaded_float32_model_with_them_is_refused_before_compiling(mode):
    """LLMEngine(model) has no folder to check first: it refuses before compiling."""
    model = load_model(TINY, dtype=torch.float32, quantization=mode)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"compile_decode: layers\.0\.\S+ is chapter "
                       r"5's fused \w+ in a float32 model.*dtype='bfloat16'"):
        LLMEngine(model, max_num_seqs=2, max_model_len=64, compile_decode=True)
    assert time.perf_counter() - start < 10  # no compile (30 s or more)


def test_auto_with_int8_loads_bfloat16_where_the_cpu_has_it():
    llm = LLM(TINY, dtype="auto", quantization="int8", max_model_len=64)
    assert llm.engine.model.embed_tokens.weight.dtype == (
        torch.bfloat16 if cpu_bf16_features() else torch.float32)
