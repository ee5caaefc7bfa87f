"""train_utils/evaluation/error_breakdown.py: the TIDE error types and their dAP, on a hand-made
case where each type appears exactly once, and its AP50 against pycocotools."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import numpy as np
import pytest
from conftest import CountingArray
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from train_utils.evaluation.error_breakdown import (
    BKG,
    BOTH,
    CLS,
    DUPE,
    FALSE_NEG,
    FALSE_POS,
    LOC,
    MAIN_ERRORS,
    MISSED,
    _mean_ap,
    error_breakdown,
    report_errors,
)
from train_utils.evaluation.metrics import dets_by_image, gt_by_image

# Image 0: five labels (class, x1, y1, x2, y2); image 1: one label nobody detects; image 2: none.
G1, G2, G3, G4, G6 = (
    [0, 0, 0, 100, 100],
    [0, 200, 0, 300, 100],
    [1, 0, 200, 100, 300],
    [0, 200, 200, 300, 300],
    [1, 400, 200, 500, 300],
)
G5 = [1, 0, 0, 100, 100]
# Detections of image 0 (x1, y1, x2, y2, score, class) and what each one is:
D_BKG = [550, 550, 600, 600, 0.97, 0]  # IoU 0 with every label: background
D1 = [0, 0, 100, 100, 0.95, 0]  # G1 exactly: true positive
D_DUP = [0, 0, 100, 80, 0.90, 0]  # IoU 0.8 with G1, which D1 took: duplicate
D_BOTH = [250, 250, 350, 350, 0.89, 1]  # IoU 1/7 with G4 (class 0), 0 with class 1: both
T6 = [400, 200, 500, 300, 0.80, 1]  # G6 exactly: true positive
D_CLS = [200, 0, 300, 100, 0.75, 1]  # G2 exactly, but class 1: classification
D_LOC = [0, 250, 100, 350, 0.70, 1]  # IoU 1/3 with G3, same class: localisation
T4 = [200, 200, 300, 300, 0.60, 0]  # G4 exactly: true positive


def _hand_made():
    gt = {
        0: np.array([G1, G2, G3, G4, G6], dtype=float),
        1: np.array([G5], dtype=float),
        2: np.zeros((0, 5)),
    }
    dets = {0: np.array([D_BKG, D1, D_DUP, D_BOTH, T6, D_CLS, D_LOC, T4], dtype=float)}
    return gt, dets


def _ap(hits: list[bool], n_labels: int) -> float:
    """COCO's AP of a ranked list of hits (best first): the mean over recall points
    0, 0.01, ..., 1 of the best precision at a recall of at least that point (0 past the last
    recall reached), written out in plain Python."""
    tp = 0
    points = []
    for k, hit in enumerate(hits, 1):
        tp += hit
        points.append((tp / n_labels, tp / k))
    total = 0.0
    for i in range(101):
        r = i / 100
        total += max((p for rec, p in points if rec >= r), default=0.0)
    return total / 101


def _map(class0: list[bool], class1: list[bool], n0: int = 3, n1: int = 3) -> float:
    """mAP in points over the two classes."""
    return 50 * (_ap(class0, n0) + _ap(class1, n1))


def test_each_error_type_once_and_its_dap():
    gt, dets = _hand_made()
    b = error_breakdown(gt, dets)
    assert b.counts == {
        CLS: 1,
        LOC: 1,
        BOTH: 1,
        DUPE: 1,
        BKG: 1,
        MISSED: 1,  # G5; G2 and G3 are pointed at by D_CLS and D_LOC
        FALSE_POS: 5,
        FALSE_NEG: 3,  # G2, G3, G5
    }
    # Ranked per class (True = true positive); 3 labels each (G1 G2 G4 / G3 G5 G6).
    c0 = [False, True, False, True]  # D_BKG D1 D_DUP T4
    c1 = [False, True, False, False]  # D_BOTH T6 D_CLS D_LOC
    base = _map(c0, c1)
    assert base == pytest.approx(25.0)  # (33.5 / 101 + 17 / 101) / 2
    assert b.ap50 == pytest.approx(base, abs=1e-9)
    fixed = {
        # D_CLS becomes G2's true positive in class 0 at 0.75 and leaves class 1.
        CLS: _map([False, True, False, True, True], [False, True, False]),
        # D_LOC becomes G3's true positive.
        LOC: _map(c0, [False, True, False, True]),
        BOTH: _map(c0, [True, False, False]),
        DUPE: _map([False, True, True], c1),
        BKG: _map([True, False, True], c1),
        MISSED: _map(c0, c1, n1=2),  # G5 leaves class 1's labels
        # Every false positive below every true positive.
        FALSE_POS: _map([True, True, False, False], [True, False, False, False]),
        # Every unmatched label gone: G2 from class 0, G3 and G5 from class 1.
        FALSE_NEG: _map(c0, c1, n0=2, n1=1),
    }
    for kind, ap in fixed.items():
        assert b.dap[kind] == pytest.approx(ap - base, abs=1e-9), kind
    # Six different effects, so no two types can have been swapped.
    assert len({round(b.dap[k], 6) for k in MAIN_ERRORS}) == 6
    assert min(b.dap[k] for k in MAIN_ERRORS) > 0


def test_fix_goes_to_the_best_error_of_a_label_and_none_to_a_matched_label():
    # Two localisation errors on one free label: only the higher-scoring one becomes its true
    # positive when fixed; a third points at a matched label and is only removed.
    gt = {0: np.array([[0, 0, 0, 100, 100], [0, 200, 0, 300, 100]], dtype=float)}
    dets = {
        0: np.array(
            [
                [200, 0, 300, 100, 0.9, 0],  # true positive of the second label
                [0, 50, 100, 150, 0.8, 0],  # IoU 1/3 with the first: localisation, fixed
                [0, 60, 100, 160, 0.7, 0],  # IoU 0.25: localisation, removed
                [200, 60, 300, 160, 0.6, 0],  # IoU 0.25 with the matched label: removed
            ],
            dtype=float,
        )
    }
    b = error_breakdown(gt, dets)
    assert b.counts[LOC] == 3 and b.counts[MISSED] == 0 and b.counts[FALSE_NEG] == 1
    assert b.ap50 == pytest.approx(100 * _ap([True, False, False, False], 2))
    assert b.dap[LOC] == pytest.approx(100 * (_ap([True, True], 2) - _ap([True] + [False] * 3, 2)))


def test_max_dets_and_images_without_labels():
    # 150 detections on an image without labels: background errors, only the best 100 kept.
    rng = np.random.default_rng(0)
    boxes = rng.uniform(0, 100, (150, 2))
    det = np.concatenate((boxes, boxes + 20, rng.uniform(0, 1, (150, 1)), np.zeros((150, 1))), 1)
    gt = {0: np.zeros((0, 5)), 1: np.array([[0, 0, 0, 50, 50]], dtype=float)}
    b = error_breakdown(gt, {0: det, 1: np.array([[0, 0, 50, 50, 0.5, 0]], dtype=float)})
    assert b.counts[BKG] == 100 and b.counts[FALSE_POS] == 100
    assert sum(b.counts[k] for k in MAIN_ERRORS) == 100
    # The true positive scores 0.5: about half the kept background boxes rank above it.
    above = int((np.sort(det[:, 4])[::-1][:100] > 0.5).sum())
    assert b.ap50 == pytest.approx(100 * _ap([False] * above + [True], 1))
    assert b.dap[BKG] == pytest.approx(100 - b.ap50)
    assert error_breakdown(gt, {0: det}, max_dets=10).counts[BKG] == 10


def _random_coco(seed: int) -> tuple[COCO, list[dict]]:
    """A COCO ground truth (12 images, 3 classes, some images empty) and detections (jittered
    labels, wrong classes, background boxes; at most 100 per image, every detected class has
    labels)."""
    rng = np.random.default_rng(seed)
    images, anns, dets = [], [], []
    for i in range(12):
        images.append({"id": i, "width": 640, "height": 480, "file_name": f"{i}.jpg"})
        for _ in range(int(rng.integers(0, 5)) if i % 4 else 0):
            x, y = rng.uniform(0, 400, 2)
            w, h = rng.uniform(10, 200, 2)
            c = int(rng.integers(0, 3))
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": c, "iscrowd": 0,
                         "bbox": [x, y, w, h], "area": w * h})  # fmt: skip
            for _ in range(int(rng.integers(0, 3))):
                jx, jy, jw, jh = rng.normal(0, rng.choice([0.05, 0.3]), 4) * [w, h, w, h]
                dc = c if rng.random() < 0.7 else int(rng.integers(0, 3))
                dets.append({"image_id": i, "category_id": dc, "score": float(rng.random()),
                             "bbox": [x + jx, y + jy, max(w + jw, 1), max(h + jh, 1)]})  # fmt: skip
        for _ in range(int(rng.integers(0, 4))):
            x, y = rng.uniform(0, 500, 2)
            dets.append({"image_id": i, "category_id": int(rng.integers(0, 3)),
                         "score": float(rng.random()), "bbox": [x, y, 40.0, 30.0]})  # fmt: skip
    cats = [{"id": c, "name": str(c)} for c in range(3)]
    gt = COCO()
    gt.dataset = {"images": images, "annotations": anns, "categories": cats}
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt, dets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ap50_is_pycocotools_map50(seed):
    gt, dets = _random_coco(seed)
    with contextlib.redirect_stdout(io.StringIO()):
        e = COCOeval(gt, gt.loadRes([dict(d) for d in dets]), "bbox")
        e.evaluate()
        e.accumulate()
        e.summarize()
    b = error_breakdown(gt_by_image(gt), dets_by_image(dets))
    assert 0.05 < e.stats[1] < 0.95
    assert b.ap50 == pytest.approx(100 * e.stats[1], abs=1e-9)
    assert b.counts[FALSE_POS] == sum(b.counts[k] for k in MAIN_ERRORS[:-1])
    assert all(0 <= b.dap[k] <= 100 - b.ap50 for k in MAIN_ERRORS)


def test_report_errors_logs_and_writes_json(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    gt, dets = _random_coco(0)
    b = report_errors(tmp_path, gt, dets, "--save-dir")
    saved = json.loads((tmp_path / "errors.json").read_text())
    assert saved["ap50"] == pytest.approx(b.ap50)
    assert (saved["pos_iou"], saved["bg_iou"], saved["max_dets"]) == (0.5, 0.1, 100)
    assert {k: v["count"] for k, v in saved["errors"].items()} == b.counts
    assert saved["errors"][LOC]["dAP"] == pytest.approx(b.dap[LOC])
    assert "error breakdown (TIDE" in caplog.text and "localisation" in caplog.text
    assert not [p for p in tmp_path.iterdir() if p.name != "errors.json"]  # no temporary left


def test_nothing_detected(tmp_path):
    """Every label missed: fixing them leaves no class to average, which the report shows as
    undefined (``-``, JSON null) rather than a number."""
    b = error_breakdown({0: np.array([[1, 0, 0, 10, 10.0]]), 1: np.zeros((0, 5))}, {})
    assert b.ap50 == 0 and b.counts[MISSED] == 1 and b.dap[BKG] == 0
    assert np.isnan(b.dap[MISSED])
    assert f"{MISSED:>16s}       1      -" in b.format()
    assert json.loads(json.dumps(b.to_dict()))["errors"][MISSED]["dAP"] is None


def test_mean_ap_reads_the_detections_a_few_times_not_once_per_class(monkeypatch):
    # COCO at conf 0.001: 1.5M detections of 80 classes, and TIDE's AP runs 9 times; a mask per
    # class read 80 x N elements per run (1.3-1.4x the CPU per image at 5k images than at 1k).
    n, nc = 4000, 80
    rng = np.random.default_rng(0)
    cls = rng.integers(0, nc, n).view(CountingArray)
    score = rng.random(n)
    tp = rng.random(n) < 0.3
    monkeypatch.setattr(CountingArray, "read", 0)
    ap = _mean_ap(cls, score, tp, {c: 10 for c in range(nc)})
    assert 0 < ap <= 100
    assert 0 < CountingArray.read <= 4 * n


def test_the_table_shows_ap50_on_the_scale_of_map50():
    """Was: "AP50 51.23" (per cent) logged under the COCO table's "mAP50 0.5123" (a fraction);
    now the same fraction, and dAP's unit (percentage points) said with the column."""
    gt, dets = _random_coco(0)
    b = error_breakdown(gt_by_image(gt), dets_by_image(dets))
    head = b.format().splitlines()[0]
    assert f"AP50 {b.ap50 / 100:.4f};" in head and f"AP50 {b.ap50:.2f};" not in head
    assert "dAP = percentage points of AP50 gained when that type is fixed" in head
