"""Per-class detection metrics at one IoU threshold: TP/FP matching, P/R/F1 curves over the
confidence, AP per class and the confusion matrix.

These complement the official COCO numbers (``coco_eval.CocoEvaluator``, pycocotools): they are
computed from the same COCO-format detections and ground truth, and answer the questions the
COCO summary does not (which class is weak, which classes are confused, which confidence
threshold to deploy at). P and R per class are read at the confidence that maximises the mean
F1 over classes, as ultralytics YOLOv3/YOLOv5 reports them.

Boxes are ``xyxy`` absolute pixels throughout; classes are integer ids ``0 .. nc - 1``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchvision.ops import box_iou

MATCH_IOU = 0.5  # IoU at which a detection counts as a true positive (curves, AP50)
CONFUSION_CONF = 0.25  # detections below this confidence stay out of the confusion matrix
CONFUSION_IOU = 0.45  # IoU at which a detection and a label are paired in the confusion matrix
CURVE_POINTS = 1001  # confidence grid of the P/R/F1 curves: 0, 0.001, ..., 1
AP_RECALL_POINTS = 101  # recall points of the AP integral, as COCO
EPS = 1e-16


def box_iou_np(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of ``a (n, 4)`` and ``b (m, 4)`` xyxy boxes -> ``(n, m)`` float64: torchvision's,
    0 (not NaN) for two empty boxes."""
    a, b = (torch.from_numpy(np.asarray(x, dtype=np.float64).reshape(-1, 4)) for x in (a, b))
    return box_iou(a, b).nan_to_num_(0.0).numpy()


def match_detections(
    det: np.ndarray,
    labels: np.ndarray,
    iou_thres: float = MATCH_IOU,
    iou: np.ndarray | None = None,
) -> np.ndarray:
    """Which detections of one image are true positives.

    Greedy in descending confidence (as COCO does): each detection takes the unmatched label of
    its class with the highest IoU, if that IoU is at least ``iou_thres``.

    Args:
        det: ``(n, 6)`` = x1, y1, x2, y2, confidence, class.
        labels: ``(m, 5)`` = class, x1, y1, x2, y2.
        iou: ``(n, m)`` IoU of ``det`` and ``labels`` when already computed.

    Returns:
        ``(n,)`` bool, in the order of ``det``.
    """
    det = np.asarray(det, dtype=np.float64).reshape(-1, 6)
    labels = np.asarray(labels, dtype=np.float64).reshape(-1, 5)
    tp = np.zeros(len(det), dtype=bool)
    if not len(det) or not len(labels):
        return tp
    iou = box_iou_np(det[:, :4], labels[:, 1:]) if iou is None else iou.copy()
    iou[det[:, 5][:, None] != labels[:, 0][None, :]] = -1.0
    taken = np.zeros(len(labels), dtype=bool)
    order = np.argsort(-det[:, 4], kind="stable")
    # Only detections with some candidate can match; the rest (most of them at a low
    # threshold) need no Python-level step.
    order = order[(iou >= iou_thres).any(1)[order]]
    for i in order:
        row = np.where(taken, -1.0, iou[i])
        j = int(row.argmax())
        if row[j] >= iou_thres:
            taken[j] = True
            tp[i] = True
    return tp


def compute_ap(recall: np.ndarray, precision: np.ndarray) -> float:
    """Average precision as COCO computes it: the mean over 101 recall points ``r`` of the best
    precision reached at a recall of at least ``r`` (0 where that recall is never reached).

    ``recall``/``precision`` are cumulative values in descending-confidence order.
    """
    recall = np.asarray(recall, dtype=np.float64)
    if not len(recall):
        return 0.0
    envelope = np.flip(np.maximum.accumulate(np.flip(np.asarray(precision, dtype=np.float64))))
    x = np.linspace(0, 1, AP_RECALL_POINTS)
    idx = np.searchsorted(recall, x, side="left")
    q = np.where(idx < len(recall), envelope[np.minimum(idx, len(recall) - 1)], 0.0)
    return float(q.mean())


@dataclass
class ClassMetrics:
    """Per-class results at IoU ``MATCH_IOU``.

    Attributes:
        classes: ``(k,)`` the class ids that have labels or detections, ascending.
        n_labels: ``(k,)`` label (instance) count per class.
        p, r, f1: ``(k,)`` precision, recall and F1 at ``best_conf``.
        ap50: ``(k,)`` average precision at IoU 0.5.
        px: ``(CURVE_POINTS,)`` confidence grid; ``p_curve``, ``r_curve``, ``f1_curve``:
            ``(k, CURVE_POINTS)`` values at each confidence; ``recall_grid``/``pr_curve``: the
            precision-recall curve ``(k, CURVE_POINTS)`` sampled at ``px`` as recall.
        best_conf: the confidence of the maximal mean F1 over classes.
    """

    classes: np.ndarray
    n_labels: np.ndarray
    p: np.ndarray
    r: np.ndarray
    f1: np.ndarray
    ap50: np.ndarray
    px: np.ndarray
    p_curve: np.ndarray
    r_curve: np.ndarray
    f1_curve: np.ndarray
    pr_curve: np.ndarray
    best_conf: float

    @property
    def mean(self) -> tuple[float, float, float]:
        """Mean (P, R, AP50) over the classes that have labels."""
        has = self.n_labels > 0
        if not has.any():
            return 0.0, 0.0, 0.0
        return float(self.p[has].mean()), float(self.r[has].mean()), float(self.ap50[has].mean())


def ap_per_class(
    tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, target_cls: np.ndarray
) -> ClassMetrics:
    """P/R/F1 curves and AP50 per class from matched detections of a whole dataset.

    Args:
        tp: ``(n,)`` bool, true positive at IoU 0.5 (:func:`match_detections`).
        conf: ``(n,)`` detection confidences; pred_cls: ``(n,)`` their classes.
        target_cls: ``(m,)`` the class of every label.
    """
    tp = np.asarray(tp, dtype=bool)
    conf = np.asarray(conf, dtype=np.float64)
    pred_cls = np.asarray(pred_cls).astype(np.int64)
    target_cls = np.asarray(target_cls).astype(np.int64)
    # By class, then by decreasing confidence: each class is one contiguous slice.
    order = np.lexsort((-conf, pred_cls))
    tp, conf, pred_cls = tp[order], conf[order], pred_cls[order]
    classes_all = np.unique(pred_cls)
    starts = np.searchsorted(pred_cls, classes_all)
    ends = np.append(starts[1:], len(pred_cls))
    slices = {int(c): slice(a, b) for c, a, b in zip(classes_all, starts, ends)}
    n_per_class = np.bincount(target_cls, minlength=1) if len(target_cls) else np.zeros(1, int)
    classes = np.unique(np.concatenate((target_cls, pred_cls)))
    k = len(classes)
    px = np.linspace(0, 1, CURVE_POINTS)
    p_curve, r_curve, pr_curve = (np.zeros((k, CURVE_POINTS)) for _ in range(3))
    ap50, n_labels = np.zeros(k), np.zeros(k, dtype=np.int64)
    for ci, c in enumerate(classes):
        i = slices.get(int(c))
        n_l = int(n_per_class[c]) if c < len(n_per_class) else 0
        n_labels[ci] = n_l
        if i is None or n_l == 0:
            continue
        tpc = np.cumsum(tp[i])
        fpc = np.cumsum(~tp[i])
        recall = tpc / (n_l + EPS)
        precision = tpc / (tpc + fpc)
        # np.interp needs increasing x: confidence decreases along the cumulative arrays.
        r_curve[ci] = np.interp(-px, -conf[i], recall, left=0)
        p_curve[ci] = np.interp(-px, -conf[i], precision, left=1)
        ap50[ci] = compute_ap(recall, precision)
        mpre = np.flip(np.maximum.accumulate(np.flip(np.concatenate(([1.0], precision, [0.0])))))
        pr_curve[ci] = np.interp(px, np.concatenate(([0.0], recall, [1.0])), mpre)
    f1_curve = 2 * p_curve * r_curve / (p_curve + r_curve + EPS)
    has = n_labels > 0
    mean_f1 = f1_curve[has].mean(0) if has.any() else np.zeros(CURVE_POINTS)
    best = int(mean_f1.argmax())
    return ClassMetrics(
        classes=classes,
        n_labels=n_labels,
        p=p_curve[:, best],
        r=r_curve[:, best],
        f1=f1_curve[:, best],
        ap50=ap50,
        px=px,
        p_curve=p_curve,
        r_curve=r_curve,
        f1_curve=f1_curve,
        pr_curve=pr_curve,
        best_conf=float(px[best]),
    )


class ConfusionMatrix:
    """``(nc + 1, nc + 1)`` counts: rows are predicted classes, columns true classes; the last
    row/column is background (a label nobody found: last row; a detection of nothing: last
    column)."""

    def __init__(self, nc: int, conf: float = CONFUSION_CONF, iou_thres: float = CONFUSION_IOU):
        self.nc, self.conf, self.iou_thres = nc, conf, iou_thres
        self.matrix = np.zeros((nc + 1, nc + 1), dtype=np.int64)

    def process_image(
        self, det: np.ndarray, labels: np.ndarray, iou: np.ndarray | None = None
    ) -> None:
        """Add one image. ``det (n, 6)`` xyxy, conf, class; ``labels (m, 5)`` class, xyxy;
        ``iou (n, m)`` of the two when already computed."""
        det = np.asarray(det, dtype=np.float64).reshape(-1, 6)
        labels = np.asarray(labels, dtype=np.float64).reshape(-1, 5)
        keep = det[:, 4] >= self.conf
        det = det[keep]
        gt_cls = labels[:, 0].astype(np.int64)
        det_cls = det[:, 5].astype(np.int64)
        bg = self.nc
        iou = box_iou_np(labels[:, 1:], det[:, :4]) if iou is None else iou[keep].T
        gi, di = np.nonzero(iou > self.iou_thres)
        # Each label and each detection takes part in at most one pair, best IoU first.
        order = np.argsort(-iou[gi, di], kind="stable")
        gi, di = gi[order], di[order]
        used_g = np.zeros(len(labels), dtype=bool)
        used_d = np.zeros(len(det), dtype=bool)
        for g, d in zip(gi.tolist(), di.tolist()):
            if used_g[g] or used_d[d]:
                continue
            used_g[g] = used_d[d] = True
            self.matrix[det_cls[d], gt_cls[g]] += 1
        np.add.at(self.matrix, (bg, gt_cls[~used_g]), 1)
        np.add.at(self.matrix, (det_cls[~used_d], bg), 1)


@dataclass
class DetectionMetrics:
    """What :func:`evaluate_detections` returns: per-class metrics and the confusion matrix."""

    per_class: ClassMetrics
    confusion: ConfusionMatrix


def gt_by_image(coco_gt: Any) -> dict[int, np.ndarray]:
    """``{image id: (m, 5) class, x1, y1, x2, y2}`` from a pycocotools ``COCO`` object."""
    out: dict[int, np.ndarray] = {}
    for img_id in coco_gt.getImgIds():
        anns = coco_gt.imgToAnns.get(img_id, [])
        rows = [
            (a["category_id"], a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2],
             a["bbox"][1] + a["bbox"][3])
            for a in anns
            if not a.get("iscrowd", 0)
        ]  # fmt: skip
        out[int(img_id)] = np.asarray(rows, dtype=np.float64).reshape(-1, 5)
    return out


def dets_by_image(detections: Sequence[dict[str, Any]]) -> dict[int, np.ndarray]:
    """``{image id: (n, 6) x1, y1, x2, y2, score, class}`` from COCO-format detection dicts."""
    rows: dict[int, list[tuple[float, ...]]] = defaultdict(list)
    for d in detections:
        x, y, w, h = d["bbox"]
        rows[int(d["image_id"])].append((x, y, x + w, y + h, d["score"], d["category_id"]))
    return {k: np.asarray(v, dtype=np.float64).reshape(-1, 6) for k, v in rows.items()}


def evaluate_detections(
    gt: dict[int, np.ndarray], dets: dict[int, np.ndarray], nc: int
) -> DetectionMetrics:
    """Per-class metrics and confusion matrix of a whole dataset.

    Args:
        gt: ``{image id: (m, 5) class, xyxy}`` for every image (:func:`gt_by_image`).
        dets: ``{image id: (n, 6) xyxy, conf, class}`` (:func:`dets_by_image`); images without
            detections may be absent.
        nc: the number of classes.
    """
    cm = ConfusionMatrix(nc)
    tps, confs, classes, targets = [], [], [], []
    empty = np.zeros((0, 6))
    for img_id, labels in gt.items():
        det = dets.get(img_id, empty)
        iou = box_iou_np(det[:, :4], labels[:, 1:])
        tps.append(match_detections(det, labels, iou=iou))
        confs.append(det[:, 4])
        classes.append(det[:, 5])
        targets.append(labels[:, 0])
        cm.process_image(det, labels, iou=iou)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)  # noqa: E731
    return DetectionMetrics(
        ap_per_class(cat(tps).astype(bool), cat(confs), cat(classes), cat(targets)), cm
    )
