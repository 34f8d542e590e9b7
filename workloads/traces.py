"""Trace and length-file loaders, tolerant of the formats providers publish.

Understood out of the box (column names matched case-insensitively):
  batchsim / bundled:  arrival_time_s, prompt_tokens, output_tokens
  Azure LLM 2023/24:   TIMESTAMP (datetime), ContextTokens, GeneratedTokens
  Vidur / Sarathi:     arrived_at, num_prefill_tokens, num_decode_tokens
  Mooncake (JSONL):    timestamp (ms), input_length, output_length, hash_ids
  BurstGPT:            Timestamp (s), Request tokens, Response tokens
Other names can be given with ``arrivals.columns: {arrival, prompt, output}``.

Files: CSV (comma, tab or semicolon separated), JSON lines or a JSON array of
objects (``.jsonl``, ``.json``, ``.ndjson``), each optionally gzipped (``.gz``).
Numeric times without ``arrivals.time_unit`` are seconds from the start
(Mooncake's: milliseconds), or epoch times in s, ms, us or ns told apart by
their magnitude; datetimes are ISO 8601 or one consistent format.
An optional ``max_tokens`` column gives each request its own client cap.
An optional ``hash_ids`` column (Mooncake's, Alibaba's) gives each request's
prompt-block ids, for prefix caching: a JSON list in JSON files; in a CSV, ids
separated by spaces or commas (commas quoted, except in a last column named
hash_ids, whose extra fields are more ids), or a JSON list string. An empty
cell, a missing key or an empty list is a request with no ids. A CSV's first
row with more fields than the header is an error (pandas would shift every
column by one).

Rows with a zero output (BurstGPT logs failed calls that way) cannot be
replayed and are dropped with a count; anything else malformed is an error
that names the file, the row and the column.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sim.base.strict import MAX_COUNT, MAX_SPAN_S, ConfigError

ALIASES: dict[str, tuple[str, ...]] = {
    "arrival": ("arrival_time_s", "timestamp", "arrived_at", "arrival_time", "arrival_s",
                "time", "time_s"),
    "prompt": ("prompt_tokens", "contexttokens", "num_prefill_tokens", "input_length",
               "request tokens", "input_tokens", "prompt_len", "num_prompt_tokens"),
    "output": ("output_tokens", "generatedtokens", "num_decode_tokens", "output_length",
               "response tokens", "completion_tokens", "output_len", "num_output_tokens"),
    "max_tokens": ("max_tokens", "max_output_tokens"),
    "hash_ids": ("hash_ids",),
}


@dataclass(frozen=True)
class TraceData:
    """Arrival offsets (s, first = 0; None for length-only files) and lengths."""

    arrival_s: np.ndarray | None
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    num_dropped: int = 0
    max_tokens: np.ndarray | None = None    # per-request client max_tokens, if the file has it
    # A hash_ids column, flat: row i's ids are hash_ids[hash_starts[i]:hash_starts[i + 1]] (None: no column).
    hash_ids: np.ndarray | None = None      # int64, 0 .. MAX_HASH_ID
    hash_starts: np.ndarray | None = None   # int64, rows + 1 offsets


JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _kind(path: Path) -> str:
    """'json' for JSON lines or a JSON array (``.jsonl``, ``.json``, ``.ndjson``,
    any case, optionally gzipped), else 'csv'."""
    name = path.name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return "json" if name.endswith(JSON_SUFFIXES) else "csv"


def _read_text(path: Path) -> str:
    """The file's text (gunzipped if it ends in .gz), without a UTF-8 byte-order mark."""
    data = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode("utf-8-sig")


def _read_json(path: Path, text: str) -> pd.DataFrame:
    """A JSON array of objects, or JSON lines (one object per line); the
    frame's ``attrs['where']`` names each row's place in the file."""
    if text.lstrip().startswith("["):
        rows = json.loads(text)
        where = [f"item {k + 1}" for k in range(len(rows))]
    else:
        rows, where = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}: line {number}: cannot parse as JSON: {exc.msg} "
                                      f"(column {exc.colno})") from None
                where.append(f"line {number}")
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: expected JSON objects, one per request (JSON lines, or an array of "
                          f"objects), with an arrival time and token counts")
    if not rows:
        raise ConfigError(f"{path}: the file holds no requests (expected JSON objects, one per request: JSON "
                          f"lines, or an array of objects)")
    bad = next((k for k, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ConfigError(f"{path}: {where[bad]}: expected a JSON object (one request: an arrival time and token "
                          f"counts), got {_json_kind(rows[bad])}")
    df = pd.DataFrame(rows)
    _unique_names(path, [str(c) for c in df.columns])
    df.attrs["where"] = where
    return df


def _json_kind(value: object) -> str:
    """'an array', 'null', 'the number 3', ...: a JSON value that is not an object, in words."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    return f"the {'string' if isinstance(value, str) else 'number'} {json.dumps(value)[:40]}"


def _unique_names(path: Path, names: list[str]) -> None:
    """Refuse a header that names a column twice (columns are matched case-insensitively:
    'Prompt_Tokens' beside 'prompt_tokens' is the same name): which one is meant is a guess."""
    seen: dict[str, str] = {}
    for name in names:
        key = name.strip().lower()
        if key and key in seen:
            same = f"'{name}'" if seen[key] == name else f"'{seen[key]}' and '{name}'"
            raise ConfigError(f"{path}: the header names one column twice: {same} (names are matched "
                              f"case-insensitively); rename or drop one")
        seen[key] = name


def _separator(header: str) -> str:
    """The CSV's field separator, from its header line: a comma, else a tab or a semicolon."""
    if "," not in header:
        for sep in ("\t", ";"):
            if sep in header:
                return sep
    return ","


def _ids_last(text: str, width: int) -> io.StringIO:
    """A CSV whose last column is hash_ids, with unquoted commas between the ids
    tolerated: a row's fields past the header's width are more ids (the text
    rewritten with each row's ids in one quoted field)."""
    rows = list(csv.reader(io.StringIO(text), skipinitialspace=True))
    out = io.StringIO()
    writer = csv.writer(out)
    for row in rows:
        writer.writerow(row[:width - 1] + [" ".join(row[width - 1:])] if len(row) > width else row)
    out.seek(0)
    return out


def _read_table(path: Path) -> pd.DataFrame:
    if not path.is_file():
        if path.is_dir():
            raise ConfigError(f"{path}: is a folder, not a trace file (check arrivals.path / lengths.path)")
        if path.exists():
            raise ConfigError(f"{path}: is not a regular file (a device or a pipe); give a trace file "
                              f"(arrivals.path / lengths.path)")
        raise ConfigError(f"{path}: trace file not found (check arrivals.path / lengths.path)")
    kind = _kind(path)
    try:
        if kind == "json":
            return _read_json(path, _read_text(path))
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8-sig") as f:
            header, first = f.readline(), f.readline()
        sep = _separator(header)
        names = [name.strip().strip('"') for name in header.rstrip("\r\n").split(sep)]
        _unique_names(path, names)
        if sep == "," and names[-1].lower() in ALIASES["hash_ids"]:
            return pd.read_csv(_ids_last(_read_text(path), len(names)), sep=sep, skipinitialspace=True)
        # pandas reads a first row one field longer than the header as (row label, fields), every
        # column shifted by one: refuse it (a longer later row is a parse error below)
        if len(next(csv.reader([first], delimiter=sep), [])) > len(names):
            raise ConfigError(f"{path}: row 2 has more fields than the header's {len(names)} "
                              f"({', '.join(names)}); quote a field that holds the separator")
        return pd.read_csv(path, sep=sep, skipinitialspace=True, encoding="utf-8-sig")
    except (json.JSONDecodeError, pd.errors.ParserError, csv.Error, UnicodeDecodeError, gzip.BadGzipFile, EOFError,
            zlib.error) as exc:
        what = "JSON lines or a JSON array" if kind == "json" else "CSV"
        raise ConfigError(f"{path}: cannot parse as {what}: {str(exc).splitlines()[0]}") from None
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{path}: the file is empty (expected a header and rows)") from None


def _shown(value: object) -> str:
    """A bad cell as the message shows it: an empty CSV cell or a missing JSON key is no 'nan'."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "no number (an empty, NA or NaN cell, a short row or a missing key)"
    return repr(str(value))


def _where(df: pd.DataFrame, row: int) -> str:
    """Where data row ``row`` (0-based) is in the file: a CSV's row number
    counting the header as row 1, a JSON line's line number."""
    where = df.attrs.get("where")
    return where[row] if where else f"row {row + 2}"


def _find(df: pd.DataFrame, role: str, given: dict[str, str] | None, path: Path,
          field: str = "arrivals.columns") -> str | None:
    if given and role in given:
        if given[role] not in df.columns:
            raise ConfigError(f"{path}: column '{given[role]}' ({field}.{role}) not found; "
                              f"columns are: {', '.join(map(str, df.columns))}")
        return given[role]
    lower = {str(c).strip().lower(): c for c in df.columns}
    for name in ALIASES[role]:
        if name in lower:
            return lower[name]
    return None


MAX_TOKENS = MAX_COUNT


def _no_booleans(df: pd.DataFrame, col: str, path: Path, what: str) -> None:
    """JSON true/false are not numbers (pandas would read them as 1 and 0)."""
    values = df[col]
    if values.dtype == bool:
        flags = np.ones(len(values), dtype=bool)
    elif values.dtype == object:           # mixed JSON values (a numeric column has none)
        flags = values.map(lambda v: isinstance(v, (bool, np.bool_))).to_numpy(dtype=bool)
    else:
        return
    if flags.any():
        row = int(np.flatnonzero(flags)[0])
        raise ConfigError(f"{path}: column '{col}' {_where(df, row)}: expected {what}, got "
                          f"{str(df[col].iloc[row]).lower()}")


def _tokens(df: pd.DataFrame, col: str, path: Path, what: str = "token count") -> np.ndarray:
    _no_booleans(df, col, path, f"a non-negative integer {what}")
    values = pd.to_numeric(df[col], errors="coerce")
    # > 2^31 tokens is no request any model serves (and would overflow int64 casts of floats).
    bad = values.isna() | (values < 0) | (values > MAX_TOKENS) | (values != np.floor(values.fillna(0)))
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ConfigError(f"{path}: column '{col}' {_where(df, row)}: expected a non-negative integer "
                          f"{what} up to {MAX_TOKENS}, got {_shown(df[col].iloc[row])}")
    return values.to_numpy(dtype=np.int64)


MAX_HASH_ID = (1 << 56) - 1     # key space 0 of workloads.generate.key_space: a trace's own ids
_ID_SEPARATORS = re.compile(r"[\s,]+")


def _id_list(value: object) -> list[int] | str:
    """One hash_ids cell as a list of ids, or why it is none: a list (JSON),
    a number (a CSV column of single ids), or a string of ids separated by
    spaces or commas, with or without JSON's brackets; empty means no ids."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return []
    if isinstance(value, (bool, np.bool_)):
        return f"{str(value).lower()} is not an id"
    if isinstance(value, (int, np.integer)):
        items: list[object] = [value]
    elif isinstance(value, (float, np.floating)):
        if not value.is_integer() or abs(value) > 2**53:   # a float column holds ids exactly up to 2^53
            return f"{value!r} is not a whole number (quote large ids in a CSV)"
        items = [int(value)]
    elif isinstance(value, list):
        items = value
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                return f"cannot parse as a JSON list: {exc.msg}"
            if not isinstance(parsed, list):
                return "not a JSON list"
            items = parsed
        else:
            items = [t for t in _ID_SEPARATORS.split(text) if t]
            for t in items:
                if not (t.isascii() and t.isdigit()):
                    return f"{t!r} is not a non-negative integer"
            items = [int(t) for t in items]
    else:
        return f"expected a list of ids, got {type(value).__name__}"
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            return f"{v!r} is not an integer"
        if not 0 <= v <= MAX_HASH_ID:
            return f"{v} is outside 0 .. 2^56 - 1"
    return [int(v) for v in items]


def _hash_ids(df: pd.DataFrame, col: str, path: Path) -> list[list[int]]:
    """Each row's hash ids (``_id_list``); a malformed cell is an error naming its row."""
    out: list[list[int]] = []
    for row, value in enumerate(df[col].tolist()):
        ids = _id_list(value)
        if isinstance(ids, str):
            raise ConfigError(f"{path}: column '{col}' {_where(df, row)}: expected hash ids (non-negative "
                              f"integers as a JSON list, or separated by spaces or commas), got "
                              f"{_shown(value) if not isinstance(value, list) else repr(value)[:80]}: {ids}")
        out.append(ids)
    return out


# Epoch timestamps, by magnitude: seconds since 1970 are ~1.7e9 today, milliseconds
# ~1.7e12, microseconds ~1.7e15, nanoseconds ~1.7e18. Times relative to a trace's
# start lie far below 1e9 s (31 years) in any of these units.
EPOCH_UNITS = ((1e17, "ns"), (1e14, "us"), (1e11, "ms"), (1e9, "s"))
UNIT_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
TIME_OF_DAY = re.compile(r"\s*\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?\s*")


def numeric_unit(t: np.ndarray, relative_ms: bool) -> str:
    """The unit of numeric timestamps given without ``time_unit``: epoch
    times by their magnitude; times relative to the start in seconds, or in
    milliseconds where the format says so (``relative_ms``: Mooncake's
    ``timestamp``)."""
    first = float(t.min())
    for bound, unit in EPOCH_UNITS:
        if first >= bound:
            return unit
    return "ms" if relative_ms else "s"


def _datetimes_s(raw: pd.Series, col: str, path: Path, df: pd.DataFrame) -> np.ndarray:
    """Seconds since the earliest of datetime strings: ISO 8601 (any
    fraction of a second, any offset), else one format inferred from the
    first row and held for all (so 05/12 is never read one way in one row
    and the other way in the next); times of day without a date, in file
    order, cross midnight into the next day when they go back in time."""
    if TIME_OF_DAY.fullmatch(str(raw.iloc[0])):
        seconds = pd.to_timedelta(raw.astype(str).str.strip(), errors="coerce")
        bad = seconds.isna()
        if not bad.any():
            s = seconds.dt.total_seconds().to_numpy()
            days = np.cumsum(np.r_[0, np.diff(s) < -43_200])     # a jump back by over 12 h: past midnight
            s = s + 86_400 * days
            return s - s.min()
    else:
        parsed = pd.to_datetime(raw, errors="coerce", utc=True, format="ISO8601")
        if parsed.isna().any():
            with warnings.catch_warnings():     # "could not infer format": then it fails below
                warnings.simplefilter("ignore")
                parsed = pd.to_datetime(raw, errors="coerce", utc=True)
        bad = parsed.isna()
        if not bad.any():
            ns = parsed.dt.as_unit("ns").astype("int64").to_numpy()    # any resolution, as nanoseconds
            return _within_span((ns - ns.min()) / 1e9, col, path, df)
    row = int(np.flatnonzero(bad.to_numpy())[0])
    raise ConfigError(f"{path}: column '{col}' {_where(df, row)}: cannot parse timestamp {raw.iloc[row]!r} "
                      f"(expected ISO 8601 like 2024-05-10 00:00:01.5+00:00, the format of the first row "
                      f"throughout, or numbers with arrivals.time_unit)")


def _times(df: pd.DataFrame, col: str, unit: str | None, path: Path, relative_ms: bool = False) -> np.ndarray:
    _no_booleans(df, col, path, "a timestamp")
    raw = df[col]
    numeric = pd.to_numeric(raw, errors="coerce")
    if unit == "datetime" and numeric.notna().all():
        raise ConfigError(f"{path}: column '{col}' holds numbers (first {str(raw.iloc[0])!r}), but "
                          f"arrivals.time_unit is datetime; fix: give the numbers' unit (s, ms, us or ns), "
                          f"or leave time_unit out to have it guessed")
    if unit == "datetime" or (unit is None and numeric.isna().all()):
        return _datetimes_s(raw, col, path, df)
    bad = numeric.isna() | ~np.isfinite(numeric.fillna(0))
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ConfigError(f"{path}: column '{col}' {_where(df, row)}: expected a finite number, "
                          f"got {_shown(raw.iloc[row])}")
    t = numeric.to_numpy(dtype=np.float64)
    unit = unit or numeric_unit(t, relative_ms)
    t = t * UNIT_SECONDS[unit]
    return _within_span(t - t.min(), col, path, df, f" (read as {unit})")


def _within_span(t: np.ndarray, col: str, path: Path, df: pd.DataFrame, unit: str = "") -> np.ndarray:
    """``t``, seconds from the trace's first arrival, if no arrival lies more than ``MAX_SPAN_S``
    after the first; else an error naming the row (a timestamp of 1e300 ms ran as a 1e297 s trace)."""
    if len(t) and float(t.max()) > MAX_SPAN_S:
        row = int(np.argmax(t))
        raise ConfigError(f"{path}: column '{col}' {_where(df, row)}: {_shown(df[col].iloc[row])}{unit} arrives "
                          f"{float(t[row]):.3g} s after the first request, past the {MAX_SPAN_S:g} s (31 years) a run "
                          f"can span; check the value (or arrivals.time_unit)")
    return t


def load_trace(path: Path, *, need_arrivals: bool, columns: dict[str, str] | None = None,
               time_unit: str | None = None, columns_field: str = "arrivals.columns") -> TraceData:
    """Load a timed trace or a length-only file into arrays, in arrival order
    (``columns``: the file's column names by role, from the workload's
    ``columns_field``)."""
    df = _read_table(path)
    if len(df) == 0:
        raise ConfigError(f"{path}: the file has a header but no rows")
    prompt_col = _find(df, "prompt", columns, path, columns_field)
    output_col = _find(df, "output", columns, path, columns_field)
    arrival_col = _find(df, "arrival", columns, path, columns_field)
    found = [(r, c) for r, c in (("arrival", arrival_col if need_arrivals else None), ("prompt", prompt_col),
                                 ("output", output_col)) if c is not None]
    for k, (role, col) in enumerate(found):
        for other, same in found[k + 1:]:
            if same == col:
                raise ConfigError(f"{path}: column '{col}' would serve as both {role} and {other} "
                                  f"({columns_field}); each role needs its own column")
    missing = [r for r, c in (("prompt", prompt_col), ("output", output_col)) if c is None]
    if need_arrivals and arrival_col is None:
        missing.insert(0, "arrival")
    if missing:
        want = {"arrival": "arrival_time_s", "prompt": "prompt_tokens", "output": "output_tokens"}
        raise ConfigError(f"{path}: missing column(s) {', '.join(want[m] for m in missing)}; found "
                          f"{', '.join(map(str, df.columns))}; rename them or set {columns_field}")
    prompt = _tokens(df, prompt_col, path)
    output = _tokens(df, output_col, path)
    # Mooncake's traces give 'timestamp' in milliseconds from the start (with input_length).
    mooncake = str(arrival_col).lower() == "timestamp" and str(prompt_col).lower() == "input_length"
    arrival = _times(df, arrival_col, time_unit, path, mooncake) if (need_arrivals and arrival_col) else None
    max_col = _find(df, "max_tokens", columns, path, columns_field)
    max_tokens = _tokens(df, max_col, path) if max_col is not None else None
    hash_col = _find(df, "hash_ids", columns, path, columns_field)
    ids = _hash_ids(df, hash_col, path) if hash_col is not None else None
    keep = (prompt > 0) & (output > 0)
    rows = np.arange(len(prompt))                  # which file row each kept row is
    if arrival is not None:
        order = np.argsort(arrival, kind="stable")
        arrival, prompt, output, keep, rows = arrival[order], prompt[order], output[order], keep[order], order
        max_tokens = max_tokens[order] if max_tokens is not None else None
    dropped = int((~keep).sum())
    if dropped == len(keep):
        raise ConfigError(f"{path}: every row has a zero prompt or output token count")
    if dropped:
        prompt, output, rows = prompt[keep], output[keep], rows[keep]
        arrival = arrival[keep] if arrival is not None else None
        max_tokens = max_tokens[keep] if max_tokens is not None else None
        if arrival is not None:
            arrival = arrival - arrival[0]
    if max_tokens is not None and (max_tokens < 1).any():
        raise ConfigError(f"{path}: column '{max_col}' must hold positive integers")
    hash_ids = hash_starts = None
    if ids is not None:
        kept = [ids[r] for r in rows.tolist()]
        hash_starts = np.concatenate([[0], np.cumsum([len(x) for x in kept])]).astype(np.int64)
        hash_ids = np.fromiter((h for x in kept for h in x), np.int64, int(hash_starts[-1]))
    return TraceData(arrival, prompt, output, dropped, max_tokens, hash_ids, hash_starts)


@dataclass(frozen=True)
class SessionData:
    """A session file's sessions: session s's turns are rows ``starts[s] ..
    starts[s + 1] - 1`` of ``user_tokens`` and ``output_tokens``, in turn order."""

    starts: np.ndarray          # int64, number of sessions + 1 offsets
    user_tokens: np.ndarray     # int64 > 0: turn 0's whole first prompt, a later turn's tokens after the history
    output_tokens: np.ndarray   # int64 > 0

    @property
    def num_turns(self) -> np.ndarray:
        return np.diff(self.starts)


SESSION_COLUMNS = ("session", "turn", "user_tokens", "output_tokens")


def load_sessions(path: Path) -> SessionData:
    """A session file (``lengths.kind sessions``): CSV or JSON rows with
    ``session``, ``turn``, ``user_tokens`` and ``output_tokens`` (other
    columns, such as the bundled file's ``gap_s``, are ignored). A session's
    rows come together, its turns numbered 0, 1, ... in order; token counts
    are positive."""
    df = _read_table(path)
    if len(df) == 0:
        raise ConfigError(f"{path}: the file has a header but no rows")
    lower = {str(c).strip().lower(): c for c in df.columns}
    missing = [c for c in SESSION_COLUMNS if c not in lower]
    if missing:
        raise ConfigError(f"{path}: missing column(s) {', '.join(missing)} of a session file (session, turn, "
                          f"user_tokens, output_tokens); found {', '.join(map(str, df.columns))}")
    session, turn, user, output = (_tokens(df, lower[c], path, what) for c, what in
                                   zip(SESSION_COLUMNS, ("session id", "turn number", "token count", "token count")))
    for name, values in (("user_tokens", user), ("output_tokens", output)):
        if (values < 1).any():
            row = int(np.flatnonzero(values < 1)[0])
            raise ConfigError(f"{path}: column '{lower[name]}' {_where(df, row)}: expected a positive token "
                              f"count, got {values[row]}")
    new = np.r_[True, session[1:] != session[:-1]]          # the first row of each session
    starts = np.flatnonzero(new)
    first = np.repeat(starts, np.diff(np.r_[starts, len(df)]))
    bad = turn != np.arange(len(df)) - first
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ConfigError(f"{path}: column '{lower['turn']}' {_where(df, row)}: expected turn "
                          f"{row - first[row]} of session {session[row]} (a session's rows come together, "
                          f"turns 0, 1, ... in order), got {turn[row]}")
    if len(np.unique(session[starts])) != len(starts):
        ids, counts = np.unique(session[starts], return_counts=True)
        again = int(ids[counts > 1][0])
        row = int(starts[session[starts] == again][1])
        raise ConfigError(f"{path}: column '{lower['session']}' {_where(df, row)}: session {again} starts "
                          f"again after other sessions (a session's rows come together)")
    return SessionData(np.r_[starts, len(df)].astype(np.int64), user, output)
