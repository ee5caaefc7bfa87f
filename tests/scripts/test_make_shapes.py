"""The demo dataset generator: valid YOLO labels, labels that match the pixels, determinism."""

from __future__ import annotations

import hashlib
from pathlib import Path

import cv2
import numpy as np
import pytest

from data.make_shapes import (
    CLASS_NAMES,
    DEFAULT_CLASSES,
    STAMP_NAME,
    GeneratorOptions,
    main,
    make_dataset,
    render_image,
)


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_layout_and_label_validity(make_shapes_data):
    data = make_shapes_data(n_train=30, n_val=6, voc=True)
    root = data.parent
    assert data.read_text().splitlines() == [
        f"classes={DEFAULT_CLASSES}",
        "train=train.txt",
        "valid=val.txt",
        "names=shapes.names",
    ]
    assert (root / "shapes.names").read_text().split() == list(CLASS_NAMES[:DEFAULT_CLASSES])
    n_objects = n_empty = 0
    for split, n in (("train", 30), ("val", 6)):
        listed = (root / f"{split}.txt").read_text().splitlines()
        assert len(listed) == n
        for rel in listed:
            img_path = root / rel
            img = cv2.imread(str(img_path))
            assert img is not None, rel
            h, w = img.shape[:2]
            label = img_path.parent.parent / "labels" / (img_path.stem + ".txt")
            rows = np.loadtxt(label, ndmin=2) if label.read_text().strip() else np.zeros((0, 5))
            n_empty += len(rows) == 0
            n_objects += len(rows)
            for cls, cx, cy, bw, bh in rows:
                assert cls == int(cls) and 0 <= cls < DEFAULT_CLASSES
                assert 0 < bw <= 1 and 0 < bh <= 1
                # The box lies inside the image, in pixels, within label rounding.
                assert (cx - bw / 2) * w >= -1e-3 and (cx + bw / 2) * w <= w + 1e-3
                assert (cy - bh / 2) * h >= -1e-3 and (cy + bh / 2) * h <= h + 1e-3
                # Objects are at least ~10 px and at most half the short side.
                assert min(bw * w, bh * h) >= 6
                assert max(bw * w, bh * h) <= 0.5 * min(w, h) + 2
            xml = img_path.parent.parent / "Annotations" / (img_path.stem + ".xml")
            assert xml.read_text().count("<object>") == len(rows)
    assert n_objects > 36  # several objects per image on average


def test_labels_match_drawn_pixels():
    """For each object not covered by a later one, its colour fills its box up to every edge."""
    checked = 0
    for seed in range(40):
        img, objects = render_image(np.random.default_rng(seed), GeneratorOptions())
        for k, obj in enumerate(objects):
            x1, y1, x2, y2 = obj.box
            later = objects[k + 1 :]
            if any(
                min(x2, o.box[2]) > max(x1, o.box[0]) and min(y2, o.box[3]) > max(y1, o.box[1])
                for o in later
            ):
                continue
            mask = np.all(img == np.array(obj.colour, np.uint8), axis=2)
            ys, xs = np.nonzero(mask[y1:y2, x1:x2])
            assert len(xs) > 0
            # The coloured pixels touch all four sides of the labelled box.
            assert xs.min() == 0 and ys.min() == 0
            assert xs.max() == x2 - x1 - 1 and ys.max() == y2 - y1 - 1
            # And the colour does not continue right outside the box.
            ring = mask[max(0, y1 - 1) : y2 + 1, max(0, x1 - 1) : x2 + 1].sum()
            assert ring == mask[y1:y2, x1:x2].sum() or ring - mask[y1:y2, x1:x2].sum() < 0.02 * ring
            checked += 1
    assert checked > 50


def test_deterministic_for_seed_and_worker_count(tmp_path):
    a = make_dataset(tmp_path / "a", 70, 3, seed=5, workers=1)
    b = make_dataset(tmp_path / "b", 70, 3, seed=5, workers=2)
    c = make_dataset(tmp_path / "c", 70, 3, seed=6, workers=1)
    assert _tree_digest(a.parent) == _tree_digest(b.parent)
    assert _tree_digest(a.parent) != _tree_digest(c.parent)


def test_some_images_empty_and_some_overlapping():
    n_empty = n_overlap = 0
    for seed in range(200):
        _, objects = render_image(np.random.default_rng(seed))
        n_empty += not objects
        boxes = [o.box for o in objects]
        n_overlap += any(
            min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])
            for i, a in enumerate(boxes)
            for b in boxes[i + 1 :]
        )
    assert 0 < n_empty < 40
    assert n_overlap > 0


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--classes", "9", "--n-train", "1", "--n-val", "1"]) == 2
    assert "n_classes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--img-size", "abc"])
    capsys.readouterr()
    # Were numpy's "high - low < 0", and a fraction of 5 accepted.
    small = ["--out", str(tmp_path / "o"), "--n-train", "1", "--n-val", "1", "--img-size", "64,64"]
    assert main([*small, "--min-obj-size", "1000"]) == 2
    assert capsys.readouterr().err == (
        "error: the smallest object side must be in (0, 32] px (0.5 x the smallest image side "
        "64), got 1000\n"
    )
    assert main([*small, "--max-obj-frac", "5"]) == 2
    assert "a fraction in (0, 1], got 5.0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_bounds_the_image_and_worker_counts(tmp_path, capsys):
    """Was: --n-train 1000000000000 built a list of that many jobs (memory without bound),
    --workers 100000 asked for that many processes and --n-train 0 / --n-val 0 wrote a dataset
    training refuses."""
    out = ["--out", str(tmp_path / "o")]
    for flag, value, line in (
        (
            "--n-train",
            "1000000000000",
            "--n-train must be in [1, 1000000], got 100000000000... (13 digits)",
        ),
        ("--n-val", "-1", "--n-val must be >= 1, got -1"),
        # Were a dataset written that training then refused ("train.txt: no images found").
        ("--n-train", "0", "--n-train must be >= 1, got 0"),
        ("--n-val", "0", "--n-val must be >= 1, got 0"),
        ("--workers", "100000", "--workers must be in [1, 256], got 100000"),
        ("--workers", "0", "--workers must be >= 1, got 0"),
    ):
        capsys.readouterr()
        assert main([*out, flag, value]) == 2
        assert capsys.readouterr().err == f"error: {line}\n"
    assert list(tmp_path.iterdir()) == []


def test_cli_never_writes_over_a_dataset_unasked(tmp_path, capsys):
    """Was: a second run into --out replaced shapes.data and the lists, and left the first
    set's images and labels beside the new ones. Now one line, nothing written, unless
    --exist-ok, which replaces the whole set."""
    out = tmp_path / "shapes"
    argv = ["--out", str(out), "--n-train", "4", "--n-val", "2", "--workers", "1"]
    assert main(argv) == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    capsys.readouterr()
    assert main([*argv[:3], "2", *argv[4:]]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {out / 'train'}, {out / 'val'}, ") and "--exist-ok" in line
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert main([*argv[:3], "2", *argv[4:], "--exist-ok"]) == 0
    assert len(list((out / "train" / "images").iterdir())) == 2
    assert len(list((out / "train" / "labels").iterdir())) == 2
    assert len((out / "train.txt").read_text().split()) == 2


def test_cli_limits_the_image_side(tmp_path, capsys):
    """Was: --img-size 99999,99999 asked numpy for 27.9 GiB, then a traceback. Now the limit on
    an image side every --img-size has (YOLO_MAX_IMG_SIZE), before anything is written."""
    out = tmp_path / "o"
    argv = ["--out", str(out), "--n-train", "2", "--n-val", "2", "--workers", "1"]
    for sizes in ("99999,99999", "64,99999", "99999,64"):
        assert main([*argv, "--img-size", sizes]) == 2
        assert capsys.readouterr().err == (
            "error: --img-size 99999 is larger than the limit 8192 (pixels per side of "
            "--img-size); set YOLO_MAX_IMG_SIZE to raise it\n"
        )
    assert not out.exists()


def test_exist_ok_replaces_only_a_dataset_this_tool_made(tmp_path, capsys):
    """Was: --exist-ok removed any train/ and val/ in --out, a user's images and notes with
    them. Now only a folder holding the tool's stamp is replaced; anything else is named."""
    out = tmp_path / "userds"
    (out / "train" / "images").mkdir(parents=True)
    (out / "val").mkdir()
    (out / "train" / "images" / "mine.jpg").write_text("x\n")
    (out / "val" / "notes.txt").write_text("x\n")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    argv = ["--out", str(out), "--n-train", "4", "--n-val", "2", "--img-size", "64,96"]
    assert main([*argv, "--workers", "1", "--exist-ok"]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {out} holds {out / 'train'}, {out / 'val'} but no {STAMP_NAME}: not a "
        "dataset made by data/make_shapes.py, the only kind --exist-ok replaces; move them away "
        "or choose another --out\n"
    )
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert (out / "train" / "images" / "mine.jpg").read_text() == "x\n"
    assert (out / "val" / "notes.txt").read_text() == "x\n"

    # A dataset it made, whose train/ is now a link to the user's folder: never written through.
    made = tmp_path / "made"
    assert main(["--out", str(made), *argv[2:], "--workers", "1"]) == 0
    capsys.readouterr()
    mine = tmp_path / "mine"
    (made / "train").rename(mine)
    (made / "train").symlink_to(mine)
    listed = sorted(mine.rglob("*"))
    assert main(["--out", str(made), *argv[2:], "--workers", "1", "--exist-ok"]) == 2
    assert capsys.readouterr().err == (
        f"error: {made / 'train'} is a symbolic link, not a folder data/make_shapes.py made; "
        "move it away or choose another --out\n"
    )
    assert sorted(mine.rglob("*")) == listed


def test_exist_ok_checks_the_options_before_removing_the_old_set(tmp_path, capsys):
    """Was: --exist-ok removed the old images, then found --classes 9 wrong: no set at all."""
    out = tmp_path / "shapes"
    argv = ["--out", str(out), "--n-train", "2", "--n-val", "1", "--workers", "1"]
    assert main(argv) == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    capsys.readouterr()
    assert main([*argv, "--exist-ok", "--classes", "9"]) == 2
    assert capsys.readouterr().err == "error: n_classes must be in 1..8, got 9\n"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_the_extra_classes_have_their_own_box_shapes():
    """--classes 8 adds a tall diamond, a hexagon and a 3:1 bar; boxes stay in the image."""
    rng = np.random.default_rng(3)
    opts = GeneratorOptions((200, 260), (24.0, 0.5), len(CLASS_NAMES))
    aspect: dict[int, list[float]] = {c: [] for c in range(len(CLASS_NAMES))}
    for _ in range(120):
        img, objects = render_image(rng, opts)
        h, w = img.shape[:2]
        for o in objects:
            x1, y1, x2, y2 = o.box
            assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h
            aspect[o.cls].append((x2 - x1) / (y2 - y1))
    assert all(aspect[c] for c in aspect), "every class is drawn"
    assert max(aspect[5]) < 0.75  # diamonds are taller than wide
    bars = np.array(aspect[7])
    assert ((bars > 2.2) | (bars < 1 / 2.2)).all() and (bars > 1).any() and (bars < 1).any()
    assert all(0.8 < a < 1.25 for a in aspect[6])  # hexagons are about as wide as tall
