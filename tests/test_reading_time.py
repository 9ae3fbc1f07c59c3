"""tools/reading_time.py: a chapter's stated reading time (and its time with the
exercises) is the tool's figure, and the formula itself (prose at 150 words a minute at 20
words a sentence, slower in proportion for longer sentences; visible code at 10 lines a
minute; a figure 1 minute, a table row 5 seconds, a displayed table 30; a core exercise
15 minutes, a closing one 10; rounded up to 5 minutes) on tiny notebooks and pages."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import reading_time  # noqa: E402

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
STAMPED = [p for p in CHAPTERS if reading_time.stated(p) is not None]


def test_some_chapters_state_their_reading_time():
    assert STAMPED == CHAPTERS, \
        "a chapter without the line '*Reading time: about N minutes; ...*'"


@pytest.mark.parametrize("path", STAMPED, ids=lambda p: p.name)
def test_stated_reading_time_is_the_tools_figure(path):
    read, with_exercises, run = reading_time.stated(path)
    figures = reading_time.reading_minutes(path), reading_time.exercises_minutes(path)
    assert abs(read - figures[0]) <= 5 and abs(with_exercises - figures[1]) <= 5, (
        f"{path.name} says {read} minutes of reading, {with_exercises} with the "
        f"exercises; tools/reading_time.py computes {figures[0]} and {figures[1]}: run "
        f"`python tools/reading_time.py --stamp chapters/{path.name} --run-minutes {run}`")
    assert run >= 1 and with_exercises >= read
    first = reading_time._source(reading_time.load(path)["cells"][0])
    assert first.count("Reading time") == 1, f"{path.name}: more than one reading-time line"


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
    ten = "Ten words in this sentence and the next one too. "  # 10 words, 1 sentence
    path = write(
        tmp_path / "99_tiny.ipynb",
        markdown("# Title\n\n| a | b |\n|---|---|\n\n" + ten * 59 + "Six words end the"
                 " paragraph here."),  # 1 + 2 + 590 + 6 = 599 words, 62 sentences
        code("x = 1\n" * 20),                                  # 20 visible lines
        code("#| export\ndef f():\n    return 1\n" + "y = 2\n" * 7),  # 10, the engine's
        code("plot()\n" * 50, "hide-input"),                  # hidden: not read
        code("check()\n" * 50, "hide-cell"),
        code("#| default_exp tiny", "remove-cell"))
    counts = reading_time.counts(reading_time.load(path))
    assert counts == {"words": 599, "sentences": 62, "code_lines": 30, "engine_lines": 10,
                      "figures": 0, "table_rows": 1, "displayed_tables": 0,
                      "core_exercises": 0, "closing_exercises": 0}
    assert reading_time.reading_minutes(path) == 10    # 599 / 150 + 30 / 10 + 1/12: 7.1
    assert reading_time.exercises_minutes(path) == 10  # no exercise
    assert reading_time.minutes(750, 0, 75) == 5        # 10 words a sentence: 150 a minute
    assert reading_time.minutes(751, 0, 75) == 10       # 5.007 minutes: rounded up
    assert reading_time.minutes(0, 0) == 5              # at least 5 minutes
    assert reading_time.minutes(4500, 600, 225) == 90   # 20 words a sentence: 30 + 60
    assert reading_time.minutes(4500, 600, 180) == 100  # 25 a sentence: 120 a minute
    assert reading_time.pace(3000, 100) == 100          # 30 a sentence: 100 a minute


def test_figures_tables_and_exercises_count(tmp_path):
    """Issue 72: a figure, a table and an exercise take a reader time too."""
    path = write(
        tmp_path / "99_tiny.ipynb",
        markdown("# Title\n\n| a | b |\n|:--|--:|\n| 1 | 2 |\n| 3 | 4 |"),  # 3 rows
        code("fig, ax = plt.subplots()\nax.plot([1])", "hide-input"),  # shown: counts
        code("plt.figure()\ndisplay(table)", "hide-input"),           # 1 + 0.5 minute
        code("fig, ax = plt.subplots()", "remove-cell"),               # not on the page
        code("def my_f(x):\n    raise NotImplementedError  # your code here"),  # core
        markdown("## Exercises\n\n**1. One.** Do it.\n\n2. **Two.** And this.\n\n"
                 "1. **Three.** A third.\n\n3. not in bold: not counted"),
        code("def my_g(x):\n    raise NotImplementedError"))  # a closing one's stub
    c = reading_time.counts(reading_time.load(path))
    assert (c["figures"], c["table_rows"], c["displayed_tables"]) == (2, 3, 1)
    assert (c["core_exercises"], c["closing_exercises"]) == (1, 3)
    assert reading_time.exercise_minutes(c) == 15 + 3 * 10
    # 3 + 1 words, 2 + 2 visible lines (0.4), 2 figures, 3 rows (0.25), 0.5: 3.2 minutes
    assert reading_time.reading_minutes(path) == 5
    assert reading_time.exercises_minutes(path) == 50  # 3.2 + 45, rounded up


def test_sentences_are_counted_as_a_reader_meets_them():
    count = reading_time.sentences
    assert count("One. Two words. Three `code` here? Yes!") == 4
    assert count("e.g. this is one sentence, and so is `x.y` here.") == 1
    assert count("A list:\n\n- first item\n- second item\n\n## A heading") == 4
    assert count("Text.\n\n```python\nx = 1. Not prose.\n```\n") == 1


def test_a_markdown_page_is_read_too(tmp_path):
    page = tmp_path / "appendix.md"
    page.write_text("# Appendix: a page\n\nSome prose here. More of it.\n\n```bash\n"
                    "python -m minillm bench kv\npython -m minillm bench quant\n```\n")
    counts = reading_time.counts(reading_time.load(page))
    assert counts["words"] == 9 and counts["code_lines"] == 2 and counts["sentences"] == 3


def test_the_appendices_are_listed_apart():
    pages, chapters = reading_time.appendices(), reading_time.main_path()
    assert ROOT / "book" / "benchmarks.md" in pages
    assert ROOT / "chapters" / "07a_cpu_speed.ipynb" in pages
    assert not set(pages) & set(chapters)
    assert set(chapters) | {p for p in pages if p.suffix == ".ipynb"} == set(CHAPTERS)
    assert "appendix" in reading_time.table(pages, "appendix")


def test_stamp_writes_the_line_once_and_keeps_the_figure(tmp_path):
    path = write(tmp_path / "99_tiny.ipynb",
                 markdown("# Chapter 99: Tiny\n\n" + "Ten words in this sentence and the next one"
                          " too. " * 200),  # 13.3 minutes + 4 of code: 20
                 code("x = 1\n" * 40))
    before = reading_time.reading_minutes(path)
    assert reading_time.stated(path) is None
    line = reading_time.stamp(path, 3)
    assert line == ("*Reading time: about 20 minutes; with the exercises: about 20 "
                    "minutes; running it: about 3 minutes on a laptop CPU.*")
    assert reading_time.stated(path) == (before, before, 3) == (20, 20, 3)
    reading_time.stamp(path, 1)                        # again: replaced, not added
    nb = json.loads(path.read_text())                  # so is a line in older words
    nb["cells"][0]["source"] = "".join(nb["cells"][0]["source"]).replace(
        "with the exercises: about 20 minutes; ", "")
    path.write_text(json.dumps(nb))
    reading_time.stamp(path, 1)
    first = reading_time.load(path)["cells"][0]["source"]
    text = "".join(first)
    assert text.count("Reading time") == 1 and text.startswith("# Chapter 99: Tiny\n\n*")
    assert "about 1 minute on" in text
    assert reading_time.reading_minutes(path) == before  # the line is not counted


def test_table_lists_every_chapter():
    table = reading_time.table(CHAPTERS)
    assert all(p.stem in table for p in CHAPTERS) and "hours" in table


@pytest.mark.parametrize("page", ["chapters/00_overview.ipynb", "book/intro.md"])
def test_the_book_states_the_total_the_tool_computes(page):
    """Chapter 0 and the intro say how many hours the chapters hold: the tool's total."""
    text = "".join(reading_time._source(c) for c in reading_time.load(ROOT / page)["cells"])
    stated = re.search(r"the chapters hold about (\d+) hours", text)
    assert stated, f"{page} does not say how many hours the chapters hold"
    total = sum(reading_time.reading_minutes(p) for p in reading_time.main_path()) / 60
    assert abs(int(stated.group(1)) - total) <= 1, (
        f"{page} says about {stated.group(1)} hours; tools/reading_time.py computes "
        f"{total:.1f}")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_the_landing_page_lists_every_chapter_with_its_stated_time(path):
    """Issue 72: book/intro.md's tables list every chapter and appendix, each with the
    reading time its first page states."""
    intro = (ROOT / "book" / "intro.md").read_text(encoding="utf-8")
    row = re.search(rf"\(\.\./chapters/{re.escape(path.name)}\)[^\n]*\| (\d+) min \| "
                    r"(\d+) min \|$", intro, re.M)
    assert row, f"book/intro.md: no row for {path.name} with its two times"
    read, with_exercises, _ = reading_time.stated(path)
    assert row.groups() == (str(read), str(with_exercises)), \
        f"{path.name}: intro.md says {row.groups()} min, the chapter {read, with_exercises}"
