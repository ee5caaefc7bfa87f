"""The demo recipe as one command: data, training, evaluation and prediction, offline.

    python tools/demo.py                          # generates demo_data/shapes, trains, evaluates
    python tools/demo.py --data my.data --output-dir runs/mine    # the recipe, fitted to my.data
    python tools/demo.py --time-budget 5          # minutes of training (default 10)

Without ``--data`` it writes the synthetic shapes dataset (``data/make_shapes.py``) and trains
``cfg/yolov3-spp-nano-newcoords.cfg`` (the nano cfg with Scaled-YOLOv4 heads, whose target
assignment gives about three times the positives) from scratch with ``cfg/hyp_demo.yaml`` for a
ten-minute budget (``train.py --time-budget``), the recipe tuned to reach mAP@0.5 >= 0.85 on a
2-core CPU (see README). With ``--data`` the recipe adapts what it fixes for its own data: the
image size comes from the images' sizes and the smallest objects (:func:`choose_img_size`), the
anchors from the labels when the cfg's fit them badly (``--autoanchor``), the epochs from the
budget. Training goes through ``train.py``'s code path; evaluation through ``validation.py``'s;
prediction images through ``predict.py``'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import predict  # noqa: E402
import validation  # noqa: E402
from build_utils.augmentations import GRID  # noqa: E402
from build_utils.checks import check_at_least  # noqa: E402
from build_utils.datasets import LoadImagesAndLabels  # noqa: E402
from build_utils.errors import ConfigError, RunStopped  # noqa: E402
from build_utils.labels import collect_image_files  # noqa: E402
from data.make_shapes import STAMP_NAME, make_dataset  # noqa: E402
from train_utils.cli import (  # noqa: E402
    HelpFormatter,
    check_environment,
    check_time_budget,
    run_script,
)
from train_utils.config import DataSource, build_config, load_data_config  # noqa: E402
from train_utils.config import get_args_parser as train_parser  # noqa: E402
from train_utils.distributed.devices import select_device  # noqa: E402
from train_utils.distributed.process_group import DistInfo  # noqa: E402
from train_utils.precision import AMP_CHOICES  # noqa: E402
from train_utils.reporting import read_results  # noqa: E402
from train_utils.trainer import RunSummary, run  # noqa: E402

logger = logging.getLogger("demo")

# The demo recipe. Each value is a flag of train.py; see README "The demo" for why.
DEMO_DATA_DIR = REPO / "demo_data" / "shapes"
DEMO_DATASET = {
    "n_train": 1500,
    "n_val": 200,
    "img_size_range": (160, 192),
    "seed": 0,
    "obj_size_range": (20.0, 0.5),
    "n_classes": 5,
}
DEMO_TRAIN_FLAGS = {
    "--cfg": str(REPO / "cfg" / "yolov3-spp-nano-newcoords.cfg"),
    "--hyp": str(REPO / "cfg" / "hyp_demo.yaml"),
    "--img-size": "128",
    "--batch-size": "16",
    "--nbs": "16",
    "--optimizer": "adam",
    "--eval-interval": "3",
    "--cache-images": "ram",
    "--workers": "0",
}
DEMO_TRAIN_SWITCHES = ["--no-multi-scale"]
TIME_BUDGET_MIN = 10.0
N_PREDICT_IMAGES = 4
TARGET_MAP50 = 0.85

# --data: the image size. Objects are trained at >= MIN_OBJECT_PX on their short side (the
# 10th percentile of the labels, so that a few specks do not decide), never above the images'
# median size (no upscaling), within IMG_SIZE_BOUNDS: the lower bound is the demo's own size,
# the upper what a ten-minute CPU budget trains for enough epochs (cost grows with the area).
MIN_OBJECT_PX = 11.0
SMALL_OBJECT_QUANTILE = 0.10
IMG_SIZE_BOUNDS = (128, 256)


def choose_img_size(
    labels: Sequence[np.ndarray], shapes: np.ndarray, bounds: tuple[int, int] = IMG_SIZE_BOUNDS
) -> int:
    """The training side for a dataset: labels per image ``(m, 5)`` class + normalised cxcywh,
    ``shapes`` per image original ``(w, h)``. See :data:`MIN_OBJECT_PX`."""
    shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 2)
    long_sides = shapes.max(1)
    # Each label's short side, in pixels of its image, as a fraction of the image's long side.
    rel = [
        np.minimum(lb[:, 3] * w, lb[:, 4] * h) / max(w, h)
        for lb, (w, h) in zip(labels, shapes)
        if len(lb)
    ]
    if not rel:
        return bounds[0]
    small = float(np.quantile(np.concatenate(rel), SMALL_OBJECT_QUANTILE))
    wanted = MIN_OBJECT_PX / max(small, 1e-6)
    side = min(wanted, float(np.median(long_sides)))
    side = GRID * math.ceil(side / GRID)
    return int(min(max(side, bounds[0]), bounds[1]))


def recipe_for(data: Path) -> tuple[dict[str, str], list[str], str]:
    """Flags and switches for a user's ``.data`` file, and a line saying what was chosen."""
    cfg = load_data_config(str(data), False)
    dataset = LoadImagesAndLabels(str(cfg.train), IMG_SIZE_BOUNDS[1], 16, rank=1, nc=cfg.nc)
    if not len(dataset):
        raise ConfigError(f"{cfg.train}: no training images")
    img_size = choose_img_size(dataset.labels, dataset.shapes)
    flags = {**DEMO_TRAIN_FLAGS, "--img-size": str(img_size)}
    why = (
        f"recipe for {data}: --img-size {img_size} (median image side "
        f"{int(np.median(np.asarray(dataset.shapes).max(1)))} px), anchors checked against the "
        f"labels (--autoanchor)"
    )
    return flags, [*DEMO_TRAIN_SWITCHES, "--autoanchor"], why


def first_crossing(results: Path, target: float) -> tuple[int, float] | None:
    """(epoch, elapsed seconds) of the first evaluation with mAP@0.5 >= ``target``."""
    for row in read_results(results):
        if float(row["mAP50"]) >= target:
            return int(row["epoch"]), float(row["elapsed_seconds"])
    return None


def ensure_demo_dataset(root: Path) -> Path:
    """Generate the shapes dataset unless a whole one of the demo's recipe is already there: the
    recipe make_shapes records first (:data:`STAMP_NAME`), and its ``shapes.data``, written last
    (so that a set cut short, or replaced with ``make_shapes.py --exist-ok``, is made again)."""
    stamp = root / STAMP_NAME
    wanted = {k: list(v) if isinstance(v, tuple) else v for k, v in DEMO_DATASET.items()}
    if stamp.is_file() and (root / "shapes.data").is_file():
        try:
            made = json.loads(stamp.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            made = None
        if made == {**wanted, "voc": False}:
            logger.info("using the existing demo dataset in %s", root)
            return root / "shapes.data"
    if stamp.is_file():
        # Another recipe, or cut short: start afresh so that no stale image or cache stays behind.
        logger.info("%s holds a shapes set of another recipe or cut short: making it again", root)
        shutil.rmtree(root)
    t0 = time.time()
    data = make_dataset(root, **DEMO_DATASET)
    logger.info(
        "generated %d + %d shapes images in %s (%.1f s)",
        DEMO_DATASET["n_train"],
        DEMO_DATASET["n_val"],
        root,
        time.time() - t0,
    )
    return data


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], add_help=add_help, formatter_class=HelpFormatter
    )
    parser.add_argument("--data", default=None, help="a .data file (default: the shapes demo)")
    parser.add_argument(
        "--output-dir",
        default="runs/demo",
        help="where the run is written (numbered, e.g. runs/demo2, when it holds a previous run)",
    )
    parser.add_argument("--device", default="", help="cpu, cuda or cuda:N (default: auto)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=TIME_BUDGET_MIN,
        metavar="MINUTES",
        help="minutes of training (train.py --time-budget)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="train this many epochs instead of a budget"
    )
    parser.add_argument(
        "--amp",
        nargs="?",
        const="on",
        default=None,
        choices=AMP_CHOICES,
        help="train.py --amp (default: its auto: bf16 on a CPU with bf16 arithmetic where timed "
        "faster, else fp32; off to compare)",
    )
    return parser


def train_argv(args: argparse.Namespace) -> tuple[list[str], Path]:
    """train.py's arguments for the demo (the recipe, fitted to ``--data`` when given), and
    the dataset file. Flags left at their default are left out (``--device`` auto)."""
    if args.data:
        data = Path(args.data)
        flags, switches, why = recipe_for(data)
        logger.info(why)
    else:
        data = ensure_demo_dataset(DEMO_DATA_DIR)
        flags, switches = dict(DEMO_TRAIN_FLAGS), list(DEMO_TRAIN_SWITCHES)
    flags.update({"--data": str(data), "--output-dir": args.output_dir, "--device": args.device})
    if args.epochs is not None:
        flags["--epochs"] = str(args.epochs)
    else:
        flags["--time-budget"] = str(args.time_budget)
    if args.amp is not None:
        flags["--amp"] = args.amp
    # An empty value (--device auto) is no flag: the logged command must paste as it is.
    argv = [x for k, v in flags.items() if v != "" for x in (k, v)] + switches
    return argv, data


def evaluate_and_predict(
    out: Path, weights: Path, valid: DataSource, device: torch.device
) -> tuple[dict[str, float], Path]:
    """validation.py's stats of ``weights`` (written to ``out/val_stats.json``) and
    predict.py's pictures of the first validation images (``out/predictions``)."""
    stats_file = out / "val_stats.json"
    # The checkpoint carries its cfg, data, sizes and precision: --weights is enough.
    code = validation.main(
        [
            "--weights",
            str(weights),
            "--device",
            str(device),
            "--json-out",
            str(stats_file),
            "--save-dir",
            str(out / "val"),
        ]
    )
    if code:
        raise SystemExit(code)
    # The images as training read them: a list (comments, relative entries), a folder, or both.
    sources = collect_image_files(valid)[:N_PREDICT_IMAGES]
    pred_dir = out / "predictions"
    argv = ["--weights", str(weights), "--source", *sources, "--output", str(pred_dir)]
    code = predict.main([*argv, "--device", str(device)])
    if code:
        raise SystemExit(code)
    return json.loads(stats_file.read_text()), pred_dir


def print_summary(
    summary: RunSummary, data: Path, stats: dict[str, float], pred_dir: Path, t0: float
) -> None:
    out = summary.output_dir
    minutes = (time.time() - t0) / 60
    verdict = "reached" if stats["mAP50"] >= TARGET_MAP50 else "NOT reached"
    crossed = first_crossing(out / "results.csv", TARGET_MAP50)
    when = (
        f"first reached in training after {crossed[1] / 60:.1f} min (epoch {crossed[0]})"
        if crossed
        else "not reached by any evaluation during training"
    )
    print(
        f"\nDemo finished in {minutes:.1f} min (training {summary.seconds / 60:.1f} min, "
        f"{summary.epochs_run} epochs).\n"
        f"  mAP@0.5 = {stats['mAP50']:.3f}, mAP@0.5:0.95 = {stats['mAP50-95']:.3f} on "
        f"{data}; the demo target mAP@0.5 >= {TARGET_MAP50} was {verdict}\n"
        f"  mAP@0.5 >= {TARGET_MAP50}: {when}\n"
        f"  results:     {out / 'results.csv'} and {out / 'results.png'}\n"
        f"  weights:     {out / 'best.pt'}, {out / 'last.pt'}\n"
        f"  predictions: {pred_dir}/\n"
        f"  TensorBoard: tensorboard --logdir {out}"
    )


def demo(args: argparse.Namespace) -> None:
    # A bad flag or YOLO_THREADS is one line before any image is generated or read.
    check_environment()
    check_at_least({"--epochs": args.epochs}, 1)
    check_time_budget(args.time_budget)
    t0 = time.time()
    argv, data = train_argv(args)
    logger.info("training: python train.py %s", shlex.join(argv))
    config = build_config(train_parser().parse_args(argv))
    device = select_device(config.device)
    try:
        summary = run(config, DistInfo.single(device))
    except (KeyboardInterrupt, RunStopped):
        last = config.output_dir / "last.pt"  # the run's folder, as the run claimed it
        if last.is_file():  # the demo itself has no --resume: the command that has one
            logger.warning(
                "the demo's training continues with: python train.py --resume %s (then "
                "validation.py and predict.py --weights %s)",
                last,
                last.with_name("best.pt"),
            )
        raise
    out = summary.output_dir  # runs/demo2 when runs/demo holds a previous run
    weights = out / "best.pt" if (out / "best.pt").is_file() else out / "last.pt"
    stats, pred_dir = evaluate_and_predict(out, weights, config.data.valid, device)
    print_summary(summary, data, stats, pred_dir, t0)


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_args_parser(), demo, argv)


if __name__ == "__main__":
    sys.exit(main())
