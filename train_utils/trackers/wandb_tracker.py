"""``--tracker wandb``: the run in Weights & Biases, offline unless the user says otherwise.

Mode: ``$WANDB_MODE`` when set (``online`` after ``wandb login``), else ``offline``: nothing
leaves the machine, and ``wandb sync <run>/wandb/offline-run-*`` uploads it later. The run's
files go inside the run folder (``<run>/wandb/``). Project: ``$WANDB_PROJECT``, else the
dataset's name; run name: the run folder's name. Console capture is off (the run's own log and
progress bars stay as they are).

Records: the run's arguments as the config, every ``results.csv`` column per epoch (step =
epoch), the pictures as images at the last step, and an artifact of type ``model`` with the
weights. Imported only when the tracker is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import wandb

from train_utils.trackers import FINISHED, KILLED, PICTURE_SUFFIXES, Tracker

# wandb.finish's exit codes: 0 is a finished run; others mark it failed.
EXIT_CODES = {FINISHED: 0, KILLED: 130}


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, out: Path, experiment: str):
        self.out = out
        self.project = os.environ.get("WANDB_PROJECT") or experiment
        self.run: Any = None
        self.step = 0

    def start(self, params: Mapping[str, Any], resume_id: str | None) -> str:
        self.run = wandb.init(
            project=self.project,
            name=self.out.name,
            dir=str(self.out),
            config=dict(params),
            mode=os.environ.get("WANDB_MODE") or "offline",
            id=resume_id,
            resume="allow" if resume_id else None,
            # Several runs in one process (tests, tools) each get their own.
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        return self.run.id

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        self.step = epoch
        self.run.log({k: float(v) for k, v in metrics.items()}, step=epoch)

    def log_files(self, paths: Sequence[Path]) -> None:
        pictures = {
            f"pictures/{p.stem}": wandb.Image(str(p))
            for p in paths
            if p.suffix.lower() in PICTURE_SUFFIXES
        }
        if pictures:
            self.run.log(pictures, step=self.step)

    def log_weights(self, path: Path) -> None:
        artifact = wandb.Artifact(f"run-{self.run.id}-model", type="model")
        artifact.add_file(str(path), name=path.name)
        self.run.log_artifact(artifact, aliases=["latest", path.stem])

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODES.get(status, 1))
