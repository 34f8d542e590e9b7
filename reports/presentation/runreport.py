"""The report of one run directory (summary.json, as ``sim.results.folder.write_run`` writes
it), and the pieces the sweep and plan reports share with it: saved figures,
reading runs back, the per-run figures and the provenance lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from reports.presentation import plots, runplots
from reports.presentation.render import Bullets, Callout, Document, Heading, Image, Para, Table, write_document
from reports.experiments.spec import flatten
from reports.experiments.sweep import offered_rate

KEY_METRICS = ("completed", "failed", "request_throughput", "output_throughput", "p50_ttft_ms", "p99_ttft_ms",
               "p50_itl_ms", "p99_itl_ms", "p99_tpot_ms", "num_preemptions", "mean_batch_size", "peak_kv_utilization")


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
    from sim.results.folder import read_run
    return {label: read_run(p) for label, p in run_dirs.items() if (p / "summary.json").is_file()}


def describe_runs(runs: dict[str, Any]) -> str:
    """``plots.describe`` of saved runs: the first run's workload, with every config value that
    differs between the runs shown as the values it takes, and their offered rates."""
    results = list(runs.values())
    flat = [{k: v for key, value in r.meta.get("config", {}).items() for k, v in flatten(key, value).items()}
            for r in results]
    for f, r in zip(flat, results):
        f["num_replicas"] = r.meta.get("num_replicas", 1)
    keys = [k for k in dict.fromkeys(k for f in flat for k in f) if k not in ("name", "source", "base_dir")]
    varied = {k: [f.get(k) for f in flat] for k in keys if len({json.dumps(f.get(k), default=str) for f in flat}) > 1}
    first = results[0]
    return plots.describe(first.meta.get("config", {}), profile_name=first.meta.get("profile_name"),
                          num_replicas=1 if "num_replicas" in varied else int(flat[0]["num_replicas"]),
                          rates_rps=[offered_rate(r.requests["arrival_s"]) for r in results], varied=varied)


def run_figures(figs: Figures, runs: dict[str, Any], *, prefix: str, slo_ttft_ms: float | None = None,
                slo_itl_ms: float | None = None, slots: bool = True,
                colors: dict[str, Any] | None = None) -> list[Image]:
    """CDFs across runs, slot occupancy of every run (if ``slots``) and the time line of the first run.

    ``colors``: run label -> colour, to match the sweep figures' series colours.
    """
    if not runs:
        return []
    subtitle = describe_runs(runs)
    images = [figs.save(runplots.latency_cdfs({k: (r.requests, r.tokens) for k, r in runs.items()},
                                              slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms, subtitle=subtitle,
                                              colors=colors),
                        f"{prefix}cdf",
                        "CDFs of time to first token (per request) and inter-token latency (per token)")]
    if slots:
        kinds = {k: (r.requests, r.tokens, r.meta.get("config", {}).get("policy", {}).get("kind", ""))
                 for k, r in runs.items()}
        images.append(figs.save(runplots.slot_occupancy(kinds, subtitle=subtitle), f"{prefix}slots",
                                "Batch slots over time (first replica of each run): idle slots show as gaps, slots "
                                "held by finished requests as dotted bars"))
    label, first = next(iter(runs.items()))
    if not len(first.steps):            # every request refused, or a measured run: no steps to draw
        return images
    images.append(figs.save(runplots.run_timeline(first.steps, title=f"Time line: {label}",
                                                  subtitle=describe_runs({label: first})), f"{prefix}timeline",
                            f"Time line of {label}: tokens computed per second (decode, prefill, padding stacked), "
                            f"requests running and waiting, KV-cache use"))
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
    from sim.results.folder import read_run
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
        doc.add(figs.save(plots.replica_balance(reps, title="Load across replicas", subtitle=describe_runs({"": run})),
                          "replicas", "Per-replica load"))
    doc.add(Heading("Figures"), *run_figures(figs, {cfg.get("name", d.name): run}, prefix="run_",
                                             slo_ttft_ms=slo.get("ttft_ms")))
    if run.prefix_cache is not None and "num_cached_tokens" in run.requests.columns:
        usable = int(run.meta.get("num_blocks", 0)) - 1          # vLLM v1's null block never caches
        doc.add(figs.save(runplots.prefix_cache_timeline(run.requests, run.prefix_cache, max(usable, 1),
                                                         title=f"Prefix cache: {cfg.get('name', d.name)}",
                                                         subtitle=describe_runs({"": run})),
                          "run_prefix_cache",
                          f"Prefix cache hit rate {100 * s.get('prefix_cache_hit_rate', 0):.1f}% over the run, "
                          f"and KV blocks in use vs free but still caching a prefix"))
    doc.add(Heading("Provenance"), Bullets(provenance_lines(run.meta, s)))
    return figs.written + write_document(doc, d)
