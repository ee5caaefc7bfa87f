"""COCO bbox scoring of detections against a ground-truth ``COCO`` object.

Two libraries give the same 12 numbers (equal to 1e-6,
``tests/train_utils/evaluation/test_coco_eval.py``): pycocotools,
the reference, and faster-coco-eval (``requirements-extra.txt``, which ``make`` installs), its
C++ reimplementation, several times faster on large sets. ``backend='auto'``, the default of
every script, takes faster-coco-eval where it is installed and pycocotools elsewhere; the log
names the one that scored.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from build_utils.errors import ConfigError

logger = logging.getLogger(__name__)

# The 12 numbers of COCOeval.summarize(), in its order (AP at IoU 0.50:0.95 unless named; AR at
# 1, 10, 100 detections per image; small/medium/large = area < 32^2, < 96^2, above).
STAT_NAMES = [
    "mAP50-95",
    "mAP50",
    "mAP75",
    "mAP_small",
    "mAP_medium",
    "mAP_large",
    "mAR1",
    "mAR10",
    "mAR100",
    "mAR_small",
    "mAR_medium",
    "mAR_large",
]
AUTO_BACKEND = "auto"  # faster-coco-eval where installed, else pycocotools
BACKENDS = (AUTO_BACKEND, "pycocotools", "faster-coco-eval")

# Decimals kept in detection files: 1/1000 pixel and 1e-5 score are far below what changes
# a COCO number, and keep the JSON small.
BBOX_DECIMALS = 3
SCORE_DECIMALS = 5


def coco_to_rows(detections: Sequence[dict[str, Any]]) -> torch.Tensor:
    """COCO detection dicts -> (n, 7) float64 rows: image_id, category_id, x, y, w, h, score.

    float64 holds the ids and the rounded values exactly, so :func:`rows_to_coco` gives back the
    same dicts; a tensor is what collectives move cheaply (no pickling).
    """
    if not detections:
        return torch.zeros((0, 7), dtype=torch.float64)
    return torch.tensor(
        [[d["image_id"], d["category_id"], *d["bbox"], d["score"]] for d in detections],
        dtype=torch.float64,
    )


def rows_to_coco(rows: torch.Tensor) -> list[dict[str, Any]]:
    """Inverse of :func:`coco_to_rows`."""
    return [
        {"image_id": int(r[0]), "category_id": int(r[1]), "bbox": r[2:6], "score": r[6]}
        for r in rows.tolist()
    ]


def detections_to_coco(
    outputs: Sequence[torch.Tensor], image_ids: Sequence[int]
) -> list[dict[str, Any]]:
    """COCO-format detection dicts from per-image NMS outputs.

    Args:
        outputs: per image (n, 6) = x1, y1, x2, y2 in original-image pixels, score, class id.
        image_ids: the COCO image id of each output (the dataset index).

    Returns:
        ``[{"image_id", "category_id", "bbox": [x_min, y_min, w, h], "score"}, ...]``.
    """
    if len(outputs) != len(image_ids):
        raise ValueError(f"{len(outputs)} outputs for {len(image_ids)} image ids")
    if not outputs:
        return []
    counts = [int(o.shape[0]) for o in outputs]
    if sum(counts) == 0:
        return []
    det = torch.cat([o.detach().reshape(-1, 6) for o in outputs]).to("cpu", torch.float64)
    det = det.numpy()
    xywh = np.stack((det[:, 0], det[:, 1], det[:, 2] - det[:, 0], det[:, 3] - det[:, 1]), 1).round(
        BBOX_DECIMALS
    )
    scores = det[:, 4].round(SCORE_DECIMALS).tolist()
    classes = det[:, 5].astype(np.int64).tolist()
    ids = np.repeat(np.asarray(image_ids, dtype=np.int64), counts).tolist()
    return [
        {"image_id": i, "category_id": c, "bbox": b, "score": s}
        for i, c, b, s in zip(ids, classes, xywh.tolist(), scores)
    ]


def faster_coco_eval_available() -> bool:
    """Whether the optional ``faster-coco-eval`` backend can be imported."""
    try:
        import faster_coco_eval  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str) -> str:
    """The library that scores for ``--coco-backend backend``: ``auto`` is faster-coco-eval
    when it can be imported, else pycocotools; the others are themselves.

    Raises:
        ConfigError: an unknown name, or faster-coco-eval asked for by name and not installed.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown COCO backend {backend!r}; choose one of {BACKENDS}")
    available = faster_coco_eval_available()
    if backend == "faster-coco-eval" and not available:
        raise ConfigError(
            "COCO backend 'faster-coco-eval' is not installed; run 'pip install -r "
            "requirements-extra.txt' or use --coco-backend auto (pycocotools when it is missing)"
        )
    if backend == AUTO_BACKEND:
        return "faster-coco-eval" if available else "pycocotools"
    return backend


class CocoEvaluator:
    """Accumulates COCO-format detections and scores them.

    ``update()`` any number of times, then ``evaluate()`` returns the 12 stats (in
    ``STAT_NAMES`` order; the scorer's own printing is silenced), and ``per_class_ap()`` gives
    AP per category.
    """

    def __init__(self, coco_gt: COCO, backend: str = AUTO_BACKEND):
        self.coco_gt = coco_gt
        # The library that scores (``auto`` resolved), see :func:`resolve_backend`.
        self.backend = resolve_backend(backend)
        self.results: list[dict[str, Any]] = []
        self.stats: np.ndarray | None = None
        self.coco_eval: Any = None
        self._img_ids = set(coco_gt.getImgIds())

    def update(self, results: Sequence[dict[str, Any]]) -> None:
        """Add detections: dicts with ``image_id``, ``category_id``, ``bbox`` (x_min, y_min, w,
        h in original pixels) and ``score``. The dicts are copied (pycocotools edits them)."""
        unknown = {r["image_id"] for r in results} - self._img_ids
        if unknown:
            raise ValueError(
                f"detections for {len(unknown)} image ids absent from the ground truth, "
                f"e.g. {sorted(unknown)[:5]}"
            )
        self.results.extend(dict(r) for r in results)

    def evaluate(self) -> np.ndarray:
        """Score everything added so far; returns the 12 stats (``STAT_NAMES`` order).

        With no detections at all every stat is 0 (pycocotools cannot load an empty result),
        or -1 as pycocotools has it for an area range without ground truth.
        """
        if not self.results:
            self.coco_eval = None
            self.stats = self._stats_without_detections()
            return self.stats.copy()
        # Both libraries run the same three steps; pycocotools prints as it goes.
        with contextlib.redirect_stdout(io.StringIO()):
            if self.backend == "pycocotools":
                coco_eval = COCOeval(self.coco_gt, self.coco_gt.loadRes(self.results), "bbox")
            else:
                coco_eval = self._faster_coco_eval()
            coco_eval.evaluate()
            coco_eval.accumulate()
            coco_eval.summarize()  # fills coco_eval.stats
        self.coco_eval = coco_eval
        self.stats = np.asarray(coco_eval.stats[: len(STAT_NAMES)], dtype=np.float64)
        return self.stats.copy()

    def _faster_coco_eval(self) -> Any:
        from faster_coco_eval import COCO as FasterCOCO
        from faster_coco_eval import COCOeval_faster

        def quiet(*args: Any) -> None:
            pass

        # A deep copy: faster-coco-eval's index building may edit the dicts it is given, and
        # those belong to the pycocotools ground truth.
        gt = FasterCOCO(self.coco_gt.dataset, use_deepcopy=True, print_function=quiet)
        dt = gt.loadRes(self.results)
        return COCOeval_faster(gt, dt, "bbox", print_function=quiet)

    def _stats_without_detections(self) -> np.ndarray:
        areas = [
            a.get("area", 0)
            for a in self.coco_gt.dataset.get("annotations", [])
            if not a.get("iscrowd", 0)
        ]
        # pycocotools' area ranges (bounds included): all, small, medium, large.
        ranges = [(0, 1e10), (0, 32**2), (32**2, 96**2), (96**2, 1e10)]
        had = [any(lo <= a <= hi for a in areas) for lo, hi in ranges]
        # Which range each stat is of (STAT_NAMES: 3 AP of all, 3 by area, 3 AR of all, 3 by area).
        of = [0, 0, 0, 1, 2, 3, 0, 0, 0, 1, 2, 3]
        return np.array([0.0 if had[r] else -1.0 for r in of])

    def per_class_ap(self) -> dict[int, tuple[float, float]]:
        """``{category id: (AP@0.5:0.95, AP@0.5)}`` over all areas at 100 detections per image.

        NaN for a category without ground truth (AP is undefined there); 0 for every other
        category when there were no detections. Call after :meth:`evaluate`.
        """
        if self.stats is None:
            raise RuntimeError("call evaluate() before per_class_ap()")
        cat_ids = sorted(self.coco_gt.getCatIds())
        if self.coco_eval is None:
            return {
                c: ((0.0, 0.0) if self.coco_gt.getAnnIds(catIds=[c]) else (math.nan, math.nan))
                for c in cat_ids
            }
        # precision: (iou thresholds, recall points, categories, area ranges, max dets);
        # area range 0 is 'all', the last max-dets entry is 100; -1 marks "no ground truth".
        precision = self.coco_eval.eval["precision"]
        out = {}
        for k, c in enumerate(self.coco_eval.params.catIds):
            out[int(c)] = (
                _mean_valid(precision[:, :, k, 0, -1]),
                _mean_valid(precision[0, :, k, 0, -1]),
            )
        return out


def _mean_valid(p: np.ndarray) -> float:
    p = p[p > -1]
    return float(p.mean()) if p.size else math.nan
