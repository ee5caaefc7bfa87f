"""One training epoch and one evaluation pass. No file I/O and no rank checks live here: the
caller (``trainer.run``) decides who logs, writes and scores.

Collectives used here (``reduce_dict``, ``all_gather``, ``all_reduce_flag``) are no-ops without a
process group, so the same code serves one process and DDP.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from build_utils.boxes import non_max_suppression, scale_coords
from build_utils.errors import YoloError
from models.loss import compute_loss
from train_utils.coco_eval import CocoEvaluator, detections_to_coco
from train_utils.distributed_utils import all_gather, all_reduce_flag, reduce_dict
from train_utils.ema import ModelEMA

GRID = 32
WARMUP_START_FACTOR = 1e-3  # learning rate multiplier at the first warm-up iteration
LOSS_NAMES = ("box_loss", "obj_loss", "cls_loss", "loss")
MAX_DET = 300

logger = logging.getLogger(__name__)


class NonFiniteLossError(YoloError):
    """The loss became NaN or infinite; training stops without saving the broken weights."""


@dataclass
class EpochStats:
    box_loss: float
    obj_loss: float
    cls_loss: float
    loss: float
    lr: float
    images: int

    def as_dict(self) -> dict[str, float]:
        return {"box_loss": self.box_loss, "obj_loss": self.obj_loss, "cls_loss": self.cls_loss,
                "loss": self.loss}


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """True when oneDNN has native bf16 kernels on this CPU (AVX512-BF16 or AMX).

    Without them (e.g. AVX2-only CPUs) a bf16 convolution falls back to ATen's generic
    ``_slow_conv2d`` and a YOLO training step runs about 10x slower than in fp32
    (``bench/bench_model.py`` measures it), so ``--amp`` would only cost time there.
    """
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


@functools.cache
def _warn_slow_cpu_bf16() -> None:
    logger.warning("--amp: this CPU has no native bf16 kernels (AVX512-BF16/AMX); bf16 autocast "
                   "would make training and evaluation about 10x slower, so they run in fp32")


def autocast_context(device: torch.device, amp: bool) -> Any:
    """bf16 autocast on CPU, fp16 on CUDA (with a GradScaler); a no-op without amp, and on a
    CPU without native bf16 kernels (with a warning, once): see :func:`cpu_bf16_is_fast`."""
    if not amp:
        return nullcontext()
    if device.type == "cpu" and not cpu_bf16_is_fast():
        _warn_slow_cpu_bf16()
        return nullcontext()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def warmup_lr(base: float, ni: int, warmup_iters: int, start: float | None = None) -> float:
    """Learning rate at global iteration ``ni``: linear from ``start`` (default
    ``base * WARMUP_START_FACTOR``) to the scheduled ``base`` over ``warmup_iters`` iterations.

    ``start`` above ``base`` gives the lineage's bias warm-up, which falls from a high value so
    that the objectness and class priors settle in the first steps."""
    if ni >= warmup_iters:
        return base
    if start is None:
        start = base * WARMUP_START_FACTOR
    return start + (base - start) * ni / warmup_iters


def resize_batch(imgs: torch.Tensor, img_size: int) -> torch.Tensor:
    """Scale a batch so its longer side is ``img_size``, sides rounded up to a multiple of 32."""
    sf = img_size / max(imgs.shape[2:])
    if sf == 1:
        return imgs
    ns = [math.ceil(x * sf / GRID) * GRID for x in imgs.shape[2:]]
    return F.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)


def train_one_epoch(
    model: nn.Module,
    model_without_ddp: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable,
    device: torch.device,
    epoch: int,
    hyp: dict[str, Any],
    base_lrs: list[float],
    accumulate: int,
    warmup_iters: int,
    scaler: torch.amp.GradScaler | None = None,
    ema: ModelEMA | None = None,
    amp: bool = False,
    multi_scale: tuple[int, int] | None = None,
    log_interval: int = 10,
    show_progress: bool = True,
    channels_last: bool = False,
    set_train_mode: Callable[[], None] | None = None,
) -> EpochStats:
    """Train for one pass over ``loader``.

    ``base_lrs`` are the scheduled learning rates of the optimizer's groups for this epoch;
    warm-up scales them per iteration. The optimizer steps every ``accumulate`` batches and at the
    last batch of the epoch, so an epoch boundary never leaves gradients pending (which keeps
    ``--resume`` exact). Losses are synchronised with the host only every ``log_interval``
    iterations; a non-finite loss on any rank raises :class:`NonFiniteLossError` on every rank.
    """
    if set_train_mode is not None:
        set_train_mode()
    else:
        model.train()
    nb = len(loader)
    sums = torch.zeros(4, device=device)
    finite_flags: list[torch.Tensor] = []
    pending_paths: list[list[str]] = []
    n_images = 0
    lr = base_lrs[0]
    bias_start = hyp.get("warmup_bias_lr", 0.0)
    img_size = None
    pbar = tqdm(total=nb, desc=f"epoch {epoch}", disable=not show_progress, leave=False,
                dynamic_ncols=True)
    optimizer.zero_grad(set_to_none=True)
    for i, (imgs, targets, paths, _, _) in enumerate(loader):
        ni = i + nb * epoch
        imgs = imgs.to(device, non_blocking=True).float().div_(255)
        targets = targets.to(device, non_blocking=True)
        if multi_scale is not None:
            if img_size is None or i % accumulate == 0:
                img_size = random.randrange(multi_scale[0], multi_scale[1] + GRID, GRID)
            imgs = resize_batch(imgs, img_size)
        if channels_last:
            imgs = imgs.contiguous(memory_format=torch.channels_last)

        for g, base in zip(optimizer.param_groups, base_lrs):
            start = bias_start if g.get("name") == "bias" and bias_start else None
            g["lr"] = warmup_lr(base, ni, warmup_iters, start)
        lr = optimizer.param_groups[0]["lr"]

        with autocast_context(device, amp):
            preds = model(imgs)
        # The loss stays in fp32 whatever the forward precision.
        loss_dict = compute_loss([p.float() for p in preds], targets, model_without_ddp, hyp)
        loss = loss_dict["box_loss"] + loss_dict["obj_loss"] + loss_dict["class_loss"]
        step_loss = loss / accumulate
        if scaler is not None:
            scaler.scale(step_loss).backward()
        else:
            step_loss.backward()

        if (i + 1) % accumulate == 0 or i == nb - 1:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(model_without_ddp)

        detached = torch.stack([loss_dict["box_loss"], loss_dict["obj_loss"],
                                loss_dict["class_loss"], loss]).detach()
        sums += detached
        finite_flags.append(torch.isfinite(detached[3]))
        pending_paths.append(list(paths))
        n_images += imgs.shape[0]

        if (i + 1) % log_interval == 0 or i == nb - 1:
            _check_finite(finite_flags, pending_paths, epoch)
            finite_flags.clear()
            pending_paths.clear()
            if show_progress:
                mean = (sums / (i + 1)).tolist()
                mem = (f"{torch.cuda.memory_reserved(device) / 2**30:.1f}G"
                       if device.type == "cuda" else "-")
                pbar.set_postfix(box=f"{mean[0]:.3f}", obj=f"{mean[1]:.3f}", cls=f"{mean[2]:.3f}",
                                 loss=f"{mean[3]:.3f}", lr=f"{lr:.2e}",
                                 size=tuple(imgs.shape[2:]), mem=mem, refresh=False)
        pbar.update(1)
    pbar.close()
    means = reduce_dict({"m": sums / max(nb, 1)})["m"].tolist()
    return EpochStats(*means, lr=lr, images=n_images)


def _check_finite(flags: list[torch.Tensor], paths: list[list[str]], epoch: int) -> None:
    ok = torch.stack(flags)
    bad_here = not bool(ok.all())
    if all_reduce_flag(bad_here):
        if bad_here:
            first = int((~ok).nonzero()[0])
            raise NonFiniteLossError(
                f"non-finite loss in epoch {epoch}; offending batch: {', '.join(paths[first])}. "
                f"Lower lr0, check these images' labels, or disable --amp")
        raise NonFiniteLossError(f"non-finite loss on another rank in epoch {epoch}; stopping")


@torch.no_grad()
def predict_batches(
    model: nn.Module,
    loader: Iterable,
    device: torch.device,
    conf_thres: float,
    iou_thres: float,
    multi_label: bool = True,
    max_det: int = MAX_DET,
    amp: bool = False,
    show_progress: bool = False,
    channels_last: bool = False,
) -> list[dict[str, Any]]:
    """COCO-format detections (original-image pixels, image_id = dataset index) for ``loader``."""
    model.eval()
    results: list[dict[str, Any]] = []
    for imgs, _, _, shapes, indices in tqdm(loader, desc="eval", disable=not show_progress,
                                            leave=False, dynamic_ncols=True):
        imgs = imgs.to(device, non_blocking=True).float().div_(255)
        if channels_last:
            imgs = imgs.contiguous(memory_format=torch.channels_last)
        with autocast_context(device, amp):
            det = model(imgs)[0]
        outputs = non_max_suppression(det.float(), conf_thres=conf_thres, iou_thres=iou_thres,
                                      multi_label=multi_label, max_det=max_det)
        scaled = []
        for out, shape in zip(outputs, shapes):
            out = out.cpu()
            if len(out):
                out[:, :4] = scale_coords(imgs.shape[2:], out[:, :4], shape[0], shape[1])
            scaled.append(out)
        results.extend(detections_to_coco(scaled, [int(i) for i in indices]))
    return results


def evaluate(
    model: nn.Module,
    loader: Iterable,
    device: torch.device,
    coco_gt: Any | None,
    conf_thres: float = 0.001,
    iou_thres: float = 0.6,
    multi_label: bool = True,
    max_det: int = MAX_DET,
    amp: bool = False,
    backend: str = "pycocotools",
    show_progress: bool = False,
    channels_last: bool = False,
    per_class: bool = False,
) -> tuple[np.ndarray | None, dict[int, tuple[float, float]] | None, list[dict[str, Any]]]:
    """Evaluate this rank's shard, gather every rank's detections, and score them once.

    Every rank must call this (it gathers). Only a caller that passes ``coco_gt`` gets the 12
    COCO stats (and per-class AP when asked); others get ``(None, None, [])``. The gathered
    detections are returned with the stats so that they can be saved.
    """
    local = predict_batches(model, loader, device, conf_thres, iou_thres, multi_label, max_det,
                            amp, show_progress, channels_last)
    gathered = all_gather(local)
    if coco_gt is None:
        return None, None, []
    detections = [d for part in gathered for d in part]
    evaluator = CocoEvaluator(coco_gt, backend=backend)
    evaluator.update(detections)
    stats = evaluator.evaluate()
    return stats, (evaluator.per_class_ap() if per_class else None), detections
