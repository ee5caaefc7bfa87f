"""The crop geometry of Darknet's detection loader (AlexeyAB/darknet ``src/data.c``,
``load_data_detection`` without OpenCV, and ``fill_truth_detection``), as pure functions of the
random draws, so that a loader can crop as Darknet does with its own random stream.

Darknet crops each image by four offsets drawn within ``jitter`` of its size (negative: the crop
reaches outside the image, which is filled), optionally grown or shrunk by ``resize`` and
extended to the network's aspect ratio by ``letter_box``; the crop is then resized to the
network input (flipped left-right when ``flip`` drew 1), and the boxes follow. Values are
computed in float32 and truncated to int where Darknet's C does, so the crop and the boxes equal
Darknet's for the same draws (tests/build_utils/test_darknet_augment.py runs Darknet's loader).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

f32 = np.float32
# fill_truth_detection marks a box it drops (a centre at 0,0, or outside the image) with this.
_DROPPED = f32(999999)


@dataclass(frozen=True)
class CropDraws:
    """Darknet's uniform draws in [0, 1] for one image: ``r1..r4`` for the left, right, top
    and bottom offsets, ``resize_r1`` (left and top) and ``resize_r2`` (right and bottom)."""

    r1: float
    r2: float
    r3: float
    r4: float
    resize_r1: float = 0.5
    resize_r2: float = 0.5


@dataclass(frozen=True)
class DarknetCrop:
    """Pixels cut from each side of an ``ow`` x ``oh`` image (negative: added). Darknet's
    ``crop_image(orig, pleft, ptop, swidth, sheight)`` then fills pixels outside the image."""

    ow: int
    oh: int
    pleft: int
    pright: int
    ptop: int
    pbot: int

    @property
    def swidth(self) -> int:
        return self.ow - self.pleft - self.pright

    @property
    def sheight(self) -> int:
        return self.oh - self.ptop - self.pbot

    @property
    def sx(self) -> np.float32:
        """Crop width over image width."""
        return f32(self.swidth) / f32(self.ow)

    @property
    def sy(self) -> np.float32:
        return f32(self.sheight) / f32(self.oh)

    @property
    def dx(self) -> np.float32:
        """Left offset in crop widths."""
        return (f32(self.pleft) / f32(self.ow)) / self.sx

    @property
    def dy(self) -> np.float32:
        return (f32(self.ptop) / f32(self.oh)) / self.sy


def _precalc(lo: float, hi: float, r: float) -> np.float32:
    """Darknet's ``rand_precalc_random(min, max, random_part)``."""
    lo, hi = f32(lo), f32(hi)
    if hi < lo:
        lo, hi = hi, lo
    return f32(r) * (hi - lo) + lo


def _c_int(value: np.float32) -> int:
    """C's float-to-int conversion (truncation toward zero)."""
    return int(np.trunc(value))


def jitter_crop(
    ow: int,
    oh: int,
    net_w: int,
    net_h: int,
    jitter: float,
    resize: float,
    letter_box: bool,
    draws: CropDraws,
) -> DarknetCrop:
    """The crop Darknet cuts from an ``ow`` x ``oh`` image for network input ``net_w`` x
    ``net_h`` with ``[yolo]`` ``jitter`` and ``resize``, ``[net]`` ``letter_box``.

    Each side moves by up to ``jitter`` of the image's size, in or out; ``resize > 1`` adds a
    common zoom in ``[1 - resize, 1 - 1/resize] / 2`` of the size per side (``resize < 1``:
    zoom out only); ``letter_box`` then extends the shorter side to the network's aspect ratio.
    """
    jitter, resize = f32(jitter), f32(resize)
    dw = _c_int(f32(ow) * jitter)
    dh = _c_int(f32(oh) * jitter)
    resize_down = resize if resize <= 1 else f32(1) / resize
    resize_up = resize if resize >= 1 else f32(1) / resize
    min_rdw = _c_int(f32(ow) * (f32(1) - f32(1) / resize_down) / f32(2))
    min_rdh = _c_int(f32(oh) * (f32(1) - f32(1) / resize_down) / f32(2))
    max_rdw = _c_int(f32(ow) * (f32(1) - f32(1) / resize_up) / f32(2))
    max_rdh = _c_int(f32(oh) * (f32(1) - f32(1) / resize_up) / f32(2))

    pleft = _c_int(_precalc(-dw, dw, draws.r1))
    pright = _c_int(_precalc(-dw, dw, draws.r2))
    ptop = _c_int(_precalc(-dh, dh, draws.r3))
    pbot = _c_int(_precalc(-dh, dh, draws.r4))
    hi_w, hi_h = (0, 0) if resize < 1 else (max_rdw, max_rdh)
    # C's `p += float`: the sum is truncated, not the float.
    pleft = _c_int(f32(pleft) + _precalc(min_rdw, hi_w, draws.resize_r1))
    pright = _c_int(f32(pright) + _precalc(min_rdw, hi_w, draws.resize_r2))
    ptop = _c_int(f32(ptop) + _precalc(min_rdh, hi_h, draws.resize_r1))
    pbot = _c_int(f32(pbot) + _precalc(min_rdh, hi_h, draws.resize_r2))

    if letter_box:
        net_ar = f32(net_w) / f32(net_h)
        if (f32(ow) / f32(oh)) / net_ar > 1:  # the image is wider: grow its height
            delta_h = (f32(ow) / net_ar - f32(oh)) / f32(2)
            ptop, pbot = _c_int(f32(ptop) - delta_h), _c_int(f32(pbot) - delta_h)
        else:
            delta_w = (f32(oh) * net_ar - f32(ow)) / f32(2)
            pleft, pright = _c_int(f32(pleft) - delta_w), _c_int(f32(pright) - delta_w)
    return DarknetCrop(ow, oh, pleft, pright, ptop, pbot)


def crop_truths(
    labels: np.ndarray,
    crop: DarknetCrop,
    flip: bool,
    net_w: int,
    net_h: int,
    classes: int,
    max_boxes: int,
) -> np.ndarray:
    """The truths Darknet trains on after ``crop`` (``fill_truth_detection``): each box moved
    and clipped to the crop, mirrored when ``flip``; dropped when its class is ``>= classes``,
    it is narrower or lower than one input pixel, its centre was exactly (0, 0) or it lies
    outside the image; a side above 1 becomes 1.

    Args:
        labels: (n, 5) class, x, y, w, h (normalized to the original image) in the order
            Darknet reads them (it shuffles them first; only the first ``max_boxes`` are
            read, dropped ones included).

    Returns:
        (k, 5) float32 x, y, w, h, class.
    """
    labels = np.asarray(labels, dtype=np.float32).reshape(-1, 5)[:max_boxes]
    cls = labels[:, 0].astype(np.int64)
    x, y, w, h = (labels[:, k].copy() for k in range(1, 5))
    sx, sy = f32(1.0 / float(crop.sx)), f32(1.0 / float(crop.sy))
    dx, dy = crop.dx, crop.dy
    half = f32(2)
    left, right = x - w / half, x + w / half
    top, bottom = y - h / half, y + h / half
    dropped = ((x == 0) & (y == 0)) | (right < 0) | (bottom < 0) | (left > 1) | (top > 1)
    left, right = left * sx - dx, right * sx - dx
    top, bottom = top * sy - dy, bottom * sy - dy
    if flip:
        left, right = f32(1) - right, f32(1) - left
    left, right, top, bottom = (np.clip(v, f32(0), f32(1)) for v in (left, right, top, bottom))
    x, y = (left + right) / half, (top + bottom) / half
    w, h = np.clip(right - left, f32(0), f32(1)), np.clip(bottom - top, f32(0), f32(1))
    x, y = np.where(dropped, _DROPPED, x), np.where(dropped, _DROPPED, y)
    w, h = np.where(dropped, _DROPPED, w), np.where(dropped, _DROPPED, h)
    lowest_w, lowest_h = f32(1) / f32(net_w), f32(1) / f32(net_h)
    keep = (cls < classes) & (w >= lowest_w) & (h >= lowest_h) & (x != _DROPPED)
    keep &= (x > 0) & (x <= 1) & (y > 0) & (y <= 1)
    out = np.stack((x, y, np.minimum(w, 1), np.minimum(h, 1), cls.astype(np.float32)), 1)
    return out[keep].astype(np.float32)
