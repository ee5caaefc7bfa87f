"""``--resume``, in one place: which checkpoint continues which run, with which settings, and
putting its state back into this run's parts.

1. Before the configuration is built, :func:`settings_of_resumed_run` finds the checkpoint
   (a path, or the newest ``runs/*/last.pt``, or the run a ``--name`` names) and takes the run's
   own arguments for every flag not typed.
2. Once the model is built, every rank reads the checkpoint (:func:`load`) and checks that it can
   continue this model (:func:`check_resumable`): the weights' names and shapes, and every value
   it records, each by the part that owns it.
3. :func:`restore` puts the state back: the model weights, then each part's ``load_state_dict``
   (optimizer, scheduler and scaler in :mod:`train_utils.optim`, the EMA in
   :mod:`train_utils.ema`, the loop and the epoch plan in :mod:`train_utils.plan`); then what
   this run changes (its own learning rate for its global batch and schedule) is applied and
   said, and ``best.pt`` is made to agree with the checkpoint.

:mod:`train_utils.checkpoint` only reads and writes the files.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from build_utils.checks import finite_float
from build_utils.errors import CheckpointError, ConfigError, YoloError
from build_utils.parse_config import format_model_cfg, parse_model_cfg_text
from train_utils.checkpoint import (
    CHECKPOINT_VERSION,
    MAX_LISTED_MISMATCHES,
    copy_checkpoint,
    is_state_dict,
    load_checkpoint,
    read_weights,
    record_int,
    record_of_kind,
    state_loading,
    strip_prefixes,
)
from train_utils.cli import check_choices, take_from_run
from train_utils.distributed.comm import all_gather, raise_if_any_rank_failed
from train_utils.distributed.process_group import DistInfo, launched_world_size
from train_utils.ema import ModelEMA
from train_utils.engine import DarknetState, TrainState
from train_utils.optim import (
    accumulate_steps,
    check_optimizer_state,
    check_scaler_state,
    load_optimizer_state,
    load_scaler_state,
    load_scheduler_state,
    scaled_lr0,
)
from train_utils.plan import FITNESS_KEY, EpochPlan, LoopState
from train_utils.reporting import read_results
from train_utils.run_folder import RUN_CFG_NAME, RUN_HYP_NAME, RUNS_DIR, refuse_if_in_use

if TYPE_CHECKING:
    from train_utils.config import TrainConfig

logger = logging.getLogger(__name__)

# What --resume restores; without these a file can only initialise weights (--weights).
RESUME_KEYS = ("model", "optimizer", "epoch")
MAX_WORLD_SIZE = 1 << 20
# The fix a file that cannot be resumed gets: it may still initialise a new run.
USE_WEIGHTS = "use --weights to initialise from it instead"

SHARED_STORAGE_HINT = (
    "resuming on several nodes needs the output folder on storage every node shares "
    "(or a copy of last.pt at the same path on each node)"
)

# Settings a resumed run takes from its command line, not from the checkpoint's run: what it is
# told to be (its cfg, data and hyp files are found from the run), where it writes and how it
# reads the checkpoint.
OWN_SETTINGS = frozenset(
    {"cfg", "data", "hyp", "output_dir", "exist_ok", "resume", "trust_checkpoint", "auto_named"}
)
# Settings that may differ on resume without a word: where and how fast it runs, not what.
# The cfg's path is one: the model is compared by its text (check_resume_cfg).
QUIET_SETTINGS = frozenset(
    {
        "resume",
        "device",
        "workers",
        "trust_checkpoint",
        "log_interval",
        "output_dir",
        "exist_ok",
        "auto_named",
        "cfg",
        "tracker",
    }
)


# ---- 1. before the configuration: the checkpoint and the run's own settings --------------------


def latest_run_checkpoint(runs: Path = RUNS_DIR) -> Path | None:
    """The most recently written ``runs/*/last.pt`` (what bare ``--resume`` continues)."""
    found = [p for p in runs.glob("*/last.pt") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resumes_in_place(resume: str | None, output_dir: Path) -> bool:
    """Whether ``--resume`` continues the run in ``output_dir`` rather than starting a folder of
    its own (the trainer's claim of the run folder asks).

    ``--resume`` of the folder's ``last.pt`` (or of any checkpoint in a folder without one)
    continues in place. ``--resume`` of another checkpoint beside a ``last.pt`` (an
    ``epoch<E>.pt`` of ``--save-period``, a copy) goes back to an earlier state: continuing in
    place would write over the later epochs' ``last.pt``, ``best.pt`` and ``results.csv`` rows,
    so the run writes the next numbered folder instead (``runs/x2``), the earlier run kept whole.
    """
    if resume is None:
        return False
    last = output_dir / "last.pt"
    if resume == "auto" or not last.is_file():
        return True
    return Path(resume).resolve() == last.resolve()


def _checkpoint_to_resume(args: argparse.Namespace, run_folder: Path | None) -> Path:
    """The checkpoint ``--resume`` means: its path; bare ``--resume`` with a run named
    (``run_folder``) is that run's ``last.pt``, without one the newest
    ``<project or runs>/*/last.pt``.

    Raises:
        ConfigError: there is no such checkpoint.
    """
    if args.resume != "auto":
        path = Path(args.resume)
        # A run's folder means its last.pt (as a search's folder means the search).
        return path / "last.pt" if path.is_dir() else path
    if run_folder is not None:
        last = run_folder / "last.pt"
        refuse_if_in_use(run_folder)  # a live run there: that is what the user must hear
        if not last.is_file():
            raise ConfigError(
                f"--resume: no checkpoint in {run_folder} (no last.pt): that run never finished "
                f"an epoch, or another --name/--project was meant"
            )
        return last
    runs = Path(args.project) if getattr(args, "project", "") else RUNS_DIR
    latest = latest_run_checkpoint(runs)
    if latest is None:
        raise ConfigError(
            f"--resume: no {runs}/*/last.pt to continue; give the path of a last.pt "
            f"or the run's --name"
        )
    return latest


def settings_of_resumed_run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    fields: Mapping[str, Any],
    named_folder: Path | None,
) -> Path | None:
    """``--resume PATH`` (or bare ``--resume``): take the run's own arguments for every flag in
    ``fields`` (dest -> fallback) not typed, and return the run's folder, where it continues.

    ``named_folder`` is the folder ``--name``/``--output-dir`` name, if any. None without
    ``--resume``.
    """
    if args.resume is None:
        return None
    path = _checkpoint_to_resume(args, named_folder)
    args.resume = str(path)
    try:
        if not path.is_file():
            raise CheckpointError("no checkpoint there; give the path of a run's last.pt", path)
        weights = read_weights(path, args.trust_checkpoint, "a run's last.pt")
        if weights.kind != "torch" or weights.ckpt is None:
            raise CheckpointError(
                "not a checkpoint but Darknet .weights (--weights starts a new run from them)",
                path,
            )
        # Before a folder is claimed: a file that cannot be resumed writes nothing beside it.
        check_training_state(weights.ckpt, path)
        check_results_are_its_own(weights.ckpt, path)
        run = weights.run
    except CheckpointError as e:
        if launched_world_size() == 1:
            raise ConfigError(f"--resume: {e}") from e
        # Under DDP one rank failing alone here would leave the others waiting; the trainer
        # reads the checkpoint again and stops every rank with this error.
        logger.debug("--resume %s: not readable here (%s); the trainer reports it", path, e)
        return path.parent
    if not run:
        logger.info("--resume %s: the checkpoint records no run arguments; using the flags", path)
        return path.parent
    folder = path.parent
    settings = {k: v for k, v in fields.items() if k not in OWN_SETTINGS}
    take_from_run(args, run, settings, f"--resume {path}")
    check_choices(parser, args)
    _take_the_run_files(args, run, folder)
    in_place = resumes_in_place(str(path), folder)
    if not in_place and _finished(weights.ckpt, args):
        # A new folder for no training (was: runs/x2 with a best.pt and no last.pt).
        raise ConfigError(
            f"--resume {path}: that checkpoint already finished all {args.epochs} epochs: "
            "nothing to resume; pass --epochs N to train it longer"
        )
    where = (
        f"in {folder}"
        if in_place
        else f"in a new folder beside {folder} (its later epochs are kept)"
    )
    logger.info(
        "--resume %s: continuing that run %s with its own arguments for the flags not given "
        "(cfg %s, data %s)",
        path,
        where,
        args.cfg,
        args.data,
    )
    return folder


def _finished(ckpt: Mapping[str, Any], args: argparse.Namespace) -> bool:
    """The default recipe's checkpoint has trained all of ``--epochs`` (without a time budget,
    which decides the length as it runs)."""
    epoch = ckpt.get("epoch")
    if (ckpt.get("recipe") or "default") != "default" or args.time_budget is not None:
        return False
    return isinstance(epoch, int) and isinstance(args.epochs, int) and epoch + 1 >= args.epochs


def check_results_are_its_own(ckpt: Mapping[str, Any], path: Path) -> None:
    """The ``results.csv`` beside checkpoint ``path`` is its run's: ``--resume`` cuts that file at
    the checkpoint's epoch (or starts a new folder's from it) and rebuilds ``best.pt`` from the
    checkpoint, which on another run's folder (a ``last.pt`` copied in) would mix two runs' files.
    Judged by the row of the checkpoint's best epoch, whose mAP the checkpoint records, not by the
    folder's path: a run folder moved or copied elsewhere is still its own.

    Raises:
        ConfigError: that row is missing or holds another mAP.
    """
    best = finite_float(ckpt.get("best_fitness"))
    epoch = ckpt.get("best_epoch", ckpt.get("epoch"))
    if best is None or epoch is None:
        return  # never evaluated: nothing to judge by
    results = path.parent / "results.csv"
    try:
        rows = read_results(results)
    except (OSError, UnicodeDecodeError, csv.Error):
        return  # unreadable: the run's own reading of it reports that
    if not rows:
        return
    row = next((r for r in rows if str(r.get("epoch", "")).strip() == str(epoch)), None)
    try:
        found = float(row[FITNESS_KEY]) if row else math.nan
    except (KeyError, TypeError, ValueError):
        found = math.nan
    if math.isclose(found, best, rel_tol=1e-6, abs_tol=1e-9):
        return
    has = f"{FITNESS_KEY} {row.get(FITNESS_KEY)}" if row is not None else "no row"
    raise ConfigError(
        f"--resume {path}: {results} is another run's (epoch {epoch}: {has}; this checkpoint's "
        f"best epoch {epoch} had {FITNESS_KEY} {best:.6g}): continuing there would mix the two "
        f"runs' files; resume the checkpoint from its own run's folder, or start a new run from "
        f"it with --weights {path}"
    )


def _take_the_run_files(args: argparse.Namespace, run: Mapping[str, Any], folder: Path) -> None:
    """The cfg, data and hyp files of the resumed run, for those not typed: the cfg it was
    started with while it is there, else the folder's resolved copy; its hyp copy."""
    given = getattr(args, "given", frozenset())
    if "cfg" not in given:
        saved = Path(str(run.get("cfg", "")))
        args.cfg = str(saved if saved.is_file() else folder / RUN_CFG_NAME)
        if not Path(args.cfg).is_file():  # the checkpoint moved away from its run's files
            raise ConfigError(
                f"--resume {args.resume}: the run's cfg is neither at {saved} nor beside the "
                f"checkpoint ({folder / RUN_CFG_NAME}); pass the cfg it trained with to --cfg"
            )
    data = run.get("data")
    if "data" not in given and isinstance(data, dict) and isinstance(data.get("path"), str):
        args.data = data["path"]
    if "hyp" not in given and (folder / RUN_HYP_NAME).is_file():
        args.hyp = str(folder / RUN_HYP_NAME)


# ---- 2. on every rank: read the checkpoint, check it fits this run -----------------------------


def resume_path(config: TrainConfig) -> Path:
    """The checkpoint file of ``--resume`` (bare: the run folder's ``last.pt``).

    Raises:
        ConfigError: it does not exist.
    """
    path = config.output_dir / "last.pt" if config.resume == "auto" else Path(config.resume)
    if not path.is_file():
        raise ConfigError(
            f"--resume: no checkpoint at {path}; train without --resume first or "
            f"give the path of a last.pt"
        )
    return path


def load(config: TrainConfig, model: nn.Module, dist: DistInfo) -> dict[str, Any] | None:
    """The checkpoint ``--resume`` names (None without ``--resume``), checked against ``model``
    (:func:`check_resumable`) before anything else is built; ``ckpt["_path"]`` is its file.

    Every rank reads it (each needs the weights), but they succeed or fail together: a rank that
    cannot read it (a node without the shared output folder) stops every rank with the same
    error instead of leaving them to hang, and all ranks must find the same epoch.
    """
    if config.resume is None:
        return None
    ckpt, error = None, None
    try:
        path = resume_path(config)
        ckpt = load_checkpoint(path, trust=config.trust_checkpoint)
        check_resumable(ckpt, model.state_dict(), path)
        ckpt["_path"] = path
    except YoloError as e:
        error = e
    if error is not None and dist.distributed:
        error = type(error)(f"{error}; {SHARED_STORAGE_HINT}")
    # Collective: every rank raises the first failing rank's error, or none does.
    raise_if_any_rank_failed(error, "--resume")
    assert ckpt is not None
    # Collective: every rank sees every rank's epoch, to refuse differing checkpoints.
    epochs = all_gather(int(ckpt.get("epoch", -1)))
    if len(set(epochs)) > 1:
        raise CheckpointError(
            f"ranks read different checkpoints (epochs {epochs} by rank); {SHARED_STORAGE_HINT}",
            ckpt["_path"],
        )
    return ckpt


def check_resumable(
    ckpt: Mapping[str, Any],
    model_state: Mapping[str, torch.Tensor],
    path: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """Check that ``ckpt`` can resume training of the model whose state is ``model_state``, and
    every value it records, before any of it is restored.

    Returns:
        The training weights with wrapper prefixes stripped, ready for ``load_state_dict``.

    Raises:
        CheckpointError: required keys missing, a pre-training file (``epoch < 0`` without a
            training state), a newer schema version, missing, unexpected or differently
            shaped model tensors (up to five listed), or any damaged recorded value (one line
            naming the field).
    """
    check_training_state(ckpt, path)
    # Resuming continues the raw training weights (``train_model``), not their EMA (``model``,
    # the weights to use), when the checkpoint has them.
    weights = ckpt.get("train_model")
    weights = ckpt.get("model") if weights is None else weights
    if not is_state_dict(weights):
        raise CheckpointError(f"'model' is not a state_dict of tensors; {USE_WEIGHTS}", path)
    saved = strip_prefixes(weights)
    mismatches = _mismatches(saved, model_state)
    if mismatches:
        listed = "; ".join(mismatches[:MAX_LISTED_MISMATCHES])
        more = len(mismatches) - MAX_LISTED_MISMATCHES
        if more > 0:
            listed += f"; and {more} more"
        raise CheckpointError(f"checkpoint is for another model: {listed}; {USE_WEIGHTS}", path)
    _check_records(ckpt, model_state, path)
    return saved


def check_training_state(ckpt: Mapping[str, Any], path: str | Path | None = None) -> None:
    """That ``ckpt`` is a training state this code can continue: the keys ``--resume`` needs, a
    schema it knows, and an epoch of training (not weights to initialise from).

    Raises:
        CheckpointError: one line saying which, and that ``--weights`` takes such a file.
    """
    missing = [k for k in RESUME_KEYS if ckpt.get(k) is None]
    if missing:
        names = ", ".join(repr(k) for k in missing)
        raise CheckpointError(
            f"not a resumable training checkpoint: missing {names}; {USE_WEIGHTS}", path
        )
    version = ckpt.get("version", CHECKPOINT_VERSION)
    if not isinstance(version, int) or version > CHECKPOINT_VERSION:
        raise CheckpointError(
            f"checkpoint schema version {version!r} is newer than this code supports "
            f"({CHECKPOINT_VERSION}); update the code",
            path,
        )
    epoch = ckpt["epoch"]
    # -1 with a training state: saved on Ctrl-C before epoch 0 finished; it runs epoch 0 again.
    if epoch == -1 and ckpt.get("train_model") is None:
        raise CheckpointError(
            f"epoch={epoch!r}: this file holds weights, not a training state; {USE_WEIGHTS}", path
        )


def _mismatches(saved: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> list[str]:
    def shape(t: torch.Tensor) -> str:
        return "(" + ", ".join(str(s) for s in t.shape) + ")"

    found = []
    for key, tensor in own.items():
        if key not in saved:
            found.append(f"{key} missing from checkpoint")
        elif saved[key].shape != tensor.shape:
            found.append(f"{key}: checkpoint {shape(saved[key])} vs model {shape(tensor)}")
    return found + [f"{key} not in model" for key in saved if key not in own]


def _check_records(
    ckpt: Mapping[str, Any], model_state: Mapping[str, torch.Tensor], path: str | Path | None
) -> None:
    """Every value the checkpoint records besides the weights, each by its owner."""
    LoopState.check_state(ckpt, path)
    EpochPlan.check_state(ckpt, path)
    ModelEMA.check_state(ckpt, model_state, path)
    record_int(ckpt, "world_size", 1, MAX_WORLD_SIZE, path)
    for key, kind in (("cfg", str), ("config", Mapping), ("scheduler", Mapping)):
        record_of_kind(ckpt, key, kind, path)
    check_optimizer_state(ckpt.get("optimizer"), path)
    check_scaler_state(ckpt.get("scaler"), path)


# ---- 3. restore -------------------------------------------------------------------------------


def restore_state(
    ckpt: Mapping[str, Any], state: TrainState | DarknetState, path: str | Path | None = None
) -> LoopState:
    """Put a checked checkpoint's training state back into ``state``'s freshly built parts,
    each loading (and checking) its own; returns the loop's state (its last finished epoch and
    best mAP; under ``--recipe darknet`` its last finished iteration)."""
    model = state.model_without_ddp
    model.load_state_dict(check_resumable(ckpt, model.state_dict(), path))
    load_optimizer_state(state.optimizer, ckpt["optimizer"], path)
    if isinstance(state, DarknetState):
        if ckpt.get("darknet_ema") is not None:
            with state_loading("Darknet EMA", path):
                state.averager.load_state_dict(ckpt["darknet_ema"])
    else:
        load_scheduler_state(state.scheduler, ckpt["scheduler"], state.optimizer, path)
        load_scaler_state(state.scaler, ckpt.get("scaler"), path)
        if state.ema is not None:
            state.ema.load_state_dict(ckpt, model, path)
    return LoopState.from_checkpoint(ckpt, path)


def restore(
    ckpt: dict[str, Any],
    state: TrainState | DarknetState,
    config: TrainConfig,
    dist: DistInfo,
    plan: EpochPlan,
    cfg_text: str,
) -> LoopState:
    """Continue the checkpoint's run in ``state`` and ``plan``: what may change (sizes, freeze,
    ...) is said in one warning, what cannot (another model, another optimizer's state) is a
    ``CheckpointError``. Every rank holds the same checkpoint and flags, so all raise alike (no
    collective needed). Returns the loop's state."""
    path = ckpt.pop("_path")
    # The model is the cfg's text (resolved for the classes, anchors from the checkpoint), not
    # its path: a cfg edited in place must not train silently on these weights.
    check_resume_cfg(
        ckpt.get("cfg"), cfg_text, config.cfg, path.parent / RUN_CFG_NAME, path, config.recipe
    )
    theirs = ckpt.get("recipe") or "default"
    if theirs != config.recipe:
        raise CheckpointError(
            f"the checkpoint was trained with --recipe {theirs}, which --recipe {config.recipe} "
            f"cannot continue: resume with --recipe {theirs}, or start a new run from these "
            f"weights with --weights {path}",
            path,
        )
    loop = restore_state(ckpt, state, path)
    if dist.is_main:
        # After the checks above: what is said to have changed is what this run then does.
        _warn_about_changes(ckpt, config, path)
        if config.savebest:
            reconcile_best(ckpt, path, config.output_dir / "best.pt", config.trust_checkpoint)
    start_epoch = loop.epoch + 1
    plan.load_state_dict(ckpt, start_epoch)
    darknet = isinstance(state, DarknetState)
    if not darknet:  # Darknet's rate is a function of the iteration alone
        _follow_this_run(ckpt, config, state, dist)
    logger.info(
        "resuming from %s: %s %d done, best mAP@0.5:0.95 %s",
        path,
        "iteration" if darknet else "epoch",
        loop.epoch,
        "-" if loop.best is None else f"{loop.best:.4f}",
    )
    if darknet and loop.epoch >= state.settings.max_batches:
        logger.info("the checkpoint already finished all %d iterations", loop.epoch)
    elif not darknet and start_epoch >= plan.epochs:
        logger.info("the checkpoint already finished all %d epochs; nothing to do", plan.epochs)
    return loop


def _follow_this_run(
    ckpt: Mapping[str, Any], config: TrainConfig, state: TrainState, dist: DistInfo
) -> None:
    """Give the restored optimizer this run's learning rate: its base rate for this run's global
    batch, on this run's schedule at the restored epoch.

    The restored state carries the saved run's rates: its base rate was scaled for its global
    batch (batch x processes), and its current rate is the saved schedule's. Resumed on another
    number of processes (or another ``--batch-size``/``--nbs``), or with another plan
    (``--epochs``, a ``--time-budget`` re-planned), those would be the wrong ones from the first
    resumed epoch on. Accumulation is always derived afresh (the trainer's options). The same
    run resumed gets the same values, which keeps resuming exact.
    """
    lr0 = scaled_lr0(config.hyp["lr0"], config.batch_size * dist.world_size, config.nbs)
    scheduler = state.scheduler
    saved = scheduler.base_lrs[0]
    scheduler.base_lrs = [lr0] * len(scheduler.base_lrs)
    factors = [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]
    for group, factor in zip(state.optimizer.param_groups, factors, strict=True):
        group["initial_lr"] = lr0
        group["lr"] = lr0 * factor
    scheduler._last_lr = [g["lr"] for g in state.optimizer.param_groups]
    if saved == lr0 or not dist.is_main:
        return
    saved_config = ckpt.get("config") or {}
    logger.warning(
        "resuming with global batch %d x %d process(es) (the checkpoint's: %s x %s): "
        "lr0 %.4g -> %.4g, accumulate %d -> %d",
        config.batch_size,
        dist.world_size,
        saved_config.get("batch_size", "?"),
        ckpt.get("world_size", "?"),
        saved,
        lr0,
        _saved_accumulate(saved_config, ckpt.get("world_size", 1)),
        accumulate_steps(config.nbs, config.batch_size, dist.world_size, config.accumulate),
    )


def _saved_accumulate(saved: Mapping[str, Any], world_size: Any) -> int:
    try:
        return accumulate_steps(
            int(saved["nbs"]),
            int(saved["batch_size"]),
            int(world_size),
            saved.get("accumulate"),
        )
    except (KeyError, TypeError, ValueError):
        return -1


def _changes(saved: Mapping[str, Any], now: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """``key: old -> new`` for each of ``keys`` whose value differs (dicts key by key)."""
    changes = []
    for key in sorted(keys):
        old, new = saved[key], now[key]
        if isinstance(old, dict) and isinstance(new, dict):
            # A key the saved dict lacks is one added since (a hyperparameter with a default).
            changes += [
                f"{key}.{k}: {old.get(k)!r} -> {new.get(k)!r}"
                for k in sorted(old)
                if old.get(k) != new.get(k)
            ]
        elif old != new:
            changes.append(f"{key}: {old!r} -> {new!r}")
    return changes


def _warn_about_changes(ckpt: Mapping[str, Any], config: TrainConfig, path: Path) -> None:
    """Say which settings of the resumed run differ from the checkpoint's (another model, by
    shapes or by cfg text, and another optimizer's state are refused earlier; the cfg's path
    alone is no change)."""
    saved = dict(ckpt.get("config") or {})
    saved["hyp"] = ckpt.get("hyp", saved.get("hyp"))
    now = config.to_dict()
    changes = _changes(saved, now, (set(saved) & set(now)) - QUIET_SETTINGS)
    if changes:
        logger.warning(
            "--resume %s: this run differs from the checkpoint's: %s", path, "; ".join(changes)
        )


def check_resume_cfg(
    saved_text: str | None,
    cfg_text: str,
    cfg: str | Path,
    own_cfg: str | Path,
    path: str | Path | None = None,
    recipe: str = "default",
) -> None:
    """Refuse to resume a model whose resolved cfg text differs from the checkpoint's.

    The text is compared, not the path: a cfg edited in place (an activation changed, same
    tensor shapes) would otherwise train another network on the checkpoint's weights, while a
    copy of the same cfg elsewhere is the same model. Checkpoints without a cfg pass.
    ``own_cfg`` is the run folder's copy of the checkpoint's cfg, offered as the fix.

    Raises:
        CheckpointError: naming the first differing line (its block and layer index).
    """
    if not saved_text or saved_text == cfg_text:
        return
    with contextlib.suppress(YoloError):
        # Written by another version, perhaps formatted otherwise: compare what it means.
        saved_text = format_model_cfg(parse_model_cfg_text(saved_text, "checkpoint"))
    if saved_text == cfg_text:
        return
    old, new = saved_text.splitlines(), cfg_text.splitlines()
    i = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    headers = [line for line in new[: i + 1] if line.startswith("[")]
    layer = sum(1 for h in headers if h != "[net]") - 1
    where = f"{headers[-1]} layer {layer}" if headers and layer >= 0 else "[net]"
    was = old[i] if i < len(old) else "(end of cfg)"
    now = new[i] if i < len(new) else "(end of cfg)"
    what, weights = "another model than the checkpoint's", path or "last.pt"
    if recipe == "darknet" and where == "[net]":
        # Darknet's way to train on with other [net] keys (more max_batches): a new run from
        # last.weights, which continues at the iteration its images seen count.
        what = "not the checkpoint's: its training keys differ"
        weights = f"{Path(weights).with_suffix('.weights')} (it continues at its iteration)"
    raise CheckpointError(
        f"--cfg {cfg} is {what}: at {where}, {was!r} in the checkpoint, {now!r} in the cfg; "
        f"resume with the run's own cfg (--cfg {own_cfg}), or start a new run from these "
        f"weights with --weights {weights}",
        path,
    )


def reconcile_best(ckpt: Mapping[str, Any], last: Path, best: Path, trust: bool) -> None:
    """Make ``best`` the epoch the resumed checkpoint ``ckpt`` (read from ``last``) names as its
    best, when a crash (SIGKILL, power loss) came between writing ``last.pt`` and ``best.pt``.

    When ``ckpt`` is itself the best epoch, ``best`` must hold the same checkpoint: ``last`` is
    copied over it (atomically) unless it already holds that epoch. Otherwise the best epoch's
    weights exist only in ``best``; if it holds another epoch (a folder written by an older
    version, or edited by hand) that is said in one line and the next better epoch replaces it.
    A ``--resume`` into a new folder (an earlier ``epoch<E>.pt`` of another run) starts its
    ``best.pt`` as the best of that state: the resumed file when it is its own best, else the
    other run's ``best.pt`` or ``epoch<E>.pt`` that holds that epoch.
    """
    best_epoch, epoch = ckpt.get("best_epoch"), ckpt.get("epoch")
    if best_epoch is None:
        return
    on_disk = _epoch_of(best, trust)
    if on_disk == best_epoch:
        return
    found = "missing" if on_disk is None else f"epoch {on_disk}"
    if best_epoch != epoch and last.resolve().parent != best.resolve().parent:
        # A new folder continuing an earlier state of another run: its best epoch's weights are
        # that run's best.pt or epoch<E>.pt, if one of them still holds that epoch.
        source = next(
            (
                p
                for p in (last.parent / "best.pt", last.parent / f"epoch{best_epoch}.pt")
                if _epoch_of(p, trust) == best_epoch
            ),
            None,
        )
        if source is not None:
            _copy_best(source, best, found, best_epoch)
            return
    if best_epoch != epoch:
        logger.warning(
            "%s is %s but %s names epoch %s as the best, whose weights are gone; best.pt will be "
            "the next epoch better than mAP@0.5:0.95 %s",
            best,
            found,
            last,
            best_epoch,
            ckpt.get("best_fitness"),
        )
        return
    # The bytes of last.pt are the checkpoint that the interrupted write of best.pt had (or,
    # in a new folder, the resumed checkpoint is its run's best so far).
    _copy_best(last, best, found, epoch)


def _epoch_of(path: Path, trust: bool) -> int | None:
    """The epoch a checkpoint file holds, None when it is missing or cannot be read."""
    if not path.is_file():
        return None
    try:
        return load_checkpoint(path, trust=trust).get("epoch")
    except CheckpointError as e:
        logger.warning("%s cannot be read (%s)", path, e)
        return None


def _copy_best(source: Path, best: Path, found: str, epoch: int) -> None:
    try:
        copy_checkpoint(source, best)
    except CheckpointError as e:
        # Only rank 0 is here: raising would leave the other ranks waiting in a collective.
        # The run goes on; its own writes to this folder report a lasting problem.
        logger.warning("%s is %s and could not be rebuilt: %s", best, found, e)
        return
    logger.info("%s was %s: rebuilt from %s (epoch %s, the best)", best, found, source, epoch)
