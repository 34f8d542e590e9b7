"""Shared figure machinery (saving, titles, legends, series order and colours) and the plan figures.

Every figure has a title naming what it shows (``describe``), axis labels
with units and a legend outside the data area; latencies use log axes
because they span decades between an idle and a saturated server. Series
follow a fixed order (numbers ascending, other values as first listed) and
series i always gets colour and marker i, so a value keeps its colour in
every figure of a report. Nothing here writes a file except ``save_figure``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter, MaxNLocator, NullLocator  # noqa: E402

from sim.base.atomic import write_atomic  # noqa: E402

FIG_WIDTH_IN = 11.0
DPI = 110
_MARKERS = "osD^vP*Xh<>"
PALETTE = list(plt.get_cmap("tab10").colors) + list(plt.get_cmap("Dark2").colors)
RATE_KEYS = ("arrivals.rate", "arrivals.rate_scale", "arrivals.time_scale")   # shown as the offered rate
REFERENCE = "reference"      # gid of thresholds and guides: listed after the data series in legends
SLO_COLORS = {"ttft": "crimson", "itl": "darkorange", "tpot": "darkorange", "e2el": "purple"}


def save_figure(fig: Figure, stem: Path, *, close: bool = True) -> list[Path]:
    """Write ``stem.png`` and ``stem.svg`` atomically (tmp + rename); return both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "svg"):
        path = stem.with_name(f"{stem.name}.{ext}")
        paths.append(write_atomic(path, lambda tmp: fig.savefig(tmp, format=ext, dpi=DPI, bbox_inches="tight")))
    if close:
        plt.close(fig)
    return paths


class _PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of which ticks to label, written as plain numbers (0.6, 20, 300)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def plain_log_ticks(fig: Figure) -> Figure:
    """Label every log axis of ``fig`` with plain numbers (20, 300, 256) instead of 2x10^1. An axis
    spanning less than a decade gets evenly spaced ticks (9-15 ms would show only 9 and 10: a log
    axis ticks at 1-9 x 10^k)."""
    for ax in fig.axes:
        for axis, scale, limits in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()),
                                    (ax.yaxis, ax.get_yscale(), ax.get_ylim())):
            if scale != "log":
                continue
            base = axis.get_transform().base
            lo, hi = sorted(limits)
            if lo > 0 and hi / lo < base:
                axis.set_major_locator(MaxNLocator(nbins=6))
                axis.set_minor_locator(NullLocator())
                axis.set_major_formatter(FuncFormatter(lambda x, pos: f"{x:g}"))
                continue
            axis.set_major_formatter(_PlainLogFormatter(base=base, labelOnlyBase=False))
            axis.set_minor_formatter(_PlainLogFormatter(base=base, labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    return fig


# ----------------------------------------------------------------------------- what a figure shows

def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


def fmt_value(value: Any) -> str:
    """16.0 -> "16", 0.1 -> "0.1", "vllm" -> "vllm"."""
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.4g}"
    return str(value)


def value_range(values: Iterable[Any]) -> str:
    """Distinct values as text: more than 3 numbers as "lo–hi", else listed (numbers ascending)."""
    distinct = list(dict.fromkeys(v for v in values if not _missing(v)))
    if distinct and all(isinstance(v, (int, float, np.number)) for v in distinct):
        distinct = sorted(distinct)
        if len(distinct) > 3:
            return f"{fmt_value(distinct[0])}–{fmt_value(distinct[-1])}"
    return ", ".join(fmt_value(v) for v in distinct) or "?"


def _hardware(profile: Mapping[str, Any], profile_name: str | None, varied: Mapping[str, Sequence]) -> str:
    """"llama-3.1-8b on h100-sxm, TP 2", or "profile: NAME" for a measured profile file."""
    swept = {k.split(".", 1)[1]: v for k, v in varied.items() if k.startswith("profile.")}
    if swept:
        return "hardware: " + "; ".join(f"{k} {value_range(v)}" for k, v in swept.items())
    if profile.get("path"):
        text = f"profile: {profile_name or Path(str(profile['path'])).stem}"
    else:
        model = profile.get("model", "?")
        model = model.get("name", "custom model") if isinstance(model, Mapping) else model
        text = f"{model} on {profile.get('gpu', '?')}"
    tp = int(profile.get("tensor_parallel") or 1)
    return text + (f", TP {tp}" if tp > 1 else "")


def _policy(policy: Mapping[str, Any], varied: Mapping[str, Sequence]) -> str:
    """"policy sarathi (max_num_seqs=256)"; a swept kind lists the kinds (the legend names their knobs)."""
    swept = {k.split(".", 1)[1]: v for k, v in varied.items() if k.startswith("policy.")}
    if "kind" in swept:
        return "policies " + value_range(swept["kind"])
    fixed = [f"{k}={fmt_value(v)}" for k, v in policy.items() if k != "kind" and not _missing(v) and k not in swept]
    text = f"policy {policy.get('kind', '?')}" + (f" ({', '.join(fixed)})" if fixed else "")
    return "; ".join([text] + [f"{k} {value_range(v)}" for k, v in swept.items()])


def describe(config: Mapping[str, Any], *, profile_name: str | None = None, num_replicas: int = 1,
             rates_rps: Iterable[float] = (), varied: Mapping[str, Sequence] | None = None) -> str:
    """One line naming what a figure shows: workload · model on GPU · replicas · policy · offered rate.

    ``config`` is a run's resolved workload (meta.json "config"); ``varied``
    maps a dotted key to the values it takes among the runs drawn, shown
    instead of the config's value; ``rates_rps`` are the offered (realized)
    rates, one for a run, the swept ones for a sweep.
    """
    varied = {k: v for k, v in (varied or {}).items() if k not in RATE_KEYS}
    parts = [str(config.get("name") or "?"), _hardware(config.get("profile") or {}, profile_name, varied)]
    if num_replicas > 1:
        parts.append(f"{num_replicas} replicas")
    parts.append(_policy(config.get("policy") or {}, varied))
    parts += [f"{k.rsplit('.', 1)[-1]} {value_range(v)}" for k, v in varied.items()
              if not k.startswith(("profile.", "policy."))]
    rates = [r for r in rates_rps if not _missing(r)]
    if rates:
        parts.append(f"offered {value_range([float(f'{r:.3g}') for r in rates])} req/s")
    return " · ".join(parts)


def _wrap_parts(text: str, width: int) -> list[str]:
    """Lines of at most ``width`` characters, broken between the " · " parts of ``describe`` first."""
    lines: list[str] = []
    for part in text.split(" · "):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " · " + part
        else:
            lines.append(part)
    return [piece for line in lines for piece in textwrap.wrap(line, width)]


def set_titles(fig: Figure, title: str, subtitle: str = "", *, fontsize: float = 11.5) -> None:
    """Figure title plus the wrapped lines saying what the data is (``describe``)."""
    width = int(fig.get_figwidth() * 12)
    fig.suptitle("\n".join([title] + (_wrap_parts(subtitle, width) if subtitle else [])), fontsize=fontsize)


# ----------------------------------------------------------------------------- series order, colours, legends

def label_of(values: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``{"policy.kind": "vllm", "policy.max_num_seqs": 64}`` -> ``"vllm, max_num_seqs=64"``."""
    parts = []
    for key in keys:
        short = key.rsplit(".", 1)[-1]
        value = values[key]
        if _missing(value):
            continue                          # the key does not apply here (e.g. a static policy's token budget)
        parts.append(fmt_value(value) if short in ("kind", "gpu", "model", "router") else f"{short}={fmt_value(value)}")
    return ", ".join(parts) if parts else "all runs"


def _column_rank(column: pd.Series):
    """Sort key of one column's values: numbers ascending (missing last), others by first appearance."""
    if pd.api.types.is_numeric_dtype(column):
        return lambda v: (1, 0.0) if _missing(v) else (0, float(v))
    first = {("<missing>" if _missing(v) else v): i for i, v in reversed(list(enumerate(column)))}
    return lambda v: (0, first["<missing>" if _missing(v) else v])


def ordered_groups(table: pd.DataFrame, group_cols: Sequence[str]) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(values, rows) per distinct combination of ``group_cols``, in series order (see module doc)."""
    if not group_cols:
        return [({}, table)]
    ranks = [_column_rank(table[c]) for c in group_cols]
    groups = []
    for key, sub in table.groupby(list(group_cols), sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        groups.append((dict(zip(group_cols, key)), sub))
    return sorted(groups, key=lambda g: tuple(rank(g[0][c]) for rank, c in zip(ranks, group_cols)))


def series_label(values: Mapping[str, Any], group_cols: Sequence[str]) -> str:
    """The legend entry: the bare value for one key (the legend title names it), else ``label_of``."""
    if len(group_cols) == 1:
        return fmt_value(values[group_cols[0]])
    return label_of(values, group_cols)


def series_style(i: int) -> dict[str, Any]:
    return {"color": PALETTE[i % len(PALETTE)], "marker": _MARKERS[i % len(_MARKERS)]}


def series_colors(table: pd.DataFrame, group_cols: Sequence[str]) -> dict[str, Any]:
    """``label_of`` text -> colour of each series, as the sweep figures colour it (for the run figures)."""
    return {label_of(values, group_cols): series_style(i)["color"]
            for i, (values, _) in enumerate(ordered_groups(table, group_cols))}


def legend_title(group_cols: Sequence[str]) -> str | None:
    """"rate (req/s)", "max_num_batched_tokens", or the section ("policy") when every key is in one."""
    sections = {c.rsplit(".", 1)[0] for c in group_cols if "." in c}
    if len(group_cols) > 1 and len(sections) == 1 and all("." in c for c in group_cols):
        return sections.pop()
    return ", ".join("rate (req/s)" if c == "arrivals.rate" else c.rsplit(".", 1)[-1] for c in group_cols) or None


def slo_line(ax, value_ms: float | None, metric: str, *, vertical: bool = False) -> None:
    """A dashed line at an SLO threshold, labelled "TTFT SLO 2000 ms"."""
    if value_ms:
        draw = ax.axvline if vertical else ax.axhline
        draw(value_ms, color=SLO_COLORS.get(metric, "crimson"), linestyle="--", linewidth=1.2,
             label=f"{metric.upper()} SLO {value_ms:g} ms", gid=REFERENCE)


def legend_outside(fig: Figure, *, title: str | None = None, ncol: int | None = None) -> None:
    """One legend under the panels for every labelled artist of every axis (data series, then
    artists with gid ``REFERENCE``; each label once), so no legend covers data."""
    series: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if not label.startswith("_"):
                is_ref = getattr(handle, "get_gid", lambda: None)() == REFERENCE      # containers have no gid
                (refs if is_ref else series).setdefault(label, handle)
    entries = {**series, **{k: v for k, v in refs.items() if k not in series}}
    if not entries:
        return
    longest = max(map(len, entries)) + (len(title) // 3 if title else 0)
    ncol = ncol or max(1, min(len(entries), int(fig.get_figwidth() * 13) // (longest + 6)))
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncol=ncol, fontsize=8,
               title=title, title_fontsize=8)


# ----------------------------------------------------------------------------- plan figures

def capacity_bars(ranked: pd.DataFrame, *, target_rate: float, subtitle: str = "") -> Figure:
    """Per candidate: capacity of one replica (req/s), replicas needed, and cost per hour ($).

    ``ranked`` needs columns candidate, capacity_rps, replicas, cost_per_hour,
    meets_slo (bool, from the fleet check).
    """
    n = len(ranked)
    fig, axes = plt.subplots(1, 3, figsize=(FIG_WIDTH_IN, 0.45 * n + 2.4), layout="constrained", sharey=True)
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
    set_titles(fig, "Candidates, cheapest first (green: fleet verified within SLO)", subtitle)
    return plain_log_ticks(fig)


def search_curves(evals: pd.DataFrame, *, slo_ttft_ms: float | None, slo_itl_ms: float | None,
                  slo_tpot_ms: float | None = None, subtitle: str = "") -> Figure:
    """p99 TTFT and p99 ITL (ms, log) against offered rate for every rate the bisection tried.

    ``evals`` needs candidate, rate_rps, passed, p99_ttft_ms, p99_itl_ms.
    Filled markers passed every check, hollow ones failed one (SLO or stability).
    """
    second = ("p99_tpot_ms", "p99 TPOT (ms)", "tpot", slo_tpot_ms) if slo_tpot_ms and not slo_itl_ms else \
        ("p99_itl_ms", "p99 ITL (ms)", "itl", slo_itl_ms)
    num_rows = (evals["candidate"].nunique() + 2) // 2
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.4 + 0.2 * num_rows), layout="constrained")
    for ax, (metric, ylabel, name, slo) in zip(axes, [("p99_ttft_ms", "p99 TTFT (ms)", "ttft", slo_ttft_ms), second]):
        for i, (values, sub) in enumerate(ordered_groups(evals, ["candidate"])):
            sub = sub.sort_values("rate_rps")
            style = series_style(i)
            ax.plot(sub["rate_rps"], sub[metric], linewidth=1, alpha=0.8, label=values["candidate"],
                    markersize=5.5, markerfacecolor="none", **style)               # every trial hollow ...
            ok = sub["passed"].astype(bool)
            ax.scatter(sub.loc[ok, "rate_rps"], sub.loc[ok, metric], marker=style["marker"], color=style["color"],
                       s=28)                                                       # ... passes filled
        slo_line(ax, slo, name)
        ax.set_xscale("log")
        rates = pd.to_numeric(evals["rate_rps"], errors="coerce")
        if (rates > 0).any():              # from the rates tried, even where no latency was measured
            ax.set_xlim(rates[rates > 0].min() / 1.3, rates.max() * 1.3)
        if (pd.to_numeric(evals[metric], errors="coerce") > 0).any():
            ax.set_yscale("log")
        else:                              # every request refused (or no token gap): nothing measured
            ax.text(0.5, 0.75, "nothing measured: no request completed\nat any rate tried (all refused?)",
                    transform=ax.transAxes, ha="center", va="center", color="0.3",
                    bbox={"facecolor": "white", "edgecolor": "0.7", "boxstyle": "round"})
        ax.set_xlabel("offered rate, one replica (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    legend_outside(fig)
    set_titles(fig, "Capacity search: every rate tried (hollow = failed SLO or unstable)", subtitle)
    return plain_log_ticks(fig)


def replica_balance(replicas: pd.DataFrame, *, title: str, subtitle: str = "") -> Figure:
    """Per-replica completed requests, output throughput and p99 TTFT of a fleet run.

    ``replicas`` needs replica, completed, output_throughput, p99_ttft_ms.
    """
    fig, axes = plt.subplots(1, 3, figsize=(FIG_WIDTH_IN, 3.6), layout="constrained")
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
    set_titles(fig, title, subtitle)
    return plain_log_ticks(fig)
