"""Sim-vs-real accuracy of n-gram speculative decoding against vLLM CPU, with the speed-up it buys.

Builds the tiny model and serves it twice, one server at a time (max_num_seqs
32, max_num_batched_tokens 512, prefix caching off, as
``bench_vllm_server.py``): first plain, then with vLLM's n-gram proposer
(``--speculative-config`` ``SPEC``: 3 drafts, prompt lookup 2-4 tokens). The
profile is calibrated from outside on the plain server
(``calibrate.serving.calibrate_server``): its probes time steps by the tokens
they stream, one per step, which drafts would break. The traffic is
repetitive: each prompt is one ``--unit-len``-token unit of its own repeated
to ``--prompt-len`` tokens, so the proposer finds its n-grams in the prompt
(random-weight greedy outputs that loop feed it too); outputs are pinned
(ignore_eos). Cases: every request at once (capacity) and Poisson arrivals at
``--loads`` of the plain server's capacity, each replayed against both servers
(``calibrate.serving.validate_server``, ``--repeat`` runs).

The simulated side of the speculative server is batchsim's ``vllm_v1`` with
``async_scheduling: false`` (the server's log says vLLM turns it off for
n-gram, as it does on every CPU) and ``speculative: {method: ngram,
num_speculative_tokens: 3, acceptance_rates}``, the rates measured over the
same live runs from the server's ``/metrics`` (``vllm:spec_decode_*``, growth
over the replays): so acceptance matches by construction, up to the
simulation's draws. vLLM counts a draft only where the proposer found a match
(a request's step without one verifies no drafts), so two simulations are
printed: ``sim`` with vLLM's per-draft rates (``accepted_per_pos /
num_drafts``) and drafts every step, and ``sim/match`` with the same rates and
``ngram_match_rate``, the measured share of decode steps with drafts
(``num_drafts / decode steps``, decode steps = output tokens after the first -
accepted tokens).

    python benchmarks/bench_vllm_ngram.py              # capacity + 50% load, 2 runs each (~10 min on 2 cores)
    python benchmarks/bench_vllm_ngram.py --quick      # capacity + 50% load, 1 run each, 40 requests

Printed per case: TTFT p50, ITL p50 (one gap per streamed chunk, as vLLM's
bench counts; the tokens a verify step accepts arrive together), TPOT p50 and
output throughput, measured and simulated, with and without speculation, the
error beside the live range, and the speed-up (plain / speculative) measured
and simulated. Printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KNOBS = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total", "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
            "accepted": "vllm:spec_decode_num_accepted_tokens_total"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
ROWS = (("p50_ttft_ms", "TTFT p50 ms"), ("p50_itl_ms", "ITL p50 ms"), ("p50_tpot_ms", "TPOT p50 ms"),
        ("output_throughput", "throughput tok/s"))
SPEEDUP = (("p50_itl_ms", "ITL", -1), ("p50_tpot_ms", "TPOT", -1), ("output_throughput", "throughput", 1))


def repetitive(num_requests: int, prompt_len: int, unit_len: int, output_len: int):
    """(prompt lengths, output lengths, Contents): request i's prompt is the run
    ``(key_space(1) + i, unit_len)`` repeated to ``prompt_len`` tokens (the last copy cut), its
    output key ``key_space(3) + i``; no two requests share a token."""
    from workloads.generate import Contents, key_space

    copies, rest = divmod(prompt_len, unit_len)
    lengths = [unit_len] * copies + ([rest] if rest else [])
    n, per = num_requests, len(lengths)
    keys = np.repeat(key_space(1) + np.arange(n), per).astype(np.int64)
    contents = Contents(keys, np.tile(lengths, n).astype(np.int64), np.arange(0, per * n + 1, per, dtype=np.int64),
                        (key_space(3) + np.arange(n)).astype(np.int64))
    return np.full(n, prompt_len, np.int64), np.full(n, output_len, np.int64), contents


def case(args: argparse.Namespace, rate: float | None):
    """(workload, RequestSpecs) of one case, simulated without speculation (``simulate`` adds
    it): ``rate`` None is every request at once."""
    from sim.run.config import workload_from_dict
    from workloads.generate import RequestSpecs

    prompts, outputs, contents = repetitive(args.num_requests, args.prompt_len, args.unit_len, args.output_len)
    gaps = np.zeros(len(prompts)) if rate is None else np.random.default_rng(args.seed + 1).exponential(
        1.0 / rate, len(prompts))
    gaps[0] = 0.0
    specs = RequestSpecs(np.cumsum(gaps), prompts, outputs, contents=contents)
    policy = {"kind": "vllm_v1", "async_scheduling": False, **KNOBS}
    arrivals = {"kind": "all_at_once"} if rate is None else {"kind": "poisson", "rate": round(rate, 3)}
    cfg = workload_from_dict({"name": "ngram", "seed": args.seed, "num_requests": len(prompts), "arrivals": arrivals,
                              "lengths": {"kind": "fixed", "prompt_tokens": args.prompt_len,
                                          "output_tokens": args.output_len},
                              "max_tokens": "output", "policy": policy}, "<bench ngram>")
    return cfg, specs


def spec_counters(url: str) -> dict:
    """The server's spec-decode counters (``COUNTERS``) and accepted tokens per position
    (``PER_POS``, by its ``position`` label), from ``/metrics``; None where absent."""
    from calibrate.serving.client import _get, metric_totals

    out = {k: v for k, v in zip(COUNTERS, metric_totals(url, COUNTERS.values()).values())}
    text = _get(url.rstrip("/") + "/metrics", 5.0).decode("utf-8", "replace")
    pos = {int(m.group(1)): float(m.group(2)) for m in
           re.finditer(rf'^{re.escape(PER_POS)}{{[^}}]*position="(\d+)"[^}}]*}} (\S+)$', text, re.M)}
    out["per_pos"] = [pos[i] for i in sorted(pos)] if pos else None
    return out


def grown(before: dict, after: dict) -> dict:
    """The counters' growth between two ``spec_counters`` readings."""
    out = {k: (after[k] - before[k]) if None not in (after[k], before[k]) else None for k in COUNTERS}
    out["per_pos"] = (None if not after["per_pos"] else
                      [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0.0] * len(after["per_pos"]))])
    return out


def acceptance(counts: dict, num_decode_tokens: int) -> dict:
    """vLLM's acceptance figures from the counters' growth, and the rates per decode step:
    ``num_decode_tokens`` (output tokens after each request's first) = decode steps + accepted."""
    d, t, a, pp = counts["drafts"], counts["draft_tokens"], counts["accepted"], counts["per_pos"]
    steps = num_decode_tokens - a
    return {"num_drafts": int(d), "num_draft_tokens": int(t), "num_accepted_tokens": int(a),
            "accepted_per_pos": [int(x) for x in pp], "acceptance_rate": a / t if t else None,
            "mean_acceptance_length": 1 + a / d if d else None, "rates": [x / d for x in pp] if d else None,
            "decode_steps": int(steps), "drafted_share": d / steps if steps else None,
            "step_rates": [x / steps for x in pp] if steps else None}


def simulate(v, specs, speculative: dict):
    """``v``'s simulated workload again with ``speculative`` as its policy's, on ``specs``."""
    from sim.run.config import workload_from_dict
    from sim.run.runner import run_workload

    data = dict(v.sim_cfg.raw)
    data["policy"] = {**data["policy"], "speculative": speculative}
    return run_workload(workload_from_dict(data, v.sim_cfg.source, v.sim_cfg.base_dir), specs=specs)


def live_rows(v) -> dict[str, tuple[float, float, float]]:
    """Each ROWS metric of ``v``'s live runs: (median, min, max)."""
    out = {}
    for key, _ in ROWS:
        vals = [m.run.summary.get(key) for m in v.measurements]
        vals = [x for x in vals if x is not None]
        out[key] = (float(np.median(vals)), min(vals), max(vals)) if vals else (float("nan"),) * 3
    return out


def print_case(title: str, plain, spec, sims: dict[str, dict], acc: dict) -> dict:
    """The case's table: live plain / speculative (median, range over runs), and the simulations."""
    lp, ls = live_rows(plain), live_rows(spec)
    sp, ss, ss_step = plain.sim.summary, sims["sim"], sims["sim/match"]
    print(f"\n{title}  [{len(spec.measurements)} live runs per server; load avg "
          + ", ".join(f"{m.load['before_1_5_15min'][0]:.1f}->{m.load['after_1_5_15min'][0]:.1f}"
                      for m in plain.measurements + spec.measurements) + "]")
    print(f"  {'':<18}{'plain live':>11}{'sim':>9}{'err':>8}  |{'ngram live':>11}{'range':>16}"
          f"{'sim':>9}{'err':>8}{'sim/match':>10}{'err':>8}")

    def err(s, live):
        return (s - live) / live * 100 if s is not None and live else float("nan")

    for key, label in ROWS:
        a, b = lp[key][0], ls[key][0]
        rng = f"{ls[key][1]:.4g}..{ls[key][2]:.4g}"
        print(f"  {label:<18}{a:>11.4g}{sp[key]:>9.4g}{err(sp[key], a):>+7.1f}%  |{b:>11.4g}{rng:>16}"
              f"{ss[key]:>9.4g}{err(ss[key], b):>+7.1f}%{ss_step[key]:>10.4g}{err(ss_step[key], b):>+7.1f}%")
    runs = len(spec.measurements)
    print(f"  acceptance (vLLM's counters: rate = accepted / draft tokens, length = 1 + accepted / drafts, "
          f"per position = accepted there / drafts; counts per run)")
    print(f"    live      rate {acc['acceptance_rate']:.3f}, length {acc['mean_acceptance_length']:.2f}, per position "
          + ", ".join(f"{r:.3f}" for r in acc["rates"]) + f"; {acc['num_drafts'] / runs:.0f} drafts of "
          f"{acc['num_draft_tokens'] / max(acc['num_drafts'], 1):.2f} tokens in {acc['decode_steps'] / runs:.0f} "
          f"decode steps ({100 * acc['drafted_share']:.0f}% drafted), {acc['num_accepted_tokens'] / runs:.0f} accepted")
    for name, s in sims.items():
        d = s["spec_decode_num_drafts"]
        print(f"    {name:<9} rate {s['spec_decode_acceptance_rate']:.3f}, length "
              f"{s['spec_decode_mean_acceptance_length']:.2f}, per position "
              + ", ".join(f"{x / d:.3f}" for x in s["spec_decode_num_accepted_tokens_per_pos"])
              + f"; {d} drafts of {s['spec_decode_num_draft_tokens'] / d:.2f} tokens, "
              f"{s['spec_decode_num_accepted_tokens']} accepted")
    speed = {}
    for key, label, sign in SPEEDUP:
        live = (ls[key][0] / lp[key][0]) ** sign
        speed[label] = (live, (ss[key] / sp[key]) ** sign, (ss_step[key] / sp[key]) ** sign)
    print("  speed-up (ngram vs plain): " + "; ".join(
        f"{label} live {x[0]:.2f}x, sim {x[1]:.2f}x, sim/match {x[2]:.2f}x" for label, x in speed.items()))
    return speed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=90.0, help="calibration budget (plain server)")
    p.add_argument("--profile", help="a profile of the plain server (skips calibration)")
    p.add_argument("--loads", default="0.5", help="Poisson cases, fractions of the plain server's capacity")
    p.add_argument("--repeat", type=int, default=2, help="live runs per case and server")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--unit-len", type=int, default=16, help="the repeated unit of each prompt")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--quick", action="store_true", help="1 run per case, 40 requests, 60 s calibration budget")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "batchsim-bench" / "tiny-llama-hf"))
    p.add_argument("--out", help="save the profile and a results.json here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.repeat, args.num_requests, args.budget_s = 1, 40, min(args.budget_s, 60.0)
    args.url = None
    loads = [float(x) for x in args.loads.split(",") if x]

    from bench_vllm_server import calibrated_profile

    from calibrate.serving.launch import VllmServer
    from calibrate.serving.tiny_model import write_preset
    from calibrate.serving.validate_server import validate_server

    t_start = time.perf_counter()
    model = write_preset(args.model_dir)
    k = SPEC["num_speculative_tokens"]
    results: dict[str, dict] = {"plain": {}, "ngram": {}}
    rates: list[float | None] = [None]
    for which in ("plain", "ngram"):
        extra = ["--speculative-config", json.dumps(SPEC)] if which == "ngram" else []
        server = VllmServer(model, **KNOBS, extra_args=extra).start()
        log = server.log_path.read_text(errors="replace")
        said = [ln.split("] ", 1)[-1].strip() for ln in log.splitlines() if re.search("async.sched", ln, re.I)]
        print(f"{which} vLLM server {server.url} up in {server.startup_s:.0f} s (log {server.log_path}); its log on "
              f"async scheduling: {' | '.join(dict.fromkeys(said)) or 'nothing'}", flush=True)
        results[which]["async_log"] = said
        try:
            if which == "plain":
                profile = args.profile or calibrated_profile(args, server.url, "bench-vllm-ngram-")
            # warm-up, discarded: a fresh server compiles the shapes of its first steps (the n-gram
            # server's first replay of 8 requests had a TTFT p50 of 2.7 s, the next 0.25 s)
            warm_cfg, warm_specs = case(argparse.Namespace(**{**vars(args), "num_requests": 8}), None)
            validate_server(warm_cfg, profile=profile, server=server.url, specs=warm_specs)
            for rate in rates:
                cfg, specs = case(args, rate)
                before = spec_counters(server.url) if which == "ngram" else None
                # simulated plain on both servers; the speculative simulations, which need the
                # acceptance these live runs measure, follow (``simulate``)
                v = validate_server(cfg, profile=profile, server=server.url, specs=specs, repeat=args.repeat)
                results[which][rate] = {"v": v, "specs": specs}
                if which == "ngram":
                    decode_tokens = sum(int(m.run.requests["output_tokens"].sum()) - len(m.run.requests)
                                        for m in v.measurements)
                    results[which][rate]["acc"] = acceptance(grown(before, spec_counters(server.url)),
                                                             decode_tokens)
                if which == "plain" and rate is None:
                    capacity = v.measurement.run.summary["request_throughput"]
                    print(f"plain capacity: {capacity:.2f} req/s measured, "
                          f"{v.sim.summary['request_throughput']:.2f} simulated", flush=True)
                    rates += [load * capacity for load in loads]
        finally:
            server.stop()

    print(f"\nn-gram speculation ({json.dumps(SPEC)}) vs none; prompts of {args.prompt_len} tokens "
          f"({args.unit_len}-token unit repeated), {args.output_len} output tokens; errors vs the live median")
    saved = []
    for rate in rates:
        plain, spec = results["plain"][rate]["v"], results["ngram"][rate]["v"]
        specs, acc = results["ngram"][rate]["specs"], results["ngram"][rate]["acc"]
        sims = {"sim": simulate(spec, specs, {"method": "ngram", "num_speculative_tokens": k,
                                              "acceptance_rates": acc["rates"]}).summary,
                "sim/match": simulate(spec, specs, {"method": "ngram", "num_speculative_tokens": k,
                                                    "acceptance_rates": acc["rates"],
                                                    "ngram_match_rate": min(1.0, acc["drafted_share"])}).summary}
        title = ("every request at once" if rate is None else f"Poisson {rate:.2f} req/s") + \
                f", {len(specs)} requests"
        speed = print_case(title, plain, spec, sims, acc)
        saved.append({"case": title, "acceptance": acc, "speedup": speed,
                      "live_plain": live_rows(plain), "live_ngram": live_rows(spec),
                      "sim_plain": {k2: plain.sim.summary[k2] for k2, _ in ROWS},
                      **{name: {k2: s[k2] for k2, _ in ROWS} for name, s in sims.items()}})
    print(f"\nasync scheduling, as the servers' logs say: plain: "
          f"{' | '.join(results['plain']['async_log']) or 'nothing said'}; ngram: "
          f"{' | '.join(results['ngram']['async_log']) or 'nothing said'}")
    print(f"{time.perf_counter() - t_start:.0f} s in all")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(saved, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
