"""`sim report DIR`: rebuild figures and reports from saved results alone.

DIR may be a sweep directory (results.csv), a plan directory (plan.json) or a
single run directory (summary.json, as ``sim.io.write_run`` writes it).
Figures go to DIR/figures/ as PNG and SVG; the report to DIR/report.md and
DIR/report.html.
"""

from __future__ import annotations

from pathlib import Path

from reports.presentation.planreport import plan_report
from reports.presentation.runreport import run_report
from reports.presentation.sweepreport import sweep_report
from sim.config import ConfigError


def regenerate(directory: Path) -> list[Path]:
    """Rebuild figures and report of a sweep, plan or run directory; return the files written."""
    d = Path(directory)
    if (d / "plan.json").is_file():
        return _prune(d, plan_report(d))
    if (d / "results.csv").is_file():
        return _prune(d, sweep_report(d))
    if (d / "summary.json").is_file():
        return _prune(d, run_report(d))
    raise ConfigError(f"{d}: not a sweep, plan or run directory (expected results.csv, plan.json or summary.json); "
                      f"fix: pass the --out directory of `sim sweep`, `sim plan` or `sim run`")


def _prune(d: Path, written: list[Path]) -> list[Path]:
    """Remove figures an earlier report wrote that this one no longer has (they would look current)."""
    keep = {p.resolve() for p in written}
    for path in (d / "figures").glob("*"):
        if path.suffix in (".png", ".svg") and path.resolve() not in keep:
            path.unlink()
    return written
