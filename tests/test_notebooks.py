"""Repository-level checks: notebooks are clean, the package matches them, every chapter
starts with the same setup cell and is in the book's table of contents."""
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


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_there_are_chapters():
    assert CHAPTERS, "no notebooks in chapters/"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_notebook_is_committed_clean(path):
    dirty = clean_notebooks.dirty_cells(load(path))
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; run `make clean-notebooks`"


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
    assert any(re.match(r"#\s*\|\s*default_exp \w+", s) for s in sources), f"{path.name} has no #| default_exp cell"
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
