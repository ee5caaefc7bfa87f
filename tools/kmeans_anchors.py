"""Anchor boxes for a dataset: k-means on label widths/heights with IoU distance, then a genetic
refinement, reporting the best possible recall.

    python tools/kmeans_anchors.py --data demo_data/shapes/shapes.data --img-size 512
    python tools/kmeans_anchors.py --data my_data.data --cfg cfg/yolov3-spp.cfg \\
        --out-cfg cfg/my_yolov3-spp.cfg      # also write the anchors into a cfg
    python tools/kmeans_anchors.py --list my_data/train.txt --classes 20   # a list, 20 classes

Label sizes are taken at ``--img-size`` the way the loader letterboxes (long side = img-size).
Distance between a box and an anchor is ``1 - IoU`` with both centred at the origin (YOLOv2);
centroids are cluster medians. The genetic step mutates the anchors and keeps a mutation when
``fitness = mean(best IoU, counting only IoUs above --iou-t)`` improves. Best possible recall
(BPR) is the fraction of labels whose best anchor IoU exceeds ``--iou-t``, the training matching
threshold (``iou_t`` in cfg/hyp.yaml): labels below it have no anchor to learn from.

The metric and the search live in ``build_utils/anchors.py``, shared with the anchor check at
training start (``train.py --autoanchor`` runs the same search itself).

Writing into a cfg replaces the ``anchors=`` line of every ``[yolo]`` section (sorted small to
large, as the masks 0,1,2 / 3,4,5 / 6,7,8 expect) and leaves everything else as it was.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from build_utils import anchors as anchors_lib
from build_utils.anchors import (
    MIN_LABEL_PX,
    anchor_fit,
    evolve,
    format_anchors,
    kmeans_iou,
    too_small,
)
from build_utils.atomic import check_apart, make_output_dir, write_text
from build_utils.augmentations import GRID
from build_utils.checks import check_at_least
from build_utils.datasets import LoadImagesAndLabels
from build_utils.errors import ConfigError
from build_utils.labels import data_folders
from build_utils.limits import MAX_TEXT_BYTES, check_config_file, read_config_text
from build_utils.safe_yaml import short_text
from train_utils.cli import HelpFormatter, check_img_size_limit, path_arg, run_script
from train_utils.config import load_data_config
from train_utils.run_folder import check_new_file

LOGGER = logging.getLogger("kmeans_anchors")
# Upper bound of --generations: the search runs them all, so a mistyped count would not end.
MAX_GENERATIONS = 100_000


def describe(wh: np.ndarray, anchors: np.ndarray, iou_t: float) -> str:
    return anchor_fit(wh, anchors, iou_t).describe()


def write_anchors_into_cfg(src: Path, dst: Path, anchors: np.ndarray) -> int:
    """Copy ``src`` to ``dst`` with the ``anchors=`` line of each ``[yolo]`` section replaced.

    Returns the number of sections changed.

    Raises:
        ConfigError: no ``[yolo]`` section, or one whose ``num`` differs from the anchor count.
    """
    lines = read_config_text(src, MAX_TEXT_BYTES, "model cfg").splitlines()
    section, changed = "", 0
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[]").strip().lower()
        elif section == "yolo":
            m = re.match(r"\s*(\w+)\s*=\s*(.*)", line)
            if m and m.group(1) == "num" and _num(m.group(2), src, i + 1) != len(anchors):
                raise ConfigError(
                    f"[yolo] num={m.group(2)} but {len(anchors)} anchors were "
                    "computed; pass -n to match",
                    src,
                    i + 1,
                )
            if m and m.group(1) == "anchors":
                lines[i] = f"anchors={format_anchors(anchors)}"
                changed += 1
    if not changed:
        raise ConfigError("no [yolo] section with an anchors= line", src)
    make_output_dir(dst.parent, "--out-cfg")
    write_text(dst, "\n".join(lines) + "\n", "--out-cfg")
    return changed


def _num(value: str, cfg: Path, line: int) -> int:
    """A ``[yolo] num=`` value (a trailing ``# comment`` allowed) as an integer."""
    text = value.split("#")[0].strip()
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"[yolo] num={short_text(text, 40)!r} must be a whole number", cfg, line
        ) from None


def cfg_anchor_count(cfg: Path) -> int | None:
    """The ``num`` of the first ``[yolo]`` section, if any."""
    section, text = "", read_config_text(cfg, MAX_TEXT_BYTES, "model cfg")
    for number, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("["):
            section = s.strip("[]").strip().lower()
        elif section == "yolo" and re.match(r"num\s*=", s):
            return _num(s.split("=", 1)[1], cfg, number)
    return None


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], add_help=add_help, formatter_class=HelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--data", type=path_arg, help=".data or data.yaml file (its train images are used)"
    )
    src.add_argument("--list", type=path_arg, help="image list or folder")
    p.add_argument(
        "--classes",
        type=int,
        default=None,
        help="with --list: the dataset's class count (the .data's classes=), so that the label "
        "cache written here is the one training reuses (it is keyed by the class count)",
    )
    p.add_argument("--img-size", type=int, default=512, help="training image size")
    p.add_argument("-n", "--num", type=int, default=None, help="anchors (default: cfg's or 9)")
    p.add_argument("--iou-t", type=float, default=0.20, help="anchor matching IoU threshold")
    p.add_argument("--generations", type=int, default=1000, help="genetic refinement steps")
    p.add_argument("--seed", type=int, default=0, help="seed of k-means and the genetic search")
    p.add_argument(
        "--cfg", type=path_arg, help="cfg whose [yolo] anchors to replace (with --out-cfg)"
    )
    p.add_argument("--out-cfg", type=path_arg, help="where to write the cfg with the new anchors")
    p.add_argument("--exist-ok", action="store_true", help="replace an existing --out-cfg")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every flag, before any label is read."""
    if (args.cfg is None) != (args.out_cfg is None):
        raise ConfigError("--cfg and --out-cfg go together")
    if args.cfg is not None:
        check_config_file(args.cfg, MAX_TEXT_BYTES, "model cfg")
    if not 0 < args.iou_t < 1:
        raise ConfigError(f"--iou-t must be in (0, 1), got {args.iou_t}")
    check_img_size_limit(args.img_size)
    # Any size the loader takes (not only multiples of GRID), checked here to name the flag.
    check_at_least({"--img-size": args.img_size}, GRID)
    check_at_least({"--num": args.num, "--classes": args.classes}, 1)
    check_at_least({"--seed": args.seed}, 0)
    check_at_least({"--generations": args.generations}, 0, MAX_GENERATIONS)
    if args.data and args.classes is not None:
        raise ConfigError("--classes goes with --list (--data has the .data's classes=)")


def label_wh(source: str | Path, img_size: int, nc: int | None) -> np.ndarray:
    """``(n, 2)`` label widths/heights at ``img_size`` of the images ``source`` lists, without
    those too small to fit an anchor to (a warning counts them)."""
    if nc is None:
        LOGGER.info(
            "no --classes: class ids are not checked, and training (which knows the class "
            "count) checks the labels again instead of reusing the cache written here"
        )
    dataset = LoadImagesAndLabels(source, img_size, nc=nc)
    wh = anchors_lib.label_sizes(dataset.labels, dataset.shapes, dataset.img_size)
    small = too_small(wh)
    if small.any():
        LOGGER.warning(
            "%d of %d labels are under %g px at img-size %d; ignored",
            small.sum(),
            len(wh),
            MIN_LABEL_PX,
            img_size,
        )
    return wh[~small]


def fit_anchors(args: argparse.Namespace) -> None:
    check_args(args)
    in_cfg = cfg_anchor_count(args.cfg) if args.cfg else None
    n = args.num or in_cfg or 9
    if in_cfg is not None and n != in_cfg:  # before the search, not after it (was: after)
        raise ConfigError(
            f"-n {n} but [yolo] num={in_cfg}: the cfg's heads take {in_cfg} anchors; pass "
            f"-n {in_cfg} or leave -n out",
            args.cfg,
        )
    data = load_data_config(args.data) if args.data else None
    source = data.train if data else args.list
    if args.out_cfg is not None:
        # Never over a file this tool reads or the data names (was: --out-cfg my.data replaced
        # the .data, --out-cfg coco_ids.json --exist-ok the id map), nor over any other file
        # without --exist-ok.
        reads = {"--cfg that": args.cfg, "--data that": args.data, "the image list that": source}
        reads |= {f"the '{k}' file of --data that": p for k, p in data.files} if data else {}
        check_new_file(args.out_cfg, "--out-cfg", args.exist_ok, reads)
        # Nor among the images and labels of any split (was: --out-cfg <labels>/x.txt
        # --exist-ok replaced a training label, and a val label, with a cfg).
        folders = []
        for split in (data.train, data.valid) if data else (source,):
            images, labels = data_folders(split)
            folders += images + labels
        check_apart({"--out-cfg": args.out_cfg}, folders, "the dataset's folder")
    # The label cache is keyed by the class count as well: read it with the .data's (or
    # --classes), as training does, so that the cache written here is the one training reuses.
    wh = label_wh(source, args.img_size, data.nc if data else args.classes)
    rng = np.random.default_rng(args.seed)
    anchors = kmeans_iou(wh, n, rng)
    LOGGER.info("k-means:  %s; %s", format_anchors(anchors), describe(wh, anchors, args.iou_t))
    anchors = evolve(wh, anchors, args.iou_t, args.generations, rng)
    LOGGER.info("evolved:  %s; %s", format_anchors(anchors), describe(wh, anchors, args.iou_t))
    print(f"anchors={format_anchors(anchors)}")
    if args.cfg is not None:
        k = write_anchors_into_cfg(args.cfg, args.out_cfg, anchors)
        LOGGER.info("wrote %s (%d [yolo] sections)", args.out_cfg, k)


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_args_parser(), fit_anchors, argv)


if __name__ == "__main__":
    sys.exit(main())
