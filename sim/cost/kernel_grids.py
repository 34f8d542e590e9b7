"""The grids of a kernel profile (``sim.cost.kernels``): each op family asked of the wheel's
tables (``sim.cost.aic.KernelTables``) on whole-number grid points that hold the tables'
own measured points, refined until piecewise-linear interpolation stays within
``GRID_TOLERANCE`` of the wheel at probe points, then repaired to be monotone (a step
with more work never costs less), with what the repair moved and where the tables
measured reported beside the curves.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

from sim.cost import aic
from sim.cost.curves import isotonic, isotonic_grid, repairs_of

GRID_TOLERANCE = 0.01              # relative interpolation error allowed at the probes
MAX_AXIS_POINTS = 96               # a grid axis stops growing here (the worst error left is reported)
MIN_SPLIT_REL = 0.02               # nor is an interval split once it is narrower than 2% of its start
_PROBES = (0.25, 0.5, 0.75)
DECODE_ROUNDS = 3                  # the decode table's refining rounds (its answers cost ~100 us each)
_MAX_ROUNDS = 10
MS = 1e-3


# ---- grids ---------------------------------------------------------------------------
def _ints_between(a: int, b: int) -> int | None:
    """A whole number strictly inside (a, b), near the geometric middle; None if none
    (or if the interval is already narrower than ``MIN_SPLIT_REL`` of its start)."""
    if b - a < 2 or (a > 0 and b - a < MIN_SPLIT_REL * a):
        return None
    mid = int(round(math.sqrt(a * b))) if a > 0 else (a + b) // 2
    return min(max(mid, a + 1), b - 1)


def _probes(a: int, b: int) -> list[int]:
    return sorted({int(round(a + (b - a) * u)) for u in _PROBES} - {a, b})


def _rel(approx: float, exact: float) -> float:
    return abs(approx - exact) / max(abs(exact), 1e-12)


def refine_1d(f: Callable[[int], float], xs: list[int], tol: float = GRID_TOLERANCE) -> tuple[list[int], float]:
    """Whole-number grid points, split until linear interpolation of f is within ``tol``
    (relative) at the probes of every interval; the worst error left."""
    xs = sorted(set(xs))
    worst = 0.0
    for _ in range(_MAX_ROUNDS):
        worst, new = 0.0, []
        for a, b in zip(xs, xs[1:]):
            fa, fb = f(a), f(b)
            err = max((_rel(fa + (fb - fa) * (p - a) / (b - a), f(p)) for p in _probes(a, b)), default=0.0)
            worst = max(worst, err)
            if err > tol and (m := _ints_between(a, b)) is not None:
                new.append(m)
        if not new or len(xs) >= MAX_AXIS_POINTS:
            break
        xs = sorted(set(xs) | set(new))
    return xs, worst


def refine_2d(f: Callable[[int, int], float], xs: list[int], ys: list[int], tol: float = GRID_TOLERANCE,
              max_points: int = MAX_AXIS_POINTS, max_rounds: int = _MAX_ROUNDS) -> tuple[list[int], list[int], float]:
    """``refine_1d`` for a tensor grid: a cell whose bilinear interpolation misses f by
    more than ``tol`` at a probe splits the axis along which 1-D interpolation misses more.
    A cell is checked once (its error is kept while its four corners stay grid points)."""
    xs, ys = sorted(set(xs)), sorted(set(ys))
    checked: dict[tuple[int, int, int, int], float] = {}

    def cell_error(x0: int, x1: int, y0: int, y1: int) -> tuple[float, float, float]:
        z00, z01, z10, z11 = f(x0, y0), f(x0, y1), f(x1, y0), f(x1, y1)
        err = err_x = err_y = 0.0
        for px in _probes(x0, x1) or [x0]:
            tx = (px - x0) / (x1 - x0)
            for py in _probes(y0, y1) or [y0]:
                ty = (py - y0) / (y1 - y0)
                exact = f(px, py)
                bil = (z00 * (1 - tx) + z10 * tx) * (1 - ty) + (z01 * (1 - tx) + z11 * tx) * ty
                err = max(err, _rel(bil, exact))
                err_x = max(err_x, _rel(f(x0, py) * (1 - tx) + f(x1, py) * tx, exact))
                err_y = max(err_y, _rel(f(px, y0) * (1 - ty) + f(px, y1) * ty, exact))
        return err, err_x, err_y

    worst = 0.0
    for round_ in range(max_rounds):
        worst, add_x, add_y = 0.0, set(), set()
        for x0, x1 in zip(xs, xs[1:]):
            for y0, y1 in zip(ys, ys[1:]):
                key = (x0, x1, y0, y1)
                if key not in checked:
                    err, err_x, err_y = cell_error(*key)
                    checked[key] = err
                    if err > tol:
                        if err_x >= 0.5 * err_y and (m := _ints_between(x0, x1)) is not None:
                            add_x.add(m)
                        if err_y >= 0.5 * err_x and (m := _ints_between(y0, y1)) is not None:
                            add_y.add(m)
                worst = max(worst, checked[key])
        if len(xs) >= max_points or round_ == max_rounds - 1:
            add_x = set()
        if len(ys) >= max_points or round_ == max_rounds - 1:
            add_y = set()
        if not add_x and not add_y:
            break
        xs, ys = sorted(set(xs) | add_x), sorted(set(ys) | add_y)
    return xs, ys, worst


def _feasible_prefill(f: Callable[[int, int], float], max_context: int) -> Callable[[int, int], float]:
    """f(chunk, context) where chunk + context fits the model's context; past it (no request
    gets there, but a rectangular grid has corners there) the value at the edge, scaled by
    the (query, key) pairs: monotone, and never the tables' far extrapolation."""
    def g(c: int, p: int) -> float:
        edge = max(0, max_context - c)
        if p <= edge:
            return f(c, p)
        return f(c, edge) * (p + (c + 1) / 2) / (edge + (c + 1) / 2)
    return g


def _axis(measured: list[int], lo: int, hi: int) -> list[int]:
    """A grid axis on [lo, hi]: the measured points inside, the powers of two and their
    1.5x (the tables' usual spacing), lo and hi."""
    fill = {v for k in range(64) for v in (2**k, 3 * 2**k) if lo < v < hi}
    return sorted({lo, hi} | fill | {int(m) for m in measured if lo < m < hi})


def _memo(f: Callable[..., float]) -> Callable[..., float]:
    cache: dict[tuple, float] = {}

    def g(*args: int) -> float:
        hit = cache.get(args)
        if hit is None:
            hit = cache[args] = f(*args)
        return hit
    return g


def _powers(lo: int, hi: int) -> list[int]:
    """lo, the powers of two between, hi."""
    out = [lo] + [2**k for k in range(1, 64) if lo < 2**k < hi] + [hi]
    return sorted(set(out))


# ---- the tables ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GridBounds:
    """How far each curve's grid reaches (the measured ranges are usually narrower)."""

    max_tokens: int          # a step's tokens (linear)
    max_seqs: int            # sequences in a step (lm_head, attn_decode)
    max_context: int         # a request's context (attn_prefill's axes, attn_decode's mean context)


def tabulate(tables: aic.KernelTables, bounds: GridBounds) -> dict[str, Any]:
    """The kernel curves (seconds, monotone) of ``tables`` on grids that hold the tables'
    measured points and are refined within ``bounds``, with where each was measured, the
    repairs monotonicity needed and the worst interpolation error left at the probes."""
    axes = tables.measured_axes()
    token_axis = _axis(axes.get("tokens", []), 1, bounds.max_tokens)
    seq_axis = _axis(axes.get("decode_seqs", []), 1, bounds.max_seqs)
    row_axis = _axis(axes.get("tokens", []), 1, bounds.max_seqs)
    length_axis = _axis(axes.get("prefill_len", []), 1, bounds.max_context)
    with aic.quiet():
        linear = _memo(lambda t: tables.linear_ms(t) * MS)
        lm_head = _memo(lambda n: tables.lm_head_ms(n) * MS)
        prefill = _memo(_feasible_prefill(lambda c, p: tables.prefill_attention_ms(c, p) * MS, bounds.max_context))
        # Decodes by their mean context c (the tables' KV length is c + 1, the new token's own
        # key included), on the tables' measured batches and lengths and refined a few rounds
        # (where the wheel's lanes interpolate on other points than the table's).
        decode = _memo(lambda n, c: tables.decode_attention_ms(n, c + 1) * MS)
        lin_x, lin_err = refine_1d(linear, token_axis)
        moe = moe_x = None
        if tables.splits_moe:                  # data-parallel MoE ranks: the experts on their own curve
            moe = _memo(lambda t: tables.moe_ms(t) * MS)
            moe_x, moe_err = refine_1d(moe, token_axis)
        lm_x, lm_err = refine_1d(lm_head, row_axis)
        pre_c, pre_p, pre_err = refine_2d(prefill, length_axis, [0] + length_axis)
        mean_axis = [0] + _axis([kv - 1 for kv in axes.get("decode_len", []) if kv > 1], 1, bounds.max_context)
        dec_n, dec_p, dec_err = refine_2d(decode, seq_axis, mean_axis, max_rounds=DECODE_ROUNDS)
        # One launch over the step's chunks: b chunks of 16 tokens cost little more than one,
        # so what one chunk alone pays beyond its share is the launch (measured at b = 8).
        one, eight = tables.prefill_attention_ms(16, 0) * MS, tables.prefill_attention_ms(16, 0, batch=8) * MS
        shared_s = min(one, max(0.0, (8 * one - eight) / 7))
        # A chunk over more context is never cheaper than over none: the tables measure
        # whole prompts (context 0) and the wheel derives a chunk over context from them, so
        # where the derived value falls below the measured one it is raised to it (a running
        # maximum along the context axis, before the two-axis repair).
        values = {"linear": [linear(t) for t in lin_x], "lm_head": [lm_head(n) for n in lm_x],
                  "attn_prefill": [list(itertools.accumulate((prefill(c, p) for p in pre_p), max)) for c in pre_c],
                  "attn_decode": [[decode(n, p) for p in dec_p] for n in dec_n]}
        if moe is not None:
            values["moe"] = [moe(t) for t in moe_x]
    repaired = {}
    for name in ("linear", "lm_head", *(("moe",) if moe is not None else ())):
        fixed = isotonic(values[name])
        repaired[name] = _repair_note(repairs_of([values[name]], [fixed]), len(fixed))
        values[name] = fixed
    for name in ("attn_prefill", "attn_decode"):
        fixed = isotonic_grid(values[name])
        repaired[name] = _repair_note(repairs_of(values[name], fixed), sum(len(r) for r in fixed))
        values[name] = fixed
    limits = {axis: float(max(v)) for axis, v in axes.items() if v}
    return {"grids": {"linear": lin_x, "lm_head": lm_x, "attn_prefill": (pre_c, pre_p), "attn_decode": (dec_n, dec_p),
                      **({"moe": moe_x} if moe is not None else {})},
            "values": values, "prefill_shared_s": shared_s, "limits": limits, "repairs": repaired,
            "max_rel_error_at_probes": {"linear": lin_err, "lm_head": lm_err, "attn_prefill": pre_err,
                                        "attn_decode": dec_err, **({"moe": moe_err} if moe is not None else {})}}


def _repair_note(repairs: list, num_values: int) -> dict[str, Any]:
    """How many table values the monotone repair moved by more than 5%, and the largest move."""
    top = repairs[0] if repairs else None
    return {"moved_over_5pct": len(repairs), "of": num_values,
            "largest_pct": round(100 * (top.after - top.before) / max(abs(top.before), 1e-300), 1) if top else 0.0}


