"""`sim report DIR`: rebuild figures and reports from saved results alone.

DIR may be a sweep directory (results.csv), a plan directory (plan.json) or a
single run directory (summary.json, as ``sim.results.folder.write_run`` writes it).
Figures go to DIR/figures/ as PNG and SVG; the report to DIR/report.md and
DIR/report.html.
"""

from __future__ import annotations

import errno
import json
import zipfile
from pathlib import Path
from typing import Callable

import pandas as pd

from reports.presentation.planreport import plan_report
from reports.presentation.runreport import run_report
from reports.presentation.sweepreport import sweep_report
from sim.run.config import ConfigError


def regenerate(directory: Path) -> list[Path]:
    """Rebuild figures and report of a sweep, plan or run directory; return the files written."""
    d = Path(directory)
    if not d.exists():
        raise ConfigError(f"{d}: no such folder; fix: pass the --out folder of `sim sweep`, `sim plan` or `sim run`")
    if (d / "plan.json").is_file():
        return _prune(d, _build(d, "plan", plan_report, json_files=("plan.json",), tables=("ranked.csv",),
                                others=("trials.csv",)))
    if (d / "results.csv").is_file():
        return _prune(d, _build(d, "sweep", sweep_report, json_files=("sweep.json",), tables=("results.csv",)))
    if (d / "summary.json").is_file():
        return _prune(d, _build(d, "run", run_report, json_files=("summary.json", "meta.json"),
                                tables=("requests.csv", "steps.csv"), others=("tokens.npz",)))
    raise ConfigError(f"{d}: not a sweep, plan or run directory (expected results.csv, plan.json or summary.json); "
                      f"fix: pass the --out directory of `sim sweep`, `sim plan` or `sim run`")


# What a damaged or hand-edited results file raises while a report reads it.
DAMAGED = (ValueError, KeyError, IndexError, TypeError, AttributeError, zipfile.BadZipFile, EOFError)


def _build(d: Path, kind: str, report: Callable[[Path], list[Path]], *, json_files: tuple[str, ...],
           tables: tuple[str, ...], others: tuple[str, ...] = ()) -> list[Path]:
    """Check the folder's files (present, JSON objects, tables with a header), then build its
    report; a file that is missing or damaged is a one-line error naming it, not a traceback."""
    fix = (f"fix: {'run the workload' if kind == 'run' else 'run the ' + kind} again into a new folder "
           f"(sim {kind} ... --out NEW); the report is rebuilt from its saved results")
    for name in (*json_files, *tables, *others):
        path = d / name
        if not path.is_file():
            if name in ("meta.json", "sweep.json"):      # older folders lack them; the report copes
                continue
            raise ConfigError(f"{d}: this {kind} folder has no {name}; {fix}")
        try:
            if name in json_files and not isinstance(json.loads(path.read_text()), dict):
                raise ValueError("expected a JSON object")
            if name in tables:
                pd.read_csv(path, nrows=1)
        except (ValueError, pd.errors.ParserError) as exc:
            raise ConfigError(f"{path}: damaged ({str(exc).splitlines()[0] or type(exc).__name__}); {fix}") from None
    _check_rows(d, kind, fix)
    try:
        return report(d)
    except FileNotFoundError as exc:
        raise ConfigError(f"{d}: this {kind} folder has no {Path(exc.filename or '?').name}; {fix}") from None
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTDIR, errno.EACCES, errno.EROFS, errno.ENOSPC):
            raise                          # where the report goes, not what it reads: sim.cli says which
        raise ConfigError(f"{d}: cannot read this {kind} folder ({exc}); {fix}") from None
    except DAMAGED as exc:
        what = f"missing field or column {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
        raise ConfigError(f"{d}: this {kind} folder's files are damaged or from another version "
                          f"({type(exc).__name__}: {what}); {fix}") from None


def _check_rows(d: Path, kind: str, fix: str) -> None:
    """Rows the report would silently draw from less than: a sweep table row that is cut,
    garbled or repeated (as ``sim sweep`` checks it on a resume), a requests table shorter than
    the run it summarises."""
    if kind == "sweep":
        from reports.experiments.table import scan_table
        scan = scan_table(d / "results.csv")
        if not scan.header:
            raise ConfigError(f"{d / 'results.csv'}: the header was cut short; rerun the same `sim sweep` "
                              f"into this folder to redo the runs")
        if scan.damaged:
            first = scan.damaged[0]
            raise ConfigError(f"{d / 'results.csv'} line {first.line}: {first.why} ({len(scan.damaged)} damaged "
                              f"row(s)); rerun the same `sim sweep` into this folder: it drops them and redoes "
                              f"those runs")
    elif kind == "run":
        summary = json.loads((d / "summary.json").read_text())
        want = summary.get("completed", 0) + summary.get("failed", 0) if isinstance(summary, dict) else None
        with (d / "requests.csv").open("rb") as f:
            rows = sum(1 for _ in f) - 1
        if isinstance(want, int) and rows != want:
            raise ConfigError(f"{d / 'requests.csv'}: {rows:,} rows, but summary.json counts {want:,} requests "
                              f"(the file was cut or edited); {fix}")


def _prune(d: Path, written: list[Path]) -> list[Path]:
    """Remove figures an earlier report wrote that this one no longer has (they would look current)."""
    keep = {p.resolve() for p in written}
    for path in (d / "figures").glob("*"):
        if path.suffix in (".png", ".svg") and path.resolve() not in keep:
            path.unlink()
    return written
