"""Darknet model cfg, ``.data``, ultralytics ``data.yaml`` and ``.names`` parsing.

A model cfg is a list of ``[section]`` blocks of ``key=value`` lines. :func:`parse_model_cfg`
returns one dict per block, ``[net]`` first::

    {"type": "convolutional", "filters": 255, "size": 1, ..., "_path": "cfg/x.cfg",
     "_line": 812, "_lines": {"filters": 815, "size": 816, ...}}

Values are converted by key: integers, floats, lists of integers (``mask``, ``layers``,
``from``) or of numbers (``anchors``, ``steps``, ``scales``), strings (``activation``).
Keys starting with ``_`` are bookkeeping: the file, the line of the section header and the line
of each key, so that every later check (here or while building the model) can name
``path:line``. Missing keys take Darknet's defaults when the model is built; nothing is filled in
here, so that :func:`write_model_cfg` writes back what was read.

Every problem is a :class:`~build_utils.errors.ConfigError` naming the file and line.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from build_utils.atomic import write_text
from build_utils.checks import is_int, shown
from build_utils.errors import ConfigError
from build_utils.limits import MAX_TEXT_BYTES, read_config_text
from build_utils.safe_yaml import dump_yaml, parse_yaml, short_repr, short_text

LOGGER = logging.getLogger(__name__)
# The repeated [net] keys already reported by this process, as (cfg, line, key): one run reads
# its cfg more than once (train.py checks it before claiming a run folder and builds the model
# from it later, --evolve once per candidate), and the user needs to hear it once.
_REPORTED_REPEATS: set[tuple[str, int, str]] = set()

Block = dict[str, Any]

# Value kinds of the cfg keys.
INT, FLOAT, INTS, NUMS, STR = "int", "float", "ints", "nums", "str"

# Activation names accepted in [convolutional] and [shortcut]. models/layers.py maps each one to a
# module (a test checks both lists agree); the names are Darknet's plus `silu`, PyTorch's name
# for swish.
ACTIVATIONS: tuple[str, ...] = (
    "leaky",
    "mish",
    "swish",
    "silu",
    "logistic",
    "relu",
    "relu6",
    "elu",
    "selu",
    "gelu",
    "tanh",
    "linear",
)

# [net] options of Darknet: the training loop takes its settings from the hyp file and the CLI,
# so apart from the input size and channels these are only read and kept. A key in no list is
# an error, to catch typos.
_NET_KEYS: dict[str, str] = {
    "batch": INT,
    "subdivisions": INT,
    "width": INT,
    "height": INT,
    "channels": INT,
    "inputs": INT,
    "momentum": FLOAT,
    "decay": FLOAT,
    "angle": FLOAT,
    "aspect": FLOAT,
    "saturation": FLOAT,
    "exposure": FLOAT,
    "hue": FLOAT,
    "learning_rate": FLOAT,
    "learning_rate_min": FLOAT,
    "burn_in": INT,
    "max_batches": INT,
    "policy": STR,
    "steps": NUMS,
    "scales": NUMS,
    "step": INT,
    "scale": FLOAT,
    "gamma": FLOAT,
    "power": FLOAT,
    "seq_scales": NUMS,
    "mosaic": INT,
    "mosaic_bound": INT,
    "mixup": INT,
    "cutmix": INT,
    "blur": INT,
    "gaussian_noise": INT,
    "flip": INT,
    "letter_box": INT,
    "max_crop": INT,
    "min_crop": INT,
    "adam": INT,
    "B1": FLOAT,
    "B2": FLOAT,
    "eps": FLOAT,
    "time_steps": INT,
    "track": INT,
    "augment_speed": INT,
    "sequential_subdivisions": INT,
    "init_sequential_subdivisions": INT,
    "try_fix_nan": INT,
    "loss_scale": FLOAT,
    "dynamic_minibatch": INT,
    "optimized_memory": INT,
    "workspace_size_limit_MB": INT,
    # policy=sgdr: the first cycle's length in iterations (default max_batches) and the factor
    # each next cycle is longer by (default 2).
    "sgdr_cycle": INT,
    "sgdr_mult": INT,
    "use_cuda_graph": INT,
    "max_chart_loss": FLOAT,
    "label_smooth_eps": FLOAT,
    "resize_step": INT,
    "ema_alpha": FLOAT,
    "weights_reject_freq": INT,
    "equidistant_point": INT,
    "badlabels_rejection_percentage": FLOAT,
    "num_sigmas_reject_badlabels": FLOAT,
    "contrastive": INT,
    "contrastive_jit_flip": INT,
    "contrastive_color": INT,
    "unsupervised": INT,
    "attention": INT,
    "adversarial_lr": FLOAT,
    "show_receptive_field": INT,
    # Not Darknet's: the BatchNorm epsilon of the model built from this cfg (models/darknet.py).
    # Darknet normalises with 1e-5; ultralytics/yolov3 trained its .pt checkpoints with 1e-4
    # (bn_eps=0.0001 reproduces them exactly). Darknet itself ignores the key with a warning.
    "bn_eps": FLOAT,
}

# Keys Darknet reads in every layer section. stopbackward=1 freezes this layer and every
# layer before it; stopbackward=N > 1 does so for the first N iterations (models/darknet.py).
_LAYER_KEYS: dict[str, str] = {"stopbackward": INT}

# The window of [convolutional] and [maxpool].
_WINDOW_KEYS: dict[str, str] = {"size": INT, "stride": INT, "stride_x": INT, "stride_y": INT}
_CONV_KEYS: dict[str, str] = {
    "batch_normalize": INT,
    "filters": INT,
    **_WINDOW_KEYS,
    "pad": INT,
    "padding": INT,
    "groups": INT,
    "activation": STR,
    **_LAYER_KEYS,
}
_MAXPOOL_KEYS: dict[str, str] = {**_WINDOW_KEYS, "padding": INT, **_LAYER_KEYS}
_UPSAMPLE_KEYS: dict[str, str] = {"stride": INT, **_LAYER_KEYS}
_ROUTE_KEYS: dict[str, str] = {"layers": INTS, "groups": INT, "group_id": INT, **_LAYER_KEYS}
_SHORTCUT_KEYS: dict[str, str] = {
    "from": INTS,
    "activation": STR,
    "weights_type": STR,
    **_LAYER_KEYS,
}
_YOLO_KEYS: dict[str, str] = {
    "mask": INTS,
    "anchors": NUMS,
    "classes": INT,
    "num": INT,
    "scale_x_y": FLOAT,
    # 1: Scaled-YOLOv4/YOLOv7 box coordinates (models/layers.py YOLOLayer); the conv before the
    # head must then have activation=logistic.
    "new_coords": INT,
    # Training-time options of Darknet's loss and NMS: read and kept, the model ignores them.
    "jitter": FLOAT,
    "ignore_thresh": FLOAT,
    "truth_thresh": FLOAT,
    "iou_thresh": FLOAT,
    "random": FLOAT,
    "resize": FLOAT,
    "iou_normalizer": FLOAT,
    "cls_normalizer": FLOAT,
    "obj_normalizer": FLOAT,
    "delta_normalizer": FLOAT,
    "iou_loss": STR,
    "iou_thresh_kind": STR,
    "nms_kind": STR,
    "beta_nms": FLOAT,
    "max_delta": FLOAT,
    "label_smooth_eps": FLOAT,
    "focal_loss": INT,
    "objectness_smooth": INT,
    "counters_per_class": INTS,
    "max": INT,
    "map": STR,
    "show_details": INT,
    "track_history_size": INT,
    "sim_thresh": FLOAT,
    "dets_for_track": INT,
    "dets_for_show": INT,
    "track_ciou_norm": FLOAT,
    "embedding_layer": INT,
    **_LAYER_KEYS,
}
_DROPOUT_KEYS: dict[str, str] = {"probability": FLOAT, **_LAYER_KEYS}

# Keys this parser once accepted under names Darknet does not read: refused with Darknet's name.
RENAMED: dict[str, dict[str, str]] = {
    "net": {"batches_per_cycle": "sgdr_cycle", "batches_cycle_mult": "sgdr_mult"},
}

KEYS: dict[str, dict[str, str]] = {
    "net": _NET_KEYS,
    "convolutional": _CONV_KEYS,
    "maxpool": _MAXPOOL_KEYS,
    "upsample": _UPSAMPLE_KEYS,
    "route": _ROUTE_KEYS,
    "shortcut": _SHORTCUT_KEYS,
    "yolo": _YOLO_KEYS,
    "dropout": _DROPOUT_KEYS,
}
# Section names: the canonical ones (KEYS) and the aliases Darknet's own parser accepts.
SECTION_ALIASES: dict[str, str] = {
    **{name: name for name in KEYS},
    "network": "net",
    "conv": "convolutional",
    "max": "maxpool",
}

# Darknet options that change what a layer computes but that this implementation does not
# implement. They are accepted only with their neutral value (shown), so that a file using them
# fails with a clear message instead of silently building a different network.
UNSUPPORTED: dict[str, dict[str, Any]] = {
    "convolutional": {
        "dilation": 1,
        "binary": 0,
        "xnor": 0,
        "bin_output": 0,
        "sway": 0,
        "rotate": 0,
        "stretch": 0,
        "stretch_sway": 0,
        "deform": 0,
        "flipped": 0,
        "dot": 0,
        "antialiasing": 0,
        "assisted_excitation": 0,
        "cbn": 0,
        "coordconv": 0,
        "reverse": 0,
        "grad_centr": 0,
    },
    "maxpool": {"antialiasing": 0, "maxpool_depth": 0},
    "upsample": {"scale": 1},
    "shortcut": {"weights_normalization": "none"},
    "dropout": {"dropblock": 0},
}

# Keys without which a layer means nothing (Darknet's defaults for them are not useful).
REQUIRED: dict[str, tuple[str, ...]] = {
    "route": ("layers",),
    "shortcut": ("from",),
    "yolo": ("anchors",),
}

# Bounds of the numeric cfg values, by section and key: (lowest, highest) allowed, inclusive.
# A value passes the type check and may still build a network no machine holds (filters=1e9:
# a 108 GB weight tensor) or a window that pads the input a million-fold; the highest values are
# far above what Darknet's own cfgs use (in brackets) and what sane models need, and the model's
# memory is checked separately (models/budget.py). Every other integer key is bounded to a C
# ``int``, as Darknet reads it (a 400-digit integer is an error, not a bignum).
MAX_FILTERS = 65_536  # [2048]; YOLO9000's 9418 classes need 3 * 9423 = 28269 at a head
MAX_KERNEL = 63  # conv and maxpool window side [13, the SPP max-pool]
MAX_LAYER_STRIDE = 32  # one layer's stride (conv, maxpool, upsample) [2; upsample 4]
MAX_CLASSES = 20_000  # [601, OpenImages]; ImageNet-21k-scale label sets stay below it
MAX_ANCHORS = 64  # w,h pairs per [yolo] [16]
MAX_NET_SIDE = 65_536  # [net] width/height [1280]; only read and kept (--img-size rules)
MIN_BN_EPS = 1.1754943508222875e-38  # float32's smallest normal number (numpy finfo tiny)
INPUT_CHANNELS = 3  # the data loader feeds RGB images (build_utils/datasets.py)
C_INT = (-(2**31), 2**31 - 1)

_POSITIVE_SIDE = (1, MAX_LAYER_STRIDE)
_WINDOW_BOUNDS = {
    "size": (1, MAX_KERNEL),
    "stride": _POSITIVE_SIDE,
    "stride_x": _POSITIVE_SIDE,
    "stride_y": _POSITIVE_SIDE,
}
BOUNDS: dict[str, dict[str, tuple[int, int]]] = {
    "net": {
        "width": (1, MAX_NET_SIDE),
        "height": (1, MAX_NET_SIDE),
    },
    "convolutional": {
        "batch_normalize": (0, 1),
        "filters": (1, MAX_FILTERS),
        **_WINDOW_BOUNDS,
        "pad": (0, 1),  # a flag in Darknet: 1 = "same" padding (size // 2)
        "padding": (0, MAX_KERNEL),
        "groups": (1, MAX_FILTERS),
        "stopbackward": (0, C_INT[1]),
    },
    "maxpool": {**_WINDOW_BOUNDS, "padding": (0, 2 * MAX_KERNEL - 2)},
    "upsample": {"stride": _POSITIVE_SIDE},
    "route": {"groups": (1, MAX_FILTERS), "group_id": (0, MAX_FILTERS - 1)},
    "yolo": {
        "classes": (1, MAX_CLASSES),
        "num": (1, MAX_ANCHORS),
        "mask": (0, MAX_ANCHORS - 1),
    },
}
# Entries of a [route] layers= / [shortcut] from= list [4, SPP and CSP routes].
MAX_ROUTE_INPUTS = 64
# Float keys the model computes with: each must be positive, and at most this.
POSITIVE_FLOAT_MAX: dict[str, dict[str, float]] = {
    "net": {"bn_eps": 1.0},
    "yolo": {"scale_x_y": 16.0},  # [2.0, Scaled-YOLOv4's heads]
}

# Keys holding file paths in a .data file, resolved by parse_data_cfg.
DATA_PATH_KEYS: tuple[str, ...] = ("train", "valid", "test", "names", "backup")
# train is optional here: validation.py scores a file of val only (coco2yolo's of val2017);
# training asks for it (train_utils.config.load_data_config).
DATA_REQUIRED_KEYS: tuple[str, ...] = ("classes", "valid", "names")

# The ultralytics (YOLOv5/YOLOv8) dataset file: a YAML mapping, told apart by its extension.
DATA_YAML_SUFFIXES: tuple[str, ...] = (".yaml", ".yml")
# Its splits, each a folder of images, a .txt list or a list of those; train and val required.
DATA_YAML_SPLITS: tuple[str, ...] = ("train", "val", "test")
# Every key read; others (Roboflow's `roboflow:`, pose keys) are ignored with one warning.
# `coco_ids` is ours: the file tools/coco2yolo.py writes to map classes and images back to the
# ids of the COCO JSON they came from (validation.py --save-json).
DATA_YAML_KEYS: tuple[str, ...] = ("path", *DATA_YAML_SPLITS, "names", "nc", "download", "coco_ids")

_COMMENT_CHARS = ("#", ";")


# ---------------------------------------------------------------------------------------------
# Values


def _to_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _to_num(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return _to_float(text)


def _split_list(text: str) -> list[str]:
    # Darknet tolerates spaces and a trailing comma ("10,13,  16,30,").
    return [p.strip() for p in text.split(",") if p.strip()]


_CONVERTERS: dict[str, tuple[Callable[[str], Any], str]] = {
    INT: (int, "an integer"),
    FLOAT: (_to_float, "a finite number"),
    INTS: (lambda t: [int(p) for p in _split_list(t)], "a comma-separated list of integers"),
    NUMS: (lambda t: [_to_num(p) for p in _split_list(t)], "a comma-separated list of numbers"),
    STR: (str, "a string"),
}


def _convert(kind: str, text: str, key: str, section: str, path: str, line: int) -> Any:
    func, what = _CONVERTERS[kind]
    try:
        value = func(text)
    except ValueError as e:
        raise ConfigError(
            f"value {_quoted(text)} of key '{key}' in [{section}] must be {what}", path, line
        ) from e
    if kind in (INTS, NUMS) and not value:
        raise ConfigError(f"key '{key}' in [{section}] must list at least one number", path, line)
    return value


def _format_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_format_value(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


# ---------------------------------------------------------------------------------------------
# Model cfg


def _read_text(path: Path, what: str) -> str:
    if not os.path.lexists(path):
        raise ConfigError(f"{what} not found", path)
    # A regular file within MAX_TEXT_BYTES (a FIFO would block, /dev/zero never ends), UTF-8
    # with its byte-order mark dropped (some Windows editors write one), or one line.
    return read_config_text(path, MAX_TEXT_BYTES, what)


def _content_lines(text: str) -> Iterable[tuple[int, str]]:
    """(1-based line number, stripped content) of every line that is not blank or a comment.
    ``splitlines`` takes care of CRLF and CR endings; a comment may also end a line."""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw
        for c in _COMMENT_CHARS:
            line = line.split(c, 1)[0]
        line = line.strip()
        if line:
            yield number, line


def parse_model_cfg(path: str | os.PathLike[str]) -> list[Block]:
    """Parse and validate a Darknet model cfg file; see :func:`parse_model_cfg_text`."""
    path = Path(path)
    return parse_model_cfg_text(_read_text(path, "model cfg"), path)


def parse_model_cfg_text(text: str, path: str | os.PathLike[str] = "<cfg text>") -> list[Block]:
    """Parse and validate the text of a Darknet model cfg.

    Args:
        text: the cfg's content (e.g. the ``cfg`` stored in a checkpoint).
        path: the name messages give for it: the file it came from, or a description such as
            ``"runs/x/last.pt (cfg)"``.

    Returns:
        One dict per section in file order, the ``[net]`` block first; see the module docstring
        for the layout. The result has passed :func:`validate_model_cfg`.

    Raises:
        ConfigError: naming ``path:line`` for an unknown section or key, a non-numeric value where
            a number is needed, a duplicate key, a malformed line, an empty file, and every
            structural problem listed in :func:`validate_model_cfg`.
    """
    spath = str(path)
    blocks: list[Block] = []
    for number, line in _content_lines(text):
        if line.startswith("["):
            blocks.append(_section_header(line, spath, number))
        elif not blocks:
            raise ConfigError(
                f"{_quoted(line)} appears before the first [section] header", path, number
            )
        else:
            _add_key_line(blocks[-1], line, spath, number)
    if not blocks:
        raise ConfigError("empty model cfg: no [net] section and no layers", path, 1)
    return validate_model_cfg(blocks)


def _section_header(line: str, path: str, number: int) -> Block:
    """A new, empty block for a ``[name]`` line."""
    if not line.endswith("]"):
        raise ConfigError(
            f"malformed section header {_quoted(line)}: expected '[name]'", path, number
        )
    name = line[1:-1].strip().lower()
    section = SECTION_ALIASES.get(name)
    if section is None:
        known = ", ".join(f"[{s}]" for s in KEYS)
        raise ConfigError(
            f"unknown section [{_quoted(name)[1:-1]}]; known sections: {known}", path, number
        )
    return {"type": section, "_path": path, "_line": number, "_lines": {}}


def _add_key_line(block: Block, line: str, path: str, number: int) -> None:
    """Parse a ``key=value`` line into ``block``, checking the key and converting the value."""
    key, sep, value = line.partition("=")
    key, value = key.strip(), value.strip()
    section = block["type"]
    if not sep or not key:
        raise ConfigError(
            f"expected 'key=value' or a [section] header in [{section}], got {_quoted(line)}",
            path,
            number,
        )
    if not value:
        raise ConfigError(f"key {_quoted(key)} in [{section}] has no value", path, number)
    if key in block["_lines"] and section == "net":
        # Darknet's option lists return the first occurrence and report the rest as unused
        # (yolov3-openimages.cfg sets batch twice). [net] only holds training settings; a
        # repeated layer key, which would silently change the network, stays an error.
        if (path, number, key) not in _REPORTED_REPEATS:
            _REPORTED_REPEATS.add((path, number, key))
            LOGGER.warning(
                "%s:%d: key '%s' in [net] repeats line %d; the first value is used, as in Darknet",
                path,
                number,
                key,
                block["_lines"][key],
            )
        return
    if key in block["_lines"]:
        first = block["_lines"][key]
        raise ConfigError(
            f"duplicate key '{key}' in [{section}] (first set at line {first})", path, number
        )
    if key in KEYS[section]:
        block[key] = _convert(KEYS[section][key], value, key, section, path, number)
    elif key in UNSUPPORTED.get(section, {}):
        block[key] = _neutral_value(key, value, section, path, number)
    elif key in RENAMED.get(section, {}):
        raise ConfigError(
            f"key {_quoted(key)} in [{section}] is not Darknet's (Darknet ignores it): write "
            f"{RENAMED[section][key]}={value}",
            path,
            number,
        )
    else:
        known = ", ".join(KEYS[section])
        raise ConfigError(
            f"unknown key {_quoted(key)} in [{section}]; known keys: {known}", path, number
        )
    block["_lines"][key] = number


def _neutral_value(key: str, value: str, section: str, path: str, number: int) -> Any:
    """A Darknet option this implementation only accepts at its neutral value."""
    neutral = UNSUPPORTED[section][key]
    try:
        parsed = _to_num(value)
    except ValueError:  # a word ("none"), or a list, which no neutral value is
        parsed = value
    if parsed != neutral:
        raise ConfigError(
            f"key {_quoted(f'{key}={value}')} in [{section}] is a Darknet option this "
            f"implementation does not support (only {key}={neutral} is accepted)",
            path,
            number,
        )
    return parsed


def _where(block: Block, key: str | None = None) -> tuple[str | None, int | None]:
    """(path, line) of a block's key, or of its section header when the key is absent."""
    lines = block.get("_lines", {})
    line = lines.get(key, block.get("_line")) if key is not None else block.get("_line")
    return block.get("_path"), line


def layer_error(block: Block, message: str, key: str | None = None) -> ConfigError:
    """A :class:`ConfigError` at the line of ``key`` in ``block`` (or of its section header),
    prefixing the message with the section name. For the model builder as well as this module."""
    path, line = _where(block, key)
    return ConfigError(f"[{block['type']}]: {message}", path, line)


def to_c_float(value: float) -> float:
    """``value`` as the C ``float`` Darknet keeps it in: rounded to float32, inf beyond its
    range as in C (without numpy's overflow warning: the readers below refuse it)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def c_floats(block: Block, key: str, default: Sequence[float] = ()) -> tuple[float, ...]:
    """The number or list ``block[key]`` (else ``default``) as the C ``float`` Darknet reads
    each into.

    Raises:
        ConfigError: naming the key's line, for a value beyond float32's range (C makes it
            inf, and Darknet would train on with it).
    """
    value = block.get(key, default)
    values = tuple(to_c_float(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    if not all(math.isfinite(v) for v in values):
        message = f"{key}={block[key]} is beyond float32's range (Darknet reads a C float)"
        raise layer_error(block, message, key)
    return values


def c_float(block: Block, key: str, default: float) -> float:
    """The number ``block[key]`` (else ``default``) as :func:`c_floats` reads it."""
    return c_floats(block, key, [default])[0]


def yolo_mask(block: Block) -> list[int]:
    """The anchor indices a ``[yolo]`` block uses: its ``mask``, or all anchors (Darknet's
    default when there is no mask)."""
    if "mask" in block:
        return list(block["mask"])
    return list(range(len(block["anchors"]) // 2))


def yolo_classes(block: Block) -> int:
    """A ``[yolo]`` block's class count: its ``classes``, or Darknet's default."""
    return int(block.get("classes", DEFAULT_CLASSES))


# Darknet's defaults (src/parser.c) for keys a layer may omit, for every reader of the blocks
# (the model builder, its memory estimate, the Darknet loss and loader, the checks here): they
# are not filled into the blocks, so that write_model_cfg writes back what was read.
CONV_DEFAULTS: dict[str, Any] = {
    "batch_normalize": 0,
    "filters": 1,
    "size": 1,
    "stride": 1,
    "pad": 0,
    "padding": 0,
    "groups": 1,
    "activation": "logistic",
}
DEFAULT_CLASSES = 20  # [yolo] classes
DEFAULT_MAX_BOXES = 200  # [yolo] max: truths read per image
DEFAULT_UPSAMPLE_STRIDE = 2
DEFAULT_DROPOUT = 0.5  # [dropout] probability


def stride_pair(block: Block, default: int) -> tuple[int, int]:
    """``(stride_y, stride_x)`` of a ``[convolutional]`` or ``[maxpool]`` block: ``stride``
    (else ``default``) unless ``stride_y`` or ``stride_x`` is set."""
    s = block.get("stride", default)
    return block.get("stride_y", s), block.get("stride_x", s)


def layer_refs(block: Block, index: int) -> list[int]:
    """The layers a ``[route]`` (``layers``) or ``[shortcut]`` (``from``) at layer ``index``
    reads, as absolute layer indices (``[net]`` not counted): a negative entry counts back."""
    key = "layers" if block["type"] == "route" else "from"
    return [index + r if r < 0 else r for r in block[key]]


def maxpool_params(block: Block) -> tuple[int, int, int, int]:
    """``(size, stride_y, stride_x, padding)`` of a ``[maxpool]`` block with Darknet's defaults
    (``src/parser.c``): stride 1, size = stride, padding = size - 1."""
    size = block.get("size", block.get("stride", 1))
    return (size, *stride_pair(block, 1), block.get("padding", size - 1))


def head_conv_index(blocks: list[Block], yolo_index: int) -> int | None:
    """Index in ``blocks`` of the ``[convolutional]`` that feeds the ``[yolo]`` at ``yolo_index``
    (skipping ``[dropout]`` in between), or None when the block before it is something else."""
    j = yolo_index - 1
    while j > 0 and blocks[j]["type"] == "dropout":
        j -= 1
    return j if j > 0 and blocks[j]["type"] == "convolutional" else None


def _check_bounds(block: Block) -> None:
    """Every numeric value of ``block`` inside its bounds (:data:`BOUNDS`, else a C ``int``;
    :data:`POSITIVE_FLOAT_MAX`); a value below the lowest says ``must be at least`` (``must be
    positive``), above the highest names the range.
    This is the one check of the integer keys' lowest values (sizes, strides and filters at
    least 1, paddings at least 0): the checks by layer below only add what relates keys."""
    section = block["type"]
    bounds = BOUNDS.get(section, {})
    for key, value in block.items():
        if key.startswith("_") or key == "type":
            continue
        values = value if isinstance(value, list) else [value]
        ints = [v for v in values if is_int(v)]
        lo, hi = bounds.get(key, C_INT)
        for v in ints:
            if v < lo:
                raise layer_error(block, f"{key}={shown(v)} must be at least {lo}", key)
            if v > hi:
                raise layer_error(
                    block,
                    f"{key}={shown(v)} is over the limit: allowed {lo}..{hi}",
                    key,
                )
        if key in ("layers", "from") and len(values) > MAX_ROUTE_INPUTS:
            raise layer_error(
                block,
                f"{key} lists {len(values)} layers, over the limit: allowed 1..{MAX_ROUTE_INPUTS}",
                key,
            )
        fhi = POSITIVE_FLOAT_MAX.get(section, {}).get(key)
        if fhi is not None and isinstance(value, (int, float)):
            if value <= 0:
                raise layer_error(block, f"{key}={value} must be positive", key)
            if value > fhi:
                raise layer_error(
                    block, f"{key}={shown(value)} is over the limit: allowed (0, {fhi:g}]", key
                )
    if section == "net" and block.get("channels", INPUT_CHANNELS) != INPUT_CHANNELS:
        raise layer_error(
            block,
            f"channels={shown(block['channels'])}: only channels={INPUT_CHANNELS} is supported "
            f"(the data loader feeds RGB images; grayscale images are read as 3 channels)",
            "channels",
        )
    if section == "yolo" and "anchors" in block:
        anchors = block["anchors"]
        if len(anchors) > 2 * MAX_ANCHORS:
            raise layer_error(
                block,
                f"anchors lists {len(anchors) // 2} w,h pairs, over the limit: allowed "
                f"1..{MAX_ANCHORS}",
                "anchors",
            )
        big = [a for a in anchors if a > MAX_NET_SIDE]
        if big:
            raise layer_error(
                block,
                f"anchor size {shown(big[0])} is over the limit: allowed up to {MAX_NET_SIDE} "
                "pixels",
                "anchors",
            )


def validate_model_cfg(blocks: list[Block]) -> list[Block]:
    """Check the structure of parsed cfg blocks (``[net]`` first) and return them unchanged.

    Checks: ``[net]`` comes first and only once, at least one layer follows; required keys;
    ``route``/``shortcut`` indices point to an earlier layer (negative: relative, otherwise
    absolute; the ``[net]`` block is not a layer); route ``groups``/``group_id``; activation
    names; positive sizes; ``[yolo]`` anchors come in pairs, ``num`` agrees with them, ``mask``
    stays inside them, and the ``[convolutional]`` before each head has
    ``filters == len(mask) * (classes + 5)``.

    Raises:
        ConfigError: naming the file and line of the offending key.
    """
    if not blocks or blocks[0].get("type") != "net":
        first = blocks[0] if blocks else {}
        path, line = _where(first)
        raise ConfigError("the first section must be [net] (or [network])", path, line)
    if len(blocks) == 1:
        raise layer_error(blocks[0], "the cfg defines no layers after [net]")
    for block in blocks:
        _check_bounds(block)
    if blocks[0].get("bn_eps", 1.0) < MIN_BN_EPS:
        # Below float32's smallest normal number it rounds to 0 (1e-320) or loses its digits:
        # a channel of constant values is then 0/0 and the model outputs NaN, silently.
        raise layer_error(
            blocks[0],
            f"bn_eps={blocks[0]['bn_eps']} is below {MIN_BN_EPS:.3g}, the smallest float32 "
            "normal number (a constant channel would be normalised to NaN)",
            "bn_eps",
        )
    layers = blocks[1:]
    for i, block in enumerate(layers):
        kind = block["type"]
        if kind == "net":
            raise layer_error(block, "a second [net] section; [net] must come once, first")
        for key in REQUIRED.get(kind, ()):
            if key not in block:
                raise layer_error(block, f"missing required key '{key}'")
        if kind == "convolutional":
            _check_activation(block, default=CONV_DEFAULTS["activation"])
        elif kind == "maxpool":
            _check_maxpool(block)
        elif kind in ("route", "shortcut"):
            _check_references(layers, i)
            if kind == "route":
                _check_route(block)
            else:
                _check_shortcut(block)
        elif kind == "dropout":
            p = block.get("probability", DEFAULT_DROPOUT)
            if not 0.0 <= p < 1.0:
                raise layer_error(block, f"probability={p} must be in [0, 1)", "probability")
        elif kind == "yolo":
            _check_yolo(blocks, i + 1)
    return blocks


def _check_maxpool(block: Block) -> None:
    size, _, _, padding = maxpool_params(block)
    # Each window must hold at least one input pixel: Darknet would output -FLT_MAX for a
    # window lying wholly in the padding.
    if (padding + 1) // 2 >= size:
        raise layer_error(
            block,
            f"padding={padding} must be in 0..{2 * size - 2} for size={size} (a larger "
            "padding makes windows that see no input pixel)",
            "padding" if "padding" in block else "size",
        )


def _check_references(layers: list[Block], i: int) -> None:
    """A route's ``layers`` / a shortcut's ``from`` point to earlier layers, never a head."""
    block = layers[i]
    key = "layers" if block["type"] == "route" else "from"
    for ref, target in zip(block[key], layer_refs(block, i)):
        if not 0 <= target < i:
            raise layer_error(
                block,
                f"{key}={ref} points to layer {target}, outside the network: layer {i} "
                f"can only use layers 0..{i - 1} (relative -1..{-i})",
                key,
            )
        if layers[target]["type"] == "yolo":
            raise layer_error(block, f"{key}={ref} points to a [yolo] layer (layer {target})", key)


def _check_route(block: Block) -> None:
    groups = block.get("groups", 1)
    gid = block.get("group_id", 0)
    if not 0 <= gid < groups:
        raise layer_error(
            block, f"group_id={gid} must be in 0..{groups - 1} (groups={groups})", "group_id"
        )


def _check_shortcut(block: Block) -> None:
    _check_activation(block, default="linear")
    wtype = block.get("weights_type", "none")
    if wtype not in ("none", "per_feature"):
        raise layer_error(
            block,
            f"weights_type={wtype} is not supported (use none or per_feature)",
            "weights_type",
        )


def _check_activation(block: Block, default: str) -> None:
    act = block.get("activation", default)
    if act not in ACTIVATIONS:
        raise layer_error(
            block,
            f"unknown activation {_quoted(str(act))}; known: {', '.join(ACTIVATIONS)}",
            "activation",
        )


def _check_yolo(blocks: list[Block], index: int) -> None:
    block = blocks[index]
    anchors = block["anchors"]
    if len(anchors) % 2:
        raise layer_error(
            block, f"anchors has {len(anchors)} numbers; they must come in w,h pairs", "anchors"
        )
    if any(a <= 0 for a in anchors):
        raise layer_error(block, "anchor sizes must be positive (pixels)", "anchors")
    n_anchors = len(anchors) // 2
    if "num" in block and block["num"] != n_anchors:
        raise layer_error(
            block, f"num={block['num']} but anchors lists {n_anchors} w,h pairs", "num"
        )
    mask = yolo_mask(block)
    for m in mask:
        if not 0 <= m < n_anchors:
            raise layer_error(
                block,
                f"mask index {m} is outside the {n_anchors} anchors (valid: 0..{n_anchors - 1})",
                "mask",
            )
    nc = yolo_classes(block)
    new_coords = block.get("new_coords", 0)
    if new_coords not in (0, 1):
        raise layer_error(block, f"new_coords={new_coords} must be 0 or 1", "new_coords")
    j = head_conv_index(blocks, index)
    if new_coords:
        # Darknet applies no sigmoid in a new_coords head: the conv before it must.
        act = blocks[j].get("activation", CONV_DEFAULTS["activation"]) if j is not None else None
        if act != "logistic":
            feeder = f"activation={act}" if j is not None else "no [convolutional]"
            raise layer_error(
                blocks[j] if j is not None else block,
                f"new_coords=1 needs the [convolutional] right before the [yolo] to have "
                f"activation=logistic (it has {feeder})",
                "activation" if j is not None else "new_coords",
            )
    if j is not None:
        conv = blocks[j]
        filters = conv.get("filters", CONV_DEFAULTS["filters"])
        expected = len(mask) * (nc + 5)
        if filters != expected:
            _, yolo_line = _where(block)
            raise layer_error(
                conv,
                f"filters={filters} before the [yolo] at line {yolo_line} must be "
                f"len(mask) * (classes + 5) = {len(mask)} * ({nc} + 5) = {expected}",
                "filters",
            )


def rewrite_cfg_classes(blocks: list[Block], nc: int) -> list[Block]:
    """Return a copy of ``blocks`` for ``nc`` classes: every ``[yolo]`` gets ``classes=nc`` and
    the ``[convolutional]`` feeding it ``filters=len(mask) * (nc + 5)``.

    The input is not modified; bookkeeping keys keep the original lines, so later messages
    still point into the source file.

    Raises:
        ConfigError: ``nc < 1``, or a ``[yolo]`` not fed by a ``[convolutional]``.
    """
    if not is_int(nc) or nc < 1:
        raise ConfigError(f"the number of classes must be a positive integer, got {nc!r}")
    if nc > MAX_CLASSES:
        # The count comes from the data (.data classes, names), not from a line of this cfg.
        raise ConfigError(
            f"{shown(nc)} classes is over the limit: allowed 1..{MAX_CLASSES} (classes per model)"
        )
    out = copy.deepcopy(blocks)
    for i, block in enumerate(out):
        if block["type"] != "yolo":
            continue
        j = head_conv_index(out, i)
        if j is None:
            raise layer_error(block, "cannot rewrite classes: no [convolutional] feeds this head")
        block["classes"] = nc
        out[j]["filters"] = len(yolo_mask(block)) * (nc + 5)
    return validate_model_cfg(out)


def format_model_cfg(blocks: list[Block], header: str = "") -> str:
    """Parsed blocks as Darknet cfg text (``key=value`` lines, lists comma-separated).

    ``header`` becomes ``#`` comment lines at the top. Bookkeeping keys (``_...``) are dropped,
    so comments and the original formatting are not preserved; the values are, and
    :func:`parse_model_cfg_text` reads the text back into equal blocks.
    """
    lines = [f"# {h}".rstrip() for h in header.splitlines()]
    for block in blocks:
        if lines:
            lines.append("")
        lines.append(f"[{block['type']}]")
        lines.extend(
            f"{k}={_format_value(v)}" for k, v in block.items() if k != "type" and k[0] != "_"
        )
    return "\n".join(lines) + "\n"


def write_model_cfg(
    blocks: list[Block], path: str | os.PathLike[str], header: str = "", flag: str | None = None
) -> None:
    """Write :func:`format_model_cfg`'s text to ``path``, atomically.

    Raises:
        OutputError: it cannot be written (a folder there, a full disk; ``flag``: the option
            that chose the place), in one line; a previous file stays as it was.
    """
    write_text(path, format_model_cfg(blocks, header), flag)


# ---------------------------------------------------------------------------------------------
# .data and .names


def _quoted(value: str, head: int = 48, tail: int = 24) -> str:
    """``value`` quoted for an error line, its middle cut when long (a 1 MB line stays short:
    every piece of a cfg, .data or names line an error quotes goes through here)."""
    if len(value) <= head + tail + 3:
        return repr(value)
    return repr(f"{value[:head]}...{value[-tail:]}")


def split_role(split: str, flag: str = "--split") -> str:
    """The data.yaml key of a split name: train, val or test by its start (val2017 -> val).

    Raises:
        ConfigError: a name that starts with none of them (``flag``: the option that gave it).
    """
    for role in DATA_YAML_SPLITS:
        if split.lower().startswith(role):
            return role
    raise ConfigError(
        f"{flag} {short_repr(split)}: name it train..., val... or test... (it becomes that "
        "key of data.yaml)"
    )


def data_yaml_text(
    splits: Mapping[str, str | list[str]],
    names: Sequence[str],
    header: str,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """An ultralytics data.yaml that :func:`parse_data_yaml` reads back: ``path`` its own
    folder, the ``splits`` (role -> folder or list of folders, relative to it; roles in the
    order train, val, test), ``names`` numbered 0..n-1, then ``extra`` keys; ``header`` a
    comment line saying who wrote it."""
    doc: dict[str, Any] = {"path": "."}
    doc.update({role: splits[role] for role in DATA_YAML_SPLITS if role in splits})
    doc["names"] = dict(enumerate(names))
    doc.update(extra or {})
    return f"# {header}; path is this file's folder\n" + dump_yaml(doc)


def _not_a_data_line(line: str, path: Path, number: int) -> ConfigError:
    """The error for a ``.data`` line that is no ``key=value``, naming the file it looks like."""
    if line.startswith("["):
        # A model cfg ([net], [convolutional], ...) where the dataset file goes.
        return ConfigError(
            f"a model cfg (section {_quoted(line)}), not a dataset file: it goes to --cfg; "
            "--data takes a .data or data.yaml file",
            path,
            number,
        )
    hint = ""
    if path.suffix.lower() == ".json":
        # A COCO user's first try: their instances JSON as --data.
        hint = (
            " (a COCO JSON? convert it with tools/coco2yolo.py --json FILE --images DIR "
            "--out OUT, then pass OUT/data.yaml)"
        )
    elif ":" in line and not line.startswith(("/", "~")):
        # `train: images/train` is the data.yaml schema, read by its extension.
        hint = f" (a data.yaml? name it {path.stem}.yaml)"
    return ConfigError(f"expected 'key=value', got {_quoted(line)}{hint}", path, number)


# What --weights takes (checkpoints, Darknet weights, exports): never a dataset file.
WEIGHTS_SUFFIXES = (".pt", ".pth", ".weights", ".onnx", ".torchscript")


def parse_data_cfg(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a dataset file: a Darknet ``.data`` file (``key=value`` lines; ``#``/``;``
    comments), or an ultralytics ``data.yaml`` (``.yaml``/``.yml``, :func:`parse_data_yaml`),
    into the same dict.

    Required keys: ``classes`` (positive integer), ``valid``, ``names``; ``train`` for training
    (:func:`train_utils.config.load_data_config` asks); other keys (``backup``, ``eval``, ...)
    are kept as strings.

    Relative paths (``train``, ``valid``, ``test``, ``names``, ``backup``) are resolved this way:
    if the path exists relative to the folder of the ``.data`` file, that one is used (a
    self-contained dataset folder); otherwise it is taken relative to the current directory
    (ultralytics/yolov3 convention, ``train=data/coco/train.txt`` run from the repository root).
    Absolute paths are kept. ``~`` is expanded.

    The ``names`` file must exist and list exactly ``classes`` names.

    Returns:
        dict with ``classes: int``, ``class_names: list[str]``, ``_lines`` (key -> line) and
        strings for everything else.

    Raises:
        ConfigError: naming the file and line (or the missing key).
    """
    path = Path(path)
    if path.suffix.lower() in DATA_YAML_SUFFIXES:
        return parse_data_yaml(path)
    if path.suffix.lower() in WEIGHTS_SUFFIXES:
        raise ConfigError(
            "a weights file, not a dataset file: it goes to --weights; --data takes a .data or "
            "data.yaml file",
            path,
        )
    text = _read_text(path, ".data file")
    out: dict[str, Any] = {}
    lines: dict[str, int] = {}
    for number, line in _content_lines(text):
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise _not_a_data_line(line, path, number)
        if key in lines:
            raise ConfigError(
                f"duplicate key '{key}' (first set at line {lines[key]})", path, number
            )
        if not value:
            raise ConfigError(f"key '{key}' has no value", path, number)
        lines[key] = number
        if key == "classes":
            try:
                out[key] = int(value)
            except ValueError as e:
                raise ConfigError(
                    f"classes={_quoted(value)} must be an integer number of classes", path, number
                ) from e
            if out[key] < 1:
                raise ConfigError(f"classes={out[key]} must be at least 1", path, number)
        elif key in DATA_PATH_KEYS:
            out[key] = _data_path_value(key, value, path, number)
        else:
            out[key] = value
    for key in DATA_REQUIRED_KEYS:
        if key not in out:
            raise ConfigError(
                f"missing required key '{key}' (needs {', '.join(DATA_REQUIRED_KEYS)})", path
            )
    out["class_names"] = _check_names_file(out, lines, path)
    out["_lines"] = lines
    return out


def _data_path_value(key: str, value: str, path: Path, number: int) -> str:
    """A path key of a ``.data`` file resolved (see :func:`parse_data_cfg`), refused when it is
    not a usable path or, not found, is written with Windows separators."""
    try:
        p = Path(value).expanduser()
        if not p.is_absolute() and (path.parent / p).exists():
            if p.exists() and not p.samefile(path.parent / p):
                # Darknet reads it from the current folder: the user may mean that one.
                LOGGER.warning(
                    "%s:%d: %s=%s is read beside the .data file (%s), not from the current "
                    "folder, which has another %s",
                    path,
                    number,
                    key,
                    short_text(value),
                    path.parent / p,
                    short_text(value),
                )
            p = path.parent / p
        missing = not p.exists()
    except OSError as e:  # e.g. a name too long for the file system
        raise ConfigError(
            f"{key}={_quoted(value)} is not a usable path ({e.strerror or e})", path, number
        ) from e
    if missing and "\\" in value and os.sep == "/" and key != "backup":
        # A .data file written for Darknet on Windows: `train = data\train.txt`.
        slashed = value.replace("\\", "/")
        raise ConfigError(
            f"{key}={short_text(value)} is not found: it is written with Windows "
            f"separators (backslashes); write {key}={short_text(slashed)}",
            path,
            number,
        )
    return str(p)


def _check_names_file(out: dict[str, Any], lines: dict[str, int], path: Path) -> list[str]:
    """The names of the ``names`` file of a parsed ``.data``, which must exist and list exactly
    ``classes`` names."""
    names_file = Path(out["names"])
    try:
        # exists(), not is_file(): a names file that is a device or FIFO gets the reader's
        # line ("a character device, not a regular file"), not "not found".
        names_found = names_file.exists()
    except OSError:  # a name too long for the file system
        names_found = False
    if not names_found:
        raise ConfigError(
            f"names file {_quoted(out['names'])} not found (looked beside the .data file and in "
            "the current directory)",
            path,
            lines["names"],
        )
    names = load_class_names(names_file)
    if len(names) != out["classes"]:
        raise ConfigError(
            f"classes={short_repr(out['classes'])} but '{out['names']}' lists {len(names)} names",
            path,
            lines["classes"],
        )
    return names


def load_class_names(path: str | os.PathLike[str]) -> list[str]:
    """Class names of a ``.names`` file: one per line, surrounding spaces stripped, blank lines
    skipped (a trailing newline is common). A blank line between names and a name given twice
    are warned about: Darknet reads a blank line as a class named "", so the classes after it
    are numbered one lower here than there.

    A data.yaml (``.yaml``/``.yml``) gives its ``names``, as YOLOv5 users keep them (was: each
    of its lines taken as a name).

    Raises:
        ConfigError: missing or unreadable file, or no names in it.
    """
    path = Path(path)
    if path.suffix.lower() in DATA_YAML_SUFFIXES:
        return _yaml_class_names(*_data_yaml_values(path), path)
    text = _read_text(path, "class names file")
    lines = [line.strip() for line in text.splitlines()]
    names = [line for line in lines if line]
    if not names:
        raise ConfigError("class names file lists no names", path)
    last = max(k for k, line in enumerate(lines) if line)
    blank = [k + 1 for k, line in enumerate(lines[:last]) if not line]
    if blank:
        LOGGER.warning(
            "%s: blank line(s) %s between names skipped: class ids follow the names (Darknet "
            'would read each as a class named "")',
            path,
            ", ".join(map(str, blank[:5])),
        )
    twice = sorted(n for n, count in Counter(names).items() if count > 1)
    if twice:
        LOGGER.warning("%s: names given more than once: %s", path, ", ".join(twice[:5]))
    return names


# ---------------------------------------------------------------------------------------------
# data.yaml (ultralytics)


def beside_or_cwd(value: str, base: Path) -> Path:
    """``value`` resolved against ``base`` when it exists there (or exists nowhere: the error
    then names the place under ``base``), else against the current directory where it exists."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p
    beside = base / p
    try:
        if beside.exists() or not p.exists():
            return beside
    except OSError:  # a name too long for the file system
        return beside
    return p


def _split_source(value: str, base: Path) -> Path:
    """A split entry resolved by :func:`beside_or_cwd`; an entry ``../x`` found nowhere that
    way but as ``base/x`` is that one, as ultralytics reads Roboflow's exports (a data.yaml
    beside ``train/`` saying ``train: ../train/images``)."""
    p = beside_or_cwd(value, base)
    if value.startswith("../") and not p.exists() and (base / value[3:]).exists():
        return base / value[3:]
    return p


def parse_data_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse an ultralytics ``data.yaml`` into the dict :func:`parse_data_cfg` returns.

    Keys (as YOLOv5/YOLOv8 write them)::

        path: ../datasets/coco128   # dataset root (optional: the yaml's folder)
        train: images/train2017     # a folder of images, a .txt list, or a list of those
        val: images/val2017
        test:                       # optional
        names: [person, bicycle]    # or {0: person, 1: bicycle}
        nc: 2                       # optional, must agree with names
        download: https://...       # ignored: nothing is downloaded at run time

    ``path`` is taken relative to the yaml's folder, so a dataset travels with its yaml; when it
    does not exist there but does relative to the current directory (YOLOv5's repository-root
    convention, ``path: ../datasets/coco128``), that one is used. Split entries are relative to
    ``path`` (else, where only that exists, to the current directory; ``../x`` found only as
    ``path/x`` is that, as ultralytics reads Roboflow's exports). ``names`` as a mapping
    must number the classes 0..n-1 without gaps. Unknown keys are ignored with one warning.

    Returns:
        ``classes``, ``class_names``, ``valid`` (and ``train``, ``test`` when given): a path
        string, or a list of them for a list of sources; ``root``; ``coco_ids`` when given;
        ``_lines`` (key -> line, ``valid`` for ``val``); ``_format``: ``"yaml"``.

    Raises:
        ConfigError: naming ``path:line``: not a mapping, a missing split or names, a value of
            the wrong kind, names and nc disagreeing, class ids with gaps; and every YAML problem
            :mod:`build_utils.safe_yaml` refuses (size, aliases, tags, keys given twice).
    """
    path = Path(path)
    values, lines = _data_yaml_values(path)
    base = path.parent
    if values.get("path") is not None:
        base = beside_or_cwd(_yaml_path_text("path", values, lines, path), path.parent)
    out: dict[str, Any] = {"_format": "yaml", "root": str(base)}
    out.update(_data_yaml_splits(values, lines, path, base))
    if values.get("coco_ids") is not None:
        out["coco_ids"] = str(beside_or_cwd(_yaml_path_text("coco_ids", values, lines, path), base))
    names = _yaml_class_names(values, lines, path)
    out["classes"] = len(names)
    out["class_names"] = names
    out["_lines"] = lines
    return out


def _data_yaml_values(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """A data.yaml's known keys: their values and lines (unknown keys named in one warning)."""
    doc = parse_yaml(_read_text(path, "data.yaml"), path)
    root = doc.root
    if root is None or root.id != "mapping":
        line = root.start_mark.line + 1 if root is not None else None
        raise ConfigError(
            "expected a mapping of keys (path, train, val, names, ...) to values", path, line
        )
    doc.value()  # the whole document built once: a key given twice is refused here
    values: dict[str, Any] = {}
    lines: dict[str, int] = {}
    unknown: list[str] = []
    for key_node, value_node in root.value:
        key = doc.value(key_node)
        line = key_node.start_mark.line + 1
        if key not in DATA_YAML_KEYS:
            unknown.append(f"{short_repr(key)} (line {line})")
            continue
        values[key], lines[key] = doc.value(value_node), line
    if unknown:
        LOGGER.warning(
            "%s: ignored unknown key(s) %s; read: %s",
            path,
            ", ".join(unknown),
            ", ".join(DATA_YAML_KEYS),
        )
    if values.get("download") is not None:
        LOGGER.info(
            "%s:%d: 'download' ignored: nothing is downloaded at run time; fetch the dataset "
            "yourself",
            path,
            lines["download"],
        )
    return values, lines


def _yaml_path_text(key: str, values: dict[str, Any], lines: dict[str, int], path: Path) -> str:
    """``values[key]`` as a path string (a number is a folder name too)."""
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, str | int | float) or value == "":
        raise ConfigError(f"'{key}' must be a path, got {short_repr(value)}", path, lines[key])
    return str(value)


def _data_yaml_splits(
    values: dict[str, Any], lines: dict[str, int], path: Path, base: Path
) -> dict[str, Any]:
    """``train``, ``valid`` (and ``test``): each source resolved from ``base``; their lines are
    added to ``lines`` under our names."""
    out: dict[str, Any] = {}
    for key in DATA_YAML_SPLITS:
        value = values.get(key)
        ours = "valid" if key == "val" else key
        if value is None or value == []:
            if key != "val":
                continue  # train and test are optional here (see DATA_REQUIRED_KEYS)
            where = lines.get(key)
            why = f"'{key}' has no value" if where else f"missing required key '{key}'"
            raise ConfigError(
                f"{why} (a folder of images, a .txt list of images, or a list of those; train "
                "too for training)",
                path,
                where,
            )
        items = value if isinstance(value, list) else [value]
        sources = [
            str(_split_source(_yaml_path_text(key, {key: v}, lines, path), base)) for v in items
        ]
        out[ours] = sources if isinstance(value, list) else sources[0]
        lines[ours] = lines[key]
    return out


def _yaml_class_names(values: dict[str, Any], lines: dict[str, int], path: Path) -> list[str]:
    """The class names of a data.yaml's ``names`` (a list, or a mapping of ids 0..n-1 to names),
    checked against ``nc`` when it is given; without ``names``, ``nc`` class ids as names."""
    nc = values.get("nc")
    if nc is not None and (not is_int(nc) or nc < 1):
        raise ConfigError(
            f"nc={short_repr(nc)} must be a positive integer number of classes", path, lines["nc"]
        )
    raw = values.get("names")
    if raw is None:
        if nc is None:
            raise ConfigError(
                "missing 'names' (a list of class names, or a mapping 0: name, 1: name, ...)",
                path,
                lines.get("names"),
            )
        if nc > MAX_CLASSES:
            raise ConfigError(
                f"nc={shown(nc)} is over the limit of {MAX_CLASSES}", path, lines["nc"]
            )
        return [str(i) for i in range(nc)]
    line = lines["names"]
    if isinstance(raw, dict):
        items = _numbered_names(raw, path, line)
    elif isinstance(raw, list):
        items = raw
    else:
        raise ConfigError(
            f"names must be a list of class names or a mapping 0: name, ..., got {short_repr(raw)}",
            path,
            line,
        )
    if not items:
        raise ConfigError("names lists no classes", path, line)
    names = []
    for k, item in enumerate(items):
        if (
            isinstance(item, bool)
            or not isinstance(item, str | int | float)
            or not str(item).strip()
        ):
            raise ConfigError(
                f"names: class {k} must be a non-empty name, got {short_repr(item)}", path, line
            )
        names.append(str(item).strip())
    if nc is not None and nc != len(names):
        raise ConfigError(
            f"nc={short_repr(nc)} but names lists {len(names)} classes; make them agree",
            path,
            lines["nc"],
        )
    return names


def _numbered_names(raw: dict[Any, Any], path: Path, line: int) -> list[Any]:
    """The values of a ``names`` mapping in class id order; the ids must be 0..n-1."""
    # A yaml written from JSON quotes its keys ("0": person); ultralytics reads them as ids.
    numbered = {
        int(k) if isinstance(k, str) and k.strip().isdecimal() else k: v for k, v in raw.items()
    }
    if len(numbered) < len(raw):
        raise ConfigError("names: a class id is given twice (0 and '0')", path, line)
    ids = list(numbered)
    bad = [i for i in ids if not is_int(i)]
    if bad:
        raise ConfigError(
            f"names: class id {short_repr(bad[0])} is not an integer (write 0: name, ...)",
            path,
            line,
        )
    if sorted(ids) != list(range(len(ids))):
        missing = sorted(set(range(len(ids))) - set(ids))
        got = ", ".join(str(i) for i in sorted(ids)[:8]) + (", ..." if len(ids) > 8 else "")
        raise ConfigError(
            f"names: class ids must be 0..{len(ids) - 1} without gaps (got {got}; "
            f"{missing[0]} is missing)",
            path,
            line,
        )
    return [numbered[i] for i in range(len(ids))]
