"""Reading images, labels and image lists within the limits (build_utils/image_io.py, the data
side of build_utils/labels.py): pixel bombs refused from the header, huge and sparse files by
their size, and anything that is not a regular file by its kind, each with its reason."""

from __future__ import annotations

import io
import os
import signal
import socket
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from build_utils import image_io
from build_utils.datasets import LoadImagesAndLabels, SubstitutePath
from build_utils.errors import ConfigError, DatasetError
from build_utils.image_io import check_image, read_image
from build_utils.labels import check_file, collect_image_files

# A test that would wait on a FIFO forever (the old code did) fails after this many seconds.
HANG_S = 20


def write_png(path: Path, w: int, h: int, full: bool = True) -> Path:
    """A PNG declaring ``w x h`` 1-bit grayscale pixels, all black. ``full``: every row is in
    the (valid) zlib stream, which compresses about 1000:1, so 25000x25000 takes 76 KB and any
    decoder allocates the whole image; otherwise one row only (a header-valid file that fails
    late, quick to write at any size)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    row = b"\0" * (1 + (w + 7) // 8)  # filter byte + packed bits
    if full:
        comp = zlib.compressobj(9)
        idat = b"".join([comp.compress(row) for _ in range(h)] + [comp.flush()])
    else:
        idat = zlib.compress(row)
    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )
    return path


def sparse_file(path: Path, size: int) -> Path:
    """A file of ``size`` bytes taking no disk space (skips the test where that is impossible)."""
    with open(path, "wb") as f:
        f.truncate(size)
    if os.stat(path).st_blocks * 512 > 1 << 20:
        path.unlink()
        pytest.skip("this file system has no sparse files")
    return path


def good_jpeg(path: Path, w: int = 48, h: int = 32) -> Path:
    ok, buf = cv2.imencode(".jpg", np.full((h, w, 3), 128, np.uint8))
    assert ok
    path.write_bytes(buf.tobytes())
    return path


class Hung(Exception):
    """Not an OSError (as TimeoutError is), so that no reader takes it for a read error."""


@pytest.fixture
def no_hang():
    """Fail, instead of waiting forever, when a read blocks in this thread (a FIFO opened for
    reading)."""

    def on_alarm(signum, frame):
        raise Hung(f"blocked for {HANG_S} s (a FIFO was opened?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def bind_socket(path: Path) -> None:
    """A Unix socket at ``path``, bound by its short relative name (socket paths are limited to
    about 100 characters, less than a temporary folder's may be)."""
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        sock.close()
    finally:
        os.chdir(cwd)


def _not_files(d: Path) -> dict[str, str]:
    """Things named like images that are not regular files -> the reason each must give."""
    os.mkfifo(d / "fifo.jpg")
    (d / "folder.jpg").mkdir()
    (d / "loop.jpg").symlink_to("loop.jpg")
    (d / "dangling.jpg").symlink_to("nothing-here.jpg")
    (d / "zero.jpg").symlink_to("/dev/zero")
    bind_socket(d / "sock.jpg")
    return {
        "fifo.jpg": "a FIFO (named pipe), not a regular file",
        "folder.jpg": "a folder, not a file",
        "loop.jpg": "a symbolic link loop",
        "dangling.jpg": "dangling symbolic link",
        "zero.jpg": "a character device, not a regular file",
        "sock.jpg": "a socket, not a regular file",
    }


# ---------------------------------------------------------------------------------------------
# Pixels: from the header, before decoding


def test_pixel_bomb_is_refused_from_its_header_without_decoding(tmp_path, monkeypatch):
    bomb = write_png(tmp_path / "bomb.png", 25000, 25000)
    assert bomb.stat().st_size < 200_000
    decoded = []
    monkeypatch.setattr(image_io.cv2, "imdecode", lambda *a: decoded.append(a))
    size, reason = check_image(bomb)
    assert size is None
    assert reason == (
        "image of 25000x25000 = 625000000 pixels, over the limit of 150000000 pixels "
        "(decoded pixels per image); set YOLO_MAX_IMAGE_PIXELS to raise it"
    )
    with pytest.raises(DatasetError, match=r"bomb\.png: image of 25000x25000 = 625000000 pixels"):
        read_image(bomb)
    assert decoded == []  # refused before OpenCV saw a byte


def test_our_pixel_limit_is_the_one_in_force_in_both_directions(tmp_path, monkeypatch):
    """Scaled down: Pillow's own bomb threshold (Image.MAX_IMAGE_PIXELS, refusing at twice it)
    set below the image, ours above it: the image is read, and Pillow's global is untouched.
    Ours below the image: refused, whatever Pillow would say."""
    img = write_png(tmp_path / "img.png", 40, 30)  # 1200 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Image.open refuses > 200 pixels
    with pytest.raises(Image.DecompressionBombError):
        Image.open(img)
    monkeypatch.setenv("YOLO_MAX_IMAGE_PIXELS", "1200")
    assert check_image(img) == ((40, 30), None)
    assert read_image(img).shape == (30, 40, 3)
    assert Image.MAX_IMAGE_PIXELS == 100
    monkeypatch.setenv("YOLO_MAX_IMAGE_PIXELS", "1199")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10**9)
    assert check_image(img) == (
        None,
        "image of 40x30 = 1200 pixels, over the limit of 1199 pixels (decoded pixels per "
        "image); set YOLO_MAX_IMAGE_PIXELS to raise it",
    )


def test_a_limit_raised_past_opencvs_cap_says_to_raise_opencvs_too(tmp_path, monkeypatch):
    big = write_png(tmp_path / "big.png", 40000, 30000, full=False)  # 1.2e9 > 2^30 pixels
    monkeypatch.setenv("YOLO_MAX_IMAGE_PIXELS", str(2 * 10**9))
    monkeypatch.delenv("OPENCV_IO_MAX_IMAGE_PIXELS", raising=False)
    size, reason = check_image(big)
    assert size is None
    assert reason == (
        "image of 40000x30000 = 1200000000 pixels is within YOLO_MAX_IMAGE_PIXELS but over "
        "OpenCV's own limit of 1073741824 pixels; set OPENCV_IO_MAX_IMAGE_PIXELS to raise it too"
    )


def test_header_sizes_of_every_accepted_format_without_decoding(tmp_path):
    img = np.zeros((30, 40, 3), np.uint8)
    for ext in (".bmp", ".jpg", ".png", ".tif", ".webp"):
        path = tmp_path / f"x{ext}"
        assert cv2.imwrite(str(path), img)
        with open(path, "rb") as f:
            assert image_io.header_size(f) == (40, 30), ext
    with open(good_jpeg(tmp_path / "y.jpg"), "rb") as f:
        assert image_io.header_size(f) == (48, 32)
    (tmp_path / "junk.jpg").write_bytes(b"not an image at all")
    with open(tmp_path / "junk.jpg", "rb") as f:
        assert image_io.header_size(f) is None


def test_an_image_pillow_cannot_parse_is_checked_after_decoding(tmp_path, monkeypatch):
    """A format only OpenCV knows (PGM here, hidden from the header reader) still works within
    the limit, and its decoded size is held to the limit."""
    path = tmp_path / "x.png"
    assert cv2.imwrite(str(tmp_path / "x.pgm"), np.zeros((30, 40), np.uint8))
    path.write_bytes((tmp_path / "x.pgm").read_bytes())
    monkeypatch.setattr(image_io, "header_size", lambda f: None)
    assert check_image(path) == ((40, 30), None)
    monkeypatch.setenv("YOLO_MAX_IMAGE_PIXELS", "1000")
    size, reason = check_image(path)
    assert size is None and reason.startswith("image of 40x30 = 1200 pixels, over the limit")
    with pytest.raises(DatasetError, match="over the limit of 1000 pixels"):
        read_image(path)


# ---------------------------------------------------------------------------------------------
# Bytes and kinds: stat first


def test_a_40_gb_sparse_jpg_is_refused_by_its_size(tmp_path):
    huge = sparse_file(tmp_path / "huge.jpg", 40 << 30)
    assert check_image(huge) == (
        None,
        "40 GiB, over the limit of 512 MiB (bytes per image file); set YOLO_MAX_IMAGE_BYTES "
        "to raise it",
    )


def test_things_that_are_not_files_are_refused_by_their_kind(tmp_path, no_hang):
    for name, reason in _not_files(tmp_path).items():
        assert check_image(tmp_path / name) == (None, reason), name
        with pytest.raises(DatasetError) as e:
            read_image(tmp_path / name)
        assert str(e.value) == f"{tmp_path / name}: {reason}"


def test_label_files_that_are_not_files_or_too_large_exclude_their_image(tmp_path, no_hang):
    img = good_jpeg(tmp_path / "a.jpg")
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    r = check_file(str(img), str(fifo), 1)
    assert (r.size, r.state) == (None, "corrupt")
    assert r.reason == f"label file {fifo}: a FIFO (named pipe), not a regular file"
    big = sparse_file(tmp_path / "big.txt", 20 << 20)
    r = check_file(str(img), str(big), 1)
    assert r.size is None
    assert r.reason == (
        f"label file {big}: 20 MiB, over the limit of 4 MiB (bytes per label file); "
        "set YOLO_MAX_LABEL_BYTES to raise it"
    )
    # A label file that does not exist is still an image without objects.
    r = check_file(str(img), str(tmp_path / "none.txt"), 1)
    assert (r.size, r.state) == ((48, 32), "missing")


def test_dev_zero_in_a_list_is_a_device_whatever_its_name(tmp_path):
    r = check_file("/dev/zero", str(tmp_path / "zero.txt"), 1)
    assert (r.size, r.reason) == (None, "a character device, not a regular file")


def test_list_files_are_configuration_one_line_each(tmp_path, monkeypatch, no_hang):
    fifo = tmp_path / "train.txt"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"train\.txt: image list: a FIFO \(named pipe\)"):
        collect_image_files(fifo)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("images/caf\xe9.jpg\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.txt:1: image list is not UTF-8 text"):
        collect_image_files(latin)
    monkeypatch.setenv("YOLO_MAX_LIST_BYTES", "10")
    long = tmp_path / "long.txt"
    long.write_text("images/a.jpg\nimages/b.jpg\n")
    with pytest.raises(ConfigError, match="over the limit of 10 B .*YOLO_MAX_LIST_BYTES"):
        collect_image_files(long)


def test_a_folder_scan_with_link_loops_ends_and_lists_the_loop_named_like_an_image(tmp_path):
    d = tmp_path / "images"
    d.mkdir()
    good_jpeg(d / "a.jpg")
    (d / "back").symlink_to(d)  # a folder loop: never followed
    (d / "loop.jpg").symlink_to("loop.jpg")
    files = collect_image_files(d)
    assert [Path(f).name for f in files] == ["a.jpg", "loop.jpg"]


def test_dataset_skips_every_kind_and_reports_it(tmp_path, no_hang):
    images = tmp_path / "data" / "images"
    images.mkdir(parents=True)
    good = [good_jpeg(images / f"g{k}.jpg") for k in range(2)]
    reasons = _not_files(images)
    write_png(images / "bomb.png", 25000, 25000)
    sparse_file(images / "huge.jpg", 40 << 30)
    reasons["bomb.png"] = "image of 25000x25000 = 625000000 pixels, over the limit"
    reasons["huge.jpg"] = "40 GiB, over the limit of 512 MiB (bytes per image file)"
    lst = tmp_path / "data" / "list.txt"
    lst.write_text("".join(f"images/{n}\n" for n in ["g0.jpg", *reasons, "g1.jpg"]))
    d = LoadImagesAndLabels(lst, 64)
    assert d.img_files == [str(p) for p in good]
    report = d.report_path.read_text()
    for name, reason in reasons.items():
        assert f"{images / name}: excluded: {reason}" in report, name
    assert (
        f"{len(reasons)} images excluded for an unusable image or label file"
        in report.splitlines()[0]
    )


# ---------------------------------------------------------------------------------------------
# Mid-run: a file swapped for a FIFO or a pixel bomb after the dataset was checked


@pytest.mark.parametrize("swap", ["fifo", "bomb"])
def test_an_image_swapped_mid_run_is_replaced_never_waited_on_or_decoded(tmp_path, swap, no_hang):
    images = tmp_path / "data" / "images"
    images.mkdir(parents=True)
    files = [good_jpeg(images / f"g{k}.jpg") for k in range(3)]
    d = LoadImagesAndLabels(str(images), 64, augment=False)
    files[1].unlink()
    if swap == "fifo":
        os.mkfifo(files[1])
        why = "a FIFO (named pipe), not a regular file"
    else:
        write_png(files[1], 25000, 25000)
        why = "image of 25000x25000 = 625000000 pixels, over the limit"
    img, labels, path, _, index = d[1]
    assert isinstance(path, SubstitutePath) and path.unreadable == (str(files[1]),)
    assert index == 1 and len(labels) == 0 and img.shape == (3, 64, 64)
    with pytest.raises(DatasetError) as e:
        d._decode(1, 1.0)
    checked = "image became unreadable after the dataset was checked"
    assert e.value.message.startswith(f"{checked}: {why}")


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_orientation_of_png_and_webp_is_the_one_opencv_applies(fmt, orientation):
    """Was: 1 for every PNG and WebP (only JPEG was parsed), while OpenCV rotates them too, so
    trans_voc2yolo.py left the boxes of a sideways PNG/WebP in the stored frame."""
    raw = np.zeros((24, 40, 3), np.uint8)
    raw[3:9, 5:17] = 255
    exif = Image.Exif()
    exif[image_io.EXIF_ORIENTATION_TAG] = orientation
    buf = io.BytesIO()
    Image.fromarray(raw).save(buf, fmt, exif=exif.tobytes(), lossless=True)
    data = buf.getvalue()
    assert image_io.exif_orientation(data) == orientation
    upright = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert (upright.shape[1], upright.shape[0]) == image_io.oriented_size(40, 24, orientation)
    ys, xs = np.nonzero(upright[..., 0] > 127)
    box = image_io.orient_boxes(np.array([[5, 3, 17, 9]]), orientation, 40, 24)[0]
    np.testing.assert_allclose([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], box, atol=1)
    plain = io.BytesIO()
    Image.fromarray(raw).save(plain, fmt)
    assert image_io.exif_orientation(plain.getvalue()) == 1
    assert image_io.exif_orientation(data[:20]) == 1  # cut short: no chunk, no error


def test_a_folder_scan_enters_linked_folders_once(tmp_path):
    """Was: a dataset folder gathering its parts by links (images/cam1 -> /data/cam1) lost their
    images in silence; YOLOv5's glob('**') enters them. A folder linked twice is listed once."""
    part = tmp_path / "elsewhere" / "cam1"
    part.mkdir(parents=True)
    good_jpeg(part / "b.jpg")
    d = tmp_path / "images"
    d.mkdir()
    good_jpeg(d / "a.jpg")
    (d / "cam1").symlink_to(part)
    (d / "cam1_again").symlink_to(part)
    (d / "up").symlink_to(tmp_path)  # a loop through the parent: ends
    files = collect_image_files(d)
    assert files == [str(d / "a.jpg"), str(d / "cam1" / "b.jpg")]
