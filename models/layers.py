"""Layers of the cfg-built Darknet: activations, max-pooling (DarknetMaxPool), route
(FeatureConcat), shortcut (WeightedFeatureFusion) and the YOLO head (YOLOLayer).

Parameter and buffer names follow the Darknet-cfg era of ultralytics/yolov3 so that its checkpoints
load with ``strict=True``: the only parameter owned by these layers is ``w`` of a weighted
shortcut; anchors and grids are non-persistent buffers (absent from the state_dict).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# Darknet's leaky ReLU slope.
LEAKY_SLOPE = 0.1

# Activation name (as written in a cfg) -> module factory; "linear" means no module at all.
# Keep in sync with build_utils.parse_config.ACTIVATIONS (a test checks it).
ACTIVATION_FACTORIES: dict[str, Callable[[], nn.Module] | None] = {
    "leaky": lambda: nn.LeakyReLU(LEAKY_SLOPE, inplace=True),
    "mish": lambda: nn.Mish(inplace=True),
    "swish": lambda: nn.SiLU(inplace=True),
    "silu": lambda: nn.SiLU(inplace=True),
    "logistic": nn.Sigmoid,
    "relu": lambda: nn.ReLU(inplace=True),
    "relu6": lambda: nn.ReLU6(inplace=True),
    "elu": lambda: nn.ELU(inplace=True),
    "selu": lambda: nn.SELU(inplace=True),
    # Darknet's gelu is the tanh approximation.
    "gelu": lambda: nn.GELU(approximate="tanh"),
    "tanh": nn.Tanh,
    "linear": None,
}


def make_activation(name: str) -> nn.Module | None:
    """The activation module for a cfg name, or None for ``linear``.

    Raises:
        KeyError: unknown name (the cfg validator rejects those with a file:line message first).
    """
    factory = ACTIVATION_FACTORIES[name]
    return None if factory is None else factory()


class DarknetMaxPool(nn.Module):
    """Darknet ``[maxpool]`` (``src/maxpool_layer.c``): windows of ``size`` every ``stride``
    pixels, starting ``padding // 2`` pixels before the image, giving
    ``(n + padding - size) // stride + 1`` outputs per axis; positions outside the image never
    win a max (they are -inf).

    Only ``padding // 2`` pixels go before the image and the remainder after it, so
    ``size=2 stride=1`` (YOLOv3-tiny) pads one pixel on the right and bottom and keeps the grid.
    Zero padding there (ultralytics/yolov3's) would let 0 beat the many negative values a leaky
    activation leaves. Symmetric cases use ``MaxPool2d``'s own padding; the others pad with
    -inf explicitly, which exports to ONNX as a constant Pad followed by MaxPool.

    Args:
        size: window side. stride: ``(sy, sx)``. padding: Darknet's total padding per axis;
            ``(padding + 1) // 2 < size`` (the cfg validator checks it), so every window holds
            an input pixel.
    """

    def __init__(self, size: int, stride: tuple[int, int], padding: int):
        super().__init__()
        self.size = size
        self.stride = tuple(stride)
        self.padding = padding
        self.before = padding // 2
        sy, sx = self.stride
        self.pool = nn.MaxPool2d(
            kernel_size=size,
            stride=self.stride if sy != sx else sy,
            # MaxPool2d's own padding is -inf too, but only symmetric and at most size // 2.
            padding=self.before if self.symmetric() else 0,
        )

    def symmetric(self) -> bool:
        # An even padding p puts p / 2 pixels on each side: then MaxPool2d's output count
        # (n + p - size) // stride + 1 and window positions are Darknet's, on every input size.
        return self.padding % 2 == 0 and self.before <= self.size // 2

    def out_size(self, n: int, axis: int) -> int:
        """Darknet's output size along ``axis`` (0: height, 1: width) for an input of ``n``."""
        return (n + self.padding - self.size) // self.stride[axis] + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, c, h, w) -> (bs, c, out_size(h, 0), out_size(w, 1))."""
        if self.symmetric():
            return self.pool(x)
        h, w = x.shape[-2:]
        # Padding after the image: whatever the last window needs beyond it (negative: the
        # last input rows/columns are in no window, and pooling without padding drops them).
        after = [
            max(0, (self.out_size(n, a) - 1) * self.stride[a] + self.size - n - self.before)
            for a, n in enumerate((int(h), int(w)))
        ]
        if self.before or any(after):
            x = F.pad(x, (self.before, after[1], self.before, after[0]), value=float("-inf"))
        return self.pool(x)

    def extra_repr(self) -> str:
        return f"size={self.size}, stride={self.stride}, padding={self.padding}"


class StopGradient(torch.autograd.Function):
    """Identity forward; zero gradient backward (Darknet's ``stopbackward`` while it is active).

    Zeros rather than ``detach()``: every parameter still receives a (zero) gradient, which
    DistributedDataParallel requires, and optimiser weight decay keeps acting as in Darknet,
    whose update step also runs for layers that got no backward pass."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


class FeatureConcat(nn.Module):
    """Darknet ``[route]``: concatenate earlier layer outputs along channels.

    With ``groups > 1`` (YOLOv4-tiny) each referenced output is split into ``groups`` equal
    channel chunks and only chunk ``group_id`` is used.

    Args:
        layers: absolute indices of the referenced layers.
    """

    def __init__(self, layers: Sequence[int], groups: int = 1, group_id: int = 0):
        super().__init__()
        self.layers = list(layers)
        self.groups = groups
        self.group_id = group_id

    def forward(self, x: torch.Tensor, outputs: list[torch.Tensor | None]) -> torch.Tensor:
        """``outputs[i]``: (bs, c_i, h, w) -> (bs, sum(c_i) / groups, h, w)."""
        feats = [outputs[i] for i in self.layers]
        if self.groups > 1:
            feats = [f.chunk(self.groups, dim=1)[self.group_id] for f in feats]
        return feats[0] if len(feats) == 1 else torch.cat(feats, 1)

    def extra_repr(self) -> str:
        return f"layers={self.layers}, groups={self.groups}, group_id={self.group_id}"


class WeightedFeatureFusion(nn.Module):
    """Darknet ``[shortcut]``: add earlier layer outputs to the input (a residual connection).

    With ``weight=True`` (``weights_type=per_feature``) each of the ``n`` inputs is scaled by
    ``sigmoid(w) * 2 / n`` first, as ultralytics/yolov3 does (https://arxiv.org/abs/1911.09070).
    Inputs of different channel counts are added on their common leading channels, keeping the
    input's channel count, as Darknet does.

    Args:
        layers: absolute indices of the layers added to the input.
        weight: learn one fusion weight per input (parameter ``w``, shape ``(len(layers) + 1,)``).
        activation: applied after the sum (Darknet's ``activation=`` of the shortcut).
        channels: channel counts of the input and of each referenced layer, when known at build
            time; equal counts skip the per-call comparison (which ONNX tracing cannot record).
    """

    def __init__(
        self,
        layers: Sequence[int],
        weight: bool = False,
        activation: nn.Module | None = None,
        channels: Sequence[int] | None = None,
    ):
        super().__init__()
        self.layers = list(layers)
        self.weight = weight
        self.n = len(self.layers) + 1
        if weight:
            self.w = nn.Parameter(torch.zeros(self.n))
        self.act = activation
        self.same_channels = channels is not None and len(set(channels)) == 1

    def forward(self, x: torch.Tensor, outputs: list[torch.Tensor | None]) -> torch.Tensor:
        """``x``: (bs, c, h, w) -> (bs, c, h, w)."""
        w = torch.sigmoid(self.w) * (2 / self.n) if self.weight else None
        if w is not None:
            x = x * w[0]
        nx = x.shape[1]
        for k, i in enumerate(self.layers):
            a = outputs[i]
            if w is not None:
                a = a * w[k + 1]
            if self.same_channels:
                x = x + a
                continue
            na = a.shape[1]
            if na == nx:
                x = x + a
            elif nx > na:
                # Not in place: x may be a stored output another route still needs.
                x = torch.cat((x[:, :na] + a, x[:, na:]), 1)
            else:
                x = x + a[:, :nx]
        return self.act(x) if self.act is not None else x

    def extra_repr(self) -> str:
        return f"layers={self.layers}, weight={self.weight}"


class YOLOLayer(nn.Module):
    """Darknet ``[yolo]`` head: reshapes the preceding conv's output and decodes boxes.

    Attributes:
        na: anchors of this head; nc: classes; no: ``nc + 5`` outputs per anchor.
        stride: input pixels per grid cell (from the network's downsampling).
        anchors: buffer ``(na, 2)``, anchor w, h in input pixels.
        anchor_vec: buffer ``(na, 2)``, ``anchors / stride`` (grid units).
        scale_x_y: Darknet's ``scale_x_y`` (1 = plain sigmoid offsets).
        new_coords: Darknet's ``new_coords=1`` (Scaled-YOLOv4, YOLOv7): ``wh`` is
            ``(2 * sigmoid(t_wh)) ** 2 * anchors`` instead of ``exp(t_wh) * anchors``. Darknet
            takes the sigmoid in the conv before the head (``activation=logistic``); the model
            builder moves that sigmoid in here, so that this head, like the others, sees and
            returns logits (the loss needs them for a stable BCE).
    """

    def __init__(
        self,
        anchors: torch.Tensor | Sequence[Sequence[float]],
        nc: int,
        stride: float,
        scale_x_y: float = 1.0,
        new_coords: bool = False,
    ):
        super().__init__()
        anchors = torch.as_tensor(anchors, dtype=torch.float32).reshape(-1, 2)
        self.na = anchors.shape[0]
        self.nc = nc
        self.no = nc + 5
        self.stride = float(stride)
        self.scale_x_y = float(scale_x_y)
        self.new_coords = bool(new_coords)
        # Non-persistent: they follow .to(device) but stay out of the state_dict, whose keys must
        # match ultralytics/yolov3's checkpoints exactly.
        self.register_buffer("anchors", anchors, persistent=False)
        self.register_buffer("anchor_vec", anchors / self.stride, persistent=False)
        self.grid: torch.Tensor | None = None  # (1, 1, ny, nx, 2) cell offsets, built lazily

    def _grid(self, ny: int, nx: int, like: torch.Tensor) -> torch.Tensor:
        g = self.grid
        if (
            g is None
            or g.shape[2:4] != (ny, nx)
            or g.device != like.device
            or g.dtype != like.dtype
        ):
            yv, xv = torch.meshgrid(
                torch.arange(ny, device=like.device, dtype=like.dtype),
                torch.arange(nx, device=like.device, dtype=like.dtype),
                indexing="ij",
            )
            g = torch.stack((xv, yv), 2).view(1, 1, ny, nx, 2)
            self.grid = g
        return g

    def forward(self, p: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Args:
            p: (bs, na * no, ny, nx) raw conv output.

        Returns:
            training: (bs, na, ny, nx, no) raw logits.
            eval: ``(det, raw)`` with ``det`` (bs, na * ny * nx, no): cx, cy, w, h in input
            pixels, sigmoid objectness, sigmoid class scores (all 1 when ``nc == 1``), in the
            model's dtype (float32 under autocast, see :meth:`decode`), and ``raw`` as in
            training.
        """
        bs, _, ny, nx = p.shape
        p = p.view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
        if self.training:
            return p
        return self.decode(p).view(bs, -1, self.no), p

    def decode(self, p: torch.Tensor) -> torch.Tensor:
        """(bs, na, ny, nx, no) raw logits -> the same shape decoded (see :meth:`forward`):
        ``xy = (sigmoid(t_xy) * s - (s - 1) / 2 + grid) * stride``, ``wh = exp(t_wh) * anchors``
        (``new_coords``: ``wh = (2 * sigmoid(t_wh)) ** 2 * anchors``, Darknet's
        ``get_yolo_box``). Built without in-place writes so that it traces cleanly for ONNX
        export.

        Computed in float32 (float64 for a float64 model) whatever ``p`` is: under autocast
        ``p`` is bf16 (8 significant bits) or fp16 (11), and ``(xy + grid) * stride`` in bf16
        rounds a centre near 600 px to a multiple of 4 px. The result has the dtype of the
        model's own tensors (its anchors): float32 under autocast, float16 for a ``.half()``
        model (predict.py --half, fp16 export), rounded once at the end."""
        _, _, ny, nx, _ = p.shape
        out_dtype = self.anchors.dtype
        p = p.to(torch.promote_types(out_dtype, torch.float32))
        grid = self._grid(ny, nx, p)
        s = self.scale_x_y
        xy = torch.sigmoid(p[..., :2])
        if s != 1.0:
            xy = xy * s - (s - 1) / 2
        xy = (xy + grid) * self.stride
        anchor_wh = self.anchors.to(p.dtype).view(1, self.na, 1, 1, 2)
        if self.new_coords:
            wh = (2 * torch.sigmoid(p[..., 2:4])) ** 2 * anchor_wh
        else:
            wh = torch.exp(p[..., 2:4]) * anchor_wh
        obj = torch.sigmoid(p[..., 4:5])
        # A single-class model has no class choice to make: its score is the objectness alone.
        cls = torch.ones_like(p[..., 5:]) if self.nc == 1 else torch.sigmoid(p[..., 5:])
        return torch.cat((xy, wh, obj, cls), -1).to(out_dtype)

    def extra_repr(self) -> str:
        return (
            f"na={self.na}, nc={self.nc}, stride={self.stride:g}, scale_x_y={self.scale_x_y:g}, "
            f"new_coords={self.new_coords}"
        )
