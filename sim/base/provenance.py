"""Where a result came from: the one home of the provenance helpers that
run directories (``sim.results.folder``), calibrated profiles (``calibrate``) and
reports stamp on what they write."""

from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path


def git_revision(repo_dir: str | Path | None = None) -> str:
    """``git rev-parse HEAD`` of the repository holding batchsim (or ``repo_dir``); "unknown" if none."""
    cwd = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def utc_now_iso() -> str:
    """Now, in UTC, to the second (ISO 8601)."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
