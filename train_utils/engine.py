"""One training epoch and one evaluation pass. No file I/O and no rank checks live here: the
caller (``trainer.run``) decides who logs, writes and scores.

Collectives used here (``all_reduce_mean``, ``gather_rows_to_main``, ``all_reduce_flag``) are
no-ops without a process group, so the same code serves one process and DDP.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from build_utils.augmentations import GRID
from build_utils.boxes import scale_coords
from build_utils.errors import YoloError
from models.darknet_loss import DarknetLoss
from models.loss import compute_loss
from models.tta import detect
from train_utils.darknet_schedule import DarknetEMA, DarknetSettings, DarknetSGD, current_rate
from train_utils.distributed.comm import all_reduce_flag, all_reduce_mean, gather_rows_to_main
from train_utils.ema import ModelEMA
from train_utils.evaluation.coco_eval import (
    CocoEvaluator,
    coco_to_rows,
    detections_to_coco,
    rows_to_coco,
)
from train_utils.evaluation.coco_gt import dataset_image_ids
from train_utils.evaluation.options import EvalOptions
from train_utils.precision import autocast_context, to_model_input
from train_utils.threads import adapt_threads

WARMUP_START_FACTOR = 1e-3  # learning rate multiplier at the first warm-up iteration

logger = logging.getLogger(__name__)


# What the non-finite loss error advises: under the default recipe, and under --recipe darknet
# (whose rate and precision come from the cfg: no lr0, no --amp).
NONFINITE_ADVICE = "Lower lr0, check these images' labels, or disable --amp"
DARKNET_NONFINITE_ADVICE = (
    "Lower the cfg's learning_rate (or lengthen its burn_in), or check these images' labels"
)


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
    # Seconds the device waited for the loader this epoch (mean over ranks), see _WaitClock.
    data_wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "box_loss": self.box_loss,
            "obj_loss": self.obj_loss,
            "cls_loss": self.cls_loss,
            "loss": self.loss,
        }


def warmup_lr(base: float, ni: int, warmup_iters: int, start: float | None = None) -> float:
    """Learning rate at global iteration ``ni``: linear from ``start`` (default
    ``base * WARMUP_START_FACTOR``) to the scheduled ``base`` over ``warmup_iters`` iterations.

    ``start`` above ``base`` gives ultralytics/yolov3's bias warm-up, which falls from a high value
    so that the objectness and class priors settle in the first steps."""
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


@dataclass(frozen=True)
class TrainOptions:
    """What one training epoch needs besides the model, optimizer and data.

    Attributes:
        device: where the batches go.
        hyp: hyperparameters with the loss gains already scaled (``scale_loss_gains``).
        accumulate: batches per optimizer step.
        warmup_iters: iterations of learning-rate warm-up, counted from the first epoch.
        amp: the autocast dtype, or None/False for fp32 (see :func:`autocast_context`).
        multi_scale: (min, max) side for multi-scale training, or None for fixed sizes.
        log_interval: iterations between host syncs of the losses (finiteness check, progress).
        show_progress: draw a tqdm bar (rank 0).
        channels_last: feed NHWC batches.
        seed: the run's seed; multi-scale sizes are drawn from (seed, epoch, step) alone, so
            every rank uses the same size at each step (see :func:`multi_scale_size`).
        label_smoothing: ``--label-smoothing`` eps of the class targets (0: one-hot).
    """

    device: torch.device
    hyp: Mapping[str, Any]
    accumulate: int = 1
    warmup_iters: int = 0
    amp: bool | torch.dtype | None = None
    multi_scale: tuple[int, int] | None = None
    log_interval: int = 10
    show_progress: bool = False
    channels_last: bool = False
    seed: int = 0
    label_smoothing: float = 0.0


def multi_scale_size(bounds: tuple[int, int], seed: int, epoch: int, step: int) -> int:
    """The training side for optimizer step ``step`` of ``epoch``: a multiple of :data:`GRID` in
    ``bounds`` (inclusive), the same on every rank.

    Drawn from its own generator seeded by (seed, epoch, step), not from the rank's random
    stream: with per-rank sizes every DDP step waits for the rank with the largest images.
    """
    choices = (bounds[1] - bounds[0]) // GRID + 1
    rng = np.random.default_rng([seed, epoch, step])
    return bounds[0] + GRID * int(rng.integers(choices))


@dataclass
class TrainState:
    """The objects a training step updates.

    ``model`` is what the batches go through (a DDP or ``torch.compile`` wrapper, or the model
    itself); ``model_without_ddp`` is the Darknet inside, whose heads the loss reads and whose
    weights the EMA averages. The scheduler gives each epoch's learning rates, which warm-up
    scales per iteration.
    """

    model: nn.Module
    model_without_ddp: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None = None
    ema: ModelEMA | None = None


@dataclass
class DarknetState:
    """What an iteration of ``--recipe darknet`` updates (:func:`train_darknet_iterations`).

    ``model``/``model_without_ddp`` as in :class:`TrainState`; ``averager`` is Darknet's EMA
    (its averages enter the weights only at ``max_batches - 1000``, so evaluation and saving use
    the model itself: ``ema`` and ``scaler`` are None, the trainer's slots for ours).
    """

    model: nn.Module
    model_without_ddp: nn.Module
    optimizer: DarknetSGD
    averager: DarknetEMA
    criterion: DarknetLoss
    settings: DarknetSettings
    ema: None = None
    scaler: None = None

    def state_dict(self, iteration: int) -> dict[str, Any]:
        """The checkpoint's parts after ``iteration``: the update's momentum buffers, the EMA,
        and Darknet's ``seen`` (images per process); no scheduler (the rate is a function of
        the iteration) and no ``ModelEMA``."""
        return {
            "recipe": "darknet",
            "optimizer": self.optimizer.state_dict(),
            "darknet_ema": self.averager.state_dict(),
            "seen": iteration * self.settings.update_batch,
            "scheduler": None,
            "scaler": None,
            "ema": None,
            "ema_updates": 0,
        }


def iterations_name(first: int, last: int, subdivisions: int) -> str:
    """A round of ``--recipe darknet`` as its progress bar and stop message name it: the bar
    and a stop's "batch i/n" count mini-batches, ``subdivisions`` to an iteration."""
    each = f" ({subdivisions} mini-batches each)" if subdivisions > 1 else ""
    return f"iterations {first}-{last}{each}"


def train_darknet_iterations(
    state: DarknetState, loader: Iterable, first: int, last: int, opts: TrainOptions
) -> EpochStats:
    """Darknet's iterations ``first .. last`` (from 1, inclusive): each ``subdivisions``
    mini-batches of ``loader`` forward and backward through Darknet's loss (gradients summed,
    DDP's all-reduce on the last), then one update at :func:`current_rate` of the iteration and
    the EMA (``train_network`` then ``update_network``).

    Returns the mean of Darknet's reported loss per mini-batch (``loss``; box, objectness and
    class parts are not separated: NaN) over all ranks, and the last rate.
    """
    state.model.train()
    settings, model = state.settings, state.model_without_ddp
    subdivisions = settings.subdivisions
    nb = (last - first + 1) * subdivisions
    meter = _LossMeter(
        nb, iterations_name(first, last, subdivisions), opts, DARKNET_NONFINITE_ADVICE
    )
    batches = iter(meter.clock.batches(loader))
    parts = torch.full((3,), math.nan, device=opts.device)
    state.optimizer.zero_grad(set_to_none=True)
    for k in range(first, last + 1):
        # Darknet's image count before the iteration, which stopbackward=N reads.
        model.seen = (k - 1) * settings.update_batch
        rate = current_rate(settings, k)
        for s in range(subdivisions):
            imgs, targets, paths, _, _ = next(batches)
            imgs = to_model_input(imgs, opts.device, opts.channels_last)
            with nullcontext() if s == subdivisions - 1 else _no_sync(state.model):
                preds = state.model(imgs)
                # The loader's (host) targets: the criterion builds its truths there.
                loss, reported = state.criterion(
                    [p.float() for p in preds], targets, imgs.shape[-2:]
                )
                loss.backward()
            meter.add(torch.cat([parts, reported.view(1)]), paths, imgs.shape, rate)
        state.optimizer.set_rate(rate)
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.averager.update(model, k)
        adapt_threads(opts.device)
    return meter.finish()  # Collective: the mean losses and data wait over all ranks


def train_one_epoch(
    state: TrainState, loader: Iterable, epoch: int, opts: TrainOptions
) -> EpochStats:
    """Train for one pass over ``loader``; returns the epoch's mean losses over all ranks.

    The optimizer steps every ``opts.accumulate`` batches and at the last batch of the epoch, so
    an epoch boundary never leaves gradients pending (which keeps ``--resume`` exact). Losses
    are synchronised with the host only every ``opts.log_interval`` iterations; a non-finite
    loss on any rank raises :class:`NonFiniteLossError` on every rank.

    ``data_wait_s`` of the result is the time the device waited for the loader (the mean over
    ranks, see :class:`_WaitClock`), the rest of the epoch being compute.
    """
    state.model.train()
    nb = len(loader)
    base_lrs = state.scheduler.get_last_lr()
    meter = _LossMeter(nb, f"epoch {epoch}", opts)
    img_size = None
    state.optimizer.zero_grad(set_to_none=True)
    for i, (imgs, targets, paths, _, _) in enumerate(meter.clock.batches(loader)):
        if opts.multi_scale is not None and (img_size is None or i % opts.accumulate == 0):
            img_size = multi_scale_size(opts.multi_scale, opts.seed, epoch, i // opts.accumulate)
        imgs, targets = _prepare_batch(imgs, targets, img_size, opts)
        lr = _warm_up(state.optimizer, base_lrs, i + nb * epoch, opts)
        steps = (i + 1) % opts.accumulate == 0 or i == nb - 1
        # DDP all-reduces gradients in backward(); on micro-batches that do not end in an
        # optimizer step that traffic is wasted, so it waits for the last one (no_sync).
        with nullcontext() if steps else _no_sync(state.model):
            losses = _forward_backward(state, imgs, targets, opts)
        if steps:
            _optimizer_step(state)
        meter.add(losses, paths, imgs.shape, lr)
        adapt_threads(opts.device)
    return meter.finish()  # Collective: the mean losses and data wait over all ranks


class _WaitClock:
    """How long the device waited for the loader during an epoch.

    On the CPU the device is the process itself: the wall time blocked in ``next(loader)``
    (the first call includes starting the loader's workers). On CUDA, kernels run behind the
    host, so time blocked in ``next`` may overlap work still queued on the GPU; what starves
    the GPU is the gap between the end of the queued work and the batch's arrival. Two timing
    events per batch measure exactly that gap on the GPU's own clock without a host sync in
    the loop; they are read once, at the epoch's end.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.waited = 0.0
        self.gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``loader``'s batches, timing each wait."""
        t0, queued_done = self._start()
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            self._stop(t0, queued_done)
            yield batch
            t0, queued_done = self._start()

    def _start(self) -> tuple[float, torch.cuda.Event | None]:
        if not self.cuda:
            return time.perf_counter(), None
        queued_done = torch.cuda.Event(enable_timing=True)
        # On the training device's stream, whichever device is current.
        queued_done.record(torch.cuda.current_stream(self.device))
        return 0.0, queued_done

    def _stop(self, t0: float, queued_done: torch.cuda.Event | None) -> None:
        if queued_done is None:
            self.waited += time.perf_counter() - t0
            return
        arrived = torch.cuda.Event(enable_timing=True)
        arrived.record(torch.cuda.current_stream(self.device))
        self.gaps.append((queued_done, arrived))

    def seconds(self) -> float:
        """The epoch's total wait; on CUDA this waits for the last batch's events."""
        if self.gaps:
            self.gaps[-1][1].synchronize()
            self.waited += sum(a.elapsed_time(b) for a, b in self.gaps) / 1000.0
            self.gaps.clear()
        return self.waited


def _no_sync(model: nn.Module) -> Any:
    """``model.no_sync()`` for a DDP model (also under ``torch.compile``), else a no-op."""
    inner = getattr(model, "_orig_mod", model)
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    return nullcontext()


def _prepare_batch(
    imgs: torch.Tensor, targets: torch.Tensor, img_size: int | None, opts: TrainOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (bs, 3, h, w) -> float in [0, 1] on the device, resized for multi-scale."""
    if img_size is None:
        imgs = to_model_input(imgs, opts.device, opts.channels_last)
    else:
        # Multi-scale resizes the NCHW batch and only then changes the memory format, as it
        # always has: interpolating a channels_last batch may round differently.
        imgs = resize_batch(to_model_input(imgs, opts.device), img_size)
        if opts.channels_last:
            imgs = imgs.contiguous(memory_format=torch.channels_last)
    targets = targets.to(opts.device, non_blocking=True)
    return imgs, targets


def _warm_up(
    optimizer: torch.optim.Optimizer, base_lrs: list[float], ni: int, opts: TrainOptions
) -> float:
    """Set every group's learning rate for global iteration ``ni`` (and, with
    ``warmup_momentum`` >= 0, YOLOv5's momentum ramp to ``momentum``); returns the first
    group's rate."""
    bias_start = opts.hyp.get("warmup_bias_lr", 0.0)
    momentum_start = opts.hyp.get("warmup_momentum", -1.0)
    momentum = None
    if momentum_start >= 0 and ni <= opts.warmup_iters:
        momentum = warmup_lr(opts.hyp["momentum"], ni, opts.warmup_iters, momentum_start)
    for g, base in zip(optimizer.param_groups, base_lrs):
        start = bias_start if g.get("name") == "bias" and bias_start else None
        g["lr"] = warmup_lr(base, ni, opts.warmup_iters, start)
        if momentum is not None and "betas" in g:
            g["betas"] = (momentum, g["betas"][1])
        elif momentum is not None:
            g["momentum"] = momentum
    return optimizer.param_groups[0]["lr"]


def _forward_backward(
    state: TrainState, imgs: torch.Tensor, targets: torch.Tensor, opts: TrainOptions
) -> torch.Tensor:
    """One micro-batch; returns the detached (box, obj, cls, total) losses."""
    with autocast_context(opts.device, opts.amp):
        preds = state.model(imgs)
    # The loss stays in fp32 whatever the forward precision.
    loss_dict = compute_loss(
        [p.float() for p in preds],
        targets,
        state.model_without_ddp,
        opts.hyp,
        label_smoothing=opts.label_smoothing,
    )
    loss = loss_dict["box_loss"] + loss_dict["obj_loss"] + loss_dict["cls_loss"]
    step_loss = loss / opts.accumulate
    if state.scaler is not None:
        state.scaler.scale(step_loss).backward()
    else:
        step_loss.backward()
    parts = (loss_dict["box_loss"], loss_dict["obj_loss"], loss_dict["cls_loss"], loss)
    return torch.stack(parts).detach()


def _optimizer_step(state: TrainState) -> None:
    if state.scaler is not None:
        state.scaler.step(state.optimizer)
        state.scaler.update()
    else:
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    if state.ema is not None:
        state.ema.update(state.model_without_ddp)


class _LossMeter:
    """Running loss sums, the finiteness check every ``log_interval`` iterations, the bar
    (``where``: its words for the span, "epoch 3") and the loader's wait (``clock``)."""

    def __init__(self, nb: int, where: str, opts: TrainOptions, advice: str = NONFINITE_ADVICE):
        self.nb, self.where, self.opts, self.advice = nb, where, opts, advice
        self.clock = _WaitClock(opts.device)
        self.sums = torch.zeros(4, device=opts.device)
        self.finite_flags: list[torch.Tensor] = []
        self.pending_paths: list[list[str]] = []
        self.images = 0
        self.seen = 0
        self.lr = 0.0
        self.pbar = tqdm(
            total=nb,
            desc=where,
            disable=not opts.show_progress,
            leave=False,
            dynamic_ncols=True,
        )

    def add(self, losses: torch.Tensor, paths: Sequence[str], shape: torch.Size, lr: float) -> None:
        self.sums += losses
        self.finite_flags.append(torch.isfinite(losses[3]))
        self.pending_paths.append(list(paths))
        self.images += shape[0]
        self.seen += 1
        self.lr = lr
        if self.seen % self.opts.log_interval == 0 or self.seen == self.nb:
            _check_finite(self.finite_flags, self.pending_paths, self.where, self.advice)
            self.finite_flags.clear()
            self.pending_paths.clear()
            if self.opts.show_progress:
                self._show(shape)
        self.pbar.update(1)

    def _show(self, shape: torch.Size) -> None:
        mean = (self.sums / self.seen).tolist()
        device = self.opts.device
        mem = f"{torch.cuda.memory_reserved(device) / 2**30:.1f}G" if device.type == "cuda" else "-"
        # Darknet's loss has no separate parts (NaN): only its total is shown.
        parts = {k: f"{v:.3f}" for k, v in zip(("box", "obj", "cls"), mean) if math.isfinite(v)}
        self.pbar.set_postfix(
            **parts,
            loss=f"{mean[3]:.3f}",
            lr=f"{self.lr:.2e}",
            size=tuple(shape[2:]),
            mem=mem,
            refresh=False,
        )

    def finish(self) -> EpochStats:
        """Collective. Close the bar; the span's mean losses and data wait over all ranks."""
        self.pbar.close()
        wait = torch.tensor([self.clock.seconds()], device=self.opts.device, dtype=self.sums.dtype)
        # One collective for both: the wait rides along with the mean losses.
        local = torch.cat([self.sums / max(self.nb, 1), wait])
        *means, data_wait = all_reduce_mean(local).tolist()
        return EpochStats(*means, lr=self.lr, images=self.images, data_wait_s=data_wait)


def _check_finite(
    flags: list[torch.Tensor], paths: list[list[str]], where: str, advice: str
) -> None:
    """Collective. ``where``: the bar's words for the span ("epoch 3")."""
    ok = torch.stack(flags)
    bad_here = not bool(ok.all())
    if all_reduce_flag(bad_here):
        if bad_here:
            first = int((~ok).nonzero()[0])
            raise NonFiniteLossError(
                f"non-finite loss in {where}; offending batch: {', '.join(paths[first])}. {advice}"
            )
        raise NonFiniteLossError(f"non-finite loss on another rank in {where}; stopping")


@torch.no_grad()
def predict_batches(model: nn.Module, loader: Iterable, opts: EvalOptions) -> list[dict[str, Any]]:
    """COCO-format detections (original-image pixels, image_id = dataset index) for ``loader``."""
    model.eval()
    results: list[dict[str, Any]] = []
    for imgs, _, _, shapes, indices in tqdm(
        loader, desc="eval", disable=not opts.show_progress, leave=False, dynamic_ncols=True
    ):
        imgs = to_model_input(imgs, opts.device, opts.channels_last, opts.dtype)
        with autocast_context(opts.device, opts.amp):
            det = detect(model, imgs, opts.augment)
        outputs = opts.nms(det)
        scaled = []
        for out, shape in zip(outputs, shapes):
            out = out.cpu()
            if opts.single_cls:
                out[:, 5] = 0
            if len(out):
                out[:, :4] = scale_coords(imgs.shape[2:], out[:, :4], shape[0], shape[1])
            scaled.append(out)
        results.extend(detections_to_coco(scaled, [int(i) for i in indices]))
        adapt_threads(opts.device)
    return results


def evaluate(
    model: nn.Module, loader: Iterable, coco_gt: Any | None, opts: EvalOptions
) -> tuple[np.ndarray | None, dict[int, tuple[float, float]] | None, list[dict[str, Any]]]:
    """Evaluate this rank's shard, gather every rank's detections on rank 0, and score them once.

    Every rank must call this (it gathers). Only rank 0, which must pass ``coco_gt``, gets the 12
    COCO stats (and per-class AP with ``opts.per_class``); others get ``(None, None, [])``. The
    gathered detections are returned with the stats so that they can be saved, with the image
    ids of ``coco_gt`` (dataset indices unless it was built with others).
    """
    local = predict_batches(model, loader, opts)
    gathered = gather_rows_to_main(coco_to_rows(local))
    if coco_gt is None:
        return None, None, []
    if gathered is None:
        raise RuntimeError("evaluate(): coco_gt was given on a rank other than 0")
    detections = rows_to_coco(gathered)
    image_ids = dataset_image_ids(coco_gt)
    if image_ids is not None:  # a ground truth with its source JSON's image ids
        detections = [{**d, "image_id": image_ids[d["image_id"]]} for d in detections]
    evaluator = CocoEvaluator(coco_gt, backend=opts.backend)
    evaluator.update(detections)
    stats = evaluator.evaluate()
    return stats, (evaluator.per_class_ap() if opts.per_class else None), detections
