"""Figures from sweep and plan tables: functions take DataFrames, return Figures.

Every figure has a title, axis labels with units and a legend; latencies use
log axes because they span decades between an idle and a saturated server.
Nothing here writes a file except ``save_figure``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402

FIG_WIDTH_IN = 11.0
DPI = 110
_MARKERS = "osD^vP*Xh<>"


def save_figure(fig: Figure, stem: Path, *, close: bool = True) -> list[Path]:
    """Write ``stem.png`` and ``stem.svg`` atomically (tmp + rename); return both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "svg"):
        path = stem.with_name(f"{stem.name}.{ext}")
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, format=ext, dpi=DPI, bbox_inches="tight")
        os.replace(tmp, path)
        paths.append(path)
    if close:
        plt.close(fig)
    return paths


class _PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of which ticks to label, written as plain numbers (0.6, 20, 300)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def plain_log_ticks(fig: Figure) -> Figure:
    """Label every log axis of ``fig`` with plain numbers (20, 300, 256) instead of 2x10^1."""
    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                base = axis.get_transform().base
                axis.set_major_formatter(_PlainLogFormatter(base=base, labelOnlyBase=False))
                axis.set_minor_formatter(_PlainLogFormatter(base=base, labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    return fig


def label_of(values: dict, keys: Sequence[str]) -> str:
    """``{"policy.kind": "vllm", "policy.max_num_seqs": 64}`` -> ``"vllm, max_num_seqs=64"``."""
    parts = []
    for key in keys:
        short = key.rsplit(".", 1)[-1]
        value = values[key]
        if value is None or (isinstance(value, float) and np.isnan(value)):
            continue                          # the key does not apply here (e.g. a static policy's token budget)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        parts.append(str(value) if short in ("kind", "gpu", "model", "router") else f"{short}={value}")
    return ", ".join(parts) if parts else "all runs"


def _groups(table: pd.DataFrame, group_cols: Sequence[str]):
    """Yield (label, sub-table) per distinct combination of ``group_cols``, in table order."""
    if not group_cols:
        yield "all runs", table
        return
    for key, sub in table.groupby(list(group_cols), sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        if len(group_cols) == 1:             # the legend title names the key; the label is the value
            value = key[0]
            yield (f"{int(value)}" if isinstance(value, float) and value.is_integer() else str(value)), sub
        else:
            yield label_of(dict(zip(group_cols, key)), group_cols), sub


def _mean_over_reps(sub: pd.DataFrame, by: str, cols: Sequence[str]) -> pd.DataFrame:
    """Mean, min and max of ``cols`` over repetitions at each value of ``by``, sorted by ``by``."""
    agg = sub.groupby(by, sort=True)[list(cols)].agg(["mean", "min", "max"])
    return agg


def legend_title(group_cols: Sequence[str]) -> str | None:
    return ", ".join(c.rsplit(".", 1)[-1] for c in group_cols) or None


def _slo_line(ax, value_ms: float | None, label: str) -> None:
    if value_ms:
        ax.axhline(value_ms, color="crimson", linestyle="--", linewidth=1.2, label=label)


def legend_below(fig: Figure, ax, *, exclude: Sequence[str] = ("SLO", "p99"), ncol: int = 2) -> None:
    """Series legend under the panels (long labels would hide the data); reference lines keep
    a small legend on each axis."""
    handles, labels = ax.get_legend_handles_labels()
    series = [(h, lab) for h, lab in zip(handles, labels) if not lab.startswith(tuple(exclude))]
    fig.legend([h for h, _ in series], [lab for _, lab in series], loc="outside lower center", ncol=ncol, fontsize=8)
    for a in fig.axes:
        refs = [(h, lab) for h, lab in zip(*a.get_legend_handles_labels()) if lab.startswith(tuple(exclude))]
        if refs:
            a.legend([h for h, _ in refs], [lab for _, lab in refs], fontsize=8, loc="upper left")


def latency_throughput(table: pd.DataFrame, *, rate_col: str, group_cols: Sequence[str],
                       slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None,
                       title: str = "Latency vs achieved throughput") -> Figure:
    """p99 TTFT and p99 ITL (ms, log) against achieved output throughput (tok/s).

    One line per combination of ``group_cols``; points follow ``rate_col``
    (the offered load) upwards; repetitions are averaged, whiskers show their
    range. A curve bending up vertically is the saturation knee.
    """
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.4), constrained_layout=True)
    metrics = [("p99_ttft_ms", "p99 TTFT (ms)", slo_ttft_ms), ("p99_itl_ms", "p99 ITL (ms)", slo_itl_ms)]
    for ax, (metric, ylabel, slo) in zip(axes, metrics):
        for i, (label, sub) in enumerate(_groups(table, group_cols)):
            agg = _mean_over_reps(sub, rate_col, ["output_throughput", metric])
            x, y = agg[("output_throughput", "mean")], agg[(metric, "mean")]
            yerr = np.vstack([y - agg[(metric, "min")], agg[(metric, "max")] - y])
            ax.errorbar(x, y, yerr=yerr if yerr.any() else None, marker=_MARKERS[i % len(_MARKERS)],
                        markersize=5, capsize=2, label=label)
        _slo_line(ax, slo, f"SLO {slo:g} ms" if slo else "")
        ax.set_yscale("log")
        ax.set_xlabel("achieved output throughput (tokens/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel.split(" (")[0] + f" as {rate_col.rsplit('.', 1)[-1]} rises")
        ax.grid(True, which="both", alpha=0.3)
    if len(group_cols) > 1 or len(axes[0].get_lines()) > 4:
        legend_below(fig, axes[0], ncol=3)       # many or long labels would hide the curves
    else:
        axes[0].legend(fontsize=8, title=legend_title(group_cols), title_fontsize=8)
    fig.suptitle(title, fontsize=13)
    return plain_log_ticks(fig)


def ttft_itl_tradeoff(table: pd.DataFrame, *, budget_col: str, group_cols: Sequence[str],
                      slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None,
                      title: str = "TTFT vs ITL trade-off across the token budget") -> Figure:
    """p99 TTFT (y) against p99 ITL (x), both ms and log, one point per budget value.

    Each line joins the budgets of one group (e.g. one offered rate); points are
    annotated with the budget. Small budgets sit left/up (short stalls, slow
    prefill), large ones right/down; the knee is where the line turns.
    """
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN * 0.75, 5.2), constrained_layout=True)
    for i, (label, sub) in enumerate(_groups(table, group_cols)):
        agg = _mean_over_reps(sub, budget_col, ["p99_itl_ms", "p99_ttft_ms"])
        x, y = agg[("p99_itl_ms", "mean")], agg[("p99_ttft_ms", "mean")]
        line, = ax.plot(x, y, marker=_MARKERS[i % len(_MARKERS)], label=label)
        for budget, xi, yi in zip(agg.index, x, y):
            ax.annotate(f"{budget:g}" if isinstance(budget, (int, float)) else str(budget), (xi, yi),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
    if slo_ttft_ms:
        ax.axhline(slo_ttft_ms, color="crimson", linestyle="--", linewidth=1.2, label=f"TTFT SLO {slo_ttft_ms:g} ms")
    if slo_itl_ms:
        ax.axvline(slo_itl_ms, color="darkorange", linestyle="--", linewidth=1.2, label=f"ITL SLO {slo_itl_ms:g} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("p99 inter-token latency (ms)")
    ax.set_ylabel("p99 time to first token (ms)")
    ax.set_title(f"{title}\n(labels: {budget_col.rsplit('.', 1)[-1]})", fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title=legend_title(group_cols), title_fontsize=8)
    return plain_log_ticks(fig)


def metric_vs_param(table: pd.DataFrame, *, param_col: str, group_cols: Sequence[str],
                    metrics: Sequence[tuple[str, str]] = (("p99_ttft_ms", "p99 TTFT (ms)"),
                                                          ("p99_itl_ms", "p99 ITL (ms)"),
                                                          ("output_throughput", "output throughput (tokens/s)")),
                    title: str | None = None) -> Figure:
    """One panel per metric against ``param_col`` (log2 x when the values are powers of two)."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(FIG_WIDTH_IN, 4.0), constrained_layout=True, squeeze=False)
    values = pd.to_numeric(table[param_col], errors="coerce").dropna()
    log2 = len(values) > 0 and bool((values > 0).all()) and values.nunique() > 2 and values.max() / values.min() >= 8
    for ax, (metric, ylabel) in zip(axes[0], metrics):
        for i, (label, sub) in enumerate(_groups(table, group_cols)):
            agg = _mean_over_reps(sub, param_col, [metric])
            ax.plot(agg.index, agg[(metric, "mean")], marker=_MARKERS[i % len(_MARKERS)], label=label)
        if log2:
            ax.set_xscale("log", base=2)
        if metric.endswith("_ms"):
            ax.set_yscale("log")
        ax.set_xlabel(param_col.rsplit(".", 1)[-1])
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8, title=legend_title(group_cols), title_fontsize=8)
    fig.suptitle(title or f"Metrics vs {param_col.rsplit('.', 1)[-1]}", fontsize=13)
    return plain_log_ticks(fig)


def capacity_bars(ranked: pd.DataFrame, *, target_rate: float) -> Figure:
    """Per candidate: capacity of one replica (req/s), replicas needed, and cost per hour ($).

    ``ranked`` needs columns candidate, capacity_rps, replicas, cost_per_hour,
    meets_slo (bool, from the fleet check).
    """
    n = len(ranked)
    fig, axes = plt.subplots(1, 3, figsize=(FIG_WIDTH_IN, 0.45 * n + 2.2), constrained_layout=True, sharey=True)
    y = np.arange(n)
    colors = ["tab:green" if ok else "tab:gray" for ok in ranked["meets_slo"]]
    panels = [("capacity_rps", "capacity of one replica (req/s)"), ("replicas", f"replicas for {target_rate:g} req/s"),
              ("cost_per_hour", "fleet cost ($/hour)")]
    for ax, (col, xlabel) in zip(axes, panels):
        vals = pd.to_numeric(ranked[col], errors="coerce").fillna(0.0)
        ax.barh(y, vals, color=colors)
        for yi, v in zip(y, vals):
            ax.annotate(f"{v:,.1f}" if col != "replicas" else f"{v:.0f}", (v, yi), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.grid(True, axis="x", alpha=0.3)
        ax.margins(x=0.18)
    axes[0].set_yticks(y, ranked["candidate"], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("Candidates, cheapest first (green: fleet verified within SLO)", fontsize=12)
    return plain_log_ticks(fig)


def search_curves(evals: pd.DataFrame, *, slo_ttft_ms: float | None, slo_itl_ms: float | None,
                  slo_tpot_ms: float | None = None) -> Figure:
    """p99 TTFT and p99 ITL (ms, log) against offered rate for every rate the bisection tried.

    ``evals`` needs candidate, rate_rps, passed, p99_ttft_ms, p99_itl_ms.
    Filled markers passed every check, hollow ones failed one (SLO or stability).
    """
    second = ("p99_tpot_ms", "p99 TPOT (ms)", slo_tpot_ms) if slo_tpot_ms and not slo_itl_ms else \
        ("p99_itl_ms", "p99 ITL (ms)", slo_itl_ms)
    num_rows = (evals["candidate"].nunique() + 2) // 2
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.2 + 0.2 * num_rows), layout="constrained")
    for ax, (metric, ylabel, slo) in zip(axes, [("p99_ttft_ms", "p99 TTFT (ms)", slo_ttft_ms), second]):
        for i, (name, sub) in enumerate(evals.groupby("candidate", sort=False)):
            sub = sub.sort_values("rate_rps")
            m = _MARKERS[i % len(_MARKERS)]
            line, = ax.plot(sub["rate_rps"], sub[metric], linewidth=1, alpha=0.8, label=name, marker=m,
                            markersize=5.5, markerfacecolor="none")       # every trial hollow ...
            ok = sub["passed"].astype(bool)
            ax.scatter(sub.loc[ok, "rate_rps"], sub.loc[ok, metric], marker=m, color=line.get_color(),
                       s=28)                                             # ... passes filled
        _slo_line(ax, slo, f"SLO {slo:g} ms" if slo else "")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered rate, one replica (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    legend_below(fig, axes[0])
    fig.suptitle("Capacity search: every rate tried (hollow = failed SLO or unstable)", fontsize=12)
    return plain_log_ticks(fig)


def replica_balance(replicas: pd.DataFrame, *, title: str) -> Figure:
    """Per-replica completed requests, output throughput and p99 TTFT of a fleet run.

    ``replicas`` needs replica, completed, output_throughput, p99_ttft_ms.
    """
    fig, axes = plt.subplots(1, 3, figsize=(FIG_WIDTH_IN, 3.4), constrained_layout=True)
    panels = [("completed", "completed requests"), ("output_throughput", "output throughput (tokens/s)"),
              ("p99_ttft_ms", "p99 TTFT (ms)")]
    x = replicas["replica"].astype(str)
    for ax, (col, ylabel) in zip(axes, panels):
        ax.bar(x, pd.to_numeric(replicas[col], errors="coerce"), color="tab:blue")
        ax.set_xlabel("replica")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        if len(x) > 16:
            ax.tick_params(axis="x", labelsize=6, rotation=90)
    fig.suptitle(title, fontsize=12)
    return plain_log_ticks(fig)
