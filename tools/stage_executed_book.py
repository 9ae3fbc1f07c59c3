"""Stage the book's sources with the chapter outputs that `make nbval` produced.

    python tools/stage_executed_book.py [--executed _build/executed] [--out _build/staged]

`make nbval` (tools/nbval_executed.py) writes a copy of every chapter it executed, with its
outputs, to _build/executed/chapters/. This script checks that every chapter in chapters/ has
such a copy and that the copy's cells have the same sources as the chapter now (otherwise the
website would show outputs of other code: it stops with an error), then writes a source tree
for Jupyter Book to --out:

- chapters/*.ipynb: the source notebooks with the outputs of the copies (and what executing
  adds to a notebook's metadata: language_info, which picks the code highlighting). Widgets
  become text: a static page has no kernel, and their renderer would come from a CDN (the site
  is read offline too), so each would leave a blank gap. A progress bar is dropped (it says
  nothing once the work is done); any other widget shows what its Output widgets hold, after
  a line that says the widget is interactive in the notebook;
- _config.yml: the book's, with execute_notebooks "off" (the outputs are there already);
- everything else at the top of the repository (_toc.yml, book/, data/, ...; not .venv or
  _build): symbolic links into it, so that relative links such as
  ../book/figures/engine_map_03.svg resolve as in the repository.

`make site-from-nbval` then builds the website from --out without executing a notebook.
"""
from __future__ import annotations

import argparse
import copy
import html
import re
import shutil
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
# Not part of the book, or replaced in the staged tree.
SKIP = {"_build", "__pycache__", "chapters", "_config.yml"}
EXECUTE_FORCE = "execute_notebooks: force"
EXECUTE_OFF = 'execute_notebooks: "off"'


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
INTERACTIVE = "(an interactive widget: run the notebook to use it)"


def _plain(markup: str) -> str:
    """The text of a widget's HTML value."""
    text = html.unescape(re.sub(r"<[^>]+>", "", markup or ""))
    return re.sub(r"[\u2007\xa0]", " ", text)


def _children(state: dict, model_id: str) -> list[str]:
    model = state.get(model_id, {}).get("state", {})
    return [c.removeprefix("IPY_MODEL_") for c in model.get("children", [])
            if isinstance(c, str)]


def progress_line(state: dict, model_id: str) -> str | None:
    """A tqdm bar (HBox of HTML, progress, HTML) as one line of text, or None."""
    parts = [state.get(c, {}) for c in _children(state, model_id)]
    names = [p.get("model_name") for p in parts]
    if state.get(model_id, {}).get("model_name") != "HBoxModel" or names not in (
            ["HTMLModel", "FloatProgressModel", "HTMLModel"],
            ["HTMLModel", "IntProgressModel", "HTMLModel"]):
        return None
    left, bar, right = (p.get("state", {}) for p in parts)
    total = bar.get("max") or 0
    filled = round(10 * (bar.get("value") or 0) / total) if total else 0
    return (f"{_plain(left.get('value')).rstrip()}|{'█' * filled}{' ' * (10 - filled)}|"
            f"{_plain(right.get('value')).rstrip()}")


def _outputs_inside(state: dict, model_id: str, seen=None) -> list[dict]:
    """What the Output widgets under model_id hold, in order."""
    seen = set() if seen is None else seen
    if model_id in seen:
        return []
    seen.add(model_id)
    model = state.get(model_id, {})
    if model.get("model_name") == "OutputModel":
        return list(model.get("state", {}).get("outputs", []))
    return [o for c in _children(state, model_id) for o in _outputs_inside(state, c, seen)]


def widgets_as_text(nb) -> int:
    """Replace every widget output of nb by text (and what its Output widgets hold);
    drops the widget state. Returns how many widgets were replaced."""
    state = (nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}) or {}).get("state", {})
    replaced = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW) if "data" in out else None
            if view is None:
                outputs.append(out)
                continue
            replaced += 1
            model_id = view.get("model_id", "")
            if progress_line(state, model_id) is not None:
                continue  # a progress bar: noise on a static page (issue 42), dropped
            outputs.append(nbformat.v4.new_output("stream", name="stdout",
                                                  text=INTERACTIVE + "\n"))
            outputs += [nbformat.from_dict(o) for o in _outputs_inside(state, model_id)]
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return replaced


class StaleOutputs(Exception):
    """An executed copy is missing, incomplete, or was made from other cell sources."""


def _cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def merge(source_path: Path, executed_path: Path, name: str):
    """The notebook at source_path with the outputs of executed_path (checked to match)."""
    rerun = "run `make nbval` (it saves the executed chapters) and build again"
    if not executed_path.exists():
        raise StaleOutputs(f"{name}: no executed copy at {executed_path}: {rerun}")
    source = nbformat.read(str(source_path), as_version=4)
    executed = nbformat.read(str(executed_path), as_version=4)
    old, new = _cells(executed), _cells(source)
    if old != new:
        if len(old) != len(new):
            where = f"{len(old)} cells were executed, the notebook has {len(new)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
            cell_id = source.cells[i].get("id", "?")
            where = f"cell {i}, id {cell_id}, differs from the executed one"
        raise StaleOutputs(f"{name} changed after nbval executed it ({where}): {rerun}")
    merged = copy.deepcopy(source)
    for cell, done in zip(merged.cells, executed.cells):
        if cell.cell_type != "code":
            continue
        if cell.source.strip() and done.execution_count is None:
            raise StaleOutputs(f"{name}: a cell of the executed copy did not run: {rerun}")
        cell.outputs = done.outputs
        cell.execution_count = done.execution_count
    for key in ("language_info", "widgets"):  # what executing adds to the metadata
        if key in executed.metadata:
            merged.metadata[key] = executed.metadata[key]
    widgets_as_text(merged)
    return merged


def stage(root: Path, executed: Path, out: Path) -> list[Path]:
    """Write the staged source tree to out; returns the staged chapters."""
    chapters = sorted((root / "chapters").glob("*.ipynb"))
    if not chapters:
        raise StaleOutputs(f"no chapters in {root / 'chapters'}")
    merged = {p.name: merge(p, executed / "chapters" / p.name, f"chapters/{p.name}")
              for p in chapters}  # check all before writing anything

    config = (root / "_config.yml").read_text(encoding="utf-8")
    if config.count(EXECUTE_FORCE) != 1:
        raise StaleOutputs(f"_config.yml: expected one '{EXECUTE_FORCE}' to switch off")
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        shutil.rmtree(out)
    (out / "chapters").mkdir(parents=True)
    (out / "_config.yml").write_text(config.replace(EXECUTE_FORCE, EXECUTE_OFF),
                                     encoding="utf-8")
    for entry in sorted(root.iterdir()):
        if entry.name not in SKIP and not entry.name.startswith("."):
            (out / entry.name).symlink_to(entry.resolve())
    for name, nb in merged.items():
        nbformat.write(nb, str(out / "chapters" / name))
    return [out / "chapters" / name for name in merged]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executed", type=Path, default=ROOT / "_build" / "executed",
                        help="where `make nbval` saved the executed chapters")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "staged",
                        help="the staged source tree to write (replaced)")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        staged = stage(args.root.resolve(), args.executed.resolve(), args.out.resolve())
    except StaleOutputs as error:
        print(f"stage_executed_book: {error}", file=sys.stderr)
        return 1
    print(f"staged {len(staged)} executed chapters in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
