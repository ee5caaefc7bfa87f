"""Command line, hyperparameters and dataset description, validated once into explicit objects.

Each source of configuration has one owner: the CLI for the run (:func:`get_args_parser`),
``cfg/hyp.yaml`` for hyperparameters (:func:`load_hyp`), the ``.data`` file for the dataset
(:func:`load_data_config`) and the ``.cfg`` for the architecture (``build_utils.parse_config``).
Every problem is raised as :class:`ConfigError` naming the file, line or flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from build_utils.augmentations import GRID  # every input side must be a multiple of it
from build_utils.errors import ConfigError
from build_utils.parse_config import load_class_names, parse_data_cfg
from models.darknet import FREEZE_MODES
from train_utils.distributed.node import MAX_DEFAULT_WORKERS
from train_utils.optim import OPTIMIZER_CHOICES

NOMINAL_BATCH_SIZE = 64  # the lineage accumulates gradients up to this many images per step
# --amp values; resolved per device by train_eval_utils.resolve_amp.
AMP_CHOICES = ("auto", "on", "fp16", "bf16", "off")
MULTI_SCALE_RANGE = (0.67, 1.5)  # multi-scale training samples sides in this fraction of img-size
DEFAULT_EVAL_CONF = 0.001
DEFAULT_EVAL_IOU = 0.6
DEFAULT_EPOCHS = 30


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


def load_hyp(path: str | Path) -> dict[str, Any]:
    """Read and validate a hyperparameter YAML file.

    Unknown keys, missing required keys, wrong types and out-of-range values raise
    :class:`ConfigError` naming ``path:line`` and the key. Optional keys get their defaults.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("hyperparameter file not found; pass an existing file to --hyp", path)
    text = path.read_text(encoding="utf-8-sig")
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(
            f"not valid YAML: {getattr(e, 'problem', e)}", path, mark.line + 1 if mark else None
        ) from e
    if root is None or not isinstance(root, yaml.MappingNode):
        raise ConfigError("expected a mapping of hyperparameter names to values", path)
    hyp: dict[str, Any] = {}
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        key = key_node.value
        if key not in HYP_SPECS:
            raise ConfigError(
                f"unknown hyperparameter '{key}'; known keys: {', '.join(HYP_SPECS)}", path, line
            )
        if key in hyp:
            raise ConfigError(f"hyperparameter '{key}' is given twice", path, line)
        value = yaml.safe_load(yaml.serialize(value_node))
        hyp[key] = _check_hyp_value(key, value, path, line)
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


def _check_hyp_value(key: str, value: Any, path: Path, line: int) -> Any:
    spec = HYP_SPECS[key]
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"'{key}' must be true or false, got {value!r}", path, line)
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"'{key}' must be a number, got {value!r}", path, line)
    if not spec.lo <= value <= spec.hi:
        raise ConfigError(f"'{key}' = {value} is outside [{spec.lo}, {spec.hi}]", path, line)
    return float(value)


@dataclass(frozen=True)
class DataConfig:
    """A validated ``.data`` file: class count and names, image lists for train and val."""

    path: Path
    nc: int
    names: list[str]
    train: Path
    valid: Path


def load_data_config(path: str | Path, single_cls: bool = False) -> DataConfig:
    """Resolve a ``.data`` file, check its list files exist and the names agree with ``classes``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("dataset file not found; pass an existing .data file to --data", path)
    d = parse_data_cfg(path)
    for key in ("train", "valid"):
        p = Path(d[key])
        if not p.exists():
            raise ConfigError(f"'{key}' points to {p}, which does not exist", path)
    nc = int(d["classes"])
    names_path = d.get("names")
    if names_path:
        names = load_class_names(names_path)
        if len(names) != nc:
            raise ConfigError(
                f"classes={nc} but {names_path} lists {len(names)} names; make them agree", path
            )
    else:
        names = [str(i) for i in range(nc)]
    if single_cls:
        nc, names = 1, ["object"]
    return DataConfig(path, nc, names, Path(d["train"]), Path(d["valid"]))


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The training CLI shared by ``train.py`` and ``train_multi_GPU.py``."""
    p = argparse.ArgumentParser(
        "YOLOv3-SPP training",
        add_help=add_help,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_inputs(p.add_argument_group("model, data and weights"))
    _add_schedule(p.add_argument_group("training"))
    _add_evaluation(p.add_argument_group("evaluation during training"))
    _add_runtime(p.add_argument_group("output and runtime"))
    return p


def _switch(group: argparse._ArgumentGroup, flag: str, default: bool | None, help: str) -> None:
    """``--flag`` / ``--no-flag`` (never ``type=bool``, with which ``--flag False`` is true)."""
    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)


def _add_inputs(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--cfg", default="cfg/yolov3-spp.cfg", help="model .cfg file")
    g.add_argument("--data", default="data/my_data.data", help="dataset .data file")
    g.add_argument("--hyp", default="cfg/hyp.yaml", help="hyperparameter YAML file")
    g.add_argument("--weights", default="", help="initial weights: .pt or Darknet .weights")
    resume_help = "resume from PATH, or from OUTPUT_DIR/last.pt when no path is given"
    g.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="PATH", help=resume_help
    )
    trust_help = "allow full-pickle checkpoint loading (only for files you trust)"
    g.add_argument("--trust-checkpoint", action="store_true", help=trust_help)
    g.add_argument("--single-cls", action="store_true", help="train as a one-class detector")
    _switch(
        g,
        "--autoanchor",
        False,
        "when the cfg's anchors fit the training labels poorly (best possible recall < 0.98), "
        "train with k-means anchors that fit better (written into the run's model.cfg)",
    )
    g.add_argument(
        "--cache-images",
        nargs="?",
        const="ram",
        default=None,
        choices=("ram", "disk"),
        help="cache resized images in RAM or as .npy on disk",
    )


def _add_schedule(g: argparse._ArgumentGroup) -> None:
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
    g.add_argument("--batch-size", type=int, default=4, help="images per process per step")
    g.add_argument(
        "--img-size",
        type=int,
        default=512,
        help="training/test image side, a multiple of 32 (max side for --rect)",
    )
    _switch(g, "--multi-scale", True, "train at random sides in 67%%-150%% of --img-size")
    g.add_argument("--rect", action="store_true", help="rectangular training batches (no mosaic)")
    g.add_argument(
        "--freeze-layers",
        nargs="?",
        const="all-but-heads",
        default="none",
        choices=FREEZE_MODES,
        help="freeze the Darknet-53 backbone, or everything but the output layers",
    )
    g.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_CHOICES,
        help="Nesterov SGD (lineage) or Adam (betas momentum, 0.999)",
    )
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
    _switch(
        g, "--ema", True, "keep an exponential moving average of the weights for eval and saving"
    )
    g.add_argument(
        "--amp",
        nargs="?",
        const="on",
        default="auto",
        choices=AMP_CHOICES,
        help="mixed precision. auto: on for CUDA (bf16 where the GPU has it, else "
        "fp16 with a GradScaler), off on CPU; --amp alone: also bf16 autocast on CPU "
        "(fp32 on CPUs without native bf16 kernels); fp16, bf16 or off to choose",
    )
    g.add_argument("--seed", type=int, default=0)


def _add_evaluation(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--notest", action="store_true", help="only evaluate after the final epoch")
    g.add_argument("--eval-interval", type=int, default=1, help="evaluate every N epochs")
    g.add_argument(
        "--conf-thres",
        type=float,
        default=DEFAULT_EVAL_CONF,
        help="evaluation confidence threshold",
    )
    g.add_argument("--iou-thres", type=float, default=DEFAULT_EVAL_IOU, help="evaluation NMS IoU")
    g.add_argument(
        "--coco-backend",
        default="pycocotools",
        choices=("pycocotools", "faster-coco-eval"),
        help="COCO scoring library",
    )
    _switch(
        g,
        "--savebest",
        True,
        "keep best.pt, the checkpoint of the best mAP@0.5:0.95 so "
        "far (--no-savebest saves the time and disk of a second checkpoint)",
    )


def _add_runtime(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--name", default="", help="run name; output goes to runs/<name>")
    g.add_argument("--output-dir", default="", help="output folder (default runs/<name or time>)")
    g.add_argument(
        "--device",
        default="",
        help="cpu, cuda, cuda:N or N (default: cuda if available); a GPU list such as 0,1 "
        "starts one DDP process per listed GPU on this node",
    )
    workers_help = (
        "DataLoader workers per process (default: the process's share of the node's usable "
        f"CPUs, at most {MAX_DEFAULT_WORKERS}; results do not depend on it)"
    )
    g.add_argument("--workers", type=int, default=None, help=workers_help)
    _switch(
        g,
        "--channels-last",
        None,
        "channels_last memory format (default: on CUDA; on CPU the faster for this model, timed)",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument(
        "--log-interval",
        type=int,
        default=10,
        help="iterations between loss synchronisations/log lines",
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
    output_dir: Path
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

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (YAML- and ``weights_only``-safe)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, DataConfig):
                v = {
                    k: str(x) if isinstance(x, Path) else x
                    for k, x in dataclasses.asdict(v).items()
                }
            elif isinstance(v, Path):
                v = str(v)
            out[f.name] = v
        return out


def check_img_size(size: int, flag: str = "--img-size") -> int:
    if size <= 0 or size % GRID:
        fix = max(GRID, round(size / GRID) * GRID)
        raise ConfigError(f"{flag} {size} is not a positive multiple of {GRID}; use e.g. {fix}")
    return size


def build_config(args: argparse.Namespace) -> TrainConfig:
    """Validate parsed CLI arguments, load hyp and .data, and decide the output folder."""
    check_img_size(args.img_size)
    if args.epochs is None and args.time_budget is None:
        args.epochs = DEFAULT_EPOCHS
    if args.time_budget is not None and not args.time_budget > 0:
        raise ConfigError(
            f"--time-budget must be a positive number of minutes, got {args.time_budget}"
        )
    for flag, value, lo in (
        ("--epochs", 1 if args.epochs is None else args.epochs, 1),
        ("--patience", args.patience, 0),
        ("--batch-size", args.batch_size, 1),
        ("--workers", 0 if args.workers is None else args.workers, 0),
        ("--nbs", args.nbs, 1),
        ("--eval-interval", args.eval_interval, 1),
        ("--log-interval", args.log_interval, 1),
    ):
        if value < lo:
            raise ConfigError(f"{flag} must be >= {lo}, got {value}")
    if args.accumulate is not None and args.accumulate < 1:
        raise ConfigError(f"--accumulate must be >= 1, got {args.accumulate}")
    for flag, value in (("--conf-thres", args.conf_thres), ("--iou-thres", args.iou_thres)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{flag} must be in [0, 1], got {value}")
    cfg = Path(args.cfg)
    if not cfg.is_file():
        raise ConfigError("model cfg not found; pass an existing .cfg to --cfg", cfg)
    if args.weights and not Path(args.weights).is_file():
        raise ConfigError("weights file not found; check --weights", args.weights)
    data = load_data_config(args.data, args.single_cls)
    hyp = load_hyp(args.hyp)
    if args.output_dir:
        output_dir = Path(args.output_dir)
    else:
        output_dir = Path("runs") / (args.name or time.strftime("%Y%m%d-%H%M%S"))
    derived = {"cfg": cfg, "data": data, "hyp": hyp, "output_dir": output_dir}
    # Every other field is the flag of the same name, as validated above.
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{**flags, **derived})


def accumulate_steps(nbs: int, batch_size: int, world_size: int, override: int | None) -> int:
    """Batches per optimizer step so that one step sees about ``nbs`` images across all ranks."""
    if override is not None:
        return override
    return max(round(nbs / (batch_size * world_size)), 1)


def multi_scale_bounds(img_size: int) -> tuple[int, int]:
    """Smallest and largest multi-scale side, both multiples of :data:`GRID`."""
    lo = max(GRID, math.ceil(img_size * MULTI_SCALE_RANGE[0] / GRID) * GRID)
    hi = max(lo, math.floor(img_size * MULTI_SCALE_RANGE[1] / GRID) * GRID)
    return lo, hi


def scaled_lr0(lr0: float, global_batch: int, nbs: int) -> float:
    """The lineage scales the learning rate up linearly once the global batch exceeds ``nbs``."""
    return lr0 * max(1.0, global_batch / nbs)
