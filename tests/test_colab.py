"""The Colab path, as closely as an offline machine allows (`make colab`).

On Colab a reader opens a chapter from the launch button and runs the setup cell: with
`google.colab` imported, it clones the book's repository and runs `pip install -e
<clone>[colab]` next to Colab's own PyTorch. Here:

- a fresh virtual environment holds only torch and ipykernel, as Colab has them (torch
  and its dependencies are linked from the environment running the test, which has the
  version pinned in constraints.txt: the same files pip would unpack, without ~1 GB of
  copying);
- a stub `google.colab` module is imported when the kernel starts, so the setup cell
  takes its Colab branch;
- the repository is a local `git clone` of this one (what was committed, as on GitHub;
  MINILLM_COLAB_REPO names another), put where the setup cell looks for it (`MINILLM_CLONE`, /content/minillm on Colab);
- the kernel runs in an empty working folder, like /content, and executes a chapter
  (MINILLM_COLAB_CHAPTER, default the quick chapter 0) top to bottom.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from setup_cell import MARKER  # noqa: E402

pytestmark = pytest.mark.colab

CHAPTER = os.environ.get("MINILLM_COLAB_CHAPTER", "00_overview")
REPO = os.environ.get("MINILLM_COLAB_REPO", str(ROOT))  # the repository to clone
KERNEL = "colab-sim"
PROBE = """\
import json, google.colab, minillm, torch
print("PROBE " + json.dumps({"minillm": minillm.__file__, "torch": torch.__version__,
                             "torch_file": torch.__file__}))"""


def torch_pin() -> str:
    text = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    return re.search(r"^torch==(\S+)", text, re.M).group(0)


def link_installed(name: str, site: Path) -> list[str]:
    """Make distribution `name` and what it requires (no extras) installed in `site`,
    by symlinking the files of this environment's installation."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    todo, done = [name], []
    while todo:
        try:
            dist = distribution(todo.pop())
        except PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in done:
            continue
        done.append(key)
        for file in dist.files or []:
            if file.parts[0] == "..":  # console scripts in bin/: not needed
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(Path(dist.locate_file(file)).resolve())
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return done


def run(*cmd, **kw):
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """A fresh environment like a Colab runtime; returns its folders."""
    tmp = tmp_path_factory.mktemp("colab")
    env_dir, content = tmp / "venv", tmp / "content"
    content.mkdir()
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    import torch

    assert torch_pin() == f"torch=={torch.__version__.split('+')[0]}", \
        f"this environment has torch {torch.__version__}, constraints.txt pins {torch_pin()}"
    link_installed("torch", site)
    run(py, "-m", "pip", "install", "-q", "ipykernel")
    stub = site / "google" / "colab"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('"""A stand-in for Colab\'s module (tests only)."""\n')
    # IPython runs the startup folder's files when the kernel starts, as Colab imports
    # google.colab before the reader's first cell.
    startup = tmp / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-colab.py").write_text("import google.colab  # noqa: F401\n")
    kernel_dir = tmp / "jupyter" / "kernels" / KERNEL
    kernel_dir.mkdir(parents=True)
    clone = tmp / "clone" / "minillm"
    kernel_env = {"IPYTHONDIR": str(tmp / "ipython"), "MINILLM_CLONE": str(clone),
                  "PYTHONNOUSERSITE": "1"}
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab (simulated)", "language": "python", "env": kernel_env}))
    torch_before = run(py, "-c", "import torch; print(torch.__version__, torch.__file__)")
    return {"tmp": tmp, "python": py, "content": content, "clone": clone,
            "jupyter_path": tmp / "jupyter", "torch_before": torch_before.split()}


def test_setup_cell_installs_from_a_clone_and_the_chapter_runs(colab, monkeypatch):
    from nbclient import NotebookClient

    # what the setup cell's `git clone` does, from the local repository
    run("git", "clone", "--quiet", "--depth", "1", f"file://{REPO}", colab["clone"])
    nb = nbformat.read(colab["clone"] / "chapters" / f"{CHAPTER}.ipynb", as_version=4)
    setup = next(c for c in nb.cells if c.cell_type == "code")
    assert setup.source.startswith(MARKER), f"{CHAPTER}: the first code cell is not the setup cell"
    assert "MINILLM_CLONE" in setup.source, (
        f"{CHAPTER}: the committed setup cell predates MINILLM_CLONE: run `make setup-cells`")
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))

    monkeypatch.setenv("JUPYTER_PATH", str(colab["jupyter_path"]))
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=600, allow_errors=False,
                            resources={"metadata": {"path": str(colab["content"])}})
    client.execute()  # raises CellExecutionError on the first failing cell

    setup_out = "".join(o.get("text", "") for o in setup.outputs if o.output_type == "stream")
    assert re.search(r"^device: (cpu|cuda)", setup_out, re.M), setup_out
    probe_out = "".join(o.get("text", "") for o in nb.cells[-1].outputs
                        if o.output_type == "stream")
    probe = json.loads(probe_out.split("PROBE ", 1)[1])
    assert Path(probe["minillm"]).is_relative_to(colab["clone"]), \
        f"minillm was imported from {probe['minillm']}, not from the clone"
    assert [probe["torch"], probe["torch_file"]] == colab["torch_before"], \
        "the setup cell's pip install replaced the preinstalled torch"
