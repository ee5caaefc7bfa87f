"""How a training run reacts to signals: Ctrl-C and SIGTERM stop it (except while an epoch's
files are written, when they wait for the writes), SIGUSR1 only asks it to stop at the next safe
point (the trainer's ``_StopPoints``, agreed by every rank)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

# A scheduler's "time is nearly up" warning (SLURM ``--signal=USR1@120``); absent on Windows.
STOP_SIGNAL = getattr(signal, "SIGUSR1", None)


class StopSignals:
    """How the run reacts to signals while it trains.

    SIGINT (Ctrl-C) and SIGTERM (torchrun, schedulers, ``kill``) raise KeyboardInterrupt at
    once, so the run stops and says how to resume, except inside :meth:`deferred` (the writes
    of an epoch's end), where they wait until those are done: a signal never leaves
    ``results.csv``, ``last.pt`` and ``best.pt`` disagreeing. SIGUSR1 only asks for a stop,
    which :class:`_StopPoints` acts on between two batches, agreed by every rank.
    """

    def __init__(self) -> None:
        self.stop_requested = False
        self._deferring = False
        self._pending: int | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == STOP_SIGNAL:
            self.stop_requested = True
        elif self._deferring:
            self._pending = signum
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """SIGINT/SIGTERM arriving inside wait for its end (then raise KeyboardInterrupt)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            logger.warning(
                "signal %d received during the epoch's writes: stopping after them", self._pending
            )
            self._pending = None
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handle the signals while inside (only the main thread can set handlers). SIGINT is
        taken over only from Python's own Ctrl-C handler (a shell may have set it to ignore)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = [signal.SIGTERM, STOP_SIGNAL]
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            wanted.append(signal.SIGINT)
        previous = {s: signal.signal(s, self._handle) for s in wanted if s is not None}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
