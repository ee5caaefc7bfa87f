"""User-facing error types.

Every problem caused by user input (a cfg, ``.data``, hyp file, CLI flag, image, label or
checkpoint) is raised as one of these. Scripts catch :class:`YoloError` in ``main()`` and turn it
into a single line on stderr with exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class YoloError(Exception):
    """Base class of errors that are the user's to fix; the message is the whole story."""

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None):
        self.message = message
        self.path = str(path) if path is not None else None
        self.line = line
        super().__init__(self.__str__())

    def __str__(self) -> str:
        if self.path is None:
            return self.message
        if self.line is None:
            return f"{self.path}: {self.message}"
        return f"{self.path}:{self.line}: {self.message}"


class ConfigError(YoloError):
    """A malformed model cfg, ``.data`` file, hyperparameter file or command-line value."""


class DatasetError(YoloError):
    """A dataset that cannot be used at all (no usable image left, missing list file, ...)."""


class CheckpointError(YoloError):
    """A weights or checkpoint file that is truncated, of the wrong kind, or for another model."""


class RunStopped(Exception):
    """A run that stopped on request (a scheduler's warning signal, SIGUSR1) at a safe point,
    with its last finished epoch saved: nothing is wrong, ``--resume`` continues it exactly.
    Not a :class:`YoloError` (no user error); scripts map it to ``EXIT_STOPPED``."""


class RankFailed(Exception):
    """A process of a distributed run died without a user error (a signal, a native crash) and
    the others were stopped. Not a :class:`YoloError`: scripts print it as one line and exit
    with status 1, as a failed process does."""


class OutputError(YoloError):
    """A file or folder the user chose cannot be written: a full disk, a read-only place, a file
    where a folder should be, or a name taken by something else. The previous file stays."""
