"""build_utils/darknet_data.py feeds the network what Darknet's loader feeds it: for the draws
Darknet's ``load_data_detection`` (its build without OpenCV, tests/darknet_ref/) makes after
``srand(seed)``, our crop, resize, flip and colour change of the same image give Darknet's
network input; the multi-scale rule and the per-iteration draws are functions of their key."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from build_utils.darknet_augment import CropDraws, jitter_crop
from build_utils.darknet_data import (
    DarknetBatches,
    DarknetLoaderSettings,
    ImageDraws,
    darknet_pixels,
    network_size,
    rand_scale,
)
from tests.darknet_ref.runs import run_harness
from train_utils.darknet_schedule import RAND_MAX, GlibcRandom

TRUTH_SIZE = 6


def _uniform(rand) -> float:
    return float(np.float32(rand()) / np.float32(RAND_MAX))


def _replayed(seed: int, hue: float, saturation: float, exposure: float) -> ImageDraws:
    """load_data_detection's draws for one image after srand(seed): random_index and the path
    index, resize_r1, resize_r2, r1..r4, the flip, r_scale, then the colour."""
    rand = GlibcRandom(seed).rand
    rand(), rand()
    resize_r1, resize_r2 = _uniform(rand), _uniform(rand)
    r = [_uniform(rand) for _ in range(4)]
    flip = bool(rand() % 2)
    _uniform(rand)  # r_scale

    def scale(s: float) -> float:
        lo, hi = sorted((1.0, s))
        v = float(np.float32(_uniform(rand)) * np.float32(hi - lo) + np.float32(lo))
        return v if rand() % 2 else float(np.float32(1) / np.float32(v))

    dhue = float(np.float32(_uniform(rand)) * np.float32(2 * hue) - np.float32(hue))
    dsat = scale(saturation)
    dexp = scale(exposure)
    return ImageDraws(CropDraws(*r, resize_r1, resize_r2), flip, dhue, dsat, dexp)


def _image(size: tuple[int, int], seed: int) -> np.ndarray:
    """A colourful BGR image with grey patches (Darknet's hue of a grey pixel is 0/0)."""
    w, h = size
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img[: h // 4, : w // 4] = 128
    img[-3:, -5:] = 0
    return img


CASES = {
    "jitter, colour": ((97, 71), (64, 64), 0.3, 1.0, 0, (0.1, 1.5, 1.5)),
    "zoom in, letter_box": ((120, 80), (96, 64), 0.2, 1.5, 1, (0.05, 1.2, 0.8)),
    "zoom out, no colour": ((64, 100), (32, 64), 0.1, 0.75, 1, (0.0, 1.0, 1.0)),
}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_network_input_equals_darknets(darknet_harness, tmp_path, case, seed):
    size, net, jitter, resize, letter_box, colour = CASES[case]
    bgr = _image(size, seed)
    image = tmp_path / "im.png"
    cv2.imwrite(str(image), bgr)
    image.with_suffix(".txt").write_text("0 0.5 0.5 0.2 0.2\n")
    truths, pixels = tmp_path / "truths.f32", tmp_path / "pixels.f32"
    args = ["loader", image, *net, jitter, resize, letter_box, 1, 2, 10, seed, truths]
    run_harness(darknet_harness, [*args, pixels, *colour], tmp_path)
    theirs = np.fromfile(pixels, np.float32).reshape(3, net[1], net[0]).transpose(1, 2, 0)

    draws = _replayed(seed, *colour)
    crop = jitter_crop(*size, *net, jitter, resize, bool(letter_box), draws.crop)
    rgb = bgr[..., ::-1].astype(np.float32) / np.float32(255)
    ours = darknet_pixels(rgb, crop, *net, draws)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=2e-6, rtol=0)


def test_no_colour_change_keeps_the_pixels():
    """hue 0, saturation and exposure 1: HSV there and back gives the resized pixels."""
    rgb = _image((40, 30), 0)[..., ::-1].astype(np.float32) / 255
    crop = jitter_crop(40, 30, 40, 30, 0.0, 1.0, False, CropDraws(0.5, 0.5, 0.5, 0.5))
    out = darknet_pixels(rgb, crop, 40, 30, ImageDraws(crop=CropDraws(0.5, 0.5, 0.5, 0.5)))
    np.testing.assert_allclose(out, rgb, atol=1e-6)


def _settings(**kw) -> DarknetLoaderSettings:
    return DarknetLoaderSettings(width=128, height=96, classes=2, **kw)


def test_random_sizes_follow_train_detectors_rule():
    s = _settings(random=1.0)
    # roundl(1.4 * 128 / 32 + 1) * 32 = 224, roundl(1.4 * 96 / 32 + 1) * 32 = 160.
    assert s.largest_size == (224, 160)
    sizes = [network_size(s, 7, k, 1000) for k in range(1, 1001)]
    assert sizes[:10] == [(224, 160)] * 10  # the first block: the largest (memory check)
    # A block starting once more than max_batches - 100 iterations are done: the largest.
    assert sizes[910:] == [(224, 160)] * 90
    for k in range(0, 900, 10):  # one size per block of 10 iterations
        assert len(set(sizes[k : k + 10])) == 1
    assert all(w % 32 == 0 and h % 32 == 0 and 32 <= w <= 224 for w, h in sizes)
    assert len(set(sizes)) > 3
    assert _settings().largest_size == (128, 96)
    assert network_size(_settings(), 7, 55, 1000) == (128, 96)


def test_rand_scale_draws_between_the_factor_and_its_inverse():
    rng = np.random.default_rng(0)
    values = np.array([rand_scale(rng, 1.5) for _ in range(2000)])
    assert values.min() >= 1 / 1.5 - 1e-6 and values.max() <= 1.5 + 1e-6
    assert 0.45 < (values > 1).mean() < 0.55
    # C's float arithmetic: rand_coef 1.4f - 1.0f is 0.39999998f, not f32(1.4 - 1.0) =
    # 0.40000001f, and one draw in eight came out one float step apart (was: 1.3651023).

    class Draw:  # a random_float of 0.91275555 and the scale itself, not its inverse
        def random(self) -> float:
            return 0.91275554895401

        def integers(self, n: int) -> int:
            return 1

    assert rand_scale(Draw(), 1.4) == 1.3651021718978882


def test_batches_of_a_range_replay_the_whole_run():
    s = _settings()

    def keys(first: int, last: int) -> list:
        b = DarknetBatches(50, s, mini_batch=3, subdivisions=2, max_batches=20, seed=5, rank=1)
        b.set_range(first, last)
        assert len(b) == (last - first + 1) * 2
        return list(b)

    whole = keys(1, 6)
    assert keys(1, 3) + keys(4, 6) == whole
    assert all(len(batch) == 3 for batch in whole)
    iterations = [k.iteration for batch in whole for k in batch]
    assert iterations == sorted(iterations) and set(iterations) == set(range(1, 7))
    other_rank = DarknetBatches(50, s, 3, 2, 20, seed=5, rank=0)
    other_rank.set_range(1, 6)
    assert [k.index for b in other_rank for k in b] != [k.index for b in whole for k in b]


def test_bad_loader_keys_are_refused(tmp_path: Path):
    from build_utils.errors import ConfigError
    from build_utils.parse_config import parse_model_cfg_text

    def blocks(net: str, yolo: str) -> list:
        text = (
            f"[net]\nwidth=64\nheight=64\n{net}\n[convolutional]\nfilters=21\nsize=1\n"
            f"activation=linear\n[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\n{yolo}\n"
        )
        return parse_model_cfg_text(text, "x.cfg")

    assert DarknetLoaderSettings.from_blocks(blocks("hue=.1", "jitter=.3")).jitter == 0.3
    with pytest.raises(ConfigError, match=r"x.cfg:.*jitter=0.6 must be in \[0, 0.5\)"):
        DarknetLoaderSettings.from_blocks(blocks("", "jitter=0.6"))
    with pytest.raises(ConfigError, match="resize_step=40 must be a multiple of 32"):
        DarknetLoaderSettings.from_blocks(blocks("resize_step=40", ""))
    # Darknet would train on these: hues off the colour circle, NaN pixels (numpy's warnings).
    assert DarknetLoaderSettings.from_blocks(blocks("hue=-1", "")).hue == -1
    with pytest.raises(ConfigError, match=r"x.cfg:4: \[net\]: hue=5(.0)? must be in \[-1, 1\]"):
        DarknetLoaderSettings.from_blocks(blocks("hue=5", ""))
    with pytest.raises(ConfigError, match=r"x.cfg:4: \[net\]: exposure=1e\+39 is beyond float32"):
        DarknetLoaderSettings.from_blocks(blocks("exposure=1e39", ""))


def test_mixup_blends_half_the_iterations(make_shapes_data):
    from build_utils.darknet_data import DarknetDetections, DarknetKey
    from build_utils.datasets import LoadImagesAndLabels

    s = _settings(mixup=True, jitter=0.1)
    batches = DarknetBatches(8, s, mini_batch=2, subdivisions=1, max_batches=100, seed=3)
    batches.set_range(1, 100)
    mixed = [all(k.mix >= 0 for k in b) for b in batches]
    assert all(any(k.mix >= 0 for k in b) == m for b, m in zip(batches, mixed))
    assert 35 <= sum(mixed) <= 65  # half the iterations
    plain = DarknetBatches(8, _settings(), 2, 1, 100, seed=3)
    plain.set_range(1, 100)
    assert all(k.mix == -1 for b in plain for k in b)

    data = make_shapes_data(n_train=4, n_val=1, img_size_range=(96, 96))
    images = LoadImagesAndLabels(data.parent / "train.txt", 96, 2)
    ds = DarknetDetections(images, s)
    key = DarknetKey(0, 0, 1, 128, 96, 3, 0, mix=1)
    own, other = ds._sample(key), ds._sample(key._replace(index=1), second=True)
    img, labels, *_ = ds[key]
    expected = np.rint((own[0] * 0.5 + other[0] * 0.5) * 255).astype(np.uint8)
    np.testing.assert_array_equal(img.permute(1, 2, 0).numpy(), expected)
    # blend_truth: the second image's truths first, then the first's.
    truths = np.concatenate((other[1], own[1]))
    np.testing.assert_array_equal(labels[:, 2:].numpy(), truths[:, :4])
    np.testing.assert_array_equal(labels[:, 1].numpy(), truths[:, 4])
