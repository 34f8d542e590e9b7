"""Serving metrics, named and defined as vLLM's serving benchmark reports them.

- TTFT: first output token time - arrival.
- ITL: every gap between consecutive output tokens of a request (a
  distribution over tokens, not requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with > 1 output token.
- E2EL: finished (result returned) - arrival.
- queue: first scheduled - arrival.
Percentiles are numpy's linear interpolation, std is numpy's default (the
population std, ddof 0, as vLLM's benchmark reports it); every metric comes
with its count. Throughputs divide by ``duration_s``: first arrival to last
completion. Goodput counts completed requests meeting every SLO (<=).
KV utilisation is weighted by step duration over busy time; busy fraction is
the busy time per replica over ``duration_s``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

PERCENTILES = (50, 90, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el", "queue")


def distribution(name: str, values_s: np.ndarray) -> dict[str, Any]:
    """mean/median/std/p50/p90/p95/p99 in ms plus the count (NaN-free input)."""
    v = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, Any] = {f"count_{name}": int(v.size)}
    if v.size == 0:
        for key in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            out[f"{key}_{name}_ms"] = None
        return out
    out[f"mean_{name}_ms"] = float(v.mean())
    out[f"median_{name}_ms"] = float(np.median(v))
    out[f"std_{name}_ms"] = float(v.std())
    for p, q in zip(PERCENTILES, np.percentile(v, PERCENTILES)):
        out[f"p{p}_{name}_ms"] = float(q)
    return out


def inter_token_latencies(token_req_ids: np.ndarray, token_times_s: np.ndarray) -> np.ndarray:
    """All gaps between consecutive tokens of the same request (seconds)."""
    if token_req_ids.size < 2:
        return np.empty(0)
    order = np.argsort(token_req_ids, kind="stable")    # the log is already in time order
    ids, times = token_req_ids[order], token_times_s[order]
    same = ids[1:] == ids[:-1]
    return (times[1:] - times[:-1])[same]


def summarize(requests: pd.DataFrame, tokens: pd.DataFrame, steps: pd.DataFrame,
              slo: dict[str, float | None] | None = None,
              kv_total_blocks: int | None = None) -> dict[str, Any]:
    """The run's summary.json (vLLM serving-benchmark key names plus extras)."""
    done = requests[requests["status"] == "finished"]
    failed = int((requests["status"] != "finished").sum())
    start_s = float(requests["arrival_s"].min()) if len(requests) else 0.0
    end_s = float(done["finished_s"].max()) if len(done) else start_s
    duration_s = max(end_s - start_s, 1e-12)
    total_in = int(done["prompt_tokens"].sum())
    total_out = int(done["output_tokens"].sum())
    s: dict[str, Any] = {
        "completed": int(len(done)),
        "failed": failed,
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    multi = done["output_tokens"] > 1
    itl = inter_token_latencies(tokens["req_id"].to_numpy(), tokens["t_s"].to_numpy())
    series = {
        "ttft": done["ttft_s"].to_numpy(),
        "tpot": done.loc[multi, "tpot_s"].to_numpy(),
        "itl": itl,
        "e2el": done["e2e_s"].to_numpy(),
        "queue": done["queue_s"].to_numpy(),
    }
    for name in METRICS:
        s.update(distribution(name, series[name]))
    s["request_goodput"] = None
    if slo and any(v is not None for v in slo.values()):
        # vLLM's --goodput: a completed request is good when every constrained metric is <= its
        # threshold, compared in seconds against slo_ms / 1000 as vLLM does (value_s * 1e3 <= slo_ms
        # rounds differently at the threshold); a one-token request's TPOT counts as 0.
        ok = np.ones(len(done), bool)
        for key, col in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s"), ("e2el_ms", "e2e_s")):
            if slo.get(key) is not None:
                vals_s = done[col].to_numpy()
                ok &= np.nan_to_num(vals_s, nan=0.0) <= slo[key] / 1e3
        s["request_goodput"] = int(ok.sum()) / duration_s
        s["slo_attainment"] = float(ok.mean()) if len(ok) else None
    s["num_preemptions"] = int(requests["num_preemptions"].sum())
    s["num_steps"] = int(len(steps))
    if len(steps):
        dur = steps["duration_s"].to_numpy()
        busy_s = float(dur.sum())
        # Steps of several replicas overlap in time: busy is per replica, averaged over the fleet.
        num_replicas = int(steps["replica"].nunique()) if "replica" in steps else 1
        s["mean_batch_size"] = float(steps["batch_size"].mean())
        s["busy_fraction"] = min(1.0, busy_s / (num_replicas * duration_s))
        if kv_total_blocks:
            kv = steps["kv_used_blocks"].to_numpy() / kv_total_blocks
            s["mean_kv_utilization"] = float((kv * dur).sum() / busy_s) if busy_s > 0 else 0.0
            s["peak_kv_utilization"] = float(kv.max())
    else:
        s.update(mean_batch_size=0.0, busy_fraction=0.0, mean_kv_utilization=0.0, peak_kv_utilization=0.0)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.items()}
