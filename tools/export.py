"""Export a model to ONNX, TorchScript and OpenVINO, each checked against PyTorch.

    python tools/export.py --weights runs/exp/best.pt                  # -> runs/exp/best.onnx
    python tools/export.py --weights runs/exp/best.pt --include onnx torchscript openvino --half
    python tools/export.py --cfg cfg/yolov3-spp-nano.cfg --img-size 320 --include torchscript
    python tools/export.py --weights yolov3-spp.weights --cfg cfg/yolov3-spp.cfg --img-size 320 416

The model is read once (``--weights`` alone for a checkpoint train.py wrote; Darknet ``.weights``
need ``--cfg``; without ``--weights`` the cfg's random initialisation is exported, for tests) and
written once per format, named as YOLOv5 names them, beside the weights unless ``--output DIR``;
each export is then run in its own runtime on two sample images next to PyTorch float32
(``--no-verify`` skips it). The graph every format holds: models/export.py; the formats, file
names, tolerances and what is never replaced: README "Export".
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2
import numpy as np
import torch

from build_utils.atomic import check_new_outputs, make_output_dir
from build_utils.augmentations import letterbox
from build_utils.errors import ConfigError
from data.make_shapes import GeneratorOptions, render_image
from models.budget import check_model_fits
from models.darknet import Darknet
from models.export import (
    DEFAULT_OPSET,
    FORMATS,
    INSTALL_ONNX,
    MAX_OPSET,
    MIN_OPSET,
    NMS_CONF,
    OUTPUT_FLAG,
    check_opset,
    export_metadata,
    hw,
    verify,
)
from train_utils.checkpoint import read_weights
from train_utils.cli import (
    HelpFormatter,
    add_model_flag,
    add_weights_flags,
    check_img_size,
    path_arg,
    run_script,
    switch,
)
from train_utils.load_model import default_img_size, model_from_weights

LOGGER = logging.getLogger(__name__)

DEFAULT_SIDE = 416  # export size of a cfg without a trained run
DEFAULT_INCLUDE = ["onnx"]
SAMPLE_IMAGES = 2  # not the traced batch (1), to exercise the dynamic batch axis
SAMPLE_SEED = 0


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Export a model to ONNX, TorchScript and OpenVINO, each checked against "
        "PyTorch.",
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
        help=(
            "input H [W] in pixels (default: the checkpoint's run's side; a Darknet .weights: "
            f"its cfg's [net] side, as predict.py runs it; a cfg alone: {DEFAULT_SIDE})"
        ),
    )
    parser.add_argument(
        "--include",
        nargs="*",
        default=DEFAULT_INCLUDE,
        metavar="FORMAT",
        help=f"formats to write: {', '.join(FORMATS)} (default: onnx)",
    )
    parser.add_argument(
        "--half", action="store_true", help="float16 (ONNX, TorchScript; OpenVINO's weights)"
    )
    parser.add_argument(
        "-o",
        "--output",
        type=path_arg,
        metavar="DIR",
        help="folder for the exports (default: the weights' folder, else the current one)",
    )
    parser.add_argument("--exist-ok", action="store_true", help="replace exports of the same name")
    parser.add_argument(
        "--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset, {MIN_OPSET} to {MAX_OPSET}"
    )
    switch(parser, "--verify", True, "run each export in its runtime and compare with PyTorch")
    return parser


def included(names: list[str]) -> list[str]:
    """The formats of ``--include`` (case-insensitive, commas allowed, in the given order, each
    once); raises ConfigError for none or an unknown one."""
    wanted = [n.lower() for name in names for n in name.split(",") if n]
    if not wanted:
        raise ConfigError(f"--include needs at least one format: {', '.join(FORMATS)}")
    unknown = [n for n in wanted if n not in FORMATS]
    if unknown:
        raise ConfigError(
            f"--include {unknown[0]!r} is not a format this tool writes; "
            f"choose from {', '.join(FORMATS)}"
        )
    return list(dict.fromkeys(wanted))


def sample_images(h: int, w: int, n: int = SAMPLE_IMAGES, seed: int = SAMPLE_SEED) -> torch.Tensor:
    """``n`` images of drawn shapes on textured backgrounds, letterboxed to (H, W) as predict.py
    feeds them: (n, 3, H, W) float32 RGB in [0, 1]. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    opts = GeneratorOptions(img_size_range=(min(h, w) // 2, max(h, w)))
    batch = []
    for _ in range(n):
        img, _objects = render_image(rng, opts)
        boxed = letterbox(img, (h, w))[0]
        batch.append(cv2.cvtColor(boxed, cv2.COLOR_BGR2RGB).transpose(2, 0, 1))
    return torch.from_numpy(np.stack(batch)).float() / 255.0


def checked_hw(sides: list[int]) -> tuple[int, int]:
    """(H, W) of ``--img-size H [W]``, each a multiple of 32 within the limit
    (:func:`~train_utils.cli.check_img_size`)."""
    if len(sides) > 2:
        raise ConfigError(f"--img-size takes H or H W, got {len(sides)} numbers")
    for side in sides:
        check_img_size(side)
    return hw(sides)


def _load(
    args: argparse.Namespace,
) -> tuple[Darknet, list[str] | None, str, Path, tuple[int, int]]:
    """The model (eval mode, CPU), its class names (None: not known), the exports' stem, the
    weights' folder (or the current one) and the input (H, W)."""
    given = checked_hw(args.img_size) if args.img_size is not None else None
    if not args.weights:
        if args.cfg is None:
            raise ConfigError("pass --weights (a checkpoint carries its cfg) or --cfg")
        size = given or hw(DEFAULT_SIDE)
        model = Darknet(args.cfg, img_size=size).eval()
        return model, None, Path(args.cfg).stem, Path("."), size
    weights = read_weights(args.weights, trust=args.trust_checkpoint)
    # As predict.py and validation.py run them: a .weights file at its cfg's [net] side.
    size = given or checked_hw([weights.run.get("img_size") or default_img_size(weights, args.cfg)])
    model = model_from_weights(weights, args.cfg, None, size).eval()
    stem, home = Path(args.weights).stem, Path(args.weights).parent
    return model, weights.names, stem, home, size


def _targets(args: argparse.Namespace, formats: list[str], stem: str, home: Path) -> list[Path]:
    """Where each format goes; ConfigError when one exists (without ``--exist-ok``), is the
    weights file itself, or (an OpenVINO folder) holds the user's own files."""
    folder = args.output if args.output is not None else home
    targets = [folder / FORMATS[f].target(stem) for f in formats]
    source = Path(args.weights).resolve() if args.weights else None
    for path in targets:
        if source is not None and path.resolve() == source:
            raise ConfigError(f"{path} is the weights file itself; choose another --output")
    check_new_outputs(targets, OUTPUT_FLAG, args.exist_ok)
    for name, path in zip(formats, targets):
        if FORMATS[name].check_target is not None:
            FORMATS[name].check_target(path)
    return targets


def check_formats(args: argparse.Namespace) -> list[str]:
    """The formats of ``--include``, each with what it needs installed, and the opset: before
    anything is written (a bad opset would fail after earlier formats were)."""
    formats = included(args.include)
    check_opset(args.opset)
    for name in formats:
        missing = FORMATS[name].missing(args.verify)
        if missing:
            raise ConfigError(
                f"--include {name} needs {' and '.join(missing)}: {INSTALL_ONNX}"
                + ("" if FORMATS[name].missing(False) else " (or --no-verify)")
            )
    return formats


def check_export(name: str, model: Darknet, path: Path, images: torch.Tensor, half: bool) -> str:
    """Run the export ``path`` of format ``name`` in its runtime next to ``model`` and log how
    they agree; what failed ("" when it agrees)."""
    a = verify(FORMATS[name], model, path, images, half)
    if a.unavailable is not None:
        LOGGER.error("%s not checked: %s", name, a.unavailable)
        return f"{name} ({a.unavailable})"
    LOGGER.info(
        "%s %s PyTorch %s the tolerance %g relative + %g absolute: %s (max abs difference "
        "%.2e); %s",
        name,
        "matches" if a.ok else "DIFFERS FROM",
        "within" if a.ok else "beyond",
        a.tolerance,
        a.tolerance,
        # Which part of the tolerance a value uses: the relative part lets large values (box
        # sides in pixels) differ by more than the absolute part alone.
        f"the largest difference is {a.worst:.0%} of what it allows"
        if math.isfinite(a.worst)
        else "the output's shape differs",
        a.max_abs,
        f"{a.found} of its {a.detections} detections after NMS found"
        if a.detections
        else f"no detections above conf {NMS_CONF} on the sample images to compare",
    )
    if a.deployment is not None:
        LOGGER.warning("%s: %s", name, a.deployment)
    return "" if a.ok else f"{name} output differs from PyTorch"


def export(args: argparse.Namespace) -> int:
    formats = check_formats(args)
    model, names, stem, home, (h, w) = _load(args)
    # Before tracing: an export at a size the RAM cannot hold would run for minutes and end in
    # the kernel's OOM killer (models/budget.py).
    check_model_fits([model.hyperparams, *model.module_defs], (h, w), export=True)
    metadata = export_metadata(model, (h, w), names)
    targets = _targets(args, formats, stem, home)
    make_output_dir(targets[0].parent, OUTPUT_FLAG)
    images = sample_images(h, w) if args.verify else None
    failed = []
    for name, path in zip(formats, targets):
        FORMATS[name].write(model, path, (h, w), args.half, args.opset, metadata)
        precision = "float16" if args.half else "float32"
        LOGGER.info("wrote %s (%s, input images: batch x 3 x %d x %d)", path, precision, h, w)
        if images is not None:
            failed.append(check_export(name, model, path, images, args.half))
    failed = [f for f in failed if f]
    if failed:
        # A converter's or runtime's fault, not the user's: exit 1, the exports left for
        # inspection (--no-verify writes them without the check).
        print(f"error: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_script(get_args_parser(), export, argv)


if __name__ == "__main__":
    sys.exit(main())
