"""``sim calibrate --server URL``: a profile of a running vLLM server, measured from outside; torch-free.

Method. The server's facts come first (``client.server_info``: model length,
KV blocks and block size, prefix caching, and the scheduler knobs when the
server is in dev mode; which engine it is, vLLM, SGLang or TensorRT-LLM, and
that engine's own knobs, ``engines``: the profile's ``engine`` mapping keeps
them under the engine's names beside the batchsim keys, and a server whose
engine's policy is not in this batchsim is refused before any probe);
``--max-num-seqs`` / ``--max-num-batched-tokens`` override them, and a knob
neither gives is inferred by probing
(``probes.infer_knobs``: the token budget is one plus the largest prompt that
joins one decoding request in a single step, found by bisection on whether
the step before its first token grew; ``max_num_seqs`` is how many of M
simultaneous requests decode together, M = 64, 256, 1024). The profile's
``engine.knob_source`` says which. Then probe traffic whose batch
composition is known is sent in passes (designs in random order, cheap core
designs first, more designs and repeats as the budget allows), every request
with an exact ``max_tokens`` and ``ignore_eos``:

- ``A``: one request alone, over a grid of prompt lengths (chunked past the
  token budget): its time to first token is ``overhead + the steps of its
  chunks``; its decode gaps are batch-1 steps;
- ``B``: k equal requests at once: once all have their first token, every step
  is k decodes whose contexts are known;
- ``C``: k long-running decoders joined, one group at a time, by prompts of
  many sizes (``max_tokens`` 1): each join is a mixed step (k decodes + a
  chunk), a long prompt a run of chunk steps, a group several chunks in one
  step (a long prompt's last chunk beside a new one, too).
- ``D``: random traffic (``traffic``: Poisson arrivals, log-uniform lengths)
  at 60% and 85% of the capacity a first fit predicts: busy batches of every
  size whose requests join and leave all the time, so the costs a real
  workload meets (a request's first decode, finishing, the front end busy
  with arrivals) enter the fit where the steps' composition is certain.

``probes.analyse`` turns the token timelines into equations (one step's gap,
a window of decode gaps, or a whole time to first token); repeats of a design
are averaged (``STATISTIC``) and all are fitted jointly
(``calibrate.fit.fit_curves``: relative error, Huber re-weighting, monotone
curves) together with the per-request overhead (client send to engine queue
plus engine output to client), which only times to first token contain.
That overhead is stored as ``engine.request_overhead_s``; ``sim run`` delays
each request by it before the server sees it. The same overhead bounded from
prompts that joined a busy engine is stored beside it
(``request_overhead_busy_s``, for information).

Prefix caching: a cache hit would skip the prefill a probe times, so every
probe prompt starts with a tag of its own (``probes.HttpTransport``: a
calibration's prompts differ within their first ``tag_length`` tokens, 3-5
for real vocabularies, fewer than any KV block holds). The server's
``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
are read before and after; their growth is stored in
``provenance.prefix_cache`` (hits should be 0; a warning says otherwise).

Self-check (held out, after the fit): fresh random traffic of the same kind,
at about 50% and 80% of the capacity the fitted profile predicts, is
replayed against the server and simulated with
``sim.run.runner.run_workload`` (the engine's policy, ``vllm_v1`` for vLLM,
and the server's knobs); the errors of throughput and of TTFT and ITL p50 / p99 are printed and stored in
the profile's ``fit_error``. The whole run, self-check included, stays within
``budget_s`` (plus one design's overrun at most).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from calibrate.fit import CurveGrid, fit_curves
from calibrate.serving.engines import require_policy
from calibrate.serving.probes import (Costs, Equation, HttpTransport, Knobs, Sent, Session, Transport, analyse,
                                      combine, infer_knobs, model_facts, read_server, stab)
from sim.run.config import ConfigError
from sim.cost.curves import Curve1D, Curve2D
from sim.cost.profile import Profile

FIT_SHARE = 0.78              # of budget_s: knobs, pilot and probes; the rest: fit and self-check
# What a window of gaps, and repeats of a design, stand for: "mean" (default) or "median". A
# server's occasional slow steps (its own housekeeping, other processes) are part of how fast
# it serves, and queues feel the mean: on a simulated server with 3-8% slow steps, medians
# left sim TTFT and ITL p50 5-20% low at 50-80% load, means within about 5%. Gross outliers
# are still down-weighted by the fit (Huber).
STATISTIC = "mean"
Progress = Callable[[str], None]


@dataclass
class ServerCalibration:
    """The fitted profile, the equations it was fitted on, and the self-check."""

    profile: Profile
    equations: list[Equation]
    predicted_s: list[float]
    self_check: dict[str, Any] = field(default_factory=dict)
    knobs: Knobs | None = None
    overhead_bounds: list[tuple[float, float]] = field(default_factory=list)

    def save(self, out: str | Path) -> tuple[Path, Path]:
        """The profile at ``out`` (YAML or JSON by suffix) and its equations as CSV beside it."""
        out = Path(out)
        csv_path = out.with_suffix(".csv")
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w") as f:
            f.write("kind,key,measured_s,measured_median_s,predicted_s,ro,steps\n")
            for e, p in zip(self.equations, self.predicted_s):
                steps = " + ".join(";".join([f"{c}@{k}" for c, k in s.prefills]
                                            + [f"d{len(s.decode_contexts)}:{sum(s.decode_contexts)}"])
                                   for s in e.shapes)
                key = "/".join(str(k) for k in e.key).replace(",", " ")
                f.write(f"{e.kind},{key},{_fitted_y(e):.6g},{e.y:.6g},{p:.6g},{e.ro:g},{steps}\n")
        self.profile.provenance["raw_csv"] = csv_path.name
        self.profile.save(out)
        return out, csv_path


# ---- probe designs -------------------------------------------------------------------------------
def designs(k: Knobs, costs: Costs, rng: np.random.Generator) -> list[tuple[int, str, list[Sent]]]:
    """(priority, name, session) for every probe design; priority 0 is run first."""
    B, S, L = k.max_num_batched_tokens, k.max_num_seqs, k.max_model_len
    out: list[tuple[int, str, list[Sent]]] = []
    top = L - 9
    lone = sorted({p for p in [1 << i for i in range(13)] if p < B} | {B, top}
                  | {int(B * m) for m in (1.5, 2, 3, 4, 6, 8, 12, 16) if B * m < top})
    core = {1, 16, 128, B, min(2 * B, top), top}
    for p in lone:
        out.append((0 if p in core else 1, f"A:{p}", [Sent(0.0, p, 8, f"A:{p}")]))
    seqs = sorted({min(S, 1 << i) for i in range(1, 13)} - {1})
    # decode batches: every size at per-sequence contexts spread over the model's length
    for prio, c in ((0, 8), (1, max(16, L // 16)), (1, max(16, L // 8)), (2, max(16, L // 32)), (2, L // 4),
                    (3, L // 2)):
        for n in seqs:
            if n * (c + 48) > k.kv_tokens or c + 48 >= L:
                continue
            out.append((prio if n in (seqs[0], seqs[-1]) or prio else 1, f"B:{n}x{c}",
                        [Sent(0.0, c, 48, f"B:{n}x{c}")] * n))
    for prio, n in ((0, max(1, S // 4)), (1, 1), (1, max(1, S - 4)), (2, max(1, S // 2))):
        room = B - n                                       # what a prompt gets beside n decodes
        if room < 2 or n + 4 > S:
            continue
        single = sorted({2, 8, 32, 128, max(2, room // 2), room, min(2 * B, L - 2), min(3 * B + room // 3, L - 2),
                         L - 2})
        groups = [(p,) for p in single] + [g for g in (
            (room // 4,) * 2, (room // 8,) * 4, (room // 2, 16), (room // 16,) * 3,       # fit together
            (min(room + room // 3, L - 2), 16), (min(2 * room + room // 5, L - 2), room // 4),   # a long one
            (min(room + room // 2, L - 2), 64, 8)) if min(g) >= 2]                         # and others
        out.append((prio, f"C:{n}", mixed_session(n, groups, B, costs, rng, L)))
    return out


def mixed_session(n: int, groups: list[tuple[int, ...]], budget: int, costs: Costs,
                  rng: np.random.Generator, max_len: int) -> list[Sent]:
    """``n`` decoders (prompt 32) joined by groups of prompts sent together (``max_tokens``
    1), one group at a time, in random order. Groups sent after the decoders ended
    (they live at most ``max_len`` positions) meet an idle server: TTFT equations."""
    tag = f"C:{n}"
    t = 1.5 * costs.overhead_s + costs.prefill(32 * n, budget) + 6 * costs.step(n)
    sents = []
    for g in rng.permutation(len(groups)):
        for p in groups[g]:
            sents.append(Sent(t, int(p), 1, f"{tag}:{p}"))
        t += (2 * costs.overhead_s + costs.prefill(sum(groups[g]), budget - n) * 1.5
              + costs.step(n) * (4 + 3 * rng.random()))
    steps = min(int(t / costs.step(n) * 1.3) + 16, max_len - 33)
    return [Sent(0.0, 32, steps, tag)] * n + sents


def session_estimate(sents: list[Sent], costs: Costs, budget: int) -> float:
    n_dec = max(sum(1 for s in sents if s.offset_s == 0), 1)
    return (max(s.offset_s for s in sents) + costs.overhead_s
            + costs.prefill(sum(s.prompt_tokens for s in sents if s.offset_s == 0), budget)
            + max(s.max_tokens for s in sents) * costs.step(n_dec))


# ---- the calibration ------------------------------------------------------------------------------
def calibrate_server(url: str, *, budget_s: float, seed: int = 0, progress: Progress | None = None,
                     max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                     model_config: str | Path | None = None, transport: Transport | None = None,
                     info: Any = None) -> ServerCalibration:
    """Measure, fit and self-check a profile of the server at ``url`` in about ``budget_s``.

    ``transport`` / ``info``: send the probes elsewhere and take the server's
    facts as given (tests: ``probes.SimTransport``). Raises ConfigError when
    the server cannot be reached or the input is bad."""
    if not budget_s > 0:
        raise ConfigError(f"--budget-s must be > 0, got {budget_s}")
    clock = getattr(transport, "now", None) or time.perf_counter    # a simulated server has its own
    start = clock()
    say = progress or (lambda msg: None)
    loads = [os.getloadavg()[0]]
    info, version = (info, None) if info is not None else read_server(url, model_config)
    engine = require_policy(getattr(info, "engine_kind", "unknown"))   # before any probing: one clear line
    facts = model_facts(info, model_config)
    counters0 = prefix_counters(url) if transport is None else None
    transport = transport or HttpTransport(url, info.model, facts.vocab_size, seed)
    rng = np.random.default_rng(seed)
    knobs, costs = infer_knobs(info, transport, say, kv_bytes_per_token=facts.kv_bytes_per_token,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    say(f"server {url}: {engine.label} {version or '?'}, model {info.model}; " + knobs.describe())
    fit_end = start + FIT_SHARE * budget_s
    equations: list[Equation] = []
    bounds: list[tuple[float, float]] = []
    num_sessions = num_requests = 0
    capacity = None                            # req/s of TRAFFIC's requests, from a fit of pass 1
    for pass_no in range(1000):                # designs anew each pass: current costs, fresh orders
        todo = [d for d in designs(knobs, costs, rng) if d[0] <= pass_no]
        if pass_no and capacity is None and equations:
            capacity = _capacity(fit_profile(combine(equations), knobs, facts, bounds).profile, knobs, rng)
        if capacity:                           # realistic traffic, at a high and a moderate load
            load = TRAFFIC_LOADS[pass_no % len(TRAFFIC_LOADS)]
            todo.append((1, f"D:{load:g}", [Sent(s.offset_s, s.prompt_tokens, s.max_tokens, f"D{pass_no}:{i}")
                                            for i, s in enumerate(traffic(60, load * capacity, knobs, rng))]))
        todo = [todo[i] for i in rng.permutation(len(todo))]
        ran = 0
        for _, name, sents in todo:
            est = session_estimate(sents, costs, knobs.max_num_batched_tokens)
            if clock() + est > fit_end:
                continue
            t0 = clock()
            ses = transport(sents)
            took = clock() - t0
            if not name.startswith("D"):       # traffic's duration follows its arrivals, not costs
                costs.scale = float(np.clip(costs.scale * (took / est) ** 0.3, 0.3, 10))
            num_sessions += 1
            num_requests += len(sents)
            ran += 1
            if any(ses.errors):
                say(f"  {name}: {sum(e is not None for e in ses.errors)} request(s) failed "
                    f"({next(e for e in ses.errors if e)}); session skipped")
                continue
            try:
                eqs, bnd = analyse(sents, ses.prompts, ses.token_times, ses.send_s,
                                   knobs.max_num_batched_tokens, max_num_seqs=knobs.max_num_seqs)
            except (ValueError, IndexError, KeyError) as exc:      # a timeline we cannot read
                _dump(name, sents, ses, exc)
                say(f"  {name}: could not read its token timeline ({type(exc).__name__}: {exc}); skipped")
                continue
            equations += eqs
            bounds += bnd
        loads.append(os.getloadavg()[0])
        say(f"  pass {pass_no + 1}: {ran} sessions, {len(equations)} equations so far, "
            f"{clock() - start:.0f} s")
        if ran == 0 and pass_no >= 3:
            break
    if not equations:
        raise ConfigError(f"--server {url}: no usable measurements within --budget-s {budget_s:g}; "
                          f"raise the budget")
    cal = fit_profile(combine(equations), knobs, facts, bounds)
    prof = cal.profile
    prof.provenance.update({
        "source": "batchsim-calibrate-server", "url": url, "engine_kind": knobs.engine_kind,
        "engine_version": version, "vllm_version": version if knobs.engine_kind == "vllm" else None,
        "model_id": info.model,
        "date_utc": _utc_now(), "budget_s": budget_s, "seed": seed, "num_probe_sessions": num_sessions,
        "num_probe_requests": num_requests, "num_equations": len(cal.equations),
        "model_shape_from": facts.source,
        "machine": {"cpus": os.cpu_count(), "load_1min_min": min(loads), "load_1min_max": max(loads),
                    "load_note": "1-min load average of the client's machine, calibration included"},
        "method": "black-box probes (lone prompts, decode batches, joins of decoding batches, random "
                  "traffic); steps from token bursts; joint robust fit of the step curves and the "
                  "per-request overhead (calibrate.serving.calibrate_server)",
        "statistic": f"{STATISTIC} of step gaps (windows and repeats)",
    })
    fe = prof.fit_error
    say(f"fit: MAPE {fe['fit_mape_pct']:.1f}% (p90 {fe['fit_p90_abs_pct']:.1f}%) on {fe['fit_num_points']} "
        f"equations; request overhead {prof.engine['request_overhead_s'] * 1e3:.2f} ms")
    cal.self_check = self_check(prof, transport, knobs, start + budget_s - clock(), rng, say, clock)
    prof.fit_error.update(cal.self_check)
    prof.fit_error["elapsed_s"] = round(clock() - start, 1)
    loads.append(os.getloadavg()[0])
    prof.provenance["machine"].update(load_1min_min=min(loads), load_1min_max=max(loads))
    if counters0 is not None:
        prof.provenance["prefix_cache"] = cache = prefix_cache_record(
            info.enable_prefix_caching, counters0, prefix_counters(url))
        if cache["hits"]:
            say(f"warning: the server's prefix cache hit {cache['hits']} of the {cache['queries']} prompt "
                f"tokens of the probes (they are built to miss it: was other traffic sharing the server?); "
                f"the times of those prefills are short")
    return cal


PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def prefix_counters(url: str) -> dict[str, float | None]:
    """The server's prefix-cache counters (tokens queried and hit, new requests), None where unreadable."""
    from calibrate.serving.client import metric_totals
    return metric_totals(url, PREFIX_COUNTERS)


def prefix_cache_record(enabled: bool | None, before: dict[str, float | None],
                        after: dict[str, float | None]) -> dict[str, Any]:
    """provenance.prefix_cache: whether the server caches prefixes and the counters'
    growth over the calibration (None where a reading is missing); ``hits`` should be 0."""
    delta = {}
    for key, name in zip(("queries", "hits"), PREFIX_COUNTERS):
        a, b = before.get(name), after.get(name)
        delta[key] = None if a is None or b is None else int(round(b - a))
    return {"enabled": enabled, **delta,
            "note": "the probes' prompts differ from their first tokens on (probes.HttpTransport), so a "
                    "prefix cache never hits them"}


def _dump(name: str, sents: list[Sent], ses: Session, exc: Exception) -> None:
    """Keep an unreadable session for a bug report, if BATCHSIM_PROBE_DUMP names a folder."""
    folder = os.environ.get("BATCHSIM_PROBE_DUMP")
    if folder:
        import dataclasses
        import json
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"{name.replace(':', '_')}-{time.time():.0f}.json", "w") as f:
            json.dump({"error": repr(exc), "sents": [dataclasses.astuple(s) for s in sents],
                       "session": dataclasses.asdict(ses)}, f)


def _utc_now() -> str:
    from sim.base.provenance import utc_now_iso
    return utc_now_iso()


def _fitted_y(e: Equation) -> float:
    return e.y if STATISTIC == "median" or e.y_mean is None else e.y_mean


def _pow2(lo: int, hi: int) -> tuple[int, ...]:
    nodes = [lo]
    while nodes[-1] * 2 < hi:
        nodes.append(nodes[-1] * 2)
    return tuple(nodes + [hi] if hi > nodes[-1] else nodes)


def fit_profile(equations: list[Equation], knobs: Knobs, facts: Any,
                bounds: list[tuple[float, float]]) -> ServerCalibration:
    """Fit the curves and the per-request overhead; build the Profile."""
    B, S, L = knobs.max_num_batched_tokens, knobs.max_num_seqs, knobs.max_model_len
    top_dec = max(64, min(S * L, knobs.kv_tokens))
    grid = CurveGrid(_pow2(1, B), _pow2(2, B), (0,) + _pow2(B, max(L, 2 * B)) if B < L else (0, L),
                     _pow2(1, max(S, 2)), (0,) + _pow2(16, top_dec))
    ys = [_fitted_y(e) for e in equations]
    fitted = fit_curves([e.shapes for e in equations], ys, grid, extra_columns=[[e.ro] for e in equations])
    ro_idle = fitted.extra_s[0]
    ro_busy = stab(bounds)
    prof = Profile(
        name=f"{facts.name}@{knobs.engine_kind}-server", model=facts.shape, device=facts.device, dtype=facts.dtype,
        tensor_parallel=facts.tensor_parallel, memory_bytes_per_gpu=facts.weight_bytes + knobs.kv_bytes,
        weight_bytes=facts.weight_bytes, activation_bytes_per_gpu=0,
        kv_bytes_per_token=facts.kv_bytes_per_token, overhead_s=fitted.overhead_s,
        linear=Curve1D(list(grid.token_nodes), fitted.linear_s, name="curves.linear"),
        attn_prefill=Curve2D(list(grid.chunk_nodes), list(grid.chunk_context_nodes), fitted.attn_prefill_s,
                             name="curves.attn_prefill"),
        attn_decode=Curve2D(list(grid.seq_nodes), list(grid.decode_context_nodes), fitted.attn_decode_s,
                            name="curves.attn_decode"))
    prof.engine = knobs.engine_dict()
    prof.engine.update(request_overhead_s=round(float(ro_idle), 6), request_overhead_idle_s=round(float(ro_idle), 6),
                       request_overhead_busy_s=None if ro_busy is None else round(float(ro_busy), 6),
                       num_busy_overhead_bounds=len(bounds))
    pred = [sum(prof.step_time_s(s.to_batch()) for s in e.shapes) + e.ro * ro_idle for e in equations]
    prof.reset_counters()
    err = np.array([abs(p - y) / y * 100 for p, y in zip(pred, ys)])
    prof.fit_error = {"fit_mape_pct": float(err.mean()), "fit_p90_abs_pct": float(np.percentile(err, 90)),
                      "fit_max_abs_pct": float(err.max()), "fit_num_points": len(err),
                      "fit_num_downweighted": fitted.num_downweighted}
    for kind in ("ttft", "decode", "mixed"):
        sel = [x for x, e in zip(err, equations) if e.kind == kind]
        if sel:
            prof.fit_error[f"fit_{kind}_mape_pct"] = float(np.mean(sel))
            prof.fit_error[f"fit_{kind}_num_points"] = len(sel)
    for family in "ABCD":                           # probe families (module doc); D: random traffic
        sel = [x for x, e in zip(err, equations) if str(e.key[0]).startswith(family)]
        if sel:
            prof.fit_error[f"fit_{family}_mape_pct"] = float(np.mean(sel))
    return ServerCalibration(prof, equations, pred, knobs=knobs, overhead_bounds=list(bounds))


# ---- realistic traffic and the self-check ----------------------------------------------------------
LOADS = (0.5, 0.8)
TRAFFIC_LOADS = (0.85, 0.6)


def traffic(n: int, rate: float, knobs: Knobs, rng: np.random.Generator) -> list[Sent]:
    """Fit traffic ("D"): Poisson arrivals, prompts log-uniform on [16, min(L/2, 2 x budget)],
    outputs log-uniform on [8, 256]: busy batches of every size, joined and left all the
    time, whose steps ``probes.analyse`` reads where their composition is certain."""
    L, B = knobs.max_model_len, knobs.max_num_batched_tokens
    hi_p = max(32, min(L // 2, 2 * B))
    prompts = np.exp(rng.uniform(np.log(16), np.log(hi_p), n)).astype(int)
    outs = np.exp(rng.uniform(np.log(8), np.log(max(9, min(256, L - hi_p - 1))), n)).astype(int)
    t = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, n - 1))])
    return [Sent(float(a), int(p), int(o), "traffic") for a, p, o in zip(t, prompts, outs)]


def _capacity(prof: Profile, knobs: Knobs, rng: np.random.Generator) -> float | None:
    """Requests/s the profile predicts for ``traffic``'s requests all sent at once."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="batchsim-capacity-") as d:
        path = Path(d) / "profile.yaml"
        prof.save(path)
        probe = traffic(120, 1.0, knobs, rng)
        try:
            _, toks = simulate(path, [0.0] * len(probe), [s.prompt_tokens for s in probe],
                               [s.max_tokens for s in probe], Path(d), _policy_kind(prof))
        except ConfigError:
            return None
    return len(probe) / max(ts[-1] for ts in toks)


def _policy_kind(prof: Profile) -> str:
    """The policy that models the engine the profile was measured on (``engines.ENGINES``)."""
    from calibrate.serving.engines import ENGINES
    return ENGINES.get(str(prof.engine.get("engine_kind", "vllm")), ENGINES["unknown"]).policy


def simulate(profile_path: Path, arrivals: list[float], prompts: list[int], outputs: list[int],
             tmp: Path, policy_kind: str = "vllm_v1") -> tuple[list[float], list[list[float]]]:
    """(arrival, token times per request) of ``sim.run.runner.run_workload`` on these requests, in
    their order, with policy ``policy_kind`` and the profile's server knobs."""
    import warnings

    from sim.run.config import workload_from_dict
    from sim.run.runner import run_workload

    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    t0 = min(arrivals)
    with open(tmp / "trace.csv", "w") as f:
        f.write("arrival_time_s,prompt_tokens,output_tokens\n")
        for i in order:
            f.write(f"{arrivals[i] - t0:.6f},{prompts[i]},{outputs[i]}\n")
    cfg = workload_from_dict({"name": "self-check", "arrivals": {"kind": "trace", "path": "trace.csv",
                                                                  "time_unit": "s"},
                              "lengths": {"kind": "trace"}, "max_tokens": "output",
                              "policy": {"kind": policy_kind}, "profile": {"path": str(profile_path)}},
                             str(tmp / "self-check.yaml"), tmp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_workload(cfg)
    times: list[list[float]] = [[] for _ in order]
    for rid, t in zip(res.tokens["req_id"].to_numpy(), res.tokens["t_s"].to_numpy()):
        times[order[int(rid)]].append(float(t) + t0)
    return [arrivals[i] for i in range(len(arrivals))], [sorted(ts) for ts in times]


def latency_stats(send: list[float], token_times: list[list[float]]) -> dict[str, float]:
    """TTFT and ITL p50 / p99 (ms) and output throughput (tok/s), as vLLM's benchmark defines them."""
    ok = [i for i, ts in enumerate(token_times) if ts]
    ttft = [token_times[i][0] - send[i] for i in ok]
    itl = [b - a for i in ok for a, b in zip(token_times[i], token_times[i][1:])]
    dur = max(token_times[i][-1] for i in ok) - min(send[i] for i in ok)
    out = {"ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3, "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3,
           "throughput_tok_s": sum(len(token_times[i]) for i in ok) / dur}
    if itl:
        out.update(itl_p50_ms=float(np.percentile(itl, 50)) * 1e3, itl_p99_ms=float(np.percentile(itl, 99)) * 1e3)
    return out


def self_check(prof: Profile, transport: Transport, knobs: Knobs, time_left_s: float,
               rng: np.random.Generator, say: Progress,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Held-out check (module doc): errors (sim - measured) / measured in %, per load."""
    import tempfile

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="batchsim-selfcheck-") as d:
        tmp = Path(d)
        path = tmp / "profile.yaml"
        prof.save(path)
        capacity = _capacity(prof, knobs, rng) or 1.0                     # requests/s, all at once
        out["selfcheck_capacity_req_s"] = round(capacity, 3)
        worst: list[float] = []
        for i, load in enumerate(LOADS):
            share = time_left_s / (len(LOADS) - i) - 1.0                   # 1 s for the slowest request
            rate = load * capacity
            n = int(np.clip(0.8 * share * rate, 16, 100))
            if n / rate > share + 1.0 and i > 0:
                continue
            start = clock()
            sents = [Sent(s.offset_s, s.prompt_tokens, s.max_tokens, "self-check")
                     for s in traffic(n, rate, knobs, rng)]
            ses = transport(sents)
            ok = [j for j, e in enumerate(ses.errors) if e is None]
            measured = latency_stats([ses.send_s[j] for j in ok], [ses.token_times[j] for j in ok])
            send, times = simulate(path, [ses.send_s[j] for j in ok], [ses.prompts[j] for j in ok],
                                   [sents[j].max_tokens for j in ok], tmp, _policy_kind(prof))
            predicted = latency_stats(send, times)
            tag = f"selfcheck_load{int(load * 100)}"
            out[f"{tag}_num_requests"] = len(ok)
            out[f"{tag}_rate_req_s"] = round(rate, 3)
            for key, m in measured.items():
                err = (predicted[key] - m) / m * 100
                out[f"{tag}_{key.replace('_ms', '').replace('_tok_s', '')}_err_pct"] = round(err, 2)
                out[f"{tag}_{key}_measured"] = round(m, 4)
                worst.append(abs(err))
            say(f"self-check at {load:.0%} load ({n} requests, {rate:.1f} req/s): " + ", ".join(
                f"{k.replace('_ms', '').replace('_tok_s', '')} {(predicted[k] - m) / m * 100:+.1f}%"
                for k, m in measured.items()) + f"  ({clock() - start:.1f} s)")
            time_left_s -= clock() - start
        out["selfcheck_max_abs_err_pct"] = round(max(worst), 2) if worst else None
        out["selfcheck_summary"] = (f"self-check max |error| {max(worst):.1f}% over throughput, TTFT and ITL "
                                    f"p50/p99 at {', '.join(f'{x:.0%}' for x in LOADS)} load"
                                    if worst else "self-check: no time left in the budget")
    return out


# ---- command line ---------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    """``sim calibrate --server URL --out PROFILE [--budget-s S] [--quiet] [--seed N]``.

    Optional attributes: ``max_num_seqs``, ``max_num_batched_tokens`` (the server's
    knobs when it does not expose them), ``model_config`` (the model's HF
    config.json or its folder). Bad input raises ConfigError (one line)."""
    out = Path(args.out)
    if out.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"--out {out}: a profile path must end in .yaml, .yml or .json")
    budget = float(getattr(args, "budget_s", None) or 120.0)
    quiet = bool(getattr(args, "quiet", False))
    say = None if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    cal = calibrate_server(args.server, budget_s=budget, seed=int(getattr(args, "seed", 0) or 0),
                           progress=say, max_num_seqs=getattr(args, "max_num_seqs", None),
                           max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
                           model_config=getattr(args, "model_config", None))
    path, csv_path = cal.save(out)
    fe = cal.profile.fit_error
    line = fe.get("selfcheck_summary", "self-check: not run")
    print(f"wrote {path} and {csv_path} (fit MAPE {fe['fit_mape_pct']:.1f}%; {line}; "
          f"{fe['elapsed_s']:.0f} s)")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m calibrate.serving.calibrate_server",
                                description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="http://host:port of an OpenAI-compatible vLLM server")
    p.add_argument("--out", required=True, help="profile path (.yaml or .json); equations CSV beside it")
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--model-config", help="the served model's config.json (or its folder)")
    return p


if __name__ == "__main__":
    try:
        raise SystemExit(main(_parser().parse_args()))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2)
