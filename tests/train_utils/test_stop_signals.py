"""StopSignals and StopPoints in one process: a Ctrl-C that Python swallowed (raised inside a
``__del__``, where Python prints "Exception ignored" and goes on) still stops the loop at its
next batch."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from train_utils.distributed.process_group import DistInfo
from train_utils.stop_signals import StopPoints, StopSignals


class InterruptsWhenDeleted:
    """Ctrl-C arriving while Python runs a ``__del__`` (or a weakref callback, as a helper saw in
    a real search): the KeyboardInterrupt is printed as "Exception ignored" and lost."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def swallowed(monkeypatch) -> list[type]:
    """The exceptions Python reports as "Exception ignored" (and goes on) from now on."""
    seen: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    return seen


def test_a_swallowed_ctrl_c_stops_at_the_next_batch(tmp_path: Path, monkeypatch) -> None:
    ignored = swallowed(monkeypatch)
    signals = StopSignals()
    points = StopPoints(range(6), signals, 3, DistInfo.single(torch.device("cpu")), tmp_path)
    taken = []
    with signals.installed(), pytest.raises(KeyboardInterrupt):
        for batch in points:
            taken.append(batch)
            if batch == 1:
                InterruptsWhenDeleted()  # deleted at once: Ctrl-C inside its __del__
    assert taken == [0, 1]  # was [0, 1, 2, 3, 4, 5]: the loop never heard of it
    # Not printed as "Exception ignored ... KeyboardInterrupt" (a traceback after the run's
    # "interrupted" line); other exceptions inside a __del__ still are.
    assert ignored == []
    assert signals.interrupted == signal.SIGINT
    with signals.installed():
        FailsWhenDeleted()
    assert ignored == [ValueError]
    InterruptsWhenDeleted()  # outside the run: Python's own reporting again
    assert ignored == [ValueError, KeyboardInterrupt]


class FailsWhenDeleted:
    def __del__(self) -> None:
        raise ValueError("a bug in a finaliser")


def test_a_ctrl_c_during_the_epochs_writes_waits_for_them_and_is_remembered() -> None:
    signals = StopSignals()
    written = []
    with signals.installed(), pytest.raises(KeyboardInterrupt), signals.deferred():
        signal.raise_signal(signal.SIGTERM)
        written.append("last.pt")  # the write goes on
    assert written == ["last.pt"] and signals.interrupted == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        signals.raise_if_interrupted()
    assert StopSignals().raise_if_interrupted() is None  # nothing received: nothing raised
