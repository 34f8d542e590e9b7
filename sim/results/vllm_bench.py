"""A run in the vocabulary of ``vllm bench serve``: its result file, the offered load, the knobs that ran.

``bench_result`` builds the JSON that ``vllm bench serve --save-result`` (vLLM
0.32, ``vllm/benchmarks/serve.py``) writes, with its key names and units:
latencies in ms as ``mean_/median_/std_/p{P}_{metric}_ms`` for ttft, tpot,
itl and e2el; ``duration`` in s; ``request_rate`` "inf" for all-at-once
traffic; the per-request ``latencies`` and ``queue_times`` (the wait for a
free client under ``--max-concurrency``) always, as vLLM 0.32 writes them; with
``detailed`` (``--save-detailed``) the other per-request arrays; all in
seconds. The metrics are defined as in ``sim.results.metrics`` (vLLM's definitions),
so the file agrees with summary.json wherever both name a number. As vLLM
does, a metric with no values reports 0.0 and std is the population std.
Extra top-level keys (``policy``, ``policy_knobs``, ...) are what vLLM's
``--metadata KEY=VALUE`` would add; readers ignore them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from sim.base.strict import ConfigError
from sim.base.heap import trim_heap
from sim.results.metrics import Values, finished_columns, latency_values_s, request_columns, stats_ms

if TYPE_CHECKING:
    from sim.results.result import RunResult

DEFAULT_PERCENTILES = "99"                  # vLLM's --metric-percentiles default
BENCH_METRICS = ("ttft", "tpot", "itl", "e2el")
OVERLOAD_RATIO = 0.9                        # sustained below this share of the offered rate: overload


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``--metric-percentiles`` ("50,90,99.9") as floats in (0, 100], in the order given, once each."""
    values: list[float] = []
    for part in text.split(","):
        item = part.strip()
        try:
            p = float(item)
        except ValueError:
            raise ConfigError(f"--metric-percentiles: {item!r} is not a number; expected comma-separated "
                              f"percentiles in (0, 100], e.g. 50,90,99") from None
        if not 0 < p <= 100:                # NaN fails this too
            raise ConfigError(f"--metric-percentiles: {item} is outside (0, 100]; expected comma-separated "
                              f"percentiles in (0, 100], e.g. 50,90,99")
        if p not in values:
            values.append(p)
    return tuple(values)


def percentile_label(p: float) -> str:
    """The key's spelling, as vLLM's: 99.0 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if p == int(p) else str(p)


# ---- offered load ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """How fast requests came, and how fast the server kept up.

    ``offered_rps``: (requests - 1) / arrival span, the mean gap's inverse
    (None when every request arrived at once or clients sent in a closed
    loop); with a concurrency cap, the workload's rate (sessions: the measured
    one, their rate counts sessions). ``ttft_growth``: the
    least-squares slope of TTFT over arrival time. A server that keeps up has
    a flat TTFT; one that serves mu req/s of lambda offered makes the request
    arriving at t wait t (lambda/mu - 1) longer, so it sustains
    lambda / (1 + slope). Under a cap the excess waits at the client, before
    the send TTFT counts from, so the slope is not taken (None)."""

    offered_rps: float | None
    ttft_growth: float | None
    max_concurrency: int | None = None
    closed_loop: bool = False

    @property
    def sustained_rps(self) -> float | None:
        if self.offered_rps is None or self.ttft_growth is None:
            return None
        return self.offered_rps / (1.0 + max(self.ttft_growth, 0.0))

    @property
    def overloaded(self) -> bool:
        sustained = self.sustained_rps
        return sustained is not None and sustained < OVERLOAD_RATIO * self.offered_rps


def offered_load(requests: pd.DataFrame | Any, arrivals: dict[str, Any] | None = None) -> Load:
    """The run's ``Load`` from its requests table (arrival_s; ttft_s of finished
    requests) and the workload's ``arrivals`` section (as meta.json's config has it)."""
    a = arrivals or {}
    cap = a.get("max_concurrency")
    if a.get("kind") == "concurrency":
        return Load(None, None, cap, closed_loop=True)
    arrival = request_columns(requests, ("arrival_s",))["arrival_s"].astype(np.float64, copy=False)
    span_s = float(arrival.max() - arrival.min()) if len(arrival) else 0.0
    measured_rps = (len(arrival) - 1) / span_s if span_s > 0 else None
    if cap is not None:                 # the sends follow the replies: the asked rate is the workload's
        rate = a.get("rate") if a.get("kind") != "sessions" else None     # sessions': sessions per second
        return Load(float(rate) if rate is not None else measured_rps, None, cap)
    if measured_rps is None:
        return Load(None, None)
    done = finished_columns(requests, ("arrival_s", "ttft_s"))
    x, y = done["arrival_s"].astype(np.float64, copy=False), done["ttft_s"].astype(np.float64, copy=False)
    growth = _slope(x, y) if len(x) >= 3 and np.ptp(x) > 0 else None
    return Load(measured_rps, growth)


# ---- the result file -------------------------------------------------------------------------------
def _slope(x: np.ndarray, y: np.ndarray) -> float:
    """The least-squares slope of y on x (``np.polyfit(x, y, 1)[0]`` up to float
    rounding), centred, with two temporaries of the input's size."""
    dx = x - x.mean()
    return float(np.dot(dx, y - y.mean()) / np.dot(dx, dx))


LATENCY_SERIES = ("ttft", "tpot", "itl", "e2el")           # vllm_bench.json's order


def latency_series_s(requests: pd.DataFrame | Any, itl_s: Values) -> Iterator[tuple[str, Values]]:
    """(name, seconds) behind each metric in ``LATENCY_SERIES``, one at a time, selected as
    ``sim.results.metrics.summarize`` selects them: finished requests; TPOT of those with more than
    one output token; ITL over all token gaps (``itl_s``: ``sim.results.metrics.itl_values`` of the
    run, ``RunResult.itl()``)."""
    for name in LATENCY_SERIES:
        yield name, itl_s if name == "itl" else latency_values_s(requests, name).astype(np.float64, copy=False)


def distribution_ms(name: str, values_s: Values, percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p{P} of ``values_s`` in ms under vLLM's key names (0.0 each when empty, as vLLM)."""
    mean, median, std, quantiles = stats_ms(values_s if len(values_s) else np.zeros(1), percentiles)
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": median, f"std_{name}_ms": std}
    for p, q in zip(percentiles, quantiles):
        out[f"p{percentile_label(p)}_{name}_ms"] = q
    return out


PEAK_ROWS = 65_536
DENSE_SECONDS = 1 << 22      # runs up to 48 days long count in an array of one-second buckets (32 MB)
MERGE_ROWS = 1 << 20         # longer ones keep (bucket, count) pairs, merged past this many


def peak_second(requests: pd.DataFrame, token_chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int]:
    """vLLM's (max_output_tokens_per_s, max_concurrent_requests) over one-second buckets counted
    from the first finished request's arrival: output tokens landing in a bucket, and finished
    requests in flight in it (from the bucket of the arrival to that of the finish, both
    counted); each is its own maximum, not necessarily in the same bucket. ``token_chunks``:
    (req_id, t_s) of the tokens, chunk by chunk. A run longer than ``DENSE_SECONDS`` counts only
    the buckets that hold something (the same maxima, in memory that follows the tokens)."""
    done = finished_columns(requests, ("req_id", "arrival_s", "finished_s"))
    if not len(done["req_id"]):
        return 0.0, 0
    t0_s = float(np.nanmin(done["arrival_s"]))
    span_s = float(np.nanmax(done["finished_s"])) - t0_s
    every = len(done["req_id"]) == len(requests)          # all finished: no token to leave out
    if every:
        del done["req_id"]
    chunks = ((times if every else times[np.isin(ids, done["req_id"])]) - t0_s for ids, times in token_chunks)
    if span_s >= DENSE_SECONDS:
        return _peak_sparse(done, chunks, t0_s)
    num_buckets = int(math.ceil(span_s)) + 1
    per_s = np.zeros(num_buckets, dtype=np.int64)
    for since in chunks:
        bucket = np.floor(since).astype(np.int64)
        per_s += np.bincount(bucket[(bucket >= 0) & (bucket < num_buckets)], minlength=num_buckets)
    delta = np.zeros(num_buckets + 1, dtype=np.int64)
    rows = PEAK_ROWS                     # requests at a time: a million would take 8 MB a temporary
    for lo in range(0, len(done["arrival_s"]), rows):
        np.add.at(delta, np.floor(done["arrival_s"][lo:lo + rows] - t0_s).astype(np.int64), 1)
        np.add.at(delta, np.floor(done["finished_s"][lo:lo + rows] - t0_s).astype(np.int64) + 1, -1)
    return float(per_s.max()), int(np.cumsum(delta)[:num_buckets].max())


def _peak_sparse(done: dict[str, np.ndarray], chunks: Iterable[np.ndarray], t0_s: float) -> tuple[float, int]:
    """``peak_second`` over the occupied buckets only, as float bucket numbers (a span of 1e300 s
    fits no integer array); tokens are counted per chunk and the (bucket, count) pairs merged."""
    def merge(buckets: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        keys, at = np.unique(np.concatenate(buckets), return_inverse=True)
        return keys, np.bincount(at, weights=np.concatenate(counts)).astype(np.int64)

    buckets: list[np.ndarray] = [np.zeros(0)]
    counts: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    held = 0
    for since in chunks:
        keys, n = np.unique(np.floor(since[since >= 0]), return_counts=True)
        buckets.append(keys)
        counts.append(n)
        held += len(keys)
        if held > MERGE_ROWS:
            keys, n = merge(buckets, counts)
            buckets, counts, held = [keys], [n], len(keys)
    per_s = merge(buckets, counts)[1]
    # in flight: +1 at the arrival's bucket, -1 after the finish's; the count only changes at those
    starts = np.floor(done["arrival_s"] - t0_s)
    ends = np.floor(done["finished_s"] - t0_s) + 1
    keys, at = np.unique(np.concatenate([starts, ends]), return_inverse=True)
    steps = np.bincount(at, weights=np.concatenate([np.ones(len(starts)), -np.ones(len(ends))]))
    return float(per_s.max()) if len(per_s) else 0.0, int(np.cumsum(steps).max())


def traffic(arrivals: dict[str, Any], load: Load) -> dict[str, Any]:
    """vLLM's request_rate / burstiness / max_concurrency for the workload's arrivals:
    a Poisson rate has burstiness 1, gamma gaps of CV c have shape 1/c^2, constant gaps
    infinite burstiness; a trace reports its measured mean rate (burstiness unknown)."""
    kind, rate = arrivals.get("kind"), arrivals.get("rate")
    out: dict[str, Any] = {"request_rate": "inf", "burstiness": 1.0,
                           "max_concurrency": arrivals.get("max_concurrency")}
    if kind in ("poisson", "gamma", "constant") and rate is not None:
        out["request_rate"] = float(rate)
        if kind == "gamma":
            out["burstiness"] = 1.0 / float(arrivals.get("cv", 1.0)) ** 2
        elif kind == "constant":
            out["burstiness"] = "inf"
    elif kind not in ("all_at_once", "concurrency"):
        out["request_rate"] = load.offered_rps if load.offered_rps is not None else "inf"
        out["burstiness"] = None
    return out


def per_request_itls_s(requests: pd.DataFrame, tokens: pd.DataFrame) -> list[list[float]]:
    """Each request's gaps between consecutive output tokens (s), in request order; [] for a failed one."""
    order = np.argsort(tokens["req_id"].to_numpy(), kind="stable")     # the log is in time order
    ids, times = tokens["req_id"].to_numpy()[order], tokens["t_s"].to_numpy()[order]
    req_ids = requests["req_id"].to_numpy()
    lo, hi = np.searchsorted(ids, req_ids, "left"), np.searchsorted(ids, req_ids, "right")
    ok = (requests["status"] == "finished").to_numpy()
    # one gap per streamed chunk: a step's tokens (speculative decoding's) arrive together
    return [[g for g in np.diff(times[a:b]).tolist() if g] if good else [] for a, b, good in zip(lo, hi, ok)]


def detailed_arrays(requests: pd.DataFrame, tokens: pd.DataFrame) -> dict[str, list[Any]]:
    """``--save-detailed``'s per-request arrays, a failed request's as vLLM fills
    them: output 0, ttft 0.0, no gaps, "rejected: REASON" in errors (a
    ``sim.core.request.REJECT_REASONS`` key). start_times are the arrivals (s);
    generated_texts are empty. (latencies and queue_times are written always.)"""
    ok = (requests["status"] == "finished").to_numpy()

    def seconds(col: str) -> list[float]:
        return np.where(ok, requests[col].to_numpy(dtype=np.float64), 0.0).tolist()
    reasons = (requests["reject_reason"].fillna("").astype(str) if "reject_reason" in requests
               else pd.Series("", index=requests.index))
    return {
        "input_lens": requests["prompt_tokens"].astype(int).tolist(),
        "output_lens": np.where(ok, requests["output_tokens"].to_numpy(), 0).astype(int).tolist(),
        "ttfts": seconds("ttft_s"),
        "itls": per_request_itls_s(requests, tokens),
        "start_times": requests["arrival_s"].astype(float).tolist(),
        "generated_texts": [""] * len(requests),                  # no text is generated
        "errors": ["" if good else f"rejected: {reason or 'unknown'}" for good, reason in zip(ok, reasons)],
    }


class PerRequest:
    """One of vllm_bench.json's per-request series, made when written: ``chunks()`` yields
    float64 arrays in request order (``sim.results.folder.write_json`` writes them as one JSON list)."""

    def __init__(self, make_chunks: Callable[[], Iterator[np.ndarray]], size: int) -> None:
        self.chunks, self.size = make_chunks, size

    def __len__(self) -> int:
        return self.size

    def tolist(self) -> list[float]:
        return [x for chunk in self.chunks() for x in chunk.tolist()]


CHUNK = 65_536                              # values per chunk of a PerRequest series made here


def bench_result(run: RunResult, percentiles: Sequence[float], *, detailed: bool = False,
                 date: str | None = None) -> dict[str, Any]:
    """``run`` as the JSON ``vllm bench serve --save-result [--save-detailed]`` writes.
    Throughputs, counts and goodput are summary.json's numbers; latencies come from the
    same series summary.json's come from, at ``percentiles``. ``latencies`` and
    ``queue_times`` are ``PerRequest`` series (``sim.results.folder.write_json`` writes them as lists)."""
    s, meta = run.summary, run.meta
    cfg = meta.get("config") or {}
    model = (meta.get("profile_provenance") or {}).get("model") or meta.get("profile_name")
    requests = run.request_source          # compact: a million requests never build the DataFrame here
    max_tok_s, max_conc = peak_second(requests, run.token_chunks())
    out: dict[str, Any] = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "batchsim", "backend": "batchsim", "label": cfg.get("name"),
        "model_id": model, "tokenizer_id": model, "num_prompts": int(len(requests)),
        **traffic(cfg.get("arrivals") or {}, offered_load(requests, cfg.get("arrivals"))),
        "duration": s["duration_s"], "completed": s["completed"], "failed": s["failed"],
        "total_input_tokens": s["total_input_tokens"], "total_output_tokens": s["total_output_tokens"],
        "request_throughput": s["request_throughput"], "request_goodput": s.get("request_goodput"),
        "output_throughput": s["output_throughput"], "total_token_throughput": s["total_token_throughput"],
        "max_output_tokens_per_s": max_tok_s, "max_concurrent_requests": max_conc,
        "rtfx": 0.0,                       # vLLM's audio-only figure, 0.0 for text as vLLM writes it
    }
    # Written with or without --save-detailed, as vLLM 0.32 does: each request's E2E latency
    # (s; 0.0 for a failed one) and its wait for a free client (s; 0.0 unless concurrency is
    # capped), made chunk by chunk as sim.results.folder.write_json writes them (a million values never
    # sit in memory at once, as arrays or as Python floats).
    out["latencies"] = PerRequest(lambda: (np.nan_to_num(f["e2e_s"].to_numpy(dtype=np.float64), nan=0.0)
                                           for f in run.request_frames()), len(requests))
    waits = run.client_queue_s
    out["queue_times"] = (PerRequest(lambda: iter((waits,)), len(waits)) if waits is not None else
                          PerRequest(lambda: (np.zeros(min(CHUNK, len(requests) - lo))
                                              for lo in range(0, len(requests), CHUNK)), len(requests)))
    if detailed:
        out.update(detailed_arrays(run.requests, run.tokens))
    for name, values in latency_series_s(requests, run.itl()):
        out.update(distribution_ms(name, values, percentiles))
        del values
        trim_heap()                        # its series and sorted copies, before the next one's
    if "prefix_cache_hit_rate" in s:        # batchsim's own: vLLM's benchmark reads it from /metrics
        out.update({k: s[k] for k in ("prefix_cache_hit_rate", "prefix_cache_queries", "prefix_cache_hits")})
    if "spec_decode_num_drafts" in s:       # vLLM's /metrics counters (vllm:spec_decode_*), as its bench reads them
        out.update({k: s[k] for k in s if k.startswith("spec_decode_")})
    out.update(policy=(cfg.get("policy") or {}).get("kind"), policy_knobs=meta.get("policy_knobs"),
               num_replicas=meta.get("num_replicas", 1), router=meta.get("router"), simulated=True)
    trim_heap()                            # the series' columns and sorted copies
    return out
