"""The measured side of a server validation as batchsim's run tables (torch-free, writes nothing).

Send and token arrival times become a ``RunResult`` (``requests``, ``tokens``,
empty ``steps``, ``summary`` from ``sim.results.metrics.summarize``); what a client
cannot see (queueing, batches, busy time, KV use; preemptions unless the
server's counter was read) is ``None``. Sources: the streaming client
(``client_run``) and a ``vllm bench serve --save-result --save-detailed``
file, where vLLM 0.32 writes per request ``input_lens``, ``output_lens`` (0:
failed), ``ttfts``, ``itls`` (gaps between streamed chunks), ``start_times``
(perf_counter at each send), ``latencies``, ``errors``, plus ``request_rate``
(a number or "inf"), ``burstiness``, ``duration``, ``completed``,
``model_id`` and its percentiles. Token times are rebuilt as send + TTFT +
the running sum of the ITLs: the timestamps the benchmark client took.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from sim.run.config import ConfigError, WorkloadConfig
from sim.results.metrics import add_request_metrics, summarize
from sim.results.result import RunResult
from workloads.generate import generate

# summary keys that only the engine knows; a measured run reports them as unknown
UNSEEN_KEYS = ("num_steps", "mean_batch_size", "busy_fraction", "mean_kv_utilization", "peak_kv_utilization",
               "mean_queue_ms", "median_queue_ms", "std_queue_ms", "p50_queue_ms", "p90_queue_ms",
               "p95_queue_ms", "p99_queue_ms")
STEP_COLUMNS = ("replica", "t_s", "duration_s", "predicted_s", "batch_size", "num_prefill_tokens",
                "num_decode_tokens", "kv_used_blocks", "kv_total_blocks")
BURST_GAP_S = 1e-4         # token gaps this short come from delivery in bursts, not from engine steps
REQUIRED = ("input_lens", "output_lens", "ttfts", "itls", "completed", "duration")


@dataclass
class Measurement:
    """The measured run and what is known about how it was taken."""

    run: RunResult
    source: str                           # "server URL" or "file PATH"
    label: str                            # for the default output folder: host_port or the file's stem
    model: str | None
    traffic: str | None = None            # the measured arrival process, when not the workload's
    load: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def measured_run(arrival_s: Sequence[float], prompt_tokens: Sequence[int], output_tokens: Sequence[int],
                 token_times_s: Sequence[Sequence[float]], ok: Sequence[bool], *,
                 num_preemptions: int | None = None, meta: dict[str, Any] | None = None,
                 extra_columns: dict[str, Sequence[Any]] | None = None) -> RunResult:
    """Tables for requests sent at ``arrival_s`` whose streamed chunks arrived at ``token_times_s``
    (one clock, seconds). Finished when ``ok`` with a chunk, else failed (partial tokens dropped, as
    ``vllm bench serve`` drops them). ``output_tokens`` counts tokens; ITL is over chunks."""
    n = len(arrival_s)
    if not (len(prompt_tokens) == len(output_tokens) == len(token_times_s) == len(ok) == n):
        raise ValueError("measured_run: every per-request sequence must have one entry per request")
    times = [np.asarray(t, dtype=np.float64) for t in token_times_s]
    done = np.array([bool(k) and len(t) > 0 for k, t in zip(ok, times)], dtype=bool)
    arrival = np.asarray(arrival_s, dtype=np.float64)
    first = np.array([t[0] if d else np.nan for t, d in zip(times, done)])
    last = np.array([t[-1] if d else np.nan for t, d in zip(times, done)])
    out = np.asarray(output_tokens, dtype=np.int64)
    req = pd.DataFrame({
        "req_id": np.arange(n), "replica": 0, "arrival_s": arrival,
        "prompt_tokens": np.asarray(prompt_tokens, dtype=np.int64), "output_tokens": out,
        "max_tokens": out, "status": np.where(done, "finished", "failed"),
        "first_scheduled_s": np.nan, "first_token_s": first, "finished_s": last, "num_preemptions": 0,
        "num_chunks": np.array([len(t) if d else 0 for t, d in zip(times, done)], dtype=np.int64)})
    for name, values in (extra_columns or {}).items():
        req[name] = list(values)
    add_request_metrics(req)              # queue_s stays NaN: a client cannot see the server's queue
    ids = np.concatenate([np.full(len(t), i, dtype=np.int64) for i, t in enumerate(times) if done[i]] or
                         [np.empty(0, np.int64)])
    ts = np.concatenate([t for i, t in enumerate(times) if done[i]] or [np.empty(0)])
    order = np.argsort(ts, kind="stable")
    tokens = pd.DataFrame({"req_id": ids[order], "t_s": ts[order]})
    steps = pd.DataFrame({c: pd.Series(dtype=float) for c in STEP_COLUMNS})
    summary = summarize(req, tokens, steps)
    for key in UNSEEN_KEYS:
        summary[key] = None
    summary.update(count_queue=0, num_preemptions=num_preemptions, num_out_of_range_lookups=None,
                   profile_source="measured")
    return RunResult(req, steps, tokens, summary, dict(meta or {}))


def client_run(results: Sequence[Any], t0_s: float, scheduled_s: Sequence[float],
               meta: dict[str, Any] | None = None) -> RunResult:
    """The streaming client's ``StreamResult``s as a measured run, times relative to ``t0_s``, with each
    request's schedule offset and send lag; tokens stamped with one time are one chunk (as vLLM's
    benchmark counts them)."""
    send = np.array([r.send_s for r in results], dtype=np.float64) - t0_s
    times = [np.asarray(r.token_times_s, dtype=np.float64) - t0_s for r in results]
    return measured_run(
        send, [r.num_prompt_tokens for r in results],
        [r.num_output_tokens or len(r.token_times_s) for r in results],
        [t[np.r_[True, np.diff(t) > 0]] if len(t) else t for t in times],
        [r.error is None for r in results], meta=meta,
        extra_columns={"scheduled_s": scheduled_s, "send_lag_s": send - np.asarray(scheduled_s, dtype=np.float64)})


# ---- vllm bench serve --save-result --save-detailed ------------------------------------------
@dataclass(frozen=True)
class BenchFile:
    """A validated ``vllm bench serve`` detailed result (per-request arrays in request order)."""

    path: Path
    input_lens: np.ndarray
    output_lens: np.ndarray           # 0 = the request failed
    ttfts_s: np.ndarray
    itls_s: list[np.ndarray]          # per request, the gaps between streamed chunks
    start_times_s: np.ndarray | None  # client perf_counter at each send; None if not saved
    completed: int
    duration_s: float
    request_rate: float | None        # req/s; inf = all at once; None if absent
    burstiness: float | None          # gamma shape of the gaps (1 = Poisson)
    model_id: str | None
    max_concurrency: int | None
    scalars: dict[str, Any] = field(default_factory=dict)   # the file's own summary numbers

    @property
    def success(self) -> np.ndarray:
        return self.output_lens > 0

    def __len__(self) -> int:
        return len(self.input_lens)


MAX_COUNT = 2**31 - 1            # token counts, as the trace loader takes them


def _fail(path: Path, key: str, what: str) -> ConfigError:
    return ConfigError(f"{path}: field '{key}' {what}")


def _number(path: Path, key: str, value: Any, *, integer: bool = False, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, key, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise _fail(path, key, f"is {value} (expected a finite number)")
    if integer and value != int(value):
        raise _fail(path, key, f"must be an integer, got {value!r}")
    if integer and value > MAX_COUNT:
        raise _fail(path, key, f"is {value:.3g}, too large for a token count (at most {MAX_COUNT:,})")
    if value < minimum:
        raise _fail(path, key, f"must be >= {minimum:g}, got {value!r}")
    return float(value)


def _numbers(path: Path, key: str, values: list[Any], *, integer: bool = False, minimum: float = 0.0) -> np.ndarray:
    """``values`` checked as ``_number`` checks one, in numpy when every one is a plain int or
    float (a 200k-request file: 21M ITL gaps in ~1 s instead of ~17 s); otherwise, or when one
    fails, value by value, so the error names the first bad one as ``key[i]``."""
    if all(type(v) is float or type(v) is int for v in values):
        arr = np.array(values, dtype=np.float64)
        ok = np.isfinite(arr) & (arr >= minimum)
        if integer:
            ok &= (arr == np.floor(arr)) & (arr <= MAX_COUNT)
        if ok.all():
            return arr.astype(np.int64) if integer else arr
    return np.array([_number(path, f"{key}[{i}]", v, integer=integer, minimum=minimum) for i, v in enumerate(values)],
                    dtype=np.int64 if integer else np.float64)


def _array(path: Path, data: dict[str, Any], key: str, n: int | None, *, integer: bool = False) -> np.ndarray:
    values = data[key]
    if not isinstance(values, list):
        raise _fail(path, key, f"must be a list, got {type(values).__name__}")
    if n is not None and len(values) != n:
        raise _fail(path, key, f"has {len(values)} entries but input_lens has {n} (one per request)")
    return _numbers(path, key, values, integer=integer, minimum=-math.inf if key == "start_times" else 0.0)


def _within_duration(p: Path, data: dict[str, Any], ttfts: np.ndarray, ok: np.ndarray, starts: np.ndarray | None,
                     duration: float) -> None:
    """The per-request times fit the benchmark's wall time: a completed request's TTFT and
    latency, and the span of the sends, are at most ``duration`` (plus 1% and 1 s of slack for
    the client's own clock reads)."""
    limit = duration * 1.01 + 1.0
    checks = [("ttfts", ttfts)]
    if "latencies" in data:
        checks.append(("latencies", np.asarray(data["latencies"], dtype=np.float64)))
    for key, values in checks:
        bad = np.flatnonzero(ok & (values > limit))
        if len(bad):
            raise _fail(p, f"{key}[{bad[0]}]", f"is {float(values[bad[0]]):.6g} s, longer than the file's duration "
                                               f"{duration:g} s")
    if starts is not None and len(starts) and float(starts.max() - starts.min()) > limit:
        raise _fail(p, "start_times", f"span {float(starts.max() - starts.min()):.6g} s, longer than the file's "
                                      f"duration {duration:g} s")


def read_bench_json(path: str | Path) -> BenchFile:
    """Read and check a ``vllm bench serve --save-result --save-detailed`` file. ConfigError (one line:
    file, field, what is wrong) for a missing file or key, arrays of other lengths, a NaN, infinite or
    negative value, ITLs that are not lists of numbers, a ``completed`` that disagrees with the outputs."""
    p = Path(path)
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "is not a regular file" if p.exists() else "file not found"
        raise ConfigError(f"{p}: {what} (expected the JSON of vllm bench serve --save-result --save-detailed)")
    try:
        data = json.loads(p.read_text())
    except RecursionError:
        raise ConfigError(f"{p}: nested too deeply to be a vllm bench serve result") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file (expected JSON)") from None
    except json.JSONDecodeError as exc:
        more = (" (several results appended with --append-result? keep one)" if exc.msg == "Extra data" else "")
        raise ConfigError(f"{p}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}{more}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object at the top level, got {type(data).__name__}")
    for key in REQUIRED:
        if key not in data:
            hint = (" (save the result with vllm bench serve --save-result --save-detailed)"
                    if key in ("input_lens", "output_lens", "ttfts", "itls") else "")
            raise _fail(p, key, f"is missing{hint}")
    input_lens = _array(p, data, "input_lens", None, integer=True)
    n = len(input_lens)
    if n == 0:
        raise _fail(p, "input_lens", "is empty: the file holds no requests")
    output_lens = _array(p, data, "output_lens", n, integer=True)
    ttfts = _array(p, data, "ttfts", n)
    raw_itls = data["itls"]
    if not isinstance(raw_itls, list) or len(raw_itls) != n:
        got = f"{len(raw_itls)} entries" if isinstance(raw_itls, list) else type(raw_itls).__name__
        raise _fail(p, "itls", f"must be a list of {n} lists (one per request), got {got}")
    for i, gaps in enumerate(raw_itls):
        if not isinstance(gaps, list):
            raise _fail(p, f"itls[{i}]", f"must be a list of seconds, got {type(gaps).__name__}")
    counts = [len(gaps) for gaps in raw_itls]
    try:                                # all gaps at once; a bad one is found again request by request
        flat = _numbers(p, "itls", [g for gaps in raw_itls for g in gaps])
        itls = np.split(flat, np.cumsum(counts)[:-1]) if n else []
    except ConfigError:
        itls = [_numbers(p, f"itls[{i}]", gaps) for i, gaps in enumerate(raw_itls)]
    starts = _array(p, data, "start_times", n) if data.get("start_times") is not None else None
    if "latencies" in data:
        _array(p, data, "latencies", n)
    if "errors" in data and (not isinstance(data["errors"], list) or len(data["errors"]) != n):
        raise _fail(p, "errors", f"must be a list of {n} entries (one per request)")
    completed = int(_number(p, "completed", data["completed"], integer=True))
    ok = output_lens > 0
    if completed != int(ok.sum()):
        raise _fail(p, "completed", f"is {completed} but {int(ok.sum())} requests have a non-zero output_lens")
    if completed == 0:
        raise _fail(p, "completed", "is 0: every request failed, there is nothing to compare")
    bad = np.flatnonzero(ok & (ttfts <= 0))
    if len(bad):
        raise _fail(p, f"ttfts[{bad[0]}]", f"is {float(ttfts[bad[0]])!r} for a completed request (expected > 0 s)")
    bad = np.flatnonzero(ok & (input_lens <= 0))
    if len(bad):
        raise _fail(p, f"input_lens[{bad[0]}]", "is 0 for a completed request (a prompt has at least one token)")
    duration = _number(p, "duration", data["duration"])
    if duration <= 0:
        raise _fail(p, "duration", f"is {duration:g}: the benchmark's wall time must be > 0 s")
    _within_duration(p, data, ttfts, ok, starts, duration)
    opt = {k: None if data.get(k) is None else math.inf if data[k] == "inf" else _number(p, k, data[k])
           for k in ("request_rate", "burstiness", "max_concurrency")}
    for key in ("request_rate", "burstiness"):
        if opt[key] is not None and opt[key] <= 0:
            raise _fail(p, key, f"is {data[key]!r} (expected a number > 0, or \"inf\")")
    if opt["max_concurrency"] is not None and not math.isinf(opt["max_concurrency"]) and (
            opt["max_concurrency"] < 1 or opt["max_concurrency"] != int(opt["max_concurrency"])):
        raise _fail(p, "max_concurrency", f"is {data['max_concurrency']!r} (expected an integer >= 1, or null)")
    scalars = {k: v for k, v in data.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    conc = opt["max_concurrency"]
    return BenchFile(p, input_lens, output_lens, ttfts, itls, starts, completed, duration, opt["request_rate"],
                     opt["burstiness"], data.get("model_id") if isinstance(data.get("model_id"), str) else None,
                     None if conc is None or math.isinf(conc) else int(conc), scalars)


def bench_run(bench: BenchFile, arrival_s: Sequence[float] | None = None) -> RunResult:
    """The file's requests as a measured run. Arrivals are the file's send
    times (first = 0) when it has them, else ``arrival_s`` (one per request,
    e.g. the workload's own arrivals); a ConfigError if neither is there."""
    n = len(bench)
    if bench.start_times_s is not None:
        arrival = bench.start_times_s - bench.start_times_s.min()
    elif arrival_s is None:
        raise ConfigError(f"{bench.path}: field 'start_times' is missing and no arrival times were given")
    else:
        arrival = np.asarray(arrival_s, dtype=np.float64)
        if len(arrival) != n:
            raise ConfigError(f"{bench.path}: the file has {n} requests but the workload has {len(arrival)}; "
                              f"without start_times the arrivals come from the workload, so the counts must match "
                              f"(set num_requests: {n})")
    times = [a + ttft + np.concatenate(([0.0], np.cumsum(gaps))) for a, ttft, gaps
             in zip(arrival, bench.ttfts_s, bench.itls_s)]
    meta = {"source": "vllm bench serve", "file": str(bench.path), "model_id": bench.model_id,
            "request_rate": bench.request_rate, "burstiness": bench.burstiness,
            "arrivals_measured": bench.start_times_s is not None}
    return measured_run(arrival, bench.input_lens, bench.output_lens, times, bench.success, meta=meta)


def replay_table(run: RunResult) -> pd.DataFrame:
    """The finished requests of a measured run as a batchsim trace (arrival_time_s,
    prompt_tokens, output_tokens), for simulating exactly what the server saw."""
    done = run.requests.loc[run.requests["status"] == "finished", ["arrival_s", "prompt_tokens", "output_tokens"]]
    return done.rename(columns={"arrival_s": "arrival_time_s"}).reset_index(drop=True)


def measure_file(cfg: WorkloadConfig, path: str) -> Measurement:
    """A vllm bench serve detailed result as the measured run, with notes on what to mind."""
    bench = read_bench_json(path)
    if bench.start_times_s is None and cfg.arrivals.kind == "concurrency":
        raise ConfigError(f"{bench.path}: field 'start_times' is missing and the workload is closed-loop "
                          f"(arrivals.kind concurrency): the send times follow the replies and cannot be rebuilt; "
                          f"fix: save the result with vllm bench serve --save-detailed (it writes start_times)")
    notes = [] if bench.start_times_s is not None else [
        "arrival times were not measured (the file has no start_times): both sides use the workload's "
        "arrivals, which assumes the benchmark drew the same ones"]
    run = bench_run(bench, generate(cfg).arrival_s if bench.start_times_s is None else None)
    if (failed := int((~bench.success).sum())):
        notes.append(f"warning: {failed} requests failed in the benchmark; they are left out of the simulation")
    for ours, theirs in (("p50_ttft_ms", "median_ttft_ms"), ("p99_ttft_ms", "p99_ttft_ms"),
                         ("p50_itl_ms", "median_itl_ms"), ("p99_itl_ms", "p99_itl_ms")):
        mine, given = run.summary.get(ours), bench.scalars.get(theirs)
        if isinstance(given, (int, float)) and mine is not None and not np.isclose(mine, given, rtol=1e-3):
            notes.append(f"warning: {theirs} recomputed from the file's per-request arrays is {mine:.4g} ms, "
                         f"the file says {given:.4g} ms")
    if bench.max_concurrency is not None:
        notes.append(f"note: the benchmark capped concurrency at {bench.max_concurrency}; its send times "
                     f"include the cap")
    rate = bench.request_rate
    traffic = None if rate is None else ("all at once" if math.isinf(rate) else
                                         f"{rate:g} req/s, burstiness {bench.burstiness or 1:g} (the file's)")
    return Measurement(run, f"file {bench.path}", bench.path.stem, bench.model_id, traffic,
                       notes=notes + delivery_notes(run))


def delivery_notes(run: RunResult) -> list[str]:
    """Notes on how tokens reached the client: several tokens in one streamed chunk, and
    bursts of gaps far shorter than any engine step (a client or front end held up)."""
    from reports.presentation.runplots import itl_s

    req = run.requests
    notes = []
    if (bundled := int(((req["num_chunks"] < req["output_tokens"]) & (req["status"] == "finished")).sum())):
        notes.append(f"note: {bundled} requests received several tokens in one streamed chunk; ITL counts "
                     f"chunks, as vllm bench serve does, and so does the simulator (a step's tokens are one "
                     f"chunk: speculative decoding's accepted drafts)")
    gaps = itl_s(run.tokens)
    share = float((gaps < BURST_GAP_S).mean()) if len(gaps) else 0.0
    if share >= 0.05:
        notes.append(f"warning: {100 * share:.0f}% of the measured token gaps are under {BURST_GAP_S * 1e3:g} ms: "
                     f"tokens reached the client in bursts (the client or the server's front end was held up, "
                     f"then caught up), which no engine step produces; measured ITL percentiles in that range "
                     f"are delivery, not decoding")
    return notes
