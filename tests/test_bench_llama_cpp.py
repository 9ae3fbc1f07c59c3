"""Chapter 7's decode benchmark beside llama.cpp (issue 39): the checkpoint is written once
as a GGUF file in each format, the bytes a llama.cpp step reads are counted as our own
step's are, and --llama-cpp is refused before any work where it cannot run. With
llama-cpp-python installed (optional), llama.cpp runs in the same turns."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minillm.bench import decode
from minillm.model.loader import load_model
from minillm.perf.mbu import decode_bytes

TINY = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    return tmp_path


def test_a_gguf_copy_is_written_once_and_read_like_our_model(cache):
    path = decode.gguf_copy(TINY, "F32")
    assert path.is_relative_to(cache) and path.name.endswith(".F32.gguf")
    stamp = path.stat().st_mtime_ns
    assert decode.gguf_copy(TINY, "F32") == path and path.stat().st_mtime_ns == stamp
    # the same tensors in float32: a llama.cpp step reads what ours reads
    assert decode.gguf_step_bytes(path) == decode_bytes(load_model(TINY), context=0)


def test_smaller_formats_read_fewer_bytes(cache):
    sizes = {k: decode.gguf_step_bytes(decode.gguf_copy(TINY, k)) for k in ("F32", "Q8_0",
                                                                            "Q4_0")}
    assert sizes["Q4_0"] < sizes["Q8_0"] < 0.3 * sizes["F32"]


@pytest.mark.parametrize("model, kinds, words", [
    ("bundled", ("Q5_K",), "allowed formats"),
    ("bundled", ("F32", "F32"), "allowed formats"),
    ("SmolLM2-135M", ("F32",), "random"),
])
def test_bad_llama_cpp_arguments_are_refused_before_any_work(model, kinds, words):
    with pytest.raises(ValueError, match=words):
        decode.check_llama_cpp(model, kinds)


def test_without_llama_cpp_python_the_command_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(decode, "llama_cpp_missing",
                        lambda: "llama-cpp-python is not installed: pip install ...")
    with pytest.raises(ValueError, match="pip install"):
        decode.run_perf_benchmark("bundled", "cpu", prompt_tokens=8, new_tokens=4,
                                  repeats=1, llama_cpp=("F32",))
    decode.check_llama_cpp("bundled", ())  # nothing asked: nothing needed


@pytest.mark.skipif(decode.llama_cpp_missing() is not None,
                    reason="llama-cpp-python is an optional install")
def test_llama_cpp_runs_in_the_same_turns(cache):
    torch.manual_seed(0)
    rows = decode.run_perf_benchmark("bundled", "cpu", prompt_tokens=16, new_tokens=8,
                                     repeats=1, llama_cpp=("F32", "Q8_0")).rows
    by_way = {r["way"]: r for r in rows}
    assert by_way["llama.cpp F32"]["ms_per_token"] > 0
    # float32 weights, greedy: llama.cpp writes transformers' first tokens
    assert by_way["llama.cpp F32"]["same_tokens_as_transformers"] >= 4
    read = {w: by_way[w]["MBU"] * by_way[w]["ms_per_token"]
            for w in ("llama.cpp F32", "llama.cpp Q8_0")}
    assert read["llama.cpp Q8_0"] < 0.4 * read["llama.cpp F32"]
