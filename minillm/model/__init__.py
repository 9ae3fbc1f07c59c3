"""The model (chapter 2): config.py (config.json read and checked), transformer.py (the
Transformer's modules, StepMeta), loader.py (safetensors into the model), sources.py (what
the user typed -> a folder), gguf.py (llama.cpp's files), naive.py (the naive loop).

`from minillm.model import Transformer` keeps working: transformer.py's names are here too
(this file is written by hand)."""
import importlib

_OLD = "minillm.model.transformer"  # what `minillm.model` was, a module, before issue 70


def __getattr__(name: str):
    """`from minillm.model import X`: X from transformer.py, imported when first asked for."""
    module = importlib.import_module(_OLD)
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'minillm.model' has no attribute {name!r}") from None
