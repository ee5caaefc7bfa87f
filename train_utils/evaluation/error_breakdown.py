"""What the missing AP is made of: the TIDE error breakdown (Bolya et al., "TIDE: A General Toolbox
for Identifying Object Detection Errors", ECCV 2020), for ``validation.py``'s report.

Every false positive at IoU ``t_f`` = 0.5 gets exactly one type, tested in this order (IoU_max
is over the image's labels; "same class" = the detection's class):

- localisation: ``t_b <= IoU_max <= t_f`` with a label of the same class;
- classification: ``IoU_max >= t_f`` with a label of another class;
- duplicate: ``IoU_max >= t_f`` with a same-class label already matched by a higher-scoring
  detection;
- background: ``IoU_max <= t_b`` with every label (``t_b`` = 0.1), and every detection of an
  image without labels;
- both (classification and localisation): what is left, i.e. ``t_b < IoU`` with some label but
  neither of the above;

and every label no detection matched is *missed* unless a classification or localisation error
points at it. Each type's effect is the dAP: the AP50 gained when all errors of that type alone
are fixed, the others left as they are (TIDE's "main errors", AP in points, 0-100): a
classification or localisation error becomes the true positive of the label it points at (only
the highest-scoring one per label; the others, and those pointing at a matched label, are
removed), a both, duplicate or background error is removed, a missed label leaves the label
count. Two more rows follow TIDE's "special errors": all false positives scored below every
true positive, and every unmatched label removed (recall made perfect without touching
precision).

This follows the authors' reference implementation (``tidecv`` 1.0.1, ``TIDERun``: matching,
types, which error a fix goes to) with two departures in the AP. Its 101 recall points are
COCO's (``np.linspace``, as pycocotools and ``metrics.compute_ap``), where tidecv's ``x / 100``
differs when a recall falls exactly on a point. And equal scores rank in the same order in
every evaluation (the detections' order, as pycocotools), where tidecv moves a fixed
evaluation's false positives before its true positives, so that with tied scores a fix can
lower its AP (TIDE then shows 0) and every dAP comes out low. Where no recall falls on a point
and no scores tie, the counts, the AP50 and every dAP equal tidecv's (to 1e-12 on random cases
with empty and crowded images); with ties the counts and the AP50 still do.

The AP is over at most ``max_dets`` (100) detections per image whatever their class, averaged
over the classes with labels or detections (a class detected but never labelled counts as 0,
as in TIDE), so it is pycocotools' mAP50 when no image has more than 100 detections and every
detected class has labels. Boxes are ``xyxy`` absolute pixels. The code is this project's:
``tidecv`` needs pandas and seaborn and has not been released since 2020.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from build_utils.atomic import write_text
from train_utils.evaluation.metrics import box_iou_np, compute_ap, dets_by_image, gt_by_image

logger = logging.getLogger(__name__)

POS_IOU = 0.5  # t_f: a detection matches a label at this IoU or above (AP50)
BG_IOU = 0.1  # t_b: below this IoU with every label a detection is on the background
MAX_DETS = 100  # TIDE's detections per image (over all classes), highest scores first
ERRORS_FILE = "errors.json"

# The six main types in TIDE's order (its short names: Cls, Loc, Both, Dupe, Bkg, Miss), then
# the two special ones (FalsePos, FalseNeg); the values are the names the report prints.
CLS = "classification"
LOC = "localisation"
BOTH = "both"
DUPE = "duplicate"
BKG = "background"
MISSED = "missed"
MAIN_ERRORS = (CLS, LOC, BOTH, DUPE, BKG, MISSED)
FALSE_POS, FALSE_NEG = "false positives", "false negatives"
_TYPE_CODE = {name: k for k, name in enumerate(MAIN_ERRORS)}
_TP = -1  # the error code of a true positive


@dataclass
class ErrorBreakdown:
    """The breakdown of one evaluation.

    Attributes:
        ap50: TIDE's AP at IoU ``pos_iou`` (points, 0-100) of the detections as they are.
        counts: errors per type (``MAIN_ERRORS``; the special types count every false positive
            and every unmatched label).
        dap: AP50 points gained when the type's errors are fixed (main types never below 0,
            as TIDE reports them); NaN where a fix leaves no class to average (e.g. missed
            when nothing was detected), and everywhere with neither labels nor detections.
        pos_iou, bg_iou, max_dets: the settings.
    """

    ap50: float
    counts: dict[str, int]
    dap: dict[str, float]
    pos_iou: float = POS_IOU
    bg_iou: float = BG_IOU
    max_dets: int = MAX_DETS

    def format(self) -> str:
        """The table for the log."""
        # AP50 on the COCO table's scale (a fraction, as mAP50 is logged beside it); dAP in
        # TIDE's own unit, percentage points, said as such.
        lines = [
            f"error breakdown (TIDE: IoU {self.pos_iou:g}, background below {self.bg_iou:g}, "
            f"{self.max_dets} detections per image; AP50 {self.ap50 / 100:.4f}; dAP = "
            "percentage points of AP50 gained when that type is fixed, 1.00 = 0.01 AP50):",
            f"{'type':>16s} {'count':>7s} {'dAP':>6s}",
        ]
        for name in (*MAIN_ERRORS, FALSE_POS, FALSE_NEG):
            dap = self.dap[name]
            shown = f"{dap:6.2f}" if math.isfinite(dap) else f"{'-':>6s}"
            lines.append(f"{name:>16s} {self.counts[name]:7d} {shown}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain types for ``errors.json``."""
        return {
            "method": "TIDE (Bolya et al. 2020), dAP in AP50 points (0-100)",
            "pos_iou": self.pos_iou,
            "bg_iou": self.bg_iou,
            "max_dets": self.max_dets,
            "ap50": _finite_or_none(self.ap50),
            "errors": {
                name: {"count": self.counts[name], "dAP": _finite_or_none(self.dap[name])}
                for name in (*MAIN_ERRORS, FALSE_POS, FALSE_NEG)
            },
        }


def _finite_or_none(x: float) -> float | None:
    """JSON has no NaN: an AP over no class at all (nothing labelled or detected, or nothing
    left once every label is fixed away) is null."""
    return x if math.isfinite(x) else None


@dataclass
class _Errors:
    """Every detection kept and every label, as TIDE sees them after matching.

    Detections, in TIDE's push order (image by image, by score inside one; its false positives
    in this order are also its list of errors): ``cls``, ``score``, ``err`` (the type's index
    in ``MAIN_ERRORS``, ``_TP`` for a true positive) and ``fix_cls`` (the class of the true
    positive a classification or localisation error becomes when fixed; -1 when it is removed
    instead). Labels: ``gt_cls``, ``missed`` (a MISSED error) and ``unmatched`` (every false
    negative).
    """

    cls: np.ndarray
    score: np.ndarray
    err: np.ndarray
    fix_cls: np.ndarray
    gt_cls: np.ndarray
    missed: np.ndarray
    unmatched: np.ndarray


def _image_errors(
    det: np.ndarray, labels: np.ndarray, pos_iou: float, bg_iou: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One image: ``det (n, 6)`` xyxy, score, class sorted by score (highest first) and already
    cut to ``max_dets``; ``labels (m, 5)`` class, xyxy.

    Returns (err (n,), fix_cls (n,), matched (m,) bool, usable (m,) bool): ``usable`` labels
    are unmatched ones a classification or localisation error points at (not missed).
    """
    n, m = len(det), len(labels)
    err = np.full(n, _TP, dtype=np.int64)
    fix_cls = np.full(n, -1, dtype=np.int64)
    matched = np.zeros(m, dtype=bool)
    usable = np.zeros(m, dtype=bool)
    if m == 0:
        err[:] = _TYPE_CODE[BKG]
        return err, fix_cls, matched, usable
    iou = box_iou_np(det[:, :4], labels[:, 1:])
    same = det[:, 5][:, None] == labels[:, 0][None, :]
    cls_iou = iou * same
    # Greedy in score order: each detection takes the free same-class label of highest IoU.
    tp = np.zeros(n, dtype=bool)
    free = cls_iou.copy()
    for i in np.flatnonzero((cls_iou >= pos_iou).any(1)).tolist():
        j = int(free[i].argmax())
        if free[i, j] >= pos_iou:
            tp[i] = matched[j] = True
            free[:, j] = 0
    rows = np.arange(n)
    loc_j = cls_iou.argmax(1)
    loc_iou = cls_iou[rows, loc_j]
    other_iou = iou * ~same
    cls_j = other_iou.argmax(1)
    dupe_iou = (cls_iou * matched[None, :]).max(1)
    is_loc = ~tp & (bg_iou <= loc_iou) & (loc_iou <= pos_iou)
    is_cls = ~tp & ~is_loc & (other_iou[rows, cls_j] >= pos_iou)
    is_dupe = ~tp & ~is_loc & ~is_cls & (dupe_iou >= pos_iou)
    is_bkg = ~tp & ~is_loc & ~is_cls & ~is_dupe & (iou.max(1) <= bg_iou)
    err[~tp] = _TYPE_CODE[BOTH]
    err[is_loc] = _TYPE_CODE[LOC]
    err[is_cls] = _TYPE_CODE[CLS]
    err[is_dupe] = _TYPE_CODE[DUPE]
    err[is_bkg] = _TYPE_CODE[BKG]
    # A classification or localisation error whose label is still free is fixed into its true
    # positive when it is the label's highest-scoring such error (the first, in score order).
    target = np.where(is_loc, loc_j, np.where(is_cls, cls_j, -1))
    pointing = np.flatnonzero((target >= 0) & ~matched[np.maximum(target, 0)])
    if len(pointing):
        labels_hit, first = np.unique(target[pointing], return_index=True)
        usable[labels_hit] = True
        best = pointing[first]
        fix_cls[best] = labels[target[best], 0].astype(np.int64)
    return err, fix_cls, matched, usable


def _collect(
    gt: Mapping[int, np.ndarray],
    dets: Mapping[int, np.ndarray],
    pos_iou: float,
    bg_iou: float,
    max_dets: int,
) -> _Errors:
    """Match and type every detection of every image of ``gt`` (its order is TIDE's)."""
    cls, score, err, fix_cls = [], [], [], []
    gt_cls, missed, unmatched = [], [], []
    empty = np.zeros((0, 6))
    for img_id, labels in gt.items():
        det = dets.get(img_id, empty)
        det = det[np.argsort(-det[:, 4], kind="stable")][:max_dets]
        e, f, matched, usable = _image_errors(det, labels, pos_iou, bg_iou)
        cls.append(det[:, 5].astype(np.int64))
        score.append(det[:, 4])
        err.append(e)
        fix_cls.append(f)
        gt_cls.append(labels[:, 0].astype(np.int64))
        missed.append(~matched & ~usable)
        unmatched.append(~matched)

    def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    return _Errors(
        cls=cat(cls, np.int64),
        score=cat(score, np.float64),
        err=cat(err, np.int64),
        fix_cls=cat(fix_cls, np.int64),
        gt_cls=cat(gt_cls, np.int64),
        missed=cat(missed, bool),
        unmatched=cat(unmatched, bool),
    )


def _mean_ap(
    cls: np.ndarray,
    score: np.ndarray,
    tp: np.ndarray,
    n_gt: Mapping[int, int],
) -> float:
    """TIDE's mAP (points): per class, AP of the detections in the given order sorted stably by
    score, with ``n_gt[c]`` labels (AP 0 without labels); averaged over the classes that have
    labels or detections."""
    # One stable sort by class, then by decreasing score: each class is a slice in the order its
    # own stable score sort gives (equal scores keep the given order), read with one pass over
    # the detections instead of a mask over all of them per class (80 x N, 9 calls at COCO).
    order = np.lexsort((-score, cls))
    by_class, hits_all = cls[order], tp[order]
    present = np.unique(by_class)
    starts = dict(zip(present.tolist(), np.searchsorted(by_class, present, "left").tolist()))
    ends = dict(zip(present.tolist(), np.searchsorted(by_class, present, "right").tolist()))
    aps = []
    for c in sorted(set(n_gt) | set(present.tolist())):
        labelled = n_gt.get(c, 0)
        if c not in starts and labelled == 0:
            continue  # TIDE's empty class: neither labels nor detections
        if labelled == 0:
            aps.append(0.0)
            continue
        hits = hits_all[starts.get(c, 0) : ends.get(c, 0)]
        n_tp = np.cumsum(hits)
        precision = n_tp / np.arange(1, len(hits) + 1)
        aps.append(compute_ap(n_tp / labelled, precision) * 100)
    return float(np.mean(aps)) if aps else math.nan


def error_breakdown(
    gt: Mapping[int, np.ndarray],
    dets: Mapping[int, np.ndarray],
    pos_iou: float = POS_IOU,
    bg_iou: float = BG_IOU,
    max_dets: int = MAX_DETS,
) -> ErrorBreakdown:
    """The TIDE breakdown of ``dets`` against ``gt``.

    Args:
        gt: ``{image id: (m, 5) class, x1, y1, x2, y2}`` for every image
            (:func:`metrics.gt_by_image`); its order is the images' order.
        dets: ``{image id: (n, 6) x1, y1, x2, y2, score, class}`` (:func:`metrics.dets_by_image`);
            images without detections may be absent, ids absent from ``gt`` are ignored.
    """
    e = _collect(gt, dets, pos_iou, bg_iou, max_dets)
    n_gt = Counter(e.gt_cls.tolist())
    is_tp = e.err == _TP
    ap50 = _mean_ap(e.cls, e.score, is_tp, n_gt)

    # A fixed evaluation keeps every detection where it was, so that equal scores rank alike in
    # every evaluation (tidecv moves a fix's errors before its true positives, and then a fix
    # can lower the AP of tied scores).
    fixable = e.fix_cls >= 0

    def fixed_ap(kind: str) -> float:
        hit = e.err == _TYPE_CODE[kind]
        to_tp = hit & fixable if kind in (CLS, LOC) else np.zeros_like(hit)
        keep = ~hit | to_tp
        cls = np.where(to_tp, e.fix_cls, e.cls)
        # A class left without labels drops out of the Counter: _mean_ap treats it as 0 labels.
        counts = n_gt - Counter(e.gt_cls[e.missed].tolist()) if kind == MISSED else n_gt
        return _mean_ap(cls[keep], e.score[keep], (is_tp | to_tp)[keep], counts)

    # Fixing can only raise the AP; max() keeps float noise from showing as a negative gain.
    dap = {kind: max(fixed_ap(kind) - ap50, 0.0) for kind in MAIN_ERRORS}
    counts = {kind: int((e.err == _TYPE_CODE[kind]).sum()) for kind in MAIN_ERRORS[:-1]}
    counts[MISSED] = int(e.missed.sum())

    # Special errors: every false positive scored below every true positive (perfect
    # precision), and every unmatched label gone (perfect recall).
    dap[FALSE_POS] = _mean_ap(e.cls, is_tp.astype(np.float64), is_tp, n_gt) - ap50
    fewer = n_gt - Counter(e.gt_cls[e.unmatched].tolist())
    dap[FALSE_NEG] = _mean_ap(e.cls, e.score, is_tp, fewer) - ap50
    counts[FALSE_POS] = int((~is_tp).sum())
    counts[FALSE_NEG] = int(e.unmatched.sum())
    return ErrorBreakdown(ap50, counts, dap, pos_iou, bg_iou, max_dets)


def report_errors(
    out_dir: Path,
    coco_gt: Any,
    detections: Sequence[dict[str, Any]],
    flag: str | None = None,
) -> ErrorBreakdown:
    """Compute the breakdown of ``detections`` (COCO dicts) against ``coco_gt`` (pycocotools
    ``COCO``), log its table and write ``out_dir/errors.json`` (atomically).

    Raises:
        OutputError: the file cannot be written (``flag``: the option that chose ``out_dir``).
    """
    breakdown = error_breakdown(gt_by_image(coco_gt), dets_by_image(detections))
    logger.info("%s", breakdown.format())
    write_text(out_dir / ERRORS_FILE, json.dumps(breakdown.to_dict(), indent=2) + "\n", flag)
    return breakdown
