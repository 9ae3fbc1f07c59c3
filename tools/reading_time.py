"""How long a chapter takes to read, by a formula that says what it assumes:

- prose at 150 words a minute when its sentences average 20 words, and slower in
  proportion when they are longer (a 25-word average: 120 words a minute). A reader who
  studies new technical material reads well below the 200-250 words a minute of easy
  prose (Carver's "learning" rate is about 200, his "memorizing" rate about 140);
  a long sentence holds more to take in, so the pace follows the sentence length,
  measured in each chapter;
- the code a reader sees on the website at 10 lines a minute;
- a figure (each plt.subplots or plt.figure of a cell whose output the page shows) at
  1 minute, a table of the prose at 5 seconds a row, a table a cell displays
  (display(...)) at 30 seconds;
- rounded up to 5 minutes.

The time with the exercises adds 15 minutes for each core exercise (a stub `def my_...`
that raises NotImplementedError, in the chapter's sections) and 10 for each exercise of
the closing "## Exercises" section (a numbered item in bold, "**1. ...**" or "1. **...**").
Neither counts running the cells: the line states that apart.

    python tools/reading_time.py                       the main path and the appendices
    python tools/reading_time.py chapters/03_kv_cache.ipynb ...
    python tools/reading_time.py --stamp chapters/03_kv_cache.ipynb --run-minutes 4
        writes (or updates) the chapter's line "*Reading time: about N minutes; with the
        exercises: about E minutes; running it: about M minutes on a laptop CPU.*" under
        the title of its first cell

Visible code is every code cell not tagged hide-input, hide-cell, remove-cell or
remove-input (the rule of tests/test_notebooks.py), and every fenced block of a
Markdown cell or page (read as code, not as prose). The reading-time line itself is not counted, so stamping a chapter does
not change its figure. The main path is chapters/*.ipynb; the appendices are the pages
of _toc.yml whose title starts with "Appendix".
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 150  # at SENTENCE_WORDS words a sentence; slower for longer ones
SENTENCE_WORDS = 20
CODE_LINES_PER_MINUTE = 10
FIGURE_MINUTES, TABLE_ROW_MINUTES, DISPLAYED_TABLE_MINUTES = 1, 5 / 60, 0.5
CORE_EXERCISE_MINUTES, CLOSING_EXERCISE_MINUTES = 15, 10
ROUND_TO = 5  # minutes
WORD = re.compile(r"\w[\w'’.,:/-]*")  # a word: no table bars, bullets or rules
HIDDEN_TAGS = {"hide-input", "hide-cell", "remove-cell", "remove-input"}
# A sentence ends at . ! or ? followed by space and a capital letter (or a code span,
# emphasis, a bracket or a quote); a paragraph, list item or table cell ends one too.
SENTENCE_END = re.compile(r'(?<=[.!?])["”’)]*\s+(?=[A-Z`*(\["“])')
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
CODE_FENCE = re.compile(r"^```(?!\{).*?^```[ \t]*$", re.M | re.S)  # not {admonition}
LINE = re.compile(r"^\*Reading time: about (\d+) minutes; with the exercises: about "
                  r"(\d+) minutes; running it: about (\d+) minutes? on a laptop CPU\.\*"
                  r"[ \t]*$", re.M)
ANY_LINE = re.compile(r"^\*Reading time: .*\*[ \t]*$", re.M)
FIGURE = re.compile(r"\bplt\.(?:subplots|figure)\(")
TABLE_ROW = re.compile(r"^\s*\|(?!\s*:?-+:?\s*\|)", re.M)  # not the |---| rule
STUB = re.compile(r"^def my_\w+\(.*?raise NotImplementedError", re.M | re.S)
CLOSING_EXERCISE = re.compile(r"^(?:\*\*\d+\.|\d+\. \*\*)", re.M)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _visible(cell: dict) -> bool:
    return not HIDDEN_TAGS & set(cell.get("metadata", {}).get("tags", []))


def sentences(text: str) -> int:
    """How many sentences the prose holds: headings, list items, table rows and
    paragraphs end a sentence; so do ., ! and ? before a new one."""
    text = FENCE.sub("", LINE.sub("", text))
    n = 0
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*|#]|\d+\.)\s)", text):
        n += sum(1 for s in SENTENCE_END.split(block) if WORD.search(s))
    return n


def counts(nb: dict) -> dict[str, int]:
    """Words and sentences of prose, visible code lines, the visible lines of exported
    code, figures, table rows of the prose, displayed tables, and exercises (core, in
    the sections; closing, in "## Exercises")."""
    words = code = engine = sents = figures = rows = shown = core = closing = 0
    closing_section = False
    for cell in nb["cells"]:
        text = _source(cell)
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "markdown":
            prose = CODE_FENCE.sub("", text)  # a fenced block of code is read as code
            words += len(WORD.findall(LINE.sub("", prose)))
            sents += sentences(prose)
            rows += len(TABLE_ROW.findall(prose))
            code += sum(len(b.splitlines()) - 2 for b in CODE_FENCE.findall(text))
            for heading in re.findall(r"^## .*", text, re.M):
                closing_section = heading.startswith("## Exercises")
            if closing_section:
                closing += len(CLOSING_EXERCISE.findall(text))
        elif cell["cell_type"] == "code":
            if not tags & {"remove-cell", "remove-output"}:  # its output is on the page
                figures += len(FIGURE.findall(text))
                shown += text.count("display(")
            if STUB.search(text) and not closing_section:
                core += 1
            if _visible(cell):
                lines = len(text.splitlines())
                code += lines
                if re.search(r"^\s*#\s*\|\s*export", text, re.M):
                    engine += lines
    return {"words": words, "sentences": sents, "code_lines": code, "engine_lines": engine,
            "figures": figures, "table_rows": rows, "displayed_tables": shown,
            "core_exercises": core, "closing_exercises": closing}


def pace(words: int, sentences: int) -> float:
    """Words a minute: WORDS_PER_MINUTE, slower in proportion to sentences longer than
    SENTENCE_WORDS words on average."""
    mean = words / sentences if sentences else SENTENCE_WORDS
    return WORDS_PER_MINUTE * SENTENCE_WORDS / max(SENTENCE_WORDS, mean)


def minutes(words: int, code_lines: int, sentences: int | None = None,
            figures: int = 0, table_rows: int = 0, displayed_tables: int = 0,
            exercises: float = 0, **_) -> int:
    """Minutes, rounded up to ROUND_TO (at least ROUND_TO); without a sentence count
    the prose is read at WORDS_PER_MINUTE. `exercises`: their minutes, if counted."""
    wpm = pace(words, sentences) if sentences is not None else WORDS_PER_MINUTE
    raw = (words / wpm + code_lines / CODE_LINES_PER_MINUTE + figures * FIGURE_MINUTES
           + table_rows * TABLE_ROW_MINUTES + displayed_tables * DISPLAYED_TABLE_MINUTES
           + exercises)
    return max(ROUND_TO, math.ceil(raw / ROUND_TO - 1e-9) * ROUND_TO)


def exercise_minutes(c: dict) -> int:
    return (c["core_exercises"] * CORE_EXERCISE_MINUTES
            + c["closing_exercises"] * CLOSING_EXERCISE_MINUTES)


def load(path: Path) -> dict:
    """A notebook, or a Markdown page as a notebook: its text one markdown cell, each
    fenced block a visible code cell."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix != ".md":
        return json.loads(text)
    cells = [{"cell_type": "markdown", "source": FENCE.sub("", text)}]
    for block in FENCE.findall(text):
        body = block.split("\n")[1:-1]  # without the fences
        cells.append({"cell_type": "code", "source": "\n".join(body), "metadata": {}})
    return {"cells": cells}


def reading_minutes(path: Path) -> int:
    return minutes(**counts(load(path)))


def exercises_minutes(path: Path) -> int:
    """Reading, then doing every exercise."""
    c = counts(load(path))
    return minutes(**c, exercises=exercise_minutes(c))


def main_path(root: Path = ROOT) -> list[Path]:
    """The chapters, chapters/NN_name.ipynb (an appendix notebook is NNa_name.ipynb)."""
    return [p for p in sorted((root / "chapters").glob("*.ipynb"))
            if re.fullmatch(r"\d\d_\w+", p.stem)]


def appendices(root: Path = ROOT) -> list[Path]:
    """The pages of _toc.yml whose title (first line) starts with "# Appendix"."""
    pages = []
    for name in re.findall(r"^\s*-\s*file:\s*(\S+)", (root / "_toc.yml").read_text(), re.M):
        for suffix in (".md", ".ipynb"):
            page = root / (name + suffix)
            if page.exists():
                first = load(page)["cells"][0]
                if _source(first).lstrip().startswith("# Appendix"):
                    pages.append(page)
    return pages


def stated(path: Path) -> tuple[int, int, int] | None:
    """(reading, with the exercises, running) minutes as the chapter's first markdown
    cell states them."""
    first = next((c for c in load(path)["cells"] if c["cell_type"] == "markdown"), None)
    m = LINE.search(_source(first)) if first else None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def line(read: int, with_exercises: int, run: int) -> str:
    unit = "minute" if run == 1 else "minutes"
    return (f"*Reading time: about {read} minutes; with the exercises: about "
            f"{with_exercises} minutes; running it: about {run} {unit} on a laptop CPU.*")


def stamp(path: Path, run_minutes: int) -> str:
    """Write the reading-time line into the chapter's first markdown cell: replace the
    line if it is there, else put it right under the title (the cell's first line)."""
    nb = load(path)
    cell = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    new = line(reading_minutes(path), exercises_minutes(path), run_minutes)
    text = _source(cell)
    if ANY_LINE.search(text):  # this line, or one in an older wording
        text = ANY_LINE.sub(new, text, count=1)
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{new}\n" + ("\n" + rest.lstrip("\n") if rest.strip() else "")
    cell["source"] = text.rstrip("\n").splitlines(keepends=True)
    Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n",
                          encoding="utf-8")
    return new


def table(paths: list[Path], title: str = "chapter") -> str:
    rows, total = [], {"words": 0, "code_lines": 0, "engine_lines": 0, "figures": 0,
                       "minutes": 0, "with_exercises": 0}
    for p in paths:
        c = counts(load(p))
        m, e = minutes(**c), minutes(**c, exercises=exercise_minutes(c))
        s = stated(p) if p.suffix == ".ipynb" else None
        per = c["words"] / c["sentences"] if c["sentences"] else 0
        rows.append((p.stem, c["words"], per, round(pace(c["words"], c["sentences"])),
                     c["code_lines"], c["engine_lines"], c["figures"], m, e,
                     "" if s is None else " / ".join(map(str, s))))
        for k in ("words", "code_lines", "engine_lines", "figures"):
            total[k] += c[k]
        total["minutes"] += m
        total["with_exercises"] += e
    head = (title, "words", "words/sent.", "words/min", "code lines", "engine",
            "figures", "minutes", "+exercises", "stated (read / +ex. / run)")
    out = [f"{head[0]:26} {head[1]:>7} {head[2]:>11} {head[3]:>9} {head[4]:>10} "
           f"{head[5]:>6} {head[6]:>7} {head[7]:>7} {head[8]:>10}  {head[9]}"]
    for r in rows:
        out.append(f"{r[0]:26} {r[1]:7,} {r[2]:11.1f} {r[3]:9} {r[4]:10,} {r[5]:6,} "
                   f"{r[6]:7} {r[7]:7} {r[8]:10}  {r[9]}")
    out.append(f"{'total':26} {total['words']:7,} {'':11} {'':9} {total['code_lines']:10,} "
               f"{total['engine_lines']:6,} {total['figures']:7} {total['minutes']:7} "
               f"{total['with_exercises']:10}  ({total['minutes'] / 60:.1f} and "
               f"{total['with_exercises'] / 60:.1f} hours)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--stamp", action="store_true",
                        help="write the reading-time line into the given chapters")
    parser.add_argument("--run-minutes", type=int,
                        help="with --stamp: minutes the chapter takes to run on a CPU")
    args = parser.parse_args(argv)
    paths = args.notebooks or main_path()
    if args.stamp:
        if not args.notebooks or args.run_minutes is None or args.run_minutes < 1:
            parser.error("--stamp needs notebooks and --run-minutes N (N >= 1)")
        for p in paths:
            print(f"{p.name}: {stamp(p, args.run_minutes)}")
        return 0
    print(table(paths))
    if not args.notebooks and appendices():
        print()
        print(table(appendices(), "appendix"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
