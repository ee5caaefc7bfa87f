"""The training data pipeline as the trainer builds it (train_utils/data_loaders.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train_argv

from build_utils import image_cache
from build_utils.errors import DatasetError
from train_utils.config import build_config, get_args_parser
from train_utils.data_loaders import build_train_data, make_eval_dataset
from train_utils.distributed.process_group import DistInfo


def _config(data: Path, out: Path, workers: int, *extra: str):
    # No --epochs and multi-scale left at its default: only the data pipeline is built.
    argv = train_argv(
        data, out, *extra, batch=6, img=96, workers=workers, epochs=None, multi_scale=None
    )
    return build_config(get_args_parser().parse_args(argv))


def _epochs(data: Path, out: Path, workers: int, epochs: int = 2) -> list[list]:
    """Image batches of ``epochs`` epochs, as the trainer loads them (set_epoch, then iterate)."""
    config = _config(data, out, workers)
    train = build_train_data(config, DistInfo.single(torch.device("cpu")), config.hyp)
    assert train.train_loader.persistent_workers == (workers > 0)
    result = []
    for epoch in range(epochs):
        train.sampler.set_epoch(epoch)
        result.append(
            [(imgs, targets, indices) for imgs, targets, _, _, indices in train.train_loader]
        )
    return result


def test_batches_do_not_depend_on_persistent_workers(shapes_data, tmp_path):
    """Two epochs with 2 persistent workers give bitwise the batches of the main process, and
    epoch 1 is augmented differently from epoch 0 (the epoch reaches the workers)."""
    main = _epochs(shapes_data, tmp_path / "w0", workers=0)
    workers = _epochs(shapes_data, tmp_path / "w2", workers=2)
    for epoch_main, epoch_workers in zip(main, workers, strict=True):
        assert len(epoch_main) == len(epoch_workers) > 0
        for (a, ta, ia), (b, tb, ib) in zip(epoch_main, epoch_workers, strict=True):
            assert ia == ib
            assert torch.equal(a, b)
            assert torch.equal(ta, tb)
    first = {i: img for imgs, _, ids in main[0] for i, img in zip(ids, imgs)}
    second = {i: img for imgs, _, ids in main[1] for i, img in zip(ids, imgs)}
    common = first.keys() & second.keys()
    assert common and all(not torch.equal(first[i], second[i]) for i in common)


def test_a_per_process_ram_cache_counts_the_processes_of_the_node(shapes_data, monkeypatch):
    """Each process that caches its own copy is counted: LOCAL_WORLD_SIZE (or SLURM's tasks on
    the node) through processes_per_node(), which build_utils cannot read itself."""
    lst = shapes_data.parent / "val.txt"
    for var in ("LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    need = make_eval_dataset(lst, 96, 4, nc=3).ram_cache_bytes()
    monkeypatch.setattr(image_cache, "available_memory_bytes", lambda: 4 * need)
    assert make_eval_dataset(lst, 96, 4, nc=3, cache_images="ram").ram_cache_copies == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(DatasetError, match=r"x 8 process\(es\)"):
        make_eval_dataset(lst, 96, 4, nc=3, cache_images="ram")


def test_a_run_ends_its_loaders_workers_even_when_something_still_holds_them(
    shapes_data, tmp_path, monkeypatch
):
    """Was: a DataLoader iterator still referenced at exit (a reference cycle) left its
    persistent workers to multiprocessing's exit hook, whose SIGTERM they ignore: the process
    hung at exit after "done" or "interrupted" (seen with --recipe darknet). The trainer now ends
    the workers itself; here something keeps the loaders alive after the run."""
    import multiprocessing

    from conftest import run_training

    from train_utils import trainer
    from train_utils.data_loaders import shut_down_workers

    held = []

    def build_and_hold(*args, **kwargs):
        held.append(build_train_data(*args, **kwargs))
        return held[-1]

    monkeypatch.setattr(trainer, "build_train_data", build_and_hold)
    try:
        run_training(train_argv(shapes_data, tmp_path / "run", workers=1, batch=2, img=64))
        assert held and held[0].train_loader._iterator is None
        assert multiprocessing.active_children() == []
    finally:  # a failure here must not leave this pytest process hanging at its exit
        for data in held:
            shut_down_workers(data.train_loader)
            shut_down_workers(data.val_loader)
