"""Speculative decoding (chapter 10). Exported from chapters/10_speculative.ipynb
(this file only describes the parts):

    rejection.py   rejection_sample, sampling_probs: drafts in, the model's distribution out
    proposers.py   ngram_lookup, NgramProposer (prompt lookup), DraftModelProposer, Drafted
    runner.py      Speculator: propose, verify through the runner's forward, accept, settle
    engine.py      LLMEngine(..., speculative_config={...}); the KV memory of drafts
"""
