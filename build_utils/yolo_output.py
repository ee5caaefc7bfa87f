"""What the dataset converters (``tools/coco2yolo.py``, ``tools/trans_voc2yolo.py``) do the
same way: a label file, an image placed in the output, the report of what was skipped (each
converter counts its own), and which frame an annotation's boxes are normalised by. Their label
lines are ``build_utils.labels.yolo_txt_lines``'s, the one writer of YOLO lines (predict.py's
and validation.py's --save-txt)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from build_utils.atomic import atomic_write

DATA_YAML = "data.yaml"  # the dataset file train.py reads, written in the output folder
# Two sizes "have the same aspect ratio" within this relative tolerance (rounding of resizes).
ASPECT_TOLERANCE = 0.01


def same_aspect(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether sizes ``a`` and ``b`` (w, h) have one aspect ratio: an annotation's size of that
    shape is the image resized (boxes drawn on a copy of another size: normalised by it); of
    another shape it is wrong, and the image's own size normalises the boxes."""
    return abs(a[0] * b[1] - a[1] * b[0]) <= ASPECT_TOLERANCE * a[0] * b[1]


def write_labels(path: Path, lines: Sequence[str]) -> None:
    """``lines`` as the label file ``path`` (none: an empty file, a background image), written
    atomically: a conversion stopped midway leaves the old file or the new one, never half."""
    with atomic_write(path, "w", fsync=False) as f:
        f.write("".join(x + "\n" for x in lines))


def place_image(src: Path, dst: Path, copy: bool = False) -> None:
    """``dst`` becomes ``src``'s content: a hard link (no space, the input untouched), or a
    copy when asked or across file systems; atomically either way (never half an image)."""
    if not copy:
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.link")
        try:
            os.link(src, tmp)
            os.replace(tmp, dst)
            return
        except OSError:
            tmp.unlink(missing_ok=True)
    with open(src, "rb") as fin, atomic_write(dst, "wb", fsync=False) as fout:
        shutil.copyfileobj(fin, fout)


def report_text(summary: str, lines: Sequence[str]) -> str:
    """A conversion's report file: its ``summary`` as a ``#`` line, then one line per problem."""
    return f"# {summary}\n" + "".join(x + "\n" for x in lines)
