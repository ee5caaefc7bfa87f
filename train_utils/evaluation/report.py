"""The pictures and the per-class table of one evaluation, from the detections and ground truth
that the COCO evaluation scored.

Written by rank 0 only (the training reporter and ``validation.py`` call it):
``confusion_matrix.png``, ``PR_curve.png``, ``F1_curve.png``, ``P_curve.png``, ``R_curve.png``,
``val_batch0_labels.jpg``, ``val_batch0_pred.jpg`` and ``per_class.csv`` (class, instances, P,
R, AP50, AP50-95; P and R at the confidence of maximal mean F1, see ``metrics.py``).
"""

from __future__ import annotations

import csv
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from build_utils.atomic import atomic_write, make_output_dir, reported_write
from build_utils.errors import DatasetError
from build_utils.image_io import read_image
from train_utils.evaluation.metrics import (
    CONFUSION_CONF,
    DetectionMetrics,
    dets_by_image,
    evaluate_detections,
    gt_by_image,
)
from train_utils.evaluation.plots import (
    CURVE_FILES,
    MOSAIC_MAX_IMAGES,
    plot_confusion_matrix,
    plot_curves,
    plot_images,
)

logger = logging.getLogger(__name__)

PER_CLASS_HEADER = ["class", "name", "instances", "P", "R", "AP50", "AP50-95"]
PER_CLASS_FILE = "per_class.csv"
CONFUSION_FILE = "confusion_matrix.png"
VAL_BATCH_FILES = ("val_batch0_labels.jpg", "val_batch0_pred.jpg")
# What write_eval_report writes under fixed names (a tool that must not replace them checks these).
REPORT_FILES = (PER_CLASS_FILE, CONFUSION_FILE, *CURVE_FILES, *VAL_BATCH_FILES)


@dataclass
class ClassRow:
    """One row of the per-class table (``cls`` -1 for the all-classes row)."""

    cls: int
    name: str
    instances: int
    p: float
    r: float
    ap50: float
    ap: float


def per_class_rows(
    metrics: DetectionMetrics,
    names: Sequence[str],
    coco_ap: Mapping[int, tuple[float, float]] | None,
) -> list[ClassRow]:
    """The all-classes row, then one row per class with labels or detections.

    AP50 and AP50-95 come from pycocotools (``coco_ap``, :meth:`CocoEvaluator.per_class_ap`)
    when given, so that they agree with the COCO summary; else AP50 from ``metrics`` and
    AP50-95 NaN.
    """
    m = metrics.per_class
    rows = []
    for k, c in enumerate(m.classes.tolist()):
        ap, ap50 = (coco_ap or {}).get(c, (math.nan, float(m.ap50[k])))
        name = names[c] if 0 <= c < len(names) else str(c)
        rows.append(ClassRow(c, name, int(m.n_labels[k]), float(m.p[k]), float(m.r[k]), ap50, ap))
    labelled = [r for r in rows if r.instances > 0]

    def mean(values: list[float]) -> float:
        v = [x for x in values if not math.isnan(x)]
        return float(np.mean(v)) if v else math.nan

    total = ClassRow(
        -1,
        "all",
        sum(r.instances for r in rows),
        mean([r.p for r in labelled]),
        mean([r.r for r in labelled]),
        mean([r.ap50 for r in labelled]),
        mean([r.ap for r in labelled]),
    )
    return [total, *rows]


def format_table(rows: Sequence[ClassRow], best_conf: float) -> str:
    """The per-class table as text for the log."""
    lines = [
        f"per class (P, R at confidence {best_conf:.3f}; AP at IoU 0.5 and 0.5:0.95):",
        f"{'class':>20s} {'instances':>9s} {'P':>6s} {'R':>6s} {'AP50':>6s} {'AP50-95':>7s}",
    ]
    for r in rows:
        lines.append(
            f"{r.name[:20]:>20s} {r.instances:9d} {r.p:6.3f} {r.r:6.3f} {r.ap50:6.3f} {r.ap:7.3f}"
        )
    return "\n".join(lines)


def write_per_class_csv(path: Path, rows: Sequence[ClassRow], flag: str | None = None) -> None:
    """The per-class table as CSV, written atomically.

    Raises:
        OutputError: ``path`` cannot be written (``flag``: the option that chose the folder).
    """
    with reported_write(path, flag), atomic_write(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(PER_CLASS_HEADER)
        for r in rows:
            w.writerow(
                [r.cls, r.name, r.instances, *(round(v, 5) for v in (r.p, r.r, r.ap50, r.ap))]
            )


def plot_val_batch(
    coco_gt: Any,
    gt: Mapping[int, np.ndarray],
    dets: Mapping[int, np.ndarray],
    names: Sequence[str],
    out_dir: Path,
) -> None:
    """``val_batch0_labels.jpg`` and ``val_batch0_pred.jpg``: the first images of the validation
    set (by image id) with their labels, and with the detections of confidence >=
    ``CONFUSION_CONF``, in original-image pixels."""
    ids = sorted(coco_gt.getImgIds())[:MOSAIC_MAX_IMAGES]
    images, labels, preds, titles = [], [], [], []
    for i in ids:
        file_name = coco_gt.imgs[i].get("file_name", "")
        if not file_name:
            continue
        try:
            # Checked like every data read: a file swapped for a FIFO or a pixel bomb since the
            # dataset was checked must not hang or fill memory for a picture.
            img = read_image(file_name)
        except DatasetError:
            continue
        g = gt.get(i, np.zeros((0, 5)))
        d = dets.get(i, np.zeros((0, 6)))
        images.append(img)
        labels.append(np.concatenate((g[:, 1:], np.ones((len(g), 1)), g[:, :1]), 1))
        preds.append(d[d[:, 4] >= CONFUSION_CONF])
        titles.append(Path(file_name).name)
    if not images:
        return
    labels_file, pred_file = VAL_BATCH_FILES
    plot_images(images, labels, names, out_dir / labels_file, titles)
    plot_images(images, preds, names, out_dir / pred_file, titles, show_conf=True)


def write_eval_report(
    out_dir: Path,
    coco_gt: Any,
    detections: Sequence[dict[str, Any]],
    names: Sequence[str],
    coco_ap: Mapping[int, tuple[float, float]] | None = None,
    plots: bool = True,
    flag: str | None = None,
) -> tuple[DetectionMetrics, list[ClassRow]]:
    """Compute the per-class metrics of ``detections`` (COCO dicts, category id = class) against
    ``coco_gt`` (pycocotools ``COCO``, image ``file_name`` = image path), log the table and
    write the CSV and (with ``plots``) the pictures into ``out_dir``.

    Raises:
        OutputError: a file cannot be written (``flag``: the option that chose ``out_dir``).
    """
    t0 = time.time()
    make_output_dir(out_dir, flag)
    gt = gt_by_image(coco_gt)
    dets = dets_by_image(detections)
    nc = max(len(names), len(coco_gt.getCatIds()))
    metrics = evaluate_detections(gt, dets, nc)
    rows = per_class_rows(metrics, names, coco_ap)
    logger.info("%s", format_table(rows, metrics.per_class.best_conf))
    write_per_class_csv(out_dir / PER_CLASS_FILE, rows, flag)
    if not plots:
        return metrics, rows
    plot_confusion_matrix(metrics.confusion.matrix, names, out_dir / CONFUSION_FILE)
    plot_curves(metrics.per_class, names, out_dir)
    plot_val_batch(coco_gt, gt, dets, names, out_dir)
    logger.debug("evaluation pictures in %s took %.2f s", out_dir, time.time() - t0)
    return metrics, rows
