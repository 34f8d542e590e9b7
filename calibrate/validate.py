"""`sim validate`: run a workload live on real kernels and in the simulator, and compare.

Both runs share the workload's requests and seed, the policy class and its
config, the block pool (num_blocks x block_size = the engine's paged KV pool)
and max_model_len; the live one runs ``sim.loop.server.Server`` in wall-clock time
on a ``LiveEngine`` (``sim.run.live``), the simulated one runs the same loop
with the profile's step times. The profile comes from ``--profile`` or, when
none is given, from a calibration of the same engine first (said so in the
output and the report). ``reports.presentation.validation`` builds the comparison; only
``main`` writes files.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from calibrate.engine import LiveEngine
from sim.run.live import run_live, run_sim
from calibrate.model import get_model_shape
from calibrate.grid import GridSpec
from calibrate.runner import DTYPES, CalibrationResult, calibrate
from calibrate.serving.validate_server import output_dir
from reports.presentation import validation as rv
from sim.run.config import ConfigError, WorkloadConfig, load_workload, parse_override
from sim.cost.profile import ModelShape, Profile, load_profile
from sim.run.runner import build_policy, kv_blocks
from sim.results.result import RunResult


@dataclass
class Validation:
    """A live run, its simulated twin and their comparison (``reports.presentation.validation.compare``)."""

    cfg: WorkloadConfig
    profile: Profile
    live: RunResult
    sim: RunResult
    comparison: dict[str, Any]
    notes: list[str]
    calibration: CalibrationResult | None = None


def resolve_target(model: str, device: str, dtype: str | None) -> tuple[ModelShape, torch.device, str]:
    """(model shape, device, dtype name); bad values are ConfigErrors."""
    try:
        model_cfg = get_model_shape(model)
    except ValueError as exc:
        raise ConfigError(f"--model: {exc}") from None
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return model_cfg, dev, dtype


def check_profile(profile: Profile, source: str, model_cfg: ModelShape, dev: torch.device, dtype: str) -> None:
    """Refuse a profile fitted on another model, dtype or device type (ConfigError)."""
    if profile.model.name != model_cfg.name:
        raise ConfigError(f"{source}: field 'model.name' is {profile.model.name!r} but --model is "
                          f"{model_cfg.name!r}; pass --model {profile.model.name} or a profile of {model_cfg.name}")
    if profile.dtype != dtype:
        raise ConfigError(f"{source}: field 'dtype' is {profile.dtype!r} but the live run uses {dtype!r}; "
                          f"pass --dtype {profile.dtype} or recalibrate")
    prof_dev = str(profile.provenance.get("device", dev.type)).split(":")[0]
    if prof_dev != dev.type:
        raise ConfigError(f"{source}: fitted on device {prof_dev!r} but --device is {dev.type!r}; "
                          f"pass --device {prof_dev} or recalibrate")


MIN_CPU_SHARE = 0.85      # CPU s per forward-pass s per thread below which a CPU run was not alone
# (tokens per batch, context per request, decodes per batch): the default calibration extents.
GRID_CAPS = {"cpu": (2048, 4096, 64), "cuda": (8192, 16384, 256)}


def calibration_grid(cfg: WorkloadConfig, model_cfg: ModelShape, dev: torch.device) -> GridSpec | None:
    """A calibration grid no larger than the batches this workload can form
    (the policy's token budget, else max_num_seqs whole prompts; max_model_len;
    max_num_seqs; KV pool), so a small budget is spent where the runs will be.
    None (calibrate's default grid) when the KV pool is not fixed by
    ``server.num_blocks``. The profile does not exist yet, so vllm_v1's
    defaults are those of an unknown device."""
    s = cfg.server
    if s.num_blocks is None:
        return None
    max_tokens, max_context, max_seqs = GRID_CAPS["cuda" if dev.type == "cuda" else "cpu"]
    max_len = min(s.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
    policy = build_policy(cfg, max_len)
    tokens = policy.token_budget or policy.max_num_seqs * max_len
    return GridSpec(max_num_tokens=max(4, min(max_tokens, tokens)), max_context=max(4, min(max_context, max_len)),
                    max_num_seqs=max(4, min(max_seqs, policy.max_num_seqs, s.num_blocks)),
                    max_kv_tokens=max(4, s.num_blocks * s.block_size), block_size=s.block_size)


def validate(cfg: WorkloadConfig, profile: Profile, *, model: str = "tiny-llama", device: str = "cpu",
             dtype: str | None = None, num_threads: int | None = None, notes: list[str] | None = None,
             progress: bool = False) -> Validation:
    """Run ``cfg`` live on ``model``/``device``/``dtype`` and simulated with ``profile``; compare.

    Blocks for the live run's duration (the workload's arrival span plus the
    drain). ``num_threads`` defaults to the profile's calibration thread count.
    Raises ConfigError for a bad model/device/dtype or a KV pool that cannot
    hold one request of max_model_len.
    """
    model_cfg, dev, dtype = resolve_target(model, device, dtype)
    notes = list(notes or [])
    num_blocks, max_model_len = kv_blocks(cfg, profile)
    if max_model_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"{cfg.source}: field 'server.max_model_len' is {max_model_len}, above "
                          f"{model_cfg.name}'s {model_cfg.max_position_embeddings} positions")
    cal_threads = profile.provenance.get("num_threads")
    threads = num_threads if num_threads is not None else (cal_threads if dev.type == "cpu" else None)
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if dev.type == "cpu" and cal_threads is not None and threads != cal_threads:
        notes.append(f"warning: the live run uses {threads} threads, the profile was fitted with {cal_threads}")
    engine = LiveEngine(model_cfg, num_blocks, cfg.server.block_size, dev, DTYPES[dtype], cfg.seed, threads)
    if progress:
        print(f"live run: {cfg.name}, policy {cfg.policy.kind}, {model_cfg.name} on {dev} ({dtype}, "
              f"{torch.get_num_threads()} threads), {num_blocks} KV blocks x {cfg.server.block_size}",
              file=sys.stderr)
    live = run_live(cfg, profile, engine, max_model_len)
    sim = run_sim(cfg, profile, num_blocks, max_model_len)
    live.meta.update(num_threads=torch.get_num_threads(), profile_name=profile.name)
    notes.append(f"live run: {live.meta['wall_s']:.1f} s wall on {model_cfg.name}, {dev} {dtype}, "
                 f"{torch.get_num_threads()} threads, {num_blocks} KV blocks x {cfg.server.block_size} tokens, "
                 f"max_model_len {max_model_len}")
    comparison = rv.compare(live, sim)
    share = comparison["steps"]["cpu_per_forward_s"] / torch.get_num_threads()
    if dev.type == "cpu" and share < MIN_CPU_SHARE:
        notes.append(f"warning: the forward passes got {share:.2f} CPU seconds per second per thread: other "
                     f"processes shared the cores, so the live run is slower than what the profile measured")
    lookups = comparison["out_of_range_lookups"]["sim"]
    if lookups:
        notes.append(f"{lookups} simulated cost lookups fell outside the profile's grid (extrapolated)")
    return Validation(cfg, profile, live, sim, comparison, notes)


def _calibrate_first(cfg: WorkloadConfig, args: argparse.Namespace) -> tuple[CalibrationResult, str]:
    model_cfg, dev, dtype = resolve_target(args.model, args.device, args.dtype)
    if args.budget_s is None or args.budget_s <= 0:
        raise ConfigError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    grid = calibration_grid(cfg, model_cfg, dev)
    extent = ("the default grid" if grid is None else f"a grid sized to the workload ({grid.max_num_tokens} "
              f"tokens, context {grid.max_context}, {grid.max_num_seqs} seqs, {grid.max_kv_tokens} KV tokens)")
    print(f"no --profile given: calibrating {model_cfg.name} on {dev} ({dtype}) first, budget "
          f"{args.budget_s:g} s, {extent}", file=sys.stderr)
    cal = calibrate(model_cfg, str(dev), dtype, args.budget_s, None, sys.stderr.isatty(), cfg.seed,
                    grid=grid, num_threads=args.threads)
    fe = cal.profile.fit_error
    note = (f"profile: calibrated first by this command (budget {args.budget_s:g} s; holdout MAPE "
            f"{fe.get('holdout_mape_pct', float('nan')):.1f}% on {fe.get('holdout_num_points', 0)} batches); "
            f"saved as profile.yaml")
    return cal, note


def main(args: argparse.Namespace) -> int:
    """``sim validate WORKLOAD``: calibrate if needed, run both, write the report, print the table."""
    overrides = dict(parse_override(t) for t in (getattr(args, "set", None) or []))
    cfg = load_workload(args.workload, overrides)
    targets = rv.parse_targets(getattr(args, "targets", None))       # before the work: a bad item fails now
    model_cfg, dev, dtype = resolve_target(args.model, args.device, args.dtype)
    calibration = None
    if args.profile:
        profile = load_profile(args.profile)
        check_profile(profile, args.profile, model_cfg, dev, args.dtype or profile.dtype)
        dtype = args.dtype or profile.dtype
        note = f"profile: {args.profile} ({profile.name}, {profile.provenance.get('source', 'unknown')})"
    else:
        calibration, note = _calibrate_first(cfg, args)
        profile = calibration.profile
    out = output_dir(args.out, cfg.name, None)
    result = validate(cfg, profile, model=args.model, device=args.device, dtype=dtype,
                      num_threads=args.threads, notes=[note], progress=True)
    result.calibration = calibration
    verdict = rv.verdict(pd.DataFrame(result.comparison["table"]), targets)
    paths = _write_report(result, verdict, out)
    print(f"{cfg.name}: policy {cfg.policy.kind}, {len(result.live.requests)} requests")
    for n in result.notes:
        print(n)
    print(rv.format_table(result.comparison["table"]))
    s, d = result.comparison["steps"], result.comparison["decisions"]
    print(f"per-step cost error: median |err| {s['all']['median_abs_pct']:.1f}%, p90 "
          f"{s['all']['p90_abs_pct']:.1f}% over {s['num_steps']} live steps; identical batches "
          f"{100 * d['identical_fraction']:.1f}% of steps")
    print(rv.format_verdict(verdict))
    print(f"wrote {out}/ ({', '.join(p.name for p in paths)})")
    return 0 if bool(verdict["met"].all()) or not getattr(args, "check", False) else 1


def _write_report(v: Validation, verdict: pd.DataFrame, out: Path) -> list[Path]:
    """Write the report directory (for ``main`` only): live/ and sim/ run dirs, report.json,
    report.md, report.html, cdf.png and step_error.png (+ SVG), and the profile if it was
    calibrated here."""
    from reports.presentation.plots import save_figure
    from reports.presentation.render import write_document
    from sim.results.folder import write_json, write_run

    out.mkdir(parents=True, exist_ok=True)
    paths = [write_run(v.live, out / "live"), write_run(v.sim, out / "sim")]
    if v.calibration is not None:
        paths += list(v.calibration.save(out / "profile.yaml"))
    title = f"Validation of {v.cfg.name}: policy {v.cfg.policy.kind}, profile {v.profile.name}"
    paths += save_figure(rv.cdf_figure(v.live, v.sim, title), out / "cdf")
    paths += save_figure(rv.step_error_figure(v.live.steps, title), out / "step_error")
    body = {"workload": v.cfg.name, "policy": dataclasses.asdict(v.cfg.policy), "profile": v.profile.name,
            "calibrated_here": v.calibration is not None, "notes": v.notes,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "targets_pct": dict(zip(verdict["target"], verdict["limit_pct"])),
            "passed": bool(verdict["met"].all()),
            "verdict": verdict.replace({np.nan: None}).to_dict("records"), **v.comparison}
    write_json(out / "report.json", body)
    paths.append(out / "report.json")
    paths += write_document(rv.live_report(body, title, out), out)
    return paths
