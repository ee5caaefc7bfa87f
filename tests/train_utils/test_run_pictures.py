"""train_utils/run_pictures.py: the first-batch pictures leave the batches and every random
number generator as they were."""

from __future__ import annotations

import random
from types import SimpleNamespace

import cv2
import numpy as np
import torch

from train_utils.run_pictures import plot_dataset_labels, plot_first_batches


def _batches(n: int) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        imgs = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8, generator=g)
        targets = torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.3], [1, 0, 0.3, 0.4, 0.2, 0.5]])
        out.append((imgs, targets, [f"a{i}.jpg", f"b{i}.jpg"], None, [2 * i, 2 * i + 1]))
    return out


def _rng_states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()


def test_first_batches_drawn_and_passed_through_unchanged(tmp_path):
    batches = _batches(5)
    copies = [(b[0].clone(), b[1].clone()) for b in batches]
    loader = plot_first_batches(batches, tmp_path, ["circle", "square"], enabled=True)
    before = _rng_states()
    seen = list(loader)
    after = _rng_states()
    assert len(loader) == 5 and len(seen) == 5
    for (imgs, targets, *_), (i0, t0) in zip(seen, copies):
        assert torch.equal(imgs, i0) and torch.equal(targets, t0)
    assert before[0] == after[0]
    assert np.array_equal(before[1], after[1])
    assert torch.equal(before[2], after[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "train_batch0.jpg",
        "train_batch1.jpg",
        "train_batch2.jpg",
    ]
    img = cv2.imread(str(tmp_path / "train_batch0.jpg"))
    assert img is not None and img.reshape(-1, 3).std(0).max() > 5


def test_disabled_is_the_loader_itself(tmp_path):
    batches = _batches(1)
    assert plot_first_batches(batches, tmp_path, [], enabled=False) is batches
    assert not list(tmp_path.iterdir())


def test_drawing_failure_is_a_warning(tmp_path, caplog):
    dataset = SimpleNamespace(labels=[np.array([[0, 0.5, 0.5, 0.2, 0.2]])])
    plot_dataset_labels(dataset, ["a"], tmp_path / "missing-folder")
    assert "could not draw" in caplog.text
