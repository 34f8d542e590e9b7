"""A run's steps as a Chrome / Perfetto trace (Trace Event Format JSON).

One complete event (``"ph": "X"``, ``ts`` and ``dur`` in microseconds) per
step, on one track per replica (``pid`` = replica, ``tid`` 0), named by the
batch's composition, e.g. "3 prefill + 12 decode, 620 tok"; its ``args``
carry the counts. Open trace.json in https://ui.perfetto.dev or
chrome://tracing. The JSON comes as text chunks, so millions of steps are
never all Python objects at once; ``first_steps`` bounds the size.
"""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np
import pandas as pd

MAX_TRACE_STEPS = 2_000_000             # about 0.5 GB of JSON; Perfetto's browser UI struggles beyond
EVENTS_PER_CHUNK = 10_000
# args key -> steps column; the KV and queue columns only where the run recorded them
ARGS = {"prefill_chunks": "num_prefill_seqs", "prefill_tokens": "num_prefill_tokens",
        "decodes": "num_decode_tokens", "pad_tokens": "num_pad_tokens", "batch_size": "batch_size",
        "kv_used_blocks": "kv_used_blocks", "num_waiting": "num_waiting", "num_running": "num_running"}


def step_name(num_prefill_chunks: int, num_decodes: int, num_tokens: int, num_pad_tokens: int = 0) -> str:
    """The event's title: "3 prefill + 12 decode, 620 tok", and "+ 40 pad" for a static batch's padding."""
    pad = f" + {num_pad_tokens:,} pad" if num_pad_tokens else ""
    return f"{num_prefill_chunks} prefill + {num_decodes} decode, {num_tokens:,} tok{pad}"


def first_steps(steps: pd.DataFrame, max_steps: int = MAX_TRACE_STEPS) -> pd.DataFrame:
    """The earliest ``max_steps`` steps of all replicas (all of them when fewer)."""
    if len(steps) <= max_steps:
        return steps
    return steps.sort_values("t_s", kind="stable").iloc[:max_steps]


def _replica_events(steps: pd.DataFrame, replica: int) -> Iterator[dict]:
    """One replica's steps in time order. ts and dur are rounded to the nanosecond, and a step
    ends no later than the next one starts (the simulator's clock sums in floating point)."""
    rows = steps.sort_values("t_s", kind="stable")
    start_us = np.round(rows["t_s"].to_numpy() * 1e6, 3)
    end_us = np.round((rows["t_s"].to_numpy() + rows["duration_s"].to_numpy()) * 1e6, 3)
    end_us[:-1] = np.minimum(end_us[:-1], start_us[1:])
    args = {key: rows[col].to_numpy() for key, col in ARGS.items() if col in rows}
    tokens = rows["num_prefill_tokens"].to_numpy() + rows["num_decode_tokens"].to_numpy()
    for i in range(len(rows)):
        step_args = {key: int(values[i]) for key, values in args.items()}
        step_args["tokens"] = int(tokens[i])
        yield {"name": step_name(step_args["prefill_chunks"], step_args["decodes"], step_args["tokens"],
                                 step_args["pad_tokens"]),
               "cat": "step", "ph": "X", "pid": replica, "tid": 0, "ts": float(start_us[i]),
               "dur": float(round(end_us[i] - start_us[i], 3)), "args": step_args}


def _events(steps: pd.DataFrame) -> Iterator[dict]:
    replicas = sorted(int(r) for r in steps["replica"].unique()) if len(steps) else []
    for k in replicas:
        yield {"name": "process_name", "ph": "M", "pid": k, "tid": 0, "args": {"name": f"replica {k}"}}
        yield {"name": "process_sort_index", "ph": "M", "pid": k, "tid": 0, "args": {"sort_index": k}}
        yield {"name": "thread_name", "ph": "M", "pid": k, "tid": 0, "args": {"name": "steps"}}
    for k in replicas:
        yield from _replica_events(steps[steps["replica"] == k], k)


def trace_chunks(steps: pd.DataFrame) -> Iterator[str]:
    """The trace of ``steps`` (columns as steps.csv, ``sim.results.result.step_frame``) as JSON text, in pieces."""
    yield '{"displayTimeUnit": "ms", "traceEvents": [\n'
    batch: list[str] = []
    first = True
    for event in _events(steps):
        batch.append(json.dumps(event, separators=(",", ":")))
        if len(batch) == EVENTS_PER_CHUNK:
            yield ("" if first else ",\n") + ",\n".join(batch)
            batch, first = [], False
    if batch:
        yield ("" if first else ",\n") + ",\n".join(batch)
    yield "\n]}\n"
