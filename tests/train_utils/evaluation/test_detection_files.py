"""train_utils/evaluation/detection_files.py: YOLO txt files and the official COCO id mapping."""

from __future__ import annotations

import pytest

from build_utils.errors import ConfigError
from train_utils.evaluation.detection_files import (
    COCO80_TO_91,
    gt_to_official_coco_ids,
    resolve_coco_ids,
    to_official_coco_ids,
)


def test_coco80_to_91_table():
    assert len(COCO80_TO_91) == 80 and len(set(COCO80_TO_91)) == 80
    assert COCO80_TO_91[0] == 1 and COCO80_TO_91[11] == 13 and COCO80_TO_91[-1] == 90
    assert sorted(COCO80_TO_91) == COCO80_TO_91
    assert not {12, 26, 29, 30, 45, 66, 68, 69, 71, 83} & set(COCO80_TO_91)


def test_resolve_coco_ids():
    files = ["/d/val2017/000000397133.jpg", "/d/val2017/000000000139.jpg"]
    assert resolve_coco_ids(None, 80, files) == [397133, 139]
    assert resolve_coco_ids(None, 5, files) is None  # not the COCO classes
    assert resolve_coco_ids(None, 80, ["a.jpg", "000000000139.jpg"]) is None
    assert resolve_coco_ids(None, 80, ["x/1.jpg", "y/001.jpg"]) is None  # same number twice
    assert resolve_coco_ids(False, 80, files) is None
    assert resolve_coco_ids(True, 80, files) == [397133, 139]
    with pytest.raises(ConfigError, match="needs the 80 COCO classes"):
        resolve_coco_ids(True, 20, files)
    with pytest.raises(ConfigError, match="distinct numbers"):
        resolve_coco_ids(True, 80, ["cat.jpg"])


def test_to_official_coco_ids():
    dets = [{"image_id": 1, "category_id": 11, "bbox": [1, 2, 3, 4], "score": 0.5}]
    assert to_official_coco_ids(dets, [397133, 139]) == [
        {"image_id": 139, "category_id": 13, "bbox": [1, 2, 3, 4], "score": 0.5}
    ]
    assert dets[0]["image_id"] == 1  # the input is not edited
    gt = {
        "images": [{"id": 0, "file_name": "a"}, {"id": 1, "file_name": "b"}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 79, "bbox": [0, 0, 1, 1]}],
        "categories": [{"id": c, "name": str(c)} for c in range(80)],
    }
    names = [f"n{c}" for c in range(80)]
    out = gt_to_official_coco_ids(gt, [397133, 139], names)
    assert [im["id"] for im in out["images"]] == [397133, 139]
    assert out["annotations"][0]["image_id"] == 139
    assert out["annotations"][0]["category_id"] == 90
    assert out["categories"][-1] == {"id": 90, "name": "n79"}
