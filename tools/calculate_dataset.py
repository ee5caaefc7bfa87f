"""Write the image lists, the ``.data`` file and a model cfg for a YOLO-layout dataset.

    python tools/calculate_dataset.py --root my_yolo_dataset --names my_yolo_dataset/voc.names \\
        --cfg cfg/yolov3-spp.cfg

reads ``ROOT/train/labels`` and ``ROOT/val/labels``, or YOLOv5's ``ROOT/labels/train`` and
``ROOT/labels/val`` (or ``--train-labels``/``--val-labels``), lists the images of the matching
``images`` folders (``train/images``; ``images/train``) and writes into ``--out-dir`` (default
ROOT)::

    my_train_data.txt my_val_data.txt   image paths, relative to the list's folder
    my_data.data                        classes, train, valid, names (paths relative to it)
    my_yolov3-spp.cfg                   the cfg with every [yolo] head rewritten for the classes

(``--name`` replaces ``my``; an existing file of these names is replaced only with
``--exist-ok``.) Every label file is checked as the data loader checks it; the counts
per split are printed, and a split without images or without any object is an error (a val set
with no objects makes mAP silently 0). Images without a label file are negatives and are listed;
label files without an image are reported.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from build_utils.atomic import check_apart, check_new_outputs, make_output_dir, write_text
from build_utils.errors import ConfigError, DatasetError
from build_utils.image_io import list_images
from build_utils.labels import list_entry_problem, parse_label_text
from build_utils.limits import (
    MAX_IMAGE_BYTES,
    MAX_LABEL_BYTES,
    MAX_TEXT_BYTES,
    UnusableFile,
    check_config_file,
    file_problem,
    read_data_file,
)
from build_utils.parse_config import (
    load_class_names,
    parse_model_cfg,
    rewrite_cfg_classes,
    write_model_cfg,
)
from train_utils.cli import HelpFormatter, path_arg, run_script

LOGGER = logging.getLogger("calculate_dataset")
OUT_FLAG = "--out-dir/--name"  # the options that choose where the files go, named in errors


@dataclass
class SplitSummary:
    """Counts for one split: images, label files, objects, images without labels, orphans."""

    name: str
    images: list[Path]
    n_labels: int
    n_objects: int
    n_negatives: int
    orphans: list[Path]
    bad_lines: list[str]

    def line(self) -> str:
        return (
            f"{self.name}: {len(self.images)} images, {self.n_labels} label files, "
            f"{self.n_objects} objects, {self.n_negatives} images without labels, "
            f"{len(self.orphans)} label files without an image, {len(self.bad_lines)} bad lines"
        )


def split_labels(root: Path, split: str) -> Path:
    """The label folder of ``split`` under ``--root``: ``ROOT/split/labels``, or YOLOv5's
    ``ROOT/labels/split`` where only that exists."""
    ours, yolov5 = root / split / "labels", root / "labels" / split
    return yolov5 if not ours.is_dir() and yolov5.is_dir() else ours


def images_of(labels_dir: Path) -> Path:
    """The image folder whose files ``labels_dir`` labels, as the loader pairs them
    (:func:`~build_utils.labels.img2label_path`): ``split/images`` beside ``split/labels``, or
    ``images/split`` for YOLOv5's ``labels/split``."""
    beside = labels_dir.parent / "images"
    yolov5 = labels_dir.parent.parent / "images" / labels_dir.name
    return yolov5 if labels_dir.parent.name == "labels" and not beside.is_dir() else beside


def scan_split(name: str, labels_dir: Path, nc: int) -> SplitSummary:
    """Images of :func:`images_of` ``labels_dir`` and the check of their labels.

    Raises:
        DatasetError: missing folders or no images.
    """
    if not labels_dir.is_dir():
        raise DatasetError(f"{name} label folder not found", labels_dir)
    # list_images gives absolute paths; a relative --root must be made absolute the same way
    # (abspath, no symlink resolution) for the relative_to below to hold.
    labels_dir = Path(os.path.abspath(labels_dir))
    images_dir = images_of(labels_dir)
    if not images_dir.is_dir():
        raise DatasetError(f"{name} images folder of {labels_dir} not found", images_dir)
    found = list_images(images_dir)
    images, bad = [], []
    for p in found:
        # A FIFO, link loop or 40 GB file named x.jpg is no image; a name the list cannot hold
        # would make the list unreadable: each is reported, not listed.
        problem = file_problem(p, MAX_IMAGE_BYTES) or list_entry_problem(p)
        if problem is None:
            images.append(Path(p))
        else:
            bad.append(f"{p}: not listed: {problem}")
    if not images:
        raise DatasetError(f"no images in the {name} split", images_dir)
    # Every image found, listed or not: the label file of an image left out is no orphan.
    stems = {Path(p).relative_to(images_dir).with_suffix("") for p in found}
    n_labels = n_objects = n_neg = 0
    for img in images:
        label = labels_dir / img.relative_to(images_dir).with_suffix(".txt")
        if not os.path.lexists(label):
            n_neg += 1
            continue
        n_labels += 1
        try:
            # A FIFO named x.txt would block read_text forever; a huge file would fill memory.
            text = read_data_file(label, MAX_LABEL_BYTES).decode("utf-8")
        except (UnusableFile, UnicodeDecodeError) as e:
            bad.append(f"{label}: unreadable: {e}")
            continue
        labels, _, _, notes = parse_label_text(text, nc, str(label))
        n_objects += len(labels)
        bad += [n for n in notes if ": dropped: " in n]
    orphans = [
        p
        for p in sorted(labels_dir.rglob("*.txt"))
        if p.relative_to(labels_dir).with_suffix("") not in stems
    ]
    return SplitSummary(name, images, n_labels, n_objects, n_neg, orphans, bad)


def write_list(path: Path, images: Sequence[Path]) -> None:
    """One image per line, relative to the list's folder (the loader resolves it there)."""
    base = path.parent.resolve()
    text = "".join(
        Path(os.path.relpath(os.path.realpath(p), base)).as_posix() + "\n" for p in images
    )
    write_text(path, text, OUT_FLAG)


def data_file_text(path: Path, nc: int, train: Path, valid: Path, names: Path) -> str:
    """Darknet ``.data`` text with paths relative to its folder; ConfigError for a path that is
    not UTF-8 (a ``--names`` or ``--name`` read from a non-UTF-8 name), which it cannot hold."""
    text = f"classes={nc}\n"
    for key, p in {"train": train, "valid": valid, "names": names}.items():
        rel = Path(os.path.relpath(p.resolve(), path.parent.resolve())).as_posix()
        problem = list_entry_problem(rel, "a .data file")
        if problem:
            raise ConfigError(f"{key}={rel}: {problem}", path)
        text += f"{key}={rel}\n"
    return text


def write_cfg(template: Path, nc: int, out: Path) -> None:
    """``template`` with every ``[yolo]`` head (and the conv before it) set to ``nc`` classes."""
    blocks = rewrite_cfg_classes(parse_model_cfg(template), nc)
    header = f"{template.name} for {nc} classes, written by tools/calculate_dataset.py"
    write_model_cfg(blocks, out, header, OUT_FLAG)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], add_help=add_help, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--root",
        type=path_arg,
        help="dataset root with train/labels and val/labels, or labels/train and labels/val",
    )
    p.add_argument("--train-labels", type=path_arg, help="training label folder")
    p.add_argument("--val-labels", type=path_arg, help="validation label folder")
    p.add_argument(
        "--names",
        type=path_arg,
        required=True,
        help="class names file (.names), or a data.yaml whose names it takes",
    )
    p.add_argument("--cfg", type=path_arg, help="model cfg to rewrite for the class count")
    p.add_argument("--out-dir", type=path_arg, help="where to write the files (default: --root)")
    p.add_argument("--name", default="my", help="prefix of the written files")
    p.add_argument("--exist-ok", action="store_true", help="replace existing files of those names")
    return p


def report_splits(splits: list[SplitSummary], labels: dict[str, Path]) -> None:
    """Log each split's counts and its first problems; a split without objects is an error."""
    for s in splits:
        LOGGER.info("%s", s.line())
        for b in s.bad_lines[:5]:
            LOGGER.warning("%s", b)
        for o in s.orphans[:5]:
            LOGGER.warning("%s: no image for this label file", o)
        if s.n_objects == 0:
            raise DatasetError(
                f"the {s.name} split has no objects ({s.line()}); check the "
                "labels folder and the class ids",
                labels[s.name],
            )


def write_dataset_files(args: argparse.Namespace) -> None:
    train_labels = args.train_labels or (split_labels(args.root, "train") if args.root else None)
    val_labels = args.val_labels or (split_labels(args.root, "val") if args.root else None)
    if train_labels is None or val_labels is None:
        raise ConfigError("give --root, or both --train-labels and --val-labels")
    if not args.name or Path(args.name).name != args.name:
        raise ConfigError(
            f"--name {args.name!r}: give a file-name prefix without a folder, e.g. my"
        )
    out_dir = args.out_dir or args.root or train_labels.parent.parent
    names = load_class_names(args.names)
    nc = len(names)
    if args.cfg is not None:  # before the splits are scanned: a device or folder, one line
        check_config_file(args.cfg, MAX_TEXT_BYTES, "model cfg")
    train_list = out_dir / f"{args.name}_train_data.txt"
    val_list = out_dir / f"{args.name}_val_data.txt"
    data = out_dir / f"{args.name}_data.data"
    written = [train_list, val_list, data]
    if args.cfg is not None:
        written.append(out_dir / f"{args.name}_{args.cfg.stem}.cfg")
    reads = {"the --names file": args.names, "the --cfg": args.cfg}
    check_new_outputs(written, OUT_FLAG, args.exist_ok, reads)
    data_text = data_file_text(data, nc, train_list, val_list, args.names)
    folders = [d for labels in (train_labels, val_labels) for d in (labels, images_of(labels))]
    check_apart({OUT_FLAG: train_list}, folders, "a split's label or image folder")
    splits = [scan_split("train", train_labels, nc), scan_split("val", val_labels, nc)]
    report_splits(splits, {"train": train_labels, "val": val_labels})
    make_output_dir(out_dir, OUT_FLAG)
    write_list(train_list, splits[0].images)
    write_list(val_list, splits[1].images)
    write_text(data, data_text, OUT_FLAG)
    if args.cfg is not None:
        write_cfg(args.cfg, nc, written[-1])
    LOGGER.info("%d classes; wrote %s", nc, ", ".join(str(p) for p in written))


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_args_parser(), write_dataset_files, argv)


if __name__ == "__main__":
    sys.exit(main())
