"""Benchmark results as files: one naming scheme and one CSV writer for all the
benchmarks of chapters 3 to 7 (chapter 3 introduces it)."""
from __future__ import annotations

import csv
import os
import re
import tempfile
from pathlib import Path

__all__ = ["file_stem", "rows_table", "write_csvs", "write_result"]


def file_stem(kind: str, model: str, device: str, *extra: str) -> str:
    """<kind>_<model>_<device>[_<extra>...]; the model name keeps letters, digits,
    '.', '_' and '-'."""
    model = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-.")
    return "_".join([kind, model or "model", device, *extra])


def rows_table(rows: list[dict], info: dict | None = None,
               digits: int | None = 6) -> list[list]:
    """A header and one row per dict (`info`'s values appended to each); a key that a
    row lacks is left empty, floats are rounded to `digits` (None: as they are)."""
    info = info or {}
    fields = list(dict.fromkeys(k for r in rows for k in r))
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


def write_result(folder: str | Path, stem: str, result) -> list[Path]:
    """<folder>/<stem>.csv: one row per entry of `result.rows`, with `result.info`."""
    return write_csvs(folder, {stem: rows_table(result.rows, result.info)})
