"""Piecewise-linear curves on a grid: fast scalar evaluation, linear
extrapolation past the measured range (with a count of how often it happened),
and monotone by construction (the fitted values are made non-decreasing).

Evaluated once or a few times per simulated step, so these use ``bisect`` on
plain lists rather than numpy (a scalar ``np.interp`` costs ~2 us; this ~0.3 us).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence


def _check_axis(name: str, xs: Sequence[float]) -> list[float]:
    out = [float(x) for x in xs]
    if len(out) < 2:
        raise ValueError(f"{name}: needs at least 2 grid points, got {len(out)}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{name}: grid points must be strictly increasing, got {out}")
    return out


def _monotone(ys: Sequence[float]) -> list[float]:
    """Running maximum: a cost never falls when the work grows."""
    out: list[float] = []
    top = float("-inf")
    for y in ys:
        top = max(top, float(y))
        out.append(top)
    return out


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
    """y(x), piecewise linear on ``xs``; linear extrapolation outside, floored at 0."""

    xs: list[float]
    ys: list[float]
    name: str = "curve"
    num_out_of_range: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        self.xs = _check_axis(f"{self.name}.x", self.xs)
        if len(self.ys) != len(self.xs):
            raise ValueError(f"{self.name}: {len(self.xs)} x values but {len(self.ys)} y values")
        self.ys = _monotone(self.ys)

    def __call__(self, x: float) -> float:
        xs = self.xs
        last = len(xs) - 2
        i = bisect_right(xs, x) - 1                  # _segment, inlined: the hot path
        if i < 0 or x > xs[-1]:
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
        return {x_name: list(self.xs), "seconds": list(self.ys)}


@dataclass(slots=True)
class Curve2D:
    """z(x, y), bilinear on the grid ``xs`` x ``ys``; ``zs[i][j]`` is z(xs[i], ys[j]).
    Linear extrapolation outside the grid, floored at 0."""

    xs: list[float]
    ys: list[float]
    zs: list[list[float]]
    name: str = "curve"
    num_out_of_range: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        self.xs = _check_axis(f"{self.name}.x", self.xs)
        self.ys = _check_axis(f"{self.name}.y", self.ys)
        if len(self.zs) != len(self.xs) or any(len(row) != len(self.ys) for row in self.zs):
            raise ValueError(
                f"{self.name}: seconds must be a {len(self.xs)} x {len(self.ys)} table "
                f"(rows follow the first axis)"
            )
        # Monotone along both axes: rows first, then columns.
        rows = [_monotone(row) for row in self.zs]
        cols = [_monotone([rows[i][j] for i in range(len(rows))]) for j in range(len(self.ys))]
        self.zs = [[cols[j][i] for j in range(len(self.ys))] for i in range(len(self.xs))]

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
        tx = (x - xs[i]) / (xs[i + 1] - xs[i])
        ty = (y - ys[j]) / (ys[j + 1] - ys[j])
        z00, z01 = zs[i][j], zs[i][j + 1]
        z10, z11 = zs[i + 1][j], zs[i + 1][j + 1]
        z0 = z00 + (z01 - z00) * ty
        z1 = z10 + (z11 - z10) * ty
        z = z0 + (z1 - z0) * tx
        return z if z > 0.0 else 0.0

    def to_dict(self, x_name: str, y_name: str) -> dict:
        return {x_name: list(self.xs), y_name: list(self.ys), "seconds": [list(r) for r in self.zs]}
