"""Experiment trackers: where a run's record goes besides its folder, on rank 0 only.

One small interface (:class:`Tracker`): ``start(params)`` once, ``log_epoch(epoch, metrics)``
after every epoch (the ``results.csv`` columns by name; the COCO stats only on evaluated
epochs), ``log_files(paths)`` (the run's pictures and small text files) and
``log_weights(path)`` (``best.pt``) when the run ends, and ``finish(status)`` always
(``FINISHED``, ``KILLED`` for Ctrl-C or a stop request, ``FAILED`` for an error).
``results.csv`` and TensorBoard are the reporter's own trackers (:mod:`train_utils.reporting`);
``--tracker mlflow`` and ``--tracker wandb`` add the external ones here.

Choices made here:

- Off unless asked (``--tracker mlflow wandb``, repeatable): ultralytics switches a tracker on
  whenever its package is installed, which surprises (a W&B login prompt, runs appearing in a
  shared MLflow). :func:`check_trackers` checks the packages are installed without importing
  them; a run without ``--tracker`` imports neither.
- A tracker that fails while the run trains (its store became unwritable, a server went away) is
  a warning, once, and the run goes on without it (:class:`GuardedTracker`): the training is
  worth more than its record. One that cannot start is an error before the first epoch
  (:class:`~build_utils.errors.OutputError`, ``--tracker none`` to train without it).
- Each tracker run's id is kept in the run folder (:data:`RECORD_NAME`); ``--resume`` continues
  the same MLflow/W&B run when that file names one (an epoch that was recorded but not saved
  before a crash is recorded again at the same step).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from build_utils.atomic import write_text
from build_utils.checks import check_choice
from build_utils.errors import ConfigError, OutputError

logger = logging.getLogger(__name__)

REQUIREMENTS = "requirements-trackers.txt"
# name -> (module holding its Tracker class, class name, package that must be importable,
# what to install)
_EXTERNAL = {
    "mlflow": ("train_utils.trackers.mlflow_tracker", "MlflowTracker", "mlflow", "mlflow-skinny"),
    "wandb": ("train_utils.trackers.wandb_tracker", "WandbTracker", "wandb", "wandb"),
}
NONE = "none"  # --tracker none: no external tracker (e.g. to resume a run without its tracker)
TRACKER_CHOICES = (*_EXTERNAL, NONE)
RECORD_NAME = "trackers.json"  # in the run folder: each tracker's run id, for --resume
PICTURE_SUFFIXES = (".png", ".jpg")  # the run's pictures among the files of log_files

# Statuses of finish(), as MLflow names them.
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


class Tracker:
    """What a run records somewhere: one instance per run, on rank 0, called in this order:
    ``start`` once, ``log_epoch`` per epoch, ``log_files`` and ``log_weights`` at a normal end,
    ``finish`` always."""

    name = "tracker"

    def start(self, params: Mapping[str, Any], resume_id: str | None) -> str | None:
        """Begin (or, with ``resume_id``, continue) the run; ``params`` are the run's resolved
        arguments (``args.yaml``). Returns the id to record for a later ``--resume``."""
        return None

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """``metrics`` of ``epoch``, by ``results.csv`` column name."""

    def log_files(self, paths: Sequence[Path]) -> None:
        """The run's pictures (:data:`PICTURE_SUFFIXES`) and small text files."""

    def log_weights(self, path: Path) -> None:
        """The run's weights (``best.pt``, else ``last.pt``)."""

    def finish(self, status: str) -> None:
        """End the run with ``status`` (:data:`FINISHED`, :data:`KILLED`, :data:`FAILED`)."""


class GuardedTracker(Tracker):
    """``inner`` whose failures after it started are one warning, after which it is dropped:
    the run goes on without it."""

    def __init__(self, inner: Tracker):
        self.inner = inner
        self.name = inner.name
        self.failed = False

    def _call(self, what: str, fn: Any, *args: Any) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as e:  # a third-party store's failure must not stop the training
            self.failed = True
            logger.warning(
                "--tracker %s: %s failed (%s: %s); the run goes on without it "
                "(results.csv and TensorBoard are unaffected)",
                self.name,
                what,
                type(e).__name__,
                e,
            )

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        self._call(f"recording epoch {epoch}", self.inner.log_epoch, epoch, metrics)

    def log_files(self, paths: Sequence[Path]) -> None:
        self._call("recording the pictures", self.inner.log_files, paths)

    def log_weights(self, path: Path) -> None:
        self._call(f"recording {path.name}", self.inner.log_weights, path)

    def finish(self, status: str) -> None:
        if not self.failed:
            self._call("ending the run", self.inner.finish, status)
            return
        # Dropped after a failure: still try to end its run (an MLflow run would stay RUNNING),
        # quietly, as the failure was already reported.
        try:
            self.inner.finish(status)
        except Exception as e:  # the same broken store, most likely
            logger.debug("--tracker %s: ending the run failed too: %s", self.name, e)


def check_trackers(names: Sequence[str] | None) -> list[str]:
    """The trackers ``--tracker`` asks for, each once, in order (``none`` alone: none).

    Raises:
        ConfigError: ``none`` with others, an unknown name (a checkpoint's run), or a tracker
            whose package is not installed (naming :data:`REQUIREMENTS`).
    """
    names = list(dict.fromkeys(names or ()))
    if NONE in names:
        if len(names) > 1:
            raise ConfigError(f"--tracker none cannot be combined with {', '.join(names)}")
        return []
    for name in names:
        check_choice("--tracker", name, TRACKER_CHOICES)  # none was taken above
        package, install = _EXTERNAL[name][2], _EXTERNAL[name][3]
        # find_spec looks for the package without importing it (MLflow takes seconds to import).
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"--tracker {name} needs the {install} package, which is not installed: "
                f"pip install -r {REQUIREMENTS} (or drop --tracker {name})"
            )
    return names


def read_record(out: Path) -> dict[str, str]:
    """Tracker name -> run id recorded in ``out`` (empty when there is none or it is unreadable:
    the trackers then start new runs)."""
    path = out / RECORD_NAME
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("%s cannot be read (%s); trackers start new runs", path, e)
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: v for k, v in record.items() if isinstance(k, str) and isinstance(v, str)}


def write_record(out: Path, record: Mapping[str, str], flag: str) -> None:
    """Write ``record`` (tracker name -> run id) to ``out``/:data:`RECORD_NAME` atomically.

    Raises:
        OutputError: it cannot be written (``flag`` named the folder).
    """
    path = out / RECORD_NAME
    write_text(path, json.dumps(dict(record), indent=1), flag)


def open_trackers(
    names: Sequence[str],
    out: Path,
    params: Mapping[str, Any],
    experiment: str,
    resumed: bool,
    flag: str,
) -> list[Tracker]:
    """Start the external trackers ``names`` (checked by :func:`check_trackers`) for the run in
    ``out``: ``experiment`` groups runs (the dataset's name unless the tracker's own variable
    says otherwise), the run is named after ``out``. With ``resumed``, each continues the run
    whose id ``out`` records. Called on rank 0 only (the reporter).

    Raises:
        OutputError: a tracker cannot start, or its id cannot be recorded.
    """
    if not names:
        return []
    record = read_record(out) if resumed else {}
    started: list[Tracker] = []
    try:
        for name in names:
            module, cls, _, _ = _EXTERNAL[name]
            try:
                tracker = getattr(importlib.import_module(module), cls)(out, experiment)
                run_id = tracker.start(params, record.get(name))
            except Exception as e:  # any store's failure: one line before training starts
                # One line: SQLAlchemy's messages carry the statement and a link on more lines.
                reason = " ".join(str(e).split())
                raise OutputError(
                    f"--tracker {name} could not start ({type(e).__name__}: {reason}); fix it, "
                    f"or train without it with --tracker none"
                ) from e
            started.append(GuardedTracker(tracker))
            if run_id is not None:
                record[name] = run_id
        write_record(out, record, flag)
    except OutputError:
        for tracker in started:
            tracker.finish(FAILED)
        raise
    return started
