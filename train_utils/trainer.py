"""THE training loop, shared by ``train.py`` (one process) and ``train_multi_GPU.py`` (torchrun).

``run(config, dist)`` reads top to bottom: model, optimizer, restore, DDP wrap, data, then the
loop ``train_one_epoch`` / scheduler / ``evaluate`` / record / save. Everything that differs
between one process and DDP is decided from ``dist`` before the loop: collectives are no-ops
without a process group, and only rank 0's reporter and checkpoints write files.

The trainer owns its state: the best mAP and its epoch (:class:`LoopState`), whether an epoch
is the best (:func:`is_better`), what is saved (:func:`_save_on_main`) and when the run stops.
Decisions that only rank 0 can make (its clock for ``--time-budget``, its mAP for
``--patience``) are pure functions of rank 0's inputs, shared by a collective written out in
the loop (``# Collective:``), never inside a helper.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from build_utils.atomic import reported_write
from build_utils.darknet_data import DarknetLoaderSettings
from build_utils.datasets import UnreadableImages, log_unreadable
from build_utils.errors import ConfigError, OutputError, RunStopped, YoloError
from build_utils.parse_config import format_model_cfg
from models.budget import check_model_fits
from models.budget import describe as describe_estimate
from models.darknet import Darknet, model_blocks_for
from models.loss import scale_loss_gains
from models.weights import save_weights
from train_utils import resume
from train_utils.autoanchor import check_anchors
from train_utils.autobatch import AUTO_BATCH, autobatch
from train_utils.checkpoint import (
    CHECKPOINT_VERSION,
    load_weights,
    save_checkpoint,
    to_plain,
    weights_kind,
)
from train_utils.cli import check_environment
from train_utils.config import DEFAULT_EPOCHS, TrainConfig, multi_scale_bounds
from train_utils.darknet_recipe import (
    darknet_initialise,
    darknet_state,
    eval_iterations,
    key_rows,
    loader_settings,
    log_default_recipe_note,
    log_key_table,
    prepare_model,
    start_iteration,
)
from train_utils.data_loaders import TrainData, build_darknet_train_data, build_train_data
from train_utils.distributed.comm import (
    all_reduce_flag,
    broadcast_object,
    broadcast_tensors_,
    raise_if_any_rank_failed,
)
from train_utils.distributed.ddp import wrap_for_training
from train_utils.distributed.node import processes_per_node
from train_utils.distributed.process_group import DistInfo
from train_utils.ema import ModelEMA
from train_utils.engine import (
    DarknetState,
    TrainOptions,
    TrainState,
    evaluate,
    train_darknet_iterations,
    train_one_epoch,
)
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.evaluation.options import EvalOptions, eval_options
from train_utils.memory_format import choose_format_and_precision
from train_utils.optim import (
    accumulate_steps,
    build_optimizer,
    build_scheduler,
    scaled_lr0,
    uses_fused_optimizer,
)
from train_utils.plan import FITNESS_KEY, EpochPlan, LoopState
from train_utils.precision import (
    dtype_from_name,
    dtype_name,
    precision_record,
    resolve_amp,
)
from train_utils.reporting import (
    OUTPUT_FLAG,
    EpochReporter,
    SilentReporter,
    log_run_start,
    logging_to,
    make_reporter,
    run_log_handler,
    write_run_files,
)
from train_utils.run_folder import claim_run_folder, launch_id, relocated
from train_utils.run_pictures import plot_dataset_labels
from train_utils.stop_signals import StopSignals
from train_utils.threads import adapt_threads

logger = logging.getLogger(__name__)

# Seeds are derived per (epoch, rank) so that a resumed run replays the same random stream.
EPOCH_SEED_STRIDE = 1000
RANK_SEED_STRIDE = 1_000_003

# Under DDP a stop request (SIGUSR1) is agreed by a collective every this many batches (one
# process checks every batch): a tiny all-reduce, but also a host sync that CUDA would rather
# skip. A scheduler's warning (``--signal=USR1@120``) leaves minutes, far more than 10 batches.
STOP_POLL_BATCHES = 10


@dataclass
class RunSummary:
    output_dir: Path
    epochs_run: int
    best_map: float | None
    last_stats: dict[str, float] | None
    seconds: float


def is_better(fitness: float, best: float | None) -> bool:
    """Whether ``fitness`` beats ``best`` (None: nothing evaluated yet). A tie is not better,
    so ``best.pt`` and ``--patience`` keep the earlier epoch."""
    return best is None or fitness > best


@dataclass
class _Run:
    """What the epoch loop and the checkpoints are made of, built once by :func:`_train`."""

    config: TrainConfig
    dist: DistInfo
    state: TrainState
    hyp: dict[str, Any]  # the loss gains as used (scaled for classes and image size)
    cfg_text: str
    plan: EpochPlan
    train_data: TrainData
    opts: TrainOptions
    eval_opts: EvalOptions
    eval_every: int = 0  # --recipe darknet: iterations between evaluations and checkpoints


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run(config: TrainConfig, dist: DistInfo) -> RunSummary:
    """Train according to ``config`` on this process's share of the work (see module docstring)."""
    t_start = time.time()
    # A bad YOLO_THREADS, limit or YOLO_MEMORY_AVAILABLE stops the run before it claims (and
    # leaves behind) a run folder.
    check_environment()
    claim, log_handler, error = None, None, None
    if dist.is_main:
        try:
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
    # Collective: a folder rank 0 may not write (a live run holds it, a full disk) stops every
    # rank with the same line, instead of leaving the others waiting in the next collective.
    raise_if_any_rank_failed(error, "claiming the run folder")
    try:
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
            return _train(config, dist, t_start)
    except Exception:
        if claim is not None:
            claim.set_aside_failed_start()
        raise
    finally:
        if claim is not None:
            claim.release()


def _train(config: TrainConfig, dist: DistInfo, t_start: float) -> RunSummary:
    data = config.data
    seed_all(config.seed + dist.rank * RANK_SEED_STRIDE)
    _configure_backends(dist.device)
    # The thread-count policy (train_utils/threads.py): YOLO_THREADS is checked now, not later.
    adapt_threads(dist.device)
    amp = resolve_amp(config.amp, dist.device)

    model, cfg_text, ckpt, channels_last, amp = _build_model(config, dist, amp)
    hyp = scale_loss_gains(config.hyp, data.nc, config.img_size)
    plan = _epoch_plan(config, t_start)
    state, loop = _start_state(model, config, hyp, dist, amp, plan, ckpt, cfg_text)
    start_epoch = loop.epoch + 1
    state.model = wrap_for_training(model, dist, config.compile, config.sync_bn)

    train_data = _train_data(config, dist, hyp, state)
    plan.eval_share = train_data.n_val / max(train_data.n_train, 1)
    opts = _train_options(config, hyp, dist, train_data, channels_last, amp)
    eval_opts = _eval_options(config, dist, channels_last, amp)
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
    run = _Run(config, dist, state, hyp, cfg_text, plan, train_data, opts, eval_opts)
    darknet = isinstance(state, DarknetState)
    if darknet:
        run.eval_every = eval_iterations(config.eval_iterations, train_data.n_train, state.settings)
    signals = StopSignals()
    try:
        with signals.installed():
            (_train_iterations if darknet else _train_epochs)(run, reporter, loop, signals)
        seconds = time.time() - t_start
        epochs_run = loop.epoch + 1 - start_epoch
        # Before close(): the external trackers record the run's files, then end it finished.
        reporter.finished(seconds, epochs_run, loop.best, "iterations" if darknet else "epochs")
    except (KeyboardInterrupt, RunStopped) as e:
        unfinished_saved = not (config.output_dir / "last.pt").is_file()
        if unfinished_saved:
            # Nothing saved yet: keep the weights, resumable from start_epoch. Before the first
            # batch (a stop request at once) that is the start and resuming is exact; later
            # they are part-trained, and epoch start_epoch runs again from them (README).
            _save_on_main(run, start_epoch - 1, loop, as_best=False)
        if isinstance(e, RunStopped):
            reporter.stopped_on_request(str(e))
        else:
            reporter.interrupted(loop.epoch, unfinished_saved, loop.saved_epoch == loop.epoch)
        raise
    finally:
        reporter.close()
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
    run: _Run,
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
        loader = _StopPoints(unreadable, signals, epoch, dist, config.output_dir / "last.pt")
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
            val, eval_s = _evaluate_epoch(run, reporter)
            log_unreadable(epoch, "val", val_unreadable.take(), rank)
        # Only rank 0 has the stats (val is None elsewhere): its best chooses best.pt.
        is_best = val is not None and is_better(val[FITNESS_KEY], loop.best)
        loop.update(epoch, val, is_best)
        # results.csv, last.pt and best.pt are written whole before a Ctrl-C/SIGTERM acts, so
        # that the three agree; a SIGKILL between them is repaired by --resume (_reconcile_best).
        failure = None
        try:
            with signals.deferred():
                reporter.end_epoch(epoch, plan.epochs, stats, val, seconds, plan.spent())
                _save_on_main(run, epoch, loop, as_best=is_best and config.savebest, periodic=True)
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
    run: _Run,
    reporter: EpochReporter | SilentReporter,
    loop: LoopState,
    signals: StopSignals,
) -> None:
    """``--recipe darknet``: Darknet's iterations after ``loop.epoch`` (the last finished one)
    up to ``max_batches``, in rounds ending at multiples of ``run.eval_every`` and at the last
    iteration; after each round, evaluated (only the last with ``--notest``), recorded (a
    ``results.csv`` row whose ``epoch`` is the iteration) and saved, as :func:`_train_epochs`
    does after an epoch. Every rank runs this; its collectives are marked."""
    config, dist, state = run.config, run.dist, run.state
    assert isinstance(state, DarknetState)
    max_batches = state.settings.max_batches
    val_unreadable = UnreadableImages(run.train_data.val_loader)
    run.train_data.val_loader = val_unreadable
    rank = dist.rank if dist.distributed else None
    while loop.epoch < max_batches:
        first = loop.epoch + 1
        last = min(max_batches, (loop.epoch // run.eval_every + 1) * run.eval_every)
        run.train_data.sampler.set_range(first, last)
        t0 = time.time()
        unreadable = UnreadableImages(
            reporter.watch_batches(run.train_data.train_loader, first - 1, config.data.names)
        )
        where = (f"iterations {first}-{last}", f"iteration {first - 1}")
        loader = _StopPoints(unreadable, signals, first, dist, config.output_dir / "last.pt", where)
        stats = train_darknet_iterations(state, loader, first, last, run.opts)
        log_unreadable(last, "train", unreadable.take(), rank)
        seconds = time.time() - t0
        val = None
        if not config.notest or last == max_batches:
            val, _ = _evaluate_epoch(run, reporter)
            log_unreadable(last, "val", val_unreadable.take(), rank)
        is_best = val is not None and is_better(val[FITNESS_KEY], loop.best)
        loop.update(last, val, is_best)
        loop.epoch = last
        failure = None
        try:
            with signals.deferred():
                reporter.end_iterations(last, max_batches, stats, val, seconds, run.plan.spent())
                _save_on_main(run, last, loop, as_best=is_best and config.savebest)
        except OutputError as e:  # a full disk: stop here, never train on without checkpoints
            failure = e
        # Collective: every rank waits for rank 0's checkpoint, and stops with its error.
        raise_if_any_rank_failed(failure, f"saving iteration {last}")


def _evaluate_epoch(
    run: _Run, reporter: EpochReporter | SilentReporter
) -> tuple[dict[str, float] | None, float]:
    """Evaluate the EMA weights (the model's when there is no EMA) and report them; the COCO
    stats by name (None off rank 0) and the seconds it took. Every rank must call this
    (:func:`evaluate` gathers the detections to rank 0, a collective).

    Every rank evaluates rank 0's weights, those :func:`_save_on_main` saves: without
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


# ---- model ----------------------------------------------------------------------------------


def _build_model(
    config: TrainConfig, dist: DistInfo, amp: torch.dtype | None
) -> tuple[Darknet, str, dict[str, Any] | None, bool, torch.dtype | None]:
    """The model on its device and in its memory format, with its resolved cfg text, the
    resume checkpoint (None when not resuming), whether it is channels_last and the autocast
    dtype it trains in (``amp``, unless ``--amp auto`` on a CPU with native bf16 timed fp32
    faster)."""
    blocks = model_blocks_for(config.cfg, config.data.nc)
    error = None
    try:
        _check_model_memory(config, blocks, dist, amp)
    except ConfigError as e:
        error = e
    # Collective: a model that cannot fit one rank's device stops every rank with the same
    # line, instead of leaving the others waiting in check_anchors.
    raise_if_any_rank_failed(error, "checking the model's memory")
    blocks = check_anchors(blocks, config, dist)
    cfg_text = format_model_cfg(blocks)
    darknet = config.recipe == "darknet"
    model = Darknet(blocks, img_size=(config.img_size, config.img_size), head_bias=not darknet)
    if darknet:
        darknet_initialise(model)
        prepare_model(model)
    ckpt = resume.load(config, model, dist)
    if ckpt is None and config.weights:
        _initialise_weights(model, config)
    model.freeze(config.freeze_layers)
    model.to(dist.device)
    if config.batch_size == AUTO_BATCH:
        batch = autobatch(model, config.img_size, dist.device, amp) if dist.is_main else None
        # Collective: every rank trains with rank 0's batch (and records it, for --resume).
        config.batch_size = int(broadcast_object(batch))
    channels_last, amp = _memory_format(config, model, dist, amp, cfg_text, ckpt)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return model, cfg_text, ckpt, channels_last, amp


def _check_model_memory(
    config: TrainConfig, blocks: list[dict[str, Any]], dist: DistInfo, amp: torch.dtype | None
) -> None:
    """Refuse a model whose training memory (parameters, gradients, optimizer state, EMA and the
    activations of a batch at the largest side this run trains at, in the autocast dtype)
    exceeds the device's, before anything is allocated (models/budget.py)."""
    side = multi_scale_bounds(config.img_size)[1] if config.multi_scale else config.img_size
    if config.recipe == "darknet":  # the largest size of the cfg's `random`
        side = max(DarknetLoaderSettings.from_blocks(blocks).largest_size)
    # The ranks of a node training on its CPU share its RAM; GPUs are one per rank.
    cpu = dist.device.type == "cpu"
    share = processes_per_node() if cpu else 1
    # --amp auto on a CPU may still time fp32 faster (_memory_format): count fp32 there.
    counted = None if cpu and config.amp == "auto" else amp
    estimate = check_model_fits(
        blocks,
        side,
        batch=max(config.batch_size, 1),  # autobatch (-1) fits the memory itself
        training=True,
        device=dist.device,
        share=share,
        amp=counted,
    )
    logger.debug("model memory: %s", describe_estimate(estimate, config.batch_size))


def _configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        # cuDNN autotunes once per input shape and caches the choice; multi-scale (~13 sides)
        # and rect batches give few distinct shapes, so the tuning pays for itself there too.
        torch.backends.cudnn.benchmark = True


def _memory_format(
    config: TrainConfig,
    model: Darknet,
    dist: DistInfo,
    amp: torch.dtype | None,
    cfg_text: str,
    ckpt: dict[str, Any] | None,
) -> tuple[bool, torch.dtype | None]:
    """Whether to train in channels_last, and in which autocast dtype: decided on rank 0
    (:func:`~train_utils.memory_format.choose_format_and_precision`; a resumed run keeps the
    precision its checkpoint records) and shared."""
    choice = None
    if dist.is_main:
        channels_last, amp = choose_format_and_precision(
            model,
            config.img_size,
            config.batch_size,
            dist.device,
            amp,
            config.amp,
            config.channels_last,
            cfg_text,
            resume.recorded_cpu_amp(ckpt),
        )
        choice = (channels_last, dtype_name(amp))
    # Collective: every rank takes rank 0's format and precision (only rank 0 timed them).
    channels_last, amp_name = broadcast_object(choice)
    return bool(channels_last), dtype_from_name(amp_name)


def _initialise_weights(model: Darknet, config: TrainConfig) -> None:
    skipped = load_weights(model, config.weights, strict=False, trust=config.trust_checkpoint)
    if skipped:
        logger.warning(
            "--weights %s: skipped %d tensors whose shapes differ: %s",
            config.weights,
            len(skipped),
            ", ".join(skipped),
        )
    elif weights_kind(config.weights) != "darknet":  # Darknet's loader says which layers it read
        # Say it when everything fitted too, so a user need not infer it from a missing warning.
        n = len(model.state_dict())
        logger.info("--weights %s: all %d tensors loaded", config.weights, n)


def _build_train_state(
    model: Darknet,
    config: TrainConfig,
    hyp: dict[str, Any],
    dist: DistInfo,
    amp: torch.dtype | None,
    plan: EpochPlan,
) -> TrainState:
    lr0 = scaled_lr0(hyp["lr0"], config.batch_size * dist.world_size, config.nbs)
    on_cuda = dist.device.type == "cuda"
    fused = uses_fused_optimizer(dist.device)  # the benchmark times the same implementation
    optimizer = build_optimizer(model, hyp, lr0, config.optimizer, fused=fused)
    return TrainState(
        model=model,
        model_without_ddp=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, lambda: plan.epochs, hyp["lrf"], config.lr_schedule),
        # bf16 has fp32's range: only fp16 needs loss scaling.
        scaler=torch.amp.GradScaler("cuda") if on_cuda and amp == torch.float16 else None,
        ema=ModelEMA(model) if config.ema else None,
    )


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
        state = _build_train_state(model, config, hyp, dist, amp, plan)
        loop = LoopState(-1)
    if ckpt is not None:
        loop = resume.restore(ckpt, state, config, dist, plan, cfg_text)
    return state, loop


def _train_data(
    config: TrainConfig, dist: DistInfo, hyp: dict[str, Any], state: TrainState | DarknetState
) -> TrainData:
    if isinstance(state, DarknetState):
        model = state.model_without_ddp
        return build_darknet_train_data(config, dist, hyp, loader_settings(model), state.settings)
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
    if not isinstance(state, DarknetState):
        lr0 = state.optimizer.param_groups[0]["initial_lr"]
        log_run_start(config, model, dist, train_data, opts, lr0)
        log_default_recipe_note(blocks, config.cfg)
        return
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


def _eval_options(
    config: TrainConfig, dist: DistInfo, channels_last: bool, amp: torch.dtype | None
) -> EvalOptions:
    return eval_options(config.to_dict(), dist.device, amp, channels_last, dist.is_main)


def _save_on_main(
    run: _Run, epoch: int, loop: LoopState, as_best: bool, periodic: bool = False
) -> None:
    """Rank 0 writes the checkpoint of ``epoch`` to ``last.pt``, then the same one to ``best.pt``
    when ``as_best`` and to ``epoch<epoch>.pt`` when ``periodic`` and ``--save-period`` asks for
    this epoch (:func:`keeps_epoch`); other ranks write nothing. Not a collective: the trainer's
    ``raise_if_any_rank_failed`` after it keeps the other ranks from running ahead.

    Why last.pt first: a crash between the two leaves a ``last.pt`` that names its own epoch as
    the best and holds exactly the bytes ``best.pt`` should have, so ``--resume`` can rebuild
    ``best.pt`` from it (:func:`_reconcile_best`). The other order would leave a ``best.pt``
    ahead of ``last.pt``, right only if the replayed epoch is judged the same way again.

    Raises:
        OutputError: a checkpoint cannot be written (the previous one stays as it was).
    """
    if not run.dist.is_main:
        return
    ckpt = _checkpoint(run, epoch, loop)
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


def _checkpoint(run: _Run, epoch: int, loop: LoopState) -> dict[str, Any]:
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


class _StopPoints:
    """The epoch's ``loader``, checking for a stop request before each batch (every
    :data:`STOP_POLL_BATCHES` under DDP, where every rank must check at the same batches).

    Stopping mid-epoch keeps the last finished epoch's ``last.pt`` as it is: a mid-epoch state
    could not be resumed exactly, so the epoch in progress is trained again after ``--resume``.
    ``where`` names what is running and what ``last.pt`` holds (default: epoch ``epoch`` and
    the one before; ``--recipe darknet``: its iterations).
    """

    def __init__(
        self,
        loader: Any,
        signals: StopSignals,
        epoch: int,
        dist: DistInfo,
        last: Path,
        where: tuple[str, str] | None = None,
    ) -> None:
        self.loader, self.signals, self.epoch, self.last = loader, signals, epoch, last
        self.poll = STOP_POLL_BATCHES if dist.distributed else 1
        self.running, self.saved = where or (f"epoch {epoch}", f"epoch {epoch - 1}")

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        n = len(self.loader)
        for i, batch in enumerate(self.loader):
            # Collective: every rank stops at the same batch when any rank was asked (srun
            # signals every task; a signal forwarded by hand may reach only some).
            if i % self.poll == 0 and all_reduce_flag(self.signals.stop_requested):
                raise RunStopped(
                    f"SIGUSR1 (stop requested) in {self.running} before batch {i}/{n}: "
                    f"{self.saved} is the last in {self.last}; continue with --resume "
                    f"({self.running} will be trained again)"
                )
            yield batch
