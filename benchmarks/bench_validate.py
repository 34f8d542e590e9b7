"""Sim-vs-live accuracy on the CPU: the tiny model, vllm and sarathi, three loads.

Calibrates the tiny model once (one thread, a grid sized to
workloads/validate_tiny.yaml), measures each policy's capacity by simulating
all 100 requests arriving at once, then validates the workload live at about
50%, 80% and 110% of that capacity and prints the errors (sim - live) / live:

    python benchmarks/bench_validate.py [--budget-s 60] [--threads 1] [--policies vllm,sarathi]

Targets: throughput within 5%, p50 TTFT and ITL within 10%, p99 within 15%
(a '*' marks a miss). "cpu" is the process CPU seconds per forward-pass
second of the live run, divided by the thread count: near 1.0 the cores were
ours; well below, other processes took them and the live run is slower for
reasons no cost model sees, so a point is retried (--tries) and the run with
the most CPU is shown. Printed, not asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOAD = ROOT / "workloads" / "validate_tiny.yaml"
LOADS = (0.5, 0.8, 1.1)
MIN_CPU_SHARE = 0.9
COLUMNS = (("request_throughput", "thr", 5.0), ("p50_ttft_ms", "TTFT p50", 10.0), ("p99_ttft_ms", "TTFT p99", 15.0),
           ("p50_itl_ms", "ITL p50", 10.0), ("p99_itl_ms", "ITL p99", 15.0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=60.0, help="calibration budget")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--policies", default="vllm,sarathi")
    p.add_argument("--tries", type=int, default=3, help="live attempts per point while the cores are shared")
    args = p.parse_args()

    import torch

    from sim.run.live import run_sim
    from calibrate.model import MODEL_PRESETS
    from calibrate.runner import calibrate
    from calibrate.validate import calibration_grid, validate
    from reports.presentation.validation import error_table
    from sim.run.config import load_workload
    from sim.run.runner import kv_blocks

    base = load_workload(WORKLOAD)
    grid = calibration_grid(base, MODEL_PRESETS["tiny-llama"], torch.device("cpu"))
    for _ in range(2):                                # once more if other processes held the cores
        t0, c0 = time.perf_counter(), time.process_time()
        cal = calibrate("tiny-llama", "cpu", "float32", args.budget_s, None, False, 0, grid=grid,
                        num_threads=args.threads)
        share = (time.process_time() - c0) / (time.perf_counter() - t0) / args.threads
        if share >= MIN_CPU_SHARE:
            break
    fe = cal.profile.fit_error
    print(f"calibration: {time.perf_counter() - t0:.0f} s (budget {args.budget_s:g} s), {args.threads} thread(s), "
          f"cpu {share:.2f}; holdout MAPE {fe['holdout_mape_pct']:.1f}% p90 {fe['holdout_p90_abs_pct']:.1f}% "
          f"on {fe['holdout_num_points']} batches")
    profile = cal.profile
    num_blocks, max_model_len = kv_blocks(base, profile)
    head = (f"{'policy':<8}{'load':>5}{'rate':>7}{'live r/s':>9}" + "".join(f"{h:>10}" for _, h, _ in COLUMNS)
            + f"{'step|e|':>8}{'unst.':>7}{'same':>6}{'cpu':>6}{'wall':>6}")
    rows = []
    for policy in args.policies.split(","):
        cfg_p = load_workload(WORKLOAD, {"policy.kind": policy})
        allin = dataclasses.replace(cfg_p, arrivals=dataclasses.replace(cfg_p.arrivals, kind="all_at_once"))
        capacity = run_sim(allin, profile, num_blocks, max_model_len).summary["request_throughput"]
        print(f"{policy}: simulated capacity {capacity:.2f} req/s (100 requests at once)")
        for load in LOADS:
            cfg = dataclasses.replace(cfg_p, arrivals=dataclasses.replace(cfg_p.arrivals, rate=load * capacity))
            t = time.perf_counter()
            tries = []
            for _ in range(args.tries):                   # keep the run that had the cores most
                tries.append(validate(cfg, profile, model="tiny-llama", num_threads=args.threads))
                if tries[-1].comparison["steps"]["cpu_per_forward_s"] / args.threads >= MIN_CPU_SHARE:
                    break
            v = max(tries, key=lambda x: x.comparison["steps"]["cpu_per_forward_s"])
            err = dict(zip(*error_table(v.live.summary, v.sim.summary)[["metric", "err_pct"]].to_numpy().T))
            cells = "".join(f"{err[k]:>+9.1f}{'*' if abs(err[k]) > lim else ' '}" for k, _, lim in COLUMNS)
            s, d = v.comparison["steps"], v.comparison["decisions"]
            rows.append(f"{policy:<8}{load:>5.0%}{load * capacity:>7.2f}{v.live.summary['request_throughput']:>9.2f}"
                        f"{cells}{s['all']['median_abs_pct']:>7.1f}%{s['unstarved']['median_abs_pct']:>6.1f}%"
                        f"{100 * d['identical_fraction']:>5.0f}%"
                        f"{s['cpu_per_forward_s'] / args.threads:>6.2f}{time.perf_counter() - t:>5.0f}s")
            print(rows[-1], file=sys.stderr)
    print("\nerrors (sim - live) / live in %; * = outside target (thr 5%, p50 10%, p99 15%);")
    print("step|e| = median per-step |predicted - measured| / measured (unst.: on steps not starved of CPU);")
    print("same = identical step batches (step i vs step i); cpu = CPU s per forward s per thread")
    print(head)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
