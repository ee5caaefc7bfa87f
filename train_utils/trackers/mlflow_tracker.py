"""``--tracker mlflow``: the run in an MLflow store, with no server needed.

Where: ``$MLFLOW_TRACKING_URI`` when set (a server, a database; as ultralytics' callback
honours it), else a sqlite store beside the run folder, shared by the runs of that folder's
parent (the "project": ``runs/mlflow.db``, artifacts in ``runs/mlartifacts/``), the layout of
``mlflow server``'s defaults. MLflow 3 refuses its old ``./mlruns`` file store, and sqlite needs
no server; look with ``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`` (the full
``mlflow`` package). Experiment: ``$MLFLOW_EXPERIMENT_NAME``, else the dataset's name; run
name: the run folder's name.

Records: params (the run's arguments, nested ones as ``hyp.lr0``), every ``results.csv`` column
per epoch (step = epoch), the pictures and small text files under ``pictures/`` and ``run/``,
and the weights under ``weights/``. Imported only when the tracker is asked for.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from train_utils.trackers import PICTURE_SUFFIXES, Tracker

STORE_NAME = "mlflow.db"  # beside the run folder, shared by its sibling runs
ARTIFACTS_NAME = "mlartifacts"
logger = logging.getLogger(__name__)


def default_tracking_uri(out: Path) -> str:
    """The sqlite store beside the run folder ``out``."""
    return f"sqlite:///{(out.resolve().parent / STORE_NAME).as_posix()}"


def flat_params(params: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``params`` as MLflow's flat string pairs: nested mappings as ``key.sub``, values cut to
    MLflow's limit."""
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flat_params(value, f"{name}.")
        else:
            yield name, str(value)[:MAX_PARAM_VAL_LENGTH]


@contextmanager
def store_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` (the one holding our own ``mlflow.db``) while
    the store is created and the experiment looked up or made: two runs of one project started
    together would otherwise both create MLflow's tables (one fails: "duplicate column name") or
    both create the experiment. A lock on the folder itself leaves no file behind; where there
    is no ``fcntl`` (Windows) runs are not serialised."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    fd = os.open(folder, os.O_RDONLY) if fcntl is not None else None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, out: Path, experiment: str):
        self.out = out
        self.own_store = not os.environ.get("MLFLOW_TRACKING_URI")
        uri = default_tracking_uri(out) if self.own_store else os.environ["MLFLOW_TRACKING_URI"]
        with self._lock():
            self.client = MlflowClient(tracking_uri=uri)  # creates the tables of a new store
        self.experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment
        self.run_id = ""

    def _lock(self) -> Any:
        """:func:`store_lock` on the folder of a sqlite store (ours, or one the user named by
        ``sqlite:///path``); a server or another database serialises itself."""
        if self.own_store:
            return store_lock(self.out.resolve().parent)
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if uri.startswith("sqlite:///"):
            folder = Path(uri[len("sqlite:///") :]).parent
            if folder.is_dir():  # else MLflow reports the missing folder itself
                return store_lock(folder)
        return nullcontext()

    def _experiment_id(self) -> str:
        with self._lock():
            return self._find_or_create_experiment()

    def _find_or_create_experiment(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        # Our own store keeps artifacts beside it; a store the user named keeps its default.
        location = (self.out.resolve().parent / ARTIFACTS_NAME).as_uri() if self.own_store else None
        return self.client.create_experiment(self.experiment, artifact_location=location)

    def start(self, params: Mapping[str, Any], resume_id: str | None) -> str:
        if resume_id is not None and self._continue(resume_id):
            return self.run_id
        run = self.client.create_run(
            self._experiment_id(), run_name=self.out.name, tags={"run_folder": str(self.out)}
        )
        self.run_id = run.info.run_id
        pairs = [Param(k, v) for k, v in flat_params(params)]
        for i in range(0, len(pairs), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=pairs[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        return self.run_id

    def _continue(self, run_id: str) -> bool:
        """Reopen ``run_id`` (its params stay as first logged: MLflow params cannot change);
        False when this store does not hold it."""
        try:
            self.client.get_run(run_id)
        except Exception:  # MlflowException: another store, or the run was deleted
            # Said, not silent: the user looks for one run and would find two halves.
            logger.warning(
                "--tracker mlflow: the run %s this run folder recorded is not in the store %s "
                "(deleted, or another MLFLOW_TRACKING_URI); recording into a new MLflow run, "
                "which holds the epochs from here on",
                run_id,
                self.client.tracking_uri,
            )
            return False
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")
        return True

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, epoch) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_files(self, paths: Sequence[Path]) -> None:
        for path in paths:
            where = "pictures" if path.suffix.lower() in PICTURE_SUFFIXES else "run"
            self.client.log_artifact(self.run_id, str(path), artifact_path=where)

    def log_weights(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path="weights")

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
