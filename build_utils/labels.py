"""The files of a detection dataset and their checked labels, cached.

Which images: :func:`collect_image_files` turns a ``.txt`` list, a folder, an image or a list of
these into image paths in dataset order, plus a short name (``stem``) for the cache files.

Where the labels are: every image ``.../images/.../x.jpg`` has its labels in
``.../labels/.../x.txt`` (the *last* ``images`` folder of the path becomes ``labels``; with no
``images`` folder the label file sits beside the image). A label file has one ``class cx cy w h``
line per object, normalised to [0, 1] by the image's upright size (EXIF orientation applied). A
missing label file means an image without objects.

Checking and caching (:func:`load_labels`). Every image is decoded once (in a thread pool) and
every label line parsed once; the result (sizes, labels, what was wrong) goes to
``<stem>.cache.npz`` beside the label folder (in the folder holding ``images/`` and ``labels/``;
``stem`` is the list file's name, so train and val never share a cache), keyed by a hash of the
image and label file names, sizes and modification times and of the class count: any change
rebuilds it, a corrupt cache is rebuilt and a read-only folder only costs a warning. A per-file
list of problems goes to ``<stem>.cache_report.txt`` beside it. Bad images are excluded and bad
label lines dropped (rules in :func:`parse_label_text`); the caller decides what an empty
result means. Nothing that is not a regular file within its limit is opened (a FIFO, device,
folder or link loop named like an image or label, a 40 GB sparse file, a PNG declaring more
pixels than :data:`~build_utils.limits.MAX_IMAGE_PIXELS`): such an image is excluded with the
reason (:func:`check_file`). No pickle anywhere (``np.savez`` with ``allow_pickle=False``).
The cache holds every listed file in list order, so one cache serves every later order (e.g.
the rect sort).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from build_utils.atomic import atomic_write
from build_utils.errors import DatasetError
from build_utils.image_io import (
    IMG_FORMATS,
    check_image,
    file_stamp,
    is_image_file,
    list_images,
    map_in_threads,
)
from build_utils.limits import (
    MAX_LABEL_BYTES,
    MAX_LIST_BYTES,
    UnusableFile,
    file_problem,
    read_config_text,
    read_data_file,
)

LOGGER = logging.getLogger(__name__)

CACHE_VERSION = 1
LABEL_FIELDS = 5  # class cx cy w h
# Label values this close outside [0, 1] are rounding noise from conversion tools: clipped.
# Farther out the line is rejected.
COORD_TOLERANCE = 1e-3
# A normalised side below this is a zero-size box (log(w) in the loss would blow up).
MIN_BOX_SIDE = 1e-5
_REPORT_LINE_CHARS = 80
# A cache file name longer than this (many sources joined) is shortened with a hash.
_MAX_STEM_CHARS = 64


# ---------------------------------------------------------------------------------------------
# Which files: label paths, image lists


def img2label_path(img_path: str) -> str:
    """Label file of an image: the last ``images`` folder component becomes ``labels`` and the
    extension ``.txt`` (``/d/images/a/images/x.jpg`` -> ``/d/images/a/labels/x.txt``)."""
    head, tail = os.path.split(img_path)
    parts = head.split(os.sep)
    for k in range(len(parts) - 1, -1, -1):
        if parts[k] == "images":
            parts[k] = "labels"
            break
    return os.path.join(os.sep.join(parts), os.path.splitext(tail)[0] + ".txt")


def label_root(img_path: str) -> str:
    """Folder that holds the label folder of an image: the parent of the last ``images``
    component (``/d/train/images/a/x.jpg`` -> ``/d/train``), or the parent of the image's folder
    when there is none. Caches and reports go there, beside the labels, not inside them."""
    parts = os.path.dirname(img_path).split(os.sep)
    for k in range(len(parts) - 1, -1, -1):
        if parts[k] == "images":
            return os.sep.join(parts[:k]) or os.sep
    return os.path.dirname(os.path.dirname(img_path))


def _read_list_file(path: Path) -> list[str]:
    """Image paths of a ``.txt`` list; relative ones are resolved against the list's folder,
    falling back to the current directory (the lineage's convention) when only that exists.
    Blank lines and lines starting with ``#`` (comments) are skipped.

    The list is configuration: a FIFO, device or folder named ``x.txt``, a list over
    :data:`~build_utils.limits.MAX_LIST_BYTES` or one not in UTF-8 is a
    :class:`~build_utils.errors.ConfigError` (one line). The entries are data: each is checked
    when the labels are (:func:`check_file`), never opened here."""
    text = read_config_text(path, MAX_LIST_BYTES, "image list")
    base = path.parent
    out, from_cwd = [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        p = Path(line).expanduser()
        if not p.is_absolute():
            beside = base / p
            if not beside.exists() and p.exists():
                beside, from_cwd = p, from_cwd + 1
            p = beside
        out.append(os.path.abspath(p))
    if from_cwd:
        LOGGER.warning(
            "%s: %d relative path(s) exist only relative to the current directory, "
            "not to the list's folder; used them that way",
            path,
            from_cwd,
        )
    return out


def collect_image_files(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> tuple[list[str], str]:
    """Image paths (absolute, in dataset order) and a short name for cache files.

    ``path`` is a ``.txt`` list of images, a folder (searched recursively, sorted), a single
    image, or a list of any of these.

    Raises:
        DatasetError: a path that does not exist or is of an unsupported kind.
    """
    sources = list(path) if isinstance(path, list | tuple) else [path]
    files: list[str] = []
    stems: list[str] = []
    for src in sources:
        p = Path(os.fspath(src)).expanduser()
        if p.is_dir():
            files += list_images(p)
            stems.append(p.parent.name if p.name == "images" and p.parent.name else p.name)
        elif p.suffix.lower() == ".txt" and os.path.lexists(p):
            files += _read_list_file(p)
            stems.append(p.stem)
        elif is_image_file(p) and os.path.lexists(p):
            # Whatever it is (a FIFO, a link loop), check_file says why it is not usable.
            files.append(os.path.abspath(p))
            stems.append(p.stem)
        elif not p.exists():
            raise DatasetError(
                "image list or folder not found; check the path (and the "
                "train/valid entries of the .data file)",
                p,
            )
        else:
            raise DatasetError(
                "expected a .txt list of image paths, a folder of images or an "
                f"image ({', '.join(IMG_FORMATS)})",
                p,
            )
    stem = "+".join(stems) or "dataset"
    if len(stem) > _MAX_STEM_CHARS:
        digest = hashlib.sha1(stem.encode()).hexdigest()[:8]
        stem = f"{stems[0][:40]}+{len(stems) - 1}-{digest}"
    return files, stem


# ---------------------------------------------------------------------------------------------
# Label parsing and checking


@dataclass
class FileCheck:
    """What checking one image and its label file found.

    ``size`` is the upright ``(w, h)``, or ``None`` when the image is excluded (``reason`` says
    why). ``labels``: ``(n, 5) float32`` class + normalised cxcywh. ``state`` of the label
    file: ``found``, ``missing``, ``empty`` or ``corrupt``. ``notes``: report lines.
    """

    size: tuple[int, int] | None
    labels: np.ndarray
    state: str
    reason: str = ""
    n_duplicate: int = 0
    n_bad: int = 0
    notes: list[str] = field(default_factory=list)


def _short(line: str) -> str:
    return line if len(line) <= _REPORT_LINE_CHARS else line[: _REPORT_LINE_CHARS - 3] + "..."


def parse_label_text(
    text: str, nc: int | None, where: str = ""
) -> tuple[np.ndarray, int, int, list[str]]:
    """Parse and check the lines of a YOLO label file.

    Blank lines are ignored. A line is dropped, with a note ``where:line: dropped: reason``, when
    it does not have 5 fields, holds a non-number, NaN or infinity, a class id that is not an
    integer in ``[0, nc)`` (only ``>= 0`` when ``nc`` is None), a value outside ``[0, 1]`` by
    more than :data:`COORD_TOLERANCE`, or a zero-size box. Values within the tolerance and box
    corners beyond the image are clipped (corners with a note). Exact duplicate rows are dropped.

    Returns:
        ``(labels (n, 5) float32 class + cxcywh normalised, n_duplicate, n_bad, notes)``.
    """
    rows: list[tuple[float, ...]] = []
    seen: set[tuple[float, ...]] = set()
    n_dup = n_bad = 0
    notes: list[str] = []

    def bad(lineno: int, why: str, line: str) -> None:
        nonlocal n_bad
        n_bad += 1
        notes.append(f"{where}:{lineno}: dropped: {why}: {_short(line)!r}")

    # Editors on Windows save UTF-8 with a byte-order mark; it is not part of the first number.
    for lineno, raw in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != LABEL_FIELDS:
            bad(lineno, f"{len(fields)} fields, expected {LABEL_FIELDS} (class cx cy w h)", line)
            continue
        try:
            values = [float(v) for v in fields]
        except ValueError:
            bad(lineno, "not a number", line)
            continue
        if not all(math.isfinite(v) for v in values):
            bad(lineno, "NaN or infinite value", line)
            continue
        c, coords = values[0], values[1:]
        if c != int(c) or c < 0:
            bad(lineno, f"class id {fields[0]} is not a non-negative integer", line)
            continue
        if nc is not None and c >= nc:
            bad(lineno, f"class id {int(c)} outside [0, {nc})", line)
            continue
        if any(v < -COORD_TOLERANCE or v > 1 + COORD_TOLERANCE for v in coords):
            bad(lineno, "coordinate outside [0, 1]", line)
            continue
        cx, cy, w, h = (min(max(v, 0.0), 1.0) for v in coords)
        x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
        overshoot = max(-x1, -y1, x2 - 1, y2 - 1)
        if overshoot > 0:
            if overshoot > COORD_TOLERANCE:
                notes.append(
                    f"{where}:{lineno}: clipped: box extends {overshoot:.4f} beyond the image"
                )
            x1, y1, x2, y2 = max(x1, 0.0), max(y1, 0.0), min(x2, 1.0), min(y2, 1.0)
            cx, cy, w, h = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1
        if w < MIN_BOX_SIDE or h < MIN_BOX_SIDE:
            bad(lineno, "zero-size box", line)
            continue
        row = (float(int(c)), cx, cy, w, h)
        if row in seen:
            n_dup += 1
            notes.append(f"{where}:{lineno}: dropped: duplicate of an earlier row")
            continue
        seen.add(row)
        rows.append(row)
    labels = np.array(rows, dtype=np.float32).reshape(-1, LABEL_FIELDS)
    return labels, n_dup, n_bad, notes


def check_file(img_path: str, label_path: str, nc: int | None) -> FileCheck:
    """Check one image and its label file (see :func:`parse_label_text`).

    Nothing is opened that is not a regular file within its limit (stat first, see
    :mod:`build_utils.limits`): an image that is a FIFO, device, socket, folder, link loop, over
    :data:`~build_utils.limits.MAX_IMAGE_BYTES` or declaring more pixels than
    :data:`~build_utils.limits.MAX_IMAGE_PIXELS` is excluded with that reason
    (:func:`~build_utils.image_io.check_image`), and so is an image whose label file is such a
    thing or over :data:`~build_utils.limits.MAX_LABEL_BYTES` (its objects are unknown). A label
    file that does not exist means no objects."""
    empty = np.zeros((0, LABEL_FIELDS), np.float32)
    kind = file_problem(img_path, None)
    if kind is not None and kind != "file not found":
        # A /dev/zero in a list is "a character device", whatever its name says.
        return FileCheck(None, empty, "missing", kind)
    if not is_image_file(img_path):
        return FileCheck(
            None, empty, "missing", f"not an image file type (supported: {', '.join(IMG_FORMATS)})"
        )
    size, reason = check_image(img_path)
    if size is None:
        return FileCheck(None, empty, "missing", reason or "unreadable image")
    if file_problem(label_path, None) == "file not found":
        return FileCheck(size, empty, "missing")
    try:
        text = read_data_file(label_path, MAX_LABEL_BYTES).decode("utf-8")
    except (UnusableFile, UnicodeDecodeError) as e:
        return FileCheck(None, empty, "corrupt", f"label file {label_path}: {e}")
    if not text.strip():
        return FileCheck(size, empty, "empty")
    labels, n_dup, n_bad, notes = parse_label_text(text, nc, label_path)
    return FileCheck(size, labels, "found", "", n_dup, n_bad, notes)


# ---------------------------------------------------------------------------------------------
# Cache and report


def label_cache_key(img_files: Sequence[str], label_files: Sequence[str], nc: int | None) -> str:
    """Hash of the file names, sizes and modification times and of the class count."""
    h = hashlib.sha256(f"v{CACHE_VERSION}|nc={nc}\n".encode())
    for img, lbl in zip(img_files, label_files):
        h.update(f"{img}|{file_stamp(img)}|{lbl}|{file_stamp(lbl)}\n".encode())
    return h.hexdigest()


@dataclass
class LabelCache:
    """Checked labels of a list of images (all of them, excluded ones with ``ok = False``).

    ``sizes``: ``(N, 2) int64`` upright ``(w, h)`` (0 when excluded); ``labels``: per image
    ``(n, 5) float32``; ``stats``: counts ``found, missing, empty, corrupt, duplicate, bad``.
    """

    files: list[str]
    ok: np.ndarray
    sizes: np.ndarray
    labels: list[np.ndarray]
    stats: dict[str, int]
    report: list[str]

    STAT_NAMES = ("found", "missing", "empty", "corrupt", "duplicate", "bad")

    def summary(self) -> str:
        s = self.stats
        return (
            f"{len(self.files)} images: {s['found']} label files found, {s['missing']} "
            f"missing, {s['empty']} empty, {s['corrupt']} corrupt images excluded, "
            f"{s['duplicate']} duplicate rows and {s['bad']} bad label lines dropped"
        )


def build_label_cache(
    img_files: Sequence[str],
    label_files: Sequence[str],
    nc: int | None,
    progress: bool = False,
    desc: str = "checking labels",
) -> LabelCache:
    """Check every image and label file (in a thread pool) and gather the results."""

    def check(k: int) -> FileCheck:
        return check_file(img_files[k], label_files[k], nc)

    results = map_in_threads(check, range(len(img_files)), desc, progress)
    stats = dict.fromkeys(LabelCache.STAT_NAMES, 0)
    report: list[str] = []
    for img, r in zip(img_files, results):
        if r.size is None:
            stats["corrupt"] += 1
            report.append(f"{img}: excluded: {r.reason}")
        else:
            stats[r.state] += 1
        stats["duplicate"] += r.n_duplicate
        stats["bad"] += r.n_bad
        report.extend(r.notes)
    return LabelCache(
        files=list(img_files),
        ok=np.array([r.size is not None for r in results], dtype=bool),
        sizes=np.array([r.size or (0, 0) for r in results], dtype=np.int64).reshape(-1, 2),
        labels=[r.labels for r in results],
        stats=stats,
        report=report,
    )


def save_label_cache(path: Path, key: str, cache: LabelCache) -> bool:
    """Write the cache atomically (:func:`~build_utils.atomic.atomic_write`). Returns False,
    with a warning, when the folder is not writable: a read-only dataset is fine, it is just
    checked again."""
    counts = np.array([len(x) for x in cache.labels], dtype=np.int64)
    labels = (
        np.concatenate(cache.labels) if cache.labels else np.zeros((0, LABEL_FIELDS), np.float32)
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "wb") as f:
            np.savez(
                f,
                version=np.int64(CACHE_VERSION),
                key=np.str_(key),
                files=np.array(cache.files, dtype=np.str_),
                ok=cache.ok,
                sizes=cache.sizes,
                counts=counts,
                labels=labels.astype(np.float32),
                stats=np.array([cache.stats[k] for k in LabelCache.STAT_NAMES]),
                report=np.array(cache.report, dtype=np.str_),
            )
    except OSError as e:
        LOGGER.warning(
            "cannot write label cache %s (%s); labels will be checked again next time",
            path,
            e.strerror or e,
        )
        return False
    return True


def load_label_cache(path: Path, key: str) -> LabelCache | None:
    """The cache at ``path`` if it is readable and was made for ``key``; else None (a corrupt
    file is reported with a warning and will be rebuilt)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["version"]) != CACHE_VERSION or str(z["key"]) != key:
                LOGGER.info("label cache %s is out of date; rebuilding", path)
                return None
            counts = z["counts"]
            labels = z["labels"]
            files = [str(f) for f in z["files"]]
            ok, sizes = z["ok"].astype(bool), z["sizes"].astype(np.int64)
            stats = dict(zip(LabelCache.STAT_NAMES, (int(v) for v in z["stats"])))
            report = [str(r) for r in z["report"]]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        LOGGER.warning("label cache %s is unreadable (%s); rebuilding", path, e)
        return None
    if (
        len(counts) != len(files)
        or counts.sum() != len(labels)
        or len(stats) != len(LabelCache.STAT_NAMES)
    ):
        LOGGER.warning("label cache %s is inconsistent; rebuilding", path)
        return None
    labels = labels.reshape(-1, LABEL_FIELDS)
    split = np.split(labels, np.cumsum(counts)[:-1]) if len(counts) else []
    return LabelCache(files, ok, sizes, [s.astype(np.float32) for s in split], stats, report)


def write_report(path: Path, header: str, lines: Sequence[str]) -> None:
    """Write the per-file problem list; a failure is only a warning."""
    try:
        with atomic_write(path, "w") as f:
            f.write(f"# {header}\n")
            f.writelines(line + "\n" for line in lines)
    except OSError as e:
        LOGGER.warning("cannot write label report %s (%s)", path, e.strerror or e)


def load_labels(
    img_files: list[str],
    label_files: list[str],
    nc: int | None,
    cache_path: Path,
    report_path: Path,
    progress: bool = False,
    desc: str = "checking labels",
) -> LabelCache:
    """The checked labels of ``img_files``: from the cache at ``cache_path`` when it was made for
    exactly these files (names, sizes, modification times) and ``nc``; otherwise every file is
    checked now (:func:`build_label_cache`) and the cache and the problem report at
    ``report_path`` are rewritten. Unwritable files only cost a warning."""
    key = label_cache_key(img_files, label_files, nc)
    cache = load_label_cache(cache_path, key)
    if cache is None or cache.files != img_files:
        cache = build_label_cache(img_files, label_files, nc, progress=progress, desc=desc)
        save_label_cache(cache_path, key, cache)
        write_report(report_path, cache.summary(), cache.report)
    return cache
