"""The model a weights file describes, built and loaded for ``validation.py``, ``predict.py``
and the tools."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from build_utils.errors import ConfigError
from build_utils.parse_config import parse_model_cfg, parse_model_cfg_text
from models.budget import check_model_fits
from models.darknet import Darknet, model_blocks_for
from train_utils.checkpoint import WeightsFile, extract_state_dict, fit_state_dict, load_weights

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
