"""Convert model weights between Darknet ``.weights`` and PyTorch ``.pt`` files.

    python tools/convert_weights.py --weights runs/exp/best.pt          # -> runs/exp/best.weights
    python tools/convert_weights.py --weights yolov3-spp.weights --cfg cfg/yolov3-spp.cfg
    python tools/convert_weights.py cfg/yolov3-spp.cfg yolov3-spp.weights yolov3-spp.pt  # old form
    python tools/convert_weights.py best.pt best.weights          # the checkpoint carries its cfg
    python tools/convert_weights.py best.pt -o out/best.weights   # the same as --weights best.pt
    python tools/convert_weights.py yolov3.weights --cfg cfg/yolov3.cfg --cutoff 75  # partial

The direction follows what the source is (recognised by its content): a PyTorch checkpoint
becomes a Darknet ``.weights`` file and a Darknet file a ``.pt``; the output defaults to the
source's name with the other suffix, never overwrites the source, and replaces an existing file
only with ``--exist-ok``, never a file of a training run (its ``last.pt``, ``best.pt``, ...,
beside its ``results.csv``). A checkpoint written by
train.py carries its cfg; Darknet files and bare state_dicts need ``--cfg`` (or ultralytics/yolov3's
first positional argument). A ``.pt`` source may be an ultralytics/yolov3 checkpoint
(``{'model': state_dict, ...}``) or a bare state_dict; it must match the cfg exactly. The
``.pt`` written is ``{'model': state_dict, 'epoch': -1, 'seen': ..., ...}``: weights to start
from, not a run to resume, with the Darknet header (``seen``, the version) so that converting
back gives the ``.weights`` file byte for byte; a run's checkpoint converts with the images its
run has seen. BatchNorm ``num_batches_tracked`` counters are not part of the Darknet format and
come back as 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from build_utils.atomic import make_output_dir, reported_write
from build_utils.checks import check_at_least
from build_utils.errors import ConfigError
from models.weights import darknet_header, save_weights
from train_utils.checkpoint import read_weights, save_weights_pt
from train_utils.cli import HelpFormatter, add_model_flag, add_weights_flags, path_arg, run_script
from train_utils.load_model import model_from_weights
from train_utils.run_folder import check_new_file

PT_SUFFIX = ".pt"
DARKNET_SUFFIX = ".weights"
OUTPUT_FLAG = "--output"  # the option that chose the output file, named in write errors


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert weights between Darknet .weights and PyTorch .pt.",
        add_help=add_help,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "paths",
        nargs="*",
        type=path_arg,
        metavar="[CFG] SRC DST",
        help="ultralytics/yolov3's positional form: cfg (optional for a checkpoint), source, "
        "output",
    )
    add_weights_flags(parser, required=False, help="source: .pt checkpoint or Darknet .weights")
    add_model_flag(parser, None)
    parser.add_argument(
        "-o",
        "--output",
        type=path_arg,
        help="output file (default: the source's name with the other suffix, .weights or .pt)",
    )
    parser.add_argument(
        "--cutoff",
        type=int,
        metavar="N",
        help="write layers 0..N-1 only, as a Darknet file with seen 0, from either format "
        "(Darknet's `partial CFG SRC DST N`; default output SRC.conv.<N-1>, as darknet53.conv.74)",
    )
    parser.add_argument("--exist-ok", action="store_true", help="replace an existing output")
    return parser


def _paths(args: argparse.Namespace) -> tuple[Path | None, Path, Path | None]:
    """(cfg, source, output) from either form of the command line."""
    if args.paths:
        if args.weights or len(args.paths) > 3 or (len(args.paths) > 1 and args.output):
            raise ConfigError("give CFG SRC DST, SRC DST, or [--weights] SRC [--output DST]")
        if len(args.paths) == 1:  # `convert_weights.py best.pt -o best.weights`
            return args.cfg, args.paths[0], args.output
        cfg, src, dst = args.paths if len(args.paths) == 3 else (None, *args.paths)
        return cfg or args.cfg, src, dst
    if not args.weights:
        raise ConfigError("nothing to convert: pass --weights SRC (or CFG SRC DST)")
    return args.cfg, Path(args.weights), args.output


def convert(
    cfg: Path | None,
    src: Path,
    dst: Path | None,
    trust: bool = False,
    exist_ok: bool = False,
    cutoff: int | None = None,
) -> Path:
    """Load ``src`` (with its own cfg unless ``cfg``) and write it in the other format as
    ``dst`` (default: ``src`` with the other suffix, replaced only when ``exist_ok``); returns
    where it was written. ``cutoff``: layers ``0 .. cutoff - 1`` as a Darknet file with seen 0,
    whatever ``src`` is (Darknet's ``partial``)."""
    weights = read_weights(src, trust=trust)
    to_darknet = weights.kind == "torch" or cutoff is not None
    wanted = (DARKNET_SUFFIX,) if to_darknet else (PT_SUFFIX, ".pth")
    suffix = dst.suffix.lower() if dst is not None else wanted[0]
    # Any name given (was: only .weights/.pt/.pth names were checked, so -o my.cfg --exist-ok
    # wrote Darknet weights over a cfg); with --cutoff also Darknet's darknet53.conv.74.
    if suffix not in wanted and not (cutoff is not None and suffix[1:].isdigit()):
        raise ConfigError(
            f"cannot convert '{src.name}' ({weights.kind}) to '{dst.name}': one file must end "
            f"in .weights and the other in .pt or .pth"
        )
    if dst is None and cutoff is not None:
        dst = src.with_name(f"{src.stem}.conv.{cutoff - 1}")
    elif dst is None:
        dst = src.with_suffix(DARKNET_SUFFIX if to_darknet else PT_SUFFIX)
    if dst.exists() and dst.resolve() == src.resolve():
        raise ConfigError(f"the output {dst} is the source itself; choose another name")
    check_new_file(dst, OUTPUT_FLAG, exist_ok, {"the cfg": cfg}, "converted")
    model = model_from_weights(weights, cfg, None, img_size=416)
    make_output_dir(dst.parent, OUTPUT_FLAG)
    if to_darknet:
        # The header of the .weights the checkpoint came from, or its run's images seen: Darknet
        # continues training from them (without -clear).
        if weights.ckpt is not None:
            model.darknet_version, model.seen = darknet_header(weights.ckpt, src)
        if cutoff is not None:
            check_at_least({"--cutoff": cutoff}, 1, len(model.module_list))
            model.seen = 0  # as Darknet's `partial`: a backbone to start training from
        with reported_write(dst, OUTPUT_FLAG):
            save_weights(model, dst, -1 if cutoff is None else cutoff)
    else:
        save_weights_pt(model, dst, OUTPUT_FLAG)
    return dst


def convert_command(args: argparse.Namespace) -> None:
    cfg, src, dst = _paths(args)
    written = convert(
        cfg, src, dst, trust=args.trust_checkpoint, exist_ok=args.exist_ok, cutoff=args.cutoff
    )
    logging.getLogger(__name__).info("wrote %s", written)


def main(argv: list[str] | None = None) -> int:
    return run_script(get_args_parser(), convert_command, argv)


if __name__ == "__main__":
    sys.exit(main())
