"""Checks before work (issue 70, part 5): LLM(folder, ...) builds and checks the engine's
whole configuration from the folder's config.json (EngineConfig: its fields, the KV
backend's options, every later chapter's option and the rules between them) before it
reads a weight, starts a worker or builds a kernel. Before: the weights were loaded and
C++ kernels built first, and attention_backend without compile_decode was refused only
after the KV pool existed."""
from __future__ import annotations

import time

import pytest
import safetensors

import minillm.kernels.build
import minillm.model.loader
import minillm.parallel.workers
from helpers import forbid
from minillm import LLM
from minillm.utils import bundled_model_path

REFUSED = [  # (LLM's arguments, what the error says)
    ({"cuda_graphs": True, "compile_decode": True}, "cannot go together"),
    ({"attention_backend": "in_place"}, "attention_backend needs compile_decode=True"),
    ({"inductor_compile_config": {"cpp_wrapper": True}}, "needs compile_decode=True"),
    ({"speculative_config": {"num_speculative_tokens": 2}, "policy": "static"},
     "speculative_config needs policy='continuous'"),
    ({"tensor_parallel_size": 2, "compile_decode": True},
     "tensor_parallel_size and compile_decode cannot go together"),
    ({"tensor_parallel_size": 2, "fuse_projections": True},
     "tensor_parallel_size and fuse_projections cannot go together"),
    ({"batch_invariant": True, "compile_decode": True}, "cannot go together"),
    ({"quantization": "int8-a8", "max_num_seqs": 0}, "max_num_seqs=0"),
    ({"quantization": "int4-a8", "kv_cache": "paged", "block_size": 3},
     "block_size=3"),
    ({"max_model_len": 10**6}, "larger than the model's context"),
    ({"no_such_option": 1}, r"\['no_such_option'\]: not an option"),
    ({"attention_backend": "flash", "compile_decode": True},
     "attention_backend='flash'"),
]


@pytest.fixture
def nothing_heavy(monkeypatch):
    """Reading a weight, loading a model, starting a worker or building a kernel
    fails the test."""
    forbid(monkeypatch, safetensors, "safe_open", "a weight was read")
    forbid(monkeypatch, minillm.model.loader, "load_model", "the model was loaded")
    forbid(monkeypatch, minillm.parallel.workers, "WorkerGroup", "a worker started")
    forbid(monkeypatch, minillm.kernels.build, "load_inline", "a kernel was built")


@pytest.mark.parametrize("kwargs, says", REFUSED, ids=[str(k)[:40] for k, _ in REFUSED])
def test_a_refused_configuration_costs_nothing(nothing_heavy, kwargs, says):
    with pytest.raises(ValueError):  # the options' modules imported once
        LLM(bundled_model_path(), max_num_seqs=-1, fuse_projections=True)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=says):
        LLM(bundled_model_path(), **kwargs)
    assert time.perf_counter() - start < 1.0


def test_a_good_configuration_still_loads():
    llm = LLM(bundled_model_path(), kv_cache="paged", block_size=4, max_num_seqs=2)
    assert llm.engine.config.max_num_seqs == 2
    assert llm.engine.kv.block_size == 4
