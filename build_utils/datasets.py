"""Detection dataset: images + YOLO labels, loaded, cached and augmented for training and eval.

Which files make up the dataset, where their labels are and how the labels are checked and
cached is :mod:`build_utils.labels`; bad images are excluded and bad label lines dropped there,
and one summary line goes to the log here. Only a dataset with no usable image at all raises
:class:`~build_utils.errors.DatasetError`. An image that becomes unreadable after that (deleted
or damaged mid-run) is replaced by a stand-in sample whose ``path`` names it
(:class:`SubstitutePath`, :func:`unreadable_in`); training goes on. The rect sort is applied
after the labels are loaded, so one label cache serves every order.

Speed (see ``bench/bench_data.py``): mosaics are resized straight into the output
(:mod:`build_utils.augmentations`), HSV jitter runs on uint8 lookup tables over the fewest pixels,
large JPEGs are decoded at 1/2, 1/4 or 1/8 scale when that is all the output needs, recently
decoded images are reused for the three extra mosaic tiles (``mosaic_buffer``), and decoded,
resized images can be cached in RAM or as ``.npy`` files (``cache_images``; the caches
themselves are :mod:`build_utils.image_cache`).

Randomness: a sample asked for by :class:`~build_utils.samplers.SampleKey` (index, epoch, seed),
as the training loader's keyed batch sampler does, draws from a ``np.random.Generator`` seeded
from that key alone, and its mosaic's extra images come from the sample's own batch: the batch is
a pure function of (seed, epoch, indices), whichever DataLoader worker loads it and however many
there are, so persistent workers, any ``--workers`` and exact resume go together. A sample asked
for by a plain index draws from a stream seeded from ``torch.initial_seed()`` of the process
(different for every non-persistent DataLoader worker and epoch, reproducible after
``torch.manual_seed``). No global random state is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from build_utils.augmentations import (
    GRID,
    PAD_COLOR,
    AffineParams,
    LetterboxGeometry,
    Tile,
    apply_hsv_lut,
    box_candidates,
    compose,
    decode_zoom,
    filled,
    flip_lr,
    flip_ud,
    hsv_lut,
    letterbox_geometry,
    mosaic_layout,
    random_affine_matrix,
    resize_into,
)
from build_utils.boxes import xywhn2xyxy, xyxy2xywhn
from build_utils.checks import is_int
from build_utils.errors import ConfigError, DatasetError, YoloError
from build_utils.image_cache import (
    cache_on_disk,
    check_ram_cache_fits,
    fill_ram,
    fill_shared,
    read_npy,
)
from build_utils.image_io import IMG_FORMATS, read_image, reduce_factor
from build_utils.labels import (
    LabelCache,
    cache_place,
    collect_image_files,
    img2label_path,
    load_labels,
)
from build_utils.samplers import SampleKey
from build_utils.shared_images import SharedImages

LOGGER = logging.getLogger(__name__)
ColorFn = Callable[[np.ndarray], np.ndarray]

HYP_AUGMENT_KEYS = (
    "hsv_h",
    "hsv_s",
    "hsv_v",
    "degrees",
    "translate",
    "scale",
    "shear",
    "flipud",
    "fliplr",
)
# Mosaic buffer (see LoadImagesAndLabels): by default this many batches' worth of images per
# process, at least/at most so many images, and a memory cap.
MOSAIC_BUFFER_BATCHES = 8
MOSAIC_BUFFER_MIN, MOSAIC_BUFFER_MAX = 64, 1000
MOSAIC_BUFFER_MAX_BYTES = 512 * 2**20
# A keyed batch of at least this many images (one mosaic's tiles) supplies its own mosaics'
# extra images; smaller batches draw them from the whole dataset.
MOSAIC_POOL_MIN = 4
# SampleKey seeds are reduced to this many bits (numpy's SeedSequence takes non-negative ints).
SEED_MASK = 2**64 - 1


class ImageUnreadable(DatasetError):
    """An image that was checked when the dataset was built can no longer be read or decoded
    (deleted, truncated, permissions changed during the run). ``index`` is the image's
    dataset index (a mosaic's lost tile is another image than the sample being built)."""

    index: int | None = None


class SubstitutePath(str):
    """The ``path`` of a sample that stands in for unreadable images: the path of what was
    loaded, carrying ``unreadable``, the images that could not be. A ``str`` rides through
    DataLoader workers, collation and pinning unchanged (a tuple subclass would not), so the
    record reaches the main process inside the batch's ``paths``."""

    unreadable: tuple[str, ...]

    def __new__(cls, path: str, unreadable: Sequence[str]) -> SubstitutePath:
        obj = super().__new__(cls, path)
        obj.unreadable = tuple(unreadable)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (SubstitutePath, (str(self), self.unreadable))


def unreadable_in(paths: Sequence[str]) -> list[str]:
    """The images a batch's samples could not read (see :class:`SubstitutePath`), in order."""
    return [bad for p in paths for bad in getattr(p, "unreadable", ())]


MAX_LISTED_UNREADABLE = 5  # file names named in an unreadable-images warning


class UnreadableImages:
    """A view of a loader that collects the images its samples could not read (the dataset
    replaced them, :class:`~build_utils.datasets.SubstitutePath`), for the epoch's warning.

    It also turns a project error raised inside a DataLoader worker (which torch re-raises with
    the worker's whole traceback as its message) back into the one line it was.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.paths: list[str] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def take(self) -> list[str]:
        """The unreadable images seen since the last call, each once, in order."""
        paths, self.paths = list(dict.fromkeys(self.paths)), []
        return paths

    def __iter__(self) -> Iterator[Any]:
        try:
            for batch in self.loader:
                self.paths += unreadable_in(batch[2])
                yield batch
        except YoloError as e:
            raise _without_worker_traceback(e) from None


def _without_worker_traceback(e: YoloError) -> YoloError:
    """``e`` as raised in the worker: its message is the last line of the traceback torch
    wraps around it (``build_utils.errors.DatasetError: path: message``)."""
    if "Original Traceback" not in e.message:
        return e
    last = [line for line in e.message.splitlines() if line.strip()][-1]
    name, sep, message = last.partition(": ")
    return type(e)(message if sep and name.endswith(type(e).__name__) else last)


def log_unreadable(epoch: int | None, split: str, paths: Sequence[str], rank: int | None) -> None:
    """One warning for the images of ``split`` (``"train"`` or ``"val"``) that could not be read
    in ``epoch`` (None: outside training), every rank its own (``rank`` None: one process)."""
    if not paths:
        return
    n = len(paths)
    listed = ", ".join(str(p) for p in paths[:MAX_LISTED_UNREADABLE])
    if n > MAX_LISTED_UNREADABLE:
        listed += f" and {n - MAX_LISTED_UNREADABLE} more"
    what = f"{n} {split} image{'s' if n > 1 else ''} could not be read"
    was = "was" if n == 1 else "were"
    if split == "train":
        done = f"and {was} replaced by the next readable sample"
    else:
        done = f"and {was} scored as blank (objects count as missed: the mAP is a lower bound)"
    where = "" if rank is None else f"rank {rank}: "
    when = "" if epoch is None else f"epoch {epoch}: "
    LOGGER.warning("%s%s%s %s: %s", where, when, what, done, listed)


def worker_init_fn(worker_id: int) -> None:
    """``DataLoader(worker_init_fn=...)``: one OpenCV thread per worker process (the workers are
    the parallelism; OpenCV's own pool in each would oversubscribe the cores).

    Ctrl-C and SIGTERM reach a worker too when they are sent to the process group (a terminal,
    ``timeout``, a scheduler): the worker ignores them and the training process, which saves
    and stops, ends its workers. A worker killed by the signal instead made the loader print
    "Exception ignored ... DataLoader worker (pid N) is killed by signal" after the run's
    "interrupted" line. (A worker whose process dies exits on its own: PyTorch's watchdog.)"""
    cv2.setNumThreads(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def rect_batch_shapes(aspect: np.ndarray, batch_size: int) -> np.ndarray:
    """Letterbox shape of each rect batch as ``(h, w)`` fractions of the long side.

    Args:
        aspect: ``(N,)`` h / w of the images in dataset order (sorted ascending for rect);
            batch ``i`` is images ``i * batch_size ... (i + 1) * batch_size - 1``.

    Returns:
        ``(ceil(N / batch_size), 2)``: ``(max h/w, 1)`` for a batch of wide images (all h < w),
        ``(1, 1 / min h/w)`` for one of tall images, ``(1, 1)`` for a mixed one.

    One pass over ``aspect`` (``reduceat`` over the batches' starts): a mask per batch costs
    ``N / batch_size`` passes over all N images, 0.5 s at 100k images and minutes at 1M.
    """
    aspect = np.asanyarray(aspect, dtype=np.float64)
    starts = np.arange(0, len(aspect), batch_size)
    shapes = np.ones((len(starts), 2))
    if not len(aspect):
        return shapes
    lo = np.minimum.reduceat(aspect, starts)
    hi = np.maximum.reduceat(aspect, starts)
    wide, tall = hi < 1, lo > 1
    shapes[wide, 0] = hi[wide]
    shapes[tall, 1] = 1 / lo[tall]
    return shapes


# ---------------------------------------------------------------------------------------------
# Dataset


class LoadImagesAndLabels(Dataset):
    """Images and YOLO labels for training (augmented, mosaic) and evaluation (letterboxed).

    Args:
        path: ``.txt`` list of images (relative paths from the list's folder), a folder of
            images, one image, or a list of these.
        img_size: output side in pixels (mosaic output and square letterbox); the long side of
            rect batches.
        batch_size: images per batch, for the rect batch shapes.
        augment: training augmentation from ``hyp`` (mosaic unless ``rect`` or
            ``hyp["mosaic"]`` is false; random affine, HSV, flips).
        hyp: hyperparameters (``cfg/hyp.yaml`` keys); required when ``augment``.
        rect: rectangular batches: images sorted by aspect ratio (stable sort, the same on every
            rank), one letterbox shape per batch of ``batch_size`` (:attr:`batch_shapes`).
        cache_images: ``False``/``None``, ``True`` or ``"ram"`` (decoded, resized images in
            memory; refused when they would not fit) or ``"disk"`` (``.npy`` files in
            ``<stem>.img<img_size>/`` beside the label cache).
        single_cls: fold every class into class 0.
        rank: DDP rank; progress bars and the summary only on rank -1/0.
        nc: number of classes; label lines with class ids ``>= nc`` are dropped (with None,
            only negative or fractional ids are).
        mosaic_buffer: how many recently decoded images each process keeps for mosaics. Once
            the buffer is full, the three extra images of a mosaic are drawn from it instead of
            from the whole dataset, so a mosaic costs one JPEG decode instead of four (YOLOv8
            does the same; with shuffling the buffer is a random sample of the dataset). None
            picks ``8 * batch_size`` within [64, 1000] (at most 512 MB per process); 0 turns it
            off (ultralytics/yolov3: every mosaic decodes four images). Unused with the RAM cache;
            with the disk cache it saves re-reading ``.npy`` files. Batches of
            :class:`~build_utils.samplers.SampleKey` (the training loader) use their own images
            instead (at least :data:`MOSAIC_POOL_MIN` of them): what a worker decoded for other
            batches must not change a sample, or results would depend on the worker.
        ram_cache_copies: processes on this node that each hold their own RAM cache
            (``cache_images="ram"``), all counted by the memory check; the caller knows how many
            there are (``train_utils.distributed.node.processes_per_node()``).

    Attributes:
        img_files: usable images in dataset order; ``label_files`` their label paths.
        labels: per image ``(n, 5) float32`` class + normalised cxcywh (of the original image).
        shapes: ``(N, 2) int64`` original upright ``(w, h)``.
        batch: ``(N,) int64`` batch index of every image (``i // batch_size``).
        batch_shapes: ``(nb, 2) int64`` ``(h, w)`` per batch when ``rect``, else None.
        content_hash: hash of the images, labels and ``single_cls``/``nc`` (ground truth key).
        cache_path, report_path: the label cache and problem report files, beside the list
            file or folder named by ``path`` (:func:`~build_utils.labels.cache_place`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        img_size: int = 416,
        batch_size: int = 16,
        augment: bool = False,
        hyp: dict[str, Any] | None = None,
        rect: bool = False,
        cache_images: bool | str | None = False,
        single_cls: bool = False,
        rank: int = -1,
        *,
        nc: int | None = None,
        mosaic_buffer: int | None = None,
        ram_cache_copies: int = 1,
    ) -> None:
        _check_sizes(img_size, batch_size, nc, mosaic_buffer, ram_cache_copies)
        mode = _cache_mode(cache_images)
        _check_hyp(augment, hyp)
        self.img_size = img_size
        self.batch_size = batch_size
        self.augment = augment
        self.hyp = dict(hyp) if hyp is not None else {}
        self.rect = rect
        self.mosaic = augment and not rect and bool(self.hyp.get("mosaic", True))
        self.single_cls = single_cls
        self.nc = nc
        self.rank = rank
        self.ram_cache_copies = ram_cache_copies
        self._affine = AffineParams(
            *(float(self.hyp.get(k, 0.0)) for k in ("degrees", "translate", "scale", "shear"))
        )
        is_main = rank in (-1, 0)

        files = collect_image_files(path)
        if not files:
            raise DatasetError(f"no images ({', '.join(IMG_FORMATS)}) found", _describe(path))
        # Beside the list or folder the user named, never derived from an entry (see cache_place).
        place = cache_place(path)
        stem = place.name
        self.cache_path = place.with_name(f"{stem}.cache.npz")
        self.report_path = place.with_name(f"{stem}.cache_report.txt")
        self._load_labels(files, stem, path, is_main)

        self.batch = np.arange(len(self.img_files), dtype=np.int64) // batch_size
        self.batch_shapes: np.ndarray | None = None
        if rect:
            self._sort_for_rect()
        self.content_hash = self._hash_content()

        self._rng_seed: int | None = None
        self._rng_gen = np.random.default_rng(0)
        # Indices the current keyed batch draws its mosaics' extra images from (None: the
        # mosaic buffer or the whole dataset).
        self._pool: list[int] | None = None
        # Indices found unreadable mid-run (see _sample_or_substitute): since the start of the
        # keyed batch, so that a batch stays a pure function of its keys and the files present.
        self._unreadable: set[int] = set()
        self._mosaic_buffer_size = mosaic_buffer
        self._cache_images(mode, place.with_name(f"{stem}.img{img_size}"), is_main)
        self._init_mosaic_buffer()

    # ---- construction steps -------------------------------------------------------------------

    def _load_labels(self, files: list[str], stem: str, source: Any, is_main: bool) -> None:
        """Keep the usable images of ``files`` with their checked labels (from the label cache,
        see :mod:`build_utils.labels`): sets ``img_files``, ``label_files``, ``labels`` and
        ``shapes``. ``source`` is the ``path`` argument, for the error message."""
        label_files = [img2label_path(f) for f in files]
        cache = load_labels(
            files,
            label_files,
            # Under single_cls every class becomes 0: a class id is not checked against the
            # (collapsed) class count, or all objects of classes >= 1 would be dropped.
            None if self.single_cls else self.nc,
            self.cache_path,
            self.report_path,
            progress=is_main,
            desc=f"checking {stem}",
        )
        if is_main:
            self._log_label_summary(stem, cache)
        keep = np.flatnonzero(cache.ok)
        if len(keep) == 0:
            raise DatasetError(
                f"no usable image: {cache.summary()}; see {self.report_path}", _describe(source)
            )
        self.img_files = [files[i] for i in keep]
        self.label_files = [label_files[i] for i in keep]
        self.labels = [cache.labels[i].copy() for i in keep]
        self.shapes = cache.sizes[keep].copy()
        if self.single_cls:
            for lb in self.labels:
                lb[:, 0] = 0
        if is_main and sum(len(lb) for lb in self.labels) == 0:
            LOGGER.warning(
                "%s: no objects in any of %d label files (expected e.g. %s); training "
                "or evaluating on it is pointless",
                stem,
                len(self.img_files),
                self.label_files[0],
            )

    def _log_label_summary(self, stem: str, cache: LabelCache) -> None:
        """One line per dataset: a warning pointing to the report when anything was dropped."""
        problems = cache.stats["corrupt"] + cache.stats["duplicate"] + cache.stats["bad"]
        LOGGER.log(
            logging.WARNING if problems else logging.INFO,
            "%s: %s%s",
            stem,
            cache.summary(),
            f"; details in {self.report_path}" if problems else "",
        )

    def _cache_images(self, mode: str | None, folder: Path, is_main: bool) -> None:
        """Fill the image cache ``mode`` asks for: None, ``"ram"`` or ``"disk"`` (``.npy``
        files in ``folder``)."""
        self._imgs: list[np.ndarray] | SharedImages | None = None
        self._npy_files: list[Path | None] | None = None
        if mode == "ram":
            self.cache_in_ram(is_main)
        elif mode == "disk":
            self._npy_files = cache_on_disk(
                self._decode_for_cache,
                self.img_files,
                self.img_size,
                folder,
                is_main,
                [self._cached_shape(i) for i in range(len(self))],
            )

    def _init_mosaic_buffer(self) -> None:
        """An empty mosaic buffer of ``mosaic_buffer`` images (None: a default from the batch
        size); off without mosaics and with the RAM cache, which holds every image already."""
        size = self._mosaic_buffer_size
        if size is None:
            size = min(
                max(MOSAIC_BUFFER_BATCHES * self.batch_size, MOSAIC_BUFFER_MIN), MOSAIC_BUFFER_MAX
            )
        use_buffer = self.mosaic and self._imgs is None
        self._buffer_cap = min(size, len(self)) if use_buffer else 0
        # index -> (pixels, decoded width / original width); insertion order = age.
        self._buffer: OrderedDict[int, tuple[np.ndarray, float]] = OrderedDict()
        self._buffer_bytes = 0

    # ---- construction helpers -----------------------------------------------------------------

    def _sort_for_rect(self) -> None:
        ar = self.shapes[:, 1] / self.shapes[:, 0]  # h / w
        order = np.argsort(ar, kind="stable")  # stable: every rank gets the same order
        self.img_files = [self.img_files[i] for i in order]
        self.label_files = [self.label_files[i] for i in order]
        self.labels = [self.labels[i] for i in order]
        self.shapes = self.shapes[order]
        shapes = rect_batch_shapes(ar[order], self.batch_size)
        self.batch_shapes = np.ceil(shapes * self.img_size / GRID).astype(np.int64) * GRID

    def _hash_content(self) -> str:
        h = hashlib.sha256(f"single_cls={self.single_cls}|nc={self.nc}\n".encode())
        for f, s, lb in zip(self.img_files, self.shapes, self.labels):
            h.update(os.fsencode(f"{f}|{int(s[0])}x{int(s[1])}\n"))  # bytes of any name
            h.update(np.ascontiguousarray(lb, dtype=np.float32).tobytes())
        return h.hexdigest()

    def _cached_size(self, i: int) -> tuple[int, int]:
        """(w, h) of image ``i`` in the image cache: long side at most img_size, never larger
        than the original (small images are enlarged later, on the fly)."""
        w0, h0 = (int(v) for v in self.shapes[i])
        return letterbox_geometry((h0, w0), self.img_size, scale_up=False).new_unpad

    def _cached_shape(self, i: int) -> tuple[int, int, int]:
        """``(h, w, 3)``: the array shape of image ``i`` in the image cache."""
        w, h = self._cached_size(i)
        return h, w, 3

    def _decode_for_cache(self, i: int) -> np.ndarray:
        w, h = self._cached_size(i)
        img = self._decode(i, w / int(self.shapes[i][0]))
        if img.shape[:2] != (h, w):
            img = cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA)
        return img

    def ram_cache_bytes(self) -> int:
        """Bytes the RAM image cache of this dataset takes (one copy)."""
        return sum(w * h * 3 for w, h in map(self._cached_size, range(len(self))))

    def ram_cache_sizes(self) -> np.ndarray:
        """``(N, 2) int64`` (w, h) of every image in the RAM cache (the shared cache's layout)."""
        return np.array([self._cached_size(i) for i in range(len(self))], dtype=np.int64)

    def fill_shared_ram_cache(
        self, images: SharedImages, share: int, shares: int, is_main: bool = True
    ) -> None:
        """Decode images ``share, share + shares, ...`` into ``images``, this process's part of a
        cache that ``shares`` processes of the node fill together; call
        :meth:`use_ram_cache` once every part is in."""
        if len(images) != len(self):
            raise ValueError(f"a shared cache of {len(images)} images for a dataset of {len(self)}")
        fill_shared(images, self._decode_for_cache, share, shares, is_main)

    def use_ram_cache(self, images: SharedImages | list[np.ndarray]) -> None:
        """Serve every image from ``images`` (all filled) from now on."""
        if len(images) != len(self):
            raise ValueError(f"{len(images)} cached images for a dataset of {len(self)}")
        self._imgs = images
        self._npy_files = None
        self._init_mosaic_buffer()

    def cache_in_ram(self, is_main: bool = True) -> None:
        """Fill the RAM image cache now (refused when it would not fit)."""
        need = self.ram_cache_bytes()
        check_ram_cache_fits(need, len(self), self.ram_cache_copies)
        self._imgs = fill_ram(self._decode_for_cache, len(self), need, is_main)
        self._init_mosaic_buffer()

    # ---- image access -------------------------------------------------------------------------

    def _decode(self, i: int, scale: float) -> np.ndarray:
        """Decode image ``i`` from its file, JPEGs reduced in the decoder when only ``scale``
        (output pixels per original pixel) of the resolution is needed. The file passes the
        same checks as when the dataset was built (:func:`~build_utils.image_io.read_image`:
        a regular file within the byte and pixel limits), so one swapped mid-run for a FIFO or
        a pixel bomb is reported as unreadable, never waited on or decoded."""
        path = self.img_files[i]
        try:
            return read_image(path, reduce_factor(scale))
        except DatasetError as e:
            err = ImageUnreadable(
                f"image became unreadable after the dataset was checked: {e.message}", path
            )
            err.index = i
            raise err from e

    def load_image(self, i: int, scale: float = 1.0) -> np.ndarray:
        """Pixels of image ``i`` as BGR ``(h, w, 3) uint8``: from the image cache if any, else
        decoded (possibly at a reduced size when ``scale`` < 0.5). Boxes must be scaled to the
        returned size, not the original one."""
        if self._imgs is not None:
            return self._imgs[i]
        npy = None if self._npy_files is None else self._npy_files[i]
        if npy is not None:
            img = read_npy(npy, self._cached_shape(i))
            if img is not None:
                return img
        return self._decode(i, scale)

    def _buffered_image(self, i: int, scale: float) -> np.ndarray:
        """:meth:`load_image` through the mosaic buffer (oldest entries evicted first)."""
        hit = self._buffer.get(i)
        if hit is not None and hit[1] >= min(scale, 1.0):  # decoded with enough resolution
            return hit[0]
        img = self.load_image(i, scale)
        if self._buffer_cap:
            if hit is not None:
                self._buffer_bytes -= hit[0].nbytes
            self._buffer[i] = (img, img.shape[1] / int(self.shapes[i][0]))
            self._buffer_bytes += img.nbytes
            while len(self._buffer) > self._buffer_cap or (
                self._buffer_bytes > MOSAIC_BUFFER_MAX_BYTES and len(self._buffer) > 1
            ):
                _, (old, _) = self._buffer.popitem(last=False)
                self._buffer_bytes -= old.nbytes
        return img

    def _boxes_px(self, i: int, w: int, h: int) -> np.ndarray:
        """Labels of image ``i`` as ``(n, 5)`` class + xyxy pixels of an image of size (w, h)."""
        out = self.labels[i].astype(np.float64)
        out[:, 1:] = xywhn2xyxy(out[:, 1:], w, h)  # a new array, read before it is written
        return out

    def _rng(self) -> np.random.Generator:
        # torch seeds every DataLoader worker (and every epoch's workers) differently.
        seed = torch.initial_seed()
        if seed != self._rng_seed:
            self._rng_seed = seed
            self._rng_gen = np.random.default_rng(seed)
            # A new seed starts a new random stream (a new epoch, or a resumed run): the mosaic
            # tiles must depend on that stream alone, not on what an earlier one decoded.
            self._clear_buffer()
        return self._rng_gen

    def _clear_buffer(self) -> None:
        self._buffer.clear()
        self._buffer_bytes = 0

    # ---- samples ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.img_files)

    def _load_mosaic(
        self, index: int, rng: np.random.Generator, color: ColorFn | None
    ) -> tuple[np.ndarray, np.ndarray]:
        s = self.img_size
        pool = self._pool
        if pool is None and self._buffer_cap and len(self._buffer) >= self._buffer_cap:
            pool = list(self._buffer)
        if pool is None and self._unreadable:
            pool = list(range(len(self)))
        if pool is not None and self._unreadable:
            # Images found unreadable are not drawn again as tiles (only then does the stream
            # differ from a run with every file present); with none of the pool left, the
            # dataset's readable images are drawn from.
            pool = [i for i in pool if i not in self._unreadable] or [
                i for i in range(len(self)) if i not in self._unreadable
            ]
        if pool:
            ids = [index] + [pool[k] for k in rng.integers(0, len(pool), 3)]
        else:
            ids = [index] + [int(i) for i in rng.integers(0, len(self), 3)]
        extents = mosaic_layout([(int(w), int(h)) for w, h in self.shapes[ids]], s, rng)
        M = random_affine_matrix(rng, (s, s), (s, s), self._affine)
        zoom = decode_zoom(M)
        tiles = []
        for i, e in zip(ids, extents):
            img = self._buffered_image(i, (e[2] - e[0]) / int(self.shapes[i][0]) * zoom)
            tiles.append(Tile(img, self._boxes_px(i, img.shape[1], img.shape[0]), e))
        img, boxes, area0 = compose(tiles, (2 * s, 2 * s), M, (s, s), color=color)
        return img, boxes[box_candidates(boxes[:, 1:5], area0)]

    def _target_shape(self, index: int) -> tuple[int, int]:
        if self.rect:
            h, w = self.batch_shapes[self.batch[index]]
            return int(h), int(w)
        return self.img_size, self.img_size

    def _load_augmented(
        self, index: int, rng: np.random.Generator, color: ColorFn | None
    ) -> tuple[np.ndarray, np.ndarray, tuple]:
        H, W = self._target_shape(index)
        w0, h0 = (int(v) for v in self.shapes[index])
        r = min(H / h0, W / w0)
        left, top = (W - w0 * r) / 2, (H - h0 * r) / 2
        extent = (left, top, left + w0 * r, top + h0 * r)
        M = random_affine_matrix(rng, (W / 2, H / 2), (W, H), self._affine)
        zoom = decode_zoom(M)
        img = self.load_image(index, r * zoom)
        tile = Tile(img, self._boxes_px(index, img.shape[1], img.shape[0]), extent)
        img, boxes, area0 = compose([tile], (W, H), M, (W, H), color=color)
        shapes = ((h0, w0), ((r, r), (left, top)))
        return img, boxes[box_candidates(boxes[:, 1:5], area0)], shapes

    def _letterbox(self, index: int) -> tuple[LetterboxGeometry, tuple]:
        """Where image ``index`` lands in its evaluation letterbox (long side at most
        ``img_size``), and the sample's ``shapes`` (see :meth:`__getitem__`)."""
        w0, h0 = (int(v) for v in self.shapes[index])
        g = letterbox_geometry(
            (h0, w0), self._target_shape(index), max_ratio=self.img_size / max(h0, w0)
        )
        return g, ((h0, w0), (g.ratio[::-1], g.pad))

    def _load_letterboxed(self, index: int) -> tuple[np.ndarray, np.ndarray, tuple]:
        g, shapes = self._letterbox(index)
        (w, h), (left, top) = g.new_unpad, g.pad
        src = self.load_image(index, min(g.ratio))
        out = filled(g.shape, PAD_COLOR)
        resize_into(src, out[top : top + h, left : left + w])
        boxes = self._boxes_px(index, w, h)
        boxes[:, 1:] += (left, top, left, top)
        return out, boxes, shapes

    def __getitem__(
        self, index: int | SampleKey
    ) -> tuple[torch.Tensor, torch.Tensor, str, Any, int]:
        """One sample; ``index`` a dataset index or a :class:`~build_utils.samplers.SampleKey`
        (its augmentation then a pure function of the key, see the module docstring).

        Returns:
            ``img``: ``(3, H, W) uint8`` RGB tensor; ``labels``: ``(n, 6) float32`` = (0, class,
            cx, cy, w, h) normalised to ``img`` (column 0 is filled by :meth:`collate_fn`);
            ``path``; ``shapes``: ``((h0, w0), ((h / h0, w / w0), (padw, padh)))`` mapping the
            output back to the original image, None for mosaics; ``index``.
        """
        if isinstance(index, SampleKey):
            return self.__getitems__([index])[0]
        return self._sample_or_substitute(index, lambda i: self._rng())

    def __getitems__(self, indices: Sequence[int | SampleKey]) -> list[tuple]:
        """A batch of samples (the DataLoader's fetcher calls this with a batch sampler's batch):
        a batch of :class:`~build_utils.samplers.SampleKey` as a pure function of its keys (see
        the module docstring), plain indices one by one as by ``dataset[i]``."""
        if not indices or not isinstance(indices[0], SampleKey):
            return [self[int(i)] for i in indices]
        keys = [SampleKey(*k) for k in indices]
        use_pool = self._buffer_cap > 0 and len(keys) >= MOSAIC_POOL_MIN
        self._clear_buffer()
        self._unreadable.clear()
        self._pool = [k.index for k in keys] if use_pool else None
        try:
            return [
                self._sample_or_substitute(k.index, lambda i, k=k: _sample_rng(k._replace(index=i)))
                for k in keys
            ]
        finally:
            self._pool = None
            self._clear_buffer()

    def _sample_or_substitute(
        self, index: int, rng_for: Callable[[int], np.random.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor, str, Any, int]:
        """Sample ``index``, or, when an image it needs cannot be read any more, a stand-in, so
        that a file deleted or damaged mid-run does not stop training (the dataset checked every
        image when it was built; see the module docstring).

        Training (``augment``): the next index whose sample loads, with that index's generator
        (``rng_for(i)``), so batch sizes stay and the stand-in is a pure function of which files
        are gone. Evaluation: a blank (padding-colour) image with no boxes at ``index`` itself,
        so no image is scored twice; its ground truth counts as not found. Either way the
        sample's ``path`` is a :class:`SubstitutePath` naming the unreadable images.

        Raises:
            DatasetError: no image of the dataset can be read any more.
        """
        unreadable: list[str] = []
        for step in range(len(self)):
            i = (index + step) % len(self)
            try:
                sample = self._sample(i, rng_for(i))
            except ImageUnreadable as e:
                unreadable.append(str(e.path))
                # The lost image itself (a mosaic's tile may be another index than i), so that
                # no later stand-in draws it again as a tile.
                self._unreadable.add(i if e.index is None else e.index)
                if not self.augment:
                    return self._blank_sample(index, unreadable)
                continue
            if not unreadable:
                return sample
            img, labels, path, shapes, j = sample
            return img, labels, SubstitutePath(path, unreadable), shapes, j
        raise DatasetError(
            f"none of the {len(self)} images can be read any more (the dataset was checked at "
            f"start-up; were its files deleted or moved?)",
            _describe(self.img_files[index]),
        )

    def _blank_sample(
        self, index: int, unreadable: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor, str, Any, int]:
        """An evaluation sample of padding colour and no boxes in place of image ``index``."""
        g, shapes = self._letterbox(index)
        img = filled(g.shape, PAD_COLOR)
        path = SubstitutePath(self.img_files[index], unreadable)
        return torch.from_numpy(_to_chw_rgb(img)), torch.zeros((0, 6)), path, shapes, index

    def _sample(
        self, index: int, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, str, Any, int]:
        if self.augment:
            hyp = self.hyp
            # HSV jitter is applied inside compose(), before resizing when that is cheaper.
            lut = hsv_lut(hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"], rng)
            color = None if lut is None else partial(apply_hsv_lut, lut=lut)
            if self.mosaic:
                img, boxes = self._load_mosaic(index, rng, color)
                shapes = None
            else:
                img, boxes, shapes = self._load_augmented(index, rng, color)
            # Always draw both numbers so the stream does not depend on the probabilities.
            lr, ud = rng.random(2)
            if lr < hyp["fliplr"]:
                img, boxes = flip_lr(img, boxes)
            if ud < hyp["flipud"]:
                img, boxes = flip_ud(img, boxes)
        else:
            img, boxes, shapes = self._load_letterboxed(index)
        h, w = img.shape[:2]
        labels = torch.zeros((len(boxes), 6), dtype=torch.float32)
        if len(boxes):
            labels[:, 1] = torch.from_numpy(boxes[:, 0])
            labels[:, 2:] = torch.from_numpy(xyxy2xywhn(boxes[:, 1:5], w, h))
        return torch.from_numpy(_to_chw_rgb(img)), labels, self.img_files[index], shapes, index

    def coco_index(self, index: int) -> tuple[np.ndarray, tuple[int, int]]:
        """Ground truth of image ``index`` without reading pixels: ``(labels (n, 5) float32
        class + cxcywh normalised to the original image, (h0, w0))``."""
        w0, h0 = (int(v) for v in self.shapes[index])
        return self.labels[index].copy(), (h0, w0)

    @staticmethod
    def collate_fn(
        batch: Sequence[tuple],
    ) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple, tuple]:
        """``(imgs (bs, 3, H, W) uint8, targets (nt, 6) = (image index in batch, class, cx, cy,
        w, h), paths, shapes, indices)``. Inside a worker the image batch is built directly in
        shared memory (``default_collate``), saving a copy on the way to the main process."""
        imgs, labels, paths, shapes, indices = zip(*batch)
        for i, lb in enumerate(labels):
            lb[:, 0] = i
        return default_collate(list(imgs)), torch.cat(labels, 0), paths, shapes, indices


def _sample_rng(key: SampleKey) -> np.random.Generator:
    """The generator of one keyed sample: a pure function of (seed, epoch, index)."""
    return np.random.default_rng([int(key.seed) & SEED_MASK, int(key.epoch), int(key.index)])


def _to_chw_rgb(img: np.ndarray) -> np.ndarray:
    """BGR ``(H, W, 3)`` -> contiguous RGB ``(3, H, W)``; ``cv2.split`` into the planes of the
    result is faster than a numpy transpose copy."""
    out = np.empty((3, *img.shape[:2]), np.uint8)
    planes = cv2.split(img, mv=[out[2], out[1], out[0]])
    if planes[0].ctypes.data != out[2].ctypes.data:  # OpenCV allocated new planes after all
        out[...] = img[:, :, ::-1].transpose(2, 0, 1)
    return out


def _check_sizes(
    img_size: Any, batch_size: Any, nc: Any, mosaic_buffer: Any, ram_cache_copies: Any
) -> None:
    """ConfigError naming the first bad size argument of :class:`LoadImagesAndLabels`."""
    if not is_int(img_size) or img_size < GRID:
        raise ConfigError(f"img_size must be an integer >= {GRID}, got {img_size!r}")
    if not is_int(batch_size) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if nc is not None and (not is_int(nc) or nc < 1):
        raise ConfigError(f"nc must be a positive integer or None, got {nc!r}")
    if mosaic_buffer is not None and (not is_int(mosaic_buffer) or mosaic_buffer < 0):
        raise ConfigError(f"mosaic_buffer must be an integer >= 0 or None, got {mosaic_buffer!r}")
    if not is_int(ram_cache_copies) or ram_cache_copies < 1:
        raise ConfigError(f"ram_cache_copies must be a positive integer, got {ram_cache_copies!r}")


def _check_hyp(augment: bool, hyp: dict[str, Any] | None) -> None:
    if augment:
        if hyp is None:
            raise ConfigError("augment=True needs hyp (the cfg/hyp.yaml values)")
        missing = [k for k in HYP_AUGMENT_KEYS if k not in hyp]
        if missing:
            raise ConfigError(f"hyp lacks augmentation key(s) {', '.join(missing)}")


def _cache_mode(cache_images: bool | str | None) -> str | None:
    if cache_images is None or cache_images is False:
        return None
    if cache_images is True or cache_images == "ram":
        return "ram"
    if cache_images == "disk":
        return "disk"
    raise ConfigError(f"cache_images must be False, True, 'ram' or 'disk', got {cache_images!r}")


def _describe(path: Any) -> str:
    if isinstance(path, list | tuple):
        return ", ".join(os.fspath(p) for p in path)
    return os.fspath(path)
