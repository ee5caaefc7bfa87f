"""The Darknet network built from a parsed cfg.

Each cfg block becomes one entry of ``module_list`` through the ``BUILDERS`` table; module
names inside an entry (``Conv2d``, ``BatchNorm2d``, ``activation``) follow the ultralytics
Darknet-cfg era of ultralytics/yolov3 so that its ``.pt`` checkpoints load with ``strict=True``.

While building, every layer's output channels and cumulative downsampling (stride, as
``(sy, sx)`` input pixels per output pixel) are tracked: convolutions and max-pools multiply the
stride, upsampling divides it and a route takes that of the layers it references. Each YOLO
head's stride is read from there, never assumed (YOLOv4's heads come in the order 8, 16, 32).

Every layer computes what Darknet's does for the same cfg and ``.weights`` (checked against
OpenCV's independent Darknet importer on all of ``cfg/darknet/``,
tests/models/test_darknet_opencv.py):
BatchNorm epsilon 1e-5, max-pooling padded with -inf (:class:`~models.layers.DarknetMaxPool`),
``new_coords`` heads, ``stopbackward``.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval
from torch.utils.flop_counter import FlopCounterMode

from build_utils.errors import ConfigError
from build_utils.parse_config import (
    CONV_DEFAULTS,
    DEFAULT_DROPOUT,
    DEFAULT_UPSAMPLE_STRIDE,
    Block,
    head_conv_index,
    layer_error,
    layer_refs,
    maxpool_params,
    parse_model_cfg,
    rewrite_cfg_classes,
    stride_pair,
    validate_model_cfg,
    yolo_classes,
    yolo_mask,
)
from models.budget import check_model_fits
from models.darknet_bn import DARKNET_BN_EPS
from models.layers import (
    DarknetMaxPool,
    FeatureConcat,
    StopGradient,
    WeightedFeatureFusion,
    YOLOLayer,
    make_activation,
)

LOGGER = logging.getLogger(__name__)

# BatchNorm running-statistics momentum of ultralytics/yolov3 (training only).
BN_MOMENTUM = 0.03
# BatchNorm epsilon. Darknet normalises with (x - mean) / sqrt(var + 1e-5) (src/blas.c
# normalize_cpu), so DARKNET_BN_EPS is the default: official .weights then give Darknet's numbers.
# The ultralytics/yolov3 trained its .pt checkpoints with 1e-4; a cfg with `bn_eps=0.0001` in
# [net] (or Darknet(..., bn_eps=1e-4)) reproduces those exactly.
ULTRALYTICS_BN_EPS = 1e-4
# Darknet's default [net] batch: stopbackward=N counts iterations of this many images.
DEFAULT_NET_BATCH = 1

# Head bias priors (focal-loss paper, https://arxiv.org/abs/1708.02002 section 3.3), as in the
# ultralytics yolov3 archive and the yolov3_spp tutorial repository: objectness starts at
# sigmoid(-4.5) ~ 0.011 so that the many background cells do not swamp the first steps, class
# logits at log(0.6 / (nc - 0.99)).
OBJ_BIAS_PRIOR = -4.5
CLS_BIAS_PRIOR_NUM = 0.6
CLS_BIAS_PRIOR_OFFSET = 0.99


Stride = tuple[float, float]


@dataclass
class _State:
    """What a builder knows about the network built so far."""

    index: int  # index of the layer being built (module_list index)
    channels: list[int]  # output channels of each layer built so far
    strides: list[Stride]  # cumulative downsampling of each layer built so far
    in_channels: int  # channels of this layer's input
    in_stride: Stride  # downsampling of this layer's input
    bn_eps: float


@dataclass
class _Built:
    module: nn.Module
    channels: int
    stride: Stride


def _build_conv(mdef: Block, st: _State) -> _Built:
    c = {**CONV_DEFAULTS, **mdef}
    filters, k, groups = c["filters"], c["size"], c["groups"]
    sy, sx = stride_pair(mdef, CONV_DEFAULTS["stride"])
    if st.in_channels % groups or filters % groups:
        raise layer_error(
            mdef,
            f"groups={groups} must divide both the input channels ({st.in_channels}) and "
            f"filters ({filters})",
            "groups",
        )
    bn = bool(c["batch_normalize"])
    seq = nn.Sequential()
    seq.add_module(
        "Conv2d",
        nn.Conv2d(
            st.in_channels,
            filters,
            kernel_size=k,
            stride=(sy, sx) if sy != sx else sy,
            # Darknet: pad=1 means "same" padding (size // 2); otherwise `padding` pixels.
            padding=k // 2 if c["pad"] else c["padding"],
            groups=groups,
            bias=not bn,
        ),
    )
    if bn:
        seq.add_module("BatchNorm2d", nn.BatchNorm2d(filters, momentum=BN_MOMENTUM, eps=st.bn_eps))
    act = make_activation(c["activation"])
    if act is not None:
        seq.add_module("activation", act)
    return _Built(seq, filters, (st.in_stride[0] * sy, st.in_stride[1] * sx))


def _build_maxpool(mdef: Block, st: _State) -> _Built:
    k, sy, sx, padding = maxpool_params(mdef)
    module = DarknetMaxPool(k, (sy, sx), padding)
    return _Built(module, st.in_channels, (st.in_stride[0] * sy, st.in_stride[1] * sx))


def _build_upsample(mdef: Block, st: _State) -> _Built:
    s = mdef.get("stride", DEFAULT_UPSAMPLE_STRIDE)
    return _Built(
        nn.Upsample(scale_factor=s, mode="nearest"),
        st.in_channels,
        (st.in_stride[0] / s, st.in_stride[1] / s),
    )


def _build_route(mdef: Block, st: _State) -> _Built:
    layers = layer_refs(mdef, st.index)
    groups, group_id = mdef.get("groups", 1), mdef.get("group_id", 0)
    strides = {st.strides[j] for j in layers}
    if len(strides) > 1:
        detail = ", ".join(f"layer {j}: /{st.strides[j][1]:g}" for j in layers)
        raise layer_error(
            mdef, f"layers={mdef['layers']} have different resolutions ({detail})", "layers"
        )
    for j in layers:
        if st.channels[j] % groups:
            raise layer_error(
                mdef,
                f"groups={groups} does not divide the {st.channels[j]} channels of layer {j}",
                "groups",
            )
    channels = sum(st.channels[j] for j in layers) // groups
    return _Built(FeatureConcat(layers, groups, group_id), channels, st.strides[layers[0]])


def _build_shortcut(mdef: Block, st: _State) -> _Built:
    layers = layer_refs(mdef, st.index)
    for j in layers:
        if st.strides[j] != st.in_stride:
            raise layer_error(
                mdef,
                f"from={mdef['from']}: layer {j} is at /{st.strides[j][1]:g} but the input is at "
                f"/{st.in_stride[1]:g}",
                "from",
            )
    module = WeightedFeatureFusion(
        layers,
        weight=mdef.get("weights_type", "none") == "per_feature",
        activation=make_activation(mdef.get("activation", "linear")),
        channels=[st.in_channels, *(st.channels[j] for j in layers)],
    )
    return _Built(module, st.in_channels, st.in_stride)


def _build_dropout(mdef: Block, st: _State) -> _Built:
    return _Built(
        nn.Dropout(p=mdef.get("probability", DEFAULT_DROPOUT)), st.in_channels, st.in_stride
    )


def _build_yolo(mdef: Block, st: _State) -> _Built:
    mask = yolo_mask(mdef)
    nc = yolo_classes(mdef)
    anchors = torch.tensor(mdef["anchors"], dtype=torch.float32).view(-1, 2)[mask]
    sy, sx = st.in_stride
    if sy != sx or sy < 1:
        raise layer_error(
            mdef,
            f"the head's input is downsampled by {sy:g} x {sx:g}; a square stride >= 1 is needed",
        )
    expected = len(mask) * (nc + 5)
    if st.in_channels != expected:
        raise layer_error(
            mdef,
            f"the head's input has {st.in_channels} channels, expected len(mask) * (classes + 5) "
            f"= {expected}",
        )
    module = YOLOLayer(
        anchors,
        nc=nc,
        stride=sy,
        scale_x_y=mdef.get("scale_x_y", 1.0),
        new_coords=bool(mdef.get("new_coords", 0)),
    )
    return _Built(module, st.in_channels, st.in_stride)


BUILDERS: dict[str, Callable[[Block, _State], _Built]] = {
    "convolutional": _build_conv,
    "maxpool": _build_maxpool,
    "upsample": _build_upsample,
    "route": _build_route,
    "shortcut": _build_shortcut,
    "dropout": _build_dropout,
    "yolo": _build_yolo,
}


def _init_head_bias(module_list: nn.ModuleList, conv_index: int, head: YOLOLayer) -> None:
    """Add the objectness and class priors to the bias feeding ``head``."""
    seq = module_list[conv_index]
    target = seq.BatchNorm2d.bias if hasattr(seq, "BatchNorm2d") else seq.Conv2d.bias
    with torch.no_grad():
        b = target.view(head.na, head.no)
        b[:, 4] += OBJ_BIAS_PRIOR
        b[:, 5:] += math.log(CLS_BIAS_PRIOR_NUM / (head.nc - CLS_BIAS_PRIOR_OFFSET))


DEFAULT_IMG_SIZE = 416  # the side Darknet(cfg) assumes when no img_size is given


class Darknet(nn.Module):
    """YOLO network defined by a Darknet cfg.

    Args:
        cfg: a ``.cfg`` path, or parsed blocks (``[net]`` first) as returned by
            :func:`~build_utils.parse_config.parse_model_cfg` or ``rewrite_cfg_classes``; blocks
            are validated again and copied.
        img_size: (h, w) or one int; the default size for :meth:`info` and export.
        bn_eps: BatchNorm epsilon; default: the cfg's ``[net] bn_eps``, else Darknet's 1e-5
            (:data:`ULTRALYTICS_BN_EPS` = 1e-4 reproduces ultralytics/yolov3's ``.pt`` checkpoints).
        head_bias: add objectness and class priors to the biases feeding the heads (the
            ultralytics/yolov3 initialisation); Darknet starts them at 0 (``--recipe darknet``).

    Attributes:
        hyperparams: the ``[net]`` block. module_defs: the other blocks.
        module_list: one module per block. yolo_layers: indices of the heads in module_list.
        nc: classes. strides: input pixels per grid cell of each head, in head order.
        bn_eps: the BatchNorm epsilon in use.
        seen: images seen in training, read from and written to Darknet ``.weights`` headers.
        stopbackward: ``{layer index: value}`` of the layers with Darknet's ``stopbackward``.
            Value 1: that layer and all before it are frozen (no gradients, BatchNorm running
            statistics fixed, as Darknet builds them with ``train=0``). Value N > 1: for the
            first N iterations (``seen // [net] batch``, counted here in training-mode
            forwards) they get zero gradients, as in Darknet's GPU build.
        fused: True after :meth:`fuse` (inference only; no longer matches the cfg's state_dict).

    ``new_coords=1`` heads: the ``activation=logistic`` of the conv feeding the head is moved
    into the :class:`~models.layers.YOLOLayer`, so raw outputs are logits for every head.

    Forward: ``x`` (bs, channels, H, W) float in [0, 1], H and W multiples of the largest
    stride. Training mode: list with one (bs, na, ny, nx, no) raw tensor per head. Eval mode:
    ``(det, raw)``, ``det`` (bs, N, no) = cx, cy, w, h in input pixels, sigmoid objectness,
    sigmoid class scores (1 when nc == 1), ``raw`` as in training mode.

    Raises:
        ConfigError: for a cfg that cannot be built (naming file:line), whose parameters do
            not fit the RAM available (:func:`~models.budget.check_model_fits`), or, when
            ``img_size`` is given, whose routes or shortcuts join maps of different sizes at it.
    """

    def __init__(
        self,
        cfg: str | os.PathLike[str] | list[Block],
        img_size: int | tuple[int, int] | None = None,
        bn_eps: float | None = None,
        head_bias: bool = True,
    ):
        super().__init__()
        if isinstance(cfg, (str, os.PathLike)):
            blocks = parse_model_cfg(cfg)
        else:
            blocks = validate_model_cfg(copy.deepcopy(list(cfg)))
        self.cfg_path: str | None = blocks[0].get("_path")
        # None: 416, a nominal size nobody asked for (FLOPs, export); the feature map sizes are
        # only held to a size the caller will run at.
        size = DEFAULT_IMG_SIZE if img_size is None else img_size
        self.img_size = (size, size) if isinstance(size, int) else tuple(size)
        self.hyperparams: Block = blocks[0]
        self.module_defs: list[Block] = blocks[1:]
        self.bn_eps = float(
            bn_eps if bn_eps is not None else blocks[0].get("bn_eps", DARKNET_BN_EPS)
        )
        # The weights are allocated on the CPU here: refuse, naming the layer, a cfg whose
        # parameters alone exceed the RAM (filters=1000000000 in a checkpoint's cfg asks for
        # 108 GB) before allocating them. Activations are checked by the callers, which know
        # the batch, the size and the device (models/budget.py).
        estimate = check_model_fits(blocks, self.img_size, params_only=True)
        self.module_list, self.routs = self._build(blocks, head_bias)
        if estimate.size_mismatch is not None and img_size is not None:
            raise estimate.size_mismatch  # forward() at img_size would fail in torch.cat / add
        self.yolo_layers: list[int] = [
            i for i, m in enumerate(self.module_list) if isinstance(m, YOLOLayer)
        ]
        if not self.yolo_layers:
            raise ConfigError(
                "the cfg has no [yolo] layer; a detection model needs one", self.cfg_path
            )
        heads = [self.module_list[i] for i in self.yolo_layers]
        ncs = {h.nc for h in heads}
        if len(ncs) > 1:
            raise layer_error(
                self.module_defs[self.yolo_layers[-1]],
                f"the [yolo] layers disagree on classes ({sorted(ncs)})",
                "classes",
            )
        self.nc: int = heads[0].nc
        self.strides: list[float] = [h.stride for h in heads]
        self.seen = 0
        self.fused = False
        self.stopbackward: dict[int, int] = {
            i: mdef["stopbackward"]
            for i, mdef in enumerate(self.module_defs)
            if mdef.get("stopbackward", 0) > 0
        }
        self._frozen_end = max((i for i, v in self.stopbackward.items() if v == 1), default=-1)
        # Layers kept out of training: stopbackward=1 and everything before it, plus what
        # freeze() adds; never a [yolo] layer (see freeze()).
        self.frozen: list[int] = self._without_heads(range(self._frozen_end + 1))
        for i in self.frozen:
            self.module_list[i].requires_grad_(False)

    def _build(self, blocks: list[Block], head_bias: bool) -> tuple[nn.ModuleList, list[bool]]:
        net = blocks[0]
        in_channels = net.get("channels", 3)
        module_list = nn.ModuleList()
        st = _State(0, [], [], in_channels, (1.0, 1.0), self.bn_eps)
        referenced: set[int] = set()
        for i, mdef in enumerate(blocks[1:]):
            st.index = i
            built = BUILDERS[mdef["type"]](mdef, st)
            module_list.append(built.module)
            st.channels.append(built.channels)
            st.strides.append(built.stride)
            st.in_channels, st.in_stride = built.channels, built.stride
            if isinstance(built.module, (FeatureConcat, WeightedFeatureFusion)):
                referenced.update(built.module.layers)
            if isinstance(built.module, YOLOLayer):
                j = head_conv_index(blocks, i + 1)
                if j is not None and head_bias:
                    _init_head_bias(module_list, j - 1, built.module)
                if built.module.new_coords:
                    # The cfg validator made sure this is the conv's logistic activation; the
                    # head applies it to the logits instead (see YOLOLayer).
                    del module_list[j - 1].activation
        # Only outputs some later layer reads are kept during forward.
        routs = [i in referenced for i in range(len(module_list))]
        return module_list, routs

    def _stop_gradient_at(self) -> int:
        """Index of the last layer whose gradients ``stopbackward=N > 1`` zeroes now, or -1.
        Darknet (GPU) skips the backward pass from that layer down while its iteration count,
        images seen / ``[net] batch``, is below N."""
        if not (self.training and torch.is_grad_enabled()):
            return -1
        iteration = self.seen // max(1, self.hyperparams.get("batch", DEFAULT_NET_BATCH))
        active = [i for i, v in self.stopbackward.items() if v > 1 and iteration < v]
        return max(active) if max(active, default=-1) > self._frozen_end else -1

    def forward(
        self, x: torch.Tensor
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """See the class docstring for shapes and conventions."""
        stop_at = self._stop_gradient_at()
        if stop_at >= 0:
            # Counted only while needed: a Python counter read in forward would make
            # torch.compile recompile on every step.
            self.seen += x.shape[0]
        outputs: list[torch.Tensor | None] = []
        yolo_out = []
        for i, (module, keep) in enumerate(zip(self.module_list, self.routs)):
            if isinstance(module, (FeatureConcat, WeightedFeatureFusion)):
                x = module(x, outputs)
            elif isinstance(module, YOLOLayer):
                # The head does not change x: a later route reads the conv output through it.
                yolo_out.append(module(x))
            else:
                x = module(x)
            outputs.append(x if keep else None)
            if i == stop_at:
                # Every later use of these outputs passes through the gradient stop.
                x = StopGradient.apply(x)
                outputs = [o if o is None else StopGradient.apply(o) for o in outputs]
        if self.training:
            return yolo_out
        det, raw = zip(*yolo_out)
        return torch.cat(det, 1), list(raw)

    def fuse(self) -> Darknet:
        """Fold each BatchNorm2d into its Conv2d, in place, for inference.

        The fused model's outputs equal the unfused model's in eval mode (to float rounding).
        Its state_dict no longer matches the cfg's (no BatchNorm2d keys, conv biases instead):
        save checkpoints and ``.weights`` before fusing.
        """
        with torch.no_grad():
            for i, m in enumerate(self.module_list):
                if not (isinstance(m, nn.Sequential) and hasattr(m, "BatchNorm2d")):
                    continue
                seq = nn.Sequential()
                # eval(): the library refuses modules in training mode; these are replaced.
                conv = fuse_conv_bn_eval(m.Conv2d.eval(), m.BatchNorm2d.eval())
                seq.add_module("Conv2d", conv)
                if hasattr(m, "activation"):
                    seq.add_module("activation", m.activation)
                self.module_list[i] = seq
        self.fused = True
        return self

    def info(
        self, img_size: int | tuple[int, int] | None = None, verbose: bool = False
    ) -> tuple[int, float]:
        """Log a layer table (at INFO with ``verbose``, else DEBUG), the parameter count and
        GFLOPs.

        GFLOPs are counted by ``torch.utils.flop_counter`` for one image of ``img_size`` (h, w)
        (default: ``self.img_size``), counting a multiply-add as 2 FLOPs.

        Returns:
            (number of parameters, GFLOPs per image).
        """
        size = img_size if img_size is not None else self.img_size
        h, w = (size, size) if isinstance(size, int) else size
        n_params = sum(p.numel() for p in self.parameters())
        n_grad = sum(p.numel() for p in self.parameters() if p.requires_grad)
        shapes: dict[int, tuple[int, ...]] = {}
        hooks = [
            m.register_forward_hook(
                lambda _m, _i, out, i=i: shapes.__setitem__(
                    i, tuple((out[1] if isinstance(out, tuple) else out).shape)
                )
            )
            for i, m in enumerate(self.module_list)
        ]
        p0 = next(self.parameters())
        was_training = self.training
        self.eval()
        try:
            counter = FlopCounterMode(display=False)
            with torch.no_grad(), counter:
                self(
                    torch.zeros(
                        1,
                        self.hyperparams.get("channels", 3),
                        h,
                        w,
                        dtype=p0.dtype,
                        device=p0.device,
                    )
                )
        finally:
            for hk in hooks:
                hk.remove()
            self.train(was_training)
        gflops = counter.get_total_flops() / 1e9
        level = logging.INFO if verbose else logging.DEBUG
        LOGGER.log(level, "%5s %-14s %12s  %s", "layer", "type", "params", "output shape")
        for i, (mdef, m) in enumerate(zip(self.module_defs, self.module_list)):
            n = sum(p.numel() for p in m.parameters())
            LOGGER.log(level, "%5d %-14s %12s  %s", i, mdef["type"], f"{n:,}", shapes.get(i))
        LOGGER.info(
            "Darknet: %d layers, %s parameters, %s gradients, %.1f GFLOPs at %dx%d (h x w)",
            len(self.module_list),
            f"{n_params:,}",
            f"{n_grad:,}",
            gflops,
            h,
            w,
        )
        return n_params, gflops

    def freeze(self, mode: str = "none") -> list[int]:
        """Stop training some layers: ``"none"``, ``"backbone"`` (up to :func:`backbone_end`)
        or ``"all-but-heads"`` (everything but the convolutions feeding the heads).

        Frozen layers get ``requires_grad=False`` and stay in eval mode through
        :meth:`train`, so their BatchNorm running statistics do not drift either
        (pytorch/pytorch#86590). Layers frozen by the cfg's ``stopbackward=1`` stay frozen.
        A ``[yolo]`` layer is never frozen: it has no parameters, and in eval mode it would
        decode boxes instead of returning the raw outputs the loss needs. Logs (INFO) what
        was frozen. Build the optimizer after freezing.

        Returns:
            The frozen ``module_list`` indices.

        Raises:
            ConfigError: an unknown mode.
        """
        stopped = range(self._frozen_end + 1)  # stopbackward=1 stays frozen whatever the mode
        self.frozen = self._without_heads(set(frozen_layer_indices(self, mode)) | set(stopped))
        for i in self.frozen:
            self.module_list[i].requires_grad_(False)
        self.train(self.training)
        if self.frozen:
            LOGGER.info("freeze %s: %s", mode, describe_frozen(self))
        return self.frozen

    def _without_heads(self, layers: Iterable[int]) -> list[int]:
        """``layers`` sorted, without the [yolo] layers."""
        heads = set(self.yolo_layers)
        return sorted(i for i in layers if i not in heads)

    def train(self, mode: bool = True) -> Darknet:
        """As ``nn.Module.train``, but frozen layers stay in eval mode (for ``stopbackward=1``
        as in Darknet, which builds them with ``train=0``)."""
        super().train(mode)
        for i in getattr(self, "frozen", ()):
            self.module_list[i].eval()
        return self


FREEZE_MODES = ("none", "backbone", "all-but-heads")
MAX_FREEZE_INDEX = 100_000  # a layer index in a freeze list (cfgs have hundreds of layers)


def head_layers(model: Darknet, yolo_index: int) -> range:
    """Layer indices of the head at ``yolo_index``: its feeding convolution, any [dropout] in
    between (:func:`~build_utils.parse_config.head_conv_index`) and the [yolo] layer itself."""
    conv = head_conv_index([{"type": "net"}, *model.module_defs], yolo_index + 1)
    return range(yolo_index - 1 if conv is None else conv - 1, yolo_index + 1)


def backbone_end(model: Darknet) -> int:
    """Index of the last backbone layer: the last [shortcut] before the first head (Darknet-53
    ends there: layer 74 of yolov3.cfg, ultralytics/yolov3's magic number), or, for networks without
    residual blocks, the layer before the first [route]; never the convolution that feeds a
    head or anything after it (yolov3-tiny: layer 14, Darknet's ``yolov3-tiny.conv.15``)."""
    first_yolo = min(model.yolo_layers)
    last_allowed = head_layers(model, first_yolo)[0] - 1  # not the head's own convolution
    defs = model.module_defs
    shortcuts = [i for i in range(first_yolo) if defs[i]["type"] == "shortcut"]
    if shortcuts:
        return min(shortcuts[-1], last_allowed)
    routes = [i for i in range(first_yolo) if defs[i]["type"] == "route"]
    return min(routes[0] - 1, last_allowed) if routes else last_allowed


def layer_list(mode: str) -> list[int] | None:
    """The layer indices of a freeze ``mode`` written as a list (``"0-9"``, ``"0,1,2"``, the
    form :func:`index_ranges` writes), else None.

    Raises:
        ConfigError: a list that is malformed or too long.
    """
    if not mode or not mode[0].isdigit():
        return None
    layers: set[int] = set()
    for part in mode.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ConfigError(f"freeze layers {mode!r}: write layer indices as 0-9 or 0,1,2")
        lo, hi = int(first), int(last or first)
        if hi < lo or hi >= MAX_FREEZE_INDEX:
            raise ConfigError(f"freeze layers {mode!r}: {part} is not a range of layer indices")
        layers.update(range(lo, hi + 1))
    return sorted(layers)


def frozen_layer_indices(model: Darknet, mode: str) -> list[int]:
    """``module_list`` indices that :meth:`Darknet.freeze` freezes for ``mode``: one of
    :data:`FREEZE_MODES` or a list of layers (``"0-9"``, YOLOv5's ``--freeze 10``)."""
    layers = layer_list(mode)
    if layers is not None:
        n = len(model.module_list)
        if layers[-1] >= n:
            raise ConfigError(f"freeze layers {mode!r}: the model has layers 0-{n - 1}")
        return layers
    if mode == "none":
        return []
    if mode == "backbone":
        return list(range(backbone_end(model) + 1))
    if mode == "all-but-heads":
        # The convolutions feeding the heads train; the heads themselves hold no parameters
        # and must stay in training mode (see Darknet.freeze).
        trained = {j for i in model.yolo_layers for j in head_layers(model, i)}
        return [i for i in range(len(model.module_list)) if i not in trained]
    raise ConfigError(
        f"unknown freeze mode {mode!r}; use one of {', '.join(FREEZE_MODES)} or layer indices "
        f"such as 0-9"
    )


def index_ranges(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_frozen(model: Darknet) -> str:
    """One line on ``model.frozen``: how many layers and parameters, and which layers."""
    n_layers = len(model.module_list)
    frozen = sum(p.numel() for i in model.frozen for p in model.module_list[i].parameters())
    total = sum(p.numel() for p in model.parameters())
    return (
        f"{len(model.frozen)} of {n_layers} layers frozen (layers {index_ranges(model.frozen)}), "
        f"{frozen:,} of {total:,} parameters; their BatchNorm statistics are kept (eval mode)"
    )


def model_blocks_for(cfg: str | Path | list[Block], nc: int, say: bool = True) -> list[Block]:
    """Parse ``cfg`` (a file, or blocks already parsed) and, when its heads are for another
    class count, rewrite them for ``nc`` (``say``: log it; one rank of several says it)."""
    blocks = cfg if isinstance(cfg, list) else parse_model_cfg(cfg)
    cfg_nc = sorted({yolo_classes(b) for b in blocks if b["type"] == "yolo"})
    if cfg_nc != [nc] and say:
        LOGGER.warning(
            "%s has classes=%s but the dataset has %d; rewriting the heads for %d classes",
            blocks[0].get("_path", "the cfg"),
            ",".join(map(str, cfg_nc)),
            nc,
            nc,
        )
    return blocks if cfg_nc == [nc] else rewrite_cfg_classes(blocks, nc)
