"""The model to run: the one a weights file describes, built and loaded for ``validation.py``,
``predict.py`` and the tools (:func:`model_from_weights`); and the one a training run starts
from, checked, initialised or resumed, on its device and in its memory format
(:func:`build_training_model`, on every rank; its collectives are marked)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from build_utils.augmentations import GRID
from build_utils.darknet_data import DarknetLoaderSettings
from build_utils.errors import CheckpointError, ConfigError
from build_utils.parse_config import (
    format_model_cfg,
    parse_model_cfg,
    parse_model_cfg_text,
    yolo_classes,
)
from models.budget import check_model_fits
from models.budget import describe as describe_estimate
from models.darknet import Darknet, model_blocks_for
from train_utils import resume
from train_utils.autoanchor import check_anchors
from train_utils.autobatch import AUTO_BATCH, autobatch
from train_utils.checkpoint import (
    WeightsFile,
    extract_state_dict,
    fit_state_dict,
    load_weights,
    weights_kind,
)
from train_utils.cli import DEFAULT_IMG_SIZE
from train_utils.config import TrainConfig, multi_scale_bounds
from train_utils.darknet_recipe import prepare_model
from train_utils.distributed.comm import broadcast_object, raise_if_any_rank_failed
from train_utils.distributed.node import processes_per_node
from train_utils.distributed.process_group import DistInfo
from train_utils.memory_format import choose_format_and_precision
from train_utils.precision import (
    dtype_from_name,
    dtype_name,
    recorded_precision,
)

logger = logging.getLogger(__name__)


def model_from_weights(
    weights: WeightsFile,
    cfg: str | Path | None,
    nc: int | None,
    img_size: int | tuple[int, int],
    batch: int = 1,
    device: torch.device | None = None,
) -> Darknet:
    """The model ``weights`` holds, with its weights loaded strictly.

    Args:
        weights: the file, as :func:`~train_utils.checkpoint.read_weights` read it.
        cfg: a cfg file that overrides the one the checkpoint carries (needed for Darknet
            ``.weights`` and bare state_dicts, which carry none).
        nc: the class count to build the heads for (None: the cfg's).
        img_size: the side (or (H, W)) the model is built for.
        batch, device: the images per forward pass and where they run (None: the CPU), for
            the memory check.

    Raises:
        ConfigError: no cfg to build from, or a model that cannot run in the device's memory
            at ``img_size`` and ``batch`` (:func:`~models.budget.check_model_fits`, before
            anything is allocated; the cfg may come from the checkpoint itself).
        CheckpointError: the weights do not fit the model.
    """
    if cfg is not None:
        if weights.cfg_text is not None:
            logger.info("--cfg %s overrides the cfg that %s carries", cfg, weights.path)
        blocks = parse_model_cfg(cfg)
    elif weights.cfg_text is not None:
        blocks = parse_model_cfg_text(weights.cfg_text, f"{weights.path} (its cfg)")
    else:
        raise ConfigError(
            "these weights carry no model cfg (Darknet .weights or a bare state_dict); pass the "
            "--cfg they were trained with",
            weights.path,
        )
    if nc is not None and cfg is None:
        # The cfg a checkpoint carries is the one its weights were trained with: its heads
        # cannot take another class count (YOLOv5's val.py says the same).
        trained = sorted({yolo_classes(b) for b in blocks if b["type"] == "yolo"})
        if trained != [nc]:
            raise CheckpointError(
                f"trained for {','.join(map(str, trained))} classes, but the class names given "
                f"number {nc}; pass the data (or names) it was trained on",
                weights.path,
            )
    if nc is not None:
        blocks = model_blocks_for(blocks, nc)
    hw = (img_size, img_size) if isinstance(img_size, int) else img_size
    check_model_fits(blocks, hw, batch=batch, device=device)
    model = Darknet(blocks, img_size=hw)
    if weights.ckpt is None:
        load_weights(model, weights.path, strict=True)
    else:
        fit_state_dict(model, extract_state_dict(weights.ckpt, weights.path), weights.path)
    return model


def default_img_size(weights: WeightsFile, cfg: str | Path | None) -> int:
    """The side ``weights`` run at when neither ``--img-size`` nor their run says (logged when it
    is the cfg's): for a Darknet
    ``.weights`` file with ``cfg``, the cfg's ``[net]`` side (the larger of width and height,
    rounded up to a multiple of 32), as ``darknet detector map`` and ``test`` run at the cfg's
    size; else :data:`~train_utils.cli.DEFAULT_IMG_SIZE`."""
    if weights.kind != "darknet" or cfg is None:
        return DEFAULT_IMG_SIZE
    net = parse_model_cfg(cfg)[0]
    side = max(int(net.get("width") or 0), int(net.get("height") or 0))
    if side <= 0:
        return DEFAULT_IMG_SIZE
    side = -(-side // GRID) * GRID
    logger.info("--img-size %d: the [net] size of %s, as Darknet runs .weights", side, cfg)
    return side


def build_training_model(
    config: TrainConfig, dist: DistInfo, amp: torch.dtype | None
) -> tuple[Darknet, str, dict[str, Any] | None, bool, torch.dtype | None]:
    """The model on its device and in its memory format, with its resolved cfg text, the
    resume checkpoint (None when not resuming), whether it is channels_last and the autocast
    dtype it trains in (``amp``, unless ``--amp auto`` on a CPU with native bf16 timed fp32
    faster)."""
    blocks = model_blocks_for(config.cfg, config.data.nc, say=dist.is_main)
    error = None
    try:
        _check_model_memory(config, blocks, dist, amp)
    except ConfigError as e:
        error = e
    # Collective: a model that cannot fit one rank's device stops every rank with the same
    # line, instead of leaving the others waiting in check_anchors.
    raise_if_any_rank_failed(error, "checking the model's memory")
    blocks = check_anchors(blocks, config, dist)
    cfg_text = format_model_cfg(blocks)
    darknet = config.recipe == "darknet"
    model = Darknet(blocks, img_size=(config.img_size, config.img_size), head_bias=not darknet)
    if darknet:
        prepare_model(model)
    ckpt = resume.load(config, model, dist)
    if ckpt is None and config.weights:
        _initialise_weights(model, config)
    model.freeze(config.freeze_layers)
    model.to(dist.device)
    if config.batch_size == AUTO_BATCH:
        batch = autobatch(model, config.img_size, dist.device, amp) if dist.is_main else None
        # Collective: every rank trains with rank 0's batch (and records it, for --resume).
        config.batch_size = int(broadcast_object(batch))
    channels_last, amp = _memory_format(config, model, dist, amp, cfg_text, ckpt)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return model, cfg_text, ckpt, channels_last, amp


def _check_model_memory(
    config: TrainConfig, blocks: list[dict[str, Any]], dist: DistInfo, amp: torch.dtype | None
) -> None:
    """Refuse a model whose training memory (parameters, gradients, optimizer state, EMA and the
    activations of a batch at the largest side this run trains at, in the autocast dtype)
    exceeds the device's, before anything is allocated (models/budget.py)."""
    side = multi_scale_bounds(config.img_size)[1] if config.multi_scale else config.img_size
    if config.recipe == "darknet":  # the largest size of the cfg's `random`
        side = max(DarknetLoaderSettings.from_blocks(blocks).largest_size)
    # The ranks of a node training on its CPU share its RAM; GPUs are one per rank.
    cpu = dist.device.type == "cpu"
    share = processes_per_node() if cpu else 1
    # --amp auto on a CPU may still time fp32 faster (_memory_format): count fp32 there.
    counted = None if cpu and config.amp == "auto" else amp
    estimate = check_model_fits(
        blocks,
        side,
        batch=max(config.batch_size, 1),  # autobatch (-1) fits the memory itself
        training=True,
        device=dist.device,
        share=share,
        amp=counted,
    )
    logger.debug("model memory: %s", describe_estimate(estimate, config.batch_size))


def _memory_format(
    config: TrainConfig,
    model: Darknet,
    dist: DistInfo,
    amp: torch.dtype | None,
    cfg_text: str,
    ckpt: dict[str, Any] | None,
) -> tuple[bool, torch.dtype | None]:
    """Whether to train in channels_last, and in which autocast dtype: decided on rank 0
    (:func:`~train_utils.memory_format.choose_format_and_precision`; a resumed run keeps the
    precision and memory format its checkpoint records) and shared."""
    choice = None
    if dist.is_main:
        channels_last, amp = choose_format_and_precision(
            model,
            config.img_size,
            config.batch_size,
            dist.device,
            amp,
            config.amp,
            config.channels_last,
            cfg_text,
            *recorded_precision(ckpt),
        )
        choice = (channels_last, dtype_name(amp))
    # Collective: every rank takes rank 0's format and precision (only rank 0 timed them).
    channels_last, amp_name = broadcast_object(choice)
    return bool(channels_last), dtype_from_name(amp_name)


def _initialise_weights(model: Darknet, config: TrainConfig) -> None:
    skipped = load_weights(model, config.weights, strict=False, trust=config.trust_checkpoint)
    if skipped:
        logger.warning(
            "--weights %s: skipped %d tensors whose shapes differ: %s",
            config.weights,
            len(skipped),
            ", ".join(skipped),
        )
    elif weights_kind(config.weights) != "darknet":  # Darknet's loader says which layers it read
        # Say it when everything fitted too, so a user need not infer it from a missing warning.
        n = len(model.state_dict())
        logger.info("--weights %s: all %d tensors loaded", config.weights, n)
