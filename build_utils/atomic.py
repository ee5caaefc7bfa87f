"""Atomic file writes: a reader (or a run resumed after a crash) sees the old file or the new one,
never half of either. The one way this project replaces a file it may read again: checkpoints,
results.csv, label and image caches, COCO ground truth, Darknet weights, small JSON caches.

The data goes to a temporary file in the same folder (so the final rename stays on one file
system and is atomic), named ``.{name}.{pid}.{random}.tmp``: hidden, unique per process and per
call, so concurrent writers (DDP ranks sharing a dataset folder) never write into each other's
file. It is flushed, fsynced and then renamed onto the target with ``os.replace``; on any
exception it is removed and the exception propagates.

Writes to a place the user chose (a run folder, ``--save-dir``, ``--output``) go through
:func:`reported_write` / :func:`make_output_dir`, which turn an ``OSError`` into one
:class:`~build_utils.errors.OutputError` line naming the place, the reason and the fix: "cannot
write runs/x/last.pt: No space left on device; free some space or choose another --output-dir".
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from build_utils.errors import ConfigError, OutputError

TEMP_SUFFIX = ".tmp"
_MODES = ("w", "wb")

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_ALLOWED = {errno.EROFS, errno.EACCES, errno.EPERM}


def temp_path(path: Path) -> Path:
    """A fresh temporary name next to ``path``: ``.{name}.{pid}.{8 hex digits}.tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _open_temp(
    tmp: Path, mode: str, encoding: str | None, errors: str | None, newline: str | None
) -> IO[Any]:
    # open() rather than tempfile.mkstemp: the file gets the usual umask permissions, not 0600.
    # "x" refuses to reuse an existing name instead of writing into another writer's file.
    if mode == "wb":
        return open(tmp, "xb")
    return open(tmp, "x", encoding=encoding, errors=errors, newline=newline)


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
    errors: str | None = None,
    newline: str | None = None,
    fsync: bool = True,
    durable_dir: bool = False,
) -> Iterator[IO[Any]]:
    """Write ``path`` atomically: ``with atomic_write(p, "w") as f: f.write(...)``.

    Args:
        path: the file to create or replace; its folder must exist.
        mode: ``"wb"`` (binary) or ``"w"`` (text, with ``encoding``, ``errors`` and ``newline``
            as for :func:`open`; ``newline=""`` for the csv module; ``errors="surrogateescape"``
            writes a file name that is not UTF-8 as its bytes on disk).
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
    f = _open_temp(tmp, mode, encoding, errors, newline)
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


# ---- failures at a place the user chose -----------------------------------------------------


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest of ``path``'s folders that exists as something other than a folder."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            return None if parent.is_dir() else parent
    return None


def write_error(
    e: OSError, path: str | os.PathLike[str], flag: str | None = None, folder: bool = False
) -> OutputError:
    """The one-line error for ``e``, raised while writing ``path`` (a folder when ``folder``):
    the place, the reason and what to do, ``flag`` being the option that chose the place.

    >>> str(write_error(OSError(errno.ENOSPC, "No space left on device"), "r/last.pt", "--o"))
    'cannot write r/last.pt: No space left on device; free some space or choose another --o'
    """
    path = Path(path)
    other = f"choose another {flag}" if flag else "choose another place"
    code = e.errno
    if code in _NO_SPACE:
        why, fix = os.strerror(code), f"free some space or {other}"
    elif code in _NOT_ALLOWED:
        why, fix = os.strerror(code), f"make it writable or {other}"
    elif code == errno.ENOTDIR or (code == errno.EEXIST and folder):
        blocker = path if path.exists() and not path.is_dir() else _file_in_the_way(path)
        why = f"{blocker or path} is a file where a folder should be"
        fix = f"move it away or {other}"
    elif code == errno.EISDIR:
        why, fix = f"{path} is a folder, not a file", f"move it away or {other}"
    elif code == errno.EEXIST:
        why, fix = f"{path} already exists", f"move it away or {other}"
    else:
        why, fix = e.strerror or str(e), other
    return OutputError(f"cannot write {path}: {why}; {fix}")


def check_output_place(
    path: str | os.PathLike[str], flag: str | None = None, folder: bool = False
) -> None:
    """Refuse now, with :func:`write_error`'s line, a place no write could use: a folder where a
    file goes, a file where a folder (``folder``) goes or among its parents. For a check before
    long work (an evaluation) whose results the last write would otherwise lose; what only a
    write can tell (permissions, space) that write reports. Creates nothing.

    Raises:
        OutputError: the place cannot be written.
    """
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise write_error(OSError(errno.EEXIST, os.strerror(errno.EEXIST)), path, flag, folder)
    if not folder and path.is_dir():
        raise write_error(OSError(errno.EISDIR, os.strerror(errno.EISDIR)), path, flag)
    if _file_in_the_way(path) is not None:
        raise write_error(OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), path, flag, folder)


def check_not_an_input(
    out: str | os.PathLike[str],
    flag: str,
    inputs: Mapping[str, str | os.PathLike[str] | None],
) -> None:
    """Refuse an output ``out`` that is one of the files a tool reads (``inputs``: how the
    message names each, e.g. ``"the cfg"``; None: not given), so that its result never replaces
    its own input.

    Raises:
        ConfigError: ``out`` is (a link to) one of ``inputs``.
    """
    out = Path(out)
    for what, read in inputs.items():
        if read is not None and out.exists() and Path(read).exists() and out.samefile(read):
            raise ConfigError(f"{flag} {out} is {what} this tool reads; choose another file")


def resolved(path: str | os.PathLike[str]) -> Path:
    """``path`` with symbolic links resolved as far as they go: ``Path.resolve`` raises on a
    link loop, which a caller reports as a path to skip, not a traceback."""
    return Path(os.path.realpath(path))


def check_apart(
    outputs: Mapping[str, str | os.PathLike[str] | None],
    folders: Iterable[str | os.PathLike[str]],
    what: str,
) -> None:
    """Refuse outputs (``outputs``: flag -> file; None: not written) that would land on each
    other, or in one of ``folders`` (``what`` names them in the message): folders the tool fills
    with files of their own kind, such as labels, where an output would replace one of them or
    be read as one. Symbolic links are followed.

    Raises:
        ConfigError: two outputs are one file, or an output lies in one of ``folders``.
    """
    folders = [(folder, resolved(folder)) for folder in folders]
    seen: dict[Path, str] = {}
    for flag, out in outputs.items():
        if out is None:
            continue
        place = resolved(out)
        if place in seen:
            raise ConfigError(f"{flag} {out} is also {seen[place]}; choose another file")
        seen[place] = flag
        for folder, real in folders:
            if place.is_relative_to(real):
                raise ConfigError(
                    f"{flag} {out} lies in {what} {folder}; choose a place outside it"
                )


def check_not_over_sources(
    out_dir: str | os.PathLike[str],
    flag: str,
    sources: Mapping[str, str | os.PathLike[str]],
    files: Iterable[str | os.PathLike[str]] = (),
    written: str = "the outputs",
    file_kind: str = "a file read",
) -> None:
    """Refuse an output folder ``out_dir`` (chosen by ``flag``) that is one of the folders
    among ``sources`` (how the message names each -> path), lies inside one, or holds one of
    them or one of ``files`` (each file read, as ``file_kind``: a symbolic link in a source
    folder may point into the output folder). ``written``: what the tool writes there. Paths
    are compared resolved, so symbolic links count as what they point to.

    Raises:
        ConfigError: the output would be written over or among what is read.
    """
    out = resolved(out_dir)
    for name, source in sources.items():
        src = resolved(source)
        if src.is_dir() and out.is_relative_to(src):
            where = "is" if out == src else "is inside"
            raise ConfigError(
                f"{flag} {out_dir} {where} {name}: {written} would be written among the files "
                "read; choose a place outside it"
            )
        if src.is_relative_to(out):
            raise ConfigError(
                f"{flag} {out_dir} holds {name}, which {written} could replace; "
                f"choose another {flag}"
            )
    for f in files:
        if resolved(f).is_relative_to(out):
            raise ConfigError(
                f"{flag} {out_dir} holds {f} ({file_kind}), which {written} could replace; "
                f"choose another {flag}"
            )


def check_new_outputs(
    paths: Iterable[str | os.PathLike[str]],
    flag: str,
    exist_ok: bool,
    inputs: Mapping[str, str | os.PathLike[str] | None] | None = None,
) -> None:
    """The output policy of every script and tool, checked before any work is done: each of
    ``paths`` (what the tool is about to write, at places ``flag`` chose) is none of the files
    it reads (``inputs``, see :func:`check_not_an_input`), can be written
    (:func:`check_output_place`, for the paths that do not exist yet), and does not exist
    unless ``exist_ok``. An existing one is refused whoever wrote it, the user or this tool in
    an earlier run, and is named in the message: a tool never replaces a file unasked.

    Raises:
        ConfigError: an output is one of ``inputs``, or exists without ``exist_ok``.
        OutputError: an output's place cannot be written (a file where a folder should be).
    """
    paths = [Path(p) for p in paths]
    for path in paths:
        if inputs:
            check_not_an_input(path, flag, inputs)
    taken = [p for p in paths if p.exists() or p.is_symlink()]
    if taken and not exist_ok:
        names = ", ".join(map(str, taken))
        verb = "exists" if len(taken) == 1 else "exist"
        raise ConfigError(
            f"{names} already {verb}; pass --exist-ok to replace, or choose another {flag}"
        )
    for path in paths:
        if path not in taken:
            check_output_place(path, flag)


@contextlib.contextmanager
def reported_write(
    path: str | os.PathLike[str], flag: str | None = None, folder: bool = False
) -> Iterator[None]:
    """Turn an ``OSError`` of the block into :func:`write_error`'s :class:`OutputError` about
    ``path``: ``with reported_write(out / "per_class.csv", "--save-dir"): ...``.

    Raises:
        OutputError: the block raised an ``OSError``.
    """
    try:
        yield
    except OSError as e:
        raise write_error(e, path, flag, folder) from e


def make_output_dir(path: str | os.PathLike[str], flag: str | None = None) -> Path:
    """Create the folder ``path`` (and its parents) unless it exists; returns it.

    Raises:
        OutputError: it cannot be created (a file of that name or in its path, a read-only or
            full file system).
    """
    path = Path(path)
    with reported_write(path, flag, folder=True):
        path.mkdir(parents=True, exist_ok=True)
    return path


def write_text(
    path: str | os.PathLike[str], text: str, flag: str | None = None, errors: str = "strict"
) -> None:
    """Write ``text`` (UTF-8) to the user-chosen ``path`` atomically; ``errors="surrogateescape"``
    for a report naming files, whose names that are not UTF-8 are then written as their bytes.

    Raises:
        OutputError: it cannot be written (``flag``: the option that chose it); the previous
            file stays as it was.
    """
    with reported_write(path, flag), atomic_write(path, "w", errors=errors) as f:
        f.write(text)
