"""The serving engine of chapter 4: sequences are scheduled step by step, and every
step runs one batched forward. Exported from chapters/04_continuous_batching.ipynb
(this file only re-exports):

    outputs.py     CompletionOutput, RequestOutput, StepRecord: what the engine hands back
    scheduler.py   Scheduler: who runs this step, and how many tokens each computes
    paged_scheduler.py  PagedScheduler (chapter 6): preemption, answers sharing a prompt
    runner.py      ModelRunner: a batch -> one forward -> sampled tokens (graphs.py: ch. 7)
    llm_engine.py  LLMEngine: add_request, step, abort
    step_outputs.py  a step's tokens -> stop rules, text deltas, logprobs, history
    llm.py         LLM: the offline front door (generate, chat, stream)
"""
from minillm.engine.llm import LLM
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "LLMEngine", "RequestOutput", "CompletionOutput"]
