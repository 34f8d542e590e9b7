"""Serving metrics, named and defined as vLLM's serving benchmark reports them.

- TTFT: first output token time - arrival.
- ITL: every gap between consecutive output tokens of a request (a
  distribution over tokens, not requests); tokens of one step (speculative
  decoding's accepted drafts) arrive in one streamed chunk and count once, as
  vLLM's benchmark counts one ITL per chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with > 1 output token.
- E2EL: finished (result returned) - arrival.
- queue: first scheduled - arrival.
Percentiles are numpy's linear interpolation, std is numpy's default (the
population std, ddof 0, as vLLM's benchmark reports it); every metric comes
with its count. Throughputs divide by ``duration_s``: first arrival to last
completion. Goodput counts completed requests meeting every SLO (<=).
KV utilisation is weighted by step duration over busy time; busy fraction is
the busy time per replica over ``duration_s``.

Long runs do not fit in memory: token and step logs arrive in chunks
(``sim.core.logs``). ITL is computed chunk by chunk, carrying each request's last
token time across chunks. Up to ``MAX_IN_MEMORY_VALUES`` tokens (and
``MAX_IN_MEMORY_STEPS`` steps) the numbers are computed in memory exactly as
numpy computes them on one array; beyond, the ITL values are spilled to disk,
percentiles are the same exact order statistics (radix selection over the
spilled chunks) with numpy's linear interpolation, and mean, std and step
sums are accumulated chunk by chunk (equal up to float rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from sim.base.heap import trim_heap
from sim.core.logs import SpillFolder

PERCENTILES = (50, 90, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el", "queue")
# Beyond these sizes the numbers are streamed. In memory, an ITL sample takes ~40 bytes a token
# at its peak (ids, times, their order, the gaps, numpy's copies for median and percentiles)
# and the step sums ~40 bytes a step: 4M tokens ~160 MB, 1M steps ~40 MB at most.
MAX_IN_MEMORY_VALUES = 4_000_000    # ITL of more tokens than this is spilled
MAX_IN_MEMORY_STEPS = 1_000_000     # more steps than this are summed chunk by chunk
GAP_PIECE = 262_144                 # tokens whose gaps are computed at once (token_gaps)
MAX_GATHER = 200_000                # radix selection sorts a bucket once it holds at most this many


class SpilledValues:
    """A float64 sample too large for memory, written to a temporary folder
    chunk by chunk; ``chunks()`` reads it back, as often as needed.
    ``known`` keeps what ``stats_ms`` found (mean, std in ms, and the values
    at the ranks it selected): the summary and vllm_bench.json ask for the
    same sample's statistics, and each pass over it reads it from disk."""

    def __init__(self) -> None:
        self._count = 0
        self._spill = SpillFolder()
        self.known: dict[str, Any] = {}

    def add(self, values: np.ndarray) -> None:
        if len(values):
            self._spill.write(np.asarray(values, dtype=np.float64))
            self._count += len(values)
            self.known = {}             # a new sample

    def chunks(self) -> Iterator[np.ndarray]:
        for (values,) in self._spill.read(1):
            yield values

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        self._spill.close()


Values = np.ndarray | SpilledValues


def add_request_metrics(req: pd.DataFrame) -> pd.DataFrame:
    """Each request's latencies from its timestamps, in place (the one home of
    these formulas, for simulated and measured runs alike): queue = first
    scheduled - arrival, TTFT = first token - arrival, E2E = finished -
    arrival, TPOT = (E2E - TTFT) / (output tokens - 1) for requests with more
    than one output token (NaN otherwise). A request that did not finish has
    NaN for all four."""
    req["queue_s"] = req["first_scheduled_s"] - req["arrival_s"]
    req["ttft_s"] = req["first_token_s"] - req["arrival_s"]
    req["e2e_s"] = req["finished_s"] - req["arrival_s"]
    n_out = req["output_tokens"].where(req["output_tokens"] > 1)
    req["tpot_s"] = (req["e2e_s"] - req["ttft_s"]) / (n_out - 1)
    req.loc[req["status"] != "finished", ["queue_s", "ttft_s", "e2e_s", "tpot_s"]] = np.nan
    return req


def distribution(name: str, values_s: Values, percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """mean/median/std/p{P} in ms plus the count (NaN-free input)."""
    out: dict[str, Any] = {f"count_{name}": len(values_s)}
    if len(values_s) == 0:
        for key in ("mean", "median", "std", *(f"p{p}" for p in percentiles)):
            out[f"{key}_{name}_ms"] = None
        return out
    mean, median, std, quantiles = stats_ms(values_s, percentiles)
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = median
    out[f"std_{name}_ms"] = std
    for p, q in zip(percentiles, quantiles):
        out[f"p{p}_{name}_ms"] = q
    return out


def stats_ms(values_s: Values, percentiles: Sequence[float]) -> tuple[float, float, float, list[float]]:
    """(mean, median, std, percentiles) of a non-empty sample, in ms: numpy's
    mean, median, population std and linear percentiles of ``values_s * 1e3``."""
    if not isinstance(values_s, SpilledValues):
        v = np.asarray(values_s, dtype=np.float64) * 1e3       # a copy of its own: reordered below
        mean, std = float(v.mean()), float(v.std())             # in the sample's order
        # Order statistics depend only on the values: select them in place, not in copies
        # (a million requests' latencies: 8 MB each).
        quantiles = [float(q) for q in np.percentile(v, list(percentiles), overwrite_input=True)]
        return mean, float(np.median(v, overwrite_input=True)), std, quantiles
    n = len(values_s)
    known = values_s.known                 # what an earlier call on this sample found
    if "mean" not in known:
        known["mean"] = math.fsum(float((c * 1e3).sum()) for c in values_s.chunks()) / n
        known["std"] = math.sqrt(math.fsum(float(np.square(c * 1e3 - known["mean"]).sum())
                                           for c in values_s.chunks()) / n)
    mean, std = known["mean"], known["std"]
    # Scaling by 1e3 rounds monotonically: the ms value at a rank is the seconds value there x 1e3.
    mid = [n // 2] if n % 2 else [n // 2 - 1, n // 2]      # np.median: the mean of these
    index, weight, last = _linear_indexes(n, percentiles)
    ranks = {*mid, *index.tolist(), *(index + 1)[~last].tolist(), n - 1}
    at = known.setdefault("at", {})
    missing = ranks - at.keys()
    if missing:
        at.update((r, v * 1e3) for r, v in order_statistics(values_s.chunks, missing).items())
    median = float(np.mean(np.array([at[r] for r in mid])))
    return mean, median, std, _linear_percentiles(at, index, weight, last, n)


def _linear_indexes(n: int, percentiles: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's 'linear' method: the lower index, the weight of the upper one, and
    whether the percentile is the maximum (virtual index (n - 1) p / 100 at its end)."""
    virtual = (n - 1) * np.true_divide(np.asarray(percentiles), np.float64(100))
    last = virtual >= n - 1
    lower = np.floor(virtual)
    return np.where(last, n - 1, lower).astype(np.int64), virtual - lower, last


def _linear_percentiles(at: dict[int, float], index: np.ndarray, weight: np.ndarray, last: np.ndarray,
                        n: int) -> list[float]:
    """numpy's interpolation between the order statistics ``at`` (its ``_lerp``,
    which subtracts from the upper value when the weight is >= 0.5)."""
    a = np.array([at[i] for i in index.tolist()])
    b = np.array([at[n - 1] if top else at[i + 1] for i, top in zip(index.tolist(), last.tolist())])
    diff = b - a
    out = np.where(weight >= 0.5, b - diff * (1 - weight), a + diff * weight)
    return [at[n - 1] if top else float(q) for q, top in zip(out, last.tolist())]


_SIGN = np.uint64(1 << 63)


def _sort_keys(values: np.ndarray) -> np.ndarray:
    """uint64 keys that order as the float64 ``values`` do (NaN-free)."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def _key_value(key: int) -> float:
    bits = key ^ (1 << 63) if key >> 63 else key ^ ((1 << 64) - 1)
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def order_statistics(chunks: Callable[[], Iterable[np.ndarray]], ranks: Iterable[int]) -> dict[int, float]:
    """The values at 0-based ``ranks`` of the sorted sample, exactly, from a
    sample read chunk by chunk (``chunks()`` starts a new read).

    Radix selection on sort keys: each read histograms the next 16 bits of
    the keys in every target's bucket (all values sharing the bits found so
    far) and moves the target into the bin holding its rank. A bucket of at
    most ``MAX_GATHER`` values is then read into memory and sorted; a bucket of
    more, however many equal values it holds, ends as one key after 64 bits.
    """
    # rank -> [bits known, key prefix, values below the bucket, values in the bucket]
    todo = {r: [0, 0, 0, -1] for r in ranks}
    found: dict[int, float] = {}
    while todo:
        for r, (bits, prefix, _, _) in list(todo.items()):
            if bits == 64:
                found[r] = _key_value(prefix)
                del todo[r]
        if not todo:
            break
        gather = {(t[0], t[1]) for t in todo.values() if 0 <= t[3] <= MAX_GATHER}
        refine = {(t[0], t[1]) for t in todo.values()} - gather
        hists = {b: np.zeros(1 << 16, dtype=np.int64) for b in refine}
        held: dict[tuple[int, int], list[np.ndarray]] = {b: [] for b in gather}
        for chunk in chunks():
            keys = _sort_keys(chunk)
            for bits, prefix in refine | gather:
                inside = keys if bits == 0 else keys[(keys >> np.uint64(64 - bits)) == np.uint64(prefix)]
                if (bits, prefix) in gather:
                    held[(bits, prefix)].append(inside)
                else:
                    digits = (inside >> np.uint64(48 - bits)) & np.uint64(0xFFFF)
                    hists[(bits, prefix)] += np.bincount(digits.astype(np.intp), minlength=1 << 16)
        for r, t in list(todo.items()):
            bits, prefix, below, _ = t
            if (bits, prefix) in gather:
                keys = np.sort(np.concatenate(held[(bits, prefix)]))
                found[r] = _key_value(int(keys[r - below]))
                del todo[r]
                continue
            cum = np.cumsum(hists[(bits, prefix)])
            digit = int(np.searchsorted(cum, r - below, side="right"))
            before = int(cum[digit - 1]) if digit else 0
            todo[r] = [bits + 16, (prefix << 16) | digit, below + before, int(cum[digit]) - before]
    return found


# ---- inter-token latency ---------------------------------------------------------------------------
def token_gaps(token_chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(request id, gap in s) for every token but a request's first, chunk by chunk.

    ``token_chunks``: (request ids, times) with each request's tokens in time
    order. Each request's last token time is carried from chunk to chunk.
    Within a chunk the gaps come by request id, each request's in time order.
    """
    last_s = np.empty(0)                  # per request id: its latest token time, NaN before any
    for ids, times in _pieces(token_chunks):
        top = int(ids.max()) + 1
        if top > len(last_s):               # grown by doubling: a million requests, ~20 copies, not ~1,000
            grown = np.full(max(top, 2 * len(last_s)), np.nan)
            grown[:len(last_s)] = last_s
            last_s = grown
        order = np.argsort(ids, kind="stable")
        ids, times = ids[order], np.asarray(times, dtype=np.float64)[order]
        first = np.empty(len(ids), dtype=bool)          # a request's first token in this chunk
        first[0] = True
        np.not_equal(ids[1:], ids[:-1], out=first[1:])
        prev = np.empty_like(times)
        prev[1:] = times[:-1]
        prev[first] = last_s[ids[first]]
        final = np.append(first[1:], True)              # a request's last token in this chunk
        last_s[ids[final]] = times[final]
        # A request's tokens of one step (speculative decoding's accepted drafts) reach the client
        # in one streamed chunk: vLLM's benchmark records one ITL per chunk, so no zero gaps.
        keep = ~np.isnan(prev) & (times != prev)
        yield ids[keep], (times - prev)[keep]


def _pieces(token_chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The chunks cut into non-empty pieces of at most ``GAP_PIECE`` tokens: the
    gaps of a piece take ~80 bytes a token while computed."""
    for ids, times in token_chunks:
        for lo in range(0, len(ids), GAP_PIECE):
            yield ids[lo:lo + GAP_PIECE], times[lo:lo + GAP_PIECE]


def itl_values(token_chunks: Iterable[tuple[np.ndarray, np.ndarray]], num_tokens: int) -> Values:
    """Every ITL (s) of ``num_tokens`` tokens given in chunks. Up to
    ``MAX_IN_MEMORY_VALUES`` tokens: an array in ``inter_token_latencies``'
    order (the same sums however the log was chunked); beyond,
    ``SpilledValues``, written as the chunks come."""
    gaps = token_gaps(token_chunks)
    if num_tokens <= MAX_IN_MEMORY_VALUES:
        return _by_request(gaps)
    spilled = SpilledValues()
    for _, values in gaps:
        spilled.add(values)
    return spilled


def inter_token_latencies(token_req_ids: np.ndarray, token_times_s: np.ndarray) -> np.ndarray:
    """All gaps between consecutive tokens of the same request (seconds), by
    request, then time; the tokens in time order within each request."""
    return _by_request(token_gaps([(np.asarray(token_req_ids), np.asarray(token_times_s))]))


def _by_request(gaps: Iterable[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The gaps of ``token_gaps`` in one array, by request, then time."""
    parts = list(gaps)
    if not parts:
        return np.empty(0)
    order = np.argsort(np.concatenate([p[0] for p in parts]), kind="stable")
    return np.concatenate([p[1] for p in parts])[order]


# ---- the summary -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTotals:
    """What the summary needs from the step log."""

    num_steps: int
    num_replicas: int                      # replicas that ran at least one step
    batch_size_sum: int
    busy_s: float                          # summed step durations (over replicas)
    kv_busy_s: float | None = None         # sum of KV utilisation x step duration (None: pool unknown)
    peak_kv_utilization: float | None = None


def step_totals(columns: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None]], num_steps: int,
                num_replicas: int, kv_total_blocks: int | None) -> StepTotals:
    """``StepTotals`` from chunks of (duration_s, batch_size, kv_used_blocks or None)."""
    kv_busy_s = peak_kv = None
    if num_steps <= MAX_IN_MEMORY_STEPS:
        parts = list(columns)
        if not parts:
            return StepTotals(0, num_replicas, 0, 0.0)
        dur = np.concatenate([p[0] for p in parts])
        busy_s = float(dur.sum())
        batch_sum = int(np.concatenate([p[1] for p in parts]).sum())
        if kv_total_blocks:
            kv = np.concatenate([p[2] for p in parts]) / kv_total_blocks
            kv_busy_s, peak_kv = float((kv * dur).sum()), float(kv.max())
        return StepTotals(num_steps, num_replicas, batch_sum, busy_s, kv_busy_s, peak_kv)
    busy, weighted, batch_sum, peak_used = [], [], 0, 0
    for dur, batch, used in columns:
        busy.append(float(dur.sum()))
        batch_sum += int(batch.sum())
        if kv_total_blocks:
            weighted.append(float((used / kv_total_blocks * dur).sum()))
            peak_used = max(peak_used, int(used.max()))
    if kv_total_blocks:
        kv_busy_s, peak_kv = math.fsum(weighted), peak_used / kv_total_blocks
    return StepTotals(num_steps, num_replicas, batch_sum, math.fsum(busy), kv_busy_s, peak_kv)


def summarize(requests: pd.DataFrame, tokens: pd.DataFrame, steps: pd.DataFrame,
              slo: dict[str, float | None] | None = None,
              kv_total_blocks: int | None = None) -> dict[str, Any]:
    """The run's summary.json (vLLM serving-benchmark key names plus extras)
    from its tables; ``steps`` has one row per step (and replica)."""
    num_replicas = int(steps["replica"].nunique()) if "replica" in steps else 1
    columns = [(steps["duration_s"].to_numpy(), steps["batch_size"].to_numpy(),
                steps["kv_used_blocks"].to_numpy() if kv_total_blocks else None)] if len(steps) else []
    itl = itl_values([(tokens["req_id"].to_numpy(), tokens["t_s"].to_numpy())], len(tokens))
    return summarize_logs(requests, itl, step_totals(columns, len(steps), num_replicas, kv_total_blocks), slo)


def request_columns(requests: Any, columns: Sequence[str], *, finished_only: bool = False) -> dict[str, np.ndarray]:
    """``columns`` of the requests (a requests DataFrame or a compact
    ``sim.results.table.RequestTable``) as arrays, of all of them or of the finished
    ones only. From a DataFrame: its own columns (no copy) where every request
    is taken, the usual case, else copies of these columns only
    (``requests[finished]`` would copy every column: a second requests table
    in memory)."""
    if not isinstance(requests, pd.DataFrame):
        return requests.columns_of(columns, finished_only=finished_only)
    if finished_only:
        finished = (requests["status"] == "finished").to_numpy()
        if not finished.all():
            return {c: requests[c].to_numpy()[finished] for c in columns}
    return {c: requests[c].to_numpy() for c in columns}


def finished_columns(requests: Any, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """``request_columns`` of the finished requests."""
    return request_columns(requests, columns, finished_only=True)


def latency_values_s(requests: Any, name: str) -> np.ndarray:
    """The seconds behind request metric ``name`` (ttft, tpot, e2el, queue): the
    finished requests' values; TPOT only of those with more than one output token."""
    if name == "tpot":
        both = finished_columns(requests, ("tpot_s", "output_tokens"))
        return both["tpot_s"][both["output_tokens"] > 1]
    column = {"ttft": "ttft_s", "e2el": "e2e_s", "queue": "queue_s"}[name]
    return finished_columns(requests, (column,))[column]


def summarize_logs(requests: Any, itl_s: Values, steps: StepTotals,
                   slo: dict[str, float | None] | None = None) -> dict[str, Any]:
    """The summary from the requests table (a DataFrame or a ``sim.results.table.RequestTable``),
    the run's ITL values (``itl_values``) and its ``step_totals``."""
    # Column by column, each dropped after use: at a million requests a column is 8 MB.
    def done(name: str) -> np.ndarray:
        return finished_columns(requests, (name,))[name]

    num_done = len(done("finished_s"))
    failed = len(requests) - num_done
    start_s = float(np.nanmin(request_columns(requests, ("arrival_s",))["arrival_s"])) if len(requests) else 0.0
    # As vLLM's benchmark_duration: until every request has returned, the failed ones too (a
    # rejected request returns when it is refused, its finished_s), not only the completed ones.
    ended_s = request_columns(requests, ("finished_s",))["finished_s"]
    end_s = float(np.nanmax(ended_s)) if len(requests) and not np.isnan(ended_s).all() else start_s
    del ended_s
    duration_s = max(end_s - start_s, 1e-12)
    total_in = int(np.nansum(done("prompt_tokens")))
    total_out = int(np.nansum(done("output_tokens")))
    s: dict[str, Any] = {
        "completed": num_done,
        "failed": failed,
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": num_done / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    for name in METRICS:
        s.update(distribution(name, itl_s if name == "itl" else latency_values_s(requests, name)))
        trim_heap()                        # its series and sorted copies, before the next one's
    s["request_goodput"] = None
    if slo and any(v is not None for v in slo.values()):
        # vLLM's --goodput: a completed request is good when every constrained metric is <= its
        # threshold, compared in seconds against slo_ms / 1000 as vLLM does (value_s * 1e3 <= slo_ms
        # rounds differently at the threshold); a one-token request's TPOT counts as 0.
        ok = np.ones(num_done, bool)
        for key, col in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s"), ("e2el_ms", "e2e_s")):
            if slo.get(key) is not None:
                ok &= np.nan_to_num(done(col), nan=0.0) <= slo[key] / 1e3
        s["request_goodput"] = int(ok.sum()) / duration_s
        s["slo_attainment"] = float(ok.mean()) if len(ok) else None
    s["num_preemptions"] = int(np.nansum(request_columns(requests, ("num_preemptions",))["num_preemptions"]))
    s["num_steps"] = steps.num_steps
    if steps.num_steps:
        # Steps of several replicas overlap in time: busy is per replica, averaged over the fleet.
        s["mean_batch_size"] = steps.batch_size_sum / steps.num_steps
        s["busy_fraction"] = min(1.0, steps.busy_s / (steps.num_replicas * duration_s))
        if steps.kv_busy_s is not None:
            s["mean_kv_utilization"] = steps.kv_busy_s / steps.busy_s if steps.busy_s > 0 else 0.0
            s["peak_kv_utilization"] = steps.peak_kv_utilization
    else:
        s.update(mean_batch_size=0.0, busy_fraction=0.0, mean_kv_utilization=0.0, peak_kv_utilization=0.0)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.items()}
