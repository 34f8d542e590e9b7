"""What a simulated or live run hands back: ``RunResult`` (requests, steps,
tokens, summary, metadata) and ``RunLogs``, the replicas' logs it streams
its tables from. Data only: ``sim.results.folder`` writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pandas as pd

from sim.base.heap import trim_heap
from sim.core.logs import StepLog, TokenLog
from sim.results.metrics import Values, itl_values
from sim.results.table import RequestTable


EMPTY_STEPS = (np.empty(0), np.empty(0), np.empty(0), np.empty((0, StepLog.NUM_INTS), dtype=np.int64))


@dataclass
class RunLogs:
    """Each replica's step and token logs (``sim.core.logs``), in replica order;
    ``kv_total_blocks`` is every replica's pool size, or each one's in replica order (pools of
    different sizes: a disaggregated run's prefill and decode instances)."""

    replicas: list[int]
    steps: list[StepLog]
    tokens: list[TokenLog]
    kv_total_blocks: int | list[int]

    def pool_size(self, k: int) -> int:
        """The KV pool of the k-th replica listed."""
        total = self.kv_total_blocks
        return total[k] if isinstance(total, list) else total

    def step_frames(self) -> Iterator[pd.DataFrame]:
        """The step table (as steps.csv), chunk by chunk, replica after replica."""
        for k, (replica, log) in enumerate(zip(self.replicas, self.steps)):
            for chunk in log.chunks():
                yield step_frame(replica, *chunk, kv_total_blocks=self.pool_size(k))

    def token_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(req_id, t_s) of the tokens, chunk by chunk, replica after replica."""
        for log in self.tokens:
            yield from log.chunks()


class RunResult:
    """A run's tables, summary and metadata.

    ``steps`` and ``tokens`` of a simulated run are built from its logs on
    first use; writers read ``step_frames()`` and ``token_chunks()`` instead,
    which stream the logs of a run too large to hold as tables.
    """

    def __init__(self, requests: pd.DataFrame | RequestTable, steps: pd.DataFrame | None,
                 tokens: pd.DataFrame | None, summary: dict[str, Any], meta: dict[str, Any] | None = None,
                 logs: RunLogs | None = None) -> None:
        if logs is None and (steps is None or tokens is None):
            raise ValueError("RunResult needs the steps and tokens tables or the logs they come from")
        # A simulated run's requests come as a compact RequestTable (sim.results.table): the
        # DataFrame is built on first use of ``requests``; writers and summaries read
        # ``request_source`` and ``request_frames()``, which never build it whole.
        self.table = requests if isinstance(requests, RequestTable) else None
        self._requests = None if self.table is not None else requests
        self.summary = summary
        self.meta = {} if meta is None else meta
        self.logs = logs
        self._steps = steps
        self._tokens = tokens
        self._itl: Values | None = None
        # Each request's wait for a free client under a concurrency cap, by request id (vLLM's
        # client_queue_time; None: open-loop arrivals, sent when drawn).
        self.client_queue_s: np.ndarray | None = None
        # With a prefix cache: its time line, rows (time_s, replica, kv_used_blocks,
        # cached_free_blocks) sampled after steps (sim.loop.server.CACHE_SAMPLE_S); None without.
        self.prefix_cache: pd.DataFrame | None = None
        # A disaggregated run's time line (sim.run.disagg.pd_timeline): the prefill side's KV held
        # for transfer and the transfers in flight; None for an aggregated run.
        self.pd_timeline: pd.DataFrame | None = None

    @property
    def requests(self) -> pd.DataFrame:
        """One row per request (``sim.results.table.COLUMNS`` and the latencies)."""
        if self._requests is None:
            assert self.table is not None, "checked in __init__"
            self._requests = self.table.frame()
        return self._requests

    @property
    def request_source(self) -> pd.DataFrame | RequestTable:
        """The requests as the summaries read them: the table if built, else the compact one."""
        return self.table if self._requests is None else self._requests

    def request_frames(self) -> Iterator[pd.DataFrame]:
        """The requests table in row chunks (all of it at once if built)."""
        if self._requests is None:
            yield from self.table.frames()
        else:
            yield self._requests

    @property
    def steps(self) -> pd.DataFrame:
        if self._steps is None:
            assert self.logs is not None, "checked in __init__"
            frames = (list(self.logs.step_frames()) or
                      [step_frame(0, *EMPTY_STEPS, kv_total_blocks=self.logs.pool_size(0))])
            self._steps = pd.concat(frames, ignore_index=True)
        return self._steps

    @property
    def tokens(self) -> pd.DataFrame:
        if self._tokens is None:
            parts = list(self.token_chunks()) or [(np.empty(0, np.int64), np.empty(0))]
            self._tokens = pd.DataFrame({"req_id": np.concatenate([p[0] for p in parts]),
                                         "t_s": np.concatenate([p[1] for p in parts])})
        return self._tokens

    def step_frames(self) -> Iterator[pd.DataFrame]:
        """The step table in chunks: from the logs unless the table was built."""
        if self._steps is None and self.logs is not None and any(len(log) for log in self.logs.steps):
            yield from self.logs.step_frames()
        else:
            yield self.steps                # as built (a caller may have added columns), or empty

    def token_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(req_id int64, t_s float64) of every token in chunks, from the table if built, else the logs."""
        if self._tokens is not None or self.logs is None:
            yield self.tokens["req_id"].to_numpy(dtype=np.int64), self.tokens["t_s"].to_numpy(dtype=np.float64)
        else:
            yield from self.logs.token_chunks()

    def itl(self) -> Values:
        """Every inter-token gap of the run (s; ``sim.results.metrics.itl_values``: spilled
        to disk when too many for memory), computed once: the summary and
        vllm_bench.json read the same values."""
        if self._itl is None:
            self._itl = itl_values(self.token_chunks(), self.num_tokens)
            trim_heap()                    # the token chunks' and gaps' temporaries
        return self._itl

    @property
    def num_tokens(self) -> int:
        if self._tokens is not None or self.logs is None:
            return len(self.tokens)
        return sum(len(log) for log in self.logs.tokens)


def step_frame(replica: int, t_s: np.ndarray, duration_s: np.ndarray, predicted_s: np.ndarray, ints: np.ndarray,
               *, kv_total_blocks: int) -> pd.DataFrame:
    """Steps of one replica as rows of steps.csv: replica, ``StepLog.COLUMNS``, kv_total_blocks."""
    df = pd.DataFrame(ints, columns=list(StepLog.COLUMNS[3:]))
    df.insert(0, "predicted_s", predicted_s)
    df.insert(0, "duration_s", duration_s)
    df.insert(0, "t_s", t_s)
    df.insert(0, "replica", replica)
    df["kv_total_blocks"] = kv_total_blocks
    return df
