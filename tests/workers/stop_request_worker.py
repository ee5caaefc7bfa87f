"""One rank of a 2-process gloo group (torchrun's variables) in which only rank 1 receives
SIGUSR1, after its 4th batch: the trainer's stop points must stop both ranks before the same
batch (the next one polled), so that neither waits for the other in a gradient all-reduce.
Writes ``OUT/rank<r>.json`` with the batches each rank got and the stop message.

Usage: python -m tests.workers.stop_request_worker OUT
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from build_utils.errors import RunStopped
from train_utils.distributed import process_group
from train_utils.stop_signals import StopPoints, StopSignals

N_BATCHES = 25
SIGNALLED_AFTER = 3  # rank 1 signals itself after taking this batch


def main(argv: list[str] | None = None) -> None:
    out = Path((sys.argv[1:] if argv is None else argv)[0])
    info = process_group.init_distributed_mode(None, timeout_s=60)
    signals = StopSignals()
    points = StopPoints(list(range(N_BATCHES)), signals, 4, info, out / "last.pt")
    taken, message = [], None
    with signals.installed():
        try:
            for batch in points:
                taken.append(batch)
                if info.rank == 1 and batch == SIGNALLED_AFTER:
                    os.kill(os.getpid(), signal.SIGUSR1)
        except RunStopped as e:
            message = str(e)
    process_group.cleanup()
    (out / f"rank{info.rank}.json").write_text(json.dumps({"taken": taken, "message": message}))


if __name__ == "__main__":
    main()
