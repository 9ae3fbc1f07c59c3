"""The serving engine of chapter 4: sequences are scheduled step by step, and every
step runs one batched forward. Exported from chapters/04_continuous_batching.ipynb
(this file only re-exports)."""
from minillm.engine.llm import LLM, CompletionOutput, LLMEngine, RequestOutput

__all__ = ["LLM", "LLMEngine", "RequestOutput", "CompletionOutput"]
