"""The serving engine of chapter 4: sequences are scheduled step by step, and every
step runs one batched forward. Exported from chapters/04_continuous_batching.ipynb
(this file only names the parts):

    config.py      EngineConfig: every argument checked once; ENGINE_OPTIONS, the
                   later chapters' options with the order they apply in
    outputs.py     CompletionOutput, RequestOutput, StepRecord: what the engine hands back
    scheduler.py   Scheduler: who runs this step, and how many tokens each computes
    paged_scheduler.py  PagedScheduler (chapter 6): preemption, answers sharing a prompt
    runner.py      ModelRunner: a batch -> one forward -> sampled tokens (graphs.py: ch. 7)
    llm_engine.py  LLMEngine: add_request, step (a step's tokens -> stop rules, text
                   deltas, logprobs, history), abort
    llm.py         LLM: the offline front door (generate, chat, stream)
"""
# `from minillm.engine import LLM, LLMEngine`: imported when first asked for, so that
# importing one part (minillm.engine.config, say) does not load every other part.
_PARTS = {"LLM": "minillm.engine.llm", "LLMEngine": "minillm.engine.llm_engine",
          "RequestOutput": "minillm.engine.outputs",
          "CompletionOutput": "minillm.engine.outputs"}
__all__ = list(_PARTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):
    if name in _PARTS:
        import importlib
        return getattr(importlib.import_module(_PARTS[name]), name)
    raise AttributeError(f"module 'minillm.engine' has no attribute {name!r}")
