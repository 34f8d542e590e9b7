"""Simulator speed on the full Azure conversation trace (19,366 requests).

For each policy, in a fresh child process (so peak RSS is the run's own):
wall seconds, simulated requests per wall second, steps per wall second, peak
RSS. Then the 2x and 4x back-to-back replays of the trace for vllm and
sarathi, to check that time grows linearly with trace length.

    python benchmarks/bench_sim.py [--policies vllm,sarathi] [--no-scaling]

Figures are measured in this run; the machine may be shared and noisy: the
process CPU seconds (cpu s) beside the wall seconds show how much of the
wall time the run really had the CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "workloads" / "azure_conv.yaml"


def one_run(policy: str, repeat: int) -> dict:
    """Runs inside the child: simulate, measure, return figures."""
    import warnings

    from sim.config import load_workload
    from sim.runner import run_workload
    warnings.simplefilter("ignore")
    cfg = load_workload(WORKLOAD, {"policy.kind": policy, "arrivals.repeat": repeat})
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_workload(cfg)
    wall_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    n_req = len(result.requests)
    return {"policy": policy, "repeat": repeat, "requests": n_req, "steps": len(result.steps),
            "wall_s": wall_s, "cpu_s": cpu_s, "loop_s": result.meta["loop_s"], "req_per_s": n_req / wall_s, "steps_per_s": len(result.steps) / wall_s,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "completed": result.summary["completed"], "mean_ttft_ms": result.summary["mean_ttft_ms"]}


def in_child(policy: str, repeat: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", policy, str(repeat)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="static,dynamic,orca,vllm,sarathi")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child[0], int(args.child[1]))))
        return
    print(f"{'policy':<9}{'requests':>9}{'steps':>9}{'wall s':>8}{'cpu s':>7}{'req/s':>8}{'steps/s':>9}"
          f"{'RSS MiB':>9}")
    for policy in args.policies.split(","):
        r = in_child(policy, 1)
        print(f"{policy:<9}{r['requests']:>9}{r['steps']:>9}{r['wall_s']:>8.2f}{r['cpu_s']:>7.2f}"
              f"{r['req_per_s']:>8.0f}{r['steps_per_s']:>9.0f}{r['peak_rss_mib']:>9.0f}", flush=True)
    if args.no_scaling:
        return
    print("\nlinear growth (trace replayed back to back):")
    print("(loop: the event loop alone; the rest builds tables and summaries, whose ITL sort is n log n)")
    print(f"{'policy':<9}{'x':>3}{'requests':>9}{'wall s':>8}{'req/s':>8}{'wall / 1x':>11}{'loop s':>8}"
          f"{'loop / 1x':>11}")
    for policy in ("vllm", "sarathi"):
        base = None
        for repeat in (1, 2, 4):
            r = in_child(policy, repeat)
            base = base or r
            print(f"{policy:<9}{repeat:>3}{r['requests']:>9}{r['wall_s']:>8.2f}{r['req_per_s']:>8.0f}"
                  f"{r['wall_s'] / base['wall_s']:>11.2f}{r['loop_s']:>8.2f}{r['loop_s'] / base['loop_s']:>11.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
