"""The capacity-plan report, rebuilt from a plan directory alone (plan.json, ranked.csv,
trials.csv and the saved run directories)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from reports.presentation import plots
from reports.presentation.layouts import layout_comparison
from reports.presentation.render import Bullets, Callout, Document, Heading, Para, Table, write_document
from reports.presentation.runreport import Figures, provenance_lines, read_runs, run_figures
from sim.run.config import ConfigError

RANKED_COLUMNS = {"candidate": "candidate", "layout": "layout", "capacity_rps": "capacity / replica (req/s)",
                  "capacity_band": "capacity band (profile error)", "replicas": "replicas",
                  "prefill_replicas": "prefill replicas", "decode_replicas": "decode replicas",
                  "gpus": "GPUs", "utilization": "utilisation at target", "meets_slo": "fleet meets SLO",
                  "queue_stable": "queue stable", "cost_per_hour": "$ / hour",
                  "cost_per_mtok": "$ / M output tokens", "fleet_p99_ttft_ms": "fleet p99 TTFT (ms)",
                  "fleet_p99_itl_ms": "fleet p99 ITL (ms)", "profile_source": "profile"}


def _definitions(plan: dict[str, Any]) -> list[str]:
    s, u = plan["search"], plan["target_utilization"]
    v = {**plan["verify"], "min_requests_used": plan["verify_requests"]}
    return [
        f"SLO: {plan['slo_text']}. A TTFT or TPOT target is met when at least "
        f"{100 * plan['slo']['attainment']:g}% of all offered requests meet it (rejected requests count as misses); "
        f"an ITL target when at least that share of all inter-token gaps, over every token, meets it — "
        f"vLLM's percentile over tokens, read as an order statistic (numpy's interpolated p99 printed beside it "
        f"can lie a little above the target when the next value is far above it).",
        f"Stable: when the last request arrives, at most {100 * s['max_backlog_fraction']:g}% of the requests are "
        f"still waiting to be scheduled (a server that falls behind builds a backlog that grows with the run).",
        f"Capacity of one replica: the highest offered rate meeting every SLO while stable, and never above "
        f"the saturation throughput (what it completes per second with the trial's requests sent at once: a "
        f"short trial above it can look fine while the batch fills), bracketed by "
        f"doubling/halving from half the saturation throughput, then geometric bisection to {100 * s['rel_tol']:g}% "
        f"({s['num_requests']} requests per trial, at most {s['max_runs']} runs per candidate). Every trial is "
        f"measured over the whole run, warm-up and drain included.",
        f"Target utilisation {100 * u:g}%: replicas = ceil(target / (capacity x {u:g})), so the fleet runs at "
        f"target / (replicas x capacity) <= {100 * u:g}% of its capacity (the utilisation at target). The reason "
        f"is headroom: a queue's wait grows as rho / (1 - rho) at utilisation rho (M/G/1), 4 at 80% against 19 "
        f"at 95%, so a fleet sized at its capacity has nothing left for bursts, a traffic ramp or the step-cost "
        f"model's error, and its p99 latencies sit on the steep part of the curve. 70-80% is common practice.",
        f"Verification: the whole fleet is simulated behind the `{plan['router']}` router at "
        f"{plan['target_rate']:g} req/s on the same traffic for every candidate and replica count: the first "
        f"{v['min_requests_used']:,} requests (at least {v['min_duration_s']:g} s of traffic and "
        f"{v['min_requests']:,} requests). It passes when it meets the SLOs, is stable as above, and its queue "
        f"is not growing when the arrivals stop: the least-squares slope of each request's queue delay on its "
        f"arrival time, over the last third of the arrivals, is at most {v['max_queue_slope']:g} s per s. A "
        f"fleet offered rho > 1 times what it serves makes each later arrival wait (rho - 1) s longer per s, "
        f"so the limit means it falls at most {100 * v['max_queue_slope']:g}% behind. While it fails a replica "
        f"is added, at most {v['max_extra_replicas']} times.",
        "Cost per hour = replicas x GPUs per replica x price per GPU-hour; cost per million output tokens = cost per "
        "hour / (output tokens per second x 3600) x 1e6, the tokens of the requests the fleet served over the "
        "span of their arrivals (the rate the traffic brings them, the same for every fleet that serves it).",
        "Offered rates are the realized mean rate of the simulated requests ((n - 1) / arrival span); the traffic "
        "keeps the base workload's shape (arrival pattern and lengths) with its timeline rescaled.",
    ]


def capacity_band(capacity_rps: float | None, error_pct: float | None) -> str:
    """Capacity with the profile's step-cost error as a band (a step cost off
    by e% moves capacity by about e% too); "unchecked" where no error is known."""
    if not capacity_rps:
        return ""
    if error_pct is None or error_pct != error_pct:
        return "unchecked profile"
    e = error_pct / 100
    return f"{capacity_rps * (1 - e):.3g}-{capacity_rps * (1 + e):.3g} (±{error_pct:.0f}%)"


def close_calls(ranked: pd.DataFrame) -> list[str]:
    """Verified candidates whose cost per hour differs by less than their
    profiles' error bands together: their order is within the models' error."""
    ok = ranked[ranked["meets_slo"] & ranked["cost_per_hour"].notna()].reset_index(drop=True)
    out = []
    for i in range(len(ok) - 1):
        a, b = ok.iloc[i], ok.iloc[i + 1]
        ea, eb = a.get("profile_error_pct"), b.get("profile_error_pct")
        if ea is None or eb is None or ea != ea or eb != eb:
            continue
        gap_pct = (b["cost_per_hour"] - a["cost_per_hour"]) / a["cost_per_hour"] * 100
        if gap_pct < ea + eb:
            out.append(f"{a['candidate']} and {b['candidate']} differ by {gap_pct:.0f}% in cost per hour, less "
                       f"than their profiles' errors together (±{ea:.0f}% and ±{eb:.0f}%): the order between them "
                       f"is within the step-cost models' error; calibrate both before choosing.")
    return out


def plan_warnings(results: list[dict[str, Any]], plan: dict[str, Any]) -> list[str]:
    """Everything a reader should doubt before acting on the ranking (the report and `sim plan` print these)."""
    out = []
    for r in results:
        if r.get("error"):
            out.append(f"{r['name']}: evaluation failed: {r['error']}")
            continue
        oor = sum(int(t.get("num_out_of_range_lookups") or 0) for t in [*r.get("trials", []), *r.get("attempts", [])])
        if oor:
            out.append(f"{r['name']}: {oor:,} step-cost lookups fell outside the profile's calibrated range "
                       f"(extrapolated); its numbers are less certain.")
        if r.get("capacity_rps", 0) <= 0:
            out.append(f"{r['name']}: no rate met the SLOs ({r.get('search_note')}).")
        elif "capped" in (r.get("search_note") or "") or "still passing" in (r.get("search_note") or ""):
            out.append(f"{r['name']}: {r['search_note']}; capacity may be higher.")
        if r.get("replicas") and not r.get("verified"):
            out.append(f"{r['name']}: the fleet still failed with {r['replicas']} replicas "
                       f"({'; '.join(r['attempts'][-1].get('reasons') or [])}).")
        elif r.get("replicas") and r["replicas"] > r["replicas_estimate"]:
            out.append(f"{r['name']}: the {r['replicas_estimate']} replicas sized for "
                       f"{100 * plan['target_utilization']:g}% utilisation failed verification "
                       f"({'; '.join(r['attempts'][0].get('reasons') or [])}) and it took {r['replicas']}: "
                       f"its capacity estimate is optimistic for this traffic.")
        out += _short_window(r, plan["verify_requests"])
    return out + _unchecked_profiles(results)


def _unchecked_profiles(results: list[dict[str, Any]]) -> list[str]:
    """One line per hardware whose profile states no error (its candidates share the profile)."""
    by_hardware: dict[str, list[str]] = {}
    for r in results:
        if not r.get("error") and r.get("profile_trust") and r.get("profile_error_pct") is None:
            by_hardware.setdefault(f"{r['hardware']}: {r['profile_trust']}", []).append(r["policy"])
    return [f"{what}: the capacity of its {len(policies)} candidate(s) has no stated error."
            for what, policies in by_hardware.items()]


def _short_window(r: dict[str, Any], num_asked: int) -> list[str]:
    """A verification cut short by the trace's end, or shorter than 5 p99 request
    durations, cannot show a queue building up."""
    last = (r.get("attempts") or [{}])[-1]
    span, e2e_ms, num = last.get("arrival_span_s"), last.get("p99_e2el_ms"), last.get("num_requests")
    out = []
    if num and num < num_asked:
        out.append(f"{r['name']}: the base traffic holds {num:,} of the {num_asked:,} verification requests "
                   f"asked for: the fleet was verified on {span:.0f} s of traffic.")
    if span and e2e_ms and span < 5 * e2e_ms / 1e3:
        out.append(f"{r['name']}: verified on {span:.0f} s of traffic, under 5x the fleet's p99 E2E latency "
                   f"({e2e_ms / 1e3:.0f} s): too short to show a growing queue; raise verify.min_duration_s.")
    return out


def _recommendation(ranked: pd.DataFrame, plan: dict[str, Any]) -> Callout:
    ok = ranked[ranked["meets_slo"]]
    if ok.empty:
        return Callout(f"No candidate serves {plan['target_rate']:g} req/s within {plan['slo_text']} in this plan; "
                       f"see the warnings and the capacity search below.")
    best = ok.iloc[0]
    fleet = (f"{int(best['prefill_replicas'])} prefill and {int(best['decode_replicas'])} decode replica(s)"
             if best.get("layout") == "disaggregated" else f"{int(best['replicas'])} replica(s)")
    return Callout(
        f"**{best['candidate']}**: {fleet}, {int(best['gpus'])} GPU(s), "
        f"${best['cost_per_hour']:,.2f} per hour, ${best['cost_per_mtok']:,.3f} per million output tokens, "
        f"{100 * best['utilization']:.0f}% utilisation at the target (aim: at most "
        f"{100 * plan['target_utilization']:g}%). The simulated fleet at {plan['target_rate']:g} req/s "
        f"({best['verify_span_s']:.0f} s of traffic) had p99 TTFT {best['fleet_p99_ttft_ms']:,.0f} ms and p99 ITL "
        f"{best['fleet_p99_itl_ms']:,.1f} ms (SLO: {plan['slo_text']}); its queue was stable (queue delay trend "
        f"{1e3 * best['queue_slope']:+.1f} ms per s).", kind="ok")


def _attempts_table(results: list[dict[str, Any]]) -> pd.DataFrame:
    rows = [{"candidate": r["name"], "replicas": a.get("num_replicas"), "offered (req/s)": a.get("offered_rate"),
             "passed": a.get("passed"), "p99 TTFT (ms)": a.get("p99_ttft_ms"), "p99 ITL (ms)": a.get("p99_itl_ms"),
             "TTFT attained": a.get("ttft_attainment"), "ITL attained": a.get("itl_attainment"),
             "traffic (s)": a.get("arrival_span_s"), "queue stable": a.get("queue_stable"),
             "queue trend (ms/s)": None if a.get("queue_slope") is None else 1e3 * a["queue_slope"],
             "queue middle / last third (ms)": _thirds(a),
             "why not": "; ".join([*(a.get("reasons") or []), *([a["next_replica"]] if a.get("next_replica") else [])])}
            for r in results for a in r.get("attempts", [])]
    return pd.DataFrame(rows)


def _search_line(r: dict[str, Any]) -> str:
    if r.get("layout") != "disaggregated":
        return (f"{r['name']}: saturation {r.get('saturation_rps', 0):.3g} req/s; capacity "
                f"{r.get('capacity_rps', 0):.3g} req/s; {r.get('search_note')}")
    return (f"{r['name']}: saturation {r.get('saturation_prefill_rps', 0):.3g} req/s per prefill replica (prompts "
            f"alone), {r.get('saturation_decode_rps', 0):.3g} per decode replica (behind "
            f"{r.get('probe_prefill_replicas')} prefill); capacity {r.get('capacity_prefill_rps', 0):.3g} req/s per "
            f"prefill replica (TTFT), {r.get('capacity_decode_rps', 0):.3g} per decode replica (ITL/TPOT); "
            f"{r.get('search_note')}")


def _thirds(attempt: dict[str, Any]) -> str:
    middle, last = attempt.get("queue_middle_ms"), attempt.get("queue_last_ms")
    return "" if middle is None or last is None else f"{middle:,.0f} / {last:,.0f}"


def _provenance(results: list[dict[str, Any]]) -> list[str]:
    """One line per hardware: profile name, source and provenance fields, efficiency factors, KV blocks;
    then each distinct rationale the profiles give for their efficiency factors, once."""
    seen, out, notes = set(), [], {}
    for r in results:
        if r.get("error") or r.get("hardware") in seen:
            continue
        seen.add(r.get("hardware"))
        meta = {"profile_name": r.get("profile_name"), "profile_provenance": r.get("profile_provenance")}
        lines = provenance_lines(meta, {"profile_source": r.get("profile_source")})
        eff = r.get("profile_efficiency") or {}
        factors = ", ".join(f"{k} {v:g}" for k, v in eff.items() if isinstance(v, (int, float)))
        if isinstance(eff.get("justification"), str):
            notes[eff["justification"]] = None
        out.append(f"**{r['hardware']}**: " + "; ".join(lines) + (f"; efficiency factors: {factors}" if factors else "")
                   + f"; {r.get('num_blocks') or '?'} KV blocks per replica")
    return out + [f"Efficiency rationale stated by the profile: {note}" for note in notes]


def _priced(candidates: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(hardware, its price record) per aggregated candidate and per pool of a disaggregated one."""
    out = []
    for c in candidates:
        if c.get("pools"):
            out += [(f"{side} pool: {pool['hardware']}", pool) for side, pool in c["pools"].items()]
        else:
            out.append((c["hardware"], c))
    return out


def plan_report(d: Path) -> list[Path]:
    """Write DIR/figures/* and DIR/report.{md,html} from a plan directory."""
    data = json.loads((d / "plan.json").read_text())
    plan, results = data["plan"], data["results"]
    if not isinstance(plan, dict) or not isinstance(results, list):
        raise ValueError("plan.json's 'plan' must be an object and its 'results' a list")   # -> damaged
    if "target_utilization" not in plan:
        raise ConfigError(f"{d}: plan.json was written before plans had a target utilisation and a queue check; "
                          f"fix: rerun `sim plan` for this plan")
    ranked = pd.read_csv(d / "ranked.csv")
    ranked["meets_slo"] = ranked["meets_slo"].astype(bool)
    trials = pd.read_csv(d / "trials.csv") if (d / "trials.csv").stat().st_size > 1 else pd.DataFrame()
    slo = plan["slo"]
    figs = Figures(d)
    doc = Document(f"Capacity plan: {plan['name']}")
    doc.add(Para(f"Question: the cheapest fleet that serves **{plan['target_rate']:g} req/s** of the traffic in "
                 f"`{Path(plan['base']).name}` within **{plan['slo_text']}**, among {len(plan['candidates'])} "
                 f"candidate (hardware, policy) options."),
            Heading("Recommendation"), _recommendation(ranked, plan))
    for w in plan_warnings(results, plan) + close_calls(ranked):
        doc.add(Callout(w))
    side = layout_comparison(ranked, results, plan)
    if side is not None:
        doc.add(Heading("Aggregated vs disaggregated"),
                Table(side["table"], caption="the best plan of each layout at the target rate"),
                Para(side["reason"]))
    errors = ranked.get("profile_error_pct", [None] * len(ranked))
    ranked = ranked.assign(capacity_band=[capacity_band(c, e) for c, e in zip(ranked["capacity_rps"], errors)],
                           utilization=[f"{100 * u:.0f}%" if u == u else "" for u in ranked["utilization"]])
    # The layout columns only where a candidate is disaggregated (an aggregated plan reads as before).
    pd_ = "layout" in ranked and (ranked["layout"] == "disaggregated").any()
    layout_columns = ("layout", "prefill_replicas", "decode_replicas")
    columns = [c for c in RANKED_COLUMNS if c in ranked.columns and (pd_ or c not in layout_columns)]
    shown = ranked[columns].rename(columns=RANKED_COLUMNS)
    doc.add(Heading("Candidates, ranked"), Table(shown, caption="fleet-verified first, then by cost per hour"))
    # Plan figures compare candidates, so their line names the question, not one model/GPU.
    subtitle = (f"{plan['name']} · traffic {Path(plan['base']).name} · target {plan['target_rate']:g} req/s · "
                f"{plan['slo_text']} · {len(plan['candidates'])} candidates")
    ok = ranked[ranked["capacity_rps"].fillna(0) > 0]
    if not ok.empty:
        doc.add(figs.save(plots.capacity_bars(ok, target_rate=plan["target_rate"], subtitle=subtitle), "capacity",
                          "Capacity of one replica, replicas needed and fleet cost per candidate"))
    if not trials.empty and (trials["phase"] == "search").any():
        search = trials[trials["phase"] == "search"]
        doc.add(Heading("Capacity search"),
                figs.save(plots.search_curves(search, slo_ttft_ms=slo.get("ttft_ms"), slo_itl_ms=slo.get("itl_ms"),
                                              slo_tpot_ms=slo.get("tpot_ms"), subtitle=subtitle), "search",
                          "p99 latencies at every rate the bisection tried (hollow markers failed)"),
                Bullets([_search_line(r) for r in results if not r.get("error")]))
    attempts = _attempts_table(results)
    if not attempts.empty:
        doc.add(Heading("Fleet verification"), Table(attempts, caption="every fleet simulated at the target rate"))
    best = ranked[ranked["meets_slo"]].head(4)["candidate"].tolist() or ranked["candidate"].head(1).tolist()
    by_name = {r["name"]: r for r in results}
    fleets = read_runs({n: Path(by_name[n]["run_dir"]) / "fleet" for n in best if by_name[n].get("run_dir")})
    aggregated = {n: r for n, r in fleets.items() if by_name[n].get("layout", "aggregated") == "aggregated"}
    if fleets and not aggregated:
        doc.add(Heading("Fleets at the target rate"),
                *run_figures(figs, fleets, prefix="fleet_", slo_ttft_ms=slo.get("ttft_ms"),
                             slo_itl_ms=slo.get("itl_ms"), slots=False))
    elif fleets:
        # The load per replica of the best aggregated fleet (a disaggregated run has two pools of another kind).
        top_name, top = next(iter(aggregated.items()))
        reps = pd.DataFrame([{"replica": i, **r} for i, r in enumerate(top.summary.get("replicas") or [top.summary])])
        doc.add(Heading("Fleets at the target rate"),
                figs.save(plots.replica_balance(
                    reps, title=f"Load across the replicas of {top_name}",
                    subtitle=plots.describe(top.meta.get("config") or {}, profile_name=top.meta.get("profile_name"),
                                            num_replicas=len(reps), rates_rps=[plan["target_rate"]])), "replicas",
                          f"Per-replica load of {top_name}"),
                Table(reps[[c for c in ("replica", "completed", "request_throughput", "output_throughput",
                                        "p99_ttft_ms", "p99_itl_ms", "mean_batch_size", "peak_kv_utilization")
                            if c in reps]],
                      caption=f"per replica, {top_name}"),
                *run_figures(figs, fleets, prefix="fleet_", slo_ttft_ms=slo.get("ttft_ms"),
                             slo_itl_ms=slo.get("itl_ms"), slots=False))
    prices = pd.DataFrame([{"hardware": h, "GPUs per replica": c["gpus_per_replica"],
                            "$ per GPU-hour": c["price_per_gpu_hour"], "price": c.get("price_source", "given")}
                           for h, c in _priced(plan["candidates"])]).drop_duplicates()
    doc.add(Heading("Definitions"), Bullets(_definitions(plan)),
            Heading("Assumptions"), Table(prices, caption="prices used"),
            Bullets(plan.get("assumptions") or ["none stated in the plan file"]),
            Heading("Profile provenance"), Bullets(_provenance(results) or ["no candidate ran"]),
            Para(f"Source files: plan `{plan['source']}`, traffic `{plan['base']}`; data: plan.json, ranked.csv, "
                 f"trials.csv, runs/ (definitions: `reports.experiments.capacity`)."))
    return figs.written + write_document(doc, d)
