"""Quantization: int8.py (chapter 5: int8 and int4 weights, quantize, the modes), formats.py
(llama.cpp's block formats, chapter 5's appendix), fused.py (stacked projections),
w8a8_cpu.py and tiled_a8.py (int8 activations on AVX-512 VNNI, chapter 7's appendix).

`from minillm.quant import quantize` keeps working: int8.py's names are here too (this
file is written by hand)."""
import importlib

_OLD = "minillm.quant.int8"  # what `minillm.quant` was, a module, before issue 70


def __getattr__(name: str):
    """`from minillm.quant import X`: X from int8.py, imported when first asked for."""
    module = importlib.import_module(_OLD)
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'minillm.quant' has no attribute {name!r}") from None
