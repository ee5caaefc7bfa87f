"""tools/darknet_check.py writes what the built Darknet computes (tests/darknet_ref/): the
``yolo`` delta file equals Darknet's ``l.delta`` for the same files, the ``lr`` lines are
Darknet's ``get_current_rate`` lines; bad input is one line and exit status 2."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.darknet_ref.runs import learning_rates, rewrite_cfg, yolo_deltas
from tools import darknet_check

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "cfg" / "darknet" / "yolov4-tiny.cfg"
SIZE = 96  # heads of 3 x 3 and 6 x 6 cells
LAYER = 37  # yolov4-tiny's second [yolo] (6 x 6)
ROWS = [
    [0, 0.5, 0.5, 0.25, 0.3125, 3.0],
    [0, 0.53125, 0.5, 0.125, 0.1875, 7.0],
    [2, 0.25, 0.75, 0.0625, 0.125, 1.0],
]


def _files(tmp_path: Path) -> tuple[Path, Path, Path, np.ndarray]:
    cfg = rewrite_cfg(TINY, tmp_path / "tiny.cfg", SIZE, {"iou_loss": "giou"})
    x = np.random.default_rng(0).normal(0, 1.5, (3, 255, 6, 6)).astype("<f4")
    x.tofile(tmp_path / "x.f32")
    (tmp_path / "t.txt").write_text("".join(" ".join(map(str, r)) + "\n" for r in ROWS))
    return cfg, tmp_path / "x.f32", tmp_path / "t.txt", x


def test_yolo_delta_file_is_darknets(darknet_harness, tmp_path, capsys):
    cfg, x_path, truths, x = _files(tmp_path)
    out = tmp_path / "d.f32"
    argv = ["yolo", "--cfg", str(cfg), "--layer", str(LAYER), "--input", str(x_path)]
    assert darknet_check.main([*argv, "--truths", str(truths), "--out", str(out)]) == 0
    ours = np.fromfile(out, dtype="<f4").reshape(x.shape)
    (work := tmp_path / "darknet").mkdir()
    theirs, cost = yolo_deltas(darknet_harness, cfg, ROWS, {LAYER: x}, work)[LAYER]
    assert np.abs(ours - theirs).max() <= 1e-4
    assert np.abs(theirs).max() > 0.1
    printed = capsys.readouterr().out.split()
    assert printed[0] == "cost" and float(printed[1]) == pytest.approx(cost, rel=1e-5)


def test_lr_lines_are_darknets(darknet_harness, tmp_path, capsys):
    cfg = rewrite_cfg(TINY, tmp_path / "tiny.cfg", SIZE, net={"max_batches": 1200})
    assert darknet_check.main(["lr", "--cfg", str(cfg), "--iterations", "1200"]) == 0
    ours = capsys.readouterr().out.splitlines()
    theirs = learning_rates(darknet_harness, cfg, 1200)
    assert len(ours) == 1200
    np.testing.assert_array_equal(np.array(ours, dtype=np.float64).astype(np.float32), theirs)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer": "36"}, r"--layer 36 is not a \[yolo\] layer \(those are: 30, 37\)"),
        ({"input_bytes": 10}, r"--input holds 10 bytes, not a whole number of images"),
        ({"truth": "0 0.5 0.5 0.2"}, r"t\.txt:1: expected six finite numbers"),
        ({"truth": "3 0.5 0.5 0.2 0.2 1"}, r"t\.txt:1: image 3 is not one of the input's images"),
        ({"out": "cfg"}, r"--out .* is the --cfg this tool reads"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, change, message):
    cfg, x_path, truths, _ = _files(tmp_path)
    if "input_bytes" in change:
        x_path.write_bytes(bytes(change["input_bytes"]))
    if "truth" in change:
        truths.write_text(change["truth"] + "\n")
    out = cfg if change.get("out") == "cfg" else tmp_path / "d.f32"
    argv = ["yolo", "--cfg", str(cfg), "--layer", change.get("layer", str(LAYER))]
    argv += ["--input", str(x_path), "--truths", str(truths), "--out", str(out)]
    assert darknet_check.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert re.search(message, err), err


def test_an_existing_out_is_kept_unless_exist_ok(tmp_path, capsys):
    """Was: --out X replaced whatever X was (one output policy: tools/ and README)."""
    cfg, x_path, truths, _ = _files(tmp_path)
    out = tmp_path / "results.csv"
    out.write_text("mine")
    argv = ["yolo", "--cfg", str(cfg), "--layer", str(LAYER), "--input", str(x_path)]
    argv += ["--truths", str(truths), "--out", str(out)]
    assert darknet_check.main(argv) == 2
    assert capsys.readouterr().err == (
        f"error: {out} already exists; pass --exist-ok to replace, or choose another --out\n"
    )
    assert out.read_text() == "mine"
    assert darknet_check.main([*argv, "--exist-ok"]) == 0
    assert out.stat().st_size > 4
