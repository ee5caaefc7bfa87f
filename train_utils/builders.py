"""Construction shared by the trainer, ``validation.py`` and ``predict.py``: the model for a
dataset's class count, its initial weights, and the evaluation data pipeline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from build_utils.datasets import LoadImagesAndLabels, worker_init_fn
from build_utils.errors import CheckpointError, ConfigError
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes
from build_utils.samplers import ShardedEvalBatchSampler
from models.darknet import Darknet
from models.weights import load_darknet_weights, load_state_dict_flexible
from train_utils.checkpoint import extract_state_dict, load_checkpoint

logger = logging.getLogger(__name__)


def model_blocks_for(cfg: str | Path, nc: int) -> list[dict[str, Any]]:
    """Parse ``cfg`` and, when its heads are for another class count, rewrite them for ``nc``."""
    blocks = parse_model_cfg(cfg)
    cfg_nc = sorted({int(b["classes"]) for b in blocks if b["type"] == "yolo"})
    if cfg_nc != [nc]:
        logger.warning("%s has classes=%s but the dataset has %d; rewriting the heads for %d "
                       "classes", cfg, ",".join(map(str, cfg_nc)), nc, nc)
        blocks = rewrite_cfg_classes(blocks, nc)
    return blocks


def load_initial_weights(model: Darknet, path: str | Path, trust: bool = False) -> list[str]:
    """Initialise from a ``.pt`` (state_dict or checkpoint) or Darknet ``.weights``.

    Returns the names of tensors skipped because the model has no such tensor or another shape
    (e.g. the heads of a checkpoint trained for another class count).
    """
    path = str(path)
    if path.endswith(".weights"):
        load_darknet_weights(model, path)
        return []
    state = extract_state_dict(load_checkpoint(path, trust=trust), path)
    return load_state_dict_flexible(model, state)


def load_inference_weights(model: Darknet, path: str | Path, trust: bool = False) -> None:
    """Load weights for evaluation or prediction: every tensor must match the model."""
    skipped = load_initial_weights(model, path, trust)
    if skipped:
        shown = ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        raise CheckpointError(f"{len(skipped)} tensors do not fit the model built from the cfg "
                              f"({shown}); pass the --cfg (and --data) the weights were trained "
                              f"with", path)


def make_eval_dataset(list_path: str | Path, img_size: int, batch_size: int, nc: int,
                      single_cls: bool = False, rank: int = -1, cache_images: str | None = None,
                      hyp: dict[str, Any] | None = None) -> LoadImagesAndLabels:
    """The validation set as training-time evaluation and ``validation.py`` both build it:
    rectangular letterboxed batches, no augmentation."""
    if img_size % 32:
        raise ConfigError(f"--img-size {img_size} is not a multiple of 32")
    return LoadImagesAndLabels(str(list_path), img_size, batch_size, augment=False, hyp=hyp,
                               rect=True, cache_images=cache_images, single_cls=single_cls,
                               rank=rank, nc=nc)


def make_eval_loader(dataset: LoadImagesAndLabels, batch_size: int, world_size: int, rank: int,
                     workers: int, pin_memory: bool) -> DataLoader:
    """This rank's disjoint share of whole rect batches (no padding duplicates)."""
    sampler = ShardedEvalBatchSampler(getattr(dataset, "batch", None), len(dataset), batch_size,
                                      world_size, rank)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                      collate_fn=LoadImagesAndLabels.collate_fn,
                      worker_init_fn=worker_init_fn if workers else None)
