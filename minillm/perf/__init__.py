"""Measuring (chapters 7 and 8): mbu.py (bandwidth, MBU, launches, GPU peaks), timing.py,
diagnose.py (chapter 8's troubleshooting helpers), dtype_auto.py (dtype="auto" on a CPU).

`from minillm.perf import mbu` keeps working: mbu.py's names are here too (this file is
written by hand)."""
import importlib

_OLD = "minillm.perf.mbu"  # what `minillm.perf` was, a module, before issue 70


def __getattr__(name: str):
    """`from minillm.perf import X`: X from mbu.py, imported when first asked for."""
    module = importlib.import_module(_OLD)
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'minillm.perf' has no attribute {name!r}") from None
