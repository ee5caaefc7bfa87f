"""The node-wide shared RAM image cache (build_utils/shared_images.py, data_loaders._cache_in_ram):
the file layout, reading it from another process without copying, the memory check that counts
one copy per node, and two gloo processes under torchrun filling one cache together
(tests/workers/shared_images_worker.py)."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import base_env, run_pair

from build_utils.datasets import LoadImagesAndLabels
from build_utils.errors import DatasetError
from build_utils.image_cache import check_ram_cache_fits
from build_utils.shared_images import (
    SharedImages,
    shared_cache_dir,
    shared_file_bytes,
    unlink_quietly,
)
from train_utils import data_loaders
from train_utils.distributed.launch import free_port
from train_utils.distributed.process_group import DistInfo

LAUNCH_TIMEOUT_S = 180
SIZES = np.array([[4, 3], [2, 5], [1, 1]])  # (w, h)


def _images(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in SIZES]


def test_layout_and_attach(tmp_path):
    path = tmp_path / "cache.u8"
    created = SharedImages.create(path, SIZES)
    assert path.stat().st_size == shared_file_bytes(SIZES) == (12 + 10 + 1) * 3 + 3
    other = SharedImages.attach(path, SIZES)
    images = _images()
    assert created.missing() == 3
    created.put(0, images[0])
    other.put(2, images[2])  # written by one mapping, seen by the other
    assert created.missing() == other.missing() == 1
    unlink_quietly(path)  # the mappings outlive the name
    created.put(1, images[1])
    for cache in (created, other):
        assert cache.missing() == 0
        for got, want in zip([cache[i] for i in range(3)], images, strict=True):
            assert np.array_equal(got, want) and not got.flags.writeable
    with pytest.raises(ValueError, match=r"expected \(5, 2, 3\) uint8"):
        created.put(1, images[0])
    with pytest.raises(DatasetError, match="cannot open the shared image cache"):
        SharedImages.attach(path, SIZES)
    with pytest.raises(DatasetError, match="cannot create the shared image cache"):
        SharedImages.create(tmp_path / "missing" / "x.u8", SIZES)


def _child_sum(cache: SharedImages, queue) -> None:
    queue.put([int(cache[i].sum()) for i in range(len(cache))])


def test_spawned_process_reads_it_after_unlink(tmp_path):
    """A spawned process (as a spawn DataLoader worker) gets a descriptor, not the pixels."""
    path = tmp_path / "cache.u8"
    cache = SharedImages.create(path, SIZES)
    images = _images(1)
    for i, img in enumerate(images):
        cache.put(i, img)
    unlink_quietly(path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_sum, args=(cache, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    assert got == [int(img.sum()) for img in images]


def test_memory_check_counts_copies():
    gb = 10**9
    check_ram_cache_fits(3 * gb, 10, procs=1, avail=4 * gb)  # one copy per node fits
    with pytest.raises(DatasetError, match=r"3\.0 GB x 2 process\(es\)"):
        check_ram_cache_fits(3 * gb, 10, procs=2, avail=4 * gb)
    with pytest.raises(DatasetError, match="one copy for the node but only 2.0 GB"):
        check_ram_cache_fits(3 * gb, 10, procs=1, avail=2 * gb)


def test_single_process_cache_counts_one_copy(shapes_data, monkeypatch):
    """Single process: the same path with one share; the check counts one copy."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # ignored: the shared cache is one copy
    counted = []

    def check(need, images, procs=None, avail=None):
        counted.append(procs)

    monkeypatch.setattr(data_loaders, "check_ram_cache_fits", check)
    lst = shapes_data.parent / "val.txt"
    ds = LoadImagesAndLabels(lst, 96, batch_size=4)
    disk = LoadImagesAndLabels(lst, 96, batch_size=4)
    before = set(shared_cache_dir().glob("yolo-images-*"))
    fill = LoadImagesAndLabels.fill_shared_ram_cache
    left_while_filling = []

    def filling(self, *args, **kwargs):
        # Was: the file stayed until the fill ended, so a SIGKILL during it leaked the cache.
        left_while_filling.append(set(shared_cache_dir().glob("yolo-images-*")) - before)
        return fill(self, *args, **kwargs)

    monkeypatch.setattr(LoadImagesAndLabels, "fill_shared_ram_cache", filling)
    data_loaders._cache_in_ram([ds], DistInfo.single("cpu"))
    assert left_while_filling == [set()]  # unlinked once mapped, before the fill
    assert set(shared_cache_dir().glob("yolo-images-*")) <= before
    assert counted == [1]
    assert isinstance(ds._imgs, SharedImages)
    for i in range(len(ds)):
        assert np.array_equal(ds.load_image(i), disk._decode_for_cache(i))


@pytest.mark.slow
def test_two_processes_share_one_cache(shapes_data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lists = [shapes_data.parent / "val.txt", shapes_data.parent / "train.txt"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",  # the worker as a module: tests/workers/shared_images_worker.py
        "tests.workers.shared_images_worker",
        *map(str, lists),
        str(out),
    ]
    run_pair([cmd], [base_env()], timeout=LAUNCH_TIMEOUT_S)
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # Created once (by local rank 0), one file per dataset, and gone once everyone mapped it.
    assert len(res[0]["created"]) == 2 and res[1]["created"] == []
    assert all(r["left"] == [] for r in res)
    assert all(not Path(p).exists() for p in res[0]["created"])
    assert res[0]["counted"] == [1] and res[1]["counted"] == []  # one copy, checked on rank 0
    for r in res:
        assert r["types"] == ["SharedImages", "SharedImages"]
        assert len(r["equal"]) == 34 and all(r["equal"])  # 10 val + 24 train images
        assert r["workers_same"]
