"""Test-time augmentation (``--augment`` of ``predict.py`` and ``validation.py``), as the
ultralytics/yolov3 archive's ``Darknet.forward(x, augment=True)`` had it.

The batch is run three times: as it is, flipped left-right and scaled by 0.83, and scaled by
0.67. A scaled batch is resized (bilinear) and padded right and bottom with the letterbox grey
up to a multiple of the model's largest stride (the archive's ``scale_img``). Each pass's
detections are mapped back to the input's pixels (de-scaled, de-flipped) and all are
concatenated, so the caller's NMS merges them as one set of candidates.

De-scaling uses the ratio of the sizes actually produced (``int(h * s) / h`` per axis, not
``s``): bilinear resizing with ``align_corners=False`` maps pixel edges by exactly that ratio,
so a box found in a scaled pass lands where the same object is in the input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from build_utils.augmentations import PAD_VALUE

# (scale, left-right flip) of each pass, the archive's order: 1, flipped 0.83, 0.67.
TTA_PASSES: tuple[tuple[float, bool], ...] = ((1.0, False), (0.83, True), (0.67, False))
PAD_FILL = PAD_VALUE / 255  # letterbox grey in the model's [0, 1] input range
DEFAULT_STRIDE = 32  # a model without ``strides`` (not a Darknet) is padded to this multiple


def model_stride(model: nn.Module) -> int:
    """The multiple a scaled input's sides are padded to: the model's largest head stride."""
    model = getattr(model, "module", model)  # DDP wrapper
    strides: Sequence[float] = getattr(model, "strides", None) or [DEFAULT_STRIDE]
    return int(max(strides))


def scale_img(img: torch.Tensor, ratio: float, stride: int) -> tuple[torch.Tensor, float, float]:
    """``img (bs, 3, H, W)`` float resized by ``ratio`` and padded right/bottom with
    :data:`PAD_FILL` to multiples of ``stride``; also the exact ratios ``(rh, rw)`` the content
    was scaled by (``int(H * ratio) / H``, ``int(W * ratio) / W``)."""
    h, w = img.shape[2:]
    if ratio == 1.0:
        return img, 1.0, 1.0
    nh, nw = max(1, int(h * ratio)), max(1, int(w * ratio))
    out = F.interpolate(img, size=(nh, nw), mode="bilinear", align_corners=False)
    ph, pw = math.ceil(nh / stride) * stride, math.ceil(nw / stride) * stride
    out = F.pad(out, [0, pw - nw, 0, ph - nh], value=PAD_FILL)
    return out, nh / h, nw / w


def descale_pred(
    det: torch.Tensor, rh: float, rw: float, flipped: bool, width: int
) -> torch.Tensor:
    """Map ``det (bs, N, no)`` (cx, cy, w, h in the scaled, maybe flipped input's pixels) back
    to the pixels of the input of ``width`` columns it was made from; a new tensor."""
    det = det.clone()
    det[..., 0] /= rw
    det[..., 2] /= rw
    det[..., 1] /= rh
    det[..., 3] /= rh
    if flipped:
        det[..., 0] = width - det[..., 0]
    return det


def forward_augmented(
    model: nn.Module,
    x: torch.Tensor,
    stride: int | None = None,
    passes: Sequence[tuple[float, bool]] = TTA_PASSES,
) -> torch.Tensor:
    """Detections of ``model`` (eval mode: ``model(x)[0]`` is ``(bs, N, no)`` cxcywh in input
    pixels) over the augmented ``passes`` of ``x (bs, 3, H, W)``, in ``x``'s pixels,
    concatenated: ``(bs, N1 + N2 + N3, no)``. ``stride``: see :func:`model_stride`."""
    stride = model_stride(model) if stride is None else stride
    width = x.shape[3]
    outputs = []
    for ratio, flip in passes:
        xi = x.flip(3) if flip else x
        xi, rh, rw = scale_img(xi, ratio, stride)
        det = model(xi)[0]
        outputs.append(descale_pred(det, rh, rw, flip, width))
    return torch.cat(outputs, 1)


def detect(model: nn.Module, x: torch.Tensor, augment: bool = False) -> torch.Tensor:
    """``model``'s decoded detections ``(bs, N, no)`` for ``x``: one pass, or with ``augment``
    the test-time augmented passes of :func:`forward_augmented`. The one inference call of
    ``predict.py``, the evaluation engine and ``--task speed``."""
    return forward_augmented(model, x) if augment else model(x)[0]
