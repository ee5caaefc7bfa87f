"""Reliability, bad data: a corpus of broken images, labels and list entries, built here in
tmp_path, run through the real entry points (``train.py`` as a process, ``validation.py``,
``predict.py`` and ``tools/kmeans_anchors.py`` through their ``main``), plus the resource limits
(RAM image cache, 20,000-file label scan, dense evaluation output).

Expected outcome for every data problem: the file is skipped (or the label line dropped) and
reported with its reason, training runs to completion on every good image, and no traceback
reaches the user. docs/RELIABILITY.md lists the cases and the tests that prove them.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import struct
import sys
import time
import tracemalloc
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import warm_python
from conftest import train_argv, validation_argv
from torch import nn

import predict
import validation
from build_utils import datasets as ds_mod
from build_utils import image_cache as cache_mod
from build_utils import labels as labels_mod
from build_utils.boxes import non_max_suppression
from build_utils.datasets import LoadImagesAndLabels
from build_utils.labels import build_label_cache
from build_utils.parse_config import parse_model_cfg
from models.darknet import Darknet
from tools import kmeans_anchors
from train_utils.checkpoint import load_checkpoint
from train_utils.data_loaders import make_eval_dataset, make_eval_loader
from train_utils.engine import predict_batches
from train_utils.evaluation.coco_gt import get_coco_api_from_dataset
from train_utils.evaluation.options import MAX_DET, EvalOptions

REPO = Path(__file__).resolve().parents[2]
NANO = REPO / "cfg" / "yolov3-spp-nano.cfg"
NC = 3
GOOD_LABEL = "0 0.5 0.5 0.3 0.3\n"
SHELL_NAME = "$(touch pwned).jpg"  # a real image whose name a shell would execute


# ---------------------------------------------------------------------------------------------
# Corpus builders


def _pixels(w: int, h: int, seed: int, channels: int = 3, dtype=np.uint8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hi = 256 if dtype == np.uint8 else 65536
    shape = (h, w) if channels == 1 else (h, w, channels)
    img = rng.integers(0, hi, size=shape).astype(dtype)
    img[h // 4 : 3 * h // 4, w // 4 : 3 * w // 4] = hi - 1  # an "object" in the middle
    return img


def _encode(img: np.ndarray, ext: str) -> bytes:
    ok, buf = cv2.imencode(ext, img)
    assert ok, ext
    return buf.tobytes()


def _jpeg_with_exif(img: np.ndarray, orientation: int) -> bytes:
    """JPEG bytes with an APP1 Exif segment holding only the orientation tag (the format that
    ``build_utils.image_io.exif_orientation`` reads)."""
    data = _encode(img, ".jpg")
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    app1 = b"Exif\x00\x00" + tiff
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + data[2:]


def _good_jpeg(w: int = 160, h: int = 120, seed: int = 0) -> bytes:
    return _encode(_pixels(w, h, seed), ".jpg")


# Images that must be used (name, bytes factory); all get GOOD_LABEL unless listed in
# LABEL_CASES.
GOOD_IMAGES: dict[str, object] = {
    "good0.jpg": lambda: _good_jpeg(seed=1),
    "good1.jpg": lambda: _good_jpeg(200, 150, seed=2),
    "grey.png": lambda: _encode(_pixels(120, 100, 3, channels=1), ".png"),
    "rgba.png": lambda: _encode(_pixels(120, 100, 4, channels=4), ".png"),
    "deep16.png": lambda: _encode(_pixels(120, 100, 5, dtype=np.uint16), ".png"),
    "exif6.jpg": lambda: _jpeg_with_exif(_pixels(160, 80, 6), 6),  # upright 80 x 160
    "tiny8.png": lambda: _encode(_pixels(8, 8, 7), ".png"),
    "wide.jpg": lambda: _good_jpeg(2000, 40, seed=8),
    "UPPER.JPG": lambda: _good_jpeg(seed=9),
    "ünïcödé ñame.jpg": lambda: _good_jpeg(seed=10),
    "with space.png": lambda: _encode(_pixels(100, 90, 11), ".png"),
    SHELL_NAME: lambda: _good_jpeg(seed=12),
}

# Label files of good images: name -> (label text, kept rows, bad lines, duplicates, reasons).
LABEL_CASES: dict[str, tuple[str | None, int, int, int, list[str]]] = {
    "nolabel.jpg": (None, 0, 0, 0, []),
    "emptylabel.jpg": ("", 0, 0, 0, []),
    "columns.jpg": (
        "0 0.5 0.5 0.2\n0 0.5 0.5 0.2 0.2 0.1\n" + GOOD_LABEL,
        1,
        2,
        0,
        ["columns.txt:1: dropped: 4 fields", "columns.txt:2: dropped: 6 fields"],
    ),
    "nonnumeric.jpg": (
        "zero 0.5 0.5 0.2 0.2\n" + GOOD_LABEL,
        1,
        1,
        0,
        ["nonnumeric.txt:1: dropped: not a number"],
    ),
    "naninf.jpg": (
        "0 nan 0.5 0.2 0.2\n0 0.5 inf 0.2 0.2\n" + GOOD_LABEL,
        1,
        2,
        0,
        ["naninf.txt:1: dropped: NaN or infinite", "naninf.txt:2: dropped: NaN or"],
    ),
    "coords.jpg": (
        "0 -0.2 0.5 0.2 0.2\n0 0.5 1.5 0.2 0.2\n" + GOOD_LABEL,
        1,
        2,
        0,
        [
            "coords.txt:1: dropped: coordinate outside [0, 1]",
            "coords.txt:2: dropped: coordinate outside [0, 1]",
        ],
    ),
    "zerosize.jpg": (
        "0 0.5 0.5 0 0.2\n" + GOOD_LABEL,
        1,
        1,
        0,
        ["zerosize.txt:1: dropped: zero-size box"],
    ),
    "classid.jpg": (
        f"{NC} 0.5 0.5 0.2 0.2\n2 0.5 0.5 0.2 0.2\n",
        1,
        1,
        0,
        [f"classid.txt:1: dropped: class id {NC} outside [0, {NC})"],
    ),
    "duplicate.jpg": (
        "1 0.5 0.5 0.2 0.2\n1 0.5 0.5 0.2 0.2\n",
        1,
        0,
        1,
        ["duplicate.txt:2: dropped: duplicate of an earlier row"],
    ),
    "bom.jpg": ("\ufeff0 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.1 0.1\n", 2, 0, 0, []),
    "crlf.jpg": ("0 0.5 0.5 0.2 0.2\r\n1 0.3 0.3 0.1 0.1\r\n", 2, 0, 0, []),
}

# Images that must be excluded: name -> (bytes or None for "listed but absent", reason).
BAD_IMAGES: dict[str, tuple[bytes | None, str]] = {
    "zero.jpg": (b"", "excluded: zero-byte image file"),
    "truncated.jpg": (_good_jpeg(seed=13)[:700], "excluded: truncated JPEG"),
    "text.jpg": (b"this is a text file, not a JPEG\n" * 4, "excluded: not a readable image"),
    "does_not_exist.jpg": (None, "excluded: image file not found"),
    "$(touch pwned2).jpg": (None, "excluded: image file not found"),
    "a;rm -rf x.jpg": (None, "excluded: image file not found"),
    "`touch pwned3`.jpg": (None, "excluded: image file not found"),
    "$HOME.jpg": (None, "excluded: image file not found"),
}

VAL_GOOD = {
    "v0.jpg": lambda: _good_jpeg(seed=20),
    "vexif.jpg": GOOD_IMAGES["exif6.jpg"],
    "vwide.jpg": GOOD_IMAGES["wide.jpg"],
    "vtiny.png": GOOD_IMAGES["tiny8.png"],
    "v1.png": lambda: _encode(_pixels(90, 120, 21), ".png"),
}
VAL_BAD = {"vzero.jpg": b"", "vtext.jpg": b"not an image\n"}


def _put(root: Path, split: str, name: str, data: bytes | None, label: str | None) -> str:
    if data is not None:
        p = root / split / "images" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    if label is not None:
        lp = root / split / "labels" / (os.path.splitext(name)[0] + ".txt")
        lp.parent.mkdir(parents=True, exist_ok=True)
        lp.write_bytes(label.encode("utf-8"))
    return f"{split}/images/{name}"


def _write_list(path: Path, entries: list[str]) -> None:
    """A list as a Windows editor saves it: BOM, CRLF, blank lines, comments, stray spaces."""
    lines = ["# images for the reliability test", ""]
    for k, e in enumerate(entries):
        lines.append(f"  {e}  " if k % 3 == 0 else e)
        if k % 4 == 0:
            lines += ["", "   # a comment between entries"]
    path.write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode("utf-8"))


def build_bad_corpus(root: Path) -> dict:
    """Write the corpus; return what the data checks must find."""
    train = []
    for name, make in GOOD_IMAGES.items():
        train.append(_put(root, "train", name, make(), GOOD_LABEL))
    for k, (name, (label, *_)) in enumerate(LABEL_CASES.items()):
        train.append(_put(root, "train", name, _good_jpeg(seed=30 + k), label))
    for name, (data, _) in BAD_IMAGES.items():
        train.append(_put(root, "train", name, data, GOOD_LABEL))
    val = [_put(root, "val", n, make(), GOOD_LABEL) for n, make in VAL_GOOD.items()]
    val += [_put(root, "val", n, data, GOOD_LABEL) for n, data in VAL_BAD.items()]
    _write_list(root / "train.txt", train)
    _write_list(root / "val.txt", val)
    (root / "bad.names").write_text("a\nb\nc\n")
    (root / "bad.data").write_text(
        f"classes={NC}\ntrain=train.txt\nvalid=val.txt\nnames=bad.names\n"
    )
    cases = LABEL_CASES.values()
    return {
        "n_listed": len(train),
        "n_good": len(GOOD_IMAGES) + len(LABEL_CASES),
        "found": len(GOOD_IMAGES) + sum(c[0] is not None and c[0] != "" for c in cases),
        "missing": sum(c[0] is None for c in cases),
        "empty": sum(c[0] == "" for c in cases),
        "corrupt": len(BAD_IMAGES),
        "duplicate": sum(c[3] for c in cases),
        "bad": sum(c[2] for c in cases),
        "n_val_good": len(VAL_GOOD),
    }


def _nano_80_weights(path: Path) -> Path:
    """Weights of the 80-class nano model: every tensor but the heads fits a 3-class model."""
    torch.save({"model": Darknet(NANO, img_size=(128, 128)).state_dict()}, path)
    return path


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    """One 1-epoch train.py process over the whole corpus (both splits hold bad files)."""
    root = tmp_path_factory.mktemp("badcorpus")
    expect = build_bad_corpus(root)
    out = root / "run"
    weights = _nano_80_weights(root / "nano80.pt")
    argv = train_argv(root / "bad.data", out, "--weights", str(weights), batch=8, nbs=8, img=64)
    cmd = [sys.executable, str(REPO / "train.py"), *argv]
    # cwd = the corpus: a shell-expanded name would create 'pwned' right here.
    proc = warm_python.run(cmd, cwd=root, env=_env(), timeout=300)
    # Read now: later tests run tools that rebuild these files with other settings.
    expect["report"] = (root / "train.cache_report.txt").read_text(encoding="utf-8")
    expect["val_report"] = (root / "val.cache_report.txt").read_text(encoding="utf-8")
    return root, out, expect, proc


# ---------------------------------------------------------------------------------------------
# The corpus through train.py


@pytest.mark.slow
def test_bad_data_is_skipped_reported_and_training_completes(bad_run):
    _, out, expect, proc = bad_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # One summary line per split with the exact counts (31 listed, 23 usable).
    assert [
        expect[k] for k in ("n_listed", "found", "missing", "empty", "corrupt", "duplicate", "bad")
    ] == [31, 21, 1, 1, 8, 1, 9]
    summary = (
        f"train: {expect['n_listed']} images: {expect['found']} label files found, "
        f"{expect['missing']} missing, {expect['empty']} empty, {expect['corrupt']} "
        f"images excluded for an unusable image or label file, {expect['duplicate']} "
        "duplicate rows and "
        f"{expect['bad']} bad label lines dropped; details in "
    )
    assert proc.stderr.count(summary) == 1, proc.stderr[-3000:]
    val_summary = re.search(
        r"val: (\d+) images: .* (\d+) images excluded for an unusable image or label file",
        proc.stderr,
    )
    assert val_summary and val_summary.groups() == (
        str(len(VAL_GOOD) + len(VAL_BAD)),
        str(len(VAL_BAD)),
    )
    # Training used every good image and nothing else.
    log = (out / "train.log").read_text(encoding="utf-8")
    assert f"data: {expect['n_good']} train / {expect['n_val_good']} val images" in log
    assert "done: 1 epochs" in log
    with (out / "results.csv").open() as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["0"]
    assert load_checkpoint(out / "last.pt")["epoch"] == 0


@pytest.mark.slow
def test_every_bad_file_and_line_is_in_the_report(bad_run):
    root, _, expect, proc = bad_run
    report = expect["report"]
    for name, (_, reason) in BAD_IMAGES.items():
        assert f"{name}: {reason}" in report, name
    for _, (_, _, _, _, reasons) in LABEL_CASES.items():
        for reason in reasons:
            assert reason in report, reason
    # Files whose problems are fixed silently leave no line; comments are not entries.
    for quiet in ("bom.txt", "crlf.txt", "good0", "grey", "UPPER", "comment"):
        assert quiet not in report, quiet
    val_report = expect["val_report"]
    assert "vzero.jpg: excluded: zero-byte" in val_report
    assert "vtext.jpg: excluded: not a readable image" in val_report
    assert f"details in {root / 'train.cache_report.txt'}" in proc.stderr


@pytest.mark.slow
def test_odd_images_are_read_upright_and_whole(bad_run):
    """EXIF orientation, 8x8 and 2000x40 images reach the evaluation ground truth at their
    upright original sizes (the COCO ground truth cache of the run holds them)."""
    _, out, _, _ = bad_run
    [gt_file] = out.glob("coco_gt_*.json")
    sizes = {
        Path(im["file_name"]).name: (im["width"], im["height"])
        for im in json.loads(gt_file.read_text())["images"]
    }
    assert sizes == {
        "v0.jpg": (160, 120),
        "vexif.jpg": (80, 160),
        "vwide.jpg": (2000, 40),
        "vtiny.png": (8, 8),
        "v1.png": (90, 120),
    }


@pytest.mark.slow
def test_mismatched_weights_and_cfg_classes_are_adapted_and_listed(bad_run):
    _, _, _, proc = bad_run
    assert "has classes=80 but the dataset has 3; rewriting the heads for 3 classes" in proc.stderr
    skipped = re.search(
        r"--weights \S+: skipped (\d+) tensors whose shapes differ: (.*)", proc.stderr
    )
    assert skipped, proc.stderr[-3000:]
    heads = [i - 1 for i, b in enumerate(parse_model_cfg(NANO)[1:]) if b["type"] == "yolo"]
    assert int(skipped.group(1)) == 2 * len(heads)  # weight and bias of each head's conv
    for i in heads:
        assert f"module_list.{i}.Conv2d.weight" in skipped.group(2)


@pytest.mark.slow
def test_list_file_paths_are_never_run_by_a_shell(bad_run):
    root, _, _, _ = bad_run
    for where in (root, REPO, Path.cwd()):
        assert not list(where.glob("pwned*")), where
    # The real file named like a command substitution was trained on like any other image.
    cache = np.load(root / "train.cache.npz", allow_pickle=False)
    names = [Path(str(f)).name for f, ok in zip(cache["files"], cache["ok"]) if ok]
    assert SHELL_NAME in names and "ünïcödé ñame.jpg" in names and "UPPER.JPG" in names
    # Nothing is expanded: '$HOME' stays literal.
    assert any(str(f).endswith("train/images/$HOME.jpg") for f in cache["files"])


@pytest.mark.slow
def test_no_cache_or_result_file_needs_pickle(bad_run):
    root, out, _, _ = bad_run
    for npz in (root / "train.cache.npz", root / "val.cache.npz"):
        with np.load(npz, allow_pickle=False) as z:
            for key in z.files:
                assert z[key].dtype != object, (npz, key)
    for js in out.glob("*.json"):
        json.loads(js.read_text())
    for pt in (out / "last.pt", out / "best.pt"):
        torch.load(pt, map_location="cpu", weights_only=True)
    leftovers = [p for p in [*root.rglob("*.tmp"), *root.rglob(".*.tmp")] if p.is_file()]
    assert leftovers == []


@pytest.mark.slow
def test_validation_and_predict_skip_bad_images(bad_run, console, tmp_path):
    root, out, _, _ = bad_run
    code = validation.main(
        validation_argv(
            out / "model.cfg",
            root / "bad.data",
            out / "last.pt",
            "--json-out",
            str(tmp_path / "stats.json"),
            "--save-dir",
            str(tmp_path / "val"),
            img=64,
        )
    )
    err = console.readouterr().err
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert f"{len(VAL_GOOD)} val images, conf" in err
    assert len(json.loads((tmp_path / "stats.json").read_text())) == 12

    images = root / "val" / "images"
    code = predict.main(
        [
            "--weights",
            str(out / "last.pt"),
            "--source",
            str(images),
            str(images / "vtext.jpg"),
            "--output",
            str(tmp_path / "pred"),
            "--img-size",
            "64",
            "--device",
            "cpu",
            "--conf-thres",
            "0.5",
        ]
    )
    cap = console.readouterr()
    assert code == 0 and "Traceback" not in cap.err, cap.err[-2000:]
    for name in VAL_GOOD:
        assert f"{images / name}: " in cap.out, name
    for name in VAL_BAD:
        assert re.search(
            rf"skipped: {re.escape(str(images / name))}: not a readable image", cap.err
        ), name
    # Two sources: the folder's pictures under its own name (the unreadable file: none).
    assert sorted(p.name for p in (tmp_path / "pred").iterdir()) == ["images"]
    assert sorted(p.name for p in (tmp_path / "pred" / "images").iterdir()) == sorted(VAL_GOOD)


@pytest.mark.slow
def test_kmeans_tool_skips_bad_data(bad_run, console, tmp_path):
    root, _, expect, _ = bad_run
    code = kmeans_anchors.main(
        ["--list", str(root / "train.txt"), "--img-size", "128", "-n", "3", "--generations", "5"]
    )
    cap = console.readouterr()
    assert code == 0 and "Traceback" not in cap.err, cap.err[-2000:]
    assert f"{expect['corrupt']} images excluded for an unusable image or label file" in cap.err
    assert re.search(r"^anchors=\d", cap.out, re.M)


def test_bom_labels_and_list_comments_are_read_as_meant(tmp_path):
    """Regression: a UTF-8 BOM cost a label file its first row ('not a number'), and a '#'
    comment in a list file was reported as an excluded image."""
    entry = _put(
        tmp_path, "train", "a.jpg", _good_jpeg(), "\ufeff0 0.5 0.5 0.2 0.2\r\n1 0.3 0.3 0.1 0.1\r\n"
    )
    lst = tmp_path / "train.txt"
    lst.write_bytes(f"\ufeff# train split\r\n\r\n  {entry}  \r\n   # end\r\n".encode())
    d = LoadImagesAndLabels(lst, 64, nc=NC)
    assert len(d) == 1 and d.labels[0][:, 0].tolist() == [0.0, 1.0]
    assert d.report_path.read_text().splitlines()[1:] == []  # nothing to report


# ---------------------------------------------------------------------------------------------
# Caches: corrupt or hostile files are rebuilt, never trusted


def _small_set(root: Path, n: int = 3) -> Path:
    names = [_put(root, "train", f"im{i}.jpg", _good_jpeg(seed=i), GOOD_LABEL) for i in range(n)]
    (root / "train.txt").write_text("\n".join(names) + "\n")
    return root / "train.txt"


class _Evil:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


def test_corrupt_or_hostile_label_cache_is_rebuilt(tmp_path, caplog):
    lst = _small_set(tmp_path)
    d = LoadImagesAndLabels(lst, 64, nc=NC)
    good = d.cache_path.read_bytes()
    evil_dir = tmp_path / "pwned_by_cache"
    with caplog.at_level(logging.WARNING, logger="build_utils.datasets"):
        for name, payload in [
            ("garbage", b"\x00garbage, not a zip" * 50),
            ("truncated", good[: len(good) // 2]),
        ]:
            d.cache_path.write_bytes(payload)
            again = LoadImagesAndLabels(lst, 64, nc=NC)
            assert len(again) == 3 and [len(x) for x in again.labels] == [1, 1, 1], name
            assert d.cache_path.read_bytes() != payload, name  # rewritten
        # A cache with a pickled object array: np.load(allow_pickle=False) refuses to run it.
        with open(d.cache_path, "wb") as f:
            np.savez(f, version=np.array([_Evil(evil_dir)], dtype=object), key=np.str_("x"))
        again = LoadImagesAndLabels(lst, 64, nc=NC)
    assert not evil_dir.exists()
    assert len(again) == 3
    warnings = [r.getMessage() for r in caplog.records if "label cache" in r.getMessage()]
    assert len(warnings) == 3 and all("rebuilding" in w for w in warnings), warnings
    with np.load(d.cache_path, allow_pickle=False) as z:
        assert int(z["version"]) == labels_mod.CACHE_VERSION


def test_label_cache_write_is_atomic(tmp_path, monkeypatch, caplog):
    """A write that fails half-way (disk full) leaves the previous cache whole and no temporary
    file; the run goes on with a warning."""
    lst = _small_set(tmp_path)
    d = LoadImagesAndLabels(lst, 64, nc=NC)
    before = d.cache_path.read_bytes()
    (tmp_path / "train" / "labels" / "im0.txt").write_text("1 0.5 0.5 0.1 0.1\n")  # new key

    def disk_full(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ds_mod.np, "savez", disk_full)
    with caplog.at_level(logging.WARNING, logger="build_utils.datasets"):
        again = LoadImagesAndLabels(lst, 64, nc=NC)
    assert again.labels[0][:, 0].tolist() == [1.0]  # the new labels are used
    assert d.cache_path.read_bytes() == before
    assert "cannot write label cache" in caplog.text and "No space left" in caplog.text
    assert [p.name for p in d.cache_path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_corrupt_coco_ground_truth_cache_is_rebuilt(tmp_path, caplog):
    d = LoadImagesAndLabels(_small_set(tmp_path), 64, nc=NC)
    cache_dir = tmp_path / "run"
    get_coco_api_from_dataset(d, cache_dir=cache_dir, num_classes=NC)
    [path] = cache_dir.glob("coco_gt_*.json")
    for payload in ('{"info": {"cache_key": "stale"}, "images": []', '["not", "a", "cache"]'):
        path.write_text(payload)
        with caplog.at_level(logging.WARNING, logger="train_utils.evaluation.coco_gt"):
            coco = get_coco_api_from_dataset(d, cache_dir=cache_dir, num_classes=NC)
        assert len(coco.getImgIds()) == 3 and len(coco.getAnnIds()) == 3
        assert "rebuilding it" in caplog.records[-1].getMessage()
        assert json.loads(path.read_text())["info"]["cache_key"] != "stale"


# ---------------------------------------------------------------------------------------------
# Resource limits


def test_ram_image_cache_is_refused_when_it_does_not_fit(tmp_path, console, monkeypatch):
    import train as train_script

    lst = _small_set(tmp_path / "d", n=4)
    (tmp_path / "d" / "x.names").write_text("a\nb\nc\n")
    (tmp_path / "d" / "x.data").write_text(
        f"classes={NC}\ntrain={lst}\nvalid={lst}\nnames=x.names\n"
    )
    monkeypatch.setattr(cache_mod, "available_memory_bytes", lambda: 50_000)  # 50 kB free
    out = tmp_path / "run"
    argv = train_argv(tmp_path / "d" / "x.data", out, "--cache-images", batch=2, multi_scale=None)
    code = train_script.main(argv)
    err = console.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1]
    # One decision for the train and val caches together (here the same 4 images twice), for
    # one copy per node (its processes share it).
    assert re.fullmatch(
        r"error: caching 8 images in RAM needs 0\.0 GB one copy for the node but "
        r"only 0\.0 GB is available; use cache_images='disk' \(--cache-images "
        r"disk\) or no image cache",
        errors[0],
    ), errors[0]
    assert not (out / "last.pt").exists()


N_LABEL_FILES = 20_000
SCAN_PEAK_LIMIT_MB = 150


class _PeakMemory:
    """Peak memory growth (MB) of this process over a ``with`` block: the resident set's
    high-water mark (reset through /proc/self/clear_refs, Linux), which counts OpenCV's buffers
    too; where that is unavailable, the Python heap peak from tracemalloc."""

    def __enter__(self) -> _PeakMemory:
        self.mb = 0.0
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self._base = self._status("VmRSS")
            self._rss = True
        except (OSError, AttributeError):
            self._rss = False
            tracemalloc.start()
        return self

    @staticmethod
    def _status(key: str) -> float:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) / 1024

    def __exit__(self, *exc) -> None:
        if self._rss:
            self.mb = self._status("VmHWM") - self._base
        else:
            self.mb = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied after the test: pytest keeps the last three sessions' temporary
    folders, and 40,000 files there would slow every later session's clean-up."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
def test_label_scan_of_20000_files_has_bounded_memory(scratch):
    """20,000 images (96x96 PNG: 9 kB each once decoded, 184 MB if decoded pixels were kept)
    with label files, one line in every 50th malformed: the label cache is built, reported and
    reloaded within SCAN_PEAK_LIMIT_MB of extra memory (about 45 MB in practice)."""
    png = _encode(np.full((96, 96, 3), 77, np.uint8), ".png")
    img_dir, lbl_dir = scratch / "images", scratch / "labels"
    img_dir.mkdir()
    lbl_dir.mkdir()
    good = b"0 0.5 0.5 0.2 0.2\n1 0.25 0.25 0.1 0.1\n"
    bad = good + b"0 0.5 0.5 0.2\n"
    sources = {}
    for name, content in (("img", png), ("good", good), ("bad", bad)):
        sources[name] = scratch / f"src.{name}"
        sources[name].write_bytes(content)

    def put(src: Path, dst: Path) -> None:
        try:
            os.link(src, dst)  # 4x faster than writing 40,000 files
        except OSError:
            dst.write_bytes(src.read_bytes())

    for i in range(N_LABEL_FILES):
        put(sources["img"], img_dir / f"{i:05d}.png")
        put(sources["bad" if i % 50 == 0 else "good"], lbl_dir / f"{i:05d}.txt")
    (scratch / "all.txt").write_text("".join(f"images/{i:05d}.png\n" for i in range(N_LABEL_FILES)))

    with _PeakMemory() as build:
        d = LoadImagesAndLabels(scratch / "all.txt", 64, nc=2)
    assert len(d) == N_LABEL_FILES and sum(len(x) for x in d.labels) == 2 * N_LABEL_FILES
    report = d.report_path.read_text().splitlines()
    assert len(report) == 1 + N_LABEL_FILES // 50  # header + one line per malformed row
    del d
    with _PeakMemory() as reload:
        again = LoadImagesAndLabels(scratch / "all.txt", 64, nc=2)
    assert len(again) == N_LABEL_FILES
    assert build.mb < SCAN_PEAK_LIMIT_MB and reload.mb < SCAN_PEAK_LIMIT_MB, (build.mb, reload.mb)


def test_label_cache_builder_does_not_keep_pixels(tmp_path):
    """The per-file check returns sizes and labels only (what makes the scan memory bounded)."""
    lst = _small_set(tmp_path, n=2)
    files = [str(tmp_path / "train" / "images" / f"im{i}.jpg") for i in range(2)]
    labels = [str(tmp_path / "train" / "labels" / f"im{i}.txt") for i in range(2)]
    cache = build_label_cache(files, labels, NC)
    assert lst.is_file() and cache.sizes.tolist() == [[160, 120], [160, 120]]
    assert all(a.nbytes == 20 for a in cache.labels)  # one (1, 5) float32 row each


DENSE_SHAPE = (2, 10647, 85)  # a 416x416 YOLOv3 output for 80 classes
NMS_SECONDS_LIMIT = 20.0


def _dense(shape: tuple[int, int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g)
    x[..., :2] *= 416  # centres
    x[..., 2:4] = 8 + 120 * x[..., 2:4]  # sizes
    x[..., 4] = 0.002 + 0.05 * x[..., 4]  # low objectness everywhere: an untrained model
    return x


def test_dense_low_confidence_output_is_capped_per_image():
    pred = _dense(DENSE_SHAPE)
    t0 = time.perf_counter()
    out = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, multi_label=True)
    seconds = time.perf_counter() - t0
    assert len(out) == DENSE_SHAPE[0]  # every image gets an entry
    assert all(0 < len(o) <= MAX_DET for o in out), [len(o) for o in out]
    assert all(bool((o[1:, 4] <= o[:-1, 4]).all()) for o in out)  # best first
    assert seconds < NMS_SECONDS_LIMIT, seconds


class _DenseModel(nn.Module):
    """Stands in for an untrained Darknet: thousands of low-confidence boxes per image."""

    def __init__(self, nc: int):
        super().__init__()
        self.nc = nc
        self.calls = 0

    def forward(self, x: torch.Tensor):
        self.calls += 1
        return _dense((x.shape[0], 10647, 5 + self.nc), self.calls), None


def test_evaluation_of_a_dense_model_stays_within_max_det(tmp_path):
    lst = _small_set(tmp_path, n=5)
    dataset = make_eval_dataset(lst, 128, 2, NC)
    loader = make_eval_loader(dataset, 2, 1, 0, 0, False)
    t0 = time.perf_counter()
    dets = predict_batches(_DenseModel(NC), loader, EvalOptions(torch.device("cpu"), 0.001, 0.6))
    seconds = time.perf_counter() - t0
    per_image = np.bincount([d["image_id"] for d in dets], minlength=len(dataset))
    assert len(per_image) == len(dataset) and per_image.min() > 0 and per_image.max() <= MAX_DET
    assert seconds < NMS_SECONDS_LIMIT, seconds
