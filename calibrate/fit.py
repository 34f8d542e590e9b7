"""Fit a Profile's curve values to measured step times; numpy only, torch-free.

The Profile's prediction is *linear in its grid values*: for a batch shape,

    step_s = overhead + sum_i w_i(T) L_i + sum_chunks sum_jk w_jk(c, k) P_jk
                      + sum_mn w_mn(n, N) D_mn

where L, P, D are the values at the nodes of the linear, attn_prefill and
attn_decode grids and the w are exactly the (bi)linear interpolation weights
``sim.cost.curves`` uses (edge segments extrapolate). So every measured step is
one linear equation in the unknown node values, and a mix of measured
shapes (empty, pure decode, single and multi-chunk prefill, mixed) pins
them down jointly. The node values are written as running sums of
non-negative increments (2-D running sums for the tables), so every curve
is non-decreasing along each axis *in the fit* rather than patched
afterwards by the curves' running maximum. We solve

    min  sum_s ((A x - y) / y)_s^2              relative error, like MAPE
       + lam^2 |D2 x|^2 / y_ref^2               curvature along every grid axis
       + eps^2 |x_attention|^2 / y_ref^2        gauge: token-proportional cost
    s.t. x = C u, u >= 0                        goes to `linear`, not attention

by Lawson-Hanson non-negative least squares in u, re-weighted (Huber)
against outlying points. A measured time may also span several steps (a
black-box server's time to first token covers every chunk of a prompt): its
row is then the sum of the steps' rows. Optional extra non-negative unknowns
(say a per-request overhead that only times to first token contain) enter
through their coefficients per point. The curvature term only matters where data are
thin: nodes no measurement reaches (a decode node with more context than
its sequences can hold, a corner past the model's context) follow their
neighbours linearly. The gauge term fixes the one direction data cannot
see: shifting b tokens' worth of cost between ``linear`` and the attention
curves changes no prediction.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from calibrate.schema import Shape


@dataclass(frozen=True, slots=True)
class CurveGrid:
    """Node positions of the three curves (strictly increasing)."""

    token_nodes: tuple[int, ...]              # linear: tokens in the batch
    chunk_nodes: tuple[int, ...]              # attn_prefill: chunk tokens
    chunk_context_nodes: tuple[int, ...]      # attn_prefill: context before the chunk
    seq_nodes: tuple[int, ...]                # attn_decode: decode sequences
    decode_context_nodes: tuple[int, ...]     # attn_decode: total decode context

    @property
    def num_unknowns(self) -> int:
        return (1 + len(self.token_nodes) + len(self.chunk_nodes) * len(self.chunk_context_nodes)
                + len(self.seq_nodes) * len(self.decode_context_nodes))


@dataclass(frozen=True, slots=True)
class FittedCurves:
    overhead_s: float
    linear_s: list[float]                     # per token node
    attn_prefill_s: list[list[float]]         # [chunk node][context node]
    attn_decode_s: list[list[float]]          # [seq node][context node]
    num_downweighted: int                     # points the robust fit weighted < 0.5
    extra_s: tuple[float, ...] = ()           # the extra unknowns, if any were asked for


def _interp_weights(nodes: Sequence[int], x: float) -> tuple[tuple[int, float], tuple[int, float]]:
    """The two (index, weight) pairs sim.cost.curves uses for x (edges extrapolate)."""
    i = min(max(bisect_right(nodes, x) - 1, 0), len(nodes) - 2)
    t = (x - nodes[i]) / (nodes[i + 1] - nodes[i])
    return (i, 1.0 - t), (i + 1, t)


def design_row(shape: Shape, grid: CurveGrid) -> np.ndarray:
    """Coefficients of the unknowns in the predicted time of ``shape``."""
    row = np.zeros(grid.num_unknowns)
    row[0] = 1.0
    off_l = 1
    off_p = off_l + len(grid.token_nodes)
    nk = len(grid.chunk_context_nodes)
    off_d = off_p + len(grid.chunk_nodes) * nk
    nn = len(grid.decode_context_nodes)
    if shape.num_tokens:
        for i, w in _interp_weights(grid.token_nodes, shape.num_tokens):
            row[off_l + i] += w
    for chunk, context in shape.prefills:
        for i, wi in _interp_weights(grid.chunk_nodes, chunk):
            for j, wj in _interp_weights(grid.chunk_context_nodes, context):
                row[off_p + i * nk + j] += wi * wj
    if shape.num_decodes:
        for i, wi in _interp_weights(grid.seq_nodes, shape.num_decodes):
            for j, wj in _interp_weights(grid.decode_context_nodes, shape.decode_context):
                row[off_d + i * nn + j] += wi * wj
    return row


def _curvature_rows(grid: CurveGrid) -> list[np.ndarray]:
    """Second differences (change of slope, in value units) along every axis."""
    rows: list[np.ndarray] = []

    def add(xs: Sequence[int], idx: Sequence[int]) -> None:
        for a in range(len(xs) - 2):
            x0, x1, x2 = xs[a], xs[a + 1], xs[a + 2]
            r = np.zeros(grid.num_unknowns)
            half = (x2 - x0) / 2
            r[idx[a]] += half / (x1 - x0)
            r[idx[a + 1]] -= half / (x1 - x0) + half / (x2 - x1)
            r[idx[a + 2]] += half / (x2 - x1)
            rows.append(r)

    off_l = 1
    add(grid.token_nodes, [off_l + i for i in range(len(grid.token_nodes))])
    for off, xs, ys in ((off_l + len(grid.token_nodes), grid.chunk_nodes, grid.chunk_context_nodes),
                        (off_l + len(grid.token_nodes) + len(grid.chunk_nodes) * len(grid.chunk_context_nodes),
                         grid.seq_nodes, grid.decode_context_nodes)):
        for i in range(len(xs)):
            add(ys, [off + i * len(ys) + j for j in range(len(ys))])
        for j in range(len(ys)):
            add(xs, [off + i * len(ys) + j for i in range(len(xs))])
    return rows


def _spd_solve(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Solve m x = v for symmetric positive definite m by Cholesky, in vector steps.

    Deliberately not LAPACK: for n ~ 150 a multi-threaded BLAS spins for
    milliseconds per call on a loaded machine (calibration runs beside other
    work); these vector steps cost ~1 ms whatever the load. LinAlgError if m
    is not positive definite.
    """
    n = len(v)
    low = np.zeros_like(m)
    for j in range(n):
        d = m[j, j] - low[j, :j] @ low[j, :j]
        if not d > 1e-13 * max(abs(m[j, j]), 1e-300):
            raise np.linalg.LinAlgError("not positive definite")
        low[j, j] = d ** 0.5
        low[j + 1:, j] = (m[j + 1:, j] - low[j + 1:, :j] @ low[j, :j]) / low[j, j]
    y = np.empty(n)
    for i in range(n):
        y[i] = (v[i] - low[i, :i] @ y[:i]) / low[i, i]
    x = np.empty(n)
    for i in range(n - 1, -1, -1):
        x[i] = (y[i] - low[i + 1:, i] @ x[i + 1:]) / low[i, i]
    return x


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12,
         start: np.ndarray | None = None) -> np.ndarray:
    """Lawson-Hanson: argmin |a x - b| subject to x >= 0.

    Works on the normal equations (a'a is n x n, n ~ 150 here), so each
    active-set solve is a small dense solve rather than a tall least squares.
    ``start``: a guess of which x_j are positive (a previous solution), which
    makes a re-solve of a slightly changed problem take a few steps.
    """
    gram, rhs = a.T @ a, a.T @ b
    n = gram.shape[0]
    scale = max(float(np.abs(rhs).max()), 1e-300)
    active = np.zeros(n, dtype=bool) if start is None else start > 0   # True: x_j free (positive)
    x = np.zeros(n)

    def solve(mask: np.ndarray) -> np.ndarray:
        z = np.zeros(n)
        sub = gram[np.ix_(mask, mask)]
        try:
            z[mask] = _spd_solve(sub, rhs[mask])
        except np.linalg.LinAlgError:
            z[mask] = np.linalg.lstsq(sub, rhs[mask], rcond=None)[0]
        return z

    while active.any():                        # feasible start: drop guesses that come out <= 0
        x = solve(active)
        if np.all(x[active] > 0):
            break
        active &= x > 0
    x[~active] = 0.0
    for _ in range(3 * n):
        grad = rhs - gram @ x
        cand = np.where(~active, grad, -np.inf)
        j = int(np.argmax(cand))
        if cand[j] <= tol * scale:
            break
        active[j] = True
        z = solve(active)
        while np.any(z[active] <= 0):
            bad = active & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            active &= x > 0
            x[~active] = 0.0
            z = solve(active)
        x = z
    return x


def _cumulative(grid: CurveGrid) -> np.ndarray:
    """Block-diagonal map from increments to node values: overhead as is, the
    linear curve as running sums, each 2-D table as 2-D running sums (which
    also makes the value's growth along one axis never shrink along the other)."""
    def tri(n: int) -> np.ndarray:
        return np.tril(np.ones((n, n)))

    blocks = [np.ones((1, 1)), tri(len(grid.token_nodes)),
              np.kron(tri(len(grid.chunk_nodes)), tri(len(grid.chunk_context_nodes))),
              np.kron(tri(len(grid.seq_nodes)), tri(len(grid.decode_context_nodes)))]
    out = np.zeros((grid.num_unknowns, grid.num_unknowns))
    at = 0
    for blk in blocks:
        out[at:at + len(blk), at:at + len(blk)] = blk
        at += len(blk)
    return out


def fit_curves(shapes: Sequence[Shape | Sequence[Shape]], times_s: Sequence[float], grid: CurveGrid, *,
               curvature_weight: float = 0.03, gauge_weight: float = 1e-3,
               num_robust_iters: int = 3,
               extra_columns: Sequence[Sequence[float]] | None = None) -> FittedCurves:
    """Node values that best predict ``times_s`` (relative error), see module doc.

    ``shapes[i]``: one step's Shape, or a sequence of Shapes whose steps
    together took ``times_s[i]``. ``extra_columns``: per point, the
    coefficients of extra non-negative unknowns (all rows the same length);
    their values come back in ``FittedCurves.extra_s``.

    Robust: after each solve, points whose relative residual exceeds 3 robust
    standard deviations (1.4826 MAD) get Huber weights, so a step disturbed
    by another process's load cannot bend a curve. Raises ValueError for
    mismatched or non-positive input.
    """
    if len(shapes) != len(times_s) or not shapes:
        raise ValueError(f"need as many times as shapes (> 0), got {len(shapes)} and {len(times_s)}")
    y = np.asarray(times_s, dtype=float)
    if np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ValueError("measured times must be finite and > 0")
    y_ref = float(np.median(y))
    design = np.stack([design_row(s, grid) if isinstance(s, Shape)
                       else np.sum([design_row(x, grid) for x in s], axis=0) for s in shapes])
    num_extra = 0
    if extra_columns is not None:
        extra = np.asarray(extra_columns, dtype=float)
        if extra.ndim != 2 or len(extra) != len(y) or np.any(~np.isfinite(extra)):
            raise ValueError(f"extra_columns must be one finite row per point ({len(y)}), "
                             f"got shape {extra.shape}")
        num_extra = extra.shape[1]
    reg = [r * (curvature_weight / y_ref) for r in _curvature_rows(grid)]
    for j in range(1 + len(grid.token_nodes), grid.num_unknowns):
        r = np.zeros(grid.num_unknowns)
        r[j] = gauge_weight / y_ref
        reg.append(r)
    # Monotone by construction: node values are cumulative sums of non-negative
    # increments (x = cum @ inc, inc >= 0), so the curves never fall as work grows.
    cum = _cumulative(grid)
    design_inc, reg_inc = design @ cum, np.stack(reg) @ cum
    if num_extra:                                 # extra unknowns: their own columns, >= 0 as they are
        n = grid.num_unknowns
        cum = np.block([[cum, np.zeros((n, num_extra))], [np.zeros((num_extra, n)), np.eye(num_extra)]])
        design = np.hstack([design, extra])
        design_inc = np.hstack([design_inc, extra])
        reg_inc = np.hstack([reg_inc, np.zeros((len(reg_inc), num_extra))])
    weights = np.ones(len(y))
    inc = np.ones(grid.num_unknowns + num_extra)  # first guess: every increment positive
    x = cum @ inc
    for it in range(num_robust_iters + 1):
        if it:                                    # Huber weights from the last solve's residuals
            rel = np.abs(design @ x - y) / y
            scale = max(1.4826 * float(np.median(rel)), 0.01)
            weights = np.minimum(1.0, 3.0 * scale / np.maximum(rel, 1e-12))
        a = np.vstack([design_inc * (weights / y)[:, None], reg_inc])
        b = np.concatenate([weights, np.zeros(len(reg))])
        inc = nnls(a * y_ref, b, start=inc) * y_ref   # in units of y_ref: all columns O(1)
        x = cum @ inc
    nt, nc, nk = len(grid.token_nodes), len(grid.chunk_nodes), len(grid.chunk_context_nodes)
    ns, nn = len(grid.seq_nodes), len(grid.decode_context_nodes)
    p = x[1 + nt: 1 + nt + nc * nk].reshape(nc, nk)
    d = x[1 + nt + nc * nk: grid.num_unknowns].reshape(ns, nn)
    return FittedCurves(float(x[0]), x[1:1 + nt].tolist(), p.tolist(), d.tolist(),
                        int(np.count_nonzero(weights < 0.5)),
                        tuple(float(v) for v in x[grid.num_unknowns:]))
