"""One rank of a 2-process gloo group (torchrun's variables) deciding the epoch plan with its own
clock and timings: every rank must follow rank 0's decision. Writes ``OUT/rank<r>.json`` with the
planned total and the early-stop decision it followed, and its own (``mine``).

Usage: python -m tests.workers.plan_worker OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from train_utils.distributed import process_group
from train_utils.distributed.comm import broadcast_object
from train_utils.plan import EpochPlan


class _Args:
    local_rank = -1
    device = "cpu"


def main(argv: list[str] | None = None) -> None:
    out = Path((sys.argv[1:] if argv is None else argv)[0])
    info = process_group.init_distributed_mode(_Args(), timeout_s=60)
    r = info.rank
    # Each rank's clock and timings differ; rank 0's must decide for both. The decisions are
    # pure; the trainer shares rank 0's with broadcast_object, as here.
    plan = EpochPlan(epochs=30, budget_s=100.0, patience=2)
    plan.started = time.time() - (10.0 if r == 0 else 95.0)
    mine = [
        plan.budget_epochs(0, 10.0 if r == 0 else 50.0, plan.spent()),
        plan.out_of_patience(4, best_epoch=2 if r == 0 else 4),
    ]
    total, stop = broadcast_object(mine)
    process_group.cleanup()
    result = {"total": total, "stop": stop, "mine": mine}
    (out / f"rank{r}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
