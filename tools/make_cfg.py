"""Rewrite a model cfg for another number of classes.

    python tools/make_cfg.py cfg/yolov3-spp.cfg --classes 20 -o cfg/yolov3-spp-voc.cfg
    python tools/make_cfg.py cfg/yolov3-spp-nano.cfg --data data/shapes.data

Every ``[yolo]`` gets ``classes=N`` and the ``[convolutional]`` feeding it
``filters=len(mask) * (N + 5)``; nothing else changes. The output is written without the source's
comments. Without ``-o`` it goes beside the source as ``<name>-<N>cls.cfg``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from build_utils.errors import YoloError
from build_utils.parse_config import (
    parse_data_cfg,
    parse_model_cfg,
    rewrite_cfg_classes,
    write_model_cfg,
)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Rewrite a Darknet cfg for another number of classes.", add_help=add_help
    )
    parser.add_argument("cfg", type=Path, help="source model cfg")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--classes", type=int, help="number of classes (>= 1)")
    source.add_argument("--data", type=Path, help=".data file whose 'classes' to use")
    parser.add_argument(
        "-o", "--output", type=Path, help="output cfg (default: <cfg stem>-<N>cls.cfg beside it)"
    )
    return parser


def make_cfg(cfg: Path, nc: int, output: Path | None = None) -> Path:
    """Write ``cfg`` rewritten for ``nc`` classes to ``output`` and return its path."""
    blocks = rewrite_cfg_classes(parse_model_cfg(cfg), nc)
    out = output if output is not None else cfg.with_name(f"{cfg.stem}-{nc}cls.cfg")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_model_cfg(
        blocks, out, header=f"{cfg.name} rewritten for {nc} classes by tools/make_cfg.py"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        nc = args.classes if args.classes is not None else parse_data_cfg(args.data)["classes"]
        out = make_cfg(args.cfg, nc, args.output)
    except YoloError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("wrote %s (%d classes)", out, nc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
