"""build_utils/labels.py: label paths, image lists, label line rules, the label cache."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from build_utils import labels as labels_mod
from build_utils.labels import (
    collect_image_files,
    img2label_path,
    label_root,
    load_label_cache,
    load_labels,
    parse_label_text,
)

# ---------------------------------------------------------------------------------------------
# Paths and image lists


def test_label_path_replaces_only_the_last_images_folder():
    sep = os.sep
    p = sep.join(["", "d", "images", "a", "images", "x.JPG"])
    assert img2label_path(p) == sep.join(["", "d", "images", "a", "labels", "x.txt"])
    assert img2label_path(sep.join(["", "d", "myimages", "x.png"])) == sep.join(
        ["", "d", "myimages", "x.txt"]
    )
    assert label_root(p) == sep.join(["", "d", "images", "a"])
    assert label_root(sep.join(["", "d", "train", "images", "s", "x.png"])) == sep.join(
        ["", "d", "train"]
    )
    assert label_root(sep.join(["", "d", "imgs", "x.png"])) == sep.join(["", "d"])


def test_collect_image_files_names_the_cache_after_the_list(make_shapes_data):
    root = make_shapes_data(n_train=2, n_val=1).parent
    lst = root / "train.txt"
    files, stem = collect_image_files(lst)
    assert stem == "train" and len(files) == 2
    files, stem = collect_image_files([lst, root / "train" / "images"])
    assert stem == "train+train" and len(files) == 4


# ---------------------------------------------------------------------------------------------
# Label lines


def test_parse_label_text_rules():
    text = "\n".join(
        [
            "0 0.5 0.5 0.2 0.2",  # good
            "",  # blank lines are ignored
            "1 0.5 0.5 0.2",  # 4 fields
            "1 0.5 0.5 0.2 0.2 0.1",  # 6 fields (a segment?)
            "a 0.5 0.5 0.2 0.2",  # not a number
            "1 nan 0.5 0.2 0.2",  # NaN
            "7 0.5 0.5 0.2 0.2",  # class >= nc
            "-1 0.5 0.5 0.2 0.2",  # negative class
            "1.5 0.5 0.5 0.2 0.2",  # fractional class
            "1 1.5 0.5 0.2 0.2",  # coordinate > 1
            "1 0.5 -0.2 0.2 0.2",  # negative coordinate
            "1 1.0005 0.5 0.2 0.2",  # within tolerance: clipped
            "1 0.5 0.5 0.0 0.2",  # zero size
            "0 0.5 0.5 0.2 0.2",  # duplicate of line 1
            "2 0.95 0.5 0.3 0.2",  # extends beyond the image: clipped, noted
        ]
    )
    labels, n_dup, n_bad, notes = parse_label_text(text, nc=5, where="f.txt")
    assert n_dup == 1
    assert n_bad == 10
    np.testing.assert_allclose(labels[0], [0, 0.5, 0.5, 0.2, 0.2], atol=1e-7)
    np.testing.assert_allclose(labels[1], [1, 0.95, 0.5, 0.1, 0.2], atol=1e-6)  # 1.0005 -> 1
    np.testing.assert_allclose(labels[2], [2, 0.9, 0.5, 0.2, 0.2], atol=1e-6)
    report = "\n".join(notes)
    for lineno, reason in [
        (3, "4 fields"),
        (4, "6 fields"),
        (5, "not a number"),
        (6, "NaN"),
        (7, "class id 7 outside [0, 5)"),
        (8, "not a non-negative integer"),
        (9, "not a non-negative integer"),
        (10, "outside [0, 1]"),
        (11, "outside [0, 1]"),
        (13, "zero-size"),
        (14, "duplicate"),
        (15, "clipped"),
    ]:
        assert f"f.txt:{lineno}: " in report and reason in report, reason
    assert len(parse_label_text("5 0.5 0.5 0.1 0.1", nc=None)[0]) == 1  # no nc: any id >= 0


# ---------------------------------------------------------------------------------------------
# Cache


def _shapes_files(root: Path) -> tuple[list[str], list[str]]:
    files, _ = collect_image_files(root / "train.txt")
    return files, [img2label_path(f) for f in files]


def test_load_labels_checks_once_then_reads_the_cache(make_shapes_data, tmp_path, monkeypatch):
    """The first call checks every file and writes cache and report; the second reads the
    cache (no check) and returns the same arrays; a changed label file is checked again."""
    root = make_shapes_data(n_train=3, n_val=1).parent
    files, label_files = _shapes_files(root)
    cache_path, report_path = tmp_path / "c" / "train.cache.npz", tmp_path / "c" / "report.txt"
    calls = []
    real = labels_mod.build_label_cache
    monkeypatch.setattr(
        labels_mod, "build_label_cache", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    first = load_labels(files, label_files, 5, cache_path, report_path)
    assert len(calls) == 1 and cache_path.is_file()
    assert report_path.read_text().startswith(f"# {first.summary()}")
    assert first.files == files and first.ok.tolist() == [True] * 3
    assert first.stats["found"] + first.stats["empty"] == 3 and first.sizes.shape == (3, 2)
    assert (first.sizes >= 160).all()  # make_shapes_data's images are 160-256 px

    again = load_labels(files, label_files, 5, cache_path, report_path)
    assert len(calls) == 1
    assert again.files == first.files and again.stats == first.stats
    np.testing.assert_array_equal(again.sizes, first.sizes)
    for a, b in zip(again.labels, first.labels):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.float32 and a.shape[1] == 5

    Path(label_files[1]).write_text("4 0.5 0.5 0.25 0.25\n")
    changed = load_labels(files, label_files, 5, cache_path, report_path)
    assert len(calls) == 2
    np.testing.assert_array_equal(changed.labels[1], [[4, 0.5, 0.5, 0.25, 0.25]])
    # The class count is part of the key: a cache made for 5 classes does not serve 4.
    key4 = labels_mod.label_cache_key(files, label_files, 4)
    assert load_label_cache(cache_path, key4) is None
