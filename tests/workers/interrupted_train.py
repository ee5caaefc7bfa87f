"""``train.py`` with one hook that makes a kill point deterministic, for
tests/scenarios/test_reliability_interrupt.py: at the point it either parks the process and
writes a marker file, so the test signals it from outside, or sends SIGKILL to itself.

The environment chooses the hook:
    REL_POINT   park-mid-epoch (after the first batch of epoch REL_EPOCH has trained, wait
                REL_PARK_S seconds), park-in-timing (in the start-up timing of the memory
                format, the run folder locked, nothing trained: wait REL_PARK_S),
                kill-in-eval (before the NMS of the first validation batch), kill-in-save
                (half-way through writing a checkpoint),
                signal-at-write (send REL_SIGNAL to itself at the epoch-end write REL_WRITE
                of epoch REL_EPOCH), or none
    REL_MARKER  the file written when the point is reached
    REL_EPOCH   the epoch park-mid-epoch stops in, or signal-at-write signals in
    REL_PARK_S  how long a parked process waits for the test's signal
    REL_WRITE   results.csv, last.pt or best.pt (while its temporary file is open, nothing of
                it on disk yet), or between (after last.pt is written, before best.pt)
    REL_SIGNAL  KILL, TERM or INT

Usage: python -m tests.workers.interrupted_train TRAIN_FLAGS...
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import time
from pathlib import Path

import torch

import train
from train_utils import checkpoint, memory_format, reporting, rounds, trainer
from train_utils.evaluation.options import EvalOptions


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _park(park_s: float) -> None:
    """Wait up to ``park_s`` seconds for the test's signal. SIGINT and SIGTERM end the wait with
    their exception; SIGUSR1 only asks the run to stop (its handler returns), so the wait ends
    once the run's own handler has seen it, instead of sleeping out the rest."""
    came: list[int] = []
    own = signal.getsignal(signal.SIGUSR1)

    def note_and_pass_on(signum: int, frame: object) -> None:
        came.append(signum)
        if callable(own):
            own(signum, frame)

    signal.signal(signal.SIGUSR1, note_and_pass_on)
    try:
        deadline = time.monotonic() + park_s
        while not came and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, own)


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
                    _park(park_s)
                yield batch

    def train_one_epoch(*args, **kwargs):
        if args[2] == epoch_to_stop:  # (state, loader, epoch, opts)
            args = (args[0], ParkAfterFirstBatch(args[1]), *args[2:])
        return real_train(*args, **kwargs)

    trainer.train_one_epoch = train_one_epoch


def _park_in_timing(marker: Path, park_s: float) -> None:
    """Instead of timing the train-step variants, wait for the test's signal."""

    def time_variants(*args, **kwargs):
        marker.write_text("timing")
        _park(park_s)
        raise AssertionError("the test's signal never came")

    memory_format.time_variants = time_variants


def _kill_in_eval(marker: Path) -> None:
    """The model has run on the first validation batch; die before its NMS."""

    def nms(*args, **kwargs):
        marker.write_text("in eval")
        _die()

    EvalOptions.nms = nms


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


def _signal_at_write(marker: Path, write: str, epoch: int, signum: int) -> None:
    """At the epoch-end ``write`` of ``epoch``, send ``signum`` to this process once. A signal
    Python handles (TERM, INT) arrives while the write's temporary file is open and the write
    then goes on, as a signal from outside could."""
    current = {"epoch": None}  # the epoch of the write in progress

    def hit() -> None:
        if marker.exists():
            return
        marker.write_text(f"{write} of epoch {epoch}")
        if signum == signal.SIGKILL:
            _die()
        os.kill(os.getpid(), signum)
        time.sleep(0.1)  # the handler runs here, at the latest

    def watch(module) -> None:
        real = module.atomic_write

        @contextlib.contextmanager
        def atomic_write(path, *args, **kwargs):
            with real(path, *args, **kwargs) as f:
                if Path(path).name == write and current["epoch"] == epoch:
                    hit()
                yield f

        module.atomic_write = atomic_write

    watch(reporting)  # results.csv
    watch(checkpoint)  # last.pt, best.pt
    real_save, real_write_results = rounds.save_checkpoint, reporting.write_results

    def save_checkpoint(obj, path, *args):
        current["epoch"] = obj["epoch"]
        real_save(obj, path, *args)
        if write == "between" and Path(path).name == "last.pt" and obj["epoch"] == epoch:
            hit()

    def write_results(path, rows):
        # The reporter rewrites results.csv at start-up too: only its row of `epoch` counts.
        current["epoch"] = max((int(r["epoch"]) for r in rows), default=None)
        real_write_results(path, rows)

    rounds.save_checkpoint = save_checkpoint
    reporting.write_results = write_results


def main(argv: list[str] | None = None) -> int:
    # Python's own Ctrl-C handler even when this process was started with SIGINT ignored (as
    # non-interactive shells start background jobs), so that the test's SIGINT is a Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    point = os.environ["REL_POINT"]
    marker = Path(os.environ["REL_MARKER"])
    if point == "park-mid-epoch":
        _park_mid_epoch(marker, int(os.environ["REL_EPOCH"]), float(os.environ["REL_PARK_S"]))
    elif point == "park-in-timing":
        _park_in_timing(marker, float(os.environ["REL_PARK_S"]))
    elif point == "kill-in-eval":
        _kill_in_eval(marker)
    elif point == "kill-in-save":
        _kill_in_save(marker)
    elif point == "signal-at-write":
        signum = getattr(signal, "SIG" + os.environ["REL_SIGNAL"])
        _signal_at_write(marker, os.environ["REL_WRITE"], int(os.environ["REL_EPOCH"]), signum)
    return train.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
