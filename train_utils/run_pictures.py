"""The pictures of a training run's data, drawn by rank 0 without touching the training:
``labels.png`` and ``train_batch0..2.jpg`` at the start. (The evaluation pictures and
``per_class.csv`` are :func:`train_utils.evaluation.report.write_eval_report`'s.)

The first batches are drawn from the batches the loop itself consumes (:func:`plot_first_batches`
wraps the loader and passes every batch through unchanged), so no random number generator is
used and a run's numbers are the same with or without pictures. A failure to draw is a warning,
never the end of a training run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train_utils.evaluation.plots import batch_to_images, plot_images, plot_labels

logger = logging.getLogger(__name__)

TRAIN_BATCHES_DRAWN = 3  # train_batch0.jpg .. train_batch2.jpg
LABELS_FILE = "labels.png"
TRAIN_BATCH_FILES = tuple(f"train_batch{i}.jpg" for i in range(TRAIN_BATCHES_DRAWN))


def plot_dataset_labels(dataset: Any, names: Sequence[str], out_dir: Path) -> None:
    """``labels.png`` of a dataset with ``labels``: per image ``(n, 5)`` class + cxcywh norm."""
    labels = getattr(dataset, "labels", None)
    if labels is None:
        return
    try:
        plot_labels(labels, names, out_dir / LABELS_FILE)
    except Exception as e:  # pictures are a convenience; training goes on without them
        logger.warning("could not draw %s: %s", out_dir / LABELS_FILE, e)


class _FirstBatches:
    """``loader`` unchanged, but the first :data:`TRAIN_BATCHES_DRAWN` batches are drawn before
    being handed on."""

    def __init__(self, loader: Any, out_dir: Path, names: Sequence[str]):
        self.loader, self.out_dir, self.names = loader, out_dir, names

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.loader):
            if i < TRAIN_BATCHES_DRAWN:
                self._draw(i, batch)
            yield batch

    def _draw(self, i: int, batch: Sequence[Any]) -> None:
        imgs, targets, paths = batch[0], batch[1], batch[2]
        path = self.out_dir / TRAIN_BATCH_FILES[i]
        try:
            images, boxes = batch_to_images(_numpy(imgs), _numpy(targets))
            plot_images(images, boxes, self.names, path, [Path(p).name for p in paths])
        except Exception as e:  # pictures are a convenience; training goes on without them
            logger.warning("could not draw %s: %s", path, e)


def _numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def plot_first_batches(
    loader: Iterable, out_dir: Path, names: Sequence[str], enabled: bool
) -> Iterable:
    """``loader`` itself when not ``enabled``, else a view of it that draws its first
    :data:`TRAIN_BATCHES_DRAWN` batches (``(imgs (bs, 3, H, W) uint8 RGB, targets (nt, 6),
    paths, ...)``) into ``out_dir/train_batch{i}.jpg``."""
    return _FirstBatches(loader, out_dir, names) if enabled else loader
