"""minillm: the small LLM inference engine built in the book
"Build an LLM inference engine from scratch".

Every module except this one is exported from a chapter notebook in chapters/ (`make export`).
"""
__version__ = "0.1.0"

# Later chapters extend earlier code by registering what they add under a name: chapter
# 5's quantization modes (minillm.loader.QUANTIZATIONS), chapter 6's paged KV cache
# (minillm.kv.base.KV_BACKENDS, continuous batching's default), chapter 7's CUDA graphs
# (minillm.engine.llm_engine.ENGINE_OPTIONS) and its dtype="auto" rule for a CPU
# (minillm.loader.DTYPE_RULES), chapter 10's speculative decoding (ENGINE_OPTIONS), chapter
# 11's structured output (ENGINE_OPTIONS, the runner's logits processors). Importing any
# part of the package imports them,
# so the package is always the whole engine, whatever came first.
from . import quant  # noqa: E402,F401  load_model(quantization="int8" | "int4" | ...)
from .kv import paged  # noqa: E402,F401  LLMEngine(kv_cache="paged", block_size=...)
from .engine import graphs  # noqa: E402,F401  LLMEngine(..., cuda_graphs=True)
from . import perf  # noqa: E402,F401  load_model(dtype="auto") on a CPU: measured
from .spec import engine as _spec  # noqa: E402,F401  LLM(..., speculative_config={...})
from .structured import engine as _structured  # noqa: E402,F401  structured_outputs

# The front door with vLLM's names: `from minillm import LLM, SamplingParams`. Imported
# when first used, so `python -m minillm.bench` and the chapters' first cells stay light.
_FRONT = {"LLM": "minillm.engine.llm", "LLMEngine": "minillm.engine.llm_engine",
          "RequestOutput": "minillm.engine.outputs",
          "CompletionOutput": "minillm.engine.outputs",
          "SamplingParams": "minillm.structured.params",  # chapter 2's + chapter 11's
          "StructuredOutputsParams": "minillm.structured.params",
          "TextPrompt": "minillm.inputs", "TokensPrompt": "minillm.inputs"}
__all__ = list(_FRONT)


def __dir__() -> list[str]:
    """The lazily loaded names too, so that dir() and tab completion show them."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):
    if name in _FRONT:
        import importlib
        return getattr(importlib.import_module(_FRONT[name]), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
