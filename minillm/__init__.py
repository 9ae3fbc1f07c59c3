"""minillm: the small LLM inference engine built in the book
"Build an LLM inference engine from scratch".

Every module except this one is exported from a chapter notebook in chapters/ (`make export`).
"""
__version__ = "0.1.0"

# Later chapters extend earlier code by registering what they add under a name, in the
# registries of earlier chapters (chapter 5's quantization modes, chapter 6's paged KV cache,
# chapter 7's CUDA graphs, chapter 10's speculative decoding, chapter 11's structured output).
# minillm/features.py names, in one place, the modules that fill each registry; a registry's
# reader loads them on first use. So nothing here is imported for its side effects, and
# `import minillm.tokenizer` loads no engine.

# The front door with vLLM's names: `from minillm import LLM, SamplingParams`. Imported
# when first used, so `python -m minillm.bench` and the chapters' first cells stay light.
_FRONT = {"LLM": "minillm.engine.llm", "LLMEngine": "minillm.engine.llm_engine",
          "RequestOutput": "minillm.engine.outputs",
          "CompletionOutput": "minillm.engine.outputs",
          "SamplingParams": "minillm.sampling",  # chapter 2's (11 registers a field)
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
