"""`sim plan`: how many replicas of which (GPU, policy) serve a target rate within SLOs.

For each candidate (one worker task each, on the process pool or Dask):
1. probe the saturation throughput (every request at once, nearly);
2. bisect the highest rate one replica sustains within the SLOs (see
   ``reports.experiments.capacity`` for the definitions);
3. replicas = ceil(target / (capacity x target_utilization)); simulate the
   whole fleet behind the router at the target rate on the plan's
   verification traffic (``Verify``), adding a replica while it fails the
   SLOs or its queue grows (up to ``verify.max_extra_replicas``);
4. cost per hour = replicas x GPUs per replica x price, and per million
   output tokens at the fleet's simulated output throughput.

Output directory: plan.json (inputs, every result), trials.csv, ranked.csv,
runs/<candidate>/{capacity,fleet}/ (run directories), figures/, report.md,
report.html.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from reports.experiments.capacity import SearchSettings, find_capacity, fleet_cost, replicas_for, utilization
from reports.experiments.pdplan import plan_disaggregated
# CandidateTask, check_queue and simulate are this module's names too (the tests take them from here).
from reports.experiments.trial import SATURATION_RATE_FACTOR, CandidateTask, check_queue, simulate
from reports.experiments.planspec import PlanSpec, parse_plan, spec_summary
from reports.experiments.pool import check_pool_args, run_tasks
from sim.base.atomic import write_text_atomic
from sim.results.folder import WHAT, folder_kind
from reports.experiments.sweep import scalar_summary
from sim.run.config import ConfigError
from workloads.spec import MAX_RATE

class PlanFailed(ConfigError):
    """No candidate could be evaluated; the message names the first error. ``out``:
    the plan directory, written all the same (its report shows the errors)."""

    def __init__(self, message: str, out: Path) -> None:
        super().__init__(message)
        self.out = out


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def plan_candidate(task: CandidateTask) -> dict[str, Any]:
    """Worker entry point: capacity search, fleet check and cost of one candidate."""
    from sim.results.folder import write_run
    s, cand = task.search, task.candidate
    if cand.layout == "disaggregated":
        return plan_disaggregated(task)
    probe, _ = simulate(task, min(s.max_rate * SATURATION_RATE_FACTOR, MAX_RATE), s.num_requests)
    saturation_rps = float(probe.summary["request_throughput"])
    best: dict[str, Any] = {}

    def evaluate(rate: float) -> dict[str, Any]:
        result, verdict = simulate(task, rate, s.num_requests)
        if rate > saturation_rps:
            # More than one replica completes per second with its queue full cannot be sustained,
            # however well a short trial went: a scheduler that admits hundreds of requests into
            # its batch shows no queue and no backlog until its batch is full.
            verdict = {**verdict, "passed": False, "reasons": [*verdict["reasons"], (
                f"offered {rate:.3g} req/s, more than the {saturation_rps:.3g} req/s it completes when saturated")]}
        if verdict["passed"] and rate >= best.get("rate", 0.0):
            best.update(rate=rate, result=result)
        return verdict

    settings = SearchSettings(**{**s.to_dict(), "max_runs": max(1, s.max_runs - 1)})
    capacity, trials, note = find_capacity(evaluate, settings, start_rate=0.5 * saturation_rps)
    run_dir = Path(task.run_dir)
    if "result" in best:
        write_run(best["result"], run_dir / "capacity")
    out: dict[str, Any] = {
        "name": cand.name, "hardware": cand.hardware, "policy": cand.policy, "layout": "aggregated",
        "gpus_per_replica": cand.gpus_per_replica,
        "price_per_gpu_hour": cand.price_per_gpu_hour, "saturation_rps": saturation_rps, "capacity_rps": capacity,
        "search_note": note, "trials": trials, "profile_source": probe.summary.get("profile_source"),
        "profile_name": probe.meta.get("profile_name"), "profile_provenance": probe.meta.get("profile_provenance"),
        "profile_efficiency": probe.meta.get("profile_efficiency"), "num_blocks": probe.meta.get("num_blocks"),
        "profile_error_pct": (probe.summary.get("profile_trust") or {}).get("error_pct"),
        "profile_trust": (probe.summary.get("profile_trust") or {}).get("basis"),
        "replicas_estimate": replicas_for(task.target_rate, capacity, task.target_utilization),
        "target_utilization": task.target_utilization, "attempts": [], "verified": False, "run_dir": str(run_dir)}
    if out["replicas_estimate"] is None:
        out.update(replicas=None, cost_per_hour=None, cost_per_mtok=None, utilization=None)
        return out
    first = out["replicas_estimate"]
    for n in range(first, first + task.verify.max_extra_replicas + 1):
        fleet, verdict = simulate(task, task.target_rate, task.verify.num_requests(task.target_rate), num_replicas=n)
        verdict = check_queue(verdict, fleet.requests, task.verify.max_queue_slope)
        verdict["replicas"] = [scalar_summary(r) for r in fleet.summary.get("replicas", [fleet.summary])]
        out["attempts"].append(verdict)
        if verdict["passed"]:
            out["verified"] = True
            break
    write_run(fleet, run_dir / "fleet")
    # Per token of the traffic served: its output tokens over the span of their arrivals (the rate
    # they come at), the same for every fleet that serves it, so $/Mtok follows $/hour; the run's
    # output_throughput divides by first arrival -> last completion, which the fleet's drain stretches.
    span_s = verdict["arrival_span_s"]
    token_rate = float(fleet.summary["total_output_tokens"]) / span_s if span_s > 0 else 0.0
    per_hour, per_mtok = fleet_cost(n, cand.gpus_per_replica, cand.price_per_gpu_hour, token_rate)
    out.update(replicas=n, cost_per_hour=per_hour, cost_per_mtok=per_mtok, utilization=utilization(
               task.target_rate, capacity, n), fleet_output_throughput=fleet.summary["output_throughput"],
               served_output_tokens_per_s=token_rate)
    return out


def ranked_table(results: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per candidate: verified first, then cheapest per hour, then cheapest per token."""
    rows = []
    for r in results:
        last = (r.get("attempts") or [{}])[-1]
        oor = sum(int(t.get("num_out_of_range_lookups") or 0) for t in [*r.get("trials", []), *r.get("attempts", [])])
        pd_ = r.get("layout") == "disaggregated"
        gpus = r.get("gpus") if pd_ else r["replicas"] * r.get("gpus_per_replica", 1) if r.get("replicas") else None
        rows.append({"candidate": r["name"], "layout": r.get("layout", "aggregated"), "hardware": r.get("hardware"),
                     "policy": r.get("policy"),
                     # disaggregated: the fleet's capacity min(x c_P, y c_D) over its x + y replicas
                     "capacity_rps": r.get("capacity_rps"), "profile_error_pct": r.get("profile_error_pct"),
                     "replicas_estimate": r.get("replicas_estimate"),
                     "replicas": r.get("replicas"),
                     "prefill_replicas": r.get("prefill_replicas") if pd_ else None,
                     "decode_replicas": r.get("decode_replicas") if pd_ else None,
                     "gpus": gpus,  # None: no fleet
                     "utilization": r.get("utilization"), "meets_slo": bool(r.get("verified")),
                     "cost_per_hour": r.get("cost_per_hour"),
                     "cost_per_mtok": r.get("cost_per_mtok"), "fleet_p99_ttft_ms": last.get("p99_ttft_ms"),
                     "fleet_p99_itl_ms": last.get("p99_itl_ms"), "fleet_p99_tpot_ms": last.get("p99_tpot_ms"),
                     **{f"{m}_attainment": last.get(f"{m}_attainment") for m in ("ttft", "itl", "tpot")},
                     "queue_stable": last.get("queue_stable"), "queue_slope": last.get("queue_slope"),
                     "verify_span_s": last.get("arrival_span_s"),
                     "profile_source": r.get("profile_source"), "out_of_range_lookups": oor,
                     "error": r.get("error")})
    df = pd.DataFrame(rows)
    order = df.assign(_bad=~df["meets_slo"], _cost=df["cost_per_hour"].fillna(float("inf")),
                      _tok=df["cost_per_mtok"].fillna(float("inf")), _cap=-df["capacity_rps"].fillna(0))
    return df.loc[order.sort_values(["_bad", "_cost", "_tok", "_cap"]).index].reset_index(drop=True)


def trials_table(results: list[dict[str, Any]]) -> pd.DataFrame:
    # A disaggregated candidate's two searches are two curves: "NAME (decode pool)", "NAME (prefill pool)".
    rows = [{"candidate": r["name"] + (f" ({t['pool']} pool)" if t.get("pool") else ""), "phase": "search",
             **{k: v for k, v in t.items() if k != "reasons"},
             "reasons": "; ".join(t.get("reasons", []))} for r in results for t in r.get("trials", [])]
    rows += [{"candidate": r["name"], "phase": "fleet",
              **{k: v for k, v in t.items() if k not in ("reasons", "replicas", "pd_phases")},
              "reasons": "; ".join(t.get("reasons", []))} for r in results for t in r.get("attempts", [])]
    return pd.DataFrame(rows)


def run_plan(spec: PlanSpec, *, jobs: int | None = None, cluster: Any = None, progress: bool = True) -> Path:
    """Evaluate every candidate, write plan.json, trials.csv, ranked.csv and the report; return the dir."""
    out = spec.out
    out.mkdir(parents=True, exist_ok=True)
    tasks = [CandidateTask(c, str(spec.base_path), str(spec.base_path.parent), spec.target_rate, spec.slo, spec.router,
                           spec.search, spec.verify, str(out / "runs" / slug(c.name)), spec.target_utilization)
             for c in spec.candidates if c.refused is None]
    # layouts of a ``layouts`` search that cannot run: reported with the line that says why
    results: list[dict[str, Any]] = [
        {"name": c.name, "hardware": c.hardware, "policy": c.policy, "error": f"refused: {c.refused}",
         "layout": c.layout, "gpus_per_replica": c.gpus_per_replica, "price_per_gpu_hour": c.price_per_gpu_hour}
        for c in spec.candidates if c.refused is not None]
    for outcome in run_tasks(plan_candidate, tasks, jobs=jobs, cluster=cluster, progress=progress,
                             desc=f"plan {spec.name}"):
        if outcome.error is not None:
            c = outcome.task.candidate
            error = str(outcome.error) if isinstance(outcome.error, ConfigError) else repr(outcome.error)
            results.append({"name": c.name, "hardware": c.hardware, "policy": c.policy, "error": error,
                            "layout": c.layout,
                            "gpus_per_replica": c.gpus_per_replica, "price_per_gpu_hour": c.price_per_gpu_hour})
        else:
            results.append(outcome.result)
    order = {c.name: i for i, c in enumerate(spec.candidates)}
    results.sort(key=lambda r: order[r["name"]])
    # plan.json marks a complete plan directory, so it is written last; every file goes tmp + rename.
    write_text_atomic(out / "trials.csv", trials_table(results).to_csv(index=False))
    write_text_atomic(out / "ranked.csv", ranked_table(results).to_csv(index=False))
    write_text_atomic(out / "plan.json", json.dumps({"plan": spec_summary(spec), "results": results}, indent=2,
                                               default=str) + "\n")
    if all("error" in r for r in results):
        raise PlanFailed(f"{spec.source}: every candidate failed; first: {results[0]['name']}: {results[0]['error']}",
                         out)
    return out


def run_plan_file(path: str | Path, *, out: Path | None = None, jobs: int | None = None,
                  cluster: str | None = None, progress: bool = True, overrides: dict[str, Any] | None = None) -> Path:
    """`sim plan FILE`: validate the plan, evaluate every candidate, write the report; return its directory.

    ``overrides``: ``--set``/``--seed`` pairs (``reports.experiments.planspec``)."""
    check_pool_args(jobs, cluster)
    spec = parse_plan(path, out, overrides)
    if spec.kept_out_of is not None:
        kind = folder_kind(spec.kept_out_of)
        what = ("a plan for another question (other traffic, SLOs, candidates or settings)" if kind == "plan"
                else WHAT.get(kind or "", "something else"))
        print(f"note: {spec.kept_out_of}/ holds {what}, so this one goes to {spec.out}/ (--out DIR to choose)",
              file=sys.stderr)
    return run_plan(spec, jobs=jobs, cluster=cluster, progress=progress)
