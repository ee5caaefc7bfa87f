"""Where a run is and how long it trains: the loop's progress (:class:`LoopState`), ``--epochs``
or as many epochs as fit ``--time-budget``, and when ``--patience`` ends it early. Both save and
check their own part of a checkpoint (``state_dict``, ``check_state``, ``load_state_dict``).

With a time budget the epoch count is estimated after every epoch from the measured time of
training epochs and evaluations, and the cosine schedule (:func:`train_utils.optim.
build_scheduler` reads :attr:`EpochPlan.epochs`) is stretched or shrunk to end at the planned
last epoch, which is always evaluated. The budget counts from the start of
:func:`train_utils.trainer.run` (set-up and caching included) and, on ``--resume``, continues
from what the checkpoint had spent.

Everything here is a pure decision and calls no collective: under DDP the trainer asks rank 0
(whose clock and mAP decide) and broadcasts the answer at the call site, so that all ranks stop
after the same epoch and a reader sees every collective there.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from build_utils.checks import is_int, is_real
from train_utils.checkpoint import MAX_EPOCH, bad_value, damaged, record_int, record_real

logger = logging.getLogger(__name__)

FITNESS_KEY = "mAP50-95"  # the COCO stat that best.pt and --patience go by


@dataclass
class LoopState:
    """What the trainer carries from epoch to epoch (the checkpoint keeps it for ``--resume``).

    Only rank 0 gets evaluation stats, so only rank 0's ``best`` moves; other ranks keep the
    resumed values and follow rank 0's broadcast decisions.

    Attributes:
        epoch: the epoch running, or the last one run (``start_epoch - 1`` before the first).
        best: the best :data:`FITNESS_KEY` so far, None before any evaluation.
        best_epoch: the epoch of ``best``.
        last_stats: the last evaluation's COCO stats by name.
        saved_epoch: the epoch this run last wrote to ``last.pt`` (None: none yet).
    """

    epoch: int
    best: float | None = None
    best_epoch: int | None = None
    last_stats: dict[str, float] | None = None
    saved_epoch: int | None = None  # the epoch last.pt holds, once this run has written it

    def update(self, epoch: int, val: dict[str, float] | None) -> bool:
        """Take ``epoch``'s evaluation (``val`` None: not evaluated here); whether it is the new
        best. A tie is not better, so ``best.pt`` and ``--patience`` keep the earlier epoch."""
        if val is None:
            return False
        self.last_stats = val
        is_best = self.best is None or val[FITNESS_KEY] > self.best
        if is_best:
            self.best, self.best_epoch = val[FITNESS_KEY], epoch
        return is_best

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint's ``epoch`` (the last finished), ``best_fitness`` and ``best_epoch``."""
        return {"epoch": self.epoch, "best_fitness": self.best, "best_epoch": self.best_epoch}

    @staticmethod
    def check_state(ckpt: Mapping[str, Any], path: str | Path | None = None) -> None:
        """The checkpoint's loop values are integers and finite numbers in range (that it has an
        ``epoch`` at all, :func:`train_utils.resume.check_training_state` checks first)."""
        record_int(ckpt, "epoch", -1, MAX_EPOCH, path)
        record_int(ckpt, "best_epoch", -1, MAX_EPOCH, path)
        record_real(ckpt, "best_fitness", path)

    @classmethod
    def from_checkpoint(cls, ckpt: Mapping[str, Any], path: str | Path | None = None) -> LoopState:
        """The loop as a checkpoint left it (``resume.check_resumable`` checked it)."""
        epoch, best = int(ckpt["epoch"]), record_real(ckpt, "best_fitness", path)
        best_epoch = ckpt.get("best_epoch")
        if best_epoch is None and best is not None:
            best_epoch = epoch  # checkpoints without it: patience counts from here
        return cls(epoch, best, best_epoch)


# Epoch-time estimate: the median of the last few epochs, so that one slow epoch (a busy
# machine, a cache filling) neither shortens the plan nor makes the schedule jump.
RECENT_EPOCHS = 5


def evaluated(epoch: int, total: int, eval_interval: int, notest: bool) -> bool:
    """The final epoch always; others every ``eval_interval`` epochs unless ``notest``."""
    return epoch == total - 1 or (not notest and (epoch + 1) % eval_interval == 0)


def epochs_within_budget(
    epoch: int,
    remaining_s: float,
    epoch_s: float,
    eval_s: float,
    eval_interval: int = 1,
    notest: bool = False,
    max_epochs: int | None = None,
) -> int:
    """The largest total epoch count whose rest fits ``remaining_s``, counted after training
    epoch ``epoch`` (but before evaluating it).

    The cost of a total ``T`` is ``epoch_s`` for each epoch after ``epoch`` up to ``T - 1`` and
    ``eval_s`` for each evaluation from ``epoch`` on (:func:`evaluated` under ``T``: the last
    epoch always). At least ``epoch + 1`` (stop now), at most ``max_epochs``.
    """

    def cost(total: int) -> float:
        # Interval evaluations among epochs epoch .. total - 2, then the final one.
        periodic = 0 if notest else (total - 1) // eval_interval - epoch // eval_interval
        return (total - 1 - epoch) * epoch_s + (periodic + 1) * eval_s

    # The cost grows with the total, so the largest total that fits is found by bisection: a
    # budget of years over second-long epochs is billions of totals (a loop over them hung).
    best = epoch + 1
    limit = epoch + 2 + int(remaining_s / max(epoch_s, 1e-9))
    if max_epochs is not None:
        limit = min(limit, max_epochs)
    lo, hi = epoch + 2, limit  # the answer is best, or a total in lo..hi
    while lo <= hi:
        mid = (lo + hi) // 2
        if cost(mid) > remaining_s:
            hi = mid - 1
        else:
            best, lo = mid, mid + 1
    return best if max_epochs is None else min(best, max_epochs)


@dataclass
class EpochPlan:
    """The planned number of epochs of a run, its time budget and its early stop.

    Attributes:
        epochs: planned total epochs (fixed without a budget; with one, a first guess until the
            first epoch has been timed).
        budget_s: ``--time-budget`` in seconds, or None.
        spent_before_s: budget seconds spent by the attempts before a resume.
        eval_interval, notest: ``--eval-interval`` / ``--notest``.
        patience: ``--patience`` (epochs without a better mAP@0.5:0.95 before stopping), or 0.
        eval_share: validation images / training images, for guessing the evaluation's time
            before the first one was timed.
    """

    epochs: int
    budget_s: float | None = None
    spent_before_s: float = 0.0
    eval_interval: int = 1
    notest: bool = False
    patience: int = 0
    eval_share: float = 0.2
    max_epochs: int | None = None
    started: float = field(default_factory=time.time)
    epoch_s: list[float] = field(default_factory=list)
    eval_s: float | None = None

    def spent(self) -> float:
        """Budget seconds used so far, resumed attempts included."""
        return self.spent_before_s + time.time() - self.started

    def evaluates(self, epoch: int) -> bool:
        return evaluated(epoch, self.epochs, self.eval_interval, self.notest)

    def budget_epochs(self, epoch: int, seconds: float, spent_s: float) -> int:
        """The total epochs that fit ``--time-budget`` after training ``epoch`` (``seconds`` of
        training) and before evaluating it, with ``spent_s`` of the budget used (:meth:`spent`).
        Only meaningful with a budget; the caller stores the answer in :attr:`epochs`."""
        assert self.budget_s is not None, "budget_epochs needs a --time-budget"
        epoch_s = statistics.median([*self.epoch_s[-(RECENT_EPOCHS - 1) :], seconds])
        return self._epochs_fitting(epoch, self.budget_s - spent_s, epoch_s)

    def after_epoch(self, wall_s: float, eval_s: float | None) -> None:
        """Record an epoch's wall time (evaluation excluded) and its evaluation's time."""
        self.epoch_s.append(wall_s)
        if eval_s is not None:
            self.eval_s = eval_s

    def out_of_patience(self, epoch: int, best_epoch: int | None) -> bool:
        """``--patience``: whether ``epoch`` ends the run because mAP@0.5:0.95 has not improved
        since ``best_epoch`` (None: nothing evaluated yet) for ``patience`` epochs; never
        without ``--patience``."""
        return self.patience > 0 and best_epoch is not None and epoch - best_epoch >= self.patience

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run continues the same budget: the plan, the
        seconds spent, and the recent epoch and evaluation times the plan was made from."""
        return {
            "planned_epochs": self.epochs,
            "budget_spent_s": round(self.spent(), 3),
            "epoch_seconds": [round(t, 3) for t in self.epoch_s[-RECENT_EPOCHS:]],
            "eval_seconds": None if self.eval_s is None else round(self.eval_s, 3),
        }

    @staticmethod
    def check_state(ckpt: Mapping[str, Any], path: str | Path | None = None) -> None:
        """The checkpoint's plan values are an epoch count and seconds, in range."""
        record_int(ckpt, "planned_epochs", 1, MAX_EPOCH, path)
        record_real(ckpt, "budget_spent_s", path, lo=0.0)
        record_real(ckpt, "eval_seconds", path, lo=0.0)
        times = ckpt.get("epoch_seconds")
        if times is not None and not (
            isinstance(times, list) and all(is_real(t) and t >= 0 for t in times)
        ):
            raise damaged(bad_value("epoch_seconds", times) + " must be seconds", path)

    def load_state_dict(self, ckpt: Mapping[str, Any], start_epoch: int) -> None:
        """Continue a checkpoint's ``--time-budget`` from ``start_epoch``: what it had spent,
        planned and measured (0 s spent when it had no budget). A run that had spent its budget
        stops. Given another budget (or more time after it finished) the run is planned anew
        now, from the epoch times it measured, so that its first resumed epoch already follows
        the new plan's schedule (a checkpoint without times: one more epoch, re-planned after
        it). Without a budget the plan is this run's ``--epochs``."""
        if self.budget_s is None:
            return
        self.spent_before_s = float(ckpt.get("budget_spent_s") or 0.0)
        self.epochs = int(ckpt.get("planned_epochs") or self.epochs)
        self.epoch_s = [float(t) for t in ckpt.get("epoch_seconds") or []]
        if ckpt.get("eval_seconds") is not None:
            self.eval_s = float(ckpt["eval_seconds"])
        saved = ckpt.get("config") or {}
        saved_budget_s = (saved.get("time_budget") or 0) * 60.0
        finished = start_epoch >= self.epochs
        # Stopped by its --epochs cap, not by the budget, and given a higher cap now.
        cap = saved.get("epochs")
        more_epochs = (
            finished
            and is_int(cap)
            and start_epoch >= cap
            and (self.max_epochs is None or self.max_epochs > cap)
        )
        if self.spent_before_s >= self.budget_s or (
            finished and saved_budget_s == self.budget_s and not more_epochs
        ):
            # Spent, or stopped where its next epoch would not have fitted this same budget.
            self.epochs = start_epoch
            logger.info("the checkpoint already spent the --time-budget; nothing to do")
        elif self.epoch_s and (saved_budget_s != self.budget_s or more_epochs):
            self.epochs = self._plan_from(start_epoch)
        elif finished and (saved_budget_s < self.budget_s or more_epochs):
            self.epochs = start_epoch + 1

    def _plan_from(self, start_epoch: int) -> int:
        """The total epochs that fit what is left of the budget, training from ``start_epoch``
        at the measured epoch and evaluation times; at least one more epoch."""
        epoch_s = statistics.median(self.epoch_s[-RECENT_EPOCHS:])
        total = self._epochs_fitting(start_epoch - 1, self.budget_s - self.spent(), epoch_s)
        return max(total, start_epoch + 1)

    def _epochs_fitting(self, epoch: int, left_s: float, epoch_s: float) -> int:
        """:func:`epochs_within_budget` after ``epoch`` with ``left_s`` of the budget left, at
        ``epoch_s`` an epoch and the last evaluation's time (before any: the validation set's
        share of an epoch)."""
        eval_s = self.eval_s if self.eval_s is not None else epoch_s * self.eval_share
        return epochs_within_budget(
            epoch, left_s, epoch_s, eval_s, self.eval_interval, self.notest, self.max_epochs
        )
