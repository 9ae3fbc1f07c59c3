"""Benchmark results: one type (Result), one naming scheme and one CSV writer for
all the benchmarks of chapters 3 to 7 (chapter 3 introduces it)."""
from __future__ import annotations

import csv
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["file_stem", "rows_table", "write_csvs", "Result"]


def file_stem(kind: str, model: str, device: str, *extra: str) -> str:
    """<kind>_<model>_<device>[_<extra>...]; the model name keeps letters, digits,
    '.', '_' and '-'."""
    model = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-.")
    return "_".join([kind, model or "model", device, *extra])


def rows_table(rows: list[dict], info: dict | None = None,
               digits: int | None = 6) -> list[list]:
    """A header and one row per dict (`info`'s values appended to each, unless the rows
    have them); a key that a row lacks is left empty, floats are rounded to `digits`
    (None: as they are)."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    info = {k: v for k, v in (info or {}).items() if k not in fields}  # once
    values = [[r.get(k, "") for k in fields] + list(info.values()) for r in rows]
    return [fields + list(info)] + [
        [round(v, digits) if digits is not None and isinstance(v, float) else v
         for v in row] for row in values]


def write_csvs(folder: str | Path, tables: dict[str, list[list]]) -> list[Path]:
    """Write every table to <folder>/<name>.csv: all of them aside first, then each
    renamed into place (os.replace), so that a full disk or a crash leaves the old
    files whole, never half a file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    temps, paths = [], [folder / f"{name}.csv" for name in tables]
    try:
        for name, rows in tables.items():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            temps.append(tmp)
            os.chmod(tmp, 0o644)  # mkstemp makes it private (0o600); a CSV is not
            with os.fdopen(fd, "w", newline="") as f:
                csv.writer(f).writerows(rows)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)
    return paths


@dataclass
class Result:
    """What a benchmark measured, the one type every benchmark returns.

    rows: one per way it ran (named in column `key`; `names` maps a short key, as the
    command line spells it, to the row's name); info: the facts of the run, written into
    every CSV row; tables: more rows by name (a token's time, a request's record),
    written beside the summary as <stem>_<name>.csv; work and setup: what it ran, in
    words, for describe(); ratio() compares the `score` column."""
    rows: list[dict]
    info: dict = field(default_factory=dict)
    tables: dict[str, list[dict]] = field(default_factory=dict)
    kind: str = "bench"             # the file name's first word
    stem_extra: tuple = ()          # and its last words (a rate, a prefix)
    key: str = "method"
    names: dict = field(default_factory=dict)
    score: str = "per_token_ms"
    lower_is_better: bool = True    # a time (True) or a rate (False)
    work: str = ""                  # e.g. "a 20-token prompt + 5 new tokens"
    setup: str = ""                 # a line on the engine's limits, if any
    digits: int | None = 6          # the CSV's floats rounded (None: as they are)

    def row(self, name: str) -> dict:
        """A row by its name ('paged + prefix cache') or its key ('paged-prefix')."""
        name = self.names.get(name, name)
        for r in self.rows:
            if r[self.key] == name:
                return r
        raise KeyError(f"no {self.key} {name!r}; measured: "
                       f"{[r[self.key] for r in self.rows]}")

    def ratio(self, slow: str, fast: str, column: str | None = None) -> float:
        """How many times `fast` beats `slow` in `column` (the score by default):
        above 1, `fast` is better."""
        column = column or self.score
        a, b = self.row(slow)[column], self.row(fast)[column]
        return a / b if self.lower_is_better else b / a

    def series(self, table: str, column: str) -> dict[str, list]:
        """One list of `column` per way, from tables[table] (its rows in order)."""
        out: dict[str, list] = {}
        for r in self.tables[table]:
            out.setdefault(r[self.key], []).append(r[column])
        return out

    def rows_of(self, table: str, name: str) -> list[dict]:
        """tables[table]'s rows of one way (by name or key)."""
        name = self.row(name)[self.key]
        return [r for r in self.tables[table] if r[self.key] == name]

    def describe(self, short: bool = False) -> str:
        """Where and how this was measured: the work, then the machine on a line of
        its own."""
        i = self.info
        if short:
            return f"{i['model']}, {i['device']}, {self.work}"
        about = ", ".join(f"{x}" for x in (
            f"{i['params_M']}M parameters" if "params_M" in i else None,
            i.get("dtype")) if x)
        return "\n".join(x for x in (
            f"{i['model']}" + (f" ({about})" if about else "") + f", {self.work}",
            self.setup, f"measured on {i['hardware']}, torch {i['torch']}") if x)

    @property
    def stem(self) -> str:
        """<kind>_<model>_<device>[_<extra>...]: the name of the files it writes."""
        return file_stem(self.kind, self.info["model"], self.info["device"],
                         *self.stem_extra)

    def write(self, folder: str | Path) -> list[Path]:
        """<folder>/<stem>.csv (the rows, with info); <stem>_<name>.csv per table."""
        return write_csvs(folder, {
            self.stem: rows_table(self.rows, self.info, self.digits), **{
            f"{self.stem}_{name}": rows_table(rows, digits=7 if name == "steps" else 6)
            for name, rows in self.tables.items()}})
