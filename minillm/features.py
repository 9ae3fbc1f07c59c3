"""What the later chapters add to the earlier ones, named in one place (written by hand).

An earlier chapter keeps a `Registry`, a table that later chapters fill by name: chapter
5's quantization modes, chapter 6's paged KV cache and its scheduler, chapter 7's engine
options, and so on. REGISTRIES below says, for each of them, which module fills which
key (or, for a table whose keys are many, which modules fill it). A key's module is
imported the first time that key is asked for, and counted as loaded only once it has
imported without error. So what runs is decided by this file, not by which module
happened to be imported first; `load_model(folder)` imports no engine; and a module
that failed to import is tried again, never left half-registered.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import MutableMapping

_QUANT_7A = {"int8-a8": "minillm.quant.w8a8_cpu", "int4-a8": "minillm.quant.tiled_a8",
             "int8-a8-tiles": "minillm.quant.tiled_a8"}  # chapter 7's appendix

# registry (its module and name) -> {key: the module that fills it}, or the modules
# that fill it (a table with many keys, filled whole)
REGISTRIES: dict[str, dict[str, str] | tuple[str, ...]] = {
    "minillm.sampling.SAMPLING_FIELDS": {"structured_outputs":            # chapter 11
                                         "minillm.structured.params"},
    "minillm.model.loader.QUANTIZATIONS": {**dict.fromkeys(                     # chapter 5
        ("int8", "w8a16", "w8a8", "int4"), "minillm.quant.int8"), **_QUANT_7A},
    "minillm.model.loader.DTYPE_RULES": {"cpu": "minillm.perf.dtype_auto"},          # chapter 7
    "minillm.quant.int8.MODES": _QUANT_7A,
    "minillm.kv.base.KV_BACKENDS": {"slots": "minillm.kv.slots",          # chapter 4
                                    "paged": "minillm.kv.paged"},         # chapter 6
    "minillm.kv.base.DEFAULT_KV_CACHE": {"continuous": "minillm.kv.paged"},  # 6
    "minillm.engine.scheduler.SCHEDULERS": {"paged":                      # chapter 6
                                            "minillm.engine.paged_scheduler"},
    "minillm.engine.llm_engine.REQUEST_EXTRAS": {"cache_salt":            # 6's appendix
                                                 "minillm.engine.cache_salt",
                                                 "follows":               # chapter 4
                                                 "minillm.engine.llm_engine"},
    "minillm.kv.paged.BLOCK_KEY_EXTRAS": {"cache_salt": "minillm.engine.cache_salt",
                                          "prompt_logprobs": "minillm.kv.paged"},
    "minillm.engine.config.ENGINE_OPTIONS": {
        "cuda_graphs": "minillm.engine.graphs",                           # chapter 7
        "fuse_projections": "minillm.quant.fused",                              # its appendix
        "compile_decode": "minillm.engine.compiled",
        "attention_backend": "minillm.engine.compiled",
        "inductor_compile_config": "minillm.engine.compiled",
        "speculative_config": "minillm.speculative.engine",                      # chapter 10
        "structured_outputs_config": "minillm.structured.engine",         # chapter 11
        "batch_invariant": "minillm.invariant.engine",                    # chapter 12
        "tensor_parallel_size": "minillm.parallel.engine"},               # chapter 13
    "minillm.engine.compiled.DECODE_ATTENTION": {"in_place":              # chapter 7
                                                 "minillm.kernels.paged_decode"},
    "minillm.quant.fused.ROWS": ("minillm.quant.tiled_a8",),                          # chapter 7
    "minillm.engine.llm_engine.REQUEST_CHECKS": {"structured_outputs":    # chapter 11
                                                 "minillm.structured.engine"},
    "minillm.engine.llm.MODEL_LOADERS": {"tensor_parallel_size":          # chapter 13
                                         "minillm.parallel.engine"},
    "minillm.engine.llm.LOAD_CHECKS": {"compile_decode":                  # chapter 7
                                       "minillm.engine.compiled"},
    "minillm.engine.llm.DEFAULT_OPTIONS": {"cpu":                         # 7's appendix
                                           "minillm.perf.cpu_defaults"},
    "minillm.serve.protocol.REQUEST_FIELDS": ("minillm.structured.serve",),  # ch. 11
    "minillm.serve.async_engine.REQUEST_PREPARERS": {"compile_grammar":
                                                     "minillm.structured.serve"},
    "minillm.serve.app.CHAT_REPLIES": {"tools": "minillm.structured.serve"},
    "minillm.serve.app.ROUTES": {"responses": "minillm.structured.responses"},  # 11
    "minillm.serve.app.HEALTH_CHECKS": {"tensor_parallel":                # chapter 13
                                        "minillm.parallel.serve"},
    "minillm.serve.cli.ENGINE_FLAGS": {
        "--speculative-config": "minillm.speculative.serve",                     # chapter 10
        "--batch-invariant": "minillm.invariant.serve",                   # chapter 12
        "--tensor-parallel-size": "minillm.parallel.serve"},              # chapter 13
    "minillm.serve.metrics.METRIC_COLLECTORS": {"spec_decode":            # chapter 10
                                                "minillm.speculative.serve"},
}


class Registry(MutableMapping):
    """A table that later chapters fill by name, declared in REGISTRIES under `name`
    (its module and its variable). Asking for a key imports the module that
    fills it first; iterating, `len` and `in` name every declared key without
    importing anything but the modules that fill the table whole; items() and
    values() import what they read."""

    def __init__(self, name: str):
        self.name = name
        self._entries: dict = {}
        self._loaded: set[str] = set()  # modules imported without error

    def _declared(self) -> tuple[dict, tuple]:
        """What REGISTRIES says fills this table: only if it is the one its module
        holds under its name (a notebook's own copy holds just what it is given)."""
        module, _, attr = self.name.rpartition(".")
        if getattr(sys.modules.get(module), attr, None) is not self:
            return {}, ()
        found = REGISTRIES.get(self.name, {})
        return (found, ()) if isinstance(found, dict) else ({}, found)

    def _load(self, *modules: str) -> None:
        for module in modules:
            if module not in self._loaded:
                importlib.import_module(module)  # raises: not counted as loaded
                self._loaded.add(module)

    def __getitem__(self, key):
        per_key, whole = self._declared()
        self._load(*whole, *([per_key[key]] if key in per_key else []))
        if key not in self._entries:
            where = (f"; {per_key[key]} should have registered it" if key in per_key
                     else "")
            raise KeyError(f"{key!r} is not in {self.name}{where}")
        return self._entries[key]

    def __setitem__(self, key, value) -> None:
        """An entry set by hand is final: the modules REGISTRIES names for the key
        are imported first (unless they are importing now), so that they cannot
        replace it later (a notebook's own version of a later chapter's entry)."""
        per_key, whole = self._declared()
        owner = sys.modules[self.name.rpartition(".")[0]] if per_key or whole else None
        if not getattr(getattr(owner, "__spec__", None), "_initializing", False):
            self._load(*[m for m in (*whole, per_key.get(key))  # not its own defaults
                         if m and m not in sys.modules])
        self._entries[key] = value

    def __delitem__(self, key) -> None:
        del self._entries[key]

    def __iter__(self):
        per_key, whole = self._declared()
        self._load(*whole)
        return iter(list(dict.fromkeys([*self._entries, *per_key])))

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, key) -> bool:
        per_key, whole = self._declared()
        self._load(*whole)
        return key in self._entries or key in per_key

    def __repr__(self) -> str:
        return f"Registry({self.name!r}: {list(self)})"
