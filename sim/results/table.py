"""A run's requests table, kept compact until someone asks for the DataFrame.

The servers hand over their ``RequestRecords`` (sim.core.request) after a run;
``RequestTable.from_records`` places them in request-id order as compact
columns (int32 counts, int8 status and reason codes: 58 bytes a request, 62 with prefix caching).
The summary, vllm_bench.json and requests.csv read it column by column or in
row chunks (``columns_of``, ``frames``), so a million-request run never holds
the full table of ~140 bytes a request (int64 and float64 columns, status
strings, the four latencies). ``frame()`` builds that table, the one
``RunResult.requests`` returns, for whoever wants it whole.

Each chunk is the full table's rows, built by the same code
(``sim.results.metrics.add_request_metrics`` for the latencies), so chunks and the
whole table agree value for value.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import pandas as pd

from sim.base.heap import trim_heap
from sim.results.metrics import add_request_metrics
from sim.core.request import REJECT_REASONS, RequestRecords, Status

# The requests table's columns before the latencies, in requests.csv's order.
COLUMNS = ("req_id", "replica", "arrival_s", "prompt_tokens", "output_tokens", "max_tokens", "status",
           "reject_reason", "first_scheduled_s", "first_token_s", "finished_s", "num_preemptions")
LATENCIES = ("queue_s", "ttft_s", "e2e_s", "tpot_s")          # add_request_metrics' columns
STATUS_TEXT = np.array([{Status.FINISHED: "finished", Status.REJECTED: "rejected"}.get(k, "")
                        for k in range(max(Status) + 1)], dtype=object)          # by Status code
REASON_TEXT = np.array(["", *REJECT_REASONS], dtype=object)                       # by REASON_CODES
_RECORD_DTYPES = {name: np.dtype(code) for name, code in RequestRecords.COLUMNS}   # same codes as array's


class RequestTable:
    """Per-request results in id order (ids 0 .. n-1), compact: ``cols`` maps
    the record column names (``RequestRecords.COLUMNS`` but req_id, plus
    ``replica``) to arrays of their record dtypes."""

    ROWS = 65_536            # rows per chunk of ``frames`` and ``columns_of``

    def __init__(self, cols: dict[str, np.ndarray]) -> None:
        self.cols = cols
        # Columns of a run's own appended after the latencies, by name, in id order (a
        # disaggregated run's phases: sim.run.disagg).
        self.extra: dict[str, np.ndarray] = {}

    @classmethod
    def from_records(cls, records: Sequence[RequestRecords], replicas: Sequence[int],
                     num_requests: int, *, prefix_caching: bool = False) -> RequestTable:
        """The table of requests 0 .. ``num_requests`` - 1 from each replica's
        records, which it takes over (they are empty afterwards); with
        ``prefix_caching`` it keeps each request's cached prompt tokens
        (``num_cached_tokens`` in ``frame()``, vLLM's
        ``prompt_tokens_details.cached_tokens``), else drops them. Each column is
        placed in id order and its record dropped before the next, so the table
        never sits beside a second copy of itself. Raises RuntimeError unless
        every id is recorded exactly once."""
        n = num_requests
        # int32 positions where they fit: they index every column below (4 MB at a million requests)
        index = np.int32 if n <= np.iinfo(np.int32).max else np.int64
        parts = [r.pop("req_id").astype(index) for r in records]
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=index)
        once = len(ids) == n and (not n or (ids.min() >= 0 and ids.max() < n))
        if once and n:                      # n ids in 0..n-1, each seen: each exactly once
            seen = np.zeros(n, dtype=bool)
            seen[ids] = True
            once = bool(seen.all())
            del seen
        if not once:
            raise RuntimeError(f"the servers' records hold {len(ids)} requests, not each of 0..{n - 1} once")
        bounds = np.cumsum([0] + [len(p) for p in parts])
        del parts
        cols: dict[str, np.ndarray] = {"replica": np.empty(n, dtype=np.int32)}
        for k, replica in enumerate(replicas):
            cols["replica"][ids[bounds[k]:bounds[k + 1]]] = replica
        for name, _ in RequestRecords.COLUMNS[1:]:
            if name == "cached_tokens" and not prefix_caching:
                for r in records:
                    r.pop(name)
                continue
            out = np.empty(n, dtype=_RECORD_DTYPES[name])
            for k, r in enumerate(records):
                out[ids[bounds[k]:bounds[k + 1]]] = r.pop(name)
            cols[name] = out
            trim_heap()     # the column's record chunks, freed in holes the next column cannot use
        return cls(cols)

    def __len__(self) -> int:
        return len(self.cols["arrival_s"])

    @property
    def finished(self) -> np.ndarray:
        return self.cols["status"] == Status.FINISHED

    def failed_by_reason(self) -> dict[str, int]:
        """Rejected requests per reason, most first (as ``value_counts`` orders them)."""
        counts = np.bincount(self.cols["reason"][self.cols["status"] == Status.REJECTED],
                             minlength=len(REASON_TEXT))
        found = [(REASON_TEXT[k], int(c)) for k, c in enumerate(counts) if c and k]
        return dict(sorted(found, key=lambda kv: -kv[1]))

    def frame(self, lo: int = 0, hi: int | None = None) -> pd.DataFrame:
        """Rows ``lo`` .. ``hi`` of the requests table (int64, float64 and text
        columns, then the latencies)."""
        hi = len(self) if hi is None else min(hi, len(self))
        c = {name: values[lo:hi] for name, values in self.cols.items()}
        as64 = {"replica", "prompt_tokens", "output_tokens", "max_tokens", "num_preemptions"}
        frame = {"req_id": np.arange(lo, hi, dtype=np.int64)}
        for name in COLUMNS[1:]:
            if name == "status":
                frame[name] = STATUS_TEXT[c["status"]]
            elif name == "reject_reason":
                frame[name] = REASON_TEXT[c["reason"]]
            else:
                frame[name] = c[name].astype(np.int64) if name in as64 else c[name].copy()
        if "cached_tokens" in c:
            frame["num_cached_tokens"] = c["cached_tokens"].astype(np.int64)
        out = add_request_metrics(pd.DataFrame(frame, copy=False))
        for name, values in self.extra.items():
            out[name] = values[lo:hi]
        return out

    def frames(self, rows: int | None = None) -> Iterator[pd.DataFrame]:
        """The requests table in row chunks (one empty frame for no requests)."""
        rows = rows or self.ROWS
        for lo in range(0, max(len(self), 1), rows):
            yield self.frame(lo, lo + rows)

    def columns_of(self, names: Sequence[str], *, finished_only: bool = False) -> dict[str, np.ndarray]:
        """Whole columns of the table (as ``frame()`` has them), of every request
        or of the finished ones only; the latencies are computed chunk by chunk."""
        keep = self.finished if finished_only else None
        out: dict[str, np.ndarray] = {}
        direct = [n for n in names if n not in LATENCIES]
        if direct:
            for name in direct:
                if name == "req_id":
                    values = np.arange(len(self), dtype=np.int64)
                elif name == "status":
                    values = STATUS_TEXT[self.cols["status"]]
                elif name == "reject_reason":
                    values = REASON_TEXT[self.cols["reason"]]
                elif name == "num_cached_tokens":
                    values = self.cols["cached_tokens"].astype(np.int64)
                else:                       # selected, then widened: one copy the size of the result
                    values = self.cols[name] if keep is None else self.cols[name][keep]
                    out[name] = values.astype(np.int64) if values.dtype.kind == "i" else values
                    continue
                out[name] = values if keep is None else values[keep]
        derived = [n for n in names if n in LATENCIES]
        if derived:
            # Filled in place chunk by chunk: no list of parts beside their concatenation.
            size = len(self) if keep is None else int(np.count_nonzero(keep))
            filled = {n: np.empty(size) for n in derived}
            at = 0
            for lo in range(0, len(self), self.ROWS):
                hi = min(lo + self.ROWS, len(self))
                chunk = add_request_metrics(pd.DataFrame({
                    "arrival_s": self.cols["arrival_s"][lo:hi],
                    "first_scheduled_s": self.cols["first_scheduled_s"][lo:hi],
                    "first_token_s": self.cols["first_token_s"][lo:hi],
                    "finished_s": self.cols["finished_s"][lo:hi],
                    "output_tokens": self.cols["output_tokens"][lo:hi].astype(np.int64),
                    "status": STATUS_TEXT[self.cols["status"][lo:hi]]}, copy=False))
                rows = slice(None) if keep is None else keep[lo:hi]
                for n in derived:
                    values = chunk[n].to_numpy()[rows]
                    filled[n][at:at + len(values)] = values
                at += len(values)
            out.update(filled)
        return {n: out[n] for n in names}

    def take(self, rows: np.ndarray) -> RequestTable:
        """The requests at positions ``rows`` (a replica's, for its summary)."""
        return _Subset({name: values[rows] for name, values in self.cols.items()}, np.asarray(rows))


class _Subset(RequestTable):
    """Some of a table's requests: their ids are ``ids``, not 0 .. k-1."""

    def __init__(self, cols: dict[str, np.ndarray], ids: np.ndarray) -> None:
        super().__init__(cols)
        self.ids = ids

    def columns_of(self, names: Sequence[str], *, finished_only: bool = False) -> dict[str, np.ndarray]:
        out = super().columns_of([n for n in names if n != "req_id"], finished_only=finished_only)
        if "req_id" in names:
            out["req_id"] = self.ids[self.finished] if finished_only else self.ids
        return {n: out[n] for n in names}

    def frame(self, lo: int = 0, hi: int | None = None) -> pd.DataFrame:
        frame = super().frame(lo, hi)
        frame["req_id"] = self.ids[lo:lo + len(frame)]
        return frame
