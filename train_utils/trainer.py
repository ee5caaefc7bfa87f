"""THE training loop, shared by ``train.py`` (one process) and ``train_multi_GPU.py`` (torchrun).

``run(config, dist)`` wires data, model, optimizer, scheduler, resume, epochs, evaluation and
checkpoints. Everything that differs between one process and DDP is decided from ``dist``; the
collectives it uses are no-ops without a process group.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from build_utils.datasets import LoadImagesAndLabels, worker_init_fn
from build_utils.errors import ConfigError, DatasetError
from build_utils.parse_config import write_model_cfg
from build_utils.samplers import make_train_batch_sampler
from models.darknet import Darknet
from models.loss import scale_loss_gains
from train_utils.builders import (
    load_initial_weights,
    make_eval_dataset,
    make_eval_loader,
    model_blocks_for,
)
from train_utils.checkpoint import (
    load_checkpoint,
    make_checkpoint,
    save_checkpoint,
    to_plain,
    validate_resume_checkpoint,
)
from train_utils.coco_eval import STAT_NAMES
from train_utils.coco_utils import get_coco_api_from_dataset
from train_utils.config import (
    TrainConfig,
    accumulate_steps,
    multi_scale_bounds,
    scaled_lr0,
)
from train_utils.distributed_utils import (
    DistInfo,
    barrier,
    torch_distributed_zero_first,
)
from train_utils.ema import ModelEMA
from train_utils.train_eval_utils import EpochStats, evaluate, train_one_epoch

logger = logging.getLogger(__name__)

RESULTS_HEADER = ["epoch", *STAT_NAMES, "box_loss", "obj_loss", "cls_loss", "loss", "lr",
                  "train_seconds"]
# Seeds are derived per (epoch, rank) so that a resumed run replays the same random stream.
EPOCH_SEED_STRIDE = 1000
RANK_SEED_STRIDE = 1_000_003


@dataclass
class RunSummary:
    output_dir: Path
    epochs_run: int
    best_map: float | None
    last_stats: dict[str, float] | None
    seconds: float


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def backbone_end(model: Darknet) -> int:
    """Index of the last backbone layer: the last [shortcut] before the first head (Darknet-53
    ends there), or, for networks without residual blocks, the layer before the first [route]."""
    first_yolo = min(model.yolo_layers)
    defs = model.module_defs
    shortcuts = [i for i in range(first_yolo) if defs[i]["type"] == "shortcut"]
    if shortcuts:
        return shortcuts[-1]
    routes = [i for i in range(first_yolo) if defs[i]["type"] == "route"]
    return (routes[0] - 1) if routes else first_yolo - 1


def frozen_layer_indices(model: Darknet, mode: str) -> list[int]:
    """Module indices whose parameters are frozen for ``--freeze-layers MODE``."""
    if mode == "none":
        return []
    if mode == "backbone":
        return list(range(backbone_end(model) + 1))
    if mode == "all-but-heads":
        outputs = {i - 1 for i in model.yolo_layers}
        return [i for i in range(len(model.module_list)) if i not in outputs]
    raise ConfigError(f"unknown --freeze-layers mode {mode!r}")


def build_optimizer(model: nn.Module, hyp: dict[str, Any], lr0: float,
                    kind: str = "sgd") -> torch.optim.Optimizer:
    """Nesterov SGD (or Adam) with three named groups; BN weights and biases get no weight decay.

    The group names let the warm-up treat biases apart (``warmup_bias_lr``).
    """
    bn_weights, conv_weights, biases = [], [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if name == "bias":
                biases.append(p)
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):
                bn_weights.append(p)
            else:
                conv_weights.append(p)
    groups = [
        {"params": bn_weights, "weight_decay": 0.0, "name": "bn"},
        {"params": conv_weights, "weight_decay": hyp["weight_decay"], "name": "weights"},
        {"params": biases, "weight_decay": 0.0, "name": "bias"},
    ]
    groups = [g for g in groups if g["params"]]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr0, betas=(hyp["momentum"], 0.999))
    if kind != "sgd":
        raise ConfigError(f"unknown --optimizer {kind!r}; use sgd or adam")
    return torch.optim.SGD(groups, lr=lr0, momentum=hyp["momentum"], nesterov=True)


def cosine_lambda(epochs: int, lrf: float):
    """Cosine decay from 1 to ``lrf`` over ``epochs`` (a picklable-free closure for LambdaLR)."""

    def f(epoch: int) -> float:
        return ((1 + math.cos(epoch * math.pi / epochs)) / 2) * (1 - lrf) + lrf

    return f


def select_device(spec: str) -> torch.device:
    """``''`` means CUDA when available, else CPU; refuses CUDA when there is none."""
    if not spec:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec if not spec.isdigit() else f"cuda:{spec}")
    except RuntimeError as e:
        raise ConfigError(f"--device {spec!r} is not a device; use cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {spec} asks for CUDA but none is available; use --device cpu")
    return device


def _read_results(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _write_results(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULTS_HEADER)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def plot_results(csv_path: Path, png_path: Path) -> None:
    """Loss and mAP curves from ``results.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read_results(csv_path)
    if not rows:
        return
    epochs = [int(r["epoch"]) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("box_loss", "obj_loss", "cls_loss", "loss"):
        axes[0].plot(epochs, [float(r[key]) for r in rows], marker=".", label=key)
    axes[0].set(title="training loss", xlabel="epoch")
    axes[0].legend()
    for key in ("mAP50-95", "mAP50"):
        axes[1].plot(epochs, [float(r[key]) for r in rows], marker=".", label=key)
    axes[1].set(title="validation mAP", xlabel="epoch", ylim=(0, 1))
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def _setup_logging(output_dir: Path, is_main: bool) -> tuple[logging.Handler | None, int]:
    """Send INFO and above to ``train.log`` on rank 0, whatever the caller's logging set-up;
    returns the handler and the root level to restore."""
    root = logging.getLogger()
    level = root.level
    if not is_main:
        return None, level
    handler = logging.FileHandler(output_dir / "train.log")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    if level > logging.INFO or level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return handler, level


def _resolve_resume_path(config: TrainConfig) -> Path | None:
    if config.resume is None:
        return None
    path = config.output_dir / "last.pt" if config.resume == "auto" else Path(config.resume)
    if not path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {path}; train without --resume first or "
                          f"give the path of a last.pt")
    return path


def run(config: TrainConfig, dist: DistInfo) -> RunSummary:
    """Train according to ``config`` on this process's share of the work (see module docstring)."""
    t_start = time.time()
    device = dist.device
    is_main = dist.is_main
    out = config.output_dir
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    barrier()
    log_handler, root_level = _setup_logging(out, is_main)
    try:
        return _run(config, dist, device, is_main, out, t_start)
    finally:
        if log_handler is not None:
            logging.getLogger().removeHandler(log_handler)
            log_handler.close()
            logging.getLogger().setLevel(root_level)


def _run(config: TrainConfig, dist: DistInfo, device: torch.device, is_main: bool, out: Path,
         t_start: float) -> RunSummary:
    data = config.data
    seed_all(config.seed + dist.rank * RANK_SEED_STRIDE)
    if device.type == "cuda":
        # Fixed input sizes let cuDNN pick the fastest kernels once; multi-scale would re-tune.
        torch.backends.cudnn.benchmark = not config.multi_scale and not config.rect
    # On by default on CUDA and CPU: NHWC is the layout of the fast cuDNN and oneDNN kernels.
    # Measured on a 2-core AVX2 CPU (bench/README.md): the nano cfg trains 1.3x and evaluates
    # 1.5x faster with it, and its 2-process DDP scales better; YOLOv3-SPP training is ~0.9x
    # there (--no-channels-last), its evaluation ~1.05x.
    channels_last = config.channels_last if config.channels_last is not None else True

    # ---- model -------------------------------------------------------------------------------
    blocks = model_blocks_for(config.cfg, data.nc)
    cfg_text = blocks_to_text(blocks)
    if is_main:
        (out / "model.cfg").write_text(cfg_text)
    model = Darknet(blocks, img_size=(config.img_size, config.img_size))
    hyp = scale_loss_gains(config.hyp, data.nc, config.img_size)

    resume_path = _resolve_resume_path(config)
    ckpt = None
    if resume_path is not None:
        ckpt = load_checkpoint(resume_path, trust=config.trust_checkpoint)
        # Resuming continues from the raw training weights, not their EMA.
        raw = ckpt["train_model"] if ckpt.get("train_model") is not None else ckpt.get("model")
        state = {**ckpt, "model": raw}
        if ckpt.get("train_model") is not None and ckpt.get("epoch") == -1:
            # Saved by this loop on Ctrl-C before epoch 0 finished: a training state (partly
            # trained weights, optimizer) that resumes by running epoch 0 again.
            state["epoch"] = 0
        model.load_state_dict(validate_resume_checkpoint(state, model.state_dict(), resume_path))
    elif config.weights:
        skipped = load_initial_weights(model, config.weights, config.trust_checkpoint)
        if skipped:
            logger.warning("--weights %s: skipped %d tensors whose shapes differ: %s",
                           config.weights, len(skipped), ", ".join(skipped))

    frozen = frozen_layer_indices(model, config.freeze_layers)
    for i in frozen:
        for p in model.module_list[i].parameters():
            p.requires_grad_(False)
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)

    world = dist.world_size
    accumulate = accumulate_steps(config.nbs, config.batch_size, world, config.accumulate)
    lr0 = scaled_lr0(hyp["lr0"], config.batch_size * world, config.nbs)
    optimizer = build_optimizer(model, hyp, lr0, config.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_lambda(config.epochs,
                                                                           hyp["lrf"]))
    scaler = torch.amp.GradScaler("cuda") if (config.amp and device.type == "cuda") else None
    ema = ModelEMA(model) if config.ema else None

    start_epoch, best_map = 0, None
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        if ema is not None and ckpt.get("ema") is not None:
            ema.ema.load_state_dict(ckpt["ema"])
            ema.updates = int(ckpt.get("ema_updates", 0))
        start_epoch = int(ckpt["epoch"]) + 1
        best_map = ckpt.get("best_fitness")
        logger.info("resuming from %s: epoch %d done, best mAP@0.5:0.95 %s", resume_path,
                    start_epoch - 1, "-" if best_map is None else f"{best_map:.4f}")
        if start_epoch >= config.epochs:
            logger.info("the checkpoint already finished all %d epochs; nothing to do",
                        config.epochs)

    model_without_ddp = model
    if dist.distributed:
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            model_without_ddp = model
        elif is_main:
            logger.info("SyncBatchNorm skipped: it supports CUDA modules only (running on CPU)")
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    train_model = torch.compile(model) if config.compile else model
    eval_model = ema.ema if ema is not None else model_without_ddp

    def set_train_mode() -> None:
        model.train()
        # Frozen BatchNorm layers must not update their running statistics.
        for i in frozen:
            model_without_ddp.module_list[i].eval()

    # ---- data --------------------------------------------------------------------------------
    with torch_distributed_zero_first(dist.rank):
        train_set = LoadImagesAndLabels(
            str(data.train), config.img_size, config.batch_size, augment=True, hyp=hyp,
            rect=config.rect, cache_images=config.cache_images, single_cls=config.single_cls,
            rank=dist.rank, nc=data.nc)
        val_set = make_eval_dataset(data.valid, config.img_size, config.batch_size, data.nc,
                                    config.single_cls, dist.rank, config.cache_images, hyp)
        coco_gt = (get_coco_api_from_dataset(val_set, cache_dir=out, num_classes=data.nc)
                   if is_main else None)
    train_batches = make_train_batch_sampler(
        len(train_set), config.batch_size, world, dist.rank, shuffle=True,
        seed=config.seed, drop_last=True,
        batch_index=train_set.batch if config.rect else None)
    pin = device.type == "cuda"
    train_loader = DataLoader(train_set, batch_sampler=train_batches, num_workers=config.workers,
                              pin_memory=pin, collate_fn=LoadImagesAndLabels.collate_fn,
                              worker_init_fn=worker_init_fn)
    if len(train_loader) == 0:
        raise DatasetError(f"{len(train_set)} usable training images are fewer than one batch "
                           f"of {config.batch_size} x {world} process(es); lower --batch-size")
    val_loader = make_eval_loader(val_set, config.batch_size, world, dist.rank, config.workers,
                                  pin)

    nb = len(train_loader)
    warmup_iters = round(hyp["warmup_epochs"] * nb)
    ms_bounds = multi_scale_bounds(config.img_size) if config.multi_scale else None
    n_params = sum(p.numel() for p in model_without_ddp.parameters())
    if is_main:
        with open(out / "args.yaml", "w") as f:
            yaml.safe_dump(to_plain(config.to_dict()), f, sort_keys=False)
        with open(out / "hyp.yaml", "w") as f:
            yaml.safe_dump(to_plain(hyp), f, sort_keys=False)
        logger.info(
            "model %s: %d layers, %.2fM parameters, %d classes | data: %d train / %d val images | "
            "device %s x %d process(es) | batch %d x %d accumulate (nominal %d), lr0 %.4g | "
            "img %d%s | output %s",
            config.cfg, len(model_without_ddp.module_list), n_params / 1e6, data.nc,
            len(train_set), len(val_set), device, world, config.batch_size, accumulate,
            config.nbs, lr0, config.img_size,
            f" (multi-scale {ms_bounds[0]}-{ms_bounds[1]})" if ms_bounds else "", out)
    writer = SummaryWriter(str(out)) if is_main else None
    results_path = out / "results.csv"
    if is_main:
        # Rows from epochs after the checkpoint belong to work that is about to be redone.
        kept = [r for r in _read_results(results_path) if int(r["epoch"]) < start_epoch]
        _write_results(results_path, kept)

    last_stats: dict[str, float] | None = None
    epoch = start_epoch - 1
    interrupted = False
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    if _is_main_thread():
        # torchrun and schedulers stop jobs with SIGTERM; treat it like Ctrl-C.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        for epoch in range(start_epoch, config.epochs):
            seed_all(config.seed + epoch * EPOCH_SEED_STRIDE + dist.rank * RANK_SEED_STRIDE)
            if hasattr(train_batches, "set_epoch"):
                train_batches.set_epoch(epoch)
            t0 = time.time()
            stats: EpochStats = train_one_epoch(
                train_model, model_without_ddp, optimizer, train_loader, device, epoch, hyp,
                scheduler.get_last_lr(), accumulate, warmup_iters, scaler, ema, config.amp,
                ms_bounds, config.log_interval, show_progress=is_main,
                channels_last=channels_last, set_train_mode=set_train_mode)
            train_seconds = time.time() - t0
            scheduler.step()

            final = epoch == config.epochs - 1
            do_eval = final or (not config.notest and (epoch + 1) % config.eval_interval == 0)
            coco_stats = None
            if do_eval:
                coco_stats, _, _ = evaluate(
                    eval_model, val_loader, device, coco_gt, config.conf_thres, config.iou_thres,
                    amp=config.amp, backend=config.coco_backend, show_progress=is_main,
                    channels_last=channels_last)
            if is_main:
                if coco_stats is not None:
                    last_stats = dict(zip(STAT_NAMES, (float(s) for s in coco_stats)))
                    row = {"epoch": epoch, **last_stats, **stats.as_dict(), "lr": stats.lr,
                           "train_seconds": round(train_seconds, 3)}
                    rows = [*_read_results(results_path), row]
                    _write_results(results_path, rows)
                    plot_results(results_path, out / "results.png")
                    for k, v in last_stats.items():
                        writer.add_scalar(f"val/{k}", v, epoch)
                    map_now = last_stats["mAP50-95"]
                    is_best = best_map is None or map_now > best_map
                    best_map = map_now if is_best else best_map
                    logger.info("epoch %d/%d: loss %.4f (box %.4f obj %.4f cls %.4f), lr %.3g, "
                                "%.1f s | mAP@0.5:0.95 %.4f mAP@0.5 %.4f", epoch, config.epochs - 1,
                                stats.loss, stats.box_loss, stats.obj_loss, stats.cls_loss,
                                stats.lr, train_seconds, map_now, last_stats["mAP50"])
                else:
                    is_best = False
                    logger.info("epoch %d/%d: loss %.4f, lr %.3g, %.1f s", epoch,
                                config.epochs - 1, stats.loss, stats.lr, train_seconds)
                for k, v in stats.as_dict().items():
                    writer.add_scalar(f"train/{k}", v, epoch)
                writer.add_scalar("train/lr", stats.lr, epoch)
                writer.flush()
                ckpt_obj = _make_checkpoint(model_without_ddp, ema, optimizer, scheduler, scaler,
                                            epoch, best_map, config, data, cfg_text)
                save_checkpoint(ckpt_obj, out / "last.pt")
                if is_best:
                    save_checkpoint(ckpt_obj, out / "best.pt")
            # Nobody starts the next epoch before the checkpoint of this one exists.
            barrier()
    except KeyboardInterrupt:
        interrupted = True
        logger.warning("interrupted in epoch %d; last completed epoch is saved in %s; continue "
                       "with --resume", epoch, out / "last.pt")
        if is_main and not (out / "last.pt").is_file():
            # Nothing saved yet: keep the partially trained weights, resumable from epoch 0.
            save_checkpoint(_make_checkpoint(model_without_ddp, ema, optimizer, scheduler,
                                             scaler, start_epoch - 1, best_map, config, data,
                                             cfg_text), out / "last.pt")
    finally:
        if _is_main_thread():
            signal.signal(signal.SIGTERM, previous_sigterm)
        if writer is not None:
            writer.close()

    seconds = time.time() - t_start
    if is_main and not interrupted:
        logger.info("done: %d epochs in %.1f min | best mAP@0.5:0.95 %s | results %s | "
                    "weights %s, %s", config.epochs - start_epoch, seconds / 60,
                    "-" if best_map is None else f"{best_map:.4f}",
                    results_path, out / "last.pt", out / "best.pt")
    if interrupted:
        raise KeyboardInterrupt
    return RunSummary(out, config.epochs - start_epoch, best_map, last_stats, seconds)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _make_checkpoint(model: nn.Module, ema: ModelEMA | None, optimizer, scheduler, scaler,
                     epoch: int, best_map: float | None, config: TrainConfig, data,
                     cfg_text: str) -> dict:
    """Everything needed to resume, as tensors and plain types (``weights_only`` loadable).

    ``model`` holds the weights to use (the EMA when enabled), as the lineage's tools expect;
    ``train_model`` holds the raw training weights that resuming continues from.
    """
    return make_checkpoint(
        model=ema.ema if ema is not None else model, epoch=epoch, optimizer=optimizer,
        scheduler=scheduler, scaler=scaler, ema=ema.ema if ema is not None else None,
        ema_updates=ema.updates if ema is not None else 0, best_fitness=best_map,
        config=config.to_dict(), train_model=model.state_dict(), hyp=config.hyp,
        names=list(data.names), nc=data.nc, cfg=cfg_text)


def blocks_to_text(blocks: list[dict]) -> str:
    """The resolved cfg as text, so a checkpoint alone can rebuild its model."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "model.cfg"
        write_model_cfg(blocks, p)
        return p.read_text()
