"""How a training run reacts to signals: Ctrl-C and SIGTERM stop it (except while an epoch's
files are written, when they wait for the writes), SIGUSR1 only asks it to stop at the next safe
point (:class:`StopPoints`, agreed by every rank). A Ctrl-C is also remembered, so that one
Python swallowed still stops the run at the next safe point."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from build_utils.errors import RunStopped
from train_utils.distributed.comm import all_reduce_flag
from train_utils.distributed.process_group import DistInfo
from train_utils.run_folder import resume_command

logger = logging.getLogger(__name__)

# A scheduler's "time is nearly up" warning (SLURM ``--signal=USR1@120``); absent on Windows.
STOP_SIGNAL = getattr(signal, "SIGUSR1", None)

# Under DDP a stop request (SIGUSR1) is agreed by a collective every this many batches (one
# process checks every batch): a tiny all-reduce, but also a host sync that CUDA would rather
# skip. A scheduler's warning (``--signal=USR1@120``) leaves minutes, far more than 10 batches.
STOP_POLL_BATCHES = 10


class StopSignals:
    """How the run reacts to signals while it trains.

    SIGINT (Ctrl-C) and SIGTERM (torchrun, schedulers, ``kill``) raise KeyboardInterrupt at
    once, so the run stops and says how to resume, except inside :meth:`deferred` (the writes
    of an epoch's end), where they wait until those are done: a signal never leaves
    ``results.csv``, ``last.pt`` and ``best.pt`` disagreeing. SIGUSR1 only asks for a stop,
    which :class:`StopPoints` acts on between two batches, agreed by every rank.

    ``interrupted`` keeps the SIGINT/SIGTERM that raised: a KeyboardInterrupt raised while
    Python runs a ``__del__`` or weakref callback is printed as "Exception ignored" and lost
    (seen once in three Ctrl-Cs of an ``--evolve`` search, which then ran to its end), so the
    next stop point raises it again (:meth:`raise_if_interrupted`).
    """

    def __init__(self) -> None:
        self.stop_requested = False
        self.interrupted: int | None = None
        self._deferring = False
        self._pending: int | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == STOP_SIGNAL:
            self.stop_requested = True
        elif self._deferring:
            self._pending = signum
        else:
            self.interrupted = signum
            raise KeyboardInterrupt

    def raise_if_interrupted(self) -> None:
        """KeyboardInterrupt again where a SIGINT/SIGTERM was received (and maybe swallowed)."""
        if self.interrupted is not None:
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
                "signal %d received during writes that must finish: stopping after them",
                self._pending,
            )
            self.interrupted, self._pending = self._pending, None
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
        previous_hook = sys.unraisablehook

        def quiet_interrupts(unraisable: Any) -> None:
            # A KeyboardInterrupt raised inside a __del__ or weakref callback: kept in
            # self.interrupted and raised again at the next stop point, not printed as a
            # traceback after the run's "interrupted" line.
            if not isinstance(unraisable.exc_value, KeyboardInterrupt):
                previous_hook(unraisable)

        sys.unraisablehook = quiet_interrupts
        try:
            yield
        finally:
            sys.unraisablehook = previous_hook
            for s, handler in previous.items():
                signal.signal(s, handler)


class StopPoints:
    """The epoch's ``loader``, checking for a stop request before each batch (every
    :data:`STOP_POLL_BATCHES` under DDP, where every rank must check at the same batches).

    Stopping mid-epoch keeps the last finished epoch's ``last.pt`` as it is: a mid-epoch state
    could not be resumed exactly, so the epoch in progress is trained again after ``--resume``.
    ``where`` names what is running and what ``last.pt`` holds (default: epoch ``epoch`` and
    the one before; ``--recipe darknet``: its iterations).
    """

    def __init__(
        self,
        loader: Any,
        signals: StopSignals,
        epoch: int,
        dist: DistInfo,
        last: Path,
        where: tuple[str, str] | None = None,
    ) -> None:
        self.loader, self.signals, self.epoch, self.last = loader, signals, epoch, last
        self.poll = STOP_POLL_BATCHES if dist.distributed else 1
        self.running, self.saved = where or (f"epoch {epoch}", f"epoch {epoch - 1}")

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        n = len(self.loader)
        for i, batch in enumerate(self.loader):
            asked = self.signals.stop_requested or self.signals.interrupted is not None
            # Collective: every rank stops at the same batch when any rank was asked (srun
            # signals every task; a signal forwarded by hand may reach only some), or holds a
            # Ctrl-C that Python swallowed: that rank raises it, the others stop as asked.
            if i % self.poll == 0 and all_reduce_flag(asked):
                self.signals.raise_if_interrupted()
                raise RunStopped(
                    f"SIGUSR1 (stop requested) in {self.running} before batch {i}/{n}: "
                    f"{self.saved} is the last in {self.last}; continue with "
                    f"{resume_command(self.last)} "
                    f"({self.running} will be trained again)"
                )
            yield batch
