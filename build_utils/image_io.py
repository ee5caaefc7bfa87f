"""Image file reading and checking with OpenCV, the same way for the loader and the dataset tools.

Every reader here goes through :func:`decode_image` so that the label tools, the label cache and
the training loader agree on an image's size and orientation:

- bytes are read from the open file (bounded) and decoded with ``cv2.imdecode`` (non-ASCII
  paths work);
- ``cv2.IMREAD_COLOR`` applies the EXIF orientation of JPEG, PNG and WebP images (a phone
  photo stored sideways comes out upright, and its size is the upright one), turns grayscale into
  3 channels, drops the alpha channel of RGBA images and maps 16-bit images to 8 bits (the high
  byte);
- images are BGR ``(H, W, 3) uint8`` (OpenCV's order); the dataset converts to RGB at the end.

Bounded before anything is decoded (:func:`read_image_data`): only a regular file within
:data:`~build_utils.limits.MAX_IMAGE_BYTES` is opened (a FIFO, device, folder or link loop named
``x.jpg`` is refused by its kind, a 40 GB sparse file by its size), and the width and height its
header declares (read by Pillow, which parses the header only) must stay within
:data:`~build_utils.limits.MAX_IMAGE_PIXELS`, so a 600 KB PNG declaring 25000x25000 pixels is
refused before OpenCV allocates 1.9 GB for it. The limit is on the image's full size whatever
JPEG reduction the loader would use, so whether an image belongs to the dataset does not depend
on ``--img-size``. An image whose header Pillow cannot parse (a format only OpenCV knows) is
decoded and its decoded size checked instead: there, OpenCV's own cap
(``OPENCV_IO_MAX_IMAGE_PIXELS``, 2^30 pixels) is what bounds the decode itself.

Nothing here changes global OpenCV or Pillow state (thread counts, log levels, Pillow's
``Image.MAX_IMAGE_PIXELS``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, TypeVar

import cv2
import numpy as np
from PIL import Image
from tqdm import tqdm

from build_utils.errors import DatasetError
from build_utils.limits import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    UnusableFile,
    open_data_file,
    read_up_to,
)

# Image file types the datasets accept; compared case-insensitively.
IMG_FORMATS: tuple[str, ...] = (".bmp", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp")
# Threads for decoding many images (label checks, image caches): decoding releases the GIL, so
# threads scale with the cores.
DECODE_THREADS = min(8, os.cpu_count() or 1)
Item = TypeVar("Item")
Result = TypeVar("Result")

# JPEG decoding can scale by 1/2, 1/4 or 1/8 inside the IDCT, much cheaper than a full decode
# followed by a resize; OpenCV exposes it through these flags.
_REDUCED_COLOR = {
    1: cv2.IMREAD_COLOR,
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}
_JPEG_SOI = b"\xff\xd8"
_JPEG_EOI = b"\xff\xd9"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Entropy-coded JPEG data never contains FF D9 (0xFF bytes are stuffed), so the end-of-image
# marker must appear within the last bytes unless the file was cut short; some writers append a
# little padding after it.
_JPEG_EOI_SEARCH_BYTES = 1024

# OpenCV refuses to decode images above this many pixels unless its environment variable raises
# it (read once, when OpenCV first decodes); our own limit can only be raised past it together.
OPENCV_MAX_PIXELS_ENV = "OPENCV_IO_MAX_IMAGE_PIXELS"
OPENCV_DEFAULT_MAX_PIXELS = 1 << 30
# Pillow's names of the formats of IMG_FORMATS, tried first when reading a header.
_COMMON_FORMATS = frozenset({"JPEG", "PNG", "BMP", "TIFF", "WEBP", "MPO"})
# Bytes Pillow's format detection looks at (as Image.open does).
_PIL_PREFIX_BYTES = 16

# EXIF orientation tag values and what they do to the stored pixels (TIFF 6.0 / EXIF 2.3).
EXIF_ORIENTATION_TAG = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)


def is_image_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` has one of :data:`IMG_FORMATS` as extension, in any letter case."""
    return os.path.splitext(os.fspath(path))[1].lower() in IMG_FORMATS


def file_stamp(path: str | os.PathLike[str]) -> str:
    """``"size:mtime_ns"`` of a file for cache keys (a rewritten file gets a new stamp), or
    ``"-"`` when it cannot be read (a missing label file is a valid state, not an error)."""
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def is_jpeg(data: np.ndarray | bytes) -> bool:
    """Whether the bytes start with the JPEG start-of-image marker."""
    return len(data) >= 2 and bytes(data[:2]) == _JPEG_SOI


def jpeg_truncated(data: np.ndarray | bytes) -> bool:
    """Whether JPEG bytes lack the end-of-image marker near their end (download cut short)."""
    tail = bytes(data[-_JPEG_EOI_SEARCH_BYTES:])
    return _JPEG_EOI not in tail


def reduce_factor(scale: float) -> int:
    """Largest JPEG decode reduction (1, 2, 4 or 8) that still leaves at least ``scale`` times
    the original resolution needed downstream, i.e. the largest ``f`` with ``f * scale <= 1``.

    ``scale`` is output pixels per original pixel; values >= 0.5 give 1 (decode in full).
    """
    f = 1
    while f < 8 and scale * f * 2 <= 1.0:
        f *= 2
    return f


def opencv_max_pixels() -> int:
    """The pixel count above which OpenCV refuses to decode (``OPENCV_IO_MAX_IMAGE_PIXELS``)."""
    raw = os.environ.get(OPENCV_MAX_PIXELS_ENV, "").strip()
    try:
        value = int(raw)
    except ValueError:
        return OPENCV_DEFAULT_MAX_PIXELS
    return value if value > 0 else OPENCV_DEFAULT_MAX_PIXELS


def pixel_problem(w: int, h: int) -> str | None:
    """Why an image of ``w x h`` pixels must not be decoded, or None.

    Over :data:`~build_utils.limits.MAX_IMAGE_PIXELS`: the limit, its name and how to raise it.
    Within it but over OpenCV's own cap (only when the limit was raised past it): that OpenCV's
    variable must be raised too, or OpenCV would refuse it with a message of its own.
    """
    pixels = int(w) * int(h)
    if pixels > MAX_IMAGE_PIXELS.value():
        return MAX_IMAGE_PIXELS.exceeded(pixels, f"image of {w}x{h} =")
    cv_cap = opencv_max_pixels()
    if pixels > cv_cap:
        return (
            f"image of {w}x{h} = {pixels} pixels is within {MAX_IMAGE_PIXELS.env} but over "
            f"OpenCV's own limit of {cv_cap} pixels; set {OPENCV_MAX_PIXELS_ENV} to raise it too"
        )
    return None


def header_size(f: BinaryIO) -> tuple[int, int] | None:
    """``(w, h)`` as stored, from the header of the image file open in ``f`` (Pillow parses
    the header only, nothing is decoded), or None when Pillow does not know the format.

    Pillow's format drivers are called directly rather than through ``Image.open``: its
    decompression-bomb check (``Image.MAX_IMAGE_PIXELS``, a global) would otherwise refuse or
    warn at its own threshold, and ours (:data:`~build_utils.limits.MAX_IMAGE_PIXELS`) must be the
    one in force, in both directions. A driver that still applies Pillow's check itself (GIF,
    ICO) reports more pixels than Pillow allows: then the size is over ours too unless ours was
    raised past Pillow's, and in that case it is unknown (None).

    Raises:
        UnusableFile: the image is known to be over the pixel limit without its exact size.
    """
    Image.init()  # every format driver registered (idempotent)
    f.seek(0)
    prefix = f.read(_PIL_PREFIX_BYTES)
    # The formats datasets hold first: each other driver's prefix test costs a little.
    for fmt in sorted(Image.ID, key=lambda fmt: fmt not in _COMMON_FORMATS):
        factory, accept = Image.OPEN[fmt]
        try:
            if accept is not None and accept(prefix) is not True:
                continue
            f.seek(0)
            im = factory(f, "")
        except Image.DecompressionBombError:
            pil_cap = 2 * (Image.MAX_IMAGE_PIXELS or 0)
            if pil_cap > 0 and MAX_IMAGE_PIXELS.value() <= pil_cap:
                reason = MAX_IMAGE_PIXELS.exceeded(pil_cap, "image of more than")
                raise UnusableFile(reason) from None
            return None
        except (SyntaxError, IndexError, TypeError, KeyError, ValueError, EOFError, struct.error):
            continue  # not this format after all (what Image.open tolerates, and a bit more)
        except OSError:
            # A header cut short ("Truncated File Read"): the decode that follows says what
            # is wrong with the file in the dataset's own words; a real read error recurs there.
            continue
        w, h = im.size
        return (int(w), int(h)) if w > 0 and h > 0 else None
    return None


def read_image_data(path: str | os.PathLike[str]) -> tuple[np.ndarray, tuple[int, int] | None]:
    """The encoded bytes of image file ``path``, read only when that is safe, and its size.

    In order, on one open file (so nothing can be swapped in between): a regular file (not a
    FIFO, device, socket, folder, link loop) within :data:`~build_utils.limits.MAX_IMAGE_BYTES`;
    the header's size within :data:`~build_utils.limits.MAX_IMAGE_PIXELS` (:func:`pixel_problem`);
    then the bytes.

    Returns:
        ``(data (n,) uint8, (w, h) as stored or None when Pillow cannot parse the header)``.

    Raises:
        DatasetError: why the file must not or cannot be read (``e.message``, for a report).
    """
    try:
        with open_data_file(path, MAX_IMAGE_BYTES) as f:
            size = header_size(f)
            if size is not None:
                problem = pixel_problem(*size)
                if problem is not None:
                    raise DatasetError(problem, path)
            f.seek(0)
            data = read_up_to(f, MAX_IMAGE_BYTES.value())
    except UnusableFile as e:
        reason = str(e)
        raise DatasetError(
            "image file not found" if reason == "file not found" else reason, path
        ) from e
    except OSError as e:
        raise DatasetError(f"cannot read image ({e.strerror or e})", path) from e
    if len(data) > MAX_IMAGE_BYTES.value():  # grew while being read
        raise DatasetError(MAX_IMAGE_BYTES.exceeded(len(data), "more than"), path)
    return np.frombuffer(data, dtype=np.uint8), size


def _decoded_problem(img: np.ndarray, header: tuple[int, int] | None) -> str | None:
    """The pixel limit, checked after decoding an image whose header Pillow could not parse."""
    return pixel_problem(img.shape[1], img.shape[0]) if header is None else None


def decode_image(data: np.ndarray, reduce: int = 1) -> np.ndarray | None:
    """Decode image bytes to BGR ``(H, W, 3) uint8`` with EXIF orientation applied.

    Args:
        data: ``(n,) uint8`` encoded bytes, checked by :func:`read_image_data`.
        reduce: 1, 2, 4 or 8; for JPEG bytes the decoder scales the image down by this factor
            (sides rounded up), other formats are decoded in full.

    Returns:
        The image, or ``None`` when the bytes are empty or cannot be decoded.
    """
    if data.size == 0:
        return None
    flags = _REDUCED_COLOR[reduce] if reduce > 1 and is_jpeg(data) else cv2.IMREAD_COLOR
    try:
        img = cv2.imdecode(data, flags)
    except cv2.error:
        return None
    if img is None or img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        return None
    return img


def read_image(path: str | os.PathLike[str], reduce: int = 1) -> np.ndarray:
    """Read and decode image file ``path`` within the limits (:func:`read_image_data`), as BGR
    ``(H, W, 3) uint8`` (see :func:`decode_image`); the loader's and predict's one way in.

    Raises:
        DatasetError: why the image was not read or decoded (``e.message``): the file is
            missing, not a regular file, over a limit, empty or not a decodable image.
    """
    data, header = read_image_data(path)
    img = decode_image(data, reduce)
    if img is None:
        raise DatasetError("not a readable image (empty, truncated or unsupported format)", path)
    problem = _decoded_problem(img, header)
    if problem is not None:
        raise DatasetError(problem, path)
    return img


def check_image(path: str | os.PathLike[str]) -> tuple[tuple[int, int] | None, str | None]:
    """Validate an image file the way the loader will read it.

    Returns:
        ``((w, h), None)`` with the upright size (EXIF orientation applied) for a good image,
        or ``(None, reason)`` for a missing, non-regular, too large, empty, truncated or
        undecodable one.
    """
    try:
        data, header = read_image_data(path)
    except DatasetError as e:
        return None, e.message
    if data.size == 0:
        return None, "zero-byte image file"
    if is_jpeg(data) and jpeg_truncated(data):
        return None, "truncated JPEG (no end-of-image marker)"
    try:
        # Grayscale decoding checks the whole stream and gives the same upright size as the
        # loader's colour decoding, at less cost.
        img = cv2.imdecode(data, cv2.IMREAD_GRAYSCALE)
    except cv2.error:
        img = None
    if img is None:
        return None, "not a readable image (corrupt, truncated or unsupported format)"
    h, w = img.shape[:2]
    if h < 1 or w < 1:
        return None, f"image has no pixels ({w}x{h})"
    problem = _decoded_problem(img, header)
    if problem is not None:
        return None, problem
    return (int(w), int(h)), None


def raw_image_size(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(w, h)`` of the pixels as stored, ignoring EXIF orientation; ``None`` if unreadable
    (including not a regular file or over a limit: nothing is decoded then)."""
    try:
        data, _ = read_image_data(path)
        img = cv2.imdecode(data, cv2.IMREAD_GRAYSCALE | cv2.IMREAD_IGNORE_ORIENTATION)
    except (DatasetError, cv2.error):
        return None
    if img is None:
        return None
    return int(img.shape[1]), int(img.shape[0])


def exif_orientation(data: np.ndarray | bytes) -> int:
    """The EXIF orientation (1..8) of an image file's bytes; 1 when absent or malformed.

    Read where OpenCV reads it, for the formats whose pixels it rotates: a JPEG's APP1 ``Exif``
    segment, a PNG's ``eXIf`` chunk, a WebP's ``EXIF`` chunk (both anywhere in the file).
    """
    if bytes(data[:8]) == _PNG_SIGNATURE:
        return _chunk_orientation(bytes(data), 8, png=True)
    if bytes(data[:4]) == b"RIFF" and bytes(data[8:12]) == b"WEBP":
        return _chunk_orientation(bytes(data), 12, png=False)
    buf = bytes(data[: 1 << 16])  # a JPEG's EXIF sits in the first 64 KiB
    if buf[:2] != _JPEG_SOI:
        return 1
    pos = 2
    while pos + 4 <= len(buf):
        if buf[pos] != 0xFF:
            return 1
        marker = buf[pos + 1]
        if marker in (0xD9, 0xDA):  # end of image / start of scan: no EXIF before the pixels
            return 1
        (length,) = struct.unpack(">H", buf[pos + 2 : pos + 4])
        segment = buf[pos + 4 : pos + 2 + length]
        if marker == 0xE1 and segment[:6] == b"Exif\x00\x00":
            return _tiff_orientation(segment[6:])
        pos += 2 + length
    return 1


def _chunk_orientation(buf: bytes, pos: int, png: bool) -> int:
    """The orientation in the EXIF chunk of a PNG (chunks of length, type, data and a 4-byte
    CRC) or a WebP (RIFF chunks of type, little-endian length and data padded to even)."""
    tag = b"eXIf" if png else b"EXIF"
    while pos + 8 <= len(buf):
        head = buf[pos : pos + 8]
        if png:
            (length,), kind = struct.unpack(">I", head[:4]), head[4:]
            end = pos + 8 + length + 4
        else:
            kind, (length,) = head[:4], struct.unpack("<I", head[4:])
            end = pos + 8 + length + (length & 1)
        if kind == tag:
            return _tiff_orientation(buf[pos + 8 : pos + 8 + length].removeprefix(b"Exif\x00\x00"))
        pos = end
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    end = "<" if tiff[:2] == b"II" else ">"
    try:
        (ifd,) = struct.unpack(end + "I", tiff[4:8])
        (count,) = struct.unpack(end + "H", tiff[ifd : ifd + 2])
        for k in range(count):
            entry = tiff[ifd + 2 + 12 * k : ifd + 14 + 12 * k]
            tag, kind = struct.unpack(end + "HH", entry[:4])
            if tag == EXIF_ORIENTATION_TAG and kind == 3:  # SHORT
                (value,) = struct.unpack(end + "H", entry[8:10])
                return int(value) if 1 <= value <= 8 else 1
    except struct.error:
        return 1
    return 1


def oriented_size(raw_w: int, raw_h: int, orientation: int) -> tuple[int, int]:
    """``(w, h)`` of an image of raw size ``(raw_w, raw_h)`` once ``orientation`` is applied."""
    return (raw_h, raw_w) if orientation in _TRANSPOSING_ORIENTATIONS else (raw_w, raw_h)


def orient_boxes(boxes: np.ndarray, orientation: int, raw_w: float, raw_h: float) -> np.ndarray:
    """Map ``(N, 4)`` xyxy boxes (absolute pixel edges) from the stored frame of an image of size
    ``(raw_w, raw_h)`` to its upright frame after EXIF ``orientation`` (what OpenCV shows).

    Returns a new ``(N, 4)`` xyxy array with ``x1 <= x2``, ``y1 <= y2``.
    """
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    x1, y1, x2, y2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    w, h = float(raw_w), float(raw_h)
    # Each case maps a stored point (x, y) to its upright position; corners are re-sorted below.
    mapping = {
        1: (x1, y1, x2, y2),
        2: (w - x1, y1, w - x2, y2),  # mirrored left-right
        3: (w - x1, h - y1, w - x2, h - y2),  # rotated 180
        4: (x1, h - y1, x2, h - y2),  # mirrored top-bottom
        5: (y1, x1, y2, x2),  # transposed
        6: (h - y1, x1, h - y2, x2),  # rotated 90 clockwise
        7: (h - y1, w - x1, h - y2, w - x2),  # transversed
        8: (y1, w - x1, y2, w - x2),  # rotated 90 counter-clockwise
    }
    ax, ay, bx, by = mapping.get(orientation, mapping[1])
    return np.stack(
        [np.minimum(ax, bx), np.minimum(ay, by), np.maximum(ax, bx), np.maximum(ay, by)], axis=1
    )


def list_files(folder: str | os.PathLike[str]) -> list[str]:
    """Every entry under ``folder`` (recursively) that is not a folder, as sorted absolute paths.

    Linked folders are entered, as YOLOv5's ``glob('**')`` does (a dataset gathered from parts
    by symbolic links), each real folder once, so a link loop ends; a link loop or a FIFO named
    like a file is listed (its reader says why it is unusable)."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    for root, dirs, files in os.walk(os.path.abspath(os.fspath(folder)), followlinks=True):
        try:
            st = os.stat(root)
        except OSError:
            dirs.clear()
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirs.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs.sort()  # deterministic walk order
        found.extend(os.path.join(root, f) for f in files)
    found.sort()
    return found


def list_images(folder: str | os.PathLike[str]) -> list[str]:
    """All image files under ``folder`` (recursively, see :func:`list_files`), sorted."""
    return [f for f in list_files(folder) if is_image_file(f)]


def map_in_threads(
    fn: Callable[[Item], Result], items: Sequence[Item], desc: str, progress: bool
) -> list[Result]:
    """``[fn(x) for x in items]`` on :data:`DECODE_THREADS` threads, in order, with a tqdm bar
    when ``progress``: the one loop behind label checking and every image cache fill."""
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        return list(
            tqdm(
                pool.map(fn, items),
                total=len(items),
                desc=desc,
                disable=not progress,
                leave=False,
            )
        )
