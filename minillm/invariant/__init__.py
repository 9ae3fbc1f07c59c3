"""Batch invariance (chapter 12). Exported from chapters/12_batch_invariance.ipynb
(this file only describes the parts):

    ops.py      fixed_rows, FixedRowsLinear (linears in fixed blocks of rows),
                fixed_order_attention (page by page, running sums), FixedOrderAttention,
                make_batch_invariant (swaps a model's layers in place)
    engine.py   LLMEngine(..., batch_invariant=True)
    serve.py    `python -m minillm serve MODEL --batch-invariant`
"""
