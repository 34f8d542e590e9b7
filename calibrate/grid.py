"""Which batch shapes calibration times, and the curve grid they pin down; torch-free.

Node positions are powers of two (plus the extent), so curves are dense
where costs change fastest in relative terms. Shapes sit exactly on nodes
where they can: decode batches on (num seqs, total context) nodes with the
contexts spread evenly around their mean (``spread_evenly``), single
prefill chunks on (chunk, context) nodes.
"Core" shapes (priority 0: every other node, the corners, a few mixes) are
measured first; the rest refine the grid as the budget allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from calibrate.fit import CurveGrid, nnls
from calibrate.schema import Shape


def pow2_nodes(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... up to and including hi."""
    nodes = [lo]
    while nodes[-1] * 2 < hi:
        nodes.append(nodes[-1] * 2)
    return tuple(nodes + [hi] if hi > nodes[-1] else nodes)


def spread_evenly(total: int, n: int, max_each: int) -> tuple[int, ...]:
    """n contexts summing to ``total``, evenly spaced on [0, 2 total / n].

    A steady-state decode batch holds requests at every stage of their
    output, so its contexts spread around their mean rather than being equal;
    kernels that pad to the longest context (or balance work per sequence)
    cost more for a spread batch of the same total. The range is narrowed
    symmetrically when 2 x mean would exceed ``max_each``.
    """
    mean = total / n
    hi = min(2 * mean, max_each)
    lo = 2 * mean - hi
    xs = [int(lo + (hi - lo) * (i + 0.5) / n) for i in range(n)]
    short = total - sum(xs)                     # 0 <= short < n after flooring
    return tuple(x + 1 if i < short else x for i, x in enumerate(xs))


@dataclass(frozen=True, slots=True)
class GridSpec:
    """Extent of the calibration grid.

    max_num_tokens: tokens in one batch; max_context: positions of one
    request (context + new tokens); max_num_seqs: decodes in one batch;
    max_kv_tokens: KV slots one batch may touch (sizes the engine's pool).
    """

    max_num_tokens: int
    max_context: int
    max_num_seqs: int
    max_kv_tokens: int
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "max_context", "max_num_seqs", "max_kv_tokens", "block_size"):
            least = 1 if name == "block_size" else 4
            if getattr(self, name) < least:
                raise ValueError(f"grid.{name} must be >= {least}, got {getattr(self, name)}")

    @classmethod
    def default(cls, max_position: int, kv_bytes_per_token: int,
                free_device_bytes: int | None = None) -> GridSpec:
        """CPU (free_device_bytes None): <= 2048 tokens, 4096 context, 64 seqs,
        a KV pool <= 1 GiB. CUDA: <= 8192 tokens, 16384 context, 256 seqs, a
        KV pool of <= 40% of the free device memory."""
        if free_device_bytes is not None:
            kv = min(256 * 16384, int(0.4 * free_device_bytes) // kv_bytes_per_token)
            return cls(min(8192, max_position), min(16384, max_position), 256, max(kv, 4096))
        return cls(min(2048, max_position), min(4096, max_position), 64,
                   max(min(65536, (1 << 30) // kv_bytes_per_token), 4096))

    @property
    def max_prefill_positions(self) -> int:
        """Context + chunk of one prefill item: within the model and the KV pool."""
        return min(self.max_context, self.max_kv_tokens)

    def curve_grid(self) -> CurveGrid:
        """Nodes: powers of two up to each extent; the top decode-context node is
        what max_num_seqs decodes can reach in the pool, so it is measured."""
        cap = self.max_prefill_positions
        top_k = max(cap - self.max_num_tokens, cap // 2)
        ctx = sorted({0, top_k, max(top_k // 4, 1), max(top_k // 16, 1)})
        return CurveGrid(pow2_nodes(1, self.max_num_tokens), pow2_nodes(2, self.max_num_tokens),
                         tuple(ctx), pow2_nodes(1, self.max_num_seqs),
                         (0,) + pow2_nodes(16, self.max_kv_tokens - self.max_num_seqs))

    def pilot_shapes(self) -> list[Shape]:
        """A few shapes spanning the cost range, for the per-step cost estimate."""
        n = self.max_num_seqs
        top_k = self.curve_grid().chunk_context_nodes[-1]
        total = min(self.max_context - 2, (self.max_kv_tokens - n) // n) * n
        return [Shape(((2, 0),)), Shape(((min(self.max_num_tokens, self.max_prefill_positions), 0),)),
                Shape(((max(min(self.max_num_tokens // 8, self.max_prefill_positions - top_k), 2), top_k),)),
                Shape((), spread_evenly(total, n, self.max_context - 2)), Shape((), (0,) * n)]


def fit_shapes(spec: GridSpec, rng: np.random.Generator) -> list[tuple[int, str, Shape]]:
    """(priority, kind, shape) for the fit; priority 0 is measured first."""
    g = spec.curve_grid()

    def core(nodes: tuple[int, ...], x: int) -> bool:
        return x in nodes[::2] or x == nodes[-1]

    out: list[tuple[int, str, Shape]] = [(0, "empty", Shape())]
    for n in g.seq_nodes:
        for total in g.decode_context_nodes:
            if total + n <= spec.max_kv_tokens and total <= n * (spec.max_context - 2):
                prio = 0 if core(g.seq_nodes, n) and core(g.decode_context_nodes, total) else 1
                out.append((prio, "decode", Shape((), spread_evenly(total, n, spec.max_context - 2))))
    for c in g.chunk_nodes:
        for k in g.chunk_context_nodes:
            if c + k <= spec.max_prefill_positions:
                out.append((0 if core(g.chunk_nodes, c) else 1, "prefill", Shape(((c, k),))))
        for m in (2, 4, 8):
            if m * c <= min(spec.max_num_tokens, spec.max_kv_tokens) and c <= spec.max_prefill_positions:
                out.append((0 if m == 4 else 1, "multi_prefill", Shape(((c, 0),) * m)))
    chunks = [x for x in g.chunk_nodes if x <= min(spec.max_num_tokens // 2, spec.max_prefill_positions)]
    for i in range(24):
        c = int(rng.choice(chunks))
        k = int(rng.choice([x for x in g.chunk_context_nodes if x + c <= spec.max_prefill_positions]))
        n = int(rng.choice(g.seq_nodes))
        per_seq = int(rng.choice([x for x in g.decode_context_nodes if x < spec.max_context - 1]))
        if c + n <= spec.max_num_tokens and (per_seq + 1) * n + c + k <= spec.max_kv_tokens:
            decodes = spread_evenly(per_seq * n, n, spec.max_context - 2)
            out.append((0 if i < 12 else 1, "mixed", Shape(((c, k),), decodes)))
    return out


def random_shape(spec: GridSpec, rng: np.random.Generator) -> Shape:
    """A held-out batch: 0-3 chunks (log-uniform sizes) at random contexts, plus
    0..max_num_seqs decodes with contexts drawn uniformly on [0, 2 x level],
    level log-uniform."""
    while True:
        prefills = []
        for _ in range(int(rng.choice([0, 1, 1, 2, 3]))):
            top_c = min(spec.max_num_tokens / 2, spec.max_prefill_positions)
            c = int(np.exp(rng.uniform(np.log(2), np.log(top_c))))
            k = 0 if rng.random() < 0.3 else int(rng.integers(0, max(1, spec.max_prefill_positions - c)))
            prefills.append((c, k))
        n = int(rng.integers(0 if prefills else 1, spec.max_num_seqs + 1))
        room = (spec.max_kv_tokens - sum(c + k for c, k in prefills)) // max(n, 1) - 1
        top = min(spec.max_context - 2, room)
        if top < 1:
            continue
        level = np.exp(rng.uniform(0, np.log(top + 1)))
        decodes = tuple(min(int(x), top) for x in rng.uniform(0.0, 2.0, n) * level)
        shape = Shape(tuple(prefills), decodes)
        if 0 < shape.num_tokens <= spec.max_num_tokens and shape.num_kv_tokens <= spec.max_kv_tokens:
            return shape


def cost_features(s: Shape) -> list[float]:
    """Crude per-step cost features, for budgeting only (not the fit)."""
    return [1.0, s.num_tokens, sum(c * (c + k) for c, k in s.prefills) / 1e3,
            s.num_decodes * (max(s.decode_contexts, default=0) + 1) / 1e3]


def cost_estimator(shapes: list[Shape], times_s: list[float]) -> Callable[[Shape], float]:
    """Seconds per step predicted from a few timed shapes (non-negative fit of cost_features)."""
    coef = nnls(np.array([cost_features(s) for s in shapes]), np.array(times_s))
    return lambda s: max(float(np.dot(coef, cost_features(s))), 1e-4)


def plan_pass(points: list[tuple[int, str, Shape]], est_s: Callable[[Shape], float], pass_s: float,
              calls: Sequence[tuple[int, int]]) -> tuple[list[tuple[str, Shape]], int]:
    """Shapes to time and repeats per shape so that one pass costs about pass_s.

    points: (priority, kind, shape), lower priority first (ties keep their
    order). calls: (warm-ups, repeats) options, most preferred first. With the
    first option that fits everything, all points are taken; else, with the
    last option, points in priority order while they fit (the empty step always).
    """
    chosen: list[tuple[str, Shape]] = []
    for warm, reps in calls:
        chosen, spent = [], 0.0
        for _, kind, s in sorted(points, key=lambda p: p[0]):
            cost = (warm + reps) * est_s(s)
            if spent + cost <= pass_s or kind == "empty":
                chosen.append((kind, s))
                spent += cost
        if len(chosen) == len(points):
            break
    return chosen, reps
