"""validation.py flags: --max-det, --save-txt/--save-conf, --save-json with official COCO ids,
--task speed, and the per-class table and pictures in --save-dir."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import shutil
import warnings
from pathlib import Path

import cv2
import pytest
import torch
from conftest import NANO_CFG, validation_argv
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

import validation
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes
from models.darknet import Darknet
from train_utils.checkpoint import save_checkpoint
from train_utils.evaluation.coco_eval import faster_coco_eval_available
from train_utils.evaluation.detection_files import COCO80_TO_91

IMG = 128


def _weights(path: Path, nc: int) -> Path:
    """A nano model whose head biases make boxes confident (class 0 wins), as a state_dict."""
    blocks = rewrite_cfg_classes(parse_model_cfg(NANO_CFG), nc)
    torch.manual_seed(0)
    model = Darknet(blocks, img_size=(128, 128))
    with torch.no_grad():
        for i in model.yolo_layers:
            bias = model.module_list[i - 1].Conv2d.bias.view(3, -1)
            bias[:, 4] = 3.0
            bias[:, 5] = 3.0
    save_checkpoint({"model": model.state_dict(), "epoch": -1}, path)
    return path


def _argv(data: Path, weights: Path, *extra: str) -> list[str]:
    """validation.py's arguments for the nano model's ``weights`` on ``data``."""
    return validation_argv(NANO_CFG, data, weights, *extra, img=IMG, plots=True)


@pytest.fixture(scope="module")
def weights5(tmp_path_factory) -> Path:
    return _weights(tmp_path_factory.mktemp("w5") / "w.pt", 5)


def test_save_txt_conf_max_det_and_pictures(shapes_data, weights5, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    save = tmp_path / "val"
    code = validation.main(
        [
            *_argv(shapes_data, weights5, "--save-dir", str(save), "--save-txt", "--save-conf"),
            "--max-det",
            "7",
            "--conf-thres",
            "0.01",
        ]
    )
    assert code == 0
    files = sorted((save / "labels").glob("*.txt"))
    assert len(files) == 10  # one per validation image, empty when nothing was found
    rows = [line.split() for f in files for line in f.read_text().splitlines()]
    assert rows, "no detections written"
    counts = [len(f.read_text().splitlines()) for f in files]
    assert max(counts) <= 7  # --max-det
    for r in rows:
        assert len(r) == 6  # class cx cy w h conf
        cls, *box, conf = r
        assert 0 <= int(cls) < 5
        assert all(0 <= float(v) <= 1 for v in box)
        assert 0.01 <= float(conf) <= 1
    with (save / "per_class.csv").open() as f:
        table = list(csv.DictReader(f))
    assert table[0]["name"] == "all" and int(table[0]["instances"]) > 0
    # The same table in the log, beside the 12 COCO numbers.
    assert "instances      P      R   AP50 AP50-95" in caplog.text and "mAP50-95" in caplog.text
    assert "circle" in caplog.text
    for name in ("confusion_matrix.png", "PR_curve.png", "F1_curve.png", "val_batch0_pred.jpg"):
        img = cv2.imread(str(save / name))
        assert img is not None and img.reshape(-1, 3).std(0).max() > 5, name


def test_no_plots_and_no_conf(shapes_data, weights5, tmp_path):
    save = tmp_path / "val"
    argv = _argv(shapes_data, weights5, "--save-dir", str(save), "--save-txt", "--no-plots")
    assert validation.main(argv) == 0
    assert (save / "per_class.csv").is_file()
    assert not (save / "confusion_matrix.png").exists()
    line = next(ln for f in (save / "labels").glob("*.txt") for ln in f.read_text().splitlines())
    assert len(line.split()) == 5


def test_a_batch_larger_than_the_dataset_is_one_batch_of_every_image(
    shapes_data, weights5, tmp_path, monkeypatch, caplog
):
    """Was: --batch 64 on 10 images refused by the model's memory check, made for 64 images;
    now the batch is the dataset's size (as YOLOv5 gets), said in one line, same scores."""
    from models.budget import MEMORY_ENV, estimate_model

    blocks = rewrite_cfg_classes(parse_model_cfg(NANO_CFG), 5)
    est = estimate_model(blocks, (IMG, IMG))
    n = len((shapes_data.parent / "val.txt").read_text().split())
    # Room for twice the dataset's images, not for 64.
    monkeypatch.setenv(MEMORY_ENV, str(est.params * 4 + 2 * n * est.live_bytes_per_image()))
    scores = {}
    for batch in (64, n):
        argv = _argv(
            shapes_data, weights5, "--save-dir", str(tmp_path / str(batch)), "--batch", str(batch)
        )
        caplog.clear()
        with caplog.at_level("INFO"):
            assert validation.main([*argv, "--no-plots"]) == 0
        scores[batch] = (tmp_path / str(batch) / "per_class.csv").read_text()
        clamped = f"--batch-size 64: the dataset has {n} images; batch {n}"
        assert (clamped in caplog.messages) == (batch == 64)
    assert scores[64] == scores[n]


def test_save_conf_without_save_txt_says_it_is_ignored(shapes_data, weights5, tmp_path, caplog):
    """Was: silently ignored (as YOLOv5 does); now one warning line."""
    save = tmp_path / "val"
    argv = _argv(shapes_data, weights5, "--save-dir", str(save), "--save-conf", "--no-plots")
    with caplog.at_level("WARNING"):
        assert validation.main(argv) == 0
    line = "--save-conf adds the confidence to --save-txt's labels; ignored without it"
    assert caplog.messages.count(line) == 1
    assert not (save / "labels").exists()


def test_half_is_predicts_flag(shapes_data, weights5, tmp_path, capsys):
    """Was: --half was rejected by argparse (exit 2), though YOLOv5's val.py takes it; now it is
    predict.py's flag (fp16 weights and inputs, CUDA only): on the CPU predict's one line, exit
    2, before the dataset is read."""
    parse = validation.get_parser().parse_args
    assert parse(["--weights", "w.pt", "--half"]).half is True
    assert parse(["--weights", "w.pt"]).half is False
    argv = _argv(shapes_data, weights5, "--half", "--save-dir", str(tmp_path / "v"))
    assert validation.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: --half needs a CUDA device, not cpu; on CPU use --amp (bf16)"
    assert not (tmp_path / "v").exists()


def test_task_speed(shapes_data, weights5, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    argv = _argv(shapes_data, weights5, "--task", "speed", "--save-dir", str(tmp_path / "v"))
    assert validation.main(argv) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("speed:"))
    assert "ms pre-process" in line and "ms inference" in line and "ms NMS per image" in line
    assert not (tmp_path / "v").exists()  # speed only times
    assert "augmentation" not in line
    caplog.clear()
    assert validation.main([*argv, "--augment"]) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("speed:"))
    assert line.endswith(", test-time augmentation")  # the setting beside the number


def _stats_json(argv: list[str], out: Path) -> list[float]:
    report = ["--json-out", str(out), "--save-dir", str(out.with_suffix("")), "--no-plots"]
    assert validation.main([*argv, *report]) == 0
    return list(json.loads(out.read_text()).values())


def test_task_test_and_train_score_that_split_as_yolov5s_val_py(
    shapes_data, weights5, tmp_path, caplog, capsys
):
    root = shapes_data.parent
    names = (root / "shapes.names").read_text().split()
    both = tmp_path / "both.yaml"
    both.write_text(
        f"path: {root}\ntrain: train.txt\nval: val.txt\ntest: train.txt\nnames: {names}\n"
    )
    # The same images as val of another data.yaml: an independent reference for the scores.
    swapped = tmp_path / "swapped.yaml"
    swapped.write_text(f"path: {root}\ntrain: val.txt\nval: train.txt\nnames: {names}\n")
    caplog.set_level(logging.INFO)
    test = _stats_json(_argv(both, weights5, "--task", "test"), tmp_path / "test.json")
    assert any(r.getMessage().startswith("24 test images") for r in caplog.records)
    train = _stats_json(_argv(both, weights5, "--task", "train"), tmp_path / "train.json")
    reference = _stats_json(_argv(swapped, weights5), tmp_path / "reference.json")
    val = _stats_json(_argv(both, weights5), tmp_path / "val.json")
    assert test == train == reference != val
    # A data.yaml of val alone (coco2yolo's of val2017) is scored as well (was: refused).
    alone = tmp_path / "alone.yaml"
    alone.write_text(f"path: {root}\nval: val.txt\nnames: {names}\n")
    assert _stats_json(_argv(alone, weights5), tmp_path / "alone.json") == val
    assert (
        validation.main(
            _argv(alone, weights5, "--task", "train", "--save-dir", str(tmp_path / "t"))
        )
        == 2
    )
    capsys.readouterr()
    # A .data file without test=: one line, exit 2.
    argv = _argv(shapes_data, weights5, "--task", "test", "--save-dir", str(tmp_path / "v"))
    assert validation.main(argv) == 2
    line = _error_line(capsys)
    assert "--task test: the dataset file names no test split" in line
    assert str(shapes_data) in line
    # A test split that is not there (YOLOv5's coco.yaml names test-dev2017.txt) stops only
    # --task test, not a training or --task val of the same file.
    (tmp_path / "gone.yaml").write_text(
        both.read_text().replace("test: train.txt", "test: gone.txt")
    )
    argv = _argv(tmp_path / "gone.yaml", weights5, "--save-dir", str(tmp_path / "v"))
    assert validation.main([*argv, "--task", "test"]) == 2
    assert f"'test' points to {root / 'gone.txt'}, which does not exist" in _error_line(capsys)
    assert validation.main([*argv, "--no-plots"]) == 0


@pytest.fixture(scope="module")
def coco_like(shapes_data, tmp_path_factory) -> Path:
    """The shapes validation images renamed like COCO's val2017, with an 80-class .data file."""
    root = tmp_path_factory.mktemp("coco")
    (root / "images" / "val2017").mkdir(parents=True)
    (root / "labels" / "val2017").mkdir(parents=True)
    src = shapes_data.parent / "val"
    lines = []
    for k, img in enumerate(sorted((src / "images").glob("*.jpg"))):
        name = f"{397133 + 7 * k:012d}"
        shutil.copy(img, root / "images" / "val2017" / f"{name}.jpg")
        shutil.copy(src / "labels" / f"{img.stem}.txt", root / "labels" / "val2017" / f"{name}.txt")
        lines.append(f"images/val2017/{name}.jpg\n")
    (root / "val2017.txt").write_text("".join(lines))
    (root / "coco.names").write_text("".join(f"class{c}\n" for c in range(80)))
    data = root / "coco.data"
    data.write_text("classes=80\ntrain=val2017.txt\nvalid=val2017.txt\nnames=coco.names\n")
    return data


def test_save_json_official_coco_ids(coco_like, tmp_path):
    weights = _weights(tmp_path / "w80.pt", 80)
    out = tmp_path / "js"
    stats_file = tmp_path / "stats.json"
    argv = _argv(coco_like, weights, "--save-json", str(out), "--json-out", str(stats_file))
    assert validation.main([*argv, "--save-dir", str(tmp_path / "v"), "--no-plots"]) == 0
    preds = json.loads((out / "predictions.json").read_text())
    gt = json.loads((out / "ground_truth.json").read_text())
    stems = {int(p.stem) for p in (coco_like.parent / "images" / "val2017").glob("*.jpg")}
    assert preds and {p["image_id"] for p in preds} <= stems
    assert {im["id"] for im in gt["images"]} == stems
    assert {p["category_id"] for p in preds} <= set(COCO80_TO_91)
    assert sorted(c["id"] for c in gt["categories"]) == COCO80_TO_91
    # The official-id files score with plain pycocotools to the numbers validation.py logged.
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(out / "ground_truth.json"))
        e = COCOeval(coco_gt, coco_gt.loadRes(str(out / "predictions.json")), "bbox")
        e.evaluate()
        e.accumulate()
        e.summarize()
    stats = json.loads(stats_file.read_text())
    assert e.stats[0] == pytest.approx(stats["mAP50-95"], abs=1e-4)
    assert e.stats[1] == pytest.approx(stats["mAP50"], abs=1e-4)


def test_no_coco_ids_keeps_dataset_ids(coco_like, tmp_path):
    weights = _weights(tmp_path / "w80.pt", 80)
    out = tmp_path / "js"
    argv = _argv(coco_like, weights, "--save-json", str(out), "--no-coco-ids", "--no-plots")
    assert validation.main([*argv, "--save-dir", str(tmp_path / "v")]) == 0
    preds = json.loads((out / "predictions.json").read_text())
    assert {p["image_id"] for p in preds} <= set(range(10))


OTHER_IMAGES = {
    "images": [{"id": 1000, "file_name": "a.jpg", "width": 64, "height": 64}],
    "annotations": [],
    "categories": [{"id": c, "name": str(c)} for c in COCO80_TO_91],
}
# coco_like's ids, as another split's JSON with overlapping ids has them: other pictures.
SAME_IDS = [{"id": 397133 + 7 * k, "width": 64, "height": 64} for k in range(10)]
OTHER_SPLIT = {**OTHER_IMAGES, "images": [{**im, "file_name": "x.jpg"} for im in SAME_IDS]}
# The right pictures, with an annotation pycocotools would fail on mid-evaluation.
RIGHT_IMAGES = [{**im, "file_name": f"{im['id']:012d}.jpg"} for im in SAME_IDS]
STRING_BOX = {"id": 5, "image_id": 397133, "category_id": 1, "bbox": ["10", "a", 3, 4]}


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('{"images": [', ":1: COCO annotation JSON is not valid JSON: Expecting value"),
        ("[1, 2, 3]", ": expected a COCO JSON with images, annotations and categories"),
        (
            json.dumps({**OTHER_IMAGES, "images": [7]}),
            ": not a COCO instances JSON: each image, annotation and category must be an object "
            "with its ids (AttributeError: 'int' object has no attribute 'get')",
        ),
        (
            json.dumps(OTHER_IMAGES),
            ": lists no image 397133 (and 9 more) of the data scored: not the JSON the data came "
            "from",
        ),
        (  # was: scored against those pictures' boxes, without a word
            json.dumps(OTHER_SPLIT),
            ": 10 of its 10 images with the data's ids are other pictures (id 397133: 'x.jpg' "
            "there, '000000397133.jpg' here): not the JSON the data came from",
        ),
        (  # was: a pycocotools traceback after the evaluation
            json.dumps({**OTHER_IMAGES, "images": RIGHT_IMAGES, "annotations": [STRING_BOX]}),
            ": annotation 5: bbox ['10', 'a', 3, 4] is not 4 numbers",
        ),
    ],
)
def test_a_wrong_coco_gt_is_refused_before_the_evaluation(
    coco_like, tmp_path, monkeypatch, capsys, text, line
):
    """Was: the whole evaluation ran, the report and both --save-json files were written, and
    only then was the --coco-gt file read and refused (a rerun then needed --exist-ok)."""
    monkeypatch.setattr(validation, "evaluate", lambda *a, **k: pytest.fail("inference ran"))
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    save, js = tmp_path / "v", tmp_path / "js"
    argv = _argv(coco_like, _weights(tmp_path / "w80.pt", 80), "--save-json", str(js))
    assert validation.main([*argv, "--coco-gt", str(bad), "--save-dir", str(save)]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"\nerror: {bad}{line}\n") and err.count("error:") == 1, err
    assert not save.exists() and not js.exists()


def test_coco_gt_scores_with_official_coco_ids(coco_like, tmp_path, monkeypatch, capsys):
    """--coco-gt on COCO itself: the ground truth --save-json wrote scores as validation.py did;
    one that lacks a category of the data is refused (was: only when a prediction had it)."""
    weights = _weights(tmp_path / "w80.pt", 80)
    argv = _argv(coco_like, weights, "--save-dir", str(tmp_path / "v"), "--no-plots")
    stats = tmp_path / "stats.json"
    assert (
        validation.main([*argv, "--save-json", str(tmp_path / "a"), "--json-out", str(stats)]) == 0
    )
    gt = tmp_path / "a" / "ground_truth.json"
    argv += ["--save-json", str(tmp_path / "b"), "--exist-ok"]
    assert validation.main([*argv, "--coco-gt", str(gt)]) == 0
    source = json.loads((tmp_path / "b" / "source_stats.json").read_text())
    assert source["mAP50-95"] == pytest.approx(json.loads(stats.read_text())["mAP50-95"], abs=1e-4)
    few = tmp_path / "few.json"
    few.write_text(json.dumps({**json.loads(gt.read_text()), "categories": [{"id": 1}]}))
    capsys.readouterr()
    monkeypatch.setattr(validation, "evaluate", lambda *a, **k: pytest.fail("inference ran"))
    assert validation.main([*argv, "--coco-gt", str(few)]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"error: {few}: lists no category 2 of the data's classes: not the JSON the "
        "data came from\n"
    ), err


def test_bare_save_json_writes_into_the_report_folder(shapes_data, weights5, tmp_path):
    """YOLOv5's bare ``--save-json`` (and before ``--json-out``): the COCO JSONs go into the
    numbered report folder, the same predictions as ``--save-json DIR``."""
    project = tmp_path / "runs" / "val"
    base = _argv(shapes_data, weights5, "--no-plots", "--project", str(project))
    assert validation.main([*base, "--save-json", "--json-out", str(tmp_path / "s.json")]) == 0
    assert validation.main([*base, "--save-json", str(tmp_path / "js")]) == 0
    bare = json.loads((project / "exp" / "predictions.json").read_text())
    assert bare and bare == json.loads((tmp_path / "js" / "predictions.json").read_text())
    assert (project / "exp" / "ground_truth.json").is_file()
    assert not (project / "exp2" / "predictions.json").exists()


def test_default_report_folder_is_numbered(shapes_data, weights5, tmp_path, monkeypatch, capsys):
    """No --save-dir and no --project/--name: runs/val/exp, then exp2 (YOLOv5's); a second
    run wrote over the first's report and mixed its --save-txt labels into the same folder."""
    monkeypatch.chdir(tmp_path)
    argv = _argv(shapes_data, weights5, "--no-plots", "--save-txt")
    for _ in range(2):
        assert validation.main(argv) == 0
    runs = tmp_path / "runs" / "val"
    assert sorted(p.name for p in runs.iterdir()) == ["exp", "exp2"]
    for run in ("exp", "exp2"):
        assert (runs / run / "per_class.csv").is_file() and (runs / run / "labels").is_dir()
    # --save-dir is the folder as given; its earlier report is replaced only with --exist-ok
    # (was: replaced without a word, a user's errors.json too).
    assert validation.main([*argv, "--save-dir", "mine"]) == 0
    (tmp_path / "mine" / "errors.json").write_text("MY NOTES")
    assert validation.main([*argv, "--save-dir", "mine"]) == 2
    assert "already exist" in capsys.readouterr().err
    assert (tmp_path / "mine" / "errors.json").read_text() == "MY NOTES"
    assert validation.main([*argv, "--save-dir", "mine", "--exist-ok"]) == 0
    assert (tmp_path / "mine" / "per_class.csv").is_file() and not (tmp_path / "mine2").exists()


def test_coco_ids_refused_on_other_data(shapes_data, weights5, tmp_path, capsys):
    argv = _argv(shapes_data, weights5, "--save-json", str(tmp_path / "js"), "--coco-ids")
    assert validation.main(argv) == 2
    assert "--coco-ids needs the 80 COCO classes" in capsys.readouterr().err


def test_single_cls_scores_a_multi_class_model_as_one_class(shapes_data, weights5, tmp_path):
    """--single-cls on a 5-class model (YOLOv5's behaviour): class-agnostic NMS, every
    detection and label class 0; the mAP equals that pipeline written out here with
    pycocotools."""
    from build_utils.boxes import non_max_suppression, scale_coords
    from build_utils.parse_config import parse_data_cfg
    from train_utils.data_loaders import make_eval_dataset, make_eval_loader
    from train_utils.evaluation.coco_eval import detections_to_coco
    from train_utils.evaluation.coco_gt import coco_dict_from_dataset

    stats_file = tmp_path / "stats.json"
    extra = ["--single-cls", "--json-out", str(stats_file), "--save-dir", str(tmp_path / "val")]
    code = validation.main(_argv(shapes_data, weights5, *extra))
    assert code == 0
    got = json.loads(stats_file.read_text())

    model = Darknet(rewrite_cfg_classes(parse_model_cfg(NANO_CFG), 5), img_size=(IMG, IMG))
    model.load_state_dict(torch.load(weights5, weights_only=True)["model"])
    model.eval()
    dataset = make_eval_dataset(parse_data_cfg(shapes_data)["valid"], IMG, 4, 5)
    dets = []
    with torch.no_grad():
        for imgs, _, _, shapes, indices in make_eval_loader(dataset, 4, 1, 0, 0, False):
            out = non_max_suppression(
                model(imgs.float() / 255)[0], 0.001, 0.6, multi_label=True, agnostic=True
            )
            for o, shape in zip(out, shapes):
                o[:, :4] = scale_coords(imgs.shape[2:], o[:, :4], shape[0], shape[1])
                o[:, 5] = 0
            dets += detections_to_coco(out, [int(i) for i in indices])
    gt_dict = coco_dict_from_dataset(dataset, num_classes=5)
    for a in gt_dict["annotations"]:
        a["category_id"] = 0
    gt_dict["categories"] = [{"id": 0, "name": "object"}]
    gt = COCO()
    gt.dataset = gt_dict
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
        e = COCOeval(gt, gt.loadRes(dets), "bbox")
        e.evaluate()
        e.accumulate()
        e.summarize()
    assert got["mAP50"] > 0.001  # not 0: dropping labels or class-wise NMS both change it
    assert got["mAP50-95"] == pytest.approx(e.stats[0], abs=1e-6)
    assert got["mAP50"] == pytest.approx(e.stats[1], abs=1e-6)


def test_error_breakdown_in_the_report(shapes_data, weights5, tmp_path, caplog):
    """validation.py logs the TIDE table and writes errors.json, whose numbers agree with the
    detections and labels it saves and with its own COCO mAP50."""
    caplog.set_level(logging.INFO)
    save, out, stats_file = tmp_path / "val", tmp_path / "json", tmp_path / "stats.json"
    argv = _argv(shapes_data, weights5, "--save-dir", str(save), "--no-plots", "--max-det", "100")
    argv += ["--save-json", str(out), "--json-out", str(stats_file)]
    assert validation.main(argv) == 0
    saved = json.loads((save / "errors.json").read_text())
    stats = json.loads(stats_file.read_text())
    preds = json.loads((out / "predictions.json").read_text())
    labels = json.loads((out / "ground_truth.json").read_text())["annotations"]
    counts = {k: v["count"] for k, v in saved["errors"].items()}
    dap = {k: v["dAP"] for k, v in saved["errors"].items()}
    main = ("classification", "localisation", "both", "duplicate", "background")
    # Every detection (at most 100 per image here) is a true positive or one false-positive type.
    true_pos = len(labels) - counts["false negatives"]
    assert counts["false positives"] == sum(counts[k] for k in main) == len(preds) - true_pos
    assert 0 <= counts["missed"] <= counts["false negatives"] <= len(labels)
    # At most 100 detections per image and only labelled classes detected: COCO's AP50.
    assert {p["category_id"] for p in preds} <= {a["category_id"] for a in labels}
    assert 0 < saved["ap50"] == pytest.approx(100 * stats["mAP50"], abs=1e-6)
    assert all(0 <= dap[k] <= 100 - saved["ap50"] + 1e-9 for k in (*main, "missed"))
    log = caplog.text
    assert "error breakdown (TIDE: IoU 0.5, background below 0.1" in log
    assert f"{'background':>16s} {counts['background']:7d} {dap['background']:6.2f}" in log
    if faster_coco_eval_available():  # the default scorer where installed
        assert "scored by faster-coco-eval" in log


@pytest.mark.parametrize(
    ("flag", "place", "why"),
    [
        ("--json-out", "out", "out is a folder, not a file"),
        ("--json-out", "file/stats.json", "file is a file where a folder should be"),
        ("--save-json", "file", "file is a file where a folder should be"),
        ("--save-dir", "file", "file is a file where a folder should be"),
    ],
)
def test_an_output_place_no_write_could_use_stops_before_the_evaluation(
    flag, place, why, tmp_path, monkeypatch, capsys
) -> None:
    # Was: the whole evaluation ran (and wrote its report into runs/val/expN) before the write
    # to this place failed. The weights do not exist: the place's line must come first.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "file").write_text("")
    assert validation.main(["--weights", "missing.pt", flag, place]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot write {place}: {why}; move it away or choose another {flag}"]
    assert not (tmp_path / "runs").exists() and (tmp_path / "file").read_text() == ""


def test_exist_ok_moves_the_previous_report_aside(shapes_data, weights5, tmp_path, caplog):
    """Was: ``--name g --exist-ok`` wrote into g over the previous report, its labels/ and
    pictures mixed with the new ones. Now they move into g/replaced-<time>/ (as train.py's
    --exist-ok moves a previous run) before the new report is written."""
    caplog.set_level(logging.INFO)
    project = tmp_path / "runs" / "val"
    base = _argv(shapes_data, weights5, "--project", str(project), "--name", "g")
    assert validation.main([*base, "--save-txt"]) == 0
    first = project / "g"
    old = sorted(p.name for p in first.iterdir())
    assert "labels" in old and "confusion_matrix.png" in old
    assert validation.main([*base, "--no-plots", "--exist-ok"]) == 0
    (aside,) = [p for p in first.iterdir() if p.name.startswith("replaced-")]
    assert sorted(p.name for p in aside.iterdir()) == old
    now = sorted(p.name for p in first.iterdir() if p != aside)
    assert "labels" not in now and "confusion_matrix.png" not in now and "per_class.csv" in now
    assert f"the previous report in {first} was moved to {aside}" in caplog.text
    assert sorted(p.name for p in project.iterdir()) == ["g"]


def test_exist_ok_never_moves_a_training_run(shapes_data, weights5, tmp_path, capsys):
    run = tmp_path / "runs" / "train" / "exp"
    run.mkdir(parents=True)
    (run / "last.pt").write_bytes(b"a run")
    argv = _argv(shapes_data, weights5, "--project", str(run.parent), "--name", "exp")
    assert validation.main([*argv, "--exist-ok"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --exist-ok would move the previous report in {run} aside, ")
    assert err.count("\n") == 1 and "choose another --name" in err
    assert sorted(p.name for p in run.iterdir()) == ["last.pt"]
    # Was: --save-dir naming the run folder wrote the report over the run's own (exit 0).
    for extra in ([], ["--exist-ok"]):
        assert validation.main([*_argv(shapes_data, weights5, "--save-dir", str(run)), *extra]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == (  # the run files found (was: every name looked for)
            f"error: --save-dir {run} holds a training run or search (last.pt), which a report "
            "never writes into: choose another --save-dir"
        )
    assert sorted(p.name for p in run.iterdir()) == ["last.pt"]


def test_json_outputs_are_kept_unless_exist_ok(shapes_data, weights5, tmp_path, capsys):
    """Was: --json-out X and --save-json DIR wrote over whatever was there (a --json-out
    naming the weights replaced them). One line before the evaluation, unless --exist-ok."""
    stats, js = tmp_path / "stats.json", tmp_path / "js"
    js.mkdir()
    stats.write_text("mine")
    (js / "predictions.json").write_text("mine")
    base = _argv(shapes_data, weights5, "--no-plots", "--save-dir", str(tmp_path / "v"))
    for extra, taken, flag in [
        (["--json-out", str(stats)], stats, "--json-out"),
        (["--save-json", str(js)], js / "predictions.json", "--save-json"),
    ]:
        assert validation.main([*base, *extra]) == 2
        assert capsys.readouterr().err == (
            f"error: {taken} already exists; pass --exist-ok to replace, or choose another {flag}\n"
        )
        assert taken.read_text() == "mine" and not (tmp_path / "v").exists()
    assert validation.main([*base, "--json-out", str(weights5)]) == 2
    assert "is the --weights file this tool reads" in capsys.readouterr().err
    # Was: --json-out onto --save-json's predictions.json replaced the predictions (exit 0).
    onto = ["--save-json", str(js), "--json-out", str(js / "sub" / ".." / "predictions.json")]
    assert validation.main([*base, *onto, "--exist-ok"]) == 2
    assert capsys.readouterr().err == (
        f"error: --json-out {js / 'sub' / '..' / 'predictions.json'} is also --save-json's "
        "predictions.json; choose another file\n"
    )
    extra = ["--json-out", str(stats), "--save-json", str(js), "--exist-ok"]
    assert validation.main([*base, *extra]) == 0
    assert "mAP50" in json.loads(stats.read_text())
    assert isinstance(json.loads((js / "predictions.json").read_text()), list)


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes, but the label cache that reading the data makes."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.name)
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def _error_line(capsys) -> str:
    """The one error line on stderr (the first run on a dataset also draws a progress bar)."""
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    return line


def test_no_output_replaces_a_file_read_or_a_training_run(
    make_shapes_data, weights5, tmp_path, capsys
):
    """Was: exit 0, --json-out naming the .data file (or a file it names) replaced it with
    JSON stats, --json-out runs/x/last.pt replaced the run's checkpoint, and --save-json runs/x
    wrote into the run's folder (while --save-dir runs/x was refused). Now one line each, even
    with --exist-ok, and every file as it was."""
    data = make_shapes_data(n_train=4, n_val=4)
    root = data.parent
    run = tmp_path / "runs" / "t1"
    run.mkdir(parents=True)
    (run / "last.pt").write_bytes(b"a run")
    (run / "results.csv").write_text("epoch\n0\n")
    before = {**_files(root), **_files(run)}
    base = _argv(data, weights5, "--save-dir", str(tmp_path / "v"), "--exist-ok")
    cases = [
        (["--json-out", str(data)], f"--json-out {data} is the --data file this tool reads"),
        (
            ["--json-out", str(root / "shapes.names")],
            f"--json-out {root / 'shapes.names'} is the 'names' file of {data} this tool reads",
        ),
        (
            ["--json-out", str(root / "val.txt")],
            f"--json-out {root / 'val.txt'} is the 'valid' file of {data} this tool reads",
        ),
        (
            ["--json-out", str(run / "last.pt")],
            f"--json-out {run / 'last.pt'} is a file of the training run in {run}, which is "
            "never replaced (not even with --exist-ok); choose another --json-out, e.g. "
            f"{run.parent / 't1-stats.json'}",  # beside the run, not in it
        ),
        (
            ["--save-json", str(run)],
            f"--save-json {run} holds a training run or search (last.pt, results.csv), which a "
            "report never writes into: choose another --save-json",
        ),
    ]
    for extra, message in cases:
        assert validation.main([*base, *extra]) == 2, extra
        line = _error_line(capsys)
        assert line.startswith(f"error: {message}"), line
        assert {**_files(root), **_files(run)} == before, extra
        assert sorted(p.name for p in run.iterdir()) == ["last.pt", "results.csv"]
    assert not (tmp_path / "v").exists()


def test_a_report_folder_over_the_scored_images_is_refused(
    make_shapes_data, weights5, tmp_path, capsys
):
    """Was: --save-dir d/val --save-txt --exist-ok replaced the ground-truth labels in
    d/val/labels with predictions, and --project d --name val --exist-ok moved d/val/images and
    labels into d/val/replaced-<time>/ (val.txt then pointing at missing files). Now a report
    folder that is, lies inside or holds the images or labels scored is refused, as
    predict.py refuses an --output over its --source: one line, even with --exist-ok."""
    data = make_shapes_data(n_train=4, n_val=4)
    root = data.parent
    val = (root / "val").resolve()
    before = _files(root)
    held = "which the report could replace"
    cases = [
        (
            ["--save-dir", str(root / "val"), "--save-txt"],
            f"--save-dir {root / 'val'} holds the images scored in {val / 'images'}, {held}; "
            "choose another --save-dir",
        ),
        (
            ["--project", str(root), "--name", "val"],
            f"--project/--name {root / 'val'} holds the images scored in {val / 'images'}, "
            f"{held}; choose another --project/--name",
        ),
        (
            ["--save-dir", str(root / "val" / "labels")],
            f"--save-dir {root / 'val' / 'labels'} is the labels scored in {val / 'labels'}: the "
            "report would be written among the files read; choose a place outside it",
        ),
        (
            ["--save-dir", str(tmp_path / "r"), "--save-json", str(root / "val" / "labels")],
            f"--save-json {root / 'val' / 'labels' / 'ground_truth.json'} lies in the images or "
            f"labels scored in {val / 'labels'}; choose a place outside it",
        ),
    ]
    for extra, message in cases:
        assert validation.main([*_argv(data, weights5, *extra), "--exist-ok"]) == 2, extra
        assert _error_line(capsys) == f"error: {message}"
        assert _files(root) == before, extra
    assert not (tmp_path / "r").exists()
    # A report folder whose previous contents --exist-ok would move aside holds the weights.
    weights = tmp_path / "mine" / "w.pt"
    weights.parent.mkdir()
    shutil.copy(weights5, weights)
    argv = _argv(data, weights, "--project", str(tmp_path), "--name", "mine", "--exist-ok")
    assert validation.main(argv) == 2
    assert _error_line(capsys) == (
        f"error: --project/--name {weights.parent} holds the --weights file {weights}, which the "
        "report could replace; choose another --project/--name"
    )
    assert sorted(p.name for p in weights.parent.iterdir()) == ["w.pt"]


def test_a_torchscript_export_as_weights_is_one_plain_line(shapes_data, weights5, tmp_path):
    """Was: torch.load's warning about TorchScript archives on stderr, then PyTorch's advice to
    re-run torch.load with weights_only=False."""
    from models.export import export_torchscript

    ts = export_torchscript(
        Darknet(NANO_CFG, img_size=64).eval(), tmp_path / "best.torchscript", 64
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert validation.main(_argv(shapes_data, ts)) == 2
    assert [str(w.message) for w in caught if "TorchScript" in str(w.message)] == []
    assert err.getvalue().count("\n") == 1, err.getvalue()
    assert err.getvalue().startswith(f"error: {ts}: a TorchScript export")
    assert "weights_only" not in err.getvalue()


def test_an_image_as_weights_says_so(shapes_data, tmp_path, capsys):
    """Was: read as a Darknet file, "these weights carry no model cfg" (without --cfg) or a
    size mismatch (with it)."""
    image = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    assert validation.main(_argv(shapes_data, image)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {image}: not a weights file but a JPEG image")
