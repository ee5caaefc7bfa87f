"""tools/coco2yolo.py: COCO instances JSON -> YOLO dataset -> train -> validation.py, whose
--save-json predictions carry the source JSON's ids and score as validation.py reports."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import REPO_ROOT, run_training, train_argv, validation_argv

import validation
from build_utils.datasets import LoadImagesAndLabels
from build_utils.parse_config import parse_data_cfg

sys.path.insert(0, str(REPO_ROOT / "tools"))

import coco2yolo

CATEGORY_IDS = [3, 7, 11]  # not contiguous, not from 0
NAMES = ["circle", "square", "triangle"]


def _coco_from_shapes(shapes: Path, split: str, first_id: int) -> dict:
    """A COCO instances dict of the shapes split (its YOLO labels as pixel boxes), with image
    ids first_id, first_id + 7, ... and categories 3, 7, 11."""
    images, anns = [], []
    for k, img in enumerate(sorted((shapes / split / "images").glob("*.jpg"))):
        h, w = cv2.imread(str(img)).shape[:2]
        iid = first_id + 7 * k
        images.append({"id": iid, "file_name": img.name, "width": w, "height": h})
        label = shapes / split / "labels" / f"{img.stem}.txt"
        rows = np.loadtxt(label, ndmin=2) if label.stat().st_size else np.zeros((0, 5))
        for c, cx, cy, bw, bh in rows:
            box = [(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h]
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": iid,
                    "category_id": CATEGORY_IDS[int(c)],
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    cats = [{"id": i, "name": n} for i, n in zip(CATEGORY_IDS, NAMES)]
    return {"images": images, "annotations": anns, "categories": cats[::-1]}


def _write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def _convert(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = coco2yolo.main(list(argv))
    return code, err.getvalue()


def test_conversion_classes_boxes_crowd_missing_and_background(tmp_path):
    images = tmp_path / "imgs"
    images.mkdir()
    for name, (h, w) in {"a.jpg": (40, 80), "b.png": (50, 50), "c.jpg": (30, 30)}.items():
        cv2.imwrite(str(images / name), np.full((h, w, 3), 128, np.uint8))
    coco = {
        "images": [
            {"id": 42, "file_name": "a.jpg", "width": 80, "height": 40},
            {"id": 5, "file_name": "b.png", "width": 10**400, "height": 50},
            {"id": 9, "file_name": "gone.jpg", "width": 10, "height": 10},
            {"id": 10, "file_name": "../c.jpg", "width": 30, "height": 30},
            {"id": 77, "file_name": "./a.jpg", "width": 80, "height": 40},
        ],
        "annotations": [
            {"id": 1, "image_id": 42, "category_id": 11, "bbox": [10, 5, 20, 10], "iscrowd": 0},
            {"id": 2, "image_id": 42, "category_id": 3, "bbox": [70, 30, 20, 20], "iscrowd": 0},
            {"id": 3, "image_id": 42, "category_id": 7, "bbox": [0, 0, 80, 40], "iscrowd": 1},
            {"id": 4, "image_id": 42, "category_id": 99, "bbox": [0, 0, 5, 5]},
            {"id": 5, "image_id": 9, "category_id": 3, "bbox": [0, 0, 5, 5]},
            {"id": 6, "image_id": 5, "category_id": 3, "bbox": [0, 0, 10**400, 5]},
        ],
        "categories": [{"id": 11, "name": "c"}, {"id": 3, "name": "a"}, {"id": 7, "name": "b"}],
    }
    src = _write_json(tmp_path / "instances_train.json", coco)
    before = sorted(p.name for p in images.iterdir())
    out = tmp_path / "out"
    code, err = _convert("--json", str(src), "--images", str(images), "--out", str(out))
    assert code == 0, err
    assert sorted(p.name for p in images.iterdir()) == before  # the input is only read
    # Split from the JSON's name (instances_train -> train); categories 3, 7, 11 -> 0, 1, 2.
    lines = (out / "labels" / "train" / "a.txt").read_text().splitlines()
    # bbox [10, 5, 20, 10] in 80x40; [70, 30, 20, 20] clipped to [70, 30, 10, 10].
    assert lines == [
        "2 0.250000 0.250000 0.250000 0.250000",
        "0 0.937500 0.875000 0.125000 0.250000",
    ]
    assert (out / "labels" / "train" / "b.txt").read_text() == ""  # background
    assert (out / "images" / "train" / "b.png").read_bytes() == (images / "b.png").read_bytes()
    assert not (out / "labels" / "train" / "c.txt").exists()
    report = (out / "coco2yolo_train_report.txt").read_text()
    assert "image 9 (gone.jpg): skipped: " in report
    assert "image 10 (../c.jpg): skipped: the file name leaves --images" in report
    assert "image 77 (./a.jpg): skipped: image 42 has the same file" in report
    assert "unknown category 99" in report and "1 crowd (iscrowd) annotation(s) skipped" in report
    assert "clipped" in report and "annotation 0: bbox [0, 0, 1000000" in report
    assert "is not 4 numbers, skipped" in report  # 10**400 has no float
    ids = json.loads((out / "coco_ids.json").read_text())
    assert ids["category_ids"] == [3, 7, 11] and ids["names"] == ["a", "b", "c"]
    assert ids["images"] == {"images/train/a.jpg": 42, "images/train/b.png": 5}
    yaml_text = (out / "data.yaml").read_text()
    assert "train: images/train" in yaml_text and "coco_ids: coco_ids.json" in yaml_text

    # Again into the same folder: refused without --exist-ok, replaced with it.
    code, err = _convert("--json", str(src), "--images", str(images), "--out", str(out))
    assert code == 2 and "converted into --out before; pass --exist-ok" in err
    assert err.count("\n") == 1
    (images / "b.png").unlink()
    code, err = _convert(
        "--json", str(src), "--images", str(images), "--out", str(out), "--exist-ok"
    )
    assert code == 0, err
    assert not (out / "labels" / "train" / "b.txt").exists()
    assert not (out / "images" / "train" / "b.png").exists()


def test_a_json_size_is_trusted_only_in_the_images_shape(tmp_path):
    """A JSON size of the image's shape is the frame a resized copy was annotated in (boxes
    normalised by it); of another shape it is wrong, and the image's own size normalises them,
    as trans_voc2yolo.py judges a <size>. Was: width 10**12 wrote zero-width boxes."""
    images = tmp_path / "imgs"
    images.mkdir()
    for name in ("resized.jpg", "wrong.jpg"):
        cv2.imwrite(str(images / name), np.full((40, 80, 3), 128, np.uint8))
    box = {"category_id": 1, "bbox": [40, 20, 40, 20], "iscrowd": 0}
    coco = {
        "images": [
            {"id": 1, "file_name": "resized.jpg", "width": 160, "height": 80},
            {"id": 2, "file_name": "wrong.jpg", "width": 10**12, "height": -3},
        ],
        "annotations": [{"id": 1, "image_id": 1, **box}, {"id": 2, "image_id": 2, **box}],
        "categories": [{"id": 1, "name": "thing"}],
    }
    src = _write_json(tmp_path / "instances_val.json", coco)
    out = tmp_path / "out"
    code, err = _convert("--json", str(src), "--images", str(images), "--out", str(out))
    assert code == 0, err
    labels = out / "labels" / "val"
    assert (labels / "resized.txt").read_text() == "0 0.375000 0.375000 0.250000 0.250000\n"
    assert (labels / "wrong.txt").read_text() == "0 0.750000 0.750000 0.500000 0.500000\n"
    report = (out / "coco2yolo_val_report.txt").read_text()
    assert (
        "the JSON's size 160x80 differs from the image's upright 80x40; boxes normalised by "
        "the JSON's (the frame they were drawn in)"
    ) in report
    assert (
        "the JSON's size 1e+12xnone differs from the image's upright 80x40; not the image's "
        "shape: boxes normalised by the image's size"
    ) in report


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("{not json", r"x\.json:1: COCO annotation JSON is not valid JSON"),
        ("[1, 2]", r"x\.json: expected a COCO JSON object"),
        ('{"images": [], "annotations": []}', r"'categories' must be a list"),
        (
            '{"images": [{"id": 1, "file_name": "a.jpg"}, {"id": 1, "file_name": "b.jpg"}], '
            '"annotations": [], "categories": [{"id": 1, "name": "x"}]}',
            r"image id 1 is given twice",
        ),
        ("[" * 100_000 + "]" * 100_000, r"x\.json: COCO annotation JSON is not usable JSON"),
    ],
)
def test_bad_json_is_one_line(tmp_path, text, pattern):
    (tmp_path / "imgs").mkdir()
    src = tmp_path / "x.json"
    src.write_text(text)
    argv = ["--json", str(src), "--images", str(tmp_path / "imgs"), "--out", str(tmp_path / "o")]
    code, err = _convert(*argv, "--split", "val")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ")
    assert re.search(pattern, err), err


def test_a_non_empty_out_of_other_content_is_refused(tmp_path, make_shapes_data):
    data = make_shapes_data(n_train=2, n_val=1, img_size_range=(64, 64), n_classes=3)
    src = _write_json(tmp_path / "v.json", _coco_from_shapes(data.parent, "val", 1))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["--json", str(src), "--images", str(data.parent / "val" / "images")]
    code, err = _convert(*argv, "--out", str(out), "--split", "val")
    assert code == 2 and "--out is not empty (notes.txt) and holds no earlier conversion" in err
    code, err = _convert(
        *argv, "--out", str(data.parent / "val" / "images" / "o"), "--split", "val"
    )
    assert code == 2 and "--out lies inside --images" in err


def test_images_that_is_a_file_is_named_so(tmp_path):
    """Was: --images FILE said "folder not found"."""
    src = _write_json(tmp_path / "instances_val.json", {"images": [], "annotations": []})
    code, err = _convert("--json", str(src), "--images", str(src), "--out", str(tmp_path / "o"))
    assert (code, err) == (2, f"error: {src}: --images: a file, not a folder\n")
    assert not (tmp_path / "o").exists()


def test_an_empty_split_is_refused_not_taken_from_the_json_name(tmp_path, make_shapes_data):
    """Was: --split "" (an unset shell variable) fell back to the JSON's name (val) silently."""
    data = make_shapes_data(n_train=2, n_val=2, img_size_range=(64, 64), n_classes=3)
    src = _write_json(tmp_path / "instances_val.json", _coco_from_shapes(data.parent, "val", 1))
    images = str(data.parent / "val" / "images")
    argv = ["--json", str(src), "--images", images, "--out", str(tmp_path / "o"), "--split", ""]
    assert _convert(*argv) == (2, "error: --split '': give a plain folder name\n")
    assert not (tmp_path / "o").exists()


def test_converting_in_place_is_refused_and_keeps_the_images(tmp_path, make_shapes_data):
    """ultralytics' layout (OUT/images/val with the JSON beside): converting into OUT itself
    would make the input the split's output, and a second --exist-ok run deleted it."""
    data = make_shapes_data(n_train=2, n_val=2, img_size_range=(64, 64), n_classes=3)
    out = tmp_path / "coco"
    shutil.copytree(data.parent / "val" / "images", out / "images" / "val")
    src = _write_json(tmp_path / "instances_val.json", _coco_from_shapes(data.parent, "val", 1))
    before = sorted(p.name for p in (out / "images" / "val").iterdir())
    argv = ["--json", str(src), "--images", str(out / "images" / "val"), "--out", str(out)]
    for _ in range(2):
        code, err = _convert(*argv, "--exist-ok")
        assert code == 2 and "where this split is written" in err, err
        assert sorted(p.name for p in (out / "images" / "val").iterdir()) == before
    # Into another split of the same folder it is no conversion onto itself: allowed.
    code, err = _convert(*argv, "--split", "val_yolo", "--exist-ok")
    assert code == 0, err
    assert sorted(p.name for p in (out / "images" / "val").iterdir()) == before


@pytest.mark.slow
def test_a_second_split_of_one_role_is_added_to_data_yaml(tmp_path, make_shapes_data, caplog):
    """Was: --split train2 into an --out holding train replaced train: in data.yaml, which then
    trained on one of them, and a category renamed in the second JSON went unsaid."""
    shapes = make_shapes_data(n_train=4, n_val=2, img_size_range=(64, 96), n_classes=3).parent
    coco = _coco_from_shapes(shapes, "train", 500)
    out = tmp_path / "yolo"
    first = _write_json(tmp_path / "instances_train.json", coco)
    renamed = {**coco, "categories": [{"id": 3, "name": "ball"}, *coco["categories"][:2]]}
    second = _write_json(tmp_path / "renamed.json", renamed)
    val = _write_json(tmp_path / "instances_val.json", _coco_from_shapes(shapes, "val", 900))
    assert (
        _convert("--json", str(val), "--images", str(shapes / "val" / "images"), "--out", str(out))[
            0
        ]
        == 0
    )
    images = ["--images", str(shapes / "train" / "images"), "--out", str(out)]
    assert _convert("--json", str(first), *images)[0] == 0
    assert _convert("--json", str(second), *images, "--split", "train2")[0] == 0
    d = parse_data_cfg(out / "data.yaml")
    assert [Path(p).name for p in d["train"]] == ["train", "train2"]  # both, in that order
    assert d["class_names"] == NAMES  # the earlier names, said:
    assert any("id 3: 'circle' there, 'ball' here" in m for m in caplog.messages)
    assert len(LoadImagesAndLabels(d["train"], 64, nc=3)) == 8


def test_coco_json_to_yolo_trains_and_scores_with_the_source_ids(
    tmp_path, make_shapes_data, capsys
):
    """The issue's acceptance: COCO JSON -> YOLO -> train -> validation.py; pycocotools on the
    source JSON scores validation.py's predictions.json exactly as validation.py reports."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    data = make_shapes_data(n_train=8, n_val=4, img_size_range=(64, 96), n_classes=3)
    shapes = data.parent
    train_json = _write_json(
        tmp_path / "instances_train.json", _coco_from_shapes(shapes, "train", 500)
    )
    val_coco = _coco_from_shapes(shapes, "val", 9001)
    val_json = _write_json(tmp_path / "instances_val.json", val_coco)
    out = tmp_path / "yolo"
    for split, src in (("train", train_json), ("val", val_json)):
        images = shapes / split / "images"
        code, err = _convert("--json", str(src), "--images", str(images), "--out", str(out))
        assert code == 0, err

    run = tmp_path / "run"
    run_training(train_argv(out / "data.yaml", run, "--nbs", "4", epochs=2, img=64))
    js, stats_file = tmp_path / "js", tmp_path / "stats.json"
    argv = validation_argv(run / "model.cfg", out / "data.yaml", run / "last.pt", img=64)
    argv += ["--save-dir", str(tmp_path / "val"), "--no-plots"]
    argv += ["--save-json", str(js), "--json-out", str(stats_file)]
    assert validation.main(argv) == 0
    ours = list(json.loads(stats_file.read_text()).values())
    argv.append("--exist-ok")  # the runs below replace these JSON files

    preds = json.loads((js / "predictions.json").read_text())
    assert preds and {p["category_id"] for p in preds} <= set(CATEGORY_IDS)
    assert {p["image_id"] for p in preds} <= {9001 + 7 * k for k in range(4)}
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(val_json))
        ev = COCOeval(gt, gt.loadRes(str(js / "predictions.json")), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    assert len(ours) == 12 and max(ours) > 0
    np.testing.assert_allclose(ours, ev.stats, rtol=0, atol=1e-6)

    # --coco-gt: scored against a source file with a crowd region too, as pycocotools does.
    crowd = {**val_coco, "annotations": [*val_coco["annotations"]]}
    first = val_coco["images"][0]
    box = [0, 0, first["width"] / 2, first["height"] / 2]
    crowd["annotations"].append(
        {"id": 10_000, "image_id": first["id"], "category_id": 7, "bbox": box, "iscrowd": 1}
    )
    crowd["annotations"][-1]["area"] = box[2] * box[3]
    crowd_json = _write_json(tmp_path / "crowd.json", crowd)
    assert validation.main([*argv, "--coco-gt", str(crowd_json)]) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(crowd_json))
        ev = COCOeval(gt, gt.loadRes(str(js / "predictions.json")), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    source = list(json.loads((js / "source_stats.json").read_text()).values())
    np.testing.assert_allclose(source, ev.stats, rtol=0, atol=1e-6)
    # A file that is not the source: one line.
    other = _write_json(tmp_path / "other.json", {**crowd, "images": crowd["images"][1:]})
    assert validation.main([*argv, "--coco-gt", str(other)]) == 2
    assert (
        "other.json: lists no image 9001 (and 0 more) of the data scored" in capsys.readouterr().err
    )

    # --no-coco-ids: dataset index and class, both, and the same numbers.
    idx = tmp_path / "idx"
    argv[argv.index(str(js))] = str(idx)
    assert validation.main([*argv, "--no-coco-ids"]) == 0
    preds = json.loads((idx / "predictions.json").read_text())
    assert {p["image_id"] for p in preds} <= set(range(4))
    assert {p["category_id"] for p in preds} <= {0, 1, 2}
    assert list(json.loads(stats_file.read_text()).values()) == ours


def test_evaluation_scores_with_the_source_image_ids(tmp_path, make_shapes_data):
    """A ground truth built with the source JSON's image ids keeps dataset order, reads them
    back (the engine maps detections to them), and caches apart from the index-id one."""
    from train_utils.data_loaders import make_eval_dataset
    from train_utils.evaluation.coco_gt import (
        cache_key,
        coco_dict_from_dataset,
        dataset_image_ids,
        get_coco_api_from_dataset,
    )

    data = make_shapes_data(n_train=1, n_val=3, img_size_range=(64, 64), n_classes=3)
    dataset = make_eval_dataset(data.parent / "val" / "images", 64, 2, 3)
    ids = [9015, 9001, 9008]
    plain = coco_dict_from_dataset(dataset, 3)
    mapped = coco_dict_from_dataset(dataset, 3, ids)
    assert [im["id"] for im in mapped["images"]] == ids
    assert [a["image_id"] for a in mapped["annotations"]] == [
        ids[a["image_id"]] for a in plain["annotations"]
    ]
    assert dataset_image_ids(get_coco_api_from_dataset(dataset, None, 3, ids)) == ids
    assert dataset_image_ids(get_coco_api_from_dataset(dataset, None, 3)) is None
    assert cache_key(dataset, 3, ids) != cache_key(dataset, 3)
    with pytest.raises(ValueError, match="3 distinct image ids"):
        coco_dict_from_dataset(dataset, 3, [1, 1, 2])
