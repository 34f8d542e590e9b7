"""Piecewise-linear curves on a grid: fast scalar evaluation, linear
extrapolation past the measured range (with a count of how often it happened),
and monotone by construction: values that violate "a cost never falls when the
work grows" are repaired locally, by the smallest change (``isotonic_grid``),
and a repair that moves any value by more than ``REPAIR_REPORT_REL`` is
reported (a ``CurveRepairWarning`` and the curve's ``repairs``).

A curve may also know where its values were *measured* (``Curve1D.measured_max``,
``Curve2D.measured``: a kernel table's range, narrower than the grid that was
tabulated from the table's own extrapolation): a lookup past that counts as
out of range too, although the grid holds a value there.

Evaluated once or a few times per simulated step, so these use ``bisect`` on
plain lists rather than numpy (a scalar ``np.interp`` costs ~2 us; this ~0.3 us).
The repair runs once, when a curve is built; lookups never pay for it.
"""

from __future__ import annotations

import math
import warnings
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

REPAIR_REPORT_REL = 0.05          # report a repair that moves a value by more than 5%


class CurveRepairWarning(UserWarning):
    """A curve's values were not monotone and the repair moved one by more than REPAIR_REPORT_REL."""


@dataclass(frozen=True, slots=True)
class Repair:
    """One grid value the monotone repair moved: ``index`` is (i,) or (i, j)."""

    index: tuple[int, ...]
    before: float
    after: float

    @property
    def rel_change(self) -> float:
        return abs(self.after - self.before) / max(abs(self.before), 1e-300)


class MeasuredRange(NamedTuple):
    """Where a 2-D curve's values are measured: x <= x_max and y <= y_max + y_per_x * x.

    A box is y_per_x 0; a table measured up to a total length (a prefill chunk of x tokens
    over y earlier ones, measured while x + y <= L) is (x_max, L, -1); one measured per
    sequence (x decodes over y context tokens in all, each measured up to L) is (x_max, 0, L)."""

    x_max: float
    y_max: float = math.inf
    y_per_x: float = 0.0

    def y_limit(self, x: float) -> float:
        return self.y_max + self.y_per_x * x

    def holds(self, x: float, y: float) -> bool:
        return x <= self.x_max and y <= self.y_max + self.y_per_x * x

    def to_dict(self) -> dict:
        return {"x_max": self.x_max, "y_max": None if math.isinf(self.y_max) else self.y_max,
                "y_per_x": self.y_per_x}


def _check_axis(name: str, xs: Sequence[float]) -> list[float]:
    out = [float(x) for x in xs]
    if len(out) < 2:
        raise ValueError(f"{name}: needs at least 2 grid points, got {len(out)}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{name}: grid points must be strictly increasing, got {out}")
    return out


def _is_sorted(ys: Sequence[float]) -> bool:
    return all(a <= b for a, b in zip(ys, ys[1:]))


def isotonic(ys: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to ``ys``: ``isotonic_grid`` of one row."""
    return isotonic_grid([ys], None if weights is None else [weights])[0]


def _running_max(ys: Sequence[float]) -> list[float]:
    out: list[float] = []
    top = float("-inf")
    for y in ys:
        top = max(top, float(y))
        out.append(top)
    return out


def _grid_is_monotone(zs: list[list[float]]) -> bool:
    if not all(_is_sorted(row) for row in zs):
        return False
    return all(a <= b for r0, r1 in zip(zs, zs[1:]) for a, b in zip(r0, r1))


def isotonic_grid(zs: Sequence[Sequence[float]],
                  weights: Sequence[Sequence[float]] | None = None) -> list[list[float]]:
    """The table non-decreasing along both axes closest to ``zs`` (a table
    already monotone comes back unchanged, as the very same values).

    "Closest" is the smallest weighted sum of relative changes |log z' - log z|
    (absolute changes when a value is <= 0): L1, so a run out of order is
    fixed by moving the fewest values, and an isolated spike or dip is
    levelled with its neighbours instead of being carried through the rest of
    the table (a running maximum copies one spike into every later value).
    Among equally small changes, the values out of order with the most others
    in their row and column move first, then raising beats lowering. A value
    with a small weight (a filled, unmeasured cell) yields to measured ones.
    Solved exactly as a linear program; the solver's ~1e-9 tolerance is
    cleaned up by a running maximum along rows, then columns, which is also
    the fallback should the solver be unavailable or fail."""
    z = [[float(v) for v in row] for row in zs]
    if _grid_is_monotone(z):
        return z
    n, m = len(z), len(z[0])
    try:
        z = _lp_repair(z, weights)
    except (ImportError, ValueError, RuntimeError):
        pass
    z = [_running_max(row) for row in z]
    cols = [_running_max([z[i][j] for i in range(n)]) for j in range(m)]
    return [[cols[j][i] for j in range(m)] for i in range(n)]


def _lp_repair(z: list[list[float]], weights: Sequence[Sequence[float]] | None) -> list[list[float]]:
    import numpy as np                    # only when a table needs repair: not on the import path
    from scipy import sparse
    from scipy.optimize import linprog

    zv = np.asarray(z, dtype=float)
    n, m = zv.shape
    k = n * m
    w = np.ones(k) if weights is None else np.asarray(weights, dtype=float).ravel()
    # Tie-break: a value out of order with many others in its row and column is cheaper to move.
    out_of_order = np.zeros((n, m))
    for line in (zv, zv.T):
        later_smaller = np.triu(line[:, :, None] > line[:, None, :], 1)      # [row, a, b]: a < b, z_a > z_b
        counts = later_smaller.sum(axis=2) + later_smaller.sum(axis=1)
        out_of_order += counts if line is zv else counts.T
    w = w * (1.0 - 1e-3 * out_of_order.ravel() / max(1.0, out_of_order.max()))
    in_log = bool((zv > 0).all())
    scale = 1.0 if in_log else (float(np.abs(zv).max()) or 1.0)
    y = (np.log(zv) if in_log else zv / scale).ravel()
    idx = np.arange(k).reshape(n, m)
    a, b = (np.concatenate([idx[:, :-1].ravel(), idx[:-1, :].ravel()]),
            np.concatenate([idx[:, 1:].ravel(), idx[1:, :].ravel()]))     # y'_a <= y'_b
    # y' = y + up - down (up, down >= 0): up_a - down_a - up_b + down_b <= y_b - y_a.
    rows = np.arange(len(a))
    a_ub = sparse.csr_matrix((np.tile([1.0, -1.0, -1.0, 1.0], len(a)),
                              (np.repeat(rows, 4), np.stack([a, k + a, b, k + b], axis=1).ravel())),
                             shape=(len(a), 2 * k))
    cost = np.r_[w * (1 - 1e-6), w * (1 + 1e-6)]               # raising is a hair cheaper than lowering
    res = linprog(cost, A_ub=a_ub, b_ub=y[b] - y[a], bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(res.message)
    shift = res.x[:k] - res.x[k:]
    shift[np.abs(shift) <= 1e-9] = 0.0                        # untouched cells stay exact
    fitted = np.where(shift == 0.0, zv.ravel(), np.exp(y + shift) if in_log else (y + shift) * scale)
    # A repaired value usually lands on another one: snap off the round-off.
    values = np.unique(zv)
    if len(values) > 1:
        near = values[np.clip(np.searchsorted(values, fitted), 1, len(values) - 1) - np.array([[1], [0]])]
        best = near[np.argmin(np.abs(near - fitted), axis=0), np.arange(k)]
        fitted = np.where(np.abs(best - fitted) <= 1e-9 * np.abs(fitted), best, fitted)
    return fitted.reshape(n, m).tolist()


def repairs_of(before: Sequence[Sequence[float]], after: Sequence[Sequence[float]],
               min_rel: float = REPAIR_REPORT_REL) -> list[Repair]:
    """Cells (i, j) whose value moved by more than ``min_rel``, largest first."""
    out = [Repair((i, j), float(b), float(a))
           for i, (rb, ra) in enumerate(zip(before, after)) for j, (b, a) in enumerate(zip(rb, ra)) if a != b]
    out = [r for r in out if r.rel_change > min_rel]
    return sorted(out, key=lambda r: -r.rel_change)


def _warn_repairs(name: str, repairs: list[Repair], num_values: int, labels: Sequence[Sequence[float]]) -> None:
    if not repairs:
        return
    top = repairs[0]
    at = ", ".join(f"{axis[k]:g}" for axis, k in zip(labels, top.index))
    warnings.warn(
        f"{name}: values not monotone; the repair moved {len(repairs)} of {num_values} by more than "
        f"{100 * REPAIR_REPORT_REL:g}% (largest at ({at}): {top.before:.6g} -> {top.after:.6g}, "
        f"{100 * (top.after - top.before) / max(abs(top.before), 1e-300):+.1f}%)",
        CurveRepairWarning, stacklevel=4)


def _segment(xs: list[float], x: float) -> int:
    """Index i of the segment [xs[i], xs[i+1]] used for x (edge segments extrapolate)."""
    i = bisect_right(xs, x) - 1
    if i < 0:
        return 0
    if i > len(xs) - 2:
        return len(xs) - 2
    return i


@dataclass(slots=True)
class Curve1D:
    """y(x), piecewise linear on ``xs``; linear extrapolation outside, floored at 0.
    ``measured_max``: the largest x measured (None: the grid's end); a lookup past it counts
    as out of range."""

    xs: list[float]
    ys: list[float]
    name: str = "curve"
    num_out_of_range: int = field(default=0, compare=False)
    measured_max: float | None = None
    repairs: list[Repair] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.xs = _check_axis(f"{self.name}.x", self.xs)
        if len(self.ys) != len(self.xs):
            raise ValueError(f"{self.name}: {len(self.xs)} x values but {len(self.ys)} y values")
        before = [float(y) for y in self.ys]
        self.ys = isotonic(before)
        if self.ys != before:
            self.repairs = [Repair((r.index[1],), r.before, r.after) for r in repairs_of([before], [self.ys])]
            _warn_repairs(self.name, self.repairs, len(before), [self.xs])

    def __call__(self, x: float) -> float:
        xs = self.xs
        last = len(xs) - 2
        i = bisect_right(xs, x) - 1                  # _segment, inlined: the hot path
        if i < 0 or x > xs[-1] or (self.measured_max is not None and x > self.measured_max):
            self.num_out_of_range += 1
        if i < 0:
            i = 0
        elif i > last:
            i = last
        x0, x1 = xs[i], xs[i + 1]
        y0, y1 = self.ys[i], self.ys[i + 1]
        y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return y if y > 0.0 else 0.0

    def to_dict(self, x_name: str) -> dict:
        out = {x_name: list(self.xs), "seconds": list(self.ys)}
        if self.measured_max is not None:
            out["measured_max"] = self.measured_max
        return out


@dataclass(slots=True)
class Curve2D:
    """z(x, y), bilinear on the grid ``xs`` x ``ys``; ``zs[i][j]`` is z(xs[i], ys[j]).
    Linear extrapolation outside the grid, floored at 0. ``measured``: where the values were
    measured (None: the whole grid); a lookup outside it counts as out of range."""

    xs: list[float]
    ys: list[float]
    zs: list[list[float]]
    name: str = "curve"
    num_out_of_range: int = field(default=0, compare=False)
    measured: MeasuredRange | None = None
    repairs: list[Repair] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.xs = _check_axis(f"{self.name}.x", self.xs)
        self.ys = _check_axis(f"{self.name}.y", self.ys)
        if len(self.zs) != len(self.xs) or any(len(row) != len(self.ys) for row in self.zs):
            raise ValueError(
                f"{self.name}: seconds must be a {len(self.xs)} x {len(self.ys)} table "
                f"(rows follow the first axis)"
            )
        before = [[float(v) for v in row] for row in self.zs]
        self.zs = isotonic_grid(before)          # monotone along both axes
        if self.zs != before:
            self.repairs = repairs_of(before, self.zs)
            _warn_repairs(self.name, self.repairs, len(self.xs) * len(self.ys), [self.xs, self.ys])

    def __call__(self, x: float, y: float) -> float:
        xs, ys, zs = self.xs, self.ys, self.zs
        if x < xs[0] or x > xs[-1] or y < ys[0] or y > ys[-1]:
            self.num_out_of_range += 1
            i = _segment(xs, x)
            j = _segment(ys, y)
        else:                                         # in range: no clamping needed
            i = bisect_right(xs, x) - 1
            j = bisect_right(ys, y) - 1
            if i == len(xs) - 1:
                i -= 1
            if j == len(ys) - 1:
                j -= 1
            m = self.measured
            if m is not None and (x > m.x_max or y > m.y_max + m.y_per_x * x):
                self.num_out_of_range += 1
        tx = (x - xs[i]) / (xs[i + 1] - xs[i])
        ty = (y - ys[j]) / (ys[j + 1] - ys[j])
        z00, z01 = zs[i][j], zs[i][j + 1]
        z10, z11 = zs[i + 1][j], zs[i + 1][j + 1]
        z0 = z00 + (z01 - z00) * ty
        z1 = z10 + (z11 - z10) * ty
        z = z0 + (z1 - z0) * tx
        return z if z > 0.0 else 0.0

    def column(self, x: float) -> tuple[int, float, bool, float]:
        """What ``__call__`` computes from ``x`` alone: the segment ``i`` of
        ``xs``, the weight ``tx``, whether ``x`` lies outside the grid or the
        measured range, and the largest ``y`` counted as in range at this ``x``
        (the grid's end, or the measured limit if lower). A caller pricing many
        ``y`` at one ``x`` (``Profile.decode_stretch_s``) repeats the rest of
        ``__call__`` per ``y`` with these. Counts nothing."""
        xs = self.xs
        x_out = x < xs[0] or x > xs[-1]
        i = _segment(xs, x) if x_out else min(bisect_right(xs, x) - 1, len(xs) - 2)
        y_last = self.ys[-1]
        m = self.measured
        if m is not None:
            x_out = x_out or x > m.x_max
            y_last = min(y_last, m.y_limit(x))
        return i, (x - xs[i]) / (xs[i + 1] - xs[i]), x_out, y_last

    def to_dict(self, x_name: str, y_name: str) -> dict:
        out = {x_name: list(self.xs), y_name: list(self.ys), "seconds": [list(r) for r in self.zs]}
        if self.measured is not None:
            out["measured"] = self.measured.to_dict()
        return out
