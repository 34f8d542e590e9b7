"""results.csv of a sweep: append rows as runs finish; on resume, find and drop damaged rows.

One row per finished run (``table_row``): run_id, the grid columns,
repetition, seed, the run's scalar metrics, wall_s last. Rows are appended
and flushed one at a time, so a killed sweep leaves at worst one cut line;
a disk or hand edit can damage any line. ``scan_table`` checks every row
against the header and the sweep's runs and ``drop_damaged`` rewrites the
file without the damaged ones, so a resume redoes exactly those runs and the
table never holds a run_id twice.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from reports.experiments.spec import RunTask
from sim.base.atomic import write_bytes_atomic
from sim.run.config import ConfigError

# The summary's text scalars (sim.run.runner); every other column after the grid columns holds a number or
# nothing. A new text scalar belongs here, or each resume would redo every run (test_sweep.py's resume
# test and test_pool_faults.py's .tmp test would fail first).
TEXT_METRICS = ("policy", "profile_source")
DROPPED = "dropped_rows.txt"


@dataclass(frozen=True)
class Damage:
    """A row of results.csv that a resume drops: its line number (the header is line 1), why, the
    sweep run it was written for when that can still be read (None otherwise), its bytes."""

    line: int
    why: str
    run_id: str | None
    raw: bytes


@dataclass(frozen=True)
class TableScan:
    """results.csv sorted into the lines to keep (the header first, byte for byte) and the damaged rows."""

    header: list[str]
    kept: list[bytes]
    ids: set[str]                 # run ids of the kept rows
    damaged: list[Damage]


def _split_lines(data: bytes) -> list[bytes]:
    """Physical lines, each with its line end; a last line without one was cut mid-write."""
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _parse_line(raw: bytes) -> tuple[list[str], str | None]:
    """(fields, None) of one physical line, or ([], why it cannot be read)."""
    if not raw.endswith(b"\n"):
        return [], "cut short (no line end: the sweep stopped while writing it)"
    try:
        text = raw[:-1].removesuffix(b"\r").decode("utf-8")
    except UnicodeDecodeError:
        return [], "garbage bytes (not UTF-8)"
    bad = next((c for c in text if not c.isprintable()), None)
    if bad is not None:
        return [], f"garbage bytes (control character {bad!r})"
    try:
        return next(csv.reader([text], strict=True), []), None
    except csv.Error as exc:
        return [], f"not CSV ({exc})"


def _header_problem(header: list[str]) -> str | None:
    if not header or header[0] != "run_id":
        return "it does not start with run_id"
    missing = [c for c in ("repetition", "seed", "wall_s") if c not in header]
    if missing:
        return f"it lacks the column(s) {', '.join(missing)}"
    if len(set(header)) < len(header):
        return "it names a column twice"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _row_problem(fields: list[str], header: list[str], numeric: list[str], runs: dict[str, RunTask] | None,
                 grid_cols: list[str]) -> str | None:
    """Why a parsed row is damaged, or None. With ``runs`` its run_id must be one of them and its
    grid columns, repetition and seed must be that run's, as ``table_row`` writes them."""
    if len(fields) != len(header):
        return f"{len(fields)} fields, the header has {len(header)}"
    row = dict(zip(header, fields))
    if runs is not None:
        task = runs.get(row["run_id"])
        if task is None:
            return f"run_id {row['run_id']!r} is not a run of this sweep"
        expected = {**{c: task.columns.get(c) for c in grid_cols}, "repetition": task.repetition, "seed": task.seed}
        for col, value in expected.items():
            want = "" if value is None else str(value)
            if row.get(col, "") != want:
                return f"column '{col}' is {row.get(col, '')!r}, run {task.run_id} has {want!r}"
    bad = next((c for c in numeric if row[c] and not _is_number(row[c])), None)
    return None if bad is None else f"column '{bad}' is {row[bad]!r}, not a number"


def scan_table(path: Path, runs: dict[str, RunTask] | None = None) -> TableScan:
    """Check every row of results.csv, line by line (damage stays on its own line).

    A row is damaged when its line was cut short, holds bytes that are not
    UTF-8 text, does not parse as CSV, has another number of fields than the
    header, holds a non-number in a numeric column, or repeats an earlier
    row's run_id; with ``runs`` (the sweep's runs by id) also when its run_id
    is none of them or its grid columns, repetition or seed are not its run's.
    A header cut short (the sweep stopped while writing it) leaves an empty
    table; any other damage to the header raises ConfigError: the rows cannot
    be read without it.
    """
    lines = _split_lines(path.read_bytes()) if path.is_file() else []
    if not lines:
        return TableScan([], [], set(), [])
    header, why = _parse_line(lines[0])
    why = why or _header_problem(header)
    if why is not None:
        if len(lines) == 1 and not lines[0].endswith(b"\n"):
            return TableScan([], [], set(), [Damage(1, f"the header is {why}", None, lines[0])])
        raise ConfigError(f"{path}: line 1 (the header) is damaged: {why}; fix: restore the file from a copy, "
                          f"or delete it to redo every run")
    grid_cols = grid_columns_of(runs.values()) if runs is not None else []
    text_cols = {"run_id", *header[:header.index("repetition")], *grid_cols, *TEXT_METRICS}
    numeric = [c for c in header if c not in text_cols]
    kept, first_line, damaged = [lines[0]], {}, []
    for n, raw in enumerate(lines[1:], start=2):
        fields, why = _parse_line(raw)
        why = why or _row_problem(fields, header, numeric, runs, grid_cols)
        if why is None and fields[0] in first_line:
            why = f"repeats run {fields[0]} of line {first_line[fields[0]]}"
        if why is not None:
            run_id = fields[0] if fields else raw[:12].decode("ascii", "replace")
            damaged.append(Damage(n, why, run_id if runs is not None and run_id in runs else None, raw))
            continue
        kept.append(raw)
        first_line[fields[0]] = n
    return TableScan(header, kept, set(first_line), damaged)


def read_table_ids(path: Path) -> tuple[list[str], set[str]]:
    """(header, run ids) of the rows of a table that pass the checks a resume makes without
    knowing the sweep's runs; ([], set()) when there is none."""
    scan = scan_table(path)
    return scan.header, scan.ids


def drop_damaged(path: Path, scan: TableScan) -> list[str]:
    """Rewrite the table without its damaged rows (atomically), keeping their bytes in DROPPED
    beside it; return one line per dropped row: where, why, and which run will be redone."""
    with (path.parent / DROPPED).open("ab") as f:
        f.writelines(d.raw for d in scan.damaged)
    write_bytes_atomic(path, b"".join(scan.kept))
    return [f"{path} line {d.line}: {d.why}; dropped the row (kept in {DROPPED})"
            + (f", run {d.run_id} will be redone" if d.run_id and d.run_id not in scan.ids else "")
            for d in scan.damaged]


def _rewrite_with_header(path: Path, header: list[str]) -> None:
    """Re-write the table under a wider header (new columns empty in old rows), atomically."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=header)
    writer.writeheader()
    writer.writerows(rows)
    write_bytes_atomic(path, text.getvalue().encode("utf-8"))


class ResultsTable:
    """Append-only CSV: one row per run, flushed as written; widens its header if needed."""

    def __init__(self, path: Path, header: list[str]) -> None:
        self.path = path
        self.header = header

    def append(self, row: dict[str, Any]) -> None:
        missing = [k for k in row if k not in self.header]
        if missing or not self.header:
            if self.header:
                self.header = self.header[:-1] + missing + self.header[-1:]   # wall_s stays last
                _rewrite_with_header(self.path, self.header)
            else:
                self.header = list(row)
                with self.path.open("w", newline="") as f:
                    csv.writer(f).writerow(self.header)
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.header).writerow({k: "" if v is None else v for k, v in row.items()})
            f.flush()


def table_row(task: RunTask, metrics: dict[str, Any], grid_columns: Sequence[str]) -> dict[str, Any]:
    row: dict[str, Any] = {"run_id": task.run_id}
    row.update({c: task.columns.get(c) for c in grid_columns})
    row.update(repetition=task.repetition, seed=task.seed)
    wall = metrics.get("wall_s")
    row.update({k: v for k, v in metrics.items() if k != "wall_s"})
    row["wall_s"] = wall
    return row


def grid_columns_of(tasks: Iterable[RunTask]) -> list[str]:
    cols: dict[str, None] = {}
    for t in tasks:
        cols.update(dict.fromkeys(t.columns))
    return list(cols)
