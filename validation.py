"""Evaluate weights on a dataset's validation set with pycocotools (COCO mAP).

    python validation.py --cfg cfg/yolov3-spp.cfg --data data/coco.data --weights best.pt
    python validation.py ... --save-json out/ --json-out stats.json
    python validation.py ... --save-txt --save-conf --save-dir runs/val/exp
    python validation.py ... --task speed --batch-size 1      # ms per image for each step
    torchrun --nproc_per_node=2 validation.py ...     # each process scores a disjoint shard

The settings are those of the training-time evaluation (rectangular letterboxed batches,
conf 0.001, NMS IoU 0.6, multi-label, at most 300 detections per image), so a checkpoint's mAP
here equals the one its training run logged.

Beside the 12 COCO numbers it writes into ``--save-dir`` a per-class table (``per_class.csv``,
also logged), the confusion matrix, the P/R/F1/PR curves and the first validation images with
labels and predictions (``--no-plots`` skips the pictures), and with ``--save-txt`` one YOLO
``.txt`` per image in ``--save-dir/labels``.

``--save-json`` ids: on COCO itself (80 classes and numeric file names such as
``000000397133.jpg``) image ids are the file numbers and category ids the official 91-id
numbering, so ``predictions.json`` scores directly against ``instances_val2017.json``; on other
data they are the dataset index and the class id. ``--coco-ids``/``--no-coco-ids`` override the
detection.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from build_utils.errors import ConfigError
from models.darknet import Darknet, model_blocks_for
from train_utils.builders import make_eval_dataset, make_eval_loader
from train_utils.checkpoint import load_weights
from train_utils.cli import run_main, setup_console_logging
from train_utils.config import (
    DEFAULT_EVAL_CONF,
    DEFAULT_EVAL_IOU,
    check_img_size,
    load_data_config,
)
from train_utils.distributed.process_group import cleanup, init_distributed_mode
from train_utils.engine import evaluate
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.evaluation.coco_gt import coco_dict_from_dataset, get_coco_api_from_dataset
from train_utils.evaluation.exports import (
    gt_to_official_coco_ids,
    resolve_coco_ids,
    to_official_coco_ids,
    write_dataset_txt,
)
from train_utils.evaluation.options import MAX_DET, EvalOptions
from train_utils.evaluation.report import write_eval_report
from train_utils.evaluation.speed import measure_speed

logger = logging.getLogger("validation")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        "YOLOv3-SPP validation", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--cfg", default="cfg/yolov3-spp.cfg", help="model .cfg file")
    p.add_argument("--data", required=True, help="dataset .data file (its 'valid' list is used)")
    p.add_argument("--weights", required=True, help=".pt checkpoint/state_dict or .weights")
    p.add_argument("--img-size", type=int, default=512, help="inference size (multiple of 32)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="", help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument("--conf-thres", type=float, default=DEFAULT_EVAL_CONF)
    p.add_argument("--iou-thres", type=float, default=DEFAULT_EVAL_IOU)
    p.add_argument("--max-det", type=int, default=MAX_DET, help="detections kept per image")
    p.add_argument(
        "--task",
        default="val",
        choices=("val", "speed"),
        help="val: COCO mAP, per-class table and pictures; speed: ms per image of "
        "pre-process, inference and NMS",
    )
    p.add_argument(
        "--save-dir",
        default="runs/val",
        help="folder for per_class.csv, the pictures and --save-txt labels",
    )
    p.add_argument(
        "--plots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw the confusion matrix, P/R/F1/PR curves and validation images",
    )
    p.add_argument(
        "--save-txt",
        action="store_true",
        help="write SAVE_DIR/labels/<image>.txt: class cx cy w h normalised, one detection a line",
    )
    p.add_argument("--save-conf", action="store_true", help="add the confidence to --save-txt")
    p.add_argument(
        "--coco-ids",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--save-json with official COCO image/category ids (default: when the data has 80 "
        "classes and numeric image file names)",
    )
    p.add_argument(
        "--multi-label",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one detection per class above threshold for each box",
    )
    p.add_argument("--single-cls", action="store_true", help="score as a one-class detector")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--amp", action="store_true", help="bf16 (CPU) / fp16 (CUDA) inference")
    p.add_argument(
        "--coco-backend", default="pycocotools", choices=("pycocotools", "faster-coco-eval")
    )
    p.add_argument(
        "--save-json",
        default=None,
        metavar="DIR",
        help="write DIR/ground_truth.json and DIR/predictions.json (COCO format)",
    )
    p.add_argument(
        "--json-out",
        default=None,
        metavar="FILE",
        help="write the 12 COCO stats as JSON with the results.csv names",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="allow full-pickle checkpoint loading (only for files you trust)",
    )
    p.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=-1,
        help=argparse.SUPPRESS,
    )
    return p


def format_report(stats: Sequence[float]) -> str:
    """The 12 COCO stats as text (the per-class table is logged by ``write_eval_report``)."""
    return "\n".join(f"{name:>12s} {value:.4f}" for name, value in zip(STAT_NAMES, stats))


def main(argv: Sequence[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    setup_console_logging()

    def body() -> None:
        check_img_size(args.img_size)
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.max_det < 1:
            raise ConfigError(f"--max-det must be >= 1, got {args.max_det}")
        for flag, v in (("--conf-thres", args.conf_thres), ("--iou-thres", args.iou_thres)):
            if not 0 <= v <= 1:
                raise ConfigError(f"{flag} must be in [0, 1], got {v}")
        if not Path(args.weights).is_file():
            raise ConfigError("weights file not found; check --weights", args.weights)
        dist = init_distributed_mode(args)
        try:
            device = dist.device
            data = load_data_config(args.data, args.single_cls)
            model = Darknet(
                model_blocks_for(args.cfg, data.nc), img_size=(args.img_size, args.img_size)
            )
            load_weights(model, args.weights, strict=True, trust=args.trust_checkpoint)
            model.to(device).eval()
            dataset = make_eval_dataset(
                data.valid, args.img_size, args.batch_size, data.nc, args.single_cls, dist.rank
            )
            coco_ids = None
            if args.save_json:
                coco_ids = resolve_coco_ids(args.coco_ids, data.nc, dataset.img_files)
            loader = make_eval_loader(
                dataset,
                args.batch_size,
                dist.world_size,
                dist.rank,
                args.workers,
                device.type == "cuda",
            )
            coco_gt = None
            if dist.is_main:
                coco_gt = get_coco_api_from_dataset(dataset, num_classes=data.nc)
            opts = EvalOptions(
                device,
                args.conf_thres,
                args.iou_thres,
                args.multi_label,
                max_det=args.max_det,
                amp=args.amp,
                backend=args.coco_backend,
                show_progress=dist.is_main,
                per_class=True,
            )
            if args.task == "speed":
                speed = measure_speed(model, loader, opts)
                if dist.is_main:
                    logger.info(
                        "%s; weights %s, img %d", speed.format(), args.weights, args.img_size
                    )
                return
            stats, per_class, detections = evaluate(model, loader, coco_gt, opts)
            if not dist.is_main:
                return
            logger.info(
                "%d images, conf %.3g, NMS IoU %.2f, img %d, weights %s\n%s",
                len(dataset),
                args.conf_thres,
                args.iou_thres,
                args.img_size,
                args.weights,
                format_report(stats),
            )
            save_dir = Path(args.save_dir)
            write_eval_report(save_dir, coco_gt, detections, data.names, per_class, args.plots)
            if args.save_txt:
                n = write_dataset_txt(save_dir / "labels", coco_gt, detections, args.save_conf)
                logger.info("wrote %d label files in %s", n, save_dir / "labels")
            if args.save_json:
                out = Path(args.save_json)
                out.mkdir(parents=True, exist_ok=True)
                gt = coco_dict_from_dataset(dataset, num_classes=data.nc)
                if coco_ids is not None:
                    gt = gt_to_official_coco_ids(gt, coco_ids, data.names)
                    detections = to_official_coco_ids(detections, coco_ids)
                (out / "ground_truth.json").write_text(json.dumps(gt))
                (out / "predictions.json").write_text(json.dumps(detections))
                logger.info(
                    "wrote %s and %s (%s ids)",
                    out / "ground_truth.json",
                    out / "predictions.json",
                    "official COCO" if coco_ids is not None else "dataset index and class",
                )
            if args.json_out:
                Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json_out).write_text(
                    json.dumps({k: float(v) for k, v in zip(STAT_NAMES, stats)}, indent=2)
                )
        finally:
            cleanup()

    return run_main(body)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
