"""Structured output (chapter 11). Exported from chapters/11_structured_output.ipynb
(this file only describes the parts):

    params.py    StructuredOutputsParams, and SamplingParams with vLLM's structured_outputs
    fsm.py       by hand: regex -> NFA -> DFA over bytes, token masks per state, a JSON
                 Schema subset -> regex, FSMGrammar and FSMMatcher
    backends.py  FSMBackend ("minillm") and XGrammarBackend ("xgrammar"), one interface
    engine.py    StructuredOutputManager, a logits processor: one bitmask per step;
                 LLMEngine(..., structured_outputs_config={"backend": ...})
    serve.py     OpenAI's response_format in chapter 9's server
"""
