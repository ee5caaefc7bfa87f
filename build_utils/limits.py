"""Named limits on what a user's file can make this program do, and the checks that apply them.

A small hostile or broken file must not exhaust memory, hang a run or end in a traceback: a PNG
whose header declares 25000x25000 pixels, a 40 GB sparse file named ``.jpg``, a FIFO named like
an image, a 3 KB YAML of nested aliases. Each limit here has a name used in its error line, a
default sized for real datasets (see ``why``), and an environment variable that raises it, the way
OpenCV's ``OPENCV_IO_MAX_IMAGE_PIXELS`` does: environment variables reach every entry point,
every DDP rank and every data-loader worker without a flag on each script.

Only regular files are data: :func:`file_problem` stats a path before anything opens it (opening
a FIFO blocks forever; reading a character device never ends) and says why it is not usable.

Two ways to report a problem, by who owns the file:
- configuration files (cfg, hyp, ``.data``, weights, checkpoints): :func:`check_config_file`
  raises :class:`~build_utils.errors.ConfigError` (one line, exit 2);
- data files (images, labels): :func:`file_problem` returns the reason, which the caller puts in
  the dataset report and skips the file.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import BinaryIO

from build_utils.errors import ConfigError

_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"1.5 GiB"``, ``"12 B"``)."""
    for size, unit in _UNITS:
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def positive_env_int(name: str, unit: str) -> int | None:
    """The positive whole number in environment variable ``name`` (``_`` allowed), or None when
    it is unset or empty; anything else is one :class:`ConfigError` line, never ignored."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be a positive whole number ({unit})")
    return value


@dataclass(frozen=True)
class Limit:
    """One named limit. ``value()`` reads the environment each time (cheap), so a limit raised
    in the environment applies in every process, and tests can set it with ``monkeypatch``."""

    name: str  # what is limited, as the error line says it: "decoded pixels per image"
    env: str  # the environment variable that raises (or lowers) it
    default: int
    unit: str  # "bytes", "pixels", "nodes" or "px" (image side)
    why: str  # what real data needs, for the README's table

    def value(self) -> int:
        """The limit in force: ``$env`` when set (a positive integer, ``_`` allowed), else the
        default. A malformed value is a configuration mistake, not a reason to run unbounded."""
        value = positive_env_int(self.env, self.unit)
        return self.default if value is None else value

    def describe(self, value: int | None = None) -> str:
        """``"1 GiB"`` / ``"150000000 pixels"``: a value of this limit in its unit."""
        v = self.value() if value is None else value
        return format_bytes(v) if self.unit == "bytes" else f"{v} {self.unit}"

    def exceeded(self, actual: int, what: str = "") -> str:
        """The reason for ``actual`` over this limit: how much, the limit, its name, the fix:
        ``"2.1 GiB, over the limit of 512 MiB (bytes per image file); set ... to raise it"``."""
        head = f"{what} {self.describe(actual)}" if what else self.describe(actual)
        return (
            f"{head}, over the limit of {self.describe()} ({self.name}); set {self.env} to raise it"
        )


# The defaults: each sized from what real data needs (``why``) with room to spare, and small
# enough that one worker per core holding one such file fits a laptop's memory.
MAX_IMAGE_PIXELS = Limit(
    "decoded pixels per image",
    "YOLO_MAX_IMAGE_PIXELS",
    150_000_000,
    "pixels",
    "8K frames are 33 Mpx, aerial tiles of 10000x10000 are 100 Mpx; a decoded 150 Mpx image "
    "takes 450 MB (OpenCV itself stops at 2^30 px, OPENCV_IO_MAX_IMAGE_PIXELS)",
)
MAX_IMAGE_BYTES = Limit(
    "bytes per image file",
    "YOLO_MAX_IMAGE_BYTES",
    512 << 20,
    "bytes",
    "an uncompressed 150 Mpx TIFF is 450 MB; camera JPEGs are a few MB",
)
MAX_LABEL_BYTES = Limit(
    "bytes per label file",
    "YOLO_MAX_LABEL_BYTES",
    4 << 20,
    "bytes",
    "a 10,000-object label file (aerial scenes) is about 400 KB, the densest crowd-counting "
    "images (25,000 heads) about 1 MB; the limit also bounds the targets the loss matches",
)
MAX_LIST_BYTES = Limit(
    "bytes per image list file",
    "YOLO_MAX_LIST_BYTES",
    1 << 30,
    "bytes",
    "OpenImages' 1.7 M training paths take about 140 MB",
)
MAX_TEXT_BYTES = Limit(
    "bytes per cfg, hyp, .data, data.yaml or names file",
    "YOLO_MAX_TEXT_BYTES",
    4 << 20,
    "bytes",
    "the largest Darknet cfg here (yolov4-p6) is 24 KB; 10,000 class names about 200 KB",
)
MAX_WEIGHTS_BYTES = Limit(
    "bytes per weights or checkpoint file",
    "YOLO_MAX_WEIGHTS_BYTES",
    8 << 30,
    "bytes",
    "YOLOv7-E6E weights are 600 MB; a checkpoint adds the EMA and optimizer state (about 3x)",
)
MAX_ANNOTATION_BYTES = Limit(
    "bytes per COCO annotation JSON or id map",
    "YOLO_MAX_ANNOTATION_BYTES",
    2 << 30,
    "bytes",
    "COCO's instances_train2017.json is 448 MB, LVIS v1's train file 1.1 GB (parsed, about 8x "
    "that in memory)",
)
MAX_YAML_NODES = Limit(
    "YAML nodes per document, aliases expanded",
    "YOLO_MAX_YAML_NODES",
    100_000,
    "nodes",
    "a hyp file has about 30 values, a data.yaml with 10,000 names about 10,000",
)
MAX_IMG_SIZE = Limit(
    "pixels per side of --img-size",
    "YOLO_MAX_IMG_SIZE",
    8192,
    "px",
    "Darknet's largest cfgs train at 1536 px; 8K frames at native size are 7680 px wide",
)

ALL_LIMITS: tuple[Limit, ...] = (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_BYTES,
    MAX_LABEL_BYTES,
    MAX_LIST_BYTES,
    MAX_TEXT_BYTES,
    MAX_WEIGHTS_BYTES,
    MAX_ANNOTATION_BYTES,
    MAX_YAML_NODES,
    MAX_IMG_SIZE,
)


def check_limit_settings() -> None:
    """Read every limit's environment variable now: a malformed one is one line before anything
    is loaded or written, not at the first file it limits (mid-run, beside a run's files).

    Raises:
        ConfigError: a limit's variable that is set but no positive whole number.
    """
    for limit in ALL_LIMITS:
        limit.value()


_KINDS = (
    (stat.S_ISDIR, "a folder, not a file"),
    (stat.S_ISFIFO, "a FIFO (named pipe), not a regular file"),
    (stat.S_ISSOCK, "a socket, not a regular file"),
    (stat.S_ISCHR, "a character device, not a regular file"),
    (stat.S_ISBLK, "a block device, not a regular file"),
)


def stat_problem(st: os.stat_result, limit: Limit | None) -> str | None:
    """Why a file with status ``st`` must not be read as data (not a regular file, or over
    ``limit`` bytes; None: no size limit, e.g. videos), or None when it may be."""
    if not stat.S_ISREG(st.st_mode):
        for test, reason in _KINDS:
            if test(st.st_mode):
                return reason
        return "not a regular file"
    if limit is not None and st.st_size > limit.value():
        return limit.exceeded(st.st_size)
    return None


def file_problem(path: str | os.PathLike[str], limit: Limit | None) -> str | None:
    """Why ``path`` must not be read as data, or None when it is a regular file within
    ``limit`` bytes (None: any size). Follows symlinks (a link to an image is an image); a link
    loop, a dangling link, a FIFO, device, socket or folder is named as such. Never opens the
    file."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if e.errno == errno.ENOENT:
            return "dangling symbolic link" if os.path.islink(path) else "file not found"
        return f"cannot read: {e.strerror or e}"
    return stat_problem(st, limit)


class UnusableFile(Exception):
    """A data file that must not be read; ``str(e)`` is the reason (no path), for the report."""


def open_data_file(path: str | os.PathLike[str], limit: Limit | None) -> BinaryIO:
    """``path`` opened for binary reading after :func:`file_problem` (``limit`` None: any
    size); the open file is checked again (``fstat``), so a file swapped for a FIFO between the
    two checks is refused too. Opened non-blocking: opening a FIFO then returns at once instead
    of waiting for a writer.

    Raises:
        UnusableFile: the reason the file must not be read.
    """
    problem = file_problem(path, limit)
    if problem is not None:
        raise UnusableFile(problem)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise UnusableFile(f"cannot read: {e.strerror or e}") from e
    try:
        problem = stat_problem(os.fstat(fd), limit)
        if problem is not None:
            raise UnusableFile(problem)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_up_to(f: BinaryIO, cap: int) -> bytes:
    """At most ``cap + 1`` bytes of open file ``f`` (one more than ``cap`` tells a file that grew
    past it), asking for no more than its size + 1: ``read(n)`` reserves n bytes up front, and
    reserving a whole limit per image fails where memory is not overcommitted."""
    return f.read(min(os.fstat(f.fileno()).st_size, cap) + 1)


def read_data_file(path: str | os.PathLike[str], limit: Limit) -> bytes:
    """The bytes of data file ``path`` (an image, a label file), read only through
    :func:`open_data_file`; at most ``limit + 1`` bytes are read, so a file that grows while
    being read cannot exhaust memory either.

    Raises:
        UnusableFile: the reason the file must not be read.
    """
    cap = limit.value()
    with open_data_file(path, limit) as f:
        try:
            data = read_up_to(f, cap)
        except OSError as e:
            raise UnusableFile(f"cannot read: {e.strerror or e}") from e
    if len(data) > cap:
        raise UnusableFile(limit.exceeded(cap + 1, "more than"))
    return data


def check_config_file(path: str | os.PathLike[str], limit: Limit, what: str) -> int:
    """Size in bytes of configuration file ``path`` (a cfg, hyp, weights...), after checking it
    is a regular file within ``limit``; otherwise :class:`ConfigError` naming it (exit 2)."""
    problem = file_problem(path, limit)
    if problem is not None:
        raise ConfigError(f"{what}: {problem}", path)
    return os.stat(path).st_size


def read_limited_bytes(path: str | os.PathLike[str], limit: Limit, what: str) -> bytes:
    """The bytes of configuration file ``path``, read the way data files are
    (:func:`read_data_file`: regular file checked before and after a non-blocking open, at most
    ``limit + 1`` bytes read); any reason not to read it is one :class:`ConfigError` line."""
    try:
        return read_data_file(path, limit)
    except UnusableFile as e:
        raise ConfigError(f"{what}: {e}", path) from e


def decode_text(data: bytes, path: str | os.PathLike[str], what: str) -> str:
    """UTF-8 text of a configuration file (a UTF-8 byte-order mark is dropped); UTF-16/32 and
    other encodings get one line saying how to fix the file instead of a decoding traceback."""
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        raise ConfigError(f"{what} is UTF-32 text; save it as UTF-8", path)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{what} is UTF-16 text; save it as UTF-8", path)
    if b"\x00" in data:
        # Valid UTF-8, but no text file holds NUL: UTF-16 without a byte-order mark (every
        # ASCII character followed or preceded by NUL) or a binary file.
        raise ConfigError(
            f"{what} holds NUL bytes (byte 0x00 at offset {data.index(0)}): UTF-16 text "
            "without a byte-order mark, or not text; save it as UTF-8",
            path,
        )
    skip = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # the UTF-8 byte-order mark
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = skip + e.start  # offsets in the file, and its line, for the user to find it
        raise ConfigError(
            f"{what} is not UTF-8 text (byte 0x{data[at]:02x} at offset {at}, e.g. Latin-1 or "
            "Windows-1252); save it as UTF-8",
            path,
            data.count(b"\n", 0, at) + 1,
        ) from e


def read_config_text(path: str | os.PathLike[str], limit: Limit, what: str) -> str:
    """The UTF-8 text of a configuration file, checked as a regular file within ``limit``."""
    return decode_text(read_limited_bytes(path, limit, what), path, what)
