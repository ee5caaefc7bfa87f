"""Anchor boxes against a dataset's label sizes: the fit (best possible recall) and new anchors
by k-means on widths/heights with IoU distance plus a genetic refinement.

One definition shared by ``tools/kmeans_anchors.py`` and the anchor check at training start
(``train_utils/autoanchor.py``), so the figure the trainer warns about is the one the tool
improves.

Label sizes are taken at the training image size the way the loader letterboxes (long side =
img_size). Distance between a box and an anchor is ``1 - IoU`` with both centred at the origin
(YOLOv2); k-means centroids are cluster medians. The genetic step mutates the anchors and keeps
a mutation when ``fitness = mean(best IoU, counting only IoUs above iou_t)`` improves. Best
possible recall (BPR) is the fraction of labels whose best anchor IoU exceeds ``iou_t``, the
training matching threshold (``iou_t`` in cfg/hyp.yaml): labels below it have no anchor to
learn from. All sizes are in pixels at the training image size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from build_utils.boxes import wh_iou
from build_utils.errors import DatasetError

MIN_LABEL_PX = 2.0  # labels smaller than this at img_size are ignored (ultralytics/yolov3: 2 px)
KMEANS_ITERS = 300
MUTATION_PROB, MUTATION_SIGMA = 0.9, 0.1  # genetic step (ultralytics' values)
MUTATION_RANGE = (0.3, 3.0)  # one mutation scales an anchor by at most this


def fitness(wh: np.ndarray, anchors: np.ndarray, iou_t: float) -> float:
    """Mean best IoU of the labels, counting a label only when its best IoU exceeds ``iou_t``."""
    best = wh_iou(wh, anchors).max(1)
    return float((best * (best > iou_t)).mean())


@dataclass(frozen=True)
class AnchorFit:
    """How ``anchors`` serve ``n_labels`` label sizes at the matching threshold ``iou_t``.

    ``bpr``: fraction of labels whose best anchor IoU exceeds ``iou_t`` (best possible recall);
    ``mean_best_iou``: mean over labels of the best IoU; ``anchors_above``: mean number of
    anchors per label whose IoU exceeds ``iou_t`` (targets per label the loss will assign).
    """

    bpr: float
    mean_best_iou: float
    anchors_above: float
    iou_t: float
    n_labels: int

    def describe(self) -> str:
        return (
            f"best possible recall {self.bpr:.4f} at IoU > {self.iou_t}; mean best IoU "
            f"{self.mean_best_iou:.4f}; {self.anchors_above:.2f} anchors per label above it"
        )


def anchor_fit(wh: np.ndarray, anchors: np.ndarray, iou_t: float) -> AnchorFit:
    """The fit of ``(k, 2)`` anchors to ``(n, 2)`` label sizes, n > 0 (see :class:`AnchorFit`)."""
    iou = wh_iou(wh, anchors)
    best = iou.max(1)
    return AnchorFit(
        bpr=float((best > iou_t).mean()),
        mean_best_iou=float(best.mean()),
        anchors_above=float((iou > iou_t).sum(1).mean()),
        iou_t=iou_t,
        n_labels=len(wh),
    )


def kmeans_iou(wh: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means with ``1 - IoU`` distance and median centroids, k-means++ seeding.

    Returns ``(k, 2)`` anchors sorted by area.

    Raises:
        DatasetError: fewer labels than anchors.
    """
    if len(wh) < k:
        raise DatasetError(f"{len(wh)} labels are too few for {k} anchors")
    centroids = [wh[rng.integers(len(wh))]]
    for _ in range(1, k):
        d = 1 - wh_iou(wh, np.array(centroids)).max(1)
        p = d**2
        centroids.append(
            wh[rng.choice(len(wh), p=p / p.sum()) if p.sum() > 0 else rng.integers(len(wh))]
        )
    c = np.array(centroids, dtype=np.float64)
    assign = None
    for _ in range(KMEANS_ITERS):
        iou = wh_iou(wh, c)
        new = iou.argmax(1)
        if assign is not None and (new == assign).all():
            break
        assign = new
        for j in range(k):
            members = wh[assign == j]
            if len(members):
                c[j] = np.median(members, axis=0)
            else:  # an empty cluster takes the worst-served label
                c[j] = wh[iou.max(1).argmin()]
    return c[np.argsort(c.prod(1))]


def evolve(
    wh: np.ndarray, anchors: np.ndarray, iou_t: float, generations: int, rng: np.random.Generator
) -> np.ndarray:
    """Genetic refinement: random multiplicative mutations kept when the fitness improves.

    Returns ``(k, 2)`` anchors sorted by area.
    """
    best, best_f = anchors.copy(), fitness(wh, anchors, iou_t)
    for _ in range(generations):
        mutate = np.ones_like(best)
        while (mutate == 1).all():
            mask = rng.random(best.shape) < MUTATION_PROB
            mutate = np.clip(
                (rng.standard_normal(best.shape) * MUTATION_SIGMA * rng.random() + 1) * mask
                + ~mask,
                *MUTATION_RANGE,
            )
        cand = np.clip(best * mutate, MIN_LABEL_PX, None)
        f = fitness(wh, cand, iou_t)
        if f > best_f:
            best, best_f = cand, f
    return best[np.argsort(best.prod(1))]


def label_sizes(
    labels: Sequence[np.ndarray], shapes: np.ndarray | Sequence[Sequence[int]], img_size: int
) -> np.ndarray:
    """``(n, 2)`` label widths/heights in pixels at ``img_size`` (long side), as letterboxed.

    Args:
        labels: per image ``(m, 5)`` class + normalised cxcywh.
        shapes: per image original ``(w, h)`` in pixels.
        img_size: the training image side.
    """
    out = []
    for lb, (w0, h0) in zip(labels, shapes):
        if len(lb):
            r = img_size / max(w0, h0)
            out.append(lb[:, 3:5] * [w0 * r, h0 * r])
    return np.concatenate(out).astype(np.float64) if out else np.zeros((0, 2))


def too_small(wh: np.ndarray) -> np.ndarray:
    """``(n,)`` bool: labels under :data:`MIN_LABEL_PX` on a side, which anchors ignore."""
    return (wh < MIN_LABEL_PX).any(1)


def format_anchors(anchors: np.ndarray) -> str:
    """Darknet's ``anchors=`` value: ``w,h`` pairs in whole pixels."""
    return ",  ".join(f"{round(w)},{round(h)}" for w, h in anchors)
