"""`sim report DIR`: rebuild figures and reports from saved results alone.

DIR may be a sweep directory (results.csv), a plan directory (plan.json) or a
single run directory (summary.json, as ``sim.io.write_run`` writes it).
Figures go to DIR/figures/ as PNG and SVG; the report to DIR/report.md and
DIR/report.html.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from reports import plots, runplots
from reports.render import Bullets, Callout, Document, Heading, Image, Para, Table, write_document
from sim.config import ConfigError

RATE_COLUMNS = ("arrivals.rate", "arrivals.rate_scale")
BUDGET_COLUMN = "policy.max_num_batched_tokens"
KEY_METRICS = ("completed", "failed", "request_throughput", "output_throughput", "p50_ttft_ms", "p99_ttft_ms",
               "p50_itl_ms", "p99_itl_ms", "p99_tpot_ms", "num_preemptions", "mean_batch_size", "peak_kv_utilization")
MAX_TABLE_ROWS = 200
MAX_COMPARED_RUNS = 6


def regenerate(directory: Path) -> list[Path]:
    """Rebuild figures and report of a sweep, plan or run directory; return the files written."""
    d = Path(directory)
    if (d / "plan.json").is_file():
        from reports.planreport import plan_report
        return _prune(d, plan_report(d))
    if (d / "results.csv").is_file():
        return _prune(d, sweep_report(d))
    if (d / "summary.json").is_file():
        return _prune(d, run_report(d))
    raise ConfigError(f"{d}: not a sweep, plan or run directory (expected results.csv, plan.json or summary.json); "
                      f"fix: pass the --out directory of `sim sweep`, `sim plan` or `sim run`")


def _prune(d: Path, written: list[Path]) -> list[Path]:
    """Remove figures an earlier report wrote that this one no longer has (they would look current)."""
    keep = {p.resolve() for p in written}
    for path in (d / "figures").glob("*"):
        if path.suffix in (".png", ".svg") and path.resolve() not in keep:
            path.unlink()
    return written


class Figures:
    """Saves figures under DIR/figures and remembers what it wrote."""

    def __init__(self, out_dir: Path) -> None:
        self.dir = out_dir / "figures"
        self.written: list[Path] = []

    def save(self, fig: Any, name: str, caption: str) -> Image:
        paths = plots.save_figure(fig, self.dir / name)
        self.written += paths
        return Image(paths[0], caption)


def read_runs(run_dirs: dict[str, Path]) -> dict[str, Any]:
    """label -> RunResult for every complete run directory among ``run_dirs``."""
    from sim.io import read_run
    return {label: read_run(p) for label, p in run_dirs.items() if (p / "summary.json").is_file()}


def run_figures(figs: Figures, runs: dict[str, Any], *, prefix: str, slo_ttft_ms: float | None = None,
                slo_itl_ms: float | None = None, slots: bool = True) -> list[Image]:
    """CDFs across runs, slot occupancy (up to 4 runs, if ``slots``) and the time line of the first run."""
    if not runs:
        return []
    images = [figs.save(runplots.latency_cdfs({k: (r.requests, r.tokens) for k, r in runs.items()},
                                              slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms),
                        f"{prefix}cdf",
                        "CDFs of time to first token (per request) and inter-token latency (per token)")]
    if slots:
        some = dict(list(runs.items())[:4])
        kinds = {k: (r.requests, r.tokens, r.meta.get("config", {}).get("policy", {}).get("kind", ""))
                 for k, r in some.items()}
        images.append(figs.save(runplots.slot_occupancy(kinds), f"{prefix}slots", "Batch slots over time (first "
                                "replica): idle slots show as gaps, slots held by finished requests as dotted bars"))
    label, first = next(iter(runs.items()))
    images.append(figs.save(runplots.run_timeline(first.steps, title=f"Time line: {label}"), f"{prefix}timeline",
                            f"Time line of {label}: batch size, queues, KV-cache use, tokens per step"))
    return images


def provenance_lines(meta: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    prov = meta.get("profile_provenance") or {}
    source = summary.get("profile_source", prov.get("source", "?"))
    lines = [f"profile `{meta.get('profile_name', '?')}`: source **{source}**"]
    lines += [f"{k}: {v}" for k, v in prov.items() if k != "source" and not isinstance(v, (dict, list))]
    if summary.get("num_out_of_range_lookups"):
        lines.append(f"{summary['num_out_of_range_lookups']} cost lookups fell outside the profile's calibrated grid")
    return lines


def run_report(d: Path) -> list[Path]:
    """Report of one run directory: summary tables, CDFs, slots, time line, provenance."""
    from sim.io import read_run
    run = read_run(d)
    s, cfg = run.summary, run.meta.get("config", {})
    slo = cfg.get("slo") or {}
    figs = Figures(d)
    doc = Document(f"Run report: {cfg.get('name', d.name)}")
    policy = cfg.get("policy") or {}
    knobs = ", ".join(f"{k}={v}" for k, v in policy.items() if k != "kind")
    doc.add(Para(f"Policy `{policy.get('kind', '?')}` ({knobs}), "
                 f"seed {run.meta.get('seed')}, {run.meta.get('num_replicas', 1)} replica(s), "
                 f"router `{run.meta.get('router', 'round_robin')}`."))
    if s.get("num_out_of_range_lookups"):
        doc.add(Callout(f"{s['num_out_of_range_lookups']} step-cost lookups fell outside the profile's calibrated "
                        f"range and were extrapolated; treat the latencies with care."))
    doc.add(Heading("Summary"), Table(pd.DataFrame([{k: s.get(k) for k in KEY_METRICS}])))
    if s.get("replicas"):
        reps = pd.DataFrame([{"replica": i, **{k: r.get(k) for k in KEY_METRICS}} for i, r in enumerate(s["replicas"])])
        doc.add(Heading("Per replica"), Table(reps))
        doc.add(figs.save(plots.replica_balance(reps, title="Load across replicas"), "replicas", "Per-replica load"))
    doc.add(Heading("Figures"), *run_figures(figs, {cfg.get("name", d.name): run}, prefix="run_",
                                             slo_ttft_ms=slo.get("ttft_ms")))
    doc.add(Heading("Provenance"), Bullets(provenance_lines(run.meta, s)))
    return figs.written + write_document(doc, d)


def _nonconstant(table: pd.DataFrame, cols: list[str]) -> list[str]:
    return [c for c in cols if c in table.columns and table[c].nunique(dropna=False) > 1]


def sweep_report(d: Path) -> list[Path]:
    """Report of a sweep directory: tables and figures chosen from what the grid varies."""
    table = pd.read_csv(d / "results.csv")
    meta = json.loads((d / "sweep.json").read_text()) if (d / "sweep.json").is_file() else {}
    grid = _nonconstant(table, meta.get("grid_columns") or [c for c in table.columns if "." in c])
    slo = meta.get("slo") or {}
    slo_ttft, slo_itl = slo.get("ttft_ms"), slo.get("itl_ms")
    rate_col = next((c for c in RATE_COLUMNS if c in grid and table[c].nunique() > 1), None)
    budget_col = BUDGET_COLUMN if BUDGET_COLUMN in grid and table[BUDGET_COLUMN].nunique() > 1 else None
    figs = Figures(d)
    doc = Document(f"Sweep report: {meta.get('name', d.name)}")
    doc.add(Para(f"{len(table)} runs of `{meta.get('base', '?')}`"
                 + (f" (of {meta['num_runs']} in the grid)" if meta.get("num_runs") else "")
                 + f"; varied: {', '.join(f'`{c}`' for c in grid) or 'nothing'}; "
                 f"{meta.get('repetitions', 1)} repetition(s) per point, averaged in the figures."))
    if "num_out_of_range_lookups" in table and table["num_out_of_range_lookups"].fillna(0).gt(0).any():
        n = int(table["num_out_of_range_lookups"].fillna(0).gt(0).sum())
        doc.add(Callout(f"{n} runs made step-cost lookups outside the profile's calibrated range (extrapolated)."))
    if "failed" in table and table["failed"].fillna(0).gt(0).any():
        doc.add(Callout("Some runs rejected requests (longer than the model context or the policy's limit); "
                        "see the 'failed' column.", kind="note"))
    images = []
    if rate_col:
        groups = [c for c in grid if c != rate_col]
        images.append(figs.save(plots.latency_throughput(table, rate_col=rate_col, group_cols=groups,
                                                         slo_ttft_ms=slo_ttft, slo_itl_ms=slo_itl),
                                "latency_throughput", f"p99 TTFT and ITL against achieved throughput as "
                                                      f"{rate_col} rises"))
    if budget_col:
        with_budget = table.dropna(subset=[budget_col])
        groups = _nonconstant(with_budget, [c for c in grid if c != budget_col])
        images.append(figs.save(plots.ttft_itl_tradeoff(with_budget, budget_col=budget_col, group_cols=groups,
                                                        slo_ttft_ms=slo_ttft, slo_itl_ms=slo_itl),
                                "ttft_itl_tradeoff", "TTFT against ITL across the token budget"))
    numeric = [c for c in grid if c != rate_col and pd.api.types.is_numeric_dtype(table[c]) and table[c].nunique() > 1]
    param = budget_col or (numeric[0] if numeric else None)
    if param:
        rows = table.dropna(subset=[param])
        images.append(figs.save(plots.metric_vs_param(rows, param_col=param,
                                                      group_cols=_nonconstant(rows, [c for c in grid if c != param])),
                                f"metrics_vs_{param.rsplit('.', 1)[-1]}", f"Key metrics against {param}"))
    slo_ms = {k[:-3]: v for k, v in slo.items() if k in ("ttft_ms", "tpot_ms", "e2el_ms") and v}
    if rate_col and slo_ms:
        from reports.capacity import sweep_capacity
        caps = sweep_capacity(table, rate_col=rate_col, group_cols=[c for c in grid if c != rate_col], slo_ms=slo_ms)
        doc.add(Heading("Highest rate within the SLO"),
                Para(f"Per configuration, the highest `{rate_col}` of the grid at which the mean p99 of "
                     + ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in slo_ms.items())
                     + " holds, at that rate and every lower one (the workload's `slo`). `sim plan` bisects "
                       "the rate instead of reading it off a grid."),
                Table(caps))
    if images:
        doc.add(Heading("Figures"), *images)
    runs = _compared_runs(d, table, grid, rate_col)
    if runs:
        doc.add(Heading("Selected runs"), Para("Saved runs compared: " + "; ".join(runs) + "."),
                *run_figures(figs, read_runs(runs), prefix="runs_", slo_ttft_ms=slo_ttft, slo_itl_ms=slo_itl))
    metrics = [m for m in KEY_METRICS if m in table.columns]
    agg = table.groupby(grid, sort=True, dropna=False)[metrics].mean().reset_index() if grid else table[metrics]
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
