"""What this repository computes where Darknet trains a cfg, in files you can compare with your
own Darknet build (ours is checked against AlexeyAB/darknet by tests/models/test_darknet_loss.py
and tests/train_utils/test_darknet_schedule.py).

    python tools/darknet_check.py yolo --cfg yolov4-tiny.cfg --layer 30 --input x.f32 \\
        --truths truths.txt --out delta.f32
    python tools/darknet_check.py lr --cfg yolov4-tiny.cfg --iterations 3000 > rates.txt

``yolo``: the ``l.delta`` of ``[yolo]`` layer ``--layer`` (Darknet's layer index: the sections
after ``[net]``, from 0) in training, for the raw input ``--input``: float32, batch x channels x
h x w, the output of the layer below at the cfg's width and height (batch = file size / one
image). ``--truths``: lines ``image x y w h class`` (normalized centre and size; images from 0;
Darknet reads an image's truths up to its first with ``x == 0``). ``--out`` gets the delta in
the input's layout, with Darknet's sign (minus the gradient); the layer's cost is printed.

``lr``: ``--iterations`` lines; line ``k`` (from 0) is Darknet's ``get_current_rate`` when
``*net.seen = k * batch * subdivisions``, so Darknet's first update uses line 1. With
``policy=random``, ``--seed S`` repeats a Darknet that called ``srand(S)`` (glibc's ``rand``).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from build_utils.atomic import atomic_write, reported_write
from build_utils.checks import check_at_least
from build_utils.errors import ConfigError
from build_utils.limits import (
    MAX_LABEL_BYTES,
    MAX_WEIGHTS_BYTES,
    decode_text,
    read_limited_bytes,
)
from build_utils.parse_config import Block, parse_model_cfg
from models.budget import FLOAT_BYTES, estimate_model
from models.darknet_loss import TRUTH_FIELDS, yolo_delta, yolo_specs
from train_utils.cli import HelpFormatter, run_script
from train_utils.darknet_schedule import DarknetSettings, GlibcRandom, current_rate
from train_utils.run_folder import check_new_file

LOGGER = logging.getLogger(__name__)

# --iterations: Darknet's cfgs train at most a few hundred thousand (yolov4: 500500).
MAX_ITERATIONS = 10_000_000
TRUTH_COLUMNS = 1 + TRUTH_FIELDS  # image, x, y, w, h, class


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Darknet's [yolo] delta or learning rates, as this repository computes them.",
        add_help=add_help,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="what", required=True, metavar="{yolo,lr}", help="what to compute"
    )
    yolo = sub.add_parser(
        "yolo", help="the delta of one [yolo] layer", formatter_class=HelpFormatter
    )
    yolo.add_argument("--cfg", required=True, help="Darknet model cfg")
    yolo.add_argument(
        "--layer", required=True, type=int, help="Darknet's index of the [yolo] layer (from 0)"
    )
    yolo.add_argument(
        "--input",
        required=True,
        help="float32 batch x channels x h x w: the output of the layer below",
    )
    yolo.add_argument(
        "--truths", required=True, help="text file of lines 'image x y w h class' (normalized)"
    )
    yolo.add_argument("--out", required=True, help="float32 file for the delta (input's layout)")
    yolo.add_argument("--exist-ok", action="store_true", help="replace an existing --out")
    lr = sub.add_parser(
        "lr", help="the learning rate at each iteration", formatter_class=HelpFormatter
    )
    lr.add_argument("--cfg", required=True, help="Darknet model cfg (its [net] is read)")
    lr.add_argument("--iterations", required=True, type=int, help="lines to print (k = 0..N-1)")
    lr.add_argument(
        "--seed", type=int, default=None, help="policy=random: glibc srand() seed (default: 1)"
    )
    return parser


def layer_input_shape(
    blocks: list[Block], layer: int, size: tuple[int, int]
) -> tuple[int, int, int]:
    """(channels, h, w) of what ``[yolo]`` layer ``layer`` receives at the cfg's ``size``."""
    est = estimate_model(blocks, size)
    if est.size_mismatch is not None:
        raise est.size_mismatch
    return est.layers[layer - 1].shape if layer > 0 else (int(blocks[0].get("channels", 3)), *size)


def read_truths(path: str, batch: int) -> torch.Tensor:
    """(batch, T, 5) truths from lines ``image x y w h class``, in file order per image.

    Raises:
        ConfigError: naming path:line: not six numbers, an image outside ``0..batch-1``, a
            value that is not finite.
    """
    text = decode_text(read_limited_bytes(path, MAX_LABEL_BYTES, "truths file"), path, "truths")
    per_image: list[list[list[float]]] = [[] for _ in range(batch)]
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            values = [float(p) for p in parts]
        except ValueError as e:
            raise ConfigError(
                f"expected numbers 'image x y w h class', got {line!r}", path, number
            ) from e
        if len(values) != TRUTH_COLUMNS or not all(math.isfinite(v) for v in values):
            raise ConfigError(
                f"expected six finite numbers 'image x y w h class', got {line!r}", path, number
            )
        image = values[0]
        if image != int(image) or not 0 <= image < batch:
            raise ConfigError(
                f"image {parts[0]} is not one of the input's images 0..{batch - 1}", path, number
            )
        per_image[int(image)].append(values[1:])
    longest = max((len(rows) for rows in per_image), default=0)
    truths = torch.zeros(batch, longest, TRUTH_FIELDS)
    for b, rows in enumerate(per_image):
        if rows:
            truths[b, : len(rows)] = torch.tensor(rows)
    return truths


def yolo_command(args: argparse.Namespace) -> int:
    blocks = parse_model_cfg(args.cfg)
    specs = yolo_specs(blocks)
    if args.layer not in specs:
        yolos = ", ".join(map(str, specs)) or "none"
        raise ConfigError(f"--layer {args.layer} is not a [yolo] layer (those are: {yolos})")
    reads = {"the --cfg": args.cfg, "the --input": args.input, "the --truths": args.truths}
    check_new_file(args.out, "--out", args.exist_ok, reads)
    net = blocks[0]
    size = (int(net.get("height", 416)), int(net.get("width", 416)))  # Darknet's net.h, net.w
    c, h, w = layer_input_shape(blocks, args.layer, size)
    per_image = c * h * w
    data = read_limited_bytes(args.input, MAX_WEIGHTS_BYTES, "--input")
    if not data or len(data) % (per_image * FLOAT_BYTES):
        raise ConfigError(
            f"--input holds {len(data)} bytes, not a whole number of images of {c} x {h} x {w} "
            f"float32 ({per_image * FLOAT_BYTES} bytes each) for layer {args.layer}"
        )
    batch = len(data) // (per_image * FLOAT_BYTES)
    x = torch.from_numpy(
        np.frombuffer(data, dtype="<f4").astype(np.float32).reshape(batch, c, h, w)
    )
    truths = read_truths(args.truths, batch)
    result = yolo_delta(x, truths, specs[args.layer], size)
    with reported_write(args.out, "--out"), atomic_write(args.out, "wb") as f:
        f.write(result.delta.numpy().astype("<f4").tobytes())
    print(f"cost {float(result.cost):.9g} count {int(result.count)} images {batch}")
    return 0


def lr_command(args: argparse.Namespace) -> int:
    check_at_least({"--iterations": args.iterations}, 0, MAX_ITERATIONS)
    settings = DarknetSettings.from_block(parse_model_cfg(args.cfg)[0])
    rand = GlibcRandom(1 if args.seed is None else args.seed).rand
    lines = (f"{current_rate(settings, k, rand):.9g}\n" for k in range(args.iterations))
    sys.stdout.writelines(lines)
    return 0


def command(args: argparse.Namespace) -> int:
    return yolo_command(args) if args.what == "yolo" else lr_command(args)


def main(argv: list[str] | None = None) -> int:
    return run_script(get_args_parser(), command, argv)


if __name__ == "__main__":
    sys.exit(main())
