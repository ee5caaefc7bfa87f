"""Box conversions between named formats, IoU, and the evaluation helpers (``scale_coords``,
``clip_coords``, ``non_max_suppression``).

Formats used throughout the project:

- ``xyxy``: (x1, y1, x2, y2) corners.
- ``cxcywh`` (the YOLO label format, also called ``xywh`` in ultralytics/yolov3): centre and size.
- ``...n`` suffix: normalised to [0, 1] by the image width and height; otherwise absolute pixels.

The conversions and ``clip_coords``/``scale_coords`` accept ``(N, 4)`` arrays (``np.ndarray`` or
``torch.Tensor``) and return a new array of the same type; the input is never modified, and so
does ``wh_iou``. The other IoU helpers and ``non_max_suppression`` take tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch
import torchvision

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


def _empty_like(x: ArrayT) -> ArrayT:
    return x.clone() if isinstance(x, torch.Tensor) else np.copy(x)


def xywhn2xyxy(x: ArrayT, w: float, h: float) -> ArrayT:
    """(N, 4) normalised cxcywh -> (N, 4) absolute xyxy in an image of size (w, h)."""
    y = _empty_like(x)
    y[:, 0] = w * (x[:, 0] - x[:, 2] / 2)
    y[:, 1] = h * (x[:, 1] - x[:, 3] / 2)
    y[:, 2] = w * (x[:, 0] + x[:, 2] / 2)
    y[:, 3] = h * (x[:, 1] + x[:, 3] / 2)
    return y


def xyxy2xywhn(x: ArrayT, w: float, h: float) -> ArrayT:
    """(N, 4) absolute xyxy -> (N, 4) cxcywh normalised by an image of size (w, h)."""
    y = _empty_like(x)
    y[:, 0] = (x[:, 0] + x[:, 2]) / 2 / w
    y[:, 1] = (x[:, 1] + x[:, 3]) / 2 / h
    y[:, 2] = (x[:, 2] - x[:, 0]) / w
    y[:, 3] = (x[:, 3] - x[:, 1]) / h
    return y


# --------------------------------------------------------------------------------------------
# Evaluation helpers: IoU, coordinate mapping back to the original image, NMS.
# --------------------------------------------------------------------------------------------

# Boxes narrower or shorter than MIN_WH pixels, or wider or taller than MAX_WH pixels, are
# dropped before NMS (ultralytics/yolov3's min_wh/max_wh): the former are noise, the latter are
# diverged predictions that would otherwise suppress everything around them.
MIN_WH = 2.0
MAX_WH = 4096.0


def wh_iou(wh1: ArrayT, wh2: ArrayT) -> ArrayT:
    """Pairwise IoU of boxes that share the same centre, from their sizes only.

    Used to match targets to anchors (the loss) and to fit anchors to label sizes (anchor
    k-means). Args: ``wh1: (N, 2)``, ``wh2: (M, 2)`` widths and heights in the same units,
    both tensors or both arrays. Returns the ``(N, M)`` IoU matrix of the same type.
    """
    wh1 = wh1[:, None]  # (N, 1, 2)
    wh2 = wh2[None]  # (1, M, 2)
    inter = wh1.clip(max=wh2).prod(2)  # the elementwise minimum, for tensors and arrays
    return inter / (wh1.prod(2) + wh2.prod(2) - inter)


# torchvision's generalized_box_iou_loss's epsilon: the same values, to the last bit.
GIOU_EPS = 1e-7


def paired_giou(boxes1: torch.Tensor, boxes2: torch.Tensor) -> torch.Tensor:
    """Generalised IoU of ``boxes1[i]`` with ``boxes2[i]``: (P, 4) xyxy each -> (P,).

    ``1 - torchvision.ops.generalized_box_iou_loss`` computes the same values, but it writes the
    intersection through a boolean mask, which on CUDA waits for the GPU (a host sync) at every
    call: the loss calls this once per head per step. A clamp at 0 gives the same intersection
    without one. Half-precision boxes are computed in float32, as torchvision does.
    """
    full = (torch.float32, torch.float64)
    boxes1 = boxes1 if boxes1.dtype in full else boxes1.float()
    boxes2 = boxes2 if boxes2.dtype in full else boxes2.float()
    x1, y1, x2, y2 = boxes1.unbind(-1)
    x1g, y1g, x2g, y2g = boxes2.unbind(-1)
    inter_w = (torch.min(x2, x2g) - torch.max(x1, x1g)).clamp(min=0)
    inter_h = (torch.min(y2, y2g) - torch.max(y1, y1g)).clamp(min=0)
    inter = inter_w * inter_h
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + GIOU_EPS)
    hull = (torch.max(x2, x2g) - torch.min(x1, x1g)) * (torch.max(y2, y2g) - torch.min(y1, y1g))
    return iou - (hull - union) / (hull + GIOU_EPS)


def clip_coords(boxes: ArrayT, shape_hw: tuple[int, int] | tuple[float, float]) -> ArrayT:
    """Clip (N, 4) xyxy pixel boxes to an image of ``shape_hw = (height, width)``, into a new
    array (ultralytics/yolov3 clipped in place)."""
    h, w = shape_hw[0], shape_hw[1]
    y = _empty_like(boxes)
    y[:, [0, 2]] = boxes[:, [0, 2]].clip(0, w)  # Tensor.clip is clamp
    y[:, [1, 3]] = boxes[:, [1, 3]].clip(0, h)
    return y


def scale_coords(
    img1_shape: tuple[int, int],
    coords: ArrayT,
    img0_shape: tuple[int, int],
    ratio_pad: tuple[tuple[float, float], tuple[float, float]] | None = None,
) -> ArrayT:
    """Map xyxy boxes from the letterboxed network input back to the original image.

    Args:
        img1_shape: (h, w) of the letterboxed image the boxes live in.
        coords: (N, >=4) boxes, columns 0..3 xyxy pixels in ``img1_shape``; further columns
            (confidence, class) are copied unchanged.
        img0_shape: (h0, w0) of the original image.
        ratio_pad: ``((gain_h, gain_w), (padw, padh))`` as recorded by the dataset in
            ``shapes[1]``. Each axis uses its own gain: letterbox rounds the resized sides to
            whole pixels, so the two differ slightly (ultralytics/yolov3 used ``gain_h`` for both,
            up to ~1 px off at the far edge). When ``None`` it is recomputed assuming a
            centred letterbox: ``gain = min(h1 / h0, w1 / w0)``.

    Returns:
        A new array of the input's type, boxes xyxy in original-image pixels clipped to it.
    """
    if ratio_pad is None:
        gain_h = gain_w = min(img1_shape[0] / img0_shape[0], img1_shape[1] / img0_shape[1])
        padw = (img1_shape[1] - img0_shape[1] * gain_w) / 2
        padh = (img1_shape[0] - img0_shape[0] * gain_h) / 2
    else:
        gain_h, gain_w = ratio_pad[0]
        padw, padh = ratio_pad[1]
    y = _empty_like(coords)
    y[:, [0, 2]] = (coords[:, [0, 2]] - padw) / gain_w
    y[:, [1, 3]] = (coords[:, [1, 3]] - padh) / gain_h
    y[:, :4] = clip_coords(y[:, :4], img0_shape)
    return y


def non_max_suppression(
    prediction: torch.Tensor,
    conf_thres: float = 0.1,
    iou_thres: float = 0.6,
    multi_label: bool = True,
    classes: Sequence[int] | None = None,
    agnostic: bool = False,
    max_det: int = 300,
    max_nms: int = 30000,
) -> list[torch.Tensor]:
    """Confidence filtering and per-class non-maximum suppression.

    Args:
        prediction: (bs, N, 5 + nc) decoded network output: cxcywh in input pixels, objectness
            and per-class scores, all already passed through sigmoid.
        conf_thres: a box is considered when ``obj > conf_thres``, and a (box, class) pair is a
            candidate when ``conf = obj * cls > conf_thres``.
        iou_thres: a candidate is suppressed when its IoU with a higher-confidence kept
            candidate of the same class (of any class when ``agnostic``) is greater than this.
        multi_label: every class of a box whose confidence passes ``conf_thres`` is a candidate
            (better mAP); otherwise only the box's best class is (and the box is dropped when
            that class is excluded by ``classes``, as in ultralytics/yolov3). Ignored when nc == 1.
        classes: keep only these class ids; ``None`` keeps all.
        agnostic: suppress across classes.
        max_det: at most this many detections per image, highest confidence first.
        max_nms: at most this many candidates per image (highest confidence first) take part
            in NMS; bounds the work when an untrained model puts thousands of boxes above a
            low threshold.

    Boxes narrower or shorter than ``MIN_WH`` or wider or taller than ``MAX_WH`` pixels are
    dropped first. There is no time limit, and every image gets an entry.

    Returns:
        One tensor per image: (n, 6) = x1, y1, x2, y2 (input pixels), confidence, class id (as a
        float), sorted by decreasing confidence; (0, 6) when nothing is left.
    """
    nc = prediction.shape[2] - 5
    multi_label = multi_label and nc > 1
    class_mask = None
    if classes is not None:
        class_mask = torch.zeros(nc, dtype=torch.bool, device=prediction.device)
        class_mask[torch.as_tensor(list(classes), dtype=torch.long, device=prediction.device)] = (
            True
        )
    return [
        _nms_one_image(
            x, nc, conf_thres, iou_thres, multi_label, class_mask, agnostic, max_det, max_nms
        )
        for x in prediction
    ]


# First candidate prefix tried by NMS, in multiples of max_det (see _nms_one_image), and how
# fast the prefix grows when it did not yield max_det detections.
_NMS_PREFIX_START = 2
_NMS_PREFIX_GROWTH = 4


def _nms_one_image(
    x: torch.Tensor,
    nc: int,
    conf_thres: float,
    iou_thres: float,
    multi_label: bool,
    class_mask: torch.Tensor | None,
    agnostic: bool,
    max_det: int,
    max_nms: int,
) -> torch.Tensor:
    """NMS for one image: ``x: (N, 5 + nc)`` as in :func:`non_max_suppression`; (n, 6) out."""
    empty = x.new_zeros((0, 6))
    # Cheap objectness and size filters first, so that the (n, nc) product below is small.
    x = x[x[:, 4] > conf_thres]
    wh = x[:, 2:4]
    x = x[((wh >= MIN_WH) & (wh <= MAX_WH)).all(1)]
    if x.shape[0] == 0:
        return empty

    scores = x[:, 5:] * x[:, 4:5]  # conf = obj * cls, (n, nc)
    if multi_label:
        valid = scores > conf_thres
        if class_mask is not None:
            valid &= class_mask
        flat = scores.masked_fill(~valid, -torch.inf).view(-1)  # candidate = box * nc + class
        best_cls = None
    else:
        flat, best_cls = scores.max(1)
        valid = flat > conf_thres
        if class_mask is not None:
            valid &= class_mask[best_cls]
        flat = flat.masked_fill(~valid, -torch.inf)
    n_cand = int(valid.sum())
    if n_cand == 0:
        return empty
    limit = min(n_cand, max_nms)
    boxes_all = torchvision.ops.box_convert(x[:, :4], "cxcywh", "xyxy")

    # Greedy NMS decides each candidate from higher-confidence candidates only, so NMS on the
    # top-m candidates keeps exactly the full result's members among them. Once that prefix
    # yields max_det detections they are the final answer; this turns the dense early-training
    # case (hundreds of thousands of candidates) into NMS over a few hundred. The prefix grows
    # geometrically when suppression is heavy, up to the max_nms cap.
    m = min(limit, max(_NMS_PREFIX_START * max_det, 1))
    while True:
        # topk never reaches the -inf non-candidates because m <= n_cand.
        conf, idx = flat.topk(m)
        if best_cls is None:
            rows, cls = idx // nc, idx % nc
        else:
            rows, cls = idx, best_cls[idx]
        boxes = boxes_all[rows]
        groups = torch.zeros_like(cls) if agnostic else cls
        keep = torchvision.ops.batched_nms(boxes, conf, groups, iou_thres)
        if keep.shape[0] >= max_det or m == limit:
            break
        m = min(limit, m * _NMS_PREFIX_GROWTH)
    keep = keep[:max_det]
    return torch.cat((boxes[keep], conf[keep, None], cls[keep, None].to(boxes.dtype)), 1)
