"""YOLOv3 training loss (the the Darknet-cfg era of ultralytics/yolov3 and the yolov3_spp tutorial).

Per head, each target is assigned to every anchor whose shape IoU with it (``wh_iou`` in grid
units, both centred) exceeds ``iou_t``, in the grid cell that holds the target's centre. Then:

- box loss: ``mean(1 - GIoU)`` over assignments, between the predicted box
  ``(sigmoid(t_xy), exp(t_wh).clamp(max=1e3) * anchor)`` and the target box
  ``(centre offset within the cell, wh)``, both in grid units;
- objectness loss: BCE (``pos_weight = obj_pw``) over every cell and anchor, the target being
  ``(1 - gr) + gr * GIoU.detach().clamp(0)`` at assigned cells and 0 elsewhere;
- class loss: BCE (``pos_weight = cls_pw``) over assignments, one-hot targets (``1 - eps/2``
  and ``eps/2`` with label smoothing ``eps``, YOLOv5's ``smooth_BCE``), only when ``nc > 1``;

each head's terms summed, then multiplied by the ``giou``, ``obj`` and ``cls`` gains of the
hyperparameters (already scaled by :func:`scale_loss_gains`). ``fl_gamma > 0`` wraps both BCEs
in a focal loss. ``obj_balance`` (off in ultralytics/yolov3) weighs each head's objectness term as
YOLOv5 does (:func:`objectness_balance`): the finest head most.

Heads with Darknet's ``new_coords=1`` (Scaled-YOLOv4, YOLOv7) decode
``xy = sigmoid(t_xy) * s - (s - 1) / 2`` (``s = scale_x_y``, 2 in those cfgs: -0.5..1.5 around
the cell) and ``wh = (2 * sigmoid(t_wh)) ** 2 * anchor`` (at most 4x the anchor). Their targets
are assigned as Scaled-YOLOv4 and YOLOv7 train them: to every anchor whose width and height
ratios to the target are within ``ANCHOR_RATIO_MAX`` (instead of the wh-IoU threshold), in the
cell holding the centre and, when ``s >= 2`` lets a box reach it, in the two neighbouring cells
nearest to the centre (left or right, above or below); the box loss uses that same decode.

The implementation never leaves the device: every (anchor, target) pair is evaluated and the
pairs that fail the ``iou_t`` test are masked out instead of compacted away, so there is no
data-dependent shape, no ``.item()`` and no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torchvision
from torch import nn

from build_utils.boxes import paired_giou, wh_iou

# scale_loss_gains: the published cls and obj gains were tuned for COCO's 80 classes at an
# input size of 320 pixels; other datasets and sizes rescale them proportionally.
GAIN_REFERENCE_NUM_CLASSES = 80
GAIN_REFERENCE_IMG_SIZE = 320

# Objectness target at an assigned cell: (1 - gr) + gr * GIoU (gr = "giou ratio").
# ultralytics/yolov3 trains with gr = 1: the objectness of a positive learns to predict its box
# quality.
OBJ_GIOU_RATIO = 1.0

# Label smoothing of the class targets (ultralytics/yolov3's smooth_BCE eps): off unless
# ``--label-smoothing`` says otherwise.
LABEL_SMOOTHING_EPS = 0.0

# exp(t_wh) is clamped so that a diverging logit gives a huge box instead of inf/NaN.
MAX_WH_EXP = 1e3

# Focal loss alpha (Lin et al. 2017), used when hyp['fl_gamma'] > 0.
FOCAL_ALPHA = 0.25

# new_coords heads: a target goes to an anchor when both its width and height are within this
# factor of the anchor's (Scaled-YOLOv4's and YOLOv7's anchor_t; the decode's wh range is 0..4x).
ANCHOR_RATIO_MAX = 4.0
# new_coords heads: a centre within this distance of a cell border is also assigned to the
# neighbouring cell across that border (YOLOv5/Scaled-YOLOv4 "g"), needing a decode that reaches
# 0.5 beyond the cell, i.e. scale_x_y >= NEIGHBOUR_MIN_SCALE_XY.
NEIGHBOUR_MARGIN = 0.5
NEIGHBOUR_MIN_SCALE_XY = 2.0
# obj_balance: YOLOv5's objectness weight per head, from the finest stride up; three heads
# (P3-P5) get their own, other counts the first ones of the five-head list. The finest head
# has four times the cells of the next, so its per-cell mean BCE is the smallest and, unweighted,
# its few positives (the small objects) pull least on the shared gain.
OBJ_BALANCE_3_HEADS = (4.0, 1.0, 0.4)
OBJ_BALANCE = (4.0, 1.0, 0.25, 0.06, 0.02)
# An element-wise loss of (logits, targets in [0, 1]), both of one shape, in that shape.
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Centre cell, then the neighbours to the left, above, to the right, below (x, y offsets).
_CELL_OFFSETS = ((0, 0), (1, 0), (0, 1), (-1, 0), (0, -1))


class _YoloModel(Protocol):
    nc: int
    yolo_layers: Sequence[int]
    # Its heads (at yolo_layers) have anchor_vec (na, 2) anchors in grid units, stride (input
    # pixels per grid cell) and optionally (default 1.0 and False) scale_x_y and new_coords.
    module_list: Sequence[Any]


class LayerTargets(NamedTuple):
    """Targets of one head for every (anchor, target) pair, anchor-major: pair ``p`` is anchor
    ``p // nt`` with target row ``p % nt``. ``P = na * nt``. For a ``new_coords`` head that
    reaches the neighbouring cells, the pairs come once per candidate cell (centre, left, above,
    right, below), cell-major: ``P = 5 * na * nt``.

    Attributes:
        tcls: (P,) int64 class id.
        tbox: (P, 4) cxcywh in grid units: centre offset within cell (gi, gj), then w, h.
        indices: (b, a, gj, gi), each (P,) int64: image in batch, anchor, cell row, cell column.
        anchors: (P, 2) the pair's anchor w, h in grid units.
        valid: (P,) bool, True where the pair is an assignment (wh-IoU > iou_t; new_coords:
            wh ratios within ANCHOR_RATIO_MAX and the cell a chosen one). Rows where it is False
            are padding that keeps shapes static; select with ``[valid]`` to inspect.
    """

    tcls: torch.Tensor
    tbox: torch.Tensor
    indices: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    anchors: torch.Tensor
    valid: torch.Tensor


def scale_loss_gains(hyp: dict[str, Any], nc: int, img_size: int) -> dict[str, Any]:
    """A new hyp dict with the class and objectness gains scaled to the dataset and input size.

    ``cls *= nc / 80`` (the per-class BCE is averaged over more or fewer classes) and
    ``obj *= img_size / 320`` (the objectness BCE is averaged over more or fewer cells), as
    ultralytics/yolov3's training script does. The input dict is not modified.
    """
    scaled = dict(hyp)
    scaled["cls"] = hyp["cls"] * nc / GAIN_REFERENCE_NUM_CLASSES
    scaled["obj"] = hyp["obj"] * img_size / GAIN_REFERENCE_IMG_SIZE
    return scaled


def objectness_balance(strides: Sequence[float]) -> list[float]:
    """YOLOv5's objectness weight of each head, given the heads' strides in model order.

    Heads are ranked by stride from the finest (YOLOv3's cfgs list the coarsest first, YOLOv4's
    the finest); heads of equal stride share a weight. More than five distinct strides: the
    coarser ones get the last weight.
    """
    distinct = sorted(set(strides))
    weights = OBJ_BALANCE_3_HEADS if len(distinct) == 3 else OBJ_BALANCE
    return [weights[min(distinct.index(s), len(weights) - 1)] for s in strides]


def build_targets(
    preds: Sequence[torch.Tensor],
    targets: torch.Tensor,
    model: _YoloModel,
    iou_t: float,
    anchor_t: float = ANCHOR_RATIO_MAX,
) -> list[LayerTargets]:
    """Assign targets to anchors and grid cells, one :class:`LayerTargets` per head.

    Args:
        preds: per head (bs, na, ny, nx, no) raw logits, in ``model.yolo_layers`` order; only
            their grid sizes are read.
        targets: (nt, 6) = image index in batch, class, cx, cy, w, h normalised to [0, 1].
        model: the unwrapped model (``yolo_layers``, ``module_list[i].anchor_vec``).
        iou_t: an anchor is assigned to a target when their wh-IoU exceeds this.
        anchor_t: ``new_coords`` heads: when their width and height ratios are within this.

    A target is assigned to the cell holding its centre (a centre exactly on the right or
    bottom border goes to the last cell), to every anchor passing ``iou_t``, possibly none.
    ``new_coords`` heads: see the module docstring (``iou_t`` is not used there).
    """
    if len(preds) != len(model.yolo_layers):
        raise ValueError(f"{len(preds)} prediction heads for {len(model.yolo_layers)} YOLO layers")
    out = []
    for pi, layer_index in zip(preds, model.yolo_layers):
        head = model.module_list[layer_index]
        anchors = head.anchor_vec  # (na, 2) grid units
        ny, nx = pi.shape[2], pi.shape[3]
        # Boxes to grid units (Python-scalar products: no host-to-device copy of a gain tensor).
        t = targets.clone()
        t[:, 2:6:2] *= nx
        t[:, 3:6:2] *= ny
        if getattr(head, "new_coords", False):
            ratio = t[None, :, 4:6] / anchors[:, None].to(t.dtype)  # (na, nt, 2)
            fits = torch.max(ratio, 1 / ratio).amax(2) < anchor_t
            neighbours = getattr(head, "scale_x_y", 1.0) >= NEIGHBOUR_MIN_SCALE_XY
        else:
            fits = wh_iou(anchors.to(t.dtype), t[:, 4:6]) > iou_t
            neighbours = False
        out.append(_layer_targets(t, anchors, nx, ny, fits, neighbours))
    return out


def _layer_targets(
    t: torch.Tensor,
    anchors: torch.Tensor,
    nx: int,
    ny: int,
    fits: torch.Tensor,
    neighbours: bool,
) -> LayerTargets:
    """:func:`build_targets` for one head: ``t`` (nt, 6) already in grid units, ``anchors``
    (na, 2) grid units, ``fits`` (na, nt) the pairs that pass the anchor test; ``neighbours``:
    also the two neighbouring cells nearest to each centre (``new_coords`` with a reaching
    ``scale_x_y``)."""
    nt, na = t.shape[0], anchors.shape[0]
    # All na * nt pairs, anchor-major (ultralytics/yolov3's order: it decides duplicate cells).
    a = torch.arange(na, device=t.device).repeat_interleave(nt)
    t = t.repeat(na, 1)
    gxy = t[:, 2:4]
    if neighbours:
        g = NEIGHBOUR_MARGIN
        size = torch.tensor([nx, ny], dtype=gxy.dtype, device=gxy.device)
        gxy_inv = size - gxy  # distance to the right and bottom borders
        left, above = ((gxy % 1 < g) & (gxy > 1)).unbind(1)
        right, below = ((gxy_inv % 1 < g) & (gxy_inv > 1)).unbind(1)
        cells = torch.stack((torch.ones_like(left), left, above, right, below))  # (5, P)
        offsets = torch.tensor(_CELL_OFFSETS, dtype=gxy.dtype, device=gxy.device) * g
    else:  # the centre cell alone (zeros made on the device: no host-to-device copy)
        cells = torch.ones(1, gxy.shape[0], dtype=torch.bool, device=gxy.device)
        offsets = torch.zeros(1, 2, dtype=gxy.dtype, device=gxy.device)
    n_cells = cells.shape[0]
    valid = (cells & fits.reshape(1, -1)).reshape(-1)
    gxy_all = gxy.repeat(n_cells, 1)  # (n_cells * P, 2), cell-major
    gij = (gxy_all - offsets.repeat_interleave(gxy.shape[0], 0)).long()
    gi = gij[:, 0].clamp(0, nx - 1)
    gj = gij[:, 1].clamp(0, ny - 1)
    t = t.repeat(n_cells, 1)
    a = a.repeat(n_cells)
    # ultralytics/yolov3 clamps the cell in place before taking the offset, so a centre at the
    # border gets offset 1.0 in the last cell; same here.
    offset = gxy_all - torch.stack((gi, gj), 1).to(gxy.dtype)
    return LayerTargets(
        tcls=t[:, 1].long(),
        tbox=torch.cat((offset, t[:, 4:6]), 1),
        indices=(t[:, 0].long(), a, gj, gi),
        anchors=anchors[a],
        valid=valid,
    )


def predicted_boxes(ps: torch.Tensor, anchors: torch.Tensor, head: Any) -> torch.Tensor:
    """Decode the logits of assigned pairs as the head does (grid units, relative to each pair's
    cell): ``ps`` (P, no), ``anchors`` (P, 2) -> (P, 4) cxcywh."""
    s = float(getattr(head, "scale_x_y", 1.0))
    pxy = ps[:, :2].sigmoid() * s - (s - 1) / 2
    if getattr(head, "new_coords", False):
        pwh = (2 * ps[:, 2:4].sigmoid()) ** 2 * anchors.to(ps.dtype)
    else:
        pwh = ps[:, 2:4].exp().clamp(max=MAX_WH_EXP) * anchors.to(ps.dtype)
    return torch.cat((pxy, pwh), 1)


def compute_loss(
    preds: Sequence[torch.Tensor],
    targets: torch.Tensor,
    model: _YoloModel,
    hyp: dict[str, Any],
    label_smoothing: float = LABEL_SMOOTHING_EPS,
) -> dict[str, torch.Tensor]:
    """YOLOv3 loss of one batch.

    Args:
        preds: per head (bs, na, ny, nx, 5 + nc) raw logits (training-mode output), in
            ``model.yolo_layers`` order.
        targets: (nt, 6) = image index in batch, class, cx, cy, w, h normalised; may be empty.
        model: the unwrapped model: ``nc``, ``yolo_layers``, ``module_list[i].anchor_vec`` (and
            ``scale_x_y``, ``new_coords`` when the heads have them).
        hyp: validated hyperparameters with gains already scaled by :func:`scale_loss_gains`:
            ``giou``, ``obj``, ``cls`` (gains), ``obj_pw``, ``cls_pw`` (BCE positive weights),
            ``iou_t`` (anchor assignment threshold), ``fl_gamma`` (focal loss when > 0),
            optionally ``obj_balance`` (per-head objectness weights when true).
        label_smoothing: eps in [0, 1): class BCE targets ``1 - eps/2`` for the target's class
            and ``eps/2`` for the others (arXiv:1902.04103 eq. 3); 0 keeps them one-hot.

    Returns:
        ``{"box_loss", "obj_loss", "cls_loss"}``: 0-dim tensors, already multiplied by their
        gains; their sum is the loss to minimise. ``cls_loss`` is 0 when ``nc == 1``.

    Duplicates: several targets of one image may land on the same (anchor, cell). They all
    count in the box and class losses; the objectness target there is the GIoU of the last
    of them in ``targets`` order (anchor-major), exactly as ultralytics/yolov3's
    ``tobj[b, a, gj, gi] = ...`` does on CPU. ultralytics/yolov3 left the winner unspecified on
    CUDA, where index assignment with duplicates is non-deterministic; here it is resolved
    explicitly and the same on every device.
    """
    device = preds[0].device
    anchor_t = hyp.get("anchor_t", ANCHOR_RATIO_MAX)
    layer_targets = build_targets(preds, targets, model, hyp["iou_t"], anchor_t)
    criterion_cls = _criterion(hyp["cls_pw"], hyp["fl_gamma"], device)
    criterion_obj = _criterion(hyp["obj_pw"], hyp["fl_gamma"], device)
    cp, cn = 1.0 - 0.5 * label_smoothing, 0.5 * label_smoothing
    nc = model.nc
    heads = [model.module_list[i] for i in model.yolo_layers]
    if hyp.get("obj_balance", False):
        balance = objectness_balance([h.stride for h in heads])
    else:
        balance = [1.0] * len(heads)

    lbox = torch.zeros((), device=device)
    lobj = torch.zeros((), device=device)
    lcls = torch.zeros((), device=device)
    for pi, lt, head, weight in zip(preds, layer_targets, heads, balance):
        tobj = torch.zeros_like(pi[..., 0])
        if lt.valid.shape[0]:  # a static shape (na * nt): no sync
            box, cls, tobj = _assigned_losses(pi, lt, head, tobj, criterion_cls, (cp, cn), nc)
            lbox, lcls = lbox + box, lcls + cls
        lobj = lobj + criterion_obj(pi[..., 4], tobj).mean() * weight

    return {
        "box_loss": lbox * hyp["giou"],
        "obj_loss": lobj * hyp["obj"],
        "cls_loss": lcls * hyp["cls"],
    }


def _assigned_losses(
    pi: torch.Tensor,
    lt: LayerTargets,
    head: nn.Module,
    tobj: torch.Tensor,
    criterion_cls: Criterion,
    smooth: tuple[float, float],
    nc: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One head's box and class losses over its assignments ``lt``, and its objectness
    targets (``tobj`` with each assigned cell's GIoU-weighted target)."""
    b, a, gj, gi = lt.indices
    valid = lt.valid
    # Denominator of the means over assignments; 0 assignments give 0 / 1 = 0.
    n_valid = valid.sum().clamp(min=1)
    ps = pi[b, a, gj, gi]  # (P, no)

    pbox = predicted_boxes(ps, lt.anchors, head)
    giou = paired_giou(
        torchvision.ops.box_convert(pbox, "cxcywh", "xyxy"),
        torchvision.ops.box_convert(lt.tbox.to(pbox.dtype), "cxcywh", "xyxy"),
    )
    # Padding pairs are masked out of the sums (where, not a multiply by 0: an inf/NaN there
    # must not turn the value into NaN).
    box = torch.where(valid, 1.0 - giou, 0.0).sum() / n_valid
    gr = OBJ_GIOU_RATIO
    tobj = _objectness_targets(tobj, lt, (1.0 - gr) + gr * giou.detach().clamp(0))

    cls = torch.zeros((), device=pi.device)
    if nc > 1:
        cp, cn = smooth
        t = torch.full_like(ps[:, 5:], cn)
        t.scatter_(1, lt.tcls[:, None], cp)
        per_elem = criterion_cls(ps[:, 5:], t)  # (P, nc)
        cls = torch.where(valid[:, None], per_elem, 0.0).sum() / (n_valid * nc)
    return box, cls, tobj


def _criterion(pos_weight: float, fl_gamma: float, device: torch.device) -> Criterion:
    """Element-wise BCE with logits (``reduction="none"``), inside a focal loss
    (arXiv:1708.02002) when ``fl_gamma > 0``: ``bce * alpha_t * (1 - p_t) ** fl_gamma`` with
    ``p_t = p`` where the target is 1 and ``1 - p`` where it is 0 (``p = sigmoid(logit)``,
    ``alpha_t`` likewise :data:`FOCAL_ALPHA` or ``1 -`` it); soft targets interpolate linearly."""
    # torch.full fills on the device; torch.tensor([...]) would copy from the host.
    bce = nn.BCEWithLogitsLoss(
        pos_weight=torch.full((1,), float(pos_weight), device=device), reduction="none"
    )
    if fl_gamma <= 0:
        return bce

    def focal(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        loss = bce(pred, true)
        pred_prob = torch.sigmoid(pred)
        p_t = true * pred_prob + (1 - true) * (1 - pred_prob)
        alpha_factor = true * FOCAL_ALPHA + (1 - true) * (1 - FOCAL_ALPHA)
        return loss * alpha_factor * (1.0 - p_t) ** fl_gamma

    return focal


def _objectness_targets(tobj: torch.Tensor, lt: LayerTargets, score: torch.Tensor) -> torch.Tensor:
    """Objectness targets ``(bs, na, ny, nx)``: ``score[p]`` at the cell of each valid pair,
    the last valid pair winning where several share a cell, 0 elsewhere.

    Without compaction (which would need a host sync) each cell records the largest pair index
    that writes to it (``scatter_reduce`` amax; padding pairs write -1 and never win), then
    takes that pair's score.
    """
    b, a, gj, gi = lt.indices
    _, na, ny, nx = tobj.shape
    cell = ((b * na + a) * ny + gj) * nx + gi
    pair = torch.arange(cell.shape[0], device=cell.device)
    pair = torch.where(lt.valid, pair, -1)
    winner = torch.full((tobj.numel(),), -1, dtype=torch.long, device=cell.device)
    winner.scatter_reduce_(0, cell, pair, reduce="amax")
    flat = torch.where(winner >= 0, score.to(tobj.dtype)[winner.clamp(min=0)], 0.0)
    return flat.view_as(tobj)
