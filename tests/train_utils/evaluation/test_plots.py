"""train_utils/evaluation/plots.py and report.py: every picture exists, has the expected size and
is not blank."""

from __future__ import annotations

import csv
from pathlib import Path

import cv2
import numpy as np
import pytest

from train_utils.config import load_data_config
from train_utils.evaluation.coco_gt import get_coco_api_from_dataset
from train_utils.evaluation.metrics import ap_per_class, match_detections
from train_utils.evaluation.plots import (
    MOSAIC_CELL,
    batch_to_images,
    plot_confusion_matrix,
    plot_curves,
    plot_images,
    plot_labels,
)
from train_utils.evaluation.report import write_eval_report

NAMES = ["circle", "square"]
EVAL_PICTURES = [
    "confusion_matrix.png",
    "PR_curve.png",
    "F1_curve.png",
    "P_curve.png",
    "R_curve.png",
    "val_batch0_labels.jpg",
    "val_batch0_pred.jpg",
]


def assert_picture(path: Path, min_hw: tuple[int, int] = (200, 200)) -> np.ndarray:
    """The file is an image at least ``min_hw`` (h, w) pixels and not one colour."""
    assert path.is_file(), path
    img = cv2.imread(str(path))
    assert img is not None, f"{path} is not a readable image"
    assert img.shape[0] >= min_hw[0] and img.shape[1] >= min_hw[1], img.shape
    assert img.reshape(-1, 3).std(0).max() > 5, f"{path} is blank"
    return img


def test_plot_labels(tmp_path):
    labels = [
        np.array([[0, 0.2, 0.3, 0.1, 0.2], [1, 0.7, 0.6, 0.3, 0.3]]),
        np.array([[1, 0.5, 0.5, 0.5, 0.4]]),
        np.zeros((0, 5)),
    ]
    plot_labels(labels, NAMES, tmp_path / "labels.png")
    assert_picture(tmp_path / "labels.png", (300, 1000))


def test_plot_images_from_batch(tmp_path):
    imgs = np.full((3, 3, 64, 96), 30, dtype=np.uint8)
    imgs[:, 0, 10:30, 10:50] = 250  # something to see
    targets = np.array([[0, 0, 0.3, 0.3, 0.4, 0.3], [2, 1, 0.5, 0.5, 0.2, 0.2]])
    images, boxes = batch_to_images(imgs, targets)
    assert [b.shape for b in boxes] == [(1, 6), (0, 6), (1, 6)]
    # image 0's box: centre (0.3 * 96, 0.3 * 64), size (0.4 * 96, 0.3 * 64)
    np.testing.assert_allclose(boxes[0][0, :4], [9.6, 9.6, 48.0, 28.8], atol=1e-6)
    assert images[0].shape == (64, 96, 3) and images[0][20, 20].tolist() == [30, 30, 250]
    plot_images(images, boxes, NAMES, tmp_path / "b.jpg", titles=["a", "b", "c"])
    img = assert_picture(tmp_path / "b.jpg", (2 * MOSAIC_CELL, 2 * MOSAIC_CELL))
    assert img.shape[:2] == (2 * MOSAIC_CELL, 2 * MOSAIC_CELL)


def test_plot_confusion_matrix(tmp_path):
    plot_confusion_matrix(np.array([[3, 1, 2], [0, 4, 1], [1, 0, 0]]), NAMES, tmp_path / "cm.png")
    assert_picture(tmp_path / "cm.png", (300, 300))


def test_plot_curves(tmp_path):
    labels = np.array([[0, 0, 0, 10, 10], [0, 20, 20, 30, 30], [1, 50, 50, 60, 60]], float)
    dets = np.array(
        [[0, 0, 10, 10, 0.9, 0], [50, 50, 60, 60, 0.7, 1], [20, 20, 30, 31, 0.4, 0]], float
    )
    m = ap_per_class(match_detections(dets, labels), dets[:, 4], dets[:, 5], labels[:, 0])
    written = plot_curves(m, NAMES, tmp_path)
    assert [p.name for p in written] == [
        "PR_curve.png",
        "F1_curve.png",
        "P_curve.png",
        "R_curve.png",
    ]
    for p in written:
        assert_picture(p, (300, 400))


@pytest.fixture
def shapes_gt(shapes_data):
    from train_utils.data_loaders import make_eval_dataset

    data = load_data_config(shapes_data)
    dataset = make_eval_dataset(data.valid, 128, 4, data.nc)
    return get_coco_api_from_dataset(dataset, num_classes=data.nc), data.names


def test_write_eval_report(tmp_path, shapes_gt):
    coco_gt, names = shapes_gt
    # Detections: every label found (confidence 0.9) except those of image 0, plus one false
    # positive of class 0 per image.
    dets = []
    for a in coco_gt.dataset["annotations"]:
        if a["image_id"] != 0:
            dets.append({**_det(a["image_id"], a["category_id"], a["bbox"], 0.9)})
    for i in coco_gt.getImgIds():
        dets.append(_det(i, 0, [1, 1, 5, 5], 0.5))
    metrics, _ = write_eval_report(tmp_path, coco_gt, dets, names)
    for name in EVAL_PICTURES:
        assert_picture(tmp_path / name, (200, 200))
    with (tmp_path / "per_class.csv").open() as f:
        table = list(csv.DictReader(f))
    assert table[0]["name"] == "all"
    n_labels = len(coco_gt.dataset["annotations"])
    assert int(table[0]["instances"]) == n_labels
    assert sum(int(r["instances"]) for r in table[1:]) == n_labels
    missed = len(coco_gt.imgToAnns[0])
    # Recall over all labels of a class: found / instances; the background row counts the misses.
    assert metrics.confusion.matrix[-1, :-1].sum() == missed
    assert metrics.confusion.matrix[0, -1] == len(coco_gt.getImgIds())
    # pycocotools' per-class AP is used when given
    _, rows2 = write_eval_report(tmp_path, coco_gt, dets, names, {0: (0.123, 0.456)})
    row0 = next(r for r in rows2 if r.cls == 0)
    assert (row0.ap, row0.ap50) == (0.123, 0.456)


def _det(image_id, cls, bbox, score):
    return {"image_id": image_id, "category_id": cls, "bbox": list(bbox), "score": score}


def test_val_batch_picture_skips_an_image_that_became_a_fifo(tmp_path):
    """The picture of the first validation images reads them like the loader does: one swapped
    for a FIFO since the dataset was checked is left out, not waited on."""
    import os
    import signal
    from types import SimpleNamespace

    from tests.build_utils.test_image_io import HANG_S, Hung, good_jpeg
    from train_utils.evaluation.report import plot_val_batch

    good = good_jpeg(tmp_path / "good.jpg", 96, 64)
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    imgs = {0: {"file_name": str(fifo)}, 1: {"file_name": str(good)}}
    coco_gt = SimpleNamespace(imgs=imgs, getImgIds=lambda: list(imgs))

    def on_alarm(signum, frame):
        raise Hung(f"blocked for {HANG_S} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_S)
    try:
        plot_val_batch(coco_gt, {}, {}, NAMES, tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert cv2.imread(str(tmp_path / "val_batch0_labels.jpg")) is not None
