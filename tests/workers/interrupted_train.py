"""``train.py`` with one hook that makes a kill point deterministic, for
tests/test_reliability_interrupt.py: at the point it either parks the process and writes a marker
file, so the test signals it from outside, or sends SIGKILL to itself.

The environment chooses the hook:
    REL_POINT   park-mid-epoch (after the first batch of epoch REL_EPOCH has trained, wait
                REL_PARK_S seconds), kill-in-eval (before the NMS of the first validation
                batch), kill-in-save (half-way through writing a checkpoint), or none
    REL_MARKER  the file written when the point is reached
    REL_EPOCH   the epoch park-mid-epoch stops in
    REL_PARK_S  how long a parked process waits for the test's signal

Usage: python -m tests.workers.interrupted_train TRAIN_FLAGS...
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import torch

import train
from train_utils import engine, trainer


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _park_mid_epoch(marker: Path, epoch_to_stop: int, park_s: float) -> None:
    """After the first batch of the epoch has trained, wait for the test's signal."""
    real_train = trainer.train_one_epoch

    class ParkAfterFirstBatch:
        def __init__(self, loader):
            self.loader = loader

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            for i, batch in enumerate(self.loader):
                if i == 1:
                    marker.write_text("parked")
                    time.sleep(park_s)
                yield batch

    def train_one_epoch(*args, **kwargs):
        if args[2] == epoch_to_stop:  # (state, loader, epoch, opts)
            args = (args[0], ParkAfterFirstBatch(args[1]), *args[2:])
        return real_train(*args, **kwargs)

    trainer.train_one_epoch = train_one_epoch


def _kill_in_eval(marker: Path) -> None:
    """The model has run on the first validation batch; die before its NMS."""

    def nms(*args, **kwargs):
        marker.write_text("in eval")
        _die()

    engine.non_max_suppression = nms


def _kill_in_save(marker: Path) -> None:
    """Write half of the checkpoint's bytes into the temporary file, then die."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        marker.write_text("half written")
        _die()

    torch.save = save


def main(argv: list[str] | None = None) -> int:
    # Python's own Ctrl-C handler even when this process was started with SIGINT ignored (as
    # non-interactive shells start background jobs), so that the test's SIGINT is a Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    point = os.environ["REL_POINT"]
    marker = Path(os.environ["REL_MARKER"])
    if point == "park-mid-epoch":
        _park_mid_epoch(marker, int(os.environ["REL_EPOCH"]), float(os.environ["REL_PARK_S"]))
    elif point == "kill-in-eval":
        _kill_in_eval(marker)
    elif point == "kill-in-save":
        _kill_in_save(marker)
    return train.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
