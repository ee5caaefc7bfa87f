"""What a model costs before it is built: parameters and activation memory from parsed cfg blocks,
and the check that refuses a model the machine cannot hold.

A cfg that passes every value check can still describe a network no machine holds (a checkpoint
whose embedded cfg says ``filters=1000000000`` asks for a 108 GB weight tensor), and a sane model
at ``--img-size 8192`` and batch 64 needs hundreds of GB of activations. Building it, or running
its first batch, ends in an allocator traceback or the kernel's OOM killer. This module walks the
blocks as :mod:`models.darknet` builds them, with shapes only (nothing is allocated), and
:func:`check_model_fits` names the layer where the estimate crosses the memory available:
``/proc/meminfo`` ``MemAvailable`` for the CPU, ``torch.cuda.mem_get_info`` for a CUDA device.

It is an estimate, held to the real model by ``tests/models/test_budget.py`` (the factors
measured are in bench/README.md "Memory estimate"):
- parameters: exact (``sum(p.numel() for p in model.parameters())``);
- layer output shapes: exact (each layer's output in a forward pass);
- training activations: what autograd saves for the backward pass; it counts a convolution's
  output and its activation's apart, which in-place activations share, so it errs high;
- inference activations: the largest set of tensors alive at once (the outputs later layers
  read, one layer's input, outputs and the convolution backend's copy of its input);
- under autocast (``amp``) activations take the autocast dtype's bytes (2 for bf16 and fp16:
  convolutions output it and BatchNorm and the activations keep it), and training adds the
  low-precision copy of every weight that autocast caches for the step.
A model is refused only when the estimate exceeds all the memory available, never for coming
close to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from build_utils.errors import ConfigError
from build_utils.image_cache import available_memory_bytes
from build_utils.limits import format_bytes, positive_env_int
from build_utils.parse_config import (
    CONV_DEFAULTS,
    DEFAULT_UPSAMPLE_STRIDE,
    Block,
    layer_error,
    layer_refs,
    maxpool_params,
    stride_pair,
)
from models.layers import DarknetMaxPool

FLOAT_BYTES = 4  # float32: parameters, their copies, and activations without autocast
INDEX_BYTES = 8  # max-pool indices saved for backward are int64
# Per parameter while training: the weight, its gradient, two optimizer states (Adam's moments;
# SGD momentum needs one) and the EMA copy.
TRAIN_COPIES_PER_PARAM = 5
# Activations without a saved copy for backward (a convolution's output feeds BatchNorm, whose
# output an in-place activation overwrites): 1 + BatchNorm + activation.
_ACTIVATIONS_SAVING_INPUT = frozenset({"mish", "swish", "silu", "elu", "selu", "gelu"})
# Exporting (tools/export.py) holds several sets of one image's inference activations at once:
# the tracer's run, the converter's graph and, while checking, PyTorch's and the runtime's runs
# of the sample batch. The largest peak measured over the estimate (bench/README.md "Export
# memory"), rounded up.
EXPORT_ACTIVATION_COPIES = 8
EXPORT_PARAM_COPIES = 5  # the weights, the traced and serialized graph, the runtime's copy
# Overrides the measured memory (bytes), e.g. on a machine with swap, or to test.
MEMORY_ENV = "YOLO_MEMORY_AVAILABLE"


@dataclass(frozen=True)
class LayerCost:
    """One layer's share. ``shape`` is its output (channels, height, width) for one image;
    ``train_bytes`` what its forward keeps for the backward pass per image; ``live_bytes`` the
    memory alive while it runs in inference (earlier outputs still needed, its input and
    outputs), per image."""

    index: int  # module_list index
    kind: str
    line: int | None
    params: int
    shape: tuple[int, int, int]
    train_bytes: int
    live_bytes: int


@dataclass
class ModelEstimate:
    """The walk over all layers at one input size (h, w)."""

    img_hw: tuple[int, int]
    layers: list[LayerCost] = field(default_factory=list)
    path: str | None = None
    # The first route or shortcut joining maps of different sizes at this input: the model
    # raises it after its build has checked the strides (which names a wrong reference better).
    size_mismatch: ConfigError | None = None

    @property
    def params(self) -> int:
        return sum(c.params for c in self.layers)

    def train_bytes_per_image(self) -> int:
        return sum(c.train_bytes for c in self.layers)

    def live_bytes_per_image(self) -> int:
        return max((c.live_bytes for c in self.layers), default=0)


def _out_side(n: int, k: int, pad: int, stride: int) -> int:
    return max(0, (n + 2 * pad - k) // stride + 1)


def activation_bytes(amp: torch.dtype | None) -> int:
    """Bytes per activation element: the autocast dtype's (None: float32)."""
    return FLOAT_BYTES if amp is None else amp.itemsize


def estimate_model(
    blocks: list[Block], img_hw: tuple[int, int], act_bytes: int = FLOAT_BYTES
) -> ModelEstimate:
    """Shapes, parameters and activation bytes of every layer of ``blocks`` (``[net]`` first,
    validated) for one image of ``img_hw`` = (h, w) pixels, activations of ``act_bytes`` bytes
    per element (:func:`activation_bytes`). Allocates nothing."""
    net, layers = blocks[0], blocks[1:]
    est = ModelEstimate((int(img_hw[0]), int(img_hw[1])), path=net.get("_path"))
    c, h, w = int(net.get("channels", 3)), est.img_hw[0], est.img_hw[1]
    shapes: list[tuple[int, int, int]] = []
    referenced: set[int] = set()
    for i, mdef in enumerate(layers):
        if mdef["type"] in ("route", "shortcut"):
            referenced.update(layer_refs(mdef, i))
    kept = 0  # bytes of earlier outputs that later layers read (inference keeps them)
    for i, mdef in enumerate(layers):
        kind = mdef["type"]
        params, extra_train, workspace = 0, 0, 0
        in_elems = c * h * w
        if kind == "convolutional":
            cd = {**CONV_DEFAULTS, **mdef}
            k, filters, groups = cd["size"], cd["filters"], cd["groups"]
            sy, sx = stride_pair(mdef, CONV_DEFAULTS["stride"])
            pad = k // 2 if cd["pad"] else cd["padding"]
            bn = bool(cd["batch_normalize"])
            params = filters * (c // max(1, groups)) * k * k + (2 * filters if bn else filters)
            c, h, w = filters, _out_side(h, k, pad, sy), _out_side(w, k, pad, sx)
            if k > 1:  # a convolution backend's reordered (padded, blocked) copy of its input
                workspace = c * h * w * act_bytes
            copies = 1 + bn + (cd["activation"] in _ACTIVATIONS_SAVING_INPUT)
            extra_train = (copies - 1) * c * h * w * act_bytes
        elif kind == "maxpool":
            size, sy, sx, padding = maxpool_params(mdef)
            pool = DarknetMaxPool(size, (sy, sx), padding)
            if not pool.symmetric():  # a padded copy of the input
                extra_train += c * (h + padding) * (w + padding) * act_bytes
            h, w = max(0, pool.out_size(h, 0)), max(0, pool.out_size(w, 1))
            extra_train += c * h * w * INDEX_BYTES
        elif kind == "upsample":
            s = mdef.get("stride", DEFAULT_UPSAMPLE_STRIDE)
            h, w = h * s, w * s
        elif kind == "route":
            refs = layer_refs(mdef, i)
            groups = mdef.get("groups", 1)
            _check_same_size(est, mdef, "layers", [shapes[j][1:] for j in refs])
            c = sum(shapes[j][0] for j in refs) // max(1, groups)
            h, w = shapes[refs[0]][1], shapes[refs[0]][2]
        elif kind == "shortcut":
            refs = layer_refs(mdef, i)
            _check_same_size(est, mdef, "from", [(h, w)] + [shapes[j][1:] for j in refs])
            if mdef.get("weights_type", "none") == "per_feature":
                params = len(mdef["from"]) + 1
        out_bytes = c * h * w * act_bytes
        # A [yolo] head returns views in training; in inference it decodes a copy.
        train = 0 if kind == "yolo" else out_bytes + extra_train
        live = kept + in_elems * act_bytes + 2 * out_bytes + workspace
        shapes.append((c, h, w))
        if i in referenced:
            kept += out_bytes
        est.layers.append(LayerCost(i, kind, mdef.get("_line"), params, (c, h, w), train, live))
    return est


def _check_same_size(
    est: ModelEstimate, mdef: Block, key: str, sizes: list[tuple[int, int]]
) -> None:
    """The feature maps a route joins or a shortcut adds must have one size at this input: the
    build only compares the layers' strides, and a map that an even kernel with pad=1 grew by a
    pixel (or a stride that does not divide it) passes that and fails in forward(). The first
    such layer is kept in ``est.size_mismatch``."""
    if len(set(sizes)) > 1 and est.size_mismatch is None:
        img_hw = est.img_hw
        shown = " and ".join(sorted({f"{h}x{w}" for h, w in sizes}))
        est.size_mismatch = layer_error(
            mdef,
            f"{key}={','.join(map(str, mdef[key]))} joins feature maps of different sizes "
            f"({shown}) at an input of {img_hw[1]}x{img_hw[0]}; check the kernel sizes, pads "
            f"and strides of the layers before it (an even size with pad=1 adds a pixel)",
            key,
        )


def available_memory(device: Any = None) -> tuple[int, str]:
    """(bytes, what) free for a model on ``device`` (None or CPU: RAM; CUDA: the GPU's free
    memory). ``$YOLO_MEMORY_AVAILABLE`` (bytes) replaces the measurement."""
    value = positive_env_int(MEMORY_ENV, "bytes")
    if value is not None:
        return value, MEMORY_ENV
    dev_type = getattr(device, "type", None) or (str(device).split(":")[0] if device else "cpu")
    if dev_type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    available = available_memory_bytes()  # MemAvailable, the same figure the RAM cache uses
    if available is None:
        available = 1 << 62  # unknown: no refusal
    return available, "RAM available (MemAvailable)"


def check_model_fits(
    blocks: list[Block],
    img_hw: tuple[int, int] | int,
    batch: int = 1,
    training: bool = False,
    device: Any = None,
    params_only: bool = False,
    share: int = 1,
    amp: torch.dtype | None = None,
    export: bool = False,
) -> ModelEstimate:
    """Refuse, in one line, a model that cannot fit the memory of ``device``.

    Walks the layers adding each one's cost: its parameters (x :data:`TRAIN_COPIES_PER_PARAM`
    when training) and its activations for ``batch`` images of ``img_hw`` (saved for backward
    when training; the largest live set in inference). ``params_only`` counts the parameters
    alone (building the model on the CPU, before the size and batch are known). ``share``
    processes use the same memory alike (the DDP ranks of a node training on its CPU): each
    gets its part. ``amp``: the autocast dtype the model runs under (None: float32), which sets
    the bytes of every activation (see the module docstring). ``export``: what exporting one
    image's graph and checking it needs (:data:`EXPORT_ACTIVATION_COPIES` times the inference
    activations, :data:`EXPORT_PARAM_COPIES` of the parameters).

    Returns:
        The estimate, when it fits.

    Raises:
        ConfigError: at the cfg line of the layer where the running total first exceeds the
            memory available, with the estimate and what is available; or where a feature map
            shrinks to nothing at this input size.
    """
    hw = (img_hw, img_hw) if isinstance(img_hw, int) else (int(img_hw[0]), int(img_hw[1]))
    est = estimate_model(blocks, hw, activation_bytes(amp))
    avail, what = available_memory(device)
    if share > 1:
        avail, what = avail // share, f"{what}, shared by {share} processes"
    copies = EXPORT_ACTIVATION_COPIES if export else batch
    param_bytes = FLOAT_BYTES * (
        TRAIN_COPIES_PER_PARAM if training else EXPORT_PARAM_COPIES if export else 1
    )
    if training and amp is not None and not params_only:
        # Autocast casts each weight once per step and keeps the copy for the backward pass.
        param_bytes += activation_bytes(amp)
    total, live_peak = 0, 0
    mode = "training" if training else "export, trace and check" if export else "inference"
    for cost in est.layers:
        if not params_only and 0 in cost.shape[1:]:
            raise _layer_error(
                blocks,
                cost,
                f"the feature map is {cost.shape[1]}x{cost.shape[2]} at an input of "
                f"{hw[0]}x{hw[1]}: the input is too small for this network's downsampling",
            )
        total += cost.params * param_bytes
        if params_only:
            needed = total
        elif training:
            total += batch * cost.train_bytes
            needed = total
        else:
            live_peak = max(live_peak, copies * cost.live_bytes)
            needed = total + live_peak
        if needed > avail:
            scope = (
                f"{est.params:,} parameters in all"
                if params_only
                else f"{mode}, {'' if export else f'batch {batch}, '}{hw[0]}x{hw[1]} px"
                f"{_amp_note(amp)}"
            )
            raise _layer_error(
                blocks,
                cost,
                f"the model does not fit: about {format_bytes(needed)} needed up to this layer "
                f"({scope}), {format_bytes(avail)} {what}; use a smaller model, image size or "
                f"batch (the need is an estimate: set {MEMORY_ENV} to override the measurement)",
            )
    return est


def _amp_note(amp: torch.dtype | None) -> str:
    return "" if amp is None else f", {str(amp).removeprefix('torch.')} autocast"


def _layer_error(blocks: list[Block], cost: LayerCost, message: str) -> ConfigError:
    mdef = blocks[cost.index + 1]
    return ConfigError(
        f"[{cost.kind}] layer {cost.index}: {message}", mdef.get("_path"), mdef.get("_line")
    )


def describe(est: ModelEstimate, batch: int = 1) -> str:
    """One line for the log: parameters and activation memory of ``batch`` images."""
    h, w = est.img_hw
    return (
        f"{est.params:,} parameters ({format_bytes(est.params * FLOAT_BYTES)}); activations for "
        f"{batch} image(s) of {h}x{w}: about "
        f"{format_bytes(batch * est.train_bytes_per_image())} training, "
        f"{format_bytes(batch * est.live_bytes_per_image())} inference"
    )
