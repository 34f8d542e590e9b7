"""The best aggregated plan beside the best disaggregated one, and why the winner wins.

Read from a plan directory's ranked.csv and plan.json results alone (the terminal and the
report print the same block). The reason is the SLO that binds the loser, taken from its own
capacity search: the reasons of its first failed trial above the capacity found (for a
disaggregated loser, in the pool that costs it more per hour).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

# What limits a replica when a metric binds it; the clause says why, the numbers follow it.
WHY = {
    # Whatever the policy: its prefills run inside the decodes' steps (chunked, mixed) or between them.
    ("aggregated", "ITL"): "its prefills run in or between the decodes' steps, so every prefill stretches the "
                           "token gaps",
    ("aggregated", "TPOT"): "its prefills run in or between the decodes' steps, so every prefill slows the decodes",
    ("aggregated", "TTFT"): "its prompts share the replica's steps with the running decodes",
    ("decode", "ITL"): "its decode batch grows until a step takes longer than the gap allowed",
    ("decode", "TPOT"): "its decode batch grows until a step takes longer than the TPOT allowed",
    ("prefill", "TTFT"): "its prompts queue behind one another",
}


def metric_of(reason: str) -> str:
    """The SLO or limit a judge() reason names: TTFT, ITL, TPOT, saturation, backlog or queue."""
    head = reason.split(" ", 1)[0]
    if head in ("TTFT", "ITL", "TPOT"):
        return head
    if reason.startswith("offered "):
        return "saturation"
    return "backlog" if reason.startswith("unstable") else "queue"


def binding(trials: list[dict[str, Any]], capacity_rps: float | None, pool: str | None = None) -> dict[str, Any] | None:
    """The failed trial just above ``capacity_rps`` (the lowest failing rate above it, which
    bounds the bisection; of ``pool`` when given): {metric, reason, rate_rps}, or None when no
    trial failed above it. An SLO miss is named before a saturation cap or backlog beside it."""
    failed = [t for t in trials if (pool is None or t.get("pool") == pool) and not t.get("passed")
              and t.get("rate_rps", 0.0) > (capacity_rps or 0.0) and t.get("reasons")]
    if not failed:
        return None
    t = min(failed, key=lambda t: t["rate_rps"])
    reasons = sorted(t["reasons"], key=lambda r: metric_of(r) not in ("TTFT", "ITL", "TPOT"))
    return {"metric": metric_of(reasons[0]), "reason": reasons[0], "rate_rps": t["rate_rps"]}


def _limit(metric: str, slo: dict[str, Any]) -> str:
    return f"{metric} {slo.get(metric.lower() + '_ms'):g} ms"


def _holds(capacity_rps: float, b: dict[str, Any], slo: dict[str, Any]) -> str:
    """"3.03 req/s under TTFT 2000 ms (TTFT within ... at 3.3 req/s)", or the cap that binds first."""
    if b["metric"] == "saturation":
        return f"{capacity_rps:.3g} req/s, its saturation throughput (every SLO still met there)"
    if b["metric"] in ("backlog", "queue"):
        return f"{capacity_rps:.3g} req/s within the SLOs before its queue backs up ({b['reason']} at " \
               f"{b['rate_rps']:.3g} req/s)"
    return f"{capacity_rps:.3g} req/s under {_limit(b['metric'], slo)} ({b['reason']} at {b['rate_rps']:.3g} req/s)"


def _sized(r: dict[str, Any], pool: str, capacity_rps: float, plan: dict[str, Any]) -> str:
    """"ceil(10 / (3.1 x 0.8)) = 4", and the replicas the verification added."""
    u, n, first = plan["target_utilization"], r.get(f"{pool}_replicas"), r.get(f"{pool}_replicas_estimate")
    text = f"ceil({plan['target_rate']:g} / ({capacity_rps:.3g} x {u:g})) = {first}"
    return text + (f", +{n - first} to pass verification" if n and first and n > first else "")


def _bound(metric: str) -> str:
    return f"{metric}-bound" if metric in ("TTFT", "ITL", "TPOT") else f"throughput-bound ({metric})"


def _best(ranked: pd.DataFrame, layout: str) -> pd.Series | None:
    rows = ranked[ranked["layout"] == layout] if "layout" in ranked else ranked.iloc[0:0]
    return None if rows.empty else rows.iloc[0]


def _number(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _shown(value: Any, fmt: str) -> str:
    v = _number(value)
    return "-" if v is None else format(v, fmt)


def _shape(row: pd.Series) -> str:
    if row["layout"] == "disaggregated" and _number(row.get("prefill_replicas")) is not None:
        return f"{int(row['prefill_replicas'])}P{int(row['decode_replicas'])}D"
    return "-" if _number(row.get("replicas")) is None else f"{int(row['replicas'])} replicas"


def _reason(winner: dict[str, Any], loser: dict[str, Any], w_row: pd.Series, l_row: pd.Series,
            plan: dict[str, Any]) -> str:
    slo = plan["slo"]
    w_layout, l_layout = w_row["layout"], l_row["layout"]
    if not bool(w_row["meets_slo"]):
        return (f"Neither layout serves {plan['target_rate']:g} req/s within {plan['slo_text']} in this plan: see "
                f"the warnings.")
    if not bool(l_row["meets_slo"]):
        why = "; ".join((loser.get("attempts") or [{}])[-1].get("reasons") or []) or loser.get("search_note") or \
            loser.get("error") or "no fleet"
        return (f"{w_layout} wins: the best {l_layout} plan, {l_row['candidate']}, does not serve "
                f"{plan['target_rate']:g} req/s within {plan['slo_text']} ({why}).")
    cost = f"at ${w_row['cost_per_hour']:,.2f}/h against ${l_row['cost_per_hour']:,.2f}/h"
    if f"{w_row['cost_per_hour']:.2f}" == f"{l_row['cost_per_hour']:.2f}":
        # The ranking's tie-breaks: $ per M output tokens (the same traffic: the same), then capacity per replica.
        cost = (f"on a tie at ${w_row['cost_per_hour']:,.2f}/h by capacity per replica ({w_row['capacity_rps']:.3g} "
                f"against {l_row['capacity_rps']:.3g} req/s)")
    if l_layout == "aggregated":
        b = binding(loser.get("trials") or [], loser.get("capacity_rps"))
        if b is None:
            return f"{w_layout} wins {cost}."
        why = WHY.get(("aggregated", b["metric"]))
        return (f"{w_layout} wins {cost}: aggregated is {_bound(b['metric'])}" + (f" ({why})" if why else "")
                + f": each replica holds {_holds(loser['capacity_rps'], b, slo)}, against "
                f"{winner.get('capacity_decode_rps', 0):.3g} req/s for a decode replica and "
                f"{winner.get('capacity_prefill_rps', 0):.3g} for a prefill replica.")
    # A disaggregated loser: the pool that costs it more binds it.
    pool = "prefill" if (loser.get("cost_per_hour_prefill") or 0) > (loser.get("cost_per_hour_decode") or 0) \
        else "decode"
    capacity = loser.get(f"capacity_{pool}_rps") or 0.0
    b = binding(loser.get("trials") or [], capacity, pool)
    if b is None:
        return f"{w_layout} wins {cost}."
    why = WHY.get((pool, b["metric"]))
    n = loser.get(f"{pool}_replicas")
    return (f"{w_layout} wins {cost}: disaggregated is {_bound(b['metric'])} in its {pool} pool"
            + (f" ({why})" if why else "") + f": each {pool} replica holds {_holds(capacity, b, slo)}, and it takes "
            f"{n} of them ({_sized(loser, pool, capacity, plan)}; "
            f"${loser.get(f'cost_per_hour_{pool}') or 0:,.2f} of its ${l_row['cost_per_hour']:,.2f}/h), against "
            f"{winner.get('capacity_rps', 0):.3g} req/s for an aggregated replica.")


def layout_comparison(ranked: pd.DataFrame, results: list[dict[str, Any]],
                      plan: dict[str, Any]) -> dict[str, Any] | None:
    """{"table": DataFrame (one column per layout), "reason": sentence, "winner": layout} when the
    plan has both an aggregated and a disaggregated candidate; else None."""
    rows = {layout: _best(ranked, layout) for layout in ("aggregated", "disaggregated")}
    if any(r is None for r in rows.values()):
        return None
    by_name = {r["name"]: r for r in results}
    order = list(ranked["candidate"])
    w, l_ = sorted(rows, key=lambda k: order.index(rows[k]["candidate"]))
    table = {}
    for layout, r in rows.items():
        att = " ".join(f"{m.upper()} {100 * v:.1f}%" for m in ("ttft", "itl", "tpot")
                       if (v := _number(r.get(f"{m}_attainment"))) is not None)
        table[layout] = {
            "plan": r["candidate"], "GPUs": "-" if _number(r.get("gpus")) is None else f"{int(r['gpus'])}",
            "replicas": _shape(r),
            "$/hour": "-" if _number(r.get("cost_per_hour")) is None else f"{r['cost_per_hour']:,.2f}",
            "fleet p99 TTFT (ms)": _shown(r.get("fleet_p99_ttft_ms"), ",.0f"),
            "fleet p99 ITL (ms)": _shown(r.get("fleet_p99_itl_ms"), ",.1f"),
            "SLO attained": att or "-", "meets SLO": "yes" if bool(r["meets_slo"]) else "no"}
    frame = pd.DataFrame(table).rename_axis("").reset_index()
    reason = _reason(by_name.get(rows[w]["candidate"], {}), by_name.get(rows[l_]["candidate"], {}), rows[w], rows[l_],
                     plan)
    return {"table": frame, "reason": reason, "winner": w}
