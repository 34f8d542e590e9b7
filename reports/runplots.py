"""Figures of single runs: latency CDFs, step time lines, batch-slot occupancy.

Inputs are the DataFrames of a ``RunResult`` (``requests``, ``steps``,
``tokens``) as ``sim.io.read_run`` returns them; outputs are Figures.
"""

from __future__ import annotations

import heapq
from typing import Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from reports.plots import FIG_WIDTH_IN, legend_below, plain_log_ticks, plt

BATCH_HOLDING_POLICIES = frozenset({"static", "dynamic"})   # a slot is held until the batch's last request ends
MAX_TIMELINE_POINTS = 4000


def itl_s(tokens: pd.DataFrame) -> np.ndarray:
    """Every gap (s) between consecutive output tokens of the same request."""
    req = tokens["req_id"].to_numpy()
    t = tokens["t_s"].to_numpy(dtype=float)
    order = np.lexsort((t, req))
    req, t = req[order], t[order]
    same = req[1:] == req[:-1]
    return np.diff(t)[same]


def _ecdf(ax, values_ms: np.ndarray, label: str) -> None:
    values_ms = np.sort(values_ms[np.isfinite(values_ms)])
    if len(values_ms) == 0:
        return
    frac = np.arange(1, len(values_ms) + 1) / len(values_ms)
    ax.plot(np.maximum(values_ms, 1e-3), frac, drawstyle="steps-post", label=f"{label} (n={len(values_ms):,})")


def latency_cdfs(runs: Mapping[str, tuple[pd.DataFrame, pd.DataFrame]], *, slo_ttft_ms: float | None = None,
                 slo_itl_ms: float | None = None, title: str = "Latency distributions") -> Figure:
    """CDFs of TTFT (per finished request) and ITL (per token gap), ms on log x.

    ``runs`` maps a label to ``(requests, tokens)``.
    """
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.2 + 0.2 * len(runs)), layout="constrained")
    for label, (requests, tokens) in runs.items():
        finished = requests[requests["status"] == "finished"]
        _ecdf(axes[0], finished["ttft_s"].to_numpy(dtype=float) * 1e3, label)
        _ecdf(axes[1], itl_s(tokens) * 1e3, label)
    for ax, name, slo in [(axes[0], "time to first token", slo_ttft_ms), (axes[1], "inter-token latency", slo_itl_ms)]:
        ax.axhline(0.99, color="gray", linestyle=":", linewidth=1, label="p99")
        if slo:
            ax.axvline(slo, color="crimson", linestyle="--", linewidth=1.2, label=f"SLO {slo:g} ms")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction ≤ x")
        ax.set_title(f"CDF of {name}")
        ax.grid(True, which="both", alpha=0.3)
    legend_below(fig, axes[0], ncol=1 if max(map(len, runs), default=0) > 40 else 2)
    fig.suptitle(title, fontsize=13)
    return plain_log_ticks(fig)


def _binned(steps: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """Average the step table into at most MAX_TIMELINE_POINTS time bins (mean per step in a bin)."""
    if len(steps) <= MAX_TIMELINE_POINTS:
        return steps, False
    bins = pd.cut(steps["t_s"], MAX_TIMELINE_POINTS, labels=False)
    return steps.groupby(bins).mean(numeric_only=True), True


def run_timeline(steps: pd.DataFrame, *, replica: int | None = None, title: str = "Run time line") -> Figure:
    """Four panels over simulated time: batch size, running/waiting requests,
    KV-cache use (% of blocks), prefill/decode/pad tokens per step.

    ``replica``: which replica to draw (default: the first in the table).
    """
    if "replica" in steps.columns and len(steps):
        replica = int(steps["replica"].iloc[0]) if replica is None else replica
        steps = steps[steps["replica"] == replica]
        title = f"{title} (replica {replica})" if steps["replica"].nunique() == 1 else title
    data, binned = _binned(steps.sort_values("t_s"))
    t = data["t_s"].to_numpy()
    fig, axes = plt.subplots(4, 1, figsize=(FIG_WIDTH_IN, 9.0), sharex=True, constrained_layout=True)
    axes[0].plot(t, data["batch_size"], drawstyle="steps-post", color="tab:blue")
    axes[0].set_ylabel("batch size\n(requests)")
    axes[1].plot(t, data["num_running"], drawstyle="steps-post", label="running", color="tab:green")
    axes[1].plot(t, data["num_waiting"], drawstyle="steps-post", label="waiting", color="tab:red")
    axes[1].set_ylabel("requests")
    axes[1].legend(fontsize=8, loc="upper left")
    total = data["kv_total_blocks"].replace(0, np.nan)
    axes[2].plot(t, 100.0 * data["kv_used_blocks"] / total, drawstyle="steps-post", color="tab:purple")
    axes[2].set_ylabel("KV cache used\n(% of blocks)")
    axes[2].set_ylim(0, 105)
    for col, color, label in [("num_prefill_tokens", "tab:orange", "prefill"),
                              ("num_decode_tokens", "tab:blue", "decode"), ("num_pad_tokens", "tab:gray", "padding")]:
        if col in data.columns and data[col].any():
            axes[3].plot(t, data[col], drawstyle="steps-post", color=color, label=label, linewidth=1)
    axes[3].set_ylabel("tokens per step")
    axes[3].legend(fontsize=8, loc="upper left")
    axes[3].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    note = " — each point is the mean over the steps of a time bin" if binned else ""
    fig.suptitle(title + note, fontsize=12)
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


def _draw_slots(ax, iv: pd.DataFrame, t_end_s: float) -> str:
    """Draw slot lanes up to ``t_end_s``; return a one-line occupancy summary for the title."""
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
    t0 = float(iv["start_s"].min())
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
                   title: str = "Batch-slot occupancy") -> Figure:
    """One lane chart per run, on a shared time axis: which request occupies each batch slot.

    ``runs`` maps a label to ``(requests, tokens, policy_kind)``; only the
    first replica is drawn. Hatched: scheduled, prefilling (until its first
    token); solid: decoding; dotted grey: slot held by a request that has
    produced all its tokens, until its result returns (static/dynamic batching
    return a batch together). The window ends when the run with the fastest
    turnover has started ``max_requests`` requests.
    """
    intervals = {}
    for label, (requests, tokens, kind) in runs.items():
        if "replica" in requests.columns and len(requests):
            first = requests["replica"].min()
            requests = requests[requests["replica"] == first]
        intervals[label] = slot_intervals(requests, tokens, holds_until_batch_end=kind in BATCH_HOLDING_POLICIES)
    t_end_s = min(_window_end_s(iv, max_requests) for iv in intervals.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(FIG_WIDTH_IN, 2.6 * len(runs) + 1.0), sharex=True,
                             constrained_layout=True, squeeze=False)
    for ax, (label, iv) in zip(axes[:, 0], intervals.items()):
        ax.set_title(f"{label}: {_draw_slots(ax, iv, t_end_s)}", fontsize=10)
    axes[-1, 0].set_xlabel("simulated time (s)")
    handles = [Patch(facecolor="lightsteelblue", hatch="////", edgecolor="black", label="scheduled, prefilling"),
               Patch(facecolor="lightsteelblue", edgecolor="black", label="decoding"),
               Patch(facecolor="whitesmoke", hatch="..", edgecolor="gray",
                     label="done, slot held until its batch returns"),
               Patch(facecolor="white", edgecolor="lightgray", label="empty slot")]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(f"{title} (colour = request)", fontsize=12)
    return fig
