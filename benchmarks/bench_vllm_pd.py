"""Sim-vs-real accuracy of disaggregated prefill and decode: two vLLM CPU servers with NixlConnector.

Builds the tiny model (``calibrate.serving.tiny_model``) and starts two vLLM
servers on it (max_num_seqs 32, max_num_batched_tokens 512, prefix caching
off, ``--enforce-eager``), each model worker bound to a core of its own
(``VLLM_CPU_OMP_THREADS_BIND``): a prefill server (``kv_role`` kv_producer)
and a decode server (kv_consumer), both with ``NixlConnector`` and
``kv_buffer_device`` cpu (NIXL over UCX, host memory to host memory). A
two-step proxy (``calibrate.serving.pd_proxy``) sends each request to the
prefill server with max_tokens 1 and ``do_remote_decode``, then to the decode
server with the ``kv_transfer_params`` it got back: the handoff that
batchsim's ``disaggregation`` section models (``sim.loop.handoff``).

Then: a few warm-up requests through the proxy, whose NIXL counters on the
decode server (bytes moved, transfer time; the first read, which waits for the
NIXL handshake, left out) give the link's rate; a profile of
the servers calibrated from outside on the prefill server
(``calibrate.serving.calibrate_server``, as the other server benches do: both
servers run the same model on one core each); the traffic (Poisson, short
prompts) replayed through the proxy and simulated with the disaggregation
section (one prefill and one decode instance, the measured link)
(``calibrate.serving.validate_server``); the same traffic sent to the decode
server alone and simulated without disaggregation, so the P/D-over-aggregated
ratios are measured and simulated in the same run. Printed: TTFT, ITL, TPOT,
throughput (measured, simulated, error), the ratios, the prefill phase as the
proxy saw it, and the decode server's counters that show it loaded the KV
(tokens from the connector against prompt tokens, NIXL transfers, failures).

Needs the ``nixl`` package where vLLM's processes import it (it is not one of
batchsim's dependencies; its CPU build works through its UCX backend):

    pip install --no-deps --target /tmp/nixl-pkgs nixl nixl-cu12
    PYTHONPATH=/tmp/nixl-pkgs python benchmarks/bench_vllm_pd.py            # 4-8 min on 2 busy cores
    PYTHONPATH=/tmp/nixl-pkgs python benchmarks/bench_vllm_pd.py --quick    # 30 requests, 40 s budget
    PYTHONPATH=/tmp/nixl-pkgs python benchmarks/bench_vllm_pd.py --profile P.yaml   # no calibration

(On a loaded machine a 40 s budget may not finish one probe: then raise ``--budget-s``.)

err % = (sim - measured) / measured. The servers share the machine's cores
with the client, the proxy and anything else running; the load average is
printed beside each case. Printed, not asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KNOBS = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
LENGTHS = {"kind": "uniform", "prompt_min": 128, "prompt_max": 384, "output_min": 16, "output_max": 64}
ROWS = (("p50_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"), ("p50_itl_ms", "ITL p50 ms"),
        ("p99_itl_ms", "ITL p99 ms"), ("p50_tpot_ms", "TPOT p50 ms"), ("output_throughput", "throughput tok/s"))
DECODE_COUNTERS = {"prompt": "vllm:prompt_tokens_total", "from_connector": "vllm:external_prefix_cache_hits_total",
                   "transfers": "vllm:nixl_xfer_time_seconds_count", "xfer_s": "vllm:nixl_xfer_time_seconds_sum",
                   "bytes": "vllm:nixl_bytes_transferred_sum", "failed": "vllm:nixl_num_failed_transfers_total",
                   "expired": "vllm:nixl_num_kv_expired_reqs_total"}


def workload(name: str, args: argparse.Namespace, link: dict | None):
    """The traffic; with ``link``, on one prefill and one decode instance joined by it."""
    from sim.run.config import workload_from_dict
    data = {"name": name, "seed": args.seed, "num_requests": args.num_requests,
            "arrivals": {"kind": "poisson", "rate": args.rate}, "lengths": LENGTHS, "max_tokens": "output",
            "policy": {"kind": "vllm_v1", **KNOBS}}
    if link is not None:
        data["disaggregation"] = {"prefill": {}, "decode": {}, "link": link}
    return workload_from_dict(data, f"<bench {name}>")


def start_servers(args: argparse.Namespace):
    """The prefill and the decode server (each VllmServer), started."""
    from calibrate.serving.launch import VllmServer, free_port
    from calibrate.serving.tiny_model import write_preset
    model = write_preset(args.model_dir)
    servers = []
    for role, core in (("kv_producer", args.prefill_core), ("kv_consumer", args.decode_core)):
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        servers.append(VllmServer(model, **KNOBS, enforce_eager=True, threads_bind=core,
                                  extra_args=["--kv-transfer-config", json.dumps(kv)],
                                  extra_env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}))
    try:
        for s, side in zip(servers, ("prefill", "decode")):
            s.start()
            print(f"{side} server {s.url} up in {s.startup_s:.0f} s (worker on core "
                  f"{s.env['VLLM_CPU_OMP_THREADS_BIND']}, log {s.log_path})", flush=True)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def counters(url: str) -> dict[str, float | None]:
    from calibrate.serving.client import metric_totals
    raw = metric_totals(url, DECODE_COUNTERS.values())
    return {key: raw[name] for key, name in DECODE_COUNTERS.items()}


def grown(before: dict, after: dict) -> dict[str, float | None]:
    return {k: None if before[k] is None or after[k] is None else after[k] - before[k] for k in before}


def warm_up(proxy_url: str, model: str, decode_url: str, num: int, seed: int) -> dict[str, float | None]:
    """``num`` requests through the proxy, one after the other; the decode server's counters'
    growth over all but the first (whose read waits for the NIXL handshake with the prefill
    server, a one-off)."""
    from calibrate.serving import client
    before = counters(decode_url)
    for i in range(num):
        prompt = client.prompt_ids(128 + 128 * (i % 4), seed + i, 4096, avoid=(0, 1, 2))
        res = client.run(client.stream_completion(proxy_url, model, prompt, 8))
        if res.error:
            raise SystemExit(f"a warm-up request through the proxy failed: {res.error}")
        if i == 0:
            time.sleep(0.3)
            before = counters(decode_url)
    time.sleep(0.3)
    return grown(before, counters(decode_url))


def link_of(g: dict) -> tuple[dict, str]:
    """The disaggregation link from the warm-up's NIXL counters: its mean rate, no extra latency."""
    if not g["bytes"] or not g["xfer_s"] or not g["transfers"]:
        raise SystemExit(f"the decode server's NIXL counters did not grow over the warm-up ({g}): it did not "
                         f"load KV through the connector; see its log")
    rate = g["bytes"] / g["xfer_s"]
    return ({"bandwidth_gbps": round(rate * 8 / 1e9, 3), "latency_us": 0.0},
            f"link: {int(g['transfers'])} NIXL reads of {g['bytes'] / g['transfers'] / 1e6:.2f} MB in "
            f"{g['xfer_s'] / g['transfers'] * 1e3:.2f} ms on average = {rate / 1e9:.2f} GB/s "
            f"({rate * 8 / 1e9:.1f} Gb/s), simulated as disaggregation.link bandwidth_gbps at that rate")


def print_case(title: str, v) -> None:
    s_meas, s_sim = v.measurement.run.summary, v.sim.summary
    ld = v.measurement.load
    print(f"\n{title}  [load avg {ld['before_1_5_15min'][0]:.2f} -> {ld['after_1_5_15min'][0]:.2f}, peak "
          f"{ld['max_1min_during']:.2f}, {ld['cpus']} CPUs]")
    print(f"  {'':<18}{'measured':>10}{'sim':>10}{'err %':>10}")
    for key, label in ROWS:
        a, b = s_meas.get(key), s_sim.get(key)
        err = (b - a) / a * 100 if a and b is not None else float("nan")
        print(f"  {label:<18}{a if a is not None else float('nan'):>10.4g}"
              f"{b if b is not None else float('nan'):>10.4g}{err:>+10.1f}")
    for note in v.notes:
        if note.startswith(("warning", "note")):
            print(f"  {note}")


def prefill_phase(hops, sim) -> tuple[float, float]:
    """p50 (ms) of the prefill phase: measured, the proxy's send to the prefill server's answer;
    simulated, the prefill queue (which holds the profile's per-request overhead: the simulator
    sends each request that much after its arrival) and the prefill."""
    live = [(h.prefill_done_s - h.received_s) * 1e3 for h in hops if h.prefill_status == 200]
    extra = sim.table.extra
    simulated = (np.asarray(extra["prefill_queue_s"]) + np.asarray(extra["prefill_s"])) * 1e3
    return float(np.median(live)), float(np.nanmedian(simulated))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-url", help="an already running prefill server (NixlConnector, kv_producer)")
    p.add_argument("--decode-url", help="an already running decode server (NixlConnector, kv_consumer)")
    p.add_argument("--profile", help="a profile of those servers (skips calibration)")
    p.add_argument("--budget-s", type=float, default=60.0, help="calibration budget")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests per second")
    p.add_argument("--warm-up", type=int, default=8, help="requests through the proxy before anything is timed")
    p.add_argument("--prefill-core", default="0", help="VLLM_CPU_OMP_THREADS_BIND of the prefill server")
    p.add_argument("--decode-core", default="1", help="VLLM_CPU_OMP_THREADS_BIND of the decode server")
    p.add_argument("--no-aggregated", action="store_true", help="skip the aggregated case (and the ratios)")
    p.add_argument("--quick", action="store_true", help="30 requests, 40 s calibration budget")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "batchsim-bench" / "tiny-llama-hf"))
    p.add_argument("--out", help="keep the profile and each case's report under this folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.budget_s = 30, min(args.budget_s, 40.0)
    if bool(args.prefill_url) != bool(args.decode_url):
        p.error("give both --prefill-url and --decode-url, or neither")
    if args.num_requests < 1 or not args.rate > 0 or args.warm_up < 2:
        p.error("--num-requests must be >= 1, --warm-up >= 2 (the first one's read is left out: the NIXL "
                "handshake happens during it) and --rate > 0")
    if args.prefill_url is None and importlib.util.find_spec("nixl") is None:
        raise SystemExit("vLLM's NixlConnector needs the nixl package, which is not importable here (and so not "
                         "in the servers' processes, which inherit PYTHONPATH): pip install --no-deps --target "
                         "DIR nixl nixl-cu12, then run with PYTHONPATH=DIR")

    from bench_vllm_server import calibrated_profile

    from calibrate.serving.client import server_info
    from calibrate.serving.pd_proxy import PdProxy
    from calibrate.serving.validate_server import validate_server, write_report

    t_start = time.perf_counter()
    servers = [] if args.prefill_url else start_servers(args)
    prefill_url, decode_url = (args.prefill_url, args.decode_url) if args.prefill_url else [s.url for s in servers]
    try:
        with PdProxy(prefill_url, decode_url) as proxy:
            model = server_info(decode_url).model
            g = warm_up(proxy.url, model, decode_url, args.warm_up, args.seed + 1000)
            link, link_line = link_of(g)
            print(link_line)
            profile = args.profile or calibrated_profile(args, prefill_url, "bench-vllm-pd-", KNOBS)
            before = counters(decode_url)
            hops0 = len(proxy.hops)
            pd_cfg = workload("pd-1p1d", args, link)
            v_pd = validate_server(pd_cfg, profile=profile, server=proxy.url)
            g = grown(before, counters(decode_url))
            hops = proxy.hops[hops0:]
        print_case(f"disaggregated, 1 prefill + 1 decode server: {args.num_requests} requests, {args.rate:g} req/s "
                   f"Poisson, through the proxy", v_pd)
        live_p, sim_p = prefill_phase(hops, v_pd.sim)
        print(f"  {'prefill phase p50':<18}{live_p:>10.4g}{sim_p:>10.4g}{(sim_p - live_p) / live_p * 100:>+10.1f}"
              f"   (proxy: sent to the prefill server -> its answer)")
        ph = v_pd.sim.summary["disaggregation"]["phases"]
        print("  simulated phases, p50 ms: " + ", ".join(
            f"{k.removesuffix('_s')} {ph[k]['p50_ms']:.2f}" for k in ph if ph[k]["p50_ms"] is not None))
        if g["prompt"]:
            print(f"  decode server over the run: {g['from_connector']:.0f} of {g['prompt']:.0f} prompt tokens "
                  f"({100 * g['from_connector'] / g['prompt']:.1f}%) came through the connector; "
                  f"{g['transfers']:.0f} NIXL reads for {len(hops)} requests, {g['bytes'] / 1e6:.1f} MB, "
                  f"{g['failed']:.0f} failed, {g['expired']:.0f} expired")
        if g["transfers"]:
            xfer = v_pd.sim.summary["disaggregation"]["phases"]["transfer_s"]["mean_ms"]
            print(f"  NIXL read time, mean ms: measured {g['xfer_s'] / g['transfers'] * 1e3:.2f} (the decode "
                  f"server's vllm:nixl_xfer_time_seconds), simulated transfer {xfer:.2f}")
        cases = [("pd", v_pd)]
        if not args.no_aggregated:
            v_agg = validate_server(workload("aggregated-1", args, None), profile=profile, server=decode_url)
            print_case(f"aggregated, the decode server alone: the same {args.num_requests} requests", v_agg)
            cases.append(("aggregated", v_agg))
            print("\nP/D over aggregated, measured / simulated (the same traffic, in this run):")
            for key, label in ROWS:
                lm, la = v_pd.measurement.run.summary.get(key), v_agg.measurement.run.summary.get(key)
                sm, sa = v_pd.sim.summary.get(key), v_agg.sim.summary.get(key)
                if lm and la and sm and sa:
                    print(f"  {label:<18}{lm / la:>8.2f}x /{sm / sa:>6.2f}x")
        if args.out:
            for name, v in cases:
                write_report(Path(args.out) / name, v)
        print(f"\n{time.perf_counter() - t_start:.0f} s in all")
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
