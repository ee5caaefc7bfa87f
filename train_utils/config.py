"""Command line, hyperparameters and dataset description, validated once into explicit objects.

Each source of configuration has one owner: the CLI for the run (:func:`get_args_parser`),
``cfg/hyp.yaml`` for hyperparameters (:func:`load_hyp`), the ``.data`` or ``data.yaml`` file for
the dataset (:func:`load_data_config`) and the ``.cfg`` for the architecture
(``build_utils.parse_config``). Every problem is raised as :class:`ConfigError` naming the file,
line or flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from build_utils.atomic import check_apart
from build_utils.augmentations import GRID  # every input side must be a multiple of it
from build_utils.checks import check_at_least, check_choice, check_fractions
from build_utils.errors import ConfigError
from build_utils.labels import data_folders
from build_utils.limits import MAX_WEIGHTS_BYTES, check_config_file
from build_utils.parse_config import DATA_PATH_KEYS, parse_data_cfg, parse_model_cfg
from build_utils.safe_yaml import compose_yaml, short_repr, short_text
from models.darknet import FREEZE_MODES, layer_list
from train_utils.autobatch import AUTO_BATCH
from train_utils.checkpoint import MAX_EPOCH, weights_kind
from train_utils.cli import (
    DEFAULT_EVAL_CONF,
    DEFAULT_EVAL_IOU,
    DEFAULT_IMG_SIZE,
    DEFAULT_RUN_NAME,
    HelpFormatter,
    add_data_flags,
    add_device_flags,
    add_eval_flags,
    add_img_size_flag,
    add_model_flag,
    add_precision_flags,
    add_weights_flags,
    check_img_size,
    check_time_budget,
    run_name_folder,
    switch,
)
from train_utils.darknet_recipe import RECIPES, apply_recipe
from train_utils.distributed.node import MAX_DEFAULT_WORKERS
from train_utils.evolve.space import DEFAULT_SPACE
from train_utils.optim import LR_SCHEDULES, OPTIMIZER_CHOICES
from train_utils.resume import settings_of_resumed_run
from train_utils.run_folder import RUNS_DIR
from train_utils.trackers import TRACKER_CHOICES, check_trackers

NOMINAL_BATCH_SIZE = 64  # ultralytics/yolov3 accumulates gradients up to this many images per step
MULTI_SCALE_RANGE = (0.67, 1.5)  # multi-scale training samples sides in this fraction of img-size
DEFAULT_EPOCHS = 30
SEED_MAX = 2**63 - 1  # torch.manual_seed's largest; numpy takes any seed >= 0
# The largest --nbs (images) and --accumulate (batches) of one optimizer step: far beyond any
# dataset, and small enough that the loss's division by them stays a float operation.
MAX_STEP_SIZE = 100_000_000
DEFAULT_CFG = "cfg/yolov3-spp.cfg"
DEFAULT_DATA = "data/my_data.data"
DEFAULT_HYP = "cfg/hyp.yaml"
# The repository's root: the default --cfg/--hyp are its files, found from any working folder.
REPO_ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger(__name__)


# Hyperparameters: name -> (type, min, max, required). Booleans have no range.
@dataclass(frozen=True)
class HypSpec:
    kind: type
    lo: float | None = None
    hi: float | None = None
    default: Any = None  # None means the key is required


HYP_SPECS: dict[str, HypSpec] = {
    # loss
    "giou": HypSpec(float, 0.0, 1e3),
    "cls": HypSpec(float, 0.0, 1e3),
    "cls_pw": HypSpec(float, 0.0, 1e2),
    "obj": HypSpec(float, 0.0, 1e3),
    "obj_pw": HypSpec(float, 0.0, 1e2),
    "iou_t": HypSpec(float, 0.0, 1.0),
    "fl_gamma": HypSpec(float, 0.0, 10.0),
    "obj_balance": HypSpec(bool, default=False),
    # optimiser and schedule
    "lr0": HypSpec(float, 0.0, 10.0),
    "lrf": HypSpec(float, 0.0, 1.0),
    "momentum": HypSpec(float, 0.0, 1.0),
    "weight_decay": HypSpec(float, 0.0, 1.0),
    "warmup_epochs": HypSpec(float, 0.0, 1e3, default=1.0),
    "warmup_bias_lr": HypSpec(float, 0.0, 1.0, default=0.0),
    # -1: the momentum (no momentum warm-up, ultralytics/yolov3's)
    "warmup_momentum": HypSpec(float, -1.0, 1.0, default=-1.0),
    "anchor_t": HypSpec(float, 1.0, 100.0, default=4.0),
    # augmentation
    "hsv_h": HypSpec(float, 0.0, 1.0),
    "hsv_s": HypSpec(float, 0.0, 1.0),
    "hsv_v": HypSpec(float, 0.0, 1.0),
    "degrees": HypSpec(float, 0.0, 180.0),
    "translate": HypSpec(float, 0.0, 1.0),
    "scale": HypSpec(float, 0.0, 1.0),
    "shear": HypSpec(float, 0.0, 90.0),
    "flipud": HypSpec(float, 0.0, 1.0),
    "fliplr": HypSpec(float, 0.0, 1.0),
    "mosaic": HypSpec(bool, default=True),
}


# YOLOv5's hyp.scratch-*.yaml keys and ours: a YOLOv5 file is taken with a line per mapped key.
YOLOV5_HYP_NAMES = {"box": "giou"}
# YOLOv5 keys for augmentations not offered here: accepted at 0 (off), refused otherwise.
YOLOV5_OFF_AT_ZERO = ("perspective", "mixup", "copy_paste")


def load_hyp(path: str | Path) -> dict[str, Any]:
    """Read and validate a hyperparameter YAML file: ours (cfg/hyp.yaml), or YOLOv5's
    ``hyp.scratch-*.yaml``, whose ``box`` is our ``giou`` and whose augmentations not offered
    here are accepted at 0 (each said in one line).

    Unknown keys (all of them, in one line), missing required keys, wrong types and
    out-of-range values raise :class:`ConfigError` naming ``path:line`` and the key. Optional
    keys get their defaults.
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise ConfigError("hyperparameter file not found; pass an existing file to --hyp", path)
    # Bounded: size, UTF-8, node count with aliases expanded, standard tags only, scalar keys.
    doc = compose_yaml(path, "hyperparameter file")
    root = doc.root
    if root is None or not isinstance(root, yaml.MappingNode):
        raise ConfigError("expected a mapping of hyperparameter names to values", path)
    hyp: dict[str, Any] = {}
    unknown: list[tuple[int, str]] = []
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        key, value = _our_hyp_name(key_node.value, doc.value(value_node), path, line)
        if key is None:
            continue
        if key not in HYP_SPECS:
            unknown.append((line, short_repr(key)))
            continue
        if key in hyp:
            raise ConfigError(f"hyperparameter '{key}' is given twice", path, line)
        hyp[key] = check_hyp_value(key, value, path, line)
    if unknown:
        listed = ", ".join(f"{key} (line {line})" for line, key in unknown)
        what = (
            f"hyperparameter {unknown[0][1]}" if len(unknown) == 1 else f"hyperparameters {listed}"
        )
        raise ConfigError(
            f"unknown {what}; known keys: {', '.join(HYP_SPECS)}", path, unknown[0][0]
        )
    missing = [k for k, s in HYP_SPECS.items() if s.default is None and k not in hyp]
    if missing:
        raise ConfigError(
            f"missing hyperparameter(s) {', '.join(missing)}; add them "
            f"(see cfg/hyp.yaml for meanings and defaults)",
            path,
        )
    for key, spec in HYP_SPECS.items():
        hyp.setdefault(key, spec.default)
    return hyp


def _our_hyp_name(key: Any, value: Any, path: Path, line: int) -> tuple[str | None, Any]:
    """A hyp file's key and value as ours (a YOLOv5 name mapped, its 0/1 mosaic a switch);
    (None, _) for a YOLOv5 augmentation that is off. Each mapping is logged once."""
    if key in YOLOV5_HYP_NAMES:
        ours = YOLOV5_HYP_NAMES[key]
        logger.info(
            "%s:%d: YOLOv5's %r is this project's %r (box loss gain; the gains here are "
            "ultralytics/yolov3's, see cfg/hyp.yaml)",
            path,
            line,
            key,
            ours,
        )
        return ours, value
    if key in YOLOV5_OFF_AT_ZERO:
        if value != 0:
            raise ConfigError(
                f"'{key}' = {short_repr(value)}: YOLOv5's {key} augmentation is not offered "
                f"here; set it to 0 or remove the line",
                path,
                line,
            )
        logger.info("%s:%d: %s: 0 (YOLOv5's, off; not offered here)", path, line, key)
        return None, value
    if key == "mosaic" and isinstance(value, float) and value in (0.0, 1.0):
        return key, bool(value)  # YOLOv5's probability 0.0 or 1.0
    return key, value


def check_hyp_value(key: str, value: Any, path: Path, line: int | None) -> Any:
    """``value`` of hyp key ``key`` as :data:`HYP_SPECS` allows it (ConfigError naming ``path``
    and ``line`` otherwise)."""
    spec = HYP_SPECS[key]
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"'{key}' must be true or false, got {short_repr(value)}", path, line)
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = {list: "a list", dict: "a mapping"}.get(type(value))
        got = kind if kind else short_repr(value)
        raise ConfigError(f"'{key}' must be a number, got {got}", path, line)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"'{key}' must be a finite number, got {value}", path, line)
    # Compared as given: a 400-digit integer has no float (OverflowError), but is out of range.
    if not spec.lo <= value <= spec.hi:
        raise ConfigError(
            f"'{key}' = {short_repr(value)} is outside [{spec.lo}, {spec.hi}]", path, line
        )
    return float(value)


# One source of images (a folder, a .txt list, an image) or several (a data.yaml list).
DataSource = Path | tuple[Path, ...]


@dataclass(frozen=True)
class DataConfig:
    """A validated ``.data`` or ``data.yaml`` file: class count and names, the train and val
    images (one source, or several from a data.yaml list), ``test`` when it names one,
    ``coco_ids``: the file of ``tools/coco2yolo.py`` mapping classes and images back to their
    COCO JSON's ids (None), and
    ``files``: (key, path) of every file or folder the dataset file names (image lists and
    folders, names file, ``coco_ids``), which a tool that reads the data must not write over."""

    path: Path
    nc: int
    names: list[str]
    train: DataSource | None  # None: a file of val alone, which only validation.py reads
    valid: DataSource
    coco_ids: Path | None = None
    files: tuple[tuple[str, Path], ...] = ()
    test: DataSource | None = None
    backup: Path | None = None  # Darknet's weights folder (a .data's backup=), not used here


# The split (a DataConfig field, a dataset file's key) that each validation.py --task scores.
TASK_SPLITS = {"train": "train", "test": "test", "val": "valid", "speed": "valid"}
# Why a split a command reads is not there (val is required by the parser).
_MISSING_SPLIT = {
    "train": "missing required key 'train': training needs train and val (validation.py takes "
    "a file of val alone, but for --task train)",
    "test": "--task test: the dataset file names no test split (test: in a data.yaml, test= in "
    "a .data file)",
}


def _sources(value: str | list[str]) -> DataSource:
    return tuple(Path(v) for v in value) if isinstance(value, list) else Path(value)


def load_data_config(
    path: str | Path, single_cls: bool = False, splits: Sequence[str] = ("train", "valid")
) -> DataConfig:
    """Resolve a ``.data`` or ``data.yaml`` file (``build_utils.parse_config.parse_data_cfg``)
    and check that the ``splits`` a command reads are there and exist (training: train and
    val; validation.py: the one its --task scores, so that a file of val alone, or YOLOv5's
    coco.yaml naming a test-dev2017.txt few have, is scored)."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a dataset file" if path.is_dir() else "dataset file not found"
        if path.exists() and not path.is_dir():
            what = "is not a regular file"  # a FIFO or device would block or never end
        raise ConfigError(f"{what}; pass an existing .data or data.yaml file to --data", path)
    d = parse_data_cfg(path)
    yaml_file = d.get("_format") == "yaml"
    for key in splits:
        if not d.get(key):
            raise ConfigError(_MISSING_SPLIT[key], path)
        shown = "val" if yaml_file and key == "valid" else key
        for source in d[key] if isinstance(d[key], list) else [d[key]]:
            try:
                exists = Path(source).exists()
            except OSError:  # a name too long for the file system exists nowhere
                exists = False
            if not exists:
                hint = f" (dataset root 'path': {short_text(d['root'])})" if yaml_file else ""
                raise ConfigError(
                    f"'{shown}' points to {short_text(str(source))}, which does not exist{hint}",
                    path,
                    d["_lines"].get(key),
                )
    nc, names = int(d["classes"]), list(d["class_names"])
    if single_cls:
        nc, names = 1, ["object"]
    coco_ids = Path(d["coco_ids"]) if d.get("coco_ids") else None
    files = tuple(
        (key, Path(value))
        for key in (*DATA_PATH_KEYS, "coco_ids")
        if key != "backup"  # Darknet's own output folder, not read
        for value in (d[key] if isinstance(d.get(key), list) else [d.get(key)])
        if isinstance(value, str)
    )
    train, valid = _sources(d["train"]) if d.get("train") else None, _sources(d["valid"])
    test = _sources(d["test"]) if d.get("test") else None
    backup = Path(d["backup"]) if d.get("backup") else None
    return DataConfig(path, nc, names, train, valid, coco_ids, files, test, backup)


def repo_default(value: str, default: str) -> str:
    """``value``, or the repository's own copy when ``value`` is the flag's default and the working
    folder has no such file: ``python ~/yolo/train.py`` run from a data folder finds the shipped
    ``cfg/hyp.yaml`` as YOLOv5 resolves its defaults against its root. A path the user typed is
    never redirected."""
    if value != default or Path(value).exists():
        return value
    shipped = REPO_ROOT / default
    return str(shipped) if shipped.is_file() else value


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The training CLI shared by ``train.py`` and ``train_multi_GPU.py``."""
    p = argparse.ArgumentParser(
        "YOLOv3-SPP training",
        add_help=add_help,
        formatter_class=HelpFormatter,
    )
    _add_inputs(p.add_argument_group("model, data and weights"))
    _add_length(p.add_argument_group("how long to train"))
    _add_batches(p.add_argument_group("batches and image sizes"))
    _add_optimization(p.add_argument_group("optimization"))
    _add_evaluation(p.add_argument_group("evaluation during training"))
    _add_runtime(p.add_argument_group("output and runtime"))
    _add_recipe(p.add_argument_group("training recipe"))
    _add_evolve(p.add_argument_group("hyperparameter evolution (README: Evolve hyperparameters)"))
    return p


def _add_evolve(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--evolve",
        type=int,
        nargs="?",
        const=300,
        default=None,
        metavar="N",
        help="YOLOv5's hyperparameter evolution: train N candidates (alone: 300), each a "
        "mutation of the best so far, into <run>/candidate-NNN; writes evolve.csv, "
        "hyp_evolve.yaml and evolve.png; --resume <run> continues it",
    )
    g.add_argument(
        "--evolve-space",
        default=DEFAULT_SPACE,
        metavar="YAML",
        help="the keys searched, their mutation gains and bounds",
    )
    g.add_argument(
        "--evolve-backend",
        default="local",
        choices=("local", "ray"),
        help="local: one candidate after another here; ray: candidates as Ray Tune trials "
        "with ASHA early stopping (pip install -r requirements-ray.txt)",
    )
    g.add_argument(
        "--address",
        default=None,
        help="--evolve-backend ray: the Ray cluster to join (ray start --head prints it); "
        "default: a Ray of this machine alone",
    )
    g.add_argument(
        "--trial-resources",
        type=float,
        nargs=2,
        default=None,
        metavar=("CPUS", "GPUS"),
        help="--evolve-backend ray: CPUs and GPUs one candidate uses (default: 1 CPU and, "
        "where the cluster has GPUs, 1 GPU)",
    )


def _add_inputs(g: argparse._ArgumentGroup) -> None:
    add_model_flag(g, DEFAULT_CFG)
    add_data_flags(g, DEFAULT_DATA, single_cls_default=False)
    g.add_argument("--hyp", default=DEFAULT_HYP, help="hyperparameter YAML file")
    add_weights_flags(g, required=False, help="initial weights: .pt or Darknet .weights")
    resume_help = (
        "continue a run in its folder with its own arguments (flags given override them): "
        "PATH (a last.pt, a run's folder, or an --evolve search's folder), else "
        "<--project or runs>/<--name>/last.pt or <--output-dir>/last.pt, else the most recent "
        "runs/*/last.pt or search (under --project when given)"
    )
    g.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="PATH", help=resume_help
    )
    switch(
        g,
        "--autoanchor",
        False,
        "when the cfg's anchors fit the training labels poorly (best possible recall < 0.98), "
        "train with k-means anchors that fit better (written into the run's model.cfg)",
    )
    # YOLOv5 checks and replaces anchors unless told --noautoanchor; here replacing them is
    # asked for, so its --noautoanchor is the default, accepted as typed.
    g.add_argument(
        "--noautoanchor", dest="autoanchor", action="store_false", help="YOLOv5's --no-autoanchor"
    )
    g.add_argument(
        "--cache-images",
        nargs="?",
        const="ram",
        default=None,
        choices=("ram", "disk"),
        help="cache resized images in RAM or as .npy on disk",
    )


def _add_length(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"epochs to train (default {DEFAULT_EPOCHS}; with --time-budget: the most, "
        "default as many as fit)",
    )
    g.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="MINUTES",
        help="train for this many minutes (set-up included): the epoch count is estimated from "
        "measured epoch times, the LR schedule ends at the last epoch, which is evaluated",
    )
    g.add_argument(
        "--patience",
        type=int,
        default=0,
        help="stop when mAP@0.5:0.95 has not improved for N epochs (0 = never)",
    )


def _add_batches(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--batch-size",
        "--batch",
        type=int,
        default=4,
        help="images per process per step; -1: the largest that fits 60%% of the GPU's memory "
        "(YOLOv5's autobatch, measured; 16 on a CPU)",
    )
    add_img_size_flag(
        g, DEFAULT_IMG_SIZE, "training/test image side, a multiple of 32 (max side for --rect)"
    )
    switch(
        g,
        "--multi-scale",
        True,
        "train at random sides in 67%%-150%% of --img-size, rounded inward to multiples of 32 "
        "(the start line says the range; YOLOv5's default is --no-multi-scale)",
    )
    g.add_argument("--rect", action="store_true", help="rectangular training batches (no mosaic)")
    g.add_argument(
        "--nbs",
        type=int,
        default=NOMINAL_BATCH_SIZE,
        help="nominal batch size: gradients accumulate up to it across steps/ranks",
    )
    g.add_argument(
        "--accumulate",
        type=int,
        default=None,
        help="override: optimizer step every N batches (default from --nbs)",
    )


def _add_optimization(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--freeze-layers",
        nargs="?",
        const="all-but-heads",
        default="none",
        metavar="MODE",
        help=f"freeze layers: {', '.join(FREEZE_MODES)} (the Darknet-53 backbone, everything but "
        "the output layers) or layer indices such as 0-9 (alone: all-but-heads)",
    )
    g.add_argument(
        "--freeze",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="YOLOv5's form: --freeze 10 freezes layers 0-9, --freeze 0 1 2 those layers",
    )
    # --adam is the archive's switch for the same choice; both at once would contradict.
    which = g.add_mutually_exclusive_group()
    which.add_argument(
        "--optimizer",
        type=str.lower,  # YOLOv5 spells them SGD, Adam, AdamW; runs store them lowercase
        default="sgd",
        choices=OPTIMIZER_CHOICES,
        metavar="{SGD,Adam,AdamW}",
        help="Nesterov SGD (ultralytics/yolov3's), Adam or AdamW (betas: momentum, 0.999; AdamW "
        "decays the conv weights decoupled from the gradient); case-insensitive",
    )
    which.add_argument(
        "--adam",
        dest="optimizer",
        action="store_const",
        const="adam",
        help="deprecated: the same as --optimizer Adam",
    )
    schedule = g.add_mutually_exclusive_group()
    schedule.add_argument(
        "--cos-lr",
        dest="lr_schedule",
        action="store_const",
        const="cosine",
        default="cosine",
        help="cosine learning-rate decay from lr0 to lr0 * lrf over the epochs (the default)",
    )
    schedule.add_argument(
        "--linear-lr",
        dest="lr_schedule",
        action="store_const",
        const="linear",
        default="cosine",
        help="linear decay instead, YOLOv5's (1 - epoch / epochs) * (1 - lrf) + lrf "
        "(default: cosine)",
    )
    g.add_argument(
        "--label-smoothing",
        type=float,
        default=0.0,
        metavar="EPS",
        help="class targets 1 - EPS/2 and EPS/2 instead of 1 and 0, EPS in [0, 1)",
    )
    switch(
        g, "--ema", True, "keep an exponential moving average of the weights for eval and saving"
    )
    add_precision_flags(g, "auto")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of every random choice (init, augmentation, sampling, multi-scale sizes)",
    )


def _add_evaluation(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--notest", "--noval", action="store_true", help="only evaluate after the final epoch"
    )
    g.add_argument("--eval-interval", type=int, default=1, help="evaluate every N epochs")
    add_eval_flags(g, DEFAULT_EVAL_CONF, DEFAULT_EVAL_IOU, "auto")
    switch(
        g,
        "--savebest",
        True,
        "keep best.pt, the checkpoint of the best mAP@0.5:0.95 so "
        "far (--no-savebest saves the time and disk of a second checkpoint)",
    )
    g.add_argument(
        "--nosave",
        dest="savebest",
        action="store_false",
        help="YOLOv5's: keep only the final checkpoint; here last.pt is still written after "
        "every epoch (what --resume continues), best.pt is not (as --no-savebest)",
    )
    g.add_argument(
        "--noplots",
        dest="plots",
        action="store_false",
        help="draw no pictures (labels.png, train_batch*.jpg, results.png, the evaluation's); "
        "results.csv, per_class.csv and the logs are still written",
    )


def _add_runtime(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--project",
        default="",
        metavar="DIR",
        help=f"the folder run folders go in (default {RUNS_DIR}); --project alone names the run "
        f"'{DEFAULT_RUN_NAME}' (YOLOv5's --project runs/train --name exp)",
    )
    g.add_argument(
        "--name",
        default="",
        help="run name; output goes to <project>/<name>, or <project>/<name>2, 3, ... when that "
        "folder holds a previous run (never overwritten)",
    )
    g.add_argument(
        "--output-dir",
        default="",
        help="output folder, instead of --project/--name (default runs/<name or time>); "
        "numbered like --name when it holds a previous run",
    )
    g.add_argument(
        "--exist-ok",
        action="store_true",
        help="write into the --name/--output-dir folder even when it holds a previous run: "
        "that run's files are first moved into <folder>/replaced-<time>/",
    )
    g.add_argument(
        "--save-period",
        type=int,
        default=-1,
        metavar="N",
        help="also keep epoch<E>.pt beside last.pt after every N-th epoch (E = N-1, 2N-1, ..., "
        "counted from 0 as in results.csv); -1 or 0: off",
    )
    workers_help = (
        "DataLoader workers per process (default: the process's share of the node's usable "
        f"CPUs, at most {MAX_DEFAULT_WORKERS}; results do not depend on it)"
    )
    add_device_flags(g, None, workers_help)
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    switch(
        g,
        "--sync-bn",
        True,
        "SyncBatchNorm under CUDA DDP: BatchNorm statistics over every GPU's batch (costs an "
        "all-reduce per layer; off pays when the batch per GPU is 8 or more)",
    )
    g.add_argument(
        "--tracker",
        nargs="+",
        action="extend",
        default=[],
        choices=TRACKER_CHOICES,
        metavar="NAME",
        help="also record the run (params, metrics per epoch, pictures, best.pt) in these "
        f"experiment trackers, on rank 0: {', '.join(TRACKER_CHOICES)} (none: none, e.g. to "
        "resume without the run's trackers); repeatable. MLflow: a sqlite store beside the "
        "run folder (mlflow.db) unless MLFLOW_TRACKING_URI is set; W&B: offline unless "
        "WANDB_MODE is set. Needs requirements-trackers.txt (default: none; results.csv and "
        "TensorBoard are always written)",
    )
    g.add_argument(
        "--log-interval",
        type=int,
        default=10,
        help="iterations between loss synchronisations/log lines",
    )


def _add_recipe(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--recipe",
        default="default",
        choices=RECIPES,
        help="darknet: train as Darknet's train_detector does, with the cfg's training keys "
        "(batch, subdivisions, max_batches, learning_rate, policy, [yolo] loss keys, jitter, "
        "...; the run prints them), Darknet's loss, update, BatchNorm and loader; default: "
        "this repository's recipe (--hyp, --epochs, ...). README: Train as Darknet does",
    )
    g.add_argument(
        "--clear",
        action="store_true",
        help="--recipe darknet with --weights x.weights: start at iteration 0 (Darknet's "
        "-clear) instead of the iterations the file's 'seen' counts",
    )
    g.add_argument(
        "--eval-iterations",
        type=int,
        default=None,
        metavar="N",
        help="--recipe darknet: evaluate and save (last.pt, last.weights, best.*) every N "
        "iterations and after the last (default: Darknet's -map rule, every 4 epochs of images "
        "and at least 100 iterations)",
    )


@dataclass
class TrainConfig:
    """The validated run configuration handed to :func:`train_utils.trainer.run`."""

    cfg: Path
    data: DataConfig
    hyp: dict[str, Any]
    epochs: int | None  # None: as many as --time-budget allows
    time_budget: float | None  # minutes
    patience: int
    batch_size: int
    img_size: int
    multi_scale: bool
    rect: bool
    cache_images: str | None
    weights: str
    resume: str | None
    trust_checkpoint: bool
    output_dir: Path  # as given; the trainer's run_folder claim may number it (runs/x2)
    exist_ok: bool
    device: str
    workers: int | None  # None: resolve_workers() picks it once the node's process count is known
    seed: int
    single_cls: bool
    autoanchor: bool
    freeze_layers: str
    amp: str
    ema: bool
    optimizer: str
    nbs: int
    accumulate: int | None
    savebest: bool
    notest: bool
    eval_interval: int
    conf_thres: float
    iou_thres: float
    channels_last: bool | None
    compile: bool
    coco_backend: str
    log_interval: int
    # The output folder is the default name (the start time), not one the user chose.
    auto_named: bool = False
    # External experiment trackers (--tracker); runs recorded before it existed had none.
    tracker: list[str] = dataclasses.field(default_factory=list)
    # Fields added later default to what runs of older versions did, so that a checkpoint whose
    # recorded arguments lack them resumes exactly (take_from_run falls back to these).
    lr_schedule: str = "cosine"  # "cosine" or "linear" (optim.LR_SCHEDULES)
    label_smoothing: float = 0.0  # class-target smoothing eps in [0, 1)
    save_period: int = -1  # keep epoch<E>.pt every N epochs; <= 0 off
    sync_bn: bool = True  # SyncBatchNorm under CUDA DDP (--sync-bn / --no-sync-bn)
    plots: bool = True  # --noplots: False
    recipe: str = "default"  # "darknet": the cfg's training keys (train_utils/darknet_recipe.py)
    clear: bool = False  # --recipe darknet: start at iteration 0 whatever --weights has seen
    eval_iterations: int | None = None  # --recipe darknet: iterations between evaluations

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (YAML- and ``weights_only``-safe)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, DataConfig):
                v = {k: _plain_path(x) for k, x in dataclasses.asdict(v).items()}
                # Absolute: --resume and validation.py --weights alone find it from any folder
                # (was: as typed, relative to the folder the run started in).
                v["path"] = os.path.abspath(v["path"])
            elif isinstance(v, Path):
                v = str(v)
            out[f.name] = v
        return out


def _plain_path(x: Any) -> Any:
    """Paths as strings (a tuple of sources as a list of them), anything else as it is."""
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, tuple):
        return [_plain_path(v) for v in x]
    return x


def build_config(args: argparse.Namespace) -> TrainConfig:
    """Validate parsed CLI arguments, load hyp and .data, and decide the output folder."""
    resumed = _settings_of_resumed_run(args)
    check_img_size(args.img_size)
    if args.epochs is None and args.time_budget is None:
        args.epochs = DEFAULT_EPOCHS
    check_time_budget(args.time_budget)
    if args.batch_size != AUTO_BATCH:  # -1: the largest that fits (train_utils/autobatch.py)
        check_at_least({"--batch-size": args.batch_size}, 1)
    # At most what a checkpoint may record: a run that starts can always be resumed.
    check_at_least({"--epochs": args.epochs}, 1, MAX_EPOCH)
    check_at_least({"--nbs": args.nbs, "--accumulate": args.accumulate}, 1, MAX_STEP_SIZE)
    check_at_least({"--eval-interval": args.eval_interval, "--log-interval": args.log_interval}, 1)
    check_at_least({"--patience": args.patience, "--workers": args.workers}, 0)
    check_at_least({"--save-period": args.save_period}, -1)
    check_at_least({"--seed": args.seed}, 0, SEED_MAX)
    check_fractions({"--conf-thres": args.conf_thres, "--iou-thres": args.iou_thres})
    _check_training_choices(args)
    args.cfg = repo_default(args.cfg, DEFAULT_CFG)
    args.hyp = repo_default(args.hyp, DEFAULT_HYP)
    cfg = Path(args.cfg)
    if not os.path.lexists(cfg):
        raise ConfigError("model cfg not found; pass an existing .cfg to --cfg", cfg)
    # Anything else that is no regular file (a device, FIFO, folder) is named by parse_model_cfg's
    # file check. The cfg's values (bounds, [net] channels) are checked before a run folder is
    # claimed.
    apply_recipe(args, parse_model_cfg(cfg))
    if args.weights and not Path(args.weights).exists():
        raise ConfigError("weights file not found; check --weights", args.weights)
    if args.weights:
        # A FIFO would block the reader, a 40 GB sparse file be read whole: stat it first.
        check_config_file(args.weights, MAX_WEIGHTS_BYTES, "--weights")
        weights_kind(args.weights)  # an image or a text file is one line before a folder is made
    data = load_data_config(args.data, args.single_cls)
    hyp = load_hyp(args.hyp)
    output_dir, auto_named = run_folder_of(args) if resumed is None else (resumed, False)
    check_run_folder_apart(output_dir, data, run_folder_flag(args, resumed))
    derived = {
        "cfg": cfg,
        "data": data,
        "hyp": hyp,
        "output_dir": output_dir,
        "auto_named": auto_named,
        "tracker": check_trackers(args.tracker),
    }
    # Every other field is the flag of the same name, as validated above.
    flags = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.name not in derived
    }
    return TrainConfig(**{**flags, **derived})


def _settings_of_resumed_run(args: argparse.Namespace) -> Path | None:
    """See :func:`train_utils.resume.settings_of_resumed_run`: the run's folder, its arguments
    taken for every flag not typed."""
    if args.resume is None:
        return None
    named = None
    if args.resume == "auto" and (args.name or args.output_dir):
        named = run_folder_of(args)[0]  # <project or runs>/<name>: that run's last.pt
    fields = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainConfig)}
    return settings_of_resumed_run(args, get_args_parser(), fields, named)


def _yolov5_freeze(layers: list[int]) -> str:
    """YOLOv5's ``--freeze``: one number N freezes layers 0 to N-1 (0: none), several numbers
    those layers; as a ``--freeze-layers`` value."""
    if any(n < 0 for n in layers):
        raise ConfigError(f"--freeze takes layer counts or indices >= 0, got {layers}")
    if len(layers) == 1:
        return "none" if layers[0] == 0 else f"0-{layers[0] - 1}"
    return ",".join(map(str, layers))


def _check_training_choices(args: argparse.Namespace) -> None:
    """The values of the optimizer and schedule flags, which a resumed run may also take from
    its checkpoint (argparse checks only what was typed)."""
    if getattr(args, "freeze", None) is not None:
        args.freeze_layers = _yolov5_freeze(args.freeze)
    if args.freeze_layers not in FREEZE_MODES and layer_list(args.freeze_layers) is None:
        raise ConfigError(
            f"--freeze-layers {args.freeze_layers!r} is not one of {', '.join(FREEZE_MODES)} "
            f"nor layer indices such as 0-9"
        )
    eps = args.label_smoothing
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0.0 <= eps < 1.0:
        raise ConfigError(f"--label-smoothing must be a number in [0, 1), got {eps!r}")
    check_choice("the LR schedule", args.lr_schedule, LR_SCHEDULES)


def run_folder_of(args: argparse.Namespace) -> tuple[Path, bool]:
    """The run folder a new run is given (before :func:`run_folder.claim_run_folder` numbers
    it) and whether that is the default name, which the user did not choose.

    ``--output-dir`` is the folder itself; ``--project`` and ``--name`` are its parent and name
    (YOLOv5's), ``--project`` alone names the run ``exp``, ``--name`` alone puts it in ``runs``;
    neither: ``runs/<start time>``. ``--output-dir`` with ``--project`` would say the parent
    twice: refused.
    """
    project = getattr(args, "project", "")
    if args.output_dir:
        if project:
            raise ConfigError(
                "--output-dir is the run folder itself, --project its parent: give one "
                "(--project DIR --name NAME writes DIR/NAME)"
            )
        return Path(args.output_dir), False
    if project:
        return run_name_folder(Path(project), args.name), False
    if args.name:
        return run_name_folder(RUNS_DIR, args.name), False
    return RUNS_DIR / time.strftime("%Y%m%d-%H%M%S"), True


def run_folder_flag(args: argparse.Namespace, resumed: Path | None) -> str:
    """The option that chose the run folder, as messages name it."""
    if resumed is not None:
        return "--resume"
    if args.output_dir:
        return "--output-dir"
    return "--project/--name" if getattr(args, "project", "") else "--name"


def check_run_folder_apart(folder: Path, data: DataConfig, flag: str) -> None:
    """Refuse a run folder that is or lies inside a folder of the dataset's train or val images
    or labels: the run's pictures and checkpoints would land among them, and the next run would
    train on its own plots (was: accepted, as validation.py and predict.py refuse). A run
    folder that holds them (a split's folder, a project's root) writes beside them: allowed.

    Raises:
        ConfigError: the run folder is or lies inside one of the dataset's folders.
        DatasetError: an image list or folder of ``data`` cannot be read.
    """
    folders = []
    for source in (data.train, data.valid):
        images, labels = data_folders(source)
        folders += images + labels
    check_apart({flag: folder}, folders, "the dataset's image or label folder")


def multi_scale_bounds(img_size: int) -> tuple[int, int]:
    """Smallest and largest multi-scale side, both multiples of :data:`GRID`."""
    lo = max(GRID, math.ceil(img_size * MULTI_SCALE_RANGE[0] / GRID) * GRID)
    hi = max(lo, math.floor(img_size * MULTI_SCALE_RANGE[1] / GRID) * GRID)
    return lo, hi
