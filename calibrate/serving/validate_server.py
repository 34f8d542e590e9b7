"""`sim validate WORKLOAD --server URL | --measured FILE`: predict a real vLLM server, and say how well.

Measured: the workload replayed live against the server (exact arrival times
and lengths, each request asking for exactly its output length with
``ignore_eos``, token arrivals recorded as ``vllm bench serve`` records them),
or a saved ``vllm bench serve --save-detailed`` file. Simulated: the same
requests through ``run_workload`` with policy ``vllm_v1``, each knob from the
server if it exposes it, else the profile's ``engine`` mapping, else the
workload; it runs first, so a bad configuration costs no measuring. Only
``main`` and ``write_report`` write files. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from calibrate.serving.measured import Measurement, delivery_notes, client_run, measure_file, replay_table
from policies.vllm_v1 import VllmV1Config
from reports.presentation import validation as rv
from sim.run.config import ConfigError, WorkloadConfig, load_workload, parse_override, workload_from_dict
from sim.cost.profile import Profile, ProfileError, load_profile
from sim.run.runner import make_requests, run_workload
from sim.results.result import RunResult
from workloads.generate import generate

KNOBS = ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
ENGINE_KEYS = {"num_blocks": "num_gpu_blocks"}          # knob -> its name in a profile's engine mapping
POLICY_KNOBS = ("max_num_seqs", "max_num_batched_tokens")
MAX_SEND_LAG_S = 0.05      # a client that sent later than this behind schedule is worth a warning


# ---- configuration -------------------------------------------------------------------------------
def resolve_profile(cfg: WorkloadConfig, profile_arg: str | None) -> tuple[Profile, str | None, str]:
    """(profile, its file path or None for the workload's analytic profile, a line for the report)."""
    if profile_arg or cfg.profile.path:
        path = Path(profile_arg) if profile_arg else cfg.resolve_path(cfg.profile.path)
        where = "--profile" if profile_arg else f"{cfg.source}: field 'profile.path'"
        try:
            profile = load_profile(path)
        except ProfileError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return profile, str(path.resolve()), f"profile: {path} ({profile.name}, " \
                                             f"{profile.provenance.get('source', 'unknown')})"
    if "profile" not in cfg.raw:
        raise ConfigError(f"{cfg.source}: no profile: pass --profile PATH (from `sim calibrate --server URL "
                          f"--out PATH`) or set profile.path in the workload")
    from sim.run.runner import build_profile
    profile = build_profile(cfg)
    return profile, None, f"profile: the workload's {profile.name} ({profile.provenance.get('source', 'unknown')})"


def resolve_knobs(cfg: WorkloadConfig, profile: Profile, server: dict[str, Any] | None
                  ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Each knob's value, where it came from (server, profile engine, workload, default) and
    notes where the workload asked for another value than the one used."""
    values, sources, notes = {}, {}, []
    raw_server = cfg.raw.get("server") if isinstance(cfg.raw.get("server"), dict) else {}
    for knob in KNOBS:
        own = getattr(cfg.policy, knob, None) if knob in POLICY_KNOBS else raw_server.get(knob)
        found = [(src, v) for src, v in (("server", (server or {}).get(knob)),
                                         ("profile engine", profile.engine.get(ENGINE_KEYS.get(knob, knob))),
                                         ("workload", own)) if v is not None]
        values[knob], sources[knob] = (int(found[0][1]), found[0][0]) if found else (None, "default")
        if own is not None and values[knob] != own:
            notes.append(f"note: the workload's {knob} {own} is not the server's; {values[knob]} "
                         f"({sources[knob]}) is used")
    if values["block_size"] is None:
        values["block_size"], sources["block_size"] = cfg.server.block_size, "batchsim default"
    return values, sources, notes


def sim_workload(cfg: WorkloadConfig, knobs: dict[str, Any], profile_path: str | None,
                 trace_path: Path | None = None) -> WorkloadConfig:
    """``cfg`` with policy vllm_v1 (keeping the workload's own vllm_v1 knobs), the
    resolved knobs, the profile and, with ``trace_path``, the measured
    requests (arrival_time_s, prompt_tokens, output_tokens) instead of its own."""
    data = dict(cfg.raw)
    own = data.get("policy") if isinstance(data.get("policy"), dict) else {}
    v1 = {f.name for f in dataclasses.fields(VllmV1Config)} - {"kind"}
    policy = {"kind": "vllm_v1", **{k: v for k, v in own.items() if k in v1}}
    policy.update({k: knobs[k] for k in POLICY_KNOBS if knobs[k] is not None})
    server = dict(data.get("server") or {})
    server.update({k: knobs[k] for k in ("num_blocks", "block_size", "max_model_len") if knobs[k] is not None})
    data.update(policy=policy, server=server)
    if profile_path is not None:
        data["profile"] = {"path": profile_path}
    if trace_path is not None:
        for key in ("num_requests", "duration_s"):
            data.pop(key, None)
        data.update(arrivals={"kind": "trace", "path": str(trace_path)}, lengths={"kind": "trace"},
                    max_tokens="output")
    return workload_from_dict(data, cfg.source, cfg.base_dir)


def describe_traffic(cfg: WorkloadConfig) -> str:
    a = cfg.arrivals
    shape = {"poisson": "Poisson", "gamma": f"gamma CV {a.cv:g}"}.get(a.kind, a.kind)
    return f"{a.rate:g} req/s {shape}" if a.rate is not None else shape


# ---- measuring a server ---------------------------------------------------------------------------
def metric_total(url: str, name: str) -> float | None:
    """Sum of a Prometheus counter from the server's /metrics, or None if unreadable."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5.0) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values) if values else None


def _sample_load(stop: threading.Event, samples: list[float]) -> None:
    while not stop.wait(1.0):               # the 1-minute load average, once a second until stopped
        samples.append(os.getloadavg()[0])


def load_line(load: dict[str, Any]) -> str:
    b, a = load["before_1_5_15min"], load["after_1_5_15min"]
    return (f"machine load (1/5/15-min load average) before {b[0]:.2f}/{b[1]:.2f}/{b[2]:.2f}, after "
            f"{a[0]:.2f}/{a[1]:.2f}/{a[2]:.2f}, 1-min peak during {load['max_1min_during']:.2f}, on "
            f"{load['cpus']} CPUs (the server's speed moves with the load)")


def measure_server(cfg: WorkloadConfig, url: str, info: Any, vocab_size: int, max_model_len: int,
                   *, progress: bool = False) -> Measurement:
    """Replay ``cfg``'s requests against ``url`` in real time and tabulate what came back."""
    from calibrate.serving import client

    cap = getattr(cfg.arrivals, "max_concurrency", None)     # vllm bench serve --max-concurrency
    if cap and (getattr(cfg.arrivals, "think_time_s", None) or 0) > 0:
        raise ConfigError(f"{cfg.source}: field 'arrivals.think_time_s': a live replay has no think time "
                          f"(vllm bench serve sends as soon as a slot frees); remove it to validate")
    specs = generate(cfg)
    caps = [r.max_output_tokens for r in make_requests(cfg, specs, max_model_len)]
    out_tokens = np.minimum(specs.output_tokens, caps)
    schedule = [(float(t), client.prompt_ids(int(p), cfg.seed * 1_000_003 + i, vocab_size), int(o))
                for i, (t, p, o) in enumerate(zip(specs.arrival_s, specs.prompt_tokens, out_tokens))]
    preempt0 = metric_total(url, "vllm:num_preemptions_total")
    if progress:
        print(f"replaying {len(schedule)} requests against {url} over {specs.arrival_s[-1]:.1f} s",
              file=sys.stderr)
    def show(done: int, total: int) -> None:
        print(f"\rreplay: {done}/{total} requests done", end="\n" if done == total else "", file=sys.stderr,
              flush=True)

    before, samples, stop = os.getloadavg(), [], threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(stop, samples), daemon=True)
    sampler.start()
    try:
        results = client.run(client.replay(url, info.model, schedule, max_concurrency=cap,
                                           progress=show if progress else None))
    finally:
        stop.set()
        sampler.join()
    after = os.getloadavg()
    load = {"cpus": os.cpu_count(), "before_1_5_15min": list(before), "after_1_5_15min": list(after),
            "max_1min_during": max(samples, default=max(before[0], after[0]))}
    preempt1 = metric_total(url, "vllm:num_preemptions_total")
    offsets = np.array([s[0] for s in schedule])
    send = np.array([r.send_s for r in results])
    t0 = float(np.min(send - offsets))      # the least-delayed send was on time: the replay's zero
    lag = send - t0 - offsets
    run = client_run(results, t0, offsets, meta={"source": "server", "url": url, "model": info.model})
    run.summary["num_preemptions"] = (None if preempt0 is None or preempt1 is None
                                      else int(round(preempt1 - preempt0)))
    notes = [f"client send lag behind the schedule: p50 {np.median(lag) * 1e3:.1f} ms, p99 "
             f"{np.percentile(lag, 99) * 1e3:.1f} ms, max {lag.max() * 1e3:.1f} ms (TTFT is measured from "
             f"the actual send, as vllm bench serve does)"]
    if cap:
        notes.append(f"at most {cap} requests in flight: a request waits for a free slot, so sends lag the "
                     f"schedule by design")
    elif lag.max() > MAX_SEND_LAG_S:
        notes.append(f"warning: the client fell up to {lag.max() * 1e3:.0f} ms behind the schedule; the server "
                     f"saw slightly different arrivals than the simulator")
    failed = [r for r in results if r.error is not None]
    if failed:
        notes.append(f"warning: {len(failed)} requests failed on the server; first error: {failed[0].error}")
    host = urlparse(url)
    label = f"{host.hostname}_{host.port}" if host.port else str(host.hostname)
    return Measurement(run, f"server {url}", label, info.model, None, load, notes + delivery_notes(run))


# ---- the command ---------------------------------------------------------------------------------
def output_dir(out: str | None, name: str, label: str | None, *, say: bool = True) -> Path:
    """``out`` (default runs/validate-NAME-LABEL, without a second "validate-" when
    NAME starts with it); an existing non-empty folder gets a -2, -3, ... suffix, said on
    stderr (``say``) so that a script reading the folder it named is not handed an old report."""
    stem = name if name.startswith("validate") else f"validate-{name}"
    if label:
        stem += "-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
    base = Path(out) if out else Path("runs") / stem
    if out and base.exists() and not base.is_dir():
        from sim.run.config import ConfigError
        raise ConfigError(f"--out {out}: is a file; give a folder for the report")
    path, k = base, 1
    while path.exists() and (not path.is_dir() or any(path.iterdir())):
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    if say and path != base:
        print(f"note: {base}/ already holds files, so this report goes to {path}/ (--out DIR to choose)",
              file=sys.stderr)
    return path


def _server_info(url: str) -> Any:
    from calibrate.serving import client

    if not urlparse(url).scheme.startswith("http") or not urlparse(url).hostname:
        raise ConfigError(f"--server: expected a URL like http://127.0.0.1:8000, got {url!r}")
    try:
        return client.server_info(url)
    except Exception as exc:   # noqa: BLE001 - any failure to reach it is the user's input to fix
        raise ConfigError(f"--server {url}: no vLLM server answered ({type(exc).__name__}: {exc}); "
                          f"start one or check the URL") from None


@dataclass
class ServerValidation:
    """A measured run, its simulated twin, their error table and the verdict."""

    cfg: WorkloadConfig
    sim_cfg: WorkloadConfig
    measurement: Measurement
    sim: RunResult
    knobs: dict[str, Any]
    sources: dict[str, str]
    table: pd.DataFrame
    verdict: pd.DataFrame
    notes: list[str]

    @property
    def passed(self) -> bool:
        return bool(self.verdict["met"].all())

    def body(self) -> dict[str, Any]:
        """report.json: everything the report says, as plain data (``live`` = measured)."""
        m, ms, ss = self.measurement, self.measurement.run.summary, self.sim.summary
        return {
            "kind": "server-validation", "workload": self.cfg.name, "workload_file": self.cfg.source,
            "traffic": m.traffic or describe_traffic(self.cfg), "num_requests": len(m.run.requests),
            "measured": {"source": m.source, "model": m.model,
                         "arrivals_measured": bool(m.run.meta.get("arrivals_measured", True))},
            "policy": dataclasses.asdict(self.sim_cfg.policy), "profile": self.sim.meta.get("profile_name"),
            "knobs": {k: {"value": self.knobs[k], "source": self.sources[k]} for k in KNOBS},
            "num_blocks_simulated": self.sim.meta.get("num_blocks"), "load": m.load or None,
            "targets_pct": dict(zip(self.verdict["target"], self.verdict["limit_pct"])), "passed": self.passed,
            "verdict": self.verdict.replace({np.nan: None}).to_dict("records"),
            "table": self.table.replace({np.nan: None}).to_dict("records"),
            **{name: {"live": ms[key], "sim": ss[key]} for name, key in (
                ("completed", "completed"), ("failed", "failed"), ("preemptions", "num_preemptions"))},
            "notes": self.notes, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }


def validate_server(cfg: WorkloadConfig, *, profile: str | None = None, server: str | None = None,
                    measured: str | None = None, targets: dict[str, float] | None = None,
                    progress: bool = False) -> ServerValidation:
    """Simulate ``cfg`` as the vLLM server at ``server`` (then replay it there) or as
    the one that produced the benchmark file ``measured``; compare. Writes no file."""
    if bool(server) == bool(measured):
        raise ConfigError("sim validate: give exactly one of --server URL or --measured FILE")
    prof, profile_path, profile_line = resolve_profile(cfg, profile)
    notes = [profile_line]
    if cfg.policy.kind != "vllm_v1":
        notes.append(f"policy: the workload's {cfg.policy.kind} is replaced by vllm_v1, the scheduler of the "
                     f"vLLM server (v1 engine) being validated")
    info = _server_info(server) if server else None
    exposed = None if info is None else {
        "num_blocks": info.num_gpu_blocks, "block_size": info.block_size, "max_model_len": info.max_model_len,
        "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens}
    knobs, sources, knob_notes = resolve_knobs(cfg, prof, exposed)
    notes += knob_notes
    if info is not None and info.enable_prefix_caching:
        notes.append("warning: the server has prefix caching on; the simulator does not model it (the replayed "
                     "prompts are random token ids, so hits are rare)")
    calibrated_on = prof.engine.get("model") or prof.provenance.get("model_id")
    if info is not None and calibrated_on not in (None, info.model):
        notes.append(f"warning: the profile was calibrated on {calibrated_on!r}, the server serves {info.model!r}")
    if prof.engine.get("request_overhead_s"):
        notes.append(f"the simulator delays each request by the profile's per-request overhead "
                     f"{prof.engine['request_overhead_s'] * 1e3:.2f} ms (client to engine and back)")
    if measured:
        m = measure_file(cfg, measured)
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "replayed_requests.csv"
            replay_table(m.run).to_csv(trace, index=False)
            sim_cfg = sim_workload(cfg, knobs, profile_path, trace)
            sim = run_workload(sim_cfg)
    else:
        sim_cfg = sim_workload(cfg, knobs, profile_path)
        sim = run_workload(sim_cfg)            # first: a configuration error costs no measuring
        m = measure_server(sim_cfg, server, info, prof.model.vocab_size, sim.meta["max_model_len"],
                           progress=progress)
    notes += m.notes + ([load_line(m.load)] if m.load else [])
    table = rv.error_table(m.run.summary, sim.summary)
    verdict = rv.verdict(table, targets if targets is not None else rv.parse_targets(None))
    return ServerValidation(cfg, sim_cfg, m, sim, knobs, sources, table, verdict, notes)


def main(args: argparse.Namespace) -> int:
    """``sim validate WORKLOAD --server URL | --measured FILE``: prints the verdict; with
    ``--check``, exit status 1 when a target is missed."""
    cfg = load_workload(args.workload, dict(parse_override(t) for t in (getattr(args, "set", None) or [])))
    if args.out:
        output_dir(args.out, cfg.name, None, say=False)      # a file at --out is refused before the work
    v = validate_server(cfg, profile=args.profile, server=getattr(args, "server", None),
                        measured=getattr(args, "measured", None),
                        targets=rv.parse_targets(getattr(args, "targets", None)),
                        progress=not getattr(args, "quiet", False))
    m = v.measurement
    out = output_dir(args.out, cfg.name, m.label)          # absent or empty: all in it is this report's
    existed = out.exists()
    try:
        paths = write_report(out, v)
    except BaseException:               # interrupted or failed: no folder that looks like a report
        shutil.rmtree(out, ignore_errors=True)
        if existed:
            out.mkdir(exist_ok=True)
        raise
    print(f"{cfg.name}: {len(m.run.requests)} requests, {m.traffic or describe_traffic(cfg)}; measured: {m.source} "
          f"(model {m.model or 'unknown'}); simulated: policy vllm_v1")
    print("knobs: " + ", ".join(f"{k} {v.knobs[k] if v.knobs[k] is not None else '-'} ({v.sources[k]})"
                                for k in KNOBS))
    for n in v.notes:
        print(n)
    print(rv.format_table(v.table, labels={"live": "measured"}))
    print(rv.format_verdict(v.verdict))
    print(f"wrote {out}/ ({', '.join(p.name for p in paths)})")
    return 0 if v.passed or not getattr(args, "check", False) else 1


def write_report(out: Path, v: ServerValidation) -> list[Path]:
    """measured/ and sim/ run folders (and the replayed requests of a benchmark file),
    cdf.png/svg, report.json, report.md, report.html."""
    from reports.presentation.plots import save_figure
    from reports.presentation.render import write_document
    from reports.presentation.runplots import latency_cdfs
    from sim.results.folder import write_json, write_run

    m, body = v.measurement, v.body()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if m.source.startswith("file "):
        paths.append(out / "replayed_requests.csv")
        replay_table(m.run).to_csv(paths[-1], index=False)
        v.sim.meta["config"]["arrivals"]["path"] = str(paths[-1].resolve())
    m.run.meta.update(load=m.load or None, notes=m.notes)
    paths += [write_run(m.run, out / "measured"), write_run(v.sim, out / "sim")]
    model = Path(m.model).name if m.model and Path(m.model).is_absolute() else (m.model or "the server")
    title = f"{body['workload']}: {model} at {body['traffic']}"
    fig = latency_cdfs({"measured (vLLM)": (m.run.requests, m.run.tokens),
                        "simulated (batchsim vllm_v1)": (v.sim.requests, v.sim.tokens)}, title=title)
    paths += save_figure(fig, out / "cdf")
    write_json(out / "report.json", body)
    paths.append(out / "report.json")
    paths += write_document(rv.server_report(body, out / "cdf.png"), out)
    return paths

