"""Detections written for other tools: YOLO-format ``.txt`` files and COCO JSON whose ids match
the official COCO annotation files, or the COCO JSON a dataset was converted from.

Inside this repository a COCO image id is the dataset index and a category id is the class id
``0 .. nc - 1`` (``coco_gt.py``). The official ``instances_val2017.json`` numbers images by
the number in their file name (``000000397133.jpg`` -> 397133) and uses 80 of 91 category ids
(``COCO80_TO_91``); :func:`to_official_coco_ids` rewrites detections (and ground truth) to those
ids so that pycocotools can score them against the official file directly. A dataset made by
``tools/coco2yolo.py`` names its ``coco_ids.json`` (class -> category id, image path -> image
id of the source JSON) in its data.yaml; :func:`read_coco_ids` reads it and
:func:`source_image_ids` gives the image ids the evaluation then uses (``coco_gt.py``), and the
same rewrites give the source JSON's category ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from build_utils.atomic import make_output_dir, write_text
from build_utils.errors import ConfigError
from build_utils.labels import yolo_txt_lines
from build_utils.limits import MAX_ANNOTATION_BYTES, read_config_text
from build_utils.safe_yaml import short_text

# The official COCO category id of each of the 80 class indices of coco.names (ids 12, 26, 29,
# 30, 45, 66, 68, 69, 71, 83 are unused in the detection annotations).
COCO80_TO_91 = [
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27,
    28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 46, 47, 48, 49, 50, 51, 52, 53,
    54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80,
    81, 82, 84, 85, 86, 87, 88, 89, 90,
]  # fmt: skip
COCO_NC = 80
# The id map tools/coco2yolo.py writes beside its data.yaml.
COCO_IDS_FILE = "coco_ids.json"


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
    write_text(path, "".join(line + "\n" for line in lines), flag)


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


def read_json_file(path: str | os.PathLike[str], what: str) -> Any:
    """The value of a JSON file a user hands over, read within ``MAX_ANNOTATION_BYTES`` as
    UTF-8; anything that is no JSON is one :class:`ConfigError` line."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ConfigError(f"{what} not found", path)
    text = read_config_text(path, MAX_ANNOTATION_BYTES, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON: {e.msg}", path, e.lineno) from e
    except (ValueError, RecursionError) as e:
        # An integer past Python's 4300 digits; arrays nested thousands deep.
        raise ConfigError(f"{what} is not usable JSON: {short_text(str(e))}", path) from e


@dataclass
class CocoIdMap:
    """``coco_ids.json`` of ``tools/coco2yolo.py``: what converted data came from. The one
    definition of that file's layout, written by the tool and read by evaluation."""

    category_ids: list[int]  # the source JSON's category id of each class
    names: list[str]
    # role -> images/<split>, or a list of them (train and train2 both converted)
    splits: dict[str, str | list[str]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # split -> source JSON
    images: dict[str, int] = field(default_factory=dict)  # map-relative image path -> image id

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def read_coco_ids(map_path: str | os.PathLike[str]) -> CocoIdMap:
    """Read a ``coco_ids.json``.

    Raises:
        ConfigError: one line for a missing or unreadable file, or one of another layout.
    """
    data = read_json_file(map_path, "COCO id map")
    try:
        return CocoIdMap(
            [int(i) for i in data["category_ids"]],
            [str(n) for n in data["names"]],
            dict(data.get("splits", {})),
            dict(data.get("sources", {})),
            {str(k): int(v) for k, v in data["images"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"not an id map of tools/coco2yolo.py ({e})", map_path) from e


def source_image_ids(
    map_path: str | os.PathLike[str], img_files: Sequence[str]
) -> tuple[list[int] | None, str | None]:
    """The source JSON's image id of every dataset image (by index), from the id map of
    ``tools/coco2yolo.py``; ``(None, why)`` when an image has none (one added after the
    conversion) or two images share one.

    Raises:
        ConfigError: the map cannot be read.
    """
    by_path = read_coco_ids(map_path).images
    root = Path(map_path).resolve().parent
    ids = []
    for f in img_files:
        key = Path(os.path.relpath(Path(f).resolve(), root)).as_posix()
        if key not in by_path:
            return None, f"image {short_text(key)} has no id in {map_path}"
        ids.append(by_path[key])
    if len(set(ids)) != len(ids):
        return None, f"two images share an id in {map_path}"
    return ids, None


def to_official_coco_ids(
    detections: Sequence[dict[str, Any]],
    image_ids: Sequence[int] | Mapping[int, int],
    category_ids: Sequence[int] = COCO80_TO_91,
) -> list[dict[str, Any]]:
    """Detections with ``image_id`` = ``image_ids[image_id]`` (the dataset index by default, or a
    mapping) and ``category_id`` = ``category_ids[class]`` (COCO's official ids by default)."""
    return [
        {
            **d,
            "image_id": image_ids[d["image_id"]],
            "category_id": category_ids[d["category_id"]],
        }
        for d in detections
    ]


def gt_to_official_coco_ids(
    gt: Mapping[str, Any],
    image_ids: Sequence[int] | Mapping[int, int],
    names: Sequence[str],
    category_ids: Sequence[int] = COCO80_TO_91,
) -> dict[str, Any]:
    """A ground-truth dict of ``coco_gt.coco_dict_from_dataset`` with the ids of
    ``image_ids`` and ``category_ids`` (official COCO ids by default)."""
    return {
        **gt,
        "images": [{**im, "id": image_ids[im["id"]]} for im in gt["images"]],
        "annotations": to_official_coco_ids(gt["annotations"], image_ids, category_ids),
        "categories": [
            {
                **c,
                "id": category_ids[c["id"]],
                "name": names[c["id"]] if c["id"] < len(names) else c.get("name", str(c["id"])),
            }
            for c in gt["categories"]
        ],
    }
