"""`sim sweep`: run a grid of workload variants into one tidy, resumable table.

Output directory::

    results.csv    one row per finished run, appended and flushed as each run
                   ends: run_id, the grid columns, repetition, seed, every
                   scalar summary metric, offered_rate, sim_wall_s, wall_s
    sweep.json     what the table depends on (base, grid, fingerprint)
    failed.jsonl   runs that raised (retried by the next invocation)
    runs/<run_id>/ each run's files, only with ``save_runs: true``
    figures/, report.md, report.html   written when the sweep ends

Rerunning the same sweep skips every run_id already in results.csv, so an
interrupted sweep resumes where it stopped and a grid can be extended. A
damaged row (cut short, garbage bytes, wrong field count, a non-number where
a number belongs, a run_id or grid values that are not one of the sweep's
runs, a repeated run_id) is named in one line on stderr, moved to
dropped_rows.txt, and its run is redone (``reports.experiments.table``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from reports.experiments.pool import check_pool_args, run_tasks
from reports.experiments.spec import RunTask, SweepSpec, expand, parse_sweep
from reports.experiments.table import ResultsTable, drop_damaged, grid_columns_of, scan_table, table_row
from sim.run.config import ConfigError
from sim.results.folder import WHAT, folder_kind, write_json

TABLE = "results.csv"
LEAD_COLUMNS = ("run_id",)
TAIL_COLUMNS = ("repetition", "seed")


class SweepFailed(ConfigError):
    """Some runs raised; the others are in the table. Reported like bad input (one
    line, exit status 2); the tracebacks are in failed.jsonl."""

    def __init__(self, message: str, table: Path) -> None:
        super().__init__(message)
        self.table = table


def scalar_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's scalar entries (drops the per-replica list and other nesting)."""
    return {k: v for k, v in summary.items() if v is None or isinstance(v, (bool, int, float, str))}


def offered_rate(arrival_s: Any) -> float | None:
    """Mean arrival rate of a run, (n - 1) / span, as the trace README defines it."""
    n = len(arrival_s)
    span = float(arrival_s.max() - arrival_s.min()) if n > 1 else 0.0
    return (n - 1) / span if span > 0 else None


def run_task(task: RunTask) -> dict[str, Any]:
    """Worker entry point: simulate one run and return its table metrics (no DataFrames)."""
    import warnings

    from sim.run.config import workload_from_dict
    from sim.run.runner import run_workload

    t0 = time.perf_counter()
    cfg = workload_from_dict(task.raw, task.source, task.base_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # rejections are counted in 'failed'
        result = run_workload(cfg, num_replicas=task.num_replicas, router=task.router)
    if task.save_dir:
        from sim.results.folder import write_run
        write_run(result, task.save_dir)
    row = scalar_summary(result.summary)
    row["offered_rate"] = offered_rate(result.requests["arrival_s"])
    row["sim_wall_s"] = result.meta.get("wall_s")
    row["wall_s"] = time.perf_counter() - t0
    return row


# ---- the sweep -------------------------------------------------------------------
def _check_same_sweep(spec: SweepSpec, meta_path: Path, table: Path) -> None:
    if not meta_path.is_file() or not table.is_file():
        return
    old = json.loads(meta_path.read_text())
    if old.get("fingerprint") != spec.fingerprint():
        raise ConfigError(f"{spec.source}: field 'out' ({spec.out}) holds results of a different sweep (another "
                          f"base workload, 'set', grid keys or run settings); fix: choose another out: / --out, "
                          f"or delete {table} to start over")


LOCK = ".sweep.lock"


def lock_folder(out: Path):
    """Hold an exclusive lock on ``out`` for this process's lifetime (the OS drops it when the
    process dies, kill -9 included): two sweeps on one folder would interleave their rows."""
    import fcntl

    handle = open(out / LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"--out {out}: another sweep is writing there ({holder}); wait for it to finish, or "
                          f"choose another --out") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def _remove_stale_tmp(out: Path) -> None:
    """Temporary files an interrupted sweep left (written through a .tmp name and renamed)."""
    for tmp in out.glob("*.tmp"):
        tmp.unlink(missing_ok=True)
    for tmp in out.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def run_sweep(spec: SweepSpec, tasks: Sequence[RunTask], *, jobs: int | None = None, cluster: Any = None,
              progress: bool = True, runner: Callable[[RunTask], dict[str, Any]] = run_task,
              announce: bool = False) -> Path:
    """Run the tasks not yet in ``spec.out/results.csv``, appending each as it finishes.

    Returns the table's path. Raises SweepFailed (after every other run has
    finished and been written) when some runs raised.
    """
    out = spec.out
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_folder(out)
    try:
        return _run_locked(spec, tasks, out, jobs=jobs, cluster=cluster, progress=progress, runner=runner,
                           announce=announce or progress)
    finally:
        lock.close()


def _run_locked(spec: SweepSpec, tasks: Sequence[RunTask], out: Path, *, jobs: int | None, cluster: Any,
                progress: bool, runner: Callable[[RunTask], dict[str, Any]], announce: bool) -> Path:
    _remove_stale_tmp(out)
    table_path, meta_path, failed_path = out / TABLE, out / "sweep.json", out / "failed.jsonl"
    _check_same_sweep(spec, meta_path, table_path)
    grid_cols = grid_columns_of(tasks)
    write_json(meta_path, {"name": spec.name, "source": str(spec.source), "base": str(spec.base_path),
                            "fingerprint": spec.fingerprint(), "vary": spec.vary, "grid_columns": grid_cols,
                            "repetitions": spec.repetitions, "num_replicas": spec.num_replicas,
                            "router": spec.router, "slo": spec.base_raw.get("slo"), "num_runs": len(tasks)})
    scan = scan_table(table_path, {t.run_id: t for t in tasks})
    if scan.damaged:
        for line in drop_damaged(table_path, scan):
            print(line, file=sys.stderr)
    header, done = scan.header, scan.ids
    todo = [t for t in tasks if t.run_id not in done]
    if announce:
        where = f"Dask cluster {cluster}" if cluster is not None else f"{jobs or 'all'} local worker(s)"
        print(f"sweep {spec.name}: {len(tasks)} runs, {len(tasks) - len(todo)} already in {table_path}, "
              f"running {len(todo)} on {where}", file=sys.stderr)
    if failed_path.exists():
        failed_path.unlink()
    table = ResultsTable(table_path, header)
    failures: list[tuple[RunTask, BaseException]] = []
    for outcome in run_tasks(runner, todo, jobs=jobs, cluster=cluster, progress=progress, desc=spec.name):
        if outcome.error is not None:
            failures.append((outcome.task, outcome.error))
            with failed_path.open("a") as f:
                f.write(json.dumps({"run_id": outcome.task.run_id, "values": outcome.task.values,
                                    "repetition": outcome.task.repetition, "error": repr(outcome.error),
                                    "traceback": "".join(traceback.format_exception(outcome.error))},
                                   default=str) + "\n")
            continue
        table.append(table_row(outcome.task, outcome.result, grid_cols))
    if failures:
        task, exc = failures[0]
        msg = (f"{len(failures)} of {len(todo)} runs failed (details in {failed_path}); the other runs are in "
               f"{table_path}; rerun the same command to retry only the failed ones. First: run {task.run_id} "
               f"{task.values}: {exc}")
        raise SweepFailed(msg, table_path)
    return table_path


def run_sweep_file(path: str | Path, *, jobs: int | None = None, cluster: str | None = None,
                   out: Path | None = None, progress: bool = True, overrides: dict[str, Any] | None = None,
                   announce: bool = False) -> Path:
    """`sim sweep FILE`: parse, validate every run, run the missing ones.

    Returns the results table's path (its folder is what the report is built
    from, ``reports.presentation.report.regenerate``). Bad files raise
    ConfigError before any run. ``overrides``: ``--set``/``--seed`` pairs
    (``reports.experiments.spec``). ``announce``: say on stderr where the sweep goes and how
    many of its runs are already done, terminal or not.
    """
    check_pool_args(jobs, cluster)
    spec = parse_sweep(path, out, overrides)
    tasks = expand(spec)
    if spec.kept_out_of is not None:
        kind = folder_kind(spec.kept_out_of)
        what = ("another sweep (another base, set or grid)" if kind == "sweep"
                else WHAT.get(kind or "", "something else"))
        print(f"note: {spec.kept_out_of}/ holds {what}, so this one goes to "
              f"{spec.out}/ (--out DIR to choose)", file=sys.stderr)
    return run_sweep(spec, tasks, jobs=jobs, cluster=cluster, progress=progress, announce=announce)
