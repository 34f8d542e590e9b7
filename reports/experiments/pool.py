"""Run independent tasks in this process, a local process pool, or on a Dask cluster.

``run_tasks`` yields each task's outcome as soon as it finishes, in completion
order, so callers can write results as they arrive. The function must be a
module-level function (picklable by reference) whose module the workers can
import: the spawn start method and Dask workers re-import it.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

from sim.run.config import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One finished task: its input and either a result or the exception it raised."""

    task: T
    result: Any = None
    error: BaseException | None = None


def default_jobs(num_tasks: int, jobs: int | None) -> int:
    """Worker count: ``jobs`` if given, else one per CPU, never more than tasks."""
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    return max(1, min(jobs or os.cpu_count() or 1, num_tasks))


def check_pool_args(jobs: int | None, cluster: Any) -> None:
    """``--jobs`` and the form of ``--cluster``, checked before a sweep or plan writes anything."""
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    if cluster is None or cluster == "local" or type(cluster).__name__ == "Client":
        return
    if not isinstance(cluster, str) or not cluster.startswith(("tcp://", "tls://", "ucx://", "inproc://")):
        raise ConfigError(f"--cluster {cluster!r}: expected 'local' or a scheduler address such as "
                          f"tcp://10.0.0.5:8786; fix: start one with `dask scheduler` or omit --cluster")


def _progress(total: int, progress: bool, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, file=sys.stderr, disable=not progress, unit="run", desc=desc, dynamic_ncols=True)


def run_tasks(fn: Callable[[T], Any], tasks: Sequence[T], *, jobs: int | None = None,
              cluster: Any = None, progress: bool = False, desc: str = "runs") -> Iterator[Outcome[T]]:
    """Yield an Outcome per task as each finishes.

    ``cluster``: None (local: inline when one job, else a spawn process pool of
    ``jobs`` workers), ``"local"`` (a Dask LocalCluster of ``jobs`` worker
    processes), ``"tcp://HOST:PORT"`` (an existing Dask scheduler), or a
    ``distributed.Client``. Closing the generator early (or Ctrl-C) cancels
    the tasks not yet started.
    """
    if not tasks:
        return
    n_jobs = default_jobs(len(tasks), jobs)
    with _progress(len(tasks), progress, desc) as bar:
        if cluster is not None:
            source = _dask(fn, tasks, cluster, n_jobs)
        elif n_jobs == 1:
            source = _inline(fn, tasks)
        else:
            source = _process_pool(fn, tasks, n_jobs)
        for outcome in source:
            bar.update(1)
            yield outcome


def _inline(fn: Callable[[T], Any], tasks: Sequence[T]) -> Iterator[Outcome[T]]:
    for task in tasks:
        try:
            result = fn(task)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:   # one bad run must not end the sweep; the caller reports it
            yield Outcome(task, error=exc)
        else:
            yield Outcome(task, result=result)


PARENT_POLL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    """Pool-worker initializer: exit as soon as the sweep's main process is gone. A ``kill -9`` of
    the main process runs no clean-up, and idle spawned workers would wait on their queue forever."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="batchsim-parent-watch").start()


def _process_pool(fn: Callable[[T], Any], tasks: Sequence[T], n_jobs: int) -> Iterator[Outcome[T]]:
    pool = ProcessPoolExecutor(max_workers=n_jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_watch_parent, initargs=(os.getpid(),))
    try:
        pending: dict[Future, T] = {pool.submit(fn, t): t for t in tasks}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                task = pending.pop(fut)
                exc = fut.exception()
                yield Outcome(task, error=exc) if exc is not None else Outcome(task, result=fut.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _probe(module: str) -> str:
    """Runs on a Dask worker: proves it can import the module of the task function
    (the simulator comes with it)."""
    importlib.import_module(module)
    return sys.version.split()[0]


def _connect(cluster: Any, n_jobs: int, stack: ExitStack, module: str):
    from distributed import Client, LocalCluster
    if isinstance(cluster, Client):
        return cluster
    if cluster == "local":
        local = stack.enter_context(LocalCluster(n_workers=n_jobs, threads_per_worker=1, processes=True,
                                                 dashboard_address=None, silence_logs=40))
        return stack.enter_context(Client(local))
    check_pool_args(n_jobs, cluster)
    try:
        client = stack.enter_context(Client(cluster, timeout="15s"))
        client.wait_for_workers(1, timeout=60)
    except (OSError, TimeoutError) as exc:
        raise ConfigError(f"--cluster {cluster}: cannot reach the Dask scheduler or it has no workers ({exc}); "
                          f"fix: check the address and start workers with `dask worker {cluster}`") from None
    try:
        client.submit(_probe, module, pure=False).result(timeout=120)
    except Exception as exc:  # noqa: BLE001 - any failure here means the workers cannot run us
        raise ConfigError(f"--cluster {cluster}: the workers cannot import batchsim ({exc!r}); "
                          f"fix: install this project on every worker (pip install -e .)") from None
    return client


def _dask(fn: Callable[[T], Any], tasks: Sequence[T], cluster: Any, n_jobs: int) -> Iterator[Outcome[T]]:
    from distributed import as_completed
    with ExitStack() as stack:
        client = _connect(cluster, n_jobs, stack, fn.__module__)
        futures = {client.submit(fn, t, pure=False): t for t in tasks}
        try:
            for fut in as_completed(futures):
                task = futures[fut]
                if fut.status == "error":
                    yield Outcome(task, error=fut.exception())
                else:
                    yield Outcome(task, result=fut.result())
        finally:
            client.cancel([f for f in futures if not f.done()])
