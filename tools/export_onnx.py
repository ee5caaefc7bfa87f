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
import io
import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch import nn

from build_utils.atomic import atomic_write, make_output_dir, reported_write
from build_utils.errors import ConfigError, YoloError
from build_utils.parse_config import parse_model_cfg
from models.budget import check_model_fits
from models.darknet import Darknet
from train_utils.builders import model_from_weights
from train_utils.checkpoint import read_weights
from train_utils.cli import HelpFormatter, add_model_flag, add_weights_flags, check_img_size

LOGGER = logging.getLogger(__name__)

# Opset 11 is the first with the Resize semantics nn.Upsample needs; 12 is widely supported.
MIN_OPSET = 11
DEFAULT_OPSET = 12
DEFAULT_SIDE = 416  # export size of a cfg without a trained run
VERIFY_TOLERANCE = 1e-4
OUTPUT_FLAG = "--output"  # the option that chose the output file, named in write errors
VERIFY_BATCH = 2  # not the export batch (1), to exercise the dynamic batch axis


class DetectionsOnly(nn.Module):
    """Wraps a Darknet so that the exported graph returns only the decoded detections."""

    def __init__(self, model: Darknet):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, 3, H, W) -> (bs, N, 5 + nc), see :class:`~models.darknet.Darknet`."""
        return self.model(x)[0]


def _hw(img_size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(img_size, int):
        return img_size, img_size
    if len(img_size) == 1:
        return img_size[0], img_size[0]
    return int(img_size[0]), int(img_size[1])


def export_onnx(
    model: Darknet,
    path: str | Path,
    img_size: int | tuple[int, int] = 416,
    opset: int = DEFAULT_OPSET,
) -> Path:
    """Write ``model`` in eval mode as ONNX with a dynamic batch axis; returns the path.

    ``model`` is left in eval mode. Raises ConfigError for an opset below 11 or an image size
    that is not a multiple of the model's largest stride.
    """
    if opset < MIN_OPSET:
        raise ConfigError(f"--opset {opset}: upsampling needs opset {MIN_OPSET} or later")
    h, w = _hw(img_size)
    stride = int(max(model.strides))
    if h % stride or w % stride:
        raise ConfigError(f"--img-size {h} {w}: both sides must be multiples of {stride}")
    path = Path(path)
    make_output_dir(path.parent, OUTPUT_FLAG)
    wrapper = DetectionsOnly(model).eval()
    x = torch.zeros(1, model.hyperparams.get("channels", 3), h, w)
    with warnings.catch_warnings():
        # The TorchScript-based exporter is deprecated in favour of torch.export (which needs the
        # extra onnxscript package); it handles this static graph fine. Its tracer warns about
        # shape-dependent Python branches, which are constant for a fixed image size.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # Darknet's max-pooling pads with -inf where MaxPool's symmetric padding cannot (size=2
        # stride=1): F.pad exports as Pad with a reversed (step -1) Slice the folder skips.
        warnings.filterwarnings("ignore", message="Constant folding", category=UserWarning)
        # Into memory first, then atomically onto ``path``: a full disk mid-write must leave
        # the previous export whole (the exporter would write ``path`` in place).
        buf = io.BytesIO()
        torch.onnx.export(
            wrapper,
            (x,),
            buf,
            dynamo=False,
            opset_version=opset,
            input_names=["images"],
            output_names=["detections"],
            dynamic_axes={"images": {0: "batch"}, "detections": {0: "batch"}},
        )
    # The exporter restores the wrapper's original (training) mode on exit, recursively.
    model.eval()
    with reported_write(path, OUTPUT_FLAG), atomic_write(path, "wb") as f:
        f.write(buf.getbuffer())
    return path


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
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise ConfigError("--verify needs onnxruntime: pip install -r requirements-onnx.txt") from e
    h, w = _hw(img_size)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(VERIFY_BATCH, model.hyperparams.get("channels", 3), h, w, generator=gen)
    model.eval()
    with torch.no_grad():
        expected = model(x)[0].numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"images": x.numpy()})
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
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f">= {MIN_OPSET}")
    parser.add_argument(
        "--verify", action="store_true", help="compare with PyTorch using onnxruntime"
    )
    return parser


def _checked_hw(sides: list[int]) -> tuple[int, int]:
    """(H, W) of ``--img-size H [W]`` (or the run's side), each a multiple of 32 within
    the limit (:func:`~train_utils.cli.check_img_size`)."""
    for side in sides:
        check_img_size(side)
    return _hw(sides)


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
