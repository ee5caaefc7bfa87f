"""Rewrite a model cfg for another number of classes, or a narrower (or wider) network.

    python tools/make_cfg.py cfg/yolov3-spp.cfg --classes 20 -o cfg/yolov3-spp-voc.cfg
    python tools/make_cfg.py cfg/yolov3-spp-nano.cfg --data demo_data/shapes/shapes.data
    python tools/make_cfg.py cfg/darknet/yolov4-csp.cfg --width 0.125 --classes 5
    python tools/make_cfg.py cfg/yolov3-spp-nano.cfg --new-coords      # -newcoords.cfg beside it

``--classes``/``--data``: every ``[yolo]`` gets ``classes=N`` and the ``[convolutional]`` feeding it
``filters=len(mask) * (N + 5)``. ``--width W``: every other ``[convolutional]`` gets
``filters`` times W, rounded up to a multiple of 8 (equal counts stay equal, so shortcuts and
grouped routes still fit); a depthwise conv (``groups=filters``) keeps ``groups`` equal to its
new ``filters``. ``--new-coords``: every ``[yolo]`` head decodes and trains as Scaled-YOLOv4's
and YOLOv7's do (Darknet's ``new_coords=1`` with ``scale_x_y=2``, the ``activation=logistic``
moved to the conv feeding it): boxes reach half a cell beyond their cell and up to 4x their
anchor, so the loss assigns each target to up to three cells and to every anchor within 4x of
its shape instead of one cell and the anchors above ``iou_t`` (``models/loss.py``). That is
about three times the positive samples per image, and a from-scratch model learns much faster
(README, "The demo"). Nothing else changes. The output is written without the source's
comments. Without ``-o`` it goes beside the source as ``<name>[-w<W>][-newcoords][-<N>cls].cfg``;
an existing output is replaced only with ``--exist-ok``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from build_utils.atomic import make_output_dir
from build_utils.checks import check_real
from build_utils.errors import ConfigError
from build_utils.parse_config import (
    Block,
    head_conv_index,
    layer_error,
    parse_data_cfg,
    parse_model_cfg,
    rewrite_cfg_classes,
    validate_model_cfg,
    write_model_cfg,
)
from train_utils.cli import HelpFormatter, path_arg, run_script
from train_utils.run_folder import check_new_file

# --width rounds filter counts up to a multiple of this (channel counts that vectorise well,
# and even ones for [route] groups=2).
WIDTH_DIVISOR = 8
# --new-coords: the centre decode's range, sigmoid * 2 - 0.5 (as in Darknet's Scaled-YOLOv4 and
# YOLOv7 cfgs); 2 is what lets the loss assign a target to the neighbouring cells.
NEW_COORDS_SCALE_XY = 2.0


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Rewrite a Darknet cfg for another number of classes.",
        add_help=add_help,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("cfg", type=path_arg, help="source model cfg")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--classes", type=int, help="number of classes (>= 1)")
    source.add_argument(
        "--data", type=path_arg, help=".data or data.yaml file whose class count to use"
    )
    parser.add_argument(
        "--width", type=float, help="multiply the filters of every non-head conv by this (> 0)"
    )
    parser.add_argument(
        "--new-coords",
        action="store_true",
        help="Scaled-YOLOv4 heads: new_coords=1, scale_x_y=2, logistic activation before them",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=path_arg,
        help="output cfg (default: beside it, <stem>[-w<W>][-newcoords][-<N>cls].cfg)",
    )
    parser.add_argument("--exist-ok", action="store_true", help="replace an existing output cfg")
    return parser


def scale_width(blocks: list[Block], multiple: float) -> list[Block]:
    """A copy of ``blocks`` with every ``[convolutional]`` that does not feed a ``[yolo]`` head
    at ``ceil(filters * multiple / 8) * 8`` filters (see the module docstring).

    Raises:
        ConfigError: ``multiple`` is not a positive number.
    """
    check_real("--width", multiple, positive=True)
    out = copy.deepcopy(blocks)
    heads = {head_conv_index(out, i) for i, b in enumerate(out) if b["type"] == "yolo"}
    for i, block in enumerate(out):
        if block["type"] != "convolutional" or i in heads:
            continue
        filters = block.get("filters", 1)
        scaled = WIDTH_DIVISOR * max(1, math.ceil(filters * multiple / WIDTH_DIVISOR))
        if block.get("groups", 1) == filters and filters > 1:
            block["groups"] = scaled
        block["filters"] = scaled
    try:
        return validate_model_cfg(out)
    except ConfigError as e:  # a value --width made, not one of the file's: the flag says why
        raise ConfigError(f"--width {multiple:g}: {e}") from e


def new_coords_heads(blocks: list[Block]) -> list[Block]:
    """A copy of ``blocks`` whose ``[yolo]`` heads are Scaled-YOLOv4 heads (module docstring).

    Raises:
        ConfigError: a head is not fed by a ``[convolutional]`` (nowhere to put the sigmoid).
    """
    out = copy.deepcopy(blocks)
    for i, block in enumerate(out):
        if block["type"] != "yolo" or block.get("new_coords", 0):
            continue
        conv = head_conv_index(out, i)
        if conv is None:
            raise layer_error(block, "--new-coords needs a [convolutional] right before it")
        out[conv]["activation"] = "logistic"
        block["new_coords"] = 1
        block["scale_x_y"] = NEW_COORDS_SCALE_XY
    return validate_model_cfg(out)


def make_cfg(
    cfg: Path,
    nc: int | None = None,
    output: Path | None = None,
    width: float | None = None,
    new_coords: bool = False,
    exist_ok: bool = False,
    reads: dict[str, Path | None] | None = None,
) -> Path:
    """Write ``cfg`` rewritten for ``nc`` classes, scaled to ``width`` and/or with
    :func:`new_coords_heads` to ``output`` and return its path.

    Raises:
        ConfigError: nothing asked, bad values (see :func:`scale_width`), or an output that
            exists (unless ``exist_ok``) or is the cfg or another file the tool ``reads``.
    """
    if nc is None and width is None and not new_coords:
        raise ConfigError("nothing to do: pass --classes, --data, --width or --new-coords")
    blocks = parse_model_cfg(cfg)
    what, stem = [], cfg.stem
    if width is not None:
        blocks = scale_width(blocks, width)
        what.append(f"width x{width:g}")
        stem += f"-w{width:g}"
    if new_coords:
        blocks = new_coords_heads(blocks)
        what.append("new_coords heads")
        stem += "-newcoords"
    if nc is not None:
        blocks = rewrite_cfg_classes(blocks, nc)
        what.append(f"{nc} classes")
        stem += f"-{nc}cls"
    out = output if output is not None else cfg.with_name(f"{stem}.cfg")
    check_new_file(out, "--output", exist_ok, {"the cfg": cfg, **(reads or {})})
    make_output_dir(out.parent, "--output")
    header = f"{cfg.name} rewritten for {', '.join(what)} by tools/make_cfg.py"
    write_model_cfg(blocks, out, header, "--output")
    return out


def rewrite(args: argparse.Namespace) -> None:
    nc = args.classes
    if args.data is not None:
        nc = parse_data_cfg(args.data)["classes"]
    reads = {"the --data file": args.data}
    out = make_cfg(args.cfg, nc, args.output, args.width, args.new_coords, args.exist_ok, reads)
    logging.getLogger(__name__).info("wrote %s", out)


def main(argv: list[str] | None = None) -> int:
    return run_script(get_args_parser(), rewrite, argv)


if __name__ == "__main__":
    sys.exit(main())
