"""Repository-level checks: notebooks are clean, the package matches them (and has no
undefined names), the benchmarks in minillm/bench/ are plain files no notebook exports,
every chapter starts with the same setup cell, is in the book's table of contents and
follows the book's conventions (code width, hidden plumbing cells)."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import clean_notebooks  # noqa: E402
import export  # noqa: E402
from setup_cell import first_code_cell, repository_url, setup_cell_source  # noqa: E402

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
# The main path: NN_name.ipynb. An appendix to chapter NN is NNa_name.ipynb (its title
# starts with "# Appendix"): no map, exercises or summary of its own.
MAIN = [p for p in CHAPTERS if re.fullmatch(r"\d\d_\w+", p.stem)]
APPENDICES = [p for p in CHAPTERS if p not in MAIN]
MAX_CODE_LINE = 88  # characters: wider lines run past the page on the website
DEFAULT_EXP = re.compile(r"^\s*#\s*\|\s*default_exp\b", re.M)


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_there_are_chapters():
    assert CHAPTERS, "no notebooks in chapters/"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_notebook_is_committed_clean(path):
    dirty = clean_notebooks.dirty_cells(load(path))
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; run `make clean-notebooks`"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_hidden_cells_are_folded_where_the_reader_runs_them(path):
    """Issue 72: a cell the website folds (hide-input, hide-cell) is folded in
    JupyterLab (jupyter.source_hidden, and outputs_hidden for hide-cell) and in Colab
    (cellView "form"); a visible cell carries none of it."""
    nb = load(path)
    wrong = clean_notebooks.unfolded_cells(nb)
    assert not wrong, f"{path.name}: cells {wrong} are not folded as tagged; run `make clean-notebooks`"
    for cell in nb["cells"]:
        tags = cell.get("metadata", {}).get("tags", [])
        if "hide-cell" in tags:
            assert cell["metadata"]["jupyter"] == {"source_hidden": True, "outputs_hidden": True}


def test_the_cleaner_folds_by_the_tags_and_check_finds_what_it_missed(tmp_path):
    cell = lambda tags, meta=None: {"cell_type": "code", "id": "x", "source": ["1\n"],
                                    "outputs": [], "execution_count": None,
                                    "metadata": {"tags": tags, **(meta or {})}}
    nb = {"cells": [cell(["hide-input"]), cell(["hide-cell"]), cell([]),
                    cell([], {"jupyter": {"source_hidden": True}})],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    assert clean_notebooks.unfolded_cells(nb) == [0, 1, 3]
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    check = [sys.executable, str(ROOT / "tools" / "clean_notebooks.py"), "--check", str(path)]
    assert subprocess.run(check, capture_output=True).returncode == 1
    subprocess.run(check[:2] + [str(path)], check=True, capture_output=True)
    metas = [c["metadata"] for c in load(path)["cells"]]
    assert metas[0]["jupyter"] == {"source_hidden": True} and metas[0]["cellView"] == "form"
    assert metas[1]["jupyter"] == {"source_hidden": True, "outputs_hidden": True}
    assert "jupyter" not in metas[2] and "jupyter" not in metas[3]
    assert subprocess.run(check, capture_output=True).returncode == 0


def test_package_is_in_sync_with_notebooks():
    problems = export.check()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_starts_with_the_setup_cell(path):
    cell = first_code_cell(load(path))
    assert "".join(cell["source"]) == setup_cell_source(), \
        f"{path.name}: the first code cell is not the setup cell; run `make setup-cells`"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_has_default_exp_and_is_in_toc(path):
    sources = ["".join(c["source"]) for c in load(path)["cells"] if c["cell_type"] == "code"]
    if path in MAIN:  # an appendix may only show the engine at work, exporting nothing
        assert any(re.match(r"#\s*\|\s*default_exp \w+", s) for s in sources), \
            f"{path.name} has no #| default_exp cell"
    toc = (ROOT / "_toc.yml").read_text(encoding="utf-8")
    assert f"chapters/{path.stem}" in toc, f"{path.name} is not listed in _toc.yml"


def test_repository_url_is_in_one_place():
    url = repository_url()
    assert url.startswith("https://github.com/")
    hits = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in {".ipynb", ".py", ".md", ".yml", ".toml"}
            and ".venv" not in p.parts and "_build" not in p.parts and url in p.read_text(encoding="utf-8", errors="ignore")]
    allowed = {ROOT / "_config.yml", ROOT / "README.md", *CHAPTERS}  # chapters get it from `make setup-cells`
    assert set(hits) <= allowed, f"the repository URL is written outside _config.yml: {sorted(set(hits) - allowed)}"


def test_clean_notebooks_strips_outputs(tmp_path):
    nb = load(CHAPTERS[0])
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["hi\n"]}]
    code["execution_count"] = 3
    path = tmp_path / "dirty.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    assert clean_notebooks.dirty_cells(load(path))
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "clean_notebooks.py"), str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not clean_notebooks.dirty_cells(load(path))


def code_cells(path: Path) -> list[tuple[int, dict]]:
    return [(i, c) for i, c in enumerate(load(path)["cells"]) if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_code_lines_fit_the_page(path):
    too_long = [f"cell {i} line {n}: {len(line)} characters: {line.strip()[:50]}..."
                for i, cell in code_cells(path)
                for n, line in enumerate("".join(cell["source"]).splitlines(), start=1)
                if len(line) > MAX_CODE_LINE]
    assert not too_long, (f"{path.name}: {len(too_long)} code lines are longer than "
                          f"{MAX_CODE_LINE} characters:\n" + "\n".join(too_long[:20]))


HIDDEN_TAGS = {"hide-input", "hide-cell", "remove-cell", "remove-input"}
MAX_VISIBLE_CELL = 60  # lines: a visible code cell is one step of the idea
MAX_VISIBLE_BOOK = 8_000  # lines of visible code across the chapters


def visible_code(path: Path) -> dict[str, int]:
    """Lines of each code cell a reader sees on the website (id -> lines)."""
    return {cell.get("id", str(i)): len("".join(cell["source"]).splitlines())
            for i, cell in code_cells(path)
            if not HIDDEN_TAGS & set(cell.get("metadata", {}).get("tags", []))}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_visible_code_cells_are_one_step_each(path):
    long = {i: n for i, n in visible_code(path).items() if n > MAX_VISIBLE_CELL}
    assert not long, (f"{path.name}: visible code cells over {MAX_VISIBLE_CELL} lines "
                      f"{long}: split them into steps with prose between, or move checks "
                      "and plumbing into helpers in hidden (hide-cell) cells")


def test_the_book_shows_a_readable_amount_of_code():
    total = sum(sum(visible_code(p).values()) for p in CHAPTERS)
    assert total <= MAX_VISIBLE_BOOK, (
        f"the chapters show {total} lines of code (at most {MAX_VISIBLE_BOOK}): hide "
        "plotting, checks and plumbing (hide-input / hide-cell), or cut")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_default_exp_cell_is_hidden_on_the_site(path):
    untagged = [i for i, cell in code_cells(path) if DEFAULT_EXP.search("".join(cell["source"]))
                and "remove-cell" not in cell.get("metadata", {}).get("tags", [])]
    assert not untagged, (f"{path.name}: the `#| default_exp` cell(s) {untagged} need the "
                          "cell tag remove-cell (plumbing, not content)")


def test_no_two_notebooks_export_into_one_module():
    problems = export.conflicts(CHAPTERS)
    assert not problems, "\n".join(problems)


def write_notebook(folder: Path, name: str, *sources: str) -> None:
    """A notebook of code cells, one per source, as folder/name."""
    cells = [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None,
              "outputs": [], "source": src} for i, src in enumerate(sources)]
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (folder / name).write_text(json.dumps(nb), encoding="utf-8")


def test_export_refuses_two_notebooks_writing_one_module(tmp_path):
    def notebook(name, *sources):
        write_notebook(tmp_path / "chapters", name, *sources)

    (tmp_path / "chapters").mkdir()
    (tmp_path / "lib").mkdir()
    notebook("00_a.ipynb", "#| default_exp alpha", "#| export\ndef f(): return 1")
    notebook("01_b.ipynb", "#| default_exp beta", "#| export\ndef g(): return 2")
    export.export(tmp_path / "chapters", tmp_path / "lib")  # distinct modules: fine
    assert {p.name for p in (tmp_path / "lib").glob("*.py")} == {"alpha.py", "beta.py"}
    notebook("01_b.ipynb", "#| default_exp beta", "#| export alpha\ndef g(): return 2")
    with pytest.raises(export.ExportConflict, match=r"alpha .*00_a\.ipynb, 01_b\.ipynb"):
        export.export(tmp_path / "chapters", tmp_path / "lib")
    assert "def g" not in (tmp_path / "lib" / "alpha.py").read_text()  # nothing written


def test_a_shared_module_gathers_each_chapters_cells_in_chapter_order(tmp_path):
    """minillm/kv/attention.py is written by chapter 3 and appended to by chapter 4: each
    chapter teaches its own attention function; the module has both, in order, once."""
    (tmp_path / "chapters").mkdir()
    (tmp_path / "lib").mkdir()
    write_notebook(tmp_path / "chapters", "00_a.ipynb", "#| default_exp alpha",
                   "#| export kv.attention\nimport math\ndef f(): return math.pi")
    write_notebook(tmp_path / "chapters", "01_b.ipynb", "#| default_exp beta",
                   "#| export kv.attention\ndef g(): return f() + 1")
    for _ in range(2):  # a second export writes the same module, not a longer one
        export.export(tmp_path / "chapters", tmp_path / "lib")
    text = (tmp_path / "lib" / "kv" / "attention.py").read_text()
    assert text.count("def f") == text.count("def g") == 1
    assert text.index("def f") < text.index("def g") and "'f', 'g'" in text
    namespace: dict = {}
    exec(text, namespace)
    assert namespace["g"]() == pytest.approx(4.14159, abs=1e-5)


BENCH = ROOT / "minillm" / "bench"


def test_no_notebook_exports_into_the_benchmarks():
    """The benchmarks are plain files the chapters import (issue 37), not hidden cells."""
    assert not export.hand_written_targets(CHAPTERS)
    cells = [f"{path.name} cell {c.get('id', i)}" for path in CHAPTERS
             for i, c in enumerate(load(path)["cells"]) if c["cell_type"] == "code"
             and re.search(r"^\s*#\s*\|\s*(export|default_exp)\w*\s+bench\b",
                           "".join(c["source"]), re.M)]
    assert not cells, f"cells that export into minillm/bench: {cells}"


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_are_plain_files(path):
    text = path.read_text(encoding="utf-8")
    assert "AUTOGENERATED" not in text and not re.search(r"^# %% ", text, re.M), \
        f"minillm/bench/{path.name} has nbdev's header or cell markers: it is written by hand"
    assert ast.get_docstring(ast.parse(text)), f"minillm/bench/{path.name}: no docstring"


def test_export_refuses_a_notebook_exporting_into_the_benchmarks(tmp_path):
    (tmp_path / "chapters").mkdir()
    (tmp_path / "lib").mkdir()
    write_notebook(tmp_path / "chapters", "00_a.ipynb", "#| default_exp alpha",
                   "#| export\ndef f(): return 1", "#| export bench.kv\ndef g(): return 2")
    with pytest.raises(export.HandWrittenModule,
                       match=r"00_a\.ipynb exports into bench\.kv.*written by hand"):
        export.export(tmp_path / "chapters", tmp_path / "lib")
    assert not list((tmp_path / "lib").rglob("*.py"))  # nothing written
    assert export.is_hand_written("bench.kv") and not export.is_hand_written("kv.paged")


def test_package_has_no_undefined_or_unused_names():
    """Exported code that uses a name only a non-exported cell defines works in the notebook
    and breaks in the package: pyflakes' checks (ruff's F rules) catch it."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F",
                             "--output-format", "concise", "--no-cache", "minillm"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def markdown(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in load(path)["cells"] if c["cell_type"] == "markdown")


@pytest.mark.parametrize("path", MAIN, ids=lambda p: p.name)
def test_chapter_shows_its_engine_map(path):
    figure = f"../book/figures/engine_map_{path.name[:2]}.svg"
    assert f"]({figure})" in markdown(path), \
        f"{path.name}: no 'you are here' map; add ![Where this chapter sits in the engine]({figure})"
    assert (path.parent / figure).resolve().is_file(), f"{figure} is missing: run `make figures`"


@pytest.mark.parametrize("path", MAIN, ids=lambda p: p.name)
def test_chapter_has_exercises_and_a_summary(path):
    text = markdown(path)
    assert re.search(r"^## Exercises\s*$", text, re.M), f"{path.name}: no `## Exercises` section"
    assert re.search(r"^## .*Summary", text, re.M | re.I), f"{path.name}: no summary section"


def test_every_package_folder_is_installed():
    """pyproject.toml lists packages by name: a new subpackage (minillm/engine, ...) that is
    not listed would be missing from a wheel or a non-editable install."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "minillm").rglob("__init__.py")}
    assert folders == listed, f"pyproject.toml [tool.setuptools] packages={sorted(listed)}; the package folders are {sorted(folders)}"


def exercise_cells(path: Path) -> list[dict]:
    """The code cells of the chapter's `## Exercises` section (up to the next `## `)."""
    cells, inside = [], False
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("## "):
                    inside = line.startswith("## Exercises")
        elif inside:
            cells.append(cell)
    return cells


@pytest.mark.parametrize("path", MAIN, ids=lambda p: p.name)
def test_solutions_are_code_and_hidden_with_their_output(path):
    """A solution is a cell that checks its answer; on the website the answer stays
    folded away, its output too (hide-cell: hide-input would show the output). A cell
    tagged exercise-test is shown: the test a reader's own function must pass."""
    cells = exercise_cells(path)
    assert cells, f"{path.name}: the exercises have no solution cells"
    tags = [set(c.get("metadata", {}).get("tags", [])) for c in cells]
    shown = [c["id"] for c, t in zip(cells, tags)
             if not t & {"hide-cell", "exercise-test", "exercise-stub"}]
    assert not shown, f"{path.name}: solution cells shown on the page: {shown}"
    for c, t in zip(cells, tags):  # issue 72: the reader's function has a name of its
        if "exercise-stub" in t:   # own, which the folded solution cannot overwrite
            assert re.search(r"^def my_\w+\(", "".join(c["source"]), re.M) and \
                "raise NotImplementedError" in "".join(c["source"]), c["id"]
    for c, t in zip(cells, tags):  # a test the reader's own function must pass
        if "exercise-test" in t:
            assert "assert" in "".join(c["source"]), f"{c['id']}: a test that asserts"
    assert any("assert" in "".join(c["source"]) for c in cells), \
        f"{path.name}: no solution asserts its answer"


@pytest.mark.parametrize("path", MAIN, ids=lambda p: p.name)
def test_solution_toggles_say_what_they_hide(path):
    """Issue 42: MyST-NB labels a folded cell "Show code cell content"; a solution's
    toggle says "Solution" (cell metadata mystnb.code_prompt_show), and every chapter
    has an exercise that asks for a function, with a test cell that checks it."""
    cells = exercise_cells(path)
    folded = [c for c in cells if "hide-cell" in c.get("metadata", {}).get("tags", [])]
    unlabelled = [c["id"] for c in folded
                  if not c["metadata"].get("mystnb", {}).get("code_prompt_show")]
    assert not unlabelled, f"{path.name}: solution toggles without a label: {unlabelled}"
    assert any(c["metadata"]["mystnb"]["code_prompt_show"] == "Solution" for c in folded)
    assert any("exercise-test" in c.get("metadata", {}).get("tags", []) for c in cells), \
        f"{path.name}: no exercise asks the reader to write a function (exercise-test)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_core_exercise_has_a_stub_and_a_test_that_can_fail(path):
    """Issue 54: a core exercise is `fn_to_use = attempt(check, my_fn, books_fn)` after a stub
    `my_fn` that raises NotImplementedError (so the chapter runs on the book's function
    until the reader writes theirs), and the same notebook shows `check` rejecting a
    wrong function (`rejects(check, ...)`)."""
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                     if c["cell_type"] == "code")
    calls = re.findall(r"^\w+ = attempt\((\w+), (\w+),", text, re.M)
    tests = re.findall(r"^attempt\((\w+), (my_\w+), \w+\);", text, re.M)  # exercises'
    used = re.findall(r"(?<!def )\battempt\(", text)
    assert len(calls) + len(tests) == len(used), \
        f"{path.name}: an attempt(...) whose function is unused"
    for check, mine in calls + tests:
        stub = re.search(rf"def {mine}\(.*?\n(?=\S|\Z)", text, re.S)
        assert stub and "raise NotImplementedError" in stub.group(0), (path.name, mine)
    for check, mine in calls:
        assert re.search(rf"rejects\({check},", text), (path.name, check)


def test_the_chapters_have_core_exercises():
    """Issue 54: from chapter 1 on, the function that is a chapter's idea is an exercise
    (`attempt(...)`)."""
    missing = [p.name for p in MAIN if "00" < p.name[:2]
               and not re.search(r"^\w+ = attempt\(", "\n".join(
                   "".join(c["source"]) for c in json.loads(p.read_text())["cells"]), re.M)]
    assert not missing, f"no core exercise in {missing}"


@pytest.mark.parametrize("path", APPENDICES, ids=lambda p: p.name)
def test_an_appendix_names_itself_and_its_chapter_exists(path):
    """An appendix notebook (NNa_name.ipynb) is titled "# Appendix: ..." and belongs to a
    chapter NN of the main path, which links to it."""
    assert re.fullmatch(r"\d\d[a-z]_\w+", path.stem), path.name
    assert markdown(path).lstrip().startswith("# Appendix: "), path.name
    chapter = [p for p in MAIN if p.name[:2] == path.name[:2]]
    assert chapter, f"{path.name}: no chapter {path.name[:2]} on the main path"
    assert f"<{path.stem}>" in markdown(chapter[0]), \
        f"{chapter[0].name} does not link to its appendix {path.stem}"


def test_the_chapters_have_concept_drawings():
    """Issue 54: a concept drawing (a picture of an idea, not a plot of data) before
    the code it explains, tagged `concept-drawing`: at least 30 on the main path, and at
    least 3 in chapter 1 (the tokenizer) and chapter 11 (structured output). Each is a
    figure the cell draws, with its code folded (hide-input)."""
    per = {}
    for path in MAIN:
        for cell in load(path)["cells"]:
            tags = cell.get("metadata", {}).get("tags", [])
            if "concept-drawing" in tags:
                assert "hide-input" in tags, (path.name, cell.get("id"))
                assert re.search(r"\bplt\.|\.add_patch\(|\bfig\b", "".join(cell["source"])), \
                    f"{path.name} {cell.get('id')}: a concept drawing that draws nothing"
                per[path.name[:2]] = per.get(path.name[:2], 0) + 1
    assert sum(per.values()) >= 30, per
    assert per.get("01", 0) >= 3 and per.get("11", 0) >= 3, per
