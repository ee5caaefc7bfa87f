"""One rank of a 2-process gloo group (torchrun's variables) in which rank 1 fails to read its
checkpoint: ``comm.raise_if_any_rank_failed`` must raise the same error on both ranks. Writes
``OUT/rank<r>.json`` with the error each rank raised.

Usage: python -m tests.workers.rank_failure_worker OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from build_utils.errors import CheckpointError
from train_utils.distributed import comm, process_group


def main(argv: list[str] | None = None) -> None:
    out = Path((sys.argv[1:] if argv is None else argv)[0])
    info = process_group.init_distributed_mode(None, timeout_s=60)
    r = info.rank
    res = {}
    comm.raise_if_any_rank_failed(None, "nothing")  # nobody failed: nobody raises
    error = CheckpointError("cannot read", "/node1/last.pt") if r == 1 else None
    try:
        comm.raise_if_any_rank_failed(error, "--resume")
    except CheckpointError as e:
        res["error"] = str(e)
    process_group.cleanup()
    (out / f"rank{r}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
