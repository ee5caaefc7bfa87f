"""How a round of training ends, the same under both recipes: a round is an epoch, or under
``--recipe darknet`` the iterations up to the next evaluation.

After a round every rank evaluates rank 0's weights (:func:`evaluate_round`), the fitness judges
the best (:meth:`~train_utils.plan.LoopState.update`), and rank 0 writes ``last.pt``, then
``best.pt`` and ``epoch<E>.pt`` when the loop says so (:func:`save_on_main`, the checkpoint of
:func:`run_checkpoint`). The loops in :mod:`train_utils.trainer` (epochs, or Darknet's
iterations) decide when; this module says what is evaluated and what is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from build_utils.atomic import reported_write
from models.weights import save_weights
from train_utils.checkpoint import CHECKPOINT_VERSION, save_checkpoint
from train_utils.config import TrainConfig
from train_utils.data_loaders import TrainData
from train_utils.distributed.comm import broadcast_tensors_
from train_utils.distributed.process_group import DistInfo
from train_utils.engine import DarknetState, TrainOptions, TrainState, evaluate
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.evaluation.options import EvalOptions
from train_utils.plan import EpochPlan, LoopState
from train_utils.precision import precision_record
from train_utils.reporting import OUTPUT_FLAG, EpochReporter, SilentReporter


@dataclass
class Run:
    """What the loops and the checkpoints are made of, built once by the trainer."""

    config: TrainConfig
    dist: DistInfo
    state: TrainState | DarknetState
    hyp: dict[str, Any]  # the loss gains as used (scaled for classes and image size)
    cfg_text: str
    plan: EpochPlan
    train_data: TrainData
    opts: TrainOptions
    eval_opts: EvalOptions


def evaluate_round(
    run: Run, reporter: EpochReporter | SilentReporter
) -> tuple[dict[str, float] | None, float]:
    """Evaluate the EMA weights (the model's when there is no EMA) and report them; the COCO
    stats by name (None off rank 0) and the seconds it took. Every rank must call this
    (:func:`evaluate` gathers the detections to rank 0, a collective).

    Every rank evaluates rank 0's weights, those :func:`save_on_main` saves: without
    SyncBatchNorm (CPU/gloo, ``--compile``) each rank's BatchNorm running statistics follow its
    own batches, and so do its EMA's, so each shard would be scored by a different model.
    """
    t_eval = time.time()
    state, train_data = run.state, run.train_data
    model = state.ema.ema if state.ema else state.model_without_ddp
    # Rank 0's own weights are untouched (it is the source); on the other ranks the EMA only
    # serves evaluation, DDP overwrites the model's buffers with rank 0's at the next forward
    # (broadcast_buffers), and its parameters equal rank 0's already (all-reduced gradients).
    # Collective: every rank takes rank 0's evaluated weights and BatchNorm statistics.
    broadcast_tensors_(list(model.state_dict().values()))
    coco_stats, coco_ap, detections = evaluate(
        model,
        train_data.val_loader,
        train_data.coco_gt,
        run.eval_opts,
    )
    reporter.evaluated(train_data.coco_gt, detections, run.config.data.names, coco_ap)
    val = None if coco_stats is None else dict(zip(STAT_NAMES, (float(x) for x in coco_stats)))
    return val, time.time() - t_eval


def save_on_main(
    run: Run, epoch: int, loop: LoopState, as_best: bool, periodic: bool = False
) -> None:
    """Rank 0 writes the checkpoint of ``epoch`` to ``last.pt``, then the same one to ``best.pt``
    when ``as_best`` and to ``epoch<epoch>.pt`` when ``periodic`` and ``--save-period`` asks for
    this epoch (:func:`keeps_epoch`); other ranks write nothing. Not a collective: the loop's
    ``raise_if_any_rank_failed`` after it keeps the other ranks from running ahead.

    Why last.pt first: a crash between the two leaves a ``last.pt`` that names its own epoch as
    the best and holds exactly the bytes ``best.pt`` should have, so ``--resume`` can rebuild
    ``best.pt`` from it (:func:`train_utils.resume.reconcile_best`). The other order would leave
    a ``best.pt`` ahead of ``last.pt``, right only if the replayed epoch is judged the same way
    again.

    Raises:
        OutputError: a checkpoint cannot be written (the previous one stays as it was).
    """
    if not run.dist.is_main:
        return
    ckpt = run_checkpoint(run, epoch, loop)
    out = run.config.output_dir
    save_checkpoint(ckpt, out / "last.pt", OUTPUT_FLAG)
    loop.saved_epoch = epoch
    darknet = isinstance(run.state, DarknetState)
    if darknet:
        _save_darknet_weights(run.state, epoch, out / "last.weights")
    if as_best:
        save_checkpoint(ckpt, out / "best.pt", OUTPUT_FLAG)
        if darknet:
            _save_darknet_weights(run.state, epoch, out / "best.weights")
    if periodic and keeps_epoch(epoch, run.config.save_period):
        # Last: a crash before it loses only this copy; last.pt and best.pt are whole.
        save_checkpoint(ckpt, run.config.output_dir / f"epoch{epoch}.pt", OUTPUT_FLAG)


def _save_darknet_weights(state: DarknetState, iteration: int, path: Path) -> None:
    """The model as a Darknet ``.weights`` file that Darknet itself loads, its header's
    ``seen`` the images of ``iteration`` iterations (so ``darknet detector train`` with it
    continues at the next one).

    Raises:
        OutputError: it cannot be written.
    """
    model = state.model_without_ddp
    model.seen = iteration * state.settings.update_batch
    with reported_write(path, OUTPUT_FLAG):
        save_weights(model, path)


def keeps_epoch(epoch: int, save_period: int) -> bool:
    """Whether ``--save-period`` keeps ``epoch``'s checkpoint (0-based epochs): after every
    ``save_period``-th epoch, i.e. epochs ``N-1, 2N-1, ...``; never when it is 0 or -1."""
    return save_period > 0 and (epoch + 1) % save_period == 0


def run_checkpoint(run: Run, epoch: int, loop: LoopState) -> dict[str, Any]:
    """Epoch ``epoch``'s checkpoint: the run's record, then each part's own state (tensors and
    plain types, ``weights_only`` loadable; the file layout of :mod:`train_utils.checkpoint`).

    ``model`` holds the weights to use (the EMA's when enabled), as ultralytics/yolov3's tools
    expect; ``train_model`` the raw training weights that resuming continues from. ``hyp`` is what
    the user gave, ``hyp_scaled`` the gains the loss used (scaled for classes and image size).
    """
    config, state = run.config, run.state
    model = state.model_without_ddp
    ema = state.ema
    if isinstance(state, DarknetState):
        parts = state.state_dict(epoch)  # `epoch` is the last finished iteration
    else:
        parts = {
            **(ema.state_dict() if ema is not None else {"ema": None, "ema_updates": 0}),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "scaler": None if state.scaler is None else state.scaler.state_dict(),
        }
    return {
        "version": CHECKPOINT_VERSION,
        "config": config.to_dict(),
        "hyp": config.hyp,
        "hyp_scaled": run.hyp,
        "names": list(config.data.names),
        "nc": config.data.nc,
        "cfg": run.cfg_text,
        "world_size": run.dist.world_size,
        # How this run computes, so that validation.py evaluates as it does.
        "precision": precision_record(run.eval_opts.amp, run.eval_opts.channels_last),
        "model": (ema.ema if ema is not None else model).state_dict(),
        "train_model": model.state_dict(),
        **loop.state_dict(),
        "epoch": epoch,
        **run.plan.state_dict(),
        **parts,
    }
