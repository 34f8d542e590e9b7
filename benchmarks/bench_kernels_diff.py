"""Kernel profiles against the wheel's own step estimator on every (GPU, engine) it measures:

    python benchmarks/bench_kernels_diff.py [--shapes 200]

For each pair: the tables built (seconds, into a temporary cache), then ``--shapes`` random
step shapes priced by the profile and by ``aiconfigurator_core`` (``sim.cost.kernel_check``):
the mean |error|, the share within 3%, the worst error, and the worst once the explained
differences are taken out (LM head rows, the context-0 floor, the monotone repair, one
launch per step's prompts). The test suite runs the same check (tests/cost/test_kernels.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "cost"))

from sim.cost import aic, kernels  # noqa: E402
from sim.cost.kernel_check import check, summary  # noqa: E402
from test_kernels import MODELS, NO_HOST, PAIRS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=200)
    args = ap.parse_args()
    print(f"{'gpu':<13} {'engine':<7} {'version':<10} {'model':<14} {'build s':>7} {'mean|err|':>9} {'<=3%':>5} "
          f"{'worst':>6} {'residual':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        worst_residual = 0.0
        for gpu, engine in PAIRS:
            model, tp = MODELS.get((gpu, engine), ("qwen3-8b", 1))
            spec = kernels.KernelSpec(model=model, gpu=gpu, engine=engine, tensor_parallel=tp)
            t0 = time.perf_counter()
            profile = kernels.kernel_profile(spec, NO_HOST, Path(tmp))
            build_s = time.perf_counter() - t0
            version = profile.provenance["engine_version"]
            tables = aic.KernelTables(kernels.resolve_model(model, Path(tmp)).wheel_path, aic.system_of(gpu), engine,
                                      version, tp)
            s = summary(check(profile, tables, count=args.shapes, seed=7))["all"]
            worst_residual = max(worst_residual, s["max_residual_pct"])
            print(f"{gpu:<13} {engine:<7} {version:<10} {model + (f' tp{tp}' if tp > 1 else ''):<14} {build_s:>7.1f} "
                  f"{s['mean_abs_pct']:>8.2f}% {100 * s['within_tolerance']:>4.0f}% {s['max_abs_pct']:>5.1f}% "
                  f"{s['max_residual_pct']:>7.2f}%")
        print(f"{len(PAIRS)} pairs x {args.shapes} shapes; worst residual {worst_residual:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
