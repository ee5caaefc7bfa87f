"""Image file reading and checking with OpenCV, the same way for the loader and the dataset tools.

Every reader here goes through :func:`decode_image` so that the label tools, the label cache and
the training loader agree on an image's size and orientation:

- bytes are read with ``np.fromfile`` and decoded with ``cv2.imdecode`` (non-ASCII paths work);
- ``cv2.IMREAD_COLOR`` applies the EXIF orientation of JPEG images (a phone photo stored
  sideways comes out upright, and its size is the upright one), turns grayscale into 3 channels,
  drops the alpha channel of RGBA images and maps 16-bit images to 8 bits (the high byte);
- images are BGR ``(H, W, 3) uint8`` (OpenCV's order); the dataset converts to RGB at the end.

Nothing here changes global OpenCV state (thread counts, log levels).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import cv2
import numpy as np
from tqdm import tqdm

from build_utils.errors import DatasetError

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
# Entropy-coded JPEG data never contains FF D9 (0xFF bytes are stuffed), so the end-of-image
# marker must appear within the last bytes unless the file was cut short; some writers append a
# little padding after it.
_JPEG_EOI_SEARCH_BYTES = 1024

# EXIF orientation tag values and what they do to the stored pixels (TIFF 6.0 / EXIF 2.3).
EXIF_ORIENTATION_TAG = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)


def is_image_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` has one of :data:`IMG_FORMATS` as extension, in any letter case."""
    return os.path.splitext(os.fspath(path))[1].lower() in IMG_FORMATS


def read_file_bytes(path: str | os.PathLike[str]) -> np.ndarray:
    """The raw bytes of a file as a ``(n,) uint8`` array (works for non-ASCII paths on Windows)."""
    return np.fromfile(os.fspath(path), dtype=np.uint8)


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


def decode_image(data: np.ndarray, reduce: int = 1) -> np.ndarray | None:
    """Decode image bytes to BGR ``(H, W, 3) uint8`` with EXIF orientation applied.

    Args:
        data: ``(n,) uint8`` encoded bytes.
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
    """Read an image file as BGR ``(H, W, 3) uint8`` (see :func:`decode_image`).

    Raises:
        DatasetError: the file is missing, empty or not a decodable image.
    """
    try:
        data = read_file_bytes(path)
    except OSError as e:
        raise DatasetError(f"cannot read image: {e.strerror or e}", path) from e
    img = decode_image(data, reduce)
    if img is None:
        raise DatasetError("not a readable image (empty, truncated or unsupported format)", path)
    return img


def check_image(path: str | os.PathLike[str]) -> tuple[tuple[int, int] | None, str | None]:
    """Validate an image file the way the loader will read it.

    Returns:
        ``((w, h), None)`` with the upright size (EXIF orientation applied) for a good image,
        or ``(None, reason)`` for a missing, empty, truncated or undecodable one.
    """
    try:
        data = read_file_bytes(path)
    except FileNotFoundError:
        return None, "image file not found"
    except OSError as e:
        return None, f"cannot read image ({e.strerror or e})"
    if data.size == 0:
        return None, "zero-byte image file"
    if is_jpeg(data) and jpeg_truncated(data):
        return None, "truncated JPEG (no end-of-image marker)"
    try:
        # Grayscale decoding checks the whole stream and gives the same upright size as the
        # loader's colour decoding, at about 60% of the cost.
        img = cv2.imdecode(data, cv2.IMREAD_GRAYSCALE)
    except cv2.error:
        img = None
    if img is None:
        return None, "not a readable image (corrupt, truncated or unsupported format)"
    h, w = img.shape[:2]
    if h < 1 or w < 1:
        return None, f"image has no pixels ({w}x{h})"
    return (int(w), int(h)), None


def raw_image_size(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(w, h)`` of the pixels as stored, ignoring EXIF orientation; ``None`` if unreadable."""
    try:
        data = read_file_bytes(path)
        img = cv2.imdecode(data, cv2.IMREAD_GRAYSCALE | cv2.IMREAD_IGNORE_ORIENTATION)
    except (OSError, cv2.error):
        return None
    if img is None:
        return None
    return int(img.shape[1]), int(img.shape[0])


def exif_orientation(data: np.ndarray | bytes) -> int:
    """The EXIF orientation (1..8) of JPEG bytes; 1 when absent, not a JPEG or malformed.

    Only the JPEG APP1 ``Exif`` segment is parsed (the same images OpenCV rotates).
    """
    buf = bytes(data[: 1 << 16])  # EXIF sits in the first 64 KiB
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


def list_images(folder: str | os.PathLike[str]) -> list[str]:
    """All image files under ``folder`` (recursively), as sorted absolute paths."""
    found: list[str] = []
    for root, dirs, files in os.walk(os.path.abspath(os.fspath(folder))):
        dirs.sort()  # deterministic walk order
        found.extend(os.path.join(root, f) for f in sorted(files) if is_image_file(f))
    found.sort()
    return found


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
