"""Figures of single runs: latency CDFs, step time lines, batch-slot occupancy.

Inputs are the DataFrames of a ``RunResult`` (``requests``, ``steps``,
``tokens``) as ``sim.results.folder.read_run`` returns them; outputs are Figures.
"""

from __future__ import annotations

import heapq
from typing import Any, Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from policies import POLICIES
from reports.presentation.plots import (FIG_WIDTH_IN, REFERENCE, legend_outside, plain_log_ticks, plt, series_style, set_titles,
                           slo_line)
from sim.results.metrics import inter_token_latencies

NUM_TIME_BINS = 240
TOKEN_COLUMNS = ("num_decode_tokens", "num_prefill_tokens", "num_pad_tokens")
STATE_COLUMNS = ("num_running", "num_waiting", "batch_size", "kv_used_blocks", "kv_total_blocks")
STACK = [("num_decode_tokens", "tab:blue", "decode"), ("num_prefill_tokens", "tab:orange", "prefill"),
         ("num_pad_tokens", "tab:gray", "padding (computed, thrown away)")]


def itl_s(tokens: pd.DataFrame) -> np.ndarray:
    """Every gap (s) between consecutive output tokens of the same request
    (``sim.results.metrics``' ITL; each request's tokens in time order, as logged)."""
    return inter_token_latencies(tokens["req_id"].to_numpy(), tokens["t_s"].to_numpy(dtype=float))


# Steps drawn per CDF curve: 1/4,000 of the height apart (the axes are ~600 px tall), the
# smallest and largest values always among them. Drawing every one of an hour's 4M token gaps
# took matplotlib ~900 MB (a run's report peaked at 1.2 GB) for the same picture.
ECDF_POINTS = 4_000


def _ecdf(ax, values_ms: np.ndarray, label: str, color: Any) -> int:
    """Draw the empirical CDF (at most ``ECDF_POINTS`` of its steps, each exact: the value at
    rank i with fraction (i + 1) / n); return how many values it holds."""
    values_ms = np.sort(values_ms[np.isfinite(values_ms)])
    n = len(values_ms)
    if n:
        ranks = np.unique(np.linspace(0, n - 1, min(n, ECDF_POINTS)).round().astype(np.int64))
        ax.plot(np.maximum(values_ms[ranks], 1e-3), (ranks + 1) / n, drawstyle="steps-post", color=color,
                label=label)
    return n


def latency_cdfs(runs: Mapping[str, tuple[pd.DataFrame, pd.DataFrame]], *, slo_ttft_ms: float | None = None,
                 slo_itl_ms: float | None = None, title: str = "Latency distributions", subtitle: str = "",
                 colors: Mapping[str, Any] | None = None) -> Figure:
    """CDFs of TTFT (per finished request) and ITL (per token gap), ms on log x.

    ``runs`` maps a label to ``(requests, tokens)``, drawn in that order;
    ``colors`` maps a label to its colour (default: series i gets colour i).
    """
    colors = colors or {}
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.6 + 0.15 * len(runs)), layout="constrained")
    counts: list[list[int]] = [[], []]
    for i, (label, (requests, tokens)) in enumerate(runs.items()):
        color = colors.get(label, series_style(i)["color"])
        finished = requests[requests["status"] == "finished"]
        counts[0].append(_ecdf(axes[0], finished["ttft_s"].to_numpy(dtype=float) * 1e3, label, color))
        counts[1].append(_ecdf(axes[1], itl_s(tokens) * 1e3, label, color))
    for ax, name, metric, slo, n, unit in [(axes[0], "time to first token", "ttft", slo_ttft_ms, counts[0], "requests"),
                                           (axes[1], "inter-token latency", "itl", slo_itl_ms, counts[1], "gaps")]:
        ax.axhline(0.99, color="gray", linestyle=":", linewidth=1, label="p99", gid=REFERENCE)
        slo_line(ax, slo, metric, vertical=True)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction ≤ x")
        count = f"{min(n):,}" if min(n) == max(n) else f"{min(n):,}–{max(n):,}"
        ax.set_title(f"CDF of {name} ({count} {unit}" + (" per run)" if len(n) > 1 else ")"), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    legend_outside(fig)
    set_titles(fig, title, subtitle)
    return plain_log_ticks(fig)


def _spread(t: np.ndarray, end: np.ndarray, counts: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Per bin, the part of ``counts`` computed inside it: each step's count spread evenly over
    its [t, end) (steps of one replica follow each other, so the running total rises
    piecewise linearly and is flat while the server idles)."""
    done = np.cumsum(counts)
    knots_t = np.column_stack([t, end]).ravel()
    knots_done = np.column_stack([done - counts, done]).ravel()
    return np.diff(np.interp(edges, knots_t, knots_done))


def timeline_bins(steps: pd.DataFrame, num_bins: int) -> tuple[pd.DataFrame, float]:
    """The step table of one replica (sorted by time) in ``num_bins`` equal time bins; returns
    (bins, bin width s).

    Token columns become rates: the tokens computed inside a bin (a step's
    tokens spread over its duration) divided by the bin width. State columns
    (running, waiting, batch size, KV blocks) are the mean over the steps
    that start in a bin, carried through bins that a longer step still
    covers, and NaN (a gap) in bins where the server idles.
    """
    t = steps["t_s"].to_numpy(dtype=float)
    end = t + steps["duration_s"].to_numpy(dtype=float)
    t0, t1 = float(t.min()), float(end.max())
    width = max(t1 - t0, 1e-9) / num_bins
    edges = t0 + width * np.arange(num_bins + 1)
    rates = pd.DataFrame({c: _spread(t, end, steps[c].to_numpy(dtype=float), edges) / width
                          for c in TOKEN_COLUMNS if c in steps.columns})
    first = np.minimum(((t - t0) / width).astype(int), num_bins - 1)
    last = np.minimum(((end - t0) / width).astype(int), num_bins - 1)
    cover = np.zeros(num_bins + 1, int)               # +1 at a step's first bin, -1 after its last
    np.add.at(cover, first, 1)
    np.add.at(cover, last + 1, -1)
    state = [c for c in STATE_COLUMNS if c in steps.columns]
    means = steps.assign(bin=first).groupby("bin")[state].mean().reindex(range(num_bins)).ffill()
    means.loc[np.cumsum(cover[:-1]) == 0] = np.nan
    return pd.concat([rates, means], axis=1).assign(t_s=edges[:-1]), width


def run_timeline(steps: pd.DataFrame, *, replica: int | None = None, title: str = "Run time line",
                 subtitle: str = "", num_bins: int = NUM_TIME_BINS) -> Figure:
    """Three panels over simulated time, binned (``timeline_bins``): tokens computed per
    second stacked decode / prefill / padding, request counts (running, waiting, batch size),
    and KV-cache use (% of blocks).

    Decode sits at the bottom of the stack, so its steady rate stays visible
    under the spikes of prefill that dominate token counts. ``replica``: which
    replica to draw (default: the first in the table).
    """
    num_replicas = steps["replica"].nunique() if "replica" in steps.columns else 1
    if "replica" in steps.columns and len(steps):
        replica = int(steps["replica"].min()) if replica is None else replica
        steps = steps[steps["replica"] == replica]
    bins, width = timeline_bins(steps.sort_values("t_s"), max(1, min(num_bins, len(steps) // 4)))
    edges = np.append(bins["t_s"].to_numpy(), bins["t_s"].iloc[-1] + width)
    fig, axes = plt.subplots(3, 1, figsize=(FIG_WIDTH_IN, 8.4), sharex=True, layout="constrained",
                             gridspec_kw={"height_ratios": [2.2, 1.3, 1.0]})
    below = np.zeros(len(bins))
    for col, color, label in STACK:
        if col in bins.columns and bins[col].any():
            top = below + bins[col].to_numpy()
            axes[0].fill_between(edges, np.append(below, below[-1]), np.append(top, top[-1]), step="post",
                                 color=color, alpha=0.85, linewidth=0, label=label)
            below = top
    axes[0].set_ylabel("tokens computed\nper second")
    axes[1].plot(edges[:-1], bins["num_running"], drawstyle="steps-post", color="tab:green", label="running")
    axes[1].plot(edges[:-1], bins["num_waiting"], drawstyle="steps-post", color="tab:red", label="waiting")
    axes[1].plot(edges[:-1], bins["batch_size"], drawstyle="steps-post", color="black", linewidth=0.8,
                 linestyle="--", label="batch size (requests per step)")
    axes[1].set_ylabel("requests\n(mean over steps;\nwaiting: at each step's end)")
    kv_pct = 100.0 * bins["kv_used_blocks"] / bins["kv_total_blocks"].replace(0, np.nan)
    axes[2].fill_between(edges[:-1], 0, kv_pct, step="post", color="tab:purple", alpha=0.5,
                         label=f"KV cache used (peak {kv_pct.max():.0f}% of {int(bins['kv_total_blocks'].max()):,} "
                               f"blocks)")
    axes[2].set_ylim(0, min(100.0, max(5.0, 1.2 * float(kv_pct.max() or 0))))
    axes[2].set_ylabel("KV cache used\n(% of blocks)")
    axes[2].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].set_xlim(edges[0], edges[-1])
    legend_outside(fig)
    where = f"replica {replica} of {num_replicas}; " if num_replicas > 1 else ""
    set_titles(fig, title, subtitle)
    axes[0].set_title(f"{where}{width:.3g} s bins: tokens computed in a bin / bin width; counts and KV use: "
                      f"mean over the steps starting in it (gaps: server idle)", fontsize=9)
    return fig


def slot_intervals(requests: pd.DataFrame, tokens: pd.DataFrame | None = None, *,
                   holds_until_batch_end: bool) -> pd.DataFrame:
    """Assign each scheduled request of one replica to a batch slot.

    A request runs from ``first_scheduled_s`` to its last output token (from
    ``tokens``; ``finished_s`` when no tokens are given) and holds its slot
    until ``finished_s``, when its result is returned. Under batch-holding
    policies (static, dynamic) it also holds the slot until the last request
    that started with it is done. Slots are handed out lowest-free-first, so a
    refilled slot shows as a new colour in the same lane. A preempted request
    is drawn as holding its slot throughout.

    Returns req_id, slot, start_s, first_token_s, done_s, held_until_s.
    """
    req = requests.dropna(subset=["first_scheduled_s", "finished_s"])
    req = req.sort_values(["first_scheduled_s", "req_id"])
    done = req["finished_s"]
    if tokens is not None and len(tokens):
        last_token = tokens.groupby("req_id")["t_s"].max()
        done = req["req_id"].map(last_token).fillna(req["finished_s"]).set_axis(req.index)
    held = req["finished_s"]
    if holds_until_batch_end:
        held = np.maximum(held, req.groupby("first_scheduled_s")["finished_s"].transform("max"))
    free: list[int] = []
    busy: list[tuple[float, int]] = []
    num_slots = 0
    slots = []
    for start, end in zip(req["first_scheduled_s"].to_numpy(), held.to_numpy()):
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, num_slots = num_slots, num_slots + 1
        slots.append(slot)
        heapq.heappush(busy, (end, slot))
    first_token = req["first_token_s"].fillna(done)
    return pd.DataFrame({"req_id": req["req_id"].to_numpy(), "slot": slots,
                         "start_s": req["first_scheduled_s"].to_numpy(), "first_token_s": first_token.to_numpy(),
                         "done_s": done.to_numpy(), "held_until_s": held.to_numpy()})


def _draw_slots(ax, iv: pd.DataFrame, t_end_s: float, t_start_s: float | None = None) -> str:
    """Draw slot lanes up to ``t_end_s``; return a one-line occupancy summary for the title,
    averaged over the window shown: from ``t_start_s`` (panels on a shared axis share it) or
    else from the first request scheduled."""
    cmap = plt.get_cmap("tab20")
    iv = iv[iv["start_s"] < t_end_s]
    for row in iv.itertuples(index=False):
        color = cmap(int(row.req_id) % 20)
        ax.broken_barh([(row.start_s, row.first_token_s - row.start_s)], (row.slot - 0.4, 0.8),
                       facecolors=color, edgecolors="black", linewidth=0.3, hatch="////")
        ax.broken_barh([(row.first_token_s, row.done_s - row.first_token_s)], (row.slot - 0.4, 0.8),
                       facecolors=color, edgecolors="black", linewidth=0.3)
        if row.held_until_s > row.done_s:
            ax.broken_barh([(row.done_s, row.held_until_s - row.done_s)], (row.slot - 0.4, 0.8),
                           facecolors="whitesmoke", edgecolors="gray", linewidth=0.3, hatch="..")
    if iv.empty or t_end_s <= float(iv["start_s"].min()):
        return "no request scheduled"
    t0 = float(iv["start_s"].min()) if t_start_s is None else min(t_start_s, float(iv["start_s"].min()))
    clip = lambda col: np.clip(iv[col].to_numpy(dtype=float), t0, t_end_s)  # noqa: E731
    active_s = float((clip("done_s") - clip("start_s")).sum())
    held_s = float((clip("held_until_s") - clip("start_s")).sum())
    num_slots = int(iv["slot"].max()) + 1
    ax.set_ylim(-0.7, num_slots - 0.3)
    ax.set_xlim(t0, t_end_s)
    ax.set_ylabel("batch slot")
    ax.grid(True, axis="x", alpha=0.3)
    text = f"on average {active_s / (t_end_s - t0):.1f} of {num_slots} slots hold a running request"
    if held_s > active_s:
        text += f"; {1 - active_s / held_s:.0%} of held slot-time is idle (done, waiting for its batch)"
    return text


def _window_end_s(iv: pd.DataFrame, max_requests: int) -> float:
    if iv.empty:
        return 1.0
    ordered = iv.sort_values("start_s")
    if len(ordered) <= max_requests:
        return float(ordered["held_until_s"].max())
    return float(ordered["start_s"].iloc[max_requests])


def slot_occupancy(runs: Mapping[str, tuple[pd.DataFrame, pd.DataFrame | None, str]], *, max_requests: int = 60,
                   title: str = "Batch-slot occupancy (colour = request)", subtitle: str = "") -> Figure:
    """One lane chart per run, on a shared time axis: which request occupies each batch slot.

    ``runs`` maps a label to ``(requests, tokens, policy_kind)``; every run is
    drawn, first replica only. Hatched: scheduled, prefilling (until its
    first token); solid: decoding; dotted grey: slot held by a request that
    has produced all its tokens, until its result returns (static/dynamic
    batching return a batch together). The window ends when the run with the
    fastest turnover has started ``max_requests`` requests.
    """
    intervals = {}
    for label, (requests, tokens, kind) in runs.items():
        if "replica" in requests.columns and len(requests):
            first = requests["replica"].min()
            requests = requests[requests["replica"] == first]
        holds = kind in POLICIES and POLICIES[kind][1].holds_batch   # a slot is held until its batch's last request ends
        intervals[label] = slot_intervals(requests, tokens, holds_until_batch_end=holds)
    t_end_s = min(_window_end_s(iv, max_requests) for iv in intervals.values())
    lane_in = 2.6 if len(runs) <= 2 else 1.9
    fig, axes = plt.subplots(len(runs), 1, figsize=(FIG_WIDTH_IN, lane_in * len(runs) + 1.4), sharex=True,
                             layout="constrained", squeeze=False)
    # One window for every panel (the axis is shared): a run that started late (static waiting to fill
    # its first batch) is averaged over its idle start too, not only from its first batch.
    t_start_s = min(float(iv["start_s"].min()) for iv in intervals.values() if not iv.empty) \
        if any(not iv.empty for iv in intervals.values()) else None
    for ax, (label, iv) in zip(axes[:, 0], intervals.items()):
        ax.set_title(f"{label}: {_draw_slots(ax, iv, t_end_s, t_start_s)}", fontsize=9)
    axes[-1, 0].set_xlabel("simulated time (s)")
    handles = [Patch(facecolor="lightsteelblue", hatch="////", edgecolor="black", label="scheduled, prefilling"),
               Patch(facecolor="lightsteelblue", edgecolor="black", label="decoding"),
               Patch(facecolor="whitesmoke", hatch="..", edgecolor="gray",
                     label="done, slot held until its batch returns"),
               Patch(facecolor="white", edgecolor="lightgray", label="empty slot")]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8)
    set_titles(fig, title, subtitle)
    return fig


def prefix_cache_timeline(requests: pd.DataFrame, cache: pd.DataFrame, num_blocks: int, *,
                          title: str = "Prefix cache", subtitle: str = "",
                          num_bins: int = NUM_TIME_BINS) -> Figure:
    """Two panels over simulated time: the prefix cache hit rate of the requests
    first scheduled in each bin (their cached prompt tokens / their prompt
    tokens, vLLM's hits / queries) with the run's cumulative rate, and the KV
    blocks of the fleet split into in use, free but still caching a prefix
    (evicted only when reused) and free and empty.

    ``requests``: the requests table (``num_cached_tokens`` column);
    ``cache``: ``RunResult.prefix_cache``; ``num_blocks``: usable blocks per replica."""
    fig, axes = plt.subplots(2, 1, figsize=(FIG_WIDTH_IN, 6.4), sharex=True, layout="constrained",
                             gridspec_kw={"height_ratios": [1.0, 1.3]})
    admitted = requests[requests["first_scheduled_s"].notna()].sort_values("first_scheduled_s")
    t = admitted["first_scheduled_s"].to_numpy(dtype=np.float64)
    cached = admitted["num_cached_tokens"].to_numpy(dtype=np.float64)
    prompt = admitted["prompt_tokens"].to_numpy(dtype=np.float64)
    t_end = max(float(t[-1]) if len(t) else 0.0, float(cache["time_s"].max()) if len(cache) else 0.0, 1e-9)
    edges = np.linspace(0.0, t_end, max(2, min(num_bins // 2, len(t) // 10)) + 1)      # ~10+ requests a bin
    hit_sum, _ = np.histogram(t, bins=edges, weights=cached)
    query_sum, _ = np.histogram(t, bins=edges, weights=prompt)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = 100.0 * hit_sum / query_sum
    overall = 100.0 * cached.sum() / prompt.sum() if prompt.sum() else 0.0
    axes[0].plot(edges[:-1], rate, drawstyle="steps-post", color="tab:blue",
                 label="hit rate of the requests first scheduled in the bin")
    if len(t):
        axes[0].plot(t, 100.0 * np.cumsum(cached) / np.cumsum(prompt), color="black", linewidth=1.0,
                     linestyle="--", label=f"cumulative hit rate (run: {overall:.1f}%)")
    axes[0].set_ylim(0, 100)
    axes[0].set_ylabel("prefix cache hit rate\n(% of prompt tokens)")
    num_replicas = int(cache["replica"].nunique()) if len(cache) else 1
    fleet = cache.groupby("time_s", sort=True)[["kv_used_blocks", "cached_free_blocks"]].sum() if len(cache) \
        else pd.DataFrame({"kv_used_blocks": [], "cached_free_blocks": []})
    x = fleet.index.to_numpy(dtype=np.float64)
    total = num_blocks * num_replicas
    used = 100.0 * fleet["kv_used_blocks"].to_numpy() / total
    cached_free = 100.0 * fleet["cached_free_blocks"].to_numpy() / total
    axes[1].fill_between(x, 0, used, step="post", color="tab:purple", alpha=0.6, linewidth=0,
                         label="in use by running requests")
    axes[1].fill_between(x, used, used + cached_free, step="post", color="tab:olive", alpha=0.5, linewidth=0,
                         label="free, still caching a prefix (LRU: evicted when reused)")
    axes[1].set_ylim(0, 100)
    axes[1].set_ylabel(f"KV blocks\n(% of {total:,})")
    axes[1].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[0].set_xlim(0, t_end)
    legend_outside(fig)
    set_titles(fig, title, subtitle)
    where = f"{num_replicas} replicas summed; " if num_replicas > 1 else ""
    axes[0].set_title(f"{where}hit rate in {edges[1]:.3g} s bins by first scheduling (preempted requests' "
                      f"re-admissions not counted, as vLLM counts them apart)", fontsize=9)
    return fig
