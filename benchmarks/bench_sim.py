"""Simulator speed on the full Azure conversation trace (19,366 requests).

For each policy, in a fresh child process: wall seconds, simulated requests,
steps and events per wall second, and the child's peak RSS (read by the
parent from os.wait4 when the child exits). Events are the model's
scheduling events: arrivals + completions + preemptions (requests table and
summary). Then the 2x and 4x back-to-back replays of the trace for each
policy, to check that time grows linearly with trace length. Each policy
also runs with the loop's fast path off (``BATCHSIM_FAST_PATH=0``: every
iteration stepped; same results) and the table gives the ratio of the two
loops' times. ``proc s`` is the whole child process (interpreter start,
imports, the run and its tables); req/s and events/s divide by it. ``sim
run s`` is the real command in a fresh process, its files written.

    python benchmarks/bench_sim.py [--policies vllm,sarathi,vllm_v1-sync] [--no-scaling]

(every registered policy unless --policies names some; ``vllm_v1-sync``: vllm_v1 without async
scheduling; ``vllm_v1-spec`` and ``vllm_v1-sync-spec``: with EAGLE-3 speculative decoding, k = 3).

Figures are measured in this run; the machine may be shared and noisy: the
process CPU seconds (cpu s) beside the wall seconds show how much of the
wall time the run really had the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORKLOAD = ROOT / "workloads" / "azure_conv.yaml"


def overrides(policy: str) -> dict[str, object]:
    """The workload fields of a policy name: a kind, or ``vllm_v1-sync`` (vllm_v1 with
    ``async_scheduling: false``: the synchronous loop and its fast path; vllm_v1 alone runs
    async on the trace's GPU, as vLLM 0.32 does)."""
    kind, *variants = policy.split("-")
    if any(v not in ("sync", "spec") for v in variants):
        sys.exit(f"--policies: {policy!r}: the variants are KIND-sync, KIND-spec and KIND-sync-spec")
    out: dict[str, object] = {"policy.kind": kind}
    if "sync" in variants:
        out["policy.async_scheduling"] = False
    if "spec" in variants:
        out["policy.speculative"] = SPEC
    return out


# ``KIND-spec``: EAGLE-3 with 3 drafts and vLLM-like per-position acceptance (every step verifies
# and draws: no fast path).
SPEC = {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_rates": [0.8, 0.62, 0.48]}


def one_run(policy: str, repeat: int) -> dict:
    """Runs inside the child: simulate, measure, return figures."""
    import warnings

    from sim.run.config import load_workload
    from sim.run.runner import run_workload
    warnings.simplefilter("ignore")
    cfg = load_workload(WORKLOAD, {**overrides(policy), "arrivals.repeat": repeat})
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_workload(cfg)
    wall_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    n_req = len(result.request_source)       # the compact table: building the DataFrames would cost their memory
    num_steps = result.summary["num_steps"]
    events = num_events(n_req, result.summary)
    return {"policy": policy, "repeat": repeat, "requests": n_req, "steps": num_steps, "events": events,
            "wall_s": wall_s, "cpu_s": cpu_s, "loop_s": result.meta["loop_s"], "req_per_s": n_req / wall_s,
            "steps_per_s": num_steps / wall_s, "events_per_s": events / wall_s,
            "completed": result.summary["completed"], "mean_ttft_ms": result.summary["mean_ttft_ms"]}


def num_events(num_requests: int, summary: dict) -> int:
    """Scheduling events of a run: one arrival per request, one completion per finished
    request, one per preemption."""
    return num_requests + summary["completed"] + summary["num_preemptions"]


@dataclass(frozen=True)
class Child:
    """A finished child process: exit status, output, and its own resource use."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float                  # user + system, the whole process (start-up included)
    peak_rss_mib: float


def run_child(argv: list[str], env: dict[str, str] | None = None) -> Child:
    """Run ``argv`` from the repository root and wait for it with os.wait4, which returns this
    child's own peak RSS (RUSAGE_CHILDREN would report the largest of all children so far)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        wall_s = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)      # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        return Child(proc.returncode, out.read().decode(), err.read().decode(), wall_s,
                     usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)     # ru_maxrss is in KiB


def in_child(policy: str, repeat: int, fast_path: bool = True) -> dict:
    child = run_child([sys.executable, __file__, "--child", policy, str(repeat)],
                      {"BATCHSIM_FAST_PATH": "1" if fast_path else "0"})
    if child.returncode != 0:
        sys.exit(f"{policy} x{repeat}: the child exited with {child.returncode}: {child.stderr.strip()[-2000:]}")
    r = json.loads(child.stdout.strip().splitlines()[-1])
    return {**r, "peak_rss_mib": child.peak_rss_mib, "proc_s": child.wall_s,
            "req_per_s": r["requests"] / child.wall_s, "steps_per_s": r["steps"] / child.wall_s,
            "events_per_s": r["events"] / child.wall_s}


def sim_run_child(policy: str) -> Child:
    """The real command, files and all, in a fresh process: ``sim run`` of the trace."""
    with tempfile.TemporaryDirectory(prefix="bench_sim_") as tmp:
        sets = [a for k, v in overrides(policy).items() for a in ("--set", f"{k}={json.dumps(v) if isinstance(v, dict) else str(v).lower()}")]
        child = run_child([sys.executable, "-m", "sim.cli", "run", str(WORKLOAD), *sets,
                           "--out", str(Path(tmp) / "run"), "--quiet"])
    if child.returncode != 0:
        sys.exit(f"sim run {policy}: exited with {child.returncode}: {child.stderr.strip()[-2000:]}")
    return child


def main() -> None:
    ap = argparse.ArgumentParser()
    from policies import POLICIES
    ap.add_argument("--policies", default=",".join(POLICIES), help="policy kinds, comma-separated (default: all)")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child[0], int(args.child[1]))))
        return
    print(f"{'policy':<13}{'requests':>9}{'steps':>9}{'events':>8}{'proc s':>8}{'run s':>7}{'cpu s':>7}{'req/s':>8}"
          f"{'steps/s':>9}{'events/s':>10}{'RSS MiB':>9}{'loop s':>8}{'stepped':>9}{'speed-up':>10}"
          f"{'sim run s':>11}{'req/s':>8}")
    for policy in args.policies.split(","):
        r = in_child(policy, 1)
        off = in_child(policy, 1, fast_path=False)
        cli = sim_run_child(policy)
        print(f"{policy:<13}{r['requests']:>9}{r['steps']:>9}{r['events']:>8}{r['proc_s']:>8.2f}{r['wall_s']:>7.2f}"
              f"{r['cpu_s']:>7.2f}{r['req_per_s']:>8.0f}{r['steps_per_s']:>9.0f}{r['events_per_s']:>10.0f}"
              f"{r['peak_rss_mib']:>9.0f}{r['loop_s']:>8.2f}{off['loop_s']:>9.2f}{off['loop_s'] / r['loop_s']:>9.2f}x"
              f"{cli.wall_s:>11.2f}{r['requests'] / cli.wall_s:>8.0f}", flush=True)
    print("(loop s: the event loop with the fast path; stepped: the same loop stepping every iteration;\n"
          " sim run s: the command itself in a fresh process, requests.csv, steps.csv, tokens.npz and the\n"
          " summaries written, and its req/s)")
    if args.no_scaling:
        return
    print("\nlinear growth (trace replayed back to back):")
    print("(loop: the event loop alone; the rest builds tables and summaries, whose ITL sort is n log n)")
    print(f"{'policy':<13}{'x':>3}{'requests':>9}{'wall s':>8}{'req/s':>8}{'events/s':>10}{'wall / 1x':>11}"
          f"{'loop s':>8}{'loop / 1x':>11}{'RSS MiB':>9}")
    for policy in args.policies.split(","):
        base = None
        for repeat in (1, 2, 4):
            r = in_child(policy, repeat)
            base = base or r
            print(f"{policy:<13}{repeat:>3}{r['requests']:>9}{r['wall_s']:>8.2f}{r['req_per_s']:>8.0f}"
                  f"{r['events_per_s']:>10.0f}{r['wall_s'] / base['wall_s']:>11.2f}{r['loop_s']:>8.2f}"
                  f"{r['loop_s'] / base['loop_s']:>11.2f}{r['peak_rss_mib']:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
