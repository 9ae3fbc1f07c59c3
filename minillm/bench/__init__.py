"""The book's benchmarks, as commands: `python -m minillm.bench <name> --help`.

Shared by all (chapter 3, except workloads): cli.py (the command line and the one
main()), measure.py (a clock on the forward passes, the ways to generate, `in_turns`:
the one runner of ways in turns, random prompts), results.py (`Result`: the one result
type; file names and the one CSV writer), folders.py (model folders), and workloads.py
(request streams, chapter 4). Then one module per chapter, importing only the shared
ones: kv (3), serving (4), quant (5), paged (6), decode and article (7), spec (10) and
structured (11).

Every module here is a plain, hand-written file: chapters 3 to 7 import and run them, and
no notebook exports into this folder (tools/export.py refuses one that tries).
"""
