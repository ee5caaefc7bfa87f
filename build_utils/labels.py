"""The files of a detection dataset and their checked labels, cached.

Which images: :func:`collect_image_files` turns a ``.txt`` list, a folder, an image or a list of
these into image paths in dataset order; :func:`cache_place` gives their cache files a short
name (``stem``).

Where the labels are: every image ``.../images/.../x.jpg`` has its labels in
``.../labels/.../x.txt`` (the *last* ``images`` folder of the path becomes ``labels``; with no
``images`` folder the label file sits beside the image). A label file has one ``class cx cy w h``
line per object, normalised to [0, 1] by the image's upright size (EXIF orientation applied); a
segment line ``class x1 y1 x2 y2 ...`` stands for the box around its points, as in YOLOv5. A
missing label file means an image without objects.

Checking and caching (:func:`load_labels`). Every image is decoded once (in a thread pool) and
every label line parsed once; the result (sizes, labels, what was wrong) goes to
``<stem>.cache.npz`` beside the list file or folder the user named (:func:`cache_place`), never
at a place derived from a list's entries, which may point anywhere; train and val never share a
cache. Any change to the files or the class count changes its key (:func:`label_cache_key`) and
rebuilds it. A corrupt cache, or one whose arrays disagree with each other
(:func:`cache_disagreement`), is rebuilt with a warning; a read-only folder only costs a warning.
A per-file list of problems goes to ``<stem>.cache_report.txt`` beside it. Bad images are
excluded and bad label lines dropped (rules in :func:`parse_label_text`, :func:`check_file`:
nothing that is not a regular file within its limit is opened); the caller decides what an empty
result means. No pickle anywhere (``np.savez``, loaded with ``allow_pickle=False``). The cache
holds every listed file in list order, so one cache serves every later order (e.g. the rect sort).
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
from build_utils.image_cache import npy_header
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
    open_data_file,
    read_config_text,
    read_data_file,
    read_up_to,
)
from build_utils.parse_config import beside_or_cwd
from build_utils.safe_yaml import short_text

LOGGER = logging.getLogger(__name__)

# 2: the key hashes the label files' bytes; caches live beside the list or folder.
# 3: polygon (segment) lines become their boxes instead of being dropped.
# 4: images that share a label file are excluded.
CACHE_VERSION = 4
LABEL_FIELDS = 5  # class cx cy w h
# A segment label line (YOLOv5/YOLOv8 "class x1 y1 x2 y2 x3 y3 ..."): a class and 3 or more points.
MIN_POLYGON_FIELDS = 7
# Label values this close outside [0, 1] are rounding noise from conversion tools: clipped.
# Farther out the line is rejected.
COORD_TOLERANCE = 1e-3
# A normalised side below this is a zero-size box (log(w) in the loss would blow up).
MIN_BOX_SIDE = 1e-5
_REPORT_LINE_CHARS = 80
# A cache file name longer than this (many sources joined) is shortened with a hash.
_MAX_STEM_CHARS = 64
_DIGEST_BYTES = 32  # blake2b digest size of the cache key and of each label file's hash


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


# The lists whose entries were found from the current folder, already reported by this process
# as (list, count): a run reads each list more than once (the anchor check, then the loader), and
# Darknet's own layout (`data/train.txt` listing `data/obj/x.jpg`) is read this way every time.
_REPORTED_FROM_CWD: set[tuple[str, int]] = set()


def read_image_list(path: Path) -> list[str]:
    """Image paths of a ``.txt`` list; relative ones are resolved against the list's folder,
    falling back to the current directory (ultralytics/yolov3's convention) when only that exists.
    Blank lines and lines starting with ``#`` (comments) are skipped.

    The list is configuration: a FIFO, device or folder named ``x.txt``, a list over
    :data:`~build_utils.limits.MAX_LIST_BYTES` or one not in UTF-8 is a
    :class:`~build_utils.errors.ConfigError` (one line). The entries are data: each is checked
    when the labels are (:func:`check_file`), never opened here."""
    text = read_config_text(path, MAX_LIST_BYTES, "image list")
    base = path.parent
    out, from_cwd, windows, beside = [], 0, [], []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        p = beside_or_cwd(line, base)
        if p != base / Path(line).expanduser():
            from_cwd += 1  # found only from the current folder
        elif not Path(line).expanduser().is_absolute():
            beside.append((len(out), line))
        if os.sep == "/" and "\\" in line and not p.exists():  # a Darknet list from Windows
            windows.append(line)
        out.append(os.path.abspath(p))
    if from_cwd:
        # A list of current-folder paths: one found nowhere is named there too, where the
        # others were found (was: beside the list, a place nobody looked).
        for k, line in beside:
            if not os.path.lexists(out[k]):
                out[k] = os.path.abspath(Path(line).expanduser())
    if windows:
        LOGGER.warning(
            "%s: %d path(s) not found are written with Windows separators (backslashes), such "
            "as %s; write them with / (here a backslash is part of the file name)",
            path,
            len(windows),
            short_text(windows[0]),
        )
    if from_cwd and (str(path), from_cwd) not in _REPORTED_FROM_CWD:
        _REPORTED_FROM_CWD.add((str(path), from_cwd))
        LOGGER.warning(
            "%s: %d relative path(s) exist only relative to the current directory, "
            "not to the list's folder; used them that way",
            path,
            from_cwd,
        )
    return out


def list_entry_problem(path: str, holder: str = "an image list") -> str | None:
    """Why ``path`` cannot be written into an image list (or another ``holder`` read as UTF-8
    text, a ``.data`` file), or None: :func:`read_image_list` reads a list as UTF-8 text, so a
    name that is not UTF-8 (its odd bytes read as lone surrogates, ``bad\\udce9.jpg``) would
    make the whole list unreadable. Loaders given a folder use such a file; only a list cannot
    name it."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(path[e.start]) - 0xDC00  # surrogateescape keeps byte b as U+DC00 + b
        return f"its name is not UTF-8 (byte 0x{byte:02x}), which {holder} cannot hold; rename it"
    return None


def collect_image_files(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> list[str]:
    """Image paths (absolute, in dataset order); their caches' name is :func:`cache_place`'s.

    ``path`` is a ``.txt`` list of images, a folder (searched recursively, sorted), a single
    image, or a list of any of these.

    Raises:
        DatasetError: a path that does not exist or is of an unsupported kind.
    """
    sources = list(path) if isinstance(path, list | tuple) else [path]
    files: list[str] = []
    for src in sources:
        p = Path(os.fspath(src)).expanduser()
        if p.is_dir():
            files += list_images(p)
        elif p.suffix.lower() == ".txt" and os.path.lexists(p):
            files += read_image_list(p)
        elif is_image_file(p) and os.path.lexists(p):
            # Whatever it is (a FIFO, a link loop), check_file says why it is not usable.
            files.append(os.path.abspath(p))
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
    return files


def data_folders(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> tuple[list[Path], list[Path]]:
    """The folders that hold the images of ``path`` (as :func:`collect_image_files` takes it)
    and those that hold their label files (:func:`img2label_path`), each once, in dataset order:
    what a tool that reads the dataset must not write into. A folder source is itself and its
    labels' counterpart (a later scan takes anything written inside it), not scanned; lists and
    single images name their images' folders.

    Raises:
        DatasetError: as :func:`collect_image_files`.
    """
    sources = list(path) if isinstance(path, list | tuple) else [path]
    images: list[str] = []
    for src in sources:
        p = Path(os.fspath(src)).expanduser()
        # A file inside the folder maps to its labels' folder as every image in it does.
        images += [os.path.join(p, "x.jpg")] if p.is_dir() else collect_image_files(p)
    image_dirs = dict.fromkeys(Path(f).parent for f in images)
    label_dirs = dict.fromkeys(Path(img2label_path(f)).parent for f in images)
    return list(image_dirs), list(label_dirs)


def cache_place(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Path:
    """Where the caches of the dataset ``path`` (as :func:`collect_image_files` takes it) live,
    as ``folder / stem``; callers add ``.cache.npz``, ``.cache_report.txt``, ``.img<size>``.

    ``folder`` holds the first source the user named: a list ``d/train.txt`` -> ``d/train``; a
    folder ``d/val`` -> ``d/val`` (beside the folder, not inside it among the images); a folder
    named ``images`` takes its parent's name (``d/train/images`` -> ``d/train/train``); an image
    ``d/x.jpg`` -> ``d/x``. Several sources: beside the first, their names joined with ``+``.
    Nothing here depends on the entries of a list, which may point anywhere (``../../x``): a
    cache never lands outside the place the user named. Paths are made absolute first, so
    ``.`` or ``..`` name the real folder.
    """
    sources = list(path) if isinstance(path, list | tuple) else [path]
    if not sources:
        raise DatasetError("no image list, folder or image given")
    places = [Path(os.path.abspath(Path(os.fspath(src)).expanduser())) for src in sources]
    stems = []
    for p in places:
        if p.is_dir():
            stems.append(p.parent.name if p.name == "images" and p.parent.name else p.name)
        else:
            stems.append(p.stem)
    stems = [s or "dataset" for s in stems]  # "/" has no name
    stem = "+".join(stems)
    if len(stem) > _MAX_STEM_CHARS:
        digest = hashlib.sha1(os.fsencode(stem)).hexdigest()[:8]  # any folder name's bytes
        stem = f"{stems[0][:40]}+{len(stems) - 1}-{digest}"
    return places[0].parent / stem


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


def yolo_txt_lines(det: np.ndarray, width: int, height: int, save_conf: bool) -> list[str]:
    """YOLO label lines ``class cx cy w h [conf]`` (normalised to the image) for one image.

    Args:
        det: ``(n, 6)`` = x1, y1, x2, y2 in image pixels, confidence, class.
    """
    det = np.asarray(det, dtype=np.float64).reshape(-1, 6)
    lines = []
    for x1, y1, x2, y2, conf, c in det.tolist():
        x1, x2 = max(0.0, x1), min(float(width), x2)
        y1, y2 = max(0.0, y1), min(float(height), y2)
        cx, cy = (x1 + x2) / 2 / width, (y1 + y2) / 2 / height
        w, h = (x2 - x1) / width, (y2 - y1) / height
        line = f"{int(c)} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}"
        lines.append(line + (f" {conf:.5f}" if save_conf else ""))
    return lines


def _line_values(fields: list[str], nc: int | None) -> tuple[float, list[float]] | str:
    """(class, [cx, cy, w, h]) of one label line's fields (a polygon's as the box around its
    points), or why the line is dropped."""
    polygon = len(fields) >= MIN_POLYGON_FIELDS and len(fields) % 2 == 1
    if len(fields) != LABEL_FIELDS and not polygon:
        return (
            f"{len(fields)} fields, expected {LABEL_FIELDS} (class cx cy w h) "
            "or a polygon (class x1 y1 x2 y2 x3 y3 ...)"
        )
    try:
        values = [float(v) for v in fields]
    except ValueError:
        return "not a number"
    if not all(math.isfinite(v) for v in values):
        return "NaN or infinite value"
    c, coords = values[0], values[1:]
    if c != int(c) or c < 0:
        return f"class id {fields[0]} is not a non-negative integer"
    if nc is not None and c >= nc:
        return f"class id {int(c)} outside [0, {nc})"
    if any(v < -COORD_TOLERANCE or v > 1 + COORD_TOLERANCE for v in coords):
        return "coordinate outside [0, 1]"
    if polygon:
        xs, ys = coords[0::2], coords[1::2]
        x1, y1, x2, y2 = min(xs), min(ys), max(xs), max(ys)
        coords = [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]
    return c, coords


def parse_label_text(
    text: str, nc: int | None, where: str = ""
) -> tuple[np.ndarray, int, int, list[str]]:
    """Parse and check the lines of a YOLO label file.

    Blank lines are ignored. A polygon line ``class x1 y1 x2 y2 x3 y3 ...`` (a segment label,
    3 or more points) becomes the box around its points, as YOLOv5's ``segments2boxes`` does.
    A line is dropped, with a note ``where:line: dropped: reason``, when it has neither 5
    fields nor a polygon's, holds a non-number, NaN or infinity, a class id that is not an
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
        checked = _line_values(line.split(), nc)
        if isinstance(checked, str):
            bad(lineno, checked, line)
            continue
        c, coords = checked
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
    """Check one image and its label file (see :func:`parse_label_text`). The image is excluded,
    with the reason, when :func:`~build_utils.image_io.check_image` refuses it or its label file
    is not a regular UTF-8 file within :data:`~build_utils.limits.MAX_LABEL_BYTES` (its objects
    are unknown); a label file that does not exist means no objects."""
    empty = np.zeros((0, LABEL_FIELDS), np.float32)
    if not is_image_file(img_path):
        # A /dev/zero in a list is "a character device", whatever its name says (check_image
        # says what is wrong with a file named like an image).
        kind = file_problem(img_path, None)
        if kind is None or kind == "file not found":
            kind = f"not an image file type (supported: {', '.join(IMG_FORMATS)})"
        return FileCheck(None, empty, "missing", kind)
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


def label_file_digest(path: str) -> str:
    """What a label file adds to the cache key: the blake2b hash of its bytes, or, for a file
    that is not read (missing, not a regular file, over :data:`~build_utils.limits.MAX_LABEL_BYTES`,
    unreadable), the reason. Opened by :func:`~build_utils.limits.open_data_file`: stat first,
    a non-blocking open, and ``fstat`` again (a FIFO swapped in after the stat is not read)."""
    try:
        with open_data_file(path, MAX_LABEL_BYTES) as f:
            data = read_up_to(f, MAX_LABEL_BYTES.value())
    except UnusableFile as e:
        return f"!{e}"
    except OSError as e:
        return f"!cannot read: {e.strerror or e}"
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).hexdigest()


def label_cache_key(img_files: Sequence[str], label_files: Sequence[str], nc: int | None) -> str:
    """Hash (blake2b) of the image and label file names, the images' sizes and modification
    times, the label files' bytes (:func:`label_file_digest`) and the class count.

    Labels are hashed by content because a size and a time say nothing when a label is edited
    and its time put back (``touch -r``, a copy with ``cp -p``, a checkout); they are small, so
    that costs little next to the stamps (``docs/RELIABILITY.md``; a thread pool was no faster,
    so the files are read in order). Images keep the cheap stamp: hashing them would cost as
    much as checking them."""
    h = hashlib.blake2b(f"v{CACHE_VERSION}|nc={nc}\n".encode(), digest_size=_DIGEST_BYTES)
    for img, lbl in zip(img_files, label_files):
        # os.fsencode: a name that is not UTF-8 (``b"bad\xe9.jpg"`` reads as a lone surrogate)
        # hashes as its bytes on disk instead of failing to encode.
        h.update(os.fsencode(f"{img}|{file_stamp(img)}|{lbl}|{label_file_digest(lbl)}\n"))
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
            f"missing, {s['empty']} empty, {s['corrupt']} images excluded for an unusable image "
            "or label file, "
            f"{s['duplicate']} duplicate rows and {s['bad']} bad label lines dropped"
        )


def _label_file_clashes(
    img_files: Sequence[str], label_files: Sequence[str], results: Sequence[FileCheck]
) -> dict[int, str]:
    """Why each usable image whose label file also belongs to another image is excluded
    (``x.jpg`` and ``x.png`` both read ``labels/x.txt``: whose objects they are is unknown).
    The same image listed twice (oversampling) shares its labels with itself: no clash."""
    owners: dict[str, set[str]] = {}
    for img, lbl, r in zip(img_files, label_files, results):
        if r.size is not None and r.state != "missing":
            owners.setdefault(lbl, set()).add(img)
    clashes = {}
    for k, (img, lbl, r) in enumerate(zip(img_files, label_files, results)):
        others = sorted(owners.get(lbl, set()) - {img})
        if r.size is not None and others:
            clashes[k] = (
                f"its label file {lbl} is also the one of {others[0]}; give each image its own name"
            )
    return clashes


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

    results = list(map_in_threads(check, range(len(img_files)), desc, progress))
    for k, reason in _label_file_clashes(img_files, label_files, results).items():
        results[k] = FileCheck(None, np.zeros((0, LABEL_FIELDS), np.float32), "missing", reason)
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


# The arrays of a cache file, as save_label_cache writes them.
_CACHE_ARRAYS = ("files", "ok", "sizes", "counts", "labels", "stats", "report")
# Box corners of saved labels may overshoot [0, 1] by float32 rounding of the clipped values.
_CORNER_SLACK = 1e-5


def cache_disagreement(arrays: dict[str, np.ndarray], nc: int | None) -> str | None:
    """What in the arrays of a label cache disagrees with the rest, or None when they agree.

    The cache is only trusted when it could have been written by :func:`save_label_cache` from
    a real check: kinds and shapes of every array, one entry per file in ``files``/``ok``/
    ``sizes``/``counts``, counts that add up to the label rows and are 0 for excluded images,
    sizes that are positive exactly for the images kept, stats that count every file once and
    the excluded ones as ``corrupt``, a report line for every exclusion and dropped line, and
    labels a check could have produced (finite, class ids in ``[0, nc)``, boxes inside the image
    and not zero-size). A cache that passes gives a summary that is true of the images used.
    """
    files, ok, sizes = arrays["files"], arrays["ok"], arrays["sizes"]
    counts, labels, stats, report = (arrays[k] for k in ("counts", "labels", "stats", "report"))
    kinds = {
        "files": (files, "U", 1),
        "ok": (ok, "b", 1),
        "sizes": (sizes, "i", 2),
        "counts": (counts, "i", 1),
        "labels": (labels, "f", 2),
        "stats": (stats, "i", 1),
        "report": (report, "U", 1),
    }
    for name, (a, kind, ndim) in kinds.items():
        if a.dtype.kind != kind or a.ndim != ndim:
            return f"{name} is {a.dtype} with {a.ndim} dimension(s)"
    n = len(files)
    for name, a in (("ok", ok), ("sizes", sizes), ("counts", counts)):
        if len(a) != n:
            return f"{len(a)} entries in {name} for {n} files"
    if sizes.shape[1] != 2 or labels.shape[1] != LABEL_FIELDS or labels.dtype != np.float32:
        return f"sizes of shape {sizes.shape}, labels of shape {labels.shape} {labels.dtype}"
    if len(stats) != len(LabelCache.STAT_NAMES) or (stats < 0).any():
        return f"stats {stats.tolist()}"
    if (counts < 0).any() or int(counts.sum()) != len(labels):
        return f"label counts add up to {int(counts.sum())} but {len(labels)} label rows are stored"
    if (counts[~ok] != 0).any():
        return "labels stored for excluded images"
    if (sizes[ok] < 1).any() or (sizes[~ok] != 0).any():
        return "image sizes disagree with which images are kept"
    found, missing, empty, corrupt, duplicate, bad = (int(v) for v in stats)
    if found + missing + empty + corrupt != n:
        return f"stats count {found + missing + empty + corrupt} files, the cache holds {n}"
    if corrupt != int((~ok).sum()):
        return f"stats say {corrupt} images excluded, {int((~ok).sum())} are marked excluded"
    if int((counts > 0).sum()) > found:
        return f"{int((counts > 0).sum())} images have labels but {found} label files were found"
    if len(report) < corrupt + duplicate + bad:
        return f"{len(report)} report lines for {corrupt + duplicate + bad} problems"
    if len(labels):
        cls, xywh = labels[:, 0], labels[:, 1:].astype(np.float64)
        if not np.isfinite(labels).all():
            return "NaN or infinite label values"
        if (cls < 0).any() or (cls != np.round(cls)).any():
            return "class ids that are not non-negative integers"
        if nc is not None and (cls >= nc).any():
            return f"class id {int(cls.max())} outside [0, {nc})"
        half = xywh[:, 2:] / 2
        lo, hi = xywh[:, :2] - half, xywh[:, :2] + half
        if (lo < -_CORNER_SLACK).any() or (hi > 1 + _CORNER_SLACK).any():
            return "boxes outside [0, 1]"
        if (xywh[:, 2:] < MIN_BOX_SIDE * (1 - _CORNER_SLACK)).any():
            return "zero-size boxes"
    return None


def _oversized_member(archive: zipfile.ZipFile, file_bytes: int) -> str | None:
    """A member of a cache file whose array ``np.load`` would allocate beyond what the file holds
    (it allocates the shape the header declares before reading): a compressed member (a zip bomb;
    ``np.savez`` stores), a stored size over the file's, or a header declaring more bytes than
    its member has. None when every member fits, so loading costs at most the file's size."""
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            return f"member {info.filename} is compressed"
        if info.file_size > file_bytes:
            return (
                f"member {info.filename} claims {info.file_size} bytes in a {file_bytes}-byte file"
            )
        try:
            with archive.open(info) as f:
                shape, _, dtype = npy_header(f)
        except ValueError as e:
            return f"member {info.filename}: {e}"
        if math.prod(shape) * dtype.itemsize > info.file_size:
            return f"member {info.filename} declares an array of shape {shape}, larger than itself"
    return None


def load_label_cache(path: Path, key: str, nc: int | None = None) -> LabelCache | None:
    """The cache at ``path`` if it is readable, was made for ``key`` and agrees with itself
    (:func:`cache_disagreement`, class ids checked against ``nc``); else None. A corrupt or
    inconsistent file is reported with a warning naming it and what was wrong, and rebuilt."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            oversized = _oversized_member(z.zip, path.stat().st_size)
            if oversized is not None:
                raise ValueError(oversized)
            if int(z["version"]) != CACHE_VERSION or str(z["key"]) != key:
                LOGGER.info("label cache %s is out of date; rebuilding", path)
                return None
            arrays = {name: z[name] for name in _CACHE_ARRAYS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        # numpy's words for a file that is no .npz advise loading it unsafely: never here.
        why = "not a .npz file: corrupt" if "allow_pickle" in str(e) else e
        LOGGER.warning("label cache %s is unreadable (%s); rebuilding", path, why)
        return None
    problem = cache_disagreement(arrays, nc)
    if problem is not None:
        LOGGER.warning("label cache %s disagrees with itself (%s); rebuilding", path, problem)
        return None
    counts = arrays["counts"]
    split = np.split(arrays["labels"], np.cumsum(counts)[:-1]) if len(counts) else []
    return LabelCache(
        files=[str(f) for f in arrays["files"]],
        ok=arrays["ok"].astype(bool),
        sizes=arrays["sizes"].astype(np.int64),
        labels=[np.ascontiguousarray(x, dtype=np.float32) for x in split],
        stats=dict(zip(LabelCache.STAT_NAMES, (int(v) for v in arrays["stats"]))),
        report=[str(r) for r in arrays["report"]],
    )


def write_report(path: Path, header: str, lines: Sequence[str], warn: bool = True) -> None:
    """Write the per-file problem list; a failure is only a warning (``warn``: else a debug
    line, where the cache's warning has already named the unwritable folder). A file name that
    is not UTF-8 is written as its bytes on disk (``surrogateescape``), so the report names the
    very file; nothing reads the report back."""
    try:
        with atomic_write(path, "w", errors="surrogateescape") as f:
            f.write(f"# {header}\n")
            f.writelines(line + "\n" for line in lines)
    except OSError as e:
        log = LOGGER.warning if warn else LOGGER.debug
        log("cannot write label report %s (%s)", path, e.strerror or e)


# Checked labels whose cache could not be written (a read-only dataset), kept for the rest of
# the process by (cache file, key): the next dataset of the same files (the start-up check,
# then the training set) reuses the check instead of doing it and warning again. A few
# datasets' worth: a process reads its train and val sets, and tools a handful.
_UNSAVED_MAX = 4
_unsaved: dict[tuple[str, str], LabelCache] = {}


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
    exactly these files (names, image sizes and modification times, label contents) and ``nc``
    and agrees with itself; otherwise every file is checked now (:func:`build_label_cache`) and
    the cache and the problem report at ``report_path`` are rewritten. Unwritable files only
    cost one warning per process: the check is kept in memory (see :data:`_unsaved`)."""
    key = label_cache_key(img_files, label_files, nc)
    unsaved = _unsaved.get((str(cache_path), key))
    if unsaved is not None:
        return unsaved
    cache = load_label_cache(cache_path, key, nc)
    if cache is not None and cache.files != img_files:
        # The key hashes the file names, so this cache was altered after it was written.
        LOGGER.warning(
            "label cache %s disagrees with itself (its file list is not the one its key "
            "was made for); rebuilding",
            cache_path,
        )
        cache = None
    if cache is None:
        cache = build_label_cache(img_files, label_files, nc, progress=progress, desc=desc)
        saved = save_label_cache(cache_path, key, cache)
        write_report(report_path, cache.summary(), cache.report, warn=saved)
        if not saved:
            _unsaved[(str(cache_path), key)] = cache
            while len(_unsaved) > _UNSAVED_MAX:
                del _unsaved[next(iter(_unsaved))]  # the oldest
    return cache
