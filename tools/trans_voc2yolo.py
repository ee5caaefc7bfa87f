"""Convert Pascal VOC XML annotations to YOLO label files (``class cx cy w h``, normalised).

Two layouts:

    # one folder of XML files -> one folder of label files
    python tools/trans_voc2yolo.py --xml-dir D/train/Annotations --img-dir D/train/images \\
        --label-dir D/train/labels --classes D/shapes.names

    # a VOC devkit year folder -> OUT/<split>/{images,labels} for the ImageSets/Main splits,
    # OUT/classes.names and OUT/data.yaml (train.py --data OUT/data.yaml); voc.names: the 20
    # VOC class names in the order you want their ids, one a line (leave --classes out to
    # collect the names from the XML files)
    python tools/trans_voc2yolo.py --voc-root VOCdevkit/VOC2012 --out my_yolo_dataset \\
        --classes voc.names

Classes come from ``--classes`` (a ``.names`` file, one name per line, or a JSON list or
``{name: id}`` mapping; 0- or 1-based ids are both accepted, ids are taken in increasing order),
whose order is kept: class k is its k-th name. Without it they are collected from the XML files
and sorted by name (VOC's own 20 classes are numbered alphabetically too). The class list used is
always written: to ``--names-out`` (default ``classes.names`` beside the labels' folder, or in
``--out``), and with ``--voc-root`` a ``data.yaml`` in ``--out`` names the splits and the classes
in that order. A label folder that holds labels, an existing names file, data.yaml or report
is written into or replaced only with ``--exist-ok``.
What is done about problems (all listed in the report file, never fatal):

- ``difficult`` objects are skipped unless ``--include-difficult``;
- boxes reaching outside the image are clipped, boxes left empty skipped;
- a missing, zero or negative ``<size>`` is read from the image;
- EXIF-rotated JPEG, PNG and WebP images: the loader sees them upright; when the XML size is
  that of the pixels as stored (sideways), as LabelImg writes it, the boxes are rotated into the
  upright frame;
- an XML size that disagrees with the image: boxes are normalised by the XML size when it has the
  image's aspect ratio (a resized copy), else by the image size;
- unreadable or empty XML files, unknown class names and missing images are reported and skipped;
  an image whose objects were all skipped gets an empty label file (a negative example).

Coordinates are taken as pixel edges (``xmin = 10`` is the left edge of column 10), as written by
LabelImg and the demo generator; ``--one-based`` follows the VOC devkit instead (``xmin - 1``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from build_utils.atomic import (
    check_apart,
    check_output_place,
    make_output_dir,
    write_text,
)
from build_utils.checks import check_folder
from build_utils.errors import ConfigError, DatasetError
from build_utils.image_io import (
    exif_orientation,
    is_image_file,
    orient_boxes,
    oriented_size,
    raw_image_size,
    read_image_data,
)
from build_utils.labels import yolo_txt_lines
from build_utils.limits import (
    MAX_IMAGE_BYTES,
    MAX_LABEL_BYTES,
    MAX_LIST_BYTES,
    MAX_TEXT_BYTES,
    file_problem,
    read_config_text,
)
from build_utils.parse_config import data_yaml_text, split_role
from build_utils.safe_yaml import short_text
from build_utils.yolo_output import DATA_YAML, place_image, report_text, same_aspect, write_labels
from train_utils.cli import HelpFormatter, path_arg, run_script
from train_utils.run_folder import check_new_file

LOGGER = logging.getLogger("trans_voc2yolo")
NAMES_FILE = "classes.names"  # the class list written beside the labels (default --names-out)
REPORT_FILE = "voc2yolo_report.txt"


@dataclass
class ConvertReport:
    """What a conversion did: counts and one line per problem (``path: what``)."""

    files: int = 0
    written: int = 0
    objects: int = 0
    skipped_files: int = 0
    skipped_objects: int = 0
    lines: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.files} XML files: {self.written} label files written with {self.objects} "
            f"objects; {self.skipped_files} files and {self.skipped_objects} objects skipped"
        )

    def merge(self, other: ConvertReport) -> None:
        for name in ("files", "written", "objects", "skipped_files", "skipped_objects"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.lines += other.lines


def load_class_list(path: str | os.PathLike[str]) -> list[str]:
    """Class names from a ``.names`` file or a JSON list / ``{name: id}`` mapping.

    Raises:
        ConfigError: unreadable file, no names, duplicate names or ids.
    """
    path = Path(path)
    text = read_config_text(path, MAX_TEXT_BYTES, "class list")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not valid JSON: {e.msg}", path, e.lineno) from e
        except (ValueError, RecursionError) as e:
            # An integer past Python's 4300 digits; arrays nested thousands deep.
            raise ConfigError(f"not a usable JSON class list: {short_text(str(e))}", path) from e
        if isinstance(data, dict):
            if not all(isinstance(v, int) for v in data.values()):
                raise ConfigError("a class mapping must map names to integer ids", path)
            if len(set(data.values())) != len(data):
                raise ConfigError("two classes share an id", path)
            names = [str(k) for k, _ in sorted(data.items(), key=lambda kv: kv[1])]
        elif isinstance(data, list):
            names = [str(n) for n in data]
        else:
            raise ConfigError("expected a JSON list of names or a {name: id} mapping", path)
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise ConfigError("the class list is empty", path)
    if len(set(names)) != len(names):
        raise ConfigError("a class name appears twice", path)
    return names


def _text(node: ET.Element | None, tag: str) -> str | None:
    child = node.find(tag) if node is not None else None
    return child.text.strip() if child is not None and child.text else None


def _number(node: ET.Element | None, tag: str) -> float | None:
    value = _text(node, tag)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def collect_class_names(xml_files: Sequence[Path]) -> list[str]:
    """Sorted object names found in the XML files (unparsable files are ignored here)."""
    names = set()
    for f in xml_files:
        if file_problem(f, MAX_LABEL_BYTES) is not None:
            continue  # convert_file reports it
        try:
            root = ET.parse(f).getroot()
        except (ET.ParseError, OSError):
            continue
        names.update(n for n in (_text(o, "name") for o in root.iter("object")) if n)
    return sorted(names)


def _image_index(img_dir: Path | None) -> dict[str, Path]:
    if img_dir is None or not img_dir.is_dir():
        return {}
    # Only regular files (within the image size limit) are images: a FIFO cannot be linked
    # across file systems or copied, nor read.
    return {
        p.stem: p
        for p in sorted(img_dir.iterdir())
        if is_image_file(p) and file_problem(p, MAX_IMAGE_BYTES) is None
    }


@dataclass(frozen=True)
class _Frame:
    """The pixel frame of one XML file's boxes: ``w`` x ``h`` as annotated, normalised by
    ``W`` x ``H`` (the upright image); ``orientation`` the EXIF rotation applied to boxes drawn
    on the stored pixels (1: none)."""

    w: float
    h: float
    W: float
    H: float
    orientation: int = 1


def _upright_size(xml_path: Path, image: Path | None, notes: list[str]) -> tuple[Any, int]:
    """The image's stored size (None: no readable image) and its EXIF orientation."""
    if image is None:
        return None, 1
    raw = raw_image_size(image)
    if raw is None:
        notes.append(f"{xml_path}: image {image} is unreadable")
        return None, 1
    try:
        orientation = exif_orientation(read_image_data(image)[0])
    except DatasetError:
        orientation = 1
    return raw, orientation


def _frame(
    xml_path: Path, size: ET.Element | None, image: Path | None, notes: list[str]
) -> _Frame | None:
    """Which frame the XML's boxes are in (see the module docstring); None: no size at all."""
    w, h = _number(size, "width"), _number(size, "height")
    raw, orientation = _upright_size(xml_path, image, notes)
    img_w, img_h = oriented_size(*raw, orientation) if raw is not None else (None, None)
    if not all(v is not None and 0 < v < math.inf for v in (w, h)):
        if img_w is None:
            return None
        given = [_text(size, tag) for tag in ("width", "height")]
        what = (
            "no <size>"
            if given == [None, None]
            else f"<size> {given[0] or '?'}x{given[1] or '?'} is not a positive size"
        )
        notes.append(f"{xml_path}: {what}; used the image's {img_w}x{img_h}")
        return _Frame(float(img_w), float(img_h), float(img_w), float(img_h))
    if img_w is None:
        return _Frame(w, h, w, h)
    if orientation != 1 and (w, h) == raw:
        # Annotated on the pixels as stored (LabelImg and the classic VOC tools ignore EXIF);
        # when the stored and upright sizes are equal this is an assumption, and says so.
        notes.append(f"{xml_path}: boxes rotated to the image's EXIF orientation {orientation}")
        W, H = (float(v) for v in oriented_size(int(w), int(h), orientation))
        return _Frame(w, h, W, H, orientation)
    if (w, h) == (img_w, img_h):
        return _Frame(w, h, w, h)
    if same_aspect((w, h), (img_w, img_h)):
        notes.append(f"{xml_path}: <size> {w:g}x{h:g} is a resized {img_w}x{img_h}; used <size>")
        return _Frame(w, h, w, h)
    notes.append(
        f"{xml_path}: <size> {w:g}x{h:g} disagrees with the image {img_w}x{img_h}; "
        "normalised by the image size"
    )
    return _Frame(float(img_w), float(img_h), float(img_w), float(img_h))


def _object_line(
    obj: ET.Element, where: str, frame: _Frame, class_id: int, one_based: bool, notes: list[str]
) -> str | None:
    """The label line of one object (``where``: its file and number, for the report); None
    when its box is missing or empty."""
    bb = obj.find("bndbox")
    coords = [_number(bb, t) for t in ("xmin", "ymin", "xmax", "ymax")]
    if any(c is None for c in coords):
        notes.append(f"{where}: missing or non-numeric <bndbox>, skipped")
        return None
    x1, y1, x2, y2 = coords
    if one_based:
        x1, y1 = x1 - 1, y1 - 1
    if frame.orientation != 1:
        box = np.array([[x1, y1, x2, y2]])
        x1, y1, x2, y2 = orient_boxes(box, frame.orientation, frame.w, frame.h)[0]
    W, H = frame.W, frame.H
    cx1, cy1, cx2, cy2 = max(x1, 0.0), max(y1, 0.0), min(x2, W), min(y2, H)
    if (cx1, cy1, cx2, cy2) != (x1, y1, x2, y2):
        notes.append(
            f"{where}: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) clipped to the {W:g}x{H:g} image"
        )
    if cx2 <= cx1 or cy2 <= cy1:
        notes.append(f"{where}: empty box, skipped")
        return None
    return yolo_txt_lines([(cx1, cy1, cx2, cy2, 0.0, class_id)], W, H, save_conf=False)[0]


def convert_file(
    xml_path: Path,
    image: Path | None,
    class_ids: dict[str, int],
    include_difficult: bool = False,
    one_based: bool = False,
) -> tuple[list[str] | None, list[str], int]:
    """Convert one XML file.

    Returns:
        ``(label lines or None when the file is skipped, report lines, skipped objects)``.
    """
    notes: list[str] = []
    # Stat first: a FIFO named x.xml would block the parser forever, a huge file fill memory.
    # (expat itself refuses entity-expansion bombs.)
    problem = file_problem(xml_path, MAX_LABEL_BYTES)
    if problem is not None:
        return None, [f"{xml_path}: skipped: {problem}"], 0
    try:
        root = ET.parse(xml_path).getroot()
    except (ET.ParseError, OSError) as e:
        return None, [f"{xml_path}: skipped: unreadable XML ({e})"], 0
    frame = _frame(xml_path, root.find("size"), image, notes)
    if frame is None:
        return None, [f"{xml_path}: skipped: no usable <size> and no readable image"], 0
    lines: list[str] = []
    skipped = 0
    for k, obj in enumerate(root.iter("object"), 1):
        name = _text(obj, "name")
        if name not in class_ids:
            notes.append(f"{xml_path}: object {k}: unknown class {name!r}, skipped")
            skipped += 1
            continue
        if (_number(obj, "difficult") or 0) and not include_difficult:
            skipped += 1
            continue
        where = f"{xml_path}: object {k}"
        line = _object_line(obj, where, frame, class_ids[name], one_based, notes)
        if line is None:
            skipped += 1
        else:
            lines.append(line)
    if not lines:
        notes.append(f"{xml_path}: no objects kept; wrote an empty label file")
    return lines, notes, skipped


def convert_dir(
    xml_dir: Path,
    img_dir: Path | None,
    label_dir: Path,
    class_names: Sequence[str],
    include_difficult: bool = False,
    one_based: bool = False,
    ids: Sequence[str] | None = None,
) -> ConvertReport:
    """Convert every ``xml_dir/*.xml`` (or only ``ids``) into ``label_dir/<stem>.txt``."""
    if not xml_dir.is_dir():
        raise DatasetError("annotation folder not found", xml_dir)
    xml_files = (
        [xml_dir / f"{i}.xml" for i in ids] if ids is not None else sorted(xml_dir.glob("*.xml"))
    )
    images = _image_index(img_dir)
    class_ids = {n: i for i, n in enumerate(class_names)}
    make_output_dir(label_dir)
    report = ConvertReport(files=len(xml_files))
    for xml_path in xml_files:
        image = images.get(xml_path.stem)
        if image is None and img_dir is not None:
            report.lines.append(f"{xml_path}: no image {xml_path.stem}.* in {img_dir}")
        lines, notes, skipped = convert_file(
            xml_path, image, class_ids, include_difficult, one_based
        )
        report.lines += notes
        report.skipped_objects += skipped
        if lines is None:
            report.skipped_files += 1
            continue
        write_labels(label_dir / f"{xml_path.stem}.txt", lines)
        report.written += 1
        report.objects += len(lines)
    return report


def convert_voc_root(
    voc_root: Path,
    out: Path,
    splits: Sequence[str],
    class_names: Sequence[str],
    include_difficult: bool = False,
    one_based: bool = False,
) -> ConvertReport:
    """A VOC devkit year folder (``Annotations``, ``JPEGImages``, ``ImageSets/Main``) to
    ``out/<split>/images`` (hard links, or copies across file systems) and ``out/<split>/labels``.
    """
    report = ConvertReport()
    for split in splits:
        id_file = voc_root / "ImageSets" / "Main" / f"{split}.txt"
        if not id_file.is_file():
            raise DatasetError(f"no image id list for split '{split}'", id_file)
        text = read_config_text(id_file, MAX_LIST_BYTES, "image id list")
        ids = [line.split()[0] for line in text.splitlines() if line.strip()]
        img_out = out / split / "images"
        make_output_dir(img_out)
        images = _image_index(voc_root / "JPEGImages")
        for i in ids:
            # An image placed by an earlier run is kept (place_image never leaves half of one).
            if i in images and not (img_out / images[i].name).exists():
                place_image(images[i], img_out / images[i].name)
        report.merge(
            convert_dir(
                voc_root / "Annotations",
                voc_root / "JPEGImages",
                out / split / "labels",
                class_names,
                include_difficult,
                one_based,
                ids=ids,
            )
        )
    return report


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], add_help=add_help, formatter_class=HelpFormatter
    )
    p.add_argument("--xml-dir", type=path_arg, help="folder of VOC XML files")
    p.add_argument("--img-dir", type=path_arg, help="folder of the images (for sizes and EXIF)")
    p.add_argument("--label-dir", type=path_arg, help="output folder for the label files")
    p.add_argument(
        "--voc-root", type=path_arg, help="VOC devkit year folder (instead of --xml-dir)"
    )
    p.add_argument("--out", type=path_arg, help="output root for --voc-root")
    p.add_argument("--splits", nargs="+", default=["train", "val"], help="splits of --voc-root")
    p.add_argument("--classes", type=path_arg, help=".names or JSON class list (default: from XML)")
    p.add_argument(
        "--names-out",
        type=path_arg,
        help=f"write the class list used here (default: {NAMES_FILE} in --out, or beside the "
        "--label-dir folder)",
    )
    p.add_argument("--include-difficult", action="store_true", help="keep 'difficult' objects")
    p.add_argument(
        "--one-based",
        action="store_true",
        help="VOC devkit convention: xmin/ymin are 1-based pixel indices",
    )
    p.add_argument("--report", type=path_arg, help="problem report (default: beside the labels)")
    p.add_argument(
        "--exist-ok",
        action="store_true",
        help="write into a label folder that holds labels (those of the same names are "
        "replaced) and replace an existing names file, data.yaml or report",
    )
    return p


def class_names(args: argparse.Namespace) -> list[str]:
    """The classes in id order: ``--classes`` as given, else the XML files' names sorted."""
    if args.classes is not None:
        return load_class_list(args.classes)
    xml_dir = args.xml_dir or args.voc_root / "Annotations"
    if not xml_dir.is_dir():
        raise DatasetError("annotation folder not found", xml_dir)
    names = collect_class_names(sorted(Path(xml_dir).glob("*.xml")))
    if not names:
        raise DatasetError("no object names found in the XML files", xml_dir)
    return names


def _files_read(args: argparse.Namespace) -> dict[Path, str]:
    """The XML files and images a conversion reads (resolved path -> what it is), which no
    output may replace, ``--exist-ok`` or not."""
    voc = args.voc_root
    xml_dir = voc / "Annotations" if voc is not None else args.xml_dir
    img_dir = voc / "JPEGImages" if voc is not None else args.img_dir
    read = {p.resolve(): "an XML file" for p in xml_dir.glob("*.xml")}
    if img_dir is not None and img_dir.is_dir():
        read.update({p.resolve(): "an image" for p in img_dir.iterdir() if is_image_file(p)})
    return read


@dataclass(frozen=True)
class Outputs:
    """The files a conversion writes beside its labels (None: not written)."""

    names: Path | None
    report: Path
    data_yaml: Path | None


def plan_outputs(args: argparse.Namespace) -> Outputs:
    """Where the class list, the report and (``--voc-root``) the data.yaml go, refused when
    one exists (unless ``--exist-ok``) or is the class list read (see
    :func:`~build_utils.atomic.check_new_outputs`)."""
    voc = args.voc_root is not None
    home = args.out if voc else args.label_dir.parent
    names = args.names_out or home / NAMES_FILE
    default = args.names_out is None and args.classes is not None and names.exists()
    if default and names.samefile(args.classes):
        names = None  # the class list read is that file: nothing to add
    outputs = Outputs(names, args.report or home / REPORT_FILE, home / DATA_YAML if voc else None)
    reads = {"the --classes file": args.classes}
    label_dirs = [args.out / s / "labels" for s in args.splits] if voc else [args.label_dir]
    image_dirs = [args.out / s / "images" for s in args.splits] if voc else []
    for folder in label_dirs + image_dirs:
        check_output_place(folder, "--out" if voc else "--label-dir", folder=True)
    for folder in label_dirs:
        label = next(folder.glob("*.txt"), None) if folder.is_dir() else None
        if label is not None and not args.exist_ok:
            flag = "--out" if voc else "--label-dir"
            raise ConfigError(
                f"{folder} already holds label files ({label.name}, ...); pass --exist-ok to "
                f"replace those of the same names, or choose another {flag}"
            )
    files = {"--names-out": outputs.names, "--report": outputs.report, "--out": outputs.data_yaml}
    check_apart(files, label_dirs, "the label folder")
    read = _files_read(args)
    for flag, path in files.items():
        if path is not None and path.resolve() in read:
            raise ConfigError(
                f"{flag} {path} is {read[path.resolve()]} this tool reads; choose another file"
            )
        if path is not None:
            check_new_file(path, flag, args.exist_ok, reads)
    return outputs


def voc_data_yaml(splits: Sequence[str], names: Sequence[str]) -> str:
    """The data.yaml of ``--voc-root``'s ``OUT/<split>/images`` folders (several splits of one
    role, e.g. train and trainval, as a list)."""
    roles: dict[str, list[str]] = {}
    for split in splits:
        roles.setdefault(split_role(split, "--splits"), []).append(f"{split}/images")
    folders = {role: f[0] if len(f) == 1 else f for role, f in roles.items()}
    return data_yaml_text(folders, names, "written by tools/trans_voc2yolo.py")


def voc_to_yolo(args: argparse.Namespace) -> None:
    if (args.voc_root is None) == (args.xml_dir is None):
        raise ConfigError("give either --xml-dir (with --label-dir) or --voc-root (with --out)")
    if args.xml_dir is not None and args.label_dir is None:
        raise ConfigError("--xml-dir needs --label-dir")
    if args.voc_root is not None and args.out is None:
        raise ConfigError("--voc-root needs --out")
    source, flag = (
        (args.xml_dir, "--xml-dir") if args.voc_root is None else (args.voc_root, "--voc-root")
    )
    check_folder(source, flag)
    names = class_names(args)
    # Before anything is written: a split that is no data.yaml role, an output in the way.
    data_yaml = voc_data_yaml(args.splits, names) if args.voc_root is not None else None
    outputs = plan_outputs(args)
    if args.voc_root is not None:
        report = convert_voc_root(
            args.voc_root, args.out, args.splits, names, args.include_difficult, args.one_based
        )
    else:
        report = convert_dir(
            args.xml_dir,
            args.img_dir,
            args.label_dir,
            names,
            args.include_difficult,
            args.one_based,
        )
    written = []
    # The report names files as they are on disk, a name that is not UTF-8 too.
    for path, text, flag, errors in (
        (outputs.names, "".join(n + "\n" for n in names), "--names-out", "strict"),
        (outputs.data_yaml, data_yaml, "--out", "strict"),
        (
            outputs.report,
            report_text(report.summary(), report.lines),
            "--report",
            "surrogateescape",
        ),
    ):
        if path is not None:
            make_output_dir(path.parent, flag)
            write_text(path, text, flag, errors)
            written.append(str(path))
    LOGGER.info("%s; %d classes; wrote %s", report.summary(), len(names), ", ".join(written))


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_args_parser(), voc_to_yolo, argv)


if __name__ == "__main__":
    sys.exit(main())
