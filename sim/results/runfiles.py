"""A run's two big files, steps.csv and tokens.npz, written by a second
process while the simulation runs; and CSV text from numpy columns.

``csv_columns`` formats columns of ints, floats, bools and plain strings the
way ``DataFrame.to_csv(index=False)`` does (``sim.results.folder.write_csv`` uses it), with
neither pandas nor a Python call per integer cell.

Formatting steps.csv is most of what a run costs after its loop: a step has
thirteen cells, two of them floats whose shortest ``repr`` is the expensive
part (the conversation trace: 330k steps, ~0.5 s; a million requests: ~17M
steps, ~30 s), and tokens.npz is ~0.3 s of zlib more. Python formats on one
core, and the loop runs on one. So ``sim run`` hands both files to a second
process (``RunFilesProcess``): each replica's ``StepLog`` spills its rows in
chunks to its temporary folder anyway, and now tells the process each
chunk's file as it is written; the process formats the chunks in
steps.csv's order (replica after replica) while the loop goes on. After the
loop every log spills what it still holds; the process then finishes
steps.csv and writes tokens.npz from the ``TokenLog`` chunks, while this
process computes the summaries and writes requests.csv. ``write_run`` waits
for it and renames both files into place. The bytes are those ``write_run``
writes in process (a test compares them).

The protocol on the process's stdin is one line per message:
``C <position> <replica> <chunk file>`` for a spilled step chunk of the
replica at ``position`` in the run's replica order, ``T <chunk file>`` for a
token chunk (in tokens.npz's order), then ``E <steps> <tokens>`` once every
row is spilled. Without ``E`` (the parent died or gave up) the process
removes its files and exits non-zero; on a failure it prints one line to
stderr, removes its files and exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

import numpy as np

from sim.base.heap import trim_heap
from sim.core.logs import StepLog, read_chunk, token_chunk

# steps.csv's columns: replica, StepLog.COLUMNS, kv_total_blocks (sim.results.result.step_frame's order).
STEP_COLUMNS = ("replica", *StepLog.COLUMNS, "kv_total_blocks")
NUM_INTS = StepLog.NUM_INTS     # StepLog's integer columns, after its three float columns
STREAM_STEP_CHUNK = 65_536      # steps a log holds before it spills while a process formats them
# Beyond this many replicas sim run writes its files itself: each replica's last rows would be
# spilled to a folder of its own just to be announced (400 replicas of 300 requests: +0.5 s on 2 s).
MAX_REPLICAS = 16
_SPECIAL = frozenset(',"\r\n')


def _plain(text: str) -> bool:
    """Whether ``text`` needs no quoting in a CSV cell."""
    return not _SPECIAL.intersection(text)


def csv_columns(names: Sequence[str], columns: Sequence[np.ndarray], *, header: bool = True) -> str | None:
    """The CSV text ``to_csv(index=False, header=header)`` writes for a table
    of these columns, or None for a column it does not write the same way
    (anything but int, float64, bool and plain str columns; then use ``to_csv``).

    Each distinct small non-negative int is formatted once (a table indexed by
    the column); a float column equal to an earlier one is formatted once (a
    simulated step's predicted_s is its duration_s); floats as ``repr`` (what
    pandas writes; NaN as an empty cell); rows are joined in one pass."""
    if not all(isinstance(c, str) and _plain(c) for c in names):
        return None
    cells: list[list[str]] = []
    done: list[tuple[np.ndarray, list[str]]] = []
    for values in columns:
        values = np.asarray(values)
        kind = values.dtype.kind
        if kind == "f" and values.dtype.itemsize == 8:
            same = next((strs for prev, strs in done if np.array_equal(prev, values, equal_nan=True)), None)
            if same is None:
                same = list(map(repr, values.tolist()))
                if np.isnan(values).any():
                    same = ["" if x == "nan" else x for x in same]
                done.append((values, same))
            cells.append(same)
        elif kind in "iu":
            cells.append(int_cells(values))
        elif kind == "b":
            cells.append(["True" if x else "False" for x in values.tolist()])
        elif kind == "O":
            strs = values.tolist()
            if not all(type(x) is str for x in strs) or not all(_plain(x) for x in set(strs)):
                return None
            cells.append(strs)
        else:
            return None
    head = ",".join(names) + "\n" if header else ""
    if not cells or not len(cells[0]):
        return head
    if len(cells) == 1:
        return head + "\n".join('""' if x == "" else x for x in cells[0]) + "\n"
    return head + "\n".join(map(",".join, zip(*cells))) + "\n"


def int_cells(values: np.ndarray) -> list[str]:
    """``str`` of each integer: small non-negative ones through a table of their strings."""
    if not len(values):
        return []
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0 and hi < 4 * len(values) + 1024:
        return np.array([str(i) for i in range(hi + 1)], dtype=object)[values].tolist()
    return list(map(str, values.tolist()))


def step_chunk_text(replica: int, t_s: np.ndarray, duration_s: np.ndarray, predicted_s: np.ndarray,
                    ints: np.ndarray, kv_total_blocks: int, *, header: bool) -> str:
    """steps.csv's rows for one chunk of a replica's ``StepLog`` (``ints``: its
    (k, 8) integer columns, or the flat row-major array a spill holds)."""
    n = len(t_s)
    ints = np.asarray(ints).reshape(n, NUM_INTS)
    columns = [np.full(n, replica, dtype=np.int64), t_s, duration_s, predicted_s,
               *(ints[:, k] for k in range(NUM_INTS)), np.full(n, kv_total_blocks, dtype=np.int64)]
    text = csv_columns(STEP_COLUMNS, columns, header=header)
    assert text is not None, "steps hold only ints and float64"
    return text


def write_tokens_npz(path: Path, chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]],
                     num_tokens: int) -> None:
    """tokens.npz (arrays req_id int64 and t_s float64, as ``np.savez_compressed``
    writes them) streamed from ``chunks()`` (read once per array), never all in
    memory. Members carry a fixed date, so equal tokens give equal bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
        for column, (name, dtype) in enumerate((("req_id", np.int64), ("t_s", np.float64))):
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o600 << 16
            with zf.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                              "fortran_order": False, "shape": (num_tokens,)})
                written = 0
                for chunk in chunks():
                    values = np.ascontiguousarray(chunk[column], dtype=dtype)
                    member.write(values)
                    written += len(values)
            if written != num_tokens:
                raise RuntimeError(f"{path}: {written} tokens written, {num_tokens} announced")


class RunFilesProcess:
    """steps.csv and tokens.npz in ``out_dir``, written by a second process
    from the spilled chunks of the run's logs (see the module's doc).

    ``start(step_logs, token_logs, replicas, kv_total_blocks)`` before the
    loop starts the process and makes each step log spill in small chunks and
    announce each one; ``finish()`` after the loop spills what the logs still
    hold and announces the rest; ``commit()`` waits for the process and
    renames its files into place; ``close()`` stops a process that was not
    committed and removes its files. Where no process can be started,
    ``started`` is False and ``sim.results.folder.write_run`` writes both files itself."""

    NAMES = ("steps.csv", "tokens.npz")

    def __init__(self, out_dir: str | Path) -> None:
        self.paths = [Path(out_dir) / name for name in self.NAMES]
        self.tmps = [p.with_name(f".{p.name}.{os.getpid()}.tmp") for p in self.paths]
        self.proc: subprocess.Popen | None = None
        self.step_logs: list = []
        self.token_logs: list = []
        self._broken = False
        self._finished = False
        self.peak_rss_mib: float | None = None

    @property
    def started(self) -> bool:
        return self.proc is not None

    def start(self, step_logs: Sequence, token_logs: Sequence, replicas: Sequence[int],
              kv_total_blocks: int) -> bool:
        """Start the process for these replicas' logs (in the files' order);
        False, and nothing started, for more than ``MAX_REPLICAS`` of them."""
        if len(step_logs) > MAX_REPLICAS:
            return False
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "sim.results.runfiles", *map(str, self.tmps),
                                          str(kv_total_blocks)],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         env=env, text=True, encoding="utf-8")
        except OSError:
            self.proc = None
            return False
        self.step_logs, self.token_logs = list(step_logs), list(token_logs)
        for position, (log, replica) in enumerate(zip(self.step_logs, replicas)):
            log.stream_to(lambda path, p=position, r=replica: self._send(f"C {p} {r} {path}\n"),
                          STREAM_STEP_CHUNK)
        return True

    def _send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None, "started"
        if self._broken:
            return
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except OSError:                 # the process failed: commit() reports why
            self._broken = True

    def finish(self) -> None:
        """Every row is logged: spill the rest and announce the token chunks and the totals."""
        if self.proc is None or self._finished:
            return
        for log in self.step_logs:
            log.spill_rest()
        for log in self.token_logs:
            for path in log.spill_rest():
                self._send(f"T {path}\n")
        self._send(f"E {sum(len(log) for log in self.step_logs)} {sum(len(log) for log in self.token_logs)}\n")
        self._finished = True

    def commit(self) -> str | None:
        """Wait for the process and rename its files into place; the failure's
        one line, ``FILE: why`` (None if it wrote both files)."""
        assert self.proc is not None, "started"
        if not self._finished:
            return "the run did not finish"
        said = self._wait()
        proc, self.proc = self.proc, None
        doing = self.NAMES[0]
        try:
            if proc.returncode != 0:
                return said[-1] if said else f"steps.csv: the writer process exited with status {proc.returncode}"
            for tmp, path in zip(self.tmps, self.paths):
                doing = path.name
                os.replace(tmp, path)
        except OSError as exc:
            return f"{doing}: {exc.strerror or exc}"
        finally:
            for tmp in self.tmps:
                _remove(tmp)
        return None

    def _wait(self) -> list[str]:
        """Close its stdin, read its stderr, reap it; the non-blank lines of
        its stderr, less the line ``peak_rss_kib N`` by which it reports its own peak resident
        memory (``peak_rss_mib``; a run's footprint is this process's and
        that). Not ``os.wait4``'s ``ru_maxrss``: Linux counts in it the
        memory of this process at the moment the child was spawned."""
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stderr is not None, "started"
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            err = proc.stderr.read()
        except OSError:
            err = ""
        proc.stderr.close()
        proc.wait()
        lines = []
        for line in err.splitlines():
            if line.startswith("peak_rss_kib "):
                self.peak_rss_mib = int(line.split()[1]) / 1024
            elif line.strip():
                lines.append(line.strip())
        return lines

    def close(self) -> None:
        """Stop the process if it was not committed, and remove its files."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        for tmp in self.tmps:
            _remove(tmp)

    def __enter__(self) -> RunFilesProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove(path: Path) -> None:
    """Remove the file ``path`` if there is one (what is not a file stays)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _serve(steps_tmp: Path, tokens_tmp: Path, kv_total_blocks: int, messages: IO[str], doing: list[str]) -> int:
    """The second process: format the announced step chunks in order into
    ``steps_tmp``; after ``E``, the token chunks into ``tokens_tmp``
    (``doing[0]``: the file being written, for an error message)."""
    queued: dict[int, list[tuple[int, str]]] = {}   # later replicas' step chunks wait for E
    token_files: list[str] = []
    rows = 0
    doing[0] = "steps.csv"
    with open(steps_tmp, "w", encoding="utf-8", newline="") as f:
        def write(replica: int, chunk: str) -> None:
            nonlocal rows
            t_s, duration_s, predicted_s, ints = read_chunk(chunk, 4)
            f.write(step_chunk_text(replica, t_s, duration_s, predicted_s, ints, kv_total_blocks, header=False))
            rows += len(t_s)
            trim_heap()             # the chunk's strings and arrays: else this process grows with the run

        f.write(",".join(STEP_COLUMNS) + "\n")
        for line in messages:
            kind, *fields = line.rstrip("\n").split(" ", 3 if line.startswith("C") else 1)
            if kind == "C":
                position, replica, chunk = int(fields[0]), int(fields[1]), fields[2]
                if position == 0:
                    write(replica, chunk)
                else:
                    queued.setdefault(position, []).append((replica, chunk))
            elif kind == "T":
                token_files.append(fields[0])
            elif kind == "E":
                num_steps, num_tokens = map(int, fields[0].split())
                break
            else:
                raise RuntimeError(f"unknown message {line!r}")
        else:
            raise EOFError("the run ended before its logs did")
        for position in sorted(queued):
            for replica, chunk in queued[position]:
                write(replica, chunk)
        if rows != num_steps:
            raise RuntimeError(f"{rows} steps written, {num_steps} announced")
    doing[0] = "tokens.npz"
    def tokens() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for k, path in enumerate(token_files):
            if k % 16 == 15:
                trim_heap()
            yield token_chunk(*read_chunk(path, 3))

    write_tokens_npz(tokens_tmp, tokens, num_tokens)
    return 0


def _peak_rss_kib() -> int | None:
    """This process's peak resident memory since it started (VmHWM), where /proc says."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def main(argv: Sequence[str]) -> int:
    """The second process's entry: ``python -m sim.results.runfiles STEPS_TMP TOKENS_TMP KV_TOTAL_BLOCKS``,
    messages on stdin. A failure: one line ``FILE: why`` on stderr, no file left, status 1."""
    steps_tmp, tokens_tmp, kv_total_blocks = Path(argv[0]), Path(argv[1]), int(argv[2])
    doing = ["steps.csv"]
    try:
        code = _serve(steps_tmp, tokens_tmp, kv_total_blocks, sys.stdin, doing)
        peak = _peak_rss_kib()
        if peak is not None:
            print(f"peak_rss_kib {peak}", file=sys.stderr)
        return code
    except BaseException as exc:
        for tmp in (steps_tmp, tokens_tmp):
            _remove(tmp)
        if isinstance(exc, OSError):
            print(f"{doing[0]}: {exc.strerror or exc}", file=sys.stderr)
        elif not isinstance(exc, (EOFError, KeyboardInterrupt)):
            print(f"{doing[0]}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
