"""Run directories: the only place the simulator writes files.

A run directory holds requests.csv, steps.csv, tokens.npz (every output
token: req_id, t_s), summary.json and meta.json. Files are written to a
temporary name and renamed, and summary.json is written last, so a directory
with a summary.json is complete.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sim.config import ConfigError
from sim.runner import RunResult


class OutputError(ConfigError):
    """An output that cannot be written (no permission, disk full); one line."""


def _atomic(path: Path, write) -> None:
    """Write through a temporary name and rename; on failure leave no ``.tmp``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc}); the run directory is "
                          f"incomplete (no summary.json)") from None


def ensure_writable(out_dir: str | Path) -> Path:
    """Check before any work that ``out_dir`` can be created and written."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".batchsim-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"--out {out}: cannot write there ({exc.strerror or exc}); choose another "
                          f"directory") from None
    return out


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import simpy
    from importlib import metadata
    try:
        batchsim = metadata.version("batchsim")
    except metadata.PackageNotFoundError:
        batchsim = "unknown"
    return {"batchsim": batchsim, "python": platform.python_version(), "numpy": np.__version__,
            "pandas": pd.__version__, "simpy": simpy.__version__}


def write_json(path: Path, data: Any) -> None:
    _atomic(path, lambda p: p.write_text(json.dumps(data, indent=2, default=str) + "\n"))


def write_run(result: RunResult, out_dir: str | Path) -> Path:
    out = ensure_writable(out_dir)
    stale = out / "summary.json"
    if stale.exists():
        stale.unlink()                     # a half-rewritten directory must not look complete
    _atomic(out / "requests.csv", lambda p: result.requests.to_csv(p, index=False))
    _atomic(out / "steps.csv", lambda p: result.steps.to_csv(p, index=False))

    def tokens(p: Path) -> None:
        with open(p, "wb") as f:
            np.savez_compressed(f, req_id=result.tokens["req_id"].to_numpy(),
                                t_s=result.tokens["t_s"].to_numpy())
    _atomic(out / "tokens.npz", tokens)
    meta = dict(result.meta)
    meta.setdefault("git_revision", git_revision())
    meta.setdefault("versions", versions())
    write_json(out / "meta.json", meta)
    write_json(out / "summary.json", result.summary)
    return out


def read_run(out_dir: str | Path) -> RunResult:
    out = Path(out_dir)
    if not (out / "summary.json").is_file():
        raise FileNotFoundError(f"{out}: not a complete run directory (no summary.json)")
    with np.load(out / "tokens.npz") as z:
        tokens = pd.DataFrame({"req_id": z["req_id"], "t_s": z["t_s"]})
    return RunResult(
        requests=pd.read_csv(out / "requests.csv"),
        steps=pd.read_csv(out / "steps.csv"),
        tokens=tokens,
        summary=json.loads((out / "summary.json").read_text()),
        meta=json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {},
    )
