"""Darknet's detection loader as a dataset: what ``train_detector`` feeds its network each
iteration (AlexeyAB/darknet ``src/detector.c``, and ``load_data_detection`` of ``src/data.c`` in
the build without OpenCV), for ``train.py --recipe darknet``.

Per iteration Darknet draws ``batch`` images at random from the training list (with
replacement, not in epochs), and for each image draws a crop (``jitter``, ``resize``,
``letter_box``; :mod:`build_utils.darknet_augment`), a left-right flip (``flip``) and a colour
change (``hue``, ``saturation``, ``exposure``: ``distort_image`` in HSV); the crop is resized to
the network's size with Darknet's own bilinear ``resize_image`` and the labels follow
(``fill_truth_detection``). With ``random`` in the last ``[yolo]`` layer, the network's size is
drawn again every 10 iterations (:func:`network_size`).

The random streams are ours (numpy, seeded per run, rank, iteration and image, so that a batch
is a pure function of its key whatever DataLoader worker builds it, and ``--resume`` replays
it); the distributions and the geometry are Darknet's. Pixels are kept as uint8 (Darknet keeps
floats): the network sees them within half a grey level.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from build_utils.augmentations import GRID
from build_utils.darknet_augment import CropDraws, DarknetCrop, crop_truths, f32, jitter_crop
from build_utils.datasets import SEED_MASK, ImageUnreadable, LoadImagesAndLabels, SubstitutePath
from build_utils.errors import DatasetError
from build_utils.parse_config import DEFAULT_MAX_BOXES, Block, c_float, layer_error, yolo_classes

# train_detector's multi-scale rule (``random`` of the last [yolo] layer): a new size every
# RANDOM_PERIOD iterations, the largest one at the start and for the last RANDOM_LAST ones;
# random=1 means a factor of RANDOM_DEFAULT_COEF.
RANDOM_PERIOD = 10
RANDOM_LAST = 100
RANDOM_DEFAULT_COEF = 1.4
DEFAULT_RESIZE_STEP = 32
# Distinct first words of the seeds of the loader's streams, so that none repeats another.
_STREAM_IMAGES, _STREAM_SAMPLE, _STREAM_SIZE = 1, 2, 3
GREY_LEVELS = 255


@dataclass(frozen=True)
class DarknetLoaderSettings:
    """The cfg keys Darknet's detection loader reads, with its defaults (``parse_net_options``,
    ``parse_yolo``): ``[net]`` ``width height flip letter_box hue saturation exposure
    resize_step``, and ``jitter resize random classes max`` of the *last* ``[yolo]`` layer, the
    one ``train_detector`` passes to the loader."""

    width: int
    height: int
    classes: int
    max_boxes: int = DEFAULT_MAX_BOXES
    jitter: float = 0.2
    resize: float = 1.0
    random: float = 0.0
    letter_box: bool = False
    flip: bool = True
    hue: float = 0.0
    saturation: float = 1.0
    exposure: float = 1.0
    resize_step: int = DEFAULT_RESIZE_STEP
    mixup: bool = False

    @classmethod
    def from_blocks(cls, blocks: Sequence[Block]) -> DarknetLoaderSettings:
        """The settings of a parsed cfg (``[net]`` first).

        Raises:
            ConfigError: naming the key's line: a ``jitter`` whose crop could be empty (Darknet
                would crash), a ``resize`` or colour factor that is not positive or beyond
                float32, a ``hue`` outside [-1, 1], a ``resize_step`` or size that is not a
                multiple of 32 (the model's largest stride).
        """
        net = blocks[0]
        yolo = [b for b in blocks if b["type"] == "yolo"][-1]
        jitter = float(yolo.get("jitter", cls.jitter))
        if not 0 <= jitter < 0.5:
            raise layer_error(yolo, f"jitter={jitter} must be in [0, 0.5)", "jitter")
        resize = float(yolo.get("resize", cls.resize))
        if resize <= 0:
            raise layer_error(yolo, f"resize={resize} must be above 0", "resize")
        # load_thread: a saturation or exposure of 0 means 1.
        colour = {key: c_float(net, key, 1.0) or 1.0 for key in ("saturation", "exposure")}
        for key, value in colour.items():
            if value < 0:
                raise layer_error(net, f"{key}={net[key]} must be at least 0", key)
        hue = float(net.get("hue", cls.hue))
        if not -1 <= hue <= 1:
            # Darknet wraps a shifted hue once: beyond 1 the hues leave the colour circle.
            raise layer_error(
                net, f"hue={net['hue']} must be in [-1, 1] (a shift of the hue)", "hue"
            )
        step = int(net.get("resize_step", DEFAULT_RESIZE_STEP))
        if step < GRID or step % GRID:
            raise layer_error(net, f"resize_step={step} must be a multiple of 32", "resize_step")
        for key in ("width", "height"):
            if int(net.get(key, 0)) % GRID or int(net.get(key, 0)) < GRID:
                raise layer_error(net, f"{key}={net.get(key)} must be a multiple of 32", key)
        return cls(
            width=int(net["width"]),
            height=int(net["height"]),
            classes=yolo_classes(yolo),
            max_boxes=int(yolo.get("max", DEFAULT_MAX_BOXES)),
            jitter=jitter,
            resize=resize,
            random=float(yolo.get("random", cls.random)),
            letter_box=bool(net.get("letter_box", cls.letter_box)),
            flip=bool(net.get("flip", cls.flip)),
            hue=hue,
            **colour,
            resize_step=step,
            # Darknet's net->mixup is 1 only for mixup=1 without cutmix and mosaic (those make
            # it 2-4: other augmentations, of the OpenCV build).
            mixup=int(net.get("mixup", 0)) == 1
            and not int(net.get("mosaic", 0))
            and not int(net.get("cutmix", 0)),
        )

    @property
    def largest_size(self) -> tuple[int, int]:
        """(width, height) of the largest network size ``random`` trains at."""
        if not self.random:
            return self.width, self.height
        coef = _random_coef(self.random)
        return self._side(coef, self.width), self._side(coef, self.height)

    def _side(self, factor: float, side: int) -> int:
        """``train_detector``'s ``roundl(factor * side / resize_step + 1) * resize_step``, at
        least one step."""
        return max(
            self.resize_step,
            _round_half_away(factor * side / self.resize_step + 1) * self.resize_step,
        )


def _round_half_away(x: float) -> int:
    """C's ``roundl``."""
    return math.floor(abs(x) + 0.5) * (1 if x >= 0 else -1)


def _random_coef(random: float) -> float:
    return RANDOM_DEFAULT_COEF if random == 1.0 else random


def rand_scale(rng: np.random.Generator, s: float) -> float:
    """Darknet's ``rand_scale(s)``: uniform between 1 and ``s``, then that or its inverse with
    equal odds; in C's float arithmetic (``s`` is a float there, and so is ``max - min``)."""
    lo, hi = sorted((f32(1.0), f32(s)))
    scale = float(f32(rng.random()) * (hi - lo) + lo)
    return scale if rng.integers(2) else float(f32(1) / f32(scale))


def network_size(
    settings: DarknetLoaderSettings, seed: int, iteration: int, max_batches: int
) -> tuple[int, int]:
    """(width, height) the network trains at in ``iteration`` (from 1): the cfg's, or with
    ``random`` the size ``train_detector`` draws for each block of :data:`RANDOM_PERIOD`
    iterations, the largest for the first block and once fewer than :data:`RANDOM_LAST`
    iterations are left.

    Darknet resizes at the first iteration of each process (``count % 10``); here the blocks
    count from iteration 1, so that a resumed run trains at the sizes of an uninterrupted one.
    The draw is the same on every rank (its stream is seeded by the block alone).
    """
    s = settings
    if not s.random:
        return s.width, s.height
    start = iteration - (iteration - 1) % RANDOM_PERIOD
    if start == 1 or start - 1 > max_batches - RANDOM_LAST:
        return s.largest_size
    rng = np.random.default_rng([_STREAM_SIZE, seed & SEED_MASK, start])
    factor = rand_scale(rng, _random_coef(s.random))
    w, h = s._side(factor, s.width), s._side(factor, s.height)
    if factor < 1 and (w > s.width or h > s.height):
        w, h = s.width, s.height
    return w, h


# ---- one image -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageDraws:
    """Darknet's draws for one image: the crop's, the flip, the hue shift and the saturation and
    exposure factors."""

    crop: CropDraws
    flip: bool = False
    dhue: float = 0.0
    dsat: float = 1.0
    dexp: float = 1.0


def draw_image(rng: np.random.Generator, s: DarknetLoaderSettings) -> ImageDraws:
    """The draws of ``load_data_detection`` for one image, in Darknet's order (every number is
    drawn whatever the settings, so the stream does not depend on them)."""
    resize_r1, resize_r2, r1, r2, r3, r4 = (float(f32(v)) for v in rng.random(6))
    flip = bool(rng.integers(2)) and s.flip
    rng.random()  # r_scale, which the detection loader draws and never uses
    dhue = float(f32(rng.random()) * f32(2 * s.hue) - f32(s.hue))
    dsat, dexp = rand_scale(rng, s.saturation), rand_scale(rng, s.exposure)
    return ImageDraws(CropDraws(r1, r2, r3, r4, resize_r1, resize_r2), flip, dhue, dsat, dexp)


def shuffle_boxes(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Darknet's ``randomize_boxes``: swap box ``i`` with a random one, for each ``i`` in
    order (not a uniform shuffle; its order decides which boxes ``max`` keeps)."""
    out = np.array(labels, copy=True)
    for i, j in enumerate(rng.integers(0, max(len(out), 1), len(out))):
        out[[i, j]] = out[[j, i]]
    return out


def _axis(start: int, span: int, n_out: int, n_src: int, zoom: float):
    """Source pixels and weights along one axis of Darknet's ``resize_image`` of a crop of
    ``span`` pixels from ``start`` (``crop_image`` repeats the edge pixels outside the image) to
    ``n_out``: output ``c`` reads crop position ``c * (span - 1) / (n_out - 1)``. ``zoom`` is
    the source image's size over the original's (1: the original pixels)."""
    scale = f32(span - 1) / f32(n_out - 1) if n_out > 1 else f32(0)
    pos = np.arange(n_out, dtype=f32) * scale
    if zoom == 1:
        whole = pos.astype(np.int64)  # C's (int): pos >= 0
        frac = pos - whole.astype(f32)
        whole += start
    else:
        x = (pos + f32(start) + f32(0.5)) * f32(zoom) - f32(0.5)
        whole = np.floor(x).astype(np.int64)
        frac = (x - whole).astype(f32)
    lo, hi = np.clip(whole, 0, n_src - 1), np.clip(whole + 1, 0, n_src - 1)
    return lo, hi, frac.astype(f32)


def crop_resize(img: np.ndarray, crop: DarknetCrop, net_w: int, net_h: int) -> np.ndarray:
    """Darknet's ``resize_image(crop_image(img, ...), net_w, net_h)``.

    Args:
        img: (h, w, 3) float32 RGB in [0, 1], the original image or a resized copy of it.
        crop: the crop of the original ``crop.ow`` x ``crop.oh`` image.

    Returns:
        (net_h, net_w, 3) float32.
    """
    zx, zy = img.shape[1] / crop.ow, img.shape[0] / crop.oh
    x0, x1, dx = _axis(crop.pleft, crop.swidth, net_w, img.shape[1], zx)
    if zx == 1:  # resize_image takes the crop's last column itself for the last one
        x0[-1] = x1[-1] = np.clip(crop.pleft + crop.swidth - 1, 0, img.shape[1] - 1)
        dx[-1] = 0
    y0, y1, dy = _axis(crop.ptop, crop.sheight, net_h, img.shape[0], zy)
    part_lo = img[y0][:, x0] * (1 - dx)[None, :, None] + img[y0][:, x1] * dx[None, :, None]
    part_hi = img[y1][:, x0] * (1 - dx)[None, :, None] + img[y1][:, x1] * dx[None, :, None]
    dy = dy[:, None, None]
    out = part_lo * (1 - dy) + part_hi * dy
    if zy == 1:  # resize_image adds no second row to its last one
        out[-1] = part_lo[-1] * (1 - dy[-1])
    return out.astype(f32)


def rgb_to_hsv(img: np.ndarray) -> np.ndarray:
    """Darknet's ``rgb_to_hsv`` (hue in [0, 1)) of (h, w, 3) float32 RGB."""
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    mx, mn = img.max(-1), img.min(-1)
    delta = mx - mn
    safe = np.where(delta > 0, delta, f32(1))
    h = np.where(r == mx, (g - b) / safe, np.where(g == mx, 2 + (b - r) / safe, 4 + (r - g) / safe))
    h = np.where(h < 0, h + 6, h) / f32(6)
    s = np.where(mx > 0, delta / np.where(mx > 0, mx, f32(1)), f32(0))
    # Darknet's hue of a grey pixel is 0/0; any value serves, as saturation 0 ignores it.
    h = np.where((mx > 0) & (delta > 0), h, f32(0))
    return np.stack((h, s, mx), -1).astype(f32)


def hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """Darknet's ``hsv_to_rgb``."""
    h, s, v = f32(6) * hsv[..., 0], hsv[..., 1], hsv[..., 2]
    index = np.floor(h)
    f = h - index
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    choices = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v)]
    rgb = [
        np.select([index == k for k in range(5)], [c[ch] for c in choices], default=d)
        for ch, d in enumerate((v, p, q))
    ]
    out = np.stack(rgb, -1)
    grey = (s == 0)[..., None]
    return np.where(grey, v[..., None], out).astype(f32)


def distort(img: np.ndarray, dhue: float, dsat: float, dexp: float) -> np.ndarray:
    """Darknet's ``distort_image``: saturation and value scaled, hue shifted (wrapped), then
    clipped to [0, 1]."""
    hsv = rgb_to_hsv(img)
    hsv[..., 1] *= f32(dsat)
    hsv[..., 2] *= f32(dexp)
    hue = hsv[..., 0] + f32(dhue)
    hue = np.where(hue > 1, hue - 1, hue)
    hsv[..., 0] = np.where(hue < 0, hue + 1, hue)
    return np.clip(hsv_to_rgb(hsv), 0, 1)


def darknet_pixels(
    img: np.ndarray, crop: DarknetCrop, net_w: int, net_h: int, draws: ImageDraws
) -> np.ndarray:
    """The network input Darknet makes of ``img`` ((h, w, 3) float32 RGB in [0, 1]): crop,
    resize, flip, colour. Returns (net_h, net_w, 3) float32 in [0, 1]."""
    out = crop_resize(img, crop, net_w, net_h)
    if draws.flip:
        out = out[:, ::-1]
    return distort(out, draws.dhue, draws.dsat, draws.dexp)


def darknet_sample(
    img_bgr: np.ndarray,
    size: tuple[int, int],
    labels: np.ndarray,
    net_size: tuple[int, int],
    settings: DarknetLoaderSettings,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """One training image as Darknet's loader makes it.

    Args:
        img_bgr: (h, w, 3) uint8 BGR, the image or a resized copy of it.
        size: (width, height) of the original image, which the crop is drawn for.
        labels: (n, 5) class, cx, cy, w, h normalized to the image.
        net_size: (width, height) of the network input.

    Returns:
        ``(img, truths)``: (net_h, net_w, 3) float32 RGB in [0, 1], and (k, 5) float32 x, y, w,
        h, class (:func:`~build_utils.darknet_augment.crop_truths`).
    """
    net_w, net_h = net_size
    draws = draw_image(rng, settings)
    crop = jitter_crop(
        *size, net_w, net_h, settings.jitter, settings.resize, settings.letter_box, draws.crop
    )
    rgb = img_bgr[..., ::-1].astype(f32) / f32(GREY_LEVELS)
    pixels = darknet_pixels(rgb, crop, net_w, net_h, draws)
    boxes = shuffle_boxes(labels, rng)
    truths = crop_truths(
        boxes, crop, draws.flip, net_w, net_h, settings.classes, settings.max_boxes
    )
    return pixels, truths


def blend(
    first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray], max_boxes: int
) -> tuple[np.ndarray, np.ndarray]:
    """``mixup=1``: the two samples' pixels half and half (``blend_images``), the second's
    truths first and the first's after them, ``max_boxes`` at most (``blend_truth``)."""
    pixels = second[0] * f32(0.5) + first[0] * f32(0.5)
    return pixels, np.concatenate((second[1], first[1]))[:max_boxes]


# ---- the dataset and its batches ----------------------------------------------------------------


class DarknetKey(NamedTuple):
    """What one training sample is a pure function of: the image ``index``, its ``slot`` among
    the iteration's images, the ``iteration``, the network ``width`` and ``height``, the run's
    ``seed`` and the process's ``rank``; ``mix`` the image ``mixup`` blends it with (-1:
    none)."""

    index: int
    slot: int
    iteration: int
    width: int
    height: int
    seed: int
    rank: int
    mix: int = -1


class DarknetDetections(Dataset):
    """Training samples as Darknet's loader makes them, from the images and checked labels of a
    :class:`~build_utils.datasets.LoadImagesAndLabels` (its caches included).

    Indexed by :class:`DarknetKey`; a sample is ``(img (3, h, w) uint8 RGB, labels (k, 6) =
    (0, class, x, y, w, h) normalized, path, None, index)`` as the project's collate function
    takes them. An image found unreadable mid-run is replaced by the next readable one (its
    ``path`` a :class:`~build_utils.datasets.SubstitutePath` naming it).
    """

    def __init__(self, images: LoadImagesAndLabels, settings: DarknetLoaderSettings):
        self.images = images
        self.settings = settings
        self.labels = images.labels  # per image (n, 5) class, cx, cy, w, h (labels.png)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: DarknetKey) -> tuple[torch.Tensor, torch.Tensor, str, Any, int]:
        key = DarknetKey(*key)
        unreadable: list[str] = []
        for step in range(len(self)):
            i = (key.index + step) % len(self)
            try:
                pixels, truths = self._sample(key._replace(index=i))
                if key.mix >= 0:
                    second = self._sample(key._replace(index=key.mix), second=True)
                    pixels, truths = blend((pixels, truths), second, self.settings.max_boxes)
            except ImageUnreadable as e:
                unreadable.append(str(e.path))
                continue
            img = np.rint(pixels * GREY_LEVELS).astype(np.uint8)
            labels = torch.zeros((len(truths), 6), dtype=torch.float32)
            if len(truths):
                labels[:, 1] = torch.from_numpy(truths[:, 4])
                labels[:, 2:] = torch.from_numpy(truths[:, :4])
            path = self.images.img_files[i]
            if unreadable:
                path = SubstitutePath(path, unreadable)
            return (
                torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))),
                labels,
                path,
                None,
                i,
            )
        raise DatasetError(
            f"none of the {len(self)} training images can be read any more (the dataset was "
            "checked at start-up; were its files deleted or moved?)"
        )

    def _sample(self, key: DarknetKey, second: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Image ``key.index`` as :func:`darknet_sample` makes it; ``second``: the image
        ``mixup`` blends in, with draws of its own (Darknet draws them again)."""
        rng = np.random.default_rng(
            [_STREAM_SAMPLE, key.seed & SEED_MASK, key.rank, key.iteration, key.slot, int(second)]
        )
        ow, oh = (int(v) for v in self.images.shapes[key.index])
        # The resolution the smallest crop needs: JPEGs may then be decoded at 1/2, 1/4, 1/8.
        st = self.settings
        zoom = max(st.resize, 1 / st.resize) / (1 - 2 * st.jitter)
        scale = min(1.0, max(key.width / ow, key.height / oh) * zoom)
        img = self.images.load_image(key.index, scale)
        labels = self.images.labels[key.index]
        return darknet_sample(img, (ow, oh), labels, (key.width, key.height), self.settings, rng)


class DarknetBatches(Sampler[list[DarknetKey]]):
    """One rank's mini-batches of iterations ``first .. last`` (:meth:`set_range`), in order:
    per iteration ``subdivisions`` lists of ``mini_batch`` keys.

    As ``get_random_paths`` does, each iteration's ``mini_batch * subdivisions`` images are
    drawn at random with replacement from the whole list (with ``mixup``, in half the
    iterations, as many partners); the draws and the network size are functions of (seed,
    rank, iteration) alone, so any range replays an uninterrupted run.
    """

    def __init__(
        self,
        n_images: int,
        settings: DarknetLoaderSettings,
        mini_batch: int,
        subdivisions: int,
        max_batches: int,
        seed: int,
        rank: int = 0,
    ):
        if n_images < 1:
            raise DatasetError("no training images to draw from")
        self.n_images, self.settings = n_images, settings
        self.mini_batch, self.subdivisions = mini_batch, subdivisions
        self.max_batches, self.seed, self.rank = max_batches, seed, rank
        self.first, self.last = 1, 0

    def set_range(self, first: int, last: int) -> None:
        """Iterations ``first .. last`` (from 1, inclusive) next time."""
        self.first, self.last = first, last

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1) * self.subdivisions

    def __iter__(self) -> Iterator[list[DarknetKey]]:
        per_iteration = self.mini_batch * self.subdivisions
        for k in range(self.first, self.last + 1):
            w, h = network_size(self.settings, self.seed, k, self.max_batches)
            rng = np.random.default_rng([_STREAM_IMAGES, self.seed & SEED_MASK, self.rank, k])
            chosen = rng.integers(0, self.n_images, per_iteration)
            # mixup=1: every image of half the iterations is blended with another random one.
            mixed = rng.integers(2) == 1 and self.settings.mixup
            partners = rng.integers(0, self.n_images, per_iteration)
            keys = [
                DarknetKey(int(i), slot, k, w, h, self.seed, self.rank, int(m) if mixed else -1)
                for slot, (i, m) in enumerate(zip(chosen, partners))
            ]
            for s in range(self.subdivisions):
                yield keys[s * self.mini_batch : (s + 1) * self.mini_batch]
