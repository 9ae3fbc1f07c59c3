"""Issue 73, item 1: fast by default. On a CPU, LLM(folder) and serve add appendix 7d's
rule's options (the compiled step, fused projections, pages in place, the C++ wrapper) to
a float32 model of at least 50 M parameters on the paged cache, say so in one line, and
give the eager step's tokens; enforce_eager=True, any engine option the caller chose,
another cache, bfloat16, chapter 5's modes, a small model and a loaded model get nothing
added. The rule reads the config and the call only, so it chooses the same every time."""
from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine.llm import DEFAULT_OPTIONS
from minillm.model.config import ModelConfig
from minillm.model.loader import load_model
from minillm.perf import cpu_defaults
from minillm.perf.cpu_defaults import FAST_PATH, cpu_fast_path
from minillm.serve.cli import engine_args, parser
from minillm.utils import bundled_model_path

TINY = str(bundled_model_path())
SMOL = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576,
                   intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                   head_dim=64, torch_dtype="float32")  # SmolLM2-135M's shape
CALL = dict(max_num_seqs=32, kv_cache=None, policy="continuous")
LOAD = dict(dtype=None, device=None, quantization=None)


def chosen(config=SMOL, args=None, **load) -> dict:
    return cpu_fast_path(config, {**CALL, **(args or {})}, {**LOAD, **load})[0]


def test_a_float32_model_of_real_size_gets_the_whole_fast_path():
    assert DEFAULT_OPTIONS["cpu"] is cpu_fast_path  # the registry holds 7d's rule
    assert chosen() == FAST_PATH
    assert set(FAST_PATH) == {"compile_decode", "fuse_projections",
                              "attention_backend", "inductor_compile_config"}
    for quantization in ("int8-a8", "int8-a8-tiles", "int4-a8"):  # 7c, 7d: float32
        assert chosen(quantization=quantization) == FAST_PATH
    assert chosen() is not chosen()  # a fresh dict: a caller cannot change the rule


@pytest.mark.parametrize("case", [
    dict(args={"compile_decode": False}), dict(args={"fuse_projections": True}),
    dict(args={"speculative_config": {"method": "ngram"}}),
    dict(args={"tensor_parallel_size": 2}), dict(args={"batch_invariant": True}),
    dict(args={"kv_cache": "slots"}), dict(args={"policy": "static"}),
    dict(dtype="bfloat16"),
    dict(quantization="int8"), dict(quantization="int4"), dict(quantization="w8a16"),
    dict(config="tiny"), dict(config="head 96")])
def test_nothing_is_added_where_the_caller_chose_or_the_path_was_not_measured(case):
    case = dict(case)
    config = {"tiny": ModelConfig.from_hf(bundled_model_path()),
              "head 96": ModelConfig(**{**SMOL.__dict__, "head_dim": 96}),
              None: SMOL}[case.pop("config", None)]
    assert chosen(config, **case) == {}


def test_the_rule_reads_no_clock(monkeypatch):
    """The same call, the same engine: the rule takes no timing."""
    def clock():
        raise AssertionError("the rule read a clock")
    for name in ("perf_counter", "monotonic", "time", "perf_counter_ns"):
        monkeypatch.setattr(f"time.{name}", clock)
    assert chosen() == FAST_PATH and chosen(quantization="int8") == {}


def test_llm_of_a_folder_runs_it_says_so_and_gives_the_eager_tokens(monkeypatch,
                                                                      capsys):
    """The book's model is under the size the rule asks for; with the size lowered,
    LLM(folder) runs the fast path, says so once, and gives enforce_eager's tokens."""
    monkeypatch.setattr(cpu_defaults, "MIN_PARAMETERS", 0)
    monkeypatch.setattr("minillm.model.sources._ANNOUNCED", set())
    kw = dict(max_num_seqs=2, max_model_len=64)
    fast, eager = LLM(TINY, **kw), LLM(TINY, **kw, enforce_eager=True)
    said = capsys.readouterr()
    assert said.err.count("minillm: engine: chapter 7's fast path") == 1, said.err
    options = fast.engine.config.options
    assert {k: options[k] for k in FAST_PATH} == FAST_PATH
    assert eager.engine.config.options["compile_decode"] is None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17], [1, 30, 31, 32]]
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params,
                                                         use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params,
                                                           use_tqdm=False)]
    assert got == want
    assert fast.engine.runner.forward.compile_seconds > 0  # the step it ran compiled


def test_small_and_loaded_models_keep_the_step_they_were_given():
    kw = dict(max_num_seqs=2, max_model_len=64)
    assert LLM(TINY, **kw).engine.config.options["compile_decode"] is None  # 6 M
    model = load_model(TINY, dtype=torch.float32)
    assert LLM(model, **kw).engine.config.options["compile_decode"] is None


def test_serve_takes_enforce_eager():
    assert engine_args(parser().parse_args([TINY, "--enforce-eager"]))[
        "enforce_eager"] is True
    assert "enforce_eager" not in engine_args(parser().parse_args([TINY]))
