"""What a training run records, and only on rank 0: the run folder's files, one results.csv row
and TensorBoard scalars per epoch, results.png, the epoch's log line, the evaluation report
(per-class table, ``per_class.csv`` and pictures), the first training batches, and the external
experiment trackers asked for with ``--tracker`` (:mod:`train_utils.trackers`).

``results.csv`` and TensorBoard are trackers too (:class:`ResultsCsv`, :class:`TensorBoard`):
every tracker gets the same metrics per epoch (:func:`epoch_metrics`, named as the
``results.csv`` columns). Their write failures stop the run (an :class:`OutputError`, as the
run folder is where the checkpoints go too); an external tracker's are one warning.

Each epoch's training time is split into the time the device waited for data and the rest
(compute); when waiting takes more than :data:`DATA_WAIT_WARN_SHARE` of an epoch, one warning
per run names the knobs that feed the model faster.

The reporter only records what the trainer hands it: the best mAP, the checkpoints and every
decision stay in :mod:`train_utils.trainer`. The trainer calls the same methods on every rank;
:func:`make_reporter` gives the other ranks a :class:`SilentReporter` whose methods do nothing,
so the loop has no rank branches.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.tensorboard import SummaryWriter

from build_utils.atomic import atomic_write, reported_write, write_error, write_text
from build_utils.errors import OutputError
from build_utils.safe_yaml import dump_yaml
from train_utils.checkpoint import to_plain
from train_utils.engine import EpochStats, TrainOptions
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.evaluation.plots import save_figure
from train_utils.evaluation.report import write_eval_report
from train_utils.run_pictures import plot_first_batches
from train_utils.trackers import (
    FAILED,
    FINISHED,
    KILLED,
    PICTURE_SUFFIXES,
    Tracker,
    open_trackers,
)

if TYPE_CHECKING:
    from models.darknet import Darknet
    from train_utils.config import TrainConfig
    from train_utils.data_loaders import TrainData
    from train_utils.distributed.process_group import DistInfo

logger = logging.getLogger(__name__)

OUTPUT_FLAG = "--output-dir"  # the option that chose the run folder, named in write errors

RESULTS_HEADER = [
    "epoch",
    *STAT_NAMES,
    "box_loss",
    "obj_loss",
    "cls_loss",
    "loss",
    "lr",
    "train_seconds",
    "data_wait_s",  # of train_seconds, the device waited for the loader (mean over ranks)
    "compute_s",  # train_seconds - data_wait_s
    "data_wait_share",  # data_wait_s / train_seconds
    "elapsed_seconds",  # since the run started (earlier attempts of a resumed run included)
]
# Columns that differ between two runs of the same numbers (compare rows without them).
TIMING_COLUMNS = ("train_seconds", "data_wait_s", "compute_s", "data_wait_share", "elapsed_seconds")
# Warn (once per run) when an epoch waits for data longer than this share of its training time:
# the model could train faster with a faster data pipeline. Darknet warns when loading takes
# longer than training (a share of 0.5); from 0.3 on, the knobs below already pay.
DATA_WAIT_WARN_SHARE = 0.3
RESULTS_PLOT = "results.png"  # ResultsCsv's curves
TENSORBOARD_FILES = "events.out.tfevents.*"  # the names SummaryWriter gives its files (a glob)
# The run's small text files an external tracker keeps with its pictures.
RUN_TEXT_FILES = ("results.csv", "per_class.csv", "args.yaml", "hyp.yaml", "model.cfg")


def read_results(path: Path) -> list[dict[str, str]]:
    """The rows of a ``results.csv`` (none when it does not exist)."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_results(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Replace ``results.csv`` atomically.

    Raises:
        OutputError: it cannot be written (the previous file stays as it was).
    """
    with reported_write(path, OUTPUT_FLAG), atomic_write(path, "w", newline="") as f:
        # Rows of an older results.csv lack the newer columns: they are written empty.
        w = csv.DictWriter(f, fieldnames=RESULTS_HEADER, restval="")
        w.writeheader()
        w.writerows(rows)


def plot_results(csv_path: Path, png_path: Path) -> None:
    """Loss and mAP curves from ``results.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_results(csv_path)
    if not rows:
        return
    epochs = [int(r["epoch"]) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("box_loss", "obj_loss", "cls_loss", "loss"):
        if all(r.get(key) for r in rows):  # --recipe darknet has the total only
            axes[0].plot(epochs, [float(r[key]) for r in rows], marker=".", label=key)
    axes[0].set(title="training loss", xlabel="epoch")
    axes[0].legend()
    for key in ("mAP50-95", "mAP50"):
        axes[1].plot(epochs, [float(r[key]) for r in rows], marker=".", label=key)
    axes[1].set(title="validation mAP", xlabel="epoch", ylim=(0, 1))
    axes[1].legend()
    fig.tight_layout()
    save_figure(fig, png_path)


def write_run_files(
    out: Path, args: Mapping[str, Any], hyp: Mapping[str, Any], cfg_text: str
) -> None:
    """``args.yaml`` (the resolved run config), ``hyp.yaml`` (the hyperparameters as the user
    gave them, so that ``--hyp runs/x/hyp.yaml`` reproduces the run) and ``model.cfg``, each
    atomically (a resumed run rewrites them over the previous run's).

    Raises:
        OutputError: one of them cannot be written.
    """
    texts = {
        "model.cfg": cfg_text,
        # dump_yaml quotes a string that load_yaml would read as a number ('1e6'): read back equal.
        "args.yaml": dump_yaml(to_plain(dict(args))),
        "hyp.yaml": dump_yaml(to_plain(dict(hyp))),
    }
    for name, text in texts.items():
        write_text(out / name, text, OUTPUT_FLAG)


def epoch_metrics(
    stats: EpochStats, val: Mapping[str, float] | None, seconds: float, elapsed: float
) -> dict[str, float]:
    """What every tracker records for an epoch, by ``results.csv`` column: ``val`` its COCO stats
    (None when not evaluated: then no ``results.csv`` row), ``seconds`` its training time,
    ``elapsed`` the run's time so far. Rounded as ``results.csv`` shows them, so that every
    tracker holds the same numbers."""
    wait = min(max(stats.data_wait_s, 0.0), seconds)  # another rank's mean may exceed rank 0's
    # Darknet's cost has no box/obj/cls parts (NaN): left out (an empty results.csv cell).
    losses = {k: v for k, v in stats.as_dict().items() if math.isfinite(v)}
    return {
        **(val or {}),
        **losses,
        "lr": stats.lr,
        "train_seconds": round(seconds, 3),
        "data_wait_s": round(wait, 3),
        "compute_s": round(seconds - wait, 3),
        "data_wait_share": round(wait / seconds, 4) if seconds > 0 else 0.0,
        "elapsed_seconds": round(elapsed, 1),
    }


class ResultsCsv(Tracker):
    """``results.csv`` (a row per evaluated epoch) and ``results.png``.

    Args:
        out: the run folder.
        start_epoch: the first epoch this process runs; rows of later epochs left by an
            interrupted attempt are dropped, as that work is redone. The file is rewritten
            whole, so an older run's header gains the newer columns (empty in its old rows).
        history: the ``results.csv`` of the run a ``--resume`` into a new folder continues
            (an ``epoch<E>.pt`` beside a later ``last.pt``): its rows before ``start_epoch``
            start this folder's file.
    """

    name = "results.csv"

    def __init__(
        self, out: Path, start_epoch: int, history: Path | None = None, plots: bool = True
    ):
        self.out = out
        self.plots = plots
        self.path = out / "results.csv"
        source = history if history is not None and not self.path.exists() else self.path
        write_results(self.path, [r for r in read_results(source) if int(r["epoch"]) < start_epoch])

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        if not set(STAT_NAMES) <= metrics.keys():
            return  # not evaluated: no row
        row = {"epoch": epoch, **{k: v for k, v in metrics.items() if k in RESULTS_HEADER}}
        write_results(self.path, [*read_results(self.path), row])
        if self.plots:
            plot_results(self.path, self.out / RESULTS_PLOT)


class TensorBoard(Tracker):
    """TensorBoard scalars in the run folder: ``train/`` losses and lr, ``val/`` COCO stats,
    ``time/`` the epoch's time split."""

    name = "tensorboard"

    def __init__(self, out: Path):
        self.out = out
        with reported_write(out, OUTPUT_FLAG, folder=True):
            self.writer = SummaryWriter(str(out))

    @staticmethod
    def tag(key: str) -> str:
        if key in STAT_NAMES:
            return f"val/{key}"
        if key in TIMING_COLUMNS:
            return f"time/{key}"
        return f"train/{key}"

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(self.tag(k), v, epoch)
        # TensorBoard writes in a thread and raises its failure at the next flush.
        with reported_write(self.out, OUTPUT_FLAG, folder=True):
            self.writer.flush()

    def finish(self, status: str) -> None:
        """Flush and close the file; a failure is a warning, as this runs while the run ends,
        often with an error of its own that it must not hide."""
        try:
            self.writer.close()
        except OSError as e:
            logger.warning("could not finish the TensorBoard file in %s: %s", self.out, e)


class EpochReporter:
    """Rank 0's record of a run in ``out``.

    Args:
        out: the run folder.
        start_epoch: the first epoch this process runs (see :class:`ResultsCsv`).
        trackers: the external trackers to record to (``--tracker``, checked).
        params: the run's resolved arguments, which the external trackers record.
        experiment: what groups the run in an external tracker (the dataset's name).
        resumed: a ``--resume``: external trackers continue the run the folder records.
        workers: the DataLoader workers per process, named when the data is too slow.
        history: see :class:`ResultsCsv`.
        plots: draw pictures (the first batches, results.png, the evaluation's); False is
            YOLOv5's ``--noplots`` (results.csv, per_class.csv and the logs are still written).

    Raises:
        OutputError: the run folder, or an external tracker, cannot be written.
    """

    def __init__(
        self,
        out: Path,
        start_epoch: int,
        trackers: Sequence[str] = (),
        params: Mapping[str, Any] | None = None,
        experiment: str = "",
        resumed: bool = False,
        workers: int | None = None,
        history: Path | None = None,
        plots: bool = True,
        unit: str = "epoch",
    ):
        self.out = out
        self.plots = plots
        self.unit = unit  # what the run counts: "iteration" under --recipe darknet
        self.results = out / "results.csv"
        self.workers = workers
        self.status = FAILED  # until finished() or an interruption says otherwise
        self.warned_data_wait = False
        results = ResultsCsv(out, start_epoch, history, plots)
        self.trackers: list[Tracker] = [results, TensorBoard(out)]
        try:
            self.external = open_trackers(
                trackers, out, params or {}, experiment, resumed, OUTPUT_FLAG
            )
        except OutputError:
            self.close()
            raise
        self.trackers += self.external

    def end_epoch(
        self,
        epoch: int,
        total_epochs: int,
        stats: EpochStats,
        val: Mapping[str, float] | None,
        seconds: float,
        elapsed: float = 0.0,
    ) -> None:
        """Record a finished epoch of the ``total_epochs`` now planned: ``val`` its COCO stats by
        name (None when it was not evaluated), ``seconds`` its training time, ``elapsed`` the
        run's time so far."""
        where = f"epoch {epoch}/{total_epochs - 1}"
        metrics = self._record_round(epoch, where, stats, val, seconds, elapsed)
        self._check_data_wait(epoch, metrics)

    def end_iterations(
        self,
        iteration: int,
        max_batches: int,
        stats: EpochStats,
        val: Mapping[str, float] | None,
        seconds: float,
        elapsed: float = 0.0,
    ) -> None:
        """Record the iterations of ``--recipe darknet`` up to ``iteration`` as
        :meth:`end_epoch` records an epoch: the ``results.csv`` row's ``epoch`` is the
        iteration."""
        where = f"iteration {iteration}/{max_batches}"
        self._record_round(iteration, where, stats, val, seconds, elapsed)

    def _check_data_wait(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """One warning per run when an epoch waited for data too long, naming the knobs."""
        share = metrics["data_wait_share"]
        if self.warned_data_wait or share <= DATA_WAIT_WARN_SHARE:
            return
        self.warned_data_wait = True
        now = "" if self.workers is None else f" (now {self.workers})"
        logger.warning(
            "epoch %d waited for data %.0f%% of its training time (%.1f of %.1f s): the model "
            "could train faster with a faster data pipeline: more --workers%s, --cache-images "
            "ram (or disk), a smaller --img-size, or mosaic: false in the --hyp file",
            epoch,
            100 * share,
            metrics["data_wait_s"],
            metrics["train_seconds"],
            now,
        )

    def watch_batches(self, loader: Any, epoch: int, names: Sequence[str]) -> Any:
        """``loader``, drawing its first batches to ``train_batch*.jpg`` in epoch 0."""
        return plot_first_batches(loader, self.out, names, epoch == 0 and self.plots)

    def evaluated(
        self,
        coco_gt: Any,
        detections: Sequence[dict],
        names: Sequence[str],
        coco_ap: Mapping[int, tuple[float, float]] | None,
    ) -> None:
        """The per-class table, ``per_class.csv`` and the evaluation pictures
        (:func:`write_eval_report`); a failure is a warning."""
        t0 = time.time()
        try:
            write_eval_report(self.out, coco_gt, detections, names, coco_ap, plots=self.plots)
        except Exception as e:  # pictures are a convenience; training goes on without them
            logger.warning("could not write the evaluation pictures in %s: %s", self.out, e)
            return
        what = "evaluation pictures and per_class.csv" if self.plots else "per_class.csv"
        logger.info("%s in %s (%.1f s)", what, self.out, time.time() - t0)

    def _record_round(
        self,
        step: int,
        where: str,
        stats: EpochStats,
        val: Mapping[str, float] | None,
        s: float,
        elapsed: float,
    ) -> dict[str, float]:
        """Give every tracker the metrics of round ``step`` (an epoch, or the iteration that ends
        a ``--recipe darknet`` round) and log one line for it, ``where`` ("epoch 3/9"): ``s``
        seconds of training and how long of it was spent waiting for data. Returns the metrics."""
        metrics = epoch_metrics(stats, val, s, elapsed)
        for tracker in self.trackers:
            tracker.log_epoch(step, metrics)
        wait = f"data wait {metrics['data_wait_s']:.1f} s ({100 * metrics['data_wait_share']:.0f}%)"
        parts = (stats.box_loss, stats.obj_loss, stats.cls_loss)
        loss = f"loss {stats.loss:.4f}"
        if val is not None and all(map(math.isfinite, parts)):  # Darknet's cost has no parts
            loss += " (box {:.4f} obj {:.4f} cls {:.4f})".format(*parts)
        line = f"{where}: {loss}, lr {stats.lr:.3g}, {s:.1f} s, {wait}"
        if val is not None:
            line += f" | mAP@0.5:0.95 {val['mAP50-95']:.4f} mAP@0.5 {val['mAP50']:.4f}"
        logger.info("%s", line)
        return metrics

    def stopped_early(self, epoch: int, best_epoch: int | None, patience: int) -> None:
        """``--patience`` ended the run after ``epoch`` (the best was ``best_epoch``)."""
        logger.info(
            "--patience %d: no better mAP@0.5:0.95 since epoch %s; stopping after epoch %d",
            patience,
            best_epoch,
            epoch,
        )

    def interrupted(
        self, epoch: int, unfinished_saved: bool = False, completed: bool = False
    ) -> None:
        """Ctrl-C/SIGTERM: say how to continue (or that nothing could be saved).
        ``unfinished_saved``: no epoch was completed, and last.pt holds the part-trained
        weights of ``epoch``; ``completed``: ``epoch`` itself was completed and saved (the
        signal came between two epochs)."""
        # Here, not at the top: run_folder imports this module's file names.
        from train_utils.run_folder import resume_command

        self.status = KILLED
        last = self.out / "last.pt"
        unit = self.unit
        if not last.is_file():
            logger.warning("interrupted in %s %d; nothing is saved in %s", unit, epoch, self.out)
            return
        if unfinished_saved:  # first: the start it saved counts as "completed" too
            where = (
                f"in epoch {epoch} before any epoch"
                if unit == "epoch"
                else "before the first round of iterations (--eval-iterations)"
            )
            again = f"epoch {epoch}" if unit == "epoch" else "that round"
            logger.warning(
                "interrupted %s completed; its part-trained weights are saved in %s; continue "
                "with %s (%s is trained again from them)",
                where,
                last,
                resume_command(last),
                again,
            )
        elif completed:
            logger.warning(
                "interrupted after %s %d, which is complete and saved in %s; continue with %s",
                unit,
                epoch,
                last,
                resume_command(last),
            )
        else:
            # --recipe darknet saves every --eval-iterations, not after each iteration.
            saved = "last completed epoch is saved" if unit == "epoch" else "the last round is"
            logger.warning(
                "interrupted in %s %d; %s in %s; continue with %s",
                unit,
                epoch,
                saved,
                last,
                resume_command(last),
            )

    def stopped_on_request(self, why: str) -> None:
        """A stop request (SIGUSR1) ended the run between two batches; ``why`` says where."""
        self.status = KILLED
        logger.warning("stopped: %s", why)

    def finished(
        self, seconds: float, epochs_run: int, best: float | None, in_all: int = 0
    ) -> None:
        """The run's last line: ``epochs_run`` epochs (``--recipe darknet``: iterations) of
        ``in_all`` with those before a resume, ``best`` the best mAP@0.5:0.95 (None: never
        evaluated). It
        names only the checkpoints that exist (no best.pt with --no-savebest or no evaluation).
        The external trackers get the run's pictures, text files and weights first."""
        weights = [p for p in (self.out / "last.pt", self.out / "best.pt") if p.is_file()]
        self.status = FINISHED
        if self.external:
            self._record_files(weights)
        logger.info(
            "done: %d %s%s in %.1f min | best mAP@0.5:0.95 %s | results %s | weights %s",
            epochs_run,
            f"{self.unit}s",
            f" ({in_all} in all)" if in_all > epochs_run else "",  # a resumed run's
            seconds / 60,
            "-" if best is None else f"{best:.4f}",
            self.results,
            ", ".join(map(str, weights)) or "none",
        )

    def _record_files(self, weights: Sequence[Path]) -> None:
        """Hand the external trackers the run's pictures and small text files, and its best
        weights (``last.pt`` when there is no ``best.pt``: the resume state is not sent twice)."""
        files = sorted(p for p in self.out.iterdir() if p.suffix.lower() in PICTURE_SUFFIXES)
        files += [self.out / n for n in RUN_TEXT_FILES if (self.out / n).is_file()]
        files = [p for p in files if p.is_file()]
        t0 = time.time()
        for tracker in self.external:
            tracker.log_files(files)
            if weights:
                tracker.log_weights(weights[-1])
        logger.info(
            "%s: %d files and %s recorded (%.1f s)",
            ", ".join(t.name for t in self.external),
            len(files),
            weights[-1].name if weights else "no weights",
            time.time() - t0,
        )

    def close(self) -> None:
        """End every tracker with the run's status (finished, interrupted or failed)."""
        for tracker in reversed(self.trackers):
            tracker.finish(self.status)


class SilentReporter:
    """The reporter of ranks other than 0: records nothing (only the interruption is logged,
    as a warning, which other ranks still show)."""

    def __init__(self, unit: str = "epoch"):
        self.unit = unit

    def _nothing(self, *args: Any) -> None:
        pass

    # What rank 0's reporter records, done here by nothing.
    end_epoch = end_iterations = evaluated = stopped_early = _nothing
    stopped_on_request = finished = close = _nothing

    def watch_batches(self, loader: Any, *args: Any) -> Any:
        return loader

    def interrupted(
        self, epoch: int, unfinished_saved: bool = False, completed: bool = False
    ) -> None:
        # Rank 0's words without its file: "after" when the signal came between two rounds.
        logger.warning("interrupted %s %s %d", "after" if completed else "in", self.unit, epoch)


def make_reporter(
    is_main: bool, out: Path, start_epoch: int, unit: str = "epoch", **run: Any
) -> EpochReporter | SilentReporter:
    """``EpochReporter(out, start_epoch, unit=unit, **run)`` on rank 0, a
    :class:`SilentReporter` elsewhere: other ranks write nothing and start no tracker."""
    if is_main:
        return EpochReporter(out, start_epoch, unit=unit, **run)
    return SilentReporter(unit)


# ---- train.log and the start line ----------------------------------------------------


class RunLogHandler(logging.FileHandler):
    """``train.log``. A line it cannot write (a full disk) is one warning on the console, not
    logging's traceback per line; the run goes on (its next checkpoint says whether the disk
    is full)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        self.failed = True  # before logging: the warning comes back here and must not loop
        e = sys.exc_info()[1]
        why = write_error(e, self.baseFilename) if isinstance(e, OSError) else e
        logger.warning("%s; the log goes on on the console only", why)


def run_log_handler(path: Path) -> logging.FileHandler:
    """A handler appending to ``path`` (rank 0's ``train.log``).

    Raises:
        OutputError: the file cannot be opened for writing.
    """
    with reported_write(path, OUTPUT_FLAG):
        # backslashreplace, as on the console: a file name that is not UTF-8 shows as
        # bad\udce9.jpg instead of failing the line (and with it the rest of the log).
        return RunLogHandler(path, encoding="utf-8", errors="backslashreplace")


@contextlib.contextmanager
def logging_to(handler: logging.Handler | None) -> Iterator[None]:
    """Send INFO and above to ``handler`` (None: nowhere, off rank 0), whatever the caller's
    logging set-up, and restore the root logger afterwards."""
    root = logging.getLogger()
    level = root.level
    if handler is None:
        yield
        return
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    if level > logging.INFO or level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(level)


def log_run_start(
    config: TrainConfig,
    model: Darknet,
    dist: DistInfo,
    train_data: TrainData,
    opts: TrainOptions,
    lr0: float,
) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    ms = opts.multi_scale
    logger.info(
        "model %s: %d layers, %.2fM parameters, %d classes | data: %d train / %d val images | "
        "device %s x %d process(es) | batch %d x %d accumulate (nominal %d), lr0 %.4g | "
        "img %d%s | %s | output %s",
        config.cfg,
        len(model.module_list),
        n_params / 1e6,
        config.data.nc,
        train_data.n_train,
        train_data.n_val,
        dist.device,
        dist.world_size,
        config.batch_size,
        opts.accumulate,
        config.nbs,
        lr0,
        config.img_size,
        f" (multi-scale {ms[0]}-{ms[1]})" if ms else "",
        f"{config.epochs} epochs"
        if config.time_budget is None
        else f"time budget {config.time_budget:g} min"
        + (f" (at most {config.epochs} epochs)" if config.epochs else ""),
        config.output_dir,
    )
