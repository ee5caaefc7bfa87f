"""Samplers that split a dataset over DDP ranks without breaking rectangular batches.

Two problems with ``torch.utils.data.DistributedSampler`` motivate this module:

- it pads the index list by repeating samples so that every rank gets the same count; for
  evaluation that scores the repeats twice (pytorch/pytorch#25162). :class:`ShardedEvalBatchSampler`
  shards without padding.
- it interleaves (and shuffles) single images across ranks, while rectangular (``--rect``)
  batches need consecutive images of the aspect-ratio-sorted dataset that share one letterbox
  shape; mixing them crashes collate with "stack expects each tensor to be equal size"
  (ultralytics/yolov5#8698). Here whole rect batches are what gets shuffled and dealt out.

Rect batches come from the dataset's ``batch`` attribute: ``batch[i]`` is the batch id of image
``i``, and images with the same id share one shape. Build the dataset with the *per-rank* batch
size so that its batches are the ones each rank loads.

``num_replicas``/``rank`` default to the current process group (1 and 0 without one); pass them
explicitly to build another rank's sampler, e.g. in tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from build_utils.errors import DatasetError


class SampleKey(NamedTuple):
    """What a training sample's augmentation is a pure function of: the dataset ``index``, the
    ``epoch`` and the run's ``seed``. A keyed batch sampler yields these instead of plain
    indices, so the dataset seeds each sample's random generator from them and the result is
    the same whichever DataLoader worker (persistent or not, any number of them) loads it."""

    index: int
    epoch: int
    seed: int


def _resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Fill in world size and rank from the process group; ValueError on inconsistent values."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
    return int(num_replicas), int(rank)


def _check_len(dataset_len: int) -> int:
    if dataset_len < 0:
        raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
    return int(dataset_len)


def _check_batch_size(batch_size: int) -> int:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return int(batch_size)


def make_batches(
    batch_index: np.ndarray | Sequence[int] | None, dataset_len: int, batch_size: int
) -> list[list[int]]:
    """Group dataset indices into batches whose images may be stacked together.

    Args:
        batch_index: ``(dataset_len,)`` integer batch id per image (the rect dataset's ``batch``
            attribute), or None for plain chunks of ``batch_size`` consecutive indices.
        dataset_len: number of images.
        batch_size: upper bound on a batch's size; a group larger than this (a ``batch`` array
            made for a bigger batch) is split into chunks, which keeps one shape per batch.

    Returns:
        Batches in order of batch id, each a list of ascending indices; the last (or any group
        of a rect dataset) may be smaller than ``batch_size``. Every index appears exactly once.
    """
    dataset_len = _check_len(dataset_len)
    batch_size = _check_batch_size(batch_size)
    if batch_index is None:
        return [
            list(range(start, min(start + batch_size, dataset_len)))
            for start in range(0, dataset_len, batch_size)
        ]
    ids = np.asarray(batch_index).reshape(-1)
    if ids.shape[0] != dataset_len:
        raise ValueError(
            f"batch_index has {ids.shape[0]} entries but the dataset has {dataset_len} images"
        )
    # Stable sort keeps indices ascending within a group: the dataset's batch ids are
    # contiguous runs already, so this is the identity there, but it stays right otherwise.
    order = np.argsort(ids, kind="stable")
    boundaries = np.flatnonzero(np.diff(ids[order])) + 1
    batches: list[list[int]] = []
    for group in np.split(order, boundaries):
        if group.size == 0:
            continue
        for start in range(0, group.size, batch_size):
            batches.append(group[start : start + batch_size].tolist())
    return batches


class ShardedEvalBatchSampler(Sampler[list[int]]):
    """Whole batches dealt round-robin to ranks for evaluation; no padding, no duplicates.

    Batches are built by :func:`make_batches` (rect groups, or chunks of ``batch_size``) and
    batch ``j`` goes to rank ``j % num_replicas``. Round-robin rather than contiguous because
    rect batches are sorted by aspect ratio: each rank gets a similar mix of shapes and so a
    similar amount of work. Ranks may get different numbers of batches (by at most one), so
    after the loop gather results with a collective that all ranks enter.

    Use with ``DataLoader(dataset, batch_sampler=sampler)``.
    """

    def __init__(
        self,
        batch_index: np.ndarray | Sequence[int] | None,
        dataset_len: int,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
    ):
        self.num_replicas, self.rank = _resolve_replicas(num_replicas, rank)
        all_batches = make_batches(batch_index, dataset_len, batch_size)
        self.batches = all_batches[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


class DistributedBatchSampler(Sampler[list[int]]):
    """Training batch sampler for one rank: same step count on every rank, reshuffled per epoch.

    Without ``batch_index`` this is exactly ``DistributedSampler(shuffle=shuffle, seed=seed)``
    followed by ``BatchSampler(batch_size, drop_last)``. The DistributedSampler pads its index
    list by repeating up to ``num_replicas - 1`` images so the ranks' shards are equal in size
    (acceptable for training; the union covers the dataset), then ``drop_last`` drops each rank's
    incomplete last batch.

    With ``batch_index`` (rect training) the unit is a whole rect batch: the list of batches
    (from :func:`make_batches`) is permuted with a generator seeded by ``seed + epoch`` - the
    same permutation on every rank - and dealt out with stride ``num_replicas``, so every batch
    has one shape. ``drop_last`` then drops incomplete rect batches and the permutation's tail
    that would leave ranks with unequal counts (up to ``num_replicas - 1`` batches, different
    ones each epoch); without it the tail is padded by repeating batches from the start.

    Either way the ranks' batches of an epoch are disjoint apart from that padding, and every
    rank yields the same number of batches: DDP needs all ranks to run the same number of
    steps, or the last all-reduce waits forever.

    Call :meth:`set_epoch` before each epoch, as with DistributedSampler; without it every epoch
    repeats epoch 0's order.

    ``keyed=True`` yields :class:`SampleKey` (index, epoch, seed) instead of plain indices: the
    epoch then travels with every index to the DataLoader workers, which persistent workers
    need (they are started once, so per-epoch worker seeding cannot reach them).

    Raises:
        DatasetError: when a rank would get no batch at all (dataset smaller than
            ``batch_size * num_replicas`` with ``drop_last``).
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        batch_index: np.ndarray | Sequence[int] | None = None,
        keyed: bool = False,
    ):
        self.dataset_len = _check_len(dataset_len)
        self.batch_size = _check_batch_size(batch_size)
        self.num_replicas, self.rank = _resolve_replicas(num_replicas, rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.keyed = keyed
        self.epoch = 0
        self.rect = batch_index is not None
        self.sampler: DistributedSampler | None = None
        self.batch_sampler: BatchSampler | None = None
        self.batches: list[list[int]] = []

        if not self.rect:
            # DistributedSampler only needs len(dataset); a range stands in for the dataset.
            self.sampler = DistributedSampler(
                range(self.dataset_len),  # type: ignore[arg-type]
                num_replicas=self.num_replicas,
                rank=self.rank,
                shuffle=shuffle,
                seed=self.seed,
                drop_last=False,
            )
            self.batch_sampler = BatchSampler(self.sampler, self.batch_size, drop_last)
        else:
            batches = make_batches(batch_index, self.dataset_len, self.batch_size)
            if drop_last:
                batches = [b for b in batches if len(b) == self.batch_size]
            self.batches = batches

        if len(self) == 0:
            raise DatasetError(
                f"{self.dataset_len} training images give no batch of {self.batch_size} on each "
                f"of {self.num_replicas} process(es): lower --batch-size or add images"
            )

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle order of ``epoch`` (identical on all ranks)."""
        self.epoch = int(epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)

    def _rect_batches_per_rank(self) -> int:
        n = len(self.batches)
        if self.drop_last:
            return n // self.num_replicas
        return math.ceil(n / self.num_replicas)

    def __iter__(self) -> Iterator[list[int] | list[SampleKey]]:
        if not self.keyed:
            yield from self._index_batches()
            return
        epoch, seed = self.epoch, self.seed
        for batch in self._index_batches():
            yield [SampleKey(i, epoch, seed) for i in batch]

    def _index_batches(self) -> Iterator[list[int]]:
        if self.batch_sampler is not None:
            yield from self.batch_sampler
            return
        n = len(self.batches)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self._rect_batches_per_rank() * self.num_replicas
        if total > n:
            # Pad by repeating from the start (more than once if there are fewer batches than
            # ranks) so that every rank gets the same count.
            order = (order * math.ceil(total / n))[:total]
        else:
            order = order[:total]
        for j in order[self.rank :: self.num_replicas]:
            yield list(self.batches[j])

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return self._rect_batches_per_rank()
