"""One rank of a 2-process gloo group as a launcher started it (torchrun, SLURM variables, or the
legacy ``--local_rank`` argument): it runs every collective of train_utils.distributed.comm and
writes what it saw to ``OUT/rank<r>.json`` for tests/train_utils/distributed/test_comm.py to check.

Usage: python -m tests.workers.comm_worker OUT [--local_rank N | --local-rank N] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from train_utils.distributed import comm, process_group


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    out = Path(args.out)

    info = process_group.init_distributed_mode(args, timeout_s=60)
    r = info.rank
    res = {
        "rank": r,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "backend": info.backend,
        "device": str(info.device),
        "distributed": info.distributed,
        "is_main": info.is_main,
        "get_rank": comm.get_rank(),
        "get_world_size": comm.get_world_size(),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "env_rank": os.environ.get("RANK"),
        "root_level": logging.getLogger().level,
    }
    # An epoch's mean losses, as the engine reduces them: [1, 0] and [2, 10] average elementwise.
    res["reduce_avg"] = comm.all_reduce_mean(torch.tensor([float(r + 1), 10.0 * r])).tolist()
    res["reduce_int"] = comm.all_reduce_mean(torch.tensor(r + 1)).item()
    res["gather"] = comm.all_gather({"rank": r, "items": list(range(r + 1))})
    res["broadcast"] = comm.broadcast_object(f"from rank {r}", src=1)
    rows = torch.arange(3.0 * (r + 1), dtype=torch.float64).reshape(-1, 3) + 100 * r
    gathered = comm.gather_rows_to_main(rows)
    res["rows"] = None if gathered is None else gathered.tolist()
    # Two dtypes, a channels_last tensor among them: every rank ends with rank 1's values, in
    # place (same objects, same memory format).
    tensors = [
        torch.full((2, 3), float(r)),
        torch.arange(24.0).reshape(1, 2, 3, 4).add(10 * r).to(memory_format=torch.channels_last),
        torch.tensor(r + 7),
    ]
    ids = [id(t) for t in tensors]
    comm.broadcast_tensors_(tensors, src=1)
    res["tensors"] = [t.tolist() for t in tensors]
    res["tensors_kept"] = [id(t) for t in tensors] == ids and tensors[1].is_contiguous(
        memory_format=torch.channels_last
    )
    res["flag_none"] = comm.all_reduce_flag(False)
    res["flag_one"] = comm.all_reduce_flag(r == 1)

    marker = out / "marker.txt"
    with comm.torch_distributed_zero_first(r):
        if r == 0:
            # Rank 1 would read a missing file if it did not wait for this block.
            time.sleep(1.0)
            marker.write_text("written by rank 0")
        else:
            res["marker"] = marker.read_text()
    comm.barrier()
    process_group.cleanup()
    res["initialised_after_cleanup"] = comm.is_dist_avail_and_initialized()
    (out / f"rank{r}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
