"""One RAM image cache per node, shared by the node's processes and their DataLoader workers.

With ``--cache-images ram`` every process of a node used to decode and hold its own copy of the
dataset. :class:`SharedImages` keeps the decoded, resized images once per node in a file on a
RAM file system (``/dev/shm``), mapped by every process (``mmap``, no copy): one process
creates it, all of the node's processes fill disjoint shares, and everyone reads every image.

The file is unlinked as soon as every process has mapped it, so a run that is killed later
leaves nothing behind; the pages live as long as a mapping or descriptor does. DataLoader
workers made by ``fork`` inherit the mapping; a pickled :class:`SharedImages` (``spawn`` or
``forkserver`` workers) carries a duplicate of the file descriptor, never the pixels.

Layout: the images in dataset order, each ``(h, w, 3) uint8`` BGR, back to back, then one byte
per image set once it is stored (so a share nobody filled is found, not trained on as black);
the index (offset and shape of each image) is computed from the image sizes, which every process
knows already, so only the pixels are shared.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import numpy as np

from build_utils.errors import DatasetError

SHM_DIR = Path("/dev/shm")
CHANNELS = 3  # BGR


def shared_cache_dir() -> Path:
    """Where shared caches are created: ``/dev/shm`` (RAM), else the temporary folder."""
    return SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())


def shared_file_bytes(sizes: np.ndarray) -> int:
    """Size of the shared file for images of ``sizes (N, 2)`` (w, h): pixels and flags."""
    return int(image_offsets(sizes)[-1]) + len(np.asarray(sizes).reshape(-1, 2))


def image_offsets(sizes: np.ndarray) -> np.ndarray:
    """Byte offset of every image and the total at the end: ``sizes (N, 2)`` as (w, h) ->
    ``(N + 1,) int64``."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes[:, 0] * sizes[:, 1] * CHANNELS, out=offsets[1:])
    return offsets


class SharedImages:
    """Images of one dataset in one shared, memory-mapped file.

    Create with :meth:`create` (one process of the node) or :meth:`attach` (the others). Indexing
    gives a read-only ``(h, w, 3) uint8`` view; :meth:`put` writes an image (filling only).

    Args:
        fd: open descriptor of the file; owned by this object.
        sizes: ``(N, 2)`` (w, h) of every image.
        writable: map for writing (filling) or read only (workers).
    """

    def __init__(self, fd: int, sizes: np.ndarray, writable: bool) -> None:
        self._fd = fd
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
        self._offsets = image_offsets(self.sizes)
        self.nbytes = shared_file_bytes(self.sizes)
        pixels = int(self._offsets[-1])
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        # mmap refuses length 0; a dataset always has at least one image.
        self._map = mmap.mmap(fd, max(self.nbytes, 1), access=access)
        self._data = np.frombuffer(self._map, dtype=np.uint8, count=pixels)
        self._stored = np.frombuffer(
            self._map, dtype=np.uint8, count=len(self.sizes), offset=pixels
        )

    @classmethod
    def create(cls, path: Path, sizes: np.ndarray) -> SharedImages:
        """A new file at ``path`` (which must not exist) with room for every image.

        The space is reserved now (``posix_fallocate``): a RAM file system that is too small
        (e.g. Docker's 64 MB ``/dev/shm``) fails here with a clear error instead of killing the
        process with SIGBUS when a later write finds no page.

        Raises:
            DatasetError: the file cannot be created or the space is missing.
        """
        nbytes = shared_file_bytes(sizes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise DatasetError(
                f"cannot create the shared image cache: {e.strerror or e}", path
            ) from e
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            else:
                os.ftruncate(fd, max(nbytes, 1))
            return cls(fd, sizes, writable=True)
        except OSError as e:
            os.close(fd)
            unlink_quietly(path)
            raise DatasetError(
                f"cannot reserve {nbytes / 1e9:.2f} GB for the shared image cache "
                f"({e.strerror or e}); enlarge {path.parent} (e.g. docker --shm-size) or use "
                f"--cache-images disk",
                path,
            ) from e

    @classmethod
    def attach(cls, path: Path, sizes: np.ndarray) -> SharedImages:
        """Map the file another process of the node created at ``path``.

        Raises:
            DatasetError: it is missing or has the wrong size.
        """
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise DatasetError(
                f"cannot open the shared image cache: {e.strerror or e}", path
            ) from e
        nbytes = shared_file_bytes(sizes)
        if os.fstat(fd).st_size < nbytes:
            os.close(fd)
            raise DatasetError(f"the shared image cache is smaller than {nbytes} bytes", path)
        return cls(fd, sizes, writable=True)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        w, h = (int(v) for v in self.sizes[i])
        start = int(self._offsets[i])
        view = self._data[start : start + w * h * CHANNELS].reshape(h, w, CHANNELS)
        view.flags.writeable = False
        return view

    def put(self, i: int, img: np.ndarray) -> None:
        """Store image ``i``; ``img`` must be ``(h, w, 3) uint8`` of its size."""
        w, h = (int(v) for v in self.sizes[i])
        if img.shape != (h, w, CHANNELS) or img.dtype != np.uint8:
            raise ValueError(f"image {i} is {img.shape} {img.dtype}, expected ({h}, {w}, 3) uint8")
        start = int(self._offsets[i])
        self._data[start : start + w * h * CHANNELS] = img.reshape(-1)
        self._stored[i] = 1

    def missing(self) -> int:
        """How many images nobody has stored yet."""
        return int(len(self._stored) - np.count_nonzero(self._stored))

    def __reduce__(self) -> tuple[Any, tuple]:
        # A duplicate of the descriptor travels (to a spawned worker, through multiprocessing's
        # fd passing), never the pixels.
        return _from_dup_fd, (reduction.DupFd(self._fd), self.sizes)


def _from_dup_fd(dup: Any, sizes: np.ndarray) -> SharedImages:
    return SharedImages(dup.detach(), sizes, writable=False)


def unlink_quietly(path: Path) -> None:
    """Remove ``path`` if it is still there (mappings stay valid after the unlink)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
