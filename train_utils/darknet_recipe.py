"""``--recipe darknet``: train a cfg as Darknet's ``train_detector`` does, from the cfg's own
training keys (README "Train as Darknet does").

This module says which keys the recipe honours (:data:`TRAINING_KEYS`, the README's table), prints
them at the start of a run with their values and where they came from, names in one warning the
keys of the cfg it does not implement, decides which flags it overrides, and builds the parts:
Darknet's loss (:mod:`models.darknet_loss`), update, schedule and EMA
(:mod:`train_utils.darknet_schedule`), BatchNorm (:mod:`models.darknet_bn`), weight
initialisation and loader (:mod:`build_utils.darknet_data`). The loop is
:func:`train_utils.engine.train_darknet_iterations`, driven by :mod:`train_utils.trainer`.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from build_utils.checks import check_at_least
from build_utils.darknet_data import DarknetLoaderSettings
from build_utils.parse_config import Block, layer_error
from models.darknet_bn import use_darknet_batchnorm
from models.darknet_loss import DarknetLoss, yolo_specs
from train_utils.checkpoint import MAX_EPOCH
from train_utils.darknet_schedule import (
    DarknetEMA,
    DarknetSettings,
    DarknetSGD,
)
from train_utils.engine import DarknetState

logger = logging.getLogger(__name__)

RECIPES = ("default", "darknet")

# What the recipe does with a key (the table's last column).
HONOURED = "honoured"
NOT_IMPLEMENTED = "not implemented"
NO_EFFECT = "no effect"  # Darknet's detector training (CPU build) does not read it either


@dataclass(frozen=True)
class TrainingKey:
    """A training key of a Darknet cfg: its section, Darknet's default (as text), what it means
    and what the recipe does with it."""

    section: str
    key: str
    default: str
    meaning: str
    status: str = HONOURED


def _keys(section: str, status: str, rows: Sequence[tuple[str, str, str]]) -> list[TrainingKey]:
    return [TrainingKey(section, k, d, m, status) for k, d, m in rows]


# Darknet's defaults are those of src/parser.c (parse_net_options, parse_yolo) and load_thread.
TRAINING_KEYS: tuple[TrainingKey, ...] = (
    *_keys(
        "net",
        HONOURED,
        [
            ("batch", "1", "images per iteration (per GPU)"),
            ("subdivisions", "1", "forward passes per iteration, batch/subdivisions images each"),
            ("max_batches", "0", "iterations to train"),
            ("learning_rate", "0.001", "base rate (x the number of GPUs)"),
            (
                "policy",
                "constant",
                "rate schedule: constant step steps exp poly random sigmoid sgdr",
            ),
            ("burn_in", "0", "iterations of warm-up, rate x (k/burn_in)^power"),
            ("power", "4", "exponent of burn_in and poly"),
            ("steps", "-", "policy=steps: iterations where the rate changes"),
            ("scales", "-", "policy=steps: factor at each step"),
            ("step", "1", "policy=step/sigmoid: period or centre"),
            ("scale", "1", "policy=step: factor per period"),
            ("gamma", "1", "policy=exp/sigmoid: factor or slope"),
            ("sgdr_cycle", "max_batches", "policy=sgdr: first cycle's length"),
            ("sgdr_mult", "2", "policy=sgdr: growth of each next cycle"),
            ("learning_rate_min", "0.00001", "policy=sgdr: lowest rate"),
            ("momentum", "0.9", "SGD momentum"),
            ("decay", "0.0001", "weight decay of convolution kernels"),
            (
                "ema_alpha",
                "0",
                "EMA of the weights from max_batches/2, applied at max_batches-1000",
            ),
            ("flip", "1", "left-right flip with probability 0.5"),
            ("letter_box", "0", "crop extended to the network's aspect ratio"),
            ("hue", "0", "hue shift, uniform in +-hue"),
            ("saturation", "1", "saturation factor in [1/s, s]"),
            ("exposure", "1", "brightness factor in [1/e, e]"),
            ("resize_step", "32", "random: sizes are multiples of it"),
            ("mixup", "0", "1: in half the iterations each image blended 50/50 with another"),
        ],
    ),
    *_keys(
        "net",
        NOT_IMPLEMENTED,
        [
            ("mosaic", "0", "4-image mosaics (OpenCV build only)"),
            ("mosaic_bound", "0", "mosaic: keep boxes inside their tile"),
            ("cutmix", "0", "CutMix (refused by Darknet's detector)"),
            ("blur", "0", "blur (OpenCV build only)"),
            ("gaussian_noise", "0", "noise (OpenCV build only)"),
            ("adam", "0", "Adam instead of SGD (with B1, B2, eps)"),
            ("B1", "0.9", "adam: beta1"),
            ("B2", "0.999", "adam: beta2"),
            ("eps", "0.000001", "adam: epsilon"),
            ("dynamic_minibatch", "0", "random: batch grows when the size shrinks"),
            ("weights_reject_freq", "0", "re-initialise similar filters every N iterations"),
            ("equidistant_point", "0", "bad-label rejection: from this iteration"),
            ("badlabels_rejection_percentage", "0", "bad-label rejection: share rejected"),
            ("num_sigmas_reject_badlabels", "0", "bad-label rejection: threshold in sigmas"),
            ("track", "0", "video sequences (with time_steps, augment_speed, seq_scales)"),
            ("time_steps", "1", "track: frames per sequence"),
            ("augment_speed", "2", "track: frames between augmentations"),
            ("sequential_subdivisions", "subdivisions", "track: subdivisions per sequence"),
            ("init_sequential_subdivisions", "subdivisions", "track: the first of them"),
            ("seq_scales", "-", "track: their scale at each step"),
            ("contrastive", "0", "contrastive loss (with contrastive_jit_flip/_color)"),
            ("contrastive_jit_flip", "0", "contrastive: jitter and flip per pair"),
            ("contrastive_color", "0", "contrastive: colour per pair"),
            ("unsupervised", "0", "contrastive without labels"),
            ("try_fix_nan", "0", "replace NaN deltas"),
            ("adversarial_lr", "0", "adversarial training (GPU build only)"),
            ("loss_scale", "1", "fp16 loss scale (GPU build only)"),
            ("attention", "0", "attention maps (GPU build only)"),
        ],
    ),
    *_keys(
        "net",
        NO_EFFECT,
        [
            ("angle", "0", "rotation: the detector's loader ignores it"),
            ("aspect", "1", "classifier loader only"),
            ("max_crop", "2 x width", "classifier loader only"),
            ("min_crop", "width", "classifier loader only"),
            ("label_smooth_eps", "0", "[net]: classifier only ([yolo] has its own)"),
            ("max_chart_loss", "20", "the loss chart's scale"),
            ("use_cuda_graph", "0", "GPU memory and speed"),
            ("optimized_memory", "0", "GPU memory and speed"),
            ("workspace_size_limit_MB", "1024", "GPU memory and speed"),
            ("show_receptive_field", "0", "a display"),
        ],
    ),
    *_keys(
        "yolo",
        HONOURED,
        [
            ("ignore_thresh", "0.5", "no objectness loss above this IoU with a truth"),
            ("truth_thresh", "1", "trained as a positive above this IoU"),
            ("iou_thresh", "1", "extra anchors above this IoU with a truth"),
            ("iou_thresh_kind", "iou", "iou_thresh's IoU: iou giou diou ciou"),
            ("iou_loss", "mse", "box loss: mse iou giou diou ciou"),
            ("iou_normalizer", "0.75", "box loss gain"),
            ("obj_normalizer", "1", "objectness loss gain"),
            ("cls_normalizer", "1", "class loss gain (with counters_per_class)"),
            ("max_delta", "inf", "clip of box deltas"),
            ("label_smooth_eps", "0", "class label smoothing"),
            ("objectness_smooth", "0", "objectness target = IoU"),
            ("focal_loss", "0", "focal class loss"),
            ("counters_per_class", "-", "class loss weights from counts"),
            ("max", "200", "truths read per image"),
            ("show_details", "1", "what the reported loss sums"),
            ("jitter", "0.2", "crop offsets up to jitter x size per side (last [yolo])"),
            ("resize", "1", "zoom in [1/resize, resize] (last [yolo])"),
            ("random", "0", "new network size every 10 iterations, x up to 1.4 (last [yolo])"),
        ],
    ),
    *_keys(
        "yolo",
        NOT_IMPLEMENTED,
        [("delta_normalizer", "1", "gradient gain (GPU build only)")],
    ),
    *_keys(
        "yolo",
        NO_EFFECT,
        [
            ("nms_kind", "default", "detection NMS, not training"),
            ("beta_nms", "0.6", "detection NMS, not training"),
            ("track_history_size", "5", "tracking at detection"),
            ("sim_thresh", "0.8", "tracking at detection"),
            ("dets_for_track", "1", "tracking at detection"),
            ("dets_for_show", "1", "tracking at detection"),
            ("track_ciou_norm", "0.01", "tracking at detection"),
            ("embedding_layer", "-", "tracking at detection"),
        ],
    ),
)
# Flags whose work the cfg does under --recipe darknet, as argparse dests -> the flag named.
OVERRIDDEN_FLAGS = {
    "epochs": "--epochs",
    "time_budget": "--time-budget",
    "patience": "--patience",
    "batch_size": "--batch-size",
    "img_size": "--img-size",
    "multi_scale": "--multi-scale",
    "rect": "--rect",
    "nbs": "--nbs",
    "accumulate": "--accumulate",
    "hyp": "--hyp",
    "optimizer": "--optimizer",
    "lr_schedule": "--cos-lr/--linear-lr",
    "label_smoothing": "--label-smoothing",
    "ema": "--ema",
    "amp": "--amp",
    "sync_bn": "--sync-bn",
    "eval_interval": "--eval-interval",
    "save_period": "--save-period",
}
RECIPE_ONLY_FLAGS = {"clear": "--clear", "eval_iterations": "--eval-iterations"}
# Darknet's -map: every mAP_epochs (4) epochs of images, and at least every this many iterations.
MAP_EPOCHS = 4
MIN_MAP_ITERATIONS = 100


# ---- the table at start --------------------------------------------------------------------


@dataclass(frozen=True)
class KeyRow:
    """One row of the start table: the key, its value, where it came from, its status."""

    section: str
    key: str
    value: str
    source: str
    status: str


def _shown(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_shown(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def key_rows(blocks: Sequence[Block]) -> list[KeyRow]:
    """The training keys of a parsed cfg (``[net]`` first): every honoured key (its value, or
    Darknet's default), and every other key the cfg sets. A ``[yolo]`` key whose layers differ
    shows one value per layer, in cfg order."""
    net, yolos = blocks[0], [b for b in blocks if b["type"] == "yolo"]
    rows = []
    for k in TRAINING_KEYS:
        if k.section == "net":
            present = k.key in net
            value = _shown(net[k.key]) if present else k.default
            source = "[net]" if present else "default"
        else:
            given = [b for b in yolos if k.key in b]
            present = bool(given)
            values = [_shown(b[k.key]) if k.key in b else k.default for b in yolos]
            value = values[0] if len(set(values)) == 1 else " / ".join(values)
            source = "default" if not given else "[yolo]"
            if given and len(given) < len(yolos):
                source = f"[yolo] ({len(given)} of {len(yolos)} layers)"
        if present or k.status == HONOURED:
            rows.append(KeyRow(k.section, k.key, value, source, k.status))
    return rows


def unimplemented(rows: Sequence[KeyRow]) -> list[KeyRow]:
    """The rows of keys the cfg sets, to other values than Darknet's defaults, that the recipe
    does not implement (``mosaic=0`` asks for nothing to be done)."""
    defaults = {(k.section, k.key): k.default for k in TRAINING_KEYS}
    return [
        r
        for r in rows
        if r.status == NOT_IMPLEMENTED and not _is_default(r.value, defaults[r.section, r.key])
    ]


def _is_default(value: str, default: str) -> bool:
    try:
        return float(value) == float(default)
    except ValueError:
        return value == default


def log_key_table(rows: Sequence[KeyRow], cfg: object) -> None:
    """The table, then (if any) one warning naming the cfg's keys the recipe ignores."""
    width = max(len(f"[{r.section}] {r.key}") for r in rows)
    vwidth = min(24, max(len(r.value) for r in rows))
    lines = [f"--recipe darknet: the training keys of {cfg}"]
    lines.append(f"  {'key':<{width}}  {'value':<{vwidth}}  {'from':<22}  recipe")
    for r in rows:
        name = f"[{r.section}] {r.key}"
        lines.append(f"  {name:<{width}}  {r.value:<{vwidth}}  {r.source:<22}  {r.status}")
    logger.info("\n".join(lines))
    ignored = unimplemented(rows)
    if ignored:
        logger.warning(
            "--recipe darknet does not implement these keys of %s, which train without them: %s",
            cfg,
            ", ".join(f"{r.key}={r.value}" for r in ignored),
        )


def log_default_recipe_note(blocks: Sequence[Block], cfg: object) -> None:
    """Under the default recipe: one line saying the cfg's training keys are not used."""
    rows = key_rows(blocks)
    given = [r.key for r in rows if r.source != "default"]
    if given:
        logger.info(
            "%s sets Darknet training keys (%s) that the default recipe does not use "
            "(hyperparameters come from --hyp); --recipe darknet trains as the cfg says",
            cfg,
            ", ".join(given[:6]) + (", ..." if len(given) > 6 else ""),
        )


# ---- flags ------------------------------------------------------------------------------------


def check_recipe_blocks(blocks: Sequence[Block]) -> DarknetSettings:
    """The cfg's training settings, checked before a run folder exists.

    Raises:
        ConfigError: naming the key's line: the schedule's, the loss's or the loader's keys
            Darknet would misread (see their ``from_block``), ``batch=1`` (Darknet refuses it
            for training), no ``max_batches``, or more iterations than a checkpoint records.
    """
    net = blocks[0]
    settings = DarknetSettings.from_block(net)
    yolo_specs(blocks)
    DarknetLoaderSettings.from_blocks(blocks)
    if settings.update_batch == 1:
        raise layer_error(
            net,
            "batch=1 trains one image an iteration; Darknet refuses it (e.g. batch=64)",
            "batch",
        )
    if not 1 <= settings.max_batches <= MAX_EPOCH:
        raise layer_error(
            net,
            f"max_batches={settings.max_batches} must be in 1..{MAX_EPOCH} (the iterations to "
            "train; Darknet suggests 2000 x classes)",
            "max_batches",
        )
    return settings


def apply_recipe(args: argparse.Namespace, blocks: Sequence[Block]) -> None:
    """Set the flags the cfg decides under ``--recipe darknet`` (one process's ``mini_batch``
    as ``--batch-size``, the cfg's side as ``--img-size``; no multi-scale, rect batches, our
    EMA, autocast or SyncBatchNorm), and say once which of the typed flags do not apply. Under
    the default recipe, say that ``--clear`` and ``--eval-iterations`` do not apply.

    Raises:
        ConfigError: see :func:`check_recipe_blocks`; an ``--eval-iterations`` below 1.
    """
    given = getattr(args, "given", frozenset())
    if args.recipe != "darknet":
        typed = [flag for dest, flag in RECIPE_ONLY_FLAGS.items() if dest in given]
        if typed:
            verb = "applies" if len(typed) == 1 else "apply"
            logger.warning("%s %s only to --recipe darknet; ignored", ", ".join(typed), verb)
        return
    settings = check_recipe_blocks(blocks)
    net = blocks[0]
    typed = [flag for dest, flag in OVERRIDDEN_FLAGS.items() if dest in given]
    if typed:
        logger.warning(
            "--recipe darknet: the cfg's training keys decide; these flags do not apply: %s",
            ", ".join(dict.fromkeys(typed)),
        )
    args.batch_size = settings.mini_batch
    args.img_size = max(int(net["width"]), int(net["height"]))
    args.multi_scale = args.rect = args.ema = args.sync_bn = False
    args.amp = "off"
    args.save_period = -1
    check_at_least({"--eval-iterations": args.eval_iterations}, 1)


def eval_iterations(chosen: int | None, n_train: int, settings: DarknetSettings) -> int:
    """Iterations between evaluations (and checkpoints): ``--eval-iterations``, else Darknet's
    ``-map`` rule, every :data:`MAP_EPOCHS` epochs of images, at least
    :data:`MIN_MAP_ITERATIONS`."""
    if chosen is not None:
        return chosen
    return max(MAP_EPOCHS * n_train // settings.update_batch, MIN_MAP_ITERATIONS)


# ---- the parts --------------------------------------------------------------------------------


def prepare_model(model: nn.Module) -> None:
    """The model as Darknet's GPU build starts and trains it: Darknet's initial weights
    (``make_convolutional_layer``: kernels uniform in ``+-sqrt(2 / fan_in)``, biases 0;
    BatchNorm scale 1, shift 0, as PyTorch's), then its BatchNorm (the shift trained). Same
    parameters and buffers: checkpoints and ``.weights`` are unchanged."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                bound = math.sqrt(2.0 / m.weight[0].numel())
                m.weight.uniform_(-bound, bound)
                if m.bias is not None:
                    m.bias.zero_()
    use_darknet_batchnorm(model, train_shift=True)


def darknet_state(model: nn.Module, world_size: int) -> DarknetState:
    """Loss, update, schedule and EMA of the cfg (``model.hyperparams``), for one of
    ``world_size`` processes."""
    settings = DarknetSettings.from_block(model.hyperparams).for_gpus(world_size)
    return DarknetState(
        model=model,
        model_without_ddp=model,
        optimizer=DarknetSGD.for_model(model, settings),
        averager=DarknetEMA(settings.ema_alpha, settings.max_batches),
        criterion=DarknetLoss([model.hyperparams, *model.module_defs], model.yolo_layers),
        settings=settings,
    )


def start_iteration(seen: int, clear: bool, settings: DarknetSettings, weights: str) -> int:
    """The iterations already done by a ``--weights`` file: Darknet's ``seen / (batch *
    subdivisions)`` from a ``.weights`` header, 0 with ``--clear`` (Darknet's ``-clear``)."""
    if clear and not seen:
        logger.warning(
            "--clear: --weights %s has no images seen to clear (only a Darknet .weights file "
            "counts them); the run starts at iteration 0 as it would without --clear",
            weights or "(none)",
        )
    if clear or not seen:
        return 0
    done = seen // settings.update_batch
    finished = done >= settings.max_batches
    then = (
        f"max_batches={settings.max_batches} is done: nothing to train"
        if finished
        else f"training continues at iteration {done + 1} of {settings.max_batches}"
    )
    # A finished file is a warning (on the console): the run then ends at once, no weights.
    logger.log(
        logging.WARNING if finished else logging.INFO,
        "--weights %s: seen %d images = %d iterations of %d images; %s (--clear starts at 0)",
        weights,
        seen,
        done,
        settings.update_batch,
        then,
    )
    return min(done, settings.max_batches)
