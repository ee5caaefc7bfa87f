"""The image caches of a dataset: decoded, resized images kept so that later epochs skip decoding.

Three kinds, all filled by :func:`~build_utils.image_io.map_in_threads` from a dataset's
``decode(i)`` (image ``i`` resized for the cache, BGR ``(h, w, 3) uint8``):

- RAM, one copy per process (:func:`fill_ram`), refused by :func:`check_ram_cache_fits` when the
  node's copies would not fit;
- RAM, one copy per node in a shared file (:func:`fill_shared`, see
  :mod:`build_utils.shared_images`), filled by the node's processes together;
- ``.npy`` files on disk (:func:`cache_on_disk`) in ``<stem>.img<size>/`` beside the label cache
  (beside the list or folder the user named, never at a place derived from an entry), one per
  image, named by a hash of the image path, its size and modification time and the cache's image
  size, so a changed image or another ``img_size`` gets a new file and nothing stale is read. A
  file whose header disagrees with the image it stands for (shape, dtype, length) is rewritten
  when the cache is filled and never served (:func:`npy_problem`, :func:`read_npy`); no pickle.

Which images go into the cache and at what size is the dataset's business
(:class:`~build_utils.datasets.LoadImagesAndLabels`); this module only stores and reads them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tokenize
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from build_utils.atomic import atomic_write
from build_utils.errors import DatasetError
from build_utils.image_io import file_stamp, map_in_threads
from build_utils.limits import UnusableFile, open_data_file
from build_utils.shared_images import SharedImages

LOGGER = logging.getLogger(__name__)
Decode = Callable[[int], np.ndarray]

# cache_images="ram" is refused when the estimate exceeds this fraction of available memory.
RAM_CACHE_MAX_FRACTION = 0.8
NPY_NAME_CHARS = 20  # hex digits of the SHA-1 that name a .npy cache file
GB = 1e9


def available_memory_bytes() -> int | None:
    """Memory available to new allocations (Linux ``MemAvailable``), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_ram_cache_fits(need: int, images: int, procs: int, avail: int | None = None) -> None:
    """Refuse a RAM image cache of ``need`` bytes per copy when ``procs`` copies on this node
    (one per process that caches its own, see
    :func:`train_utils.distributed.node.processes_per_node`; 1 for the node's shared cache, see
    :class:`~build_utils.shared_images.SharedImages`) would take more than
    :data:`RAM_CACHE_MAX_FRACTION` of ``avail`` bytes (default: the available memory).

    Raises:
        DatasetError: it would not fit.
    """
    avail = available_memory_bytes() if avail is None else avail
    if avail is not None and need * procs > RAM_CACHE_MAX_FRACTION * avail:
        copies = "one copy for the node" if procs == 1 else f"x {procs} process(es)"
        raise DatasetError(
            f"caching {images} images in RAM needs {need / GB:.1f} GB {copies} "
            f"but only {avail / GB:.1f} GB is available; use "
            f"cache_images='disk' (--cache-images disk) or no image cache"
        )


def fill_ram(decode: Decode, count: int, nbytes: int, progress: bool) -> list[np.ndarray]:
    """Images ``0 .. count - 1`` (``nbytes`` in all, for the log) decoded into this process's
    memory; ``progress`` logs and draws a bar (the main process)."""
    if progress:
        LOGGER.info("caching %d images in RAM (%.2f GB)", count, nbytes / GB)
    return map_in_threads(decode, range(count), "caching images", progress)


def fill_shared(
    images: SharedImages, decode: Decode, share: int, shares: int, progress: bool
) -> None:
    """Decode images ``share, share + shares, ...`` into ``images``: this process's part of a
    cache that ``shares`` processes of the node fill together."""
    if progress:
        LOGGER.info(
            "caching %d images in RAM shared by %d process(es) (%.2f GB per node)",
            len(images),
            shares,
            images.nbytes / GB,
        )

    def put(i: int) -> None:
        images.put(i, decode(i))

    map_in_threads(put, range(share, len(images), shares), "caching images", progress)


def npy_cache_files(img_files: Sequence[str], img_size: int, folder: Path) -> list[Path]:
    """The ``.npy`` file of every image in ``folder``: named by the image's path, size and
    modification time and ``img_size``, so an edited image is cached again."""
    names = []
    for f in img_files:
        # fsencode: a name that is not UTF-8 hashes as its bytes (str.encode would raise).
        digest = hashlib.sha1(os.fsencode(f"{f}|{file_stamp(f)}|{img_size}")).hexdigest()
        names.append(folder / f"{digest[:NPY_NAME_CHARS]}.npy")
    return names


def npy_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the open ``.npy`` file ``f`` (an image cache file, a
    member of a label cache), left at its data; read without allocating the array.

    Raises:
        ValueError: not a ``.npy`` file, an unsupported version, or a garbled header.
    """
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"unsupported .npy format version {version}")
    read = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else (np.lib.format.read_array_header_2_0)
    )
    try:
        return read(f)
    except (SyntaxError, tokenize.TokenError) as e:  # numpy parses the header as Python text
        raise ValueError(f"garbled .npy header ({e})") from e


def _header_problem(
    got: tuple[int, ...], fortran: bool, dtype: np.dtype, shape: tuple[int, int, int]
) -> str | None:
    if dtype != np.uint8 or fortran or tuple(got) != tuple(shape):
        order = "Fortran-order " if fortran else ""
        return f"holds {order}{dtype} {tuple(got)}, expected uint8 {tuple(shape)}"
    return None


def npy_problem(path: Path, shape: tuple[int, int, int]) -> str | None:
    """Why the ``.npy`` cache file ``path`` does not hold a ``uint8`` image of ``shape``
    (``(h, w, 3)``), or None when it does. Reads the header only (a few hundred bytes), so a
    file declaring a huge array costs nothing; the size of the file must match its header."""
    try:
        # Only a regular file is read (a FIFO or device placed where a cache file should be
        # would block or never end).
        with open_data_file(path, None) as f:
            got, fortran, dtype = npy_header(f)
            data_bytes = os.fstat(f.fileno()).st_size - f.tell()
    except UnusableFile as e:
        return "missing" if str(e) == "file not found" else f"unreadable ({e})"
    except (OSError, ValueError) as e:
        return f"unreadable ({e})"
    problem = _header_problem(got, fortran, dtype, shape)
    if problem is not None:
        return problem
    if data_bytes != int(np.prod(shape)):
        return f"{data_bytes} bytes of data for a {shape} image"
    return None


def cache_on_disk(
    decode: Decode,
    img_files: Sequence[str],
    img_size: int,
    folder: Path,
    progress: bool,
    shapes: Sequence[tuple[int, int, int]],
) -> list[Path | None] | None:
    """The ``.npy`` file of every image in ``folder``, writing those that do not exist yet or do
    not hold an image of ``shapes[i]`` (``(h, w, 3)`` uint8, see :func:`npy_problem`: a
    truncated, foreign or altered file is rewritten, with a warning); None, with a warning, when
    ``folder`` is not writable (images are then decoded on the fly). An image whose file name is
    taken by a folder has None (decoded), the others are cached (was: none of them)."""
    if folder.is_symlink():  # a cache moved to another disk by a link: where it is written
        LOGGER.info("image cache %s is a link: writing into %s", folder, folder.resolve())
    names: list[Path | None] = list(npy_cache_files(img_files, img_size, folder))
    problems = [npy_problem(p, shape) for p, shape in zip(names, shapes)]
    taken = [i for i, p in enumerate(names) if problems[i] is not None and p.is_dir()]
    if taken:
        LOGGER.warning(
            "%d image cache file name(s) in %s are folders (%s); those images are decoded on "
            "the fly",
            len(taken),
            folder,
            names[taken[0]].name,
        )
        for i in taken:
            names[i] = problems[i] = None
    todo = [i for i, why in enumerate(problems) if why is not None]
    bad = [(names[i], problems[i]) for i in todo if problems[i] != "missing"]
    if bad:
        LOGGER.warning(
            "%d image cache file(s) in %s disagree with their image and are rebuilt (%s: %s)",
            len(bad),
            folder,
            bad[0][0].name,
            bad[0][1],
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)

        def write(i: int) -> None:
            img = decode(i)
            # Not fsynced: a cache file is cheap to rebuild, and there is one per image.
            with atomic_write(names[i], "wb", fsync=False) as f:
                np.save(f, img, allow_pickle=False)

        map_in_threads(write, todo, "caching images to disk", progress and bool(todo))
    except OSError as e:
        LOGGER.warning(
            "cannot write the image cache in %s (%s); images are decoded on the fly",
            folder,
            e.strerror or e,
        )
        return None
    return names


def read_npy(path: Path, shape: tuple[int, int, int]) -> np.ndarray | None:
    """The image in the ``.npy`` cache file ``path`` if it holds a ``uint8`` image of ``shape``
    (``(h, w, 3)``; the header is checked before any data is read, no pickle); None, with a
    warning, otherwise (the caller decodes the image instead)."""
    try:
        with open_data_file(path, None) as f:
            problem = _header_problem(*npy_header(f), shape)
            if problem is not None:
                raise ValueError(problem)
            img = np.fromfile(f, dtype=np.uint8, count=int(np.prod(shape)))
        if img.size != int(np.prod(shape)):
            raise ValueError(f"truncated: {img.size} of {int(np.prod(shape))} bytes")
        return img.reshape(shape)
    except (OSError, ValueError, UnusableFile) as e:
        LOGGER.warning("image cache file %s is unreadable (%s); decoding the image", path, e)
        return None
