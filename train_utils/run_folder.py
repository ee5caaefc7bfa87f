"""Who may write a run folder: one live run at a time, and never over a previous run.

A live run holds ``<run>/run.lock`` (JSON: host, pid, start time), created with
``O_CREAT | O_EXCL`` so that of two runs started together exactly one gets it, refreshed every
:data:`HEARTBEAT_S` seconds and removed when the run ends (normally, by an exception or Ctrl-C).
A lock is stale, and taken over with a log line, when its process is gone: on this host when its
pid no longer runs; from another host (whose processes this one cannot see) when it was not
refreshed for :data:`FOREIGN_STALE_S` seconds; an earlier attempt of the same SLURM job or
torchrun rendezvous (:func:`job_id`) at once. A live lock stops the second run with one line
naming its holder.

A folder that holds a previous run (:data:`RUN_FILES`), or any other file a run writes
(:func:`is_run_write`: its pictures, ``model.cfg``, ...; perhaps the user's own), is never written
over by accident: ``--name x`` / ``--output-dir x`` then writes ``x2``, ``x3``, ... (YOLOv5's
``increment_path``), ``--resume`` continues the run in it, and ``--exist-ok`` reuses it after
moving the previous run's files into ``x/replaced-<time>/`` (nothing is deleted or mixed).

Only rank 0 calls :func:`claim_run_folder`; the trainer shares its answer with every rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from build_utils.atomic import TEMP_SUFFIX, check_new_outputs, check_output_place, write_error
from build_utils.errors import ConfigError
from build_utils.safe_yaml import load_yaml
from train_utils.evaluation.coco_gt import CACHE_FILES
from train_utils.evaluation.report import REPORT_FILES
from train_utils.reporting import RESULTS_PLOT, TENSORBOARD_FILES
from train_utils.run_pictures import LABELS_FILE, TRAIN_BATCH_FILES
from train_utils.trackers import RECORD_NAME

logger = logging.getLogger(__name__)

RUNS_DIR = Path("runs")  # where runs go when no --output-dir or --project is given
RUN_CFG_NAME = "model.cfg"  # the resolved cfg every run folder keeps (reporting.write_run_files)
RUN_HYP_NAME = "hyp.yaml"  # the hyperparameters as the run read them
LOCK_NAME = "run.lock"
RUN_ARGS_NAME = "args.yaml"  # the run's resolved arguments (reporting.write_run_files)
SEARCH_RECORD = "search.yaml"  # an --evolve search's folder (train_utils/evolve/search.py)
# A search's other files (train_utils/evolve/record.py): its rows, best hyp, plot and log.
SEARCH_WRITES = ("evolve.csv", "hyp_evolve.yaml", "evolve.png", "evolve.log")
# The files by which a folder holds a run (or a search) that must not be written over.
RUN_FILES = ("last.pt", "best.pt", "results.csv", "train.log", SEARCH_RECORD)
# Other files a run writes under fixed names or globs, as named where they are written: a folder
# holding them (a user's own model.cfg or labels.png, say: perhaps this run's --cfg) is not
# written over either.
RUN_WRITES = (
    RUN_CFG_NAME,  # with args.yaml and hyp.yaml: reporting.write_run_files
    RUN_HYP_NAME,
    RUN_ARGS_NAME,
    *REPORT_FILES,  # each evaluation's per_class.csv and pictures
    LABELS_FILE,
    *TRAIN_BATCH_FILES,
    RESULTS_PLOT,
    TENSORBOARD_FILES,
    CACHE_FILES,  # the validation set's COCO ground truth
    RECORD_NAME,  # --tracker's run ids
    *SEARCH_WRITES,
)
# The checkpoints a run writes (train_utils/rounds.save_on_main; .weights: --recipe darknet).
RUN_CHECKPOINT = re.compile(r"(last|best)\.(pt|weights)|epoch\d+\.pt")
WRITES_NAMED = 5  # a folder's files a run writes that a note names (then "and N more")
REPLACED_PREFIX = "replaced-"  # --exist-ok moves a previous run into <run>/replaced-<time>/
FAILED_PREFIX = "failed-"  # a start that failed before its first checkpoint: <run>/failed-<time>/
MOVED_PREFIXES = (REPLACED_PREFIX, FAILED_PREFIX)
HEARTBEAT_S = 60.0  # how often a live run refreshes its lock's modification time
# Another host's lock not refreshed for this long belongs to a run that is gone (ten missed
# heartbeats: a slow shared file system may delay a few, a live run never misses ten).
FOREIGN_STALE_S = 10 * HEARTBEAT_S
RUN_FOLDER_FLAGS = "--name/--output-dir"  # the options that choose a run folder, for errors
MAX_NUMBER = 9999  # x2 ... x9999, as YOLOv5's increment_path
# Default-named runs started together (a job array): each takes the next free number.
MAX_AUTO_NAME_TRIES = 5


def resume_command(last: Path) -> str:
    """The flag that continues the run whose checkpoint is ``last``: bare ``--resume`` finds
    ``runs/*/last.pt`` only (the newest), so a run elsewhere (``--project``, ``--output-dir``)
    is named by its path, and a candidate of an ``--evolve`` search by its search's folder."""
    search = last.parent.parent
    if (search / SEARCH_RECORD).is_file():
        return f"--resume {search}"
    return "--resume" if search.resolve() == RUNS_DIR.resolve() else f"--resume {last}"


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about the run holding it."""

    host: str
    pid: int
    started: str  # local time, ISO 8601
    age_s: float  # seconds since the lock was last refreshed
    job: str = ""  # the scheduler's job (see job_id), "" outside one

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"


def this_host() -> str:
    return socket.gethostname()


def job_id(env: Mapping[str, str] | None = None) -> str:
    """The job this process belongs to across its restarts: SLURM keeps ``SLURM_JOB_ID`` when it
    requeues a job, torchrun keeps ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``) when it restarts
    workers; "" when neither names one (torchrun's static default is "none")."""
    env = os.environ if env is None else env
    slurm = env.get("SLURM_JOB_ID", "")
    if slurm:
        return f"slurm:{slurm}"
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun:{elastic}" if elastic and elastic != "none" else ""


def launch_id(env: Mapping[str, str] | None = None) -> str:
    """What stays the same when torchrun restarts this run's workers: the scheduler's job
    (:func:`job_id`), else the torchrun agent that started this process (host and pid: the agent
    outlives the workers it restarts); "" outside torchrun and SLURM."""
    env = os.environ if env is None else env
    job = job_id(env)
    if job or "TORCHELASTIC_RESTART_COUNT" not in env:
        return job
    return f"torchrun-agent:{this_host()}:{os.getppid()}"


def _written_by_launch(folder: Path, launch: str) -> bool:
    """Whether the run in ``folder`` was started by ``launch`` (:func:`launch_id`, recorded in
    its ``args.yaml``)."""
    if not launch:
        return False
    try:
        # Bounded (size, aliases, tags): a hostile args.yaml is "not a run of ours".
        recorded = load_yaml(folder / RUN_ARGS_NAME, "run arguments")
    except ConfigError:
        return False
    return isinstance(recorded, dict) and recorded.get("launch") == launch


def folder_of_launch(base: Path, launch: str) -> Path | None:
    """The folder among ``base``, ``base2``, ``base3``, ... that an earlier attempt of this
    launch (:func:`launch_id`, recorded in its ``args.yaml``) wrote a ``last.pt`` into: where a
    restarted worker continues when the first attempt was numbered. None when there is none."""
    if not launch or not base.parent.is_dir():
        return None
    pattern = re.compile(re.escape(base.name) + r"\d*")
    for candidate in sorted(base.parent.iterdir()):
        if not pattern.fullmatch(candidate.name) or not (candidate / "last.pt").is_file():
            continue
        if _written_by_launch(candidate, launch):
            return candidate
    return None


def read_lock(path: Path) -> LockHolder | None:
    """The holder of the lock file ``path``; None when there is none. A lock that cannot be
    parsed (being written this instant, or damaged) is reported with pid -1."""
    try:
        text = path.read_text(encoding="utf-8")
        age = time.time() - path.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None  # no lock (a file in the folder's path is reported when it is made)
    except OSError as e:
        raise ConfigError(f"cannot read the run lock: {e.strerror}", path) from e
    try:
        info = json.loads(text)
        job = str(info.get("job", ""))
        return LockHolder(str(info["host"]), int(info["pid"]), str(info["started"]), age, job)
    except (ValueError, KeyError, TypeError):
        return LockHolder("unknown host", -1, "at an unknown time", age)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    # A killed process its parent has not reaped yet (a zombie) still answers kill(0).
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def is_stale(holder: LockHolder, host: str | None = None, job: str | None = None) -> bool:
    """Whether the run ``holder`` names is gone (see the module docstring). An earlier attempt
    of this process's own job (requeued, restarted) is gone by definition: its scheduler
    stopped it before starting this one, maybe on another node."""
    job = job_id() if job is None else job
    if job and holder.job == job:
        return True
    if holder.pid > 0 and holder.host == (host or this_host()):
        return not _pid_alive(holder.pid)
    # Another host's run, or an unreadable lock: only its heartbeat tells.
    return holder.age_s > FOREIGN_STALE_S


def run_files_in(folder: Path, names: tuple[str, ...] = RUN_FILES) -> list[str]:
    """Which of ``names`` (a previous run's files) ``folder`` holds; empty ones do not count: a
    run that stopped before logging anything leaves an empty ``train.log``."""
    found = []
    for name in names:
        try:
            if (folder / name).stat().st_size > 0:
                found.append(name)
        except FileNotFoundError:
            continue
    return found


def holds_run(folder: Path, names: tuple[str, ...] = RUN_FILES) -> bool:
    """Whether ``folder`` holds the files of a previous run (:func:`run_files_in`)."""
    return bool(run_files_in(folder, names))


def is_run_write(name: str) -> bool:
    """Whether a run writes a file called ``name`` into its folder (:data:`RUN_FILES`,
    :data:`RUN_WRITES`, :data:`RUN_CHECKPOINT`)."""
    if RUN_CHECKPOINT.fullmatch(name):
        return True
    return any(fnmatchcase(name, pattern) for pattern in RUN_FILES + RUN_WRITES)


def run_writes_in(folder: Path) -> list[str]:
    """The names of the files in ``folder`` that a run writes (:func:`is_run_write`), in the
    order of :data:`RUN_FILES` and :data:`RUN_WRITES`; empty files do not count (as in
    :func:`holds_run`). Nothing when ``folder`` cannot be listed (not there, unreadable: claiming
    it says why)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            if is_run_write(entry.name) and entry.is_file() and entry.stat().st_size > 0:
                found.append(entry.name)
        except OSError:
            continue  # gone since the listing
    patterns = RUN_FILES + RUN_WRITES

    def order(name: str) -> tuple[int, str]:
        first = next((i for i, p in enumerate(patterns) if fnmatchcase(name, p)), len(patterns))
        return first, name

    return sorted(found, key=order)


def check_not_a_run_file(path: Path, flag: str, instead: Path) -> None:
    """Refuse an output ``path`` that is a file a training run wrote (a checkpoint such as its
    resumable ``last.pt``, its ``results.csv``, ...) in a folder that holds that run by its
    other files: a finished run is never written over, not even with ``--exist-ok``
    (``--resume`` continues it). ``instead``: the output the message suggests.

    Raises:
        ConfigError: ``path`` exists and is one of the run's files.
    """
    path = Path(path)
    if not is_run_write(path.name):
        return
    # A run's log or results tell its folder (a folder of weights alone, weights/x/best.pt
    # beside its converted best.weights, is no run: --exist-ok may replace what is there).
    others = tuple(n for n in RUN_FILES if n != path.name and not RUN_CHECKPOINT.fullmatch(n))
    if path.exists() and holds_run(path.parent, others):
        raise ConfigError(
            f"{flag} {path} is a file of the training run in {path.parent}, which is never "
            f"replaced (not even with --exist-ok); choose another {flag}, e.g. {instead}"
        )


def check_new_file(
    path: Path,
    flag: str,
    exist_ok: bool,
    inputs: Mapping[str, str | os.PathLike[str] | None] | None = None,
    tag: str = "new",
) -> None:
    """The output check of a tool that writes one file ``path`` (chosen by ``flag``): never a
    training run's file (:func:`check_not_a_run_file`, not even with ``--exist-ok``; the
    message suggests ``<stem>-<tag><suffix>`` instead), then
    :func:`~build_utils.atomic.check_new_outputs` (not one of ``inputs``, writable, and not
    there unless ``exist_ok``).

    Raises:
        ConfigError: ``path`` is a run's file, an input, or exists without ``exist_ok``.
        OutputError: its place cannot be written.
    """
    path = Path(path)
    # A folder where the file goes is said as such first (was: "exists; pass --exist-ok", and
    # with --exist-ok then "is a folder").
    check_output_place(path, flag)
    check_not_a_run_file(path, flag, path.with_name(f"{path.stem}-{tag}{path.suffix}"))
    check_new_outputs([path], flag, exist_ok, inputs)


class FolderInUse(ConfigError):
    """A live run holds the run folder (its lock names it)."""


def _refusal(folder: Path, holder: LockHolder) -> FolderInUse:
    return FolderInUse(
        f"{folder} is in use by another run ({holder.describe()}); wait for it to finish or "
        f"choose another --name/--output-dir (if that run is gone, delete {folder / LOCK_NAME})"
    )


def refuse_if_in_use(folder: Path) -> None:
    """Raises :class:`FolderInUse` when a live run holds ``folder``'s lock."""
    holder = read_lock(folder / LOCK_NAME)
    if holder is not None and not is_stale(holder):
        raise _refusal(folder, holder)


def _numbered(base: Path) -> Path:
    """The first of ``base2``, ``base3``, ... that holds no run and no lock (YOLOv5's
    ``increment_path`` with an empty separator)."""
    for n in range(2, MAX_NUMBER + 1):
        candidate = base.with_name(f"{base.name}{n}")
        if not candidate.exists():
            return candidate
        free = not run_writes_in(candidate) and not (candidate / LOCK_NAME).exists()
        if candidate.is_dir() and free:
            return candidate
    raise ConfigError(f"{base}2 ... {base}{MAX_NUMBER} all hold runs; choose another --name")


@dataclass
class RunFolder:
    """A run folder this process holds the lock of; :meth:`release` gives it up.

    Attributes:
        path: the folder the run writes.
        notes: what the claim did that the run's log should say (logged by :meth:`log`, once
            ``train.log`` is open).
    """

    path: Path
    notes: list[str] = field(default_factory=list)
    moved_to: Path | None = None  # where --exist-ok moved the previous run
    # What the folder held when it was claimed: never moved by set_aside_failed_start.
    found: frozenset[str] = frozenset()
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def lock(self) -> Path:
        return self.path / LOCK_NAME

    def log(self) -> None:
        for note in self.notes:
            logger.warning(note)

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            # A missed beat only makes the lock look older to other hosts.
            with contextlib.suppress(OSError):
                os.utime(self.lock)

    def set_aside_failed_start(self, what: str = "failed") -> None:
        """After a start that failed before its first checkpoint (an empty dataset, a model that
        does not fit) or was interrupted (``what``: "was interrupted"): move what it wrote
        (train.log, args.yaml, ...) into ``failed-<time>/``,
        so that the folder holds no run, the next run of the same name writes it and nothing
        offers it to ``--resume``. Only what this start wrote moves (never what the folder held
        when it was claimed); a folder with a ``last.pt`` is a run: left as it is."""
        if (self.path / "last.pt").exists() or not holds_run(self.path):
            return
        written = [
            e
            for e in self.path.iterdir()
            if e.name not in self.found | {LOCK_NAME} and not e.name.startswith(MOVED_PREFIXES)
        ]
        if not written:
            return
        try:
            moved = _move_into(self.path, FAILED_PREFIX, written)
        except OSError as e:
            logger.warning("%s: could not move the failed start's files aside: %s", self.path, e)
            return
        logger.warning(
            "the run %s before its first checkpoint; its files are in %s, and %s is free for "
            "the next run",
            what,
            moved,
            self.path,
        )

    def release(self) -> None:
        """Remove the lock (only if it is still this process's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        holder = read_lock(self.lock)
        if holder is not None and holder.pid == os.getpid() and holder.host == this_host():
            self.lock.unlink(missing_ok=True)


def _lock_text() -> str:
    info: dict[str, Any] = {
        "host": this_host(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "job": job_id(),
    }
    return json.dumps(info) + "\n"


def _create_lock(path: Path) -> bool:
    """Create ``path`` holding this process's lock; False when it exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        try:
            os.write(fd, _lock_text().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        # A full disk: no half-written lock that would look like another run's.
        path.unlink(missing_ok=True)
        raise
    return True


def _take_over(path: Path, holder: LockHolder) -> bool:
    """Move the stale lock ``holder`` out of the way; False when another run did first."""
    aside = path.with_name(f".{LOCK_NAME}.{os.getpid()}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    # Between reading the stale lock and the rename, another run may have taken it over and
    # written its own: that one is live, so put it back.
    now = read_lock(aside)
    if now is not None and (now.host, now.pid, now.started) != (
        holder.host,
        holder.pid,
        holder.started,
    ):
        if not path.exists():
            os.rename(aside, path)
        return False
    aside.unlink(missing_ok=True)
    return True


def _acquire(folder: Path, notes: list[str]) -> None:
    lock = folder / LOCK_NAME
    for _ in range(3):  # a lost race with another taker is retried once or twice
        if _create_lock(lock):
            return
        holder = read_lock(lock)
        if holder is None:
            continue  # released in between
        if not is_stale(holder):
            raise _refusal(folder, holder)
        if _take_over(lock, holder):
            gone = holder.describe()
            notes.append(f"{lock}: taking over the lock of a run that is gone ({gone})")
    holder = read_lock(lock)
    raise _refusal(folder, holder or LockHolder("unknown host", -1, "just now", 0.0))


# build_utils.atomic.temp_path's names: ``.{name}.{pid}.{8 hex digits}.tmp``.
_TORN_WRITE = re.compile(r"\..+\.\d+\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX))


def _remove_torn_writes(folder: Path, notes: list[str]) -> None:
    """Delete the temporary files of writes a killed run left half done (SIGKILL, power loss
    during ``last.pt``): the files they would have replaced are whole. Safe only while this
    run holds the folder's lock: no other run writes here."""
    torn = [p for p in folder.iterdir() if _TORN_WRITE.fullmatch(p.name) and p.is_file()]
    for p in torn:
        with contextlib.suppress(OSError):
            p.unlink()
    if torn:
        names = ", ".join(sorted(p.name for p in torn))
        notes.append(f"{folder}: removed {len(torn)} half-written temporary file(s): {names}")


def move_previous_run(folder: Path) -> Path:
    """Move everything in ``folder`` but the lock and earlier moved runs into
    ``folder/replaced-<time>/``; that folder."""
    entries = [
        e for e in folder.iterdir() if e.name != LOCK_NAME and not e.name.startswith(MOVED_PREFIXES)
    ]
    return _move_into(folder, REPLACED_PREFIX, entries)


def _move_into(folder: Path, prefix: str, entries: list[Path]) -> Path:
    """Move ``entries`` of ``folder`` into a new ``folder/<prefix><time>/``; that folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder / f"{prefix}{stamp}"
    n = 2
    while target.exists():
        target = folder / f"{prefix}{stamp}-{n}"
        n += 1
    target.mkdir()
    for entry in sorted(entries):
        os.rename(entry, target / entry.name)
    return target


def _choose_folder(
    base: Path, resume: bool, exist_ok: bool, auto_named: bool, notes: list[str]
) -> Path:
    """``base``, or the next number when it holds a previous run (or, for a default name, a
    live one); a live run on a chosen name is refused (:class:`FolderInUse`)."""
    holder = read_lock(base / LOCK_NAME)
    live = holder is not None and not is_stale(holder)
    if live and not auto_named:
        raise _refusal(base, holder)
    if resume or exist_ok or not base.is_dir():
        return base
    written = run_writes_in(base)
    if not (live or written):
        return base
    if not live and not (base / "last.pt").exists() and _written_by_launch(base, launch_id()):
        # An earlier attempt of this job (a SLURM requeue, a torchrun restart) killed before
        # its first checkpoint (SIGKILL leaves no failed-<time>/): this attempt is that run.
        try:
            moved = _move_into(
                base, FAILED_PREFIX, [e for e in base.iterdir() if is_run_write(e.name)]
            )
        except OSError as e:  # a folder that cannot change: numbered, as any previous run
            notes.append(f"{base}: an earlier attempt's files cannot be moved aside ({e})")
        else:
            notes.append(
                f"{base}: an earlier attempt of this job ({launch_id()}) stopped before its "
                f"first checkpoint; its files are in {moved}, and this attempt writes {base}"
            )
            return base
    folder = _numbered(base)
    if live:
        why = "is in use by another run"
    elif holds_run(base):
        why = "holds a previous run (never overwritten)"
    else:
        names = ", ".join(written[:WRITES_NAMED])
        if len(written) > WRITES_NAMED:
            names += f" and {len(written) - WRITES_NAMED} more"
        why = f"holds files a run writes ({names}: never overwritten)"
    note = f"{base} {why}; this run writes {folder}"
    if not live:
        resumable = any((base / name).is_file() for name in ("last.pt", SEARCH_RECORD))
        note += f" ({f'--resume continues {base}, ' if resumable else ''}--exist-ok reuses it)"
    notes.append(note)
    return folder


def claim_run_folder(
    base: Path, resume: bool, exist_ok: bool, auto_named: bool = False
) -> RunFolder:
    """Decide the folder a run writes from the one it was given, and lock it.

    Args:
        base: ``--output-dir``, ``runs/<--name>`` or the resumed run's folder.
        resume: the run continues the run in ``base`` (``--resume``): used as it is.
        exist_ok: ``--exist-ok``: reuse ``base``, its previous run moved aside.
        auto_named: ``base`` is the default name (the start time), which the user did not
            choose: a live run there (another started in the same second, e.g. a job array)
            means the next number, not a refusal.

    Returns:
        The locked folder (created), with notes for the run's log.

    Raises:
        ConfigError: a live run holds the folder (named), or the path is a file.
        OutputError: the folder cannot be created or locked (read-only, full disk).
    """
    notes: list[str] = []
    if base.exists() and not base.is_dir():
        raise ConfigError(
            "the run folder's path is a file; choose another --name/--output-dir", base
        )
    for attempt in range(MAX_AUTO_NAME_TRIES if auto_named else 1):
        folder = _choose_folder(base, resume, exist_ok, auto_named, notes)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            found = frozenset(e.name for e in folder.iterdir())
            _acquire(folder, notes)
            break
        except FolderInUse:
            # Another run of the same default name won the race for this folder: the next one.
            if attempt + 1 >= (MAX_AUTO_NAME_TRIES if auto_named else 1):
                raise
        except OSError as e:  # a read-only place, a full disk, a file in the path
            raise write_error(e, folder, RUN_FOLDER_FLAGS, folder=True) from e
    try:
        _remove_torn_writes(folder, notes)
    except OSError as e:
        raise write_error(e, folder, RUN_FOLDER_FLAGS, folder=True) from e
    claim = RunFolder(folder, notes, found=found)
    try:
        if exist_ok and not resume and run_writes_in(folder):
            claim.moved_to = move_previous_run(folder)
            notes.append(f"--exist-ok: the previous run in {folder} was moved to {claim.moved_to}")
    except OSError as e:
        claim.release()
        raise ConfigError(
            f"--exist-ok: cannot move the previous run aside: {e.strerror or e}", folder
        ) from e
    claim.start_heartbeat()
    return claim


def relocated(path: str, claim: RunFolder) -> str:
    """``path`` as it is after ``--exist-ok`` moved the previous run aside (a ``--weights``
    inside the folder moved with it); unchanged when it was not inside the folder."""
    if not path or claim.moved_to is None:
        return path
    try:
        rel = Path(path).resolve().relative_to(claim.path.resolve())
    except ValueError:
        return path
    return str(claim.moved_to / rel)
