"""``--recipe darknet`` in the run: Darknet's iterations in rounds of ``--eval-iterations``
(:func:`train_iterations`, the trainer's loop for this recipe), and the lines that open such a
run (:func:`log_recipe_start`). The iterations themselves are
:func:`train_utils.engine.train_darknet_iterations`; a round ends as an epoch does
(:mod:`train_utils.rounds`); the recipe's parts are built by :mod:`train_utils.darknet_recipe`.
"""

from __future__ import annotations

import logging
import time

from build_utils.datasets import UnreadableImages, log_unreadable
from build_utils.errors import OutputError
from train_utils.config import TrainConfig
from train_utils.darknet_recipe import eval_iterations, key_rows, log_key_table
from train_utils.data_loaders import TrainData
from train_utils.distributed.comm import raise_if_any_rank_failed
from train_utils.distributed.process_group import DistInfo
from train_utils.engine import DarknetState, train_darknet_iterations
from train_utils.plan import LoopState
from train_utils.reporting import EpochReporter, SilentReporter
from train_utils.rounds import Run, evaluate_round, save_on_main
from train_utils.stop_signals import StopPoints, StopSignals

logger = logging.getLogger(__name__)


def train_iterations(
    run: Run,
    reporter: EpochReporter | SilentReporter,
    loop: LoopState,
    signals: StopSignals,
) -> None:
    """``--recipe darknet``: Darknet's iterations after ``loop.epoch`` (the last finished one)
    up to ``max_batches``, in rounds ending at multiples of ``--eval-iterations``
    (:func:`eval_iterations`) and at the last iteration; after each round, evaluated (only the
    last with ``--notest``), recorded (a ``results.csv`` row whose ``epoch`` is the iteration)
    and saved, as the trainer does after an epoch. Every rank runs this; its collectives are
    marked."""
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
        where = (f"iterations {first}-{last}", f"iteration {first - 1}")
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


def log_recipe_start(
    config: TrainConfig,
    dist: DistInfo,
    train_data: TrainData,
    state: DarknetState,
    blocks: list[dict],
) -> None:
    """Rank 0's lines at the start of a ``--recipe darknet`` run: the run, then the table of
    the cfg's training keys (``blocks``: the ``[net]`` block, then the layers)."""
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
