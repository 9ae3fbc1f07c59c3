"""Export the chapter notebooks into the minillm package with nbdev.

    python tools/export.py            # write minillm/ from chapters/*.ipynb
    python tools/export.py --check    # export into a temporary folder and compare

Every module belongs to exactly one notebook: when two notebooks export into the same
module (two `#| default_exp x`, or a `#| export x` in another chapter), the export stops
before it writes anything and names both notebooks. The one exception is a module named
in SHARED_MODULES (`minillm/kv/attention.py`): each chapter teaches its own attention
function in its own cells, and the module gathers them in chapter order (the first
chapter writes the header and imports; a later chapter's cells are appended, so they
may not hold a `from __future__` import).

Some of the package is written by hand, not exported: `minillm/__main__.py`, every
`__init__.py`, and the whole of `minillm/bench/` (the benchmarks are plain files that the
chapters import, issue 37). The export never writes there, the check does not ask a
notebook for them, and a notebook cell that exports into `bench.*` stops the export
before it writes anything.

nbdev writes a header into every module naming the notebook it came from; the
relative path in that header depends on where the library lives, so the check
exports into a copy with the same layout (tmp/chapters, tmp/minillm).

C++ (issue 70): a markdown cell's ```cpp block whose first line is a comment naming a
file of minillm/csrc/ (`// minillm/csrc/paged_decode.cpp`) is that file's next part. The
chapter shows the code (highlighted, on the website); the export joins a file's parts in
notebook order under a header naming the notebook. A file belongs to one notebook.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from nbdev.export import ExportModuleProc, nb_export
from nbdev.maker import ModuleMaker
from nbdev.process import NBProcessor

ROOT = Path(__file__).resolve().parent.parent
HAND_WRITTEN = {"__init__.py", "__main__.py", "features.py"}  # modules no notebook owns
HAND_WRITTEN_PACKAGES = ("bench",)  # folders of minillm/ that no notebook exports into
SHARED_MODULES = {"kv.attention"}  # modules several chapters export into, in chapter order
SUFFIXES = {".py", ".cpp", ".h"}  # what the export writes (and the check compares)


def module_maker(started: set[str]) -> type:
    """A ModuleMaker for one export run. Every module belongs to exactly one notebook,
    also the ones a cell names with `#| export othermodule`: write it whole (nbdev by
    default would append to a module that another notebook created first). A shared
    module is written whole by the first chapter and appended to by the later ones;
    `started` remembers which shared modules this run has begun."""

    class OwnedModuleMaker(ModuleMaker):
        def __init__(self, dest, name, nb_path, is_new=True, parse=True, solo_nb=False):
            first = name not in SHARED_MODULES or name not in started
            started.add(name)
            super().__init__(dest, name, nb_path, is_new=first, parse=parse,
                             solo_nb=solo_nb)

    return OwnedModuleMaker


class ExportError(ValueError):
    """The notebooks cannot be exported as they are; nothing was written."""


class ExportConflict(ExportError):
    """Two notebooks export into the same module."""


class HandWrittenModule(ExportError):
    """A notebook exports into a module that is written by hand (minillm/bench/)."""


def is_hand_written(module: str) -> bool:
    """Whether the module (dotted, as a cell names it: `bench.kv`) lies in a folder of
    minillm/ that is written by hand."""
    parts = module.split(".")
    return len(parts) > 1 and parts[0] in HAND_WRITTEN_PACKAGES


def modules_of(notebook: Path) -> set[str]:
    """The modules (dotted names) that nbdev would write for `notebook`, found the way
    `nbdev.export.nb_export` finds them."""
    exp = ExportModuleProc()
    NBProcessor(str(notebook), [exp]).process()
    names = set()
    for mod, cells in exp.modules.items():
        if any(c.cell_type == "code" and "exportd" not in c.directives_ for c in cells):
            name = getattr(exp, "default_exp", None) if mod == "#" else mod
            if name:
                names.add(name)
    return names


def conflicts(notebooks: list[Path]) -> list[str]:
    """One message per module that more than one notebook exports into."""
    owners: dict[str, list[Path]] = {}
    for nb in notebooks:
        for mod in modules_of(nb):
            owners.setdefault(mod, []).append(nb)
    return [f"module {mod} is exported by {len(nbs)} notebooks: "
            f"{', '.join(p.name for p in nbs)}; every module belongs to one notebook"
            for mod, nbs in sorted(owners.items())
            if len(nbs) > 1 and mod not in SHARED_MODULES]


def hand_written_targets(notebooks: list[Path]) -> list[str]:
    """One message per notebook module that lies in a hand-written folder."""
    return [f"{nb.name} exports into {mod}, but minillm/{mod.split('.')[0]}/ is written by hand "
            f"(plain files that the chapters import): edit minillm/{mod.replace('.', '/')}.py "
            "and import from it in the notebook instead of exporting it"
            for nb in notebooks for mod in sorted(modules_of(nb)) if is_hand_written(mod)]


CPP_PART = re.compile(r"^```(?:cpp|c\+\+)\n// minillm/(csrc/[\w.]+)\n(.*?)^```",
                      re.S | re.M)


def cpp_files(notebooks: list[Path]) -> dict[str, str]:
    """{path under minillm/: text} of every C++ file the notebooks' markdown holds."""
    parts: dict[str, tuple[Path, list[str]]] = {}
    problems = []
    for nb in notebooks:
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for m in CPP_PART.finditer("".join(cell["source"])):
                owner, chunks = parts.setdefault(m.group(1), (nb, []))
                if owner != nb:
                    problems.append(f"minillm/{m.group(1)} has parts in {owner.name} and "
                                    f"{nb.name}; every file belongs to one notebook")
                chunks.append(m.group(2).rstrip("\n") + "\n")
    if problems:
        raise ExportConflict("\n".join(sorted(set(problems))))
    return {rel: f"// AUTOGENERATED! DO NOT EDIT! File to edit: chapters/{nb.name}.\n"
                 + "\n".join(chunks) for rel, (nb, chunks) in parts.items()}


def export(chapters: Path, lib: Path) -> list[Path]:
    notebooks = sorted(chapters.glob("*.ipynb"))
    refused = hand_written_targets(notebooks)
    if refused:
        raise HandWrittenModule("\n".join(refused))
    problems = conflicts(notebooks)
    if problems:
        raise ExportConflict("\n".join(problems))
    files = cpp_files(notebooks)
    maker = module_maker(set())
    for nb in notebooks:
        nb_export(str(nb), lib_path=str(lib), mod_maker=maker)
    for rel, text in files.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
    return notebooks


def check() -> list[str]:
    """Return one message per module that differs from what the notebooks export."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shutil.copytree(ROOT / "chapters", tmp / "chapters")
        (tmp / "minillm").mkdir()
        try:
            export(tmp / "chapters", tmp / "minillm")
        except ExportError as e:
            return str(e).splitlines()
        fresh = {p.relative_to(tmp / "minillm") for p in (tmp / "minillm").rglob("*")
                 if p.suffix in SUFFIXES}
        mine = {p.relative_to(ROOT / "minillm") for p in (ROOT / "minillm").rglob("*")
                if p.suffix in SUFFIXES and "__pycache__" not in p.parts}
        for rel in sorted(fresh):
            if not (ROOT / "minillm" / rel).exists():
                problems.append(f"minillm/{rel} is missing: run `make export`")
            elif not filecmp.cmp(tmp / "minillm" / rel, ROOT / "minillm" / rel, shallow=False):
                problems.append(f"minillm/{rel} differs from what its notebook exports: run `make export`")
        for rel in sorted(mine - fresh):
            if rel.name not in HAND_WRITTEN and not is_hand_written(".".join(rel.with_suffix("").parts)):
                problems.append(f"minillm/{rel} is exported by no notebook: delete it or add its notebook")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if args.check:
        problems = check()
        print("\n".join(problems) or "minillm/ is in sync with chapters/")
        return 1 if problems else 0
    try:
        notebooks = export(ROOT / "chapters", ROOT / "minillm")
    except ExportError as e:
        print(e, file=sys.stderr)
        return 1
    for nb in notebooks:
        print(f"exported {nb.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
