"""Run directories: the only place the simulator writes files (with
``sim.results.runfiles``, whose second process writes ``sim run``'s steps.csv and
tokens.npz while the run goes on; ``write_run`` renames them into place).

A run directory holds requests.csv, steps.csv, tokens.npz (every output
token: req_id, t_s), meta.json, vllm_bench.json (``vllm bench serve``'s
result format), optionally trace.json (a Perfetto trace) and prefix_cache.csv
(with a prefix cache: its time line), summary.json, and,
once a report is built, report.md, report.html and figures/. Files are
written to a temporary name and renamed, and summary.json is written last, so
a directory with a summary.json is complete. A run never lands on top of
another by accident: ``prepare_run_dir`` picks a fresh folder or refuses, and
``write_run`` first removes what an earlier run wrote there (the second
process writes through names of its own, ``.steps.csv.PID.tmp``, so that
removal cannot take its files).
"""

from __future__ import annotations

import json
import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, NamedTuple, TextIO

import numpy as np
import pandas as pd

from sim.base.atomic import tmp_path, write_atomic
from sim.results.runfiles import RunFilesProcess, csv_columns, write_tokens_npz
from sim.base.provenance import git_revision
from sim.base.strict import ConfigError
from sim.base.heap import trim_heap
from sim.results.result import RunResult


class OutputError(ConfigError):
    """An output that cannot be written (no permission, disk full, a run already there); one line."""


# What batchsim writes into a run directory: its files and, under figures/, the reports' images.
RUN_FILES = ("summary.json", "requests.csv", "steps.csv", "tokens.npz", "meta.json", "vllm_bench.json",
             "trace.json", "report.md", "report.html", "prefix_cache.csv", "pd_timeline.csv",
             "pd_phases.png")
FIGURE_SUFFIXES = (".png", ".svg")


def _atomic(path: Path, write) -> None:
    """``sim.base.atomic.write_atomic``, with a failure (a full disk, no permission) as a one-line error."""
    try:
        write_atomic(path, write)
    except OSError as exc:
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


def holds_run(out_dir: Path) -> bool:
    """Whether ``out_dir`` already holds (part of) a run or its report."""
    return any((out_dir / name).exists() for name in RUN_FILES) or (out_dir / "figures").is_dir()


# The files that say which command's results a folder holds (``folder_kind``).
FOLDER_MARKS = {"run": ("summary.json", "requests.csv", "meta.json", "vllm_bench.json"),
                "sweep": ("sweep.json", "results.csv"), "plan": ("plan.json", "ranked.csv", "trials.csv")}
WHAT = {"run": "a run (sim run)", "sweep": "a sweep's results (sim sweep)", "plan": "a capacity plan (sim plan)"}


def folder_kind(d: Path) -> str | None:
    """Which command's results ``d`` holds: 'run', 'sweep' or 'plan' (None: none of them)."""
    return next((kind for kind, names in FOLDER_MARKS.items() if any((d / n).exists() for n in names)), None)


def refuse_foreign(d: Path, mine: str, flag: str = "--out") -> None:
    """Refuse, before any work, to write ``mine``'s results into a folder that holds another
    command's: their files would mix (and --overwrite would delete the other's report)."""
    kind = folder_kind(d) if d.is_dir() else None
    if kind is not None and kind != mine:
        raise OutputError(f"{flag} {d}: holds {WHAT[kind]}; writing {WHAT[mine].split(' (')[0]} there would "
                          f"mix their files; choose another folder")


class RunDir(NamedTuple):
    path: Path                 # where the run goes
    taken: Path | None         # the folder it was kept out of, if any
    made: Path | None          # the top-most folder this call created (removed if the run fails)


def prepare_run_dir(out: str | Path | None, default: Path, *, overwrite: bool = False) -> RunDir:
    """The folder a run goes to, checked writable before any work, and the
    folder it was kept out of (None if none). ``out`` holding a run is refused
    unless ``overwrite``; without ``out``, ``default`` is used if free (or with
    ``overwrite``), else the first free of DEFAULT-2, DEFAULT-3, ..."""
    if out is not None:
        refuse_foreign(Path(out), "run")
        if holds_run(Path(out)) and not overwrite:
            raise OutputError(f"--out {out}: already holds a run; pass --overwrite to replace it, or choose "
                              f"another --out")
        path, taken = Path(out), None
    else:
        path, k = default, 1
        while (holds_run(path) and not overwrite) or folder_kind(path) not in (None, "run"):
            k += 1
            path = default.with_name(f"{default.name}-{k}")
        taken = default if path != default else None
    made = next((p for p in reversed((path, *path.parents)) if not p.exists()), None)
    return RunDir(ensure_writable(path), taken, made)


def remove_if_empty(run_dir: RunDir) -> None:
    """After a failed run: remove the folders ``prepare_run_dir`` made, if nothing is in them,
    so that a run that never happened leaves no empty folder that looks like one."""
    if run_dir.made is None:
        return
    for folder in (run_dir.path, *run_dir.path.parents):
        try:
            folder.rmdir()                 # only an empty folder goes
        except OSError:
            return
        if folder == run_dir.made:
            return


def clear_run(out_dir: Path) -> None:
    """Remove what batchsim wrote into ``out_dir`` (summary.json first, so the
    folder stops looking complete at once); files it did not write stay."""
    for name in RUN_FILES:
        for path in (out_dir / name, tmp_path(out_dir / name)):
            path.unlink(missing_ok=True)
    figures = out_dir / "figures"
    if figures.is_dir():
        for path in figures.iterdir():
            if path.is_file() and path.suffix in FIGURE_SUFFIXES:
                path.unlink()
        if not any(figures.iterdir()):
            figures.rmdir()


def versions() -> dict[str, str]:
    import simpy
    from importlib import metadata
    try:
        batchsim = metadata.version("batchsim")
    except metadata.PackageNotFoundError:
        batchsim = "unknown"
    return {"batchsim": batchsim, "python": platform.python_version(), "numpy": np.__version__,
            "pandas": pd.__version__, "simpy": simpy.__version__}


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    """``data`` as JSON; a compact (``indent`` None) mapping's chunked series (vllm_bench.json's
    per-request ``sim.results.vllm_bench.PerRequest``, a million values in a large run) are written as
    lists, chunk by chunk: the text ``json.dumps`` of their lists would give, never built whole."""
    if indent is None and isinstance(data, dict) and any(_chunked(v) for v in data.values()):
        write_text_chunks(path, _json_chunks(data))
        return
    _atomic(path, lambda p: p.write_text(json.dumps(data, indent=indent, default=str) + "\n"))


JSON_ROWS = 65_536          # values per piece of ``_json_chunks``


def _chunked(value: Any) -> bool:
    """A series made chunk by chunk (``sim.results.vllm_bench.PerRequest``: ``chunks()`` yields arrays)."""
    return callable(getattr(value, "chunks", None))


def _json_chunks(data: dict[str, Any]) -> Iterable[str]:
    yield "{"
    for k, (key, value) in enumerate(data.items()):
        yield (", " if k else "") + json.dumps(str(key)) + ": "
        if not _chunked(value):
            yield json.dumps(value, default=str)
            continue
        yield "["
        first = True
        for chunk in value.chunks():
            for lo in range(0, len(chunk), JSON_ROWS):
                part = chunk[lo:lo + JSON_ROWS].tolist()
                if part:
                    yield ("" if first else ", ") + json.dumps(part)[1:-1]
                    first = False
        yield "]"
    yield "}\n"


def write_text_chunks(path: Path, chunks: Iterable[str]) -> None:
    def write(p: Path) -> None:
        with open(p, "w", encoding="utf-8") as f:
            f.writelines(chunks)
    _atomic(path, write)


def write_csv_chunks(path: Path, frames: Iterable[pd.DataFrame]) -> None:
    """One CSV of ``frames`` (same columns) written one after the other: the
    header once, no index; the bytes ``to_csv`` writes for their concatenation."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        for k, frame in enumerate(frames):
            write_csv(f, frame, header=k == 0)


def write_csv(f: TextIO, frame: pd.DataFrame, *, header: bool = True, rows: int | None = None) -> None:
    """``frame.to_csv(f, index=False, header=header)``, byte for byte, three
    times faster on the simulator's tables (``csv_text``), ``rows`` at a time
    (default: 200,000 cells' worth, ~15 MB of strings held at once)."""
    rows = rows or max(1000, 200_000 // max(1, len(frame.columns)))
    for lo in range(0, max(len(frame), 1), rows):
        part = frame.iloc[lo:lo + rows]
        text = csv_text(part, header=header and lo == 0)
        if text is None:
            part.to_csv(f, index=False, header=header and lo == 0)
        else:
            f.write(text)


def csv_text(frame: pd.DataFrame, *, header: bool = True) -> str | None:
    """What ``frame.to_csv(index=False, header=header)`` returns, or None for a
    frame it does not know how to write the same way (then call ``to_csv``):
    ``sim.results.runfiles.csv_columns`` of its columns (ints, float64, bools and
    plain strings, which is what the simulator's tables hold)."""
    return csv_columns(list(frame.columns), [frame[name].to_numpy() for name in frame.columns], header=header)


def write_run(result: RunResult, out_dir: str | Path, *, bench: dict[str, Any] | None = None,
              trace: Iterable[str] | None = None, files: RunFilesProcess | None = None) -> Path:
    """Write ``result`` into ``out_dir`` over whatever an earlier run left there,
    with ``bench`` as vllm_bench.json (compact, as vLLM writes it) and the
    ``trace`` chunks as trace.json. ``files``: the process that wrote this
    run's steps.csv and tokens.npz while it ran (``sim.results.runfiles``), if one did."""
    out = ensure_writable(out_dir)
    try:
        clear_run(out)                     # a half-rewritten directory must not look complete
    except OSError as exc:
        raise OutputError(f"{out}: cannot remove the earlier run's files ({exc.strerror or exc})") from None
    if files is not None and files.started:
        _atomic(out / "requests.csv", lambda p: write_csv_chunks(p, result.request_frames()))
        trim_heap()                         # the row chunks' frames and strings
        failed = files.commit()                 # "FILE: why"
        if failed is not None:
            name, _, why = failed.partition(": ")
            raise OutputError(f"{out / name}: cannot write ({why}); the run directory is incomplete "
                              f"(no summary.json)")
    else:
        # tokens.npz is mostly zlib, which releases the GIL: it compresses on a second thread
        # while this one formats the CSVs (the conversation trace: ~0.2 s of ~0.7 s saved).
        with ThreadPoolExecutor(max_workers=1) as pool:
            tokens = pool.submit(_atomic, out / "tokens.npz",
                                 lambda p: write_tokens_npz(p, result.token_chunks, result.num_tokens))
            _atomic(out / "requests.csv", lambda p: write_csv_chunks(p, result.request_frames()))
            _atomic(out / "steps.csv", lambda p: write_csv_chunks(p, result.step_frames()))
            tokens.result()
    if result.prefix_cache is not None:
        _atomic(out / "prefix_cache.csv", lambda p: write_csv_chunks(p, iter((result.prefix_cache,))))
    if result.pd_timeline is not None:
        _atomic(out / "pd_timeline.csv", lambda p: write_csv_chunks(p, iter((result.pd_timeline,))))
    meta = dict(result.meta)
    if files is not None and files.peak_rss_mib is not None:
        meta["files_process_peak_rss_mib"] = round(files.peak_rss_mib, 1)    # the second process's own
    meta.setdefault("git_revision", git_revision())
    meta.setdefault("versions", versions())
    write_json(out / "meta.json", meta)
    if bench is not None:
        write_json(out / "vllm_bench.json", bench, indent=None)
    if trace is not None:
        write_text_chunks(out / "trace.json", trace)
    write_json(out / "summary.json", result.summary)
    return out


def read_run(out_dir: str | Path) -> RunResult:
    out = Path(out_dir)
    if not (out / "summary.json").is_file():
        raise FileNotFoundError(f"{out}: not a complete run directory (no summary.json)")
    with np.load(out / "tokens.npz") as z:
        tokens = pd.DataFrame({"req_id": z["req_id"], "t_s": z["t_s"]})
    result = RunResult(
        requests=pd.read_csv(out / "requests.csv"),
        steps=pd.read_csv(out / "steps.csv"),
        tokens=tokens,
        summary=json.loads((out / "summary.json").read_text()),
        meta=json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {},
    )
    if (out / "prefix_cache.csv").is_file():
        result.prefix_cache = pd.read_csv(out / "prefix_cache.csv")
    if (out / "pd_timeline.csv").is_file():
        result.pd_timeline = pd.read_csv(out / "pd_timeline.csv")
    return result
