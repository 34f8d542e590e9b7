"""The sweep report: tables and figures chosen from what the grid varies, the knee of a
token-budget sweep and the Pareto plot (``sim report`` on a directory with results.csv)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from reports.experiments import knee

from reports.presentation import plots, sweepplots
from reports.presentation.render import Bullets, Callout, Document, Heading, Image, Para, Table, write_document
from reports.presentation.runreport import KEY_METRICS, Figures, read_runs, run_figures
from reports.experiments.spec import flatten
from sim.run.config import ConfigError

RATE_COLUMNS = ("arrivals.rate", "arrivals.rate_scale")
BUDGET_COLUMN = "policy.max_num_batched_tokens"
MAX_TABLE_ROWS = 200
MAX_COMPARED_RUNS = 6


def nonconstant(table: pd.DataFrame, cols: list[str]) -> list[str]:
    return [c for c in cols if c in table.columns and table[c].nunique(dropna=False) > 1]


def in_sweep_order(table: pd.DataFrame, grid: list[str], vary: dict[str, list[Any]]) -> pd.DataFrame:
    """Rows sorted by the grid columns: numbers ascending, other values in the order the sweep file
    lists them (workers append rows as they finish, so the table's own order changes run to run)."""
    listed: dict[str, list[Any]] = {}
    for key, values in vary.items():
        for value in values:
            for col, v in flatten(key, value).items():
                listed.setdefault(col, [])
                if v not in listed[col]:
                    listed[col].append(v)
    keys = {}
    for i, col in enumerate(grid):
        order = listed.get(col, [])
        numeric = pd.api.types.is_numeric_dtype(table[col])
        keys[f"_key{i}"] = table[col] if numeric else table[col].map(
            lambda v, o=order: o.index(v) if v in o else len(o))
    return table.assign(**keys).sort_values(list(keys), kind="stable", na_position="last").drop(columns=list(keys))


def _sweep_config(d: Path, meta: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The sweep's workload (resolved config, profile name): from a saved run, else rebuilt from the sweep file."""
    for path in sorted((d / "runs").glob("*/meta.json")):
        run_meta = json.loads(path.read_text())
        return run_meta.get("config", {}), run_meta.get("profile_name")
    from reports.experiments.spec import parse_sweep
    from sim.run.config import workload_from_dict
    try:
        spec = parse_sweep(meta["source"])
        return workload_from_dict(spec.base_raw, str(spec.base_path), spec.base_path.parent).to_dict(), None
    except (KeyError, OSError, ConfigError):
        return {}, None


def _rate_text(rate_col: str):
    short = rate_col.rsplit(".", 1)[-1]
    return (lambda v: f"{v:g} req/s") if rate_col == "arrivals.rate" else (lambda v: f"{short} {v:g}")


def knee_of_sweep(table: pd.DataFrame, grid: list[str], slo: dict[str, Any]) -> tuple | None:
    """(cells, knee table, budget column, rate column, limits) when the sweep crosses the token
    budget with a rate and has an SLO, else None: the one place report and terminal find the knee."""
    limits = knee.slo_limits(slo, table.columns)
    rate_col = next((c for c in RATE_COLUMNS if c in grid and table[c].nunique() > 1), None)
    budget_col = BUDGET_COLUMN if BUDGET_COLUMN in grid and table[BUDGET_COLUMN].nunique() > 1 else None
    if not (budget_col and rate_col and limits):
        return None
    cells = knee.knee_cells(table.dropna(subset=[budget_col]), budget_col=budget_col, rate_col=rate_col,
                            limits=limits)
    return cells, knee.knee_table(cells, budget_col=budget_col, rate_col=rate_col), budget_col, rate_col, limits


def knee_line(table: pd.DataFrame, grid: list[str], slo: dict[str, Any]) -> str | None:
    """The knee headline for the terminal (None when the sweep has no knee to name)."""
    found = knee_of_sweep(table, grid, slo)
    if found is None:
        return None
    _, kt, budget_col, rate_col, _ = found
    return knee.knee_headline(kt, budget_name=budget_col.rsplit(".", 1)[-1], rate_text=_rate_text(rate_col)) + \
        f" ({knee.RULE})"


def knee_section(figs: Figures, cells: pd.DataFrame, kt: pd.DataFrame, *, budget_col: str, rate_col: str,
                 limits: dict[str, float], subtitle: str) -> list[Any]:
    """Report blocks naming the knee of a token-budget sweep: headline, per-rate ranges, the grid figure."""
    rate_text, name = _rate_text(rate_col), budget_col.rsplit(".", 1)[-1]
    headline = knee.knee_headline(kt, budget_name=name, rate_text=rate_text)
    slo_text = ", ".join(f"{sweepplots.METRIC_LABELS[c].split(' (')[0]} <= {v:g} ms" for c, v in limits.items())
    per_rate = [f"{rate_text(r.rate)}: {name} meeting the SLO: {knee.budget_range(r.meeting, r.budgets)}"
                + (f"; recommended **{r.recommended:g}** (p99 TTFT {r.p99_ttft_ms:,.0f} ms)" if r.meeting else "")
                for r in kt.itertuples(index=False)]
    fig = sweepplots.knee_grid(cells, kt, budget_col=budget_col, rate_col=rate_col, limits=limits,
                               headline=headline, subtitle=subtitle)
    return [Heading("Knee of the token budget"), Callout(headline + ".", kind="ok"),
            Para(f"SLO (the workload's `slo`): {slo_text}, each p99 averaged over repetitions. "
                 f"Recommended budget at a rate: {knee.RULE}."),
            Bullets(per_rate),
            figs.save(fig, "knee", f"Which {name} meets the SLO at each rate (green), with the recommended one "
                                   f"framed: {knee.RULE}")]


def pareto_section(figs: Figures, table: pd.DataFrame, *, grid: list[str], groups: list[str], num_gpus: Any,
                   limits: dict[str, float], subtitle: str) -> list[Any]:
    """Report blocks of the Pareto plot: tokens/s per user against tokens/s per GPU, frontier labelled."""
    points = knee.pareto_points(table, grid_cols=grid, num_gpus=num_gpus, extra_cols=list(limits))
    if points.empty:
        return []
    meets = pd.Series(True, index=points.index)
    for col, limit in limits.items():
        meets &= points[col] <= limit
    frontier = knee.pareto_frontier(points)
    ends = [frontier.iloc[-1], frontier.iloc[0]]
    fig = sweepplots.pareto(points, frontier, group_cols=groups, label_cols=grid, meets=meets if limits else None,
                            subtitle=subtitle)
    return [Heading("Pareto: per-user speed against per-GPU throughput"),
            Para(f"x: output tokens/s per GPU = output_throughput / (replicas x tensor parallel); y: output tokens/s "
                 f"per user = 1000 / mean TPOT (ms), the mean time per output token after the first, as a speed "
                 f"(not the mean of each request's own speed; under static and dynamic batching TPOT includes the "
                 f"wait for the batch to return); "
                 f"one point per grid point, mean over repetitions. {len(frontier)} of {len(points)} points are on "
                 f"the frontier (no other point is better on both axes): from "
                 f"{ends[0][knee.PER_GPU]:,.0f} tokens/s per GPU at {ends[0][knee.PER_USER]:.1f} tokens/s per user "
                 f"({plots.label_of(ends[0].to_dict(), grid)}) to {ends[1][knee.PER_GPU]:,.0f} at "
                 f"{ends[1][knee.PER_USER]:.1f} ({plots.label_of(ends[1].to_dict(), grid)})."),
            figs.save(fig, "pareto", "Output tokens/s per user (1000 / mean TPOT) against output tokens/s per GPU; "
                                     "the step line is the Pareto frontier, its points labelled with their knobs"
                                     + ("; hollow points miss the SLO" if limits else ""))]


def _num_gpus(table: pd.DataFrame, config: dict[str, Any], meta: dict[str, Any]) -> Any:
    """GPUs of each run: replicas x tensor parallel, from the table where the grid varies them."""
    replicas = table["num_replicas"] if "num_replicas" in table else meta.get("num_replicas", 1)
    tp = table["profile.tensor_parallel"] if "profile.tensor_parallel" in table else \
        (config.get("profile") or {}).get("tensor_parallel", 1)
    return replicas * tp


def sweep_figures(figs: Figures, table: pd.DataFrame, *, grid: list[str], rate_col: str | None,
                  budget_col: str | None, limits: dict[str, float], kt: pd.DataFrame | None,
                  subtitle: str) -> list[Image]:
    """Latency against throughput (rate swept), the TTFT/ITL trade-off (budget swept, knee starred)
    and metrics against the first numeric knob."""
    images = []
    decode = sweepplots.decode_metric(limits).split("_")[1].upper()
    if rate_col:
        fig = sweepplots.latency_throughput(table, rate_col=rate_col, group_cols=[c for c in grid if c != rate_col],
                                            limits=limits, subtitle=subtitle)
        images.append(figs.save(fig, "latency_throughput",
                                f"p99 TTFT and p99 {decode} against achieved throughput as {rate_col} rises"))
    if budget_col:
        rows = table.dropna(subset=[budget_col])
        fig = sweepplots.ttft_itl_tradeoff(
            rows, budget_col=budget_col, group_cols=nonconstant(rows, [c for c in grid if c != budget_col]),
            limits=limits, rate_col=rate_col, subtitle=subtitle,
            recommended=dict(zip(kt["rate"], kt["recommended"])) if kt is not None else None,
            knee_rate=knee.knee_rate(kt) if kt is not None else None)
        images.append(figs.save(fig, "ttft_itl_tradeoff", f"p99 TTFT against p99 {decode} across the token budget; "
                                                          f"the tinted region meets the SLO, stars mark each rate's "
                                                          f"recommended budget"))
    numeric = [c for c in grid if c != rate_col and pd.api.types.is_numeric_dtype(table[c]) and table[c].nunique() > 1]
    param = budget_col or (numeric[0] if numeric else None)
    if param:
        rows = table.dropna(subset=[param])
        fig = sweepplots.metric_vs_param(rows, param_col=param, limits=limits, subtitle=subtitle,
                                         metrics=("p99_ttft_ms", sweepplots.decode_metric(limits), "output_throughput"),
                                         group_cols=nonconstant(rows, [c for c in grid if c != param]))
        images.append(figs.save(fig, f"metrics_vs_{param.rsplit('.', 1)[-1]}", f"Key metrics against {param}"))
    return images


def capacity_section(table: pd.DataFrame, slo: dict[str, Any], *, rate_col: str, groups: list[str]) -> list[Any]:
    """The highest grid rate meeting the workload's SLO, per configuration (``reports.experiments.capacity``)."""
    from reports.experiments.capacity import sweep_capacity
    slo_ms = {k[:-3]: v for k, v in slo.items() if k in ("ttft_ms", "tpot_ms", "e2el_ms") and v}
    if not slo_ms:
        return []
    caps = sweep_capacity(table, rate_col=rate_col, group_cols=groups, slo_ms=slo_ms)
    return [Heading("Highest rate within the SLO"),
            Para(f"Per configuration, the highest `{rate_col}` of the grid at which the mean p99 of "
                 + ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in slo_ms.items())
                 + " holds, at that rate and every lower one (the workload's `slo`). `sim plan` bisects "
                   "the rate instead of reading it off a grid."),
            Table(caps)]


def sweep_report(d: Path) -> list[Path]:
    """Report of a sweep directory: tables and figures chosen from what the grid varies."""
    meta = json.loads((d / "sweep.json").read_text()) if (d / "sweep.json").is_file() else {}
    table = pd.read_csv(d / "results.csv")
    grid = nonconstant(table, meta.get("grid_columns") or [c for c in table.columns if "." in c])
    table = in_sweep_order(table, grid, meta.get("vary") or {})
    slo = meta.get("slo") or {}
    limits = knee.slo_limits(slo, table.columns)
    rate_col = next((c for c in RATE_COLUMNS if c in grid and table[c].nunique() > 1), None)
    budget_col = BUDGET_COLUMN if BUDGET_COLUMN in grid and table[BUDGET_COLUMN].nunique() > 1 else None
    groups = [c for c in grid if c != rate_col]
    config, profile_name = _sweep_config(d, meta)
    subtitle = plots.describe(config, profile_name=profile_name, num_replicas=meta.get("num_replicas", 1),
                              rates_rps=table["offered_rate"] if "offered_rate" in table else (),
                              varied={c: table[c].tolist() for c in grid})
    figs = Figures(d)
    doc = Document(f"Sweep report: {meta.get('name', d.name)}")
    doc.add(Para(f"{len(table)} runs of `{meta.get('base', '?')}`"
                 + (f" (of {meta['num_runs']} in the grid)" if meta.get("num_runs") else "")
                 + f"; varied: {', '.join(f'`{c}`' for c in grid) or 'nothing'}; "
                 f"{meta.get('repetitions', 1)} repetition(s) per point, averaged in the figures."),
            Para(f"What was run: {subtitle}."))
    if "num_out_of_range_lookups" in table and table["num_out_of_range_lookups"].fillna(0).gt(0).any():
        n = int(table["num_out_of_range_lookups"].fillna(0).gt(0).sum())
        doc.add(Callout(f"{n} runs made step-cost lookups outside the profile's calibrated range (extrapolated)."))
    if "failed" in table and table["failed"].fillna(0).gt(0).any():
        doc.add(Callout("Some runs rejected requests (longer than the model context or the policy's limit); "
                        "see the 'failed' column.", kind="note"))
    kt = None
    if (found := knee_of_sweep(table, grid, slo)) is not None:
        cells, kt = found[0], found[1]
        doc.add(*knee_section(figs, cells, kt, budget_col=budget_col, rate_col=rate_col, limits=limits,
                              subtitle=subtitle))
    elif budget_col:
        doc.add(Callout("The sweep file sets no `slo`, so the report cannot name the budget's knee; add "
                        "`slo: {ttft_ms: ..., tpot_ms: ...}` under `set:`.", kind="note"))
    if rate_col:
        doc.add(*capacity_section(table, slo, rate_col=rate_col, groups=groups))
    images = sweep_figures(figs, table, grid=grid, rate_col=rate_col, budget_col=budget_col, limits=limits, kt=kt,
                           subtitle=subtitle)
    if images:
        doc.add(Heading("Figures"), *images)
    if grid and {"mean_tpot_ms", "output_throughput"} <= set(table.columns):
        doc.add(*pareto_section(figs, table, grid=grid, groups=groups, num_gpus=_num_gpus(table, config, meta),
                                limits=limits, subtitle=subtitle))
    runs = _compared_runs(d, table, grid, rate_col)
    if runs:
        doc.add(Heading("Selected runs"), Para("Saved runs compared: " + "; ".join(runs) + "."),
                *run_figures(figs, read_runs(runs), prefix="runs_", slo_ttft_ms=slo.get("ttft_ms"),
                             slo_itl_ms=slo.get("itl_ms"), colors=plots.series_colors(table, groups)))
    metrics = [m for m in KEY_METRICS if m in table.columns]
    agg = table.groupby(grid, sort=False, dropna=False)[metrics].mean().reset_index() if grid else table[metrics]
    doc.add(Heading("Results (mean over repetitions)"),
            Table(agg.head(MAX_TABLE_ROWS), caption=f"{len(agg)} grid points" + (
                f", first {MAX_TABLE_ROWS} shown; all in results.csv" if len(agg) > MAX_TABLE_ROWS else "")))
    if "profile_source" in table:
        sources = ", ".join(map(str, table["profile_source"].unique()))
        doc.add(Heading("Provenance"), Bullets([f"profile source: {sources}",
                                                f"results table: results.csv ({len(table.columns)} columns)"]))
    return figs.written + write_document(doc, d)


def _compared_runs(d: Path, table: pd.DataFrame, grid: list[str], rate_col: str | None) -> dict[str, Path]:
    """Up to MAX_COMPARED_RUNS saved runs, repetition 0, at the middle offered rate."""
    if not (d / "runs").is_dir():
        return {}
    rows = table[table["repetition"] == 0] if "repetition" in table else table
    if rate_col:
        rates = sorted(rows[rate_col].dropna().unique())
        rows = rows[rows[rate_col] == rates[len(rates) // 2]] if rates else rows
    labels = [c for c in grid if c != rate_col]
    out = {}
    for _, row in rows.head(MAX_COMPARED_RUNS).iterrows():
        path = d / "runs" / str(row["run_id"])
        if (path / "summary.json").is_file():
            out[plots.label_of(row.to_dict(), labels) if labels else str(row["run_id"])] = path
    return out
