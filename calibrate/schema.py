"""Raw calibration measurements and their provenance; torch-free.

A raw table is a CSV: two ``#`` comment lines (format version, then the
metadata as one JSON object), a header, and one row per timed batch shape.
``pandas.read_csv(path, comment="#")`` reads the rows; ``read_raw_csv`` also
returns the metadata. Tables whose key metadata (``CHECKED_METADATA``)
disagree must not be mixed: ``check_same_metadata`` refuses them (pyperf).

Format history (``FORMAT_VERSION``):
  1 - first version: columns ``RAW_COLUMNS``; metadata keys as in
      ``calibrate.runner`` (device, torch, cuda, dtype, model, threads, date,
      git revision, warmup/repeats).
"""

from __future__ import annotations

import csv
import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from sim.core.batch import Batch, BatchItem
from sim.cost.presets import model_shape_from_dict
from sim.cost.profile import ModelShape, Profile

FORMAT_VERSION = 1
RAW_COLUMNS: tuple[str, ...] = (
    "kind", "split", "num_tokens", "num_decodes", "decode_context", "decode_max_context",
    "prefill_chunks", "decode_contexts", "num_warmup", "num_repeats",
    "min_s", "median_s", "p90_s", "device_min_s", "device_median_s", "predicted_s",
)
CHECKED_METADATA: tuple[str, ...] = ("device_name", "dtype", "model", "torch_version", "num_threads")


@dataclass(frozen=True, slots=True)
class Shape:
    """What the cost model sees of one batch.

    prefills: (chunk tokens, context before) per item computing > 1 token.
    decode_contexts: context before, per item computing exactly 1 token.
    """

    prefills: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c for c, _ in self.prefills) + len(self.decode_contexts)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_contexts)

    @property
    def decode_context(self) -> int:
        """Total context of the decodes (the profile's attn_decode axis)."""
        return sum(self.decode_contexts)

    def to_batch(self) -> Batch:
        """The batch this shape describes (decodes first), with request ids 0, 1, ..."""
        items = [BatchItem(i, 1, k) for i, k in enumerate(self.decode_contexts)]
        items += [BatchItem(len(items) + i, c, k) for i, (c, k) in enumerate(self.prefills)]
        return Batch(tuple(items))

    @property
    def num_kv_tokens(self) -> int:
        """KV slots the batch touches after the step (what its block tables must hold)."""
        return sum(c + k for c, k in self.prefills) + sum(k + 1 for k in self.decode_contexts)


@dataclass(frozen=True, slots=True)
class Measurement:
    """One timed shape. ``kind``: empty | decode | prefill | multi_prefill | mixed | holdout.

    min_s, median_s, p90_s: over all timed calls (warm-ups excluded), host
        clock. ``median_s`` is the value fitted and checked: a live step
        takes the typical time, and fitting the fastest call left live steps
        ~12% slower than predicted on the CPU (1-2 ms steps, where caches and
        the allocator matter). ``min_s`` is the machine's best case, kept to
        show how noisy the run was.
    device_min_s, device_median_s: CUDA-event time (CUDA only).
    predicted_s: the fitted profile's step_time_s (held-out rows).
    """

    kind: str
    split: str                  # "fit" or "holdout"
    shape: Shape
    num_warmup: int
    num_repeats: int
    min_s: float
    median_s: float
    p90_s: float
    device_min_s: float | None = None
    device_median_s: float | None = None
    predicted_s: float | None = None

    def to_row(self) -> dict[str, Any]:
        s = self.shape
        return {
            "kind": self.kind, "split": self.split, "num_tokens": s.num_tokens,
            "num_decodes": s.num_decodes, "decode_context": s.decode_context,
            "decode_max_context": max(s.decode_contexts, default=0),
            "prefill_chunks": ";".join(f"{c}@{k}" for c, k in s.prefills),
            "decode_contexts": ";".join(str(k) for k in s.decode_contexts),
            "num_warmup": self.num_warmup, "num_repeats": self.num_repeats,
            "min_s": self.min_s, "median_s": self.median_s, "p90_s": self.p90_s,
            "device_min_s": _blank(self.device_min_s), "device_median_s": _blank(self.device_median_s),
            "predicted_s": _blank(self.predicted_s),
        }

    @classmethod
    def from_row(cls, row: Mapping[str, str]) -> Measurement:
        pre = tuple(tuple(int(v) for v in p.split("@")) for p in row["prefill_chunks"].split(";") if p)
        dec = tuple(int(v) for v in row["decode_contexts"].split(";") if v)

        def opt(key: str) -> float | None:
            return float(row[key]) if row.get(key) not in (None, "") else None

        return cls(row["kind"], row["split"], Shape(pre, dec),  # type: ignore[arg-type]
                   int(row["num_warmup"]), int(row["num_repeats"]), float(row["min_s"]),
                   float(row["median_s"]), float(row["p90_s"]), opt("device_min_s"),
                   opt("device_median_s"), opt("predicted_s"))


def _blank(x: float | None) -> float | str:
    return "" if x is None else x


# ---- errors ------------------------------------------------------------------
def errors_pct(measured: list[Measurement], profile: Profile) -> dict[str, float]:
    """|predicted - measured| / measured over ``median_s``: mean (MAPE), p90, max, count."""
    err = sorted(abs(profile.step_time_s(m.shape.to_batch()) - m.median_s) / m.median_s * 100
                 for m in measured)
    if not err:
        raise ValueError("no measurements to compare with the profile")
    p90 = err[min(len(err) - 1, int(round(0.9 * (len(err) - 1))))]
    return {"mape_pct": sum(err) / len(err), "p90_abs_pct": p90, "max_abs_pct": err[-1],
            "num_points": len(err)}


def holdout_table(measurements: list[Measurement], fit_error: Mapping[str, Any],
                  num_rows: int = 5) -> str:
    """The self-check summary and its worst held-out rows, as text."""
    fe = fit_error
    rows = sorted((m for m in measurements if m.split == "holdout" and m.predicted_s is not None),
                  key=lambda m: -abs(m.predicted_s - m.median_s) / m.median_s)  # type: ignore[operator]
    lines = [f"self-check on {fe['holdout_num_points']} held-out batches: MAPE "
             f"{fe['holdout_mape_pct']:.1f}%  p90 {fe['holdout_p90_abs_pct']:.1f}%  max "
             f"{fe['holdout_max_abs_pct']:.1f}%   (fit set: MAPE {fe['fit_mape_pct']:.1f}% on "
             f"{fe['fit_num_points']} shapes)",
             f"{'tokens':>7} {'chunks':>6} {'decodes':>7} {'dec ctx':>8} {'measured ms':>12} "
             f"{'predicted ms':>13} {'err %':>6}"]
    for m in rows[:num_rows]:
        s, pred = m.shape, m.predicted_s or 0.0
        lines.append(f"{s.num_tokens:>7} {len(s.prefills):>6} {s.num_decodes:>7} {s.decode_context:>8} "
                     f"{m.median_s * 1e3:>12.2f} {pred * 1e3:>13.2f} {(pred - m.median_s) / m.median_s * 100:>+6.1f}")
    return "\n".join(lines)


# ---- files ------------------------------------------------------------------
class RawCsvWriter:
    """Streams rows to ``path`` as they are measured (an interrupted run keeps them)."""

    def __init__(self, path: str | Path, metadata: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", newline="")
        self._file.write(f"# batchsim raw measurements, format_version={FORMAT_VERSION}\n")
        self._file.write(f"# metadata: {json.dumps(dict(metadata), sort_keys=True, default=str)}\n")
        self._writer = csv.DictWriter(self._file, fieldnames=RAW_COLUMNS)
        self._writer.writeheader()

    def write(self, m: Measurement) -> None:
        self._writer.writerow(m.to_row())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_raw_csv(path: str | Path, metadata: Mapping[str, Any],
                  measurements: Iterable[Measurement]) -> None:
    """Write a whole table (header + rows)."""
    writer = RawCsvWriter(path, metadata)
    try:
        for m in measurements:
            writer.write(m)
    finally:
        writer.close()


def read_raw_csv(path: str | Path) -> tuple[dict[str, Any], list[Measurement]]:
    """Read a raw table back. ValueError names the file and what is wrong."""
    path = Path(path)
    lines = path.read_text().splitlines()
    if len(lines) < 3 or not lines[0].startswith("# batchsim raw measurements"):
        raise ValueError(f"{path}: not a batchsim raw-measurement CSV (first line must be "
                         f"'# batchsim raw measurements, format_version=N')")
    version = lines[0].rsplit("format_version=", 1)[-1].strip()
    if version != str(FORMAT_VERSION):
        raise ValueError(f"{path}: format_version {version}; this batchsim reads {FORMAT_VERSION}")
    if not lines[1].startswith("# metadata: "):
        raise ValueError(f"{path}: second line must be '# metadata: {{...json...}}'")
    metadata = json.loads(lines[1][len("# metadata: "):])
    reader = csv.DictReader(lines[2:])
    missing = [c for c in RAW_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")
    return metadata, [Measurement.from_row(r) for r in reader]


def check_same_metadata(a: Mapping[str, Any], b: Mapping[str, Any], source: str) -> None:
    """Refuse to combine two tables measured under different key conditions."""
    diff = [k for k in CHECKED_METADATA if a.get(k) != b.get(k)]
    if diff:
        detail = ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in diff)
        raise ValueError(f"{source}: tables disagree on {detail}; measure them again together")


# ---- provenance ---------------------------------------------------------------
def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_shape_from_spec(spec: str | Mapping[str, Any]) -> ModelShape:
    """``calibrate.model.get_model_shape`` that imports torch only for a preset
    name (the tiny presets live beside the torch model); a dict is read here."""
    if isinstance(spec, Mapping):
        return model_shape_from_dict(spec)
    from calibrate.model import get_model_shape     # imports torch; only when needed

    return get_model_shape(spec)
