"""minillm.engine.compiled: the compiled decode step (chapter 7's appendix on CPU speed): the engine with
compile_decode=True gives the eager engine's greedy tokens, on both KV backends and in
chapter 5's fused int8 and int4 modes (with and without freezing), compiles one step
per bucket, reports what compiling took, and takes compiled code from PyTorch's cache."""
import copy
import os
import subprocess
import sys

import pytest
import torch

from helpers import drive
from minillm import LLM
from minillm.bench.measure import fast_copy
from minillm.engine import LLMEngine
from minillm.engine.compiled import CompiledForward
from minillm.engine.graphs import GraphForward
from minillm.sampling import SamplingParams

torch.set_num_threads(1)


def arrivals(n: int = 6) -> list:
    """(arrival step, prompt, params): prompts of 3 to 18 tokens arriving over steps,
    so the batch grows and shrinks under the one bucket of 4 rows."""
    return [(i % 3, [1] + list(range(10 + 7 * i, 12 + 10 * i)),
             SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True))
            for i in range(n)]


def serve(model, compiled: bool, kv_cache: str = "paged", freezing: bool = False,
          inductor: dict | None = None) -> tuple[list, object]:
    """Every request's output ids, and the engine's forward. One bucket (4 rows, a
    span of 64 positions) holds every decode step: one compile."""
    settings = {"buckets": [4], "spans": [64], "freezing": freezing}
    engine = LLMEngine(model, max_num_seqs=4, kv_cache=kv_cache, max_model_len=64,
                       compile_decode=settings if compiled else None,
                       inductor_compile_config=inductor)
    served = drive(engine, arrivals())
    return [r.seq.output_ids for r in served.values()], engine.runner.forward


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_compiled_step_gives_the_eager_tokens(llama, kv_cache):
    _, model = llama
    ids, runner = serve(model, True, kv_cache)
    assert ids == serve(model, False, kv_cache)[0]
    assert isinstance(runner, CompiledForward) and list(runner.steps) == [(4, 64, 1)]
    assert sum(runner.used.values()) > 10  # every decode step went through it
    assert runner.compile_seconds > 0 and runner.replays == 0
    assert runner.compile_report.startswith("compiled 1 decode step(s) in ")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_modes_compile_frozen_to_the_eager_tokens(llama, mode):
    _, model = llama
    fast = fast_copy(model, mode)  # chapter 5's fused layers, bfloat16, int8 head
    for freezing in (False, True):  # both compile, in inference mode, to the same ids
        ids, runner = serve(fast, True, freezing=freezing)
        assert runner.freezing == freezing and list(runner.steps) == [(4, 64, 1)]
        assert ids == serve(fast, False)[0]


def test_another_model_of_the_same_shape_compiles_its_own_step(llama):
    # Each step has its own code object (its guards on the modules are skipped): a
    # second model of the same shapes gets its own compiled step, from inductor's
    # on-disk cache, and its tokens are its own.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    _, model = llama
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    first, runner1 = serve(model, True)
    second, runner2 = serve(other, True)
    assert first == serve(model, False)[0]
    assert second == serve(other, False)[0] and second != first
    assert runner2.cache_hits == 1  # its C++ came from the disk
    codes = [r.steps[(4, 64, 1)]._torchdynamo_orig_callable.__code__
             for r in (runner1, runner2)]
    assert codes[0] is not codes[1] and codes[0].co_name == "step_4x64x1"
    assert [len(_debug_get_cache_entry_list(c)) for c in codes] == [1, 1]


SECOND_PROCESS = """
import sys, torch
from minillm.engine import LLMEngine
from minillm.model.loader import load_model
from minillm.sampling import SamplingParams
engine = LLMEngine(load_model(sys.argv[1]), max_num_seqs=1, max_model_len=32,
                   kv_cache="paged", compile_decode=True)
engine.add_request([1, 5, 9], SamplingParams(temperature=0, max_tokens=3))
while engine.has_unfinished():
    engine.step()
print(engine.runner.forward.cache_hits, engine.runner.forward.compile_report)
"""


def test_a_second_process_takes_the_compiled_code_from_the_disk(folder, tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    runs = [subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(folder)],
                           env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:]
    first, second = (r.stdout.split()[0] for r in runs)
    assert (first, second) == ("0", "1")  # compiled, then read back from the disk
    assert "(1 from PyTorch's on-disk cache)" in runs[1].stdout


def test_steps_compile_per_bucket_on_first_use(llama):
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=2, kv_cache="paged", max_model_len=64,
                       compile_decode={"buckets": [1, 2], "spans": [32, 64]})
    runner = engine.runner.forward
    assert runner.steps == {} and runner.compile_report is None  # nothing yet
    engine.add_request([1, 5, 6], SamplingParams(temperature=0, max_tokens=3,
                                                 ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert list(runner.steps) == [(1, 32, 1)]


def test_the_engine_option_and_its_checks(llama):
    _, model = llama
    engine = LLMEngine(model, max_num_seqs=2, compile_decode=True)
    assert isinstance(engine.runner.forward, CompiledForward)
    assert type(LLMEngine(model, compile_decode=False).runner.forward).__name__ == \
        "Forward"
    for bad in (1, "yes", {"freezing": 1}, {"capture": True}):  # None: left out
        with pytest.raises(ValueError, match="compile_decode"):
            LLMEngine(model, compile_decode=bad)
    graphs = LLMEngine(model, max_num_seqs=2, cuda_graphs=True)
    assert type(graphs.runner.forward) is GraphForward  # a CPU: padded, eager
    with pytest.raises(ValueError, match="max_graphs"):
        LLMEngine(model, max_num_seqs=2, compile_decode={"max_graphs": 0})


def test_inductor_settings_reach_the_compiled_step(llama):
    from minillm.perf.cpu_defaults import CPP_WRAPPER
    _, model = llama
    for bad in ({"no_such_setting": 1}, ["cpp_wrapper"]):
        with pytest.raises(ValueError, match="inductor_compile_config="):
            LLMEngine(model, compile_decode=True, inductor_compile_config=bad)
    with pytest.raises(ValueError, match="needs compile_decode=True"):
        LLMEngine(model, inductor_compile_config={"cpp_wrapper": True})
    engine = LLMEngine(model, compile_decode=True, inductor_compile_config=CPP_WRAPPER)
    assert engine.runner.forward.inductor == CPP_WRAPPER
    ids, runner = serve(model, True, inductor=CPP_WRAPPER)  # kernels called from C++
    assert runner.inductor == CPP_WRAPPER and list(runner.steps) == [(4, 64, 1)]
    assert ids == serve(model, False)[0]


def test_llm_takes_compile_decode(llama):
    _, model = llama
    llm = LLM(model, max_num_seqs=2, max_model_len=64, compile_decode=True)
    assert isinstance(llm.engine.runner.forward, CompiledForward)


def test_bench_decode_compile_adds_a_compiled_twin_of_each_engine_way(folder):
    from minillm.bench.decode import COMPILED, run_perf_benchmark
    rows = run_perf_benchmark(str(folder), "cpu", prompt_tokens=8, new_tokens=6,
                              repeats=1, compile=True, fast=("int8",)).rows
    by = {r["way"]: r for r in rows if r["batch"] == 1}
    twins = {"engine (ch. 4, 6)": COMPILED,
             "engine, bfloat16 (ch. 5)": "engine, bfloat16, compiled (ch. 7)",
             "engine, int8 + int8 head, bfloat16 (ch. 5)":
                 "engine, int8 + int8 head, compiled (ch. 7)"}
    for eager, compiled in twins.items():
        assert by[compiled]["compile_s"] > 0 and "compile_s" not in by[eager]
        assert by[compiled]["same_tokens_as_transformers"] == \
            by[eager]["same_tokens_as_transformers"]  # the same tokens as eagerly
    assert by[COMPILED]["same_tokens_as_transformers"] == 6  # float32: all
    assert "engine + graphs + torch.compile" in by  # compile_parts, as before
