"""Export a Darknet model to ONNX (optional extra: ``pip install -r requirements-onnx.txt``).

    python tools/export_onnx.py --weights runs/exp/best.pt --verify     # -> runs/exp/best.onnx
    python tools/export_onnx.py --cfg cfg/yolov3-spp.cfg --weights yolov3-spp.weights --img-size 608
    python tools/export_onnx.py --cfg cfg/yolov3-spp-nano.cfg --img-size 320 416 -o nano.onnx

The graph has one input ``images`` (batch, 3, H, W) float32 in [0, 1] and one output
``detections`` (batch, N, 5 + nc): eval-mode decoded boxes, cx, cy, w, h in input pixels,
sigmoid objectness and class scores, before NMS (``new_coords`` heads decode as Darknet does;
max-pools pad with -inf as Darknet does). The batch size is dynamic; H and W are fixed
at ``--img-size`` (the grids are baked in). ``--verify`` runs the file with onnxruntime on a
random batch of 2 and checks it against PyTorch (tolerance 1e-4, relative and absolute).
Without ``--weights`` the model keeps its random initialisation (useful for testing only).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from build_utils.errors import ConfigError, YoloError
from build_utils.parse_config import parse_model_cfg
from models.budget import check_model_fits
from models.darknet import Darknet
from models.export import (
    DEFAULT_OPSET,
    FORMATS,
    FP32_TOLERANCE,
    MAX_OPSET,
    MIN_OPSET,
    DetectionsOnly,
    export_onnx,
    hw,
)
from train_utils.checkpoint import read_weights
from train_utils.cli import HelpFormatter, add_model_flag, add_weights_flags, check_img_size
from train_utils.load_model import model_from_weights

# The writer and the runtime are models/export.py's, shared with tools/export.py; this script
# keeps its own command line (--img-size H W, -o FILE, --verify on a random batch).
__all__ = ["DetectionsOnly", "export_onnx", "get_args_parser", "main", "verify_onnx"]

LOGGER = logging.getLogger(__name__)

DEFAULT_SIDE = 416  # export size of a cfg without a trained run
VERIFY_TOLERANCE = FP32_TOLERANCE
VERIFY_BATCH = 2  # not the export batch (1), to exercise the dynamic batch axis


def verify_onnx(
    model: Darknet, path: str | Path, img_size: int | tuple[int, int] = 416, seed: int = 0
) -> float:
    """Run ``path`` with onnxruntime on a random batch and compare with ``model`` (eval mode).

    Returns:
        The largest absolute difference.

    Raises:
        ConfigError: onnxruntime is not installed.
        AssertionError: the outputs differ by more than 1e-4 (relative and absolute).
    """
    h, w = hw(img_size)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(VERIFY_BATCH, model.hyperparams.get("channels", 3), h, w, generator=gen)
    model.eval()
    with torch.no_grad():
        expected = model(x)[0].numpy()
    got = FORMATS["onnx"].run(Path(path), x.numpy())
    np.testing.assert_allclose(got, expected, rtol=VERIFY_TOLERANCE, atol=VERIFY_TOLERANCE)
    return float(np.abs(got - expected).max())


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Export a Darknet model to ONNX.",
        add_help=add_help,
        formatter_class=HelpFormatter,
    )
    add_weights_flags(parser, required=False, help=".pt checkpoint (carries its cfg) or .weights")
    add_model_flag(parser, None)
    parser.add_argument(
        "--img-size",
        "--imgsz",
        "--img",
        dest="img_size",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help=f"H [W] in pixels (default: the checkpoint's run's, else {DEFAULT_SIDE})",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        help="output file (default: the weights' name with .onnx, else <cfg stem>.onnx)",
    )
    parser.add_argument(
        "--opset", type=int, default=DEFAULT_OPSET, help=f"{MIN_OPSET} to {MAX_OPSET}"
    )
    parser.add_argument(
        "--verify", action="store_true", help="compare with PyTorch using onnxruntime"
    )
    return parser


def _checked_hw(sides: list[int]) -> tuple[int, int]:
    """(H, W) of ``--img-size H [W]`` (or the run's side), each a multiple of 32 within
    the limit (:func:`~train_utils.cli.check_img_size`)."""
    for side in sides:
        check_img_size(side)
    return hw(sides)


def _model_and_output(args: argparse.Namespace) -> tuple[Darknet, Path, tuple[int, int]]:
    """The model to export (from ``--weights`` alone, or ``--cfg``), where it goes, its size."""
    if not args.weights:
        if args.cfg is None:
            raise ConfigError("pass --weights (a checkpoint carries its cfg) or --cfg")
        img_size = _checked_hw(args.img_size or [DEFAULT_SIDE])
        out = args.output or Path(Path(args.cfg).stem + ".onnx")
        blocks = parse_model_cfg(args.cfg)
        check_model_fits(blocks, img_size)  # the export traces one image
        return Darknet(blocks, img_size=img_size), out, img_size
    weights = read_weights(args.weights, trust=args.trust_checkpoint)
    run_side = weights.run.get("img_size")
    img_size = _checked_hw(args.img_size or [run_side or DEFAULT_SIDE])
    model = model_from_weights(weights, args.cfg, None, img_size)
    out = args.output or Path(args.weights).with_suffix(".onnx")
    if out.resolve() == Path(args.weights).resolve():
        raise ConfigError(f"--output {out} is the weights file itself; choose another name")
    return model, out, img_size


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.img_size is not None and len(args.img_size) > 2:
            raise ConfigError(f"--img-size takes H or H W, got {len(args.img_size)} numbers")
        model, out, img_size = _model_and_output(args)
        export_onnx(model, out, img_size, args.opset)
        LOGGER.info("wrote %s (input images: batch x 3 x %d x %d)", out, *img_size)
        if args.verify:
            diff = verify_onnx(model, out, img_size)
            LOGGER.info("onnxruntime matches PyTorch: max abs difference %.2e", diff)
    except YoloError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AssertionError as e:
        print(
            f"error: ONNX output differs from PyTorch: {str(e).strip().splitlines()[0]}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
