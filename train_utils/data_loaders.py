"""The training and evaluation data pipelines: datasets, samplers and loaders as the trainer,
``validation.py`` and the tools build them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from build_utils.darknet_data import DarknetBatches, DarknetDetections, DarknetLoaderSettings
from build_utils.datasets import LoadImagesAndLabels, worker_init_fn
from build_utils.errors import DatasetError, YoloError
from build_utils.image_cache import check_ram_cache_fits
from build_utils.samplers import DistributedBatchSampler, ShardedEvalBatchSampler
from build_utils.shared_images import SharedImages, shared_cache_dir, unlink_quietly
from train_utils.config import DataConfig, TrainConfig
from train_utils.darknet_schedule import DarknetSettings
from train_utils.distributed.comm import (
    broadcast_object,
    raise_if_any_rank_failed,
    torch_distributed_zero_first,
)
from train_utils.distributed.node import processes_per_node, resolve_workers
from train_utils.distributed.process_group import DistInfo
from train_utils.evaluation.coco_gt import get_coco_api_from_dataset
from train_utils.evaluation.detection_files import source_image_ids

logger = logging.getLogger(__name__)


def make_eval_dataset(
    list_path: str | Path | tuple[Path, ...],
    img_size: int,
    batch_size: int,
    nc: int,
    single_cls: bool = False,
    rank: int = -1,
    cache_images: str | None = None,
    hyp: dict[str, Any] | None = None,
) -> LoadImagesAndLabels:
    """The validation set as training-time evaluation and ``validation.py`` both build it:
    rectangular letterboxed batches, no augmentation. ``img_size`` is checked by the caller
    (:func:`train_utils.cli.check_img_size`)."""
    options = {"augment": False, "hyp": hyp, "rect": True, "cache_images": cache_images}
    options.update(single_cls=single_cls, rank=rank, nc=nc)
    # A RAM cache built here is one copy per process of the node.
    options.update(ram_cache_copies=processes_per_node())
    return LoadImagesAndLabels(list_path, img_size, batch_size, **options)


def make_eval_loader(
    dataset: LoadImagesAndLabels,
    batch_size: int,
    world_size: int,
    rank: int,
    workers: int,
    pin_memory: bool,
    persistent: bool = False,
) -> DataLoader:
    """This rank's disjoint share of whole rect batches (no padding duplicates).

    ``persistent`` keeps the worker processes between passes (training evaluates every epoch;
    evaluation draws no random numbers, so reusing workers changes no result)."""
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
        persistent_workers=persistent and workers > 0,
    )


@dataclass
class TrainData:
    """The training run's data: this rank's loaders, the sampler to ``set_epoch``, and the
    COCO ground truth of the validation set (rank 0 only; None elsewhere)."""

    train_loader: DataLoader
    sampler: DistributedBatchSampler | DarknetBatches
    val_loader: DataLoader
    coco_gt: Any | None
    n_train: int
    n_val: int

    def __post_init__(self) -> None:
        # The trainer wraps val_loader (UnreadableImages); the loaders themselves are closed.
        self._loaders = (self.train_loader, self.val_loader)

    def close(self) -> None:
        """End both loaders' persistent worker processes now (:func:`shut_down_workers`)."""
        for loader in self._loaders:
            shut_down_workers(loader)


def shut_down_workers(loader: DataLoader) -> None:
    """End ``loader``'s persistent worker processes now, as PyTorch does when its iterator is
    freed. An iterator still referenced when the interpreter exits (a reference cycle, which
    the collector does not free before the exit hooks) leaves them to multiprocessing's exit
    hook, which sends SIGTERM, which the workers ignore (``worker_init_fn``), and then waits
    for them forever: a finished or interrupted run hung at exit. PyTorch has no public call
    for this; PyTorch Lightning shuts persistent workers down the same way."""
    iterator = getattr(loader, "_iterator", None)
    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()
    loader._iterator = None


def build_train_data(config: TrainConfig, dist: DistInfo, hyp: dict[str, Any]) -> TrainData:
    """Datasets, this rank's batch samplers and loaders, and rank 0's COCO ground truth.

    Label (and ``.npy`` image) caches are built by each node's local rank 0 first, then read by
    the node's other ranks: nodes without shared storage each build their own, and with shared
    storage the atomic writes make concurrent builders harmless. A RAM image cache is one per node,
    filled by the node's ranks together after one shared decision that it fits
    (:func:`_cache_in_ram`). A rank
    that cannot load the data stops every rank with its error.
    """
    train_set, val_set, coco_gt = _datasets(config, dist, hyp)
    sampler = DistributedBatchSampler(
        len(train_set),
        config.batch_size,
        dist.world_size,
        dist.rank,
        shuffle=True,
        seed=config.seed,
        drop_last=True,
        batch_index=train_set.batch if config.rect else None,
        # Every index carries its epoch and the seed: augmentation is a pure function of them,
        # so persistent workers (seeded once) and any worker count give the same batches.
        keyed=True,
    )
    pin = dist.device.type == "cuda"
    workers = resolve_workers(config.workers)
    train_loader = _training_loader(train_set, sampler, workers, pin)
    if len(train_loader) == 0:
        raise DatasetError(
            f"{len(train_set)} usable training images are fewer than one batch "
            f"of {config.batch_size} x {dist.world_size} process(es); lower "
            f"--batch-size"
        )
    val_loader = make_eval_loader(
        val_set, config.batch_size, dist.world_size, dist.rank, workers, pin, persistent=True
    )
    return TrainData(train_loader, sampler, val_loader, coco_gt, len(train_set), len(val_set))


def build_darknet_train_data(
    config: TrainConfig,
    dist: DistInfo,
    hyp: dict[str, Any],
    loader: DarknetLoaderSettings,
    schedule: DarknetSettings,
) -> TrainData:
    """The data of ``--recipe darknet``: the same datasets, caches and validation loader as
    :func:`build_train_data`, but training samples made as Darknet's loader makes them
    (:class:`~build_utils.darknet_data.DarknetDetections` of the training set with the cfg's
    ``loader`` keys), in this rank's mini-batches of ``schedule``'s iterations (the
    ``sampler``, a :class:`~build_utils.darknet_data.DarknetBatches`: ``set_range`` instead of
    ``set_epoch``)."""
    train_set, val_set, coco_gt = _datasets(config, dist, hyp)
    draw = DarknetBatches(
        len(train_set),
        loader,
        schedule.mini_batch,
        schedule.subdivisions,
        schedule.max_batches,
        config.seed,
        dist.rank,
    )
    workers = resolve_workers(config.workers)
    pin = dist.device.type == "cuda"
    train_loader = _training_loader(DarknetDetections(train_set, loader), draw, workers, pin)
    val_loader = make_eval_loader(
        val_set, config.batch_size, dist.world_size, dist.rank, workers, pin, persistent=True
    )
    return TrainData(train_loader, draw, val_loader, coco_gt, len(train_set), len(val_set))


def _datasets(
    config: TrainConfig, dist: DistInfo, hyp: dict[str, Any]
) -> tuple[LoadImagesAndLabels, LoadImagesAndLabels, Any | None]:
    """The training and validation datasets with their caches, and rank 0's COCO ground truth
    of the validation set (None elsewhere)."""
    data = config.data
    ram = config.cache_images == "ram"
    train_set, val_set = _load_datasets(config, dist, hyp, None if ram else config.cache_images)
    if ram:
        _cache_in_ram([train_set, val_set], dist)
    coco_gt = None
    if dist.is_main:
        coco_gt = get_coco_api_from_dataset(
            val_set,
            cache_dir=config.output_dir,
            num_classes=data.nc,
            image_ids=eval_image_ids(data, val_set.img_files),
        )
    return train_set, val_set, coco_gt


def eval_image_ids(data: DataConfig, img_files: Sequence[str]) -> list[int] | None:
    """The image ids evaluation scores with: the source JSON's for a dataset converted by
    ``tools/coco2yolo.py`` (pycocotools breaks score ties by image id order, so these make the
    figures equal pycocotools' on that JSON), else None (the dataset indices)."""
    if data.coco_ids is None:
        return None
    ids, why = source_image_ids(data.coco_ids, img_files)
    if ids is None:
        logger.warning("%s; scoring with dataset indices as image ids", why)
    return ids


def _load_datasets(
    config: TrainConfig, dist: DistInfo, hyp: dict[str, Any], build_cache: str | None
) -> tuple[LoadImagesAndLabels, LoadImagesAndLabels]:
    """The training and validation datasets, the node's local rank 0 first (it builds the
    caches); an error on any rank stops every rank."""
    data = config.data
    error, train_set, val_set = None, None, None
    with torch_distributed_zero_first(dist.local_rank):
        try:
            train_set = LoadImagesAndLabels(
                data.train,
                config.img_size,
                config.batch_size,
                augment=True,
                hyp=hyp,
                rect=config.rect,
                cache_images=build_cache,
                single_cls=config.single_cls,
                rank=dist.rank,
                nc=data.nc,
                ram_cache_copies=processes_per_node(),
            )
            val_set = make_eval_dataset(
                data.valid,
                config.img_size,
                config.batch_size,
                data.nc,
                config.single_cls,
                dist.rank,
                build_cache,
                hyp,
            )
        except YoloError as e:
            error = e
    raise_if_any_rank_failed(error, "loading the data")
    assert train_set is not None and val_set is not None
    return train_set, val_set


def _cache_in_ram(datasets: list[LoadImagesAndLabels], dist: DistInfo) -> None:
    """One RAM image cache per node for ``datasets``, shared by the node's processes.

    Whether it fits is decided once per node by its local rank 0 before anyone caches, counting
    one copy (the node's processes share it); if any node refuses, every rank stops with that
    node's error. Local rank 0 creates one shared file per dataset (a name common to the run),
    the node's ``L`` processes fill images ``local_rank, local_rank + L, ...`` of each, and once
    every rank has mapped and filled its share, local rank 0 unlinks the files: the mappings
    keep the pages, and nothing is left behind when the run ends or is killed.
    """
    need = sum(ds.ram_cache_bytes() for ds in datasets)
    error = None
    if dist.local_rank == 0:
        try:
            check_ram_cache_fits(need, sum(len(ds) for ds in datasets), procs=1)
        except DatasetError as e:
            error = e
    raise_if_any_rank_failed(error, "--cache-images ram")

    token = broadcast_object(uuid.uuid4().hex)
    # A single process fills everything itself, whatever a stray LOCAL_WORLD_SIZE says.
    shares = max(processes_per_node(), dist.local_rank + 1) if dist.distributed else 1
    paths = [shared_cache_dir() / f"yolo-images-{token}-{k}.u8" for k in range(len(datasets))]
    creator = dist.local_rank == 0
    caches: list[SharedImages] = []
    try:
        error = None
        if creator:
            try:
                caches = [
                    SharedImages.create(p, ds.ram_cache_sizes()) for p, ds in zip(paths, datasets)
                ]
            except DatasetError as e:
                error = e
        raise_if_any_rank_failed(error, "--cache-images ram")
        try:
            if not creator:
                caches = [
                    SharedImages.attach(p, ds.ram_cache_sizes()) for p, ds in zip(paths, datasets)
                ]
        except DatasetError as e:
            error = e
        # Every rank has mapped the files once this returns: their names go before the fill,
        # so that a process killed during it (SIGKILL, the OOM killer) leaves no file in
        # /dev/shm (was: unlinked only after the fill).
        raise_if_any_rank_failed(error, "--cache-images ram")
        if creator:
            for p in paths:
                unlink_quietly(p)
        try:
            for ds, cache in zip(datasets, caches):
                ds.fill_shared_ram_cache(cache, dist.local_rank, shares, is_main=dist.is_main)
        except DatasetError as e:
            error = e
        # Every rank has filled its share once this returns.
        raise_if_any_rank_failed(error, "--cache-images ram")
        missing = sum(cache.missing() for cache in caches)
        if missing:
            # Fewer processes on this node than LOCAL_WORLD_SIZE (or SLURM) said.
            error = DatasetError(
                f"{missing} images of the shared RAM cache were filled by no process: this node "
                f"runs fewer than the {shares} processes LOCAL_WORLD_SIZE/SLURM announce"
            )
        raise_if_any_rank_failed(error, "--cache-images ram")
    finally:
        if creator:
            for p in paths:
                unlink_quietly(p)
    for ds, cache in zip(datasets, caches):
        ds.use_ram_cache(cache)


def _training_loader(dataset: Dataset, batches: Sampler, workers: int, pin: bool) -> DataLoader:
    """The training DataLoader of both recipes: ``batches`` (a batch sampler) of ``dataset``,
    its workers kept between epochs and seeded by :func:`worker_init_fn`."""
    return DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=workers,
        pin_memory=pin,
        collate_fn=LoadImagesAndLabels.collate_fn,
        worker_init_fn=worker_init_fn,
        persistent_workers=workers > 0,
    )
