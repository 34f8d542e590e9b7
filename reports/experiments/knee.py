"""Table arithmetic behind the sweep report's knee and Pareto figures (no plotting, no files).

Knee of a token-budget sweep: at each offered rate, which values of the
budget keep every SLO threshold, and which one to recommend. Pareto
frontier: the runs no other run beats on both output tokens/s per GPU and
output tokens/s per user.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

# The slo keys (sim.run.config.Slo: a workload's goodput thresholds, plus a plan's itl_ms) and the p99 column each bounds.
SLO_COLUMNS = {"ttft_ms": "p99_ttft_ms", "itl_ms": "p99_itl_ms", "tpot_ms": "p99_tpot_ms", "e2el_ms": "p99_e2el_ms"}
RULE = ("among the budgets whose mean p99s meet every SLO threshold at that rate, the one with the lowest "
        "p99 TTFT (ties: the smaller budget, whose prefill chunks stall decodes less)")
PER_GPU = "tokens_per_s_per_gpu"
PER_USER = "tokens_per_s_per_user"


def slo_limits(slo: Mapping[str, Any] | None, columns: Sequence[str]) -> dict[str, float]:
    """{"p99_ttft_ms": 2000.0, ...}: the SLO's thresholds on the p99 columns the table has."""
    return {SLO_COLUMNS[k]: float(v) for k, v in (slo or {}).items()
            if k in SLO_COLUMNS and v and SLO_COLUMNS[k] in columns}


def knee_cells(table: pd.DataFrame, *, budget_col: str, rate_col: str, limits: Mapping[str, float]) -> pd.DataFrame:
    """One row per (rate, budget): the mean over repetitions of p99 TTFT, of each limited
    column and of output throughput, and ``meets`` (every limit holds)."""
    cols = list(dict.fromkeys(["p99_ttft_ms", *limits, "output_throughput"]))
    cells = table.groupby([rate_col, budget_col], sort=True)[cols].mean().reset_index()
    meets = np.ones(len(cells), bool)
    for col, limit in limits.items():
        meets &= (cells[col] <= limit).to_numpy()
    return cells.assign(meets=meets)


def knee_table(cells: pd.DataFrame, *, budget_col: str, rate_col: str) -> pd.DataFrame:
    """Per rate: the budgets meeting the SLO (as ``budget_range`` text) and the recommended one (``RULE``).

    Returns rate, meeting (list, ascending), budgets (all tried, ascending),
    recommended (NaN when none meets) and its p99 TTFT.
    """
    rows = []
    for rate, sub in cells.groupby(rate_col, sort=True):
        ok = sub[sub["meets"]].sort_values(["p99_ttft_ms", budget_col])
        best = ok.iloc[0] if len(ok) else None
        rows.append({"rate": rate, "meeting": sorted(ok[budget_col].tolist()),
                     "budgets": sorted(sub[budget_col].tolist()),
                     "recommended": best[budget_col] if best is not None else np.nan,
                     "p99_ttft_ms": best["p99_ttft_ms"] if best is not None else np.nan})
    return pd.DataFrame(rows)


def budget_range(meeting: Sequence[float], budgets: Sequence[float]) -> str:
    """"512–2048" for three or more budgets consecutive in the grid, else listed; "none" when empty."""
    if not meeting:
        return "none"
    text = [f"{b:g}" for b in meeting]
    start = list(budgets).index(meeting[0])
    if len(meeting) > 2 and list(budgets[start:start + len(meeting)]) == list(meeting):
        return f"{text[0]}–{text[-1]}"
    return ", ".join(text)


def knee_rate(knee: pd.DataFrame) -> float | None:
    """The highest rate at which some budget meets the SLO (None when none does at any rate)."""
    ok = knee[knee["meeting"].map(len) > 0]
    return float(ok["rate"].iloc[-1]) if len(ok) else None


def knee_headline(knee: pd.DataFrame, *, budget_name: str, rate_text: Callable[[float], str]) -> str:
    """One sentence naming the knee: the highest rate at which some budget meets the SLO, the budgets
    that do there and the recommended one, and the rates above it where none does."""
    rate = knee_rate(knee)
    if rate is None:
        return f"No {budget_name} tried meets the SLO, even at {rate_text(knee['rate'].min())}"
    top = knee[knee["rate"] == rate].iloc[0]
    text = (f"Knee at {rate_text(top['rate'])}: {budget_name} {budget_range(top['meeting'], top['budgets'])} "
            f"meets the SLO there, recommended {top['recommended']:g}")
    above = knee[knee["rate"] > top["rate"]]
    return text + (f"; none does at {rate_text(above['rate'].min())} and above" if len(above) else "")


def pareto_points(table: pd.DataFrame, *, grid_cols: Sequence[str], num_gpus: pd.Series | float,
                  extra_cols: Sequence[str] = ()) -> pd.DataFrame:
    """One point per grid point (mean over repetitions of every column used), with

    tokens_per_s_per_gpu  = output_throughput / num_gpus (replicas x tensor parallel)
    tokens_per_s_per_user = 1000 / mean_tpot_ms (a request's decode speed after its first token)
    """
    frame = table.assign(_gpus=num_gpus)
    cols = list(dict.fromkeys(["output_throughput", "mean_tpot_ms", "_gpus", *extra_cols]))
    points = frame.groupby(list(grid_cols), sort=False, dropna=False)[cols].mean().reset_index() if grid_cols \
        else frame[cols].mean().to_frame().T
    points[PER_GPU] = points["output_throughput"] / points["_gpus"]
    points[PER_USER] = 1000.0 / points["mean_tpot_ms"]
    return points.drop(columns="_gpus").dropna(subset=[PER_GPU, PER_USER]).reset_index(drop=True)


def pareto_frontier(points: pd.DataFrame, *, x: str = PER_GPU, y: str = PER_USER) -> pd.DataFrame:
    """The points no other point beats on both ``x`` and ``y`` (higher is better on both), x ascending.

    Scanning from the highest x down, a point is on the frontier when its y
    beats every y seen so far (points with a larger x); a point equal on both to one kept is
    kept too (two configurations that give the same result are both on the frontier).
    """
    best_y = -np.inf
    keep: list = []
    last = None
    for idx, (xi, yi) in points.sort_values([x, y], ascending=[False, False])[[x, y]].iterrows():
        if yi > best_y or (last is not None and (xi, yi) == last):
            keep.append(idx)
            best_y, last = yi, (xi, yi)
    return points.loc[keep].sort_values(x)
