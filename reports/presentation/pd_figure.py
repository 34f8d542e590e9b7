"""The figure of a disaggregated run (``sim.run.disagg``): where each request's TTFT went, phase
by phase (left: p50 / p90 / p99 of each phase, stacked in order; right: the prefill side's KV
held for transfer and the transfers in flight over time)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from reports.presentation.plots import FIG_WIDTH_IN, plt
from sim.results.result import RunResult

PHASES = (("prefill_queue_s", "prefill queue", "tab:gray"), ("prefill_s", "prefill", "tab:orange"),
          ("transfer_wait_s", "decode admission", "tab:purple"), ("transfer_s", "KV transfer", "tab:red"),
          ("decode_queue_s", "decode queue", "tab:olive"), ("decode_first_step_s", "first decode step", "tab:blue"))
QUANTILES = (50, 90, 99)


def phases_figure(requests: pd.DataFrame, timeline: pd.DataFrame | None, title: str = ""):
    """The two panels as a matplotlib Figure."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, FIG_WIDTH_IN * 0.42),
                                      gridspec_kw={"width_ratios": [1, 1.4]})
    done = requests[requests["status"] == "finished"]
    x = np.arange(len(QUANTILES))
    bottom = np.zeros(len(QUANTILES))
    for col, label, color in PHASES:
        v = done[col].to_numpy(dtype=float)
        v = v[~np.isnan(v)]
        h = np.percentile(v, QUANTILES) * 1e3 if len(v) else np.zeros(len(QUANTILES))
        left.bar(x, h, bottom=bottom, color=color, label=label, width=0.6)
        bottom += h
    ttft = done["ttft_s"].to_numpy(dtype=float) * 1e3
    if len(ttft):
        left.plot(x, np.percentile(ttft, QUANTILES), "k_", markersize=28, mew=2, label="TTFT itself")
    left.set_xticks(x, [f"p{q}" for q in QUANTILES])
    left.set_ylabel("ms (each phase's own percentile, stacked)")
    left.set_title("TTFT by phase")
    left.legend(fontsize=7, loc="upper left")
    if timeline is not None and len(timeline):
        held = timeline[timeline["what"] == "prefill_kv_held_blocks"]
        for replica, rows in held.groupby("replica"):
            right.step(rows["time_s"], rows["value"], where="post", label=f"prefill {replica}: KV blocks held")
        right.set_xlabel("time (s)")
        right.set_ylabel("KV blocks held for transfer")
        flight = timeline[timeline["what"] == "transfers_in_flight"]
        if len(flight):
            twin = right.twinx()
            twin.step(flight["time_s"], flight["value"], where="post", color="tab:red", alpha=0.5,
                      label="transfers in flight")
            twin.set_ylabel("transfers in flight", color="tab:red")
        right.legend(fontsize=7, loc="upper left")
    right.set_title("Prefill side: KV waiting to be pulled")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def write_phases_figure(result: RunResult, path: Path) -> Path:
    fig = phases_figure(result.requests, result.pd_timeline, result.meta.get("config", {}).get("name", ""))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
