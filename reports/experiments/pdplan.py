"""`sim plan` for a disaggregated candidate: how many prefill and decode replicas (xPyD).

Every run simulates the candidate's own two pools with vLLM's KV handoff between them
(``sim.run.disagg``); the definitions of attainment, stability and capacity are
``reports.experiments.capacity``'s.

0. Saturation probes, as for an aggregated replica (a short trial above them can look fine
   while batches fill). s_P: what one prefill replica completes per second with the trial's
   requests sent at once, each cut to its prefill (max_tokens 1: what a prefill instance
   serves). s_D: what one decode replica completes per second with the requests sent at once
   through P prefill replicas; P starts at 1 and is raised to ceil(2 T / s_P) + 1 (at most
   twice) while the throughput T is above 80% of what the prefill pool feeds it, P x s_P, so
   that the prefill side is not what was measured.
1. c_D, one decode replica's capacity: find_capacity on the rate with ONE decode replica
   behind ceil(rate / s_P) + 1 prefill replicas (more than the rate needs, so the prefill side
   never binds), judged on ITL / TPOT and stability only (TTFT is mostly the prefill side's),
   never above s_D.
2. c_P, one prefill replica's capacity: find_capacity with ONE prefill replica behind
   ceil(rate / c_D) + 1 decode replicas, judged on TTFT and stability only, never above s_P.
3. x = ceil(target / (c_P u)), y = ceil(target / (c_D u)) (capacity.replicas_for, u the
   target utilisation). The xPyD fleet is simulated at the target rate on the plan's
   verification traffic and judged as an aggregated fleet is (every SLO, stability, the queue
   trend); while it fails, a replica goes to the pool that binds (``binding_pool``), at most
   verify.max_extra_replicas times.
4. $/hour = x gpus_P price_P + y gpus_D price_D (capacity.fleet_cost per pool); $/M output
   tokens over the served output tokens per second, as for an aggregated fleet.

This is rate matching (x c_P ~ y c_D ~ target / u), with each pool's rate measured under the
SLO it controls instead of from its throughput alone: a decode replica's rate is the one its
ITL holds, a prefill replica's the one its TTFT holds. The verification then checks the two
together, since a request's TTFT also holds its transfer and the decode side's first step.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from reports.experiments.capacity import SearchSettings, find_capacity, fleet_cost, queue_trend, replicas_for
from sim.run.config import Slo

FEED_SHARE = 0.8            # probe throughput above this share of P x s_P: the prefill side may bind
MAX_PROBE_RAISES = 2
DECODE_PHASES = ("transfer_wait_s", "transfer_s", "decode_queue_s", "decode_first_step_s")
PREFILL_PHASES = ("prefill_queue_s", "prefill_s")


def prefill_saturation(task: Any, rate_rps: float) -> float:
    """s_P: req/s one prefill replica completes with the trial's requests sent at ``rate_rps``
    (all at once, nearly), each cut to its prefill."""
    import warnings

    from reports.experiments.trial import rate_factor
    from sim.run.config import set_dotted, workload_from_dict
    from sim.run.runner import run_workload
    raw = set_dotted(task.candidate.raw, "num_requests", task.search.num_requests)
    raw = set_dotted(raw, "arrivals.rate", rate_rps / rate_factor(raw, task.source, task.base_dir))
    cfg = replace(workload_from_dict(raw, task.source, task.base_dir).disaggregation.prefill.cfg, max_tokens=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(run_workload(cfg).summary["request_throughput"])


def binding_pool(verdict: dict[str, Any], requests: Any, slo: Slo) -> tuple[str, str]:
    """The pool that gets the next replica when a fleet fails, and why.

    An ITL or TPOT miss: decode (its steps are the token gaps). A TTFT miss: the side where
    the missing requests spent most of their TTFT (prefill queue + prefill, against transfer
    wait + transfer + decode queue + the decode's first step). Otherwise (a backlog, a growing
    queue): the side whose queue delay trends up faster over the last third of the arrivals.
    """
    for metric in ("itl", "tpot"):
        value = verdict.get(f"{metric}_attainment")
        if value is not None and value < slo.attainment:
            return "decode", f"{metric.upper()} missed: the decode steps set the token gaps"
    value = verdict.get("ttft_attainment")
    if value is not None and value < slo.attainment and slo.ttft_ms is not None:
        ttft_ms = requests["ttft_s"].to_numpy(dtype=float) * 1e3
        missed = ~(ttft_ms <= slo.ttft_ms)
        sides = {side: float(np.nansum(np.column_stack([requests[c].to_numpy(dtype=float)[missed] for c in cols])))
                 for side, cols in (("prefill", PREFILL_PHASES), ("decode", DECODE_PHASES))}
        side = "prefill" if sides["prefill"] >= sides["decode"] else "decode"
        total = sum(sides.values()) or 1.0
        return side, (f"TTFT missed: {100 * sides[side] / total:.0f}% of the late requests' TTFT was in the "
                      f"{side} side")
    arrival = requests["arrival_s"].to_numpy(dtype=float)
    slopes = {}
    for side, cols in (("prefill", ("prefill_queue_s",)), ("decode", ("transfer_wait_s", "decode_queue_s"))):
        wait = np.nansum(np.column_stack([requests[c].to_numpy(dtype=float) for c in cols]), axis=1)
        wait[np.isnan(requests[cols[0]].to_numpy(dtype=float))] = np.nan
        slopes[side] = queue_trend(arrival, wait)["queue_slope"] or 0.0
    side = "prefill" if slopes["prefill"] > slopes["decode"] else "decode"
    return side, f"queue: the {side} side's wait grows fastest ({1e3 * slopes[side]:+.0f} ms per s)"


def pd_cost(num_prefill: int, num_decode: int, pools: dict[str, dict[str, Any]],
            output_tokens_per_s: float) -> tuple[float, float, float | None]:
    """($ per hour of the prefill pool, of the decode pool, $ per million output tokens of both):
    x gpus_P price_P + y gpus_D price_D (capacity.fleet_cost per pool)."""
    p, d = pools["prefill"], pools["decode"]
    per_hour_p, _ = fleet_cost(num_prefill, p["gpus_per_replica"], p["price_per_gpu_hour"], output_tokens_per_s)
    per_hour_d, _ = fleet_cost(num_decode, d["gpus_per_replica"], d["price_per_gpu_hour"], output_tokens_per_s)
    return per_hour_p, per_hour_d, fleet_cost(1, 1, per_hour_p + per_hour_d, output_tokens_per_s)[1]


def _search(task: Any, pool: str, slo: Slo, saturation_rps: float, others, best: dict[str, Any]):
    """find_capacity for one pool: one replica of ``pool``, ``others(rate)`` of the other."""
    from reports.experiments.trial import simulate
    s = task.search

    def evaluate(rate: float) -> dict[str, Any]:
        n_other = others(rate)
        pools = (1, n_other) if pool == "prefill" else (n_other, 1)
        result, verdict = simulate(task, rate, s.num_requests, pools=pools, slo=slo)
        if rate > saturation_rps:
            verdict = {**verdict, "passed": False, "reasons": [*verdict["reasons"], (
                f"offered {rate:.3g} req/s, more than the {saturation_rps:.3g} req/s one {pool} replica completes "
                f"when saturated")]}
        if verdict["passed"] and rate >= best.get("rate", 0.0):
            best.update(rate=rate, result=result)
        return {**verdict, "pool": pool}

    settings = SearchSettings(**{**s.to_dict(), "max_runs": max(1, s.max_runs - 1)})
    return find_capacity(evaluate, settings, start_rate=0.5 * saturation_rps)


def plan_disaggregated(task: Any) -> dict[str, Any]:
    """Worker entry point for a disaggregated candidate: probes, the two searches, the xPyD fleet and
    its cost (the module docstring)."""
    from reports.experiments.trial import SATURATION_RATE_FACTOR, check_queue, simulate
    from reports.experiments.sweep import scalar_summary
    from sim.results.folder import write_run
    from workloads.spec import MAX_RATE
    s, cand, slo = task.search, task.candidate, task.slo
    pools = cand.pools
    probe_rate = min(s.max_rate * SATURATION_RATE_FACTOR, MAX_RATE)
    sat_p = prefill_saturation(task, probe_rate)
    num_probe_p = 1
    for _ in range(MAX_PROBE_RAISES + 1):
        probe, _ = simulate(task, probe_rate, s.num_requests, pools=(num_probe_p, 1))
        sat_d = float(probe.summary["request_throughput"])
        if sat_d <= FEED_SHARE * num_probe_p * sat_p:
            break
        num_probe_p = math.ceil(2 * sat_d / sat_p) + 1
    decode_slo = Slo(itl_ms=slo.itl_ms, tpot_ms=slo.tpot_ms, attainment=slo.attainment)
    prefill_slo = Slo(ttft_ms=slo.ttft_ms, attainment=slo.attainment)
    run_dir = Path(task.run_dir)
    best_d: dict[str, Any] = {}
    c_d, trials_d, note_d = _search(task, "decode", decode_slo, sat_d, lambda r: math.ceil(r / sat_p) + 1, best_d)
    c_p, trials_p, note_p, best_p = 0.0, [], "not searched: no decode capacity", {}
    if c_d > 0:
        c_p, trials_p, note_p = _search(task, "prefill", prefill_slo, sat_p, lambda r: math.ceil(r / c_d) + 1, best_p)
    for best, name in ((best_d, "capacity_decode"), (best_p, "capacity_prefill")):
        if "result" in best:
            write_run(best["result"], run_dir / name)
    x0 = replicas_for(task.target_rate, c_p, task.target_utilization)
    y0 = replicas_for(task.target_rate, c_d, task.target_utilization)
    out: dict[str, Any] = {
        "name": cand.name, "hardware": cand.hardware, "policy": cand.policy, "layout": "disaggregated",
        "pools": pools, "gpus_per_replica": cand.gpus_per_replica, "price_per_gpu_hour": cand.price_per_gpu_hour,
        "saturation_rps": sat_d, "saturation_prefill_rps": sat_p, "saturation_decode_rps": sat_d,
        "probe_prefill_replicas": num_probe_p, "capacity_prefill_rps": c_p, "capacity_decode_rps": c_d,
        "search_note": f"decode: {note_d}; prefill: {note_p}", "trials": [*trials_d, *trials_p],
        "profile_source": probe.summary.get("profile_source"), "profile_name": probe.meta.get("profile_name"),
        "profile_name_prefill": probe.meta.get("profile_name_prefill"),
        "profile_provenance": probe.meta.get("profile_provenance"),
        "profile_efficiency": probe.meta.get("profile_efficiency"), "num_blocks": probe.meta.get("num_blocks"),
        "profile_error_pct": (probe.summary.get("profile_trust") or {}).get("error_pct"),
        "profile_trust": (probe.summary.get("profile_trust") or {}).get("basis"),
        "target_utilization": task.target_utilization, "attempts": [], "verified": False, "run_dir": str(run_dir),
        "capacity_rps": 0.0, "prefill_replicas_estimate": x0, "decode_replicas_estimate": y0,
        "replicas_estimate": None if x0 is None or y0 is None else x0 + y0}
    if x0 is None or y0 is None:
        out.update(replicas=None, cost_per_hour=None, cost_per_mtok=None, utilization=None)
        return out
    x, y = x0, y0
    for extra in range(task.verify.max_extra_replicas + 1):
        fleet, verdict = simulate(task, task.target_rate, task.verify.num_requests(task.target_rate), pools=(x, y))
        verdict = check_queue(verdict, fleet.requests, task.verify.max_queue_slope)
        verdict["replicas"] = [scalar_summary(r) for r in fleet.summary.get("replicas", [fleet.summary])]
        verdict["pd_phases"] = (fleet.summary.get("disaggregation") or {}).get("phases")
        out["attempts"].append(verdict)
        if verdict["passed"]:
            out["verified"] = True
            break
        if extra < task.verify.max_extra_replicas:
            side, why = binding_pool(verdict, fleet.requests, slo)
            verdict["next_replica"] = f"+1 {side}: {why}"
            x, y = (x + 1, y) if side == "prefill" else (x, y + 1)
    write_run(fleet, run_dir / "fleet")
    span_s = verdict["arrival_span_s"]
    token_rate = float(fleet.summary["total_output_tokens"]) / span_s if span_s > 0 else 0.0
    p, d = pools["prefill"], pools["decode"]
    per_hour_p, per_hour_d, per_mtok = pd_cost(x, y, pools, token_rate)
    per_hour = per_hour_p + per_hour_d
    fleet_capacity = min(x * c_p, y * c_d)
    out.update(replicas=x + y, prefill_replicas=x, decode_replicas=y,
               gpus=x * p["gpus_per_replica"] + y * d["gpus_per_replica"],
               cost_per_hour=per_hour, cost_per_hour_prefill=per_hour_p, cost_per_hour_decode=per_hour_d,
               cost_per_mtok=per_mtok, capacity_rps=fleet_capacity / (x + y),
               utilization=task.target_rate / fleet_capacity,
               fleet_output_throughput=fleet.summary["output_throughput"],
               served_output_tokens_per_s=token_rate)
    return out
