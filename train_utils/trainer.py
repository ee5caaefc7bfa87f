"""THE training loop, shared by ``train.py`` (one process) and ``train_multi_GPU.py`` (torchrun).

``run(config, dist)`` reads top to bottom: model, optimizer, restore, DDP wrap, data, then the
loop ``train_one_epoch`` / scheduler / ``evaluate`` / record / save. Everything that differs
between one process and DDP is decided from ``dist`` before the loop: collectives are no-ops
without a process group, and only rank 0's reporter and checkpoints write files.

The trainer owns its state: the best mAP and its epoch (:class:`LoopState`), when an epoch is
saved as the best and when the run stops; how a round (an epoch) is evaluated, judged and
written is :mod:`train_utils.rounds`, the model it starts from
:func:`~train_utils.load_model.build_training_model`. Under ``--recipe darknet`` the loop is
:func:`_train_iterations`: Darknet's iterations in rounds of ``--eval-iterations``, each round
ended as an epoch is; the recipe's parts are built by :mod:`train_utils.darknet_recipe`.
Decisions that only rank 0 can make (its clock for ``--time-budget``, its mAP for
``--patience``) are pure functions of rank 0's inputs, shared by a collective written out in
the loop (``# Collective:``), never inside a helper.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from build_utils.darknet_data import DarknetLoaderSettings
from build_utils.datasets import UnreadableImages, log_unreadable
from build_utils.errors import OutputError, RunStopped, YoloError
from models.darknet import Darknet
from models.loss import scale_loss_gains
from train_utils import resume
from train_utils.checkpoint import to_plain
from train_utils.cli import check_environment
from train_utils.config import DEFAULT_EPOCHS, TrainConfig, multi_scale_bounds
from train_utils.darknet_recipe import (
    darknet_state,
    eval_iterations,
    key_rows,
    log_default_recipe_note,
    log_key_table,
    start_iteration,
)
from train_utils.data_loaders import TrainData, build_darknet_train_data, build_train_data
from train_utils.distributed.comm import broadcast_object, raise_if_any_rank_failed
from train_utils.distributed.ddp import wrap_for_training
from train_utils.distributed.process_group import DistInfo
from train_utils.ema import ModelEMA
from train_utils.engine import (
    DarknetState,
    TrainOptions,
    TrainState,
    iterations_name,
    train_darknet_iterations,
    train_one_epoch,
)
from train_utils.evaluation.options import eval_options
from train_utils.load_model import build_training_model
from train_utils.optim import (
    accumulate_steps,
    build_optimizer,
    build_scheduler,
    scaled_lr0,
    uses_fused_optimizer,
)
from train_utils.plan import EpochPlan, LoopState
from train_utils.precision import resolve_amp
from train_utils.reporting import (
    EpochReporter,
    SilentReporter,
    log_run_start,
    logging_to,
    make_reporter,
    run_log_handler,
    write_run_files,
)
from train_utils.rounds import Run, evaluate_round, save_on_main
from train_utils.run_folder import claim_run_folder, launch_id, relocated
from train_utils.run_pictures import plot_dataset_labels
from train_utils.stop_signals import StopPoints, StopSignals
from train_utils.threads import adapt_threads

logger = logging.getLogger(__name__)

# Seeds are derived per (epoch, rank) so that a resumed run replays the same random stream.
EPOCH_SEED_STRIDE = 1000
RANK_SEED_STRIDE = 1_000_003


@dataclass
class RunSummary:
    output_dir: Path
    epochs_run: int
    best_map: float | None
    last_stats: dict[str, float] | None
    seconds: float


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run(config: TrainConfig, dist: DistInfo, signals: StopSignals | None = None) -> RunSummary:
    """Train according to ``config`` on this process's share of the work (see module docstring);
    ``signals``: a caller's (an ``--evolve`` search's), so that a Ctrl-C in the run is its too.
    SIGTERM acts as Ctrl-C from before the run folder is claimed: either leaves no lock."""
    t_start = time.time()
    # A bad YOLO_THREADS, limit or YOLO_MEMORY_AVAILABLE stops the run before it claims (and
    # leaves behind) a run folder.
    check_environment()
    signals = signals or StopSignals()
    with signals.installed():
        return _claim_and_train(config, dist, t_start, signals)


def _claim_and_train(
    config: TrainConfig, dist: DistInfo, t_start: float, signals: StopSignals
) -> RunSummary:
    claim, log_handler, error = None, None, None
    try:
        if dist.is_main:
            try:
                with signals.deferred():  # a signal mid-claim waits until the lock is held
                    claim = claim_run_folder(
                        config.output_dir,
                        resume=resume.resumes_in_place(config.resume, config.output_dir),
                        exist_ok=config.exist_ok,
                        auto_named=config.auto_named,
                    )
                log_handler = run_log_handler(claim.path / "train.log")
            except YoloError as e:
                error = e
                if claim is not None:
                    claim.release()
                    claim = None
        # Collective: a folder rank 0 may not write (a live run holds it, a full disk) stops
        # every rank with the same line, instead of leaving the others waiting in the next
        # collective.
        raise_if_any_rank_failed(error, "claiming the run folder")
        # A --weights inside a folder whose previous run --exist-ok moved aside moved with it.
        # So does a checkpoint --resume goes back to (resumes_in_place) with --exist-ok; only
        # then is rank 0's path sent (each rank reads its own --resume, see SHARED_STORAGE_HINT).
        chosen = None
        if claim is not None:
            moved = None
            if config.resume not in (None, "auto"):
                moved = relocated(config.resume, claim)
                moved = None if moved == config.resume else moved
            chosen = (str(claim.path), relocated(config.weights, claim), moved)
        # Collective: every rank writes into the folder rank 0 chose and locked (runs/x2 when
        # runs/x holds a previous run); it exists once this returns.
        folder, config.weights, moved = broadcast_object(chosen)
        config.resume = moved or config.resume
        config.output_dir = Path(folder)
        with logging_to(log_handler):
            if claim is not None:
                claim.log()
            return _train(config, dist, t_start, signals)
    except (Exception, KeyboardInterrupt) as e:  # Ctrl-C while starting leaves no run either
        if claim is not None:
            interrupted = isinstance(e, KeyboardInterrupt)
            claim.set_aside_failed_start("was interrupted" if interrupted else "failed")
        raise
    finally:
        if claim is not None:
            claim.release()


def _train(config: TrainConfig, dist: DistInfo, t_start: float, signals: StopSignals) -> RunSummary:
    data = config.data
    seed_all(config.seed + dist.rank * RANK_SEED_STRIDE)
    _configure_backends(dist.device)
    # The thread-count policy (train_utils/threads.py): YOLO_THREADS is checked now, not later.
    adapt_threads(dist.device)
    amp = resolve_amp(config.amp, dist.device)

    model, cfg_text, ckpt, channels_last, amp = build_training_model(config, dist, amp)
    hyp = scale_loss_gains(config.hyp, data.nc, config.img_size)
    plan = _epoch_plan(config, t_start)
    state, loop = _start_state(model, config, hyp, dist, amp, plan, ckpt, cfg_text)
    start_epoch = loop.epoch + 1
    # --recipe darknet turns SyncBatchNorm off: Darknet's BatchNorm statistics are per process.
    off = "--recipe darknet (Darknet's BatchNorm)" if config.recipe == "darknet" else "--no-sync-bn"
    state.model = wrap_for_training(model, dist, config.compile, config.sync_bn, off)

    train_data = _train_data(config, dist, hyp, state)
    plan.eval_share = train_data.n_val / max(train_data.n_train, 1)
    opts = _train_options(config, hyp, dist, train_data, channels_last, amp)
    eval_opts = eval_options(config.to_dict(), dist.device, amp, channels_last, dist.is_main)
    failure, args = None, {}
    try:
        if dist.is_main:
            # The launch is recorded so that a torchrun restart finds this folder (run_folder).
            args = {**config.to_dict(), "launch": launch_id()}
            write_run_files(config.output_dir, args, config.hyp, cfg_text)
            _log_start(config, model, dist, train_data, opts, state)
            if config.plots:
                plot_dataset_labels(train_data.train_loader.dataset, data.names, config.output_dir)
        reporter = make_reporter(
            dist.is_main,
            config.output_dir,
            start_epoch,
            trackers=config.tracker,
            params=to_plain(args),
            experiment=data.path.stem,
            resumed=config.resume is not None,
            workers=train_data.train_loader.num_workers,
            history=_history_of(config),
            plots=config.plots,
            unit="iteration" if config.recipe == "darknet" else "epoch",
        )
    except OutputError as e:  # only rank 0 writes
        failure = e
    # Collective: every rank stops with rank 0's error when it cannot write the run's files,
    # instead of waiting for it in the first step's gradient all-reduce.
    raise_if_any_rank_failed(failure, "writing the run folder")
    run = Run(config, dist, state, hyp, cfg_text, plan, train_data, opts, eval_opts)
    darknet = isinstance(state, DarknetState)
    try:
        (_train_iterations if darknet else _train_epochs)(run, reporter, loop, signals)
        seconds = time.time() - t_start
        epochs_run = loop.epoch + 1 - start_epoch
        # Before close(): the external trackers record the run's files, then end it finished.
        # Iterations count from 1, epochs from 0.
        reporter.finished(seconds, epochs_run, loop.best, loop.epoch + (not darknet))
    except (KeyboardInterrupt, RunStopped) as e:
        unfinished_saved = not (config.output_dir / "last.pt").is_file()
        if unfinished_saved:
            # Nothing saved yet: keep the weights, resumable from start_epoch. Before the first
            # batch (a stop request at once) that is the start and resuming is exact; later
            # they are part-trained, and epoch start_epoch runs again from them (README).
            save_on_main(run, start_epoch - 1, loop, as_best=False)
        if isinstance(e, RunStopped):
            reporter.stopped_on_request(str(e))
        else:
            reporter.interrupted(loop.epoch, unfinished_saved, loop.saved_epoch == loop.epoch)
        raise
    finally:
        reporter.close()
        train_data.close()
    return RunSummary(config.output_dir, epochs_run, loop.best, loop.last_stats, seconds)


def _history_of(config: TrainConfig) -> Path | None:
    """The results.csv of the run a ``--resume`` into another folder continues (None: no such
    resume)."""
    if config.resume in (None, "auto"):
        return None
    source = Path(config.resume).parent
    same = source.resolve() == config.output_dir.resolve()
    return None if same else source / "results.csv"


def _train_epochs(
    run: Run,
    reporter: EpochReporter | SilentReporter,
    loop: LoopState,
    signals: StopSignals,
) -> None:
    """Train the epochs after ``loop.epoch`` until the plan (or ``--patience``) ends the run:
    each trained, evaluated when planned, recorded and saved, ``loop`` kept current (the caller
    reads it after an interrupt). A stop request (``signals``) ends it between two batches with
    :class:`RunStopped`. Every rank runs this; its collectives are marked."""
    config, dist, state, plan = run.config, run.dist, run.state, run.plan
    # Images deleted or damaged mid-run are replaced by the datasets; these views collect them
    # for one warning per epoch (each rank its own share: a count is not worth a collective).
    val_unreadable = UnreadableImages(run.train_data.val_loader)
    run.train_data.val_loader = val_unreadable
    rank = dist.rank if dist.distributed else None
    while loop.epoch + 1 < plan.epochs:
        loop.epoch += 1
        epoch = loop.epoch
        seed_all(config.seed + epoch * EPOCH_SEED_STRIDE + dist.rank * RANK_SEED_STRIDE)
        run.train_data.sampler.set_epoch(epoch)
        t0 = time.time()
        unreadable = UnreadableImages(
            reporter.watch_batches(run.train_data.train_loader, epoch, config.data.names)
        )
        loader = StopPoints(unreadable, signals, epoch, dist, config.output_dir / "last.pt")
        stats = train_one_epoch(state, loader, epoch, run.opts)
        log_unreadable(epoch, "train", unreadable.take(), rank)
        seconds = time.time() - t0
        if plan.budget_s is not None:
            total = plan.budget_epochs(epoch, seconds, plan.spent()) if dist.is_main else None
            # Collective: every rank takes rank 0's plan (its clock decides), so that all stop
            # after the same epoch; with --time-budget this epoch may become the last.
            plan.epochs = int(broadcast_object(total))
        state.scheduler.step()
        val, eval_s = None, None
        if plan.evaluates(epoch):
            val, eval_s = evaluate_round(run, reporter)
            log_unreadable(epoch, "val", val_unreadable.take(), rank)
        # Only rank 0 has the stats (val is None elsewhere): its best chooses best.pt.
        is_best = loop.update(epoch, val)
        # results.csv, last.pt and best.pt are written whole before a Ctrl-C/SIGTERM acts, so
        # that the three agree; a SIGKILL between them is repaired by --resume (reconcile_best).
        failure = None
        try:
            with signals.deferred():
                reporter.end_epoch(epoch, plan.epochs, stats, val, seconds, plan.spent())
                save_on_main(run, epoch, loop, as_best=is_best and config.savebest, periodic=True)
        except OutputError as e:  # a full disk: stop here, never train on without checkpoints
            failure = e
        plan.after_epoch(time.time() - t0 - (eval_s or 0.0), eval_s)
        # Collective: every rank waits here, so that none starts the next epoch before rank 0
        # has written this one's checkpoint, and all stop with rank 0's error when it could not.
        raise_if_any_rank_failed(failure, f"saving epoch {epoch}")
        if eval_s is not None and plan.patience > 0:
            stop = dist.is_main and plan.out_of_patience(epoch, loop.best_epoch)
            # Collective: every rank stops where rank 0, the only one with the mAP, says.
            if broadcast_object(stop):
                reporter.stopped_early(epoch, loop.best_epoch, plan.patience)
                return


def _train_iterations(
    run: Run,
    reporter: EpochReporter | SilentReporter,
    loop: LoopState,
    signals: StopSignals,
) -> None:
    """``--recipe darknet``: Darknet's iterations after ``loop.epoch`` (the last finished one)
    up to ``max_batches``, in rounds ending at multiples of ``--eval-iterations``
    (:func:`eval_iterations`) and at the last iteration; after each round, evaluated (only the
    last with ``--notest``), recorded (a ``results.csv`` row whose ``epoch`` is the iteration)
    and saved, as :func:`_train_epochs` does after an epoch. Every rank runs this; its
    collectives are marked."""
    config, dist, state = run.config, run.dist, run.state
    assert isinstance(state, DarknetState)
    max_batches = state.settings.max_batches
    every = eval_iterations(config.eval_iterations, run.train_data.n_train, state.settings)
    val_unreadable = UnreadableImages(run.train_data.val_loader)
    run.train_data.val_loader = val_unreadable
    rank = dist.rank if dist.distributed else None
    while loop.epoch < max_batches:
        first = loop.epoch + 1
        last = min(max_batches, (loop.epoch // every + 1) * every)
        run.train_data.sampler.set_range(first, last)
        t0 = time.time()
        unreadable = UnreadableImages(
            reporter.watch_batches(run.train_data.train_loader, first - 1, config.data.names)
        )
        running = iterations_name(first, last, state.settings.subdivisions)
        where = (running, f"iteration {first - 1}")
        loader = StopPoints(unreadable, signals, first, dist, config.output_dir / "last.pt", where)
        stats = train_darknet_iterations(state, loader, first, last, run.opts)
        log_unreadable(last, "train", unreadable.take(), rank)
        seconds = time.time() - t0
        val = None
        if not config.notest or last == max_batches:
            val, _ = evaluate_round(run, reporter)
            log_unreadable(last, "val", val_unreadable.take(), rank)
        is_best = loop.update(last, val)
        loop.epoch = last
        failure = None
        try:
            with signals.deferred():
                reporter.end_iterations(last, max_batches, stats, val, seconds, run.plan.spent())
                save_on_main(run, last, loop, as_best=is_best and config.savebest)
        except OutputError as e:  # a full disk: stop here, never train on without checkpoints
            failure = e
        # Collective: every rank waits for rank 0's checkpoint, and stops with its error.
        raise_if_any_rank_failed(failure, f"saving iteration {last}")


# ---- setup ----------------------------------------------------------------------------------


def _configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        # cuDNN autotunes once per input shape and caches the choice. Each new shape costs
        # seconds once (bench/README.md "First runs on a GPU": a train step's first call);
        # multi-scale (~13 sides) and rect batches give few distinct shapes, so a run of many
        # epochs pays that back. Not measured on a run with many shapes: a lead, not a fact.
        torch.backends.cudnn.benchmark = True


def _start_state(
    model: Darknet,
    config: TrainConfig,
    hyp: dict[str, Any],
    dist: DistInfo,
    amp: torch.dtype | None,
    plan: EpochPlan,
    ckpt: dict[str, Any] | None,
    cfg_text: str,
) -> tuple[TrainState | DarknetState, LoopState]:
    """The parts training updates (this recipe's), with the checkpoint's state put back when
    resuming; and the loop's state: the last finished epoch, or under ``--recipe darknet`` the
    last finished iteration (a ``.weights`` file's ``seen`` counts unless ``--clear``)."""
    if config.recipe == "darknet":
        state: TrainState | DarknetState = darknet_state(model, dist.world_size)
        loop = LoopState(start_iteration(model.seen, config.clear, state.settings, config.weights))
    else:
        lr0 = scaled_lr0(hyp["lr0"], config.batch_size * dist.world_size, config.nbs)
        fused = uses_fused_optimizer(dist.device)  # the benchmark times the same implementation
        optimizer = build_optimizer(model, hyp, lr0, config.optimizer, fused=fused)
        schedule = build_scheduler(optimizer, lambda: plan.epochs, hyp["lrf"], config.lr_schedule)
        scales_loss = dist.device.type == "cuda" and amp == torch.float16  # bf16 has fp32's range
        state = TrainState(
            model=model,
            model_without_ddp=model,
            optimizer=optimizer,
            scheduler=schedule,
            scaler=torch.amp.GradScaler("cuda") if scales_loss else None,
            ema=ModelEMA(model) if config.ema else None,
        )
        loop = LoopState(-1)
    if ckpt is not None:
        loop = resume.restore(ckpt, state, config, dist, plan, cfg_text)
    return state, loop


def _train_data(
    config: TrainConfig, dist: DistInfo, hyp: dict[str, Any], state: TrainState | DarknetState
) -> TrainData:
    if isinstance(state, DarknetState):
        model = state.model_without_ddp
        loader = DarknetLoaderSettings.from_blocks([model.hyperparams, *model.module_defs])
        return build_darknet_train_data(config, dist, hyp, loader, state.settings)
    return build_train_data(config, dist, hyp)


def _log_start(
    config: TrainConfig,
    model: Darknet,
    dist: DistInfo,
    train_data: TrainData,
    opts: TrainOptions,
    state: TrainState | DarknetState,
) -> None:
    """Rank 0's lines at the start: the run, and the cfg's training keys (their table under
    ``--recipe darknet``, a note that they are unused otherwise)."""
    blocks = [model.hyperparams, *model.module_defs]
    if config.data.backup is not None:  # a Darknet user looks there for the weights
        logger.info(
            "%s: backup=%s is not used: the weights are saved in the run folder %s",
            config.data.path,
            config.data.backup,
            config.output_dir,
        )
    if isinstance(state, DarknetState):
        s = state.settings
        logger.info(
            "--recipe darknet: model %s, %d classes | data: %d train / %d val images | device %s x "
            "%d process(es) | %d iterations of %d x %d images a process, learning_rate %g | "
            "evaluated every %d iterations | output %s",
            config.cfg,
            config.data.nc,
            train_data.n_train,
            train_data.n_val,
            dist.device,
            dist.world_size,
            s.max_batches,
            s.subdivisions,
            s.mini_batch,
            s.learning_rate,
            eval_iterations(config.eval_iterations, train_data.n_train, s),
            config.output_dir,
        )
        log_key_table(key_rows(blocks), config.cfg)
        return
    lr0 = state.optimizer.param_groups[0]["initial_lr"]
    log_run_start(config, model, dist, train_data, opts, lr0)
    log_default_recipe_note(blocks, config.cfg)


def _epoch_plan(config: TrainConfig, t_start: float) -> EpochPlan:
    budget_s = None if config.time_budget is None else config.time_budget * 60.0
    return EpochPlan(
        # With a budget, a first guess: it is re-planned before anything depends on it.
        epochs=config.epochs or DEFAULT_EPOCHS,
        budget_s=budget_s,
        eval_interval=config.eval_interval,
        notest=config.notest,
        patience=config.patience,
        max_epochs=config.epochs if budget_s is not None else None,
        started=t_start,
    )


# ---- loop -----------------------------------------------------------------------------------


def _train_options(
    config: TrainConfig,
    hyp: dict[str, Any],
    dist: DistInfo,
    train_data: TrainData,
    channels_last: bool,
    amp: torch.dtype | None,
) -> TrainOptions:
    nb = len(train_data.train_loader)
    return TrainOptions(
        device=dist.device,
        hyp=hyp,
        accumulate=accumulate_steps(
            config.nbs, config.batch_size, dist.world_size, config.accumulate
        ),
        warmup_iters=round(hyp["warmup_epochs"] * nb),
        amp=amp,
        multi_scale=multi_scale_bounds(config.img_size) if config.multi_scale else None,
        log_interval=config.log_interval,
        show_progress=dist.is_main,
        channels_last=channels_last,
        seed=config.seed,
        label_smoothing=config.label_smoothing,
    )
