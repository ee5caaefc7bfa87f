"""Convert model weights between Darknet ``.weights`` and PyTorch ``.pt`` files.

    python tools/convert_weights.py cfg/yolov3-spp.cfg yolov3-spp.weights yolov3-spp.pt
    python tools/convert_weights.py cfg/yolov3-spp.cfg best.pt best.weights

The direction follows the file suffixes: one of SRC and DST must end in ``.weights``, the
other in ``.pt`` (or ``.pth``). A ``.pt`` source may be a lineage checkpoint
(``{'model': state_dict, ...}``) or a bare state_dict; it must match the cfg exactly. The
``.pt`` written is ``{'model': state_dict, 'epoch': -1, ...}``: weights to start from, not a
run to resume. BatchNorm ``num_batches_tracked`` counters are not part of the Darknet format and
come back as 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from build_utils.errors import ConfigError, YoloError
from models.darknet import Darknet
from models.weights import save_weights
from train_utils.checkpoint import load_weights, save_weights_pt

PT_SUFFIXES = (".pt", ".pth")
DARKNET_SUFFIX = ".weights"


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert weights between Darknet .weights and PyTorch .pt.", add_help=add_help
    )
    parser.add_argument("cfg", type=Path, help="model cfg the weights belong to")
    parser.add_argument("src", type=Path, help="input .weights or .pt")
    parser.add_argument("dst", type=Path, help="output .pt or .weights")
    return parser


def convert(cfg: Path, src: Path, dst: Path) -> None:
    """Load ``src`` into the model of ``cfg`` and write it as ``dst`` (format from suffixes)."""
    s, d = src.suffix.lower(), dst.suffix.lower()
    to_pt = s == DARKNET_SUFFIX and d in PT_SUFFIXES
    to_darknet = s in PT_SUFFIXES and d == DARKNET_SUFFIX
    if not (to_pt or to_darknet):
        raise ConfigError(
            f"cannot convert '{src.name}' to '{dst.name}': one file must end in .weights and the "
            "other in .pt or .pth"
        )
    model = Darknet(cfg)
    load_weights(model, src, strict=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if to_pt:
        save_weights_pt(model, dst)
    else:
        save_weights(model, dst)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        convert(args.cfg, args.src, args.dst)
    except YoloError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("wrote %s", args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
