"""One rank of a 2-process gloo group started by torchrun, filling the node-wide shared RAM image
cache of two image lists together with the other rank. Writes ``OUT/rank<r>.json`` with the cache
files it created, the memory checks it made, whether every cached image equals a fresh decode,
whether forked DataLoader workers read the same pixels, and which cache files are left, for
tests/build_utils/test_shared_images.py.

Usage: torchrun --nproc_per_node=2 -m tests.workers.shared_images_worker LIST1 LIST2 OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from build_utils import shared_images
from build_utils.datasets import LoadImagesAndLabels
from train_utils import data_loaders
from train_utils.distributed import comm, process_group


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    lists, out = [Path(p) for p in argv[0:2]], Path(argv[2])
    created, counted = [], []
    real_create = shared_images.SharedImages.create

    def create(path, sizes):
        created.append(str(path))
        return real_create(path, sizes)

    def check(need, images, procs=None, avail=None):
        counted.append(procs)

    data_loaders.SharedImages.create = create
    data_loaders.check_ram_cache_fits = check
    info = process_group.init_distributed_mode(None, timeout_s=60)
    datasets = [LoadImagesAndLabels(p, 96, batch_size=4, rank=info.rank) for p in lists]
    data_loaders._cache_in_ram(datasets, info)
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


if __name__ == "__main__":
    main()
