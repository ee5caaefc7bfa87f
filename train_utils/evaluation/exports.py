"""Detections written for other tools: YOLO-format ``.txt`` files and COCO JSON whose ids match
the official COCO annotation files.

Inside this repository a COCO image id is the dataset index and a category id is the class id
``0 .. nc - 1`` (``coco_utils.py``). The official ``instances_val2017.json`` numbers images by
the number in their file name (``000000397133.jpg`` -> 397133) and uses 80 of 91 category ids
(``COCO80_TO_91``); :func:`to_official_coco_ids` rewrites detections (and ground truth) to those
ids so that pycocotools can score them against the official file directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from build_utils.atomic import atomic_write, make_output_dir, reported_write
from build_utils.errors import ConfigError

# The official COCO category id of each of the 80 class indices of coco.names (ids 12, 26, 29,
# 30, 45, 66, 68, 69, 71, 83 are unused in the detection annotations).
COCO80_TO_91 = [
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27,
    28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 46, 47, 48, 49, 50, 51, 52, 53,
    54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80,
    81, 82, 84, 85, 86, 87, 88, 89, 90,
]  # fmt: skip
COCO_NC = 80


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


def write_yolo_txt(
    path: Path,
    det: np.ndarray,
    width: int,
    height: int,
    save_conf: bool,
    flag: str | None = None,
) -> None:
    """One image's detections as a YOLO ``.txt`` (an empty file when there are none), written
    atomically.

    Raises:
        OutputError: ``path`` cannot be written (``flag``: the option that chose the folder).
    """
    lines = yolo_txt_lines(det, width, height, save_conf)
    with reported_write(path, flag), atomic_write(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))


def write_dataset_txt(
    out_dir: Path,
    coco_gt: Any,
    detections: Sequence[dict[str, Any]],
    save_conf: bool,
    flag: str | None = None,
) -> int:
    """``out_dir/<image stem>.txt`` for every image of ``coco_gt`` (``file_name``, ``width``,
    ``height``), from COCO-format ``detections`` with internal ids. Returns the files written.

    Raises:
        OutputError: a file cannot be written (``flag``: the option that chose ``out_dir``).
    """
    from train_utils.evaluation.metrics import dets_by_image

    make_output_dir(out_dir, flag)
    dets = dets_by_image(detections)
    empty = np.zeros((0, 6))
    n = 0
    for img_id in sorted(coco_gt.getImgIds()):
        info = coco_gt.imgs[img_id]
        path = out_dir / f"{Path(info['file_name']).stem}.txt"
        h, w = info["height"], info["width"]
        write_yolo_txt(path, dets.get(img_id, empty), w, h, save_conf, flag)
        n += 1
    return n


def numeric_stems(img_files: Sequence[str]) -> list[int] | None:
    """The integer of every file stem (``000000397133.jpg`` -> 397133), or None if one is not a
    number or two are the same."""
    stems = [Path(f).stem for f in img_files]
    if not stems or not all(s.isdigit() for s in stems):
        return None
    ids = [int(s) for s in stems]
    return ids if len(set(ids)) == len(ids) else None


def resolve_coco_ids(flag: bool | None, nc: int, img_files: Sequence[str]) -> list[int] | None:
    """Whether to write official COCO ids, and the image id of each dataset index if so.

    ``flag`` None (the default) decides from the data: yes when there are 80 classes and every
    image file name is a distinct number, as in COCO's ``val2017``. True insists (and fails
    when that cannot work), False keeps the internal ids.
    """
    if flag is False:
        return None
    ids = numeric_stems(img_files)
    if flag is None:
        return ids if nc == COCO_NC else None
    if nc != COCO_NC:
        raise ConfigError(f"--coco-ids needs the 80 COCO classes, this dataset has {nc}")
    if ids is None:
        raise ConfigError(
            "--coco-ids needs image file names that are distinct numbers (000000397133.jpg); "
            f"e.g. {Path(img_files[0]).name if img_files else '(no images)'} is not"
        )
    return ids


def to_official_coco_ids(
    detections: Sequence[dict[str, Any]], image_ids: Sequence[int]
) -> list[dict[str, Any]]:
    """Detections with ``image_id`` = ``image_ids[dataset index]`` and ``category_id`` = COCO's
    id of the class (``COCO80_TO_91``)."""
    return [
        {
            **d,
            "image_id": image_ids[d["image_id"]],
            "category_id": COCO80_TO_91[d["category_id"]],
        }
        for d in detections
    ]


def gt_to_official_coco_ids(
    gt: Mapping[str, Any], image_ids: Sequence[int], names: Sequence[str]
) -> dict[str, Any]:
    """A ground-truth dict of ``coco_utils.coco_dict_from_dataset`` with the official ids."""
    return {
        **gt,
        "images": [{**im, "id": image_ids[im["id"]]} for im in gt["images"]],
        "annotations": [
            {
                **a,
                "image_id": image_ids[a["image_id"]],
                "category_id": COCO80_TO_91[a["category_id"]],
            }
            for a in gt["annotations"]
        ],
        "categories": [
            {
                **c,
                "id": COCO80_TO_91[c["id"]],
                "name": names[c["id"]] if c["id"] < len(names) else c.get("name", str(c["id"])),
            }
            for c in gt["categories"]
        ],
    }
