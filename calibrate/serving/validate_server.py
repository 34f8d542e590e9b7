"""`sim validate WORKLOAD --server URL | --measured FILE`: predict a real serving engine, and say how well.

Measured: the workload replayed live against the server (exact arrival times
and lengths, each request asking for exactly its output length with
``ignore_eos``, token arrivals recorded as ``vllm bench serve`` records them),
or a saved ``vllm bench serve --save-detailed`` file. Simulated: the same
requests through ``run_workload`` with the policy of the server's engine
(``engines.ENGINES``: ``vllm_v1`` for vLLM and a server that says nothing,
``sglang`` for SGLang, ``tensorrt_llm`` for trtllm-serve; with ``--measured``,
the engine the profile was calibrated on), each knob from the server if it
exposes it, else the profile's ``engine`` mapping, else the workload; it runs
first, so a bad configuration costs no measuring, and a policy this batchsim
does not have is refused before anything else. Only
``main`` and ``write_report`` write files. Torch-free.

Prefix caching. Replayed prompts are the requests' contents made token ids
(``calibrate.serving.content``): equal (key, offset) pairs are equal ids, so
the server sees exactly the sharing the simulator models; a fresh salt per
replay keeps it from hitting what an earlier replay left cached. A request
whose prompt holds an earlier request's output (a session's next turn) is
sent a think time after that reply, its prompt holding the ids the server
generated there. The simulated policy's ``enable_prefix_caching`` follows
the server's (a note says when that overrides the workload); with it on, the
table gains the prefix-cache hit rate, hits / queries in tokens: the growth
of the server's ``vllm:prefix_cache_hits_total`` / ``_queries_total`` over
the replay against the simulated pool's counts, its error in percentage
points, target ``hit_rate`` 3 points.

``--repeat N`` replays N times (the simulation, deterministic, runs once):
the table compares the medians and gives each metric's live range and its
width; a target is met when its error is within the limit or the simulated
value lies inside the live range (``reports.presentation.validation.verdict``).
With one run (the default) the table and verdict have no spread columns.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from calibrate.serving.engines import ENGINES, prefix_caching_of, require_policy
from calibrate.serving.measured import Measurement, delivery_notes, client_run, measure_file, replay_table
from policies.vllm_v1 import VllmV1Config
from reports.presentation import validation as rv
from sim.run.config import ConfigError, WorkloadConfig, load_workload, parse_override, workload_from_dict
from sim.cost.profile import Profile, ProfileError, load_profile
from sim.run.runner import make_requests, run_workload
from sim.results.result import RunResult
from workloads.generate import RequestSpecs, generate

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


def sim_policy(cfg: WorkloadConfig, knobs: dict[str, Any], prefix_caching: bool | None = None, *,
               engine: str = "vllm", engine_knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``policy`` section that simulates ``engine`` (``engines.policy_for``): its
    policy kind, the workload's own knobs of that policy, then the resolved knobs
    (vLLM: ``knobs``' max_num_seqs and max_num_batched_tokens; another engine: its own,
    ``engine_knobs`` under its names), then ``prefix_caching`` as the engine's switch
    unless None. ConfigError when the engine's policy is not in this batchsim."""
    from calibrate.serving.engines import ENGINES, policy_for
    from policies import POLICIES

    own = cfg.raw.get("policy") if isinstance(cfg.raw.get("policy"), dict) else {}
    policy = policy_for(engine, {})
    fields = {f.name for f in dataclasses.fields(POLICIES[policy["kind"]][0])} - {"kind"}
    policy.update({k: v for k, v in own.items() if k in fields})
    if ENGINES.get(engine, ENGINES["unknown"]).policy == "vllm_v1":
        policy.update({k: knobs[k] for k in POLICY_KNOBS if knobs[k] is not None})
    else:
        policy.update(policy_for(engine, engine_knobs or {}))
    return {**policy, **policy_for(engine, {}, prefix_caching)}


def sim_workload(cfg: WorkloadConfig, knobs: dict[str, Any], profile_path: str | None,
                 trace_path: Path | None = None, prefix_caching: bool | None = None, *,
                 engine: str = "vllm", engine_knobs: dict[str, Any] | None = None) -> WorkloadConfig:
    """``cfg`` with the policy of ``engine`` (``sim_policy``), the resolved server
    knobs, the profile and, with ``trace_path``, the measured requests
    (arrival_time_s, prompt_tokens, output_tokens) instead of its own."""
    data = dict(cfg.raw)
    policy = sim_policy(cfg, knobs, prefix_caching, engine=engine, engine_knobs=engine_knobs)
    server = dict(data.get("server") or {})
    server.update({k: knobs[k] for k in ("num_blocks", "block_size", "max_model_len") if knobs[k] is not None})
    # A field the engine's policy does not read (its page is a knob of its own) stays out of the workload.
    from policies import POLICIES
    unread = POLICIES[policy["kind"]][1].server_knobs
    server = {k: v for k, v in server.items() if k not in unread}
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
COUNTERS = {"preemptions": "vllm:num_preemptions_total", "queries": "vllm:prefix_cache_queries_total",
            "hits": "vllm:prefix_cache_hits_total"}
COUNTER_SETTLE_S = 0.25    # the engine's last stats reach /metrics just after the last reply


def metric_total(url: str, name: str) -> float | None:
    """Sum of a Prometheus counter from the server's /metrics, or None if unreadable."""
    from calibrate.serving.client import metric_totals
    return metric_totals(url, [name])[name]


def _sample_load(stop: threading.Event, samples: list[float]) -> None:
    while not stop.wait(1.0):               # the 1-minute load average, once a second until stopped
        samples.append(os.getloadavg()[0])


def load_line(load: dict[str, Any]) -> str:
    b, a = load["before_1_5_15min"], load["after_1_5_15min"]
    return (f"machine load (1/5/15-min load average) before {b[0]:.2f}/{b[1]:.2f}/{b[2]:.2f}, after "
            f"{a[0]:.2f}/{a[1]:.2f}/{a[2]:.2f}, 1-min peak during {load['max_1min_during']:.2f}, on "
            f"{load['cpus']} CPUs (the server's speed moves with the load)")


def model_config(info: Any) -> dict[str, Any]:
    """The served model's config.json when its folder (``/v1/models``' root) is readable here, else {}."""
    import json

    root = next((m.get("root") for m in ((info.raw or {}).get("models") or {}).get("data", [])), None)
    try:
        cfg = json.loads((Path(root) / "config.json").read_text()) if root else {}
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def special_ids(info: Any) -> set[int]:
    """Ids a replayed prompt leaves out: 0-2 (the tiny model's unk, bos, eos) and the
    bos / eos / pad ids of the served model's config.json (``model_config``)."""
    out = {0, 1, 2}
    cfg = model_config(info)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = cfg.get(key)
        out.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return out


def hit_rate(queries: float | None, hits: float | None) -> float | None:
    """hits / queries (tokens), None when either is unknown or nothing was queried."""
    return None if queries is None or hits is None or queries <= 0 else hits / queries


def sim_prefix_counts(result: RunResult) -> tuple[int, int]:
    """(queries, hits) of a simulated run as vLLM counts them for new requests: the
    pool's own counters (``PrefixCachePool.record_lookup``, in the summary) when the
    run cached prefixes; without a cache, every admitted request's prompt queried
    (it has no outputs yet at its first admission) and nothing hit."""
    s = result.summary
    if "prefix_cache_queries" in s:
        return int(s["prefix_cache_queries"]), int(s["prefix_cache_hits"])
    cols = result.table.cols
    admitted = ~np.isnan(cols["first_scheduled_s"])
    return int(cols["prompt_tokens"][admitted].sum()), 0


def replay_tokens(cfg: WorkloadConfig, specs: RequestSpecs, max_model_len: int) -> np.ndarray:
    """The output tokens the replay asks for, request by request (max_tokens = min_tokens =
    this): the true output, within the client's max_tokens. Under a policy that cuts max_tokens
    to the context as vLLM's server does (``clamps_max_tokens``: vllm_v1, SchedulerState's
    clamp_max_tokens), also within what the context leaves, except for a request that the
    server and the simulation both refuse (a prompt of max_model_len or more, a max_tokens
    above it), which goes out as it is (the server would refuse min_tokens above its cut)."""
    caps = np.asarray([r.max_output_tokens for r in make_requests(cfg, specs, max_model_len)], dtype=np.int64)
    out_tokens = np.minimum(np.asarray(specs.output_tokens, dtype=np.int64), caps)
    from policies import POLICIES
    if not POLICIES[cfg.policy.kind][1].clamps_max_tokens:
        return out_tokens
    prompts = np.asarray(specs.prompt_tokens, dtype=np.int64)
    cut = (prompts < max_model_len) & (caps <= max_model_len)
    return np.where(cut, np.minimum(out_tokens, max_model_len - prompts), out_tokens)


def measure_server(cfg: WorkloadConfig, url: str, info: Any, vocab_size: int, max_model_len: int,
                   *, progress: bool = False, specs: RequestSpecs | None = None,
                   think_time_s: float | None = None, salt: int | None = None) -> Measurement:
    """Replay ``cfg``'s requests (``specs``: these instead) against ``url`` in real
    time and tabulate what came back.

    Prompt ids come from the requests' contents (``calibrate.serving.content``;
    a fresh ``salt`` per replay unless given, so no replay hits what an earlier
    one cached). A request whose prompt holds an earlier one's output (a
    session's next turn) is sent ``think_time_s`` (default: the workload's
    ``arrivals.think_time_s`` if it has one, else 0) after that reply, with the
    ids the server generated for it; the others at their arrival offsets. The
    server's preemption and prefix-cache counters are read before and after:
    their growth is the run's ``num_preemptions``, ``prefix_cache_queries`` and
    ``prefix_cache_hits`` (None where unreadable)."""
    from calibrate.serving import client
    from calibrate.serving.content import ReplayPlan, fresh_salt

    specs = generate(cfg) if specs is None else specs
    cap = getattr(cfg.arrivals, "max_concurrency", None)     # vllm bench serve --max-concurrency
    think = float(getattr(cfg.arrivals, "think_time_s", 0.0) or 0.0) if think_time_s is None else think_time_s
    if vocab_size <= 3:
        raise ConfigError(f"{cfg.source}: the model's vocab_size is {vocab_size}, too few ids for a replayed "
                          f"prompt (the profile's model shape is a placeholder?); recalibrate with --model-config "
                          f"(the model's config.json) or pass a profile whose model shape is known")
    plan = ReplayPlan.of_requests(specs.contents, specs.prompt_tokens, vocab_size,
                                  fresh_salt() if salt is None else salt, special_ids(info))
    follows = [bool(w) for w in plan.waits_for]
    if cap and think > 0 and not any(follows):
        raise ConfigError(f"{cfg.source}: field 'arrivals.think_time_s': a live replay has no think time "
                          f"(vllm bench serve sends as soon as a slot frees); remove it to validate")
    out_tokens = replay_tokens(cfg, specs, max_model_len)
    schedule = [(float(t), [] if follows[i] else plan.prompt(i), int(o))
                for i, (t, o) in enumerate(zip(specs.arrival_s, out_tokens))]

    def prompt_at_send(i: int, results: list[Any]) -> list[int]:
        if not follows[i]:
            return schedule[i][1]
        return plan.prompt(i, [r.token_ids if r is not None else None for r in results])

    counters0 = client.metric_totals(url, COUNTERS.values())
    if progress:
        print(f"replaying {len(schedule)} requests against {url} over {specs.arrival_s[-1]:.1f} s"
              + (f" ({sum(follows)} of them next turns, sent {think:g} s after the reply they hold)"
                 if any(follows) else ""), file=sys.stderr)
    def show(done: int, total: int) -> None:
        print(f"\rreplay: {done}/{total} requests done", end="\n" if done == total else "", file=sys.stderr,
              flush=True)

    before, samples, stop = os.getloadavg(), [], threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(stop, samples), daemon=True)
    sampler.start()
    try:
        results = client.run(client.replay(url, info.model, schedule, max_concurrency=cap,
                                           progress=show if progress else None, waits_for=plan.waits_for,
                                           think_time_s=think, prompt_at_send=prompt_at_send,
                                           return_token_ids=plan.wants_ids))
    finally:
        stop.set()
        sampler.join()
    after = os.getloadavg()
    load = {"cpus": os.cpu_count(), "before_1_5_15min": list(before), "after_1_5_15min": list(after),
            "max_1min_during": max(samples, default=max(before[0], after[0]))}
    time.sleep(COUNTER_SETTLE_S)
    counters1 = client.metric_totals(url, COUNTERS.values())
    grown = {key: None if counters0[name] is None or counters1[name] is None
             else int(round(counters1[name] - counters0[name])) for key, name in COUNTERS.items()}
    offsets = np.array([s[0] for s in schedule])
    send = np.array([r.send_s for r in results])
    free = ~np.array(follows)
    t0 = float(np.min((send - offsets)[free])) if free.any() else float(np.min(send))  # least-delayed: on time
    scheduled = np.array([r.scheduled_s - t0 if f else off for r, f, off in zip(results, follows, offsets)])
    lag = send - t0 - scheduled
    run = client_run(results, t0, scheduled, meta={"source": "server", "url": url, "model": info.model,
                                                   "salt": plan.salt})
    run.summary["num_preemptions"] = grown["preemptions"]
    if info.enable_prefix_caching is not False:
        run.summary.update(prefix_cache_queries=grown["queries"], prefix_cache_hits=grown["hits"],
                           prefix_cache_hit_rate=hit_rate(grown["queries"], grown["hits"]))
    notes = [f"client send lag behind the schedule: p50 {np.median(lag) * 1e3:.1f} ms, p99 "
             f"{np.percentile(lag, 99) * 1e3:.1f} ms, max {lag.max() * 1e3:.1f} ms (TTFT is measured from "
             f"the actual send, as vllm bench serve does)"]
    if any(follows):
        notes.append(f"sessions: {sum(follows)} requests are next turns, each sent {think:g} s after the reply "
                     f"its prompt holds (the ids the server generated there), the other {int(free.sum())} at "
                     f"their arrival offsets")
    if plan.fallbacks:
        notes.append(f"warning: {len(plan.fallbacks)} prompt runs took the simulator's ids where the server's "
                     f"were wanted (first: {plan.fallbacks[0]})")
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


def engine_of(info: Any, profile: Profile) -> str:
    """The engine being validated: the server's (a server that says nothing is vLLM, as
    before); without a server, the one the profile was calibrated on, else vLLM."""
    kind = getattr(info, "engine_kind", None) if info is not None else profile.engine.get("engine_kind")
    return "vllm" if kind in (None, "unknown") or kind not in ENGINES else str(kind)


def _server_info(url: str) -> Any:
    from calibrate.serving import client

    if not urlparse(url).scheme.startswith("http") or not urlparse(url).hostname:
        raise ConfigError(f"--server: expected a URL like http://127.0.0.1:8000, got {url!r}")
    try:
        return client.server_info(url)
    except Exception as exc:   # noqa: BLE001 - any failure to reach it is the user's input to fix
        raise ConfigError(f"--server {url}: no server answered ({type(exc).__name__}: {exc}); "
                          f"start one or check the URL") from None


@dataclass
class ServerValidation:
    """Measured runs (one per ``--repeat``), their simulated twin(s), the error table and the verdict.

    ``measurement`` and ``sim`` are the first of ``measurements`` and ``sims``
    (one sim unless it was re-run on each measurement's send times)."""

    cfg: WorkloadConfig
    sim_cfg: WorkloadConfig
    measurement: Measurement
    sim: RunResult
    knobs: dict[str, Any]
    sources: dict[str, str]
    table: pd.DataFrame
    verdict: pd.DataFrame
    notes: list[str]
    measurements: list[Measurement] = dataclasses.field(default_factory=list)
    sims: list[RunResult] = dataclasses.field(default_factory=list)
    prefix_caching: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: str = "vllm"                     # engines.ENGINE_KINDS: what was validated

    def __post_init__(self) -> None:
        self.measurements = self.measurements or [self.measurement]
        self.sims = self.sims or [self.sim]

    @property
    def passed(self) -> bool:
        return bool(self.verdict["met"].all())

    def body(self) -> dict[str, Any]:
        """report.json: everything the report says, as plain data (``live`` = measured; with
        repeats, the medians, and each live run under ``live_runs``)."""
        m, ms, ss = self.measurement, self.measurement.run.summary, self.sim.summary
        body = {
            "kind": "server-validation", "engine": self.engine, "workload": self.cfg.name,
            "workload_file": self.cfg.source,
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
        if self.prefix_caching:
            body["prefix_caching"] = dict(self.prefix_caching)
        if len(self.measurements) > 1:
            keys = [k for k, _ in rv.metric_keys()] + [rv.HIT_RATE, "prefix_cache_queries", "prefix_cache_hits",
                                                        "completed", "failed", "num_preemptions"]
            body["repeat"] = len(self.measurements)
            body["live_runs"] = [{"load": x.load or None, **{k: x.run.summary.get(k) for k in keys
                                                             if k in x.run.summary}} for x in self.measurements]
        return body


def simulate_workload(cfg: WorkloadConfig, specs: RequestSpecs | None = None) -> RunResult:
    """``cfg`` simulated: on its prefill and decode pools when it has a ``disaggregation``
    section (``sim.run.disagg``; the server validated is then the proxy in front of them), else
    on one server."""
    if cfg.disaggregation is not None:
        from sim.run.disagg import run_disaggregated
        return run_disaggregated(cfg, specs=specs)
    return run_workload(cfg, specs=specs)


def with_prefix_counts(sim: RunResult) -> RunResult:
    """``sim`` with its prefix-cache queries, hits and hit rate in the summary
    (``sim_prefix_counts``), as the measured side has them from the server."""
    queries, hits = sim_prefix_counts(sim)
    sim.summary.update(prefix_cache_queries=queries, prefix_cache_hits=hits,
                       prefix_cache_hit_rate=hit_rate(queries, hits))
    return sim


def sends_specs(m: Measurement, specs: RequestSpecs) -> RequestSpecs:
    """``specs`` arriving when the measured run sent them (first send = 0), in send order."""
    arrival = m.run.requests["arrival_s"].to_numpy(dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    return RequestSpecs(arrival[order] - arrival[order[0]], specs.prompt_tokens[order], specs.output_tokens[order],
                        0, specs.max_tokens[order] if specs.max_tokens is not None else None,
                        specs.contents.take(order) if specs.contents is not None else None)


def _vocab_size(info: Any, prof: Profile) -> int:
    """The served model's vocabulary: its config.json's (``model_config``), else the profile's model's."""
    value = model_config(info).get("vocab_size")
    return int(value) if isinstance(value, int) and value > 0 else int(prof.model.vocab_size)


def validate_server(cfg: WorkloadConfig, *, profile: str | None = None, server: str | None = None,
                    measured: str | None = None, targets: dict[str, float] | None = None,
                    progress: bool = False, repeat: int = 1, specs: RequestSpecs | None = None,
                    think_time_s: float | None = None, sim_on_sends: bool = False) -> ServerValidation:
    """Simulate ``cfg`` as the vLLM server at ``server`` (then replay it there
    ``repeat`` times) or as the one that produced the benchmark file
    ``measured``; compare. Writes no file.

    ``specs``: replay and simulate these requests (hand-built contents) instead
    of the workload's; ``think_time_s``: a next turn's pause (``measure_server``).
    Prefix caching: the simulated policy's ``enable_prefix_caching`` follows the
    server's when it says (a note tells where that changed the workload's);
    with it on, the server's prefix-cache hit rate (its counters' growth over
    each replay) is compared with the simulated one (``hits / queries``), in
    percentage points, with target ``hit_rate`` (3 points unless ``targets``
    set it). ``repeat``: N live replays; the table compares the medians and
    gives the live range beside them, and a target is met within its limit or
    inside that range (``rv.verdict``). ``sim_on_sends``: simulate each replay
    again with the requests arriving when they were sent live: both sides see
    the same arrivals, so what differs is the server, not the send times the
    simulator predicts (for sessions, ``sim.loop.feed.SessionFeed`` predicts them
    by default)."""
    if bool(server) == bool(measured):
        raise ConfigError("sim validate: give exactly one of --server URL or --measured FILE")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"--repeat must be a whole number >= 1, got {repeat!r}")
    if measured and repeat > 1:
        raise ConfigError(f"--repeat {repeat}: a saved benchmark file (--measured) is one measurement; "
                          f"--repeat needs --server")
    prof, profile_path, profile_line = resolve_profile(cfg, profile)
    notes = [profile_line]
    info = _server_info(server) if server else None
    engine = engine_of(info, prof)
    spec = require_policy(engine)            # a policy this batchsim lacks: one line, before any work
    if cfg.policy.kind != spec.policy:
        notes.append(f"policy: the workload's {cfg.policy.kind} is replaced by {spec.policy}, the scheduler of the "
                     f"{spec.label} server being validated")
    engine_knobs = {**{k: prof.engine[k] for k in spec.policy_knobs if prof.engine.get(k) is not None},
                    **({} if info is None else info.engine_knobs)}
    exposed = None if info is None else {
        "num_blocks": info.num_gpu_blocks, "block_size": info.block_size, "max_model_len": info.max_model_len,
        "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens}
    knobs, sources, knob_notes = resolve_knobs(cfg, prof, exposed)
    notes += knob_notes
    own_caching = prefix_caching_of(cfg.policy)
    own_caching = VllmV1Config().enable_prefix_caching if own_caching is None else own_caching
    server_caching = None if info is None else info.enable_prefix_caching
    if server_caching is not None and server_caching != own_caching:
        notes.append(f"note: the server has prefix caching {'on' if server_caching else 'off'}, the workload's "
                     f"policy {'on' if own_caching else 'off'}; the simulation follows the server "
                     f"(enable_prefix_caching: {str(server_caching).lower()})")
    calibrated_on = prof.engine.get("model") or prof.provenance.get("model_id")
    if info is not None and calibrated_on not in (None, info.model):
        notes.append(f"warning: the profile was calibrated on {calibrated_on!r}, the server serves {info.model!r}")
    if prof.engine.get("request_overhead_s"):
        notes.append(f"the simulator delays each request by the profile's per-request overhead "
                     f"{prof.engine['request_overhead_s'] * 1e3:.2f} ms (client to engine and back)")
    caching = {}
    if measured:
        m = measure_file(cfg, measured)
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "replayed_requests.csv"
            replay_table(m.run).to_csv(trace, index=False)
            sim_cfg = sim_workload(cfg, knobs, profile_path, trace, engine=engine, engine_knobs=engine_knobs)
            sim = simulate_workload(sim_cfg)
        ms, sims = [m], [sim]
    else:
        if sim_on_sends and cfg.arrivals.max_concurrency is not None:
            raise ConfigError(f"{cfg.source}: field 'arrivals.max_concurrency': a closed loop cannot be "
                              f"simulated on the measured send times (they hold the cap already)")
        specs = generate(cfg) if specs is None else specs
        sim_cfg = sim_workload(cfg, knobs, profile_path, prefix_caching=server_caching, engine=engine,
                               engine_knobs=engine_knobs)
        sim_caching = bool(prefix_caching_of(sim_cfg.policy))
        simulate = (lambda sp: with_prefix_counts(simulate_workload(sim_cfg, sp)) if sim_caching
                    else simulate_workload(sim_cfg, sp))
        sim = simulate(specs)                  # first: a configuration error costs no measuring
        vocab = _vocab_size(info, prof)
        ms, sims = [], []
        for k in range(repeat):
            if progress and repeat > 1:
                print(f"live run {k + 1} of {repeat}", file=sys.stderr, flush=True)
            ms.append(measure_server(sim_cfg, server, info, vocab, sim.meta["max_model_len"], progress=progress,
                                     specs=specs, think_time_s=think_time_s))
            if sim_on_sends:
                sims.append(simulate(sends_specs(ms[-1], specs)))
        if sim_on_sends:
            notes.append(f"the simulated side{'s' if repeat > 1 else ''} replay{'' if repeat > 1 else 's'} the "
                         f"measured send times (sim_on_sends), not the workload's arrivals")
        sim = sims[0] if sims else sim
        sims = sims or [sim]
        caching = {"server": server_caching, "simulated": sim_caching}
        if sim_caching or server_caching:
            caching.update(live=[{k: x.run.summary.get(f"prefix_cache_{k}") for k in ("queries", "hits", "hit_rate")}
                                 for x in ms],
                           sim=[{k: x.summary.get(f"prefix_cache_{k}") for k in ("queries", "hits", "hit_rate")}
                                for x in sims])
            if any(x.run.summary.get("prefix_cache_queries") is None for x in ms):
                notes.append("warning: the server's prefix-cache counters (/metrics) could not be read, so its hit "
                             "rate is unknown")
    m = ms[0]
    for k, x in enumerate(ms):
        tag = f"live run {k + 1}: " if len(ms) > 1 else ""
        notes += [tag + n for n in x.notes if not k or n.startswith("warning")]
        notes += [tag + load_line(x.load)] if x.load else []
    table = rv.repeat_table([x.run.summary for x in ms], [x.summary for x in sims])
    chosen = dict(targets if targets is not None else rv.parse_targets(None))
    hit_row = table.loc[table["metric"] == rv.HIT_RATE]
    if len(hit_row) and np.isfinite(hit_row["err_pct"].iloc[0]):
        for name, (_, limit) in rv.OPTIONAL_TARGETS.items():
            chosen.setdefault(name, limit)
    verdict = rv.verdict(table, chosen)
    return ServerValidation(cfg, sim_cfg, m, sim, knobs, sources, table, verdict, notes, ms, sims, caching, engine)


def main(args: argparse.Namespace) -> int:
    """``sim validate WORKLOAD --server URL | --measured FILE``: prints the verdict; with
    ``--check``, exit status 1 when a target is missed."""
    cfg = load_workload(args.workload, dict(parse_override(t) for t in (getattr(args, "set", None) or [])))
    if args.out:
        output_dir(args.out, cfg.name, None, say=False)      # a file at --out is refused before the work
    v = validate_server(cfg, profile=args.profile, server=getattr(args, "server", None),
                        measured=getattr(args, "measured", None),
                        targets=rv.parse_targets(getattr(args, "targets", None)),
                        progress=not getattr(args, "quiet", False), repeat=getattr(args, "repeat", None) or 1)
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
          f"(model {m.model or 'unknown'}, {ENGINES[v.engine].label}); simulated: policy {v.sim_cfg.policy.kind}")
    print("knobs: " + ", ".join(f"{k} {v.knobs[k] if v.knobs[k] is not None else '-'} ({v.sources[k]})"
                                for k in KNOBS))
    for n in v.notes:
        print(n)
    print(rv.format_table(v.table, labels={"live": "measured"}))
    print(rv.format_verdict(v.verdict))
    print(f"wrote {out}/ ({', '.join(p.name for p in paths)})")
    return 0 if v.passed or not getattr(args, "check", False) else 1


def write_report(out: Path, v: ServerValidation) -> list[Path]:
    """measured/ and sim/ run folders (with --repeat, measured-2/ ... for the other live
    runs, and sim-2/ ... when each had a simulation of its own; the replayed requests of a
    benchmark file), cdf.png/svg (the first live run), report.json, report.md, report.html."""
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
    for k, extra in enumerate(v.measurements[1:], start=2):            # --repeat: the other runs
        extra.run.meta.update(load=extra.load or None, notes=extra.notes)
        paths.append(write_run(extra.run, out / f"measured-{k}"))
        if len(v.sims) >= k:
            paths.append(write_run(v.sims[k - 1], out / f"sim-{k}"))
    model = Path(m.model).name if m.model and Path(m.model).is_absolute() else (m.model or "the server")
    title = f"{body['workload']}: {model} at {body['traffic']}"
    fig = latency_cdfs({f"measured ({ENGINES[v.engine].label})": (m.run.requests, m.run.tokens),
                        f"simulated (batchsim {v.sim_cfg.policy.kind})": (v.sim.requests, v.sim.tokens)},
                       title=title)
    paths += save_figure(fig, out / "cdf")
    write_json(out / "report.json", body)
    paths.append(out / "report.json")
    paths += write_document(rv.server_report(body, out / "cdf.png"), out)
    return paths

