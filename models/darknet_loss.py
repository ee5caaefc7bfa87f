"""The ``[yolo]`` layer as Darknet trains it (AlexeyAB/darknet ``src/yolo_layer.c``, CPU path of
``forward_yolo_layer``), vectorised in torch so that it can train on any device.

Darknet does not differentiate a loss: each ``[yolo]`` layer writes ``l.delta`` (minus the
gradient it wants for its input) by hand, and reports ``*l.cost``. :func:`yolo_delta` computes
both for one layer; :func:`darknet_yolo_loss` wraps it for autograd (forward: the cost;
backward: ``-delta`` to the layer's input), so that ``loss.backward()`` gives the network
Darknet's gradients; :class:`DarknetLoss` applies it to all heads of a model from the data
loader's targets. tests/models/test_darknet_loss.py checks both against the built Darknet.

What a layer does, per image (``b``), in Darknet's order:

1. Every prediction (anchor ``a`` of the mask, cell ``j, i``): its box against every truth
   (plain IoU); objectness delta ``obj_normalizer * (0 - obj)``, zeroed when the best IoU
   exceeds ``ignore_thresh`` and some class probability of the prediction exceeds 0.25
   (``objectness_smooth``: raised to ``obj_normalizer * (iou - obj)`` instead); above
   ``truth_thresh`` the prediction is trained as a positive of its best truth.
2. Every truth (up to ``max``, ending at the first with ``x == 0``, classes outside
   ``0..classes-1`` skipped): the best anchor over all ``num`` anchors of the layer by the IoU of
   centred boxes; if it is in this layer's mask, that anchor in the truth's centre cell is
   trained on it (box, objectness ``1``, classes); with ``iou_thresh < 1``, so is every other
   anchor of this layer whose centred ``iou_thresh_kind`` with the truth exceeds
   ``iou_thresh``, even when the best anchor belongs to another layer.
3. With ``iou_thresh < 1``, each box delta is divided by the number of classes with a positive
   delta at that anchor (truths of different classes sharing an anchor are averaged; those of
   one class add up).

Box deltas: ``mse`` regresses the raw ``tx, ty, tw, th`` targets scaled by
``(2 - w * h) * iou_normalizer``; ``iou/giou/diou/ciou`` use Darknet's hand-derived IoU
derivatives (``box.c dx_box_iou``), ``dw, dh`` times ``exp(t_wh)`` (not for ``new_coords``),
times ``iou_normalizer``, each clipped to ``max_delta``. Truths sharing an anchor accumulate.
The x, y deltas apply to the raw input as they are (Darknet's backward of ``[yolo]`` does not
multiply by the logistic's derivative). The cost (``show_details=1``, Darknet's default) is
``sum(delta ** 2)`` for ``mse``, else ``iou_normalizer * mean(1 - IoU)`` (``1 - GIoU`` for
giou) over the assignments plus ``obj_normalizer * sum(delta ** 2)`` of the non-box entries.
Nothing is normalised by the number of objects; Darknet's optimizer divides by the batch.

Known departures, all where Darknet's result depends on an exact float coincidence: a class
delta that is exactly 0 when a second truth reaches the same anchor (Darknet then rewrites all
class deltas), and a truth centre exactly on the right or bottom border (Darknet writes outside
the layer; here the last cell). The GPU-only keys (``delta_normalizer``), the ``map`` key, the
adversarial branch and Darknet's bad-label rejection (``[net]`` ``equidistant_point``,
``badlabels_*``, ``num_sigmas_reject_badlabels``) are not implemented.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from build_utils.parse_config import (
    DEFAULT_CLASSES,
    DEFAULT_MAX_BOXES,
    Block,
    c_float,
    layer_error,
    to_c_float,
    yolo_classes,
    yolo_mask,
)

# The iou_loss and iou_thresh_kind values of Darknet (src/parser.c parse_yolo).
IOU_LOSSES = ("mse", "iou", "giou", "diou", "ciou")
IOU_THRESH_KINDS = ("iou", "giou", "diou", "ciou")
# A class probability above this makes a prediction "match" for ignore_thresh (yolo_layer.c
# compare_yolo_class).
CLASS_MATCH_PROB = 0.25
FOCAL_ALPHA = 0.5  # delta_yolo_class's hard-coded alpha (gamma 2 is in the formula)
FOCAL_PT_EPS = 1e-15
CIOU_EPS = 1e-6
# Truth fields (yolo_delta's ``truths``): x, y, w, h normalized, class.
TRUTH_FIELDS = 5
# Elements of one IoU chunk (predictions x truths), so that a large batch with many truths
# does not allocate gigabytes at once.
_IOU_CHUNK = 1 << 24


# [yolo] gains of the deltas (a negative one climbs that part of the loss) and max_delta, the
# clip of the box deltas to +-max_delta (at 0 or below every box delta is that constant).
GAIN_KEYS = ("iou_normalizer", "obj_normalizer", "cls_normalizer")
# How YoloLossSpec.from_block reads a key of each field type (the rest it reads itself).
_FIELD_READERS = {"float": to_c_float, "bool": bool, "str": str}


@dataclass(frozen=True)
class YoloLossSpec:
    """One ``[yolo]`` layer's training keys with Darknet's defaults (floats rounded to float32
    as Darknet stores them).

    Attributes:
        anchors: all ``num`` anchors of the layer (Darknet's ``l.biases``), (w, h) in input
            pixels; ``mask`` picks this layer's.
        classes_multipliers: from ``counters_per_class`` (``max / count``, capped at
            ``max_delta``), or None.
    """

    anchors: tuple[tuple[float, float], ...]
    mask: tuple[int, ...]
    classes: int = DEFAULT_CLASSES
    ignore_thresh: float = to_c_float(0.5)
    truth_thresh: float = 1.0
    iou_thresh: float = 1.0
    iou_thresh_kind: str = "iou"
    iou_loss: str = "mse"
    iou_normalizer: float = to_c_float(0.75)
    obj_normalizer: float = 1.0
    cls_normalizer: float = 1.0
    max_delta: float = math.inf
    scale_x_y: float = 1.0
    new_coords: bool = False
    label_smooth_eps: float = 0.0
    objectness_smooth: bool = False
    focal_loss: bool = False
    classes_multipliers: tuple[float, ...] | None = None
    max_boxes: int = DEFAULT_MAX_BOXES
    show_details: bool = True

    @property
    def na(self) -> int:
        return len(self.mask)

    @property
    def outputs_per_anchor(self) -> int:
        return 5 + self.classes

    @classmethod
    def from_block(cls, block: Block) -> YoloLossSpec:
        """The spec of a parsed ``[yolo]`` block (:func:`build_utils.parse_config.parse_model_cfg`).

        Raises:
            ConfigError: naming the key's line: an unknown ``iou_loss`` or ``iou_thresh_kind``
                (Darknet would silently use iou), ``counters_per_class`` not listing one count
                per class, a ``map`` file, a negative ``max``, a negative gain
                (:data:`GAIN_KEYS`), a ``max_delta`` not above 0, either beyond float32 (Darknet
                would train on).
        """
        flat = block["anchors"]
        anchors = tuple((float(flat[k]), float(flat[k + 1])) for k in range(0, len(flat), 2))
        classes = yolo_classes(block)
        for key, names in (("iou_loss", IOU_LOSSES), ("iou_thresh_kind", IOU_THRESH_KINDS)):
            value = block.get(key)
            if value is not None and value not in names:
                raise layer_error(block, f"{key}={value} is not one of {', '.join(names)}", key)
        if "map" in block:
            raise layer_error(block, "map= (class id remapping) is not implemented", "map")
        max_boxes = int(block.get("max", DEFAULT_MAX_BOXES))
        if max_boxes < 0:
            raise layer_error(block, f"max={max_boxes} must be at least 0", "max")
        for key in (*GAIN_KEYS, "max_delta"):
            value = c_float(block, key, 1.0)
            if value < 0 or (key == "max_delta" and value == 0):
                above = "above" if key == "max_delta" else "at least"
                raise layer_error(block, f"{key}={block[key]} must be {above} 0", key)
        # The other keys with the fields' defaults: one copy (the field types are strings here:
        # annotations are postponed). Floats as Darknet reads them (float32).
        values = {
            f.name: _FIELD_READERS[f.type](block.get(f.name, f.default))
            for f in fields(cls)
            if f.type in _FIELD_READERS
        }
        multipliers = None
        if "counters_per_class" in block:
            counts = [max(1, int(c)) for c in block["counters_per_class"]]
            if len(counts) != classes:
                raise layer_error(
                    block,
                    f"counters_per_class lists {len(counts)} counts for classes={classes}",
                    "counters_per_class",
                )
            top = to_c_float(max(counts))
            multipliers = tuple(min(to_c_float(top / c), values["max_delta"]) for c in counts)
        return cls(
            anchors=anchors,
            mask=tuple(int(m) for m in yolo_mask(block)),
            classes=classes,
            classes_multipliers=multipliers,
            max_boxes=max_boxes,
            **values,
        )


# The [yolo] keys YoloLossSpec honours: its fields, named as their keys but for these two, and
# num (how many anchors it keeps); with the model's own (mask, anchors, classes, num, scale_x_y,
# new_coords). ``jitter`` and ``resize`` are the loader's (build_utils/darknet_augment.py);
# ``delta_normalizer`` acts only in Darknet's GPU build.
_KEY_OF_FIELD = {"classes_multipliers": "counters_per_class", "max_boxes": "max"}
YOLO_KEYS_HONOURED = (*(_KEY_OF_FIELD.get(f.name, f.name) for f in fields(YoloLossSpec)), "num")


def yolo_specs(blocks: Sequence[Block]) -> dict[int, YoloLossSpec]:
    """``{Darknet layer index: spec}`` of every ``[yolo]`` block of a parsed cfg (``[net]``
    first, so layer ``k`` is ``blocks[k + 1]``)."""
    return {k - 1: YoloLossSpec.from_block(b) for k, b in enumerate(blocks) if b["type"] == "yolo"}


class YoloDelta(NamedTuple):
    """What Darknet's ``forward_yolo_layer`` leaves behind for one layer.

    Attributes:
        delta: (batch, na * (5 + classes), h, w), Darknet's ``l.delta`` (minus the gradient).
        cost: scalar tensor, Darknet's ``*l.cost``.
        count: assignments made (truth-anchor pairs), Darknet's ``count``.
    """

    delta: torch.Tensor
    cost: torch.Tensor
    count: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Box math of src/box.c, elementwise over (..., 4) xywh tensors


def _edges(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, y, w, h = b.unbind(-1)
    return x - w / 2, x + w / 2, y - h / 2, y + h / 2


def _intersection_union(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    al, ar, at, ab = _edges(a)
    bl, br, bt, bb = _edges(b)
    w = torch.minimum(ar, br) - torch.maximum(al, bl)
    h = torch.minimum(ab, bb) - torch.maximum(at, bt)
    inter = torch.where((w < 0) | (h < 0), torch.zeros_like(w), w * h)
    return inter, a[..., 2] * a[..., 3] + b[..., 2] * b[..., 3] - inter


def _iou(inter: torch.Tensor, union: torch.Tensor) -> torch.Tensor:
    ok = (inter != 0) & (union != 0)
    return torch.where(ok, inter / torch.where(ok, union, torch.ones_like(union)), 0.0)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Darknet's ``box_iou`` of xywh boxes (0 without overlap or with an empty union)."""
    return _iou(*_intersection_union(a, b))


def _enclosing(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    al, ar, at, ab = _edges(a)
    bl, br, bt, bb = _edges(b)
    return torch.maximum(ar, br) - torch.minimum(al, bl), torch.maximum(ab, bb) - torch.minimum(
        at, bt
    )


def box_giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Darknet's ``box_giou``."""
    cw, ch = _enclosing(a, b)
    c = cw * ch
    inter, union = _intersection_union(a, b)
    iou = _iou(inter, union)
    safe_c = torch.where(c == 0, torch.ones_like(c), c)
    return torch.where(c == 0, iou, iou - (c - union) / safe_c)


def _distance_terms(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What DIoU and CIoU share: the IoU, the squared centre distance, the enclosing box's
    squared diagonal ``c``, and ``c`` with 1 where it is 0 (a divisor that never is)."""
    cw, ch = _enclosing(a, b)
    c = cw * cw + ch * ch
    d = (a[..., 0] - b[..., 0]) ** 2 + (a[..., 1] - b[..., 1]) ** 2
    return box_iou(a, b), d, c, torch.where(c == 0, torch.ones_like(c), c)


def box_diou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Darknet's ``box_diou`` (note its distance term ``(d / c) ** 0.6``)."""
    iou, d, c, safe_c = _distance_terms(a, b)
    return torch.where(c == 0, iou, iou - (d / safe_c) ** 0.6)


def _atan_gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``atan(w/h of b) - atan(w/h of a)``: the aspect-ratio term of CIoU."""
    return torch.atan(b[..., 2] / b[..., 3]) - torch.atan(a[..., 2] / a[..., 3])


def box_ciou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Darknet's ``box_ciou`` (``a`` the prediction, ``b`` the truth)."""
    iou, u, c, safe_c = _distance_terms(a, b)
    ar_loss = 4 / (math.pi * math.pi) * _atan_gap(a, b) ** 2
    alpha = ar_loss / (1 - iou + ar_loss + CIOU_EPS)
    return torch.where(c == 0, iou, iou - (u / safe_c + alpha * ar_loss))


_IOU_KIND = {"iou": box_iou, "giou": box_giou, "diou": box_diou, "ciou": box_ciou}


def dx_box_iou(pred: torch.Tensor, truth: torch.Tensor, kind: str) -> torch.Tensor:
    """Darknet's ``dx_box_iou``: its hand-derived derivative of the IoU (``kind`` iou, giou,
    diou or ciou) of ``pred`` with ``truth`` with respect to the prediction's x, y, w, h.

    Args:
        pred, truth: (..., 4) xywh, normalized.

    Returns:
        (..., 4) dx, dy, dw, dh (Darknet's ``dt, db, dl, dr`` fields, which hold these).
    """
    g = _PairGeometry.of(pred, truth)
    p_dt, p_db, p_dl, p_dr = _edge_partials(g, kind)
    p_dx, p_dy = p_dl + p_dr, p_dt + p_db
    p_dw, p_dh = p_dr - p_dl, p_db - p_dt
    if kind in ("diou", "ciou"):
        p_dx, p_dy, p_dw, p_dh = _with_distance_terms(g, kind, (p_dx, p_dy, p_dw, p_dh))
    return torch.stack((p_dx, p_dy, p_dw, p_dh), -1)


@dataclass(frozen=True)
class _PairGeometry:
    """What Darknet's ``dx_box_iou`` derives its partials from, for a prediction and a truth
    (each (...,) tensors; edges sorted: ``pred_t <= pred_b``, as Darknet's ``pred_t = fmin``)."""

    pred: torch.Tensor
    truth: torch.Tensor
    p_top: torch.Tensor  # the prediction's unsorted edges, which pick Darknet's corners
    p_bot: torch.Tensor
    p_left: torch.Tensor
    p_right: torch.Tensor
    pred_t: torch.Tensor
    pred_b: torch.Tensor
    pred_l: torch.Tensor
    pred_r: torch.Tensor
    t_top: torch.Tensor
    t_bot: torch.Tensor
    t_left: torch.Tensor
    t_right: torch.Tensor
    iw: torch.Tensor
    ih: torch.Tensor
    inter: torch.Tensor
    union: torch.Tensor
    giou_cw: torch.Tensor
    giou_ch: torch.Tensor

    @classmethod
    def of(cls, pred: torch.Tensor, truth: torch.Tensor) -> _PairGeometry:
        p_left, p_right, p_top, p_bot = _edges(pred)
        pred_t, pred_b = torch.minimum(p_top, p_bot), torch.maximum(p_top, p_bot)
        pred_l, pred_r = torch.minimum(p_left, p_right), torch.maximum(p_left, p_right)
        t_left, t_right, t_top, t_bot = _edges(truth)
        x_area = (pred_b - pred_t) * (pred_r - pred_l)
        xhat = (t_bot - t_top) * (t_right - t_left)
        ih = torch.minimum(pred_b, t_bot) - torch.maximum(pred_t, t_top)
        iw = torch.minimum(pred_r, t_right) - torch.maximum(pred_l, t_left)
        inter = iw * ih
        return cls(
            pred, truth, p_top, p_bot, p_left, p_right, pred_t, pred_b, pred_l, pred_r,
            t_top, t_bot, t_left, t_right, iw, ih, inter, x_area + xhat - inter,
            torch.maximum(pred_r, t_right) - torch.minimum(pred_l, t_left),
            torch.maximum(pred_b, t_bot) - torch.minimum(pred_t, t_top),
        )  # fmt: skip

    @property
    def no_overlap(self) -> torch.Tensor:
        return (self.iw <= 0) | (self.ih <= 0)


def _edge_partials(g: _PairGeometry, kind: str) -> tuple[torch.Tensor, ...]:
    """The IoU's (and for ``giou`` the GIoU term's) partials by the top, bottom, left and right
    edges, each picked by the unsorted edges as Darknet does."""
    zero = torch.zeros_like(g.iw)
    dx_t, dx_b = -(g.pred_r - g.pred_l), g.pred_r - g.pred_l
    dx_l, dx_r = -(g.pred_b - g.pred_t), g.pred_b - g.pred_t
    di_t = torch.where(g.pred_t > g.t_top, -g.iw, zero)
    di_b = torch.where(g.pred_b < g.t_bot, g.iw, zero)
    di_l = torch.where(g.pred_l > g.t_left, -g.ih, zero)
    di_r = torch.where(g.pred_r < g.t_right, g.ih, zero)
    du_t, du_b, du_l, du_r = dx_t - di_t, dx_b - di_b, dx_l - di_l, dx_r - di_r
    union, inter = g.union, g.inter
    pos_u = union > 0
    uu = torch.where(pos_u, union * union, torch.ones_like(union))

    def p_of(di: torch.Tensor, du: torch.Tensor) -> torch.Tensor:
        return torch.where(pos_u, (union * di - inter * du) / uu, zero)

    p_dt, p_db, p_dl, p_dr = p_of(di_t, du_t), p_of(di_b, du_b), p_of(di_l, du_l), p_of(di_r, du_r)
    # Darknet picks the corner by the unsorted edges; the second assignment sees the first.
    tb = g.p_top < g.p_bot
    p_dt = torch.where(tb, p_dt, p_db)
    p_db = torch.where(tb, p_db, p_dt)
    lr = g.p_left < g.p_right
    p_dl = torch.where(lr, p_dl, p_dr)
    p_dr = torch.where(lr, p_dr, p_dl)
    if kind != "giou":
        return p_dt, p_db, p_dl, p_dr
    dc_t = torch.where(g.pred_t < g.t_top, -g.giou_cw, zero)
    dc_b = torch.where(g.pred_b > g.t_bot, g.giou_cw, zero)
    dc_l = torch.where(g.pred_l < g.t_left, -g.giou_ch, zero)
    dc_r = torch.where(g.pred_r > g.t_right, g.giou_ch, zero)
    giou_c = g.giou_cw * g.giou_ch
    cc = giou_c * giou_c

    def g_of(du: torch.Tensor, dc: torch.Tensor) -> torch.Tensor:
        return (giou_c * du - union * dc) / cc

    terms = [g_of(du_t, dc_t), g_of(du_b, dc_b), g_of(du_l, dc_l), g_of(du_r, dc_r)]
    pos_c = giou_c > 0
    p = [torch.where(pos_c, v + gv, v) for v, gv in zip((p_dt, p_db, p_dl, p_dr), terms)]
    return tuple(torch.where(g.no_overlap, gv, v) for v, gv in zip(p, terms))


def _with_distance_terms(
    g: _PairGeometry, kind: str, partials: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """DIoU's centre-distance partials added to the x, y, w, h ones (and CIoU's aspect term)."""
    px, py, pw, ph = g.pred.unbind(-1)
    tx, ty, _, _ = g.truth.unbind(-1)
    zero = torch.zeros_like(px)
    s = (px - tx) ** 2 + (py - ty) ** 2
    cw, ch = _enclosing(g.pred, g.truth)
    c = cw * cw + ch * ch
    one, half = torch.ones_like(px), torch.full_like(px, 0.5)
    dct_dy = torch.where(g.pred_t < g.t_top, one, zero)
    dct_dh = torch.where(g.pred_t < g.t_top, -half, zero)
    dcb_dy = torch.where(g.pred_b > g.t_bot, one, zero)
    dcb_dh = torch.where(g.pred_b > g.t_bot, half, zero)
    dcl_dx = torch.where(g.pred_l < g.t_left, one, zero)
    dcl_dw = torch.where(g.pred_l < g.t_left, -half, zero)
    dcr_dx = torch.where(g.pred_r > g.t_right, one, zero)
    dcr_dw = torch.where(g.pred_r > g.t_right, half, zero)
    dcw_dx, dcw_dw = dcr_dx - dcl_dx, dcr_dw - dcl_dw
    dch_dy, dch_dh = dcb_dy - dct_dy, dcb_dh - dct_dh
    c2 = c * c
    d_x = (2 * (tx - px) * c - (2 * cw * dcw_dx) * s) / c2
    d_y = (2 * (ty - py) * c - (2 * ch * dch_dy) * s) / c2
    d_w = (2 * cw * dcw_dw) * s / c2
    d_h = (2 * ch * dch_dh) * s / c2
    if kind == "ciou":
        gap = _atan_gap(g.pred, g.truth)
        ar_loss = 4 / (math.pi * math.pi) * gap * gap
        alpha = ar_loss / (1 - g.inter / g.union + ar_loss + CIOU_EPS)
        d_w = d_w + alpha * (8 / (math.pi * math.pi) * gap * ph)
        d_h = d_h + alpha * (-8 / (math.pi * math.pi) * gap * pw)
    pos_c = c > 0
    terms = (d_x, d_y, d_w, d_h)
    p = [torch.where(pos_c, v + t, v) for v, t in zip(partials, terms)]
    return tuple(torch.where(g.no_overlap, t, v) for v, t in zip(p, terms))


# ---------------------------------------------------------------------------------------------
# The layer


def _activate(x: torch.Tensor, spec: YoloLossSpec) -> torch.Tensor:
    """Darknet's ``l.output`` in (B, na, 5 + classes, h, w): logistic on x, y, objectness and
    classes (nothing for ``new_coords``: the conv below applied it), then x, y scaled by
    ``scale_x_y``."""
    out = x.clone()
    if not spec.new_coords:
        out[:, :, 0:2] = torch.sigmoid(out[:, :, 0:2])
        out[:, :, 4:] = torch.sigmoid(out[:, :, 4:])
    s = spec.scale_x_y
    if s != 1:
        out[:, :, 0:2] = out[:, :, 0:2] * s + to_c_float(-0.5 * (s - 1))
    return out


def _pred_boxes(lay: _Layer, out: torch.Tensor, at: _Layer | _Pairs) -> torch.Tensor:
    """Darknet's ``get_yolo_box`` in layer ``lay`` for entries ``out[..., 0:4]`` (activated x,
    y; raw w, h) at the cells ``at.cols, at.rows`` with anchors ``at.anchor`` (..., 2) in input
    pixels; (..., 4) normalized xywh."""
    h, w = lay.size
    net_h, net_w = lay.net
    anchors = at.anchor
    bx = (at.cols + out[..., 0]) / w
    by = (at.rows + out[..., 1]) / h
    if lay.spec.new_coords:
        bw = out[..., 2] * out[..., 2] * 4 * anchors[..., 0] / net_w
        bh = out[..., 3] * out[..., 3] * 4 * anchors[..., 1] / net_h
    else:
        bw = torch.exp(out[..., 2]) * anchors[..., 0] / net_w
        bh = torch.exp(out[..., 3]) * anchors[..., 1] / net_h
    return torch.stack((bx, by, bw, bh), -1)


def _box_delta(
    lay: _Layer, truth: torch.Tensor, out: torch.Tensor, at: _Layer | _Pairs, cm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Darknet's ``delta_yolo_box`` in layer ``lay`` for P (truth, prediction) pairs.

    Args:
        truth: (P, 4) xywh normalized. out: (P, >=4) the prediction's ``l.output`` entries.
        at: the predictions' anchors ``anchor`` (P, 2) in input pixels and cells ``cols, rows``
            (P,): the layer's own (every prediction) or the assignments' (:class:`_Pairs`).
        cm: (P,) the class multiplier (the normalizer is ``iou_normalizer * cm``).

    Returns:
        (P, 4) box delta, (P,) IoU and (P,) GIoU of the prediction with the truth.
    """
    spec = lay.spec
    normalizer = spec.iou_normalizer * cm
    h, w = lay.size
    net_h, net_w = lay.net
    anchors, cols, rows = at.anchor, at.cols, at.rows
    pred = _pred_boxes(lay, out, at)
    iou = box_iou(pred, truth)
    giou = box_giou(pred, truth)
    if spec.iou_loss == "mse":
        scale = 2 - truth[:, 2] * truth[:, 3]
        tx = truth[:, 0] * w - cols
        ty = truth[:, 1] * h - rows
        if spec.new_coords:
            tw = torch.sqrt(truth[:, 2] * net_w / (4 * anchors[:, 0]))
            th = torch.sqrt(truth[:, 3] * net_h / (4 * anchors[:, 1]))
        else:
            tw = torch.log(truth[:, 2] * net_w / anchors[:, 0])
            th = torch.log(truth[:, 3] * net_h / anchors[:, 1])
        target = torch.stack((tx, ty, tw, th), -1)
        delta = (scale * normalizer)[:, None] * (target - out[:, 0:4])
        # Darknet computes scale * (t - x) * normalizer; the product order only moves the last
        # bit.
        return delta, iou, giou
    # Darknet avoids a NaN in dx_box_iou this way (after the IoUs above).
    pred = torch.stack(
        (
            pred[:, 0],
            pred[:, 1],
            torch.where(pred[:, 2] == 0, torch.ones_like(pred[:, 2]), pred[:, 2]),
            torch.where(pred[:, 3] == 0, torch.ones_like(pred[:, 3]), pred[:, 3]),
        ),
        -1,
    )
    d = dx_box_iou(pred, truth, spec.iou_loss)
    if not spec.new_coords:
        d = torch.cat((d[:, 0:2], d[:, 2:4] * torch.exp(out[:, 2:4])), -1)
    d = d * normalizer[:, None]
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    if math.isfinite(spec.max_delta):
        d = d.clamp(-spec.max_delta, spec.max_delta)
    return d, iou, giou


def _class_row(
    out_cls: torch.Tensor, class_id: torch.Tensor, spec: YoloLossSpec, cm: torch.Tensor | None
) -> torch.Tensor:
    """Darknet's ``delta_yolo_class`` when the class delta is still 0 (the full write of every
    class): (P, classes) for P predictions ``out_cls`` (P, classes) and truth classes (P,)."""
    # A scatter, not F.one_hot: one_hot checks the class range by reading values back on some
    # devices (the CPU, where tests count such reads); _valid_truths clamped the classes.
    onehot = torch.zeros_like(out_cls).scatter_(1, class_id[:, None], 1.0)
    if spec.focal_loss:
        pt = out_cls.gather(1, class_id[:, None])[:, 0] + FOCAL_PT_EPS
        grad = -(1 - pt) * (2 * pt * torch.log(pt) + pt - 1)
        return (onehot - out_cls) * (FOCAL_ALPHA * grad)[:, None]
    y = onehot
    if spec.label_smooth_eps:
        y = y * (1 - spec.label_smooth_eps) + 0.5 * spec.label_smooth_eps
    row = y - out_cls
    if cm is not None:
        factor = torch.ones_like(row)
        factor.scatter_(1, class_id[:, None], (cm[class_id] * spec.cls_normalizer)[:, None])
        row = row * factor
    return row


def _class_again(
    out_cls: torch.Tensor, class_id: torch.Tensor, spec: YoloLossSpec, cm: torch.Tensor | None
) -> torch.Tensor:
    """Darknet's ``delta_yolo_class`` when that class's delta is already set (another truth,
    or truth_thresh, reached the anchor first): only that class, ``y - p`` (times its
    multiplier)."""
    y = 1.0
    if spec.label_smooth_eps:
        y = y * (1 - spec.label_smooth_eps) + 0.5 * spec.label_smooth_eps
    value = y - out_cls.gather(1, class_id[:, None])[:, 0]
    if cm is not None:
        value = value * cm[class_id]
    return value


def _valid_truths(truths: torch.Tensor, spec: YoloLossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) mask of the truths Darknet reads (up to ``max``, stopping at the first with
    ``x == 0``, skipping classes outside the layer's) and their (B, T) class ids."""
    present = torch.cumprod((truths[..., 0] != 0).to(torch.int32), dim=1).bool()
    class_id = torch.trunc(truths[..., 4]).long()  # C's (int) cast
    ok = present & (class_id >= 0) & (class_id < spec.classes)
    return ok, class_id.clamp(0, spec.classes - 1)


def _best_truth_iou(
    pred: torch.Tensor, truths: torch.Tensor, used: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Max over truths of each prediction's IoU and the first truth reaching it (0, 0 when no
    truth overlaps). pred: (B, N, 4); truths: (B, T, 4); used: (B, T)."""
    b, n, _ = pred.shape
    t = truths.shape[1]
    best = pred.new_zeros(b, n)
    best_t = torch.zeros(b, n, dtype=torch.long, device=pred.device)
    if t == 0:
        return best, best_t
    step = max(1, _IOU_CHUNK // max(1, n * t))
    for s in range(0, b, step):
        iou = box_iou(pred[s : s + step, :, None, :], truths[s : s + step, None, :, :])
        iou = torch.where(used[s : s + step, None, :], iou, torch.zeros_like(iou))
        best[s : s + step] = iou.amax(-1)
        best_t[s : s + step] = iou.argmax(-1)  # the first maximum, as Darknet's strict '>'
    return best, best_t


@dataclass
class _Layer:
    """One layer's predictions, flattened to one row per (image, anchor, cell), and its delta
    being written. Every delta buffer has one extra row (``dump``) that takes the writes of
    (truth, anchor) pairs that are not assignments, so that nothing has a data-dependent shape.
    """

    spec: YoloLossSpec
    size: tuple[int, int]  # (h, w) cells
    net: tuple[int, int]  # (h, w) input pixels
    out: torch.Tensor  # (cells, 5 + classes) Darknet's l.output
    cols: torch.Tensor  # (cells,) i
    rows: torch.Tensor  # (cells,) j
    anchor: torch.Tensor  # (cells, 2) the prediction's anchor, pixels
    cm: torch.Tensor | None  # (classes,) class multipliers
    d_box: torch.Tensor  # (cells + 1, 4)
    d_obj: torch.Tensor  # (cells + 1,)
    d_cls: torch.Tensor  # (cells + 1, classes)
    written: torch.Tensor  # (cells + 1,) class deltas already written (truth_thresh)

    @property
    def dump(self) -> int:
        return self.out.shape[0]

    def multipliers(self, class_id: torch.Tensor) -> torch.Tensor:
        if self.cm is None:
            return torch.ones(class_id.shape, dtype=self.out.dtype, device=self.out.device)
        return self.cm[class_id]


def _layer(x: torch.Tensor, spec: YoloLossSpec, net_size: tuple[int, int]) -> _Layer:
    bsz, _, h, w = x.shape
    na, no, dev, dt = spec.na, spec.outputs_per_anchor, x.device, x.dtype
    # (B, na, h, w, no): one row per prediction.
    out = _activate(x.view(bsz, na, no, h, w), spec).permute(0, 1, 3, 4, 2).reshape(-1, no)
    cells = out.shape[0]
    grid = (bsz, na, h, w)
    rows = torch.arange(h, device=dev, dtype=dt).view(1, 1, h, 1).expand(grid).reshape(-1)
    cols = torch.arange(w, device=dev, dtype=dt).view(1, 1, 1, w).expand(grid).reshape(-1)
    anchors = torch.tensor(spec.anchors, dtype=dt, device=dev)[list(spec.mask)]
    anchor = anchors.view(1, na, 1, 1, 2).expand(*grid, 2).reshape(-1, 2)
    cm = None
    if spec.classes_multipliers is not None:
        cm = torch.tensor(spec.classes_multipliers, dtype=dt, device=dev)
    return _Layer(
        spec=spec,
        size=(h, w),
        net=net_size,
        out=out,
        cols=cols,
        rows=rows,
        anchor=anchor,
        cm=cm,
        d_box=out.new_zeros(cells + 1, 4),
        d_obj=out.new_zeros(cells + 1),
        d_cls=out.new_zeros(cells + 1, spec.classes),
        written=torch.zeros(cells + 1, dtype=torch.bool, device=dev),
    )


def _prediction_pass(
    lay: _Layer, tbox: torch.Tensor, used: torch.Tensor, class_id: torch.Tensor
) -> None:
    """Step 1 of the module docstring: objectness against the best truth of each prediction
    (``ignore_thresh``), and ``truth_thresh`` positives."""
    spec, out, bsz = lay.spec, lay.out, tbox.shape[0]
    pred = _pred_boxes(lay, out, lay)
    best_iou, best_t = _best_truth_iou(pred.view(bsz, -1, 4), tbox, used)
    best_iou, best_t = best_iou.reshape(-1), best_t
    out_obj = out[:, 4]
    class_match = (out[:, 5:] > CLASS_MATCH_PROB).any(-1)
    best_match = torch.where(class_match, best_iou, torch.zeros_like(best_iou))
    norm = spec.obj_normalizer
    d_obj = norm * (0 - out_obj)
    ignored = best_match > spec.ignore_thresh
    if spec.objectness_smooth:
        d_obj = torch.where(ignored, torch.maximum(d_obj, norm * (best_match - out_obj)), d_obj)
    else:
        d_obj = torch.where(ignored, torch.zeros_like(d_obj), d_obj)
    lay.d_obj[:-1] = d_obj
    if spec.truth_thresh >= 1:  # an IoU never exceeds 1
        return
    tt = best_iou > spec.truth_thresh
    truth = tbox.gather(1, best_t[..., None].expand(-1, -1, 4)).reshape(-1, 4)
    cls = class_id.gather(1, best_t).reshape(-1)
    cm = lay.multipliers(cls)
    sq = best_iou**2
    obj = norm * ((sq if spec.objectness_smooth else 1) - out_obj)
    lay.d_obj[:-1] = torch.where(tt, obj, lay.d_obj[:-1])
    row = _class_row(out[:, 5:], cls, spec, lay.cm)
    if spec.objectness_smooth:
        own = cm * (sq - out[:, 5:].gather(1, cls[:, None])[:, 0])
        row.scatter_(1, cls[:, None], own[:, None])
    lay.d_cls[:-1] = torch.where(tt[:, None], row, lay.d_cls[:-1])
    bd, _, _ = _box_delta(lay, truth, out, lay, cm)
    lay.d_box[:-1] += torch.where(tt[:, None], bd, torch.zeros_like(bd))
    lay.written[:-1] |= tt


class _Pairs(NamedTuple):
    """Every (image, truth, anchor of all ``num``) triple, flattened: (P,) each."""

    ok: torch.Tensor  # an assignment (the truth trains that anchor in this layer)
    cell: torch.Tensor  # the prediction's row, or the dump row
    order: torch.Tensor  # Darknet's order of writes
    truth: torch.Tensor  # (P, 4)
    cls: torch.Tensor
    anchor: torch.Tensor  # (P, 2) pixels
    cols: torch.Tensor
    rows: torch.Tensor


def _assignments(
    lay: _Layer, tbox: torch.Tensor, used: torch.Tensor, class_id: torch.Tensor
) -> _Pairs:
    """Step 2 of the module docstring: each truth's best anchor over all ``num`` anchors by
    the IoU of centred boxes, and this layer's anchors above ``iou_thresh``."""
    spec = lay.spec
    bsz, t_count, _ = tbox.shape
    h, w = lay.size
    net_h, net_w = lay.net
    dev, dt = tbox.device, tbox.dtype
    anchors = torch.tensor(spec.anchors, dtype=dt, device=dev)  # (num, 2)
    num = anchors.shape[0]
    shape_anchor = torch.zeros(num, 4, dtype=dt, device=dev)
    shape_anchor[:, 2] = anchors[:, 0] / net_w
    shape_anchor[:, 3] = anchors[:, 1] / net_h
    shape_truth = torch.zeros_like(tbox)
    shape_truth[..., 2:4] = tbox[..., 2:4]
    pair_shapes = (shape_anchor[None, None], shape_truth[:, :, None])
    best_n = box_iou(*pair_shapes).argmax(-1)  # (B, T); the first maximum, as Darknet's '>'
    # This layer's mask index of each anchor (its first occurrence), -1 outside the mask.
    first_index = {m: k for k, m in reversed(list(enumerate(spec.mask)))}
    local = torch.tensor([first_index.get(n, -1) for n in range(num)], device=dev)
    in_mask = local >= 0
    n_idx = torch.arange(num, device=dev)
    is_best = n_idx == best_n[..., None]  # (B, T, num)
    ok = is_best & in_mask
    if spec.iou_thresh < 1:
        kind = _IOU_KIND[spec.iou_thresh_kind](*pair_shapes)
        ok = ok | (in_mask & ~is_best & (kind > spec.iou_thresh))
    ok = ok & used[..., None]

    i = (tbox[..., 0] * w).long().clamp(0, w - 1)  # C's (int) cast; the border: last cell
    j = (tbox[..., 1] * h).long().clamp(0, h - 1)
    b_idx = torch.arange(bsz, device=dev).view(bsz, 1, 1)
    cell = ((b_idx * spec.na + local.clamp(min=0)) * h + j[..., None]) * w + i[..., None]
    cell = torch.where(ok, cell, lay.dump)
    # Truth by truth; within a truth the best anchor first, then by anchor index.
    order = torch.arange(t_count, device=dev).view(1, t_count, 1) * (num + 1)
    order = order + torch.where(is_best, 0, n_idx + 1)
    triple = (bsz, t_count, num)
    return _Pairs(
        ok=ok.reshape(-1),
        cell=cell.reshape(-1),
        order=order.expand(triple).reshape(-1),
        truth=tbox[:, :, None, :].expand(*triple, 4).reshape(-1, 4),
        cls=class_id[:, :, None].expand(triple).reshape(-1),
        anchor=anchors.view(1, 1, num, 2).expand(*triple, 2).reshape(-1, 2),
        cols=i[..., None].expand(triple).reshape(-1).to(dt),
        rows=j[..., None].expand(triple).reshape(-1).to(dt),
    )


def _write_assignments(lay: _Layer, pairs: _Pairs) -> torch.Tensor:
    """The deltas of every assignment, as Darknet writes them one after another: box deltas
    add up; objectness is the last writer's (``objectness_smooth``: the first's, only where
    still 0); the first writer of a cell writes every class, later ones their own class.

    Returns:
        The sum of the assignments' IoU losses (``1 - GIoU`` for giou, else ``1 - IoU``).
    """
    spec, ok, cell = lay.spec, pairs.ok, pairs.cell
    out = torch.cat((lay.out, lay.out.new_zeros(1, lay.out.shape[1])))[cell]
    cm = lay.multipliers(pairs.cls)
    bd, iou, giou = _box_delta(lay, pairs.truth, out, pairs, cm)
    lay.d_box.index_add_(0, cell, bd)  # pairs that are not assignments go to the dump row
    iou_loss = torch.where(ok, 1 - giou if spec.iou_loss == "giou" else 1 - iou, 0.0).sum()

    big = torch.iinfo(torch.long).max
    first = torch.full_like(lay.written, big, dtype=torch.long)
    first.scatter_reduce_(0, cell, torch.where(ok, pairs.order, big), "amin")
    last = torch.full_like(lay.written, -1, dtype=torch.long)
    last.scatter_reduce_(0, cell, torch.where(ok, pairs.order, -1), "amax")
    is_first = ok & (pairs.order == first[cell])
    is_last = ok & (pairs.order == last[cell])
    dump = torch.full_like(cell, lay.dump)

    obj = cm * spec.obj_normalizer * (1 - out[:, 4])
    take = (is_first & (lay.d_obj[cell] == 0)) if spec.objectness_smooth else is_last
    lay.d_obj.index_put_((torch.where(take, cell, dump),), obj)

    full = is_first & ~lay.written[cell]
    lay.d_cls.index_put_(
        (torch.where(full, cell, dump),), _class_row(out[:, 5:], pairs.cls, spec, lay.cm)
    )
    again = ok & ~full
    value = _class_again(out[:, 5:], pairs.cls, spec, lay.cm)
    lay.d_cls.index_put_((torch.where(again, cell, dump), pairs.cls), value)
    return iou_loss


@torch.no_grad()
def yolo_delta(
    x: torch.Tensor, truths: torch.Tensor, spec: YoloLossSpec, net_size: tuple[int, int]
) -> YoloDelta:
    """Darknet's ``forward_yolo_layer`` in training mode for one ``[yolo]`` layer.

    Args:
        x: (B, na * (5 + classes), h, w) the layer's input as Darknet sees it: the output of the
            layer below (for ``new_coords`` heads, after that conv's logistic activation).
        truths: (B, T, 5) per image x, y, w, h (normalized, centre and size) and class; an
            image's list ends at its first row with ``x == 0`` (zero padding); at most
            ``spec.max_boxes`` are read.
        spec: the layer's keys.
        net_size: (height, width) of the network input in pixels (Darknet's ``net.h, net.w``).

    Returns:
        :class:`YoloDelta` (``delta`` in ``x``'s layout and dtype). No autograd graph.
    """
    bsz, channels, h, w = x.shape
    na, no = spec.na, spec.outputs_per_anchor
    if channels != na * no:
        raise ValueError(f"input has {channels} channels, the layer needs {na} * {no}")
    if truths.ndim != 3 or truths.shape[0] != bsz or truths.shape[2] != TRUTH_FIELDS:
        raise ValueError(f"truths must be ({bsz}, T, {TRUTH_FIELDS}), got {tuple(truths.shape)}")
    truths = truths[:, : spec.max_boxes].to(device=x.device, dtype=x.dtype)
    used, class_id = _valid_truths(truths, spec)
    tbox = truths[..., 0:4]

    lay = _layer(x, spec, net_size)
    _prediction_pass(lay, tbox, used, class_id)
    pairs = _assignments(lay, tbox, used, class_id)
    iou_loss = _write_assignments(lay, pairs)
    d_box, d_obj, d_cls = lay.d_box[:-1], lay.d_obj[:-1], lay.d_cls[:-1]
    # Step 3: box deltas of a shared anchor averaged over the classes trained there.
    if spec.iou_thresh < 1:
        positives = (d_cls > 0).sum(-1)
        divide = (d_obj != 0) & (positives > 0)
        d_box = torch.where(
            divide[:, None], d_box / positives.clamp(min=1)[:, None].to(x.dtype), d_box
        )

    delta = torch.cat((d_box, d_obj[:, None], d_cls), -1)  # (cells, no)
    delta = delta.view(bsz, na, h, w, no).permute(0, 1, 4, 2, 3).reshape(bsz, channels, h, w)
    count = pairs.ok.sum()
    if spec.iou_loss == "mse" or not spec.show_details:
        cost = (delta * delta).sum()
    else:
        non_box = (delta.view(bsz, na, no, h, w)[:, :, 4:] ** 2).sum()
        mean_iou_loss = iou_loss / count.clamp(min=1).to(x.dtype)
        cost = spec.iou_normalizer * mean_iou_loss + spec.obj_normalizer * non_box
    return YoloDelta(delta.contiguous(), cost, count)


# ---------------------------------------------------------------------------------------------
# Autograd


class _DarknetYolo(torch.autograd.Function):
    """Forward: the layer's cost; backward: ``-delta`` (times the incoming gradient)."""

    @staticmethod
    def forward(ctx, x, truths, spec, net_size):
        result = yolo_delta(x, truths, spec, net_size)
        ctx.save_for_backward(result.delta)
        return result.cost

    @staticmethod
    def backward(ctx, grad):
        (delta,) = ctx.saved_tensors
        return -delta * grad, None, None, None


def darknet_yolo_loss(
    x: torch.Tensor, truths: torch.Tensor, spec: YoloLossSpec, net_size: tuple[int, int]
) -> torch.Tensor:
    """The layer's cost as a differentiable scalar whose gradient with respect to ``x`` is
    Darknet's ``-l.delta`` (see :func:`yolo_delta` for the arguments), in ``x``'s dtype (the
    trainer hands over float32 predictions)."""
    return _DarknetYolo.apply(x, truths, spec, tuple(net_size))


def head_input(p: torch.Tensor, spec: YoloLossSpec) -> torch.Tensor:
    """Our model's training output of a head, (bs, na, ny, nx, 5 + classes) logits
    (models/layers.py YOLOLayer), as Darknet's ``[yolo]`` input (bs, na * (5 + classes), ny,
    nx). ``new_coords`` heads get back the logistic that the model builder moved into the head,
    so autograd applies its derivative as Darknet's conv backward does."""
    bs, na, ny, nx, no = p.shape
    x = p.permute(0, 1, 4, 2, 3).reshape(bs, na * no, ny, nx)
    return torch.sigmoid(x) if spec.new_coords else x


def darknet_loss(
    preds: Sequence[torch.Tensor],
    truths: torch.Tensor,
    specs: Sequence[YoloLossSpec],
    net_size: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Darknet's loss of one mini-batch over all heads.

    Args:
        preds: per head, in the model's head order, (bs, na, ny, nx, 5 + classes) raw training
            output of :class:`~models.darknet.Darknet`.
        truths: (bs, T, 5) from :func:`targets_to_truths`.
        specs: per head, the same order.
        net_size: (height, width) of this batch's input images in pixels.

    Returns:
        ``(loss, reported)``: ``loss`` the sum of the layers' costs, to call ``backward()`` on
        as it is (each head then gets ``-delta``, summed over the images: Darknet's optimizer
        divides by the batch); ``reported`` (detached) Darknet's printed loss for this
        mini-batch, the mean of the layers' costs per image (``get_network_cost / batch``).
    """
    if len(preds) != len(specs):
        raise ValueError(f"{len(preds)} heads for {len(specs)} [yolo] specs")
    costs = [darknet_yolo_loss(head_input(p, s), truths, s, net_size) for p, s in zip(preds, specs)]
    loss = torch.stack(costs).sum()
    reported = loss.detach() / len(costs) / max(1, preds[0].shape[0])
    return loss, reported


class DarknetLoss:
    """Darknet's loss of a model built from ``blocks``, called once per mini-batch::

        blocks = [model.hyperparams, *model.module_defs]
        criterion = DarknetLoss(blocks, model.yolo_layers)
        loss, reported = criterion(model(imgs), targets, imgs.shape[-2:])
        loss.backward()

    Args:
        blocks: the parsed cfg, ``[net]`` first.
        head_layers: the heads' layer indices in the order the model returns them
            (``Darknet.yolo_layers``).
    """

    def __init__(self, blocks: Sequence[Block], head_layers: Sequence[int]):
        specs = yolo_specs(blocks)
        self.specs = [specs[k] for k in head_layers]
        self.max_boxes = max(s.max_boxes for s in self.specs)

    def __call__(
        self, preds: Sequence[torch.Tensor], targets: torch.Tensor, img_size: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``preds`` the model's training output, ``targets`` (nt, 6) image, class, cx, cy, w,
        h as the data loader collates them, ``img_size`` (h, w) of the batch's images; returns
        :func:`darknet_loss`'s ``(loss, reported)``.

        The truths are built on the host: their shape depends on the boxes per image, which a
        GPU would have to report back (a wait at every mini-batch); from pinned memory the copy
        to the GPU does not wait. Give ``targets`` as the loader returns them (on the CPU).
        """
        device = preds[0].device
        truths = targets_to_truths(targets.cpu(), preds[0].shape[0], self.max_boxes)
        if device.type == "cuda":
            truths = truths.pin_memory()
        truths = truths.to(device, non_blocking=True)
        return darknet_loss(preds, truths, self.specs, (int(img_size[0]), int(img_size[1])))


def targets_to_truths(targets: torch.Tensor, batch_size: int, max_boxes: int) -> torch.Tensor:
    """The data loader's targets as Darknet's per-image truth lists.

    Args:
        targets: (nt, 6) image index in the batch, class, cx, cy, w, h (normalized), as
            :mod:`build_utils.datasets` collates them; each image's rows in their label order.
        batch_size: images in the batch.
        max_boxes: the largest ``max`` of the heads (Darknet's loader keeps that many).

    Returns:
        (batch_size, T, 5) x, y, w, h, class, zero-padded, T = min(max_boxes, most boxes in an
        image); rows past ``max_boxes`` of an image are dropped as Darknet's loader does.
    """
    dev = targets.device
    if targets.numel() == 0:
        return torch.zeros(batch_size, 0, TRUTH_FIELDS, device=dev)
    img = targets[:, 0].long()
    order = torch.sort(img, stable=True).indices
    img, rows = img[order], targets[order]
    counts = torch.bincount(img, minlength=batch_size)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(img.numel(), device=dev) - starts[img]
    keep = rank < max_boxes
    t_max = int(min(max_boxes, int(counts.max())))
    out = torch.zeros(batch_size, t_max, TRUTH_FIELDS, dtype=targets.dtype, device=dev)
    fields = torch.cat((rows[:, 2:6], rows[:, 1:2]), 1)
    out[img[keep], rank[keep]] = fields[keep]
    return out
