"""An image deleted or damaged after the dataset was built (mid-run) does not stop training:
it is replaced, counted and named in one warning at the epoch's end; only a dataset with no
readable image left stops the run, with one line."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from conftest import HYP_YAML, train_argv

import train as train_script
from build_utils.datasets import LoadImagesAndLabels, SubstitutePath, unreadable_in
from build_utils.samplers import SampleKey
from train_utils import trainer as trainer_module
from train_utils.checkpoint import load_checkpoint
from train_utils.config import load_hyp

IMG = 64


def _damage_before_epoch_1(monkeypatch, damage) -> None:
    """Run ``damage()`` once, after epoch 0 (the datasets were built and checked long before)."""
    real = trainer_module.train_one_epoch

    def train_one_epoch(state, loader, epoch, opts):
        if epoch == 1:
            damage()
        return real(state, loader, epoch, opts)

    monkeypatch.setattr(trainer_module, "train_one_epoch", train_one_epoch)


def _images(data: Path, split: str) -> list[Path]:
    return sorted((data.parent / split / "images").glob("*.jpg"))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_image_lost_mid_run_is_replaced_and_reported(
    make_shapes_data, tmp_path, monkeypatch, capsys, console, workers
):
    data = make_shapes_data(n_train=8, n_val=4)
    gone, garbled = _images(data, "train")[3], _images(data, "val")[1]

    def damage() -> None:
        gone.unlink()
        garbled.write_bytes(b"not an image at all")

    _damage_before_epoch_1(monkeypatch, damage)
    out = tmp_path / "run"
    argv = train_argv(data, out, epochs=2, batch=4, nbs=4, img=IMG, workers=workers)
    code = train_script.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err and "error:" not in err, err
    train_lines = [line for line in err.splitlines() if "train image could not be read" in line]
    assert len(train_lines) == 1 and "epoch 1: 1 train image" in train_lines[0], err
    assert train_lines[0].endswith(f": {gone}")
    val_lines = [line for line in err.splitlines() if "val image could not be read" in line]
    assert len(val_lines) == 1, err
    assert val_lines[0].endswith(
        "epoch 1: 1 val image could not be read and was scored as blank (objects count as "
        f"missed: the mAP is a lower bound): {garbled}"
    ), err
    assert load_checkpoint(out / "last.pt")["epoch"] == 1
    assert str(gone) in (out / "train.log").read_text()


@pytest.mark.slow
def test_no_readable_image_left_is_one_line(
    make_shapes_data, tmp_path, monkeypatch, capsys, console
):
    data = make_shapes_data(n_train=8, n_val=4)

    def damage() -> None:
        for p in _images(data, "train"):
            p.unlink()

    _damage_before_epoch_1(monkeypatch, damage)
    argv = train_argv(data, tmp_path / "run", epochs=2, batch=4, nbs=4, img=IMG, workers=2)
    code = train_script.main(argv)
    err = capsys.readouterr().err
    # The epoch's progress bar is left open on the line the error ends (tqdm's, not ours).
    errors = [line for line in err.splitlines() if "error: " in line]
    assert code == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].endswith(
        ".jpg: none of the 8 images can be read any more (the dataset was checked at start-up; "
        "were its files deleted or moved?)"
    ), err[-3000:]


def test_substitute_is_the_next_readable_sample(make_shapes_data):
    """Training: the stand-in for an unreadable image is the next index's sample, exactly;
    evaluation: a blank image at the same index with no boxes. Both name the lost file, and
    the name survives pickling (DataLoader workers)."""
    data = make_shapes_data(n_train=6, n_val=2)
    hyp = {**load_hyp(HYP_YAML), "mosaic": False}
    folder = data.parent / "train" / "images"
    ds = LoadImagesAndLabels(folder, img_size=IMG, batch_size=2, augment=True, hyp=hyp)
    expected = ds.__getitems__([SampleKey(3, 0, 7)])[0]
    Path(ds.img_files[2]).unlink()
    got = ds.__getitems__([SampleKey(2, 0, 7)])[0]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[4] == 3 and got[2] == ds.img_files[3]
    assert unreadable_in([got[2]]) == [ds.img_files[2]]
    again = pickle.loads(pickle.dumps(got[2]))
    assert isinstance(again, SubstitutePath) and again.unreadable == (ds.img_files[2],)

    val = LoadImagesAndLabels(data.parent / "val" / "images", img_size=IMG, batch_size=2)
    Path(val.img_files[0]).unlink()
    img, labels, path, _, index = val[0]
    assert index == 0 and len(labels) == 0 and unreadable_in([path]) == [val.img_files[0]]
    assert img.shape == (3, IMG, IMG) and float(img.float().std()) == 0.0


def test_mosaic_tile_lost_mid_run_is_not_drawn_again(make_shapes_data):
    """A mosaic whose *extra* tile is the lost image: that image (not the sample asking for it)
    is left out of later draws, so the batch loads; before, every stand-in drew the same lost
    tile again from the batch's pool and the run stopped with "none of the images"."""
    data = make_shapes_data(n_train=8, n_val=2)
    hyp = {**load_hyp(HYP_YAML), "mosaic": True}
    folder = data.parent / "train" / "images"
    ds = LoadImagesAndLabels(folder, img_size=IMG, batch_size=8, augment=True, hyp=hyp)
    lost = [ds.img_files[5], ds.img_files[6]]
    for p in lost:
        Path(p).unlink()
    for epoch in range(4):
        keys = [SampleKey(i, epoch, 7) for i in range(len(ds))]
        batch = ds.__getitems__(keys)
        assert len(batch) == len(ds)
        named = set(unreadable_in([s[2] for s in batch]))
        assert named <= set(lost) and named, named
        assert all(s[4] not in (5, 6) for s in batch)
        for i in range(len(ds)):  # plain indices (no pool): the whole dataset is drawn from
            assert ds[i][4] not in (5, 6)
