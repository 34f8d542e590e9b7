"""``sim calibrate --kernels aiconfigurator``: a kernel profile written to a file, with its
provenance (the wheel, the system, each table's engine and version, the share of the
curves' points the tables measured and the share extrapolated beyond them), the
differential check against the wheel's own step estimate (``sim.cost.kernel_check``),
and a figure of its step costs beside the analytic roofline. Needs the kernels extra,
not torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.cost import aic
from sim.cost.kernel_check import check, summary
from sim.cost.kernels import (HostTerms, KernelSpec, KernelsError, cache_dir, host_terms, kernel_profile,
                              resolve_model, with_host)
from sim.cost.profile import Profile
from sim.run.config import ConfigError


def measured_share(profile: Profile) -> dict[str, Any]:
    """Per curve, the share of its grid points inside the range the tables measured (the rest
    are the wheel's extrapolation beyond its tables)."""
    out = {}
    for name in ("linear", "lm_head"):
        c = getattr(profile, name)
        inside = sum(x <= (c.measured_max or float("inf")) for x in c.xs)
        out[name] = {"points": len(c.xs), "measured_share": round(inside / len(c.xs), 3)}
    for name in ("attn_prefill", "attn_decode"):
        c = getattr(profile, name)
        m = c.measured
        inside = sum(m is None or m.holds(x, y) for x in c.xs for y in c.ys)
        out[name] = {"points": len(c.xs) * len(c.ys), "measured_share": round(inside / (len(c.xs) * len(c.ys)), 3)}
    return out


def main(args: argparse.Namespace) -> int:
    if args.kernels.lower() != "aiconfigurator":
        raise ConfigError(f"--kernels must be aiconfigurator, got {args.kernels!r}")
    if args.gpu is None or args.model in (None, "tiny-llama"):
        raise ConfigError("--kernels aiconfigurator needs --gpu (e.g. h100-sxm) and --model (a preset such as "
                          "qwen3-32b, a Hugging Face id the wheel bundles, or a config.json)")
    model: Any = args.model
    if model.endswith(".json"):
        import json
        path = Path(model)
        if not path.is_file():
            raise ConfigError(f"--model: config file {path} not found")
        model = {"name": path.parent.name if path.name == "config.json" else path.stem, **json.loads(path.read_text())}
    engine = {"tensorrt_llm": "trtllm", "tensorrt-llm": "trtllm"}.get(args.engine, args.engine)
    spec = KernelSpec(model=model, gpu=args.gpu, engine=engine, tensor_parallel=args.tensor_parallel,
                      dtype={"bfloat16": "bf16", "float16": "fp16"}.get(args.dtype or "bf16", args.dtype or "bf16"),
                      weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
                      expert_parallel=args.enable_expert_parallel, engine_version=args.engine_version)
    try:
        host = host_terms(engine, "vllm-v1-async" if args.async_scheduling else "vllm-v1")
        bare = kernel_profile(spec, HostTerms("none", 0.0, 0.0, 0.0, 0.0, "kernels only"))
        profile = with_host(bare, host)
        system = aic.system_of(args.gpu)
        model_path = resolve_model(spec.model, cache_dir()).wheel_path
        tables = aic.KernelTables(model_path, system, engine, profile.provenance["engine_version"],
                                  args.tensor_parallel, expert_parallel=args.enable_expert_parallel)
        checked = summary(check(bare, tables, count=200, seed=args.seed))
    except (KernelsError, ValueError) as exc:
        raise ConfigError(f"--kernels aiconfigurator: {exc}") from None
    profile.provenance["measured_share"] = measured_share(profile)
    profile.fit_error["differential_check"] = {"against": "the wheel's own step estimate (sim.cost.kernel_check)",
                                               **checked}
    out = Path(args.out)
    profile.save(out)
    from reports.presentation.kernelplots import step_cost_figure
    from reports.presentation.plots import save_figure
    from sim.cost.roofline import preset_profile
    try:
        analytic = preset_profile(model, args.gpu, args.tensor_parallel, spec.dtype,
                                  engine="vllm-v1", weight_dtype=args.weight_dtype,
                                  kv_cache_dtype=args.kv_cache_dtype, expert_parallel=args.enable_expert_parallel)
    except ValueError:
        analytic = None          # a GPU or model the roofline has no preset of: the kernels alone
    figures = save_figure(step_cost_figure(profile, analytic), out.with_suffix(""))
    a = checked["all"]
    if not args.quiet:
        print(f"wrote {out}: {profile.name} ({profile.provenance['label']})")
        print(f"  check against the wheel's own step estimate: {a['n']} shapes, mean |error| {a['mean_abs_pct']}%, "
              f"{100 * a['within_tolerance']:.0f}% within 3%, worst after the explained differences "
              f"{a['max_residual_pct']}%")
        shares = ", ".join(f"{k} {100 * v['measured_share']:.0f}%" for k, v in profile.provenance['measured_share'].items())
        print(f"  grid points inside the measured tables: {shares}")
        print(f"  figure {', '.join(str(f) for f in figures)}")
    return 0
