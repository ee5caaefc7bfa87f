"""Augmentations keep boxes on their objects: letterbox to the pixel, mosaic/affine/flip by a
property test."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from build_utils.augmentations import (
    PAD_VALUE,
    AffineParams,
    Tile,
    apply_hsv_lut,
    box_candidates,
    compose,
    flip_lr,
    flip_ud,
    hsv_lut,
    is_axis_aligned,
    letterbox,
    letterbox_geometry,
    mosaic_layout,
    random_affine_matrix,
)

# ---------------------------------------------------------------------------------------------
# Coloured-rectangle scenes. Every palette colour has one channel at 255 and the other two on a
# convex arc, so no blend of two palette colours, of a colour with the black background or with
# the grey padding comes within TOL of a third palette colour: a colour found in the output is
# really that object (after a 3x3 erosion, which removes 1-pixel seams).
_ARC = [(x, round((x - 80) ** 2 / 40)) for x in (0, 40, 80, 120, 160)]
PALETTE = [tuple(int(v) for v in np.roll([255, a, b], k)) for k in range(3) for a, b in _ARC]  # BGR
TOL = 8


def colour_mask(img: np.ndarray, k: int, erode: bool = True) -> np.ndarray:
    mask = (np.abs(img.astype(np.int16) - PALETTE[k]).max(axis=2) <= TOL).astype(np.uint8)
    return cv2.erode(mask, np.ones((3, 3), np.uint8)) if erode else mask


def make_scene(rng: np.random.Generator, w: int, h: int, first: int, n: int):
    """Black image with up to ``n`` separated rectangles of colours ``first, first + 1, ...``;
    returns (img, boxes (m, 5) class=colour index + xyxy pixel edges)."""
    img = np.zeros((h, w, 3), np.uint8)
    boxes: list[list[float]] = []
    for k in range(first, first + n):
        for _ in range(20):
            bw, bh = int(rng.integers(10, 41)), int(rng.integers(10, 41))
            if bw >= w - 4 or bh >= h - 4:
                continue
            x1, y1 = int(rng.integers(1, w - bw - 1)), int(rng.integers(1, h - bh - 1))
            if all(
                x1 > b[3] + 3 or x1 + bw < b[1] - 3 or y1 > b[4] + 3 or y1 + bh < b[2] - 3
                for b in boxes
            ):
                img[y1 : y1 + bh, x1 : x1 + bw] = PALETTE[k]
                boxes.append([k, x1, y1, x1 + bw, y1 + bh])
                break
    return img, np.array(boxes, dtype=np.float64).reshape(-1, 5)


def check_consistency(
    img: np.ndarray,
    boxes: np.ndarray,
    expected_area: dict[int, float] | None = None,
    zoom: dict[int, float] | None = None,
) -> None:
    """Every label lies on its colour and its colour lies within it; clearly visible colours
    have a label.

    Args:
        expected_area: colour -> its full (uncut) area in output pixels.
        zoom: colour -> output pixels per source pixel when the transform was axis-aligned;
            then each box must hug its colour to within the resampling blur.
    """
    H, W = img.shape[:2]
    labelled = set()
    for c, x1, y1, x2, y2 in boxes:
        k = int(c)
        assert k not in labelled, "one label per object"
        labelled.add(k)
        assert 0 <= x1 < x2 <= W and 0 <= y1 < y2 <= H
        ys, xs = np.nonzero(colour_mask(img, k, erode=False))
        inside = (xs + 0.5 > x1) & (xs + 0.5 < x2) & (ys + 0.5 > y1) & (ys + 0.5 < y2)
        assert inside.any(), f"label {k} has none of its colour"
        # The colour lies within the box (pixel centres, 1 px for interpolation).
        assert xs.min() + 0.5 >= x1 - 1 and xs.max() + 0.5 <= x2 + 1, f"colour {k} outside x"
        assert ys.min() + 0.5 >= y1 - 1 and ys.max() + 0.5 <= y2 + 1, f"colour {k} outside y"
        if zoom is not None:  # and the box hugs it: edges match up to the resampling blur
            tol = 1.0 + max(1.0, zoom[k])
            assert abs(xs.min() - x1) <= tol and abs(xs.max() + 1 - x2) <= tol, f"{k} loose x"
            assert abs(ys.min() - y1) <= tol and abs(ys.max() + 1 - y2) <= tol, f"{k} loose y"
        elif min(x2 - x1, y2 - y1) >= 12:  # rotated: bounding boxes of thin tilted shapes
            assert len(xs) >= 0.05 * (x2 - x1) * (y2 - y1), f"label {k} is far too large"
    for k, area in (expected_area or {}).items():
        n = int(colour_mask(img, k).sum())
        if n >= 30 and n >= 0.25 * area:
            assert k in labelled, f"colour {k} is clearly visible ({n} px) but unlabelled"


# ---------------------------------------------------------------------------------------------
# Letterbox


@pytest.mark.parametrize(
    ("shape0", "new_shape", "kw", "unpad", "pad", "out"),
    [
        ((100, 200), 416, {}, (416, 208), (0, 104), (416, 416)),
        ((100, 200), 416, {"auto": True}, (416, 208), (0, 8), (224, 416)),
        ((100, 200), 416, {"scale_up": False}, (200, 100), (108, 158), (416, 416)),
        ((300, 300), (416, 512), {"max_ratio": 1.0}, (300, 300), (106, 58), (416, 512)),
        ((101, 51), 64, {}, (32, 64), (16, 0), (64, 64)),
    ],
)
def test_letterbox_geometry(shape0, new_shape, kw, unpad, pad, out):
    g = letterbox_geometry(shape0, new_shape, **kw)
    assert g.new_unpad == unpad
    assert g.pad == pad
    assert g.shape == out
    assert g.ratio == (unpad[0] / shape0[1], unpad[1] / shape0[0])


@pytest.mark.parametrize(
    ("size", "new_shape", "kw"),
    [
        ((90, 160), 256, {}),  # enlarged
        ((300, 500), 256, {}),  # shrunk
        ((300, 500), 256, {"auto": True}),
        ((77, 133), (160, 96), {}),
        ((400, 120), 128, {"scale_up": False}),
    ],
)
def test_letterbox_box_lands_where_the_label_says(size, new_shape, kw):
    h0, w0 = size
    img = np.zeros((h0, w0, 3), np.uint8)
    box = np.array([w0 * 0.3, h0 * 0.2, w0 * 0.7, h0 * 0.9]).round()
    img[int(box[1]) : int(box[3]), int(box[0]) : int(box[2])] = 255
    out, ratio, (left, top) = letterbox(img, new_shape, **kw)
    g = letterbox_geometry((h0, w0), new_shape, **kw)
    assert out.shape[:2] == g.shape
    expected = box * [ratio[0], ratio[1], ratio[0], ratio[1]] + [left, top, left, top]
    # A pixel belongs to the box when it is at least half covered (resampling blurs edges).
    ys, xs = np.nonzero(out[..., 0] >= 128)
    found = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
    np.testing.assert_allclose(found, expected, atol=1.0)  # to the pixel
    # The padding is grey and the image is centred (odd pixel right/bottom).
    assert (out[:top] == PAD_VALUE).all() and (out[:, :left] == PAD_VALUE).all()
    w, h = g.new_unpad
    assert 0 <= g.shape[1] - w - 2 * left <= 1 and 0 <= g.shape[0] - h - 2 * top <= 1


# ---------------------------------------------------------------------------------------------
# Random affine and mosaic geometry


def test_default_hyp_mosaic_is_the_lineage_canvas_crop():
    """degrees = translate = scale = shear = 0 crops the middle of the 2s x 2s canvas exactly."""
    s = 64
    rng = np.random.default_rng(5)
    imgs = [
        rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for w, h in ((64, 40), (30, 64), (64, 64), (50, 64))
    ]
    extents = mosaic_layout(
        [(im.shape[1], im.shape[0]) for im in imgs], s, np.random.default_rng(1)
    )
    canvas = np.full((2 * s, 2 * s, 3), PAD_VALUE, np.uint8)
    for im, (x1, y1, x2, y2) in zip(imgs, extents):  # long side = s: pasted 1:1
        cx1, cy1, cx2, cy2 = (
            int(v) for v in (max(x1, 0), max(y1, 0), min(x2, 2 * s), min(y2, 2 * s))
        )
        canvas[cy1:cy2, cx1:cx2] = im[cy1 - int(y1) : cy2 - int(y1), cx1 - int(x1) : cx2 - int(x1)]
    M = random_affine_matrix(np.random.default_rng(0), (s, s), (s, s), AffineParams())
    np.testing.assert_array_equal(M, [[1, 0, -s / 2], [0, 1, -s / 2], [0, 0, 1]])
    tiles = [Tile(im, np.zeros((0, 5)), e) for im, e in zip(imgs, extents)]
    out, _, _ = compose(tiles, (2 * s, 2 * s), M, (s, s))
    np.testing.assert_array_equal(out, canvas[s // 2 : s // 2 + s, s // 2 : s // 2 + s])


def test_mosaic_layout_tiles_meet_at_the_centre():
    rng = np.random.default_rng(0)
    for _ in range(20):
        e = mosaic_layout([(40, 30), (20, 50), (60, 60), (10, 80)], 64, rng)
        xc, yc = e[0][2], e[0][3]
        assert 32 <= xc <= 96 and 32 <= yc <= 96
        assert e[1][0] == xc and e[1][3] == yc  # top-right
        assert e[2][2] == xc and e[2][1] == yc  # bottom-left (the predecessor's off-by-one)
        assert e[3][0] == xc and e[3][1] == yc
        for x1, y1, x2, y2 in e:
            assert max(x2 - x1, y2 - y1) == pytest.approx(64)


def test_random_affine_translation_uses_width_for_x():
    rng = np.random.default_rng(0)
    W, H = 400, 100
    ms = [
        random_affine_matrix(rng, (0, 0), (W, H), AffineParams(translate=0.5)) for _ in range(300)
    ]
    tx = np.array([m[0, 2] for m in ms]) - W / 2
    ty = np.array([m[1, 2] for m in ms]) - H / 2
    assert np.abs(tx).max() > 0.4 * W and np.abs(tx).max() <= 0.5 * W
    assert np.abs(ty).max() <= 0.5 * H  # the lineage swapped them: |ty| up to 0.5 * W


def test_box_filter_compares_areas_with_the_square_of_the_scale():
    """A box shrunk by half in each side keeps 100% of its (scaled) area and is kept."""
    img = np.zeros((100, 100, 3), np.uint8)
    boxes = np.array([[0, 10, 10, 50, 50]], float)
    M = np.diag([0.5, 0.5, 1.0])
    _, b, area0 = compose([Tile(img, boxes, (0, 0, 100, 100))], (100, 100), M, (100, 100))
    np.testing.assert_allclose(b[0, 1:], [5, 5, 25, 25])
    assert area0[0] == pytest.approx(400)
    assert box_candidates(b[:, 1:], area0).all()


def test_box_candidates_thresholds():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 2, 10], [0, 0, 10, 10], [0, 0, 100, 4]], float)
    area0 = np.array([100, 20, 1001, 400])
    np.testing.assert_array_equal(box_candidates(boxes, area0), [True, False, False, False])


def test_axis_aligned_detection():
    assert is_axis_aligned(np.diag([1.2, 0.8, 1.0]))
    M = random_affine_matrix(np.random.default_rng(0), (0, 0), (10, 10), AffineParams(degrees=5))
    assert not is_axis_aligned(M)


def test_compose_with_nothing_visible_is_all_padding():
    img = np.full((20, 20, 3), 200, np.uint8)
    M = np.eye(3)
    M[:2, 2] = 500, 0  # everything lands far right of the output
    out, b, _ = compose(
        [Tile(img, np.array([[0, 1, 1, 5, 5.0]]), (0, 0, 20, 20))], (20, 20), M, (32, 32)
    )
    assert (out == PAD_VALUE).all()
    assert box_candidates(b[:, 1:], np.full(len(b), 16.0)).sum() == 0
    R = random_affine_matrix(np.random.default_rng(0), (10, 10), (32, 32), AffineParams(degrees=30))
    R[:2, 2] += 1000
    out, b, _ = compose([Tile(img, np.zeros((0, 5)), (0, 0, 20, 20))], (20, 20), R, (32, 32))
    assert (out == PAD_VALUE).all() and len(b) == 0


# ---------------------------------------------------------------------------------------------
# Property test: boxes stay on their objects under mosaic, random affine and flips

affine_params = st.builds(
    AffineParams,
    degrees=st.one_of(st.just(0.0), st.floats(0, 30)),
    translate=st.one_of(st.just(0.0), st.floats(0, 0.25)),
    scale=st.one_of(st.just(0.0), st.floats(0, 0.5)),
    shear=st.one_of(st.just(0.0), st.floats(0, 5)),
)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    sizes=st.lists(st.tuples(st.integers(48, 200), st.integers(48, 200)), min_size=4, max_size=4),
    size=st.sampled_from([64, 96, 160]),
    params=affine_params,
    lr=st.booleans(),
    ud=st.booleans(),
)
def test_mosaic_affine_flip_keep_boxes_on_objects(seed, sizes, size, params, lr, ud):
    rng = np.random.default_rng(seed)
    imgs, boxes = [], []
    for k, (w, h) in enumerate(sizes):
        img, b = make_scene(rng, w, h, first=3 * k, n=3)
        imgs.append(img)
        boxes.append(b)
    extents = mosaic_layout([(w, h) for w, h in sizes], size, rng)
    M = random_affine_matrix(rng, (size, size), (size, size), params)
    out, b, area0 = compose(
        [Tile(i, bb, e) for i, bb, e in zip(imgs, boxes, extents)],
        (2 * size, 2 * size),
        M,
        (size, size),
    )
    b = b[box_candidates(b[:, 1:], area0)]
    if lr:
        out, b = flip_lr(out, b)
    if ud:
        out, b = flip_ud(out, b)
    det = abs(np.linalg.det(M[:2, :2]))
    expected, zoom = {}, {}
    for (w, h), bb in zip(sizes, boxes):
        r = size / max(w, h)
        for c, x1, y1, x2, y2 in bb:
            expected[int(c)] = (x2 - x1) * (y2 - y1) * r * r * det
            zoom[int(c)] = r * max(M[0, 0], M[1, 1])
    check_consistency(out, b, expected, zoom if is_axis_aligned(M) else None)


def mosaic(scenes, size, rng, params):
    """Four-image mosaic and random affine as LoadImagesAndLabels._load_mosaic builds it."""
    extents = mosaic_layout([(im.shape[1], im.shape[0]) for im, _ in scenes], size, rng)
    M = random_affine_matrix(rng, (size, size), (size, size), params)
    tiles = [Tile(im, b, e) for (im, b), e in zip(scenes, extents)]
    img, out, area0 = compose(tiles, (2 * size, 2 * size), M, (size, size))
    return img, out[box_candidates(out[:, 1:5], area0)]


def test_mosaic_with_and_without_affine_keeps_boxes_on_objects():
    rng = np.random.default_rng(3)
    scenes = [make_scene(rng, 90, 70, 3 * k, 3) for k in range(4)]
    p = AffineParams(degrees=10, translate=0.1, scale=0.3, shear=2)
    out, b = mosaic(scenes, 96, np.random.default_rng(9), AffineParams())
    out2, b2 = mosaic(scenes, 96, np.random.default_rng(9), p)
    assert out.shape == out2.shape == (96, 96, 3)
    check_consistency(out, b)
    check_consistency(out2, b2)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    w=st.integers(40, 160),
    h=st.integers(40, 160),
    params=affine_params,
)
def test_random_affine_keeps_boxes_on_objects(seed, w, h, params):
    rng = np.random.default_rng(seed)
    img, boxes = make_scene(rng, w, h, 0, 4)
    # As LoadImagesAndLabels._load_augmented: one tile covering the canvas, warped by M.
    M = random_affine_matrix(np.random.default_rng(seed), (w / 2, h / 2), (w, h), params)
    out, b, area0 = compose([Tile(img, boxes, (0.0, 0.0, float(w), float(h)))], (w, h), M, (w, h))
    b = b[box_candidates(b[:, 1:5], area0)]
    assert out.shape == img.shape
    zoom = {k: max(M[0, 0], M[1, 1]) for k in range(4)} if is_axis_aligned(M) else None
    check_consistency(out, b, zoom=zoom)


def test_flips_move_pixels_and_boxes_together():
    rng = np.random.default_rng(0)
    img, boxes = make_scene(rng, 70, 50, 0, 3)
    for flip in (flip_lr, flip_ud):
        out, b = flip(img, boxes)
        check_consistency(out, b, zoom=dict.fromkeys(range(3), 1.0))
        back, b2 = flip(out, b)
        np.testing.assert_array_equal(back, img)
        np.testing.assert_allclose(b2, boxes)


# ---------------------------------------------------------------------------------------------
# HSV


def test_hsv_zero_gains_change_nothing_and_draw_three_numbers():
    rng = np.random.default_rng(1)
    # None: LoadImagesAndLabels applies no colour transform at all.
    assert hsv_lut(0, 0, 0, rng) is None
    ref = np.random.default_rng(1)
    ref.uniform(-1, 1, 3)
    assert rng.random() == ref.random()


def test_hsv_lut_gains_match_a_float_reference():
    rng = np.random.default_rng(4)
    lut = hsv_lut(0.0138, 0.678, 0.36, np.random.default_rng(4))
    gains = rng.uniform(-1, 1, 3) * (0.0138, 0.678, 0.36) + 1
    img = np.random.default_rng(2).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV).astype(np.float64)
    ref = np.empty_like(hsv)
    ref[..., 0] = np.floor(hsv[..., 0] * gains[0]) % 180
    ref[..., 1:] = np.clip(np.floor(hsv[..., 1:] * gains[1:]), 0, 255)
    expected = cv2.cvtColor(ref.astype(np.uint8), cv2.COLOR_HSV2BGR)
    np.testing.assert_array_equal(apply_hsv_lut(img, lut), expected)


def test_hsv_keeps_grey_grey():
    grey = np.full((4, 4, 3), PAD_VALUE, np.uint8)
    out = apply_hsv_lut(grey, hsv_lut(0.5, 0.9, 0.3, np.random.default_rng(0)))
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()


def test_colour_transform_on_crops_equals_on_output_for_padding():
    """compose() may apply the colour transform before resizing; the padding gets the same
    colour either way."""
    lut = hsv_lut(0.0, 0.0, 0.3, np.random.default_rng(0))

    def color(x):
        return apply_hsv_lut(x, lut)

    outs = []
    for side in (10, 100):  # 100 source pixels (< output): on crops; 10,000: on the output
        img = np.full((side, side, 3), 200, np.uint8)
        tile = Tile(img, np.zeros((0, 5)), (0, 0, 10, 10))
        outs.append(compose([tile], (40, 40), np.eye(3), (40, 40), color=color)[0])
    np.testing.assert_array_equal(outs[0][20:, 20:], outs[1][20:, 20:])
    assert not (outs[0][20:, 20:] == PAD_VALUE).all()
    np.testing.assert_array_equal(outs[0][:10, :10], outs[1][:10, :10])
