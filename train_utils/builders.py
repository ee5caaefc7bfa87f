"""Construction shared by the trainer, ``validation.py`` and ``predict.py``: the model cfg for a
dataset's class count, and the training and evaluation data pipelines."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from build_utils.datasets import LoadImagesAndLabels, worker_init_fn
from build_utils.errors import ConfigError, DatasetError
from build_utils.parse_config import Block, parse_model_cfg, rewrite_cfg_classes
from build_utils.samplers import DistributedBatchSampler, ShardedEvalBatchSampler
from train_utils.coco_utils import get_coco_api_from_dataset
from train_utils.config import TrainConfig
from train_utils.distributed_utils import DistInfo, torch_distributed_zero_first

logger = logging.getLogger(__name__)


def model_blocks_for(cfg: str | Path | list[Block], nc: int) -> list[Block]:
    """Parse ``cfg`` (a file, or blocks already parsed) and, when its heads are for another
    class count, rewrite them for ``nc``."""
    blocks = cfg if isinstance(cfg, list) else parse_model_cfg(cfg)
    if isinstance(cfg, list):
        cfg = blocks[0].get("_path", "the cfg")
    cfg_nc = sorted({int(b["classes"]) for b in blocks if b["type"] == "yolo"})
    if cfg_nc != [nc]:
        logger.warning(
            "%s has classes=%s but the dataset has %d; rewriting the heads for %d classes",
            cfg,
            ",".join(map(str, cfg_nc)),
            nc,
            nc,
        )
        blocks = rewrite_cfg_classes(blocks, nc)
    return blocks


def make_eval_dataset(
    list_path: str | Path,
    img_size: int,
    batch_size: int,
    nc: int,
    single_cls: bool = False,
    rank: int = -1,
    cache_images: str | None = None,
    hyp: dict[str, Any] | None = None,
) -> LoadImagesAndLabels:
    """The validation set as training-time evaluation and ``validation.py`` both build it:
    rectangular letterboxed batches, no augmentation."""
    if img_size % 32:
        raise ConfigError(f"--img-size {img_size} is not a multiple of 32")
    return LoadImagesAndLabels(
        str(list_path),
        img_size,
        batch_size,
        augment=False,
        hyp=hyp,
        rect=True,
        cache_images=cache_images,
        single_cls=single_cls,
        rank=rank,
        nc=nc,
    )


def make_eval_loader(
    dataset: LoadImagesAndLabels,
    batch_size: int,
    world_size: int,
    rank: int,
    workers: int,
    pin_memory: bool,
) -> DataLoader:
    """This rank's disjoint share of whole rect batches (no padding duplicates)."""
    sampler = ShardedEvalBatchSampler(
        getattr(dataset, "batch", None), len(dataset), batch_size, world_size, rank
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        collate_fn=LoadImagesAndLabels.collate_fn,
        worker_init_fn=worker_init_fn if workers else None,
    )


@dataclass
class TrainData:
    """The training run's data: this rank's loaders, the sampler to ``set_epoch``, and the
    COCO ground truth of the validation set (rank 0 only; None elsewhere)."""

    train_loader: DataLoader
    sampler: DistributedBatchSampler
    val_loader: DataLoader
    coco_gt: Any | None
    n_train: int
    n_val: int


def build_train_data(config: TrainConfig, dist: DistInfo, hyp: dict[str, Any]) -> TrainData:
    """Datasets (label caches built by rank 0 first, then read by the others), this rank's
    batch samplers and loaders, and rank 0's COCO ground truth."""
    data = config.data
    with torch_distributed_zero_first(dist.rank):
        train_set = LoadImagesAndLabels(
            str(data.train),
            config.img_size,
            config.batch_size,
            augment=True,
            hyp=hyp,
            rect=config.rect,
            cache_images=config.cache_images,
            single_cls=config.single_cls,
            rank=dist.rank,
            nc=data.nc,
        )
        val_set = make_eval_dataset(
            data.valid,
            config.img_size,
            config.batch_size,
            data.nc,
            config.single_cls,
            dist.rank,
            config.cache_images,
            hyp,
        )
        coco_gt = None
        if dist.is_main:
            coco_gt = get_coco_api_from_dataset(
                val_set, cache_dir=config.output_dir, num_classes=data.nc
            )
    sampler = DistributedBatchSampler(
        len(train_set),
        config.batch_size,
        dist.world_size,
        dist.rank,
        shuffle=True,
        seed=config.seed,
        drop_last=True,
        batch_index=train_set.batch if config.rect else None,
    )
    pin = dist.device.type == "cuda"
    train_loader = DataLoader(
        train_set,
        batch_sampler=sampler,
        num_workers=config.workers,
        pin_memory=pin,
        collate_fn=LoadImagesAndLabels.collate_fn,
        worker_init_fn=worker_init_fn,
    )
    if len(train_loader) == 0:
        raise DatasetError(
            f"{len(train_set)} usable training images are fewer than one batch "
            f"of {config.batch_size} x {dist.world_size} process(es); lower "
            f"--batch-size"
        )
    val_loader = make_eval_loader(
        val_set, config.batch_size, dist.world_size, dist.rank, config.workers, pin
    )
    return TrainData(train_loader, sampler, val_loader, coco_gt, len(train_set), len(val_set))
