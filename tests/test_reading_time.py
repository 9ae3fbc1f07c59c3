"""tools/reading_time.py: a chapter's stated reading time is the tool's figure, and the
formula itself (prose at 200 words a minute, visible code at 10 lines a minute, rounded
up to 5 minutes) on a tiny notebook."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import reading_time  # noqa: E402

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
STAMPED = [p for p in CHAPTERS if reading_time.stated(p) is not None]


def test_some_chapters_state_their_reading_time():
    assert STAMPED, "no chapter has the line '*Reading time: about N minutes; ...*'"


@pytest.mark.parametrize("path", STAMPED, ids=lambda p: p.name)
def test_stated_reading_time_is_the_tools_figure(path):
    read, run = reading_time.stated(path)
    figure = reading_time.reading_minutes(path)
    assert abs(read - figure) <= 5, (
        f"{path.name} says {read} minutes of reading; tools/reading_time.py computes "
        f"{figure}: run `python tools/reading_time.py --stamp chapters/{path.name} "
        f"--run-minutes {run}`")
    assert run >= 1


def markdown(text: str) -> dict:
    return {"cell_type": "markdown", "id": f"m{hash(text) % 10**6}", "metadata": {},
            "source": text}


def code(text: str, *tags: str) -> dict:
    return {"cell_type": "code", "id": f"c{hash(text) % 10**6}", "execution_count": None,
            "metadata": {"tags": list(tags)} if tags else {}, "outputs": [],
            "source": text}


def write(path: Path, *cells: dict) -> Path:
    nb = {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def test_formula_on_a_tiny_notebook(tmp_path):
    path = write(
        tmp_path / "99_tiny.ipynb",
        markdown("# Title\n\n| a | b |\n|---|---|\n\n" + "word " * 397),  # 400 words
        code("x = 1\n" * 20),                                  # 20 visible lines
        code("#| export\ndef f():\n    return 1\n" + "y = 2\n" * 7),  # 10, the engine's
        code("plot()\n" * 50, "hide-input"),                  # hidden: not read
        code("check()\n" * 50, "hide-cell"),
        code("#| default_exp tiny", "remove-cell"))
    counts = reading_time.counts(reading_time.load(path))
    assert counts == {"words": 400, "code_lines": 30, "engine_lines": 10}
    assert reading_time.reading_minutes(path) == 5     # 400 / 200 + 30 / 10 = 5 minutes
    assert reading_time.minutes(401, 30) == 10          # 5.005 minutes: rounded up
    assert reading_time.minutes(0, 0) == 5              # at least 5 minutes
    assert reading_time.minutes(6000, 600) == 90        # 30 + 60 minutes


def test_stamp_writes_the_line_once_and_keeps_the_figure(tmp_path):
    path = write(tmp_path / "99_tiny.ipynb",
                 markdown("# Chapter 99: Tiny\n\nIntro " + "word " * 2000),
                 code("x = 1\n" * 40))
    before = reading_time.reading_minutes(path)
    assert reading_time.stated(path) is None
    line = reading_time.stamp(path, 3)
    assert line == ("*Reading time: about 15 minutes; running it: about 3 minutes on a "
                    "laptop CPU.*")
    assert reading_time.stated(path) == (before, 3) == (15, 3)
    reading_time.stamp(path, 1)                        # again: replaced, not added
    first = reading_time.load(path)["cells"][0]["source"]
    text = "".join(first)
    assert text.count("Reading time") == 1 and text.startswith("# Chapter 99: Tiny\n\n*")
    assert "about 1 minute on" in text
    assert reading_time.reading_minutes(path) == before  # the line is not counted


def test_table_lists_every_chapter():
    table = reading_time.table(CHAPTERS)
    assert all(p.stem in table for p in CHAPTERS) and "hours" in table
