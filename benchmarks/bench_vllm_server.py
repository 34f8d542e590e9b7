"""Sim-vs-real accuracy against a vLLM CPU server: two traffic shapes, two length mixes, three loads.

Builds the tiny model (``calibrate.serving.tiny_model``), starts vLLM on it
(max_num_seqs 32, max_num_batched_tokens 512, prefix caching off), calibrates
it from outside (``calibrate.serving.calibrate_server``), measures its
capacity per length mix (all requests at once: completed requests per
second), then validates at 50%, 80% and 110% of that capacity with Poisson
and gamma CV 2 arrivals (``calibrate.serving.validate_server``), printing one
error table per case and the machine's load average around it:

    python benchmarks/bench_vllm_server.py                      # everything (~10 min on 2 cores)
    python benchmarks/bench_vllm_server.py --quick              # one mix, gamma CV 2, 80%, 60 requests
    python benchmarks/bench_vllm_server.py --url http://127.0.0.1:8000 --profile p.yaml --mixes chat

err % = (sim - measured) / measured; targets: throughput 5%, p50 TTFT and ITL
10%, p99 20% ('*' marks a miss). The server shares the machine's cores with
the client and anything else running, so its speed moves with the load
average printed beside each case. Printed, not asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIXES = {   # name -> lengths section
    "chat": {"kind": "uniform", "prompt_min": 96, "prompt_max": 672, "output_min": 24, "output_max": 168},
    "long": {"kind": "uniform", "prompt_min": 640, "prompt_max": 1664, "output_min": 8, "output_max": 48},
}
SHAPES = {"poisson": {"kind": "poisson"}, "gamma2": {"kind": "gamma", "cv": 2.0}}
ROWS = (("output_throughput", "throughput tok/s", "throughput"), ("p50_ttft_ms", "TTFT p50 ms", "ttft_p50"),
        ("p99_ttft_ms", "TTFT p99 ms", "ttft_p99"), ("p50_itl_ms", "ITL p50 ms", "itl_p50"),
        ("p99_itl_ms", "ITL p99 ms", "itl_p99"))
KNOBS = {"max_num_seqs": 32, "max_num_batched_tokens": 512}


def workload(name: str, mix: str, arrivals: dict, num_requests: int, seed: int):
    from sim.run.config import workload_from_dict
    return workload_from_dict({"name": name, "seed": seed, "num_requests": num_requests, "arrivals": arrivals,
                               "lengths": MIXES[mix], "max_tokens": "output", "policy": {"kind": "vllm_v1", **KNOBS}},
                              f"<bench {name}>")


def print_case(title: str, v) -> None:
    from reports.presentation.validation import TARGETS
    s_meas, s_sim = v.measurement.run.summary, v.sim.summary
    met = dict(zip(v.verdict["target"], v.verdict["met"]))
    ld = v.measurement.load
    print(f"\n{title}  [load avg {ld['before_1_5_15min'][0]:.2f} -> {ld['after_1_5_15min'][0]:.2f}, peak "
          f"{ld['max_1min_during']:.2f}, {ld['cpus']} CPUs]")
    print(f"  {'':<18}{'measured':>10}{'sim':>10}{'err %':>10}")
    for key, label, target in ROWS:
        a, b = s_meas.get(key), s_sim.get(key)
        err = (b - a) / a * 100 if a and b is not None else float("nan")
        mark = "" if met.get(target, True) else f" *  (limit ±{TARGETS[target][1]:g}%)"
        print(f"  {label:<18}{a if a is not None else float('nan'):>10.3g}"
              f"{b if b is not None else float('nan'):>10.3g}{err:>+10.1f}{mark}")


def start_server(args: argparse.Namespace, knobs: dict, *, prefix_caching: bool | None = None):
    """(the vLLM server started on the tiny model, its URL), or (None, ``args.url``) for a
    server already running. ``prefix_caching``: the server's flag (None: vLLM's default)."""
    if args.url is not None:
        return None, args.url
    from calibrate.serving.launch import VllmServer
    from calibrate.serving.tiny_model import write_preset
    extra = {} if prefix_caching is None else {"prefix_caching": prefix_caching}
    server = VllmServer(write_preset(args.model_dir), **extra, **knobs).start()
    caching = "" if prefix_caching is None else f", prefix caching {'on' if prefix_caching else 'off'}"
    print(f"vLLM server {server.url} up in {server.startup_s:.0f} s{caching} (log {server.log_path})")
    return server, server.url


def calibrated_profile(args: argparse.Namespace, url: str, tmp_prefix: str, knobs: dict | None = None) -> str:
    """Calibrate ``url`` from outside (``args.budget_s``, ``args.seed``), save the profile
    in ``args.out`` (else a temporary folder) and print what the calibration measured,
    with the prefix-cache hits of its probes when the server counted them; the profile's path.
    ``knobs``: the server's max_num_seqs and max_num_batched_tokens, given rather than read from
    its /server_info (which a loaded machine may not answer in time: then they are probed for)."""
    from calibrate.serving.calibrate_server import calibrate_server
    t0 = time.perf_counter()
    cal = calibrate_server(url, budget_s=args.budget_s, seed=args.seed,
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True), **(knobs or {}))
    profile = str(Path(args.out or tempfile.mkdtemp(prefix=tmp_prefix)) / "profile.yaml")
    cal.save(profile)
    fe, pc = cal.profile.fit_error, cal.profile.provenance.get("prefix_cache") or {}
    hits = (f"prefix cache during calibration: {pc.get('hits')} hits of {pc.get('queries')} prompt tokens; "
            if pc else "")
    print(f"calibration: {time.perf_counter() - t0:.0f} s, fit MAPE {fe['fit_mape_pct']:.1f}% on "
          f"{fe['fit_num_points']} equations; {fe.get('selfcheck_summary', '')}; {hits}profile {profile}")
    return profile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="an already running vLLM server (max_num_seqs 32, max_num_batched_tokens 512)")
    p.add_argument("--profile", help="a profile of that server (skips calibration)")
    p.add_argument("--budget-s", type=float, default=120.0, help="calibration budget")
    p.add_argument("--num-requests", type=int, default=200, help="requests per case")
    p.add_argument("--loads", default="0.5,0.8,1.1", help="fractions of the measured capacity")
    p.add_argument("--shapes", default="poisson,gamma2", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--mixes", default="chat,long", help=f"of {', '.join(MIXES)}")
    p.add_argument("--quick", action="store_true", help="chat mix, gamma2, 80%% load, 60 requests, 60 s budget")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "batchsim-bench" / "tiny-llama-hf"))
    p.add_argument("--out", help="also write each case's full report (report.md/.html, runs) under this folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.mixes, args.shapes, args.loads, args.num_requests = "chat", "gamma2", "0.8", 60
        args.budget_s = min(args.budget_s, 60.0)
    mixes, shapes = args.mixes.split(","), args.shapes.split(",")
    loads = [float(x) for x in args.loads.split(",")]
    for name, known in (("mix", MIXES), ("shape", SHAPES)):
        bad = [x for x in (mixes if name == "mix" else shapes) if x not in known]
        if bad:
            p.error(f"unknown {name} {', '.join(bad)}; choose from {', '.join(known)}")

    from calibrate.serving.validate_server import validate_server, write_report

    server, url = start_server(args, KNOBS)
    try:
        profile = args.profile or calibrated_profile(args, url, "bench-vllm-")
        summary = []
        for mix in mixes:
            v = validate_server(workload(f"cap-{mix}", mix, {"kind": "all_at_once"}, args.num_requests, args.seed),
                                profile=profile, server=url)
            capacity = v.measurement.run.summary["request_throughput"]
            print_case(f"{mix}: capacity, {args.num_requests} requests at once: measured {capacity:.2f} req/s, "
                       f"simulated {v.sim.summary['request_throughput']:.2f} req/s", v)
            for shape in shapes:
                for load in loads:
                    rate = round(load * capacity, 2)
                    name = f"{mix}-{shape}-{int(round(100 * load))}pct"
                    cfg = workload(name, mix, {**SHAPES[shape], "rate": rate}, args.num_requests, args.seed)
                    v = validate_server(cfg, profile=profile, server=url)
                    print_case(f"{name}: {rate:g} req/s ({100 * load:.0f}% of capacity)", v)
                    if args.out:
                        write_report(Path(args.out) / name, v)
                    summary.append((name, v))
        print(f"\n{'case':<24}" + "".join(f"{label.split(' ms')[0]:>14}" for _, label, _ in ROWS) + "   load avg")
        for name, v in summary:
            err = dict(zip(v.verdict["target"], v.verdict["err_pct"]))
            met = dict(zip(v.verdict["target"], v.verdict["met"]))
            ld = v.measurement.load
            print(f"{name:<24}" + "".join(f"{err[t]:>+13.1f}{' ' if met[t] else '*'}" for _, _, t in ROWS)
                  + f"   {ld['before_1_5_15min'][0]:.2f}->{ld['after_1_5_15min'][0]:.2f}")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
