"""``validation.py --task speed``: time per image of pre-processing, inference and NMS.

Pre-processing is what happens to a collated batch before the model (to the device, to float
in [0, 1]); reading and letterboxing images (the data loader's work) is not counted, as in
ultralytics/yolov3's reports. CUDA timings synchronise the device around each step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from models.tta import detect
from train_utils.evaluation.options import EvalOptions
from train_utils.precision import autocast_context, to_model_input

WARMUP_BATCHES = 1  # batches run before timing starts (allocations, oneDNN/cuDNN plans)


@dataclass(frozen=True)
class SpeedResult:
    """Milliseconds per image for each step, over ``images`` timed images."""

    preprocess_ms: float
    inference_ms: float
    nms_ms: float
    images: int
    shape: tuple[int, ...]

    def format(self) -> str:
        return (
            f"speed: {self.preprocess_ms:.1f} ms pre-process, {self.inference_ms:.1f} ms "
            f"inference, {self.nms_ms:.1f} ms NMS per image ({self.images} images, last batch "
            f"shape {self.shape})"
        )


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def measure_speed(model: nn.Module, loader: Iterable, opts: EvalOptions) -> SpeedResult:
    """Run ``model`` over ``loader`` (batches ``(imgs uint8 (bs, 3, H, W), ...)``) and time
    each step; the first ``WARMUP_BATCHES`` batches are run but not timed (unless there are no
    others)."""
    model.eval()
    per_batch: list[tuple[float, float, float, int]] = []
    shape: tuple[int, ...] = ()
    for batch in loader:
        imgs = batch[0]
        t0 = _sync(opts.device)
        x = to_model_input(imgs, opts.device, opts.channels_last, opts.dtype)
        t1 = _sync(opts.device)
        with autocast_context(opts.device, opts.amp):
            det = detect(model, x, opts.augment)
        t2 = _sync(opts.device)
        opts.nms(det)
        t3 = _sync(opts.device)
        per_batch.append((t1 - t0, t2 - t1, t3 - t2, x.shape[0]))
        shape = tuple(x.shape)
    # A single batch is timed although it is the warm-up: a rough figure beats none.
    timed = per_batch[WARMUP_BATCHES:] or per_batch
    images = sum(t[3] for t in timed)
    n = max(images, 1)
    return SpeedResult(*(1000 * sum(t[k] for t in timed) / n for k in range(3)), images, shape)
