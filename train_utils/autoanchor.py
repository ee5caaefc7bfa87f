"""The anchor check at training start, and ``--autoanchor``.

:func:`check_anchors` measures how well the cfg's anchors fit the training labels, as
``tools/kmeans_anchors.py`` does (:mod:`build_utils.anchors`: best possible recall at the hyp's
``iou_t``), logs the figure, and warns below :data:`BPR_WARN_BELOW` with the command that
computes better anchors. With ``--autoanchor`` it computes them itself (k-means + genetic
refinement, fixed seed) and, when they fit better, writes them into the parsed cfg blocks before
the model is built, so the model trains with them and the run folder's ``model.cfg`` and every
checkpoint carry them.

Only rank 0 reads the labels and decides; the anchors are broadcast, so every rank builds the
same model. On resume nothing is checked: the checkpoint's cfg decides the anchors (anchors are
not in the state_dict, so a run resumed with its original ``--cfg`` gets the anchors it trained
with, not the cfg's).
"""

from __future__ import annotations

import copy
import logging
import shlex
from pathlib import Path

import numpy as np

from build_utils.anchors import (
    AnchorFit,
    anchor_fit,
    evolve,
    format_anchors,
    kmeans_iou,
    label_sizes,
    too_small,
)
from build_utils.datasets import LoadImagesAndLabels
from build_utils.errors import CheckpointError, ConfigError, YoloError
from build_utils.parse_config import Block, parse_model_cfg_text, yolo_mask
from train_utils.checkpoint import load_checkpoint
from train_utils.config import TrainConfig
from train_utils.distributed.comm import broadcast_object, raise_if_any_rank_failed
from train_utils.distributed.process_group import DistInfo
from train_utils.resume import resume_path

logger = logging.getLogger(__name__)

# Below this best possible recall the anchors leave too many labels without a match
# (ultralytics/yolov3's check_anchors threshold).
BPR_WARN_BELOW = 0.98
# --autoanchor: the k-means seed (fixed: the same data gives the same anchors on every run) and
# the genetic refinement steps (the tool's default).
AUTOANCHOR_SEED = 0
AUTOANCHOR_GENERATIONS = 1000


def cfg_anchors(blocks: list[Block]) -> np.ndarray:
    """``(k, 2)`` pixel anchors the model's heads use (each ``[yolo]`` block's ``mask``)."""
    used = []
    for b in blocks:
        if b["type"] == "yolo":
            pairs = np.asarray(b["anchors"], dtype=np.float64).reshape(-1, 2)
            used.append(pairs[yolo_mask(b)])
    return np.concatenate(used) if used else np.zeros((0, 2))


def with_anchors(blocks: list[Block], anchors: np.ndarray) -> list[Block]:
    """A copy of ``blocks`` whose ``[yolo]`` blocks list ``anchors`` (``(k, 2)``, sorted by area,
    as the masks expect), masks unchanged."""
    flat = np.asarray(anchors).ravel().tolist()
    return _with_head_anchors(blocks, [flat] * sum(b["type"] == "yolo" for b in blocks))


def _with_head_anchors(blocks: list[Block], per_head: list[list[float]]) -> list[Block]:
    """A copy of ``blocks`` whose ``[yolo]`` blocks, in order, list ``per_head``'s anchors."""
    out = copy.deepcopy(blocks)
    heads = iter(per_head)
    for b in out:
        if b["type"] == "yolo":
            # Whole pixels stay integers, so the written cfg reads like a hand-made one.
            b["anchors"] = [int(v) if float(v).is_integer() else float(v) for v in next(heads)]
    return out


def suggested_command(config: TrainConfig) -> str:
    """The ``tools/kmeans_anchors.py`` command that computes anchors for this run's data."""
    cfg = Path(config.cfg)
    out_cfg = cfg.with_name(f"{cfg.stem}-anchors{cfg.suffix}")
    args = ["python", "tools/kmeans_anchors.py", "--data", str(config.data.path)]
    args += ["--cfg", str(cfg), "--img-size", str(config.img_size)]
    args += ["--iou-t", str(config.hyp["iou_t"]), "--out-cfg", str(out_cfg)]
    return shlex.join(args)


def check_anchors(blocks: list[Block], config: TrainConfig, dist: DistInfo) -> list[Block]:
    """Log the anchors' fit to the training labels; with ``--autoanchor`` and a poor fit, return
    ``blocks`` with better anchors (the same on every rank), else ``blocks`` itself. Resuming,
    return ``blocks`` with the anchors of the checkpoint's cfg where they differ (an earlier
    ``--autoanchor``), without reading the labels.

    Every rank must call this (it broadcasts rank 0's decision).

    Raises:
        YoloError: on every rank, when rank 0 cannot read the training labels.
    """
    resuming = config.resume is not None
    per_head, error = None, None
    if dist.is_main:
        try:
            per_head = _checkpoint_anchors(blocks, config) if resuming else _check(blocks, config)
        except YoloError as e:
            error = e
    raise_if_any_rank_failed(error, "checking the anchors")
    per_head = broadcast_object(per_head)
    return blocks if per_head is None else _with_head_anchors(blocks, per_head)


def _checkpoint_anchors(blocks: list[Block], config: TrainConfig) -> list[list[float]] | None:
    """Resuming: the anchors of the checkpoint's cfg, per head, where they differ from ``blocks``.

    A missing or unreadable checkpoint is left to the trainer's resume, which reports it.
    """
    if config.autoanchor:
        logger.info("--autoanchor skipped: resuming, the checkpoint's cfg sets the anchors")
    try:
        path = resume_path(config)
        text = load_checkpoint(path, trust=config.trust_checkpoint).get("cfg")
    except (ConfigError, CheckpointError):
        return None
    if not isinstance(text, str):
        return None
    saved = [
        b["anchors"] for b in parse_model_cfg_text(text, f"{path} (its cfg)") if b["type"] == "yolo"
    ]
    ours = [b["anchors"] for b in blocks if b["type"] == "yolo"]
    if saved == ours or [len(a) for a in saved] != [len(a) for a in ours]:
        # Equal, or another architecture, which the trainer's resume check reports.
        return None
    logger.info("resuming with the anchors of %s's cfg (%s's differ)", path, config.cfg)
    return saved


def training_label_sizes(config: TrainConfig) -> np.ndarray:
    """``(n, 2)`` training label sizes in pixels at ``--img-size``, those under the minimum
    dropped. Reads the label cache the training set shares (built now if missing), no images."""
    dataset = LoadImagesAndLabels(
        config.data.train,
        config.img_size,
        max(config.batch_size, 1),  # the label sizes do not depend on it (autobatch: -1)
        single_cls=config.single_cls,
        # Quiet (progress and summary are for rank -1/0): the training set reports the labels.
        rank=1,
        nc=config.data.nc,
    )
    wh = label_sizes(dataset.labels, dataset.shapes, config.img_size)
    return wh[~too_small(wh)]


def _check(blocks: list[Block], config: TrainConfig) -> list[list[float]] | None:
    """Rank 0's part: log the fit; the new anchors per head when --autoanchor replaces them."""
    anchors = cfg_anchors(blocks)
    wh = training_label_sizes(config)
    if len(anchors) == 0 or len(wh) == 0:
        logger.info("anchor check skipped: %d anchors, %d usable labels", len(anchors), len(wh))
        return None
    iou_t = float(config.hyp["iou_t"])
    fit = anchor_fit(wh, anchors, iou_t)
    logger.info(
        "anchors vs %d training labels at %d px: %s", fit.n_labels, config.img_size, fit.describe()
    )
    if fit.bpr >= BPR_WARN_BELOW:
        return None
    if not config.autoanchor:
        logger.warning(
            "the cfg's anchors fit the training labels poorly (best possible recall %.4f < %g: "
            "%.1f%% of the labels match no anchor); compute better ones with\n    %s\n"
            "and train with the cfg it writes, or pass --autoanchor",
            fit.bpr,
            BPR_WARN_BELOW,
            100 * (1 - fit.bpr),
            suggested_command(config),
        )
        return None
    return _autoanchor(blocks, wh, fit)


def _autoanchor(blocks: list[Block], wh: np.ndarray, fit: AnchorFit) -> list[list[float]] | None:
    """New anchors by the tool's k-means + evolution, if they raise the best possible recall."""
    yolo = [b for b in blocks if b["type"] == "yolo"]
    lists = {tuple(b["anchors"]) for b in yolo}
    if len(lists) != 1:
        logger.warning("--autoanchor skipped: the [yolo] blocks list different anchors")
        return None
    k = len(yolo[0]["anchors"]) // 2
    if len(wh) < k:
        logger.warning("--autoanchor skipped: %d labels are too few for %d anchors", len(wh), k)
        return None
    logger.info(
        "--autoanchor: computing %d anchors (k-means + %d generations)", k, AUTOANCHOR_GENERATIONS
    )
    rng = np.random.default_rng(AUTOANCHOR_SEED)
    new = evolve(wh, kmeans_iou(wh, k, rng), fit.iou_t, AUTOANCHOR_GENERATIONS, rng)
    # Whole pixels, as the tool writes them; the comparison is on what the cfg will hold.
    new = np.maximum(np.round(new), 1.0)
    new_fit = anchor_fit(wh, cfg_anchors(with_anchors(blocks, new)), fit.iou_t)
    if new_fit.bpr <= fit.bpr:
        logger.warning(
            "--autoanchor: the new anchors do not fit better (best possible recall %.4f vs "
            "%.4f); keeping the cfg's",
            new_fit.bpr,
            fit.bpr,
        )
        return None
    logger.info(
        "--autoanchor: anchors=%s; %s (was %.4f); the run's model.cfg carries them",
        format_anchors(new),
        new_fit.describe(),
        fit.bpr,
    )
    return [new.ravel().tolist() for b in yolo]
