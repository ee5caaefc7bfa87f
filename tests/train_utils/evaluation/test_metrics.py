"""train_utils/evaluation/metrics.py against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from train_utils.evaluation.metrics import (
    ConfusionMatrix,
    ap_per_class,
    compute_ap,
    dets_by_image,
    evaluate_detections,
    match_detections,
)

# One image, 2 classes. Labels: two of class 0, one of class 1 (class, x1, y1, x2, y2).
LABELS = np.array(
    [
        [0, 0, 0, 10, 10],
        [0, 20, 20, 30, 30],
        [1, 50, 50, 60, 60],
    ],
    dtype=float,
)
# Detections (x1, y1, x2, y2, conf, class):
DETS = np.array(
    [
        [0, 0, 10, 10, 0.9, 0],  # TP for label 0
        [1, 1, 10, 10, 0.8, 0],  # IoU 0.81 with label 0, already taken: FP
        [50, 50, 60, 60, 0.7, 0],  # on the class-1 label, wrong class: FP
        [100, 100, 110, 110, 0.6, 1],  # on nothing: FP
    ],
    dtype=float,
)


def test_match_detections_tp_fp():
    assert match_detections(DETS, LABELS).tolist() == [True, False, False, False]


def test_match_takes_the_higher_confidence_first():
    # Listed low confidence first: the 0.9 detection still gets the label.
    dets = DETS[[1, 0]]
    assert match_detections(dets, LABELS).tolist() == [False, True]


def test_match_empty():
    assert match_detections(np.zeros((0, 6)), LABELS).shape == (0,)
    assert match_detections(DETS, np.zeros((0, 5))).tolist() == [False] * 4


def test_compute_ap_coco_101_points():
    # Recall 0.5 reached at precision 1, never more: 51 of 101 recall points have precision 1.
    assert compute_ap(np.array([0.5, 0.5, 0.5]), np.array([1, 0.5, 1 / 3])) == pytest.approx(
        51 / 101
    )
    assert compute_ap(np.array([1.0]), np.array([1.0])) == pytest.approx(1.0)
    assert compute_ap(np.zeros(0), np.zeros(0)) == 0.0


def test_confusion_matrix_cells():
    cm = ConfusionMatrix(nc=2)
    cm.process_image(DETS, LABELS)
    # rows predicted (0, 1, background), columns true (0, 1, background)
    assert cm.matrix.tolist() == [
        [1, 1, 1],  # label 0 found; class-1 label called 0; one duplicate on label 0
        [0, 0, 1],  # the class-1 detection on nothing
        [1, 0, 0],  # label (20, 20, 30, 30) missed
    ]


def test_confusion_matrix_ignores_low_confidence():
    cm = ConfusionMatrix(nc=2, conf=0.85)
    cm.process_image(DETS, LABELS)
    assert cm.matrix.tolist() == [[1, 0, 0], [0, 0, 0], [1, 1, 0]]


def test_ap_per_class_values():
    tp = match_detections(DETS, LABELS)
    m = ap_per_class(tp, DETS[:, 4], DETS[:, 5], LABELS[:, 0])
    assert m.classes.tolist() == [0, 1]
    assert m.n_labels.tolist() == [2, 1]
    assert m.ap50[0] == pytest.approx(51 / 101)
    assert m.ap50[1] == 0.0
    # Mean F1 is largest at confidence 0.9 (class 0: P 1, R 0.5; class 1 has no TP).
    assert m.best_conf == pytest.approx(0.9, abs=0.002)
    assert m.p[0] == pytest.approx(1.0, abs=0.01)
    assert m.r[0] == pytest.approx(0.5)
    assert m.r[1] == 0.0
    # At a threshold of 0.8 class 0 keeps two detections, one true: P 0.5, R 0.5.
    i = int(np.argmin(np.abs(m.px - 0.8)))
    assert m.p_curve[0, i] == pytest.approx(0.5, abs=1e-6)
    assert m.r_curve[0, i] == pytest.approx(0.5)
    assert m.f1_curve.shape == (2, len(m.px))
    assert m.mean == pytest.approx(((1.0 + m.p[1]) / 2, 0.25, 51 / 202), abs=0.01)


def test_evaluate_detections_from_coco_dicts():
    dets = [
        {"image_id": 0, "category_id": int(c), "bbox": [x1, y1, x2 - x1, y2 - y1], "score": s}
        for x1, y1, x2, y2, s, c in DETS.tolist()
    ]
    by_image = dets_by_image(dets)
    np.testing.assert_allclose(by_image[0], DETS)
    gt = {0: LABELS, 1: np.array([[1, 0, 0, 5, 5]], dtype=float)}  # image 1: a missed label
    out = evaluate_detections(gt, by_image, nc=2)
    assert out.per_class.n_labels.tolist() == [2, 2]
    assert out.confusion.matrix[2].tolist() == [1, 1, 0]
    assert out.per_class.ap50[0] == pytest.approx(51 / 101)


def test_perfect_detections():
    dets = np.concatenate([LABELS[:, 1:], np.ones((3, 1)), LABELS[:, :1]], 1)
    out = evaluate_detections({0: LABELS}, {0: dets}, nc=2)
    assert out.per_class.ap50.tolist() == pytest.approx([1.0, 1.0])
    assert out.per_class.p.tolist() == pytest.approx([1.0, 1.0])
    assert out.per_class.r.tolist() == pytest.approx([1.0, 1.0])
    assert np.trace(out.confusion.matrix) == 3
