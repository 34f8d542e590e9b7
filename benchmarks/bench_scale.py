"""Simulator speed and memory at scale: 100k and 1M synthetic requests through the real `sim run`.

    python benchmarks/bench_scale.py                                   # 100k and 1M; every registered policy
    python benchmarks/bench_scale.py --quick                           # 10k and 100k
    python benchmarks/bench_scale.py --sizes 2000,5000 --policies vllm,sarathi,orca
    python benchmarks/bench_scale.py --policies vllm_v1,vllm_v1-nocache     # the cost of prefix caching

The workload is ShareGPT-like: prompt and output lengths lognormal (sigma 1)
with means 200 and 250 tokens, capped at 2,048 each, Poisson arrivals at 70%
of the rate the default preset (the workload defaults' model and GPU) sustains
under vllm. That rate is measured first by a short saturating run: 2,000
requests all at t = 0 under vllm, completed requests per simulated second.

Each size x policy is `python -m sim.cli run` in a fresh process, writing
its files to a temporary folder that is deleted after it is read. Printed
per run: wall and CPU seconds of the whole process (start-up, simulation,
writing requests.csv, steps.csv, tokens.npz), sim s (meta.json's wall_s: the
simulation and its tables, without start-up and files), requests, steps and
events per wall second, and the process's peak RSS (os.wait4); +files is
the peak RSS of the second process that writes steps.csv and tokens.npz
while the run goes on (meta.json, sim.results.runfiles), and = MiB the two added
(an upper bound of the command's footprint). Events are the
model's scheduling events: arrivals + completions + preemptions
(summary.json). Then per policy the largest size over the smallest: the
ratios of peak RSS (linear memory: the size ratio) and of req/s (linear time:
1), and the memory each extra request took.

`sim run` refuses a size whose estimated memory (workloads.generate.
BYTES_PER_REQUEST a request, with a margin) exceeds the machine's. A refused
or failed run is printed as such and the others go on.
A policy ``X-nocache`` is policy X with ``enable_prefix_caching: false``
(vllm_v1 caches prefixes by default, as vLLM does); with both in
``--policies``, a last line per size gives caching's cost as the ratios of
req/s and peak RSS measured in this run. The workload's prompts share
nothing, so the cache finds no hits: this is the bookkeeping's price (every
full block hashed, registered and evicted), the worst case for its speed.
Figures are measured in this run; on a shared machine the CPU seconds beside
the wall seconds show how much of the wall time the run had the CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from bench_sim import Child, num_events, run_child

LOAD = 0.7
PROBE_REQUESTS = 2000
WORKLOAD = {"name": "bench-scale", "seed": 0, "arrivals": {"kind": "all_at_once"},
            "lengths": {"kind": "lognormal", "prompt_mean": 200, "output_mean": 250, "sigma": 1.0,
                        "prompt_max": 2048, "output_max": 2048},
            "policy": {"kind": "vllm"}}


def sim_run(workload: Path, out: Path, overrides: dict) -> tuple[Child, dict, dict]:
    """(the finished `sim run` process, its summary.json, its meta.json); the last two are empty
    when it failed. Its output folder is removed once read."""
    argv = [sys.executable, "-m", "sim.cli", "run", str(workload), "--out", str(out), "--quiet"]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    child = run_child(argv)
    summary = meta = {}
    if child.returncode == 0:
        summary = json.loads((out / "summary.json").read_text())
        meta = json.loads((out / "meta.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return child, summary, meta


def sustained_rate(workload: Path, tmp: Path) -> tuple[float, str]:
    """(completed requests per simulated second of PROBE_REQUESTS requests sent at once under vllm,
    the profile it ran on)."""
    child, summary, meta = sim_run(workload, tmp / "probe", {"num_requests": PROBE_REQUESTS})
    if child.returncode != 0:
        sys.exit(f"the capacity probe failed (exit {child.returncode}): {child.stderr.strip()[-2000:]}")
    return summary["request_throughput"], meta["profile_name"]


HEADER = (f"{'policy':<16}{'requests':>10}{'steps':>10}{'events':>10}{'wall s':>9}{'cpu s':>9}{'sim s':>9}"
          f"{'req/s':>8}{'steps/s':>9}{'events/s':>10}{'RSS MiB':>9}{'+files':>8}{'= MiB':>7}")


def row(policy: str, n: int, child: Child, summary: dict, meta: dict) -> tuple[str, dict | None]:
    """The printed line of one run and its figures (None when the run failed)."""
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"{policy:<16}{n:>10,}  failed (exit {child.returncode}, {child.wall_s:.1f} s): {last}", None
    wall = child.wall_s
    steps, events = summary["num_steps"], num_events(n, summary)
    files = meta.get("files_process_peak_rss_mib") or 0.0
    figures = {"req_per_s": n / wall, "rss_mib": child.peak_rss_mib, "total_mib": child.peak_rss_mib + files}
    return (f"{policy:<16}{n:>10,}{steps:>10,}{events:>10,}{wall:>9.1f}{child.cpu_s:>9.1f}{meta['wall_s']:>9.1f}"
            f"{n / wall:>8.0f}{steps / wall:>9.0f}{events / wall:>10.0f}{child.peak_rss_mib:>9.0f}{files:>8.0f}"
            f"{figures['total_mib']:>7.0f}"), figures


def ratio_line(policy: str, small: int, big: int, results: dict) -> str:
    a, b = results.get((policy, small)), results.get((policy, big))
    if a is None or b is None:
        return f"{policy:<16}{big:,} / {small:,}: - (a run failed)"
    kb_each = (b["rss_mib"] - a["rss_mib"]) * 1024 / (big - small)
    return (f"{policy:<16}{big:,} / {small:,} requests (x{big / small:g}): peak RSS "
            f"x{b['rss_mib'] / a['rss_mib']:.2f} (with the files process: x{b['total_mib'] / a['total_mib']:.2f}), "
            f"req/s x{b['req_per_s'] / a['req_per_s']:.2f}; {kb_each:.1f} KiB of RSS per extra request")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000", help="request counts, comma-separated")
    from policies import POLICIES
    ap.add_argument("--policies", default=",".join(POLICIES), help="policy kinds, comma-separated (default: all)")
    ap.add_argument("--quick", action="store_true", help="sizes 10000,100000")
    args = ap.parse_args()
    sizes = [10_000, 100_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp_name:
        tmp = Path(tmp_name)
        workload = tmp / "workload.yaml"
        workload.write_text(yaml.safe_dump(WORKLOAD))
        capacity, profile = sustained_rate(workload, tmp)
        rate = LOAD * capacity
        print(f"profile {profile}: vllm sustains {capacity:.1f} req/s ({PROBE_REQUESTS:,} requests at once); "
              f"the runs offer {LOAD:.0%} of it, Poisson {rate:.1f} req/s\n")
        print(HEADER, flush=True)
        results = {}
        for n in sizes:
            for policy in policies:
                kind, _, variant = policy.partition("-")
                overrides = {"num_requests": n, "policy.kind": kind, "arrivals.kind": "poisson",
                             "arrivals.rate": rate}
                if variant == "nocache":
                    overrides["policy.enable_prefix_caching"] = False
                elif variant:
                    sys.exit(f"--policies: {policy!r}: the only variant is KIND-nocache")
                child, summary, meta = sim_run(workload, tmp / f"{policy}-{n}", overrides)
                line, results[(policy, n)] = row(policy, n, child, summary, meta)
                print(line, flush=True)
    if len(sizes) > 1:
        print()
        for policy in policies:
            print(ratio_line(policy, min(sizes), max(sizes), results))
    for policy in policies:
        if policy + "-nocache" not in policies:
            continue
        for n in sizes:
            on, off = results.get((policy, n)), results.get((policy + "-nocache", n))
            if on is None or off is None:
                continue
            print(f"prefix caching on vs off, {policy} at {n:,} requests: req/s x{on['req_per_s'] / off['req_per_s']:.2f}, "
                  f"peak RSS x{on['rss_mib'] / off['rss_mib']:.2f} ({on['rss_mib']:.0f} vs {off['rss_mib']:.0f} MiB)")


if __name__ == "__main__":
    main()
