"""Darknet ``.weights`` files: read into and write from a :class:`~models.darknet.Darknet`.

Darknet ``.weights`` layout (little-endian): a header of int32 ``major, minor, revision`` and
``seen`` (images seen in training: int64 when ``major * 10 + minor >= 2`` and both are below
1000, int32 otherwise), then float32 values layer by layer in cfg order: for each
``[convolutional]`` either BatchNorm ``bias, weight, running_mean, running_var`` (``filters``
values each) or the conv ``bias``, then the conv weights ``(filters, in / groups, k, k)``; for
each weighted ``[shortcut]`` its fusion weights (kept in ultralytics/yolov3's
sigmoid parameterisation). Nothing marks where a layer ends, so a file for another cfg can only
be detected by its size: the whole file must be consumed exactly.

PyTorch ``.pt`` checkpoints are read and written by ``train_utils.checkpoint``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from build_utils.atomic import atomic_write
from build_utils.checks import is_int, shown
from build_utils.errors import CheckpointError
from build_utils.limits import MAX_WEIGHTS_BYTES, file_problem
from build_utils.parse_config import head_conv_index
from models.darknet import Darknet
from models.layers import WeightedFeatureFusion

LOGGER = logging.getLogger(__name__)

# Header written by save_weights: version 0.2.0, the first with a 64-bit `seen`.
DARKNET_VERSION = (0, 2, 0)
_HEADER_INTS = 3
# Darknet: versions >= 1000 mark transposed (old) files with int32 seen.
DARKNET_VERSION_LIMIT = 1000


def darknet_header(ckpt: Mapping[str, Any], path: str | Path) -> tuple[tuple[int, ...], int]:
    """(version, seen) for the ``.weights`` header of a checkpoint's model: ``seen`` (images
    trained on) as a ``--recipe darknet`` run or ``train_utils.checkpoint.save_weights_pt``
    recorded it, else 0; the version the ``.weights`` it came from had, else
    :data:`DARKNET_VERSION`.

    Raises:
        CheckpointError: a ``seen`` that is not a count or a malformed version.
    """
    seen, version = ckpt.get("seen", 0), ckpt.get("darknet_version", DARKNET_VERSION)
    if not (
        isinstance(version, (list, tuple))
        and len(version) == len(DARKNET_VERSION)
        and all(is_int(v) and 0 <= v < DARKNET_VERSION_LIMIT for v in version)
    ):
        raise CheckpointError(f"'darknet_version' is {shown(version)}, not 3 integers", path)
    seen_bits = 63 if seen_is_int64(version[0], version[1]) else 31
    if not is_int(seen) or not 0 <= seen < 2**seen_bits:
        raise CheckpointError(f"'seen' is {shown(seen)}, not a count of images", path)
    return tuple(version), seen


def seen_is_int64(major: int, minor: int) -> bool:
    """Whether a header of this version stores ``seen`` as int64 (else int32), as Darknet does."""
    return (
        major * 10 + minor >= 2 and major < DARKNET_VERSION_LIMIT and minor < DARKNET_VERSION_LIMIT
    )


def _darknet_tensors(model: Darknet, cutoff: int = -1) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """(layer index, tensors in file order) for each layer that stores values in a .weights file,
    up to (not including) layer ``cutoff`` (-1: all)."""
    if getattr(model, "fused", False):
        raise CheckpointError(
            "the model has been fused (BatchNorm folded into the convolutions); Darknet weights "
            "must be read or written before fuse()"
        )
    stop = len(model.module_list) if cutoff < 0 else cutoff
    for i, (mdef, module) in enumerate(zip(model.module_defs[:stop], model.module_list[:stop])):
        if mdef["type"] == "convolutional":
            conv = module.Conv2d
            if hasattr(module, "BatchNorm2d"):
                bn = module.BatchNorm2d
                tensors = [bn.bias, bn.weight, bn.running_mean, bn.running_var]
            else:
                tensors = [conv.bias]
            yield i, [*tensors, conv.weight]
        elif isinstance(module, WeightedFeatureFusion) and module.weight:
            yield i, [module.w]


def load_darknet_weights(
    model: Darknet, path: str | os.PathLike[str], cutoff: int = -1, partial: bool = False
) -> int:
    """Load a Darknet ``.weights`` file into ``model`` (in place).

    Args:
        model: built from the cfg the weights were trained with.
        path: the ``.weights`` file.
        cutoff: load only layers ``0 .. cutoff - 1`` (module_list indices), e.g. 75 for the
            Darknet-53 backbone file ``darknet53.conv.74``; the file may then hold more values
            than needed. -1: all layers, and the file must hold exactly the model's values.
        partial: with ``cutoff=-1``, also accept a file that ends exactly after some layer
            (``darknet53.conv.74``, ``yolov4.conv.137``: Darknet's backbone files) and load
            those layers; the others keep their values.

    Returns:
        The number of layers (``module_list`` entries from 0) the file covered.

    Sets ``model.seen`` and ``model.darknet_version`` from the header, so that
    :func:`save_weights` writes the same header back.

    Raises:
        CheckpointError: missing, truncated or over-long file (with the expected and actual value
            counts), or a fused model. Nothing is loaded in that case.
    """
    path = Path(path)
    version, seen, body, n_values = _read_weights_header(path)
    layers = list(_darknet_tensors(model, cutoff))
    needed = sum(t.numel() for _, ts in layers for t in ts)
    end = _layer_ending_at(layers, n_values)
    if partial and cutoff < 0 and n_values < needed and end is not None:
        cutoff = end + 1
        layers = list(_darknet_tensors(model, cutoff))
        LOGGER.info("%s: a partial (backbone) file: loading layers 0..%d", path, end)
    else:
        _check_value_count(model, path, cutoff, needed, n_values, end)
    # Only the values the layers take are read (a file checked by its size alone may still be
    # a sparse 40 GB one within the limit): count= stops there.
    used = sum(t.numel() for _, ts in layers for t in ts)
    values = torch.from_numpy(_read_values(path, body, used))
    ptr = 0
    with torch.no_grad():
        for _, tensors in layers:
            for t in tensors:
                n = t.numel()
                # Straight from the file's buffer: a copy per tensor would touch as many fresh
                # pages again as the file has bytes (hundreds of MB).
                t.copy_(values[ptr : ptr + n].view_as(t))
                ptr += n
    scope = "all layers" if cutoff < 0 else f"layers 0..{cutoff - 1}"
    if ptr < n_values:
        LOGGER.info("%s: loaded %s, %d trailing values not used", path, scope, n_values - ptr)
    model.seen = seen
    model.darknet_version = version
    LOGGER.info("%s: Darknet weights v%d.%d.%d, seen %d", path, *version, seen)
    return len(model.module_list) if cutoff < 0 else cutoff


def _read_weights_header(path: Path) -> tuple[tuple[int, int, int], int, int, int]:
    """(version, seen, header bytes, float32 values after it) of a ``.weights`` file, from its
    header and its size: the file is checked as a regular file within
    :data:`~build_utils.limits.MAX_WEIGHTS_BYTES` and nothing past the header is read."""
    problem = file_problem(path, MAX_WEIGHTS_BYTES)
    if problem is not None:
        if problem == "file not found":
            problem = "Darknet weights file not found"
        raise CheckpointError(problem, path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(_HEADER_INTS * 4 + 8)
    except OSError as e:
        raise CheckpointError(f"cannot read the weights file ({e.strerror or e})", path) from e
    header_bytes = 4 * _HEADER_INTS
    if size < header_bytes:
        raise CheckpointError(
            f"file of {size} bytes is too short for a Darknet weights header", path
        )
    major, minor, revision = (int(v) for v in np.frombuffer(head, "<i4", _HEADER_INTS))
    seen_dtype = "<i8" if seen_is_int64(major, minor) else "<i4"
    body = header_bytes + np.dtype(seen_dtype).itemsize
    if size < body:
        raise CheckpointError(
            f"file of {size} bytes is too short for a Darknet v{major}.{minor} header", path
        )
    seen = int(np.frombuffer(head, seen_dtype, 1, header_bytes)[0])
    if (size - body) % 4:
        raise CheckpointError(
            f"the {size - body} bytes after the {body}-byte header are not a whole number of "
            "float32 values: not a Darknet weights file, or a damaged one",
            path,
        )
    return (major, minor, revision), seen, body, (size - body) // 4


def _read_values(path: Path, offset: int, count: int) -> np.ndarray:
    """``count`` float32 values of ``path`` from byte ``offset``: exactly those, never the rest."""
    try:
        values = np.fromfile(path, dtype="<f4", count=count, offset=offset)
    except OSError as e:
        raise CheckpointError(f"cannot read the weights file ({e.strerror or e})", path) from e
    if values.size < count:  # the file shrank since its size was read
        raise CheckpointError(
            f"truncated while reading: {count:,} float32 values expected, {values.size:,} read",
            path,
        )
    return values


def _layer_ending_at(layers: list[tuple[int, list[torch.Tensor]]], n_values: int) -> int | None:
    """The layer after which exactly ``n_values`` values have been read, if there is one."""
    ptr = 0
    for i, tensors in layers:
        ptr += sum(t.numel() for t in tensors)
        if ptr == n_values:
            return i
    return None


def _classes_that_fit(model: Darknet, extra_values: int) -> int | None:
    """The class count for which the cfg's heads would take ``extra_values`` more values (fewer
    when negative), when there is one: the weights were trained with this cfg edited for
    another number of classes, the usual Darknet workflow."""
    blocks = [model.hyperparams, *model.module_defs]
    per_class = 0  # values one more class adds: na output channels in each head's conv
    for i in model.yolo_layers:
        j = head_conv_index(blocks, i + 1)
        if j is None:
            return None
        head = model.module_list[j - 1]
        per_channel = head.Conv2d.weight[0].numel() + (4 if hasattr(head, "BatchNorm2d") else 1)
        per_class += model.module_list[i].na * per_channel
    classes, rest = divmod(extra_values, per_class)
    return model.nc + classes if rest == 0 and model.nc + classes >= 1 else None


def _check_value_count(
    model: Darknet, path: Path, cutoff: int, needed: int, n_values: int, end: int | None
) -> None:
    scope = "all layers" if cutoff < 0 else f"layers 0..{cutoff - 1}"
    cfg = model.cfg_path or "the model's cfg"
    fits = _classes_that_fit(model, n_values - needed) if cutoff < 0 else None
    hint = (
        f"; it holds this cfg's values for {fits} classes (the cfg has {model.nc}): give the "
        f"class names or data of those {fits} (--names/--data: the heads are rewritten for "
        f"them), or a cfg for them (tools/make_cfg.py {cfg} --classes {fits})"
        if fits is not None
        else ""
    )
    if n_values < needed:
        # Say where the file ends when that is a layer boundary: a partial (backbone) file.
        if end is not None:
            hint += f"; it ends exactly after layer {end}: cutoff={end + 1} loads that part"
        raise CheckpointError(
            f"truncated or for another cfg: {cfg} ({scope}) needs {needed:,} float32 values, the "
            f"file holds {n_values:,}{hint}",
            path,
        )
    if n_values > needed and cutoff < 0:
        raise CheckpointError(
            f"too long, or for another cfg: {cfg} needs {needed:,} float32 values, the file "
            f"holds {n_values:,}{hint}",
            path,
        )


def save_weights(model: Darknet, path: str | os.PathLike[str], cutoff: int = -1) -> None:
    """Write ``model`` (layers ``0 .. cutoff - 1``, -1: all) as a Darknet ``.weights`` file:
    the header version of the file the model was loaded from (``model.darknet_version``),
    otherwise 0.2.0, and ``model.seen`` (int64 from version 0.2 on, as Darknet reads it), so
    that loading and saving a Darknet file gives it back byte for byte. Written atomically
    (:func:`~build_utils.atomic.atomic_write`).

    Raises:
        CheckpointError: the model is fused.
    """
    path = Path(path)
    version = tuple(getattr(model, "darknet_version", DARKNET_VERSION))
    seen_dtype = "<i8" if seen_is_int64(version[0], version[1]) else "<i4"
    layers = list(_darknet_tensors(model, cutoff))  # raises for a fused model
    with atomic_write(path, "wb") as f:
        f.write(np.asarray(version, dtype="<i4").tobytes())
        f.write(np.asarray([int(getattr(model, "seen", 0))], dtype=seen_dtype).tobytes())
        # One tensor at a time, without extra copies: files reach hundreds of MB.
        for _, tensors in layers:
            for t in tensors:
                values = t.detach().to("cpu", torch.float32).contiguous().numpy()
                f.write(np.ascontiguousarray(values, dtype="<f4").data)
