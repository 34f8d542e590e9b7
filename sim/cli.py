"""`sim run | sweep | plan | report | calibrate | validate`: parse and dispatch.

Defaults live in the config dataclasses, not here. Bad input ends with one
line on stderr (file, field, expected, fix) and exit status 2; never a
traceback.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

EXIT_BAD_INPUT = 2
EXIT_POLICY = 1                      # a policy broke its contract (sim.core.policy.PolicyError)
STARTED_S = time.perf_counter()      # the command's "in all" counts from here (interpreter start-up aside)
DTYPE_CHOICES = ("float32", "bfloat16", "float16")   # calibrate.runner.DTYPES, without importing torch
ROUTER_CHOICES = ("round_robin", "least_requests", "least_tokens", "prefix_aware", "vllm_dp")   # sim.loop.feed.ROUTERS, without importing simpy


def _num(v: Any, decimals: int) -> str:
    """Fixed decimals and thousands separators, never scientific notation; "-" for no value."""
    return "-" if v is None else f"{v:,.{decimals}f}"


def _load_text(load: Any) -> str:
    """The offered traffic beside the achieved throughput (``load``: a ``sim.results.vllm_bench.Load``)."""
    if load.closed_loop:
        return f"closed loop, at most {load.max_concurrency:,} in flight"
    if load.offered_rps is None:
        return "offered: all at t=0"
    capped = f", at most {load.max_concurrency:,} in flight" if load.max_concurrency is not None else ""
    return f"offered {_num(load.offered_rps, 3)} req/s{capped}"


def format_summary(summary: dict[str, Any], title: str = "", *, load: Any = None, num_replicas: int = 1,
                   router: str = "") -> str:
    """A readable terminal table of a run's summary; ``load`` (a ``sim.results.vllm_bench.Load``)
    adds the offered rate and an "overload:" line when the server fell behind it."""
    s = summary
    lines = []
    if title:
        lines.append(title)
    if num_replicas > 1:
        lines.append(f"replicas    {num_replicas:,} behind router {router}")
    lines.append(f"requests    completed {s['completed']:,}   failed {s['failed']:,}   "
                 f"duration {_num(s['duration_s'], 1)} s   steps {s['num_steps']:,}")
    offered = f" ({_load_text(load)})" if load is not None else ""
    lines.append(f"throughput  {_num(s['request_throughput'], 3)} req/s{offered}   "
                 f"{_num(s['output_throughput'], 1)} output tok/s   {_num(s['total_token_throughput'], 1)} total tok/s")
    if load is not None and load.overloaded:
        lines.append(f"overload:   {_num(load.offered_rps, 2)} req/s offered, about {_num(load.sustained_rps, 2)} "
                     f"sustained: TTFT grows {_num(load.ttft_growth, 2)} s per second of arrivals, so latencies "
                     f"depend on the run's length (lower the rate or add replicas)")
    if s.get("request_goodput") is not None:
        lines.append(f"goodput     {_num(s['request_goodput'], 3)} req/s meeting the SLOs "
                     f"({100 * (s.get('slo_attainment') or 0):.1f}% of requests)")
    cols = ("mean", "p50", "p90", "p95", "p99")
    rows = [(label, [_num(s.get(f"{k}_{name}_ms"), 2) for k in cols], f"{s.get(f'count_{name}', 0):,}")
            for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"),
                                ("queue", "queue"))]
    width = max(10, 2 + max(len(c) for _, cells, count in rows for c in (*cells, count)))
    lines.append(f"{'(ms)':<8}" + "".join(f"{h:>{width}}" for h in (*cols, "count")))
    for label, cells, count in rows:
        lines.append(f"{label:<8}" + "".join(f"{c:>{width}}" for c in cells) + f"{count:>{width}}")
    lines.append(f"batch       mean size {s.get('mean_batch_size', 0):.1f}   busy {100 * s.get('busy_fraction', 0):.1f}%   "
                 f"KV use mean {100 * (s.get('mean_kv_utilization') or 0):.1f}% peak "
                 f"{100 * (s.get('peak_kv_utilization') or 0):.1f}%   preemptions {s['num_preemptions']:,}")
    if "prefix_cache_hit_rate" in s:
        lines.append(f"prefix cache  hit rate {100 * s['prefix_cache_hit_rate']:.1f}% "
                     f"({s['prefix_cache_hits']:,} of {s['prefix_cache_queries']:,} prompt tokens)   "
                     f"evicted blocks {s['prefix_cache_evicted_blocks']:,}")
    if "spec_decode_num_drafts" in s:
        spec = s["speculative"]
        rate = s["spec_decode_acceptance_rate"]
        length = s["spec_decode_mean_acceptance_length"]
        lines.append(f"speculative {spec['method']} k={spec['num_speculative_tokens']}   acceptance rate "
                     f"{100 * rate:.1f}%   mean acceptance length {length:.2f}" if rate is not None else
                     f"speculative {spec['method']} k={spec['num_speculative_tokens']}   no drafts verified")
        lines[-1] += (f"   ({s['spec_decode_num_accepted_tokens']:,} of {s['spec_decode_num_draft_tokens']:,} draft "
                      f"tokens in {s['spec_decode_num_drafts']:,} verify steps)")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from sim.results.chrome_trace import first_steps, trace_chunks
    from sim.run.config import load_workload, parse_override
    from sim.results.folder import prepare_run_dir, remove_if_empty, write_run
    from sim.results.runfiles import RunFilesProcess
    from sim.run.runner import run_workload
    from sim.results.vllm_bench import DEFAULT_PERCENTILES, bench_result, offered_load, parse_percentiles

    from sim.run.config import ConfigError
    percentiles = parse_percentiles(DEFAULT_PERCENTILES if args.metric_percentiles is None
                                    else args.metric_percentiles)
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
    if args.out is not None and not args.out.strip():
        raise ConfigError("--out '': expected a folder path (without --out, the run goes to runs/<name>)")
    overrides = dict(parse_override(t) for t in args.set or [])
    if args.seed is not None:
        overrides["seed"] = args.seed
    cfg = load_workload(args.workload, overrides)
    if cfg.disaggregation is not None:
        for flag, given in (("--replicas", args.replicas != 1), ("--router", args.router != "round_robin"),
                            ("--check", args.check)):
            if given:
                raise ConfigError(f"{args.workload}: {flag} with a 'disaggregation' section: each pool sets its "
                                  f"own replicas and router (disaggregation.prefill / .decode)"
                                  if flag != "--check" else
                                  f"{args.workload}: --check with a 'disaggregation' section: the decode pool "
                                  f"steps every iteration (no fast path to check)")
    run_dir = prepare_run_dir(args.out, Path("runs") / cfg.name, overwrite=args.overwrite)   # before the work
    out, taken = run_dir.path, run_dir.taken
    try:
        # steps.csv and tokens.npz are written by a second process while the run goes on (sim.results.runfiles)
        if cfg.disaggregation is not None:
            from sim.run.disagg import run_disaggregated
            result = run_disaggregated(cfg, progress=not args.quiet, strict=args.strict)
            traced = first_steps(result.steps) if args.trace else None
            write_run(result, out, bench=bench_result(result, percentiles, detailed=args.save_detailed),
                      trace=trace_chunks(traced) if traced is not None else None)
            from reports.presentation.pd_figure import write_phases_figure
            write_phases_figure(result, out / "pd_phases.png")
        else:
            with RunFilesProcess(out) as files:
                result = run_workload(cfg, num_replicas=args.replicas, router=args.router, progress=not args.quiet,
                                      strict=args.strict, files=files, check_stretch=args.check)
                traced = first_steps(result.steps) if args.trace else None
                write_run(result, out, bench=bench_result(result, percentiles, detailed=args.save_detailed),
                          trace=trace_chunks(traced) if traced is not None else None, files=files)
    except BaseException:
        remove_if_empty(run_dir)
        raise
    meta = result.meta
    # A loop the policy chose by default says so (vLLM 0.32's async scheduling, on where vLLM turns it on;
    # SGLang's overlap schedule).
    knobs = meta.get("policy_knobs") or {}
    loop = (" (async scheduling)" if knobs.get("async_scheduling") else
            " (overlap schedule)" if knobs.get("enable_overlap") else "")
    title = (f"{cfg.name}: policy {cfg.policy.kind}{loop}, profile {meta['profile_name']} "
             f"({result.summary['profile_source']}), {meta['num_blocks']:,} KV blocks x "
             f"{meta['kv_block_size']} tokens")
    pd_ = result.summary.get("disaggregation")
    if pd_ is not None:
        title = (f"{cfg.name}: disaggregated, {pd_['prefill']['replicas']} prefill x "
                 f"{meta['profile_name_prefill']} ({cfg.disaggregation.prefill.cfg.policy.kind}) -> "
                 f"{pd_['decode']['replicas']} decode x {meta['profile_name']} ({result.summary['policy']}{loop}), "
                 f"{meta['num_blocks_prefill']:,} / {meta['num_blocks']:,} KV blocks")
        print(format_summary(result.summary, title,
                             load=offered_load(result.request_source, meta["config"]["arrivals"])))
        print(format_pd(pd_))
    else:
        print(format_summary(result.summary, title,
                             load=offered_load(result.request_source, meta["config"]["arrivals"]),
                             num_replicas=meta["num_replicas"], router=meta["router"]))
    trust = result.summary.get("profile_trust") or {}
    if trust:
        err = trust.get("error_pct")
        print(f"profile     {'step-cost error ~' + format(err, '.1f') + '%' if err is not None else 'unchecked'}"
              f" ({trust['basis']})")
    if result.summary.get("num_out_of_range_lookups"):
        print(f"note: {result.summary['num_out_of_range_lookups']:,} cost lookups fell outside the "
              f"profile's measured grid and were extrapolated")
    if "fast_path_steps_checked" in meta and loop:
        print(f"check       policy {cfg.policy.kind}{loop}: no fast path to check (the pipelined loop steps "
              f"every iteration)")
    elif "fast_path_steps_checked" in meta:
        print(f"check       policy {cfg.policy.kind}: {meta['fast_path_steps_checked']:,} of "
              f"{result.summary['num_steps']:,} steps were the fast path's, each stepped and found as planned")
    files = ["requests.csv", "steps.csv", "tokens.npz", "meta.json", "vllm_bench.json"]
    if traced is not None:
        files.append("trace.json")
    if result.prefix_cache is not None:
        files.append("prefix_cache.csv")
    if result.pd_timeline is not None:
        files += ["pd_timeline.csv", "pd_phases.png"]
    print(f"wrote {out}/ ({', '.join(files + ['summary.json'])}): simulated in {meta['wall_s']:.2f} s, "
          f"{time.perf_counter() - STARTED_S:.2f} s in all")
    if taken is not None:
        print(f"note: {taken}/ already holds a run, so this one went to {out}/ (--out DIR to choose, "
              f"--overwrite to replace)")
    if traced is not None and len(traced) < len(result.steps):
        print(f"note: trace.json holds the first {len(traced):,} of {len(result.steps):,} steps "
              f"(up to t = {traced['t_s'].max():,.1f} s); a longer trace would not load in a browser")
    if args.report:
        from reports.presentation.report import regenerate
        for path in regenerate(out):
            print(f"wrote {path}")
    return 0


def format_pd(pd_: dict[str, Any]) -> str:
    """The terminal's lines for a disaggregated run: where each request's TTFT went, the link."""
    link = pd_["link"]
    lines = [f"link        {link['kind'] or 'custom'}: {link['bandwidth_gbps']:g} Gb/s per GPU each way, "
             f"{link['latency_us']:g} us; {pd_['num_transfers']:,} transfers, "
             f"{pd_['transfer_bytes'] / 2**30:,.2f} GiB, {pd_['num_transfer_timeouts']} timed out"]
    names = (("prefill_queue_s", "prefill queue"), ("prefill_s", "prefill"), ("transfer_wait_s", "decode admit"),
             ("transfer_s", "transfer"), ("decode_queue_s", "decode queue"), ("decode_first_step_s", "first step"))
    lines.append("TTFT parts  " + " | ".join(
        f"{label} {v['p50_ms']:.1f}/{v['p99_ms']:.1f}" for key, label in names
        if (v := pd_["phases"][key])["p50_ms"] is not None) + " ms (p50/p99)")
    held = pd_["prefill_kv_held_peak_blocks"]
    if held:
        lines.append(f"prefill KV  held for transfer: peak {max(held.values()):,} of {pd_['prefill_kv_blocks']:,} "
                     f"blocks on one instance")
    return "\n".join(lines)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run the sweep (reports.experiments), then build its report and print its table
    (reports.presentation); with failed runs, the finished ones first, then the error."""
    from reports.experiments.spec import cli_overrides
    from reports.experiments.sweep import SweepFailed, run_sweep_file
    from reports.presentation.report import regenerate
    from reports.presentation.terminal import print_sweep
    try:
        table = run_sweep_file(args.sweep, jobs=args.jobs, cluster=args.cluster, out=Path(args.out) if args.out
                               else None, progress=not args.quiet and sys.stderr.isatty(),
                               overrides=cli_overrides(args.set, args.seed), announce=not args.quiet)
    except SweepFailed as exc:
        if exc.table.is_file():
            regenerate(exc.table.parent)
            print_sweep(exc.table.parent)
        raise
    regenerate(table.parent)
    print_sweep(table.parent)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Run the plan, then build its report and print the recommendation."""
    from reports.experiments.plan import PlanFailed, run_plan_file
    from reports.experiments.spec import cli_overrides
    from reports.presentation.report import regenerate
    from reports.presentation.terminal import print_plan
    try:
        out = run_plan_file(args.plan, out=Path(args.out) if args.out else None, jobs=args.jobs,
                            cluster=args.cluster, progress=not args.quiet and sys.stderr.isatty(),
                            overrides=cli_overrides(args.set, args.seed))
    except PlanFailed as exc:
        regenerate(exc.out)
        raise
    regenerate(out)
    print_plan(out)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from reports.presentation.report import regenerate
    for path in regenerate(Path(args.dir)):
        print(f"wrote {path}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from sim.base.atomic import write_text_atomic
    from sim.run.schema import workload_schema
    text = json.dumps(workload_schema(), indent=2) + "\n"
    if args.out is not None:
        check_out_file(args.out, "workload.schema.json")
        write_text_atomic(Path(args.out), text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def check_out_file(out: str, example: str) -> None:
    """An ``--out`` that names a file to write: not a folder, in a folder that exists."""
    from sim.run.config import ConfigError
    target = Path(out)
    if not out.strip() or target.is_dir() or not target.parent.is_dir():
        problem = "is a folder" if out.strip() and target.is_dir() else "its folder does not exist"
        raise ConfigError(f"--out {out!r}: {problem}; give a file path in an existing folder, e.g. --out {example}")


def check_budget(budget_s: float | None) -> None:
    from sim.run.config import ConfigError
    if budget_s is not None and not (math.isfinite(budget_s) and budget_s > 0):
        raise ConfigError(f"--budget-s must be a finite number of seconds > 0, got {budget_s}")


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_budget(args.budget_s)
    if args.out:
        check_out_file(args.out, "my-profile.yaml")
    if args.kernels:                    # measured CUDA kernel tables (the kernels extra; no torch)
        from sim.run.config import ConfigError
        if args.server:
            raise ConfigError("--kernels and --server are two sources of step costs: give one of them")
        from calibrate.kernels import main as calibrate_kernels_main
        return calibrate_kernels_main(args)
    if args.server:                     # black box: time a running server from outside (no torch)
        from calibrate.serving.calibrate_server import main as calibrate_server_main
        return calibrate_server_main(args)
    from calibrate.runner import main as calibrate_main
    return calibrate_main(args)


def cmd_validate(args: argparse.Namespace) -> int:
    from sim.run.config import ConfigError
    check_budget(args.budget_s)
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")
    if args.repeat > 1 and not args.server:
        raise ConfigError(f"--repeat {args.repeat}: only a live replay against a server (--server URL) can be "
                          f"repeated")
    if args.server or args.measured:    # a real vLLM server, live or from a saved benchmark (no torch)
        from calibrate.serving.validate_server import main as validate_server_main
        return validate_server_main(args)
    from calibrate.validate import main as validate_main
    return validate_main(args)


def _add_pool_options(parser: argparse.ArgumentParser) -> None:
    """Where the runs of a sweep or plan execute, and where their files go."""
    parser.add_argument("-j", "--jobs", type=int, help="local worker processes (default: all cores)")
    parser.add_argument("--cluster", help="tcp://HOST:PORT of a Dask scheduler, or 'local'")
    parser.add_argument("--out", help="output directory")


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("batchsim")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def policy_help() -> str:
    """The epilog of ``sim run --help``: each policy's knobs, defaults and docs,
    read from the config dataclasses (``policies.knob_docs``)."""
    import textwrap

    from policies import POLICIES, knob_docs
    lines = ["policies (policy.kind) and their knobs (default), set in the workload or with --set policy.KNOB=VALUE:"]
    for kind in POLICIES:
        lines.append(f"  {kind}")
        for name, default, doc in knob_docs(kind):
            shown = "unset" if default is None else default
            lines += textwrap.wrap(f"{name} ({shown}): {doc}", width=100, initial_indent="    ",
                                   subsequent_indent="      ")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sim", description="batchsim: simulate LLM-serving schedulers")
    p.add_argument("--version", action="version", version=f"batchsim {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="simulate one workload file", epilog=policy_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("workload", help="workload YAML (see workloads/)")
    r.add_argument("--out", help="output directory (default runs/<name>, or runs/<name>-2, -3, ... when "
                                 "that already holds a run); refused if it holds a run, unless --overwrite")
    r.add_argument("--overwrite", action="store_true",
                   help="replace the run already in the output directory (removes only files batchsim wrote)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field, e.g. --set policy.kind=sarathi (repeatable)")
    r.add_argument("--seed", type=int, help="override the workload's seed")
    r.add_argument("--replicas", type=int, default=1, help="identical replicas behind a router")
    r.add_argument("--router", default="round_robin", choices=ROUTER_CHOICES,
                   help="how arrivals are spread over the replicas")
    r.add_argument("--strict", action="store_true", help="fail if any request is rejected")
    r.add_argument("--check", action="store_true",
                   help="check the policy's fast-path declarations: step every iteration the fast path would "
                        "skip and fail on the first that differs from its plan (slower; same results; for a "
                        "policy of your own or new knobs; the workload key check_fast_path: true does the same)")
    r.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every 10 s on stderr)")
    r.add_argument("--report", action="store_true", help="also build the run's figures and report.html")
    r.add_argument("--trace", action="store_true",
                   help="also write trace.json, one event per step and replica (open in ui.perfetto.dev)")
    r.add_argument("--metric-percentiles", metavar="P,P,...",
                   help="percentiles in vllm_bench.json, as vllm bench serve's flag (default 99, as vLLM), "
                        "e.g. 50,90,99.9")
    r.add_argument("--save-detailed", action="store_true",
                   help="add per-request arrays to vllm_bench.json, as vllm bench serve --save-detailed")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("sweep", help="run a grid of workload variants")
    s.add_argument("sweep", help="sweep YAML: a base workload and the keys to vary (see workloads/sweep_*.yaml)")
    _add_pool_options(s)
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a sweep setting (repetitions=3) or a field of every run's workload "
                        "(policy.max_num_seqs=64); not a varied key (repeatable)")
    s.add_argument("--seed", type=int, help="override the base workload's seed")
    s.add_argument("--quiet", action="store_true", help="no progress bar (shown only on a terminal); the results "
                   "table still prints")
    s.set_defaults(func=cmd_sweep)

    pl = sub.add_parser("plan", help="capacity planning under SLOs")
    pl.add_argument("plan", help="plan YAML: traffic, SLOs and the candidate GPUs, TP degrees and policies "
                                 "(see workloads/plan_*.yaml)")
    _add_pool_options(pl)
    pl.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a plan setting (target_rate=80, target_utilization=0.7) or a field of the "
                         "base traffic (server.max_model_len=8192) (repeatable)")
    pl.add_argument("--seed", type=int, help="override the base traffic's seed")
    pl.add_argument("--quiet", action="store_true", help="no progress bar (shown only on a terminal); the "
                    "recommendation still prints")
    pl.set_defaults(func=cmd_plan)

    rp = sub.add_parser("report", help="regenerate plots and reports from saved results")
    rp.add_argument("dir", help="a run, sweep or plan directory written by sim run | sweep | plan")
    rp.set_defaults(func=cmd_report)

    sc = sub.add_parser("schema", help="print the JSON Schema of workload files (for editors: YAML completion "
                                       "and checks as you type)")
    sc.add_argument("--out", help="write it to this file instead of standard output")
    sc.set_defaults(func=cmd_schema)

    c = sub.add_parser("calibrate", help="measure step costs on real kernels (needs torch), or time a running "
                                         "vLLM server from outside (--server, no torch)")
    c.add_argument("--server", metavar="URL", help="calibrate a running OpenAI-compatible server (vLLM, SGLang "
                   "or trtllm-serve, told apart by what it answers), e.g. http://127.0.0.1:8000, instead of "
                   "batchsim's own torch engine")
    c.add_argument("--kernels", metavar="SOURCE", help="aiconfigurator: compose a profile from the measured CUDA "
                   "kernel tables of the aiconfigurator-core wheel (the kernels extra) instead of timing anything")
    c.add_argument("--gpu", help="--kernels: the GPU preset (h100-sxm, b200-sxm, ...)")
    c.add_argument("--engine", default="vllm", choices=["vllm", "sglang", "trtllm", "tensorrt_llm"],
                   help="--kernels: whose kernel tables (default vllm)")
    c.add_argument("--engine-version", help="--kernels: the engine version (default: the newest measured)")
    c.add_argument("--tensor-parallel", type=int, default=1, help="--kernels: TP degree")
    c.add_argument("--weight-dtype", help="--kernels: weight format (fp8, nvfp4, mxfp4; default: the checkpoint's)")
    c.add_argument("--kv-cache-dtype", help="--kernels: KV cache format (auto, fp8)")
    c.add_argument("--enable-expert-parallel", action="store_true", help="--kernels: experts placed whole (EP = TP)")
    c.add_argument("--async-scheduling", action="store_true", help="--kernels, vllm: vLLM's async host terms")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch engine: device")
    c.add_argument("--model", default="tiny-llama", help="torch engine: model preset (calibrate.model)")
    c.add_argument("--dtype", choices=DTYPE_CHOICES,
                   help="torch engine: weights and activations (default float32 on cpu, bfloat16 on cuda)")
    c.add_argument("--out", required=True, help="profile path (.yaml or .json); the raw CSV goes beside it")
    c.add_argument("--budget-s", type=float, default=120.0, help="time budget of the whole calibration, seconds")
    c.add_argument("--threads", type=int, help="torch engine: CPU threads (default: torch's)")
    c.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and timed shapes (torch engine) or the probe prompts (--server)")
    c.add_argument("--max-num-seqs", type=int, help="--server: the server's max_num_seqs, if it does not expose it")
    c.add_argument("--max-num-batched-tokens", type=int,
                   help="--server: the server's max_num_batched_tokens, if it does not expose it")
    c.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="--server: the served model's HF config.json (its shape; its max_position_embeddings "
                        "when the server does not say its model length, as trtllm-serve), if the server does not "
                        "give it")
    c.add_argument("--quiet", action="store_true", help="no progress output")
    c.set_defaults(func=cmd_calibrate)

    v = sub.add_parser("validate", help="run a workload live and compare with the simulator: on batchsim's "
                                        "torch engine, a vLLM server (--server) or a saved benchmark (--measured)")
    v.add_argument("workload", help="workload YAML to run live and simulate")
    src = v.add_mutually_exclusive_group()
    src.add_argument("--server", metavar="URL", help="replay the workload against this running server (vLLM, "
                     "SGLang or trtllm-serve; simulated with that engine's policy; no torch)")
    src.add_argument("--measured", metavar="FILE", help="compare with a `vllm bench serve --save-result "
                     "--save-detailed` JSON instead of measuring (no torch)")
    v.add_argument("--targets", metavar="NAME=PCT,...", help="accuracy targets, max |err %%| of the simulator "
                   "against the measurement (default throughput=5,ttft_p50=10,itl_p50=10,ttft_p99=20,itl_p99=20)")
    v.add_argument("--check", action="store_true", help="exit status 1 when any target is missed (for CI); "
                   "without it the verdict is printed and the exit status is 0")
    v.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch engine: device")
    v.add_argument("--model", default="tiny-llama", help="torch engine: model preset (calibrate.model)")
    v.add_argument("--dtype", choices=DTYPE_CHOICES,
                   help="torch engine: weights and activations (default float32 on cpu, bfloat16 on cuda)")
    v.add_argument("--profile", help="a profile fitted on this engine or server (torch engine default: "
                                     "calibrate first; --server/--measured default: the workload's profile)")
    v.add_argument("--out", help="report directory")
    v.add_argument("--quiet", action="store_true", help="--server: no progress on stderr")
    v.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a workload field (repeatable)")
    v.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="--server: replay the workload N times; the table gives the live spread beside each "
                        "error, and a target is met within its limit or inside that spread (default 1)")
    v.add_argument("--budget-s", type=float, default=120.0, help="calibration budget if calibrating")
    v.add_argument("--threads", type=int, help="torch engine: CPU threads (default: torch's)")
    v.set_defaults(func=cmd_validate)
    return p


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``kill``, a CI runner), raised as an interrupt is: the same cleanup
    (spill folders, half-written outputs, pool workers) runs before the process ends."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    hook = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if hook:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv)
    finally:
        if hook:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _main(argv: Sequence[str] | None) -> int:
    from sim.core.policy import PolicyError
    from sim.run.config import ConfigError
    from sim.cost.profile import ProfileError

    if sys.stdout is None:              # started with stdout closed (`sim run ... >&-`)
        sys.stdout = open(os.devnull, "w")
    if hasattr(sys.stdout, "reconfigure"):  # a name an ASCII terminal cannot show is escaped, not a crash
        sys.stdout.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    warnings.showwarning = _warning_line
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()              # here, so that a reader that left is caught below
        return status
    except (ConfigError, ProfileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PolicyError as exc:          # a policy that broke its contract (sim.core.policy): a failed check
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_POLICY
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            print("error: this command needs PyTorch: pip install torch==2.13.0 && pip install -e '.[calibrate]' "
                  "(the CPU build; see docs/contributing.md, Tests)", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated)
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        return 128 + signal.SIGTERM if terminated else 130
    except BrokenPipeError:             # `sim run ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:              # a path the user gave that cannot be read or written
        if exc.filename is None and exc.errno in (errno.ENOSPC, errno.EIO, errno.EBADF):
            print(f"error: cannot write to standard output ({exc.strerror or exc})", file=sys.stderr)
            return 1
        if exc.filename is None:
            raise
        print(f"error: {exc.filename}: {_os_problem(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _os_problem(exc: OSError) -> str:
    """What an OSError on a user's path means, in words, with the fix where there is one."""
    hints = {errno.EEXIST: "a file is in the way of a folder the command writes; choose another path",
             errno.ENOTDIR: "part of the path is a file, not a folder; choose another path",
             errno.EISDIR: "is a folder; give a file path",
             errno.EACCES: "permission denied; choose a folder you can write",
             errno.EROFS: "read-only file system; choose another folder",
             errno.ENOENT: "no such file or folder",
             errno.ENOSPC: "no space left on the device"}
    if exc.errno == errno.EACCES and exc.filename is not None:
        path = Path(os.fsdecode(exc.filename))
        if path.exists() and not path.is_dir() and not os.access(path, os.R_OK):
            return "permission denied: cannot read it; check its permissions"     # an input, not an output
    return hints.get(exc.errno or -1, exc.strerror or str(exc))


if __name__ == "__main__":
    sys.exit(main())
