"""minillm: the small LLM inference engine built in the book
"Build an LLM inference engine from scratch".

Every module except this one is exported from a chapter notebook in chapters/ (`make export`).
"""
import importlib
import importlib.abc
import importlib.util
import sys

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


# Module paths before the package was grouped by layer (issue 70), kept for one release:
# `import minillm.loader` gives minillm.model.loader itself (the same module object, so
# a patch or a registry entry made through either name is one). Only these names.
MOVED = {f"minillm.{old}": f"minillm.{new}" for old, new in {
    "config": "model.config", "loader": "model.loader", "sources": "model.sources",
    "gguf": "model.gguf", "naive": "model.naive", "attention": "kv.attention",
    "quant_formats": "quant.formats", "fused": "quant.fused",
    "w8a8_cpu": "quant.w8a8_cpu", "tiled_a8": "quant.tiled_a8",
    "paged_decode": "kernels.paged_decode", "timing": "perf.timing",
    "diagnose": "perf.diagnose", "dtype_auto": "perf.dtype_auto",
    **{f"spec{sub}": f"speculative{sub}" for sub in (  # chapter 10's package
        "", ".engine", ".proposers", ".rejection", ".runner", ".serve")}}.items()}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of MOVED; its module is the new one."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass  # imported already, under its new name


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finder: an old
    # path must not load a second copy of the module from the new folder
