"""The KV backends: where keys and values live, behind one interface (base.KVBackend).

    contiguous.py  KVCache: one row of max_seq_len positions per sequence (chapter 3)
    slots.py       SlotKVCache: a row per running request, for the engine (chapter 4)
    blocks.py      BlockManager: block tables, reference counts, prefix hashes (chapter 6)
    paged.py       PagedKVCache: K/V in blocks, read through block tables (chapter 6)

Every module is exported from a chapter notebook (`make export`); this file only names them.
"""
