"""Trace and length-file loaders, tolerant of the formats providers publish.

Understood out of the box (column names matched case-insensitively):
  batchsim / bundled:  arrival_time_s, prompt_tokens, output_tokens
  Azure LLM 2023/24:   TIMESTAMP (datetime), ContextTokens, GeneratedTokens
  Vidur / Sarathi:     arrived_at, num_prefill_tokens, num_decode_tokens
  Mooncake (JSONL):    timestamp (ms), input_length, output_length
  BurstGPT:            Timestamp (s), Request tokens, Response tokens
Other names can be given with ``arrivals.columns: {arrival, prompt, output}``.
An optional ``max_tokens`` column gives each request its own client cap.

Rows with a zero output (BurstGPT logs failed calls that way) cannot be
replayed and are dropped with a count; anything else malformed is an error
that names the file, the row and the column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sim.config import ConfigError

ALIASES: dict[str, tuple[str, ...]] = {
    "arrival": ("arrival_time_s", "timestamp", "arrived_at", "arrival_time", "arrival_s",
                "time", "time_s"),
    "prompt": ("prompt_tokens", "contexttokens", "num_prefill_tokens", "input_length",
               "request tokens", "input_tokens", "prompt_len", "num_prompt_tokens"),
    "output": ("output_tokens", "generatedtokens", "num_decode_tokens", "output_length",
               "response tokens", "completion_tokens", "output_len", "num_output_tokens"),
    "max_tokens": ("max_tokens", "max_output_tokens"),
}


@dataclass(frozen=True)
class TraceData:
    """Arrival offsets (s, first = 0; None for length-only files) and lengths."""

    arrival_s: np.ndarray | None
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    num_dropped: int = 0
    max_tokens: np.ndarray | None = None    # per-request client max_tokens, if the file has it


def _read_table(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise ConfigError(f"{path}: trace file not found (check arrivals.path / lengths.path)")
    try:
        if path.suffix in (".jsonl", ".json"):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            return pd.DataFrame(rows)
        return pd.read_csv(path, skipinitialspace=True)
    except (json.JSONDecodeError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot parse as {'JSON lines' if path.suffix.startswith('.json') else 'CSV'}: "
                          f"{str(exc).splitlines()[0]}") from None
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{path}: the file is empty (expected a header and rows)") from None


def _find(df: pd.DataFrame, role: str, given: dict[str, str] | None, path: Path) -> str | None:
    if given and role in given:
        if given[role] not in df.columns:
            raise ConfigError(f"{path}: column '{given[role]}' (arrivals.columns.{role}) not found; "
                              f"columns are: {', '.join(map(str, df.columns))}")
        return given[role]
    lower = {str(c).strip().lower(): c for c in df.columns}
    for name in ALIASES[role]:
        if name in lower:
            return lower[name]
    return None


MAX_TOKENS = 2**31 - 1


def _tokens(df: pd.DataFrame, col: str, path: Path) -> np.ndarray:
    values = pd.to_numeric(df[col], errors="coerce")
    # > 2^31 tokens is no request any model serves (and would overflow int64 casts of floats).
    bad = values.isna() | (values < 0) | (values > MAX_TOKENS) | (values != np.floor(values.fillna(0)))
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ConfigError(f"{path}: column '{col}' row {row + 2}: expected a non-negative integer "
                          f"token count up to {MAX_TOKENS}, got {str(df[col].iloc[row])!r}")
    return values.to_numpy(dtype=np.int64)


def _times(df: pd.DataFrame, col: str, unit: str | None, path: Path) -> np.ndarray:
    raw = df[col]
    numeric = pd.to_numeric(raw, errors="coerce")
    if unit == "datetime" or (unit is None and numeric.isna().all()):
        parsed = pd.to_datetime(raw, errors="coerce", utc=True, format="mixed")
        if parsed.isna().any():
            row = int(np.flatnonzero(parsed.isna().to_numpy())[0])
            raise ConfigError(f"{path}: column '{col}' row {row + 2}: cannot parse timestamp {raw.iloc[row]!r}")
        ns = parsed.astype("int64").to_numpy()
        return (ns - ns.min()) / 1e9
    bad = numeric.isna() | ~np.isfinite(numeric.fillna(0))
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ConfigError(f"{path}: column '{col}' row {row + 2}: expected a finite number, got {str(raw.iloc[row])!r}")
    t = numeric.to_numpy(dtype=np.float64)
    if unit is None:
        # Mooncake stores integer milliseconds in 'timestamp'.
        unit = "ms" if str(col).lower() == "timestamp" and np.all(t == np.floor(t)) and t.max() > 1e4 else "s"
    t = t * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
    return t - t.min()


def load_trace(path: Path, *, need_arrivals: bool, columns: dict[str, str] | None = None,
               time_unit: str | None = None) -> TraceData:
    """Load a timed trace or a length-only file into arrays, in arrival order."""
    df = _read_table(path)
    if len(df) == 0:
        raise ConfigError(f"{path}: the file has a header but no rows")
    prompt_col = _find(df, "prompt", columns, path)
    output_col = _find(df, "output", columns, path)
    arrival_col = _find(df, "arrival", columns, path)
    missing = [r for r, c in (("prompt", prompt_col), ("output", output_col)) if c is None]
    if need_arrivals and arrival_col is None:
        missing.insert(0, "arrival")
    if missing:
        want = {"arrival": "arrival_time_s", "prompt": "prompt_tokens", "output": "output_tokens"}
        raise ConfigError(f"{path}: missing column(s) {', '.join(want[m] for m in missing)}; found "
                          f"{', '.join(map(str, df.columns))}; rename them or set arrivals.columns")
    prompt = _tokens(df, prompt_col, path)
    output = _tokens(df, output_col, path)
    arrival = _times(df, arrival_col, time_unit, path) if (need_arrivals and arrival_col) else None
    max_col = _find(df, "max_tokens", columns, path)
    max_tokens = _tokens(df, max_col, path) if max_col is not None else None
    keep = (prompt > 0) & (output > 0)
    if arrival is not None:
        order = np.argsort(arrival, kind="stable")
        arrival, prompt, output, keep = arrival[order], prompt[order], output[order], keep[order]
        max_tokens = max_tokens[order] if max_tokens is not None else None
    dropped = int((~keep).sum())
    if dropped == len(keep):
        raise ConfigError(f"{path}: every row has a zero prompt or output token count")
    if dropped:
        prompt, output = prompt[keep], output[keep]
        arrival = arrival[keep] if arrival is not None else None
        max_tokens = max_tokens[keep] if max_tokens is not None else None
        if arrival is not None:
            arrival = arrival - arrival[0]
    if max_tokens is not None and (max_tokens < 1).any():
        raise ConfigError(f"{path}: column '{max_col}' must hold positive integers")
    return TraceData(arrival, prompt, output, dropped, max_tokens)
