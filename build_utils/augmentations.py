"""Geometric and photometric augmentations as pure functions on (image, boxes).

Conventions:

- images are ``(H, W, 3) uint8`` in OpenCV's BGR order;
- boxes are ``(n, 5)`` float arrays ``class, x1, y1, x2, y2`` in absolute pixels of the image they
  belong to, with *continuous* coordinates: pixel ``i`` covers ``[i, i + 1)``, so a box around
  columns 10..19 is ``x1 = 10, x2 = 20`` and an image of width ``W`` spans ``[0, W]``;
- randomness comes from a ``np.random.Generator`` passed in; nothing reads global state.

Geometry is exact under that convention: pixels and boxes go through the same maps, so a box
stays on its object under letterbox, mosaic, random affine and flips (the property test in
``tests/build_utils/test_augmentations.py`` checks it).

How the mosaic is made fast (the data pipeline must keep up with one GPU): ultralytics/yolov3 pasted
four resized images into a ``2s x 2s`` canvas and warped the whole canvas to ``s x s``. Here the
tiles are resized straight into the part of the *output* they cover whenever the random affine
is axis-aligned (no rotation, no shear: ultralytics/yolov3's default hyperparameters), so every
output pixel is written once by one ``cv2.resize`` of a crop and no canvas or warp is needed. With
rotation or shear, only the part of the canvas that the output can see is built, then warped
once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

PAD_VALUE = 114  # grey of the letterbox padding and of empty mosaic areas (ultralytics/yolov3)
PAD_COLOR = (PAD_VALUE, PAD_VALUE, PAD_VALUE)
# The network's largest stride: input sides, letterbox shapes (auto) and rect batch shapes are
# multiples of it. The one definition in the project; import it from here.
GRID = 32

# A box that an augmentation leaves smaller than this many pixels on a side, with less than this
# fraction of its area still visible, or thinner than this aspect ratio is dropped: such slivers
# are no longer recognisable objects (YOLOv5's thresholds; ultralytics/yolov3 used 4 px / 0.2 / 10).
BOX_MIN_SIDE_PX = 2.0
BOX_MIN_AREA_RATIO = 0.1
BOX_MAX_ASPECT = 20.0

_EPS = 1e-9


@dataclass(frozen=True)
class AffineParams:
    """Ranges of the random affine, as in ``cfg/hyp.yaml``.

    ``degrees``: rotation drawn from ``[-degrees, degrees]``; ``translate``: shift as a fraction
    of the output side, from ``[-translate, translate]``; ``scale``: zoom from
    ``[1 - scale, 1 + scale]``; ``shear``: shear angle in degrees from ``[-shear, shear]``.
    """

    degrees: float = 0.0
    translate: float = 0.0
    scale: float = 0.0
    shear: float = 0.0


@dataclass(frozen=True)
class LetterboxGeometry:
    """Where an image of size ``(h0, w0)`` lands in its letterboxed canvas.

    ``new_unpad = (w, h)`` is the resized image size, ``pad = (left, top)`` its integer offset in
    the canvas of ``shape = (H, W)``, ``ratio = (w / w0, h / h0)`` the actual scale per axis.
    """

    ratio: tuple[float, float]
    new_unpad: tuple[int, int]
    pad: tuple[int, int]
    shape: tuple[int, int]


@dataclass
class Tile:
    """One source image placed on a canvas.

    ``img``: ``(h, w, 3) uint8`` source pixels. ``boxes``: ``(n, 5)`` class + xyxy in source
    pixels. ``extent``: ``(x1, y1, x2, y2)`` where the whole source lands on the canvas (canvas
    pixels, continuous, may reach outside the canvas); the source is scaled to fill it.
    """

    img: np.ndarray
    boxes: np.ndarray
    extent: tuple[float, float, float, float]


# ---------------------------------------------------------------------------------------------
# Letterbox


def letterbox_geometry(
    shape0: tuple[int, int],
    new_shape: int | tuple[int, int] = 416,
    auto: bool = False,
    scale_up: bool = True,
    max_ratio: float | None = None,
) -> LetterboxGeometry:
    """Compute the letterbox placement of an image of size ``shape0 = (h0, w0)``.

    Args:
        new_shape: target ``(H, W)`` or one side for a square.
        auto: pad only up to the next multiple of :data:`GRID` instead of the full
            ``new_shape`` (minimum rectangle, for inference).
        scale_up: allow enlarging; when False images are only shrunk (better mAP at test time).
        max_ratio: an upper bound on the scale (the dataset caps it so that the long side is at
            most ``img_size`` even when a rect batch shape has room for more).
    """
    h0, w0 = shape0
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    H, W = int(new_shape[0]), int(new_shape[1])
    r = min(H / h0, W / w0)
    if not scale_up:
        r = min(r, 1.0)
    if max_ratio is not None:
        r = min(r, max_ratio)
    w, h = max(1, round(w0 * r)), max(1, round(h0 * r))
    dw, dh = W - w, H - h
    if auto:
        dw, dh = dw % GRID, dh % GRID
    # Same split as ultralytics/yolov3: the odd pixel of padding goes right/bottom.
    left, top = round(dw / 2 - 0.1), round(dh / 2 - 0.1)
    return LetterboxGeometry((w / w0, h / h0), (w, h), (left, top), (h + dh, w + dw))


def filled(hw: tuple[int, int], color: tuple[int, int, int]) -> np.ndarray:
    """A new ``(h, w, 3) uint8`` image of one colour (for grey a plain memset, which numpy's
    broadcast of a 3-tuple is far slower than)."""
    if color[0] == color[1] == color[2]:
        return np.full((*hw, 3), color[0], np.uint8)
    out = np.empty((*hw, 3), np.uint8)
    out[:, :, 0], out[:, :, 1], out[:, :, 2] = color
    return out


def resize_into(src: np.ndarray, dst: np.ndarray, interpolation: int | None = None) -> None:
    """Resize ``src`` to the size of ``dst`` (a view into a larger image) writing in place.

    The default interpolation is area averaging when shrinking both sides, bilinear otherwise.
    """
    h, w = dst.shape[:2]
    if interpolation is None:
        shrink = w < src.shape[1] and h < src.shape[0]
        interpolation = cv2.INTER_AREA if shrink else cv2.INTER_LINEAR
    if (h, w) == src.shape[:2]:
        dst[...] = src
        return
    out = cv2.resize(src, (w, h), dst=dst, interpolation=interpolation)
    if out is not dst:  # OpenCV reallocates when it cannot write into the view
        dst[...] = out


def letterbox(
    img: np.ndarray,
    new_shape: int | tuple[int, int] = 416,
    auto: bool = False,
    scale_up: bool = True,
) -> tuple[np.ndarray, tuple[float, float], tuple[int, int]]:
    """Resize keeping the aspect ratio and pad with grey (see :func:`letterbox_geometry`).

    Args:
        img: ``(h0, w0, 3) uint8``.

    Returns:
        ``(img (H, W, 3), ratio (w / w0, h / h0), pad (left, top))``: a point ``(x, y)`` of the
        original (continuous pixels) lands at ``(x * ratio[0] + left, y * ratio[1] + top)``.
    """
    g = letterbox_geometry(img.shape[:2], new_shape, auto, scale_up)
    out = filled((g.shape[0], g.shape[1]), PAD_COLOR)
    (w, h), (left, top) = g.new_unpad, g.pad
    resize_into(img, out[top : top + h, left : left + w])
    return out, g.ratio, g.pad


# ---------------------------------------------------------------------------------------------
# Random affine and mosaic layout


def random_affine_matrix(
    rng: np.random.Generator,
    center: tuple[float, float],
    out_size: tuple[int, int],
    params: AffineParams,
) -> np.ndarray:
    """A random ``(3, 3)`` affine from canvas pixels to output pixels (continuous coordinates).

    The canvas point ``center`` goes to the middle of the output ``(W, H) = out_size`` after
    rotation and scaling about it, shear, then a random translation (x by a fraction of W, y of
    H; ultralytics/yolov3 swapped the two). Always draws the same number of random values.
    """
    W, H = out_size
    a = rng.uniform(-params.degrees, params.degrees)
    s = rng.uniform(1 - params.scale, 1 + params.scale)
    shx = math.tan(math.radians(rng.uniform(-params.shear, params.shear)))
    shy = math.tan(math.radians(rng.uniform(-params.shear, params.shear)))
    tx = rng.uniform(-params.translate, params.translate) * W
    ty = rng.uniform(-params.translate, params.translate) * H
    C = np.eye(3)
    C[:2, 2] = -center[0], -center[1]
    R = np.eye(3)
    R[:2] = cv2.getRotationMatrix2D((0.0, 0.0), a, s)
    S = np.eye(3)
    S[0, 1], S[1, 0] = shx, shy
    T = np.eye(3)
    T[:2, 2] = W / 2 + tx, H / 2 + ty
    return T @ S @ R @ C


def mosaic_layout(
    sizes: Sequence[tuple[int, int]], size: int, rng: np.random.Generator
) -> list[tuple[float, float, float, float]]:
    """Extents of four images ``sizes = [(w, h), ...]`` on a ``2 size x 2 size`` mosaic canvas.

    Each image is scaled so that its long side is ``size`` and placed around a random centre
    ``(xc, yc)`` in ``[size / 2, 3 size / 2]``: top-left, top-right, bottom-left, bottom-right.
    Returns ``(x1, y1, x2, y2)`` per image in canvas pixels; parts beyond the canvas are cut by
    :func:`compose`.
    """
    if len(sizes) != 4:
        raise ValueError(f"a mosaic needs 4 images, got {len(sizes)}")
    xc = float(int(rng.uniform(size * 0.5, size * 1.5)))
    yc = float(int(rng.uniform(size * 0.5, size * 1.5)))
    extents = []
    for k, (w0, h0) in enumerate(sizes):
        r = size / max(w0, h0)
        tw, th = w0 * r, h0 * r
        x1 = xc - tw if k in (0, 2) else xc
        y1 = yc - th if k in (0, 1) else yc
        extents.append((x1, y1, x1 + tw, y1 + th))
    return extents


def decode_zoom(M: np.ndarray) -> float:
    """Output pixels per canvas pixel a tile's source is needed at under the ``(3, 3)`` affine
    ``M``: its largest linear zoom when tiles are resized straight into the output
    (:func:`is_axis_aligned`), else 1 (the canvas is drawn at its own scale, then warped)."""
    return float(np.linalg.norm(M[:2, :2], ord=2)) if is_axis_aligned(M) else 1.0


def is_axis_aligned(M: np.ndarray) -> bool:
    """Whether ``M`` only scales and translates (then tiles are resized straight into the
    output; see the module docstring)."""
    return M[0, 1] == 0 and M[1, 0] == 0 and M[0, 0] > 0 and M[1, 1] > 0


# ---------------------------------------------------------------------------------------------
# Rendering


@dataclass(frozen=True)
class _TilePlan:
    """Where a tile's source crop goes: ``src[sy1:sy2, sx1:sx2]`` is resized to
    ``target[dy1:dy2, dx1:dx2]``, which maps source to target as ``x * ax + bx``,
    ``y * ay + by`` (continuous pixels)."""

    src: tuple[int, int, int, int]  # sx1, sy1, sx2, sy2
    dst: tuple[int, int, int, int]  # dx1, dy1, dx2, dy2
    maps: tuple[float, float, float, float]  # ax, bx, ay, by

    @property
    def src_pixels(self) -> int:
        return (self.src[2] - self.src[0]) * (self.src[3] - self.src[1])


def _plan_tile(
    target_hw: tuple[int, int],
    src_hw: tuple[int, int],
    rect: tuple[float, float, float, float],
    extent: tuple[float, float, float, float],
    view: np.ndarray,
) -> _TilePlan | None:
    """Plan the resize of the part of a source that covers the canvas rectangle ``rect``.

    ``view`` is an axis-aligned ``(3, 3)`` map from canvas to target pixels. Target pixels whose
    centres fall inside ``view(rect)`` are written. The source crop is rounded to whole pixels,
    so the map actually used differs slightly from the ideal one (by under a source pixel over
    the crop); the plan records the actual map so that boxes follow the pixels exactly.
    Returns None when nothing of the tile lands in the target.
    """
    th, tw = target_hw
    h, w = src_hw
    sx, sy, tx, ty = view[0, 0], view[1, 1], view[0, 2], view[1, 2]
    out = []
    for lo, hi, s, t, limit, e1, e2, n in (
        (rect[0], rect[2], sx, tx, tw, extent[0], extent[2], w),
        (rect[1], rect[3], sy, ty, th, extent[1], extent[3], h),
    ):
        a_ideal = (e2 - e1) / n * s  # target pixels per source pixel
        b_ideal = e1 * s + t
        d1 = min(max(math.ceil(lo * s + t - 0.5), 0), limit)
        d2 = min(max(math.ceil(hi * s + t - 0.5), 0), limit)
        if d2 <= d1:
            return None
        s1 = min(max(round((d1 - b_ideal) / a_ideal), 0), n - 1)
        s2 = min(max(round((d2 - b_ideal) / a_ideal), s1 + 1), n)
        a = (d2 - d1) / (s2 - s1)
        out.append((s1, s2, d1, d2, a, d1 - s1 * a))
    (sx1, sx2, dx1, dx2, ax, bx), (sy1, sy2, dy1, dy2, ay, by) = out
    return _TilePlan((sx1, sy1, sx2, sy2), (dx1, dy1, dx2, dy2), (ax, bx, ay, by))


def _clip_boxes(b: np.ndarray, x1: float, y1: float, x2: float, y2: float) -> np.ndarray:
    """Clip ``(n, 4)`` xyxy boxes to a rectangle (in place) and return them."""
    np.clip(b[:, 0::2], x1, x2, out=b[:, 0::2])
    np.clip(b[:, 1::2], y1, y2, out=b[:, 1::2])
    return b


def _area(b: np.ndarray) -> np.ndarray:
    return np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)


def _warp_boxes_clipped(b: np.ndarray, M: np.ndarray, W: float, H: float) -> np.ndarray:
    """Bounding boxes of ``M(box) ∩ [0, W] x [0, H]`` for ``(n, 4)`` xyxy boxes.

    Clipping the transformed parallelogram (not its bounding box) to the output keeps a box
    from covering a corner of the output that the rotated object never reaches. The extreme
    points of the intersection are among the parallelogram's corners inside the output, the
    output's corners inside the parallelogram and the crossings of the edges with the output
    border; all are computed at once. Empty intersections give zero-size boxes.
    """
    n = len(b)
    if n == 0:
        return np.zeros((0, 4))
    cx, cy = b[:, [0, 2, 2, 0]], b[:, [1, 1, 3, 3]]
    px = M[0, 0] * cx + M[0, 1] * cy + M[0, 2]
    py = M[1, 0] * cx + M[1, 1] * cy + M[1, 2]
    xs, ys, ok = [px], [py], [(px >= 0) & (px <= W) & (py >= 0) & (py <= H)]
    inv = np.linalg.inv(M)
    ox, oy = np.array([0.0, W, W, 0.0]), np.array([0.0, 0.0, H, H])
    ux = inv[0, 0] * ox + inv[0, 1] * oy + inv[0, 2]
    uy = inv[1, 0] * ox + inv[1, 1] * oy + inv[1, 2]
    xs.append(np.broadcast_to(ox, (n, 4)))
    ys.append(np.broadcast_to(oy, (n, 4)))
    ok.append((ux >= b[:, [0]]) & (ux <= b[:, [2]]) & (uy >= b[:, [1]]) & (uy <= b[:, [3]]))
    dx, dy = np.roll(px, -1, axis=1) - px, np.roll(py, -1, axis=1) - py
    with np.errstate(divide="ignore", invalid="ignore"):
        for c in (0.0, W):  # crossings of the vertical output borders
            t = (c - px) / dx
            y = py + t * dy
            xs.append(np.full_like(px, c))
            ys.append(y)
            ok.append((dx != 0) & (t >= 0) & (t <= 1) & (y >= 0) & (y <= H))
        for c in (0.0, H):  # horizontal borders
            t = (c - py) / dy
            x = px + t * dx
            xs.append(x)
            ys.append(np.full_like(py, c))
            ok.append((dy != 0) & (t >= 0) & (t <= 1) & (x >= 0) & (x <= W))
    X, Y, V = np.concatenate(xs, 1), np.concatenate(ys, 1), np.concatenate(ok, 1)
    out = np.stack(
        [
            np.where(V, X, np.inf).min(1),
            np.where(V, Y, np.inf).min(1),
            np.where(V, X, -np.inf).max(1),
            np.where(V, Y, -np.inf).max(1),
        ],
        axis=1,
    )
    out[~V.any(1)] = 0.0
    return out


def _to_pixel_centre_matrix(M: np.ndarray) -> np.ndarray:
    """Turn a continuous-coordinate affine (pixel ``i`` spans ``[i, i + 1)``) into the
    ``(2, 3)`` matrix ``cv2.warpAffine`` expects (pixel ``i`` *is* point ``i``)."""
    A = M[:2, :2]
    b = M[:2, 2]
    out = np.empty((2, 3))
    out[:, :2] = A
    out[:, 2] = A @ np.array([0.5, 0.5]) + b - 0.5
    return out


def compose(
    tiles: Sequence[Tile],
    canvas_size: tuple[int, int],
    M: np.ndarray,
    out_size: tuple[int, int],
    color: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place tiles on a canvas and map the canvas to the output with the affine ``M``.

    Args:
        tiles: sources with their extents on the canvas; each is cut to the canvas.
        canvas_size: ``(Wc, Hc)`` of the (virtual) canvas, e.g. ``(2 s, 2 s)`` for a mosaic.
        M: ``(3, 3)`` canvas-to-output affine (continuous pixel coordinates).
        out_size: ``(W, H)`` of the output.
        color: a per-pixel colour transform (``(h, w, 3) uint8 -> same``, e.g. an HSV lookup
            table). It is applied to the source crops before resizing when they hold fewer
            pixels than the output (cheaper; the padding colour is transformed alike), else to
            the output.

    Returns:
        ``(img (H, W, 3) uint8, boxes (n, 5) class + xyxy output pixels clipped to the output,
        area0 (n,))`` where ``area0`` is each box's visible area on the canvas mapped to output
        scale but not cut by the output border (for :func:`box_candidates`).
    """
    out_w, out_h = out_size
    rects = [_visible_rect(t.extent, canvas_size) for t in tiles]
    target_hw, view, warp = _render_frame(M, rects, canvas_size, out_size)
    drawable = target_hw[0] > 0 and target_hw[1] > 0
    plans = [
        _plan_tile(target_hw, t.img.shape[:2], r, t.extent, view)
        if _nonempty(r) and drawable
        else None
        for t, r in zip(tiles, rects)
    ]
    # The colour transform runs where it touches fewer pixels: the source crops or the output.
    on_crops = color is not None and sum(p.src_pixels for p in plans if p) < out_w * out_h
    fill = _transformed_pad(color) if on_crops else PAD_COLOR
    target = filled(target_hw, fill)

    det = abs(float(np.linalg.det(M[:2, :2])))
    all_boxes, all_area0 = [], []
    for t, rect, plan in zip(tiles, rects, plans):
        if plan is None:
            continue
        _paste(t.img, plan, target, color if on_crops else None)
        if len(t.boxes) == 0:
            continue
        boxes, area0 = _tile_boxes(t, rect, plan, det, warp, out_size)
        all_boxes.append(boxes)
        all_area0.append(area0)

    out = _warp_target(target, warp, out_size, fill)
    if color is not None and not on_crops:
        out = color(out)
    if not all_boxes:
        return out, np.zeros((0, 5)), np.zeros(0)
    return out, np.concatenate(all_boxes), np.concatenate(all_area0)


def _visible_rect(
    extent: tuple[float, float, float, float], canvas_size: tuple[int, int]
) -> tuple[float, float, float, float]:
    """The part ``(x1, y1, x2, y2)`` of a tile's extent that lies on the canvas ``(Wc, Hc)``;
    empty (``x2 <= x1`` or ``y2 <= y1``) when none does."""
    cw, ch = canvas_size
    return (max(extent[0], 0.0), max(extent[1], 0.0), min(extent[2], cw), min(extent[3], ch))


def _nonempty(rect: tuple[float, float, float, float]) -> bool:
    return rect[2] > rect[0] and rect[3] > rect[1]


def _render_frame(
    M: np.ndarray,
    rects: Sequence[tuple[float, float, float, float]],
    canvas_size: tuple[int, int],
    out_size: tuple[int, int],
) -> tuple[tuple[int, int], np.ndarray, np.ndarray | None]:
    """Where the tiles are drawn: ``(target_hw, view, warp)``.

    With an axis-aligned ``M`` the target is the output itself: ``view = M`` maps canvas to
    output pixels and there is no ``warp``. Otherwise the target is the part of the canvas
    that the output can see (plus one pixel for interpolation) and tiles actually cover:
    ``view`` shifts canvas pixels into it and ``warp`` (``(3, 3)``) maps it to the output.
    """
    out_w, out_h = out_size
    if is_axis_aligned(M):
        return (out_h, out_w), M, None
    cw, ch = canvas_size
    used = [r for r in rects if _nonempty(r)]
    corners = np.array([[0, 0, 1], [out_w, 0, 1], [0, out_h, 1], [out_w, out_h, 1]], float)
    inv = corners @ np.linalg.inv(M).T
    x0 = x1 = y0 = y1 = 0
    if used:
        x0 = max(math.floor(inv[:, 0].min()) - 1, 0, math.floor(min(r[0] for r in used)))
        y0 = max(math.floor(inv[:, 1].min()) - 1, 0, math.floor(min(r[1] for r in used)))
        x1 = min(math.ceil(inv[:, 0].max()) + 1, cw, math.ceil(max(r[2] for r in used)))
        y1 = min(math.ceil(inv[:, 1].max()) + 1, ch, math.ceil(max(r[3] for r in used)))
    view = np.eye(3)
    view[:2, 2] = -x0, -y0
    return (max(y1 - y0, 0), max(x1 - x0, 0)), view, M @ np.linalg.inv(view)


def _transformed_pad(color: Callable[[np.ndarray], np.ndarray]) -> tuple[int, int, int]:
    """The padding grey after the colour transform (the fill of a target whose tiles are
    transformed before they are drawn)."""
    b, g, r = (int(v) for v in color(np.full((1, 1, 3), PAD_VALUE, np.uint8))[0, 0])
    return b, g, r


def _paste(
    img: np.ndarray,
    plan: _TilePlan,
    target: np.ndarray,
    color: Callable[[np.ndarray], np.ndarray] | None,
) -> None:
    """Resize the planned crop of ``img`` (colour-transformed first when ``color`` is given)
    into its place in ``target``."""
    sx1, sy1, sx2, sy2 = plan.src
    dx1, dy1, dx2, dy2 = plan.dst
    crop = img[sy1:sy2, sx1:sx2]
    resize_into(
        color(crop) if color is not None else crop, target[dy1:dy2, dx1:dx2], cv2.INTER_LINEAR
    )


def _tile_boxes(
    tile: Tile,
    rect: tuple[float, float, float, float],
    plan: _TilePlan,
    det: float,
    warp: np.ndarray | None,
    out_size: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """A tile's boxes in output pixels, following its pixels (``plan``, then ``warp``).

    Returns ``(boxes (m, 5) class + xyxy output pixels, area0 (m,))`` for the boxes that show
    in the tile's visible part ``rect``; ``area0`` is the visible area on the canvas scaled by
    ``det`` (the canvas-to-output area factor), not cut by the output border.
    """
    dx1, dy1, dx2, dy2 = plan.dst
    ax, bx, ay, by = plan.maps
    src = tile.boxes[:, 1:5].astype(np.float64)
    h, w = tile.img.shape[:2]
    # Visible area before the output border cuts it: box on the canvas cut to the tile's
    # visible rectangle, scaled to output pixels.
    kx, ky = (tile.extent[2] - tile.extent[0]) / w, (tile.extent[3] - tile.extent[1]) / h
    on_canvas = src * [kx, ky, kx, ky] + [tile.extent[0], tile.extent[1]] * 2
    area0 = _area(_clip_boxes(on_canvas, *rect)) * det
    b = _clip_boxes(src * [ax, ay, ax, ay] + [bx, by, bx, by], dx1, dy1, dx2, dy2)
    # Boxes entirely outside the tile's visible part collapse to lines here; drop them
    # before a rotation could turn such a line into a box with an area.
    seen = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
    b, area0 = b[seen], area0[seen]
    if warp is not None:
        b = _warp_boxes_clipped(b, warp, *out_size)
    return np.concatenate([tile.boxes[seen, :1], b], axis=1), area0


def _warp_target(
    target: np.ndarray,
    warp: np.ndarray | None,
    out_size: tuple[int, int],
    fill: tuple[int, int, int],
) -> np.ndarray:
    """The output image: ``target`` itself without ``warp``, else ``target`` warped to
    ``out_size = (W, H)`` with ``fill`` where no canvas pixel lands."""
    if warp is None:
        return target
    out_w, out_h = out_size
    if not target.size:  # the output sees no tile
        return filled((out_h, out_w), fill)
    return cv2.warpAffine(
        target,
        _to_pixel_centre_matrix(warp),
        (out_w, out_h),
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=fill,
    )


def box_candidates(boxes: np.ndarray, area0: np.ndarray) -> np.ndarray:
    """Mask ``(n,) bool`` of boxes worth keeping after an augmentation.

    Args:
        boxes: ``(n, 4)`` xyxy output pixels after the augmentation.
        area0: ``(n,)`` area each box would have in output pixels had nothing been cut off.
    """
    w = boxes[:, 2] - boxes[:, 0]
    h = boxes[:, 3] - boxes[:, 1]
    aspect = np.maximum(w / (h + _EPS), h / (w + _EPS))
    return (
        (area0 > 0)
        & (w > BOX_MIN_SIDE_PX)
        & (h > BOX_MIN_SIDE_PX)
        & (w * h > BOX_MIN_AREA_RATIO * area0 - _EPS)
        & (aspect < BOX_MAX_ASPECT)
    )


# ---------------------------------------------------------------------------------------------
# Flips and colour


def flip_lr(img: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mirror left-right. ``boxes``: ``(n, 5)`` class + xyxy pixels; returns new arrays."""
    w = img.shape[1]
    b = boxes.copy()
    b[:, 1], b[:, 3] = w - boxes[:, 3], w - boxes[:, 1]
    return cv2.flip(img, 1), b


def flip_ud(img: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mirror top-bottom. ``boxes``: ``(n, 5)`` class + xyxy pixels; returns new arrays."""
    h = img.shape[0]
    b = boxes.copy()
    b[:, 2], b[:, 4] = h - boxes[:, 4], h - boxes[:, 2]
    return cv2.flip(img, 0), b


def hsv_lut(
    hgain: float, sgain: float, vgain: float, rng: np.random.Generator
) -> np.ndarray | None:
    """Random hue, saturation and value gains as a ``(256, 1, 3) uint8`` lookup table on HSV
    pixels, or None when all gains are 0 (three random numbers are drawn either way).

    Each channel is multiplied by a factor drawn from ``[1 - gain, 1 + gain]`` (ultralytics/yolov3's
    definition: hue is scaled and wraps around OpenCV's 0..179 range; saturation and value are
    clipped to 255).
    """
    r = rng.uniform(-1, 1, 3) * (hgain, sgain, vgain) + 1
    if hgain == 0 and sgain == 0 and vgain == 0:
        return None
    x = np.arange(256, dtype=np.float64)
    lut = np.empty((256, 1, 3), np.uint8)
    lut[:, 0, 0] = (x * r[0]).astype(np.int64) % 180
    lut[:, 0, 1] = np.clip(x * r[1], 0, 255).astype(np.uint8)
    lut[:, 0, 2] = np.clip(x * r[2], 0, 255).astype(np.uint8)
    return lut


def apply_hsv_lut(img: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Apply :func:`hsv_lut`'s table to a BGR ``(h, w, 3) uint8`` image; returns a new image.
    Lookup tables on uint8 only, no float image."""
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    hsv = cv2.LUT(hsv, lut, dst=hsv)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR, dst=hsv)
