"""build_utils/parse_config.py: cfg, .data and .names parsing, validation, rewriting."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from build_utils.errors import ConfigError
from build_utils.parse_config import (
    ACTIVATIONS,
    c_float,
    c_floats,
    load_class_names,
    maxpool_params,
    parse_data_cfg,
    parse_model_cfg,
    rewrite_cfg_classes,
    split_role,
    to_c_float,
    write_model_cfg,
)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
CORPUS = sorted((SHARED / "darknet-cfg").glob("*.cfg")) if SHARED.is_dir() else []
OWN_CFGS = sorted((REPO / "cfg").glob("yolov3*.cfg"))

ANCHORS = "10,13,  16,30,  33,23,  30,61,  62,45,  59,119,  116,90,  156,198,  373,326"

# A small valid cfg; its line numbers are referred to below.
VALID = f"""[net]
width=64
height=64
channels=3

[convolutional]
batch_normalize=1
filters=16
size=3
stride=2
pad=1
activation=leaky

[convolutional]
size=1
stride=1
pad=1
filters=24
activation=linear

[yolo]
mask = 0,1,2
anchors = {ANCHORS}
classes=3
num=9
jitter=.3
"""


def values(blocks):
    """Blocks without bookkeeping keys."""
    return [{k: v for k, v in b.items() if not k.startswith("_")} for b in blocks]


def write(tmp_path: Path, text: str, name: str = "m.cfg", newline: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes(text.replace("\n", newline).encode())
    return path


def require_shared() -> None:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (it only exists beside the development checkout)")


# --------------------------------------------------------------------------------------------
# Reading


def test_values_are_converted(tmp_path):
    blocks = parse_model_cfg(write(tmp_path, VALID))
    net, conv, head, yolo = blocks
    assert net == {**net, "type": "net", "width": 64, "height": 64, "channels": 3}
    assert conv["filters"] == 16 and isinstance(conv["filters"], int)
    assert conv["activation"] == "leaky"
    assert yolo["mask"] == [0, 1, 2]
    assert yolo["anchors"][:4] == [10, 13, 16, 30] and len(yolo["anchors"]) == 18
    assert yolo["jitter"] == pytest.approx(0.3) and isinstance(yolo["jitter"], float)
    assert head["filters"] == 24 and "batch_normalize" not in head


def test_c_float_reads_values_as_darknet_s_c_float(tmp_path):
    """One reader for the Darknet loader, loss and schedule: float32 rounding, the default for
    an absent key, and a value beyond float32 refused at its line, without numpy's warning."""
    text = "[net]\nwidth=32\nheight=32\nmomentum=0.1\nlearning_rate=1e39\nscales=.1,-1e39\n"
    path = tmp_path / "n.cfg"
    path.write_text(text + "[convolutional]\nfilters=8\n")
    net = parse_model_cfg(path)[0]
    assert c_float(net, "momentum", 0.9) == float(np.float32(0.1)) != 0.1
    assert c_float(net, "decay", 0.5) == 0.5
    assert to_c_float(1e39) == math.inf
    assert c_floats(net, "steps") == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match=r"n.cfg:5: .*learning_rate=1e\+39 is beyond float32"):
            c_float(net, "learning_rate", 0.001)
        with pytest.raises(ConfigError, match=r"n.cfg:6: .*scales=\[0.1, -1e\+39\] is beyond"):
            c_floats(net, "scales")


def test_bookkeeping_records_path_and_lines(tmp_path):
    path = write(tmp_path, VALID)
    blocks = parse_model_cfg(path)
    assert all(b["_path"] == str(path) for b in blocks)
    assert [b["_line"] for b in blocks] == [1, 6, 14, 21]
    assert blocks[1]["_lines"]["filters"] == 8
    assert blocks[3]["_lines"]["anchors"] == 23


def test_float_lists_and_net_options(tmp_path):
    text = VALID.replace("channels=3", "channels=3\nsteps=400000,450000\nscales=.1,.1\nhue=.1")
    net = parse_model_cfg(write(tmp_path, text))[0]
    assert net["steps"] == [400000, 450000]
    assert net["scales"] == [0.1, 0.1]
    assert net["hue"] == 0.1


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_tolerates_what_real_files_contain(tmp_path, newline):
    messy = "\n".join(
        [
            "# a comment",
            "; another comment",
            "[net]   ",
            "width = 64  ",
            "height=64 # inline comment",
            "  channels=3",
            "",
            "",
            "[convolutional]",
            "batch_normalize=1",
            "filters  =  16",
            "size=3",
            "stride=2",
            "pad=1",
            "activation=leaky   ",
            "#activation=mish",
            "",
            "[convolutional]",
            "size=1",
            "stride=1",
            "pad=1",
            "filters=24",
            "activation=linear",
            "",
            "[yolo]",
            "mask = 0,1,2",
            f"anchors = {ANCHORS},",  # a trailing comma, as some files have
            "classes=3",
            "num=9",
            "jitter=.3",
            "",
        ]
    )
    clean = parse_model_cfg(write(tmp_path, VALID, "clean.cfg"))
    parsed = parse_model_cfg(write(tmp_path, messy, "messy.cfg", newline))
    assert values(parsed) == values(clean)


def test_section_aliases(tmp_path):
    text = VALID.replace("[net]", "[network]").replace("[convolutional]", "[conv]", 1)
    assert values(parse_model_cfg(write(tmp_path, text))) == values(
        parse_model_cfg(write(tmp_path, VALID, "b.cfg"))
    )


def test_corpus_parses():
    require_shared()
    assert len(CORPUS) >= 12
    for path in CORPUS:
        blocks = parse_model_cfg(path)
        assert blocks[0]["type"] == "net"
        assert any(b["type"] == "yolo" for b in blocks), path


def test_corpus_specific_keys():
    require_shared()
    tiny4 = parse_model_cfg(SHARED / "darknet-cfg" / "yolov4-tiny.cfg")
    grouped = [b for b in tiny4 if b["type"] == "route" and "groups" in b]
    assert grouped and all(b["groups"] == 2 and b["group_id"] == 1 for b in grouped)
    yolo = [b for b in tiny4 if b["type"] == "yolo"]
    assert all(b["resize"] == 1.5 and b["scale_x_y"] == 1.05 for b in yolo)
    acts = {b.get("activation") for b in parse_model_cfg(SHARED / "darknet-cfg" / "yolov4.cfg")}
    assert "mish" in acts


def test_trailing_spaces_copy_equals_original():
    require_shared()
    a = parse_model_cfg(SHARED / "darknet-cfg" / "yolov3-spp.cfg")
    b = parse_model_cfg(SHARED / "darknet-cfg" / "yolov3-spp-trailing-spaces.cfg")
    assert values(a) == values(b)


@pytest.mark.parametrize("name", ["yolov3-spp.cfg", "yolov3.cfg", "yolov3-tiny.cfg"])
def test_own_cfgs_equal_the_reference_layers(name):
    require_shared()
    ours = values(parse_model_cfg(REPO / "cfg" / name))
    ref = values(parse_model_cfg(SHARED / "darknet-cfg" / name))
    assert ours[1:] == ref[1:]  # [net] training options may differ; layers may not
    assert ours[0]["channels"] == 3


def test_own_yolov3_spp_is_608():
    net = parse_model_cfg(REPO / "cfg" / "yolov3-spp.cfg")[0]
    assert (net["width"], net["height"]) == (608, 608)


@pytest.mark.parametrize("path", OWN_CFGS, ids=lambda p: p.name)
def test_own_cfgs_parse(path):
    blocks = parse_model_cfg(path)
    assert all(b["classes"] == 80 for b in blocks if b["type"] == "yolo")


# --------------------------------------------------------------------------------------------
# Malformed files: each gives its own message at the right line.

CONV = "[convolutional]\nbatch_normalize=1\nfilters=16\nsize=3\nstride=1\npad=1\nactivation=leaky\n"
HEAD = (
    "[convolutional]\nsize=1\nstride=1\npad=1\nfilters=24\nactivation=linear\n"
    f"[yolo]\nmask=0,1,2\nanchors={ANCHORS}\nclasses=3\nnum=9\n"
)
NET = "[net]\nwidth=64\nheight=64\n"  # lines 1-3

MALFORMED = {
    # name: (cfg text, regex that must match the message, including the line)
    "empty": ("", r":1: empty model cfg"),
    "only_comments": ("# nothing\n\n; here\n", r":1: empty model cfg"),
    "unknown_section": (
        NET + "[convolutionl]\nfilters=3\n",
        r":4: unknown section \[convolutionl\]",
    ),
    "malformed_header": (NET + "[convolutional\nfilters=3\n", r":4: malformed section header"),
    "unknown_key": (
        NET + CONV.replace("filters=16", "filtrs=16"),
        r":6: unknown key 'filtrs' in \[convolutional\]",
    ),
    "not_an_integer": (
        NET + CONV.replace("filters=16", "filters=sixteen"),
        r":6: value 'sixteen' of key 'filters' in \[convolutional\] must be an integer",
    ),
    "float_for_integer": (
        NET + CONV.replace("size=3", "size=3.5"),
        r":7: value '3.5' of key 'size' in \[convolutional\] must be an integer",
    ),
    "not_a_float": (
        NET + CONV + HEAD + "jitter=lots\n",
        r":22: value 'lots' of key 'jitter' in \[yolo\] must be a finite number",
    ),
    "bad_anchor_list": (
        NET + CONV + HEAD.replace("anchors=10,13,", "anchors=10,x13,"),
        r":19: value '10,x13,.*' of key 'anchors' in \[yolo\] must be a comma-separated list",
    ),
    "no_value": (NET + CONV.replace("filters=16", "filters="), r":6: key 'filters' .* no value"),
    "no_equals": (NET + CONV.replace("pad=1", "pad 1"), r":9: expected 'key=value'"),
    "key_before_section": ("width=64\n" + NET, r":1: 'width=64' appears before the first"),
    "duplicate_key": (
        NET + CONV + "filters=32\n",
        r":11: duplicate key 'filters' in \[convolutional\] \(first set at line 6\)",
    ),
    "net_not_first": (CONV + NET, r":1: the first section must be \[net\]"),
    "second_net": (NET + CONV + NET, r":11: \[net\]: a second \[net\] section"),
    "no_layers": (NET, r":1: \[net\]: the cfg defines no layers"),
    "unknown_activation": (
        NET + CONV.replace("activation=leaky", "activation=leakyy"),
        r":10: \[convolutional\]: unknown activation 'leakyy'",
    ),
    "unsupported_option": (
        NET + CONV + "xnor=1\n",
        r":11: key 'xnor=1' in \[convolutional\] is a Darknet option this implementation does "
        r"not support",
    ),
    "route_outside_network": (
        NET + CONV + CONV + "[route]\nlayers=-3\n",
        r":19: \[route\]: layers=-3 points to layer -1, outside the network",
    ),
    "route_forward_reference": (
        NET + CONV + CONV + "[route]\nlayers=-1, 2\n",
        r":19: \[route\]: layers=2 points to layer 2, outside the network",
    ),
    "route_to_itself": (
        NET + CONV + "[route]\nlayers=1\n",
        r":12: \[route\]: layers=1 points to layer 1, outside the network",
    ),
    "route_without_layers": (
        NET + CONV + "[route]\ngroups=2\n",
        r":11: \[route\]: missing .*'layers'",
    ),
    "route_group_id": (
        NET + CONV + "[route]\nlayers=-1\ngroups=2\ngroup_id=2\n",
        r":14: \[route\]: group_id=2 must be in 0..1",
    ),
    "shortcut_outside_network": (
        NET + CONV + "[shortcut]\nfrom=-3\nactivation=linear\n",
        r":12: \[shortcut\]: from=-3 points to layer -2, outside the network",
    ),
    "shortcut_weights_type": (
        NET + CONV + CONV + "[shortcut]\nfrom=-2\nweights_type=per_channel\n",
        r":20: \[shortcut\]: weights_type=per_channel is not supported",
    ),
    "mask_outside_anchors": (
        NET + CONV + HEAD.replace("mask=0,1,2", "mask=7,8,9"),
        r":18: \[yolo\]: mask index 9 is outside the 9 anchors",
    ),
    "odd_anchor_count": (
        NET + CONV + HEAD.replace("anchors=10,13,", "anchors=10,"),
        r":19: \[yolo\]: anchors has 17 numbers",
    ),
    "num_disagrees_with_anchors": (
        NET + CONV + HEAD.replace("num=9", "num=6"),
        r":21: \[yolo\]: num=6 but anchors lists 9 w,h pairs",
    ),
    "head_filters_mismatch": (
        NET + CONV + HEAD.replace("filters=24", "filters=255"),
        r":15: \[convolutional\]: filters=255 before the \[yolo\] at line 17 must be "
        r"len\(mask\) \* \(classes \+ 5\) = 3 \* \(3 \+ 5\) = 24",
    ),
    "zero_classes": (
        NET + CONV + HEAD.replace("classes=3", "classes=0"),
        r":20: \[yolo\]: classes=0 must be at least 1",
    ),
    "zero_filters": (
        NET + CONV.replace("filters=16", "filters=0"),
        r":6: \[convolutional\]: filters=0 must be at least 1",
    ),
    "new_coords_needs_a_logistic_head_conv": (
        NET + CONV + HEAD + "new_coords=1\n",
        r":16: \[convolutional\]: new_coords=1 needs the \[convolutional\] right before the "
        r"\[yolo\] to have activation=logistic \(it has activation=linear\)",
    ),
    "new_coords_value": (
        NET + CONV + HEAD.replace("linear", "logistic") + "new_coords=2\n",
        r":22: \[yolo\]: new_coords=2 must be 0 or 1",
    ),
    "maxpool_padding_beyond_the_window": (
        NET + CONV + "[maxpool]\nsize=2\nstride=1\npadding=3\n" + HEAD,
        r":14: \[maxpool\]: padding=3 must be in 0..2 for size=2",
    ),
    "bn_eps": (
        NET + "bn_eps=0\n" + CONV + HEAD,
        r":4: \[net\]: bn_eps=0.0 must be positive",
    ),
    "bn_eps_zero_in_float32": (
        NET + "bn_eps=1e-320\n" + CONV + HEAD,
        r":4: \[net\]: bn_eps=1e-320 is below 1.18e-38, the smallest float32 normal number",
    ),
    # Values that pass the type check and would then explode at build or forward time.
    "filters_a_billion": (
        NET + CONV.replace("filters=16", "filters=1000000000") + HEAD,
        r":6: \[convolutional\]: filters=1000000000 is over the limit: allowed 1\.\.65536$",
    ),
    "conv_stride_a_million": (
        NET + CONV.replace("stride=1", "stride=1000000") + HEAD,
        r":8: \[convolutional\]: stride=1000000 is over the limit: allowed 1\.\.32$",
    ),
    "conv_kernel": (
        NET + CONV.replace("size=3", "size=999") + HEAD,
        r":7: \[convolutional\]: size=999 is over the limit: allowed 1\.\.63$",
    ),
    "pad_is_a_flag": (
        NET + CONV.replace("pad=1", "pad=7") + HEAD,
        r":9: \[convolutional\]: pad=7 is over the limit: allowed 0\.\.1$",
    ),
    "maxpool_size_a_million": (
        NET + CONV + "[maxpool]\nsize=1000000\nstride=1\n" + HEAD,
        r":12: \[maxpool\]: size=1000000 is over the limit: allowed 1\.\.63$",
    ),
    "upsample_stride": (
        NET + CONV + "[upsample]\nstride=4096\n" + HEAD,
        r":12: \[upsample\]: stride=4096 is over the limit: allowed 1\.\.32$",
    ),
    "a_400_digit_integer": (
        NET + CONV.replace("filters=16", "filters=" + "9" * 400) + HEAD,
        r":6: \[convolutional\]: filters=999999999999\.\.\. \(400 digits\) is over the "
        r"limit: allowed 1\.\.65536$",
    ),
    "stopbackward_beyond_a_c_int": (
        NET + CONV + "stopbackward=" + "1" * 30 + "\n" + HEAD,
        r":11: \[convolutional\]: stopbackward=111111111111\.\.\. \(30 digits\) is over "
        r"the limit: allowed 0\.\.2147483647$",
    ),
    "net_channels_1": (
        NET + "channels=1\n" + CONV + HEAD,
        r":4: \[net\]: channels=1: only channels=3 is supported \(the data loader feeds RGB "
        r"images; grayscale images are read as 3 channels\)$",
    ),
    "net_channels_1000": (
        NET + "channels=1000\n" + CONV + HEAD,
        r":4: \[net\]: channels=1000: only channels=3 is supported",
    ),
    "net_width": (
        NET.replace("width=64", "width=10000000") + CONV + HEAD,
        r":2: \[net\]: width=10000000 is over the limit: allowed 1\.\.65536$",
    ),
    "too_many_classes": (
        NET + CONV + HEAD.replace("classes=3", "classes=5000000"),
        r":20: \[yolo\]: classes=5000000 is over the limit: allowed 1\.\.20000$",
    ),
    "too_many_anchors": (
        NET + CONV + HEAD.replace("num=9", "num=100"),
        r":21: \[yolo\]: num=100 is over the limit: allowed 1\.\.64$",
    ),
    "anchor_list_too_long": (
        NET
        + CONV
        + HEAD.replace("num=9\n", "").replace(
            f"anchors={ANCHORS}", "anchors=" + ",".join(["10"] * 300)
        ),
        r":19: \[yolo\]: anchors lists 150 w,h pairs, over the limit: allowed 1\.\.64$",
    ),
    "huge_anchor": (
        NET + CONV + HEAD.replace("anchors=10,13,", "anchors=10000000,13,"),
        r":19: \[yolo\]: anchor size 10000000 is over the limit: allowed up to 65536 pixels$",
    ),
    "route_with_too_many_inputs": (
        NET + CONV + "[route]\nlayers=" + ",".join(["-1"] * 100) + "\n" + HEAD,
        r":12: \[route\]: layers lists 100 layers, over the limit: allowed 1\.\.64$",
    ),
    "scale_x_y": (
        NET + CONV + HEAD + "scale_x_y=1e9\n",
        r":22: \[yolo\]: scale_x_y=1000000000\.0 is over the limit: allowed \(0, 16\]$",
    ),
    "unsupported_maxpool_depth": (
        NET + CONV + "[maxpool]\nmaxpool_depth=1\n" + HEAD,
        r":12: key 'maxpool_depth=1' in \[maxpool\] is a Darknet option",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_cfg(tmp_path, case):
    text, pattern = MALFORMED[case]
    path = write(tmp_path, text, f"{case}.cfg")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + pattern) as info:
        parse_model_cfg(path)
    assert "\n" not in str(info.value)  # one line for the CLI


def test_malformed_corpus_is_valid_once_fixed(tmp_path):
    # The fragments above are only wrong where each case says: the base cfg is valid.
    blocks = parse_model_cfg(write(tmp_path, NET + CONV + CONV + "[shortcut]\nfrom=-2\n" + HEAD))
    assert [b["type"] for b in blocks][-2:] == ["convolutional", "yolo"]


def test_repeated_net_key_first_wins_with_a_warning(tmp_path, caplog):
    # Darknet's option lists return the first occurrence (yolov3-openimages.cfg sets batch=1,
    # then batch=64 under a "# Training" comment) and report the second as unused.
    text = NET + "batch=1\nsubdivisions=1\nbatch=64\n" + CONV + HEAD
    path = write(tmp_path, text)
    with caplog.at_level("WARNING", logger="build_utils.parse_config"):
        net = parse_model_cfg(path)[0]
        # Was: said again each time the same cfg was read (twice in one train.py run).
        assert parse_model_cfg(path)[0] == net
    assert net["batch"] == 1 and net["subdivisions"] == 1
    assert net["_lines"]["batch"] == 4
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:6: key 'batch' in [net] repeats line 4; the first value is used, as in Darknet"
    ]


def test_darknet_layer_options_are_read(tmp_path):
    text = NET + CONV + "stopbackward=800\n" + "[maxpool]\nsize=3\nstride=2\npadding=1\n"
    text += HEAD.replace("linear", "logistic") + "new_coords=1\nscale_x_y=2.0\n"
    blocks = parse_model_cfg(write(tmp_path, text))
    assert blocks[1]["stopbackward"] == 800
    assert blocks[2] == {**blocks[2], "size": 3, "stride": 2, "padding": 1}
    assert blocks[-1]["new_coords"] == 1 and blocks[-1]["scale_x_y"] == 2.0


@pytest.mark.parametrize(
    "block, expected",
    [
        ({"stride": 2}, (2, 2, 2, 1)),  # size defaults to the stride, padding to size - 1
        ({"size": 2, "stride": 1}, (2, 1, 1, 1)),
        ({"size": 5, "stride": 1}, (5, 1, 1, 4)),
        ({}, (1, 1, 1, 0)),
        ({"size": 3, "stride": 2, "stride_x": 1, "padding": 0}, (3, 2, 1, 0)),
    ],
)
def test_maxpool_defaults_are_darknets(block, expected):
    assert maxpool_params(block) == expected


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.cfg: model cfg not found"):
        parse_model_cfg(tmp_path / "nope.cfg")


def test_binary_file(tmp_path):
    path = tmp_path / "bin.cfg"
    path.write_bytes(b"\x80\x81\xfe\xff" * 10)
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        parse_model_cfg(path)


def test_cfg_data_and_names_text_is_checked_before_reading(tmp_path, monkeypatch):
    """A FIFO cfg (opening it would block forever), a UTF-16 cfg, an oversized one: one line.
    A .data file's hostile values are quoted short (a 1 MB line, a 400-digit class count, a
    5000-character path that no system accepts)."""
    import os

    fifo = tmp_path / "fifo.cfg"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"fifo\.cfg: model cfg: a FIFO \(named pipe\)"):
        parse_model_cfg(fifo)
    nano = Path(__file__).resolve().parents[2] / "cfg" / "yolov3-spp-nano.cfg"
    utf16 = tmp_path / "utf16.cfg"
    utf16.write_bytes(nano.read_text().encode("utf-16-le"))
    with pytest.raises(ConfigError, match=r"utf16\.cfg: model cfg holds NUL bytes .* as UTF-8$"):
        parse_model_cfg(utf16)
    monkeypatch.setenv("YOLO_MAX_TEXT_BYTES", "1000")
    with pytest.raises(ConfigError, match=r"over the limit of 1000 B .* YOLO_MAX_TEXT_BYTES"):
        parse_model_cfg(nano)
    monkeypatch.delenv("YOLO_MAX_TEXT_BYTES")

    (tmp_path / "n.names").write_text("a\nb\n")
    (tmp_path / "t.txt").write_text("x.jpg\n")
    rest = "train=t.txt\nvalid=t.txt\nnames=n.names\n"
    data = tmp_path / "x.data"
    for text, match in (
        ("x" * 1_000_000 + "\n", r":1: expected 'key=value', got 'xxx+\.\.\.x+'$"),
        (f"classes={'9' * 400}\n{rest}", r":1: classes=9{12}\.\.\.\(400 digits\) but "),
        (f"classes={'9' * 5000}\n{rest}", r":1: classes='9+\.\.\.9+' must be an integer"),
        (f"classes=2\ntrain={'a' * 5000}\nvalid=t.txt\nnames=n.names\n", r":2: train='a+\.\.\."),
    ):
        data.write_text(text)
        with pytest.raises(ConfigError, match=match) as info:
            parse_data_cfg(data)
        assert len(str(info.value)) < len(str(data)) + 200


# --------------------------------------------------------------------------------------------
# Rewriting and writing


def test_rewrite_cfg_classes(tmp_path):
    blocks = parse_model_cfg(REPO / "cfg" / "yolov3-spp-nano.cfg")
    out = rewrite_cfg_classes(blocks, 3)
    heads = [i for i, b in enumerate(out) if b["type"] == "yolo"]
    assert len(heads) == 3
    for i in heads:
        assert out[i]["classes"] == 3
        assert out[i - 1]["filters"] == 3 * (3 + 5)
        assert blocks[i]["classes"] == 80 and blocks[i - 1]["filters"] == 255  # input untouched
    changed = [i for i, (a, b) in enumerate(zip(values(blocks), values(out))) if a != b]
    assert changed == sorted([*heads, *(i - 1 for i in heads)])


def test_rewrite_uses_each_heads_mask_length(tmp_path):
    text = (
        NET + CONV + HEAD.replace("mask=0,1,2", "mask=0,1,2,3").replace("filters=24", "filters=32")
    )
    out = rewrite_cfg_classes(parse_model_cfg(write(tmp_path, text)), 1)
    assert out[-2]["filters"] == 4 * 6


@pytest.mark.parametrize("nc", [0, -1, 2.5, True])
def test_rewrite_rejects_bad_class_counts(nc):
    blocks = parse_model_cfg(REPO / "cfg" / "yolov3-tiny.cfg")
    with pytest.raises(ConfigError, match="positive integer"):
        rewrite_cfg_classes(blocks, nc)


@pytest.mark.parametrize("path", OWN_CFGS, ids=lambda p: p.name)
def test_write_then_parse_round_trip(tmp_path, path):
    blocks = parse_model_cfg(path)
    out = tmp_path / "out.cfg"
    write_model_cfg(blocks, out, header="generated\nby a test")
    assert out.read_text().startswith("# generated\n# by a test\n")
    assert values(parse_model_cfg(out)) == values(blocks)


def test_write_round_trip_corpus(tmp_path):
    require_shared()
    for path in CORPUS:
        blocks = parse_model_cfg(path)
        write_model_cfg(blocks, tmp_path / path.name)
        assert values(parse_model_cfg(tmp_path / path.name)) == values(blocks), path.name


# --------------------------------------------------------------------------------------------
# .data and .names


def make_data(root: Path, body: str, names: str = "a\nb\n", name: str = "my.data") -> Path:
    (root / "my.names").write_text(names)
    path = root / name
    path.write_text(body)
    return path


def test_parse_data_cfg_relative_to_data_folder(tmp_path, monkeypatch):
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "train.txt").write_text("")
    path = make_data(
        ds, "# my data\nclasses = 2\ntrain=train.txt\nvalid=val.txt\nnames=my.names\neval=coco\n"
    )
    monkeypatch.chdir(tmp_path)
    data = parse_data_cfg(path)
    assert data["classes"] == 2
    assert Path(data["train"]) == ds / "train.txt"  # exists beside the .data file
    assert data["valid"] == "val.txt"  # does not: taken relative to the current folder
    assert Path(data["names"]) == ds / "my.names"
    assert data["eval"] == "coco"


def test_a_path_found_both_beside_the_data_and_in_the_current_folder_is_warned_of(
    tmp_path, monkeypatch, caplog
):
    """Darknet reads `train=dk/train.txt` from the current folder; here the one beside the .data
    file wins, and when both exist (and differ) the log says which was read."""
    (tmp_path / "dk" / "dk").mkdir(parents=True)
    (tmp_path / "dk" / "train.txt").write_text("24 images\n")
    (tmp_path / "dk" / "dk" / "train.txt").write_text("4 images\n")
    path = make_data(
        tmp_path / "dk", "classes=2\ntrain=dk/train.txt\nvalid=dk/train.txt\nnames=my.names\n"
    )
    monkeypatch.chdir(tmp_path)
    assert Path(parse_data_cfg(path)["train"]) == tmp_path / "dk" / "dk" / "train.txt"
    beside = tmp_path / "dk" / "dk" / "train.txt"
    assert caplog.messages == [
        f"{path}:{n}: {key}=dk/train.txt is read beside the .data file ({beside}), not from the "
        "current folder, which has another dk/train.txt"
        for n, key in ((2, "train"), (3, "valid"))
    ]
    caplog.clear()
    monkeypatch.chdir(tmp_path / "dk")  # the same file either way: nothing to say
    parse_data_cfg(path)
    assert caplog.messages == []


def test_parse_data_cfg_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "my.names").write_text("a\nb\n")
    path = tmp_path / "data" / "my.data"
    path.write_text("classes=2\ntrain=data/t.txt\nvalid=data/v.txt\nnames=data/my.names\r\n")
    monkeypatch.chdir(tmp_path)
    data = parse_data_cfg(Path("data/my.data"))
    assert data["names"] == "data/my.names"  # data/data/my.names does not exist
    assert load_class_names(data["names"]) == ["a", "b"]


def test_parse_data_cfg_absolute_paths(tmp_path):
    names = tmp_path / "x.names"
    names.write_text("a\n")
    path = tmp_path / "x.data"
    path.write_text(f"classes=1\ntrain={tmp_path}/t\nvalid={tmp_path}/v\nnames={names}\n")
    assert parse_data_cfg(path)["names"] == str(names)


def test_windows_separators_in_a_data_file_are_named(tmp_path, monkeypatch):
    """Was: a Darknet obj.data from Windows (`names = data\\obj.names`) gave "names file
    'data\\\\obj.names' not found", the backslashes doubled and no word of the cause. Now the line
    says what to write; an unused backup folder so written is no error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "obj.names").write_text("a\nb\n")
    path = tmp_path / "obj.data"
    body = "classes=2\r\ntrain=data/t.txt\r\nvalid=data/v.txt\r\nbackup=backup\\\r\n"
    path.write_text(body + "names = data\\obj.names\r\n")
    with pytest.raises(ConfigError) as e:
        parse_data_cfg(path)
    assert str(e.value) == (
        f"{path}:5: names=data\\obj.names is not found: it is written with Windows separators "
        "(backslashes); write names=data/obj.names"
    )
    path.write_text(body + "names = data/obj.names\r\n")
    assert parse_data_cfg(path)["class_names"] == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ("train=t\nvalid=v\nnames=my.names\n", r"my\.data: missing required key 'classes'"),
        ("classes=2\ntrain=t\nnames=my.names\n", r"missing required key 'valid'"),
        ("classes=2\ntrain=t\nvalid=v\n", r"missing required key 'names'"),
        ("classes=two\ntrain=t\nvalid=v\nnames=my.names\n", r"my\.data:1: classes='two' must be"),
        ("classes=2.0\ntrain=t\nvalid=v\nnames=my.names\n", r"my\.data:1: classes='2.0' must be"),
        ("classes=0\ntrain=t\nvalid=v\nnames=my.names\n", r"my\.data:1: classes=0 must be"),
        ("classes=3\ntrain=t\nvalid=v\nnames=my.names\n", r":1: classes=3 but .* lists 2 names"),
        ("classes=2\ntrain=t\nvalid=v\nnames=other.names\n", r":4: names file 'other.names'"),
        ("classes=2\ntrain t\n", r"my\.data:2: expected 'key=value'"),
        ("classes=2\nclasses=2\n", r"my\.data:2: duplicate key 'classes'"),
        # Was "expected 'key=value', got '[net]'": a model cfg given as --data.
        (
            "# a cfg\n[net]\nbatch=64\n",
            r"my\.data:2: a model cfg \(section '\[net\]'\), not a dataset file: it goes to "
            r"--cfg; --data takes a .data or data.yaml file$",
        ),
    ],
)
def test_parse_data_cfg_errors(tmp_path, monkeypatch, body, pattern):
    monkeypatch.chdir(tmp_path)
    path = make_data(tmp_path, body)
    with pytest.raises(ConfigError, match=pattern):
        parse_data_cfg(path)


def test_a_file_without_train_is_read_and_only_training_refuses_it(tmp_path):
    """coco2yolo's conversion of val2017 alone, and any val-only file, is what validation.py
    scores (was: refused by the parser, "missing required key 'train'", for every script)."""
    from train_utils.config import load_data_config

    (tmp_path / "v").mkdir()
    path = make_data(tmp_path, f"classes=2\nvalid={tmp_path / 'v'}\nnames=my.names\n")
    assert "train" not in parse_data_cfg(path)
    assert load_data_config(path, splits=["valid"]).train is None  # as validation.py reads it
    with pytest.raises(ConfigError, match="missing required key 'train': training needs train"):
        load_data_config(path)


def test_weights_given_as_data_are_named(tmp_path):
    """Was: a 17 MB best.pt as --data '.data file: 16.6 MiB, over the limit of 4 MiB ... set
    YOLO_MAX_TEXT_BYTES', advice that cannot help."""
    for name in ("best.pt", "yolov3.weights", "model.onnx"):
        (tmp_path / name).write_bytes(b"PK\x03\x04" + bytes(64))
        with pytest.raises(ConfigError) as e:
            parse_data_cfg(tmp_path / name)
        assert str(e.value) == (
            f"{tmp_path / name}: a weights file, not a dataset file: it goes to --weights; "
            "--data takes a .data or data.yaml file"
        )


def test_load_class_names(tmp_path, caplog):
    path = tmp_path / "c.names"
    path.write_bytes(b"person \r\n\r\ntraffic light\r\n  dog\r\n\r\n")
    assert load_class_names(path) == ["person", "traffic light", "dog"]
    # The blank line 2 between names: Darknet would number traffic light 2, not 1.
    assert caplog.messages == [
        f"{path}: blank line(s) 2 between names skipped: class ids follow the names (Darknet "
        'would read each as a class named "")'
    ]
    caplog.clear()
    path.write_text("cat\ndog\ncat\n\n\n")  # blank lines at the end: nothing to say of them
    assert load_class_names(path) == ["cat", "dog", "cat"]
    assert caplog.messages == [f"{path}: names given more than once: cat"]


def test_load_class_names_of_a_data_yaml_are_its_names(tmp_path):
    """YOLOv5 users keep the names in data.yaml; --names data.yaml gave every line of it as a
    name (calculate_dataset then wrote classes=10 for 5 classes)."""
    as_dict = tmp_path / "d.yaml"
    as_dict.write_text(
        "path: ../set\ntrain: images/train\nval: images/val\n"
        "names:\n  0: circle\n  1: square\n  2: star\n"
    )
    assert load_class_names(as_dict) == ["circle", "square", "star"]
    as_list = tmp_path / "l.yml"
    as_list.write_text("names: [circle, square]\nnc: 2\n")
    assert load_class_names(as_list) == ["circle", "square"]
    as_list.write_text("names: [circle, square]\nnc: 3\n")
    with pytest.raises(ConfigError, match="nc"):
        load_class_names(as_list)


def test_load_class_names_errors(tmp_path):
    (tmp_path / "empty.names").write_text("\n \n")
    with pytest.raises(ConfigError, match="lists no names"):
        load_class_names(tmp_path / "empty.names")
    with pytest.raises(ConfigError, match="not found"):
        load_class_names(tmp_path / "missing.names")


def test_coco_names():
    require_shared()
    names = load_class_names(SHARED / "darknet-cfg" / "coco.names")
    assert len(names) == 80 and names[0] == "person"


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=30, deadline=None)
@given(
    filters=st.lists(st.integers(1, 1024), min_size=1, max_size=4),
    size=st.sampled_from([1, 3, 5]),
    activation=st.sampled_from(ACTIVATIONS),
    jitter=finite,
    steps=st.lists(st.one_of(st.integers(-(10**9), 10**9), finite), min_size=1, max_size=5),
)
def test_write_parse_round_trip_property(
    tmp_path_factory, filters, size, activation, jitter, steps
):
    convs = [
        {"type": "convolutional", "filters": f, "size": size, "activation": activation}
        for f in filters
    ]
    head = {"type": "convolutional", "filters": 24, "size": 1, "activation": "linear"}
    yolo = {"type": "yolo", "mask": [0, 1, 2], "anchors": [10, 13.5] * 3, "classes": 3}
    yolo["jitter"] = jitter
    blocks = [{"type": "net", "steps": steps}, *convs, head, yolo]
    path = tmp_path_factory.mktemp("prop") / "p.cfg"
    write_model_cfg(blocks, path)
    assert values(parse_model_cfg(path)) == blocks


def test_make_cfg_runs_as_a_script(tmp_path):
    out = tmp_path / "t.cfg"
    cmd = [sys.executable, "tools/make_cfg.py", "cfg/yolov3-tiny.cfg", "--classes", "2"]
    done = subprocess.run([*cmd, "-o", str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [b["classes"] for b in parse_model_cfg(out) if b["type"] == "yolo"] == [2, 2]
    bad = subprocess.run(
        [*cmd[:2], "missing.cfg", "--classes", "2"], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert bad.stderr == "error: missing.cfg: model cfg not found\n"


def test_a_class_count_from_the_data_is_bounded_too(tmp_path):
    # 5,000,000 classes from a .data file would make heads of 15 million filters.
    blocks = parse_model_cfg(write(tmp_path, NET + CONV + HEAD))
    with pytest.raises(
        ConfigError, match=r"^5000000 classes is over the limit: allowed 1\.\.20000"
    ):
        rewrite_cfg_classes(blocks, 5_000_000)


def test_a_names_file_that_is_a_device_is_named_as_such(tmp_path):
    """``names=/dev/zero`` exists but is not a file: the line says so (not "not found")."""
    (tmp_path / "t.txt").write_text("x.jpg\n")
    data = tmp_path / "x.data"
    data.write_text("classes=1\ntrain=t.txt\nvalid=t.txt\nnames=/dev/zero\n")
    with pytest.raises(ConfigError) as info:
        parse_data_cfg(data)
    assert str(info.value) == "/dev/zero: class names file: a character device, not a regular file"


def test_a_split_name_gives_its_data_yaml_key_or_one_quoted_line():
    """Was: an empty --splits value read '--splits : name it ...'."""
    assert [split_role(s) for s in ("train2017", "VAL", "test-dev")] == ["train", "val", "test"]
    for name in ("", "images"):
        with pytest.raises(ConfigError) as e:
            split_role(name, "--splits")
        assert str(e.value) == (
            f"--splits {name!r}: name it train..., val... or test... (it becomes that key of "
            "data.yaml)"
        )
