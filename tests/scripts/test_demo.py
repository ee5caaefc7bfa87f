"""tools/demo.py: the image size it fits to a dataset, the time it reports for crossing the
target, and a whole budgeted run on tiny data through train, validation and predict."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from tools import demo
from train_utils.reporting import RESULTS_HEADER, write_results


def _labels(short_px: list[float], w: int, h: int) -> np.ndarray:
    """Square boxes of the given sides in a ``w`` x ``h`` image, normalised."""
    return np.array([[0, 0.5, 0.5, s / w, s / h] for s in short_px], dtype=np.float64)


def test_image_size_shows_the_small_objects_at_11_px() -> None:
    assert demo.MIN_OBJECT_PX == 11.0
    shapes = np.array([[400, 300]] * 10)
    # The 10th percentile of the short sides is 20 px of a 400-px long side: 11 px needs 220,
    # the next multiple of 32 is 224.
    labels = [_labels([20.0] * 2 + [60.0] * 8, 400, 300) for _ in range(10)]
    assert demo.choose_img_size(labels, shapes) == 224
    # 16 px: 275 would be needed, more than the upper bound 256 a ten-minute budget affords.
    labels = [_labels([16.0] * 2 + [60.0] * 8, 400, 300) for _ in range(10)]
    assert demo.choose_img_size(labels, shapes) == 256
    # Objects of 40 px: 11 px at 110 (= 400 * 11 / 40), below the lower bound 128.
    labels = [_labels([40.0] * 10, 400, 300) for _ in range(10)]
    assert demo.choose_img_size(labels, shapes) == 128
    # Objects of 24 px: 183 px -> the next multiple of 32, 192.
    labels = [_labels([24.0] * 10, 400, 300) for _ in range(10)]
    assert demo.choose_img_size(labels, shapes) == 192


def test_image_size_never_upscales_nor_leaves_the_bounds() -> None:
    small_images = np.array([[180, 150]] * 4)
    tiny_objects = [_labels([4.0] * 5, 180, 150) for _ in range(4)]
    assert demo.choose_img_size(tiny_objects, small_images) == 192  # median side 180 -> 192
    huge = np.array([[2000, 1500]] * 4)
    assert demo.choose_img_size([_labels([10.0] * 5, 2000, 1500)] * 4, huge) == 256
    # No labels at all: the lower bound.
    assert demo.choose_img_size([np.zeros((0, 5))] * 4, huge) == 128
    assert demo.choose_img_size([np.zeros((0, 5))] * 4, huge, bounds=(160, 320)) == 160


def test_first_crossing_reads_the_elapsed_time(tmp_path: Path) -> None:
    rows = []
    for epoch, m, t in ((2, 0.5, 60.0), (5, 0.86, 150.0), (8, 0.84, 240.0), (9, 0.9, 270.0)):
        row = dict.fromkeys(RESULTS_HEADER, 0.0)
        row.update(epoch=epoch, mAP50=m, elapsed_seconds=t)
        rows.append(row)
    write_results(tmp_path / "results.csv", rows)
    assert demo.first_crossing(tmp_path / "results.csv", 0.85) == (5, 150.0)
    assert demo.first_crossing(tmp_path / "results.csv", 0.95) is None
    assert demo.first_crossing(tmp_path / "missing.csv", 0.5) is None


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        ([], {"YOLO_THREADS": "0"}, "YOLO_THREADS='0': expected auto"),
        (["--epochs", "0"], {}, "--epochs must be >= 1, got 0"),
        (["--time-budget", "-1"], {}, "--time-budget must be a positive, finite"),
        (["--time-budget", "inf"], {}, "--time-budget must be a positive, finite"),
    ],
)
def test_a_bad_flag_stops_the_demo_before_it_makes_or_reads_data(
    argv, env, line, monkeypatch, tmp_path, capsys
) -> None:
    # Was: the 1,700 shapes images were generated (or --data's labels scanned and cached)
    # before train.py's checks gave the line.
    def not_reached(*_args):
        raise AssertionError("data made or read before the flags were checked")

    monkeypatch.setattr(demo, "ensure_demo_dataset", not_reached)
    monkeypatch.setattr(demo, "recipe_for", not_reached)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for data in ([], ["--data", str(tmp_path / "my.data")]):
        assert demo.main([*data, *argv, "--output-dir", str(tmp_path / "run")]) == 2
        assert line in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_demo_on_given_data_runs_within_its_budget(make_shapes_data, tmp_path, capsys) -> None:
    data = make_shapes_data(n_train=20, n_val=4)  # one batch of 16 (the recipe drops the rest)
    out = tmp_path / "run"
    argv = ["--data", str(data), "--time-budget", "0.25", "--output-dir", str(out), "--amp", "off"]
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out
    assert "mAP@0.5 =" in printed and "mAP@0.5 >= 0.85:" in printed
    args = (out / "args.yaml").read_text()
    assert "time_budget: 0.25" in args and "autoanchor: true" in args
    assert re.search(r"^amp: '?off'?$", args, re.M)  # --amp reached train.py
    stats = json.loads((out / "val_stats.json").read_text())
    assert 0.0 <= stats["mAP50"] <= 1.0
    assert len(list((out / "predictions").glob("*.jpg"))) == 4


def test_an_interrupted_demo_names_the_command_that_continues_it(
    make_shapes_data, tmp_path, monkeypatch, capsys
) -> None:
    """Was: "continue with --resume", which demo.py does not take (and the next demo wrote
    runs/demo2 from scratch)."""
    data = make_shapes_data(n_train=4, n_val=2)
    out = tmp_path / "run"

    def interrupted_after_a_save(config, dist):
        config.output_dir.mkdir(parents=True)
        (config.output_dir / "last.pt").write_bytes(b"saved")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run", interrupted_after_a_save)
    assert demo.main(["--data", str(data), "--output-dir", str(out), "--amp", "off"]) == 130
    err = capsys.readouterr().err
    assert f"the demo's training continues with: python train.py --resume {out / 'last.pt'}" in err


def test_the_logged_training_command_pastes_as_it_is(tmp_path, monkeypatch) -> None:
    """Was: ``--device  --time-budget ...`` (an empty --device) in the logged command, which a
    shell reads as --device taking the next flag. Left at auto, --device is left out; given,
    it is there; the line is shell-quoted."""
    monkeypatch.setattr(demo, "ensure_demo_dataset", lambda root: tmp_path / "my data.data")
    argv, _ = demo.train_argv(demo.get_args_parser().parse_args(["--output-dir", "runs/d"]))
    assert "" not in argv and "--device" not in argv
    assert shlex.split(shlex.join(argv)) == argv and "--data" in argv
    args = demo.get_args_parser().parse_args(["--device", "cpu", "--amp", "off"])
    argv, _ = demo.train_argv(args)
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--amp") + 1] == "off"
    parsed = demo.train_parser().parse_args(argv)
    assert (parsed.device, parsed.amp, parsed.output_dir) == ("cpu", "off", "runs/demo")


@pytest.mark.parametrize("kind", ["folder", "list with a comment", "two lists"])
def test_the_pictures_come_from_the_validation_images_however_named(
    kind: str, tmp_path: Path, monkeypatch
) -> None:
    """Was: the validation source read as one ``.txt`` list split on whitespace, so a folder
    (``valid: images/val``) or data.yaml's list of sources ended the demo with a traceback after
    training, and a comment line became a source."""
    folder = tmp_path / "images" / "val"
    folder.mkdir(parents=True)
    for name in ("a.jpg", "b.jpg"):
        (folder / name).write_bytes(b"")  # only named: validation and predict are stand-ins
    listed = tmp_path / "val.txt"
    listed.write_text("# the validation images\nimages/val/a.jpg\n")
    other = tmp_path / "more.txt"
    other.write_text("images/val/b.jpg\n")
    valid = {"folder": folder, "list with a comment": listed, "two lists": (listed, other)}[kind]
    expected = {
        "folder": ["a.jpg", "b.jpg"],
        "list with a comment": ["a.jpg"],
        "two lists": ["a.jpg", "b.jpg"],
    }[kind]
    sources: list[str] = []

    def fake_validation(argv: list[str]) -> int:
        Path(argv[argv.index("--json-out") + 1]).write_text('{"mAP50": 0.5}')
        return 0

    def fake_predict(argv: list[str]) -> int:
        sources.extend(argv[argv.index("--source") + 1 : argv.index("--output")])
        return 0

    monkeypatch.setattr(demo.validation, "main", fake_validation)
    monkeypatch.setattr(demo.predict, "main", fake_predict)
    stats, _ = demo.evaluate_and_predict(tmp_path, tmp_path / "best.pt", valid, torch.device("cpu"))
    assert stats == {"mAP50": 0.5}
    assert sources == [str(folder / name) for name in expected]


def test_demo_dataset_is_reused_only_whole_and_of_the_demo_recipe(tmp_path, monkeypatch):
    """The demo reuses demo_data/shapes when make_shapes' own record (make_shapes.json) holds
    the demo's recipe and shapes.data (written last) is there. Was: the demo kept a record of its
    own, which ``make_shapes.py --exist-ok`` over that folder left in place, so the demo trained
    on a set of another recipe as its own."""
    from data.make_shapes import make_dataset

    monkeypatch.setattr(demo, "DEMO_DATASET", {**demo.DEMO_DATASET, "n_train": 2, "n_val": 1})
    made = []
    monkeypatch.setattr(
        demo, "make_dataset", lambda *a, **k: made.append(1) or make_dataset(*a, **k)
    )
    root = tmp_path / "shapes"
    data = demo.ensure_demo_dataset(root)
    assert demo.ensure_demo_dataset(root) == data and len(made) == 1  # reused
    make_dataset(root, n_train=3, n_val=1, seed=5)  # as make_shapes.py --exist-ok writes it
    demo.ensure_demo_dataset(root)
    assert len(made) == 2 and len((root / "train.txt").read_text().split()) == 2
    (root / "shapes.data").unlink()  # a set cut short
    demo.ensure_demo_dataset(root)
    assert len(made) == 3 and (root / "shapes.data").is_file()
    assert json.loads((root / "make_shapes.json").read_text())["n_train"] == 2
