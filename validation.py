"""Evaluate weights on a dataset's validation set with pycocotools (COCO mAP).

    python validation.py --cfg cfg/yolov3-spp.cfg --data data/coco.data --weights best.pt
    python validation.py ... --save-json out/ --json-out stats.json
    torchrun --nproc_per_node=2 validation.py ...     # each process scores a disjoint shard

The settings are those of the training-time evaluation (rectangular letterboxed batches,
conf 0.001, NMS IoU 0.6, multi-label, at most 300 detections per image), so a checkpoint's mAP
here equals the one its training run logged.
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
from models.darknet import Darknet
from train_utils.builders import make_eval_dataset, make_eval_loader, model_blocks_for
from train_utils.checkpoint import load_weights
from train_utils.cli import run_main, setup_console_logging
from train_utils.coco_eval import STAT_NAMES
from train_utils.coco_utils import coco_dict_from_dataset, get_coco_api_from_dataset
from train_utils.config import (
    DEFAULT_EVAL_CONF,
    DEFAULT_EVAL_IOU,
    check_img_size,
    load_data_config,
)
from train_utils.distributed_utils import cleanup, init_distributed_mode
from train_utils.train_eval_utils import EvalOptions, evaluate

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


def format_report(
    stats: Sequence[float], per_class: dict[int, tuple[float, float]], names: Sequence[str]
) -> str:
    """The 12 COCO stats and a per-class AP table as text."""
    lines = [f"{name:>12s} {value:.4f}" for name, value in zip(STAT_NAMES, stats)]
    lines += ["", f"{'class':>20s} {'AP50-95':>8s} {'AP50':>8s}"]
    for c, (ap, ap50) in sorted(per_class.items()):
        name = names[c] if c < len(names) else str(c)
        lines.append(f"{name:>20s} {ap:8.4f} {ap50:8.4f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    setup_console_logging()

    def body() -> None:
        check_img_size(args.img_size)
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
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
                amp=args.amp,
                backend=args.coco_backend,
                show_progress=dist.is_main,
                per_class=True,
            )
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
                format_report(stats, per_class, data.names),
            )
            if args.save_json:
                out = Path(args.save_json)
                out.mkdir(parents=True, exist_ok=True)
                gt = coco_dict_from_dataset(dataset, num_classes=data.nc)
                (out / "ground_truth.json").write_text(json.dumps(gt))
                (out / "predictions.json").write_text(json.dumps(detections))
                logger.info("wrote %s and %s", out / "ground_truth.json", out / "predictions.json")
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
