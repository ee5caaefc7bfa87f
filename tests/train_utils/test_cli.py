"""train_utils/cli.py: the command-line layer every script shares."""

from __future__ import annotations

import pytest

import predict
import validation
from train_utils import config
from train_utils.cli import parse_args


@pytest.mark.parametrize(
    ("parser_of", "argv", "line"),
    [
        (
            config.get_args_parser,
            ["--recipe", "darknet", "-dont_show", "-map"],
            "-dont_show is Darknet's flag; here: no window is ever shown; drop it",
        ),
        (config.get_args_parser, ["-clear"], "-clear is Darknet's flag; here: --clear"),
        (
            validation.get_parser,
            ["-iou_thresh=0.5"],
            "-iou_thresh is Darknet's flag; here: --iou-thres",
        ),
        (predict.get_parser, ["-thresh", "0.25"], "-thresh is Darknet's flag; here: --conf-thres"),
    ],
)
def test_darknet_flags_name_the_flag_to_type(parser_of, argv, line, capsys):
    """Was: argparse's bare "unrecognized arguments: -dont_show -map" for a command typed the
    Darknet way. Now the line names what this project takes instead; exit status 2 as before."""
    with pytest.raises(SystemExit) as e:
        parse_args(parser_of(), argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {line}")


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--img-szie", "96"], "(did you mean --img-size?)"),
        (["--weigths", "w.pt", "--batchsize", "4"], "--weights for --weigths, --batch-size for"),
        (["--quad"], "(--help lists the flags)"),  # YOLOv5's, not offered: nothing near
    ],
)
def test_a_mistyped_flag_is_one_line_naming_the_flag_meant(argv, hint, capsys):
    """Was: train.py's whole usage (34 lines) and then argparse's bare line."""
    with pytest.raises(SystemExit) as e:
        parse_args(config.get_args_parser(), argv)
    assert e.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("YOLOv3-SPP training: error: unrecognized arguments: ") and hint in line
