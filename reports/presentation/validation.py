"""Live-vs-simulated comparison: error tables, attribution, decision diff, figures.

Torch-free; reads only the DataFrames of two runs (``sim.results.folder.read_run`` or
``RunResult``s): a *live* run whose ``steps`` carry ``batch`` (composition),
``forward_s`` (measured) and ``predicted_s`` (profile) times, and its twin.

Attribution (measured-time replay). The live step sequence is replayed with
each step's measured duration swapped for its predicted one, keeping the live
schedule (same batches, same order; idle gaps end no earlier than they did
live). Then for every metric M:

    M(sim) - M(live) = [M(replay) - M(live)]  +  [M(sim) - M(replay)]
                        cost-curve error          policy divergence
                        (same batches,            (different batches, same
                         different time)           cost model)

The replay keeps the live order, so where the live run was much slower than
predicted, its batches wait for arrivals the live schedule had absorbed: read
the split with the per-step errors. Errors are signed % of the live value.
Nothing here writes a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from reports.presentation.plots import FIG_WIDTH_IN, plt
from reports.presentation.runplots import latency_cdfs
from sim.results.metrics import summarize

if TYPE_CHECKING:
    from reports.presentation.render import Document
    from sim.results.result import RunResult as Run  # or anything with requests, steps, tokens, summary

THROUGHPUTS = (("request_throughput", "req/s"), ("output_throughput", "tok/s"))
LATENCIES = ("ttft", "itl", "tpot", "e2el")
STATS = ("mean", "p50", "p90", "p99")
IDLE_GAP_S = 1e-9
STARVED_SHARE = 0.9     # a step with less CPU per wall second than 0.9 x the run's p90 was descheduled


# The prefix-cache hit rate (hits / queries, tokens, as vLLM's counters): a row of its own when a side
# has it, shown in %, its error the difference in percentage points (a relative error of a rate near
# 0 says nothing). POINT_METRICS are compared that way.
HIT_RATE = "prefix_cache_hit_rate"
POINT_METRICS = frozenset({HIT_RATE})


def metric_keys() -> list[tuple[str, str]]:
    """(summary key, unit) of every compared metric, in table order (the hit rate, when
    compared, comes after them)."""
    return [*THROUGHPUTS, *((f"{s}_{m}_ms", "ms") for m in LATENCIES for s in STATS)]


def _pct(value: float | None, ref: float | None) -> float:
    return float("nan") if value is None or not ref else (value - ref) / ref * 100.0


def _points(value: float | None, ref: float | None) -> float:
    return float("nan") if value is None or ref is None else (value - ref) * 100.0


def _shown(key: str, value: Any) -> Any:
    """A summary value as its table row shows it (a rate in %)."""
    return value * 100.0 if key in POINT_METRICS and value is not None else value


def error_table(live: Mapping[str, Any], sim: Mapping[str, Any],
                replay: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """One row per metric: live, sim, err_pct = (sim - live) / live; with
    ``replay``: cost_pct = (replay - live) / live and policy_pct = (sim -
    replay) / live, which add up to err_pct. When either summary has a
    ``prefix_cache_hit_rate`` (a fraction), a last row gives it in % with
    err_pct = sim - live in percentage points."""
    rows = []
    keys = metric_keys() + ([(HIT_RATE, "%")] if HIT_RATE in live or HIT_RATE in sim else [])
    for key, unit in keys:
        diff = _points if key in POINT_METRICS else _pct
        row = {"metric": key, "unit": unit, "live": _shown(key, live.get(key)), "sim": _shown(key, sim.get(key)),
               "err_pct": diff(sim.get(key), live.get(key))}
        if replay is not None:
            row["replay"] = _shown(key, replay.get(key))
            row["cost_pct"] = diff(replay.get(key), live.get(key))
            row["policy_pct"] = row["err_pct"] - row["cost_pct"]
        rows.append(row)
    return pd.DataFrame(rows)


def repeat_table(lives: list[Mapping[str, Any]], sims: list[Mapping[str, Any]]) -> pd.DataFrame:
    """``error_table`` of repeated measurements: live and sim are the medians of
    each metric over the repeats (a side run once has one), err_pct compares
    them; live_min, live_max give the live repeats' range and spread_pct its
    width, (max - min) / median in % (in points for a rate). One live run:
    ``error_table`` itself, no spread columns."""
    if len(lives) == 1 and len(sims) == 1:
        return error_table(lives[0], sims[0])

    def median(summaries: list[Mapping[str, Any]], key: str) -> float | None:
        values = [x[key] for x in summaries if x.get(key) is not None]
        return float(np.median(values)) if values else None

    keys = [k for k, _ in metric_keys()] + [HIT_RATE]
    live = {k: median(lives, k) for k in keys if any(k in x for x in lives)}
    sim = {k: median(sims, k) for k in keys if any(k in x for x in sims)}
    table = error_table(live, sim)
    lo, hi, spread = [], [], []
    for key in table["metric"]:
        values = [x[key] for x in lives if x.get(key) is not None]
        a, b = (min(values), max(values)) if len(values) == len(lives) else (None, None)
        lo.append(_shown(key, a))
        hi.append(_shown(key, b))
        spread.append(float("nan") if a is None else (b - a) * 100.0 if key in POINT_METRICS
                      else (b - a) / live[key] * 100.0 if live.get(key) else float("nan"))
    return table.assign(live_min=lo, live_max=hi, spread_pct=spread)


def check(table: pd.DataFrame, tolerances_pct: Mapping[str, float]) -> list[str]:
    """Violations of ``{metric: max |err_pct|}``; a NaN error is a violation."""
    err = dict(zip(table["metric"], table["err_pct"]))
    return [f"{key}: {err.get(key, np.nan):+.1f}% (limit ±{limit:g}%)"
            for key, limit in tolerances_pct.items() if not abs(err.get(key, np.nan)) <= limit]


# ---- verdict against accuracy targets ----------------------------------------------------------
# target name -> (summary key, default max |err %|): throughput within 5%, p50 TTFT and ITL within
# 10%, p99 within 20%. Any compared metric key (``p90_e2el_ms``) works as a target name too.
TARGETS: dict[str, tuple[str, float]] = {
    "throughput": ("output_throughput", 5.0),
    "ttft_p50": ("p50_ttft_ms", 10.0), "itl_p50": ("p50_itl_ms", 10.0),
    "ttft_p99": ("p99_ttft_ms", 20.0), "itl_p99": ("p99_itl_ms", 20.0),
}
# Targets that apply only where both sides have the metric (a server validation adds them then):
# the prefix-cache hit rate within 3 percentage points.
OPTIONAL_TARGETS: dict[str, tuple[str, float]] = {"hit_rate": (HIT_RATE, 3.0)}
VERDICT_EPS_PCT = 1e-9     # an error exactly on the target meets it, whatever the float rounding


def parse_targets(text: str | None) -> dict[str, float]:
    """``"throughput=5,ttft_p99=25"`` -> the default targets with those replaced
    or added, as {target name: max |err %|}. ConfigError for a bad item."""
    from sim.run.config import ConfigError

    out = {name: pct for name, (_, pct) in TARGETS.items()}
    known = {key for key, _ in metric_keys()} | {HIT_RATE}
    names = {**TARGETS, **OPTIONAL_TARGETS}
    if text is not None and not text.strip():
        raise ConfigError("--targets '': expected NAME=PERCENT,... (leave --targets out for the defaults)")
    seen: set[str] = set()
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or (name not in names and name not in known):
            raise ConfigError(f"--targets: {item!r} must be NAME=PERCENT with NAME one of "
                              f"{', '.join(names)} or a compared metric ({', '.join(sorted(known))})")
        try:
            pct = float(value.rstrip("% "))
        except ValueError:
            pct = float("nan")
        if not pct >= 0 or pct == float("inf"):
            raise ConfigError(f"--targets: {item!r}: the percentage must be a number >= 0")
        if name in seen:
            raise ConfigError(f"--targets: {name} is given twice; give each target once")
        seen.add(name)
        out[name] = pct
    return out


def target_metric(name: str) -> str:
    """The summary key a target name stands for."""
    return {**TARGETS, **OPTIONAL_TARGETS}.get(name, (name,))[0]


def verdict(table: pd.DataFrame, targets_pct: Mapping[str, float]) -> pd.DataFrame:
    """One row per target: target, metric, limit_pct, live, sim, err_pct and
    met (|err_pct| <= limit_pct; a missing or NaN error fails). A table of
    repeated measurements (``repeat_table``: live_min / live_max) adds
    ``in_spread``, the sim inside the live repeats' range, and a target is met
    when its error is within the limit *or* in the spread: the simulator is
    then as close to the server as the server is to itself."""
    rows = {r["metric"]: r for r in table.to_dict("records")}
    spread = "live_min" in table
    out = []
    for name, limit in targets_pct.items():
        key = target_metric(name)
        r = rows.get(key, {})
        err = r.get("err_pct")
        err = float("nan") if err is None else float(err)
        row = {"target": name, "metric": key, "limit_pct": float(limit), "live": r.get("live"),
               "sim": r.get("sim"), "err_pct": err,
               "met": bool(np.isfinite(err) and abs(err) <= limit + VERDICT_EPS_PCT)}
        if spread:
            lo, hi, sim = r.get("live_min"), r.get("live_max"), r.get("sim")
            row["spread_pct"] = r.get("spread_pct")
            row["in_spread"] = bool(sim is not None and lo is not None and hi is not None
                                    and np.isfinite(sim) and lo <= sim <= hi)
            row["met"] = row["met"] or row["in_spread"]
        out.append(row)
    columns = ["target", "metric", "limit_pct", "live", "sim", "err_pct", "met"]
    return pd.DataFrame(out, columns=columns + (["spread_pct", "in_spread"] if spread else []))


def format_verdict(rows: pd.DataFrame) -> str:
    """The verdict as text: one line per target (with repeats, the live spread and
    whether the sim is inside it), then PASS or FAIL. A rate's error is in points."""
    def line(r: Any) -> str:
        unit = "pt" if r.metric in POINT_METRICS else "%"
        text = f"{r.target:<12}{r.metric:<20} err {_num(r.err_pct, True):>7} {unit}   limit ±{r.limit_pct:g}{unit}"
        if "in_spread" in rows:
            text += f"   live spread {_num(r.spread_pct)}{unit}{', sim inside it' if r.in_spread else ''}"
        return text + f"   {'met' if r.met else 'MISSED'}"
    lines = [line(r) for r in rows.itertuples()]
    missed = [r.target for r in rows.itertuples() if not r.met]
    lines.append("verdict: PASS (every target met)" if not missed else
                 f"verdict: FAIL ({len(missed)} of {len(rows)} targets missed: {', '.join(missed)})")
    return "\n".join(lines)


# ---- per-step cost error ------------------------------------------------------------------
def step_kind(steps: pd.DataFrame) -> np.ndarray:
    """'prefill' (no decodes), 'decode' (no chunks) or 'mixed' per step."""
    pre = steps["num_prefill_seqs"].to_numpy() > 0
    dec = (steps["batch_size"] - steps["num_prefill_seqs"]).to_numpy() > 0
    return np.where(pre & dec, "mixed", np.where(pre, "prefill", "decode"))


def step_errors(steps: pd.DataFrame) -> pd.DataFrame:
    """Per live step: kind, t_s, measured_s (forward time, else the step's
    duration), predicted_s and error_pct = (predicted - measured) / measured."""
    measured = steps["forward_s"] if "forward_s" in steps else steps["duration_s"]
    measured = measured.where(np.isfinite(measured), steps["duration_s"]).to_numpy(dtype=float)
    pred = steps["predicted_s"].to_numpy(dtype=float)
    return pd.DataFrame({"kind": step_kind(steps), "t_s": steps["t_s"].to_numpy(dtype=float),
                         "measured_s": measured, "predicted_s": pred,
                         "error_pct": (pred - measured) / measured * 100.0})


def step_error_stats(steps: pd.DataFrame) -> dict[str, Any]:
    """median/p90 |error| %, mean signed error %, per kind too; host time
    outside the forward pass (scheduling, bookkeeping, clock catch-up)."""
    e = step_errors(steps)
    out: dict[str, Any] = {"num_steps": len(e)}
    for kind, sub in [("all", e), *e.groupby("kind")]:
        a = sub["error_pct"].abs()
        out[kind] = {"num_steps": len(sub), "median_abs_pct": float(a.median()),
                     "p90_abs_pct": float(a.quantile(0.9)), "mean_pct": float(sub["error_pct"].mean())}
    dur = steps["duration_s"].to_numpy(dtype=float)
    host = dur - e["measured_s"].to_numpy()
    out["host_ms"] = {"mean": float(host.mean() * 1e3), "p99": float(np.percentile(host, 99) * 1e3),
                      "share_pct": float(host.sum() / dur.sum() * 100.0)}
    out["busy_s"] = {"live_duration": float(dur.sum()), "live_forward": float(e["measured_s"].sum()),
                     "replay_predicted": float(e["predicted_s"].sum())}
    # CPU seconds per forward-pass second: ~threads when the cores were ours, less when shared.
    out["cpu_per_forward_s"] = None
    if "cpu_s" in steps and len(e):
        ratio = steps["cpu_s"].to_numpy(dtype=float) / e["measured_s"].to_numpy()
        out["cpu_per_forward_s"] = float(steps["cpu_s"].sum() / e["measured_s"].sum())
        # unstarved: steps that got (nearly) the CPU share the run's best steps got
        a = e.loc[ratio >= STARVED_SHARE * np.percentile(ratio, 90), "error_pct"].abs()
        out["unstarved"] = {"num_steps": len(a), "median_abs_pct": float(a.median()),
                            "p90_abs_pct": float(a.quantile(0.9))}
    return out


# ---- decisions --------------------------------------------------------------------------------
def decision_diff(live_steps: pd.DataFrame, sim_steps: pd.DataFrame) -> dict[str, Any]:
    """Step i of the live run against step i of the simulated one, by their
    (req_id, num_new_tokens, context_len) items in order: the fraction that
    are identical (over the longer run) and the first divergence."""
    a, b = live_steps["batch"].astype(str).tolist(), sim_steps["batch"].astype(str).tolist()
    n, m = max(len(a), len(b)), min(len(a), len(b))
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i in range(m) if a[i] != b[i]), m if len(a) != len(b) else None)
    out: dict[str, Any] = {"num_live_steps": len(a), "num_sim_steps": len(b),
                           "identical_fraction": same / n if n else 1.0, "first_divergence": None}
    if first is not None:
        (lt, lb), (st, sb) = [(float(steps["t_s"].iloc[first]), seq[first]) if first < len(seq) else (None, None)
                              for steps, seq in ((live_steps, a), (sim_steps, b))]
        out["first_divergence"] = {"step": first, "live_t_s": lt, "sim_t_s": st, "live_batch": lb, "sim_batch": sb}
    return out


# ---- measured-time replay -----------------------------------------------------------------
def _ready_s(live: Run) -> np.ndarray:
    """Per step, the latest arrival among its requests (-inf without ``batch``)."""
    if "batch" not in live.steps:
        return np.full(len(live.steps), -np.inf)
    arrival = dict(zip(live.requests["req_id"].tolist(), live.requests["arrival_s"].tolist()))
    return np.array([max((arrival[int(item.split(":", 1)[0])] for item in str(b).split()), default=-np.inf)
                     for b in live.steps["batch"]], dtype=float)


def replay(live: Run, kv_total_blocks: int | None = None) -> dict[str, Any]:
    """Summary of the live schedule re-timed with the profile's step times.

    Step i starts when step i-1 ends, but never before its requests arrived
    (from the ``batch`` compositions) nor, if the live server sat idle before
    it, before it started live. Every token, first token, finish (step ends)
    and first scheduling (step starts) moves with its step.
    """
    st = live.steps
    start = st["t_s"].to_numpy(dtype=float)
    end = start + st["duration_s"].to_numpy(dtype=float)
    pred = st["predicted_s"].to_numpy(dtype=float)
    ready = _ready_s(live)
    r_start, r_end = np.empty_like(start), np.empty_like(start)
    prev_live = prev_rep = -np.inf
    for i in range(len(start)):
        idle = start[i] > prev_live + IDLE_GAP_S
        r_start[i] = max(prev_rep, ready[i], start[i] if idle else -np.inf)
        r_end[i] = r_start[i] + pred[i]
        prev_live, prev_rep = end[i], r_end[i]

    def move(t: np.ndarray, live_marks: np.ndarray, rep_marks: np.ndarray) -> np.ndarray:
        idx = np.clip(np.searchsorted(live_marks, np.nan_to_num(t) - 1e-7), 0, len(live_marks) - 1)
        return np.where(np.isfinite(t), rep_marks[idx], np.nan)

    req = live.requests.copy()
    for col, (marks, rep) in {"first_token_s": (end, r_end), "finished_s": (end, r_end),
                              "first_scheduled_s": (start, r_start)}.items():
        req[col] = move(req[col].to_numpy(dtype=float), marks, rep)
    for col, since in (("queue_s", "first_scheduled_s"), ("ttft_s", "first_token_s"), ("e2e_s", "finished_s")):
        req[col] = req[since] - req["arrival_s"]
    req["tpot_s"] = (req["e2e_s"] - req["ttft_s"]) / (req["output_tokens"].where(req["output_tokens"] > 1) - 1)
    tokens = pd.DataFrame({"req_id": live.tokens["req_id"].to_numpy(),
                           "t_s": move(live.tokens["t_s"].to_numpy(dtype=float), end, r_end)})
    steps = st.assign(t_s=r_start, duration_s=pred)
    return summarize(req, tokens, steps, None, kv_total_blocks)


# ---- everything together ----------------------------------------------------------------------
def compare(live: Run, sim: Run) -> dict[str, Any]:
    """The whole comparison as plain data (report.json's body)."""
    kv_total = int(live.steps["kv_total_blocks"].iloc[0]) if len(live.steps.get("kv_total_blocks", ())) else None
    table = error_table(live.summary, sim.summary, replay(live, kv_total))
    return {"table": table.replace({np.nan: None}).to_dict("records"),
            "steps": step_error_stats(live.steps),
            "decisions": decision_diff(live.steps, sim.steps),
            "completed": {"live": live.summary["completed"], "sim": sim.summary["completed"]},
            "preemptions": {"live": live.summary["num_preemptions"], "sim": sim.summary["num_preemptions"]},
            "out_of_range_lookups": {"live": live.summary.get("num_out_of_range_lookups"),
                                     "sim": sim.summary.get("num_out_of_range_lookups")}}


def _num(v: Any, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    return f"{v:+.1f}" if pct else (f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}")


def format_table(rows: list[dict[str, Any]] | pd.DataFrame, markdown: bool = False,
                 labels: Mapping[str, str] | None = None) -> str:
    """The error table as aligned text, or as a Markdown table; ``labels``
    renames column headers (``{"live": "measured"}``)."""
    df = pd.DataFrame(rows)
    head = {"live": "live", "sim": "sim", "err_pct": "err %", "live_min": "live min", "live_max": "live max",
            "spread_pct": "spread %", "replay": "replay", "cost_pct": "cost-curve %", "policy_pct": "policy %",
            **(labels or {})}
    cols = [c for c in head if c in df]
    cells = [[f"{r.metric} ({r.unit})"] + [_num(getattr(r, c), c.endswith("pct") and c != "spread_pct") for c in cols]
             for r in df.itertuples()]
    header = ["metric"] + [head[c] for c in cols]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    w = max(len(c[0]) for c in cells + [header])
    fmt = lambda c: f"{c[0]:<{w}}" + "".join(f"{x:>14}" for x in c[1:])   # noqa: E731
    return "\n".join([fmt(header)] + [fmt(c) for c in cells])


def _short(batch: str | None, max_items: int = 8) -> str:
    items = (batch or "").split()
    more = f" ... (+{len(items) - max_items} items)" if len(items) > max_items else ""
    return " ".join(items[:max_items]) + more if batch is not None else "(run ended)"


COLUMN_LEGEND = (
    "**live**: measured on the engine, in wall-clock time",
    "**sim**: the simulator on the same requests, with the profile's step costs",
    "**err %** = (sim - live) / live; a target is met when |err %| <= its limit",
    "**replay**: the live run's own batches, in the live order, re-timed with the profile's step "
    "costs (same decisions, predicted durations)",
    "**cost-curve %** = (replay - live) / live: the error the cost curves alone make",
    "**policy %** = err % - cost-curve %: the rest, from decisions that drift apart once the times "
    "differ, and the host time between steps that the simulator does not have",
)


def live_report(body: Mapping[str, Any], title: str, figures_dir: Path | None = None) -> Document:
    """report.md / report.html of a validation on batchsim's own engine, from report.json's ``body``:
    the verdict, the error table with its column legend, step errors, decisions, and the
    cdf.png / step_error.png figures found in ``figures_dir``."""
    from reports.presentation.render import Bullets, Callout, Document, Heading, Image, Para, Table

    doc = Document(title)
    v = pd.DataFrame(body["verdict"])
    missed = v.loc[~v["met"].astype(bool), "target"].tolist()
    doc.add(Callout("every accuracy target met" if body["passed"] else
                    f"{len(missed)} of {len(v)} accuracy targets missed: {', '.join(missed)}",
                    "ok" if body["passed"] else "warning"))
    if body["notes"]:
        doc.add(Bullets(list(body["notes"])))
    shown = v.assign(limit_pct=[f"±{x:g}%" for x in v["limit_pct"]], err_pct=[_num(x, True) for x in v["err_pct"]],
                     met=["met" if x else "MISSED" for x in v["met"]])
    doc.add(Heading("Verdict"), Table(shown.rename(columns={"limit_pct": "limit", "err_pct": "err %"})))
    t = pd.DataFrame(body["table"])
    cols = {"live": "live", "sim": "sim", "err_pct": "err %", "replay": "replay", "cost_pct": "cost-curve %",
            "policy_pct": "policy %"}
    shown_t = pd.DataFrame({"metric": [f"{r.metric} ({r.unit})" for r in t.itertuples()],
                            **{label: [_num(x, c.endswith("pct")) for x in t[c]] for c, label in cols.items()
                               if c in t}})
    doc.add(Heading("Sim vs live"), Table(shown_t), Para("Columns:"), Bullets(list(COLUMN_LEGEND)))
    s, d = body["steps"], body["decisions"]
    step_rows = pd.DataFrame([{"steps": kind, "n": k["num_steps"], "median |err| %": round(k["median_abs_pct"], 1),
                               "p90 |err| %": round(k["p90_abs_pct"], 1), "mean signed %": round(k["mean_pct"], 1)}
                              for kind in ("all", "prefill", "decode", "mixed") if (k := s.get(kind))])
    b, h = s["busy_s"], s["host_ms"]
    busy = (f"Busy time: live {b['live_duration']:.2f} s of which forward {b['live_forward']:.2f} s; the profile "
            f"predicts {b['replay_predicted']:.2f} s for the same batches. Host time outside the forward pass "
            f"(scheduling, bookkeeping, clock catch-up): mean {h['mean']:.2f} ms, p99 {h['p99']:.2f} ms per step "
            f"({h['share_pct']:.1f}% of busy time; the simulator has none).")
    if s.get("cpu_per_forward_s") is not None:
        busy += (f" CPU seconds per forward-pass second: {s['cpu_per_forward_s']:.2f} (about the thread count "
                 f"when the cores were not shared); on the {s['unstarved']['num_steps']} steps not starved of "
                 f"CPU the median |error| is {s['unstarved']['median_abs_pct']:.1f}% (p90 "
                 f"{s['unstarved']['p90_abs_pct']:.1f}%).")
    doc.add(Heading("Per-step cost error (live batches: predicted vs measured forward time)"),
            Table(step_rows), Para(busy))
    doc.add(Heading("Decisions"), Para(f"{d['num_live_steps']} live steps, {d['num_sim_steps']} simulated; "
                                       f"{100 * d['identical_fraction']:.1f}% of step pairs (step i vs step i) "
                                       f"have identical batches."))
    f = d["first_divergence"]
    if f is None:
        doc.add(Para("The two runs made identical decisions at every step."))
    else:
        at = lambda v: "-" if v is None else f"{v:.4f} s"   # noqa: E731
        doc.add(Para(f"First divergence at step {f['step']} (live t = {at(f['live_t_s'])}, sim t = "
                     f"{at(f['sim_t_s'])}); items are req:new_tokens:context."),
                Bullets([f"live: `{_short(f['live_batch'])}`", f"sim: `{_short(f['sim_batch'])}`"]))
    pre = body["preemptions"]
    doc.add(Para(f"Preemptions: live {pre['live']}, sim {pre['sim']}."))
    for name, caption in (("cdf", "TTFT and ITL CDFs, live and simulated"),
                          ("step_error", "Per-step cost error, by step kind and over the run")):
        if figures_dir is not None and (figures_dir / f"{name}.png").is_file():
            doc.add(Image(figures_dir / f"{name}.png", caption))
    return doc


# ---- figures -----------------------------------------------------------------------------------
def cdf_figure(live: Run, sim: Run, title: str) -> Figure:
    """TTFT and ITL CDFs of both runs, overlaid."""
    return latency_cdfs({"live": (live.requests, live.tokens), "sim": (sim.requests, sim.tokens)},
                        title=title)


def step_error_figure(steps: pd.DataFrame, title: str) -> Figure:
    """Histogram of the per-step signed error % by step kind, and the error over time."""
    e = step_errors(steps)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.2), constrained_layout=True)
    lo, hi = np.nanpercentile(e["error_pct"], [0.5, 99.5]) if len(e) else (-1.0, 1.0)
    bins = np.linspace(min(lo, -5.0), max(hi, 5.0), 41)
    kinds = [k for k in ("decode", "prefill", "mixed") if (e["kind"] == k).any()]
    ax0.hist([e.loc[e["kind"] == k, "error_pct"].clip(bins[0], bins[-1]) for k in kinds], bins=bins,
             stacked=True, label=[f"{k} (n={(e['kind'] == k).sum()})" for k in kinds])
    med = float(e["error_pct"].median()) if len(e) else 0.0
    ax0.axvline(0, color="black", linewidth=1)
    ax0.axvline(med, color="crimson", linestyle="--", label=f"median {med:+.1f}%")
    ax0.set(xlabel="(predicted − measured) / measured (%)", ylabel="steps", title="Per-step cost error (tails clipped)")
    ax0.legend(fontsize=8)
    for k, sub in ((k, e[e["kind"] == k]) for k in kinds):
        ax1.scatter(sub["t_s"], sub["error_pct"], s=6, alpha=0.6, label=k)
    ax1.axhline(0, color="black", linewidth=1)
    ax1.set(ylim=(bins[0], bins[-1]), xlabel="step start (s)", ylabel="error (%)",
            title="Per-step error over the run")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8, markerscale=2)
    fig.suptitle(title, fontsize=13)
    return fig


# ---- server validation report (sim validate --server / --measured) ------------------------------
def server_report(body: Mapping[str, Any], cdf_png: Path) -> Document:
    """report.md / report.html of a server validation, from its report.json ``body`` alone."""
    from reports.presentation.render import Bullets, Callout, Document, Heading, Image, Para, Table

    v = pd.DataFrame(body["verdict"])
    missed = v.loc[~v["met"].astype(bool), "target"].tolist()
    doc = Document(f"Validation of {body['workload']} against a vLLM server")
    doc.add(Callout("every accuracy target met" if body["passed"] else
                    f"{len(missed)} of {len(v)} accuracy targets missed: {', '.join(missed)}",
                    "ok" if body["passed"] else "warning"))
    m = body["measured"]
    doc.add(Heading("Setup"), Bullets([
        f"workload `{body['workload_file']}`: {body['num_requests']} requests, {body['traffic']}",
        f"measured: {m['source']}, model `{m['model'] or 'unknown'}`"
        + ("" if m["arrivals_measured"] else " (**arrival times were not measured**: the workload's were used)"),
        f"simulated: policy `{body['policy']['kind']}`, profile `{body['profile']}`, "
        f"{body['num_blocks_simulated']} KV blocks"]))
    knobs = pd.DataFrame([{"knob": k, "value": d["value"], "from": d["source"]} for k, d in body["knobs"].items()])
    doc.add(Table(knobs, "Server knobs used by the simulator and where each came from"))
    if body.get("load"):
        ld = body["load"]
        doc.add(Heading("Machine load during the measurement"), Para(
            f"1/5/15-minute load average before: {' / '.join(f'{x:.2f}' for x in ld['before_1_5_15min'])}; "
            f"after: {' / '.join(f'{x:.2f}' for x in ld['after_1_5_15min'])}; 1-minute peak during: "
            f"{ld['max_1min_during']:.2f}; {ld['cpus']} CPUs. The server's speed moves with the load: "
            f"a load above the CPU count means it shared its cores."))
    else:
        doc.add(Heading("Machine load during the measurement"),
                Para("Not recorded: the measurement was taken elsewhere (a saved benchmark file)."))
    unit = ["pt" if x in POINT_METRICS else "%" for x in v["metric"]]
    shown = v.assign(limit_pct=[f"±{x:g}{u}" for x, u in zip(v["limit_pct"], unit)],
                     err_pct=[_num(x, True) for x in v["err_pct"]], met=["met" if x else "MISSED" for x in v["met"]])
    if "spread_pct" in v:
        shown = shown.assign(spread_pct=[f"{_num(x)}{u}" for x, u in zip(v["spread_pct"], unit)],
                             in_spread=["yes" if x else "no" for x in v["in_spread"]])
    doc.add(Heading("Verdict"), Para("err % = (simulated - measured) / measured (for a rate, in percentage "
                                     "points: pt); a target is met when |err %| <= its limit"
                                     + (", or when the simulated value lies inside the live runs' range."
                                        if "spread_pct" in v else ".")),
            Table(shown.rename(columns={"live": "measured", "sim": "simulated", "limit_pct": "limit",
                                        "err_pct": "err %", "spread_pct": "live spread",
                                        "in_spread": "sim inside it"})))
    if body.get("prefix_caching"):
        pc = body["prefix_caching"]
        on = lambda x: "unknown" if x is None else "on" if x else "off"   # noqa: E731
        doc.add(Para(f"Prefix caching: server {on(pc.get('server'))}, simulated {on(pc.get('simulated'))}."))
    t = pd.DataFrame(body["table"])
    t = t[[c for c in ("metric", "unit", "live", "sim", "err_pct", "live_min", "live_max", "spread_pct") if c in t]]
    t["err_pct"] = [_num(x, True) for x in t["err_pct"]]
    if "spread_pct" in t:
        t["spread_pct"] = [_num(x) for x in t["spread_pct"]]
    runs = body.get("repeat", 1)
    doc.add(Heading("All compared metrics"),
            *([Para(f"The server was measured {runs} times: measured is the median of the live runs, measured "
                    f"min / max their range and spread % its width over the median; a target is met when its "
                    f"error is within the limit or the simulated value lies inside that range.")]
              if runs > 1 else []),
            *([Para("The prefix-cache hit rate is hits / queries in tokens (the server's "
                    "vllm:prefix_cache_hits_total and vllm:prefix_cache_queries_total over the replay, new "
                    "requests only); its err is simulated - measured in percentage points.")]
              if HIT_RATE in set(t["metric"]) else []),
            Table(t.rename(columns={"live": "measured", "sim": "simulated", "err_pct": "err %",
                                    "live_min": "measured min", "live_max": "measured max",
                                    "spread_pct": "spread %"})))
    c, f, p = body["completed"], body["failed"], body["preemptions"]
    doc.add(Para(f"Completed: measured {c['live']}, simulated {c['sim']}; failed: measured {f['live']}, "
                 f"simulated {f['sim']}; preemptions: measured "
                 f"{'unknown' if p['live'] is None else p['live']}, simulated {p['sim']}."))
    if body["notes"]:
        doc.add(Heading("Notes"), Bullets(list(body["notes"])))
    doc.add(Heading("Latency distributions"), Image(cdf_png, "TTFT and ITL CDFs, measured and simulated"))
    return doc
