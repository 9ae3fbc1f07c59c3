"""Strip outputs, execution counts and run-time metadata from notebooks.

    python tools/clean_notebooks.py [--check] [notebooks...]   (default: chapters/*.ipynb)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEEP_NB_METADATA = {"kernelspec", "language_info"}


def dirty_cells(nb: dict) -> list[int]:
    return [i for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None)]


def clean(nb: dict) -> dict:
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        for key in ("execution", "collapsed", "scrolled", "ExecuteTime"):
            cell.get("metadata", {}).pop(key, None)
    nb["metadata"] = {k: v for k, v in nb.get("metadata", {}).items() if k in KEEP_NB_METADATA}
    nb["metadata"].get("language_info", {}).pop("version", None)
    return nb


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb"))
    bad = []
    for path in paths:
        nb = json.loads(path.read_text(encoding="utf-8"))
        if args.check:
            if dirty_cells(nb):
                bad.append(f"{path}: cells {dirty_cells(nb)} have outputs or execution counts")
            continue
        text = json.dumps(clean(nb), indent=1, ensure_ascii=False) + "\n"
        if text != path.read_text(encoding="utf-8"):
            path.write_text(text, encoding="utf-8")
            print(f"cleaned {path}")
    if bad:
        print("\n".join(bad) + "\nrun `make clean-notebooks`")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
