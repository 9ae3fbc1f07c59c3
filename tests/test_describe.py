"""One place that says what runs (issue 70, part 2): EngineConfig.describe() prints the
engine's parts in the order they are built, each with the chapter that built it; LLM's
describe() adds the model's line, and `serve` prints it at start-up. The text is pinned
for three configurations: a change to what an option does, or to its chapter, shows."""
from __future__ import annotations

import pytest

from minillm import LLM
from minillm.model.config import ModelConfig
from minillm.engine.config import EngineConfig, chapter_of
from minillm.engine.scheduler import Scheduler
from minillm.kv.paged import PagedKVCache
from minillm.utils import bundled_model_path

DEFAULT = """\
model transforms   none
KV cache           paged (chapter 6)
scheduler          PagedScheduler (chapter 6): continuous, max_num_seqs=32,
                   max_num_batched_tokens=2048, chunked prefill on
forward            eager (chapter 4)
speculator         none: one token per forward
logits processors  min_tokens (chapter 2), structured_outputs_config='xgrammar' (chapter 11)"""

FAST = """\
model transforms   fuse_projections=True (chapter 7b)
KV cache           paged (chapter 6), block_size=4
scheduler          PagedScheduler (chapter 6): continuous, max_num_seqs=8,
                   max_num_batched_tokens=2048, chunked prefill on
forward            attention_backend='in_place' (chapter 7a), compile_decode=True (chapter 7a)
speculator         speculative_config={'num_speculative_tokens': 3, 'method': 'ngram',
                   'prompt_lookup_min': 5, 'prompt_lookup_max': 5} (chapter 10)
logits processors  min_tokens (chapter 2), structured_outputs_config='xgrammar' (chapter 11)"""

STATIC = """\
model transforms   batch_invariant=True (chapter 12)
KV cache           slots (chapter 4)
scheduler          Scheduler (chapter 4): static, max_num_seqs=4, max_num_batched_tokens=2048,
                   chunked prefill off
forward            cuda_graphs=True (chapter 7)
speculator         none: one token per forward
logits processors  min_tokens (chapter 2), structured_outputs_config='xgrammar' (chapter 11)"""


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_hf(bundled_model_path())


@pytest.mark.parametrize("kwargs, text", [
    ({}, DEFAULT),
    ({"kv_cache": "paged", "block_size": 4, "max_num_seqs": 8, "compile_decode": True,
      "fuse_projections": True, "attention_backend": "in_place",
      "speculative_config": {"num_speculative_tokens": 3}}, FAST),
    ({"kv_cache": "slots", "policy": "static", "enable_chunked_prefill": False,
      "max_num_seqs": 4, "batch_invariant": True, "cuda_graphs": True}, STATIC)],
    ids=["default", "fast", "static"])
def test_the_recipe_is_pinned(config, kwargs, text):
    assert EngineConfig.create(config, **kwargs).describe() == text


def test_chapters_are_read_from_the_exported_modules():
    assert chapter_of(Scheduler) == "4" and chapter_of(PagedKVCache) == "6"
    assert chapter_of(len) == "?" and chapter_of(object()) == "?"


def test_llm_adds_the_model_line():
    llm = LLM(bundled_model_path(), quantization="int8", max_num_seqs=2)
    first, rest = llm.describe().split("\n", 1)
    assert first == ("model              Transformer (chapter 2): 6 layers, "
                     "torch.float32 on cpu, quantization='int8'")
    assert rest == llm.engine.config.describe()
