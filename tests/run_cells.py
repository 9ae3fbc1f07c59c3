"""Run a chapter's code cells, in order, up to one of them, as a reader would in Jupyter,
with some cells replaced or added: how tests/test_reader_code.py puts a reader's answer to
an exercise into a chapter and checks that the rest of the chapter runs on it.

    python tests/run_cells.py NOTEBOOK UNTIL_ID [EDITS_JSON]

EDITS_JSON maps a cell id to {"replace": source} or {"after": source}. The cells run in a
fresh module registered as __main__ (a notebook's namespace), with matplotlib's Agg
backend; `display(x)` prints x. Exits 1 with the traceback if a cell raises."""
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import sys
import time
import traceback
import types


def cells_to_run(path: str, until: str, edits: dict) -> list[tuple[str, str]]:
    cells = json.load(open(path, encoding="utf-8"))["cells"]
    if until not in {c["id"] for c in cells}:
        raise SystemExit(f"{path}: no cell {until!r}")
    missing = set(edits) - {c["id"] for c in cells}
    if missing:
        raise SystemExit(f"{path}: no cells {sorted(missing)}")
    out = []
    for c in cells:
        if c["cell_type"] == "code":
            source = "".join(c["source"])
            edit = edits.get(c["id"], {})
            out.append((c["id"], edit.get("replace", source)))
            if "after" in edit:
                out.append((c["id"] + "+", edit["after"]))
        if c["id"] == until:
            return out
    return out


def main() -> int:
    path, until = sys.argv[1], sys.argv[2]
    edits = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    os.environ.setdefault("MPLBACKEND", "Agg")
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    namespace["display"] = lambda *objs, **_: print(*objs)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    for cell_id, source in cells_to_run(path, until, edits):
        lines = [line for line in source.splitlines()
                 if not line.lstrip().startswith(("%", "!"))]  # IPython magics
        start = time.perf_counter()
        try:  # top-level await, as in Jupyter: the cell is a coroutine to run
            code = compile("\n".join(lines), f"<cell {cell_id}>", "exec",
                           flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            result = eval(code, namespace)
            if inspect.iscoroutine(result):
                loop.run_until_complete(result)
        except BaseException:
            traceback.print_exc()
            print(f"cell {cell_id} raised", flush=True)
            return 1
        if os.environ.get("RUN_CELLS_TIMES"):
            print(f"[{cell_id}: {time.perf_counter() - start:.1f} s]")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
