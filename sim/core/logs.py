"""A run's two logs that grow with its length: every output token and every step.

Both keep their newest rows in ``array``s (an append costs what a list's
does) and, once those hold a chunk, write them to a temporary folder as one
columnar chunk file (``np.save`` of each column, one after the other) and
start again. Readers get the chunks in time order, the rows still in memory
last, so a million-request run needs memory for one chunk, not for its
hundreds of millions of tokens. The folder is made at the first spill and
removed by ``close()``, when the log is garbage-collected, or at interpreter
exit (``weakref.finalize``), so a run that fails half-way leaves nothing.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from sim.base.heap import trim_heap
from sim.base.strict import ConfigError

if TYPE_CHECKING:
    from sim.core.batch import Batch, StepResult

TOKEN_CHUNK = 262_144       # tokens held in memory before a spill (2 MB of ids)
STEP_CHUNK = 250_000        # steps held in memory before a spill (22 MB)
INT32_MAX = 2 ** 31 - 1


# np.load parses each header with ast.literal_eval, and CPython 3.11's AST converter keeps its
# recursion depth per interpreter, not per thread: two threads reading chunks at once (run_dir
# writes tokens.npz on a second thread while this one writes the CSVs) can fail with
# "SystemError: AST constructor recursion depth mismatch". One reader at a time.
_READ_LOCK = threading.Lock()


def read_chunk(path: str | Path, num_arrays: int) -> tuple[np.ndarray, ...]:
    """The arrays a spill file holds (``SpillFolder.write``: ``np.save`` one after the other)."""
    with _READ_LOCK, open(path, "rb") as f:
        return tuple(np.load(f, allow_pickle=False) for _ in range(num_arrays))


def token_chunk(ids: np.ndarray, step_end_s: np.ndarray, step_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(req_id int64, t_s float64) of a ``TokenLog`` chunk: its ids, and per
    step the end time repeated for the tokens the step sampled."""
    return ids.astype(np.int64), np.repeat(step_end_s, step_counts)


class SpillError(ConfigError):
    """The temporary folder cannot take a run's spilled logs (disk full, no permission); one line."""


class SpillFolder:
    """Chunk files in a temporary folder made on the first write.

    Each chunk is one file holding a fixed number of arrays written by
    ``np.save`` in order; ``read`` yields them back chunk by chunk.
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self.num_chunks = 0
        self._remove: weakref.finalize | None = None

    def write(self, *arrays: np.ndarray) -> Path:
        """Write one chunk file; its path."""
        try:
            if self.path is None:
                self.path = Path(tempfile.mkdtemp(prefix="batchsim-spill-"))
                self._remove = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)
            path = self.path / f"{self.num_chunks:06d}.npy"
            with open(path, "wb") as f:
                for a in arrays:
                    np.save(f, a, allow_pickle=False)
        except OSError as exc:
            raise SpillError(f"{self.path or tempfile.gettempdir()}: cannot spill the run's logs to disk "
                             f"({exc.strerror or exc}); free space there or set TMPDIR to a larger disk") from None
        self.num_chunks += 1
        return path

    def paths(self) -> list[Path]:
        """The chunk files, in the order they were written."""
        return [self.path / f"{k:06d}.npy" for k in range(self.num_chunks)] if self.path is not None else []

    def read(self, num_arrays: int) -> Iterator[tuple[np.ndarray, ...]]:
        for path in self.paths():
            yield read_chunk(path, num_arrays)

    def close(self) -> None:
        """Remove the folder and its chunks now (idempotent)."""
        if self._remove is not None:
            self._remove()


def compact_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` as int32 when every one fits (halves the bytes spilled), else as they are."""
    if len(ids) and 0 <= int(ids.min()) and int(ids.max()) <= INT32_MAX:
        return ids.astype(np.int32)
    return ids


class TokenLog:
    """The request id of every sampled output token, in time order, and per
    step that sampled any, its end time and how many it sampled.

    Per step, ``SchedulerState.commit`` appends each token's request id to
    ``ids`` (through its bound ``append``) and then calls ``end_step`` once;
    ``add_stretch`` logs many identical steps at once. Chunks end on step
    boundaries.
    """

    def __init__(self) -> None:
        self.ids = array("q")
        self._step_end_s = array("d")
        self._step_counts = array("q")
        self._chunk_tokens = TOKEN_CHUNK
        self._num_spilled = 0
        self._spill = SpillFolder()

    def end_step(self, end_s: float, num_tokens: int) -> None:
        """The step that appended the last ``num_tokens`` ids (> 0) ended at ``end_s``."""
        self._step_end_s.append(end_s)
        self._step_counts.append(num_tokens)
        if len(self.ids) >= self._chunk_tokens:
            self._flush()

    def add_stretch(self, end_times_s: Sequence[float], req_ids: Sequence[int]) -> None:
        """``len(end_times_s)`` consecutive steps, ending at those times, each
        sampling one token for every id in ``req_ids``, in that order."""
        num_steps, num_reqs = len(end_times_s), len(req_ids)
        if num_steps == 0 or num_reqs == 0:
            return
        if not (isinstance(req_ids, array) and req_ids.typecode == "q"):
            req_ids = array("q", req_ids)
        self.ids.extend(req_ids * num_steps)                    # array repeat and extend: memcpy
        self._step_end_s.extend(end_times_s)
        self._step_counts.extend(array("q", (num_reqs,)) * num_steps)
        if len(self.ids) >= self._chunk_tokens:
            self._flush()

    def _flush(self) -> None:
        """Write the rows in memory as one chunk and empty the arrays (in place:
        a bound ``ids.append`` stays valid)."""
        self._spill.write(compact_ids(np.frombuffer(self.ids, dtype=np.int64)),
                          np.frombuffer(self._step_end_s, dtype=np.float64),
                          compact_ids(np.frombuffer(self._step_counts, dtype=np.int64)))
        self._num_spilled += len(self.ids)
        del self.ids[:], self._step_end_s[:], self._step_counts[:]

    def __len__(self) -> int:
        return self._num_spilled + len(self.ids)

    def spill_rest(self) -> list[Path]:
        """Spill the tokens still in memory; every chunk file, in time order."""
        if len(self.ids):
            self._flush()
        return self._spill.paths()

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(request ids int64, times float64) of the tokens, chunk by chunk in time order."""
        for ids, end_s, counts in self._spill.read(3):
            yield token_chunk(ids, end_s, counts)
        if len(self.ids):
            yield (np.frombuffer(self.ids, dtype=np.int64).copy(),
                   np.repeat(np.frombuffer(self._step_end_s, dtype=np.float64),
                             np.frombuffer(self._step_counts, dtype=np.int64)))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(request id, time in s) of every token so far, in time order, in memory."""
        parts = list(self.chunks())
        if not parts:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def close(self) -> None:
        """Remove the spilled chunks now (else when the log is collected)."""
        self._spill.close()


class StepLog:
    """Per-step records (one row per iteration), chunked like ``TokenLog``."""

    COLUMNS = ("t_s", "duration_s", "predicted_s", "batch_size", "num_prefill_tokens",
               "num_decode_tokens", "num_pad_tokens", "num_prefill_seqs", "num_waiting",
               "num_running", "kv_used_blocks")
    NUM_INTS = 8                        # COLUMNS[3:]
    # The integer columns by name: their index in a row of ``ints`` (COLUMNS[3:]).
    BATCH_SIZE, PREFILL_TOKENS, DECODE_TOKENS, PAD_TOKENS, PREFILL_SEQS, WAITING, RUNNING, KV_USED_BLOCKS = range(8)

    def __init__(self) -> None:
        self.t_s = array("d")
        self.duration_s = array("d")
        self.predicted_s = array("d")
        self.ints = array("q")          # 8 integer columns per step, row-major
        self._chunk_steps = STEP_CHUNK
        self._num_spilled = 0
        self._spill = SpillFolder()
        self._on_spill: Callable[[Path], None] | None = None

    def stream_to(self, on_spill: Callable[[Path], None], chunk_steps: int) -> None:
        """Spill every ``chunk_steps`` steps and call ``on_spill(chunk file)``
        after each spill (``sim.results.runfiles.RunFilesProcess`` formats them)."""
        self._on_spill = on_spill
        self._chunk_steps = chunk_steps

    def spill_rest(self) -> None:
        """Spill the rows still in memory (announced like the others), so that
        every row is in a chunk file."""
        if len(self.t_s):
            self._flush()

    def record(self, t_s: float, batch: Batch, result: StepResult, num_waiting: int, num_running: int,
               kv_used_blocks: int, prefill_items: int = 0) -> None:
        """One step that started at ``t_s``, with the queues and the KV blocks in use it ran with.
        ``prefill_items``: its one-token items that are prefill chunks (``SchedulerState.prefill_items``),
        counted with the prefill tokens and sequences, not with the decodes, as vLLM counts them."""
        self.t_s.append(t_s)
        self.duration_s.append(result.duration_s)
        self.predicted_s.append(result.predicted_s if result.predicted_s is not None else float("nan"))
        self.ints.extend((len(batch.items), batch.num_prefill_tokens + prefill_items,
                          batch.num_decode_tokens - prefill_items, batch.num_pad_tokens,
                          batch.num_prefill_seqs + prefill_items, num_waiting, num_running, kv_used_blocks))
        if len(self.t_s) >= self._chunk_steps:
            self._flush()

    def record_stretch(self, t_s: Sequence[float], duration_s: Sequence[float], predicted_s: Sequence[float],
                       ints: Sequence[int]) -> None:
        """K steps at once: three columns of K floats and the K x 8 integer
        columns (``COLUMNS[3:]`` order) flat, row after row (an ``array("q")``
        extends fastest)."""
        self.t_s.extend(t_s)
        self.duration_s.extend(duration_s)
        self.predicted_s.extend(predicted_s)
        self.ints.extend(ints)
        if len(self.t_s) >= self._chunk_steps:
            self._flush()

    def _flush(self) -> None:
        """Write the rows in memory as one chunk (integers as int32 when they
        fit) and empty the arrays."""
        ints = np.frombuffer(self.ints, dtype=np.int64)
        if len(ints) and -INT32_MAX <= int(ints.min()) and int(ints.max()) <= INT32_MAX:
            ints = ints.astype(np.int32)
        path = self._spill.write(np.frombuffer(self.t_s, dtype=np.float64),
                                 np.frombuffer(self.duration_s, dtype=np.float64),
                                 np.frombuffer(self.predicted_s, dtype=np.float64), ints)
        del ints                        # no view may outlive the arrays' resize
        self._num_spilled += len(self.t_s)
        del self.t_s[:], self.duration_s[:], self.predicted_s[:], self.ints[:]
        trim_heap()                     # the pages the loop freed since the last spill (a few ms)
        if self._on_spill is not None:
            self._on_spill(path)

    def __len__(self) -> int:
        return self._num_spilled + len(self.t_s)

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(t_s, duration_s, predicted_s, ints (k, 8) int64), chunk by chunk in time order."""
        for t_s, duration_s, predicted_s, ints in self._spill.read(4):
            yield t_s, duration_s, predicted_s, ints.astype(np.int64).reshape(-1, self.NUM_INTS)
        if len(self.t_s):
            yield (np.frombuffer(self.t_s, dtype=np.float64).copy(),
                   np.frombuffer(self.duration_s, dtype=np.float64).copy(),
                   np.frombuffer(self.predicted_s, dtype=np.float64).copy(),
                   np.frombuffer(self.ints, dtype=np.int64).reshape(-1, self.NUM_INTS).copy())

    def close(self) -> None:
        """Remove the spilled chunks now (else when the log is collected)."""
        self._spill.close()
