"""The C heap under a run (glibc's ``malloc_trim`` and ``mallopt`` through
ctypes; nothing where the C library is not glibc).

A run allocates and frees many arrays of a few MB (log chunks, the growing
per-request record columns, the summaries' temporaries). glibc keeps freed
pages resident until it is asked to give them back, and it lays such arrays
in the heap or in their own mappings depending on what was freed before.
``tune_heap`` fixes that choice for a run; ``trim_heap`` returns the freed
pages at the points where a run's peak would otherwise keep them.
"""

from __future__ import annotations


def _libc():
    """glibc through ctypes, or None where the C library is not glibc."""
    global _glibc
    if _glibc is None:
        import ctypes
        import ctypes.util
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name and "libc.so" in name else None
            _glibc = lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _glibc = False
    return _glibc or None


def trim_heap() -> None:
    """Give the memory freed so far back to the system (glibc's ``malloc_trim``):
    freed blocks lie in the heap among live ones, which a heap does not return
    by itself. Called at each step-log spill (the loop's growing record
    columns leave their old buffers behind: without it a million-request run
    ended its loop at 186 MB instead of ~140), at the loop's end, and after
    the records become a table and the summaries' temporaries. A few
    milliseconds; nothing where the C library is not glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3        # glibc's mallopt parameters
HEAP_MMAP_THRESHOLD = 32 << 20
HEAP_TRIM_THRESHOLD = 32 << 20


def tune_heap() -> None:
    """Fix glibc's heap thresholds for a run: blocks under 32 MB come from the
    heap, and up to 32 MB of free memory at its top stays there (8 MB was not
    enough to keep the summaries' chunk-sized temporaries resident; 64 MB
    raised a million-request run's peak).

    glibc otherwise maps a large block (a log chunk, the ITL sample's
    temporaries: ~2-32 MB) with its own ``mmap`` and moves the threshold
    with the history of what was freed, and it returns the heap's top to the
    system as soon as 128 kB of it is free. Which of the two a run's
    summaries got depended on the order of earlier allocations, and whenever
    it was the second, every temporary array was page-faulted in again: the
    conversation trace's summaries took 0.45 s instead of 0.22 s and its
    vllm_bench.json 0.23 s instead of 0.09 s. ``trim_heap`` still returns the
    free memory at the points where a run's peak would otherwise keep it.
    Nothing where the C library is not glibc."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)


_glibc = None
