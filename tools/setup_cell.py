"""The setup cell every chapter starts with, rendered from _config.yml.

The repository URL lives in one place, `repository.url` in _config.yml. This script
writes it into the first code cell of every chapter (`make setup-cells`), and
tests/test_notebooks.py fails if a chapter's first code cell differs from it.
On Colab the cell clones the repository into /content/minillm (MINILLM_CLONE overrides
the folder; tests/test_colab.py uses it to run the Colab path against a local clone).

    python tools/setup_cell.py           # rewrite the setup cell of chapters/*.ipynb
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "# Setup: run this cell first."

TEMPLATE = '''\
# Setup: run this cell first. On Colab it installs minillm from the book's
# repository (Colab's own torch is kept); elsewhere it only picks the device.
import os, subprocess, sys
REPO_URL = "{url}"  # from _config.yml
if "google.colab" in sys.modules:
    repo = os.environ.get("MINILLM_CLONE", "/content/minillm")  # where to clone it
    if not os.path.isdir(repo):
        subprocess.run(["git", "clone", "--depth", "1", REPO_URL, repo], check=True)
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-e", f"{{repo}}[colab]"], check=True)
    sys.path.insert(0, repo)

from minillm.utils import pick_device
device = pick_device()
print("device:", device)'''


def repository_url() -> str:
    text = (ROOT / "_config.yml").read_text(encoding="utf-8")
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", text, re.M)
    if not match:
        raise SystemExit("_config.yml has no repository.url")
    return match.group(1).strip("\"'")


def setup_cell_source() -> str:
    return TEMPLATE.format(url=repository_url())


def first_code_cell(nb: dict) -> dict:
    return next(c for c in nb["cells"] if c["cell_type"] == "code")


def main() -> int:
    source = setup_cell_source()
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        cell = first_code_cell(nb)
        if "".join(cell["source"]) != source:
            if not "".join(cell["source"]).startswith(MARKER):
                print(f"{path}: first code cell is not the setup cell; left alone", file=sys.stderr)
                continue
            cell["source"] = source.splitlines(keepends=True)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"updated the setup cell of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
