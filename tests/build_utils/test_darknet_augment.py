"""build_utils/darknet_augment.py crops as Darknet's loader: for the random draws Darknet's
``load_data_detection`` (its build without OpenCV, run by tests/darknet_ref/) makes after
``srand(seed)``, our crop of the same labels gives Darknet's truths exactly, with jitter,
resize (zoom in and out), letter_box and flip."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from build_utils.darknet_augment import CropDraws, crop_truths, jitter_crop
from tests.darknet_ref.runs import run_harness
from train_utils.darknet_schedule import RAND_MAX, GlibcRandom

CLASSES = 3
MAX_BOXES = 20
TRUTH_SIZE = 6  # x, y, w, h, class, track id


def _labels(seed: int) -> list[list[float]]:
    """12 boxes, some of class 3 (dropped: the network has 3 classes), some reaching out."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(12):
        xy, wh = rng.uniform(0.05, 0.95, 2), rng.uniform(0.01, 0.6, 2)
        rows.append([int(rng.integers(0, CLASSES + 1)), *map(float, (*xy, *wh))])
    return rows


def _uniform(rand) -> float:
    """Darknet's random_float(): (float)rand() / RAND_MAX."""
    return float(np.float32(rand()) / np.float32(RAND_MAX))


def _replayed_draws(seed: int, use_flip: bool) -> tuple[CropDraws, bool]:
    """The draws load_data_detection makes for one image after srand(seed): random_index and
    the path index first, then resize_r1, resize_r2, r1..r4 and the flip."""
    rand = GlibcRandom(seed).rand
    rand(), rand()
    resize_r1, resize_r2 = _uniform(rand), _uniform(rand)
    r = [_uniform(rand) for _ in range(4)]
    flip = bool(rand() % 2) if use_flip else False
    return CropDraws(*r, resize_r1, resize_r2), flip


def _darknet_truths(harness: Path, tmp_path: Path, size, net, keys, labels, seed) -> np.ndarray:
    image = tmp_path / "im.png"
    cv2.imwrite(str(image), np.zeros((size[1], size[0], 3), np.uint8))
    rows = "".join(f"{c} {x!r} {y!r} {w!r} {h!r}\n" for c, x, y, w, h in labels)
    image.with_suffix(".txt").write_text(rows)
    out = tmp_path / "truths.f32"
    args = ["loader", image, *net, keys["jitter"], keys["resize"], keys["letter_box"]]
    args += [keys["flip"], CLASSES, MAX_BOXES, seed, out]
    run_harness(harness, args, tmp_path)
    truths = np.fromfile(out, dtype=np.float32).reshape(MAX_BOXES, TRUTH_SIZE)
    return truths[truths[:, 0] != 0, :5]


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


CASES = {
    "jitter": ((320, 240), (128, 128), {"jitter": 0.3, "resize": 1.0, "letter_box": 0}),
    "zoom and letter_box": ((320, 240), (128, 96), {"jitter": 0.2, "resize": 1.5, "letter_box": 1}),
    "zoom out, tall": ((200, 300), (96, 128), {"jitter": 0.1, "resize": 0.75, "letter_box": 1}),
    "wide image": ((640, 200), (160, 160), {"jitter": 0.3, "resize": 1.2, "letter_box": 1}),
}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("case", CASES)
def test_truths_equal_darknets_loader(darknet_harness, tmp_path, case, seed):
    size, net, keys = CASES[case]
    keys = {**keys, "flip": 1}
    labels = _labels(seed)
    theirs = _darknet_truths(darknet_harness, tmp_path, size, net, keys, labels, seed)
    draws, flip = _replayed_draws(seed, use_flip=True)
    crop = jitter_crop(*size, *net, keys["jitter"], keys["resize"], keys["letter_box"], draws)
    ours = crop_truths(np.array(labels), crop, flip, *net, CLASSES, MAX_BOXES)
    assert len(theirs) >= 4, "too few boxes survive to prove anything"
    # Darknet shuffles the boxes with its random stream: compare them as sets.
    np.testing.assert_array_equal(_sorted(ours), _sorted(theirs))


def test_centred_draws_cut_nothing():
    crop = jitter_crop(320, 240, 128, 128, 0.3, 1.0, False, CropDraws(0.5, 0.5, 0.5, 0.5))
    assert (crop.pleft, crop.pright, crop.ptop, crop.pbot) == (0, 0, 0, 0)
    boxes = crop_truths(np.array([[1, 0.5, 0.5, 0.2, 0.4]]), crop, False, 128, 128, 2, 10)
    np.testing.assert_allclose(boxes, [[0.5, 0.5, 0.2, 0.4, 1]], rtol=1e-6)


def test_letter_box_pads_the_short_side():
    """A 320 x 240 image for a square network: 40 rows added above and below (320 x 320), so a
    box keeps its width and its height shrinks by 240 / 320."""
    crop = jitter_crop(320, 240, 128, 128, 0.0, 1.0, True, CropDraws(0.5, 0.5, 0.5, 0.5))
    assert (crop.pleft, crop.pright, crop.ptop, crop.pbot) == (0, 0, -40, -40)
    boxes = crop_truths(np.array([[0, 0.5, 0.5, 0.5, 0.5]]), crop, True, 128, 128, 1, 10)
    np.testing.assert_allclose(boxes, [[0.5, 0.5, 0.5, 0.375, 0]], rtol=1e-6)
