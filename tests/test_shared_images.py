"""The node-wide shared RAM image cache (build_utils/shared_images.py, builders._cache_in_ram):
the file layout, reading it from another process without copying, the memory check that counts
one copy per node, and two gloo processes under torchrun filling one cache together."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from build_utils.datasets import LoadImagesAndLabels
from build_utils.errors import DatasetError
from build_utils.image_cache import check_ram_cache_fits
from build_utils.shared_images import (
    SharedImages,
    shared_cache_dir,
    shared_file_bytes,
    unlink_quietly,
)
from train_utils import builders
from train_utils.distributed.process_group import DistInfo

REPO = Path(__file__).resolve().parents[1]
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

    monkeypatch.setattr(builders, "check_ram_cache_fits", check)
    lst = shapes_data.parent / "val.txt"
    ds = LoadImagesAndLabels(lst, 96, batch_size=4)
    disk = LoadImagesAndLabels(lst, 96, batch_size=4)
    before = set(shared_cache_dir().glob("yolo-images-*"))
    builders._cache_in_ram([ds], DistInfo.single())
    assert set(shared_cache_dir().glob("yolo-images-*")) <= before  # unlinked once mapped
    assert counted == [1]
    assert isinstance(ds._imgs, SharedImages)
    for i in range(len(ds)):
        assert np.array_equal(ds.load_image(i), disk._decode_for_cache(i))


WORKER = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from build_utils import shared_images
    from build_utils.datasets import LoadImagesAndLabels
    from train_utils import builders
    from train_utils.distributed import comm
    from train_utils.distributed import process_group

    lists, out = [Path(p) for p in sys.argv[1:3]], Path(sys.argv[3])
    created, counted = [], []
    real_create = shared_images.SharedImages.create

    def create(path, sizes):
        created.append(str(path))
        return real_create(path, sizes)

    def check(need, images, procs=None, avail=None):
        counted.append(procs)

    builders.SharedImages.create = create
    builders.check_ram_cache_fits = check
    info = process_group.init_distributed_mode(None, timeout_s=60)
    datasets = [LoadImagesAndLabels(p, 96, batch_size=4, rank=info.rank) for p in lists]
    builders._cache_in_ram(datasets, info)
    comm.barrier()
    equal = []
    for ds, p in zip(datasets, lists):
        disk = LoadImagesAndLabels(p, 96, batch_size=4, rank=info.rank)
        for i in range(len(ds)):
            equal.append(np.array_equal(ds.load_image(i), disk._decode_for_cache(i)))
    # Forked DataLoader workers read the same mapping.
    loader = DataLoader(datasets[0], batch_size=2, num_workers=2, collate_fn=datasets[0].collate_fn)
    worker_imgs = [imgs for imgs, *_ in loader]
    direct = [datasets[0][i][0] for i in range(len(datasets[0]))]
    flat = [torch.cat([b.flatten() for b in batches]) for batches in (worker_imgs, direct)]
    same = torch.equal(*flat)
    res = {
        "rank": info.rank,
        "created": created,
        "counted": counted,
        "equal": equal,
        "workers_same": same,
        "left": [p for p in created if Path(p).exists()],
        "types": [type(ds._imgs).__name__ for ds in datasets],
    }
    process_group.cleanup()
    (out / f"rank{info.rank}.json").write_text(json.dumps(res))
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_share_one_cache(shapes_data, tmp_path):
    script, out = tmp_path / "worker.py", tmp_path / "out"
    script.write_text(WORKER)
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    lists = [shapes_data.parent / "val.txt", shapes_data.parent / "train.txt"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(script),
        *map(str, lists),
        str(out),
    ]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
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
