"""Box conversions between named formats.

Formats used throughout the project:

- ``xyxy``: (x1, y1, x2, y2) corners.
- ``cxcywh`` (the YOLO label format, also called ``xywh`` in the lineage): centre and size.
- ``...n`` suffix: normalised to [0, 1] by the image width and height; otherwise absolute pixels.

Every function accepts ``(N, 4)`` arrays (``np.ndarray`` or ``torch.Tensor``) and returns a new
array of the same type; the input is never modified.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


def _empty_like(x: ArrayT) -> ArrayT:
    return x.clone() if isinstance(x, torch.Tensor) else np.copy(x)


def xywh2xyxy(x: ArrayT) -> ArrayT:
    """(N, 4) cxcywh -> (N, 4) xyxy, same units."""
    y = _empty_like(x)
    y[:, 0] = x[:, 0] - x[:, 2] / 2
    y[:, 1] = x[:, 1] - x[:, 3] / 2
    y[:, 2] = x[:, 0] + x[:, 2] / 2
    y[:, 3] = x[:, 1] + x[:, 3] / 2
    return y


def xyxy2xywh(x: ArrayT) -> ArrayT:
    """(N, 4) xyxy -> (N, 4) cxcywh, same units."""
    y = _empty_like(x)
    y[:, 0] = (x[:, 0] + x[:, 2]) / 2
    y[:, 1] = (x[:, 1] + x[:, 3]) / 2
    y[:, 2] = x[:, 2] - x[:, 0]
    y[:, 3] = x[:, 3] - x[:, 1]
    return y


def xywhn2xyxy(x: ArrayT, w: float, h: float, padw: float = 0.0, padh: float = 0.0) -> ArrayT:
    """(N, 4) normalised cxcywh -> (N, 4) absolute xyxy in an image of size (w, h) placed at an
    offset of (padw, padh) pixels (letterbox padding or a mosaic tile's origin)."""
    y = _empty_like(x)
    y[:, 0] = w * (x[:, 0] - x[:, 2] / 2) + padw
    y[:, 1] = h * (x[:, 1] - x[:, 3] / 2) + padh
    y[:, 2] = w * (x[:, 0] + x[:, 2] / 2) + padw
    y[:, 3] = h * (x[:, 1] + x[:, 3] / 2) + padh
    return y


def xyxy2xywhn(x: ArrayT, w: float, h: float) -> ArrayT:
    """(N, 4) absolute xyxy -> (N, 4) cxcywh normalised by an image of size (w, h)."""
    y = _empty_like(x)
    y[:, 0] = (x[:, 0] + x[:, 2]) / 2 / w
    y[:, 1] = (x[:, 1] + x[:, 3]) / 2 / h
    y[:, 2] = (x[:, 2] - x[:, 0]) / w
    y[:, 3] = (x[:, 3] - x[:, 1]) / h
    return y
