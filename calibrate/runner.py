"""Calibration: time the live engine over batch shapes, fit a Profile, check it.

Design. ``LiveEngine.step`` is timed (``calibrate.timing``: synchronized,
warm-up kept apart) on five kinds of batch shape (``calibrate.grid``):

- ``empty``: no items; pins ``overhead_s`` (the cost of a step with no work);
- ``decode``: n decodes with total context N (spread evenly around N / n);
- ``prefill``: one chunk of c tokens after k context tokens;
- ``multi_prefill``: m equal chunks at context 0 (tells the per-chunk
  attention cost apart from the token-parallel cost they share);
- ``mixed``: a prefill chunk plus decodes, as chunked-prefill schedulers run.

The Profile's step time is linear in its curves' grid values, so all shapes
are fitted *jointly* (``calibrate.fit``: non-negative least squares on
relative error, Huber re-weighting, light curvature smoothing for nodes no
shape reaches). No term is obtained by subtracting another measured term,
so a noisy point does not propagate into every curve. Core nodes are timed
first, finer ones as the budget allows: a pilot of five shapes gives a
per-step cost estimate and the grid is thinned to fit ``budget_s``.

Every shape is timed in passes spread over the run (fresh random order per
pass, one warm-up then one timed call); the median over its timed calls is
fitted (``Measurement.median_s``), since a live step takes the typical time,
not the best one. Min and p90 are kept in the raw CSV too. On a shared machine, use one thread and a quiet moment:
load from other processes only adds time.

Self-check: random held-out batches (0-3 prefill chunks at random contexts
plus decodes with random contexts), timed in the same passes but never
fitted, are compared with ``profile.step_time_s``; MAPE, p90 and max |error|
go to ``profile.fit_error`` and a short table is printed.

Memory facts: CUDA uses the device's total memory and the measured peak
activations. On CPU "device memory" is weights + the engine's KV pool, so
``kv_capacity_tokens(1.0)`` equals the calibration pool (num_blocks x
block_size); pass ``memory_bytes`` to model another machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from tqdm import tqdm

from calibrate import schema
from calibrate.engine import LiveEngine
from calibrate.fit import fit_curves
from calibrate.grid import GridSpec, cost_estimator, fit_shapes, plan_pass, random_shape
from calibrate.model import get_model_shape
from calibrate.schema import Measurement, Shape
from calibrate.timing import Timing, quantile, set_cpu_threads, time_callable
from sim.core.batch import Batch, BatchItem
from sim.cost.curves import Curve1D, Curve2D
from sim.core.kv import BlockManager
from sim.cost.profile import ModelShape, Profile
from sim.base.provenance import git_revision, utc_now_iso
from sim.core.request import Request

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# One warm-up and one timed call per shape per pass, shapes shuffled: each
# timed call follows its own warm-up but a different shape before that, as a
# live step follows other work. Measured on validate_tiny (CPU, 1 thread):
# 1 warm-up + 5 back-to-back repeats made live ITL 17% slower than predicted;
# no warm-up at all made it 34% faster; this scheme: within 7%.
NUM_WARMUP, NUM_REPEATS, MIN_REPEATS = 1, 1, 1      # per pass
NUM_PASSES, MAX_PASSES = 4, 12                     # planned; more run while time is left
FIT_SHARE, HOLDOUT_SHARE = 0.66, 0.22              # of budget_s; the rest: pilot and slack


@dataclass
class CalibrationResult:
    """The fitted profile, every timed shape (fit and holdout), and the run's metadata."""

    profile: Profile
    measurements: list[Measurement]
    metadata: dict[str, Any]

    def save(self, out: str | Path) -> tuple[Path, Path]:
        """Write the profile (YAML/JSON by suffix) and the raw CSV beside it."""
        out = Path(out)
        csv_path = out.with_suffix(".csv")
        schema.write_raw_csv(csv_path, self.metadata, self.measurements)
        self.profile.provenance["raw_csv"] = csv_path.name
        self.profile.provenance["raw_csv_sha256"] = schema.sha256_file(csv_path)
        self.profile.save(out)
        return out, csv_path


class _Bench:
    """The engine plus a block pool: turns a Shape into timed real steps."""

    def __init__(self, engine: LiveEngine, num_blocks: int, block_size: int) -> None:
        self.engine = engine
        self.kv = BlockManager(num_blocks, block_size)
        self.next_req_id = 0

    def time(self, shape: Shape, num_warmup: int, num_repeats: int) -> Timing:
        reqs: dict[int, Request] = {}
        items = []
        # Decodes first, then chunks; each item samples (its chunk ends the prompt).
        for new, ctx in [(1, k) for k in shape.decode_contexts] + [(c, k) for c, k in shape.prefills]:
            req = Request(self.next_req_id, 0.0, ctx + new, 1)
            self.next_req_id += 1
            self.kv.allocate(req, ctx + new)
            reqs[req.req_id] = req
            items.append(BatchItem(req.req_id, new, ctx))
        batch = Batch(tuple(items))
        eng = self.engine
        try:
            return time_callable(lambda: eng.step(batch, reqs), eng.synchronize, num_warmup=num_warmup,
                                 num_repeats=num_repeats, cuda_device=eng.device)
        finally:
            for req in reqs.values():
                self.kv.free(req)
                eng.forget(req.req_id)


def _summarize(kind: str, shape: Shape, passes: list[Timing]) -> Measurement:
    host = [x for t in passes for x in t.host_s]
    dev = [x for t in passes for x in t.device_s or ()]
    return Measurement(kind, "holdout" if kind == "holdout" else "fit", shape,
                       sum(len(t.warmup_host_s) for t in passes), len(host), min(host),
                       quantile(host, 0.5), quantile(host, 0.9), min(dev) if dev else None,
                       quantile(dev, 0.5) if dev else None)


def _run_passes(bench: _Bench, plan: list[tuple[str, Shape]], reps: int,
                soft_end_s: float, hard_end_s: float, rng: np.random.Generator, bar: tqdm
                ) -> list[Measurement]:
    """Time every planned shape once per pass, in a fresh random order each pass.

    Pass 1 stops at hard_end_s, but still times the empty step and 8 shapes of
    each split (fit, holdout); later passes, up to MAX_PASSES, stop at soft_end_s."""
    passes: list[list[Timing]] = [[] for _ in plan]
    for p in range(MAX_PASSES):
        if p >= NUM_PASSES:                        # an extra pass: extend the progress bar
            bar.total = (p + 1) * len(plan)
            bar.refresh()
        num_done = {"fit": 0, "holdout": 0}
        for i in rng.permutation(len(plan)):
            split = "holdout" if plan[i][0] == "holdout" else "fit"
            late = time.perf_counter() > (hard_end_s if p == 0 else soft_end_s)
            if late and (p > 0 or num_done[split] >= 8) and plan[i][0] != "empty":
                continue
            num_done[split] += 1
            passes[i].append(bench.time(plan[i][1], NUM_WARMUP, reps))
            bar.update()
        if time.perf_counter() > soft_end_s:
            break
    return [_summarize(kind, s, t) for (kind, s), t in zip(plan, passes) if t]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else schema.cpu_name()


def calibrate(model: str | Mapping[str, Any] | ModelShape, device: str = "cpu", dtype: str | None = None,
              budget_s: float = 120, out: str | Path | None = None, progress: bool = True,
              seed: int = 0, *, grid: GridSpec | None = None, num_threads: int | None = None,
              memory_bytes: int | None = None) -> CalibrationResult:
    """Measure, fit and self-check a Profile of ``model`` on ``device`` in about budget_s.

    model: anything ``calibrate.model.get_model_shape`` takes (a preset name,
    a ModelShape, a dict). dtype: float32 | bfloat16 | float16 (default: bfloat16 on CUDA, float32 on
    CPU). out: if given, the profile is written there and the raw CSV beside
    it (same stem, .csv). num_threads: torch CPU threads (default: torch's
    current count, then held fixed). Raises ValueError for a bad model, device,
    dtype or budget.
    """
    start = time.perf_counter()
    cfg = get_model_shape(model)
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = torch.device("meta")                 # rejected just below
    on_cuda = dev.type == "cuda"
    if dev.type not in ("cpu", "cuda") or (on_cuda and not torch.cuda.is_available()):
        raise ValueError(f"device must be 'cpu' or an available 'cuda[:i]', got {device!r}")
    dtype = dtype or ("bfloat16" if on_cuda else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    threads = set_cpu_threads(num_threads)
    dtype_bytes = torch.empty((), dtype=DTYPES[dtype]).element_size()
    kv_per_token = cfg.kv_bytes_per_token(dtype_bytes)
    spec = grid or GridSpec.default(cfg.max_position_embeddings, kv_per_token,
                                    torch.cuda.mem_get_info(dev)[0] if on_cuda else None)
    cgrid = spec.curve_grid()
    rng = np.random.default_rng(seed)
    candidates = fit_shapes(spec, rng)
    holdout_pool = [random_shape(spec, rng) for _ in range(48)]
    pilot = spec.pilot_shapes()
    num_blocks = 1 + max(-(-s.num_kv_tokens // spec.block_size) + len(s.prefills) + s.num_decodes
                         for s in [c[2] for c in candidates] + holdout_pool + pilot)
    engine = LiveEngine(cfg, num_blocks, spec.block_size, dev, DTYPES[dtype], seed,
                        None if on_cuda else threads)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    bench = _Bench(engine, num_blocks, spec.block_size)

    # Pilot: one warm-up + one timed call of a few shapes -> per-step cost estimate.
    est_s = cost_estimator(pilot, [bench.time(s, 1, 1).min_s for s in pilot])
    order = rng.permutation(len(candidates))
    reps_options = ((NUM_WARMUP, NUM_REPEATS), (NUM_WARMUP, MIN_REPEATS))
    fit_plan, fit_reps = plan_pass([candidates[i] for i in order], est_s,
                                   FIT_SHARE * budget_s / NUM_PASSES, reps_options)
    hold_plan, _ = plan_pass([(0, "holdout", s) for s in holdout_pool], est_s,
                             HOLDOUT_SHARE * budget_s / NUM_PASSES, ((NUM_WARMUP, fit_reps),))
    # Held-out shapes are timed in the same passes as the fit shapes (never fitted),
    # so both see the same machine conditions.
    plan = fit_plan + (hold_plan[:40] if len(hold_plan) >= 8 else
                       [("holdout", s) for s in sorted(holdout_pool, key=est_s)[:8]])
    bar = tqdm(total=NUM_PASSES * len(plan), file=sys.stderr, disable=not progress,
               desc=f"calibrate {cfg.name}", unit="step")
    end_s = start + (FIT_SHARE + HOLDOUT_SHARE) * budget_s
    measured = _run_passes(bench, plan, fit_reps, end_s, start + 0.95 * budget_s, rng, bar)
    bar.close()
    fit_set = [m for m in measured if m.split == "fit"]
    fitted = fit_curves([m.shape for m in fit_set], [m.median_s for m in fit_set], cgrid)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    activation_b = (torch.cuda.max_memory_allocated(dev) - weight_bytes - engine.kv_cache_bytes
                    if on_cuda else 0)
    mem_b = memory_bytes or (torch.cuda.get_device_properties(dev).total_memory if on_cuda
                             else weight_bytes + engine.kv_cache_bytes)
    metadata = {
        "source": "batchsim-calibrate", "format_version": schema.FORMAT_VERSION,
        "device_name": _device_name(dev), "device": str(dev), "platform": platform.platform(),
        "torch_version": str(torch.__version__), "cuda_version": torch.version.cuda,
        "dtype": dtype, "model": dataclasses.asdict(cfg), "num_threads": threads,
        "date_utc": utc_now_iso(), "git_revision": git_revision(),
        "num_warmup_per_pass": NUM_WARMUP, "num_repeats_per_pass": fit_reps, "num_passes": f"{NUM_PASSES}-{MAX_PASSES}",
        "statistic": "median_s: median of all timed calls (host seconds)", "budget_s": budget_s,
        "seed": seed, "grid": dataclasses.asdict(spec), "num_blocks": num_blocks,
        "memory_note": "cuda: device total memory; cpu: weights + KV pool, so capacity == pool",
    }
    profile = Profile(
        name=f"{cfg.name}-{dev.type}-{dtype}",
        model=cfg,
        device=metadata["device_name"], dtype=dtype, tensor_parallel=1, memory_bytes_per_gpu=int(mem_b),
        weight_bytes=weight_bytes, activation_bytes_per_gpu=max(0, int(activation_b)),
        kv_bytes_per_token=kv_per_token, overhead_s=fitted.overhead_s,
        linear=Curve1D(list(cgrid.token_nodes), fitted.linear_s, name="curves.linear"),
        attn_prefill=Curve2D(list(cgrid.chunk_nodes), list(cgrid.chunk_context_nodes),
                             fitted.attn_prefill_s, name="curves.attn_prefill"),
        attn_decode=Curve2D(list(cgrid.seq_nodes), list(cgrid.decode_context_nodes),
                            fitted.attn_decode_s, name="curves.attn_decode"),
        provenance=dict(metadata))
    profile.fit_error = {f"fit_{k}": v for k, v in schema.errors_pct(fit_set, profile).items()}
    profile.fit_error["fit_num_downweighted"] = fitted.num_downweighted

    hold_set = [dataclasses.replace(m, predicted_s=profile.step_time_s(m.shape.to_batch()))
                for m in measured if m.split == "holdout"]
    profile.fit_error.update({f"holdout_{k}": v for k, v in schema.errors_pct(hold_set, profile).items()})
    profile.fit_error["elapsed_s"] = round(time.perf_counter() - start, 2)
    profile.reset_counters()
    result = CalibrationResult(profile, fit_set + hold_set, metadata)
    if progress:
        print(schema.holdout_table(result.measurements, profile.fit_error), file=sys.stderr)
    if out is not None:
        result.save(out)
    return result


# A self-check this far off means the fit did not hold (too few shapes, or a machine too noisy to
# time): said loudly (the profile is still written, with its errors in fit_error).
UNTRUSTED_MAPE_PCT = 25.0


def default_out_path(model: str, device_name: str, dtype: str) -> Path:
    """calibrate/profiles/<device>/<model>/<dtype>.yaml (Vidur's layout, explicit)."""
    tag = "".join(ch if ch.isalnum() else "-" for ch in device_name.lower()).strip("-")
    return Path(__file__).resolve().parent / "profiles" / tag / model / f"{dtype}.yaml"


def main(args: argparse.Namespace) -> int:
    """``sim calibrate`` on the torch engine, with the arguments ``sim.cli``
    parsed (the one parser): run, write; errors are one line and exit code 2."""
    try:
        result = calibrate(args.model, args.device, args.dtype, args.budget_s, None,
                           not args.quiet, args.seed, num_threads=args.threads)
        meta = result.metadata
        out = Path(args.out) if args.out else default_out_path(
            args.model, meta["device_name"] if meta["device"].startswith("cuda") else "cpu", meta["dtype"])
        result.save(out)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"sim calibrate: error: {exc}", file=sys.stderr)
        return 2
    fe = result.profile.fit_error
    print(f"wrote {out} and {out.with_suffix('.csv')} (holdout MAPE {fe['holdout_mape_pct']:.1f}%)")
    if fe["holdout_mape_pct"] > UNTRUSTED_MAPE_PCT:
        print(f"warning: the profile misses its own held-out batches by {fe['holdout_mape_pct']:.0f}% on average "
              f"(p90 {fe['holdout_p90_abs_pct']:.0f}%, {fe['holdout_num_points']} batches; fitted on "
              f"{fe['fit_num_points']}): do not trust its predictions; calibrate again with a longer --budget-s on "
              f"a quieter machine", file=sys.stderr)
    return 0

