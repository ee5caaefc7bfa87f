"""How many intra-op threads a CPU run computes with: as many as the cores it has to itself.

PyTorch's CPU kernels run OpenMP parallel regions that end in a barrier, and OpenMP threads
spin while they wait there. When another process takes one of the cores, the thread that shares
that core runs only part of the time, every region waits for it, and the spinning siblings
burn the time it needed: a training step beside one busy process can take tens of times longer
than on the same cores idle (bench/README.md "Shared cores" has the figures, CPU named). Fewer
threads or a passive wait policy avoid the collapse but cost much on an idle machine, so neither
is a good fixed default.

:class:`ThreadController` measures instead of guessing: every :data:`CHECK_INTERVAL_S` it reads
how long each of this process's threads waited on a run queue (``/proc/self/task/*/schedstat``:
runnable, but another task had the core). Idle cores give waits of a few percent; a thread
sharing its core with another process waits about half the time. When threads wait more than
:data:`CONTENDED_SHARE` of the interval, the run drops that many threads; later it tries one
more thread again (after :data:`PROBE_FIRST_S`, doubling up to :data:`PROBE_MAX_S` each time the
try finds the cores still taken), or as soon as one of its CPUs sits idle (``/proc/stat``), so
it returns to full speed once the other process ends.

The count is fixed (no adaptation) when ``YOLO_THREADS=N`` or ``OMP_NUM_THREADS`` is set, on
CUDA, and where ``/proc`` has no scheduler statistics (macOS, Windows). A fixed count is also
what bit-for-bit reproducible CPU runs need: the convolutions' backward reductions, and so the
last bits of the weights, depend on the number of threads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from build_utils.errors import ConfigError

logger = logging.getLogger(__name__)

THREADS_ENV = "YOLO_THREADS"
CHECK_INTERVAL_S = 2.0
# Run-queue wait per second of one thread above which that thread shares its core: far above
# what idle cores give and far below a core shared with a busy process (bench/README.md).
CONTENDED_SHARE = 0.25
# Idle time of this process's CPUs per second (in cores) that counts as a free core.
FREE_CORE = 0.75
PROBE_FIRST_S = 20.0
PROBE_MAX_S = 300.0
# The most threads a fixed count may ask for: above the hardware threads of the largest
# two-socket servers (768); OpenMP would try to start every one (YOLO_THREADS=100000 ran out of
# memory in libgomp).
MAX_THREADS = 1024

Sample = dict[int, float]  # thread id -> seconds it has waited on a run queue


def read_run_queue_waits(task_dir: Path = Path("/proc/self/task")) -> Sample | None:
    """Each thread's cumulative run-queue wait in seconds, or None where Linux's scheduler
    statistics are unavailable. A thread that ended between listing and reading is left out."""
    waits: Sample = {}
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            fields = (task / "schedstat").read_text().split()
            waits[int(task.name)] = int(fields[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return waits or None


def read_idle_cpu_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """Seconds the CPUs this process may run on have been idle, or busy with niced processes
    while this one is not niced, since boot (``/proc/stat``); None where unavailable. A core
    free in this sense while threads were dropped suggests the other process is gone, and one
    more thread is tried without waiting for the next timed try (niced work yields to us, unless
    the kernel's autogroups keep it apart: then the try finds the core taken and backs off)."""
    try:
        allowed = os.sched_getaffinity(0)
        text = stat.read_text()
        niced_is_free = os.getpriority(os.PRIO_PROCESS, 0) <= 0
    except (OSError, AttributeError):
        return None
    ticks = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed:
            # user nice system idle iowait ...
            ticks += int(fields[3]) + int(fields[4]) + (int(fields[1]) if niced_is_free else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def fixed_thread_count(env: dict[str, str] | os._Environ) -> int | None:
    """The thread count the user fixed: ``YOLO_THREADS=N`` (``auto``, the default, adapts), else
    ``OMP_NUM_THREADS`` (also set by torchrun) when it is a count up to :data:`MAX_THREADS`,
    else None.

    Raises:
        ConfigError: ``YOLO_THREADS`` that is neither ``auto`` nor a positive integer, or above
            :data:`MAX_THREADS`.
    """
    # Set but empty (``YOLO_THREADS= python train.py``) is unset, as OpenMP reads its variables.
    value = env.get(THREADS_ENV, "").strip() or "auto"
    if value.lower() != "auto":
        count = thread_count(value)
        if count is None:
            raise ConfigError(f"{THREADS_ENV}={value!r}: expected auto or a positive integer")
        if count > MAX_THREADS:
            raise ConfigError(f"{THREADS_ENV}={value!r}: at most {MAX_THREADS} threads")
        return count
    count = thread_count(env.get("OMP_NUM_THREADS", ""))
    return count if count is not None and count <= MAX_THREADS else None


def thread_count(value: str) -> int | None:
    """``value`` as a thread count (ASCII digits, at least 1; ``str.isdigit`` also accepts
    ``'²'``, which ``int`` refuses), else None."""
    value = value.strip()
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        return None
    return int(value)


class ThreadController:
    """Lowers the intra-op thread count while other processes take this process's cores, and
    raises it again when they leave (see the module doc). Call :meth:`tick` once per step."""

    def __init__(
        self,
        max_threads: int,
        read_waits: Callable[[], Sample | None] = read_run_queue_waits,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
        read_idle: Callable[[], float | None] = read_idle_cpu_seconds,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._read_waits = read_waits
        self._read_idle = read_idle
        self._set_threads = set_threads
        self._clock = clock
        self._t0 = clock()
        self._waits = read_waits() or {}
        self._idle = read_idle()
        self._probe_wait = PROBE_FIRST_S
        self._next_probe = self._free_hold_until = self._t0
        self._probing = ""  # "", or why one more thread is being tried: "free" or "timed"
        self._warned = False

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadController | None:
        """A controller for training or evaluating on ``device``, or None where the count stays
        as it is (CUDA, a fixed count, no scheduler statistics, one thread). ``YOLO_THREADS=N``
        is applied here."""
        fixed = fixed_thread_count(os.environ)
        if fixed is not None:
            if fixed != torch.get_num_threads():  # YOLO_THREADS (torch read OMP_NUM_THREADS)
                torch.set_num_threads(fixed)
            return None
        if device.type != "cpu" or torch.get_num_threads() < 2:
            return None
        if read_run_queue_waits() is None:
            return None
        return cls(torch.get_num_threads())

    def tick(self) -> None:
        """Look at the last interval's run-queue waits (at most every CHECK_INTERVAL_S) and
        change the thread count if the cores are contended, or try one more thread if due."""
        now = self._clock()
        elapsed = now - self._t0
        if elapsed < CHECK_INTERVAL_S:
            return
        waits = self._read_waits()
        if waits is None:
            return
        contended = sum(
            1
            for tid, w in waits.items()
            if (w - self._waits.get(tid, 0.0)) / elapsed > CONTENDED_SHARE
        )
        idle = self._read_idle()
        free = 0.0 if idle is None or self._idle is None else (idle - self._idle) / elapsed
        self._t0, self._waits, self._idle = now, waits, idle
        if contended:
            self._on_contention(now, contended)
        elif self._probing:
            self._probing = ""  # the extra thread found a free core: keep it
            self._probe_wait = PROBE_FIRST_S
            self._next_probe = now + PROBE_FIRST_S
        elif self.threads < self.max_threads:
            # A free core is news only while it has not misled a try (see read_idle_cpu_seconds).
            if free >= FREE_CORE and now >= self._free_hold_until:
                self._probing = "free"
                self._change(self.threads + 1, "a core is free again")
            elif now >= self._next_probe:
                self._probing = "timed"
                self._change(self.threads + 1, "trying one more thread")

    def _on_contention(self, now: float, contended: int) -> None:
        if self._probing:  # the tried thread found no free core: back, and wait longer to try
            if self._probing == "free":
                self._free_hold_until = now + self._probe_wait
            self._probing = ""
            self._change(self.threads - 1, "the cores are still taken")
            self._probe_wait = min(self._probe_wait * 2, PROBE_MAX_S)
        elif self.threads > 1:
            target = max(1, self.threads - contended)
            if not self._warned:
                self._warned = True
                logger.warning(
                    "other processes are using this machine's cores: %d of %d threads waited "
                    "over %.0f%% of the time for a core; computing with %d (%s=N fixes the "
                    "count)",
                    contended,
                    self.threads,
                    CONTENDED_SHARE * 100,
                    target,
                    THREADS_ENV,
                )
            self._change(target, "contended")
        self._next_probe = now + self._probe_wait

    def _change(self, threads: int, why: str) -> None:
        threads = min(max(1, threads), self.max_threads)
        if threads != self.threads:
            logger.info("intra-op threads %d -> %d (%s)", self.threads, threads, why)
            self.threads = threads
            self._set_threads(threads)
            # The next interval starts now: its waits belong to the new count.
            self._t0, self._waits = self._clock(), self._read_waits() or {}
            self._idle = self._read_idle()


_controllers: dict[str, ThreadController | None] = {}


def adapt_threads(device: torch.device) -> None:
    """One tick of this process's :class:`ThreadController` for ``device`` (created on first
    use; the thread count is process-wide, so there is one). Cheap: a clock read between
    checks."""
    key = device.type
    if key not in _controllers:
        _controllers[key] = ThreadController.for_device(device)
    controller = _controllers[key]
    if controller is not None:
        controller.tick()
