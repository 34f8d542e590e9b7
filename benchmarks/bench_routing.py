"""What prefix-aware routing buys: the Mooncake FAST'25 synthetic trace (its
prefix-block hash ids; an unbounded cache would serve 65.1% of its prompt
tokens) on 4 replicas behind each router, simulated with vllm_v1 and prefix
caching on.

    python benchmarks/bench_routing.py                       # Llama-3.1-8B, 4 x H100 and 4 x H200, TP 1
    python benchmarks/bench_routing.py --gpus h200 --replicas 8

Routers (``sim.loop.feed.pick_replica``): round_robin, least_requests (the
fewest outstanding requests) and prefix_aware (the longest cached prefix
among the replicas within the load guard). Printed per run: the fleet's
prefix cache hit rate (hit tokens / queried tokens, vLLM's counters), TTFT
mean / p50 / p99, throughput, cached blocks evicted, and the busiest
replica's completed requests over the fleet mean (1.00: even). Then each
router's hit rate and mean TTFT against round_robin's, measured in this run
(simulated time, so the machine's speed does not enter; wall seconds are
printed for the cost of routing).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUTERS = ("round_robin", "least_requests", "prefix_aware")


def run(gpu: str, replicas: int, router: str, num_requests: int | None):
    from sim.run.config import load_workload
    from sim.run.runner import run_workload
    overrides = {"profile.gpu": gpu, "profile.tensor_parallel": 1}
    if num_requests:
        overrides["num_requests"] = num_requests
    cfg = load_workload(ROOT / "workloads" / "mooncake_prefix.yaml", overrides)
    wall0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # the ten prompts longer than the context
        result = run_workload(cfg, num_replicas=replicas, router=router)
    return result, time.perf_counter() - wall0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="h100-sxm,h200", help="GPU presets, comma-separated")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--num-requests", type=int, help="only the trace's first N requests")
    args = ap.parse_args()
    header = (f"{'gpu':<9}{'router':<16}{'hit rate':>9}{'TTFT mean':>11}{'p50':>9}{'p99':>10}{'req/s':>8}"
              f"{'evicted':>11}{'busiest':>9}{'wall s':>8}")
    print(f"Mooncake synthetic trace, Llama-3.1-8B, vllm_v1 with prefix caching, {args.replicas} replicas "
          f"(TTFT in ms, simulated)\n")
    print(header)
    for gpu in args.gpus.split(","):
        base = None
        lines = []
        for router in ROUTERS:
            result, wall = run(gpu, args.replicas, router, args.num_requests)
            s = result.summary
            done = [r["completed"] for r in s.get("replicas", [])] or [s["completed"]]
            busiest = max(done) / (sum(done) / len(done)) if sum(done) else float("nan")
            print(f"{gpu:<9}{router:<16}{100 * s['prefix_cache_hit_rate']:>8.1f}%{s['mean_ttft_ms']:>11.0f}"
                  f"{s['median_ttft_ms']:>9.0f}{s['p99_ttft_ms']:>10.0f}{s['request_throughput']:>8.2f}"
                  f"{s['prefix_cache_evicted_blocks']:>11,}{busiest:>9.2f}{wall:>8.1f}", flush=True)
            if base is None:
                base = s
            else:
                lines.append(f"{gpu}: {router} vs round_robin: hit rate {100 * s['prefix_cache_hit_rate']:.1f}% vs "
                             f"{100 * base['prefix_cache_hit_rate']:.1f}%, mean TTFT "
                             f"x{s['mean_ttft_ms'] / base['mean_ttft_ms']:.2f}, p99 TTFT "
                             f"x{s['p99_ttft_ms'] / base['p99_ttft_ms']:.2f}")
        print(*lines, sep="\n")
        print()


if __name__ == "__main__":
    main()
