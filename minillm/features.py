"""What the later chapters add to the earlier ones, named in one place (written by hand).

An earlier chapter keeps a registry (a dict) that later chapters fill by name: chapter 5's
quantization modes, chapter 6's paged KV cache and its scheduler, chapter 7's engine
options, and so on. The registry's reader asks `registry(THE_DICT)` before it looks inside,
which imports, once, the modules listed here for it. So what runs is decided by this file,
not by which module happened to be imported first, and `import minillm.tokenizer` loads no
engine.
"""
from __future__ import annotations

import importlib
import sys

# registry (the dict's module and name) -> the modules that fill it, in this order
FEATURES: dict[str, tuple[str, ...]] = {
    "minillm.sampling.SAMPLING_FIELDS": ("minillm.structured.params",),  # chapter 11
    "minillm.loader.QUANTIZATIONS": ("minillm.quant",                    # chapter 5
                                     "minillm.w8a8_cpu",                 # chapter 7
                                     "minillm.tiled_a8"),
    "minillm.quant.MODES": ("minillm.w8a8_cpu", "minillm.tiled_a8"),    # chapter 7
    "minillm.loader.DTYPE_RULES": ("minillm.dtype_auto",),               # chapter 7
    "minillm.kv.base.KV_BACKENDS": ("minillm.kv.slots",                  # chapter 4
                                    "minillm.kv.paged"),                 # chapter 6
    "minillm.kv.base.DEFAULT_KV_CACHE": ("minillm.kv.paged",),           # chapter 6
    "minillm.engine.scheduler.SCHEDULERS": ("minillm.engine.paged_scheduler",),  # 6
    "minillm.engine.llm_engine.REQUEST_EXTRAS": ("minillm.engine.cache_salt",),  # 6a
    "minillm.kv.paged.BLOCK_KEY_EXTRAS": ("minillm.engine.cache_salt",),     # 6a
    "minillm.engine.config.ENGINE_OPTIONS": ("minillm.engine.graphs",    # chapter 7
                                             "minillm.fused",            # chapter 7
                                             "minillm.engine.compiled",  # its appendix
                                             "minillm.spec.engine",      # chapter 10
                                             "minillm.structured.engine",  # chapter 11
                                             "minillm.invariant.engine",  # chapter 12
                                             "minillm.parallel.engine"),  # chapter 13
    "minillm.engine.compiled.DECODE_ATTENTION": ("minillm.paged_decode",),  # 7
    "minillm.engine.llm.MODEL_LOADERS": ("minillm.parallel.engine",),     # chapter 13
    "minillm.serve.protocol.REQUEST_FIELDS": ("minillm.structured.serve",),  # ch. 11
    "minillm.serve.async_engine.REQUEST_PREPARERS": ("minillm.structured.serve",),
    "minillm.serve.app.CHAT_REPLIES": ("minillm.structured.serve",),       # ch. 11
    "minillm.serve.cli.ENGINE_FLAGS": ("minillm.spec.serve",               # ch. 10
                                       "minillm.invariant.serve",          # ch. 12
                                       "minillm.parallel.serve"),          # ch. 13
    "minillm.serve.metrics.METRIC_COLLECTORS": ("minillm.spec.serve",),    # ch. 10
}
_loaded: set[str] = set()


def load(name: str) -> None:
    """Import the modules that fill registry `name` (once; a no-op for others)."""
    if name in _loaded:
        return
    _loaded.add(name)
    for module in FEATURES.get(name, ()):
        importlib.import_module(module)


_filled: set[int] = set()  # id() of each registry already filled


def registry(table: dict) -> dict:
    """`table`, one of the registries above, filled: its modules imported first
    (once; after that, one set lookup)."""
    if id(table) in _filled:
        return table
    for name in FEATURES:
        module, _, attr = name.rpartition(".")
        mod = sys.modules.get(module)
        if mod is not None and getattr(mod, attr, None) is table:
            load(name)
            _filled.add(id(table))
    return table


def load_all() -> None:
    """Every later chapter's part (what `import minillm` gave before this module)."""
    for name in FEATURES:
        load(name)
