"""One trial of a plan candidate: its workload at an offered rate, on one replica, a fleet or
(prefill, decode) pools, judged (``reports.experiments.capacity``). Shared by the aggregated
plan (``reports.experiments.plan``) and the disaggregated one (``reports.experiments.pdplan``).
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from dataclasses import dataclass
from typing import Any

from reports.experiments.capacity import SearchSettings, judge, queue_trend
from reports.experiments.planspec import Candidate, Verify
from reports.experiments.sweep import offered_rate
from sim.run.config import Slo, set_dotted, workload_from_dict

SATURATION_RATE_FACTOR = 100.0      # the probe offers 100x max_rate: effectively all at once
TRIAL_COLUMNS = ("p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "p99_e2el_ms", "request_throughput",
                 "output_throughput", "num_out_of_range_lookups", "num_preemptions", "mean_batch_size",
                 "peak_kv_utilization")


@dataclass(frozen=True)
class CandidateTask:
    candidate: Candidate
    source: str
    base_dir: str
    target_rate: float
    slo: Slo
    router: str
    search: SearchSettings
    verify: Verify
    run_dir: str
    target_utilization: float


_FACTORS: dict[str, float] = {}


def rate_factor(raw: dict[str, Any], source: str, base_dir: str) -> float:
    """Realized mean rate of the workload's requests when arrivals.rate is 1.0.

    A trace rescaled to a mean rate keeps its shape, so its first N requests
    arrive at their own mean rate; dividing by this factor makes the offered
    rate of the truncated run the one asked for.
    """
    from workloads.generate import generate
    raw = set_dotted(raw, "arrivals.rate", 1.0)
    key = json.dumps([raw.get("arrivals"), raw.get("lengths"), raw.get("num_requests"), raw.get("seed")],
                     sort_keys=True, default=str)
    if key not in _FACTORS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            specs = generate(workload_from_dict(raw, source, base_dir))
        _FACTORS[key] = offered_rate(specs.arrival_s) or 1.0
    return _FACTORS[key]


def simulate(task: CandidateTask, rate_rps: float, num_requests: int, num_replicas: int = 1, *,
             pools: tuple[int, int] | None = None, slo: Slo | None = None):
    """Run the candidate's workload at offered ``rate_rps``; (RunResult, judge() dict plus metrics).

    ``pools``: (prefill, decode) replicas of a disaggregated candidate (``num_replicas`` is then
    their sum); ``slo``: judge on these targets instead of the plan's (a pool's own search)."""
    from sim.run.runner import run_workload
    raw = set_dotted(task.candidate.raw, "num_requests", num_requests)
    if pools is not None:
        raw = set_dotted(set_dotted(raw, "disaggregation.prefill.replicas", pools[0]),
                         "disaggregation.decode.replicas", pools[1])
        num_replicas = sum(pools)
    nominal = rate_rps / rate_factor(raw, task.source, task.base_dir)
    cfg = workload_from_dict(set_dotted(raw, "arrivals.rate", nominal), task.source, task.base_dir)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # rejections count as SLO misses
        if pools is not None:
            from sim.run.disagg import run_disaggregated
            # The pools run their own sections; the record (meta.json's config, figure titles) names the
            # decode pool's, not the empty top-level profile the candidate keeps out of its pools.
            decode = cfg.disaggregation.decode.cfg
            cfg = dataclasses.replace(cfg, profile=decode.profile, policy=decode.policy, server=decode.server)
            result = run_disaggregated(cfg)
        else:
            result = run_workload(cfg, num_replicas=num_replicas, router=task.router)
    verdict = judge(result.requests, result.tokens, slo or task.slo,
                    max_backlog_fraction=task.search.max_backlog_fraction)
    verdict.update({k: result.summary.get(k) for k in TRIAL_COLUMNS})
    arrival_s = result.requests["arrival_s"]
    verdict.update(rate_rps=rate_rps, offered_rate=offered_rate(arrival_s), num_replicas=num_replicas,
                   num_requests=len(arrival_s), arrival_span_s=float(arrival_s.max() - arrival_s.min()),
                   wall_s=time.perf_counter() - t0)
    if pools is not None:
        verdict.update(prefill_replicas=pools[0], decode_replicas=pools[1])
    return result, verdict


def check_queue(verdict: dict[str, Any], requests: Any, max_slope: float) -> dict[str, Any]:
    """``verdict`` plus the queue-delay trend; a slope above ``max_slope`` fails it (the queue is growing)."""
    trend = queue_trend(requests["arrival_s"].to_numpy(), requests["queue_s"].to_numpy())
    slope = trend["queue_slope"]
    stable = slope is None or slope <= max_slope
    reasons = list(verdict["reasons"]) + ([] if stable else [
        f"queue growing: the wait rises {1e3 * slope:.0f} ms per s of traffic (> {1e3 * max_slope:g})"])
    return {**verdict, **trend, "queue_stable": stable, "passed": verdict["passed"] and stable, "reasons": reasons}
