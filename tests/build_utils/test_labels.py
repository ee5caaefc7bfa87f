"""build_utils/labels.py: label paths, image lists, label line rules, the label cache."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import give_non_utf8_name

from build_utils import atomic as atomic_mod
from build_utils import labels as labels_mod
from build_utils.errors import ConfigError
from build_utils.labels import (
    build_label_cache,
    cache_place,
    collect_image_files,
    img2label_path,
    list_entry_problem,
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


def test_collect_image_files_names_the_cache_after_the_list(make_shapes_data):
    root = make_shapes_data(n_train=2, n_val=1).parent
    lst = root / "train.txt"
    assert cache_place(lst).name == "train" and len(collect_image_files(lst)) == 2
    both = [lst, root / "train" / "images"]
    assert cache_place(both).name == "train+train" and len(collect_image_files(both)) == 4


def test_a_file_name_that_is_not_utf8_is_checked_cached_and_reported(make_shapes_data):
    """Was: an image named b"bad\\xe9name.jpg" (bad\\udce9name to Python) crashed
    label_cache_key with UnicodeEncodeError, and the report could not hold its name. Now the key
    hashes its bytes, the cache keeps and reloads it, and the report names it by its bytes."""
    root = make_shapes_data(n_train=2, n_val=1).parent
    folder = root / "train" / "images"
    bad = give_non_utf8_name(sorted(folder.iterdir())[0])
    with open(img2label_path(str(bad)), "a") as f:
        f.write("9 0.5 0.5 0.1 0.1\n")
    files = collect_image_files(folder)
    label_files = [img2label_path(f) for f in files]
    cache_path, report = root / "t.cache.npz", root / "t.cache_report.txt"
    cache = load_labels(files, label_files, 5, cache_path, report)
    assert cache.files[0] == str(bad) and cache.ok.tolist() == [True, True]
    again = load_label_cache(cache_path, labels_mod.label_cache_key(files, label_files, 5), 5)
    assert again is not None and again.files == files
    line = report.read_bytes().splitlines()[1]
    assert line.startswith(os.fsencode(img2label_path(str(bad))) + b":")
    assert line.endswith(b": dropped: class id 9 outside [0, 5): '9 0.5 0.5 0.1 0.1'")


def test_a_name_that_is_not_utf8_cannot_be_a_list_entry(tmp_path):
    """Lists are read as UTF-8 text, so a name that is not UTF-8 is refused as an entry."""
    assert list_entry_problem("/d/x.jpg") is None
    assert list_entry_problem(os.fsdecode(b"/d/bad\xe9name.jpg")) == (
        "its name is not UTF-8 (byte 0xe9), which an image list cannot hold; rename it"
    )
    lst = tmp_path / "train.txt"
    lst.write_bytes(b"bad\xe9name.jpg\n")
    with pytest.raises(ConfigError, match="image list is not UTF-8 text"):
        collect_image_files(lst)


def test_a_list_written_on_windows_is_named_in_one_warning(tmp_path, caplog):
    """Was: a Darknet train.txt from Windows (`data\\obj\\x.jpg`) dropped every image as
    "image file not found", the cause nowhere. Now one warning names it; a path that exists with
    a backslash in its name is taken quietly."""
    (tmp_path / "a\\b.jpg").write_bytes(b"")
    lst = tmp_path / "train.txt"
    lst.write_text("data\\obj\\x.jpg\r\ndata\\obj\\y.jpg\r\na\\b.jpg\r\n")
    with caplog.at_level(logging.WARNING):
        files = collect_image_files(lst)
    assert files[2] == str(tmp_path / "a\\b.jpg")
    assert [r.getMessage() for r in caplog.records] == [
        f"{lst}: 2 path(s) not found are written with Windows separators (backslashes), such as "
        "data\\obj\\x.jpg; write them with / (here a backslash is part of the file name)"
    ]


def test_a_darknet_list_read_from_the_current_folder_is_reported_once(
    tmp_path, monkeypatch, caplog
):
    """Was: Darknet's layout (data/train.txt listing data/obj/x.jpg, run from the folder above)
    gave the same warning each time a run read the list: four lines for train and val. Now
    once per list in a process."""
    (tmp_path / "data" / "obj").mkdir(parents=True)
    (tmp_path / "data" / "obj" / "x.jpg").write_bytes(b"")
    lst = tmp_path / "data" / "train.txt"
    lst.write_text("data/obj/x.jpg\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert collect_image_files(lst) == [str(tmp_path / "data" / "obj" / "x.jpg")]
    assert [r.getMessage() for r in caplog.records] == [
        f"{lst}: 1 relative path(s) exist only relative to the current directory, not to the "
        "list's folder; used them that way"
    ]


def test_a_missing_entry_of_a_current_folder_list_is_named_where_the_others_were_found(
    tmp_path, monkeypatch
):
    """Was: data/obj/gone.jpg of a list whose entries are found from the current folder was
    reported as data/data/obj/gone.jpg (beside the list), a place nobody looked."""
    (tmp_path / "data" / "obj").mkdir(parents=True)
    (tmp_path / "data" / "obj" / "x.jpg").write_bytes(b"")
    lst = tmp_path / "data" / "train.txt"
    lst.write_text("data/obj/x.jpg\ndata/obj/gone.jpg\n")
    monkeypatch.chdir(tmp_path)
    obj = tmp_path / "data" / "obj"
    assert collect_image_files(lst) == [str(obj / "x.jpg"), str(obj / "gone.jpg")]
    # A list of paths beside it keeps naming a missing one beside it.
    lst.write_text("obj/x.jpg\nobj/gone.jpg\n")
    assert collect_image_files(lst) == [str(obj / "x.jpg"), str(obj / "gone.jpg")]


def test_cache_place_is_beside_what_the_user_named_never_an_entry(tmp_path, monkeypatch):
    """Caches go beside the list file or folder named, whatever the list's entries say: a list
    whose entries traverse (``../../x``) does not move the cache there."""
    d = tmp_path / "d"
    (d / "train" / "images").mkdir(parents=True)
    (d / "val").mkdir()
    (d / "train.txt").write_text("../../elsewhere/images/x.jpg\n")
    assert cache_place(d / "train.txt") == d / "train"
    assert cache_place(d / "val") == d / "val"  # beside the folder, not inside it
    assert cache_place(d / "train" / "images") == d / "train" / "train"
    assert cache_place([d / "train.txt", d / "val"]) == d / "train+val"
    monkeypatch.chdir(d / "val")
    assert cache_place(".") == d / "val" and cache_place("..") == tmp_path / "d"


# ---------------------------------------------------------------------------------------------
# Label lines


def test_polygon_lines_become_their_boxes():
    """Was: a segment label (YOLOv5/YOLOv8 'class x1 y1 x2 y2 x3 y3 ...') dropped as '9 fields',
    so a segmentation dataset trained a detector on no objects; YOLOv5 takes the polygon's box."""
    text = "\n".join(
        [
            "2 0.1 0.2 0.5 0.2 0.5 0.6 0.1 0.6",  # a 4-point polygon
            "1 0.3 0.3 0.7 0.3 0.5 0.9",  # a triangle
            "1 0.1 0.1 0.2 0.1 0.2 0.2 0.1",  # an odd coordinate count: not a polygon
            "0 0.1 0.1 1.5 0.1 0.2 0.2",  # a point outside the image
            "0 0.5 0.5 0.5 0.5 0.5 0.5",  # all points at one place: zero size
        ]
    )
    labels, n_dup, n_bad, notes = parse_label_text(text, nc=3, where="seg.txt")
    np.testing.assert_allclose(
        labels, [[2, 0.3, 0.4, 0.4, 0.4], [1, 0.5, 0.6, 0.4, 0.6]], atol=1e-6
    )
    assert (n_dup, n_bad) == (0, 3)
    assert notes[0].startswith("seg.txt:3: dropped: 8 fields, expected 5 (class cx cy w h) or a")
    assert notes[1].startswith("seg.txt:4: dropped: coordinate outside [0, 1]")
    assert notes[2].startswith("seg.txt:5: dropped: zero-size box")


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
    files = collect_image_files(root / "train.txt")
    return files, [img2label_path(f) for f in files]


def test_a_read_only_dataset_is_checked_and_reported_once(make_shapes_data, tmp_path, monkeypatch):
    """Was: on a read-only dataset every load (the start-up check, then the training set)
    checked the labels again and printed both warnings again (cache and report). Now one
    warning naming the cache, once per process, and the second load reuses the check."""
    root = make_shapes_data(n_train=3, n_val=1).parent
    files, label_files = _shapes_files(root)
    cache_path, report_path = tmp_path / "ro" / "train.cache.npz", tmp_path / "ro" / "r.txt"
    calls = []
    real = labels_mod.build_label_cache
    monkeypatch.setattr(
        labels_mod, "build_label_cache", lambda *a, **k: calls.append(1) or real(*a, **k)
    )

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(atomic_mod, "_open_temp", read_only)
    monkeypatch.setattr(labels_mod, "_unsaved", {})
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    labels_mod.LOGGER.addHandler(handler)
    try:
        first = load_labels(files, label_files, 5, cache_path, report_path)
        again = load_labels(files, label_files, 5, cache_path, report_path)
    finally:
        labels_mod.LOGGER.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"cannot write label cache {cache_path}")
    assert len(calls) == 1 and again.files == first.files
    assert not cache_path.exists() and not report_path.exists()


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


def test_label_edited_with_size_and_time_kept_is_read_again(make_shapes_data, tmp_path):
    """The key hashes the labels' bytes: an edit that keeps the file's size and modification
    time (``touch -r``) is not served from the cache."""
    root = make_shapes_data(n_train=2, n_val=1).parent
    files, label_files = _shapes_files(root)
    cache_path, report_path = tmp_path / "train.cache.npz", tmp_path / "report.txt"
    lbl = Path(label_files[0])
    lbl.write_text("1 0.5 0.5 0.25 0.25\n")
    load_labels(files, label_files, 5, cache_path, report_path)
    st = lbl.stat()
    lbl.write_text("3 0.5 0.5 0.25 0.25\n")  # same size
    os.utime(lbl, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert lbl.stat().st_size == st.st_size and lbl.stat().st_mtime_ns == st.st_mtime_ns
    again = load_labels(files, label_files, 5, cache_path, report_path)
    np.testing.assert_array_equal(again.labels[0], [[3, 0.5, 0.5, 0.25, 0.25]])


def test_label_digest_never_opens_what_is_not_a_small_regular_file(tmp_path, monkeypatch):
    """A FIFO, a folder or an over-limit file adds its reason to the key, unread (a FIFO would
    block the open forever); a regular file adds the hash of its bytes."""
    fifo, folder, big = tmp_path / "fifo.txt", tmp_path / "dir.txt", tmp_path / "big.txt"
    os.mkfifo(fifo)
    folder.mkdir()
    big.write_text("0 0.5 0.5 0.1 0.1\n" * 10)
    monkeypatch.setenv("YOLO_MAX_LABEL_BYTES", "100")
    assert labels_mod.label_file_digest(str(fifo)) == "!a FIFO (named pipe), not a regular file"
    assert labels_mod.label_file_digest(str(folder)) == "!a folder, not a file"
    assert labels_mod.label_file_digest(str(big)).startswith("!180 B, over the limit of 100 B")
    assert labels_mod.label_file_digest(str(tmp_path / "none.txt")) == "!file not found"
    small = tmp_path / "small.txt"
    small.write_bytes(b"0 0.5 0.5 0.1 0.1\n")
    import hashlib

    expect = hashlib.blake2b(small.read_bytes(), digest_size=32).hexdigest()
    assert labels_mod.label_file_digest(str(small)) == expect


def _edit_cache(path: Path, **changes) -> None:
    """Rewrite the cache file at ``path`` with some arrays replaced, its key kept."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    for k, fn in changes.items():
        arrays[k] = fn(arrays[k])
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _set(a: np.ndarray, index, value) -> np.ndarray:
    a = a.copy()
    a[index] = value
    return a


def test_cache_that_disagrees_with_itself_is_rebuilt_with_a_warning(
    make_shapes_data, tmp_path, caplog
):
    """A cache with a valid key whose arrays disagree (images marked excluded that the stats
    count as used, counts that do not add up, NaN or out-of-range labels, a shortened file
    list...) is rebuilt, with a warning naming the cache and what disagreed; the result is the
    one a fresh check gives."""
    root = make_shapes_data(n_train=6, n_val=1).parent
    files, label_files = _shapes_files(root)
    Path(label_files[0]).write_text("1 0.5 0.5 0.25 0.25\n2 0.3 0.3 0.2 0.2\n")
    cache_path, report_path = tmp_path / "train.cache.npz", tmp_path / "report.txt"
    truth = load_labels(files, label_files, 5, cache_path, report_path)
    good = cache_path.read_bytes()
    cases = {
        "ok": (dict(ok=lambda a: _set(a, slice(0, None), False)), "excluded images"),
        "counts": (dict(counts=lambda a: _set(a, 0, 1)), "label counts add up"),
        "nan": (dict(labels=lambda a: _set(a, (0, 1), np.nan)), "NaN"),
        "class": (dict(labels=lambda a: _set(a, (0, 0), 7)), "class id 7 outside [0, 5)"),
        "box": (dict(labels=lambda a: _set(a, (0, 1), 0.99)), "boxes outside [0, 1]"),
        "files": (dict(files=lambda a: a[:-1]), "entries in ok"),
        "stats": (dict(stats=lambda a: _set(a, 0, 0)), "stats count"),
        "sizes": (dict(sizes=lambda a: a.astype(np.float64)), "sizes is float64"),
        "report": (
            dict(stats=lambda a: _set(a, 4, 3), report=lambda a: a[:0]),
            "report lines",
        ),
    }
    for name, (changes, fragment) in cases.items():
        cache_path.write_bytes(good)
        _edit_cache(cache_path, **changes)
        caplog.clear()
        got = load_labels(files, label_files, 5, cache_path, report_path)
        assert f"label cache {cache_path} disagrees with itself" in caplog.text, name
        assert fragment in caplog.text, (name, caplog.text)
        assert got.stats == truth.stats and got.ok.tolist() == truth.ok.tolist(), name
        for a, b in zip(got.labels, truth.labels):
            np.testing.assert_array_equal(a, b)
        with np.load(cache_path, allow_pickle=False) as z:  # rewritten, key kept
            assert z["stats"].tolist() == list(truth.stats.values()), name
        # The rewritten cache is trusted again.
        caplog.clear()
        assert load_label_cache(cache_path, labels_mod.label_cache_key(files, label_files, 5), 5)
        assert "disagrees" not in caplog.text


def test_cache_member_declaring_a_huge_array_is_not_allocated(make_shapes_data, tmp_path, caplog):
    """A cache member whose header declares far more than the file holds (np.load allocates the
    declared shape first: a MemoryError traceback) or a compressed member (a zip bomb) is
    reported as unreadable and rebuilt; nothing of the declared size is allocated."""
    import zipfile

    root = make_shapes_data(n_train=2, n_val=1).parent
    files, label_files = _shapes_files(root)
    cache_path, report_path = tmp_path / "train.cache.npz", tmp_path / "report.txt"
    truth = load_labels(files, label_files, 5, cache_path, report_path)
    with np.load(cache_path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    huge = {"descr": "<f4", "fortran_order": False, "shape": (10**8, 10**6)}  # 400 TB
    with zipfile.ZipFile(cache_path, "w") as zf:
        for k, a in arrays.items():
            with zf.open(f"{k}.npy", "w") as f:
                if k == "labels":
                    np.lib.format.write_array_header_1_0(f, huge)
                    f.write(a.tobytes())
                else:
                    np.lib.format.write_array(f, a, allow_pickle=False)
    got = load_labels(files, label_files, 5, cache_path, report_path)
    assert "declares an array of shape (100000000, 1000000)" in caplog.text
    assert got.stats == truth.stats
    with np.load(cache_path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez_compressed(cache_path, **arrays)
    caplog.clear()
    assert load_labels(files, label_files, 5, cache_path, report_path).stats == truth.stats
    assert "is compressed" in caplog.text


def test_yolo_txt_lines_golden():
    det = np.array([[10, 20, 50, 60, 0.87654, 3], [-5, 0, 20, 10, 0.5, 0]])
    assert labels_mod.yolo_txt_lines(det, 100, 80, save_conf=True) == [
        "3 0.300000 0.500000 0.400000 0.500000 0.87654",
        "0 0.100000 0.062500 0.200000 0.125000 0.50000",  # clipped to the image
    ]
    assert labels_mod.yolo_txt_lines(det[:1], 100, 80, save_conf=False) == [
        "3 0.300000 0.500000 0.400000 0.500000"
    ]
    assert labels_mod.yolo_txt_lines(np.zeros((0, 6)), 100, 80, save_conf=True) == []


def test_images_sharing_a_label_file_are_excluded(tmp_path):
    """Was: x.jpg and x.png both took labels/x.txt, one of them silently with another picture's
    objects (as YOLOv5 does). The same image listed twice (oversampling) keeps its labels."""
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    img = np.full((32, 48, 3), 90, np.uint8)
    for name in ("x.jpg", "x.png", "y.jpg"):
        cv2.imwrite(str(tmp_path / "images" / name), img)
    for stem in ("x", "y"):
        (tmp_path / "labels" / f"{stem}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    files = [str(tmp_path / "images" / n) for n in ("x.jpg", "x.png", "y.jpg", "y.jpg")]
    cache = build_label_cache(files, [img2label_path(f) for f in files], nc=1)
    assert cache.ok.tolist() == [False, False, True, True]
    assert [len(x) for x in cache.labels] == [0, 0, 1, 1]
    label = tmp_path / "labels" / "x.txt"
    assert cache.report == [
        f"{files[0]}: excluded: its label file {label} is also the one of {files[1]}; give each "
        "image its own name",
        f"{files[1]}: excluded: its label file {label} is also the one of {files[0]}; give each "
        "image its own name",
    ]
    assert cache.stats["corrupt"] == 2
