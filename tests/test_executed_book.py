"""`make test` executes every chapter once: nbval saves the executed notebooks
(tools/nbval_executed.py) and the website is built from them (tools/stage_executed_book.py)."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import stage_executed_book as stage  # noqa: E402

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def notebook(*sources):
    cells = [new_markdown_cell("# A chapter")] + [new_code_cell(s) for s in sources]
    nb = new_notebook(cells=cells)
    nb.metadata.kernelspec = KERNELSPEC
    return nb


def executed(nb):
    """nb as nbval leaves it: every code cell ran and printed its number."""
    nb = copy.deepcopy(nb)
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = n + 1
        cell.outputs = [new_output("stream", name="stdout", text=f"cell {n}\n")]
    return nb


@pytest.fixture
def book(tmp_path):
    """A book root with one chapter, and an empty folder for the executed copies."""
    root = tmp_path / "repo"
    (root / "chapters").mkdir(parents=True)
    (root / "book").mkdir()
    (root / "_toc.yml").write_text("format: jb-book\nroot: book/intro\n")
    (root / "_config.yml").write_text("execute:\n  execute_notebooks: force\n")
    nbformat.write(notebook("x = 1", "print(x)"), str(root / "chapters" / "01_a.ipynb"))
    (tmp_path / "executed" / "chapters").mkdir(parents=True)
    return root, tmp_path / "executed", tmp_path / "staged"


def write_executed(folder, nb, name="01_a.ipynb"):
    nbformat.write(nb, str(folder / "chapters" / name))


def test_stage_refuses_a_chapter_without_an_executed_copy(book, capsys):
    root, done, out = book
    with pytest.raises(stage.StaleOutputs, match=r"chapters/01_a.ipynb: no executed copy"):
        stage.stage(root, done, out)
    assert not out.exists()
    args = ["--root", str(root), "--executed", str(done), "--out", str(out)]
    assert stage.main(args) == 1
    assert "run `make nbval`" in capsys.readouterr().err


def test_stage_refuses_an_executed_copy_of_other_sources(book):
    root, done, out = book
    write_executed(done, executed(notebook("x = 1", "print(x + 1)")))
    with pytest.raises(stage.StaleOutputs,
                       match=r"01_a.ipynb changed after nbval executed it \(cell 2, id "):
        stage.stage(root, done, out)
    write_executed(done, executed(notebook("x = 1")))
    with pytest.raises(stage.StaleOutputs, match="2 cells were executed, the notebook has 3"):
        stage.stage(root, done, out)
    assert not out.exists()


def test_stage_refuses_an_executed_copy_with_a_cell_that_did_not_run(book):
    root, done, out = book
    nb = executed(notebook("x = 1", "print(x)"))
    nb.cells[2].execution_count = None
    write_executed(done, nb)
    with pytest.raises(stage.StaleOutputs, match="did not run"):
        stage.stage(root, done, out)


def test_stage_writes_the_chapters_with_outputs_and_execution_off(book):
    root, done, out = book
    source = (root / "chapters" / "01_a.ipynb").read_bytes()
    nb = executed(notebook("x = 1", "print(x)"))
    nb.cells[2].metadata["tags"] = ["stale-tag"]  # only outputs come from the copy
    nb.metadata.language_info = {"name": "python", "pygments_lexer": "ipython3"}
    write_executed(done, nb)
    (staged,) = stage.stage(root, done, out)
    result = nbformat.read(str(staged), as_version=4)
    assert [c.outputs[0].text for c in result.cells[1:]] == ["cell 0\n", "cell 1\n"]
    assert "tags" not in result.cells[2].metadata
    assert result.metadata.language_info.pygments_lexer == "ipython3"
    assert (root / "chapters" / "01_a.ipynb").read_bytes() == source
    assert 'execute_notebooks: "off"' in (out / "_config.yml").read_text()
    assert (out / "_toc.yml").is_symlink() and (out / "book").resolve() == root / "book"
    assert not (out / "chapters").is_symlink()


def test_the_book_config_has_the_setting_the_staging_switches_off():
    config = (ROOT / "_config.yml").read_text(encoding="utf-8")
    assert config.count(stage.EXECUTE_FORCE) == 1


CELLS = [
    "print('a'); x = 2\nx * 21",
    "x;",  # a trailing `;` hides the result, as in Jupyter
    ("from IPython.display import Pretty, display\n"
     "box = display(Pretty('start'), display_id=True)\n"
     "for i in range(3):\n    box.update(Pretty(f'step {i}'))"),
    ("import ipywidgets as widgets\n"
     "widgets.interact(lambda k=1: print('k =', k), k=(0, 3));"),
]


def run_nbval(folder, *names):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
           "--nbval-lax", "--nbval-current-env", "-p", "tools.nbval_executed",
           f"--nbval-executed-dir={folder / 'out'}", "--rootdir", str(folder), *names]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def test_nbval_plugin_writes_the_outputs_into_a_copy(tmp_path):
    nbformat.write(notebook(*CELLS), str(tmp_path / "good.ipynb"))
    nbformat.write(notebook("1 / 0"), str(tmp_path / "bad.ipynb"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "bad.ipynb").write_text("an old copy")
    sources = {p.name: p.read_bytes() for p in tmp_path.glob("*.ipynb")}

    result = run_nbval(tmp_path, "good.ipynb", "bad.ipynb")

    assert result.returncode == 1, result.stdout + result.stderr  # bad.ipynb fails
    assert "1 failed, 4 passed" in result.stdout, result.stdout
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.ipynb")} == sources
    assert not (tmp_path / "out" / "bad.ipynb").exists()  # failed: its old copy is gone
    nb = nbformat.read(str(tmp_path / "out" / "good.ipynb"), as_version=4)
    assert nb.metadata.language_info.pygments_lexer == "ipython3"  # the site's highlighting
    code = nb.cells[1:]
    assert [c.execution_count for c in code] == [1, 2, 3, 4]
    assert [o.output_type for o in code[0].outputs] == ["stream", "execute_result"]
    assert code[0].outputs[0].text == "a\n"
    assert code[0].outputs[1].data["text/plain"] == "42"
    assert code[1].outputs == []
    assert [o.data["text/plain"] for o in code[2].outputs] == ["step 2"]  # the last update
    (view,) = code[3].outputs  # the widget, its output in the widget state as nbclient has it
    model_id = view.data["application/vnd.jupyter.widget-view+json"]["model_id"]
    state = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    assert model_id in state
    printed = [o.get("text") for s in state.values() for o in s["state"].get("outputs", [])]
    assert printed == ["k = 1\n"]


def widget_state(**models):
    return {"application/vnd.jupyter.widget-state+json": {
        "state": {k: {"model_name": name, "state": state}
                  for k, (name, state) in models.items()},
        "version_major": 2, "version_minor": 0}}


def widget_output(model_id):
    return new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": model_id,
                                                     "version_major": 2},
        "text/plain": "timing:   0%|          | 0/5"})


def test_stage_turns_widgets_into_text(book):
    """A static page has no kernel and no CDN: a tqdm bar is dropped (noise once the work
    is done, issue 42), any other widget becomes a note and what its Output widget holds;
    the widget state goes."""
    root, done, out = book
    nb = executed(notebook("x = 1", "print(x)"))
    nb.metadata.widgets = widget_state(
        bar=("HBoxModel", {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]}),
        l=("HTMLModel", {"value": "timing:\u2007100%"}),
        p=("FloatProgressModel", {"value": 5.0, "max": 5.0}),
        r=("HTMLModel", {"value": "\u20075/5\u2007[00:01&lt;00:00]"}),
        box=("VBoxModel", {"children": ["IPY_MODEL_slider", "IPY_MODEL_o"]}),
        slider=("FloatSliderModel", {"value": 1.0}),
        o=("OutputModel", {"outputs": [{"output_type": "stream", "name": "stdout",
                                        "text": "k = 1\n"}]}))
    nb.cells[1].outputs = [widget_output("bar")]
    nb.cells[2].outputs = [widget_output("box")]
    write_executed(done, nb)
    (staged,) = stage.stage(root, done, out)
    result = nbformat.read(str(staged), as_version=4)
    assert result.cells[1].outputs == []
    assert stage.progress_line(nb.metadata.widgets[
        "application/vnd.jupyter.widget-state+json"]["state"], "bar") == \
        "timing: 100%|██████████| 5/5 [00:01<00:00]"  # what it recognises as a bar
    assert [o.text for o in result.cells[2].outputs] == [stage.INTERACTIVE + "\n",
                                                         "k = 1\n"]
    assert "widgets" not in result.metadata
