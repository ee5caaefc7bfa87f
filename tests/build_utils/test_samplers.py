"""Tests for build_utils/samplers.py; every rank's sampler is built in this one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from build_utils.errors import DatasetError
from build_utils.samplers import (
    DistributedBatchSampler,
    SampleKey,
    ShardedEvalBatchSampler,
    make_batches,
)


def rect_batch_index(n: int, batch_size: int) -> np.ndarray:
    """What LoadImagesAndLabels(rect=True) stores as ``batch``: consecutive runs of ids."""
    return np.floor(np.arange(n) / batch_size).astype(int)


@pytest.mark.parametrize("bad", [dict(num_replicas=0, rank=0), dict(num_replicas=2, rank=2)])
def test_bad_replicas(bad: dict) -> None:
    with pytest.raises(ValueError):
        ShardedEvalBatchSampler(None, 4, 1, **bad)


def test_make_batches() -> None:
    assert make_batches(None, 7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert make_batches(rect_batch_index(7, 3), 7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    # Groups bigger than batch_size are split; a non-contiguous group stays together.
    assert make_batches(np.array([0, 0, 0, 0, 1]), 5, 2) == [[0, 1], [2, 3], [4]]
    assert make_batches(np.array([1, 0, 1, 0]), 4, 4) == [[1, 3], [0, 2]]
    with pytest.raises(ValueError, match="batch_index has 3 entries"):
        make_batches(np.zeros(3), 4, 2)


@pytest.mark.parametrize("n,bs,k", [(7, 2, 2), (7, 2, 3), (23, 4, 3), (5, 8, 2)])
def test_eval_batch_sampler_whole_rect_batches(n: int, bs: int, k: int) -> None:
    batch_index = rect_batch_index(n, bs)
    per_rank = [list(ShardedEvalBatchSampler(batch_index, n, bs, k, r)) for r in range(k)]
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(n))  # no padding, no duplicates
    for r, batches in enumerate(per_rank):
        s = ShardedEvalBatchSampler(batch_index, n, bs, k, r)
        assert len(s) == len(batches)
        for b in batches:
            # One rect batch id per batch, so one letterbox shape.
            assert len({int(batch_index[i]) for i in b}) == 1
            assert 1 <= len(b) <= bs
    # Round-robin: batch counts differ by at most one.
    counts = [len(b) for b in per_rank]
    assert max(counts) - min(counts) <= 1


def test_eval_batch_sampler_plain_chunks() -> None:
    per_rank = [list(ShardedEvalBatchSampler(None, 7, 2, 2, r)) for r in range(2)]
    assert per_rank == [[[0, 1], [4, 5]], [[2, 3], [6]]]


def test_eval_batch_sampler_with_dataloader() -> None:
    data = list(range(10))
    loader = DataLoader(data, batch_sampler=ShardedEvalBatchSampler(None, 10, 4, 2, 1))
    assert [b.tolist() for b in loader] == [[4, 5, 6, 7]]


def _epoch(sampler: DistributedBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("n,bs,k", [(20, 3, 2), (21, 4, 3), (16, 4, 1)])
def test_train_sampler_matches_torch_composition(n: int, bs: int, k: int) -> None:
    for r in range(k):
        ours = DistributedBatchSampler(n, bs, k, r, shuffle=True, seed=5)
        ref = BatchSampler(DistributedSampler(range(n), k, r, shuffle=True, seed=5), bs, True)
        for epoch in (0, 3):
            ref.sampler.set_epoch(epoch)
            assert _epoch(ours, epoch) == list(ref)
        assert len(ours) == len(ref)


def test_train_sampler_epochs_differ_and_ranks_disjoint() -> None:
    n, bs, k = 40, 4, 2
    samplers = [DistributedBatchSampler(n, bs, k, r, seed=0) for r in range(k)]
    epochs = []
    for epoch in range(3):
        per_rank = [_epoch(s, epoch) for s in samplers]
        flat = [set(i for b in batches for i in b) for batches in per_rank]
        assert flat[0].isdisjoint(flat[1])
        assert flat[0] | flat[1] == set(range(n))  # 40 = 2 ranks x 5 batches x 4
        assert len(per_rank[0]) == len(per_rank[1]) == len(samplers[0]) == 5
        epochs.append(per_rank[0])
    assert epochs[0] != epochs[1] != epochs[2]
    # set_epoch is what changes the order: going back reproduces it.
    assert _epoch(samplers[0], 0) == epochs[0]


def test_train_sampler_no_shuffle() -> None:
    s = DistributedBatchSampler(8, 2, 2, 0, shuffle=False)
    assert _epoch(s, 0) == _epoch(s, 1) == [[0, 2], [4, 6]]


@pytest.mark.parametrize("n,bs,k", [(23, 4, 2), (23, 4, 3), (40, 8, 4), (9, 2, 2)])
def test_rect_train_sampler(n: int, bs: int, k: int) -> None:
    batch_index = rect_batch_index(n, bs)
    samplers = [
        DistributedBatchSampler(n, bs, k, r, seed=1, batch_index=batch_index) for r in range(k)
    ]
    orders = []
    for epoch in range(3):
        per_rank = [_epoch(s, epoch) for s in samplers]
        # Same number of full batches on every rank, each of a single rect shape.
        assert len({len(p) for p in per_rank}) == 1
        assert all(len(p) == len(samplers[0]) > 0 for p in per_rank)
        for batches in per_rank:
            for b in batches:
                assert len(b) == bs
                assert len({int(batch_index[i]) for i in b}) == 1
        flat = [i for batches in per_rank for b in batches for i in b]
        assert len(flat) == len(set(flat))  # disjoint across ranks
        # Only whole batches are left out: the incomplete one and the tail that does not
        # divide among the ranks.
        full = n // bs
        assert len(flat) == (full // k) * k * bs
        orders.append(per_rank)
    assert orders[0] != orders[1] or orders[1] != orders[2]


def test_rect_train_sampler_epochs_differ() -> None:
    n, bs = 64, 4
    s = DistributedBatchSampler(n, bs, 2, 0, seed=0, batch_index=rect_batch_index(n, bs))
    assert _epoch(s, 0) != _epoch(s, 1)
    assert _epoch(s, 0) == _epoch(s, 0)
    other_seed = DistributedBatchSampler(n, bs, 2, 0, seed=1, batch_index=rect_batch_index(n, bs))
    assert _epoch(other_seed, 0) != _epoch(s, 0)


@pytest.mark.parametrize("rect", [False, True])
def test_keyed_sampler_carries_epoch_and_seed(rect: bool) -> None:
    """keyed=True yields the same batches as plain indices, each index with its epoch and seed."""
    n, bs = 24, 4
    batch_index = rect_batch_index(n, bs) if rect else None
    plain = DistributedBatchSampler(n, bs, 2, 1, seed=3, batch_index=batch_index)
    keyed = DistributedBatchSampler(n, bs, 2, 1, seed=3, batch_index=batch_index, keyed=True)
    for epoch in (0, 5):
        plain.set_epoch(epoch)
        keyed.set_epoch(epoch)
        expected = [[SampleKey(i, epoch, 3) for i in b] for b in plain]
        assert list(keyed) == expected and len(keyed) == len(plain)


def test_rect_train_sampler_without_drop_last_pads_whole_batches() -> None:
    n, bs, k = 9, 2, 2  # batches [0,1] [2,3] [4,5] [6,7] [8]: 5 batches -> 3 per rank
    batch_index = rect_batch_index(n, bs)
    per_rank = [
        _epoch(DistributedBatchSampler(n, bs, k, r, drop_last=False, batch_index=batch_index), 2)
        for r in range(k)
    ]
    assert [len(p) for p in per_rank] == [3, 3]
    flat = [i for p in per_rank for b in p for i in b]
    assert set(flat) == set(range(n))  # covers everything, one batch repeated
    for p in per_rank:
        for b in p:
            assert len({int(batch_index[i]) for i in b}) == 1


def test_rect_train_sampler_with_dataloader() -> None:
    n, bs = 12, 3
    sampler = DistributedBatchSampler(n, bs, 2, 1, batch_index=rect_batch_index(n, bs))
    loader = DataLoader(torch.arange(n), batch_sampler=sampler)
    got = [b.tolist() for b in loader]
    assert len(got) == len(sampler) == 2 and all(len(b) == bs for b in got)


def test_train_sampler_too_small_dataset() -> None:
    with pytest.raises(DatasetError, match="no batch of 8"):
        DistributedBatchSampler(10, 8, 2, 0)
    with pytest.raises(DatasetError, match="no batch of 8"):
        DistributedBatchSampler(10, 8, 2, 0, batch_index=rect_batch_index(10, 8))
