"""Settings of an evaluation pass, shared by the evaluation inside training and
``validation.py``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from build_utils.boxes import non_max_suppression
from train_utils.cli import DEFAULT_EVAL_CONF, DEFAULT_EVAL_IOU
from train_utils.evaluation.coco_eval import AUTO_BACKEND, resolve_backend

logger = logging.getLogger(__name__)

MAX_DET = 300


@dataclass(frozen=True)
class EvalOptions:
    """Settings of an evaluation pass; the defaults are the training-time evaluation's.

    Attributes:
        device: where the batches go.
        conf_thres, iou_thres, multi_label, max_det: NMS settings.
        amp: mixed-precision inference: a dtype, True or None/False (see
            :func:`autocast_context`).
        backend: COCO scoring library: ``auto`` (faster-coco-eval where installed, else
            pycocotools), ``pycocotools`` or ``faster-coco-eval``; :func:`eval_options` gives
            the library ``auto`` resolved to.
        show_progress: draw a tqdm bar (rank 0).
        channels_last: feed NHWC batches.
        per_class: also compute per-class AP.
        single_cls: score every class as one (YOLOv5's ``--single-cls`` on a multi-class
            model): class-agnostic NMS, then every detection is class 0.
        augment: test-time augmentation (``models.tta``: scales 1, 0.83 flipped, 0.67);
            ``validation.py --augment`` only, never the evaluation inside training.
        dtype: the model's weights and its inputs (``validation.py --half``: float16).
    """

    device: torch.device
    conf_thres: float = DEFAULT_EVAL_CONF
    iou_thres: float = DEFAULT_EVAL_IOU
    multi_label: bool = True
    max_det: int = MAX_DET
    amp: bool | torch.dtype | None = None
    backend: str = "auto"
    show_progress: bool = False
    channels_last: bool = False
    per_class: bool = False
    single_cls: bool = False
    augment: bool = False
    dtype: torch.dtype = torch.float32

    def nms(self, det: torch.Tensor) -> list[torch.Tensor]:
        """Non-maximum suppression of raw detections ``det`` (bs, n, 5 + nc) as these options
        ask: the one call of the evaluation and of its speed measurement, so that
        ``--task speed`` times the NMS the scores come from."""
        return non_max_suppression(
            det.float(),
            conf_thres=self.conf_thres,
            iou_thres=self.iou_thres,
            multi_label=self.multi_label,
            # One class: a box found as two classes is one detection, kept once.
            agnostic=self.single_cls,
            max_det=self.max_det,
        )


def eval_options(
    run: Mapping[str, Any],
    device: torch.device,
    amp: torch.dtype | None,
    channels_last: bool,
    show_progress: bool,
    **nms: Any,
) -> EvalOptions:
    """The options of an evaluation of a run: the one builder for the evaluation inside training
    (``run`` = the run's config) and ``validation.py`` (``run`` = the checkpoint's run config
    with the flags given on top), so both score with the same thresholds, backend, precision
    and memory format. ``nms`` may set ``multi_label``/``max_det``/``single_cls``/``augment``
    and ``dtype`` (``validation.py`` flags). The COCO backend is resolved here, once per run,
    and logged: ``auto`` becomes the library that will score.

    Raises:
        ConfigError: ``coco_backend`` names faster-coco-eval and it is not installed (before
            training, not at the first evaluation).
    """
    asked = str(run["coco_backend"])
    backend = resolve_backend(asked)
    if asked == AUTO_BACKEND:
        why = "installed" if backend == "faster-coco-eval" else "faster-coco-eval is not installed"
        logger.info("COCO scoring: %s (--coco-backend auto: %s)", backend, why)
    else:
        logger.info("COCO scoring: %s", backend)
    return EvalOptions(
        device,
        float(run["conf_thres"]),
        float(run["iou_thres"]),
        amp=amp,
        backend=backend,
        show_progress=show_progress,
        channels_last=channels_last,
        per_class=True,
        **nms,
    )
