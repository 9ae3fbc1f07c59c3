"""Strip outputs, execution counts and run-time metadata from notebooks, and fold what
the website folds where the reader runs the notebook: a cell tagged hide-input,
hide-cell or hide-output gets the metadata JupyterLab (`jupyter.source_hidden`,
`jupyter.outputs_hidden`) and Colab (`cellView: "form"`, code hidden) honour.

    python tools/clean_notebooks.py [--check] [notebooks...]   (default: chapters/*.ipynb)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEEP_NB_METADATA = {"kernelspec", "language_info"}


# tag -> what JupyterLab folds: the code, the output, or both
FOLDS = {"hide-input": {"source_hidden": True},
         "hide-cell": {"source_hidden": True, "outputs_hidden": True},
         "hide-output": {"outputs_hidden": True}}


def folds(cell: dict) -> dict:
    """The `jupyter` metadata a cell's tags ask for ({} for a visible cell)."""
    want: dict = {}
    for tag in cell.get("metadata", {}).get("tags", []):
        want.update(FOLDS.get(tag, {}))
    return want


def fold(cell: dict) -> None:
    """Set a cell's folding metadata from its tags (and drop any its tags do not ask)."""
    meta, want = cell.setdefault("metadata", {}), folds(cell)
    meta.pop("jupyter", None)
    meta.pop("cellView", None)
    if want:
        meta["jupyter"] = want
        if want.get("source_hidden") and cell["cell_type"] == "code":
            meta["cellView"] = "form"  # Colab: the code folded behind "Show code"


def unfolded_cells(nb: dict) -> list[int]:
    """Cells whose folding metadata is not what their tags ask for."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        meta = cell.get("metadata", {})
        want = folds(cell)
        colab = "form" if want.get("source_hidden") and cell["cell_type"] == "code" else None
        if meta.get("jupyter", {}) != want or meta.get("cellView") != colab:
            out.append(i)
    return out


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
        fold(cell)
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
            if unfolded_cells(nb):
                bad.append(f"{path}: cells {unfolded_cells(nb)} are not folded as tagged")
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
