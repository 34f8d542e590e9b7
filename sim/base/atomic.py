"""The one atomic writer: every file batchsim writes goes through a hidden
temporary name beside it (``.NAME.tmp``) and a rename, so a reader (or a run
killed half way) sees the old file or the new one, never half of one; a
write that fails removes its temporary file. A sweep removes the ``.tmp``
files an interrupted run left behind (``reports.experiments.sweep``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def tmp_path(path: Path) -> Path:
    """The temporary name ``path`` is written through."""
    return path.with_name(f".{path.name}.tmp")


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to fill the temporary file, then rename it over ``path``."""
    tmp = tmp_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))
