"""Sweep throughput: every registered policy x 16 rates on a sample of the Azure conversation trace.

    python benchmarks/bench_sweep.py [--requests 200] [--jobs 1 2] [--cluster local]

Prints, for each worker count, the sweep's wall time, the sum of the runs' own
wall times (measured inside the workers: config build + simulation), the
scaling ratio against the first worker count, and the sweep overhead:

    overhead = (wall x workers - sum of per-run wall) / sum of per-run wall

i.e. the share of worker time not spent in runs (process start-up, pickling,
scheduling, writing the table, idle workers at the end). With one worker it
is (wall - sum) / sum. Not a timed test: numbers depend on the machine.

Each policy runs at its defaults (``policies.POLICIES``: 10 policies make 160
runs), the trace replayed at 2, 3, ..., 17 req/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from policies import POLICIES  # noqa: E402
from reports.experiments.spec import expand, parse_sweep  # noqa: E402
from reports.experiments.sweep import run_sweep  # noqa: E402

RATES = tuple(float(r) for r in range(2, 18))


def burn(n: int) -> float:
    """Pure-Python CPU work; returns its own wall time (s)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i
    return time.perf_counter() - t0


def machine_scaling(workers: int, n: int = 5_000_000) -> float:
    """How much faster ``workers`` processes finish ``workers`` equal CPU-bound jobs than one process
    does them in turn: the ceiling for any pool on this machine (shared or hyper-threaded cores give ~1)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context
    serial_s = sum(burn(n) for _ in range(workers))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(burn, [1000] * workers))              # start the workers first
        t0 = time.perf_counter()
        list(pool.map(burn, [n] * workers))
        return serial_s / (time.perf_counter() - t0)


def write_sweep(folder: Path, num_requests: int) -> Path:
    path = folder / "bench_sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "bench-sweep", "base": str(ROOT / "workloads" / "azure_conv.yaml"),
        "set": {"num_requests": num_requests},
        "vary": {"policy.kind": list(POLICIES), "arrivals.rate": list(RATES)}}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="first N requests of the trace per run")
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="worker counts to compare")
    ap.add_argument("--cluster", help="run on a Dask cluster ('local' or tcp://HOST:PORT) instead of the pool")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = write_sweep(folder, args.requests)
        rows = []
        for jobs in args.jobs:
            spec = parse_sweep(path, out=folder / f"jobs{jobs}")
            tasks = expand(spec)
            t0 = time.perf_counter()
            table = run_sweep(spec, tasks, jobs=jobs, cluster=args.cluster, progress=False)
            wall_s = time.perf_counter() - t0
            runs = pd.read_csv(table)
            busy_s = float(runs["wall_s"].sum())
            rows.append({"workers": jobs, "runs": len(runs), "wall_s": wall_s, "sum_run_wall_s": busy_s,
                         "sum_sim_wall_s": float(runs["sim_wall_s"].sum()),
                         "overhead_pct": 100.0 * (wall_s * jobs - busy_s) / busy_s})
    base = rows[0]["wall_s"]
    print(f"sweep: {len(POLICIES)} policies x {len(RATES)} rates = {rows[0]['runs']} runs, "
          f"first {args.requests} requests of the Azure conversation trace"
          + (f", Dask cluster {args.cluster}" if args.cluster else ", local process pool"))
    print(f"{'workers':>7} {'wall (s)':>9} {'sum run (s)':>12} {'sum sim (s)':>12} {'scaling':>8} {'overhead':>9}")
    for r in rows:
        print(f"{r['workers']:>7} {r['wall_s']:>9.2f} {r['sum_run_wall_s']:>12.2f} {r['sum_sim_wall_s']:>12.2f} "
              f"{base / r['wall_s']:>7.2f}x {r['overhead_pct']:>8.1f}%")
    for jobs in args.jobs[1:]:
        print(f"machine ceiling: {jobs} processes of pure-Python CPU work run {machine_scaling(jobs):.2f}x faster "
              f"than one (compare with the scaling column)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
