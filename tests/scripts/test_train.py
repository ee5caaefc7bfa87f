"""End-to-end training through train.py's code path on a tiny dataset: outputs, resume, weights."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import pytest
import torch
from conftest import read_results, run_training, train_argv, validation_argv

import train as train_script
import validation
from models.loss import scale_loss_gains
from train_utils import trainer as trainer_module
from train_utils.checkpoint import load_checkpoint
from train_utils.config import load_hyp
from train_utils.evaluation.coco_eval import faster_coco_eval_available
from train_utils.reporting import RESULTS_HEADER, TIMING_COLUMNS

pytestmark = pytest.mark.slow

IMG = 128


def _flags(data: Path, out: Path, *extra: str, **overrides) -> list[str]:
    """This file's run: 2 epochs, batches of 8 (nominal 8), a log line per step."""
    settings = {"epochs": 2, "batch": 8, "nbs": 8, "img": IMG, **overrides}
    return train_argv(data, out, "--log-interval", "1", *extra, **settings)


@pytest.fixture(scope="module")
def trained(shapes_data, tmp_path_factory):
    """One 2-epoch run shared by the tests that only read its outputs."""
    out = tmp_path_factory.mktemp("run")
    summary = run_training(_flags(shapes_data, out, plots=True))
    return out, summary


def test_training_writes_every_output_and_lowers_loss(trained):
    out, summary = trained
    for name in (
        "last.pt",
        "best.pt",
        "results.csv",
        "results.png",
        "args.yaml",
        "hyp.yaml",
        "model.cfg",
        "train.log",
        "per_class.csv",
    ):
        assert (out / name).is_file(), name
    for name in (
        "labels.png",
        "train_batch0.jpg",
        "train_batch1.jpg",
        "train_batch2.jpg",
        "confusion_matrix.png",
        "PR_curve.png",
        "F1_curve.png",
        "P_curve.png",
        "R_curve.png",
        "val_batch0_labels.jpg",
        "val_batch0_pred.jpg",
    ):
        img = cv2.imread(str(out / name))
        assert img is not None and min(img.shape[:2]) >= 200, name
        assert img.reshape(-1, 3).std(0).max() > 5, f"{name} is blank"
    assert read_results(out / "per_class.csv")[0]["name"] == "all"
    assert list(out.glob("events.out.tfevents.*"))
    with (out / "results.csv").open() as f:
        assert f.readline().strip() == ",".join(RESULTS_HEADER)
    rows = read_results(out / "results.csv")
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    assert all(float(r["loss"]) > 0 and float(r["train_seconds"]) > 0 for r in rows)
    ckpt = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    for key in (
        "model",
        "train_model",
        "ema",
        "optimizer",
        "scheduler",
        "epoch",
        "best_fitness",
        "config",
        "names",
        "nc",
        "cfg",
    ):
        assert key in ckpt, key
    assert ckpt["epoch"] == 1 and ckpt["nc"] == 5 and ckpt["names"][0] == "circle"
    assert summary.epochs_run == 2
    # The default COCO scorer: faster-coco-eval where installed, named once in the run's log.
    assert ckpt["config"]["coco_backend"] == "auto"
    if faster_coco_eval_available():
        log = (out / "train.log").read_text()
        assert log.count("COCO scoring: faster-coco-eval (--coco-backend auto: installed)") == 1


def test_training_lowers_the_loss(make_shapes_data, repo_root, tmp_path):
    """Six epochs of one 8-image batch without augmentation: the last epoch's loss is clearly
    below the first's. (From scratch, the loss of a few steps over varied augmented images is
    dominated by noise and by the objectness target rising with box quality, so a fixed batch
    is what makes this a property of learning rather than luck.)"""
    data = make_shapes_data(n_train=8, n_val=4)
    hyp = tmp_path / "no_aug.yaml"
    text = (repo_root / "cfg" / "hyp_demo.yaml").read_text()
    for key in ("hsv_h", "hsv_s", "hsv_v", "translate", "scale", "fliplr", "warmup_epochs"):
        text = "\n".join(
            f"{key}: 0.0" if line.startswith(f"{key}:") else line for line in text.splitlines()
        )
    hyp.write_text(text.replace("mosaic: true", "mosaic: false"))
    out = tmp_path / "run"
    # hyp_demo.yaml's lr0 is an Adam learning rate.
    run_training(
        _flags(data, out, "--notest", "--no-ema", "--optimizer", "adam", epochs=6, hyp=hyp)
    )
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["5"]  # --notest: only the final epoch is evaluated
    log = (out / "train.log").read_text()
    losses = [
        float(line.split("loss ")[1].split()[0].rstrip(","))
        for line in log.splitlines()
        if "epoch " in line and "loss " in line
    ]
    assert len(losses) == 6 and losses[-1] < 0.9 * losses[0], losses


def test_validation_reproduces_training_map(trained, shapes_data, tmp_path):
    out, _ = trained
    stats_file = tmp_path / "stats.json"
    code = validation.main(
        validation_argv(
            out / "model.cfg",
            shapes_data,
            out / "last.pt",
            "--json-out",
            str(stats_file),
            "--save-json",
            str(tmp_path / "js"),
            "--save-dir",
            str(tmp_path / "val"),
            img=IMG,
            batch=8,
        )
    )
    assert code == 0
    stats = json.loads(stats_file.read_text())
    last = read_results(out / "results.csv")[-1]
    for name, value in stats.items():
        assert value == pytest.approx(float(last[name]), abs=1e-4), name
    gt = json.loads((tmp_path / "js" / "ground_truth.json").read_text())
    preds = json.loads((tmp_path / "js" / "predictions.json").read_text())
    assert len(gt["images"]) == 10 and Path(gt["images"][0]["file_name"]).is_absolute()
    assert all({"image_id", "category_id", "bbox", "score"} <= set(p) for p in preds)


def test_resume_is_exact(shapes_data, tmp_path, monkeypatch):
    full = tmp_path / "full"
    run_training(_flags(shapes_data, full))

    part = tmp_path / "part"
    real = trainer_module.train_one_epoch

    def interrupt_second_epoch(*args, **kwargs):
        if args[2] == 1:  # the epoch argument
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_one_epoch", interrupt_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        run_training(_flags(shapes_data, part))
    monkeypatch.setattr(trainer_module, "train_one_epoch", real)
    assert load_checkpoint(part / "last.pt")["epoch"] == 0
    run_training(_flags(shapes_data, part, "--resume"))

    a = load_checkpoint(full / "last.pt")
    b = load_checkpoint(part / "last.pt")
    for key in ("model", "train_model"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    ra, rb = read_results(full / "results.csv"), read_results(part / "results.csv")
    assert [r["epoch"] for r in rb] == ["0", "1"]
    for x, y in zip(ra, rb):
        for column in TIMING_COLUMNS:
            x.pop(column), y.pop(column)
        assert x == y


def test_weights_with_other_class_count(trained, shapes_data, tmp_path, caplog):
    out, _ = trained
    # --single-cls makes a 1-class model: the 5-class heads cannot load, everything else does.
    run_dir = tmp_path / "ft"
    with caplog.at_level("WARNING"):
        run_training(
            _flags(
                shapes_data, run_dir, "--single-cls", "--weights", str(out / "last.pt"), epochs=1
            )
        )
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped and "Conv2d" in skipped[0]
    assert load_checkpoint(run_dir / "last.pt")["nc"] == 1


def test_cli_errors_are_one_line(shapes_data, tmp_path, capsys):
    code = train_script.main(_flags(shapes_data, tmp_path / "x", epochs=1, img=100))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "error: --img-size 100 is not a positive multiple of 32; use e.g. 96"
    ]
    code = train_script.main(_flags(shapes_data, tmp_path / "x", "--resume", epochs=1))
    assert code == 2 and "--resume: no checkpoint" in capsys.readouterr().err


def test_run_folder_hyp_is_what_the_user_gave(trained, repo_root):
    """Passing a run's hyp.yaml back with --hyp reproduces its settings (the class/size-scaled
    gains are kept in the checkpoint under their own key, never scaled twice)."""
    out, _ = trained
    given = load_hyp(repo_root / "cfg" / "hyp.yaml")
    assert load_hyp(out / "hyp.yaml") == given
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["hyp"] == given
    assert ckpt["hyp_scaled"] == scale_loss_gains(given, 5, IMG)
    assert ckpt["hyp_scaled"]["cls"] != given["cls"]


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_run_folder_among_the_datasets_images_or_labels_is_refused(make_shapes_data, capsys):
    """Was: --output-dir d/train/images was accepted (exit 0): the run wrote its pictures and
    checkpoints among the training images, and the next run trained on its own plots as
    background images. A run folder that is or lies inside a train or val images or labels
    folder (--output-dir or --project/--name) is now one line, exit 2, nothing written; one
    that holds them (d/val, beside its images/ and labels/) is a place like any other."""
    data = make_shapes_data()
    root = data.parent
    before = _files(root)
    cases = [
        (
            ["--output-dir", str(root / "train" / "images")],
            f"--output-dir {root / 'train' / 'images'} lies in the dataset's image or label "
            f"folder {root / 'train' / 'images'}; choose a place outside it",
        ),
        (
            ["--project", str(root / "val" / "labels"), "--name", "exp"],
            f"--project/--name {root / 'val' / 'labels' / 'exp'} lies in the dataset's image or "
            f"label folder {root / 'val' / 'labels'}; choose a place outside it",
        ),
    ]
    for where, line in cases:
        capsys.readouterr()
        assert train_script.main(train_argv(data, None, *where, img=64)) == 2
        assert capsys.readouterr().err == f"error: {line}\n"
        assert _files(root) == before
