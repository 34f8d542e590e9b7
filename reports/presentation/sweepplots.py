"""Figures of sweep tables: latency against throughput, the token-budget knee, metrics
against a knob, and the Pareto plot of tokens/s per user against tokens/s per GPU.

Inputs are results.csv rows (one per run) or the tables of ``reports.experiments.knee``;
``limits`` maps a p99 column to its SLO threshold in ms (``knee.slo_limits``).
"""

from __future__ import annotations

import textwrap
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from reports.experiments.knee import PER_GPU, PER_USER, RULE, budget_range
from reports.presentation.plots import (FIG_WIDTH_IN, RATE_KEYS, REFERENCE, fmt_value, label_of, legend_outside, legend_title,
                           ordered_groups, plain_log_ticks, plt, series_label, series_style, set_titles, slo_line)

METRIC_LABELS = {"p99_ttft_ms": "p99 TTFT (ms)", "p99_itl_ms": "p99 ITL (ms)", "p99_tpot_ms": "p99 TPOT (ms)",
                 "p99_e2el_ms": "p99 end-to-end latency (ms)", "output_throughput": "output throughput (tokens/s)"}


def decode_metric(limits: Mapping[str, float]) -> str:
    """The decode-latency column to draw: p99 TPOT when the SLO bounds TPOT but not ITL, else p99 ITL."""
    return "p99_tpot_ms" if "p99_tpot_ms" in limits and "p99_itl_ms" not in limits else "p99_itl_ms"


def _slo_name(metric: str) -> str:
    return metric.split("_")[1]                                  # p99_ttft_ms -> ttft


def _mean_over_reps(sub: pd.DataFrame, by: str, cols: Sequence[str]) -> pd.DataFrame:
    """Mean, min and max of ``cols`` over repetitions at each value of ``by``, sorted by ``by``."""
    return sub.groupby(by, sort=True)[list(cols)].agg(["mean", "min", "max"])


def latency_throughput(table: pd.DataFrame, *, rate_col: str, group_cols: Sequence[str],
                       limits: Mapping[str, float] | None = None, subtitle: str = "") -> Figure:
    """p99 TTFT and p99 ITL (or TPOT, see ``decode_metric``), ms on log y, against achieved output throughput.

    One line per combination of ``group_cols``; points follow ``rate_col``
    (the offered load) upwards; repetitions are averaged, whiskers show their
    range. A curve bending up vertically is the saturation knee.
    """
    limits = limits or {}
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.8), layout="constrained")
    for ax, metric in zip(axes, ["p99_ttft_ms", decode_metric(limits)]):
        for i, (values, sub) in enumerate(ordered_groups(table, group_cols)):
            agg = _mean_over_reps(sub, rate_col, ["output_throughput", metric])
            x, y = agg[("output_throughput", "mean")], agg[(metric, "mean")]
            yerr = np.vstack([y - agg[(metric, "min")], agg[(metric, "max")] - y])
            ax.errorbar(x, y, yerr=yerr if yerr.any() else None, markersize=5, capsize=2,
                        label=series_label(values, group_cols), **series_style(i))
        slo_line(ax, limits.get(metric), _slo_name(metric))
        ax.set_yscale("log")
        ax.set_xlabel("achieved output throughput (tokens/s)")
        ax.set_ylabel(METRIC_LABELS[metric])
        ax.set_title(METRIC_LABELS[metric].split(" (")[0] + f" as {rate_col.rsplit('.', 1)[-1]} rises", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    legend_outside(fig, title=legend_title(group_cols))
    set_titles(fig, "Latency vs achieved throughput", subtitle)
    return plain_log_ticks(fig)


def _shade_within(ax, x_limit: float | None, y_limit: float | None) -> None:
    """Tint the region where both drawn metrics meet their SLO (below/left of the lines)."""
    if not (x_limit or y_limit):
        return
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    xr, yr = min(x_limit or x1, x1), min(y_limit or y1, y1)
    if xr > x0 and yr > y0:
        ax.add_patch(Rectangle((x0, y0), xr - x0, yr - y0, facecolor="tab:green", alpha=0.08, zorder=0,
                               label="meets both SLOs drawn", gid=REFERENCE))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)


def ttft_itl_tradeoff(table: pd.DataFrame, *, budget_col: str, group_cols: Sequence[str],
                      limits: Mapping[str, float] | None = None, rate_col: str | None = None,
                      recommended: Mapping[float, float] | None = None, knee_rate: float | None = None,
                      subtitle: str = "") -> Figure:
    """p99 TTFT (y) against p99 ITL or TPOT (x), both ms and log, one point per budget value.

    Each line joins the budgets of one group (e.g. one offered rate); points
    are annotated with the budget. Small budgets sit left/up (short stalls,
    slow prefill), large ones right/down. SLO lines bound the tinted region
    that meets them; a star marks ``recommended[rate]`` on the line of that
    ``rate_col`` value, and the star at ``knee_rate`` is labelled as the knee.
    """
    limits, recommended = limits or {}, recommended or {}
    x_metric = decode_metric(limits)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN * 0.8, 6.4), layout="constrained")
    for i, (values, sub) in enumerate(ordered_groups(table, group_cols)):
        agg = _mean_over_reps(sub, budget_col, [x_metric, "p99_ttft_ms"])
        x, y = agg[(x_metric, "mean")], agg[("p99_ttft_ms", "mean")]
        style = series_style(i)
        ax.plot(x, y, label=series_label(values, group_cols), **style)
        for budget, xi, yi in zip(agg.index, x, y):
            ax.annotate(fmt_value(budget), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=style["color"])
        best = recommended.get(values.get(rate_col)) if rate_col else None
        if best is not None and best in agg.index:
            ax.scatter([x[best]], [y[best]], marker="*", s=260, facecolor=style["color"], edgecolor="black",
                       zorder=5)
            if values.get(rate_col) == knee_rate:
                unit = " req/s" if rate_col == "arrivals.rate" else ""
                ax.annotate(f"knee: {fmt_value(best)} at {fmt_value(knee_rate)}{unit}", (x[best], y[best]),
                            xytext=(-30, -45), textcoords="offset points", ha="right", fontsize=9, fontweight="bold",
                            arrowprops={"arrowstyle": "->", "color": "black"})
    if recommended:
        ax.scatter([], [], marker="*", s=160, facecolor="white", edgecolor="black",
                   label="recommended budget at that rate", gid=REFERENCE)
    slo_line(ax, limits.get("p99_ttft_ms"), "ttft")
    slo_line(ax, limits.get(x_metric), _slo_name(x_metric), vertical=True)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _shade_within(ax, limits.get(x_metric), limits.get("p99_ttft_ms"))
    ax.set_xlabel(f"{METRIC_LABELS[x_metric].replace('ITL', 'inter-token latency')}")
    ax.set_ylabel("p99 time to first token (ms)")
    ax.grid(True, which="both", alpha=0.3)
    legend_outside(fig, title=legend_title(group_cols))
    set_titles(fig, f"TTFT vs {_slo_name(x_metric).upper()} across {budget_col.rsplit('.', 1)[-1]} "
                    f"(point labels)", subtitle)
    return plain_log_ticks(fig)


def knee_grid(cells: pd.DataFrame, knee: pd.DataFrame, *, budget_col: str, rate_col: str,
              limits: Mapping[str, float], headline: str, subtitle: str = "") -> Figure:
    """Budget (columns) x rate (rows): green cells meet every SLO threshold, red ones miss one;
    each cell prints the limited p99s; a thick frame marks the recommended budget of each rate
    (``knee.RULE``); the right margin names each rate's budget range."""
    budgets = sorted(cells[budget_col].unique())
    rates = sorted(cells[rate_col].unique())
    metrics = list(limits) or ["p99_ttft_ms"]
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 1.0 + 0.62 * len(rates) * max(1, len(metrics) / 1.5) + 1.2),
                           layout="constrained")
    rec = dict(zip(knee["rate"], knee["recommended"]))
    for cell in cells.to_dict("records"):
        col, row = budgets.index(cell[budget_col]), rates.index(cell[rate_col])
        best = rec.get(cell[rate_col]) == cell[budget_col]
        ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, facecolor="#c7e9c0" if cell["meets"] else "#fcd5ce",
                               edgecolor="black" if best else "white", linewidth=3 if best else 1,
                               zorder=2 if best else 1))
        lines = [f"{_slo_name(m).upper()} {_ms(cell[m])}" for m in metrics]
        ax.text(col, row, ("★ " if best else "") + "\n".join(lines), ha="center", va="center", fontsize=7.5)
    ax.set_xlim(-0.5, len(budgets) - 0.5)
    ax.set_ylim(len(rates) - 0.5, -0.5)
    ax.set_xticks(range(len(budgets)), [fmt_value(b) for b in budgets])
    ax.set_yticks(range(len(rates)), [fmt_value(r) for r in rates])
    ax.set_xlabel(budget_col)
    ax.set_ylabel("offered rate, arrivals.rate (req/s)" if rate_col == "arrivals.rate" else rate_col)
    right = ax.secondary_yaxis("right")
    right.set_yticks(range(len(rates)), [_row_note(k) for k in knee.sort_values("rate").itertuples(index=False)],
                     fontsize=8)
    ax.tick_params(length=0)
    limit_text = ", ".join(f"{METRIC_LABELS[m].split(' (')[0]} ≤ {v:g} ms" for m, v in limits.items())
    handles = [Patch(facecolor="#c7e9c0", label=f"meets the SLO ({limit_text})"),
               Patch(facecolor="#fcd5ce", label="misses it"),
               Patch(facecolor="white", edgecolor="black", linewidth=3, label="★ recommended: " + RULE)]
    fig.legend(handles=handles, loc="outside lower center", ncol=1, fontsize=8)
    set_titles(fig, headline, subtitle)
    return fig


def _ms(value: float) -> str:
    return f"{value / 1000:.3g} s" if value >= 1000 else f"{value:.3g} ms"


def _row_note(row: Any) -> str:
    return f"meets: {budget_range(row.meeting, row.budgets)}" + (
        f"; best {fmt_value(row.recommended)}" if row.meeting else "")


def point_label(row: Mapping[str, Any], cols: Sequence[str]) -> str:
    """Compact knob values of one grid point: "1024 @ 16 req/s", "sarathi, max_num_batched_tokens=512 @ 2 req/s"."""
    others = [c for c in cols if c not in RATE_KEYS]
    head = fmt_value(row[others[0]]) if len(others) == 1 else (label_of(row, others) if others else "")
    rates = [f"{row[c]:g} req/s" if c == "arrivals.rate" else f"{c.rsplit('.', 1)[-1]} {row[c]:g}"
             for c in cols if c in RATE_KEYS]
    return " @ ".join(p for p in [head, *rates] if p)


def metric_vs_param(table: pd.DataFrame, *, param_col: str, group_cols: Sequence[str],
                    metrics: Sequence[str] = ("p99_ttft_ms", "p99_itl_ms", "output_throughput"),
                    limits: Mapping[str, float] | None = None, subtitle: str = "") -> Figure:
    """One panel per metric against ``param_col`` (log2 x when the values are powers of two),
    with the SLO threshold of each limited metric."""
    limits = limits or {}
    fig, axes = plt.subplots(1, len(metrics), figsize=(FIG_WIDTH_IN, 4.6), layout="constrained", squeeze=False)
    values = pd.to_numeric(table[param_col], errors="coerce").dropna()
    log2 = len(values) > 0 and bool((values > 0).all()) and values.nunique() > 2 and values.max() / values.min() >= 8
    for ax, metric in zip(axes[0], metrics):
        for i, (key, sub) in enumerate(ordered_groups(table, group_cols)):
            agg = _mean_over_reps(sub, param_col, [metric])
            ax.plot(agg.index, agg[(metric, "mean")], label=series_label(key, group_cols), **series_style(i))
        slo_line(ax, limits.get(metric), _slo_name(metric))
        if log2:
            ax.set_xscale("log", base=2)
        if metric.endswith("_ms"):
            ax.set_yscale("log")
        ax.set_xlabel(param_col.rsplit(".", 1)[-1])
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.grid(True, which="both", alpha=0.3)
    legend_outside(fig, title=legend_title(group_cols))
    set_titles(fig, f"Metrics vs {param_col.rsplit('.', 1)[-1]}", subtitle)
    return plain_log_ticks(fig)


def pareto(points: pd.DataFrame, frontier: pd.DataFrame, *, group_cols: Sequence[str], label_cols: Sequence[str],
           meets: pd.Series | None = None, subtitle: str = "") -> Figure:
    """Output tokens/s per user (y) against output tokens/s per GPU (x), one point per grid point.

    Points are coloured by ``group_cols`` (as in the other sweep figures);
    hollow ones miss the SLO (``meets`` False). The frontier is a step line:
    left of each frontier point its per-user speed is attainable. Frontier
    points are labelled with their ``label_cols`` values.
    """
    fig, (ax, key) = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 6.4), layout="constrained",
                                  gridspec_kw={"width_ratios": [3.2, 1]})
    meets = meets if meets is not None else pd.Series(True, index=points.index)
    for i, (values, sub) in enumerate(ordered_groups(points, group_cols)):
        style = series_style(i)
        ok = meets.loc[sub.index].astype(bool)
        ax.scatter(sub[PER_GPU], sub[PER_USER], marker=style["marker"], s=36, facecolor="none",
                   edgecolor=style["color"])
        ax.scatter(sub.loc[ok, PER_GPU], sub.loc[ok, PER_USER], marker=style["marker"], s=36, color=style["color"],
                   label=series_label(values, group_cols) if group_cols else "runs")
    ax.plot(frontier[PER_GPU], frontier[PER_USER], drawstyle="steps-pre", color="black", linewidth=1.2,
            label="Pareto frontier (numbered)", gid=REFERENCE)
    lines = []
    for k, row in enumerate(frontier.to_dict("records"), start=1):
        ax.annotate(str(k), (row[PER_GPU], row[PER_USER]), textcoords="offset points", xytext=(5, 4), fontsize=8,
                    fontweight="bold")
        lines += textwrap.wrap(f"{k}. {point_label(row, label_cols)}: {row[PER_GPU]:,.0f} | {row[PER_USER]:.1f}",
                               46, subsequent_indent="     ")
    others = [c for c in label_cols if c not in RATE_KEYS]
    what = others[0].rsplit(".", 1)[-1] if len(others) == 1 else "configuration"
    key.axis("off")
    key.set_title(f"frontier points:\n{what} @ rate:\ntokens/s per GPU | per user", fontsize=8, loc="left")
    key.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=7.5, transform=key.transAxes)
    if not meets.all():
        ax.scatter([], [], marker="o", facecolor="none", edgecolor="gray", label="hollow: misses the SLO",
                   gid=REFERENCE)
    ax.set_xlabel("output tokens/s per GPU (output throughput / (replicas × tensor parallel))")
    ax.set_ylabel("output tokens/s per user (1000 / mean TPOT ms)")
    ax.margins(x=0.12, y=0.1)
    ax.grid(True, alpha=0.3)
    legend_outside(fig, title=legend_title(group_cols))
    set_titles(fig, "Pareto: per-user decode speed vs per-GPU throughput", subtitle)
    return fig
