"""Settings of an evaluation pass, shared by the evaluation inside training and
``validation.py``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

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
        backend: COCO scoring library (``pycocotools`` or ``faster-coco-eval``).
        show_progress: draw a tqdm bar (rank 0).
        channels_last: feed NHWC batches.
        per_class: also compute per-class AP.
    """

    device: torch.device
    conf_thres: float = 0.001
    iou_thres: float = 0.6
    multi_label: bool = True
    max_det: int = MAX_DET
    amp: bool | torch.dtype | None = None
    backend: str = "pycocotools"
    show_progress: bool = False
    channels_last: bool = False
    per_class: bool = False
