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
BINS = 120          # the time line's bins: the most each series reached in each


def binned_max(t: np.ndarray, v: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The largest value a step function (``v[i]`` from ``t[i]`` on, ``t`` sorted) takes in each
    bin [edges[k], edges[k+1]): the value it enters with and every value set inside."""
    out = np.zeros(len(edges) - 1)
    if not len(t):
        return out
    entering = np.searchsorted(t, edges[:-1], side="right") - 1       # last change at or before each start
    out = np.where(entering >= 0, v[np.clip(entering, 0, None)], 0.0)
    inside = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, len(out) - 1)
    np.maximum.at(out, inside, v)
    return out


def phases_figure(requests: pd.DataFrame, timeline: pd.DataFrame | None, title: str = ""):
    """The two panels as a matplotlib Figure."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, FIG_WIDTH_IN * 0.42),
                                      gridspec_kw={"width_ratios": [1, 1.4]})
    done = requests[requests["status"] == "finished"]
    x = np.arange(len(QUANTILES))
    bottom = np.zeros(len(QUANTILES))
    # SGLang's handoff (sim.loop.handoff_sglang): the wait for the decode reservation comes first.
    phases = ((("bootstrap_wait_s", "decode reservation", "tab:cyan"),) if "bootstrap_wait_s" in done else ()) + PHASES
    for col, label, color in phases:
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
    left.legend(fontsize=7, loc="upper left", markerscale=0.35)
    if timeline is not None and len(timeline):
        span = (float(timeline["time_s"].min()), float(timeline["time_s"].max()))
        edges = np.linspace(span[0], span[1] if span[1] > span[0] else span[0] + 1.0, BINS + 1)
        mids = (edges[:-1] + edges[1:]) / 2
        held = timeline[timeline["what"] == "prefill_kv_held_blocks"]
        for replica, rows in held.groupby("replica"):
            right.plot(mids, binned_max(rows["time_s"].to_numpy(), rows["value"].to_numpy(), edges), lw=1.2,
                       label=f"prefill {replica}: KV blocks held (max per {edges[1] - edges[0]:.3g} s)")
        right.set_xlabel("time (s)")
        right.set_ylabel("KV blocks held for transfer")
        flight = timeline[timeline["what"] == "transfers_in_flight"]
        if len(flight):
            twin = right.twinx()
            twin.plot(mids, binned_max(flight["time_s"].to_numpy(), flight["value"].to_numpy(), edges),
                      color="tab:red", lw=0.8, alpha=0.6, ls="--", label="transfers in flight (max)")
            twin.set_ylabel("transfers in flight (max per bin)", color="tab:red")
            twin.set_ylim(bottom=0)
        right.set_ylim(bottom=0)
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
