"""LoadImagesAndLabels: inputs, label checking and caching, geometry, augmentation, image cache."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import CountingArray, give_non_utf8_name
from torch.utils.data import DataLoader

from build_utils import atomic as atomic_mod
from build_utils import image_cache as cache_mod
from build_utils import labels as labels_mod
from build_utils.datasets import LoadImagesAndLabels, rect_batch_shapes, worker_init_fn
from build_utils.errors import ConfigError, DatasetError
from build_utils.image_io import exif_orientation, orient_boxes, oriented_size

HYP = {
    "hsv_h": 0.0,
    "hsv_s": 0.0,
    "hsv_v": 0.0,
    "degrees": 0.0,
    "translate": 0.0,
    "scale": 0.0,
    "shear": 0.0,
    "flipud": 0.0,
    "fliplr": 0.5,
    "mosaic": True,
}
# Unique colours that no blend of two others (or with black/grey) imitates; see
# test_augmentations.py for the construction.
_ARC = [(x, round((x - 80) ** 2 / 40)) for x in (0, 40, 80, 120, 160)]
PALETTE = [tuple(int(v) for v in np.roll([255, a, b], k)) for k in range(3) for a, b in _ARC]


def imwrite(path: Path, img: np.ndarray, params: tuple = ()) -> Path:
    """cv2.imwrite that works for non-ASCII paths and creates folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ok, buf = cv2.imencode(
        path.suffix.lower() if path.suffix.lower() != ".jpeg" else ".jpg", img, list(params)
    )
    assert ok
    buf.tofile(str(path))
    return path


def scene(w: int, h: int, boxes: list[tuple[int, int, int, int, int]]) -> tuple[np.ndarray, str]:
    """Black BGR image with filled rectangles ``(colour, x1, y1, x2, y2)`` (pixel edges) and the
    matching label text (class = colour index)."""
    img = np.zeros((h, w, 3), np.uint8)
    lines = []
    for k, x1, y1, x2, y2 in boxes:
        img[y1:y2, x1:x2] = PALETTE[k]
        lines.append(
            f"{k} {(x1 + x2) / 2 / w:.8f} {(y1 + y2) / 2 / h:.8f} {(x2 - x1) / w:.8f} "
            f"{(y2 - y1) / h:.8f}"
        )
    return img, "\n".join(lines) + "\n"


def add_image(
    root: Path,
    name: str,
    img: np.ndarray,
    label: str | None,
    split: str = "train",
    params: tuple = (),
) -> Path:
    p = imwrite(root / split / "images" / name, img, params)
    if label is not None:
        lp = root / split / "labels" / (Path(name).stem + ".txt")
        lp.parent.mkdir(parents=True, exist_ok=True)
        lp.write_text(label)
    return p


def write_list(path: Path, entries: list[str]) -> Path:
    path.write_text("".join(e + "\n" for e in entries))
    return path


def small_dataset(root: Path, n: int = 6, seed: int = 0) -> Path:
    """``n`` images with 1-3 coloured rectangles each; returns the list file."""
    rng = np.random.default_rng(seed)
    names = []
    for i in range(n):
        w, h = int(rng.integers(60, 140)), int(rng.integers(60, 140))
        boxes = []
        for j in range(int(rng.integers(1, 4))):
            bw, bh = int(rng.integers(10, 24)), int(rng.integers(10, 24))
            x1 = 4 + j * (w // 3)
            y1 = int(rng.integers(2, h - bh - 2))
            boxes.append(((3 * i + j) % len(PALETTE), x1, y1, min(x1 + bw, w - 2), y1 + bh))
        img, label = scene(w, h, boxes)
        add_image(root, f"im{i}.png", img, label)
        names.append(f"train/images/im{i}.png")
    return write_list(root / "train.txt", names)


def colour_mask(img_rgb_chw: torch.Tensor | np.ndarray, k: int) -> np.ndarray:
    img = (
        img_rgb_chw.numpy().transpose(1, 2, 0)[:, :, ::-1]
        if isinstance(img_rgb_chw, torch.Tensor)
        else img_rgb_chw
    )
    return np.abs(img.astype(np.int16) - PALETTE[k]).max(axis=2) <= 8


def boxes_px(labels: torch.Tensor, w: int, h: int) -> np.ndarray:
    """(n, 6) normalised dataset labels -> (n, 5) class + xyxy pixels."""
    lb = labels.numpy().astype(np.float64)
    out = np.empty((len(lb), 5))
    out[:, 0] = lb[:, 1]
    out[:, 1] = (lb[:, 2] - lb[:, 4] / 2) * w
    out[:, 2] = (lb[:, 3] - lb[:, 5] / 2) * h
    out[:, 3] = (lb[:, 2] + lb[:, 4] / 2) * w
    out[:, 4] = (lb[:, 3] + lb[:, 5] / 2) * h
    return out


# ---------------------------------------------------------------------------------------------
# Inputs


def test_list_folder_relative_and_mixed_inputs(tmp_path, monkeypatch):
    img = np.full((40, 50, 3), 90, np.uint8)
    names = ["a.jpg", "b.PNG", "c.bmp", "d.tif", "e.webp", "f.JPEG", "g.tiff", "ü ñ.jpg"]
    for n in names:
        add_image(tmp_path, n, img, "0 0.5 0.5 0.2 0.2\n")
    (tmp_path / "train" / "images" / "notes.txt").write_text("not an image")
    sub = add_image(tmp_path, "sub/h.png", img, None)  # nested folder, no label file
    lst = write_list(
        tmp_path / "train.txt",
        [
            f"train/images/{names[0]}",
            f"./train/images/{names[1]}",
            str(tmp_path / "train" / "images" / names[2]),
        ],
    )
    d = LoadImagesAndLabels(str(lst), 64)
    assert [Path(f).name for f in d.img_files] == names[:3]
    assert all(Path(f).is_absolute() for f in d.img_files)
    assert d.label_files[1] == str(tmp_path / "train" / "labels" / "b.txt")

    folder = LoadImagesAndLabels(tmp_path / "train" / "images", 64)
    assert sorted(Path(f).name for f in folder.img_files) == sorted([*names, "h.png"])
    assert folder.cache_path.name == "train.cache.npz"  # named after the split, not "images"
    assert folder.label_files[folder.img_files.index(str(sub))].endswith(
        os.path.join("labels", "sub", "h.txt")
    )

    both = LoadImagesAndLabels([lst, str(sub)], 64)
    assert len(both) == 4
    monkeypatch.chdir(tmp_path)  # the lineage wrote lists relative to the current directory
    lst2 = write_list(tmp_path / "train" / "other.txt", [f"train/images/{names[3]}"])
    assert len(LoadImagesAndLabels(lst2, 64)) == 1


def test_missing_or_empty_inputs_raise(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        LoadImagesAndLabels(tmp_path / "nope.txt")
    with pytest.raises(DatasetError, match="no images"):
        LoadImagesAndLabels(write_list(tmp_path / "empty.txt", []))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DatasetError, match="expected a .txt list"):
        LoadImagesAndLabels(tmp_path / "x.csv")
    with pytest.raises(ConfigError, match="hyp"):
        LoadImagesAndLabels(tmp_path, augment=True)
    with pytest.raises(ConfigError, match="lacks"):
        LoadImagesAndLabels(tmp_path, augment=True, hyp={"hsv_h": 0.1})
    with pytest.raises(ConfigError, match="mosaic_buffer"):
        LoadImagesAndLabels(tmp_path, mosaic_buffer=-1)
    with pytest.raises(ConfigError, match="img_size"):
        LoadImagesAndLabels(tmp_path, img_size=0)
    with pytest.raises(ConfigError, match="cache_images"):
        LoadImagesAndLabels(small_dataset(tmp_path / "s"), cache_images="gpu")


# ---------------------------------------------------------------------------------------------
# Label checking


def _jpeg_with_exif(img: np.ndarray, orientation: int) -> bytes:
    """JPEG bytes with an APP1 EXIF segment holding only the orientation tag."""
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    app1 = b"Exif\x00\x00" + tiff
    data = buf.tobytes()
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + data[2:]


def test_bad_inputs_are_excluded_and_reported(tmp_path, caplog):
    good = np.full((48, 64, 3), 100, np.uint8)
    ok_label = "0 0.5 0.5 0.25 0.25\n"
    add_image(tmp_path, "good.jpg", good, ok_label)
    add_image(tmp_path, "nolabel.jpg", good, None)
    add_image(tmp_path, "empty.jpg", good, "")
    add_image(tmp_path, "badlines.jpg", good, ok_label + "0 2.0 0.5 0.1 0.1\n" + ok_label)
    zero = tmp_path / "train" / "images" / "zero.jpg"
    zero.write_bytes(b"")
    (tmp_path / "train" / "labels" / "zero.txt").write_text(ok_label)
    data = imwrite(tmp_path / "full.jpg", good).read_bytes()
    (tmp_path / "train" / "images" / "trunc.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "train" / "images" / "junk.png").write_bytes(b"\x89PNG not really" * 10)
    add_image(tmp_path, "badlabel.jpg", good, None)
    (tmp_path / "train" / "labels" / "badlabel.txt").write_bytes(b"\xff\xfe\x00garbage")
    lst = write_list(
        tmp_path / "train.txt",
        [
            "train/images/good.jpg",
            "train/images/nolabel.jpg",
            "train/images/empty.jpg",
            "train/images/badlines.jpg",
            "train/images/zero.jpg",
            "train/images/trunc.jpg",
            "train/images/junk.png",
            "train/images/badlabel.jpg",
            "train/images/missing.jpg",
            "train/images/readme.gif",
        ],
    )
    with caplog.at_level(logging.INFO, logger="build_utils.datasets"):
        d = LoadImagesAndLabels(lst, 64, nc=1)
    assert [Path(f).name for f in d.img_files] == [
        "good.jpg",
        "nolabel.jpg",
        "empty.jpg",
        "badlines.jpg",
    ]
    assert [len(lb) for lb in d.labels] == [1, 0, 0, 1]
    summary = [r.message for r in caplog.records if "images:" in r.message]
    assert len(summary) == 1
    assert (
        "10 images: 2 label files found, 1 missing, 1 empty, 6 images excluded for an unusable "
        "image or label file, "
        "1 duplicate rows and 1 bad label lines dropped"
    ) in summary[0]
    assert caplog.records[-1].levelno == logging.WARNING
    report = d.report_path.read_text()
    for reason in [
        "zero.jpg: excluded: zero-byte image file",
        "trunc.jpg: excluded: truncated JPEG",
        "junk.png: excluded: not a readable image",
        "badlabel.jpg: excluded: label file",
        "missing.jpg: excluded: image file not found",
        "readme.gif: excluded: not an image file type",
        "badlines.txt:2: dropped: coordinate outside [0, 1]",
        "badlines.txt:3: dropped: duplicate",
    ]:
        assert reason in report, reason
    assert d.report_path.parent == d.cache_path.parent


def test_no_usable_image_raises_with_the_counts(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"")
    with pytest.raises(DatasetError, match="no usable image: 1 images: .* 1 images excluded"):
        LoadImagesAndLabels(tmp_path / "images")


def test_grey_rgba_16bit_and_exif_images(tmp_path):
    grey = np.zeros((30, 40), np.uint8)
    grey[:, :20] = 200
    add_image(tmp_path, "grey.png", grey, "")
    rgba = np.zeros((30, 40, 4), np.uint8)
    rgba[..., 2] = 255  # red in BGR(A)
    rgba[..., 3] = 10  # mostly transparent: the colour is kept, the alpha dropped
    add_image(tmp_path, "rgba.png", rgba, "")
    deep = np.full((30, 40, 3), 0x1234, np.uint16)
    deep[..., 0] = 0xFF00  # blue channel (BGR) near full scale
    add_image(tmp_path, "deep.png", deep, "")
    # A sideways phone photo: stored 60 wide x 30 high with orientation 6 (rotate 90 clockwise);
    # a box in the stored top-left corner appears top-right when upright.
    raw = np.zeros((30, 60, 3), np.uint8)
    raw[:10, :20] = (0, 0, 255)
    exif = tmp_path / "train" / "images" / "exif.jpg"
    exif.write_bytes(_jpeg_with_exif(raw, 6))
    box = orient_boxes(np.array([[0, 0, 20, 10]]), 6, 60, 30)[0]
    w, h = oriented_size(60, 30, 6)
    (tmp_path / "train" / "labels" / "exif.txt").write_text(
        f"0 {(box[0] + box[2]) / 2 / w} {(box[1] + box[3]) / 2 / h} {(box[2] - box[0]) / w} "
        f"{(box[3] - box[1]) / h}\n"
    )
    d = LoadImagesAndLabels(tmp_path / "train" / "images", 64)
    by_name = {Path(f).name: i for i, f in enumerate(d.img_files)}
    assert d.shapes[by_name["exif.jpg"]].tolist() == [30, 60]  # upright (w, h)
    for name, rgb in [
        ("grey.png", (200, 200, 200)),
        ("rgba.png", (255, 0, 0)),
        ("deep.png", (0x12, 0x12, 0xFF)),
    ]:
        img = d[by_name[name]][0]
        assert img.shape == (3, 64, 64) and img.dtype == torch.uint8
        assert tuple(img[:, 32, 5].tolist()) == rgb, name  # RGB order
    img, labels, *_ = d[by_name["exif.jpg"]]
    red = (img[0] > 150) & (img[1] < 80)
    ys, xs = np.nonzero(red.numpy())
    b = boxes_px(labels, 64, 64)[0]
    np.testing.assert_allclose([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], b[1:], atol=1.5)
    assert exif_orientation(exif.read_bytes()) == 6


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_boxes_agrees_with_opencv(orientation):
    raw = np.zeros((24, 40, 3), np.uint8)
    raw[3:9, 5:17] = 255
    data = _jpeg_with_exif(raw, orientation)
    assert exif_orientation(data) == orientation
    upright = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert (upright.shape[1], upright.shape[0]) == oriented_size(40, 24, orientation)
    ys, xs = np.nonzero(upright[..., 0] > 127)
    box = orient_boxes(np.array([[5, 3, 17, 9]]), orientation, 40, 24)[0]
    np.testing.assert_allclose([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], box, atol=1)


# ---------------------------------------------------------------------------------------------
# Geometry


@pytest.mark.parametrize("rect", [False, True])
def test_letterboxed_box_lands_where_the_label_says(tmp_path, rect):
    specs = [
        (90, 60, (2, 20, 10, 70, 50)),
        (50, 120, (5, 10, 40, 45, 100)),
        (300, 200, (7, 100, 50, 260, 190)),
        (1300, 600, (9, 200, 100, 1000, 500)),
    ]
    names = []
    for i, (w, h, box) in enumerate(specs):
        img, label = scene(w, h, [box])
        add_image(
            tmp_path,
            f"{i}.jpg" if i == 3 else f"{i}.png",
            img,
            label,
            params=(cv2.IMWRITE_JPEG_QUALITY, 100) if i == 3 else (),
        )
        names.append(f"train/images/{i}.jpg" if i == 3 else f"train/images/{i}.png")
    d = LoadImagesAndLabels(write_list(tmp_path / "train.txt", names), 128, batch_size=2, rect=rect)
    for i in range(len(d)):
        img, labels, path, shapes, index = d[i]
        assert index == i and path == d.img_files[i]
        H, W = img.shape[1:]
        if rect:
            assert tuple(d.batch_shapes[d.batch[i]]) == (H, W)
        else:
            assert (H, W) == (128, 128)
        k, x1, y1, x2, y2 = boxes_px(labels, W, H)[0]
        mask = colour_mask(img, int(k))
        ys, xs = np.nonzero(mask)
        # The big JPEG is decoded at reduced size and JPEG blurs edges: 1.5 px there.
        tol = 1.5 if path.endswith(".jpg") else 1.0
        np.testing.assert_allclose(
            [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], [x1, y1, x2, y2], atol=tol
        )
        # shapes maps the output back to the original image.
        (h0, w0), ((rh, rw), (padw, padh)) = shapes
        orig = d.labels[i][0, 1:] * [w0, h0, w0, h0]
        back = [(x1 - padw) / rw, (y1 - padh) / rh, (x2 - padw) / rw, (y2 - padh) / rh]
        want = [
            orig[0] - orig[2] / 2,
            orig[1] - orig[3] / 2,
            orig[0] + orig[2] / 2,
            orig[1] + orig[3] / 2,
        ]
        np.testing.assert_allclose(back, want, atol=1e-3 * max(w0, h0))


def test_rect_batches_sorted_by_aspect_ratio(tmp_path):
    sizes = [(100, 50), (50, 100), (80, 80), (120, 40), (40, 60), (90, 45)]  # (w, h)
    names = []
    for i, (w, h) in enumerate(sizes):
        add_image(tmp_path, f"{i}.png", np.zeros((h, w, 3), np.uint8), "")
        names.append(f"train/images/{i}.png")
    lst = write_list(tmp_path / "train.txt", names)
    d = LoadImagesAndLabels(lst, 128, batch_size=2, rect=True)
    ar = d.shapes[:, 1] / d.shapes[:, 0]
    assert (np.diff(ar) >= 0).all()
    # Ties (100x50 and 90x45) keep list order: a stable sort, the same on every rank.
    assert [Path(f).name for f in d.img_files] == [
        "3.png",
        "0.png",
        "5.png",
        "2.png",
        "4.png",
        "1.png",
    ]
    np.testing.assert_array_equal(d.batch, [0, 0, 1, 1, 2, 2])
    # batch 0: h/w 1/3 and 1/2 -> [0.5, 1] * 128 -> (64, 128); batch 1: 1/2, 1 -> (128, 128);
    # batch 2: 1.5, 2 -> [1, 1/1.5] -> (128, 96)
    np.testing.assert_array_equal(d.batch_shapes, [[64, 128], [128, 128], [128, 96]])
    batch = LoadImagesAndLabels.collate_fn([d[4], d[5]])
    assert batch[0].shape == (2, 3, 128, 96)


def _rect_shapes_per_batch(aspect: np.ndarray, batch_size: int) -> np.ndarray:
    """The lineage's rule, batch by batch: the reference for rect_batch_shapes."""
    out = []
    for start in range(0, len(aspect), batch_size):
        part = aspect[start : start + batch_size]
        lo, hi = part.min(), part.max()
        out.append([hi, 1] if hi < 1 else [1, 1 / lo] if lo > 1 else [1, 1])
    return np.array(out, dtype=np.float64).reshape(-1, 2)


@pytest.mark.parametrize("n, batch_size", [(1, 4), (7, 3), (64, 8), (101, 16)])
def test_rect_batch_shapes_equal_the_per_batch_rule(n, batch_size):
    rng = np.random.default_rng(n)
    # Sorted h/w with wide, square and tall batches, ties at exactly 1, and a ragged last batch.
    aspect = np.sort(np.concatenate((rng.uniform(0.3, 3.0, n - n // 4), np.ones(n // 4))))
    np.testing.assert_array_equal(
        rect_batch_shapes(aspect, batch_size), _rect_shapes_per_batch(aspect, batch_size)
    )


def test_rect_batch_shapes_read_the_ratios_a_few_times_not_once_per_batch(monkeypatch):
    # 100k images in batches of 16 took 0.5 s (a mask over all images per batch: quadratic);
    # 4,096 images in batches of 2 would read 2,048 x 4,096 elements that way.
    n = 4096
    aspect = np.linspace(0.5, 2.0, n).view(CountingArray)
    monkeypatch.setattr(CountingArray, "read", 0)
    shapes = rect_batch_shapes(aspect, 2)
    assert shapes.shape == (n // 2, 2)
    assert 0 < CountingArray.read <= 8 * n


def test_labels_follow_their_images_in_every_order(tmp_path):
    lst = small_dataset(tmp_path, n=7)
    for rect in (False, True, False):
        d = LoadImagesAndLabels(lst, 96, batch_size=3, rect=rect)
        for f, lf, lb in zip(d.img_files, d.label_files, d.labels):
            assert Path(lf).stem == Path(f).stem
            np.testing.assert_allclose(lb, np.loadtxt(lf, ndmin=2), atol=1e-6)


def test_deterministic_order_hash_and_samples(tmp_path):
    lst = small_dataset(tmp_path, n=8)
    a = LoadImagesAndLabels(lst, 96, augment=True, hyp=HYP)
    b = LoadImagesAndLabels(lst, 96, augment=True, hyp=HYP)
    assert a.img_files == b.img_files and a.content_hash == b.content_hash
    torch.manual_seed(3)
    xa = [a[i] for i in range(4)]
    torch.manual_seed(3)
    xb = [b[i] for i in range(4)]
    for s, t in zip(xa, xb):
        assert torch.equal(s[0], t[0]) and torch.equal(s[1], t[1])
    assert LoadImagesAndLabels(lst, 96, single_cls=True).content_hash != a.content_hash


def test_single_cls_folds_classes(tmp_path):
    d = LoadImagesAndLabels(small_dataset(tmp_path), 96, single_cls=True)
    assert all((lb[:, 0] == 0).all() for lb in d.labels)
    assert sum(len(lb) for lb in d.labels) > len(d)
    # With the collapsed class count (nc=1, as training and validation.py pass it under
    # --single-cls) no object of a class >= 1 is dropped: the same boxes as without folding.
    one = LoadImagesAndLabels(small_dataset(tmp_path), 96, single_cls=True, nc=1)
    every = LoadImagesAndLabels(small_dataset(tmp_path), 96)
    assert any((lb[:, 0] > 0).any() for lb in every.labels)
    for a, b in zip(one.labels, every.labels, strict=True):
        np.testing.assert_array_equal(a[:, 1:], b[:, 1:])


def test_coco_index_reads_no_pixels(tmp_path, monkeypatch):
    d = LoadImagesAndLabels(small_dataset(tmp_path), 96)
    monkeypatch.setattr(d, "load_image", lambda *a: pytest.fail("pixels were read"))
    labels, (h0, w0) = d.coco_index(2)
    np.testing.assert_array_equal(labels, d.labels[2])
    assert (w0, h0) == tuple(d.shapes[2])


def test_collate_fills_the_batch_index(tmp_path):
    d = LoadImagesAndLabels(small_dataset(tmp_path), 96)
    imgs, targets, paths, shapes, indices = LoadImagesAndLabels.collate_fn([d[0], d[1], d[2]])
    assert imgs.shape == (3, 3, 96, 96) and imgs.dtype == torch.uint8
    counts = [len(d.labels[i]) for i in range(3)]
    assert targets.shape == (sum(counts), 6)
    np.testing.assert_array_equal(targets[:, 0].numpy(), np.repeat([0, 1, 2], counts))
    assert paths == tuple(d.img_files[:3]) and indices == (0, 1, 2) and len(shapes) == 3


# ---------------------------------------------------------------------------------------------
# Caches


def test_label_cache_reuse_and_invalidation(tmp_path, monkeypatch, caplog):
    lst = small_dataset(tmp_path)
    calls = []
    real = labels_mod.build_label_cache
    monkeypatch.setattr(
        labels_mod, "build_label_cache", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    d = LoadImagesAndLabels(lst, 96)
    assert len(calls) == 1 and d.cache_path.is_file() and d.cache_path.name == "train.cache.npz"
    LoadImagesAndLabels(lst, 96)
    assert len(calls) == 1  # reused
    LoadImagesAndLabels(lst, 96, nc=80)
    assert len(calls) == 2  # the class count is part of the key

    label = Path(d.label_files[0])
    label.write_text("0 0.5 0.5 0.5 0.5\n")
    os.utime(label, ns=(1, 1))  # even with an old timestamp: the size differs
    d2 = LoadImagesAndLabels(lst, 96, nc=80)
    assert len(calls) == 3
    np.testing.assert_allclose(d2.labels[0], [[0, 0.5, 0.5, 0.5, 0.5]])
    assert d2.content_hash != d.content_hash

    d2.cache_path.write_bytes(b"not a zip file")
    with caplog.at_level(logging.WARNING, logger="build_utils.labels"):
        LoadImagesAndLabels(lst, 96, nc=80)
    assert len(calls) == 4 and "unreadable" in caplog.text
    # Random bytes: numpy reads them as a pickle and advises allow_pickle; never said here.
    caplog.clear()
    d2.cache_path.write_bytes(bytes(range(256)) * 12)
    with caplog.at_level(logging.WARNING, logger="build_utils.labels"):
        LoadImagesAndLabels(lst, 96, nc=80)
    assert len(calls) == 5 and "not a .npz file: corrupt" in caplog.text
    assert "pickle" not in caplog.text

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")

    caplog.clear()
    monkeypatch.setattr(atomic_mod, "_open_temp", read_only)  # no file can be created
    with caplog.at_level(logging.WARNING, logger="build_utils.labels"):
        d3 = LoadImagesAndLabels(lst, 96, nc=3)
    assert len(d3) == len(d) and "cannot write label cache" in caplog.text


def test_train_and_val_caches_do_not_collide(tmp_path):
    lst = small_dataset(tmp_path, n=6)
    names = lst.read_text().split()
    tr = LoadImagesAndLabels(write_list(tmp_path / "a.txt", names[:4]), 96)
    va = LoadImagesAndLabels(write_list(tmp_path / "b.txt", names[4:]), 96)
    assert tr.cache_path != va.cache_path
    assert len(LoadImagesAndLabels(tmp_path / "a.txt", 96)) == 4
    assert len(LoadImagesAndLabels(tmp_path / "b.txt", 96)) == 2


def test_image_cache_in_ram_and_on_disk(tmp_path, monkeypatch, caplog):
    lst = small_dataset(tmp_path)
    plain = LoadImagesAndLabels(lst, 96)
    ram = LoadImagesAndLabels(lst, 96, cache_images=True)
    disk = LoadImagesAndLabels(lst, 96, cache_images="disk")
    npys = list(disk.cache_path.parent.glob("train.img96/*.npy"))
    assert len(npys) == len(plain)
    disk2 = LoadImagesAndLabels(lst, 96, cache_images="disk")
    for i in range(len(plain)):
        a = plain[i][0]
        assert torch.equal(a, ram[i][0]) and torch.equal(a, disk[i][0])
        assert torch.equal(a, disk2[i][0])
    # A folder where one cache file goes: that image is decoded, the others still cached
    # (was: "cannot write the image cache", every image decoded in every run).
    taken, *others = sorted(npys)
    taken.unlink()
    taken.mkdir()
    for npy in others:
        npy.unlink()
    disk3 = LoadImagesAndLabels(lst, 96, cache_images="disk")
    assert taken.is_dir() and all(npy.is_file() for npy in others)
    assert sum(p is None for p in disk3._npy_files) == 1
    for i in range(len(plain)):
        assert torch.equal(plain[i][0], disk3[i][0])
    # A cache folder linked elsewhere (another disk) is used, and said where it writes.
    elsewhere = tmp_path / "elsewhere"
    shutil.move(taken.parent, elsewhere)
    taken.parent.symlink_to(elsewhere)
    with caplog.at_level(logging.INFO, logger="build_utils.image_cache"):
        LoadImagesAndLabels(lst, 96, cache_images="disk")
    assert f"image cache {taken.parent} is a link: writing into {elsewhere}" in caplog.messages
    # Filled later (as bench/bench_scale.py does): the same.
    later = LoadImagesAndLabels(lst, 96)
    later.cache_in_ram()
    assert later.ram_cache_bytes() == ram.ram_cache_bytes() > 0
    for i in range(len(plain)):
        assert torch.equal(plain[i][0], later[i][0])
    monkeypatch.setattr(cache_mod, "available_memory_bytes", lambda: 1000)
    with pytest.raises(DatasetError, match="cache_images='disk'"):
        LoadImagesAndLabels(lst, 96, cache_images="ram")


def test_a_file_name_that_is_not_utf8_is_loaded_and_cached_on_disk(tmp_path):
    """Was: UnicodeEncodeError hashing such a name (b"bad\\xe9name.png") for the dataset's
    content hash and its .npy cache file. Now both hash its bytes and the image is used."""
    lst = small_dataset(tmp_path, n=2)
    folder = lst.parent / "train" / "images"
    bad = give_non_utf8_name(folder / "im0.png")
    plain = LoadImagesAndLabels(folder, 96)
    disk = LoadImagesAndLabels(folder, 96, cache_images="disk")
    assert disk.img_files == [str(bad), str(folder / "im1.png")]
    assert len(list(disk.cache_path.parent.glob("train.img96/*.npy"))) == 2
    assert disk.content_hash == plain.content_hash
    assert torch.equal(plain[0][0], disk[0][0]) and len(plain[0][1]) > 0


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_caches_live_beside_the_list_even_when_entries_point_elsewhere(tmp_path):
    """A list whose entries traverse out of its folder (``../../``) still loads, and the label
    cache, its report and the disk image cache are written beside the list, nowhere else."""
    outside = tmp_path / "outside"
    small_dataset(outside, n=4)
    names = (outside / "train.txt").read_text().split()
    ds = tmp_path / "a" / "b" / "ds"
    ds.mkdir(parents=True)
    lst = write_list(ds / "mine.txt", [f"../../../outside/{n}" for n in names])
    before = _tree(tmp_path)
    d = LoadImagesAndLabels(lst, 96, cache_images="disk")
    assert len(d) == 4 and d.img_files[0].startswith(str(outside))
    new = _tree(tmp_path) - before
    assert d.cache_path == ds / "mine.cache.npz" and d.report_path == ds / "mine.cache_report.txt"
    assert {p.split(os.sep)[0] for p in new} == {"a"}, sorted(new)
    assert {p for p in new if not p.endswith(".npy")} == {
        os.path.join("a", "b", "ds", n)
        for n in ("mine.cache.npz", "mine.cache_report.txt", "mine.img96")
    }, sorted(new)
    # A folder named as the source: beside the folder, named after it.
    f = LoadImagesAndLabels(outside / "train" / "images", 96)
    assert f.cache_path == outside / "train" / "train.cache.npz"


def test_disk_image_cache_file_that_disagrees_is_rebuilt(tmp_path, caplog):
    """An ``.npy`` whose header disagrees with its image (another shape, dtype, a truncated file,
    a huge declared array) is never served: rewritten when the cache is filled (with a warning),
    decoded instead when it goes bad later."""
    lst = small_dataset(tmp_path, n=3)
    plain = LoadImagesAndLabels(lst, 96)
    disk = LoadImagesAndLabels(lst, 96, cache_images="disk")
    npys = disk._npy_files
    with open(npys[0], "wb") as f:
        np.save(f, np.zeros((5, 5, 3), np.uint8))
    with open(npys[1], "wb") as f:  # a header declaring 3 TB, no data
        header = {"descr": "|u1", "fortran_order": False, "shape": (10**6, 10**6, 3)}
        np.lib.format.write_array_header_1_0(f, header)
    npys[2].write_bytes(npys[2].read_bytes()[:-10])  # truncated
    with caplog.at_level(logging.WARNING, logger="build_utils.image_cache"):
        again = LoadImagesAndLabels(lst, 96, cache_images="disk")
    assert "3 image cache file(s)" in caplog.text and "disagree with their image" in caplog.text
    for i in range(3):
        assert cache_mod.npy_problem(npys[i], again._cached_shape(i)) is None
        assert torch.equal(plain[i][0], again[i][0])
    with open(npys[0], "wb") as f:  # goes bad while training: decoded instead, with a warning
        np.save(f, np.zeros((5, 5, 3), np.float32))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="build_utils.image_cache"):
        assert torch.equal(plain[0][0], again[0][0])
    assert "expected uint8" in caplog.text
    npys[1].write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': '|u1', (")  # garbled header
    assert torch.equal(plain[1][0], again[1][0])
    assert "garbled .npy header" in caplog.text


def test_ram_cache_check_counts_the_processes_of_the_node(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "available_memory_bytes", lambda: 10_000)
    cache_mod.check_ram_cache_fits(1500, 5, procs=4)
    with pytest.raises(DatasetError, match=r"needs 0\.0 GB x 8 process\(es\)"):
        cache_mod.check_ram_cache_fits(1500, 5, procs=8)
    # The dataset counts the copies its caller announces (train_utils passes the processes per
    # node, from LOCAL_WORLD_SIZE or SLURM); build_utils reads no environment for it.
    lst = small_dataset(tmp_path)
    need = LoadImagesAndLabels(lst, 96).ram_cache_bytes()
    monkeypatch.setattr(cache_mod, "available_memory_bytes", lambda: 4 * need)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert len(LoadImagesAndLabels(lst, 96, cache_images="ram")) > 0
    with pytest.raises(DatasetError, match="x 8 process"):
        LoadImagesAndLabels(lst, 96, cache_images="ram", ram_cache_copies=8)
    with pytest.raises(ConfigError, match="ram_cache_copies must be a positive integer"):
        LoadImagesAndLabels(lst, 96, ram_cache_copies=0)


# ---------------------------------------------------------------------------------------------
# Augmentation through the dataset


def _check_labels_on_objects(img: torch.Tensor, labels: torch.Tensor, tol: float) -> None:
    """Each label box holds its colour and hugs it (when not cut by the border); every pixel of
    a labelled colour lies in one of that colour's boxes (a mosaic may show an image twice)."""
    H, W = img.shape[1:]
    boxes = boxes_px(labels, W, H)
    for k in np.unique(boxes[:, 0]).astype(int):
        ys, xs = np.nonzero(colour_mask(img, k))
        covered = np.zeros(len(xs), bool)
        for _, x1, y1, x2, y2 in boxes[boxes[:, 0] == k]:
            near = (xs + 0.5 >= x1 - tol) & (xs + 0.5 <= x2 + tol)
            near &= (ys + 0.5 >= y1 - tol) & (ys + 0.5 <= y2 + tol)
            assert near.any(), f"label {k} has none of its colour"
            covered |= near
            if x1 > 2 and y1 > 2 and x2 < W - 2 and y2 < H - 2:  # uncut: the box hugs it
                bx, by = xs[near], ys[near]
                assert abs(bx.min() - x1) <= tol + 1 and abs(bx.max() + 1 - x2) <= tol + 1
                assert abs(by.min() - y1) <= tol + 1 and abs(by.max() + 1 - y2) <= tol + 1
        assert covered.all(), f"pixels of colour {k} outside its boxes"


@pytest.mark.parametrize("mode", ["mosaic", "mosaic-affine", "single", "rect"])
def test_augmented_samples_keep_labels_on_objects(tmp_path, mode):
    lst = small_dataset(tmp_path, n=5, seed=1)  # 5 x up to 3 boxes: unique colours
    hyp = dict(HYP, flipud=0.5, mosaic=mode.startswith("mosaic"))
    if mode == "mosaic-affine":
        hyp.update(scale=0.3, translate=0.1)  # axis-aligned: boxes stay exact
    if mode == "single":
        hyp.update(degrees=0.0, scale=0.4, translate=0.2)
    d = LoadImagesAndLabels(
        lst, 96, batch_size=4, augment=True, hyp=hyp, rect=mode == "rect", mosaic_buffer=4
    )
    torch.manual_seed(0)
    n_labels = 0
    for i in list(range(len(d))) * 2:
        img, labels, _, shapes, _ = d[i]
        assert (shapes is None) == mode.startswith("mosaic")
        _check_labels_on_objects(img, labels, tol=2.5)
        n_labels += len(labels)
    assert n_labels > len(d)
    if mode.startswith("mosaic"):
        assert len(d._buffer) == 4  # the buffer stays at its size


def test_hsv_and_rotation_through_the_dataset(tmp_path):
    lst = small_dataset(tmp_path, n=6, seed=2)
    hyp = dict(HYP, hsv_h=0.0138, hsv_s=0.678, hsv_v=0.36, degrees=10.0, shear=2.0)
    d = LoadImagesAndLabels(lst, 96, augment=True, hyp=hyp)
    torch.manual_seed(1)
    grey_levels = set()
    for i in range(len(d)):
        img, labels, *_ = d[i]
        assert img.shape == (3, 96, 96)
        assert ((labels[:, 2:] >= 0) & (labels[:, 2:] <= 1)).all()
        r, g, b = img.numpy().astype(int)
        grey = (r == g) & (g == b) & (r > 40) & (r < 230)  # the padding, jittered by hsv_v
        grey_levels.update(np.unique(r[grey]).tolist())
    assert len(grey_levels) > 1


def test_dataloader_with_workers(shapes_data):
    lst = shapes_data.parent / "train.txt"
    d = LoadImagesAndLabels(lst, 128, batch_size=4, augment=True, hyp=dict(HYP, hsv_v=0.3), nc=5)
    loader = DataLoader(
        d,
        batch_size=4,
        num_workers=2,
        collate_fn=d.collate_fn,
        worker_init_fn=worker_init_fn,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    seen = 0
    for imgs, targets, paths, _, _ in loader:
        assert imgs.shape == (4, 3, 128, 128) and imgs.dtype == torch.uint8
        assert targets.shape[1] == 6 and set(targets[:, 0].tolist()) <= {0, 1, 2, 3}
        assert ((targets[:, 1] >= 0) & (targets[:, 1] < 5)).all()
        seen += len(paths)
    assert seen == len(d)


def test_a_worker_leaves_ctrl_c_and_sigterm_to_the_training_process() -> None:
    """Was: a process-group SIGTERM killed the workers, and the loader printed "Exception
    ignored ... DataLoader worker (pid N) is killed by signal: Terminated" after the run's
    "interrupted" line."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        worker_init_fn(0)
        assert {s: signal.getsignal(s) for s in before} == dict.fromkeys(before, signal.SIG_IGN)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
