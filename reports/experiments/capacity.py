"""Capacity under SLOs: judge a run, bisect the rate one replica sustains, size a fleet.

Definitions (stated in every plan report):

- SLO attainment, per metric, with fraction f (e.g. 0.99):
  TTFT: at least f of all offered requests got their first token within
  ``ttft_ms`` (a rejected request counts as a miss);
  ITL: at least f of all inter-token gaps, over every token of every
  request, are within ``itl_ms`` (vLLM's p99 ITL is a percentile over tokens);
  TPOT: at least f of the requests with more than one output token have
  TPOT within ``tpot_ms`` (a rejected request counts as a miss).
  With f = 0.99 this is "p99 TTFT <= ttft_ms and p99 ITL <= itl_ms" read as
  order statistics, not as numpy's interpolated p99: 99 TTFTs of 1.99 s and
  one of 30 s meet a 2000 ms target (99% within), while np.percentile(.., 99)
  interpolates 1% of the way to 30 s, 2.27 s.
- Stable: when the last request arrives, at most ``max_backlog_fraction``
  (5%) of all requests are still waiting to be scheduled for the first time.
  A server that keeps up with the offered rate holds a bounded queue; one that
  falls behind accumulates a backlog that grows with the run.
- Capacity of one replica: the highest offered rate (req/s) at which a run
  meets every SLO and is stable, and at most what the replica completes per
  second when saturated (a probe sends the trial's requests at once), found
  by doubling/halving to bracket it and then geometric bisection to ``rel_tol``. Replicas for a target rate:
  ceil(target / (capacity x target utilisation)), then checked by simulating
  the whole fleet.
- Target utilisation (headroom): a queue's wait grows as rho / (1 - rho) at
  utilisation rho (M/G/1: 4x the wait at 80% as at 50%, 19x at 95%), so a
  fleet sized to run at its capacity has no room for bursts or for the
  model's own error. Capacity planners commonly aim at 70-80%; a plan sizes
  the fleet so that target / (replicas x capacity) <= target_utilization.
- Queue trend: the least-squares slope of each request's queue delay (s) on
  its arrival time (s) over the last third of the arrival window: is the
  queue still growing when the arrivals stop? In a fluid model a fleet
  offered rho > 1 times the rate it serves makes the request arriving at t
  wait (rho - 1) t more than the one arriving at 0, so a slope of 0.01 means
  the fleet is falling 1% behind. A stable queue has a flat trend even where
  its wait is long; a traffic ramp tilts it a little.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

from sim.run.config import Slo
from sim.results.metrics import inter_token_latencies


def _fraction_within(values_s: np.ndarray, limit_ms: float, num_total: int) -> float:
    """Share of ``num_total`` items whose value is within the limit (missing ones are misses)."""
    if num_total == 0:
        return 1.0
    ok = np.count_nonzero(np.nan_to_num(values_s * 1e3, nan=np.inf) <= limit_ms)
    return ok / num_total


def _below(value: float, target: float) -> str:
    """``value`` in percent, with the digits it takes to show it below ``target`` (0.98975 against
    0.99 is 98.97, not a rounded 99.0)."""
    for digits in range(1, 7):
        # rounded down (never up to the target), after float noise is rounded away (0.95 -> 95.0)
        text = f"{math.floor(round(100 * value * 10**digits, 6)) / 10**digits:.{digits}f}"
        if float(text) < 100 * target:
            return text
    return f"{100 * value:.6f}"


def judge(requests: pd.DataFrame, tokens: pd.DataFrame, slo: Slo, *,
          max_backlog_fraction: float = 0.05) -> dict[str, Any]:
    """Attainment per metric, the backlog at the last arrival, and the verdict.

    Returns passed (bool), reasons (list of str, empty when passed),
    ttft_attainment / itl_attainment / tpot_attainment (None when not
    constrained), backlog_fraction and stable.
    """
    n = len(requests)
    finished = requests["status"] == "finished"
    out: dict[str, Any] = {"ttft_attainment": None, "itl_attainment": None, "tpot_attainment": None}
    reasons = []
    if slo.ttft_ms is not None:
        ttft = requests["ttft_s"].where(finished).to_numpy(dtype=float)
        out["ttft_attainment"] = _fraction_within(ttft, slo.ttft_ms, n)
    if slo.tpot_ms is not None:
        multi = requests["output_tokens"] > 1
        tpot = requests.loc[multi, "tpot_s"].where(finished[multi]).to_numpy(dtype=float)
        out["tpot_attainment"] = _fraction_within(tpot, slo.tpot_ms, int(multi.sum()))
    if slo.itl_ms is not None:
        gaps = inter_token_latencies(tokens["req_id"].to_numpy(), tokens["t_s"].to_numpy(dtype=float))
        out["itl_attainment"] = _fraction_within(gaps, slo.itl_ms, len(gaps))
    for metric in ("ttft", "itl", "tpot"):
        value = out[f"{metric}_attainment"]
        if value is not None and value < slo.attainment:
            limit = getattr(slo, f"{metric}_ms")
            reasons.append(f"{metric.upper()} within {limit:g} ms for {_below(value, slo.attainment)}% "
                           f"< {100 * slo.attainment:g}%")
    last_arrival_s = float(requests["arrival_s"].max()) if n else 0.0
    # Backlog: arrived before the last arrival, served later, yet not started by then.
    started_s = requests["first_scheduled_s"].to_numpy(dtype=float)
    waiting = finished.to_numpy() & (requests["arrival_s"].to_numpy() < last_arrival_s) & ~(started_s < last_arrival_s)
    out["backlog_fraction"] = int(np.count_nonzero(waiting)) / n if n else 0.0
    out["stable"] = out["backlog_fraction"] <= max_backlog_fraction
    if not out["stable"]:
        reasons.append(f"unstable: {100 * out['backlog_fraction']:.1f}% of requests still waiting at the last "
                       f"arrival (> {100 * max_backlog_fraction:g}%)")
    out["passed"] = not reasons
    out["reasons"] = reasons
    return out


@dataclass(frozen=True)
class SearchSettings:
    """Bisection settings; rates in req/s for one replica."""

    num_requests: int = 400          # requests per trial run
    min_rate: float = 0.05
    max_rate: float = 2000.0
    rel_tol: float = 0.05            # stop when hi / lo - 1 <= rel_tol
    max_runs: int = 14               # trial runs per candidate, saturation probe included
    max_backlog_fraction: float = 0.05

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Evaluate = Callable[[float], dict[str, Any]]     # rate -> judge() result plus metrics; must hold 'passed'


def find_capacity(evaluate: Evaluate, settings: SearchSettings,
                  start_rate: float) -> tuple[float, list[dict[str, Any]], str]:
    """Highest passing rate, every trial (in order), and a note on how the search ended.

    Brackets the capacity by doubling from ``start_rate`` while runs pass (or
    halving while they fail), then bisects geometrically. The result is the
    highest rate that passed below the lowest that failed; 0.0 when even
    ``min_rate`` fails.
    """
    trials: list[dict[str, Any]] = []

    def trial(rate: float) -> bool:
        result = dict(evaluate(rate))
        result.setdefault("rate_rps", rate)
        trials.append(result)
        return bool(result["passed"])

    rate = min(max(start_rate, settings.min_rate), settings.max_rate)
    lo, hi = 0.0, math.inf
    note = ""
    while len(trials) < settings.max_runs:
        if trial(rate):
            lo = rate
            if rate >= settings.max_rate:
                note = f"capped: passed at max_rate {settings.max_rate:g} req/s"
                break
            if hi == math.inf:
                rate = min(rate * 2.0, settings.max_rate)
                continue
        else:
            hi = rate
            if rate <= settings.min_rate:
                note = f"fails even at min_rate {settings.min_rate:g} req/s"
                break
            if lo == 0.0:
                rate = max(rate / 2.0, settings.min_rate)
                continue
        if hi / lo - 1.0 <= settings.rel_tol:
            note = f"bracketed within {100 * settings.rel_tol:g}%: passes at {lo:.4g}, fails at {hi:.4g} req/s"
            break
        rate = math.sqrt(lo * hi)
    else:
        if hi == math.inf:
            note = (f"stopped after {len(trials)} runs (max_runs) still passing: capacity is at least {lo:.4g} "
                    f"req/s (raise search.max_runs)")
        elif lo == 0.0:
            note = (f"stopped after {len(trials)} runs (max_runs) still failing, down to {hi:.4g} req/s; "
                    f"search.min_rate {settings.min_rate:g} was not reached (raise search.max_runs)")
        else:
            note = f"stopped after {len(trials)} runs (max_runs): passes at {lo:.4g}, fails at {hi:.4g} req/s"
    return lo, trials, note


def replicas_for(target_rate: float, capacity_rps: float, target_utilization: float = 1.0) -> int | None:
    """ceil(target / (capacity x target_utilization)); None when one replica sustains no load at all."""
    if capacity_rps <= 0:
        return None
    return max(1, math.ceil(target_rate / (capacity_rps * target_utilization) - 1e-9))


def utilization(target_rate: float, capacity_rps: float, replicas: int | None) -> float | None:
    """Share of the fleet's capacity the target uses: target / (replicas x capacity)."""
    if not replicas or capacity_rps <= 0:
        return None
    return target_rate / (replicas * capacity_rps)


def queue_trend(arrival_s: np.ndarray, queue_s: np.ndarray) -> dict[str, float | None]:
    """Slope of queue delay on arrival time over the last third of the arrivals, and the
    mean delay of the middle and last thirds.

    Returns queue_slope (s of delay per s of traffic; None with fewer than two
    timed requests at distinct times in the last third), queue_middle_ms and
    queue_last_ms (None when a third is empty). Requests without a queue
    delay (rejected) are left out: they count against the SLOs already.
    """
    arrival_s, queue_s = np.asarray(arrival_s, dtype=float), np.asarray(queue_s, dtype=float)
    timed = ~np.isnan(queue_s)
    t, q = arrival_s[timed], queue_s[timed]
    out: dict[str, float | None] = {"queue_slope": None, "queue_middle_ms": None, "queue_last_ms": None}
    if t.size == 0:
        return out
    start_s, span_s = float(arrival_s.min()), float(arrival_s.max() - arrival_s.min())
    middle = (t >= start_s + span_s / 3) & (t < start_s + 2 * span_s / 3)
    last = t >= start_s + 2 * span_s / 3
    for key, sel in (("queue_middle_ms", middle), ("queue_last_ms", last)):
        out[key] = float(q[sel].mean() * 1e3) if sel.any() else None
    dt = t[last] - t[last].mean() if last.any() else t[last]
    if (dt * dt).sum() > 0:
        out["queue_slope"] = float((dt * (q[last] - q[last].mean())).sum() / (dt * dt).sum())
    return out


def fleet_cost(replicas: int, tensor_parallel: int, price_per_gpu_hour: float,
               output_tokens_per_s: float) -> tuple[float, float | None]:
    """($ per hour, $ per million output tokens) of ``replicas`` x ``tensor_parallel`` GPUs."""
    per_hour = replicas * tensor_parallel * price_per_gpu_hour
    per_mtok = per_hour / (output_tokens_per_s * 3600.0) * 1e6 if output_tokens_per_s > 0 else None
    return per_hour, per_mtok


def sweep_capacity(table: pd.DataFrame, *, rate_col: str, group_cols: list[str],
                   slo_ms: dict[str, float]) -> pd.DataFrame:
    """Per configuration of a sweep: the highest rate whose mean p99s meet ``slo_ms``
    ({"ttft": 2000, "tpot": 50, ...}) at that rate and at every lower rate of the grid.

    Returns group_cols + max_rate (the ``rate_col`` value, NaN if none passes),
    offered_rate (realized req/s at that rate) and output_throughput.
    """
    metrics = [f"p99_{m}_ms" for m in slo_ms if f"p99_{m}_ms" in table.columns]
    cols = [*metrics, *(c for c in ("offered_rate", "output_throughput") if c in table.columns)]
    rows = []
    groups = table.groupby(group_cols, sort=False, dropna=False) if group_cols else [((), table)]
    for key, sub in groups:
        mean = sub.groupby(rate_col, sort=True)[cols].mean()
        ok = np.ones(len(mean), bool)
        for m in metrics:
            ok &= (mean[m] <= slo_ms[m.split("_")[1]]).to_numpy()
        passing = np.cumprod(ok).astype(bool)          # every lower rate must pass too
        best = mean[passing].tail(1)
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(group_cols, key))
        row["max_rate"] = best.index[0] if len(best) else np.nan
        for c in ("offered_rate", "output_throughput"):
            if c in mean:
                row[c] = float(best[c].iloc[0]) if len(best) else np.nan
        rows.append(row)
    return pd.DataFrame(rows)
