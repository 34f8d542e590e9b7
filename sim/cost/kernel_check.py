"""The differential check of a kernel profile: its step costs against the wheel's own step
estimates (``aiconfigurator_core``'s ``mixed_step_latency``, ``decode_step_latency`` and
``predict_prefill_latency``) on random step shapes both can express.

``Profile.step_time_s`` composes tabulated curves; the wheel sums its per-op answers of one
step. Both start from the same tables, so a difference is the composition's or the
tabulation's. Shapes, and how each side reads them (ms on the wheel's side):

    decode       n decodes at context c        decode_step_latency(n, isl=c - 1, osl=2)
                                               (its KV length isl + osl // 2 + 1 = c + 1)
    mixed        a whole prompt of L tokens + n decodes at context L + o // 2
                                               mixed_step_latency(L, n, isl=L, osl=o)
    prompts      k whole prompts of L tokens (+ n decodes)
                                               mixed_step_latency(k L, n, isl=L, osl=o)
    prefix       a prompt of L tokens, P of them cached: one chunk of L - P over P
                                               predict_prefill_latency(1, L, prefix=P)

Differences that are explained, each taken out by its own amount before the 3% check
(``Checked.residual``):

- ``lm_head``: the LM head runs one row per sequence sampled here, one row in all in the
  wheel's mixed step (and none in its context graph of a mixture of experts);
- ``floor``: a chunk over context is never cheaper than over none here; where the wheel's
  derived chunk-over-context attention falls below its own measurement at context 0 (small
  chunks), this profile keeps the measured value;
- ``repair``: where the wheel's answers fall as the work grows (measurement noise between
  table points), the profile's monotone repair moved a grid value the lookup reads;
- ``launch``: k prompts in one step cost k single-prompt attentions less k - 1 shared
  launches here (chunks of any lengths mix in a step); the wheel measures k equal prompts
  in one kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.core.batch import Batch, BatchItem
from sim.cost.profile import Profile

KINDS = ("decode", "mixed", "prompts", "prefix")
TOLERANCE = 0.03
EXPLAINED = {
    "lm_head": "the LM head: one row per sequence sampled here; the wheel's mixed step samples one row, "
               "and its mixture-of-experts context graph has no LM head",
    "prompts": "a step's prompts share one attention launch here (prefill_shared_s); the wheel measures "
               "k prompts in one kernel",
}


@dataclass(frozen=True)
class Checked:
    kind: str
    shape: tuple[int, ...]           # the kind's numbers (see the module docstring)
    ours_s: float
    wheel_s: float
    lm_head_s: float                 # what the LM head's rows add here beyond the wheel's
    floor_s: float = 0.0             # what the context-0 floor adds to the wheel's attention
    repair_s: float = 0.0            # what the monotone repair moved the lookups by
    launch_s: float = 0.0            # k single prompts less shared launches, less the wheel's k-prompt kernel

    @property
    def rel_err(self) -> float:
        return self.ours_s / self.wheel_s - 1

    @property
    def residual(self) -> float:
        """The error once the explained differences are taken out."""
        return (self.ours_s - self.lm_head_s - self.repair_s - self.launch_s) / (self.wheel_s + self.floor_s) - 1

    @property
    def explained_by(self) -> tuple[str, ...]:
        return tuple(name for name, v in (("lm_head", self.lm_head_s), ("floor", self.floor_s),
                                          ("repair", self.repair_s), ("launch", self.launch_s))
                     if abs(v) > 1e-3 * self.wheel_s)


def _raw_linear(curve: Any, raw: Any, x: float) -> float:
    """``_raw_bilinear`` of a 1-D curve."""
    from sim.cost.curves import _segment
    i = _segment(curve.xs, x)
    x0, x1 = curve.xs[i], curve.xs[i + 1]
    t = (x - x0) / (x1 - x0)
    return raw(x0) * (1 - t) + raw(x1) * t


def _raw_bilinear(curve: Any, raw: Any, x: float, y: float) -> float:
    """The curve's bilinear interpolation at (x, y) on the wheel's raw answers at the corners
    of the cell the curve reads (before the monotone repair)."""
    from sim.cost.curves import _segment
    i, j = _segment(curve.xs, x), _segment(curve.ys, y)
    x0, x1, y0, y1 = curve.xs[i], curve.xs[i + 1], curve.ys[j], curve.ys[j + 1]
    tx, ty = (x - x0) / (x1 - x0), (y - y0) / (y1 - y0)
    z0 = raw(x0, y0) * (1 - ty) + raw(x0, y1) * ty
    z1 = raw(x1, y0) * (1 - ty) + raw(x1, y1) * ty
    return z0 * (1 - tx) + z1 * tx


def _log_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def random_shapes(rng: np.random.Generator, count: int, max_context: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` shapes, the kinds in turn, sizes log-uniform within what a step of a model
    with ``max_context`` tokens of context can hold."""
    longest = min(max_context, 16384)
    out = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        if kind == "decode":
            out.append((kind, (_log_int(rng, 1, 1024), _log_int(rng, 16, min(32768, max_context - 2)))))
        elif kind == "mixed":
            length = _log_int(rng, 16, min(8192, longest))
            out.append((kind, (length, int(rng.integers(0, 257)), _log_int(rng, 2, min(1024, max_context - length)))))
        elif kind == "prompts":
            out.append((kind, (int(rng.integers(2, 9)), _log_int(rng, 16, 2048), int(rng.integers(0, 65)),
                               _log_int(rng, 2, 512))))
        else:
            length = _log_int(rng, 256, longest)
            out.append((kind, (length, int(length * rng.uniform(0.05, 0.95)))))
    return out


def batch_of(kind: str, shape: tuple[int, ...]) -> Batch:
    """The step ``shape`` as batchsim's batch (request ids are arbitrary)."""
    if kind == "decode":
        n, context = shape
        return Batch(tuple(BatchItem(i, 1, context) for i in range(n)))
    if kind == "mixed":
        length, n, osl = shape
        return Batch((BatchItem(0, length, 0),) + tuple(BatchItem(1 + i, 1, length + osl // 2) for i in range(n)))
    if kind == "prompts":
        k, length, n, osl = shape
        return Batch(tuple(BatchItem(i, length, 0) for i in range(k))
                     + tuple(BatchItem(k + i, 1, length + osl // 2) for i in range(n)))
    length, cached = shape
    return Batch((BatchItem(0, length - cached, cached),))


def wheel_ms(handle: Any, kind: str, shape: tuple[int, ...]) -> float:
    """The wheel's own estimate of the step (ms)."""
    if kind == "decode":
        n, context = shape
        return handle.decode_step_latency(n, context - 1, 2)
    if kind == "mixed":
        length, n, osl = shape
        return handle.mixed_step_latency(length, n, length, osl)
    if kind == "prompts":
        k, length, n, osl = shape
        return handle.mixed_step_latency(k * length, n, length, osl)
    length, cached = shape
    return handle.predict_prefill_latency(1, length, cached)


def lm_head_rows_wheel(kind: str, shape: tuple[int, ...], moe_context: bool) -> int:
    """The rows the wheel's estimate gives the LM head (0: its context graph has none)."""
    if kind == "decode":
        return shape[0]
    return 0 if moe_context else 1


def check(profile: Profile, tables: Any, count: int = 200, seed: int = 0) -> list[Checked]:
    """``profile`` (the tables only: no host terms) against the wheel on ``count`` random shapes."""
    from sim.cost.aic import quiet
    from sim.cost.kernel_grids import MS, _feasible_prefill
    rng = np.random.default_rng(seed)
    moe_context = not tables._context["lm_head"]
    context = profile.model.max_position_embeddings
    raw_prefill = _feasible_prefill(lambda c, p: tables.prefill_attention_ms(c, p) * MS, context)
    raw_decode = lambda n, c: tables.decode_attention_ms(int(n), int(c) + 1) * MS     # noqa: E731
    out = []
    with quiet():
        for kind, shape in random_shapes(rng, count, context):
            batch = batch_of(kind, shape)
            rows = batch.num_prefill_seqs + batch.decode_seqs
            wheel_rows = lm_head_rows_wheel(kind, shape, moe_context)
            lm = profile.lm_head(rows) - (profile.lm_head(wheel_rows) if wheel_rows else 0.0)
            floor = 0.0
            repair = profile.linear(batch.num_tokens) - _raw_linear(
                profile.linear, lambda t: tables.linear_ms(int(t)) * MS, batch.num_tokens)
            repair += profile.lm_head(rows) - _raw_linear(profile.lm_head, lambda r: tables.lm_head_ms(int(r)) * MS,
                                                          rows)
            for c, p in batch.prefill_chunks:
                floor += max(0.0, raw_prefill(c, 0) - raw_prefill(c, p))
                lifted = lambda x, y: max(raw_prefill(x, 0), raw_prefill(x, y))     # noqa: E731
                repair += profile.attn_prefill(c, p) - _raw_bilinear(profile.attn_prefill, lifted, c, p)
            launch = 0.0
            if kind == "prompts":
                k, length = shape[0], shape[1]
                launch = (k * raw_prefill(length, 0) - (k - 1) * profile.prefill_shared_s
                          - tables.prefill_attention_ms(length, 0, batch=k) * MS)
            if batch.decode_seqs:
                n, mean = batch.decode_seqs, batch.decode_context / batch.decode_seqs
                repair += profile.attn_decode(n, mean) - _raw_bilinear(profile.attn_decode, raw_decode, n, mean)
            out.append(Checked(kind, shape, profile.step_time_s(batch), wheel_ms(tables.handle, kind, shape) * 1e-3,
                               lm, floor, repair, launch))
    profile.reset_counters()
    return out


def summary(results: list[Checked]) -> dict[str, Any]:
    """Per kind and in all: count, mean and worst |error|, share within ``TOLERANCE``, before
    and after the LM head's explained difference."""
    out: dict[str, Any] = {}
    for kind in (*KINDS, "all"):
        rs = [r for r in results if kind in ("all", r.kind)]
        if not rs:
            continue
        raw = np.abs([r.rel_err for r in rs])
        residual = np.abs([r.residual for r in rs])
        out[kind] = {"n": len(rs), "mean_abs_pct": round(100 * float(raw.mean()), 2),
                     "max_abs_pct": round(100 * float(raw.max()), 2),
                     "within_tolerance": round(float((raw <= TOLERANCE).mean()), 3),
                     "max_residual_pct": round(100 * float(residual.max()), 2),
                     "explained": {name: sum(name in r.explained_by for r in rs if abs(r.rel_err) > TOLERANCE)
                                   for name in ("lm_head", "floor", "repair", "launch")}}
    return out
