"""What `sim sweep` and `sim plan` print: the results, read back from their output directory.

Printed with rich. On a terminal: a light table with a bold header and a
coloured verdict. Anywhere else (a pipe, a log file, CI): no colour or escape
codes at all, Markdown pipe tables, and lines never folded, so logs stay
greppable and can be pasted into an issue as they are. ``--quiet`` only
drops the progress bar: the results are the output.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from reports.presentation.layouts import layout_comparison
from reports.presentation.planreport import close_calls, plan_warnings

NO_WRAP_WIDTH = 1000        # columns of a non-terminal console: wide enough that rich never folds a line


def make_console(file: TextIO | None = None) -> Console:
    """A console on ``file`` (stdout): styled on a terminal, plain text elsewhere, whatever FORCE_COLOR says."""
    stream = file or sys.stdout
    tty = stream.isatty()
    return Console(file=stream, force_terminal=tty, color_system="auto" if tty else None, highlight=False,
                   emoji=False, markup=False, width=None if tty else NO_WRAP_WIDTH, soft_wrap=not tty)


def print_table(console: Console, headers: list[str], rows: list[list[Any]], right_from: int) -> None:
    """Columns from ``right_from`` on hold numbers and align right. No cell is ever wrapped
    or cropped: on a narrow terminal the lines overflow. Off a terminal the Markdown table
    loses the blank, space-padded edge lines rich gives it."""
    plain = not console.is_terminal
    table = Table(box=box.MARKDOWN if plain else box.SIMPLE_HEAD, header_style="" if plain else "bold",
                  show_edge=plain)
    for i, header in enumerate(headers):
        table.add_column(header, justify="right" if i >= right_from else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    if not plain:
        need = Measurement.get(console, console.options.update_width(NO_WRAP_WIDTH), table).maximum
        if need > console.width:               # too wide: let the terminal wrap its lines rather than crop cells
            console = Console(file=console.file, width=need, force_terminal=True, color_system=console.color_system,
                              highlight=False, markup=False)
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    console.print("\n".join(line.rstrip() for line in captured.get().splitlines() if line.strip()))


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _num(v: Any, digits: int = 1) -> str:
    """A count or a measurement: thousands separators, ``digits`` decimals below 100, none above."""
    if _missing(v):
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.{digits}f}"


def _value(v: Any) -> str:
    """A grid value as written in the sweep file (32.0 read back from CSV is 32)."""
    return f"{v:g}" if isinstance(v, float) else str(v)


# ---- sim sweep ---------------------------------------------------------------------
def _order_key(v: Any) -> tuple:
    """Numbers in numeric order, then text in alphabetical order, then missing values."""
    if _missing(v):
        return (2, 0.0, "")
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)):     # numpy's int64 from the CSV too
        return (0, float(v), "")
    return (1, 0.0, str(v))


def _knob_columns(vary: list[str], grid_columns: list[str]) -> dict[str, list[str]]:
    """Each varied key -> its table columns (a varied mapping such as ``policy`` flattens to several)."""
    return {k: [c for c in grid_columns if c == k or c.startswith(k + ".")] for k in vary}


def _knob(row: pd.Series, key: str, columns: list[str]) -> str:
    """``sarathi max_num_batched_tokens=512`` for a varied mapping, the value itself for a scalar key."""
    parts = []
    for c in columns:
        if _missing(row.get(c)):
            continue
        name = c[len(key) + 1:]
        parts.append(_value(row[c]) if c == key or name == "kind" else f"{name}={_value(row[c])}")
    return " ".join(parts)


def slo_met(row: pd.Series, slo: dict[str, Any]) -> bool:
    """Every constrained p99 within its threshold (the workload's ``slo``, in ms) and no request rejected."""
    within = all(not _missing(row.get(f"p99_{k[:-3]}_ms")) and row[f"p99_{k[:-3]}_ms"] <= v
                 for k, v in slo.items() if v is not None)
    return within and not row.get("failed")


def sweep_rows(table: pd.DataFrame, meta: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the sweep summary: one row per run, sorted by the varied values, then repetition."""
    knobs = _knob_columns(list(meta["vary"]), meta["grid_columns"])
    order = sorted(table.index, key=lambda i: (
        [_order_key(table.at[i, c]) for cols in knobs.values() for c in cols], table.at[i, "repetition"]))
    slo = {k: v for k, v in (meta.get("slo") or {}).items() if k in ("ttft_ms", "tpot_ms", "e2el_ms") and v}
    reps = table["repetition"].nunique() > 1
    # every p99 the SLO constrains is shown, so that 'SLO met' can be checked from the table
    extra = [m for m in ("tpot", "e2el") if f"{m}_ms" in slo and f"p99_{m}_ms" in table.columns]
    # the prefix cache's hit rate, when some run of the sweep had a cache
    cache = "prefix_cache_hit_rate" in table.columns and bool(table["prefix_cache_hit_rate"].notna().any())
    headers = [*knobs, *(["rep"] if reps else []), "completed", "failed", "req/s", "output tok/s", "p50 TTFT ms",
               "p99 TTFT ms", "p99 ITL ms", *(f"p99 {m.upper()} ms" for m in extra),
               *(["cache hits"] if cache else []), *(["SLO met"] if slo else [])]
    rows = []
    for i in order:
        r = table.loc[i]
        hits = r["prefix_cache_hit_rate"] if cache else None
        rows.append([*(_knob(r, k, cols) for k, cols in knobs.items()), *([str(r["repetition"])] if reps else []),
                     f"{r['completed']:,}", f"{r['failed']:,}", f"{r['request_throughput']:.2f}",
                     _num(r["output_throughput"]), _num(r["p50_ttft_ms"]), _num(r["p99_ttft_ms"]),
                     _num(r["p99_itl_ms"]), *(_num(r[f"p99_{m}_ms"]) for m in extra),
                     *([("-" if _missing(hits) else f"{100 * hits:.1f}%")] if cache else []),
                     *(["yes" if slo_met(r, slo) else "no"] if slo else [])])
    return headers, rows


def print_sweep(out_dir: Path, console: Console | None = None) -> None:
    """The sweep's results table (every run in results.csv), what 'SLO met' means, and where the files are."""
    console = console or make_console()
    meta = json.loads((out_dir / "sweep.json").read_text())
    table = pd.read_csv(out_dir / "results.csv")
    headers, rows = sweep_rows(table, meta)
    console.print(f"sweep {meta['name']}: {len(rows)} runs, varying {' x '.join(meta['vary'])}")
    print_table(console, headers, rows, right_from=len(meta["vary"]))
    slo = {k: v for k, v in (meta.get("slo") or {}).items() if k in ("ttft_ms", "tpot_ms", "e2el_ms") and v}
    if slo:
        console.print("SLO met: " + " and ".join(f"p99 {k[:-3].upper()} <= {v:g} ms" for k, v in slo.items())
                      + ", no request rejected")
    from reports.presentation.sweepreport import in_sweep_order, nonconstant, knee_line
    grid = nonconstant(table, meta.get("grid_columns") or [c for c in table.columns if "." in c])
    line = knee_line(in_sweep_order(table, grid, meta.get("vary") or {}), grid, meta.get("slo") or {})
    if line:
        console.print(line)
    report = out_dir / "report.html"
    console.print(f"results: {out_dir / 'results.csv'}" + (f"; report: {report}" if report.is_file() else ""))


# ---- sim plan ----------------------------------------------------------------------
def _attained(row: pd.Series) -> str:
    """'TTFT 99.8% ITL 99.9%': the verified fleet's share within each constrained SLO."""
    parts = [f"{m.upper()} {100 * row[f'{m}_attainment']:.1f}%" for m in ("ttft", "itl", "tpot")
             if not _missing(row.get(f"{m}_attainment"))]
    return " ".join(parts) or "-"


def recommendation(ranked: pd.DataFrame, plan: dict[str, Any]) -> str:
    """The answer in one sentence, or why there is none."""
    ok = ranked[ranked["meets_slo"]]
    if ok.empty:
        return (f"No candidate serves {plan['target_rate']:g} req/s within {plan['slo_text']}: see the warnings "
                f"and the capacity search in the report.")
    b = ok.iloc[0]
    gpus = f" ({int(b['gpus'])} GPUs)" if b["gpus"] != b["replicas"] else ""
    fleet = f"{int(b['replicas'])} x {b['hardware']}{gpus}"
    if b.get("layout") == "disaggregated":
        fleet = f"{_xpyd(b)} of {b['hardware']} ({int(b['gpus'])} GPUs)"
    per_mtok = f" (${b['cost_per_mtok']:,.2f} per M output tokens)" if not _missing(b["cost_per_mtok"]) else ""
    latency = ", ".join(f"p99 {m.upper()} {_num(b[f'fleet_p99_{m}_ms'])} ms" for m in ("ttft", "itl", "tpot")
                        if plan["slo"].get(f"{m}_ms") is not None and not _missing(b.get(f"fleet_p99_{m}_ms")))
    return (f"Recommended: {fleet} running {b['policy']}: "
            f"${b['cost_per_hour']:,.2f}/h{per_mtok}, serves {plan['target_rate']:g} req/s at "
            f"{100 * b['utilization']:.0f}% utilisation; verified on {b['verify_span_s']:.0f} s of traffic: "
            f"{latency}, queue stable.")


def _xpyd(row: pd.Series) -> str:
    """A disaggregated fleet's shape: 2P3D (2 prefill and 3 decode replicas)."""
    return f"{int(row['prefill_replicas'])}P{int(row['decode_replicas'])}D"


def plan_rows(ranked: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the ranked candidates, best first."""
    headers = ["#", "candidate", "policy", "capacity/replica (req/s)", "replicas", "util. at target", "$/hour",
               "meets SLO", "attained", "queue"]
    rows = []
    for i, (_, r) in enumerate(ranked.iterrows(), start=1):
        err = r.get("profile_error_pct")
        capacity = "-" if _missing(r["capacity_rps"]) else f"{r['capacity_rps']:.3g}" + (
            "" if _missing(err) else f" +/-{err:.0f}%")
        queue = "-" if _missing(r.get("queue_stable")) else "stable" if r["queue_stable"] else "growing"
        rows.append([str(i), str(r["hardware"]), str(r["policy"]), capacity,
                     "-" if _missing(r["replicas"]) else _xpyd(r) if r.get("layout") == "disaggregated" else
                     f"{int(r['replicas'])}",
                     "-" if _missing(r.get("utilization")) else f"{100 * r['utilization']:.0f}%",
                     "-" if _missing(r["cost_per_hour"]) else f"{r['cost_per_hour']:,.2f}",
                     "yes" if r["meets_slo"] else "no", _attained(r), queue])
    return headers, rows


def print_plan(out_dir: Path, console: Console | None = None) -> None:
    """Recommendation sentence, ranked table, warnings, and where the files are."""
    console = console or make_console()
    data = json.loads((out_dir / "plan.json").read_text())
    plan, results = data["plan"], data["results"]
    ranked = pd.read_csv(out_dir / "ranked.csv")
    ranked["meets_slo"] = ranked["meets_slo"].astype(bool)
    console.print(f"plan {plan['name']}: {plan['target_rate']:g} req/s of {Path(plan['base']).name} within "
                  f"{plan['slo_text']}; fleets sized to run at <= {100 * plan['target_utilization']:g}% of capacity")
    ok = ranked["meets_slo"].any()
    console.print(Text(recommendation(ranked, plan), style="bold green" if ok else "bold red"))
    headers, rows = plan_rows(ranked)
    print_table(console, headers, rows, right_from=3)
    side = layout_comparison(ranked, results, plan)
    if side is not None:
        console.print(Text("aggregated vs disaggregated:", style="bold"))
        table = side["table"]
        print_table(console, [str(c) for c in table.columns], table.astype(str).values.tolist(), right_from=1)
        console.print(side["reason"])
    warnings = plan_warnings(results, plan) + close_calls(ranked)
    if warnings:
        console.print(Text("warnings:", style="bold yellow"))
        for w in warnings:
            console.print(f"- {w}")
    console.print(f"report: {out_dir / 'report.html'} (also report.md); data: plan.json, ranked.csv, trials.csv, "
                  f"runs/ in {out_dir}")
