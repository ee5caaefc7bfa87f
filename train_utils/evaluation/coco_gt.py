"""Ground truth of a dataset as a COCO API object, for pycocotools scoring.

Image ids are dataset indices, or the ids a caller gives per dataset index (a dataset converted
by ``tools/coco2yolo.py`` gets its source JSON's: pycocotools breaks ties between equal scores
by the order of the image ids, so scoring with the source ids is what makes the figures equal
pycocotools' on the source JSON); :func:`dataset_image_ids` reads them back. Categories are the
class ids ``0 .. nc - 1`` (no mapping to the 91 COCO ids: the detections use the same class
ids). Boxes are in original-image pixels,
``[x_min, y_min, w, h]`` as COCO wants.

Building the ground truth reads every label once; with ``cache_dir`` the result is kept as JSON
keyed by the dataset's ``content_hash``, its ordered image list and the class count, so a changed
label, image set, order or class count never reuses a stale file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from pycocotools.coco import COCO

from build_utils.atomic import atomic_write
from build_utils.checks import is_int, is_real, shown
from build_utils.errors import ConfigError, DatasetError
from train_utils.evaluation.detection_files import read_json_file

logger = logging.getLogger(__name__)

# Bump when the layout of the cached dict changes, so that old cache files are not reused.
CACHE_VERSION = 1
CACHE_PREFIX = "coco_gt_"
CACHE_FILES = f"{CACHE_PREFIX}*.json"  # the cache files' names (a glob)


class _CocoIndexable(Protocol):
    img_files: list[str]
    content_hash: str

    def __len__(self) -> int: ...

    def coco_index(self, i: int) -> tuple[np.ndarray, tuple[int, int]]: ...


def _resolve_num_classes(dataset: Any, num_classes: int | None) -> int:
    return int(num_classes if num_classes is not None else dataset.nc)


def coco_dict_from_dataset(
    dataset: _CocoIndexable,
    num_classes: int | None = None,
    image_ids: Sequence[int] | None = None,
) -> dict:
    """The dataset's ground truth as a COCO-format dict (``images``, ``annotations``,
    ``categories``), images in dataset order.

    Args:
        dataset: provides ``len()``, ``img_files`` and ``coco_index(i) -> (labels, (h0, w0))``
            with ``labels (n, 5)`` = class, cx, cy, w, h normalised.
        num_classes: categories ``0 .. num_classes - 1``; default ``dataset.nc``.
        image_ids: the image id of each dataset index (distinct); default the index.

    Returns:
        image ``id`` = ``image_ids[index]`` or the dataset index, ``file_name`` = absolute
        image path, ``height``/``width`` of the original image; annotations with ``bbox`` =
        [x_min, y_min, w, h] original pixels, ``area = w * h``, ``iscrowd = 0``,
        ``category_id`` = class id, and ids from 1 (pycocotools treats an annotation id of 0
        as "unmatched").

    Raises:
        DatasetError: a label's class id is outside ``0 .. num_classes - 1``.
    """
    nc = _resolve_num_classes(dataset, num_classes)
    if image_ids is not None and (
        len(image_ids) != len(dataset) or len(set(image_ids)) != len(image_ids)
    ):
        raise ValueError(f"need {len(dataset)} distinct image ids, got {len(image_ids)}")
    ids = list(range(len(dataset))) if image_ids is None else [int(i) for i in image_ids]
    images: list[dict] = []
    annotations: list[dict] = []
    for i in range(len(dataset)):
        labels, (h0, w0) = dataset.coco_index(i)
        images.append(
            {
                "id": ids[i],
                "file_name": os.path.abspath(dataset.img_files[i]),
                "height": int(h0),
                "width": int(w0),
            }
        )
        labels = np.asarray(labels, dtype=np.float64).reshape(-1, 5)
        if labels.shape[0] == 0:
            continue
        cls = labels[:, 0].astype(np.int64)
        _check_classes(cls, nc, dataset.img_files[i])
        annotations += _annotations(labels, cls, (h0, w0), ids[i], len(annotations) + 1)
    categories = [{"id": c, "name": str(c), "supercategory": "none"} for c in range(nc)]
    return {
        "info": {"description": "ground truth built from the dataset"},
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }


def _check_classes(cls: np.ndarray, nc: int, path: str) -> None:
    """Raises DatasetError for a class id outside ``0 .. nc - 1``."""
    if cls.min() < 0 or cls.max() >= nc:
        bad = int(cls[(cls < 0) | (cls >= nc)][0])
        raise DatasetError(
            f"class id {bad} in the labels is outside 0..{nc - 1} ({nc} classes); "
            "check the .data file's classes against the labels",
            path=path,
        )


def _annotations(
    labels: np.ndarray, cls: np.ndarray, hw0: tuple[int, int], image_id: int, first_id: int
) -> list[dict]:
    """COCO annotations of one image's ``labels`` (n, 5) class, cx, cy, w, h normalised: boxes
    in original pixels ``hw0``, ids from ``first_id``."""
    h0, w0 = hw0
    w = labels[:, 3] * w0
    h = labels[:, 4] * h0
    x = labels[:, 1] * w0 - w / 2
    y = labels[:, 2] * h0 - h / 2
    boxes = np.stack((x, y, w, h), 1).tolist()
    areas = (w * h).tolist()
    return [
        {
            "id": first_id + k,
            "image_id": image_id,
            "category_id": c,
            "bbox": box,
            "area": area,
            "iscrowd": 0,
        }
        for k, (c, box, area) in enumerate(zip(cls.tolist(), boxes, areas))
    ]


def coco_from_dict(dataset_dict: dict) -> COCO:
    """A pycocotools COCO object from a COCO-format dict, without pycocotools' prints."""
    coco = COCO()
    coco.dataset = dataset_dict
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def dataset_image_ids(coco_gt: COCO) -> list[int] | None:
    """The image id of each dataset index of a ground truth built here (its images are in
    dataset order), or None when they are the indices themselves."""
    ids = [int(im["id"]) for im in coco_gt.dataset.get("images", [])]
    return None if ids == list(range(len(ids))) else ids


def cache_key(
    dataset: _CocoIndexable,
    num_classes: int | None = None,
    image_ids: Sequence[int] | None = None,
) -> str:
    """sha256 hex of everything that defines the ground truth: the dataset's ``content_hash``,
    its ordered image list, the class count, the image ids and the cache layout version."""
    h = hashlib.sha256()
    h.update(f"v{CACHE_VERSION}\n{dataset.content_hash}\n".encode())
    h.update(f"classes={_resolve_num_classes(dataset, num_classes)}\n".encode())
    if image_ids is not None:
        h.update(("ids=" + ",".join(str(int(i)) for i in image_ids) + "\n").encode())
    for f in dataset.img_files:
        h.update(os.fsencode(f))
        h.update(b"\n")
    return h.hexdigest()


def get_coco_api_from_dataset(
    dataset: _CocoIndexable,
    cache_dir: Path | None = None,
    num_classes: int | None = None,
    image_ids: Sequence[int] | None = None,
) -> COCO:
    """The dataset's ground truth as a pycocotools ``COCO`` (see :func:`coco_dict_from_dataset`).

    With ``cache_dir``, the dict is read from ``cache_dir / coco_gt_<key>.json`` when present
    and intact (``key`` = :func:`cache_key`), else built and written there atomically. A
    corrupt cache file is rebuilt; a cache that cannot be written (read-only folder) only logs
    a warning.
    """
    if cache_dir is None:
        return coco_from_dict(coco_dict_from_dataset(dataset, num_classes, image_ids))

    key = cache_key(dataset, num_classes, image_ids)
    path = Path(cache_dir) / f"{CACHE_PREFIX}{key}.json"
    cached = _read_cache(path, key)
    if cached is not None:
        logger.debug("COCO ground truth read from %s", path)
        return coco_from_dict(cached)

    coco_dict = coco_dict_from_dataset(dataset, num_classes, image_ids)
    coco_dict["info"]["cache_key"] = key
    _write_cache(path, coco_dict)
    return coco_from_dict(coco_dict)


def _read_cache(path: Path, key: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        logger.warning("COCO ground-truth cache %s is unreadable (%s); rebuilding it", path, e)
        return None
    valid = (
        isinstance(data, dict)
        and isinstance(data.get("info"), dict)
        and data["info"].get("cache_key") == key
        and all(isinstance(data.get(k), list) for k in ("images", "annotations", "categories"))
    )
    if not valid:
        logger.warning("COCO ground-truth cache %s is not a valid cache file; rebuilding it", path)
        return None
    return data


def _write_cache(path: Path, coco_dict: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as f:
            json.dump(coco_dict, f)
        logger.info("COCO ground truth cached to %s", path)
    except OSError as e:
        logger.warning("could not write the COCO ground-truth cache %s: %s", path, e)


def ground_truth_from_file(
    path: str | os.PathLike[str],
    image_ids: Sequence[int],
    category_ids: Sequence[int] = (),
    file_names: Sequence[str] = (),
) -> COCO:
    """The images ``image_ids`` of a COCO instances JSON and their annotations, crowd regions
    included (pycocotools ignores detections there), as a pycocotools ``COCO``: what a run's
    detections with that file's ids are scored against, as YOLOv5's val.py does for COCO. Read
    before the evaluation, so that a wrong file costs no inference. ``file_names``: the data's
    image files in the order of ``image_ids``, which the JSON's must mostly match.

    Raises:
        ConfigError: the file is no COCO JSON, lacks one of ``image_ids`` or ``category_ids``
            (the ids the detections will carry), names other pictures under those ids, or has
            an annotation pycocotools cannot score (a bbox that is not 4 numbers, ...).
    """
    data = read_json_file(path, "COCO annotation JSON")
    lists = isinstance(data, dict) and all(
        isinstance(data.get(k), list) for k in ("images", "annotations", "categories")
    )
    if not lists:
        raise ConfigError("expected a COCO JSON with images, annotations and categories", path)
    wanted = set(image_ids)
    try:
        images = [im for im in data["images"] if im.get("id") in wanted]
        anns = [a for a in data["annotations"] if a.get("image_id") in wanted]
        source = coco_from_dict({**data, "images": images, "annotations": anns})
    except (AttributeError, KeyError, TypeError) as e:
        # A number where a record should be, a record without its id, an id that is a list.
        raise ConfigError(
            "not a COCO instances JSON: each image, annotation and category must be an object "
            f"with its ids ({type(e).__name__}: {e})",
            path,
        ) from e
    missing = wanted - set(source.getImgIds())
    if missing:
        raise ConfigError(
            f"lists no image {min(missing)} (and {len(missing) - 1} more) of the data scored: "
            "not the JSON the data came from",
            path,
        )
    unknown = set(category_ids) - set(source.getCatIds())
    if unknown:
        raise ConfigError(
            f"lists no category {min(unknown)} of the data's classes: not the JSON the data "
            "came from",
            path,
        )
    _check_same_pictures(source, image_ids, file_names, path)
    for a in anns:
        problem = _annotation_problem(a)
        if problem is not None:
            raise ConfigError(f"annotation {shown(a.get('id'))}: {problem}", path)
    return source


def _check_same_pictures(
    source: COCO, image_ids: Sequence[int], file_names: Sequence[str], path: Any
) -> None:
    """Most of the JSON's images under ``image_ids`` have the names of the data's pictures
    (was: another split's JSON with overlapping ids was scored, without a word). Most, not all:
    a converter may have renamed a few that shared a name."""
    pairs = [
        (i, Path(str(source.imgs[i].get("file_name"))).name, Path(f).name)
        for i, f in zip(image_ids, file_names)
        if "file_name" in source.imgs[i]
    ]
    differ = [p for p in pairs if p[1] != p[2]]
    if pairs and 2 * len(differ) > len(pairs):
        i, theirs, ours = min(differ)
        raise ConfigError(
            f"{len(differ)} of its {len(pairs)} images with the data's ids are other pictures "
            f"(id {i}: {shown(theirs)} there, {shown(ours)} here): not the JSON the data came "
            "from",
            path,
        )


def _annotation_problem(a: dict[str, Any]) -> str | None:
    """Why pycocotools could not score annotation ``a`` (it would raise mid-evaluation)."""
    box = a.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(is_real(v) for v in box)):
        return f"bbox {shown(box)} is not 4 numbers"
    if not is_int(a.get("category_id")):
        return f"category_id {shown(a.get('category_id'))} is not an integer"
    if not is_real(a.get("area", 0)) or a.get("iscrowd", 0) not in (0, 1):
        return f"area {shown(a.get('area'))} or iscrowd {shown(a.get('iscrowd'))} is not valid"
    return None
