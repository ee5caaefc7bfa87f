"""Dataset tools on data made by the demo generator: VOC -> YOLO, lists/.data/cfg, anchors."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import give_non_utf8_name, run_script, run_with_model_cfg

from build_utils.datasets import LoadImagesAndLabels
from build_utils.parse_config import parse_data_cfg, parse_model_cfg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import calculate_dataset
import kmeans_anchors
import trans_voc2yolo

REPO = Path(__file__).resolve().parents[2]
NANO_CFG = REPO / "cfg" / "yolov3-spp-nano.cfg"


def _labels(folder: Path) -> dict[str, np.ndarray]:
    """stem -> (n, 5) label rows of every label file in ``folder``."""
    return {
        p.stem: np.array(
            [
                [float(v) for v in line.split()]
                for line in p.read_text().splitlines()
                if line.strip()
            ]
        ).reshape(-1, 5)
        for p in sorted(folder.glob("*.txt"))
    }


def _xml(name: str, size: tuple[int, int] | None, objects: list[tuple]) -> str:
    parts = ["<annotation>", f"<filename>{name}</filename>"]
    if size is not None:
        parts.append(f"<size><width>{size[0]}</width><height>{size[1]}</height></size>")
    for cls, box, difficult in objects:
        parts.append(
            f"<object><name>{cls}</name><difficult>{difficult}</difficult><bndbox>"
            f"<xmin>{box[0]}</xmin><ymin>{box[1]}</ymin><xmax>{box[2]}</xmax>"
            f"<ymax>{box[3]}</ymax></bndbox></object>"
        )
    return "".join(parts) + "</annotation>"


def _jpeg_with_exif(img: np.ndarray, orientation: int) -> bytes:
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    tiff = b"II\x2a\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
    tiff += struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack("<I", 0)
    app1 = b"Exif\x00\x00" + tiff
    data = buf.tobytes()
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + data[2:]


# ---------------------------------------------------------------------------------------------
# VOC -> YOLO


def test_voc_to_yolo_reproduces_the_generator_labels(make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=10, n_val=4, voc=True)
    root = data.parent
    out = tmp_path / "out"
    for split in ("train", "val"):
        rc = trans_voc2yolo.main(
            [
                "--xml-dir",
                str(root / split / "Annotations"),
                "--img-dir",
                str(root / split / "images"),
                "--label-dir",
                str(out / split / "labels"),
                "--classes",
                str(root / "shapes.names"),
                "--names-out",
                str(out / "shapes.names"),
                # The second split writes the same names file: replacing it is asked for.
                *(["--exist-ok"] if split == "val" else []),
            ]
        )
        assert rc == 0
        want, got = _labels(root / split / "labels"), _labels(out / split / "labels")
        assert want.keys() == got.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], atol=1e-6)
    assert (out / "shapes.names").read_text() == (root / "shapes.names").read_text()
    assert (out / "train" / "voc2yolo_report.txt").read_text().startswith("# 10 XML files")


def test_voc_report_names_an_xml_file_whose_name_is_not_utf8(make_shapes_data, tmp_path):
    """Was: a UnicodeEncodeError traceback writing the report, after the labels and the names
    file were written (so the same command then refused: names file exists). The report now
    names the file by its bytes on disk."""
    root = make_shapes_data(n_train=2, n_val=1, voc=True).parent / "train"
    xml = root / "Annotations" / "train_000001.xml"
    odd = xml.with_name(os.fsdecode(b"odd\xff.xml"))
    try:
        xml.rename(odd)
    except OSError as e:
        pytest.skip(f"this file system refuses names that are not UTF-8 ({e})")
    argv = ["--xml-dir", str(root / "Annotations"), "--img-dir", str(root / "images")]
    assert trans_voc2yolo.main([*argv, "--label-dir", str(tmp_path / "labels")]) == 0
    report = (tmp_path / "voc2yolo_report.txt").read_bytes()
    assert b"odd\xff.xml: no image odd\xff.* in " in report


def test_voc_problems_are_handled_and_reported(tmp_path, capsys):
    xml_dir, img_dir, label_dir = tmp_path / "Annotations", tmp_path / "images", tmp_path / "labels"
    xml_dir.mkdir()
    img_dir.mkdir()
    img = np.zeros((50, 80, 3), np.uint8)
    for name in ("a", "b", "c", "d", "e"):
        cv2.imwrite(str(img_dir / f"{name}.png"), img)
    (xml_dir / "a.xml").write_text(
        _xml(
            "a.png",
            (80, 50),
            [
                ("dog", (10, 10, 30, 40), 0),
                ("cat", (0, 0, 20, 20), 1),  # difficult
                ("dog", (60, 30, 95, 60), 0),  # beyond the image: clipped to (60, 30, 80, 50)
                ("bird", (5, 5, 9, 9), 0),  # unknown class
                ("dog", (90, 10, 99, 20), 0),
            ],
        )
    )  # entirely outside: skipped
    (xml_dir / "b.xml").write_text(_xml("b.png", None, [("cat", (8, 5, 24, 25), 0)]))  # no size
    (xml_dir / "c.xml").write_text("<annotation><size>")  # malformed
    (xml_dir / "d.xml").write_text(_xml("d.png", (80, 50), []))  # no objects: a negative
    (xml_dir / "e.xml").write_text(_xml("e.png", (160, 100), [("cat", (20, 20, 60, 60), 0)]))
    (tmp_path / "classes.json").write_text(json.dumps({"cat": 1, "dog": 2}))  # 1-based ids
    rc = trans_voc2yolo.main(
        [
            "--xml-dir",
            str(xml_dir),
            "--img-dir",
            str(img_dir),
            "--label-dir",
            str(label_dir),
            "--classes",
            str(tmp_path / "classes.json"),
        ]
    )
    assert rc == 0
    labels = _labels(label_dir)
    np.testing.assert_allclose(
        labels["a"],
        [[1, 20 / 80, 25 / 50, 20 / 80, 30 / 50], [1, 70 / 80, 40 / 50, 20 / 80, 20 / 50]],
        atol=1e-6,
    )
    np.testing.assert_allclose(labels["b"], [[0, 16 / 80, 15 / 50, 16 / 80, 20 / 50]], atol=1e-6)
    assert labels["d"].shape == (0, 5) and "c" not in labels
    # e: <size> 160x100 is the 80x50 image resized: the boxes are in the XML's frame.
    np.testing.assert_allclose(
        labels["e"], [[0, 40 / 160, 40 / 100, 40 / 160, 40 / 100]], atol=1e-6
    )
    report = (tmp_path / "voc2yolo_report.txt").read_text()
    for what in [
        "a.xml: object 3: box (60, 30, 95, 60) clipped",
        "unknown class 'bird'",
        "object 5: empty box, skipped",
        "b.xml: no <size>; used the image's 80x50",
        "c.xml: skipped: unreadable XML",
        "d.xml: no objects kept",
        "e.xml: <size> 160x100 is a resized 80x50",
    ]:
        assert what in report, what
    assert report.startswith(
        "# 5 XML files: 4 label files written with 4 objects; 1 files and 3 objects skipped"
    )

    rc = trans_voc2yolo.main(
        [
            "--xml-dir",
            str(xml_dir),
            "--img-dir",
            str(img_dir),
            "--label-dir",
            str(tmp_path / "l2"),
            "--include-difficult",
            "--one-based",
            "--names-out",
            str(tmp_path / "collected.names"),
            "--exist-ok",  # the report beside the labels' folder is the first run's
        ]
    )
    assert rc == 0
    assert (tmp_path / "collected.names").read_text() == "bird\ncat\ndog\n"  # from the XML
    a = _labels(tmp_path / "l2")["a"]
    assert len(a) == 4  # the difficult cat and the bird are kept now
    np.testing.assert_allclose(a[0], [2, 19.5 / 80, 24.5 / 50, 21 / 80, 31 / 50], atol=1e-6)

    assert trans_voc2yolo.main(["--xml-dir", str(xml_dir)]) == 2
    assert "error: --xml-dir needs --label-dir" in capsys.readouterr().err


def test_voc_boxes_on_sideways_photos_agree_with_the_loader(tmp_path):
    """A JPEG stored 90x60 with EXIF orientation 6 is shown upright (60x90) by the loader; an
    XML written on the stored pixels (LabelImg) gets its boxes rotated."""
    raw = np.zeros((60, 90, 3), np.uint8)
    raw[10:30, 20:50] = (0, 0, 255)  # stored-frame box (20, 10, 50, 30)
    root = tmp_path / "ds"
    (root / "images").mkdir(parents=True)
    (root / "Annotations").mkdir()
    (root / "images" / "p.jpg").write_bytes(_jpeg_with_exif(raw, 6))
    (root / "Annotations" / "p.xml").write_text(
        _xml("p.jpg", (90, 60), [("o", (20, 10, 50, 30), 0)])
    )
    (tmp_path / "o.names").write_text("o\n")
    assert (
        trans_voc2yolo.main(
            [
                "--xml-dir",
                str(root / "Annotations"),
                "--img-dir",
                str(root / "images"),
                "--label-dir",
                str(root / "labels"),
                "--classes",
                str(tmp_path / "o.names"),
            ]
        )
        == 0
    )
    assert "rotated to the image's EXIF orientation 6" in (root / "voc2yolo_report.txt").read_text()
    d = LoadImagesAndLabels(root / "images", 96)
    assert d.shapes[0].tolist() == [60, 90]
    img, labels, *_ = d[0]
    red = ((img[0] > 150) & (img[1] < 80)).numpy()
    ys, xs = np.nonzero(red)
    _, _, cx, cy, w, h = labels[0].tolist()
    H, W = img.shape[1:]
    np.testing.assert_allclose(
        [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1],
        [(cx - w / 2) * W, (cy - h / 2) * H, (cx + w / 2) * W, (cy + h / 2) * H],
        atol=1.5,
    )


def _voc_devkit(src: Path, voc: Path) -> Path:
    """The shapes set ``src`` (made with ``voc=True``) as a VOC devkit year folder ``voc``:
    JPEGImages, Annotations and ImageSets/Main/{train,val}.txt."""
    (voc / "ImageSets" / "Main").mkdir(parents=True)
    (voc / "JPEGImages").mkdir()
    (voc / "Annotations").mkdir()
    for split in ("train", "val"):
        ids = []
        for p in sorted((src / split / "images").glob("*.jpg")):
            (voc / "JPEGImages" / p.name).write_bytes(p.read_bytes())
            xml = src / split / "Annotations" / f"{p.stem}.xml"
            (voc / "Annotations" / xml.name).write_bytes(xml.read_bytes())
            ids.append(p.stem)
        (voc / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return voc


def test_voc_devkit_layout(make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=6, n_val=3, voc=True)
    src = data.parent
    voc = _voc_devkit(src, tmp_path / "VOC2012")
    out = tmp_path / "yolo"
    assert (
        trans_voc2yolo.main(
            ["--voc-root", str(voc), "--out", str(out), "--classes", str(src / "shapes.names")]
        )
        == 0
    )
    for split, n in (("train", 6), ("val", 3)):
        assert len(list((out / split / "images").glob("*.jpg"))) == n
        want, got = _labels(src / split / "labels"), _labels(out / split / "labels")
        assert want.keys() == got.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], atol=1e-6)


def test_converters_write_boxes_labels_and_images_one_way(tmp_path):
    """build_utils/yolo_output.py, what both converters write with: an atomic label file, an image
    linked (or copied) in place, the report's text."""
    from build_utils.yolo_output import place_image, report_text, write_labels

    label = tmp_path / "x.txt"
    write_labels(label, ["0 0.5 0.5 0.1 0.1", "1 0.2 0.2 0.1 0.1"])
    assert label.read_text() == "0 0.5 0.5 0.1 0.1\n1 0.2 0.2 0.1 0.1\n"
    write_labels(label, [])
    assert label.read_text() == ""  # a background image
    src = tmp_path / "a.jpg"
    src.write_bytes(b"jpeg")
    for copy in (False, True):
        dst = tmp_path / f"b{copy}.jpg"
        place_image(src, dst, copy)
        assert dst.read_bytes() == b"jpeg" and (dst.stat().st_ino == src.stat().st_ino) != copy
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.jpg",
        "bFalse.jpg",
        "bTrue.jpg",
        "x.txt",
    ]
    assert report_text("2 files", ["a: skipped"]) == "# 2 files\na: skipped\n"


def test_voc_conversion_never_writes_over_labels_unasked(make_shapes_data, tmp_path, capsys):
    """Was: --label-dir pointing at a folder of labels (a hand-edited one, or the dataset's own
    labels/) replaced them, exit 0. Now one line, exit 2, nothing written, unless --exist-ok."""
    data = make_shapes_data(n_train=3, n_val=2, voc=True)
    root = data.parent
    labels = root / "train" / "labels"
    before = {p.name: p.read_bytes() for p in labels.iterdir()}
    edited = sorted(labels.glob("*.txt"))[0]
    edited.write_text("0 0.5 0.5 0.1 0.1\n")
    before[edited.name] = edited.read_bytes()
    argv = [
        "--xml-dir",
        str(root / "train" / "Annotations"),
        "--label-dir",
        str(labels),
        "--classes",
        str(root / "shapes.names"),
        "--names-out",
        str(tmp_path / "n.names"),
        "--report",
        str(tmp_path / "r.txt"),
    ]
    capsys.readouterr()
    assert trans_voc2yolo.main(argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {labels} already holds label files") and "--exist-ok" in line
    assert {p.name: p.read_bytes() for p in labels.iterdir()} == before
    assert not (tmp_path / "n.names").exists() and not (tmp_path / "r.txt").exists()
    assert trans_voc2yolo.main([*argv, "--exist-ok"]) == 0
    assert edited.read_bytes() != before[edited.name]  # asked for: the XML's boxes again


def _one_voc_file(root: Path, size: tuple[int, int] | None = (30, 20)) -> tuple[Path, Path]:
    """``root/xml/a.xml`` (one ``cat``, the XML's ``<size>``: ``size``) and ``root/img/a.png``
    (30x20)."""
    xml_dir, img_dir = root / "xml", root / "img"
    xml_dir.mkdir()
    img_dir.mkdir()
    (xml_dir / "a.xml").write_text(_xml("a.png", size, [("cat", (3, 2, 15, 10), 0)]))
    cv2.imwrite(str(img_dir / "a.png"), np.zeros((20, 30, 3), np.uint8))
    return xml_dir, img_dir


def test_voc_outputs_in_the_way_are_one_line_before_anything_is_written(tmp_path, capsys):
    """Was: a file given as --label-dir ended in a FileExistsError traceback (exit 1); an existing
    folder given as --report with --exist-ok failed (exit 2) only after every label file and the
    names file were written. Now both are one line, exit 2, before anything is written."""
    xml_dir, img_dir = _one_voc_file(tmp_path)
    blocker = tmp_path / "labels"
    blocker.write_text("mine")
    argv = ["--xml-dir", str(xml_dir), "--img-dir", str(img_dir), "--exist-ok"]
    capsys.readouterr()
    assert trans_voc2yolo.main([*argv, "--label-dir", str(blocker)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"error: cannot write {blocker}: {blocker} is a file where a folder should be; "
        "move it away or choose another --label-dir"
    )
    assert blocker.read_text() == "mine"
    report = tmp_path / "report"
    report.mkdir()
    label_dir = tmp_path / "out" / "labels"
    assert trans_voc2yolo.main([*argv, "--label-dir", str(label_dir), "--report", str(report)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"error: cannot write {report}: {report} is a folder, not a file; "
        "move it away or choose another --report"
    )
    assert not (tmp_path / "out").exists() and list(report.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img", "labels", "report", "xml"]
    # --voc-root: a file where a split's images folder goes.
    voc = tmp_path / "VOC"
    (voc / "ImageSets" / "Main").mkdir(parents=True)
    (voc / "ImageSets" / "Main" / "train.txt").write_text("a\n")
    xml_dir.rename(voc / "Annotations")
    img_dir.rename(voc / "JPEGImages")
    (tmp_path / "o" / "train").mkdir(parents=True)
    (tmp_path / "o" / "train" / "images").write_text("mine")
    voc_argv = ["--voc-root", str(voc), "--out", str(tmp_path / "o"), "--splits", "train"]
    assert trans_voc2yolo.main(voc_argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "images is a file where a folder should be; move it away or choose another --out" in line
    assert sorted(p.name for p in (tmp_path / "o").rglob("*")) == ["images", "train"]


def test_voc_names_and_report_never_replace_an_input_a_label_or_each_other(tmp_path, capsys):
    """Was: --names-out/--report naming an input XML or image (with --exist-ok), a label file the
    run writes, or each other (without it) were written over, exit 0. Now one line, exit 2,
    nothing written."""
    xml_dir, img_dir = _one_voc_file(tmp_path)
    xml, img, labels = xml_dir / "a.xml", img_dir / "a.png", tmp_path / "labels"
    before = {xml: xml.read_bytes(), img: img.read_bytes()}
    argv = ["--xml-dir", str(xml_dir), "--img-dir", str(img_dir), "--label-dir", str(labels)]
    same = tmp_path / "same.txt"
    cases = [
        (["--names-out", str(xml), "--exist-ok"], f"--names-out {xml} is an XML file this tool"),
        (["--report", str(img), "--exist-ok"], f"--report {img} is an image this tool reads"),
        (["--report", str(labels / "a.txt")], f"--report {labels / 'a.txt'} lies in the label"),
        (["--names-out", str(same), "--report", str(same)], f"--report {same} is also --names"),
    ]
    for extra, start in cases:
        capsys.readouterr()
        assert trans_voc2yolo.main([*argv, *extra]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: {start}")
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img", "xml"]


def test_voc_size_and_folder_problems_are_named_as_they_are(tmp_path, capsys):
    """Was: a negative or zero <size> was reported as "no <size>", and a --xml-dir or --voc-root
    that does not exist as "no object names found in the XML files"."""
    xml_dir, img_dir = _one_voc_file(tmp_path, size=(-5, 0))
    label_dir = tmp_path / "labels"
    argv = ["--xml-dir", str(xml_dir), "--img-dir", str(img_dir), "--label-dir", str(label_dir)]
    assert trans_voc2yolo.main(argv) == 0
    report = (tmp_path / "voc2yolo_report.txt").read_text()
    assert "a.xml: <size> -5x0 is not a positive size; used the image's 30x20" in report
    assert "no <size>" not in report
    np.testing.assert_allclose(_labels(label_dir)["a"], [[0, 0.3, 0.3, 0.4, 0.4]], atol=1e-6)
    capsys.readouterr()
    missing = tmp_path / "nope"
    for flag, more in (("--xml-dir", ["--label-dir", str(tmp_path / "l")]), ("--voc-root", [])):
        out = ["--out", str(tmp_path / "o")] if flag == "--voc-root" else []
        assert trans_voc2yolo.main([flag, str(missing), *more, *out]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == f"error: {missing}: {flag}: folder not found"
        # Was: "folder not found" for a file too.
        file = tmp_path / "a.xml"
        file.write_text("<annotation/>")
        assert trans_voc2yolo.main([flag, str(file), *more, *out]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == f"error: {file}: {flag}: a file, not a folder"
    assert not (tmp_path / "l").exists() and not (tmp_path / "o").exists()


def test_voc_devkit_keeps_the_class_order_and_writes_names_and_data_yaml(
    make_shapes_data, tmp_path, capsys
):
    """Was: no names file or data.yaml unless --names-out, so the ids (sorted names without
    --classes) were nowhere recorded. Now --classes' order is the ids', and OUT/classes.names
    and OUT/data.yaml (which train.py reads) record it; a second conversion into OUT is refused
    unless --exist-ok."""
    data = make_shapes_data(n_train=3, n_val=2, voc=True)
    src = data.parent
    voc = _voc_devkit(src, tmp_path / "VOC")
    order = (src / "shapes.names").read_text().split()
    assert order != sorted(order)  # the generator's order is not alphabetical
    out = tmp_path / "yolo"
    argv = ["--voc-root", str(voc), "--out", str(out), "--classes", str(src / "shapes.names")]
    assert trans_voc2yolo.main(argv) == 0
    assert (out / "classes.names").read_text().split() == order
    parsed = parse_data_cfg(out / "data.yaml")
    assert parsed["class_names"] == order and parsed["classes"] == len(order)
    assert Path(parsed["train"]) == out / "train" / "images"
    assert Path(parsed["valid"]) == out / "val" / "images"
    for split in ("train", "val"):  # the generator's ids, i.e. the order given
        want, got = _labels(src / split / "labels"), _labels(out / split / "labels")
        assert want.keys() == got.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], atol=1e-6)
    capsys.readouterr()
    before = (out / "data.yaml").read_text()
    assert trans_voc2yolo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"{out / 'train' / 'labels'} already holds label files" in err
    assert (out / "data.yaml").read_text() == before
    assert trans_voc2yolo.main([*argv, "--exist-ok"]) == 0


# ---------------------------------------------------------------------------------------------
# Lists, .data and cfg


def test_calculate_dataset_writes_lists_data_and_cfg(make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=8, n_val=4)
    root = data.parent
    out = tmp_path / "out"
    rc = calculate_dataset.main(
        [
            "--root",
            str(root),
            "--names",
            str(root / "shapes.names"),
            "--cfg",
            str(NANO_CFG),
            "--out-dir",
            str(out),
        ]
    )
    assert rc == 0
    d = parse_data_cfg(out / "my_data.data")
    assert d["classes"] == 5
    assert Path(d["train"]).resolve() == (out / "my_train_data.txt").resolve()
    lines = (out / "my_train_data.txt").read_text().split()
    assert len(lines) == 8 and not Path(lines[0]).is_absolute()
    train = LoadImagesAndLabels(d["train"], 64, nc=5)
    ref = LoadImagesAndLabels(root / "train.txt", 64, nc=5)
    assert train.img_files == ref.img_files
    assert len(LoadImagesAndLabels(d["valid"], 64, nc=5)) == 4
    blocks = parse_model_cfg(out / "my_yolov3-spp-nano.cfg")
    heads = [b for b in blocks if b["type"] == "yolo"]
    assert heads and all(b["classes"] == 5 for b in heads)


def test_calculate_dataset_keeps_existing_files_unless_exist_ok(make_shapes_data, tmp_path, capsys):
    """Was: a second run (or a user's my_data.data) was written over in silence."""
    data = make_shapes_data(n_train=4, n_val=2)
    root, out = data.parent, tmp_path / "out"
    argv = ["--root", str(root), "--names", str(root / "shapes.names"), "--out-dir", str(out)]
    out.mkdir()
    (out / "my_data.data").write_text("mine\n")
    assert calculate_dataset.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"{out / 'my_data.data'} already exists; pass --exist-ok" in err
    assert sorted(p.name for p in out.iterdir()) == ["my_data.data"]
    assert calculate_dataset.main([*argv, "--exist-ok"]) == 0
    assert parse_data_cfg(out / "my_data.data")["classes"] == 5


def test_calculate_dataset_never_writes_among_the_labels_or_images(make_shapes_data, capsys):
    """Was: --out-dir ROOT/train/labels put the lists and .data among the label files, which
    the next scan reported as label files without an image, exit 0. Now one line, exit 2."""
    data = make_shapes_data(n_train=4, n_val=2)
    root = data.parent
    for folder in (root / "train" / "labels", root / "val" / "images"):
        before = sorted(folder.iterdir())
        argv = [
            "--root",
            str(root),
            "--names",
            str(root / "shapes.names"),
            "--out-dir",
            str(folder),
        ]
        capsys.readouterr()
        assert calculate_dataset.main(argv) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == (
            f"error: --out-dir/--name {folder / 'my_train_data.txt'} lies in a split's label or "
            f"image folder {folder}; choose a place outside it"
        )
        assert sorted(folder.iterdir()) == before


def test_calculate_dataset_name_is_a_plain_prefix(make_shapes_data, tmp_path, capsys):
    """Was: --name '' wrote _data.data, --name ../x wrote beside --out-dir, exit 0."""
    data = make_shapes_data(n_train=4, n_val=2)
    root, out = data.parent, tmp_path / "out"
    argv = ["--root", str(root), "--names", str(root / "shapes.names"), "--out-dir", str(out)]
    for name in ("", "../x", "a/b"):
        capsys.readouterr()
        assert calculate_dataset.main([*argv, "--name", name]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == f"error: --name {name!r}: give a file-name prefix without a folder, e.g. my"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"] and not out.exists()


def test_calculate_dataset_with_a_relative_root(make_shapes_data, monkeypatch):
    """``--root shapes`` from the dataset's parent folder (all paths relative), as a user types
    it: the same lists as with the absolute root."""
    root = make_shapes_data(n_train=4, n_val=2).parent
    monkeypatch.chdir(root.parent)
    rc = calculate_dataset.main(["--root", root.name, "--names", f"{root.name}/shapes.names"])
    assert rc == 0
    d = parse_data_cfg(root / "my_data.data")
    train = LoadImagesAndLabels(d["train"], 64, nc=5)
    assert train.img_files == LoadImagesAndLabels(root / "train.txt", 64, nc=5).img_files
    assert len(LoadImagesAndLabels(d["valid"], 64, nc=5)) == 2


def test_calculate_dataset_reads_yolov5s_images_split_and_labels_split_layout(
    make_shapes_data, tmp_path
):
    """``--root`` of YOLOv5's layout (``images/train``, ``labels/train``): the same images and
    labels, by the loader, as the generator's own lists of the same files."""
    root = make_shapes_data(n_train=6, n_val=3).parent
    reference = {
        split: LoadImagesAndLabels(root / f"{split}.txt", 64, nc=5) for split in ("train", "val")
    }
    y = tmp_path / "y"
    for split in ("train", "val"):
        for kind in ("images", "labels"):
            (y / kind).mkdir(parents=True, exist_ok=True)
            shutil.copytree(root / split / kind, y / kind / split)
    # The names from YOLOv5's data.yaml, as that user keeps them.
    names = (root / "shapes.names").read_text().split()
    (y / "data.yaml").write_text(f"train: images/train\nval: images/val\nnames: {names}\n")
    assert calculate_dataset.main(["--root", str(y), "--names", str(y / "data.yaml")]) == 0
    d = parse_data_cfg(y / "my_data.data")
    assert d["classes"] == 5 and d["class_names"] == names
    for split, key in (("train", "train"), ("val", "valid")):
        ours, ref = LoadImagesAndLabels(d[key], 64, nc=5), reference[split]
        assert [Path(f).relative_to(y / "images" / split) for f in ours.img_files] == [
            Path(f).relative_to(root / split / "images") for f in ref.img_files
        ]
        assert len(ours.labels) == len(ref.labels) > 0
        for a, b in zip(ours.labels, ref.labels, strict=True):
            np.testing.assert_array_equal(a, b)


def test_calculate_dataset_names_a_cfg_that_is_no_regular_file(make_shapes_data, tmp_path, capsys):
    """Was: --cfg /dev/zero said "model cfg not found"; now the kind of file, as every input."""
    root = make_shapes_data(n_train=2, n_val=1).parent
    out = tmp_path / "out"
    argv = ["--root", str(root), "--names", str(root / "shapes.names"), "--out-dir", str(out)]
    assert calculate_dataset.main([*argv, "--cfg", "/dev/zero"]) == 2
    assert capsys.readouterr().err == (
        "error: /dev/zero: model cfg: a character device, not a regular file\n"
    )
    assert not out.exists()


def test_calculate_dataset_refuses_a_split_without_objects(make_shapes_data, tmp_path, capsys):
    data = make_shapes_data(n_train=4, n_val=2)
    root = data.parent
    for p in (root / "val" / "labels").glob("*.txt"):
        p.write_text("")
    rc = calculate_dataset.main(
        ["--root", str(root), "--names", str(root / "shapes.names"), "--out-dir", str(tmp_path)]
    )
    assert rc == 2
    assert "val split has no objects" in capsys.readouterr().err
    assert calculate_dataset.main(["--names", str(root / "shapes.names")]) == 2


def test_calculate_dataset_leaves_out_an_image_whose_name_a_list_cannot_hold(
    make_shapes_data, tmp_path, caplog
):
    """Was: an image named b"bad\\xe9name.jpg" was a UnicodeEncodeError traceback writing the
    list, and an empty --out-dir. Lists are read as UTF-8 (a list holding such a name is refused
    whole), so the image is left out with its reason and its label file is no orphan."""
    root = make_shapes_data(n_train=3, n_val=2).parent
    bad = give_non_utf8_name(root / "train" / "images" / "train_000000.jpg")
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        rc = calculate_dataset.main(
            ["--root", str(root), "--names", str(root / "shapes.names"), "--out-dir", str(out)]
        )
    assert rc == 0
    lines = (out / "my_train_data.txt").read_text(encoding="utf-8").split()
    assert [Path(x).name for x in lines] == ["train_000001.jpg", "train_000002.jpg"]
    messages = [r.getMessage() for r in caplog.records]
    why = "its name is not UTF-8 (byte 0xe9), which an image list cannot hold; rename it"
    assert f"{bad}: not listed: {why}" in messages
    assert messages[0].startswith("train: 2 images, 2 label files,")
    assert " 0 label files without an image, 1 bad lines" in messages[0]


def test_calculate_dataset_refuses_a_names_path_or_prefix_the_data_file_cannot_hold(
    make_shapes_data, tmp_path
):
    """Was: a --names file or a --name prefix with a non-UTF-8 name was a UnicodeEncodeError
    traceback writing the .data file, after both lists were written. Now one line, exit 2,
    before anything is written (run as a process: its stderr escapes the odd byte)."""
    root = make_shapes_data(n_train=3, n_val=2).parent
    names = root / os.fsdecode(b"bad\xe9.names")
    try:
        names.write_bytes((root / "shapes.names").read_bytes())
    except OSError as e:
        pytest.skip(f"this file system refuses names that are not UTF-8 ({e})")
    script, flags = "tools/calculate_dataset.py", ["--root", str(root), "--out-dir"]
    done = run_script(script, [*flags, str(tmp_path / "a"), "--names", str(names)])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    why = "its name is not UTF-8 (byte 0xe9), which a .data file cannot hold; rename it"
    assert f"names=../shapes/bad\\udce9.names: {why}" in done.stderr
    good = str(root / "shapes.names")
    argv = [*flags, str(tmp_path / "b"), "--names", good, "--name", os.fsdecode(b"my\xe9")]
    done = run_script(script, argv)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"train=my\\udce9_train_data.txt: {why}" in done.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------------------
# Anchors


def test_kmeans_anchors_cli_writes_a_cfg(make_shapes_data, tmp_path, capsys):
    data = make_shapes_data(n_train=12, n_val=2)
    out_cfg = tmp_path / "anchored.cfg"
    rc = kmeans_anchors.main(
        [
            "--data",
            str(data),
            "--img-size",
            "256",
            "--generations",
            "30",
            "--cfg",
            str(NANO_CFG),
            "--out-cfg",
            str(out_cfg),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("anchors=")
    anchors = np.array([float(v) for v in printed.split("=")[1].replace(" ", "").split(",")])
    anchors = anchors.reshape(-1, 2)
    assert len(anchors) == 9 and (np.diff(anchors.prod(1)) >= 0).all()
    heads = [b for b in parse_model_cfg(out_cfg) if b["type"] == "yolo"]
    for b in heads:
        np.testing.assert_allclose(np.array(b["anchors"]).reshape(-1, 2), anchors)
    # Everything else is unchanged.
    src_lines = NANO_CFG.read_text().splitlines()
    out_lines = out_cfg.read_text().splitlines()
    assert len(src_lines) == len(out_lines)
    assert sum(a != b for a, b in zip(src_lines, out_lines)) == len(heads)
    rc = kmeans_anchors.main(
        [
            "--data",
            str(data),
            "-n",
            "6",
            "--generations",
            "5",
            "--cfg",
            str(NANO_CFG),
            "--out-cfg",
            str(tmp_path / "x.cfg"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "-n 6 but [yolo] num=9: the cfg's heads take 9 anchors" in err
    assert "k-means:" not in err  # said before the search (was: after all of it)


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--out-cfg", "{data}"], "--out-cfg {data} is --data that this tool reads"),
        (["--out-cfg", "{cfg}"], "--out-cfg {cfg} is --cfg that this tool reads"),
        (["--out-cfg", "{list}"], "--out-cfg {list} is the image list that this tool reads"),
        (["--out-cfg", "{data}/x.cfg"], "{data} is a file where a folder should be"),
        (["--out-cfg", "o.cfg", "--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--out-cfg", "o.cfg", "-n", "0"], "--num must be >= 1, got 0"),
        (["--out-cfg", "o.cfg", "--generations", "-1"], "--generations must be >= 0, got -1"),
    ],
)
def test_kmeans_anchors_never_writes_over_what_it_reads(
    flags, line, make_shapes_data, tmp_path, capsys
):
    # Was: --out-cfg my.data replaced the .data with a cfg (the --cfg and the image list
    # alike), -n 0 meant the default, and --seed -1 was a numpy traceback.
    data = make_shapes_data(n_train=4, n_val=1)
    cfg = tmp_path / "my.cfg"
    cfg.write_text(NANO_CFG.read_text())
    names = {"data": data, "cfg": cfg, "list": data.parent / "train.txt"}
    before = {p: p.read_bytes() for p in names.values()}
    flags = [f.format(**names) for f in flags]
    argv = ["--data", str(data), "--cfg", str(cfg), "--generations", "3", *flags]
    assert kmeans_anchors.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and line.format(**names) in err
    assert {p: p.read_bytes() for p in names.values()} == before


@pytest.mark.parametrize(
    "name",
    [
        "train/labels/train_000000.txt",
        "train/images/train_000000.jpg",
        "val/labels/val_000000.txt",  # was: written over (only the train split was guarded)
    ],
)
def test_kmeans_anchors_never_writes_into_the_datasets_folders(
    name, make_shapes_data, tmp_path, capsys
):
    """Was: --out-cfg <train labels>/train_000000.txt --exist-ok replaced a training label it had
    just read with a cfg (an image alike). The dataset's image and label folders are refused as
    its other inputs are: one line, exit 2, the file unchanged."""
    data = make_shapes_data(n_train=4, n_val=1)
    out = data.parent / name
    before = out.read_bytes()
    argv = ["--data", str(data), "--cfg", str(NANO_CFG), "--out-cfg", str(out), "--exist-ok"]
    assert kmeans_anchors.main([*argv, "--img-size", "64", "--generations", "3"]) == 2
    assert capsys.readouterr().err == (
        f"error: --out-cfg {out} lies in the dataset's folder {out.parent}; choose a place "
        "outside it\n"
    )
    assert out.read_bytes() == before


def test_kmeans_anchors_never_replaces_a_file_the_data_names(make_shapes_data, tmp_path, capsys):
    """Was: --out-cfg coco_ids.json --exist-ok (the id map a data.yaml of coco2yolo names, which
    validation reads) replaced it with a cfg."""
    data = make_shapes_data(n_train=4, n_val=1)
    root = data.parent
    ids = root / "coco_ids.json"
    ids.write_text("{}")
    yaml = root / "data.yaml"
    yaml.write_text(
        "train: train.txt\nval: val.txt\ncoco_ids: coco_ids.json\nnames: [a, b, c, d, e]\n"
    )
    argv = ["--data", str(yaml), "--cfg", str(NANO_CFG), "--out-cfg", str(ids), "--exist-ok"]
    assert kmeans_anchors.main([*argv, "--img-size", "64", "--generations", "3"]) == 2
    assert capsys.readouterr().err == (
        f"error: --out-cfg {ids} is the 'coco_ids' file of --data that this tool reads; choose "
        "another file\n"
    )
    assert ids.read_text() == "{}"


def test_kmeans_anchors_never_replaces_a_runs_model_cfg(make_shapes_data, tmp_path, capsys):
    """Was: --out-cfg runs/demo/model.cfg --exist-ok replaced a training run's own cfg. Now one
    line, with or without --exist-ok, as tools/make_cfg.py and convert_weights.py say it."""
    data = make_shapes_data(n_train=4, n_val=1)
    model_cfg = run_with_model_cfg(tmp_path / "demo", NANO_CFG.read_text())
    run = model_cfg.parent
    before = model_cfg.read_bytes()
    argv = ["--data", str(data), "--cfg", str(NANO_CFG), "--out-cfg", str(model_cfg)]
    for extra in ([], ["--exist-ok"]):
        assert kmeans_anchors.main([*argv, "--img-size", "64", "--generations", "3", *extra]) == 2
        assert capsys.readouterr().err == (
            f"error: --out-cfg {model_cfg} is a file of the training run in {run}, which is "
            f"never replaced (not even with --exist-ok); choose another --out-cfg, e.g. "
            f"{run / 'model-new.cfg'}\n"
        )
        assert model_cfg.read_bytes() == before


def test_kmeans_anchors_keeps_an_existing_out_cfg(make_shapes_data, tmp_path, capsys):
    """Was: --out-cfg X replaced whatever X was; now one line unless --exist-ok."""
    data = make_shapes_data(n_train=4, n_val=1)
    out = tmp_path / "results.csv"
    out.write_text("epoch\n")
    argv = ["--data", str(data), "--cfg", str(NANO_CFG), "--out-cfg", str(out)]
    argv += ["--img-size", "64", "--generations", "3"]
    assert kmeans_anchors.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"error: {out} already exists; pass --exist-ok to replace, or choose another --out-cfg\n"
    )
    assert out.read_text() == "epoch\n"
    assert kmeans_anchors.main([*argv, "--exist-ok"]) == 0
    assert "anchors=" in out.read_text()


def test_kmeans_anchors_refuses_a_folder_out_cfg_before_reading_labels(
    make_shapes_data, tmp_path, capsys
):
    """Was: --out-cfg naming a folder, with --exist-ok, failed only after the labels were read
    and the anchors fitted. Now the same line before any label is read."""
    data = make_shapes_data(n_train=3, n_val=2)
    folder = tmp_path / "out"
    folder.mkdir()
    argv = ["--data", str(data), "--cfg", "cfg/yolov3-spp-nano.cfg", "--out-cfg", str(folder)]
    capsys.readouterr()
    assert kmeans_anchors.main([*argv, "--exist-ok", "--img-size", "64"]) == 2
    out, err = capsys.readouterr()
    assert "anchors=" not in out and err.splitlines() == [
        f"error: cannot write {folder}: {folder} is a folder, not a file; move it away or "
        "choose another --out-cfg"
    ]
    assert list(folder.iterdir()) == [] and not list(data.parent.glob("*.cache*"))


def test_kmeans_anchors_cfg_that_is_a_folder_is_named_so(tmp_path, capsys):
    """Was: --cfg FOLDER said "model cfg not found"."""
    argv = ["--list", str(tmp_path), "--cfg", str(tmp_path), "--out-cfg", str(tmp_path / "o.cfg")]
    assert kmeans_anchors.main(argv) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: model cfg: a folder, not a file\n"
    assert not (tmp_path / "o.cfg").exists()


def test_kmeans_anchors_generations_are_bounded(tmp_path, capsys):
    """Was: --generations 1000000000 ran for days."""
    argv = ["--list", str(tmp_path), "--generations", "1000000000"]
    assert kmeans_anchors.main(argv) == 2
    assert capsys.readouterr().err == (
        "error: --generations must be in [0, 100000], got 1000000000\n"
    )


def test_kmeans_label_cache_is_the_one_training_reads(make_shapes_data, monkeypatch, caplog):
    """The label cache tools/kmeans_anchors.py writes is reused as it is by training's dataset
    (no "out of date; rebuilding", no image checked again)."""
    import build_utils.labels as labels
    from train_utils.config import load_data_config

    data = make_shapes_data(n_train=8, n_val=2)
    assert kmeans_anchors.main(["--data", str(data), "--img-size", "64", "--generations", "3"]) == 0
    checked = []
    monkeypatch.setattr(labels, "check_file", lambda *a: checked.append(a))
    caplog.clear()
    d = load_data_config(data)
    train = LoadImagesAndLabels(str(d.train), 64, 4, nc=d.nc)
    assert checked == [] and "out of date" not in caplog.text
    assert len(train) == 8


def test_tools_read_configuration_text_within_limits_and_skip_xml_that_is_not_a_file(
    tmp_path, capsys
):
    """The tools' configuration text (class list, VOC id list, cfg) is UTF-8 within
    YOLO_MAX_TEXT_BYTES or one line; an annotation that is not a regular file (a FIFO would
    block the XML parser forever) is skipped with its reason in the report."""
    import os

    xml_dir, label_dir = tmp_path / "Annotations", tmp_path / "labels"
    xml_dir.mkdir()
    (xml_dir / "a.xml").write_text(_xml("a.png", (80, 50), [("cat", (8, 5, 24, 25), 0)]))
    os.mkfifo(xml_dir / "b.xml")
    (xml_dir / "c.xml").mkdir()
    names = tmp_path / "classes.names"
    names.write_text("cat\n")
    argv = ["--xml-dir", str(xml_dir), "--label-dir", str(label_dir), "--classes", str(names)]
    assert trans_voc2yolo.main(argv) == 0
    report = (tmp_path / "voc2yolo_report.txt").read_text()
    assert f"{xml_dir / 'b.xml'}: skipped: a FIFO (named pipe), not a regular file" in report
    assert f"{xml_dir / 'c.xml'}: skipped: a folder, not a file" in report
    assert sorted(p.name for p in label_dir.iterdir()) == ["a.txt"]
    capsys.readouterr()

    cases = {
        "utf16.names": ("cat\n".encode("utf-16"), "class list is UTF-16 text; save it as UTF-8"),
        "deep.json": (b"[" * 100_000 + b"]" * 100_000, "not a usable JSON class list"),
        "big.json": (b"[" + b"9" * 5000 + b"]", "not a usable JSON class list: Exceeds"),
    }
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_bytes(content)
        argv[-1] = str(tmp_path / name)
        assert trans_voc2yolo.main(argv) == 2, name
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {tmp_path / name}: {expected}"), line
        assert len(line) < 300

    voc = tmp_path / "VOC"
    (voc / "ImageSets" / "Main").mkdir(parents=True)
    (voc / "Annotations").mkdir()
    (voc / "ImageSets" / "Main" / "train.txt").write_bytes("a\n".encode("utf-16-le"))
    argv = ["--voc-root", str(voc), "--out", str(tmp_path / "out"), "--classes", str(names)]
    assert trans_voc2yolo.main([*argv, "--splits", "train"]) == 2
    err = capsys.readouterr().err
    assert "train.txt: image id list holds NUL bytes" in err and "save it as UTF-8" in err

    bad_num = tmp_path / "num.cfg"
    bad_num.write_text(NANO_CFG.read_text().replace("num=9", "num=nine", 1))
    utf16_cfg = tmp_path / "utf16.cfg"
    utf16_cfg.write_bytes(NANO_CFG.read_text().encode("utf-16"))
    for cfg, expected in (
        (bad_num, "[yolo] num='nine' must be a whole number"),
        (utf16_cfg, "model cfg is UTF-16 text; save it as UTF-8"),
    ):
        argv = ["--list", str(tmp_path), "--cfg", str(cfg), "--out-cfg", str(tmp_path / "o.cfg")]
        assert kmeans_anchors.main(argv) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {cfg}") and expected in line, line


def test_kmeans_anchors_img_size_is_limited(tmp_path, capsys):
    rc = kmeans_anchors.main(["--list", str(tmp_path / "train.txt"), "--img-size", "65536"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (
        "error: --img-size 65536 is larger than the limit 8192 (pixels per side of --img-size); "
        "set YOLO_MAX_IMG_SIZE to raise it"
    )


@pytest.mark.parametrize("size", ["-5", "0", "31"])
def test_kmeans_anchors_too_small_img_size_names_the_flag(tmp_path, capsys, size):
    """Was: "img_size must be an integer >= 32" (the loader's argument, not the flag)."""
    rc = kmeans_anchors.main(["--list", str(tmp_path / "train.txt"), "--img-size", size])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --img-size must be >= 32, got {size}"
    )
