"""Training in the data modes the default run leaves out, through the public CLIs: ``--rect``
in one process (train.py) and under DDP (torchrun train_multi_GPU.py, gloo on the CPU), and
``--cache-images disk``. One epoch of the nano model on a few tiny images each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import read_results, torchrun, train_argv

import train as train_script
from build_utils.augmentations import GRID
from build_utils.datasets import LoadImagesAndLabels
from train_utils.reporting import TIMING_COLUMNS

pytestmark = pytest.mark.slow  # whole training runs, like tests/scripts/test_train.py, test_ddp.py

REPO = Path(__file__).resolve().parents[2]
IMG = 128
BATCH = 4
NC = 5  # classes of the shapes dataset
# The rect tests' data: sides of 64-256 px and batches of 2, so that at IMG (4 x GRID) three
# batch shapes occur, 96x128, 128x128 and 128x96. (With the session's shapes_data, 160-256 px
# in batches of 4, every rect batch rounds up to a square and a mix-up could not show.)
RECT_SIDES = (64, 256)
RECT_BATCH = 2
N_RECT_TRAIN = 16
DISK_CACHE = ("--cache-images", "disk")


def _rect_train_set(data: Path) -> LoadImagesAndLabels:
    """The training set as the trainer builds it for ``--rect`` (same order, same batches)."""
    hyp = yaml.safe_load((REPO / "cfg" / "hyp.yaml").read_text())
    return LoadImagesAndLabels(
        data.parent / "train.txt", IMG, RECT_BATCH, augment=True, hyp=hyp, rect=True, nc=NC
    )


# ---------------------------------------------------------------------------------------------
# --rect


def test_rect_training_trains_on_whole_rectangular_batches(
    make_shapes_data, tmp_path, console, monkeypatch
):
    """One process: every training batch is one whole rect batch of the dataset, in its
    letterbox shape (not square for these non-square images), each dealt once per epoch."""
    data = make_shapes_data(n_train=N_RECT_TRAIN, n_val=4, img_size_range=RECT_SIDES)
    ref = _rect_train_set(data)
    shapes = [tuple(int(v) for v in s) for s in ref.batch_shapes]
    assert all(h % GRID == 0 and w % GRID == 0 and max(h, w) == IMG for h, w in shapes)
    assert any(h != w for h, w in shapes), shapes  # else this test could not see a mix-up
    index = {f: i for i, f in enumerate(ref.img_files)}
    groups = {int(b): sorted(np.flatnonzero(ref.batch == b).tolist()) for b in set(ref.batch)}

    seen: list[tuple[tuple[int, int], list[int]]] = []
    real_collate = LoadImagesAndLabels.collate_fn

    def recording_collate(batch):
        out = real_collate(batch)
        if out[2][0] in index:  # a training batch (validation images are not in ref)
            seen.append((tuple(out[0].shape[2:]), sorted(index[p] for p in out[2])))
        return out

    monkeypatch.setattr(LoadImagesAndLabels, "collate_fn", staticmethod(recording_collate))
    out = tmp_path / "rect"
    assert train_script.main(train_argv(data, out, "--rect", img=IMG, batch=RECT_BATCH)) == 0
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0"]

    assert len(seen) == len(groups) == N_RECT_TRAIN // RECT_BATCH  # all batches full
    dealt = []
    for hw, ids in seen:
        b = int(ref.batch[ids[0]])
        assert ids == groups[b], (ids, groups[b])  # a whole rect batch, nothing mixed in
        assert hw == shapes[b]  # trained in that batch's letterbox shape
        dealt.append(b)
    assert sorted(dealt) == sorted(groups)  # each batch once in the epoch
    assert any(h != w for (h, w), _ in seen)


def test_rect_training_under_ddp(make_shapes_data, tmp_path):
    """Two processes (torchrun, gloo): rect batches of different shapes are dealt whole to the
    ranks, so no rank stacks images of two shapes ("stack expects each tensor to be equal
    size", PITFALLS) and the epoch completes."""
    data = make_shapes_data(n_train=N_RECT_TRAIN, n_val=4, img_size_range=RECT_SIDES)
    ref = _rect_train_set(data)
    assert len({tuple(s) for s in ref.batch_shapes.tolist()}) > 1  # a mix-up would crash
    out = tmp_path / "ddp_rect"
    argv = train_argv(data, out, "--rect", img=IMG, batch=RECT_BATCH)
    proc = torchrun("train_multi_GPU.py", argv)
    assert "stack expects" not in proc.stderr + proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0"]
    assert torch.load(out / "last.pt", weights_only=True)["epoch"] == 0
    log = (out / "train.log").read_text()
    assert "device cpu x 2 process(es)" in log and log.count("done: 1 epochs") == 1


# ---------------------------------------------------------------------------------------------
# --cache-images disk


def test_disk_image_cache_is_written_reused_and_changes_nothing(
    make_shapes_data, tmp_path, console, monkeypatch
):
    """The first run writes one ``.npy`` per image beside the label cache and trains from
    them; a second run trains from the same files (not rewritten, no image decoded) and
    reproduces the first run's losses and mAP. (A RAM cache holds the same pixels but turns
    the mosaic buffer off, and a run without a cache decodes at other scales: neither is
    expected to equal these runs.)"""
    n_images = {"train": 8, "val": 4}
    data = make_shapes_data(n_train=n_images["train"], n_val=n_images["val"])
    first = tmp_path / "first"
    assert train_script.main(train_argv(data, first, *DISK_CACHE, img=IMG, batch=BATCH)) == 0

    def cached() -> dict[Path, int]:
        """Every .npy file of both splits with its modification time."""
        found = {}
        for split, n in n_images.items():
            label_cache = LoadImagesAndLabels(data.parent / f"{split}.txt", IMG).cache_path
            files = sorted((label_cache.parent / f"{split}.img{IMG}").glob("*.npy"))
            assert len(files) == n, (split, files)
            found.update((f, f.stat().st_mtime_ns) for f in files)
        return found

    npys = cached()
    for f in npys:
        img = np.load(f, allow_pickle=False)
        # Resized once to the training size: long side IMG (the images are 160-256 px).
        assert img.dtype == np.uint8 and img.shape[2] == 3 and max(img.shape[:2]) == IMG

    decoded = []
    real_decode = LoadImagesAndLabels._decode

    def recording_decode(self, i, scale):
        decoded.append(self.img_files[i])
        return real_decode(self, i, scale)

    monkeypatch.setattr(LoadImagesAndLabels, "_decode", recording_decode)
    second = tmp_path / "second"
    assert train_script.main(train_argv(data, second, *DISK_CACHE, img=IMG, batch=BATCH)) == 0
    assert cached() == npys  # the same files, none rewritten
    assert decoded == []  # every image came from its .npy file

    a, b = read_results(first / "results.csv"), read_results(second / "results.csv")
    assert [r["epoch"] for r in a] == [r["epoch"] for r in b] == ["0"]
    assert float(a[0]["loss"]) > 0
    for x, y in zip(a, b):
        for column in TIMING_COLUMNS:
            x.pop(column), y.pop(column)
        assert x == y
