"""Import Vidur's published operator profiles into a batchsim Profile; torch-free.

Vidur (github.com/microsoft/vidur) publishes, per device and model,
``data/profiling/compute/<device>/<org>/<model>/mlp.csv`` and
``attention.csv``: one row per profiled shape, times of *one layer's*
operators in milliseconds (``time_stats.<op>.{min,max,mean,median,std}``).
We read the medians and map them onto our four curves:

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

Cells a file does not cover (a prefill chunk past the model's context, a
decode total beyond n x the longest profiled context) are filled by linear
continuation along the context axis. Not in these files, so not modelled:
CPU overheads (overhead_s = 0), tensor-parallel all-reduce, attention
input/output reshapes (Vidur's predictor skips them too).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any, Iterable, Mapping

from calibrate.schema import model_shape_from_spec, sha256_file
from sim.curves import Curve1D, Curve2D
from sim.profile import GIB, Profile

MS = 1e-3
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
OPTIONAL_OPS = ("input_layernorm", "post_attention_layernorm", "add", "emb")
MLP_KEYS = ("num_tokens", "num_tensor_parallel_workers", "n_head", "n_kv_head", "n_embd", "n_expanded_embd")
ATTN_KEYS = ("batch_size", "prefill_chunk_size", "kv_cache_size", "num_tensor_parallel_workers",
             "n_q_head", "n_kv_head", "n_embd")
# Device memory per GPU, for the devices Vidur publishes (override with memory_bytes_per_gpu).
DEVICE_MEMORY_BYTES = {"a100": 80 * GIB, "h100": 80 * GIB, "a40": 48 * GIB, "h200": 141 * 10**9}
MAX_NODES = 48


class VidurImportError(ValueError):
    """A Vidur file that cannot be used; the message names the file and the column."""


def _read(path: Path, required: Iterable[str]) -> list[dict[str, str]]:
    if not path.is_file():
        raise VidurImportError(f"{path}: file not found")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise VidurImportError(f"{path}: missing column(s) {missing}; is this Vidur's "
                                   f"{path.name} (data/profiling/compute/<device>/<model>/)?")
        return list(reader)


def _num(row: Mapping[str, str], col: str, path: Path, optional: bool = False) -> float:
    value = row.get(col, "")
    if value in ("", None):
        if optional:
            return 0.0
        raise VidurImportError(f"{path}: empty value in column {col!r} (row {dict(row)})")
    try:
        return float(value)
    except ValueError:
        raise VidurImportError(f"{path}: column {col!r} has non-numeric value {value!r}") from None


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


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), linear continuation outside; one point -> constant."""
    if len(xs) == 1:
        return ys[0]
    i = max(0, min(len(xs) - 2, next((j - 1 for j, v in enumerate(xs) if v > x), len(xs) - 1)))
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


def import_vidur(mlp_csv: str | Path, attention_csv: str | Path, model: str | Mapping[str, Any],
                 device: str, tensor_parallel: int = 1, *, block_size: int | None = None,
                 memory_bytes_per_gpu: int | None = None, activation_bytes_per_gpu: int = 0,
                 dtype: str = "float16") -> Profile:
    """Build a Profile from Vidur's mlp.csv and attention.csv for ``model`` at ``tensor_parallel``.

    Rows are selected by the model's shape (heads, kv heads, hidden, MLP size)
    and num_tensor_parallel_workers; ``block_size`` picks among attention rows
    profiled with several. Raises VidurImportError (a ValueError) naming the
    file and the missing column or the shapes the file does hold.
    """
    mlp_path, attn_path = Path(mlp_csv), Path(attention_csv)
    shape = model_shape_from_spec(model)
    ops = [f"time_stats.{op}.median" for op in LAYER_OPS + ("emb",)]
    mlp_rows = _read(mlp_path, MLP_KEYS + tuple(c for c, op in zip(ops, LAYER_OPS + ("emb",))
                                                if op not in OPTIONAL_OPS))
    attn_rows = _read(attn_path, ATTN_KEYS + ("time_stats.attn_prefill.median", "time_stats.attn_decode.median"))
    want_mlp = (shape.num_heads, shape.num_kv_heads, shape.hidden_size, shape.intermediate_size, tensor_parallel)
    mlp_keys = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tensor_parallel_workers")
    mlp_sel = [r for r in mlp_rows if tuple(int(_num(r, k, mlp_path)) for k in mlp_keys) == want_mlp]
    if not mlp_sel:
        held = sorted({tuple(r[k] for k in mlp_keys) for r in mlp_rows})
        raise VidurImportError(f"{mlp_path}: no rows for {dict(zip(mlp_keys, want_mlp))}; "
                               f"the file holds {mlp_keys} = {held}")
    want_attn = (shape.num_heads, shape.num_kv_heads, shape.hidden_size, tensor_parallel)
    attn_keys = ("n_q_head", "n_kv_head", "n_embd", "num_tensor_parallel_workers")
    attn_sel = [r for r in attn_rows if tuple(int(_num(r, k, attn_path)) for k in attn_keys) == want_attn]
    sizes = sorted({r.get("block_size", "") for r in attn_sel})
    if block_size is not None:
        attn_sel = [r for r in attn_sel if r.get("block_size") == str(block_size)]
    elif len(sizes) > 1:
        raise VidurImportError(f"{attn_path}: rows for several block sizes {sizes}; pass block_size")
    if not attn_sel:
        held = sorted({tuple(r[k] for k in attn_keys) for r in attn_rows})
        raise VidurImportError(f"{attn_path}: no rows for {dict(zip(attn_keys, want_attn))} "
                               f"(block_size {block_size}); the file holds {attn_keys} = {held}")

    layers = shape.num_layers
    linear = _median_by_key(
        (int(_num(r, "num_tokens", mlp_path)),
         MS * (layers * sum(_num(r, c, mlp_path, op in OPTIONAL_OPS) for c, op in zip(ops, LAYER_OPS))
               + _num(r, ops[-1], mlp_path, True))) for r in mlp_sel)
    save = "time_stats.attn_kv_cache_save.median"
    points: dict[bool, list[tuple[tuple[int, int], float]]] = {True: [], False: []}
    for r in attn_sel:
        chunk = int(_num(r, "prefill_chunk_size", attn_path))
        first = chunk or int(_num(r, "batch_size", attn_path))      # prefill: chunk; decode: seqs
        col = "time_stats.attn_prefill.median" if chunk else "time_stats.attn_decode.median"
        value = MS * layers * (_num(r, col, attn_path) + _num(r, save, attn_path, True))
        points[chunk > 0].append(((first, int(_num(r, "kv_cache_size", attn_path))), value))
    pre, dec = _median_by_key(points[True]), _median_by_key(points[False])
    for name, table in (("prefill (prefill_chunk_size > 0)", pre), ("decode (prefill_chunk_size == 0)", dec)):
        if len({k[0] for k in table}) < 2 or len({k[1] for k in table}) < 2:
            raise VidurImportError(f"{attn_path}: needs {name} rows at >= 2 sizes and >= 2 "
                                   f"kv_cache_size values for this model, found {sorted(table)}")

    def row_curve(table: dict[tuple[int, int], float], first: float) -> tuple[list[float], list[float]]:
        pts = sorted((k, v) for (f, k), v in table.items() if f == first)
        return [float(k) for k, _ in pts], [v for _, v in pts]

    chunks = _thin(k[0] for k in pre)
    ctxs = _thin(k[1] for k in pre)
    pre_z = [[_interp(*row_curve(pre, c), k) for k in ctxs] for c in chunks]
    seqs = _thin(k[0] for k in dec)
    totals = _thin(b * k for b in seqs for k in _thin(k2 for _, k2 in dec))
    dec_z = [[_interp(*row_curve(dec, b), total / b) for total in totals] for b in seqs]
    token_nodes = _thin(linear)
    memory = memory_bytes_per_gpu or DEVICE_MEMORY_BYTES.get(device.lower())
    if memory is None:
        raise VidurImportError(f"device {device!r}: memory unknown; pass memory_bytes_per_gpu "
                               f"(known: {', '.join(DEVICE_MEMORY_BYTES)})")
    dtype_bytes = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    return Profile(
        name=f"vidur-{device}-{shape.name}-tp{tensor_parallel}", model=shape, device=device, dtype=dtype,
        tensor_parallel=tensor_parallel, memory_bytes_per_gpu=int(memory),
        weight_bytes=shape.num_params * dtype_bytes, activation_bytes_per_gpu=activation_bytes_per_gpu,
        kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes), overhead_s=0.0,
        linear=Curve1D(token_nodes, [linear[int(t)] for t in token_nodes], name="curves.linear"),
        attn_prefill=Curve2D(chunks, ctxs, pre_z, name="curves.attn_prefill"),
        attn_decode=Curve2D(seqs, totals, dec_z, name="curves.attn_decode"),
        provenance={
            "source": "vidur-profiling", "files": {"mlp": str(mlp_path), "attention": str(attn_path)},
            "sha256": {"mlp": sha256_file(mlp_path), "attention": sha256_file(attn_path)},
            "statistic": "median of Vidur's per-layer operator times (ms -> s)",
            "num_rows": {"mlp": len(mlp_sel), "attention": len(attn_sel)},
            "block_size": block_size or (sizes[0] if sizes else None),
            "not_modelled": ["cpu overheads (overhead_s = 0)", "tensor-parallel all-reduce",
                             "attention input/output reshape"],
            "activation_bytes_per_gpu": "not in Vidur's files; as given (default 0)",
        })
