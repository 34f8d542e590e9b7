"""`sim run | sweep | plan | report | calibrate | validate`: parse and dispatch.

Defaults live in the config dataclasses, not here. Bad input ends with one
line on stderr (file, field, expected, fix) and exit status 2; never a
traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

EXIT_BAD_INPUT = 2


def _fmt(v: Any, width: int = 10) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if isinstance(v, float):
        if abs(v) >= 10000:
            return f"{v:>{width}.0f}"
        return f"{v:>{width}.1f}" if abs(v) >= 100 else f"{v:>{width}.2f}"
    return f"{v:>{width}}"


def format_summary(summary: dict[str, Any], title: str = "") -> str:
    """A readable terminal table of a run's summary."""
    s = summary
    lines = []
    if title:
        lines.append(title)
    lines.append(f"requests    completed {s['completed']}   failed {s['failed']}   "
                 f"duration {s['duration_s']:.1f} s   steps {s['num_steps']}")
    lines.append(f"throughput  {s['request_throughput']:.3f} req/s   {s['output_throughput']:.1f} output tok/s   "
                 f"{s['total_token_throughput']:.1f} total tok/s")
    if s.get("request_goodput") is not None:
        lines.append(f"goodput     {s['request_goodput']:.3f} req/s meeting the SLOs "
                     f"({100 * (s.get('slo_attainment') or 0):.1f}% of requests)")
    head = f"{'(ms)':<8}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p95", "p99")) + f"{'count':>10}"
    lines.append(head)
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"),
                        ("queue", "queue")):
        row = [s.get(f"{k}_{name}_ms") for k in ("mean", "p50", "p90", "p95", "p99")]
        lines.append(f"{label:<8}" + "".join(_fmt(v) for v in row) + f"{s.get(f'count_{name}', 0):>10}")
    lines.append(f"batch       mean size {s.get('mean_batch_size', 0):.1f}   busy {100 * s.get('busy_fraction', 0):.1f}%   "
                 f"KV use mean {100 * (s.get('mean_kv_utilization') or 0):.1f}% peak "
                 f"{100 * (s.get('peak_kv_utilization') or 0):.1f}%   preemptions {s['num_preemptions']}")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from sim.config import load_workload, parse_override
    from sim.io import ensure_writable, write_run
    from sim.runner import run_workload

    overrides = dict(parse_override(t) for t in args.set or [])
    if args.seed is not None:
        overrides["seed"] = args.seed
    cfg = load_workload(args.workload, overrides)
    out = ensure_writable(Path(args.out) if args.out else Path("runs") / cfg.name)   # before the work
    result = run_workload(cfg, num_replicas=args.replicas, router=args.router,
                          progress=not args.quiet and sys.stderr.isatty(), strict=args.strict)
    write_run(result, out)
    title = (f"{cfg.name}: policy {cfg.policy.kind}, profile {result.meta['profile_name']} "
             f"({result.summary['profile_source']}), {result.meta['num_blocks']} KV blocks x "
             f"{result.meta['kv_block_size']} tokens")
    print(format_summary(result.summary, title))
    trust = result.summary.get("profile_trust") or {}
    if trust:
        err = trust.get("error_pct")
        print(f"profile     {'step-cost error ~' + format(err, '.1f') + '%' if err is not None else 'unchecked'}"
              f" ({trust['basis']})")
    if result.summary.get("num_out_of_range_lookups"):
        print(f"note: {result.summary['num_out_of_range_lookups']} cost lookups fell outside the "
              f"profile's measured grid and were extrapolated")
    print(f"wrote {out}/ (requests.csv, steps.csv, tokens.npz, summary.json, meta.json) "
          f"in {result.meta['wall_s']:.2f} s")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from reports.sweep import run_sweep_file
    table = run_sweep_file(args.sweep, jobs=args.jobs, cluster=args.cluster,
                           out=Path(args.out) if args.out else None, progress=not args.quiet)
    print(f"wrote {table}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from reports.plan import run_plan_file
    out = run_plan_file(args.plan, out=Path(args.out) if args.out else None, jobs=args.jobs,
                        cluster=args.cluster, progress=not args.quiet)
    print(f"wrote {out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from reports.report import regenerate
    for path in regenerate(Path(args.dir)):
        print(f"wrote {path}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.server:                     # black box: time a running server from outside (no torch)
        from calibrate.serving.calibrate_server import main as calibrate_server_main
        return calibrate_server_main(args)
    from calibrate.runner import main as calibrate_main
    argv = ["--model", args.model, "--device", args.device, "--out", args.out,
            "--budget-s", str(args.budget_s)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.quiet:
        argv.append("--quiet")
    return calibrate_main(argv)


def cmd_validate(args: argparse.Namespace) -> int:
    if args.server or args.measured:    # a real vLLM server, live or from a saved benchmark (no torch)
        from calibrate.serving.validate_server import main as validate_server_main
        return validate_server_main(args)
    if args.targets:
        from sim.config import ConfigError
        raise ConfigError("--targets applies to --server and --measured validations only")
    from calibrate.validate import main as validate_main
    return validate_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sim", description="batchsim: simulate LLM-serving schedulers")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="simulate one workload file")
    r.add_argument("workload", help="workload YAML (see workloads/)")
    r.add_argument("--out", help="output directory (default runs/<name>)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field, e.g. --set policy.kind=sarathi (repeatable)")
    r.add_argument("--seed", type=int, help="override the workload's seed")
    r.add_argument("--replicas", type=int, default=1, help="identical replicas behind a router")
    r.add_argument("--router", default="round_robin",
                   help="round_robin | least_requests | least_tokens")
    r.add_argument("--strict", action="store_true", help="fail if any request is rejected")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("sweep", help="run a grid of workload variants")
    s.add_argument("sweep")
    s.add_argument("-j", "--jobs", type=int, help="local worker processes (default: all cores)")
    s.add_argument("--cluster", help="tcp://HOST:PORT of a Dask scheduler, or 'local'")
    s.add_argument("--out", help="output directory")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_sweep)

    pl = sub.add_parser("plan", help="capacity planning under SLOs")
    pl.add_argument("plan")
    pl.add_argument("-j", "--jobs", type=int)
    pl.add_argument("--cluster")
    pl.add_argument("--out")
    pl.add_argument("--quiet", action="store_true")
    pl.set_defaults(func=cmd_plan)

    rp = sub.add_parser("report", help="regenerate plots and reports from saved results")
    rp.add_argument("dir")
    rp.set_defaults(func=cmd_report)

    c = sub.add_parser("calibrate", help="measure step costs on real kernels (needs torch), or time a running "
                                         "vLLM server from outside (--server, no torch)")
    c.add_argument("--server", metavar="URL", help="calibrate a running OpenAI-compatible vLLM server, "
                   "e.g. http://127.0.0.1:8000, instead of batchsim's own torch engine")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch engine: device")
    c.add_argument("--model", default="tiny-llama", help="torch engine: model preset")
    c.add_argument("--dtype")
    c.add_argument("--out", required=True, help="profile path (.yaml or .json)")
    c.add_argument("--budget-s", type=float, default=120.0)
    c.add_argument("--threads", type=int)
    c.add_argument("--seed", type=int, default=0, help="seed of the probe prompts (--server)")
    c.add_argument("--max-num-seqs", type=int, help="--server: the server's max_num_seqs, if it does not expose it")
    c.add_argument("--max-num-batched-tokens", type=int,
                   help="--server: the server's max_num_batched_tokens, if it does not expose it")
    c.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="--server: the served model's HF config.json (its shape), if the server does not give it")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    v = sub.add_parser("validate", help="run a workload live and compare with the simulator: on batchsim's "
                                        "torch engine, a vLLM server (--server) or a saved benchmark (--measured)")
    v.add_argument("workload")
    src = v.add_mutually_exclusive_group()
    src.add_argument("--server", metavar="URL", help="replay the workload against this running vLLM server "
                     "(no torch)")
    src.add_argument("--measured", metavar="FILE", help="compare with a `vllm bench serve --save-result "
                     "--save-detailed` JSON instead of measuring (no torch)")
    v.add_argument("--targets", metavar="NAME=PCT,...", help="--server/--measured accuracy targets, max |err %%| "
                   "(default throughput=5,ttft_p50=10,itl_p50=10,ttft_p99=20,itl_p99=20)")
    v.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    v.add_argument("--model", default="tiny-llama")
    v.add_argument("--dtype")
    v.add_argument("--profile", help="a profile fitted on this engine or server (torch engine default: "
                                     "calibrate first; --server/--measured default: the workload's profile)")
    v.add_argument("--out", help="report directory")
    v.add_argument("--quiet", action="store_true", help="--server: no progress on stderr")
    v.add_argument("--set", action="append", metavar="KEY=VALUE")
    v.add_argument("--budget-s", type=float, default=120.0, help="calibration budget if calibrating")
    v.add_argument("--threads", type=int)
    v.set_defaults(func=cmd_validate)
    return p


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from sim.config import ConfigError
    from sim.profile import ProfileError

    args = build_parser().parse_args(argv)
    warnings.showwarning = _warning_line
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ProfileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            print("error: this command needs PyTorch: pip install 'batchsim[calibrate]' "
                  "(or pip install torch)", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
