"""Sim-vs-real accuracy with prefix caching on: shared-prefix and multi-turn traffic against vLLM CPU.

Builds the tiny model, starts vLLM on it (max_num_seqs 32,
max_num_batched_tokens 512, as ``bench_vllm_server.py``, prefix caching
on), calibrates it from outside (``calibrate.serving.calibrate_server``;
its probes must not hit the cache: the hits it counted are printed), then
for each kind of traffic measures the capacity as ``bench_vllm_server.py``
does (the requests all at once: completed requests per second, live) and
validates at 50% and 80% of it (``calibrate.serving.validate_server``), each
case replayed ``--repeat`` times (default 2):

- ``prefix``: vLLM's ``prefix_repetition`` dataset, built as
  ``workloads.generate.Contents`` directly: ``num_prefixes`` prefixes of
  ``prefix_len`` tokens, ``num_requests // num_prefixes`` requests each with
  a ``suffix_len``-token suffix of its own and ``output_len`` outputs,
  shuffled; Poisson arrivals.
- ``multiturn``: sessions of ``turns`` turns behind one shared system prompt:
  turn k + 1's prompt is turn k's, its reply (the output key of turn k, its
  whole output) and a new user message; sessions start as a Poisson process
  (the request rate is ``turns`` x theirs) and a next turn is sent
  ``think_s`` after the reply it holds, with the ids the server generated;
  the simulator predicts the send times with its own sessions feed
  (``sim.loop.feed.SessionFeed``: each next turn a think time after its
  simulated reply).

    python benchmarks/bench_vllm_prefix.py                     # everything (~8-12 min on 2 cores)
    python benchmarks/bench_vllm_prefix.py --quick             # prefix traffic, 80% load, 60 requests
    python benchmarks/bench_vllm_prefix.py --url http://127.0.0.1:8000 --profile p.yaml --cases multiturn

Printed per case and in a closing table: the prefix-cache hit rate (the
server's counters over the replay against the simulated pool's
hits / queries; target within 3 points), output throughput (5%), median
TTFT and ITL (15%), each error beside the live runs' spread ('*' marks a
target missed both ways: outside the limit and outside the live range). The
server shares the machine's cores with the client and anything else
running, so its speed moves with the load average printed beside each
case. Printed, not asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KNOBS = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
TARGETS = {"hit_rate": 3.0, "throughput": 5.0, "ttft_p50": 15.0, "itl_p50": 15.0}
ROWS = (("prefix_cache_hit_rate", "hit rate %", "hit_rate", "pt"), ("output_throughput", "throughput tok/s",
        "throughput", "%"), ("p50_ttft_ms", "TTFT p50 ms", "ttft_p50", "%"), ("p50_itl_ms", "ITL p50 ms",
                                                                             "itl_p50", "%"))


def prefix_repetition(num_requests: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                      seed: int):
    """vLLM's prefix_repetition requests as (prompt lengths, output lengths, Contents): each
    prefix p has key ``key_space(1) + p``, request i's suffix ``key_space(2) + i`` and its
    output ``key_space(3) + i``; ``num_requests // num_prefixes`` per prefix, shuffled."""
    from workloads.generate import Contents, key_space

    per = num_requests // num_prefixes
    if per == 0:
        raise SystemExit(f"--num-requests {num_requests} must be at least --num-prefixes {num_prefixes}")
    which = np.random.default_rng(seed).permutation(np.repeat(np.arange(num_prefixes), per))
    n = len(which)
    keys = np.column_stack([key_space(1) + which, key_space(2) + np.arange(n)]).ravel().astype(np.int64)
    contents = Contents(keys, np.tile([prefix_len, suffix_len], n).astype(np.int64),
                        np.arange(0, 2 * n + 1, 2, dtype=np.int64), (key_space(3) + np.arange(n)).astype(np.int64))
    return np.full(n, prefix_len + suffix_len, np.int64), np.full(n, output_len, np.int64), contents


def sessions(num_sessions: int, turns: int, system_len: int, user_len: int, reply_len: int, rate: float,
             seed: int):
    """Multi-turn sessions (module doc) as (arrivals, prompt lengths, output lengths, Contents,
    session offsets), requests ordered by session then turn, each turn's arrival its session's
    start (the earliest it may go: ``RequestSpecs.sessions``). Keys: the system prompt
    ``key_space(1)``, user message (s, k) ``key_space(2) + s * turns + k``, the output of request i
    ``key_space(3) + i``."""
    from workloads.generate import Contents, key_space

    start = np.concatenate([[0.0], np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, num_sessions - 1))])
    keys: list[int] = []
    lengths: list[int] = []
    starts, prompts, arrival = [0], [], []
    for s in range(num_sessions):
        for k in range(turns):
            runs = [(key_space(1), system_len)]
            for j in range(k + 1):
                runs.append((key_space(2) + s * turns + j, user_len))
                if j < k:
                    runs.append((key_space(3) + s * turns + j, reply_len))
            keys += [r[0] for r in runs]
            lengths += [r[1] for r in runs]
            starts.append(len(keys))
            prompts.append(sum(r[1] for r in runs))
            arrival.append(start[s])
    n = num_sessions * turns
    contents = Contents(np.array(keys, np.int64), np.array(lengths, np.int64), np.array(starts, np.int64),
                        (key_space(3) + np.arange(n)).astype(np.int64))
    return (np.array(arrival), np.array(prompts, np.int64), np.full(n, reply_len, np.int64), contents,
            np.arange(0, n + 1, turns, dtype=np.int64))


def case_specs(kind: str, args: argparse.Namespace, rate: float | None):
    """(RequestSpecs, think time) of one case; ``rate`` None: everything at once (capacity)."""
    from workloads.generate import RequestSpecs

    if kind == "prefix":
        prompts, outputs, contents = prefix_repetition(args.num_requests, args.num_prefixes, args.prefix_len,
                                                       args.suffix_len, args.output_len, args.seed)
        n = len(prompts)
        gaps = (np.zeros(n) if rate is None else
                np.random.default_rng(args.seed + 1).exponential(1.0 / rate, n))
        gaps[0] = 0.0
        return RequestSpecs(np.cumsum(gaps), prompts, outputs, contents=contents), 0.0
    num_sessions = max(1, args.num_requests // args.turns)
    session_rate = 1e9 if rate is None else rate / args.turns
    arrival, prompts, outputs, contents, offsets = sessions(num_sessions, args.turns, args.system_len,
                                                            args.user_len, args.reply_len, session_rate, args.seed)
    return (RequestSpecs(arrival, prompts, outputs, contents=contents, sessions=offsets),
            0.0 if rate is None else args.think_s)


def workload(name: str, specs, rate: float | None, think_s: float = 0.0):
    """The case's workload (its requests are ``specs``, which validate_server replays and
    simulates); sessions: arrivals kind sessions, so the simulator sends each next turn
    ``think_s`` after its simulated reply."""
    from sim.run.config import workload_from_dict
    lengths = {"kind": "fixed", "prompt_tokens": int(specs.prompt_tokens.max()),
               "output_tokens": int(specs.output_tokens.max())}
    policy = {"kind": "vllm_v1", **KNOBS}
    if specs.sessions is not None:
        num_sessions = len(specs.sessions) - 1
        turns = int(specs.sessions[1] - specs.sessions[0])
        # capacity (no rate): every session at once, each next turn right after its reply
        arrivals = {"kind": "sessions", "think_time_s": think_s,
                    **({"rate": round(rate / turns, 3)} if rate else {"max_concurrency": num_sessions})}
        return workload_from_dict({"name": name, "arrivals": arrivals,
                                   "sessions": {"num_sessions": num_sessions, "num_turns": turns},
                                   "lengths": {**lengths, "prompt_tokens": 1}, "policy": policy},
                                  f"<bench {name}>")
    arrivals = {"kind": "all_at_once"} if rate is None else {"kind": "poisson", "rate": round(rate, 3)}
    return workload_from_dict({"name": name, "num_requests": len(specs), "arrivals": arrivals,
                               "lengths": lengths, "max_tokens": "output", "policy": policy}, f"<bench {name}>")


def rows_of(v) -> dict[str, dict]:
    table = v.table.set_index("metric")
    met = dict(zip(v.verdict["metric"], v.verdict["met"]))
    out = {}
    for key, label, target, unit in ROWS:
        if key not in table.index:
            continue
        r = table.loc[key]
        out[key] = {"label": label, "unit": unit, "limit": TARGETS[target], "live": r["live"], "sim": r["sim"],
                    "err": r["err_pct"], "lo": r.get("live_min", r["live"]), "hi": r.get("live_max", r["live"]),
                    "spread": r.get("spread_pct", 0.0), "met": bool(met.get(key, False))}
    return out


def print_case(title: str, v) -> None:
    ld = [m.load for m in v.measurements]
    print(f"\n{title}  [{len(v.measurements)} live runs; load avg "
          + ", ".join(f"{x['before_1_5_15min'][0]:.2f}->{x['after_1_5_15min'][0]:.2f}" for x in ld)
          + f" on {ld[0]['cpus']} CPUs]")
    print(f"  {'':<18}{'measured':>10}{'live range':>22}{'sim':>10}{'err':>11}{'spread':>9}  target")
    for r in rows_of(v).values():
        rng = f"{r['lo']:.4g}..{r['hi']:.4g}"
        mark = "" if r["met"] else " *"
        print(f"  {r['label']:<18}{r['live']:>10.4g}{rng:>22}{r['sim']:>10.4g}{r['err']:>+10.1f}{r['unit']:<1}"
              f"{r['spread']:>8.1f}{r['unit']:<1}  ±{r['limit']:g}{r['unit']}{mark}")
    pc = v.prefix_caching
    if pc.get("live"):
        print("  prefix cache (tokens): server hits/queries " + ", ".join(
            f"{x['hits']}/{x['queries']}" for x in pc["live"]) + "; simulated " + ", ".join(
            f"{x['hits']}/{x['queries']}" for x in pc["sim"]))
    for note in v.notes:
        if note.startswith(("warning", "live run 1: warning", "note", "sessions", "live run 1: sessions")):
            print(f"  {note}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="an already running vLLM server with prefix caching on (max_num_seqs 32, "
                                 "max_num_batched_tokens 512)")
    p.add_argument("--profile", help="a profile of that server (skips calibration)")
    p.add_argument("--budget-s", type=float, default=120.0, help="calibration budget")
    p.add_argument("--cases", default="prefix,multiturn", help="of prefix, multiturn")
    p.add_argument("--loads", default="0.5,0.8", help="fractions of the measured capacity")
    p.add_argument("--repeat", type=int, default=2, help="live runs per case")
    p.add_argument("--num-requests", type=int, default=120, help="requests per case (about)")
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=96)
    p.add_argument("--reply-len", type=int, default=48)
    p.add_argument("--think-s", type=float, default=0.5, help="pause between a reply and the next turn")
    p.add_argument("--quick", action="store_true", help="prefix traffic, 80%% load, 60 requests, 60 s budget")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "batchsim-bench" / "tiny-llama-hf"))
    p.add_argument("--out", help="also write each case's full report (report.md/.html, runs) under this folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.cases, args.loads, args.num_requests = "prefix", "0.8", 60
        args.budget_s = min(args.budget_s, 60.0)
    cases = args.cases.split(",")
    loads = [float(x) for x in args.loads.split(",")]
    if bad := [c for c in cases if c not in ("prefix", "multiturn")]:
        p.error(f"unknown case {', '.join(bad)}; choose from prefix, multiturn")

    from bench_vllm_server import calibrated_profile, start_server

    from calibrate.serving.client import server_info
    from calibrate.serving.validate_server import validate_server, write_report

    t_start = time.perf_counter()
    server, url = start_server(args, KNOBS, prefix_caching=True)
    if server is None and not server_info(url).enable_prefix_caching:
        print(f"warning: {url} does not say its prefix caching is on; the simulated side follows the server")
    try:
        profile = args.profile or calibrated_profile(args, url, "bench-vllm-prefix-")
        summary = []
        for kind in cases:
            specs, think = case_specs(kind, args, None)
            v = validate_server(workload(f"cap-{kind}", specs, None, think), profile=profile, server=url,
                                specs=specs, think_time_s=think, targets=dict(TARGETS))
            capacity = v.measurement.run.summary["request_throughput"]
            print_case(f"{kind}: capacity, {len(specs)} requests at once"
                       + (" (next turns right after their replies)" if kind == "multiturn" else "")
                       + f": measured {capacity:.2f} req/s, simulated {v.sim.summary['request_throughput']:.2f}", v)
            for load in loads:
                rate = load * capacity
                name = f"{kind}-{int(round(100 * load))}pct"
                specs, think = case_specs(kind, args, rate)
                v = validate_server(workload(name, specs, rate, think), profile=profile, server=url, specs=specs,
                                    repeat=args.repeat, think_time_s=think, targets=dict(TARGETS))
                print_case(f"{name}: {rate:.2f} req/s ({100 * load:.0f}% of capacity), {len(specs)} requests", v)
                if args.out:
                    write_report(Path(args.out) / name, v)
                summary.append((name, v))
        print(f"\nerrors, sim vs the median of the live runs (live spread in brackets; '*': missed, outside "
              f"both the target and the spread); {time.perf_counter() - t_start:.0f} s in all")
        print(f"{'case':<18}" + "".join(f"{label:>26}" for _, label, _, _ in ROWS) + "   load avg")
        for name, v in summary:
            rows = rows_of(v)
            cells = []
            for key, _, _, unit in ROWS:
                r = rows.get(key)
                cells.append("-" if r is None else
                             f"{r['err']:+.1f}{unit} [{r['spread']:.1f}{unit}]{' ' if r['met'] else '*'}")
            ld = [m.load for m in v.measurements]
            print(f"{name:<18}" + "".join(f"{c:>26}" for c in cells) + "   "
                  + ", ".join(f"{x['before_1_5_15min'][0]:.1f}->{x['after_1_5_15min'][0]:.1f}" for x in ld))
        print("targets: hit rate ±3 points, throughput ±5%, TTFT and ITL p50 ±15%")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
