"""Import Vidur's published operator profiles into a batchsim Profile; torch-free.

Vidur (github.com/microsoft/vidur) publishes, per device and model,
``data/profiling/compute/<device>/<org>/<model>/mlp.csv`` and
``attention.csv``: one row per profiled shape, times of *one layer's*
operators in milliseconds (``time_stats.<op>.{min,max,mean,median,std}``).
We read the medians and map them onto our curves:

- linear(T) = num_layers x (input_layernorm + attn_pre_proj + attn_rope
  + attn_post_proj + post_attention_layernorm + mlp_up_proj + mlp_act
  + mlp_down_proj + add)  at num_tokens = T, plus ``emb`` once per step
  (norms, add and emb count 0 where a file lacks them, as Vidur does);
- attn_prefill(c, k) = num_layers x attn_prefill of the row with
  prefill_chunk_size = c, kv_cache_size = k (batch_size 1);
- attn_decode(n, N) = num_layers x attn_decode at batch_size = n and
  kv_cache_size = N / n: Vidur's decode rows give every one of the n
  sequences kv_cache_size tokens, our axis is their total;
- ``attn_kv_cache_save`` (when present) is added to both attention terms.

Only what was measured is imported as measured. A table cell no row covers
(a decode total that would need more context per sequence than was profiled,
a prefill chunk past the model's context) is *filled*: held at the nearest
measured value below the profiled range, continued along the row's mean
slope above it. The monotone repair (``sim.cost.curves.isotonic_grid``) gives
filled cells a negligible weight, so they bend to the measured ones and
never the other way round; measured values it moves by more than 5% are
listed in the import report. ``import_report`` (printed by the CLI, stored
in the profile's provenance) also says which of Vidur's own cost
adjustments the import keeps or drops.

    python -m calibrate.vidur_import --mlp mlp.csv --attention attention.csv \\
        --out profile.yaml [--model llama-2-7b] [--gpu a100-80gb] [--tp 1]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
import sys
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any, Iterable, Mapping

from calibrate.schema import model_shape_from_spec, sha256_file
from sim.cost.curves import REPAIR_REPORT_REL, Curve1D, Curve2D, isotonic, isotonic_grid
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS
from sim.cost.profile import GIB, ModelShape, Profile

MS = 1e-3
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
OPTIONAL_OPS = ("input_layernorm", "post_attention_layernorm", "add", "emb")
MLP_KEYS = ("num_tokens", "num_tensor_parallel_workers", "n_head", "n_kv_head", "n_embd", "n_expanded_embd")
ATTN_KEYS = ("batch_size", "prefill_chunk_size", "kv_cache_size", "num_tensor_parallel_workers",
             "n_q_head", "n_kv_head", "n_embd")
# Device memory per GPU, for the devices Vidur publishes (override with memory_bytes_per_gpu).
DEVICE_MEMORY_BYTES = {"a100": 80 * GIB, "h100": 80 * GIB, "a40": 48 * GIB, "h200": 141 * 10**9}
VIDUR_DEVICE_TO_GPU = {"a100": "a100-80gb", "h100": "h100-sxm"}     # Vidur's device folders
MAX_NODES = 48                  # per axis of linear and attn_prefill
MAX_SEQ_NODES = 256             # attn_decode keeps every profiled batch size up to this many
DECODE_TOTAL_NODES = 64         # attn_decode total-context axis: a geometric ladder
FILL_WEIGHT = 1e-6              # a filled cell's weight in the monotone repair (measured: 1)
# Vidur's predictor defaults (vidur/config/config.py, BaseExecutionTimePredictorConfig).
VIDUR_BATCHING_OVERHEAD = 0.1   # attention_{decode,prefill}_batching_overhead_fraction
VIDUR_KV_GRANULARITY = 64       # kv_cache_prediction_granularity
VIDUR_TOKEN_ROUNDING = 8        # Batch._total_num_tokens_rounded


class VidurImportError(ValueError):
    """A Vidur file that cannot be used; the message names the file and the column."""


def _read(path: Path, required: Iterable[str]) -> list[dict[str, str]]:
    if not path.is_file():
        raise VidurImportError(f"{path}: file not found")
    try:
        with (gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")) as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise VidurImportError(f"{path}: missing column(s) {missing}; is this Vidur's "
                                       f"{path.name} (data/profiling/compute/<device>/<model>/)?")
            rows = list(reader)
            if not rows:
                raise VidurImportError(f"{path}: the file has a header but no data rows")
            return rows
    except (UnicodeDecodeError, csv.Error, OSError, EOFError) as exc:
        raise VidurImportError(f"{path}: not a readable CSV file ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _num(rows: list[dict[str, str]], i: int, col: str, path: Path, optional: bool = False) -> float:
    value = rows[i].get(col) or ""
    if value == "":
        if optional:
            return 0.0
        raise VidurImportError(f"{path}: line {i + 2}: empty value in column {col!r}")
    try:
        out = float(value)
    except ValueError:
        raise VidurImportError(f"{path}: line {i + 2}: column {col!r} has non-numeric value {value!r}") from None
    if not math.isfinite(out) or out < 0:
        raise VidurImportError(f"{path}: line {i + 2}: column {col!r} must be a finite number >= 0, got {value!r}")
    return out


def _count(rows: list[dict[str, str]], i: int, col: str, path: Path, minimum: int = 1) -> int:
    """A whole-number column (tokens, sequences, context) that is at least ``minimum``."""
    value = _num(rows, i, col, path)
    if value != int(value) or value < minimum:
        raise VidurImportError(f"{path}: line {i + 2}: column {col!r} must be a whole number >= {minimum}, "
                               f"got {rows[i].get(col)!r}")
    return int(value)


def _median_by_key(points: Iterable[tuple[Any, float]]) -> dict[Any, float]:
    """Duplicate profiled shapes (Vidur files have some) -> the median of their values."""
    groups: dict[Any, list[float]] = defaultdict(list)
    for key, value in points:
        groups[key].append(value)
    return {k: median(v) for k, v in groups.items()}


def _thin(values: Iterable[float], max_nodes: int = MAX_NODES) -> list[float]:
    """Sorted unique values, at most max_nodes: the ends plus those nearest a geometric ladder."""
    xs = sorted(set(values))
    if len(xs) <= max_nodes:
        return xs
    lo, hi = max(xs[0], 1.0), xs[-1]
    targets = [lo * (hi / lo) ** (i / (max_nodes - 1)) for i in range(max_nodes)]
    return sorted({xs[0], xs[-1]} | {min(xs, key=lambda x: abs(x - t)) for t in targets})


def _ladder(lo: float, hi: float, num: int) -> list[float]:
    """About ``num`` integers from lo to hi, evenly spaced in log."""
    return sorted({float(round(lo * (hi / lo) ** (i / (num - 1)))) for i in range(num)} | {lo, hi})


def _row_value(ks: list[float], vs: list[float], k: float) -> tuple[float, bool]:
    """(value, measured) of one profiled row at context k: piecewise linear
    inside the row's range; held at its first value below it; continued along
    the row's mean slope (first to last point) above it."""
    if k < ks[0]:
        return vs[0], False
    if k > ks[-1]:
        slope = (vs[-1] - vs[0]) / (ks[-1] - ks[0]) if len(ks) > 1 else 0.0
        return vs[-1] + max(slope, 0.0) * (k - ks[-1]), False
    if len(ks) == 1:
        return vs[0], True
    i = min(bisect_right(ks, k) - 1, len(ks) - 2)
    return vs[i] + (vs[i + 1] - vs[i]) * (k - ks[i]) / (ks[i + 1] - ks[i]), True


def _rows_by_first(table: dict[tuple[int, int], float]) -> dict[int, tuple[list[float], list[float]]]:
    rows: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (first, k), v in table.items():
        rows[first].append((k, v))
    return {f: ([float(k) for k, _ in sorted(p)], [v for _, v in sorted(p)]) for f, p in rows.items()}


def _table(rows: dict[int, tuple[list[float], list[float]]], firsts: list[float], seconds: list[float],
           context_of: Any) -> tuple[list[list[float]], list[list[float]]]:
    """Values and repair weights of a (first axis x second axis) table."""
    z, w = [], []
    for f in firsts:
        ks, vs = rows[int(f)]
        cells = [_row_value(ks, vs, context_of(f, s)) for s in seconds]
        z.append([v for v, _ in cells])
        w.append([1.0 if measured else FILL_WEIGHT for _, measured in cells])
    return z, w


def _repair(name: str, z: list[list[float]], w: list[list[float]], labels: tuple[str, str],
            axes: tuple[list[float], list[float]]) -> tuple[list[list[float]], list[str], int]:
    """Monotone repair with filled cells yielding; (table, measured cells moved > 5%, fills moved)."""
    fixed = isotonic_grid(z, w)
    moved, fills = [], 0
    for i, (r0, r1, rw) in enumerate(zip(z, fixed, w)):
        for j, (a, b, wt) in enumerate(zip(r0, r1, rw)):
            if a == b:
                continue
            if wt < 1.0:
                fills += 1
            elif abs(b - a) > REPAIR_REPORT_REL * abs(a):
                moved.append((abs(b - a) / max(abs(a), 1e-300), f"{name}({labels[0]}={axes[0][i]:g}, "
                              f"{labels[1]}={axes[1][j]:g}): {a / MS:.4g} -> {b / MS:.4g} ms"))
    return fixed, [text for _, text in sorted(moved, key=lambda m: -m[0])], fills


def _select(rows: list[dict[str, str]], keys: tuple[str, ...], want: tuple[int, ...], path: Path) -> list[int]:
    sel = [i for i in range(len(rows)) if tuple(int(_num(rows, i, k, path)) for k in keys) == want]
    if not sel:
        held = sorted({tuple(r.get(k) for k in keys) for r in rows})
        shown = ", ".join(str(h) for h in held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "")
        raise VidurImportError(f"{path}: no rows for {dict(zip(keys, want))}; the file holds {keys} = {shown}")
    return sel


def import_vidur(mlp_csv: str | Path, attention_csv: str | Path, model: str | ModelShape | Mapping[str, Any],
                 device: str, tensor_parallel: int = 1, *, block_size: int | None = None,
                 memory_bytes_per_gpu: int | None = None, activation_bytes_per_gpu: int = 0,
                 dtype: str = "float16") -> Profile:
    """Build a Profile from Vidur's mlp.csv and attention.csv for ``model`` at ``tensor_parallel``.

    Rows are selected by the model's shape (heads, kv heads, hidden, MLP size)
    and num_tensor_parallel_workers; ``block_size`` picks among attention rows
    profiled with several. ``device`` is a GPU preset name or one of Vidur's
    device folders. The import report is ``provenance["import_report"]``.
    Raises VidurImportError (a ValueError) naming the file, the line or column,
    and what the file does hold.
    """
    mlp_path, attn_path = Path(mlp_csv), Path(attention_csv)
    shape = model if isinstance(model, ModelShape) else model_shape_from_spec(model)
    ops = [f"time_stats.{op}.median" for op in LAYER_OPS + ("emb",)]
    mlp_rows = _read(mlp_path, MLP_KEYS + tuple(c for c, op in zip(ops, LAYER_OPS + ("emb",))
                                                if op not in OPTIONAL_OPS))
    attn_rows = _read(attn_path, ATTN_KEYS + ("time_stats.attn_prefill.median", "time_stats.attn_decode.median"))
    mlp_sel = _select(mlp_rows, ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tensor_parallel_workers"),
                      (shape.num_heads, shape.num_kv_heads, shape.hidden_size, shape.intermediate_size,
                       tensor_parallel), mlp_path)
    attn_sel = _select(attn_rows, ("n_q_head", "n_kv_head", "n_embd", "num_tensor_parallel_workers"),
                       (shape.num_heads, shape.num_kv_heads, shape.hidden_size, tensor_parallel), attn_path)
    sizes = sorted({attn_rows[i].get("block_size", "") for i in attn_sel})
    if block_size is not None:
        attn_sel = [i for i in attn_sel if attn_rows[i].get("block_size") == str(block_size)]
        if not attn_sel:
            raise VidurImportError(f"{attn_path}: no rows with block_size {block_size}; the file holds {sizes}")
    elif len(sizes) > 1:
        raise VidurImportError(f"{attn_path}: rows for several block sizes {sizes}; pass block_size")

    layers = shape.num_layers
    linear = _median_by_key(
        (_count(mlp_rows, i, "num_tokens", mlp_path),
         MS * (layers * sum(_num(mlp_rows, i, c, mlp_path, op in OPTIONAL_OPS) for c, op in zip(ops, LAYER_OPS))
               + _num(mlp_rows, i, ops[-1], mlp_path, True))) for i in mlp_sel)
    save = "time_stats.attn_kv_cache_save.median"
    points: dict[bool, list[tuple[tuple[int, int], float]]] = {True: [], False: []}
    for i in attn_sel:
        chunk = _count(attn_rows, i, "prefill_chunk_size", attn_path, minimum=0)
        first = chunk or _count(attn_rows, i, "batch_size", attn_path)      # prefill: chunk; decode: seqs
        col = "time_stats.attn_prefill.median" if chunk else "time_stats.attn_decode.median"
        value = MS * layers * (_num(attn_rows, i, col, attn_path) + _num(attn_rows, i, save, attn_path, True))
        points[chunk > 0].append(((first, _count(attn_rows, i, "kv_cache_size", attn_path, minimum=0)), value))
    pre, dec = _median_by_key(points[True]), _median_by_key(points[False])
    for name, table in (("prefill (prefill_chunk_size > 0)", pre), ("decode (prefill_chunk_size == 0)", dec)):
        if len({k[0] for k in table}) < 2 or len({k[1] for k in table}) < 2:
            raise VidurImportError(f"{attn_path}: needs {name} rows at >= 2 sizes and >= 2 "
                                   f"kv_cache_size values for this model, found {len(table)} distinct shapes")
    if len(linear) < 2:
        raise VidurImportError(f"{mlp_path}: needs rows at >= 2 num_tokens values for this model, found {len(linear)}")
    for path, name, values in ((mlp_path, "the MLP and norm times", linear.values()),
                               (attn_path, "the prefill attention times", pre.values()),
                               (attn_path, "the decode attention times", dec.values())):
        values = list(values)
        if not all(math.isfinite(v) for v in values):
            raise VidurImportError(f"{path}: {name} overflow when summed over {layers} layers (values near 1e308?)")
        if not any(v > 0 for v in values):
            raise VidurImportError(f"{path}: {name} are all 0 for this model: nothing was measured")

    # attn_prefill: chunk x context, every node a profiled chunk and a profiled context.
    pre_rows = _rows_by_first(pre)
    chunks, ctxs = _thin(k[0] for k in pre), _thin(k[1] for k in pre)
    pre_z, pre_w = _table(pre_rows, chunks, ctxs, lambda c, p: p)
    pre_z, pre_moved, pre_fills = _repair("attn_prefill", pre_z, pre_w, ("chunk", "context"), (chunks, ctxs))
    # attn_decode: seqs x total context; a cell (n, N) reads row n at N / n tokens per sequence.
    dec_rows = _rows_by_first(dec)
    seqs = sorted(float(n) for n in dec_rows)
    seqs = seqs if len(seqs) <= MAX_SEQ_NODES else _thin(seqs, MAX_SEQ_NODES)
    lo = min(n * dec_rows[int(n)][0][0] for n in seqs)
    hi = max(n * dec_rows[int(n)][0][-1] for n in seqs)
    totals = _ladder(max(lo, 1.0), hi, DECODE_TOTAL_NODES)
    dec_z, dec_w = _table(dec_rows, seqs, totals, lambda n, total: total / n)
    dec_z, dec_moved, dec_fills = _repair("attn_decode", dec_z, dec_w, ("seqs", "context"), (seqs, totals))
    token_nodes = _thin(linear)
    lin_measured = [linear[int(t)] for t in token_nodes]
    lin_y = isotonic(lin_measured)
    lin_moved = [f"linear(tokens={t:g}): {a / MS:.4g} -> {b / MS:.4g} ms" for t, a, b in
                 zip(token_nodes, lin_measured, lin_y) if abs(b - a) > REPAIR_REPORT_REL * abs(a)]

    gpu = GPU_PRESETS.get(device.lower())
    memory = memory_bytes_per_gpu or (gpu.memory_bytes if gpu else DEVICE_MEMORY_BYTES.get(device.lower()))
    if memory is None:
        raise VidurImportError(f"device {device!r}: memory unknown; pass memory_bytes_per_gpu "
                               f"(known: {', '.join([*GPU_PRESETS, *DEVICE_MEMORY_BYTES])})")
    dtype_bytes = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    prof = Profile(
        name=f"vidur-{device}-{shape.name}-tp{tensor_parallel}", model=shape, device=device, dtype=dtype,
        tensor_parallel=tensor_parallel, memory_bytes_per_gpu=int(memory),
        weight_bytes=shape.num_params * dtype_bytes, activation_bytes_per_gpu=activation_bytes_per_gpu,
        kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes), overhead_s=0.0,
        linear=Curve1D(token_nodes, lin_y, name="curves.linear"),
        attn_prefill=Curve2D(chunks, ctxs, pre_z, name="curves.attn_prefill"),
        attn_decode=Curve2D(seqs, totals, dec_z, name="curves.attn_decode"),
        provenance={
            "source": "vidur-profiling", "files": {"mlp": str(mlp_path), "attention": str(attn_path)},
            "sha256": {"mlp": sha256_file(mlp_path), "attention": sha256_file(attn_path)},
            "statistic": "median of Vidur's per-layer operator times (ms -> s)",
            "num_rows": {"mlp": len(mlp_sel), "attention": len(attn_sel)},
            "block_size": block_size or (sizes[0] if sizes else None),
            "not_modelled": ["cpu overheads (overhead_s = 0; Vidur's default skip_cpu_overhead_modeling too)",
                             "LM head and sampling (not in Vidur's mlp.csv)", "tensor-parallel all-reduce",
                             "attention input/output reshape"],
            "activation_bytes_per_gpu": "not in Vidur's files; as given (default 0)",
        })
    prof.provenance["import_report"] = _report(
        prof, shape, linear, pre_rows, dec_rows,
        {"linear": lin_moved, "attn_prefill": pre_moved, "attn_decode": dec_moved},
        {"attn_prefill": (sum(v < 1 for r in pre_w for v in r), pre_fills, len(chunks) * len(ctxs)),
         "attn_decode": (sum(v < 1 for r in dec_w for v in r), dec_fills, len(seqs) * len(totals))})
    return prof


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f}%"


def _report(prof: Profile, shape: ModelShape, linear: dict[int, float],
            pre_rows: dict[int, tuple[list[float], list[float]]], dec_rows: dict[int, tuple[list[float], list[float]]],
            moved: dict[str, list[str]], fills: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """What was measured, what was filled or repaired, and Vidur's adjustments kept or dropped."""
    ctx_lo = min(ks[0] for ks, _ in dec_rows.values())
    ctx_hi = max(ks[-1] for ks, _ in dec_rows.values())
    measured = {
        "linear": f"num_tokens {min(linear)}..{max(linear)} ({len(linear)} values)",
        "attn_prefill": f"prefill_chunk_size {min(pre_rows)}..{max(pre_rows)} ({len(pre_rows)} sizes) x context "
                        f"from 0 up to {max(ks[-1] for ks, _ in pre_rows.values()):g}",
        "attn_decode": f"batch_size {min(dec_rows)}..{max(dec_rows)} ({len(dec_rows)} sizes) x kv_cache_size "
                       f"{ctx_lo:g}..{ctx_hi:g} per sequence",
    }
    how = {"attn_prefill": "context past the chunk's profiled range: continued along the row's mean slope",
           "attn_decode": "context per sequence below the profiled range: held at its first value; above it: "
                          "continued along the row's mean slope"}
    filled = {name: f"{n} of {total} grid cells no profiled row covers ({how[name]}); the repair moved {m} of them"
              for name, (n, m, total) in fills.items()}
    # Vidur's adjustments, sized on this profile.
    tokens = range(1, max(linear) + 1)
    ratio, at = max((prof.linear(-(-t // VIDUR_TOKEN_ROUNDING) * VIDUR_TOKEN_ROUNDING) / prof.linear(t), t)
                    for t in tokens)
    n_ref, k_ref = (32, 1000) if 32 in dec_rows else (min(dec_rows), 1000)
    k_round = -(-k_ref // VIDUR_KV_GRANULARITY) * VIDUR_KV_GRANULARITY
    gqa = shape.num_heads > shape.num_kv_heads
    adjustments = [
        {"adjustment": f"attention batching factor x{1 + VIDUR_BATCHING_OVERHEAD:g}",
         "vidur": "decode attention x1.1 when a batch has more than one decode, prefill attention x1.1 when it "
                  "has more than one prefill; only for GQA models (q heads > kv heads)",
         "import": "dropped",
         "why": "the profiled decode rows already time batched kernels; "
                + ("this model uses GQA, so Vidur would charge batched attention 10% more than measured"
                   if gqa else f"this model is not GQA ({shape.num_heads} q = {shape.num_kv_heads} kv heads), "
                               "so Vidur does not apply it either")},
        {"adjustment": f"context rounded up to a multiple of {VIDUR_KV_GRANULARITY}",
         "vidur": "decode attention looked up at the batch's mean context rounded up, prefill attention at the "
                  "context before the chunk rounded up (kv_cache_prediction_granularity)",
         "import": "dropped",
         "why": "the curves interpolate the profiled grid at the exact context; at "
                f"{n_ref} decodes x {k_ref} context rounding to {k_round} would change attention by "
                f"{_pct(prof.attn_decode(n_ref, n_ref * k_round), prof.attn_decode(n_ref, n_ref * k_ref))}"},
        {"adjustment": f"token count rounded up to a multiple of {VIDUR_TOKEN_ROUNDING}",
         "vidur": "every token-parallel operator priced at the batch's total tokens rounded up (1-8 tokens cost "
                  "as 8, 9-16 as 16, ...)",
         "import": "dropped",
         "why": "linear() is priced at the exact token count, interpolated between profiled counts; the rounding "
                f"would change it by at most {100 * (ratio - 1):+.1f}% on this file (at {at} tokens)"},
        {"adjustment": "one attention lookup for all prefills of a batch",
         "vidur": "prefill attention of several chunks looked up once at the summed context and the "
                  "root-sum-square chunk size", "import": "dropped",
         "why": "attn_prefill is summed over the batch's chunks, each at its own chunk and context"},
    ]
    return {"measured": measured, "filled": filled,
            "monotone_repair": [*moved["linear"], *moved["attn_prefill"], *moved["attn_decode"]],
            "monotone_repair_note": f"measured values the monotone repair moved by more than "
                                    f"{100 * REPAIR_REPORT_REL:g}% (smallest change, filled cells yield first)",
            "vidur_adjustments": adjustments}


def format_report(prof: Profile) -> str:
    """The import report as text (what the CLI prints)."""
    r = prof.provenance["import_report"]
    lines = [f"imported {prof.name}: {prof.provenance['num_rows']['mlp']} mlp rows, "
             f"{prof.provenance['num_rows']['attention']} attention rows"]
    lines += [f"  measured {k}: {v}" for k, v in r["measured"].items()]
    lines += [f"  filled {k}: {v}" for k, v in r["filled"].items()]
    repairs = r["monotone_repair"]
    lines.append(f"  monotone repair: {len(repairs)} {r['monotone_repair_note']}" + (":" if repairs else ""))
    lines += [f"    {text}" for text in repairs[:10]] + ([f"    ... and {len(repairs) - 10} more"]
                                                         if len(repairs) > 10 else [])
    lines.append("  Vidur's cost adjustments:")
    lines += [f"    {a['import']}: {a['adjustment']} ({a['vidur']}): {a['why']}" for a in r["vidur_adjustments"]]
    lines.append(f"  not modelled: {'; '.join(prof.provenance['not_modelled'])}")
    return "\n".join(lines)


def _model_from(spec: str | None, mlp_path: Path) -> ModelShape:
    if spec is not None:
        if spec.lower() in MODEL_PRESETS:
            return MODEL_PRESETS[spec.lower()]
        path = Path(spec)
        if path.is_file():
            import json

            from sim.cost.presets import model_shape_from_hf
            try:
                return model_shape_from_hf(json.loads(path.read_text()), path.parent.name or path.stem)
            except (ValueError, json.JSONDecodeError) as exc:
                raise VidurImportError(f"{path}: {str(exc).splitlines()[0]}") from None
        raise VidurImportError(f"--model {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}) "
                               f"nor an HF config.json file")
    rows = _read(mlp_path, ("n_head", "n_kv_head", "n_embd", "n_expanded_embd"))
    held = {tuple(int(_num(rows, i, k, mlp_path)) for k in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd"))
            for i in range(len(rows))}
    match = [m for m in MODEL_PRESETS.values()
             if (m.num_heads, m.num_kv_heads, m.hidden_size, m.intermediate_size) in held]
    if len(match) != 1:
        raise VidurImportError(f"{mlp_path}: cannot tell the model from its shape "
                               f"({len(match)} presets match); pass --model")
    return match[0]


def _gpu_from(spec: str | None, mlp_path: Path) -> str:
    if spec is not None:
        if spec.lower() in GPU_PRESETS or spec.lower() in DEVICE_MEMORY_BYTES:
            return spec.lower()
        raise VidurImportError(f"--gpu {spec!r}: unknown; known: {', '.join(GPU_PRESETS)}")
    for part in mlp_path.resolve().parts:
        if part.lower() in VIDUR_DEVICE_TO_GPU:
            return VIDUR_DEVICE_TO_GPU[part.lower()]
    raise VidurImportError(f"{mlp_path}: no Vidur device folder in the path; pass --gpu ({', '.join(GPU_PRESETS)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m calibrate.vidur_import",
                                 description="Vidur profiling CSVs (mlp.csv, attention.csv) -> a batchsim profile")
    ap.add_argument("--mlp", required=True, help="Vidur's mlp.csv")
    ap.add_argument("--attention", required=True, help="Vidur's attention.csv")
    ap.add_argument("--out", required=True, help="profile file to write (.yaml or .json)")
    ap.add_argument("--model", help="model preset or HF config.json (default: the preset matching mlp.csv's shape)")
    ap.add_argument("--gpu", help="GPU preset (default: from Vidur's device folder in the path, a100 -> a100-80gb)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel degree (default 1)")
    ap.add_argument("--block-size", type=int, help="attention rows' block_size when the file has several")
    args = ap.parse_args(argv)
    try:
        mlp = Path(args.mlp)
        model, gpu = _model_from(args.model, mlp), _gpu_from(args.gpu, mlp)
        out = Path(args.out)
        if out.suffix not in (".yaml", ".yml", ".json"):
            raise VidurImportError(f"--out {out}: use a .yaml or .json file name")
        if out.is_dir() or not out.parent.is_dir():
            raise VidurImportError(f"--out {out}: {'is a folder' if out.is_dir() else 'its folder does not exist'}; "
                                   f"give a file path in an existing folder")
        prof = import_vidur(mlp, args.attention, model, gpu, args.tp, block_size=args.block_size)
        prof.save(out)
    except (ValueError, OSError) as exc:      # VidurImportError is a ValueError
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_report(prof))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
