"""What a training run records, and only on rank 0: the run folder's files, one results.csv row
and TensorBoard scalars per epoch, results.png, the epoch's log line, the evaluation report
(per-class table, ``per_class.csv`` and pictures) and the first training batches.

The reporter only records what the trainer hands it: the best mAP, the checkpoints and every
decision stay in :mod:`train_utils.trainer`. The trainer calls the same methods on every rank;
:func:`make_reporter` gives the other ranks a :class:`SilentReporter` whose methods do nothing,
so the loop has no rank branches.
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from build_utils.atomic import atomic_write, reported_write
from build_utils.safe_yaml import dump_yaml
from train_utils.checkpoint import to_plain
from train_utils.engine import EpochStats
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.evaluation.plots import save_figure
from train_utils.evaluation.report import write_eval_report
from train_utils.run_pictures import plot_first_batches

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
    "elapsed_seconds",  # since the run started (earlier attempts of a resumed run included)
]


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
        w = csv.DictWriter(f, fieldnames=RESULTS_HEADER)
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
        with reported_write(out / name, OUTPUT_FLAG), atomic_write(out / name, "w") as f:
            f.write(text)


class EpochReporter:
    """Rank 0's record of a run in ``out``.

    Args:
        out: the run folder.
        start_epoch: the first epoch this process runs; rows of later epochs left in
            ``results.csv`` by an interrupted attempt are dropped, as that work is redone.
    """

    def __init__(self, out: Path, start_epoch: int):
        self.out = out
        self.results = out / "results.csv"
        write_results(
            self.results, [r for r in read_results(self.results) if int(r["epoch"]) < start_epoch]
        )
        with reported_write(out, OUTPUT_FLAG, folder=True):
            self.writer = SummaryWriter(str(out))

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
        if val is not None:
            row = {
                "epoch": epoch,
                **val,
                **stats.as_dict(),
                "lr": stats.lr,
                "train_seconds": round(seconds, 3),
                "elapsed_seconds": round(elapsed, 1),
            }
            self._append_row(epoch, row, val)
        self._log_epoch(f"epoch {epoch}/{total_epochs - 1}", stats, val, seconds)
        for k, v in stats.as_dict().items():
            self.writer.add_scalar(f"train/{k}", v, epoch)
        self.writer.add_scalar("train/lr", stats.lr, epoch)
        # TensorBoard writes in a thread and raises its failure at the next flush.
        with reported_write(self.out, OUTPUT_FLAG, folder=True):
            self.writer.flush()

    def watch_batches(self, loader: Any, epoch: int, names: Sequence[str]) -> Any:
        """``loader``, drawing its first batches to ``train_batch*.jpg`` in epoch 0."""
        return plot_first_batches(loader, self.out, names, epoch == 0)

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
            write_eval_report(self.out, coco_gt, detections, names, coco_ap)
        except Exception as e:  # pictures are a convenience; training goes on without them
            logger.warning("could not write the evaluation pictures in %s: %s", self.out, e)
            return
        logger.info(
            "evaluation pictures and per_class.csv in %s (%.1f s)", self.out, time.time() - t0
        )

    def _append_row(self, epoch: int, row: Mapping[str, Any], val: Mapping[str, float]) -> None:
        write_results(self.results, [*read_results(self.results), row])
        plot_results(self.results, self.out / "results.png")
        for k, v in val.items():
            self.writer.add_scalar(f"val/{k}", v, epoch)

    @staticmethod
    def _log_epoch(
        where: str, stats: EpochStats, val: Mapping[str, float] | None, s: float
    ) -> None:
        """One line for the epoch ``where`` ("epoch 3/9"), ``s`` seconds of training."""
        if val is None:
            logger.info("%s: loss %.4f, lr %.3g, %.1f s", where, stats.loss, stats.lr, s)
            return
        logger.info(
            "%s: loss %.4f (box %.4f obj %.4f cls %.4f), lr %.3g, %.1f s | "
            "mAP@0.5:0.95 %.4f mAP@0.5 %.4f",
            where,
            stats.loss,
            stats.box_loss,
            stats.obj_loss,
            stats.cls_loss,
            stats.lr,
            s,
            val["mAP50-95"],
            val["mAP50"],
        )

    def stopped_early(self, epoch: int, best_epoch: int | None, patience: int) -> None:
        """``--patience`` ended the run after ``epoch`` (the best was ``best_epoch``)."""
        logger.info(
            "--patience %d: no better mAP@0.5:0.95 since epoch %s; stopping after epoch %d",
            patience,
            best_epoch,
            epoch,
        )

    def interrupted(self, epoch: int, unfinished_saved: bool = False) -> None:
        """Ctrl-C/SIGTERM: say how to continue (or that nothing could be saved).
        ``unfinished_saved``: no epoch was completed, and last.pt holds the part-trained
        weights of ``epoch``."""
        last = self.out / "last.pt"
        if not last.is_file():
            logger.warning("interrupted in epoch %d; nothing is saved in %s", epoch, self.out)
            return
        if unfinished_saved:
            logger.warning(
                "interrupted in epoch %d before any epoch completed; its part-trained weights "
                "are saved in %s; continue with --resume (epoch %d is trained again from them)",
                epoch,
                last,
                epoch,
            )
            return
        logger.warning(
            "interrupted in epoch %d; last completed epoch is saved in %s; continue with --resume",
            epoch,
            last,
        )

    def stopped_on_request(self, why: str) -> None:
        """A stop request (SIGUSR1) ended the run between two batches; ``why`` says where."""
        logger.warning("stopped: %s", why)

    def finished(self, seconds: float, epochs_run: int, best: float | None) -> None:
        """The run's last line: ``best`` is the best mAP@0.5:0.95 (None: never evaluated). It
        names only the checkpoints that exist (no best.pt with --no-savebest or no evaluation)."""
        weights = [str(p) for p in (self.out / "last.pt", self.out / "best.pt") if p.is_file()]
        logger.info(
            "done: %d epochs in %.1f min | best mAP@0.5:0.95 %s | results %s | weights %s",
            epochs_run,
            seconds / 60,
            "-" if best is None else f"{best:.4f}",
            self.results,
            ", ".join(weights) or "none",
        )

    def close(self) -> None:
        """Flush and close TensorBoard's file; a failure is a warning, as this runs while the
        run ends, often with an error of its own that it must not hide."""
        try:
            self.writer.close()
        except OSError as e:
            logger.warning("could not finish the TensorBoard file in %s: %s", self.out, e)


class SilentReporter:
    """The reporter of ranks other than 0: records nothing (only the interruption is logged,
    as a warning, which other ranks still show)."""

    def end_epoch(self, *args: Any) -> None:
        pass

    def watch_batches(self, loader: Any, *args: Any) -> Any:
        return loader

    def evaluated(self, *args: Any) -> None:
        pass

    def stopped_early(self, *args: Any) -> None:
        pass

    def interrupted(self, epoch: int, unfinished_saved: bool = False) -> None:
        logger.warning("interrupted in epoch %d", epoch)

    def stopped_on_request(self, *args: Any) -> None:
        pass

    def finished(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


def make_reporter(is_main: bool, out: Path, start_epoch: int) -> EpochReporter | SilentReporter:
    """``EpochReporter(out, start_epoch)`` on rank 0, a :class:`SilentReporter` elsewhere."""
    if is_main:
        return EpochReporter(out, start_epoch)
    return SilentReporter()
