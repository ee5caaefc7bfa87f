"""train_utils/evaluation/coco_gt.py and coco_eval.py on small fake datasets."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from build_utils.errors import ConfigError, DatasetError
from train_utils.evaluation.coco_eval import (
    STAT_NAMES,
    CocoEvaluator,
    detections_to_coco,
    faster_coco_eval_available,
)
from train_utils.evaluation.coco_gt import (
    CACHE_PREFIX,
    coco_dict_from_dataset,
    coco_from_dict,
    get_coco_api_from_dataset,
)


class FakeDataset:
    """What coco_utils needs of LoadImagesAndLabels: len, img_files, coco_index, content_hash."""

    def __init__(self, labels, shapes_hw, nc=None, content_hash="hash-0", root="/data/images"):
        self.labels = [np.asarray(lb, dtype=np.float32).reshape(-1, 5) for lb in labels]
        self.shapes_hw = shapes_hw
        self.img_files = [f"{root}/img{i}.jpg" for i in range(len(labels))]
        self.content_hash = content_hash
        self.calls = 0
        if nc is not None:
            self.nc = nc

    def __len__(self) -> int:
        return len(self.labels)

    def coco_index(self, i: int):
        self.calls += 1
        return self.labels[i], self.shapes_hw[i]


def _label(cls, x1, y1, w, h, img_w, img_h):
    """A normalised cxcywh label row from a pixel box (x_min, y_min, w, h)."""
    return [cls, (x1 + w / 2) / img_w, (y1 + h / 2) / img_h, w / img_w, h / img_h]


# Objects well apart inside each image; sizes span small (< 32^2), medium and large areas.
PIXEL_BOXES = [
    (640, 480, [(0, 10, 20, 20, 16), (1, 200, 100, 60, 50), (2, 400, 200, 200, 250)]),
    (500, 375, [(1, 30, 40, 100, 120), (1, 300, 50, 40, 30)]),
    (320, 240, []),  # an image without objects still counts (its detections are FPs)
    (800, 600, [(0, 100, 100, 300, 200), (2, 500, 400, 24, 24)]),
]


@pytest.fixture
def dataset() -> FakeDataset:
    labels = [[_label(*b, w, h) for b in boxes] for w, h, boxes in PIXEL_BOXES]
    shapes = [(h, w) for w, h, _ in PIXEL_BOXES]
    return FakeDataset(labels, shapes, nc=4)  # class 3 never occurs


def _gt_outputs(coco_gt, dx_fraction=0.0, score=0.9):
    """Per-image (n, 6) xyxy outputs equal to the ground truth, each shifted right by
    ``dx_fraction`` of its width."""
    outputs, ids = [], []
    for img_id in sorted(coco_gt.getImgIds()):
        rows = []
        for ann in coco_gt.loadAnns(coco_gt.getAnnIds(imgIds=[img_id])):
            x, y, w, h = ann["bbox"]
            dx = dx_fraction * w
            rows.append([x + dx, y, x + dx + w, y + h, score, ann["category_id"]])
        outputs.append(torch.tensor(rows, dtype=torch.float64).reshape(-1, 6))
        ids.append(img_id)
    return outputs, ids


# ---------------------------------------------------------------------------- ground truth


def test_coco_dict_contents(dataset):
    d = coco_dict_from_dataset(dataset)
    assert [c["id"] for c in d["categories"]] == [0, 1, 2, 3]
    img = d["images"][0]
    assert img == {"id": 0, "file_name": "/data/images/img0.jpg", "height": 480, "width": 640}
    assert len(d["annotations"]) == 7
    ann = d["annotations"][2]
    assert ann["image_id"] == 0 and ann["category_id"] == 2 and ann["iscrowd"] == 0
    assert ann["bbox"] == pytest.approx([400, 200, 200, 250], abs=1e-3)
    assert ann["area"] == pytest.approx(200 * 250, rel=1e-5)
    assert [a["id"] for a in d["annotations"]] == list(range(1, 8))  # 0 would mean "unmatched"


def test_file_names_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ds = FakeDataset([[]], [(10, 10)], nc=1, root="rel/images")
    d = coco_dict_from_dataset(ds)
    assert d["images"][0]["file_name"] == str(tmp_path / "rel/images/img0.jpg")


def test_category_count_sources(dataset):
    assert len(coco_dict_from_dataset(dataset, num_classes=6)["categories"]) == 6
    assert len(coco_dict_from_dataset(dataset)["categories"]) == 4  # dataset.nc


def test_class_outside_num_classes_is_a_dataset_error(dataset):
    with pytest.raises(DatasetError, match=r"class id 2 .* outside 0\.\.1"):
        coco_dict_from_dataset(dataset, num_classes=2)


def test_coco_api_builds_silently(dataset, capsys):
    coco = get_coco_api_from_dataset(dataset)
    assert capsys.readouterr().out == ""
    assert len(coco.getAnnIds()) == 7 and sorted(coco.getImgIds()) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------ cache


def _cache_files(d: Path) -> list[Path]:
    return sorted(d.glob(f"{CACHE_PREFIX}*.json"))


def test_cache_is_reused(dataset, tmp_path):
    first = get_coco_api_from_dataset(dataset, cache_dir=tmp_path)
    assert len(_cache_files(tmp_path)) == 1 and dataset.calls == 4
    second = get_coco_api_from_dataset(dataset, cache_dir=tmp_path)
    assert dataset.calls == 4, "a matching cache must not re-read the labels"
    assert second.dataset["annotations"] == first.dataset["annotations"]
    assert not list(tmp_path.glob("*.tmp")), "no temporary file may be left behind"


@pytest.mark.parametrize("change", ["content_hash", "order", "num_classes"])
def test_cache_invalidation(dataset, tmp_path, change):
    get_coco_api_from_dataset(dataset, cache_dir=tmp_path)
    num_classes = None
    if change == "content_hash":
        dataset.content_hash = "hash-1"
        dataset.labels[0][0, 0] = 1  # the edit that changed the hash
    elif change == "order":
        dataset.img_files = dataset.img_files[::-1]
    else:
        num_classes = 5
    calls = dataset.calls
    coco = get_coco_api_from_dataset(dataset, cache_dir=tmp_path, num_classes=num_classes)
    assert dataset.calls == calls + 4, "a changed dataset must be rebuilt"
    assert len(_cache_files(tmp_path)) == 2
    if change == "content_hash":
        assert coco.loadAnns(coco.getAnnIds(imgIds=[0]))[0]["category_id"] == 1


def test_corrupt_cache_is_rebuilt(dataset, tmp_path, caplog):
    get_coco_api_from_dataset(dataset, cache_dir=tmp_path)
    (path,) = _cache_files(tmp_path)
    path.write_text('{"images": [', encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        coco = get_coco_api_from_dataset(dataset, cache_dir=tmp_path)
    assert "rebuilding" in caplog.text
    assert len(coco.getAnnIds()) == 7
    json.loads(path.read_text(encoding="utf-8"))  # rewritten whole


def test_unwritable_cache_only_warns(dataset, tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        coco = get_coco_api_from_dataset(dataset, cache_dir=not_a_dir)
    assert "could not write" in caplog.text
    assert len(coco.getAnnIds()) == 7


# ------------------------------------------------------------------------------- evaluation


def test_stat_names():
    assert STAT_NAMES == [
        "mAP50-95",
        "mAP50",
        "mAP75",
        "mAP_small",
        "mAP_medium",
        "mAP_large",
        "mAR1",
        "mAR10",
        "mAR100",
        "mAR_small",
        "mAR_medium",
        "mAR_large",
    ]


def test_perfect_predictions(dataset, capsys):
    coco_gt = get_coco_api_from_dataset(dataset)
    evaluator = CocoEvaluator(coco_gt)
    evaluator.update(detections_to_coco(*_gt_outputs(coco_gt)))
    stats = evaluator.evaluate()
    assert stats.shape == (12,)
    assert stats[0] == pytest.approx(1.0) and stats[1] == pytest.approx(1.0)
    assert capsys.readouterr().out == "", "pycocotools output must be captured, not printed"
    per_class = evaluator.per_class_ap()
    assert per_class[0] == pytest.approx((1.0, 1.0)) and per_class[2] == pytest.approx((1.0, 1.0))
    assert all(math.isnan(v) for v in per_class[3])  # no ground truth for class 3


def test_shifted_predictions_pass_half_the_thresholds(dataset):
    # A box shifted sideways by d = f * w keeps IoU (w - d) / (w + d) with its ground truth.
    # f = 0.28 / 1.72 gives IoU 0.72: a match at thresholds 0.50..0.70 (5 of 10) only, so
    # AP50 = 1, AP75 = 0 and AP50:95 = 0.5 exactly.
    coco_gt = get_coco_api_from_dataset(dataset)
    evaluator = CocoEvaluator(coco_gt)
    evaluator.update(detections_to_coco(*_gt_outputs(coco_gt, dx_fraction=0.28 / 1.72)))
    stats = evaluator.evaluate()
    assert stats[0] == pytest.approx(0.5, abs=1e-6)
    assert stats[1] == pytest.approx(1.0, abs=1e-6)
    assert stats[2] == pytest.approx(0.0, abs=1e-6)
    assert evaluator.per_class_ap()[1] == pytest.approx((0.5, 1.0), abs=1e-6)


def test_zero_detections(dataset):
    coco_gt = get_coco_api_from_dataset(dataset)
    evaluator = CocoEvaluator(coco_gt)
    evaluator.update([])
    stats = evaluator.evaluate()
    # pycocotools with one detection that matches nothing gives the same: 0, and -1 for an area
    # range without ground truth (was: 0 there too, unlike a run with detections).
    img = sorted(coco_gt.getImgIds())[0]
    reference = CocoEvaluator(coco_gt, backend="pycocotools")
    reference.update([{"image_id": img, "category_id": 0, "bbox": [0, 0, 1, 1], "score": 0.01}])
    assert stats.tolist() == reference.evaluate().tolist() == [0.0] * 12  # every size here
    # Only small objects: the medium and large stats are -1, as pycocotools has them.
    small = coco_from_dict(
        {
            "images": [{"id": 1, "width": 100, "height": 100}],
            "annotations": [
                {
                    "id": 1,
                    "image_id": 1,
                    "category_id": 0,
                    "bbox": [5, 5, 10, 10],
                    "area": 100,
                    "iscrowd": 0,
                }
            ],
            "categories": [{"id": 0, "name": "a"}],
        }
    )

    def stats_of(results: list[dict]) -> list[float]:
        evaluator = CocoEvaluator(small, backend="pycocotools")
        evaluator.update(results)
        return evaluator.evaluate().tolist()

    miss = [{"image_id": 1, "category_id": 0, "bbox": [80, 80, 1, 1], "score": 0.1}]
    assert stats_of([]) == stats_of(miss) and stats_of([]).count(-1.0) == 4
    per_class = evaluator.per_class_ap()
    assert per_class[0] == (0.0, 0.0) and math.isnan(per_class[3][0])


def test_per_class_ap_needs_evaluate(dataset):
    with pytest.raises(RuntimeError, match="evaluate"):
        CocoEvaluator(get_coco_api_from_dataset(dataset)).per_class_ap()


def test_unknown_image_id_is_rejected(dataset):
    evaluator = CocoEvaluator(get_coco_api_from_dataset(dataset))
    with pytest.raises(ValueError, match="absent from the ground truth"):
        evaluator.update([{"image_id": 99, "category_id": 0, "bbox": [0, 0, 1, 1], "score": 1}])


def test_unknown_backend_is_a_config_error(dataset):
    with pytest.raises(ConfigError, match="unknown COCO backend"):
        CocoEvaluator(get_coco_api_from_dataset(dataset), backend="cocoapi")


def test_update_copies_results(dataset):
    coco_gt = get_coco_api_from_dataset(dataset)
    results = detections_to_coco(*_gt_outputs(coco_gt))
    before = [dict(r) for r in results]
    evaluator = CocoEvaluator(coco_gt)
    evaluator.update(results)
    evaluator.evaluate()
    assert results == before, "pycocotools must not edit the caller's dicts"


def test_detections_to_coco():
    out = [
        torch.tensor(
            [[10.0, 20.0, 40.0, 60.0, 0.987654321, 3.0], [0.1234, 0.5, 1.0, 2.0, 0.5, 0.0]]
        ),
        torch.zeros(0, 6),
        torch.tensor([[1.0, 2.0, 3.0, 5.0, 0.25, 1.0]]),
    ]
    res = detections_to_coco(out, [7, 8, 9])
    assert res[0] == {
        "image_id": 7,
        "category_id": 3,
        "bbox": [10.0, 20.0, 30.0, 40.0],
        "score": pytest.approx(0.98765, abs=1e-9),
    }
    assert res[1]["bbox"] == pytest.approx([0.123, 0.5, 0.877, 1.5], abs=1e-9)
    assert res[2]["image_id"] == 9 and res[2]["bbox"] == [1.0, 2.0, 2.0, 3.0]
    assert all(type(r["image_id"]) is int and type(r["category_id"]) is int for r in res)
    assert detections_to_coco([torch.zeros(0, 6)], [0]) == []
    assert detections_to_coco([], []) == []
    with pytest.raises(ValueError, match="image ids"):
        detections_to_coco(out, [1])


def _noisy_case(seed: int = 0):
    """30 images, 3 classes; detections: jittered ground truth plus false positives."""
    rng = np.random.default_rng(seed)
    labels, shapes, outputs = [], [], []
    for _ in range(30):
        w, h = int(rng.integers(200, 800)), int(rng.integers(200, 800))
        n = int(rng.integers(0, 6))
        bw, bh = rng.uniform(8, w / 2, n), rng.uniform(8, h / 2, n)
        x1, y1 = rng.uniform(0, w - bw), rng.uniform(0, h / 2, n)
        cls = rng.integers(0, 3, n)
        labels.append(
            [_label(c, a, b, c_w, c_h, w, h) for c, a, b, c_w, c_h in zip(cls, x1, y1, bw, bh)]
        )
        shapes.append((h, w))
        jitter = rng.normal(0, 0.1, (n, 4)) * np.stack((bw, bh, bw, bh), 1)
        boxes = np.stack((x1, y1, x1 + bw, y1 + bh), 1) + jitter
        m = int(rng.integers(0, 8))
        fp = rng.uniform(0, 1, (m, 4)) * [w, h, w, h]
        fp = np.concatenate((fp[:, :2].clip(max=fp[:, 2:] - 1), fp[:, 2:]), 1)
        rows = np.concatenate(
            (
                np.concatenate((boxes, rng.uniform(0.3, 1, (n, 1)), cls[:, None]), 1),
                np.concatenate((fp, rng.uniform(0, 0.6, (m, 1)), rng.integers(0, 3, (m, 1))), 1),
            )
        )
        outputs.append(torch.from_numpy(rows))
    return FakeDataset(labels, shapes, nc=3), outputs


def test_noisy_case_is_between_zero_and_one():
    ds, outputs = _noisy_case()
    evaluator = CocoEvaluator(get_coco_api_from_dataset(ds))
    evaluator.update(detections_to_coco(outputs, list(range(len(ds)))))
    stats = evaluator.evaluate()
    assert 0.05 < stats[0] < stats[1] < 1.0


def _scorer_case(seed: int = 1):
    """:func:`_noisy_case` (several images and classes, no crowd) grown where scorers can part:
    images without labels (with and without detections), two images with 150 detections (so
    that the 100-per-image cut of mAR100/mAP acts), scores tied in groups, and a class (3) that
    is detected but never labelled."""
    ds, outputs = _noisy_case(seed)
    rng = np.random.default_rng(seed + 100)
    labels, shapes = list(ds.labels), list(ds.shapes_hw)
    for k in range(7):
        h, w = 480, 640
        n_det = (0, 0, 0, 6, 9, 150, 150)[k]
        n_lab = 5 if n_det == 150 else 0
        xy = rng.uniform(0, 400, (n_lab, 2))
        wh = rng.uniform(20, 200, (n_lab, 2))
        cls = rng.integers(0, 3, n_lab)
        labels.append(
            np.asarray(
                [_label(c, *a, *b, w, h) for c, a, b in zip(cls, xy, wh)], dtype=np.float32
            ).reshape(-1, 5)
        )
        shapes.append((h, w))
        x1 = rng.uniform(0, 500, (n_det, 2))
        boxes = np.concatenate((x1, x1 + rng.uniform(5, 150, (n_det, 2))), 1)
        if n_lab:  # the labels found, among many other boxes
            boxes[:n_lab] = np.concatenate((xy, xy + wh), 1) + rng.normal(0, 3, (n_lab, 4))
        score = rng.integers(1, 20, (n_det, 1)) / 20  # ties
        det_cls = rng.integers(0, 4, (n_det, 1))
        if n_lab:
            det_cls[:n_lab, 0] = cls
        outputs.append(torch.from_numpy(np.concatenate((boxes, score, det_cls), 1)))
    return FakeDataset(labels, shapes, nc=4), outputs


@pytest.mark.skipif(
    not faster_coco_eval_available(),
    reason="faster-coco-eval is not installed (requirements-extra.txt)",
)
@pytest.mark.parametrize("case", ["perfect", "noisy", "scorer"])
def test_faster_coco_eval_matches_pycocotools(case, dataset):
    """The two libraries give the same 12 numbers and per-class APs to 1e-6: ``auto`` may pick
    either."""
    if case == "perfect":
        coco_gt = get_coco_api_from_dataset(dataset)
        results = detections_to_coco(*_gt_outputs(coco_gt, dx_fraction=0.1))
    else:
        ds, outputs = _noisy_case(1) if case == "noisy" else _scorer_case()
        coco_gt = get_coco_api_from_dataset(ds)
        results = detections_to_coco(outputs, list(range(len(ds))))
        per_image = np.bincount([r["image_id"] for r in results])
        if case == "scorer":
            assert per_image.max() > 100 and (per_image == 0).sum() >= 3
    stats = {}
    per_class = {}
    for backend in ("pycocotools", "faster-coco-eval"):
        evaluator = CocoEvaluator(coco_gt, backend=backend)
        assert evaluator.backend == backend
        evaluator.update(results)
        stats[backend] = evaluator.evaluate()
        per_class[backend] = evaluator.per_class_ap()
    assert 0.05 < stats["pycocotools"][0] < 1  # a case where a difference would show
    np.testing.assert_allclose(stats["faster-coco-eval"], stats["pycocotools"], rtol=0, atol=1e-6)
    assert per_class["faster-coco-eval"].keys() == per_class["pycocotools"].keys()
    for c, (ap, ap50) in per_class["pycocotools"].items():
        np.testing.assert_allclose(
            per_class["faster-coco-eval"][c], (ap, ap50), rtol=0, atol=1e-6, equal_nan=True
        )


@pytest.mark.skipif(
    not faster_coco_eval_available(),
    reason="faster-coco-eval is not installed (requirements-extra.txt)",
)
def test_auto_is_every_default_and_picks_faster_coco_eval(dataset, caplog):
    """``auto`` is the default of training, validation.py, EvalOptions and CocoEvaluator, and
    means faster-coco-eval when it is installed; eval_options (training, validation.py, and so
    the gathered multi-rank path, which scores with its options) says which."""
    import validation
    from train_utils.config import get_args_parser
    from train_utils.evaluation.options import EvalOptions, eval_options

    train_args = get_args_parser().parse_args(["--data", "x.data"])
    assert train_args.coco_backend == "auto"
    assert validation.RUN_SETTINGS["coco_backend"] == "auto"
    assert EvalOptions(torch.device("cpu")).backend == "auto"
    assert CocoEvaluator(get_coco_api_from_dataset(dataset)).backend == "faster-coco-eval"
    caplog.set_level(logging.INFO)
    opts = eval_options(vars(train_args), torch.device("cpu"), None, False, True)
    assert opts.backend == "faster-coco-eval"
    assert "COCO scoring: faster-coco-eval (--coco-backend auto: installed)" in caplog.text


def test_auto_falls_back_to_pycocotools(dataset, monkeypatch, caplog):
    from train_utils.evaluation import coco_eval
    from train_utils.evaluation.options import eval_options

    monkeypatch.setattr(coco_eval, "faster_coco_eval_available", lambda: False)
    assert coco_eval.resolve_backend("auto") == "pycocotools"
    assert CocoEvaluator(get_coco_api_from_dataset(dataset)).backend == "pycocotools"
    caplog.set_level(logging.INFO)
    run = {"conf_thres": 0.001, "iou_thres": 0.6, "coco_backend": "auto"}
    assert eval_options(run, torch.device("cpu"), None, False, True).backend == "pycocotools"
    assert "pycocotools (--coco-backend auto: faster-coco-eval is not installed)" in caplog.text
    # Asked for by name it is an error before anything runs, not at the first evaluation.
    with pytest.raises(ConfigError, match="requirements-extra.txt"):
        eval_options({**run, "coco_backend": "faster-coco-eval"}, torch.device("cpu"), None, 0, 1)


def test_missing_faster_backend_is_a_config_error(dataset, monkeypatch):
    from train_utils.evaluation import coco_eval

    monkeypatch.setattr(coco_eval, "faster_coco_eval_available", lambda: False)
    with pytest.raises(ConfigError, match="requirements-extra.txt"):
        CocoEvaluator(get_coco_api_from_dataset(dataset), backend="faster-coco-eval")


def test_coco_rows_round_trip():
    from train_utils.evaluation.coco_eval import coco_to_rows, rows_to_coco

    dets = [
        {"image_id": 3, "category_id": 1, "bbox": [1.25, 2.5, 30.0, 4.125], "score": 0.91234},
        {"image_id": 12345, "category_id": 79, "bbox": [0.0, 0.1, 0.2, 0.3], "score": 0.00101},
    ]
    rows = coco_to_rows(dets)
    assert rows.shape == (2, 7) and rows.dtype == torch.float64
    assert rows_to_coco(rows) == dets
    assert coco_to_rows([]).shape == (0, 7) and rows_to_coco(coco_to_rows([])) == []
