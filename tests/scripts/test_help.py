"""Every script's ``--help``: each option has help text, each default is shown once, and no
"(default: None)" stands where a flag's None means "from the checkpoint", "auto" or "none"."""

from __future__ import annotations

import argparse
import contextlib
import io
import re

import pytest

import predict
import train_multi_GPU
import validation
from data import make_shapes
from tools import (
    calculate_dataset,
    coco2yolo,
    convert_weights,
    darknet_check,
    demo,
    export,
    kmeans_anchors,
    make_cfg,
    trans_voc2yolo,
)
from train_utils import config
from train_utils.cli import path_arg

PARSERS = {
    "train.py": config.get_args_parser,
    "train_multi_GPU.py": train_multi_GPU.get_parser,
    "validation.py": validation.get_parser,
    "predict.py": predict.get_parser,
    "tools/calculate_dataset.py": calculate_dataset.get_args_parser,
    "tools/convert_weights.py": convert_weights.get_args_parser,
    "tools/darknet_check.py": darknet_check.get_args_parser,
    "tools/demo.py": demo.get_args_parser,
    "tools/export.py": export.get_args_parser,
    "tools/kmeans_anchors.py": kmeans_anchors.get_args_parser,
    "tools/make_cfg.py": make_cfg.get_args_parser,
    "tools/trans_voc2yolo.py": trans_voc2yolo.get_args_parser,
}
# Inference scripts fill most flags from the checkpoint: each value flag says its default.
EVERY_DEFAULT_STATED = {"validation.py", "predict.py"}


def _help_text(parser: argparse.ArgumentParser) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0
    return out.getvalue()


def _option_blocks(text: str) -> dict[str, str]:
    """Each option line of ``--help`` output with its wrapped help, joined into one line."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-[-\w]+|\w[\w-]*)\b", line)
        if m:
            current = m.group(1)
            blocks[current] = line.strip()
        elif current and line.startswith("    ") and line.strip():
            blocks[current] += " " + line.strip()
        else:
            current = None
    return {k: re.sub(r"\s+", " ", v) for k, v in blocks.items()}


@pytest.mark.parametrize("script", sorted(PARSERS))
def test_help_states_each_default_once(script):
    parser = PARSERS[script]()
    blocks = _option_blocks(_help_text(parser))
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flag = (action.option_strings or [action.dest])[0]
        assert action.help, f"{script} {flag}: no help text"
        if not action.option_strings:
            continue  # positionals have no default to show
        block = blocks[flag]
        assert "(default: None)" not in block, f"{script}: {block}"
        # Was: '--nosave ... (default: True)', which reads as if it were on.
        if isinstance(action, argparse._StoreConstAction):
            assert "(default: True)" not in block, f"{script}: {block}"
        assert block.count("(default") <= 1, f"{script}: default shown twice: {block}"
        takes_value = action.nargs != 0 and not action.required
        real_default = action.default not in (None, False, "", argparse.SUPPRESS)
        if takes_value and (real_default or script in EVERY_DEFAULT_STATED):
            assert "default" in block, f"{script}: {flag} does not say its default: {block}"


@pytest.mark.parametrize(
    "parser_of",
    [*PARSERS.values(), coco2yolo.get_args_parser, make_shapes.get_args_parser],
)
def test_an_empty_path_is_refused_not_read_as_the_current_folder(parser_of, capsys):
    """Was: --out "" (an unset shell variable) was Path("."): coco2yolo and export wrote into
    the current folder, others named "." in a misleading line. Now argparse's line, exit 2."""
    parser = parser_of()
    for action in parser._actions:
        if action.type is not path_arg:
            continue
        flag = action.option_strings[0] if action.option_strings else None
        argv = [flag, ""] if flag else [""]
        with pytest.raises(SystemExit) as e:
            parser.parse_known_args(argv)
        assert e.value.code == 2
        name = "/".join(action.option_strings) or action.metavar or action.dest
        line = capsys.readouterr().err.splitlines()[-1]
        assert line.endswith(f"error: argument {name}: an empty path; give a file or folder")
