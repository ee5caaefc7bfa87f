"""Atomic file writes: a reader (or a run resumed after a crash) sees the old file or the new one,
never half of either. The one way this project replaces a file it may read again: checkpoints,
results.csv, label and image caches, COCO ground truth, Darknet weights, small JSON caches.

The data goes to a temporary file in the same folder (so the final rename stays on one file
system and is atomic), named ``.{name}.{pid}.{random}.tmp``: hidden, unique per process and per
call, so concurrent writers (DDP ranks sharing a dataset folder) never write into each other's
file. It is flushed, fsynced and then renamed onto the target with ``os.replace``; on any
exception it is removed and the exception propagates.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMP_SUFFIX = ".tmp"
_MODES = ("w", "wb")


def temp_path(path: Path) -> Path:
    """A fresh temporary name next to ``path``: ``.{name}.{pid}.{8 hex digits}.tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _open_temp(tmp: Path, mode: str, encoding: str | None, newline: str | None) -> IO[Any]:
    # open() rather than tempfile.mkstemp: the file gets the usual umask permissions, not 0600.
    # "x" refuses to reuse an existing name instead of writing into another writer's file.
    if mode == "wb":
        return open(tmp, "xb")
    return open(tmp, "x", encoding=encoding, newline=newline)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable; best effort, as some OSes (Windows) refuse."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str],
    mode: str = "wb",
    *,
    encoding: str | None = "utf-8",
    newline: str | None = None,
    fsync: bool = True,
    durable_dir: bool = False,
) -> Iterator[IO[Any]]:
    """Write ``path`` atomically: ``with atomic_write(p, "w") as f: f.write(...)``.

    Args:
        path: the file to create or replace; its folder must exist.
        mode: ``"wb"`` (binary) or ``"w"`` (text, with ``encoding`` and ``newline`` as for
            :func:`open`; ``newline=""`` for the csv module).
        fsync: flush the data to the disk before the rename, so that a power cut cannot leave
            an empty file under the new name. Off only for files that are cheap to rebuild and
            written by the thousand (the ``.npy`` image cache).
        durable_dir: also fsync the folder after the rename (the rename itself survives a power
            cut; checkpoints).

    Raises:
        OSError: the temporary file cannot be created, written or renamed (the old ``path``, if
            any, is left as it was and no temporary file remains).
    """
    if mode not in _MODES:
        raise ValueError(f"atomic_write mode must be one of {_MODES}, got {mode!r}")
    path = Path(path)
    tmp = temp_path(path)
    f = _open_temp(tmp, mode, encoding, newline)
    try:
        with f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Best effort: a failed cleanup must not hide the error that caused it.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if durable_dir:
        fsync_dir(path.parent)
