"""Disaggregated prefill and decode: a workload's ``disaggregation`` section and its run.

::

    disaggregation:
      prefill: {replicas: 2, router: prefix_aware, profile: {tensor_parallel: 2}, policy: {...}}
      decode:  {replicas: 1, router: least_requests, profile: {gpu: h200}, server: {...}}
      link: {kind: rdma-400g}            # or bandwidth_gbps / latency_us, each GPU's port
      proxy_ms: 0.0                      # the proxy's hop from a prefill reply to the decode send
      abort_timeout_s: 480               # KV nobody read is freed (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)

Each pool's ``profile``, ``policy`` and ``server`` are the workload's own with the pool's
fields over them (a pool's ``policy`` of another ``kind`` replaces the workload's); its
``replicas`` and ``router`` (``sim.loop.feed.ROUTERS``) are its own. The handoff between them
is vLLM's (``sim.loop.handoff``) with a decode pool of ``vllm_v1`` (the prefill pool's policy
may be any), SGLang's (``sim.loop.handoff_sglang``) with both pools ``sglang``, or TensorRT-LLM's
(``sim.run.pd_trtllm``) with both pools ``tensorrt_llm``. Both pools serve the same model, with
the same KV precision.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import simpy

from policies.config import policy_knobs
from sim.base.heap import trim_heap, tune_heap
from sim.core.logs import TokenLog
from sim.core.request import REJECT_REASONS
from sim.core.state import SchedulerState
from sim.cost.profile import Profile
from sim.loop.feed import ClientPool
from sim.loop.handoff import Handoff, feed_prefills, feed_prefills_capped
from sim.loop.handoff_sglang import SglangHandoff
from sim.loop.handoff_trtllm import TrtllmHandoff
from sim.loop.server import Server, SimExecutor
from sim.results.result import RunLogs, RunResult
from sim.results.table import RequestTable
from sim.base.strict import ConfigError
from sim.run.config import WorkloadConfig
from sim.run.pd_config import Disaggregation, Pool

# ---- the run -------------------------------------------------------------------------------------
def _build_pool(pool: Pool, env: simpy.Environment, first_replica: int, decode: bool):
    from sim.run.runner import block_size_of, build_policy, build_profile, kv_blocks, max_model_len_of, \
        resolve_server
    cfg = pool.cfg
    profile = build_profile(cfg)
    side = "decode" if decode else "prefill"
    if profile.model.is_hybrid or profile.data_parallel_size > 1:
        what = ("linear-attention layers (their state's handoff)" if profile.model.is_hybrid
                else "data-parallel ranks")
        raise ConfigError(f"{cfg.source}: field 'disaggregation.{side}.profile': a pool of {profile.model.name} "
                          f"with {what} is not modelled in disaggregated serving yet")
    cfg = resolve_server(cfg, profile)
    policy = build_policy(cfg, max_model_len_of(cfg, profile), profile)
    num_blocks, max_model_len = kv_blocks(cfg, profile, policy)
    executor = SimExecutor(profile)
    servers = []
    for k in range(pool.replicas):
        if k:
            policy = build_policy(cfg, max_model_len, profile)
        if decode:
            policy.decode_stretch = False        # a received transfer may admit at any step
        usable = num_blocks - policy.num_reserved_blocks
        state = SchedulerState(policy.kv_pool_class(usable, block_size_of(cfg, policy), cfg.server.watermark),
                               max_model_len, policy.max_prompt_tokens, refuse_by_prompt=policy.refuses_by_prompt,
                               clamp_max_tokens=policy.clamps_max_tokens)
        servers.append(Server(env, policy, state, executor, replica=first_replica + k))
    return cfg, profile, servers, num_blocks, max_model_len


def run_disaggregated(cfg: WorkloadConfig, *, progress: bool = False, strict: bool = False,
                      specs: Any = None) -> RunResult:
    """Simulate ``cfg`` (with its ``disaggregation``) on its prefill and decode pools; ``specs``
    (a ``workloads.generate.RequestSpecs``): these requests instead of the workload's."""
    from sim.run.runner import RequestStream, _run_env, profile_trust, request_max_tokens
    from workloads.generate import generate
    d: Disaggregation = cfg.disaggregation
    wall0 = time.perf_counter()
    tune_heap()
    env = simpy.Environment()
    p_cfg, p_profile, p_servers, p_blocks, p_len = _build_pool(d.prefill, env, 0, False)
    d_cfg, d_profile, d_servers, d_blocks, d_len = _build_pool(d.decode, env, d.prefill.replicas, True)
    specs = generate(cfg) if specs is None else specs
    if len(specs) == 0:
        raise ConfigError(f"{cfg.source}: the workload has no requests (check num_requests, duration_s, "
                          f"arrivals.start_s)")
    n = len(specs)
    requests = RequestStream(specs, request_max_tokens(d_cfg, specs, d_len))
    a = cfg.arrivals
    clients = ClientPool(env, min(a.max_concurrency, n), a.think_time_s) if a.max_concurrency is not None else None
    routers, tp = (d.prefill.router, d.decode.router), (p_cfg.profile.tensor_parallel, d_cfg.profile.tensor_parallel)
    if d.handoff == "sglang":
        handoff = SglangHandoff(env, p_servers, d_servers, routers, d.link, d_profile.kv_bytes_per_token, tp, n,
                                reserved_tokens=d.num_reserved_decode_tokens, clients=clients)
    else:
        # TensorRT-LLM's pools (sim.run.pd_trtllm): its context copies keep the client's max_tokens.
        handoff_class = TrtllmHandoff if d.handoff == "tensorrt_llm" else Handoff
        handoff = handoff_class(env, p_servers, d_servers, routers, d.link, d_profile.kv_bytes_per_token, tp, n,
                                proxy_s=d.proxy_s, abort_timeout_s=d.abort_timeout_s, clients=clients)
    lag_s = float(d_profile.engine.get("request_overhead_s") or 0.0)
    if clients is None:
        env.process(feed_prefills(env, handoff, requests, requests.true_outputs(), lag_s))
    else:
        env.process(feed_prefills_capped(env, handoff, requests, requests.true_outputs(), clients, lag_s))
    p_profile.reset_counters()
    d_profile.reset_counters()
    loop0 = time.perf_counter()
    _run_env(env, d_servers, n, progress)
    loop_s = time.perf_counter() - loop0
    trim_heap()
    for s in (*p_servers, *d_servers):
        left = [*s.state.waiting, *s.state.running, *(s.state.remote.holding if s.state.remote else ())]
        if left:
            r = left[0]
            raise RuntimeError(f"disaggregated run stalled: {len(left)} request(s) unfinished on replica "
                               f"{s.replica}, first request {r.req_id} ({r.status.name.lower()}, "
                               f"{r.num_computed_tokens:,} of {r.num_prompt_tokens:,} prompt tokens computed)")
    result = _collect(cfg, d, handoff, p_servers, d_servers, p_blocks, d_blocks, p_profile, d_profile,
                      clients.waits_s if clients is not None else None)
    rejected = result.summary["failed_by_reason"]
    if rejected:
        reasons = "; ".join(f"{k} with " + REJECT_REASONS[why].format(max_model_len=d_len, limit=None)
                            for why, k in sorted(rejected.items()))
        msg = f"{cfg.source}: {sum(rejected.values())} of {n} requests were rejected ({reasons}); counted as failed"
        if strict:
            raise ConfigError(msg + " (--strict)")
        warnings.warn(msg, stacklevel=2)
    result.meta.update(wall_s=time.perf_counter() - wall0, loop_s=loop_s, num_blocks=d_blocks,
                       num_blocks_prefill=p_blocks, max_model_len=d_len, max_model_len_prefill=p_len,
                       num_replicas=d.prefill.replicas + d.decode.replicas, router=d.decode.router,
                       num_trace_rows_dropped=specs.num_dropped, profile_trust_prefill=profile_trust(p_profile),
                       policy_knobs_prefill=policy_knobs(p_cfg.policy, p_servers[0].policy))
    return result


def _phases(h: Handoff, table: RequestTable, p_first_scheduled: np.ndarray) -> dict[str, np.ndarray]:
    """Each request's time in each phase (seconds; NaN where it never got there)."""
    arrival = table.cols["arrival_s"]
    d_sched = table.cols["first_scheduled_s"].astype(np.float64)
    d_first = table.cols["first_token_s"].astype(np.float64)
    if h.kind == "sglang":
        # SGLang (sim.loop.handoff_sglang): the decode reservation comes first, the prefill's
        # queue starts at it, the sends of earlier chunks overlap the prefill (transfer_s is
        # the rest, after the prefill's end: the last send leaves then, so no transfer_wait_s),
        # and the first token is streamed at the decode's pass that takes the request in.
        return {
            "prefill_replica": h.prefill_replica,
            "bootstrap_wait_s": h.reserved_s - arrival,
            "prefill_queue_s": p_first_scheduled - h.reserved_s,
            "prefill_s": h.prefill_done_s - p_first_scheduled,
            "transfer_wait_s": np.where(np.isnan(h.transfer_end_s), np.nan, 0.0),
            "transfer_s": h.transfer_end_s - h.prefill_done_s,
            "transfer_tokens": h.transfer_tokens,
            "decode_queue_s": d_sched - h.transfer_end_s,
            "decode_first_step_s": d_first - d_sched,
        }
    xfer_end = np.where(np.isnan(h.transfer_end_s), h.decode_sent_s, h.transfer_end_s)
    return {
        "prefill_replica": h.prefill_replica,
        "prefill_queue_s": p_first_scheduled - arrival,
        "prefill_s": h.prefill_done_s - p_first_scheduled,
        "transfer_wait_s": np.where(np.isnan(h.transfer_start_s), np.nan, h.transfer_start_s - h.prefill_done_s),
        "transfer_s": h.transfer_end_s - h.transfer_start_s,
        "transfer_tokens": h.transfer_tokens,
        "decode_queue_s": d_sched - xfer_end,
        "decode_first_step_s": d_first - d_sched,
    }


def _collect(cfg: WorkloadConfig, d: Disaggregation, h: Handoff, p_servers: list[Server], d_servers: list[Server],
             p_blocks: int, d_blocks: int, p_profile: Profile, d_profile: Profile,
             client_queue_s) -> RunResult:
    from sim.run.runner import log_summary, prefix_cache_summary, profile_trust
    n = h.num_requests
    # The prefill side's own table (its copies, max_tokens 1): for its queue and prefill times.
    # (Its records hold every request once: finished, or refused at arrival.)
    p_table = RequestTable.from_records([s.state.records for s in p_servers], [s.replica for s in p_servers], n,
                                        prefix_caching=p_servers[0].state.kv.caching)
    table = RequestTable.from_records([s.state.records for s in d_servers] + [h.failed],
                                      [s.replica for s in d_servers] + [-1], n,
                                      prefix_caching=d_servers[0].state.kv.caching)
    phases = _phases(h, table, p_table.cols["first_scheduled_s"].astype(np.float64))
    table.extra.update(phases)
    servers = [*p_servers, *d_servers]
    empty = TokenLog()
    logs = RunLogs([s.replica for s in servers], [s.log for s in servers],
                   [empty for _ in p_servers] + [s.state.tokens for s in d_servers],
                   [p_blocks] * len(p_servers) + [d_blocks] * len(d_servers))
    slo = cfg.slo.goodput_thresholds() if cfg.slo else None
    result = RunResult(table, None, None, {}, {}, logs)
    summary = log_summary(table, [s.log for s in d_servers], [s.state.tokens for s in d_servers], slo, d_blocks,
                          result.itl())
    summary["profile_source"] = d_profile.provenance.get("label") or d_profile.provenance.get("source", "unknown")
    summary["profile_trust"] = profile_trust(d_profile)
    summary["policy"] = d.decode.cfg.policy.kind
    summary["failed_by_reason"] = table.failed_by_reason()
    summary.update(prefix_cache_summary([s.state.kv for s in d_servers]))
    prefill = log_summary(p_table, [s.log for s in p_servers], [empty], None, p_blocks)
    prefill.update(prefix_cache_summary([s.state.kv for s in p_servers]))
    summary["disaggregation"] = _pd_summary(d, h, phases, table, prefill, p_servers, d_servers, p_blocks)
    result.summary = summary
    result.meta = {"config": cfg.to_dict(), "seed": cfg.seed, "profile_name": d_profile.name,
                   "profile_name_prefill": p_profile.name, "profile_provenance": d_profile.provenance,
                   "profile_efficiency": d_profile.efficiency, "kv_block_size": d_servers[0].state.kv.block_size,
                   "policy_knobs": policy_knobs(d.decode.cfg.policy, d_servers[0].policy)}
    result.client_queue_s = client_queue_s
    result.prefix_cache = None
    result.pd_timeline = pd_timeline(h)
    return result


def _stats(values: np.ndarray) -> dict[str, float | None]:
    v = values[~np.isnan(values)]
    if not len(v):
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    return {"mean_ms": float(v.mean() * 1e3), "p50_ms": float(np.percentile(v, 50) * 1e3),
            "p99_ms": float(np.percentile(v, 99) * 1e3)}


def _pd_summary(d: Disaggregation, h: Handoff, phases: dict[str, np.ndarray], table: RequestTable,
                prefill: dict[str, Any], p_servers, d_servers, p_blocks: int) -> dict[str, Any]:
    finished = table.finished
    makespan = float(np.nanmax(table.cols["finished_s"])) if len(table) else 0.0
    link = h.link
    held = h.held_timeline()
    peak_held = {}
    for s in p_servers:
        rows = held[held[:, 1] == s.replica]
        peak_held[str(s.replica)] = int(rows[:, 2].max()) if len(rows) else 0
    util = {}
    for (side, replica), busy in sorted(link.busy_s.items()):
        cap = link.capacity[(side, replica)]
        moved = link.bytes_moved.get((side, replica), 0.0)
        util[f"{'prefill' if side == 'p' else 'decode'}_{replica}"] = {
            "bytes": int(moved), "busy_share": busy / makespan if makespan else 0.0,
            "utilisation": moved / (cap * makespan) if makespan else 0.0}
    return {
        **d.to_dict(),
        "num_transfers": int(np.sum(~np.isnan(h.transfer_end_s))),
        "transfer_bytes": int(np.nansum(h.transfer_tokens * h.kv_bytes_per_token)),
        "num_transfer_timeouts": h.num_timeouts,
        "phases": {name: _stats(phases[name][finished]) for name in
                   ("bootstrap_wait_s", "prefill_queue_s", "prefill_s", "transfer_wait_s", "transfer_s",
                    "decode_queue_s", "decode_first_step_s") if name in phases},
        "prefill_kv_held_peak_blocks": peak_held,
        "prefill_kv_blocks": p_blocks,
        "link_usage": util,
        # The prefill instances' own view: their "TTFT" is the prefill's end (the token dropped).
        "prefill_pool": {k: prefill.get(k) for k in ("mean_ttft_ms", "p99_ttft_ms", "num_steps", "mean_batch_size",
                                                     "busy_fraction", "mean_kv_utilization", "peak_kv_utilization",
                                                     "prefix_cache_hit_rate") if k in prefill},
    }


def pd_timeline(h: Handoff):
    """pd_timeline.csv: the prefill instances' KV held for transfer, and the transfers in
    flight, over time."""
    import pandas as pd
    held = h.held_timeline()
    link = h.link_timeline()
    a = pd.DataFrame({"time_s": held[:, 0], "what": "prefill_kv_held_blocks", "replica": held[:, 1].astype(np.int64),
                      "value": held[:, 2]})
    b = pd.DataFrame({"time_s": link[:, 0], "what": "transfers_in_flight", "replica": -1, "value": link[:, 1]})
    return pd.concat([a, b], ignore_index=True).sort_values(["time_s", "what"], kind="stable", ignore_index=True)

