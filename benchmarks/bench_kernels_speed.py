"""Speed of a kernel-profile run against an analytic one, on the full Azure conversation trace
(19,366 requests), measured in the same run:

    python benchmarks/bench_kernels_speed.py [--policies vllm_v1,sglang,tensorrt_llm] [--repeats 2]

The kernel tables are built once first (into a temporary cache folder) and not timed: the
target is the run once its tables are cached, at most 1.5x the analytic run. Each run is a
fresh ``sim run`` process (imports, profile, simulation, files), the two kinds alternating,
``--repeats`` times each; the figure is the median wall time and the ratio of medians. The
machine may be shared: the CPU seconds beside the wall seconds say how much of it a run had.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "workloads" / "azure_conv.yaml"


def sim_run(policy: str, kernels: bool, out: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one ``sim run`` of the whole trace in a fresh process."""
    cmd = [sys.executable, "-m", "sim.cli", "run", str(WORKLOAD), "--out", str(out), "--overwrite", "--quiet",
           "--set", f"policy.kind={policy}"] + (["--set", "profile.kernels=aiconfigurator"] if kernels else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="vllm_v1,sglang,tensorrt_llm")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BATCHSIM_CACHE_DIR": str(Path(tmp) / "cache")}
        print(f"{'policy':<14} {'analytic s':>11} {'(cpu s)':>8} {'kernels s':>10} {'(cpu s)':>8} {'ratio':>6}  "
              f"(median of {args.repeats}; tables built first, untimed)")
        for policy in args.policies.split(","):
            t0 = time.perf_counter()
            sim_run(policy, True, Path(tmp) / "warm", env)           # builds and caches the tables
            build_s = time.perf_counter() - t0
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(args.repeats):
                for kernels in (False, True):
                    runs[kernels].append(sim_run(policy, kernels, Path(tmp) / f"run-{kernels}", env))
            a = statistics.median(w for w, _ in runs[False])
            k = statistics.median(w for w, _ in runs[True])
            print(f"{policy:<14} {a:>11.2f} {statistics.median(c for _, c in runs[False]):>8.2f} {k:>10.2f} "
                  f"{statistics.median(c for _, c in runs[True]):>8.2f} {k / a:>6.2f}  (first kernel run, "
                  f"tables built: {build_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
